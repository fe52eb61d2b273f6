"""`trace` and `verify` over IPv6: flows of the IPv6 proxier, walked through its ip6tables rules.

A node runs one proxier per family; an IPv6 flow is the IPv6 proxier's, whose rules are
ip6tables' (in ebpf mode too: the eBPF programs serve IPv4 only). These tests walk rules our
renderer writes for IPv6 (the same text as upstream's TestNodePorts IPv6 cases, see
test_iptables_render_ipv6.py) and check seed 000's three cases, every cell of the local-traffic
truth table against the model (`verify`'s own comparison), and the command line over a dump.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ebpf_proxy.cli.trace import trace
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.render import render
from ebpf_proxy.datapath.iptables.ruleset import full_plan
from ebpf_proxy.explain.iptables_rules import from_ruleset
from ebpf_proxy.explain.iptables_walk import NodeFacts, walk
from ebpf_proxy.explain.packet import FlowError, FlowSpec, parse_endpoint
from ebpf_proxy.explain.result import Trace
from ebpf_proxy.explain.state import desired_state
from ebpf_proxy.explain.verify import Origin, flows_for, verify
from ebpf_proxy.lab.topology import load_topology
from ebpf_proxy.lab.trace import plan
from ebpf_proxy.model import Endpoint, LocalDetector, LocalMode, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName
from tests.unit.kobjects import endpoint, endpoint_slice, node, port, service

CLUSTER_CIDR6 = "fd00:10:244::/56"
NODES6 = {"worker1": ("fd00:20::15", "fd00:10:244:5::/64"), "worker2": ("fd00:20::16", "fd00:10:244:3::/64"),
          "worker3": ("fd00:20::17", "fd00:10:244:4::/64")}
POD_W1, POD_W3 = "fd00:10:244:5::4", "fd00:10:244:4::3"  # seed 000's my-nginx pods, in IPv6
NGINX = ServicePortName("default", "my-nginx", "", Protocol.TCP)
CLIENT = "2001:db8:1::5"


def node_config(name: str, detector: LocalDetector | None = None, masquerade_all: bool = False) -> NodeConfig:
    return NodeConfig(name, family=6, node_ips=(NODES6[name][0],), cluster_cidrs=("10.244.0.0/16", CLUSTER_CIDR6),
                      masquerade_all=masquerade_all, local_detector=detector)


def nginx_state(name: str, *, local: bool = True, **svc) -> ProxyState:
    sp = ServicePort(NGINX, "fd00:10:96::2e5a", 80, Protocol.TCP, node_port=30294, external_policy_local=local, **svc)
    eps = (Endpoint(POD_W1, 80, "worker1", is_local=name == "worker1"),
           Endpoint(POD_W3, 80, "worker3", is_local=name == "worker3"))
    return ProxyState({NGINX: sp}, {NGINX: eps})


def facts(name: str) -> NodeFacts:
    return NodeFacts(frozenset({NODES6[name][0]}), masquerade_ip=NODES6[name][0])


def seed_walk(name: str, flow: FlowSpec) -> Trace:
    return walk(from_ruleset(render(node_config(name), nginx_state(name))), flow, facts(name))


# ---- the flow's spelling --------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("[fd00:10:96::a]:80/udp", ("fd00:10:96::a", 80, Protocol.UDP)),
    ("[fd00:10:96::a]:53", ("fd00:10:96::a", 53, Protocol.TCP)),
    ("fd00:10:96::a", ("fd00:10:96::a", None, Protocol.TCP)),  # bare: all of it is the address
    ("[fd00:10:96::a]", ("fd00:10:96::a", None, Protocol.TCP)),
    ("10.96.0.10:53/udp", ("10.96.0.10", 53, Protocol.UDP)),
])
def test_endpoints_spell_ipv6_in_brackets(text, want):
    assert parse_endpoint(text, "--to") == want


def test_a_flow_has_one_family_canonical_addresses_and_a_bracketed_label():
    f = FlowSpec("2001:db8:1:0::5", "fd00:10:96:0::a", 80)
    assert (f.src, f.dst, f.family) == ("2001:db8:1::5", "fd00:10:96::a", 6)
    assert f.label == "[2001:db8:1::5]:40000 → [fd00:10:96::a]:80/tcp (external)"
    with pytest.raises(FlowError, match=r"--from 203.0.113.5 is IPv4 but --to fd00:10:96::a is IPv6"):
        FlowSpec("203.0.113.5", "fd00:10:96::a", 80)
    with pytest.raises(FlowError, match=r"--to: 'fd00::zz' is not an IPv4 or IPv6 address"):
        FlowSpec(CLIENT, "fd00::zz", 80)


def test_backends_sort_ipv4_first_then_by_address():
    t = Trace("iptables", "dnat", "x", backends=("[fd00::10]:80", "10.0.0.2:80", "[fd00::9]:80"))
    assert t.backends == ("10.0.0.2:80", "[fd00::9]:80", "[fd00::10]:80")


# ---- seed 000 over IPv6 ----------------------------------------------------------------------------

def test_seed_case1_outside_to_worker2_ipv6_nodeport_is_dropped():
    t = seed_walk("worker2", FlowSpec(CLIENT, "fd00:20::16", 30294, in_iface="eth0"))
    assert (t.verdict, t.reason, t.backends, t.source_after) == (
        "drop", "default/my-nginx has no local endpoints", (), None)


def test_seed_case2_outside_to_worker3_ipv6_nodeport_reaches_its_pod_keeping_the_client():
    t = seed_walk("worker3", FlowSpec(CLIENT, "fd00:20::17", 30294, in_iface="eth0"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == ("dnat", (f"[{POD_W3}]:80",), False, CLIENT)


def test_seed_case3_worker2_to_its_own_ipv6_nodeport_goes_anywhere_masqueraded():
    t = seed_walk("worker2", FlowSpec("fd00:20::16", "fd00:20::16", 30294, origin="host"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == (
        "dnat", (f"[{POD_W3}]:80", f"[{POD_W1}]:80"), True, "fd00:20::16")


def test_no_localhost_nodeports_on_ipv6():
    """kube-proxy's IPv6 nodeports jump excludes ::1 (`! -d ::1/128`): ::1:<nodePort> is never
    translated. With eTP=Local and no local endpoint, KUBE-EXTERNAL-SERVICES' `--dst-type LOCAL`
    DROP still meets it in filter INPUT (::1 is local), as on a real node."""
    flow = FlowSpec("::1", "::1", 30294, origin="host")
    cluster = walk(from_ruleset(render(node_config("worker2"), nginx_state("worker2", local=False))), flow,
                   facts("worker2"))
    assert (cluster.verdict, cluster.service, cluster.backends) == ("pass", None, ())
    local = seed_walk("worker2", flow)
    assert (local.verdict, local.backends) == ("drop", ())
    assert [(s.hook, s.unit) for s in local.steps][-1] == ("INPUT", "KUBE-EXTERNAL-SERVICES")


def test_a_service_without_ipv6_endpoints_rejects():
    state = ProxyState({NGINX: ServicePort(NGINX, "fd00:10:96::2e5a", 80, Protocol.TCP)}, {NGINX: ()})
    t = walk(from_ruleset(render(node_config("worker2"), state)),
             FlowSpec("fd00:10:244:3::7", "fd00:10:96::2e5a", 80, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert (t.verdict, t.reason) == ("reject", "default/my-nginx has no endpoints")


# ---- every local-traffic cell: the walk of the ip6tables rules agrees with the model -------------------

def detector(mode: str, name: str) -> LocalDetector:
    return {"none": LocalDetector(),
            "ClusterCIDR": LocalDetector(LocalMode.CLUSTER_CIDR, (CLUSTER_CIDR6,)),
            "NodeCIDR": LocalDetector(LocalMode.NODE_CIDR, (NODES6[name][1],)),
            "BridgeInterface": LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0"),
            "InterfaceNamePrefix": LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="lxc")}[mode]


def senders(name: str) -> list[Origin]:
    own = NODES6[name][1].split("::")[0]
    return [Origin("pod, routed veth", f"{own}::7", "pod", "lxc1a2b3c4d"),
            Origin("pod, on the bridge", f"{own}::8", "pod", "cbr0"),
            Origin("pod on another node", "fd00:10:244:9::9", "external", "eth0"),
            Origin("this node", NODES6[name][0], "host"),
            Origin("another node", "fd00:20::99", "external", "eth0"),
            Origin("client outside", CLIENT, "external", "eth0"),
            Origin("an IPv4 client", "203.0.113.5", "external", "eth0")]  # not the IPv6 proxier's: left out


CELLS = [(mode, masq_all, name, local) for mode in ("none", "ClusterCIDR", "NodeCIDR", "BridgeInterface",
                                                    "InterfaceNamePrefix")
         for masq_all in (False, True) for name in ("worker2", "worker3") for local in (False, True)]


@pytest.mark.parametrize("mode, masq_all, name, local", CELLS,
                         ids=[f"{m}-{'masqAll' if a else 'noMasqAll'}-{n}-eTP{'Local' if p else 'Cluster'}"
                              for m, a, n, p in CELLS])
def test_the_walk_of_ipv6_rules_agrees_with_the_model_in_every_cell(mode, masq_all, name, local):
    """verify's comparison, IPv6: clusterIP, NodePort, externalIP and LB IP, from every sender class."""
    node = node_config(name, detector(mode, name), masq_all)
    state = nginx_state(name, local=local, external_ips=("2001:db8:5::20", "198.51.100.20"),
                        load_balancer_ips=("2001:db8:5::21",))
    tables = from_ruleset(render(node, state))
    flows = flows_for(state, node, senders(name))
    report = verify(flows, state, node, {"ip6tables (rendered)": lambda f: walk(tables, f, facts(name))})
    assert report.ok, "\n".join([m.render() for m in report.mismatches] + report.errors)
    assert report.flows == 4 * 6  # 4 IPv6 frontends x 6 IPv6 senders, no localhost NodePort, no IPv4


