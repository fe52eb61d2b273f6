"""Which tracer answers an IPv6 flow in ebpf mode (cli/trace.py): the programs when the node's IPv6
path is on (ebpf_trace.ipv6_served), else the ip6tables rules with a note saying why; IPv4 flows
always the programs. The tracers themselves are tested on real programs and rules elsewhere
(tests/bpf/test_trace6_ebpf.py, tests/unit/test_trace_ipv6.py): here they are stand-ins that
record how they were asked."""

from __future__ import annotations

import pytest

from ebpf_proxy.cli import trace as cli
from ebpf_proxy.explain import ebpf_trace
from ebpf_proxy.explain import iptables_live as live
from ebpf_proxy.explain.iptables_walk import NodeFacts
from ebpf_proxy.explain.result import Trace

V6 = dict(src="2001:db8:113::9", dst="[fd00:96::10]:80", in_iface="eth0", from_pod=False, from_host=False)
V4 = dict(src="203.0.113.9", dst="10.96.0.10:80", in_iface="eth0", from_pod=False, from_host=False)


@pytest.fixture
def asked(monkeypatch):
    """The tracers replaced by recorders; `served` is what ipv6_served answers."""
    calls: dict = {"served": True}

    def ebpf(flow, bpffs, names):
        calls["ebpf"] = (flow.family, bpffs)
        return Trace("ebpf", "dnat", "FWD_NEW")

    def iptables(flow_args, backend, rules_file, node_ips, masq):
        calls["iptables"] = cli.flow_family(flow_args["dst"])
        return Trace("iptables", "dnat", "KUBE-SVC")

    def facts(local_ips=None, masquerade_ip=None, family=4):
        calls["facts_family"] = family
        return NodeFacts(frozenset())

    monkeypatch.setattr(ebpf_trace, "trace_ebpf", ebpf)
    monkeypatch.setattr(ebpf_trace, "ipv6_served", lambda bpffs: calls["served"])
    monkeypatch.setattr(cli, "trace_iptables", iptables)
    monkeypatch.setattr(live, "node_facts", facts)
    return calls


def test_ipv6_goes_to_the_programs_when_the_ipv6_path_is_on(asked):
    result = cli.trace_ebpf_mode(V6, "/sys/fs/bpf")
    assert result.datapath == "ebpf" and asked["ebpf"] == (6, "/sys/fs/bpf")
    assert asked["facts_family"] == 6, "the node's IPv6 addresses decide whether the source is the node"
    assert "iptables" not in asked


def test_ipv6_goes_to_ip6tables_with_a_note_when_it_is_off(asked):
    asked["served"] = False
    result = cli.trace_ebpf_mode(V6, None)
    assert result.datapath == "iptables" and asked["iptables"] == 6 and "ebpf" not in asked
    assert result.details["notes"] == [cli.IPV6_BY_IP6TABLES] and "CFG6_F_ON" in result.story


def test_ipv4_always_goes_to_the_programs(asked):
    asked["served"] = False
    assert cli.trace_ebpf_mode(V4, None).datapath == "ebpf" and asked["ebpf"] == (4, "/sys/fs/bpf")
