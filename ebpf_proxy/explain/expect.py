"""What kube-proxy's semantics say a new connection gets: the model's side of `verify`.

Neither datapath uses this: each implements the rules its own way (iptables chains, C). `verify`
compares both against this third statement of them, written from shared/SEMANTICS.md and the
truth table of docs/local-traffic.md, with the endpoint sets from `model.categorize` (the one
place endpoint choice is decided). Where the three disagree on a flow, one of them is wrong.

Scope: the first packet of a TCP/UDP connection from a source that is not itself one of the
backends (a hairpin's masquerade depends on which backend is picked, so `verify` avoids it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ebpf_proxy.explain.packet import FlowSpec, host_port, is_loopback
from ebpf_proxy.model import NodeConfig, ProxyState, ServicePort, categorize


@dataclass(frozen=True)
class Frontend:
    """How the flow's destination matched a service port."""

    service: ServicePort
    kind: str  # "clusterIP" | "nodePort" | "externalIP" | "loadBalancerIP"

    @property
    def external(self) -> bool:
        return self.kind != "clusterIP"


@dataclass(frozen=True)
class Expectation:
    verdict: str  # dnat | drop | reject | pass
    backends: frozenset[str] = frozenset()
    masquerade: bool = False
    service: str | None = None
    reason: str = ""


def find_frontend(flow: FlowSpec, state: ProxyState, node: NodeConfig) -> Frontend | None:
    """The service port the destination belongs to, as KUBE-SERVICES / epx_svc would find it.

    Exact frontends first (clusterIP, externalIP, LB IP), then NodePorts on the node's addresses
    (and on 127.0.0.0/8 for the node's own connections when localhost NodePorts are on)."""
    nodeport_candidate = flow.dst in node.node_ips or (
        is_loopback(flow.dst) and flow.origin == "host" and node.localhost_nodeports)
    by_nodeport = None
    for svc in state.services.values():
        if svc.protocol is not flow.protocol or svc.cluster_ip is None:
            continue
        if svc.port == flow.dport:
            if svc.cluster_ip == flow.dst:
                return Frontend(svc, "clusterIP")
            if flow.dst in svc.external_ips:
                return Frontend(svc, "externalIP")
            if flow.dst in svc.load_balancer_ips:
                return Frontend(svc, "loadBalancerIP")
        if nodeport_candidate and svc.node_port == flow.dport:
            by_nodeport = Frontend(svc, "nodePort")
    return by_nodeport


def is_local_source(flow: FlowSpec, node: NodeConfig) -> bool:
    """kube-proxy's LocalTrafficDetector.IfLocal for this flow (docs/local-traffic.md, table 1)."""
    detector = node.detector
    if not detector.implemented or flow.origin == "host":
        return False
    if detector.by_cidr:
        src = ipaddress.ip_address(flow.src)
        return any(src in ipaddress.ip_network(c, strict=False) for c in detector.cidrs)
    return flow.in_iface is not None and detector.matches_l3_device(flow.in_iface)


def is_node_source(flow: FlowSpec, node: NodeConfig) -> bool:
    """iptables' `--src-type LOCAL`: one of the node's own addresses (127.0.0.0/8 and ::1 included)."""
    return flow.origin == "host" or flow.src in node.node_ips or is_loopback(flow.src)


def expected(flow: FlowSpec, state: ProxyState, node: NodeConfig) -> Expectation:
    """The outcome docs/local-traffic.md and SEMANTICS.md give this flow."""
    fe = find_frontend(flow, state, node)
    if fe is None:
        return Expectation("pass", reason="no service frontend")
    svc = fe.service
    name = str(svc.name)
    sets = categorize(svc, state.endpoints_of(svc.name), state.topology)
    if not sets.has_any:
        if flow.origin == "host" and fe.kind in ("externalIP", "loadBalancerIP") and flow.dst not in node.node_ips:
            # kube-proxy rejects these in KUBE-EXTERNAL-SERVICES, which only INPUT and FORWARD
            # reach: the node's own connection leaves untouched
            return Expectation("pass", service=name, reason=f"{name} has no endpoints; the node's own traffic to "
                                                            f"its {fe.kind} is not rejected (OUTPUT)")
        return Expectation("reject", service=name, reason=f"{name} has no endpoints")
    if fe.kind == "loadBalancerIP" and svc.load_balancer_source_ranges:
        src = ipaddress.ip_address(flow.src)
        ranges = [ipaddress.ip_network(r.strip(), strict=False) for r in svc.load_balancer_source_ranges]
        if not any(src in r for r in ranges):
            return Expectation("drop", service=name, reason=f"{name}: loadBalancerSourceRanges do not admit {flow.src}")

    local, host = is_local_source(flow, node), is_node_source(flow, node)
    if not fe.external:
        if svc.internal_policy_local:
            chosen, scope = sets.local, "internalTrafficPolicy=Local"
        else:
            chosen, scope = sets.cluster, ""
        masq = node.masquerade_all or (node.detector.implemented and not local)
        if not chosen:
            return Expectation("drop", service=name, reason=f"{name} is {scope} and this node has no local endpoint")
    elif not svc.external_policy_local:
        chosen, masq = sets.cluster, True
    elif local:
        chosen, masq = sets.cluster, False  # pod traffic short-circuited; masqueradeAll does not reach it
    elif host:
        chosen, masq = sets.cluster, True
    else:
        chosen, masq = sets.local, False
        if not chosen:
            return Expectation("drop", service=name,
                               reason=f"{name} is externalTrafficPolicy=Local and this node has no local endpoint")
    return Expectation("dnat", frozenset(host_port(ep.ip, ep.port) for ep in chosen), masq, name,
                       reason=f"{fe.kind} of {name}")