def test_verify_takes_the_ipv6_half_of_a_dual_stack_service():
    objs = dict(
        services=[service(svc_type="NodePort", ports=[port(node_port=30080)], ipFamilies=["IPv4", "IPv6"],
                          ipFamilyPolicy="RequireDualStack", clusterIPs=["10.96.0.10", "fd00:10:96::10"])],
        slices=[endpoint_slice(endpoints=[endpoint("10.244.1.5", "n1")]),
                endpoint_slice("web-v6", endpoints=[endpoint("fd00:10:244:1::5", "n1")], address_type="IPv6")],
        nodes=[node("n1")],
    )
    state, _ = desired_state(node_name="n1", family=6, **objs)
    ((name, svc),) = state.services.items()
    assert svc.cluster_ip == "fd00:10:96::10"
    assert [ep.ip for ep in state.endpoints_of(name)] == ["fd00:10:244:1::5"]
    node6 = NodeConfig("n1", family=6, node_ips=("fd00:20::10",), cluster_cidrs=("fd00:10:244::/56",))
    flows = flows_for(state, node6, [Origin("out", CLIENT, "external", "eth0"), Origin("v4", "203.0.113.5", "external")])
    assert {(f.frontend, f.spec.dst) for f in flows} == {("clusterIP", "fd00:10:96::10"), ("nodePort", "fd00:20::10")}


