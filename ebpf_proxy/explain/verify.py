"""`verify`: every flow that matters on a node, three opinions each, and where they disagree.

For each service frontend (clusterIP, NodePort on a node address and on 127.0.0.1, externalIPs,
LB IPs) and each origin class (a pod of this node, a pod elsewhere, the node itself, a client
outside), the flow is put to:
  - the model (`expect.expected`: SEMANTICS and docs/local-traffic.md over model.categorize),
  - and to each tracer given: the eBPF programs running on the node (dry run), the iptables
    rules the iptables mode would write for the same state (rendered, not installed), or the
    node's live rules.
A flow passes when every tracer's verdict equals the model's and, for a DNAT, the set of
backends it could reach and whether it masquerades are the same. Anything else is a mismatch,
reported with every opinion so that the wrong one is plain to see.

Flows whose source is one of the service's own backends are left out: a hairpin's masquerade
depends on which backend is picked, which a set of possible backends cannot state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ebpf_proxy.explain.expect import Expectation, expected
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.explain.result import Trace
from ebpf_proxy.model import NodeConfig, Protocol, ProxyState, of_family

Tracer = Callable[[FlowSpec], Trace]
SUPPORTED = (Protocol.TCP, Protocol.UDP)


@dataclass(frozen=True)
class Origin:
    """A concrete sender of one origin class, as the node sees it."""

    label: str  # "pod web-1 (this node)", "client outside", ...
    src: str
    origin: str  # FlowSpec.origin: pod | external | host
    in_iface: str | None = None


@dataclass(frozen=True)
class Flow:
    spec: FlowSpec
    sender: Origin
    service: str
    frontend: str  # clusterIP | nodePort | localhost nodePort | externalIP | loadBalancerIP


@dataclass
class Mismatch:
    flow: Flow
    expectation: Expectation
    traces: dict[str, Trace]
    problems: list[str]

    def render(self) -> str:
        lines = [f"MISMATCH {self.flow.service} {self.flow.frontend}: {self.flow.sender.label} "
                 f"{self.flow.spec.label}"]
        lines += [f"  - {p}" for p in self.problems]
        exp = self.expectation
        lines.append(f"  model:    {exp.verdict} {sorted(exp.backends)} masquerade={exp.masquerade} ({exp.reason})")
        for name, t in self.traces.items():
            lines.append(f"  {name + ':':<9} {t.verdict} {list(t.backends)} masquerade={t.masquerade} ({t.reason})")
            lines += [f"            {s.hook} {s.unit}: {s.action}" for s in t.steps]
        return "\n".join(lines)


@dataclass
class Report:
    flows: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # flows a tracer could not answer

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.errors


def flows_for(state: ProxyState, node: NodeConfig, senders: Sequence[Origin]) -> list[Flow]:
    """Every (frontend, sender) pair of this node's programmable service ports of the node's family
    (`node.family`: a NodeConfig is one proxier's), from the senders of that family."""
    out = []
    family = node.family
    first_node_ip = next(iter(of_family(node.node_ips, family)), None)
    senders = [s for s in senders if of_family((s.src,), family)]
    for name, svc in sorted(state.services.items()):
        if svc.cluster_ip is None or svc.protocol not in SUPPORTED or not of_family((svc.cluster_ip,), family):
            continue
        dests = [(svc.cluster_ip, svc.port, "clusterIP", False)]
        if svc.node_port and first_node_ip:
            dests.append((first_node_ip, svc.node_port, "nodePort", False))
        if svc.node_port and node.localhost_nodeports and family == 4:  # none on IPv6 (kube-proxy)
            dests.append(("127.0.0.1", svc.node_port, "localhost nodePort", True))
        dests += [(ip, svc.port, "externalIP", False) for ip in of_family(svc.external_ips, family)]
        dests += [(ip, svc.port, "loadBalancerIP", False) for ip in of_family(svc.load_balancer_ips, family)]
        backends = {ep.ip for ep in state.endpoints_of(name)}
        for dst, port, kind, host_only in dests:
            for sender in senders:
                if sender.src in backends or (host_only and sender.origin != "host"):
                    continue
                # a node socket connecting to 127.0.0.1 has 127.0.0.1 as its source
                src = "127.0.0.1" if host_only else sender.src
                spec = FlowSpec(src, dst, port, svc.protocol, origin=sender.origin, in_iface=sender.in_iface)
                out.append(Flow(spec, sender, str(name), kind))
    return out


def compare(exp: Expectation, trace: Trace, who: str | None = None) -> list[str]:
    """What `trace` (from tracer `who`, default its datapath) gets wrong against the model's
    expectation (empty: agrees)."""
    who = who or trace.datapath
    verdict = "pass" if trace.verdict == "accept" else trace.verdict
    if verdict != exp.verdict:
        return [f"{who}: verdict {trace.verdict}, the model says {exp.verdict}"]
    problems = []
    if verdict == "dnat":
        if frozenset(trace.backends) != exp.backends:
            problems.append(f"{who}: backends {sorted(trace.backends)}, the model says {sorted(exp.backends)}")
        if trace.masquerade != exp.masquerade:
            problems.append(f"{who}: masquerade {trace.masquerade}, the model says {exp.masquerade}")
    return problems


def verify(flows: Iterable[Flow], state: ProxyState, node: NodeConfig, tracers: Mapping[str, Tracer]) -> Report:
    """Put every flow to the model and to each tracer (name -> function)."""
    report = Report()
    for flow in flows:
        report.flows += 1
        exp = expected(flow.spec, state, node)
        traces, problems = {}, []
        for name, tracer in tracers.items():
            try:
                traces[name] = tracer(flow.spec)
            except Exception as exc:  # a tracer that cannot answer is a finding, not a crash
                report.errors.append(f"{name} could not trace {flow.spec.label} ({flow.service}): {exc}")
                continue
            problems += compare(exp, traces[name], name)
        if problems:
            report.mismatches.append(Mismatch(flow, exp, traces, problems))
    return report
