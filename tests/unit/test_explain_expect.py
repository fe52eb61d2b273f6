"""The model's expected outcome (explain/expect.py) against kube-proxy's own expectations.

Upstream `TestInternalExternalMasquerade` (pkg/proxy/iptables/proxier_test.go): three
LoadBalancer services (eTP=Cluster, eTP=Local, iTP=Local), one local and one remote endpoint each,
30 flows from a pod, the node, localhost and an external client, in four variants (base, no
LocalTrafficDetector, masqueradeAll, both). Facts (addresses, ports, outcomes) as the test states
them, including its flow that sends "node to NodePort with eTP:Local" to svc1's port 3001.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.explain.expect import expected
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import (
    Endpoint,
    LocalDetector,
    LocalMode,
    NodeConfig,
    NodeTopology,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)

NODE = "test-node"
SOURCES = {"pod": ("10.0.0.2", "pod"), "node": ("192.168.0.2", "host"), "localhost": ("127.0.0.1", "host"),
           "external": ("203.0.113.2", "external")}
# svc: (clusterIP, nodePort, LB IP, eTP local, iTP local, local endpoint, remote endpoint)
SERVICES = {
    "svc1": ("172.30.0.41", 3001, "1.2.3.4", False, False, "10.180.0.1", "10.180.1.1"),
    "svc2": ("172.30.0.42", 3002, "5.6.7.8", True, False, "10.180.0.2", "10.180.1.2"),
    "svc3": ("172.30.0.43", 3003, "9.10.11.12", False, True, "10.180.0.3", "10.180.1.3"),
}
BOTH = {s: f"{v[5]}:80, {v[6]}:80" for s, v in SERVICES.items()}
LOCAL = {s: f"{v[5]}:80" for s, v in SERVICES.items()}

# (flow name, source, destination, output, masq)
BASE = [
    ("pod to ClusterIP", "pod", "172.30.0.41:80", BOTH["svc1"], False),
    ("pod to NodePort", "pod", "192.168.0.2:3001", BOTH["svc1"], True),
    ("pod to LB", "pod", "1.2.3.4:80", BOTH["svc1"], True),
    ("node to ClusterIP", "node", "172.30.0.41:80", BOTH["svc1"], True),
    ("node to NodePort", "node", "192.168.0.2:3001", BOTH["svc1"], True),
    ("localhost to NodePort", "localhost", "127.0.0.1:3001", BOTH["svc1"], True),
    ("node to LB", "node", "1.2.3.4:80", BOTH["svc1"], True),
    ("external to ClusterIP", "external", "172.30.0.41:80", BOTH["svc1"], True),
    ("external to NodePort", "external", "192.168.0.2:3001", BOTH["svc1"], True),
    ("external to LB", "external", "1.2.3.4:80", BOTH["svc1"], True),
    ("pod to ClusterIP with eTP:Local", "pod", "172.30.0.42:80", BOTH["svc2"], False),
    ("pod to NodePort with eTP:Local", "pod", "192.168.0.2:3002", BOTH["svc2"], False),
    ("pod to LB with eTP:Local", "pod", "5.6.7.8:80", BOTH["svc2"], False),
    ("node to ClusterIP with eTP:Local", "node", "172.30.0.42:80", BOTH["svc2"], True),
    ("node to NodePort with eTP:Local", "node", "192.168.0.2:3001", BOTH["svc1"], True),
    ("localhost to NodePort with eTP:Local", "localhost", "127.0.0.1:3002", BOTH["svc2"], True),
    ("node to LB with eTP:Local", "node", "5.6.7.8:80", BOTH["svc2"], True),
    ("external to ClusterIP with eTP:Local", "external", "172.30.0.42:80", BOTH["svc2"], True),
    ("external to NodePort with eTP:Local", "external", "192.168.0.2:3002", LOCAL["svc2"], False),
    ("external to LB with eTP:Local", "external", "5.6.7.8:80", LOCAL["svc2"], False),
    ("pod to ClusterIP with iTP:Local", "pod", "172.30.0.43:80", LOCAL["svc3"], False),
    ("pod to NodePort with iTP:Local", "pod", "192.168.0.2:3003", BOTH["svc3"], True),
    ("pod to LB with iTP:Local", "pod", "9.10.11.12:80", BOTH["svc3"], True),
    ("node to ClusterIP with iTP:Local", "node", "172.30.0.43:80", LOCAL["svc3"], True),
    ("node to NodePort with iTP:Local", "node", "192.168.0.2:3003", BOTH["svc3"], True),
    ("localhost to NodePort with iTP:Local", "localhost", "127.0.0.1:3003", BOTH["svc3"], True),
    ("node to LB with iTP:Local", "node", "9.10.11.12:80", BOTH["svc3"], True),
    ("external to ClusterIP with iTP:Local", "external", "172.30.0.43:80", LOCAL["svc3"], True),
    ("external to NodePort with iTP:Local", "external", "192.168.0.2:3003", BOTH["svc3"], True),
    ("external to LB with iTP:Local", "external", "9.10.11.12:80", BOTH["svc3"], True),
]
NO_DETECTOR = {
    "node to ClusterIP": (None, False), "node to ClusterIP with eTP:Local": (None, False),
    "node to ClusterIP with iTP:Local": (None, False), "external to ClusterIP": (None, False),
    "external to ClusterIP with eTP:Local": (None, False), "external to ClusterIP with iTP:Local": (None, False),
    "pod to NodePort with eTP:Local": (LOCAL["svc2"], None), "pod to LB with eTP:Local": (LOCAL["svc2"], None),
}
MASQUERADE_ALL = {"pod to ClusterIP": (None, True), "pod to ClusterIP with eTP:Local": (None, True),
                  "pod to ClusterIP with iTP:Local": (None, True)}
BOTH_VARIANTS = {**MASQUERADE_ALL, "pod to NodePort with eTP:Local": (LOCAL["svc2"], None),
                 "pod to LB with eTP:Local": (LOCAL["svc2"], None)}
VARIANTS = {  # name: (masqueradeAll, detector, overrides)
    "base": (False, True, {}),
    "no LocalTrafficDetector": (False, False, NO_DETECTOR),
    "masqueradeAll": (True, True, MASQUERADE_ALL),
    "masqueradeAll, no LocalTrafficDetector": (True, False, BOTH_VARIANTS),
}


def world() -> ProxyState:
    services, endpoints = {}, {}
    for name, (cip, np, lb, etp, itp, local, remote) in SERVICES.items():
        spn = ServicePortName(f"ns{name[-1]}", name, "p80", Protocol.TCP)
        services[spn] = ServicePort(spn, cip, 80, Protocol.TCP, node_port=np, load_balancer_ips=(lb,),
                                    external_policy_local=etp, internal_policy_local=itp,
                                    health_check_node_port=30000 + np)
        endpoints[spn] = (Endpoint(local, 80, NODE, is_local=True), Endpoint(remote, 80, "remote"))
    return ProxyState(services, endpoints, NodeTopology(NODE))


def flows(variant: str):
    _, _, overrides = VARIANTS[variant]
    for name, src, dst, output, masq in BASE:
        out, m = overrides.get(name, (None, None))
        yield name, src, dst, out or output, masq if m is None else m


@pytest.mark.parametrize("variant", VARIANTS)
def test_internal_external_masquerade(variant):
    masquerade_all, detector, _ = VARIANTS[variant]
    node = NodeConfig(NODE, node_ips=("192.168.0.2", "192.168.1.2", "192.168.99.11"), masquerade_all=masquerade_all,
                      local_detector=LocalDetector(LocalMode.CLUSTER_CIDR, ("10.0.0.0/8",)) if detector else LocalDetector())
    state = world()
    wrong = []
    for name, src, dst, output, masq in flows(variant):
        ip, origin = SOURCES[src]
        host, port = dst.rsplit(":", 1)
        got = expected(FlowSpec(ip, host, int(port), origin=origin), state, node)
        want = frozenset(output.split(", "))
        if got.verdict != "dnat" or got.backends != want or got.masquerade != masq:
            wrong.append(f"{name}: {got.verdict} {sorted(got.backends)} masq={got.masquerade}, "
                         f"upstream {sorted(want)} masq={masq}")
    assert not wrong, "\n".join(wrong)


def test_no_frontend_passes_and_no_endpoints_rejects():
    node = NodeConfig(NODE, node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
    state = world()
    assert expected(FlowSpec("10.0.0.2", "172.30.0.99", 80, origin="pod"), state, node).verdict == "pass"
    empty = ProxyState(state.services, {}, state.topology)
    got = expected(FlowSpec("10.0.0.2", "172.30.0.41", 80, origin="pod"), empty, node)
    assert (got.verdict, got.service) == ("reject", "ns1/svc1:p80")