# ---- the command line, over an ip6tables-save dump --------------------------------------------------------

def save_text(ruleset) -> str:
    """What ip6tables-save prints once the agent applied `ruleset`: its restore input, plus the
    built-in chains (policy ACCEPT) with kube-proxy's jump rules, which are ensured one by one."""
    lines = full_plan(ruleset, {}).text(ruleset).splitlines()
    for jump in ch.JUMP_RULES:
        at = lines.index("COMMIT", lines.index(f"*{jump.table}"))
        decl = f":{jump.chain} ACCEPT [0:0]"
        lines[at:at] = ([] if decl in lines else [decl]) + [" ".join(f'"{a}"' if " " in a else a for a in ("-A", jump.chain, *jump.args, "-j", jump.target))]
    return "\n".join(lines) + "\n"


def test_trace_walks_an_ip6tables_dump_and_prints_bracketed_backends(tmp_path):
    ruleset = render(node_config("worker2"), nginx_state("worker2"))
    dump = tmp_path / "worker2.save6"
    dump.write_text(save_text(ruleset))
    args = ["--rules-file", str(dump), "--node-ip", "fd00:20::16", "--json"]
    out = CliRunner().invoke(trace, ["--from", CLIENT, "--in-iface", "eth0", "--to", "[fd00:20::16]:30294", *args])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["verdict"] == "drop"
    out = CliRunner().invoke(trace, ["--from", "fd00:20::16", "--to", "[fd00:20::16]:30294", *args])
    data = json.loads(out.output)
    assert (data["verdict"], data["backends"], data["masquerade"], data["sourceAfter"]) == (
        "dnat", [f"[{POD_W3}]:80", f"[{POD_W1}]:80"], True, "fd00:20::16")
    out = CliRunner().invoke(trace, ["--from", "203.0.113.5", "--to", "[fd00:20::16]:30294", *args])
    assert out.exit_code == 1 and "a packet has one IP family" in out.output


# ---- lab trace picks the place's address of the target's family ---------------------------------------

@pytest.fixture
def dual_lab():
    topo = load_topology(Path(__file__).parents[2] / "examples" / "dualstack.yaml")
    return SimpleNamespace(name="t", topology=topo, dir=Path("/run/ebpf-proxy/labs/t"))


def test_lab_trace_sends_from_each_places_ipv6_address(dual_lab):
    p = plan(dual_lab, "outside", "[fd00:20::16]:30294")
    assert p.node == "worker2" and p.argv[:6] == ("--from", CLIENT, "--in-iface", "eth0", "--to",
                                                  "[fd00:20::16]:30294/tcp")
    assert plan(dual_lab, "my-nginx-1", "[fd00:10:96::a]:80").argv[:3] == ("--from", POD_W1, "--from-pod")
    assert plan(dual_lab, "worker3", "[fd00:20::17]:30294").argv[:2] == ("--from", "fd00:20::17")
    assert plan(dual_lab, "worker3", "[::1]:30294").argv[:2] == ("--from", "::1")
    assert plan(dual_lab, "outside", "203.0.113.9:80").argv[:2] == ("--from", "203.0.113.5")
