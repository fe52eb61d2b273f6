"""kube-proxy's own `TestInternalExternalMasquerade` (pkg/proxy/iptables/proxier_test.go), ported.

Upstream sets up three LoadBalancer services on a fake proxier, syncs, and traces 30 flows
through the generated rules with its packet tracer, in four variants ("base", "no
LocalTrafficDetector", "masqueradeAll", "masqueradeAll, no LocalTrafficDetector"), checking the
DNAT targets reachable and whether the flow is masqueraded. Here the same services go through
*our* renderer and the same flows through our walker, with the same expectations (flow names,
addresses and the variants' overrides as upstream's, row 15's port 3001 quirk included: see
/work/research/masquerade-flows.md): if our rules differed from kube-proxy's in anything these
flows touch, a row would fail. Upstream spells out all 30 rows; here they are built from their
shared shape (the same ten flows per service, most reaching every endpoint masqueraded) and
each service's differences, which yields upstream's rows in upstream's order.

Differences of harness, none of which changes an expectation: upstream's tracer runs only nat
PREROUTING and calls a flow masqueraded when it passed KUBE-MARK-MASQ; the walker runs the
kernel's hooks (nat OUTPUT for the node's own connections) and reads masquerade off nat
POSTROUTING. Both list every endpoint a random spread can reach.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.datapath.iptables.render import render
from ebpf_proxy.explain.iptables_rules import from_ruleset
from ebpf_proxy.explain.iptables_walk import NodeFacts, walk
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import Endpoint, LocalDetector, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName

NODE_NAME = "test-node"
NODE_IP, NODE_IP_ALT, EXTERNAL_IP = "192.168.0.2", "192.168.1.2", "192.168.99.11"  # testNodeIPs (IPv4)
POD_CIDR = "10.0.0.0/8"
POD, EXTERNAL_CLIENT, LOCALHOST = "10.0.0.2", "203.0.113.2", "127.0.0.1"

# name, clusterIP, nodePort, healthCheckNodePort, LB IP, eTP Local, iTP Local (setupTest)
SERVICES = [
    ("svc1", "172.30.0.41", 3001, 30001, "1.2.3.4", False, False),
    ("svc2", "172.30.0.42", 3002, 30002, "5.6.7.8", True, False),
    ("svc3", "172.30.0.43", 3003, 30003, "9.10.11.12", False, True),
]


def ruleset(masquerade_all: bool, detector: bool):
    services, endpoints = {}, {}
    for i, (name, cip, np, hc, lb, etp_local, itp_local) in enumerate(SERVICES, 1):
        spn = ServicePortName(f"ns{i}", name, "p80", Protocol.TCP)
        services[spn] = ServicePort(spn, cip, 80, Protocol.TCP, node_port=np, health_check_node_port=hc,
                                    load_balancer_ips=(lb,), external_policy_local=etp_local,
                                    internal_policy_local=itp_local)
        endpoints[spn] = (Endpoint(f"10.180.0.{i}", 80, NODE_NAME, is_local=True),
                          Endpoint(f"10.180.1.{i}", 80, "remote"))
    node = NodeConfig(NODE_NAME, node_ips=(NODE_IP, NODE_IP_ALT, EXTERNAL_IP), cluster_cidrs=(POD_CIDR,),
                      masquerade_all=masquerade_all, local_detector=None if detector else LocalDetector())
    return from_ruleset(render(node, ProxyState(services, endpoints)))


ALL, LOCAL = "all", "local"  # which of a service's endpoints a flow may reach: both, or the node-local one
SOURCES = {"pod": POD, "node": NODE_IP, "localhost": LOCALHOST, "external": EXTERNAL_CLIENT}
# The ten flows upstream sends to each service, in its order: who sends, to which address
FLOW_SHAPE = [("pod", "ClusterIP"), ("pod", "NodePort"), ("pod", "LB"),
              ("node", "ClusterIP"), ("node", "NodePort"), ("localhost", "NodePort"), ("node", "LB"),
              ("external", "ClusterIP"), ("external", "NodePort"), ("external", "LB")]
# service -> the suffix of its flows' names, and where its flows differ from "reaches every
# endpoint, masqueraded" (flow name -> (endpoints, masq)): upstream's 30 base rows, in this form
BASE_EXPECTED = {
    "svc1": ("", {"pod to ClusterIP": (ALL, False)}),
    "svc2": (" with eTP:Local", {
        "pod to ClusterIP with eTP:Local": (ALL, False),
        "pod to NodePort with eTP:Local": (ALL, False),
        "pod to LB with eTP:Local": (ALL, False),
        "external to NodePort with eTP:Local": (LOCAL, False),
        "external to LB with eTP:Local": (LOCAL, False),
    }),
    "svc3": (" with iTP:Local", {
        "pod to ClusterIP with iTP:Local": (LOCAL, False),
        "node to ClusterIP with iTP:Local": (LOCAL, True),
        "external to ClusterIP with iTP:Local": (LOCAL, True),
    }),
}
# upstream's quirk, kept: this flow goes to port 3001, svc1's NodePort ("short-circuited ... same
# as 'node to NodePort'"), so it reaches svc1's endpoints
AIMED_ELSEWHERE = {"node to NodePort with eTP:Local": "svc1"}


def reach(service: str, which: str) -> str:
    """The walker's backends for a flow that may reach `which` endpoints of `service` (the
    endpoints ruleset() gives the i-th service: 10.180.0.i local, 10.180.1.i remote)."""
    i = [name for name, *_ in SERVICES].index(service) + 1
    return f"10.180.0.{i}:80" + (f", 10.180.1.{i}:80" if which == ALL else "")


def base_flows() -> list[tuple[str, str, str, int, str, bool]]:
    """(name, source, destination IP, destination port, expected output, masq), upstream's 30 base flows."""
    flows = []
    by_name = {name: (cluster_ip, node_port, lb_ip) for name, cluster_ip, node_port, _, lb_ip, *_ in SERVICES}
    for service, (suffix, differ) in BASE_EXPECTED.items():
        for who, kind in FLOW_SHAPE:
            name = f"{who} to {kind}{suffix}"
            aimed = AIMED_ELSEWHERE.get(name, service)
            cluster_ip, node_port, lb_ip = by_name[aimed]
            dst, port = {"ClusterIP": (cluster_ip, 80), "LB": (lb_ip, 80),
                         "NodePort": (LOCALHOST if who == "localhost" else NODE_IP, node_port)}[kind]
            which, masq = differ.get(name, (ALL, True))
            flows.append((name, SOURCES[who], dst, port, reach(aimed, which), masq))
    return flows


