"""`ebpf-proxy trace` without root: options to FlowSpec, a dump walked end to end, exit codes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ebpf_proxy.cli.trace import build_flow, trace
from ebpf_proxy.explain.packet import FlowError
from ebpf_proxy.model import Protocol
from tests.unit.test_iptables_walk import SEED_WORKER2

LOCAL = {"172.20.20.16"}


def flow(src, dst, **kw):
    args = dict(in_iface=None, from_pod=False, from_host=False)
    args.update(kw)
    return build_flow(src, dst, **args, is_local=lambda ip: ip in LOCAL or ip.startswith("127."),
                      route_device=lambda ip: "lxc1" if ip.startswith("10.244.") else "eth0")


def test_origin_and_device_follow_the_source_unless_told():
    f = flow("203.0.113.5", "172.20.20.16:30294")
    assert (f.origin, f.in_iface, f.sport, f.protocol) == ("external", "eth0", 40000, Protocol.TCP)
    f = flow("172.20.20.16:5555", "10.96.0.10:53/udp")
    assert (f.origin, f.in_iface, f.sport, f.protocol) == ("host", None, 5555, Protocol.UDP)
    f = flow("10.244.3.4", "10.96.0.10:80", from_pod=True)
    assert (f.origin, f.in_iface) == ("pod", "lxc1")
    f = flow("10.244.3.4", "10.96.0.10:80", in_iface="cbr0", from_pod=True)
    assert f.in_iface == "cbr0"


@pytest.mark.parametrize("src, dst, kw, message", [
    ("1.2.3.4", "10.96.0.10", {}, "--to: '10.96.0.10' has no port"),
    ("1.2.3.4/udp", "10.96.0.10:53", {}, "--from: '1.2.3.4/udp': the protocol goes on --to"),
    ("1.2.3", "10.96.0.10:53", {}, "--from: '1.2.3' is not an IPv4 or IPv6 address"),
    ("1.2.3.4", "10.96.0.10:53/icmp", {}, "--to: protocol 'icmp'"),
    ("1.2.3.4", "10.96.0.10:53", {"from_pod": True, "from_host": True}, "give one"),
    ("1.2.3.4", "10.96.0.10:53", {"from_host": True, "in_iface": "eth0"}, "--in-iface"),
])
def test_bad_options_name_the_option(src, dst, kw, message):
    with pytest.raises(FlowError, match=message.replace("(", r"\(")):
        flow(src, dst, **kw)


@pytest.fixture
def dump(tmp_path):
    path = tmp_path / "worker2.save"
    path.write_text(SEED_WORKER2)
    return str(path)


def test_a_dump_from_another_node_is_walked_and_json_is_exactly_one_object(dump):
    args = ["--rules-file", dump, "--node-ip", "172.20.20.16", "--to", "172.20.20.16:30294", "--json"]
    out = CliRunner().invoke(trace, ["--from", "203.0.113.5", "--in-iface", "eth0", *args])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert (data["datapath"], data["verdict"], data["service"]) == ("iptables", "drop", "default/my-nginx")
    out = CliRunner().invoke(trace, ["--from", "172.20.20.16", *args])  # a local address: the node itself
    data = json.loads(out.output)
    assert (data["verdict"], data["masquerade"], data["sourceAfter"]) == ("dnat", True, "172.20.20.16")


def test_human_output_and_errors(dump):
    out = CliRunner().invoke(trace, ["--rules-file", dump, "--node-ip", "172.20.20.16", "--from", "203.0.113.5",
                                     "--in-iface", "eth0", "--to", "172.20.20.16:30294"])
    assert out.exit_code == 0 and out.output.startswith("[iptables] drop default/my-nginx:")
    # -i in the walked chains and no device given or derivable: the error names the rule
    bad = SEED_WORKER2.replace("-A PREROUTING -m comment", "-A PREROUTING -i eth0 -m comment")
    with open(dump, "w") as fh:
        fh.write(bad)
    out = CliRunner().invoke(trace, ["--rules-file", dump, "--node-ip", "172.20.20.16", "--from", "203.0.113.5",
                                     "--to", "172.20.20.16:30294"])
    assert out.exit_code == 1 and "nat PREROUTING rule 1, line 16" in out.output and "--in-iface" in out.output


def test_ebpf_mode_without_the_ebpf_tracer_exits_2(monkeypatch, dump):
    import builtins

    real_import = builtins.__import__

    def no_ebpf_trace(name, *a, **kw):
        if name == "ebpf_proxy.explain.ebpf_trace":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ebpf_trace)
    out = CliRunner().invoke(trace, ["--mode", "ebpf", "--from", "1.2.3.4", "--to", "10.96.0.10:80"])
    assert out.exit_code == 2 and "ebpf tracing not available" in out.output
    out = CliRunner().invoke(trace, ["--mode", "ebpf", "--rules-file", dump, "--from", "1.2.3.4", "--to", "10.96.0.10:80"])
    assert out.exit_code == 2 and "--rules-file" in out.output  # a usage error