BASE = base_flows()
# the flows a variant changes when the node has no working LocalTrafficDetector, or masquerades all
# ("there's no eTP:Local short-circuit for pod traffic, so pods get only the local endpoints")
_NO_DETECTOR_ETP = {"pod to NodePort with eTP:Local": (reach("svc2", LOCAL), None),
                    "pod to LB with eTP:Local": (reach("svc2", LOCAL), None)}
_POD_TO_CLUSTER_IP_MASQUERADED = {f"pod to ClusterIP{suffix}": (None, True) for suffix, _ in BASE_EXPECTED.values()}

# variant -> (masqueradeAll, a working detector, {flow name: (output or None: unchanged, masq or None)})
VARIANTS = {
    "base": (False, True, {}),
    "no LocalTrafficDetector": (False, False, {
        **{f"{who} to ClusterIP{suffix}": (None, False)
           for who in ("node", "external") for suffix, _ in BASE_EXPECTED.values()},
        **_NO_DETECTOR_ETP,
    }),
    "masqueradeAll": (True, True, _POD_TO_CLUSTER_IP_MASQUERADED),
    "masqueradeAll, no LocalTrafficDetector": (True, False, {**_POD_TO_CLUSTER_IP_MASQUERADED, **_NO_DETECTOR_ETP}),
}


def flow_for(src: str, dst: str, port: int) -> FlowSpec:
    if src in (NODE_IP, LOCALHOST):
        return FlowSpec(src, dst, port, origin="host")
    if src == POD:
        return FlowSpec(src, dst, port, origin="pod", in_iface="veth0")
    return FlowSpec(src, dst, port, origin="external", in_iface="eth0")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_internal_external_masquerade(variant):
    masquerade_all, detector, overrides = VARIANTS[variant]
    names = {name for name, *_ in BASE}
    assert len(names) == len(BASE) == 30, "upstream traces 30 distinct flows"
    assert set(overrides) <= names, "an override names no flow (upstream fails the test then too)"
    tables = ruleset(masquerade_all, detector)
    facts = NodeFacts(frozenset({NODE_IP, NODE_IP_ALT, EXTERNAL_IP}), masquerade_ip=NODE_IP)
    failures = []
    for name, src, dst, port, output, masq in BASE:
        new_output, new_masq = overrides.get(name, (None, None))
        assert (new_output, new_masq) != (output, masq), f"override of {name!r} equals the base value"
        output = new_output if new_output is not None else output
        masq = new_masq if new_masq is not None else masq
        t = walk(tables, flow_for(src, dst, port), facts)
        got = ", ".join(t.backends)
        if (t.verdict, got, t.masquerade) != ("dnat", output, masq):
            failures.append(f"{name}: want {output} masq={masq}, got {t.verdict} {got} masq={t.masquerade}")
    assert not failures, "\n".join(failures)
