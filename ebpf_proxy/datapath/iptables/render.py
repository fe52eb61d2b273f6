"""Pure rendering of kube-proxy's iptables rules: (NodeConfig, ProxyState) -> Ruleset.

The rules follow kube-proxy's current `pkg/proxy/iptables/proxier.go` rule for rule (same
chains, same matches, same order, same comments), because this mode is the reference the eBPF
datapath is compared against: if it differed from kube-proxy, the comparison would prove nothing.
Each service port renders into its own `ServiceRules` fragment so that a partial sync can
re-render only the services that changed and reuse the other fragments (kube-proxy's partial
sync); `assemble` stitches fragments and the fixed chains into a `Ruleset`.

Endpoint sets come from `model.categorize`, the one place both datapaths take them from.
One IP family is rendered, the NodeConfig's (`iptables` for IPv4, `ip6tables` for IPv6), as
kube-proxy runs one proxier per family: addresses and CIDRs of the other family are skipped, and
a service whose cluster IP is of the other family renders nothing. The IPv6 rules differ from the
IPv4 ones only where kube-proxy's do: no localhost NodePorts (so no route_localnet and no
"block incoming localnet connections" rule; the match-all NodePorts jump excludes ::1/128), and
REJECT as ip6tables-save prints it (icmp6-port-unreachable).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.ruleset import Ruleset
from ebpf_proxy.model import (
    Endpoint,
    LocalDetector,
    LocalMode,
    NodeConfig,
    NodeTopology,
    ProxyState,
    ServicePort,
    ServicePortName,
    categorize,
    networks_of_family,
    of_family,
)
from ebpf_proxy.model.types import ip_family

# Past this many endpoints in total kube-proxy drops the per-endpoint comments, which are up to
# 40% of the ruleset's size; same threshold so that both render the same rules.
LARGE_CLUSTER_ENDPOINTS_THRESHOLD = 1000

LOOPBACK_NET = "127.0.0.0/8"
LOOPBACK_NET6 = "::1/128"
_LOOPBACK_IP = {4: ipaddress.ip_address("127.0.0.1"), 6: ipaddress.ip_address("::1")}
# REJECT's default, spelled out as iptables-save / ip6tables-save print it
_REJECT_WITH = {4: "icmp-port-unreachable", 6: "icmp6-port-unreachable"}
_NODEPORTS_JUMP_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"


@dataclass(frozen=True)
class RenderContext:
    """Node-wide facts every service's rules depend on, computed once per sync."""

    masq_mark: str  # e.g. "0x004000", formatted like kube-proxy's "%#08x"
    # the local-traffic detector's matches (kube-proxy's IfLocal / IfNotLocal); None: a no-op
    # detector, and the rules that need one are not written
    if_local: tuple[str, ...] | None
    if_not_local: tuple[str, ...] | None
    masquerade_all: bool
    # effective: the flag, and 127.0.0.1 within --nodeport-addresses; never for IPv6 (kube-proxy:
    # localhost NodePorts cannot work there)
    localhost_nodeports: bool
    nodeport_match_all: bool  # no --nodeport-addresses of the family (or 0.0.0.0/0, ::/0): every LOCAL address
    nodeport_ips: tuple[str, ...]  # the addresses NodePorts answer on when not match-all
    node_ips: tuple[str, ...]
    drop_invalid: bool = True  # False when nf_conntrack_tcp_be_liberal is set, as kube-proxy
    large_cluster: bool = False
    family: int = 4  # the one IP family rendered: 4 (iptables) or 6 (ip6tables)

    @classmethod
    def for_node(cls, node: NodeConfig, *, drop_invalid: bool = True, large_cluster: bool = False) -> RenderContext:
        """kube-proxy's NewProxier and NewNodePortAddresses for the node's family: the
        --nodeport-addresses of that family (none, or a zero CIDR: match-all), localhost NodePorts
        only when IPv4 and 127.0.0.1 is within them, and the local detector of that family."""
        family = node.family
        if_local, if_not_local = detector_matches(node.node_name, node.detector, family)
        nodeport_nets = node.networks(node.nodeport_addresses)
        match_all = not nodeport_nets or any(n.prefixlen == 0 for n in nodeport_nets)
        loopback = _LOOPBACK_IP[family]
        localhost = family == 4 and node.localhost_nodeports and (
            match_all or any(loopback in n for n in nodeport_nets))
        node_ips = node.of_family(node.node_ips)
        nodeport_ips: list[str] = []
        if not match_all:
            candidates = list(node_ips)
            if any(loopback in n for n in nodeport_nets):
                candidates.append(str(loopback))
            for ip in candidates:
                addr = ipaddress.ip_address(ip)
                if not any(addr in n for n in nodeport_nets) or ip in nodeport_ips:
                    continue
                if addr.is_loopback and not localhost:  # always skipped for IPv6, as kube-proxy
                    continue
                nodeport_ips.append(ip)
        return cls(
            masq_mark=f"{1 << node.masquerade_bit:#08x}",
            if_local=if_local,
            if_not_local=if_not_local,
            masquerade_all=node.masquerade_all,
            localhost_nodeports=localhost,
            nodeport_match_all=match_all,
            nodeport_ips=tuple(nodeport_ips),
            node_ips=node_ips,
            drop_invalid=drop_invalid,
            large_cluster=large_cluster,
            family=family,
        )


def detector_matches(
    node_name: str, detector: LocalDetector, family: int = 4
) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """kube-proxy's LocalTrafficDetector as iptables matches: (IfLocal, IfNotLocal), or (None, None)
    for the no-op detector (pkg/proxy/util/localdetector.go): `-s CIDR` for ClusterCIDR and
    NodeCIDR, `-i BRIDGE` for BridgeInterface, `-i PREFIX+` for InterfaceNamePrefix. A CIDR
    detector takes the CIDR of `family` (the proxier's); without one it is a no-op."""
    if detector.by_cidr:
        nets = networks_of_family(detector.cidrs, family)
        if len(nets) > 1:
            source = "--cluster-cidr" if detector.mode is LocalMode.CLUSTER_CIDR else "spec.podCIDRs"
            raise ValueError(
                f"node {node_name}: {source} {','.join(detector.cidrs)!r} holds more than one IPv{family} CIDR; "
                f"kube-proxy's {detector.mode.value} local-traffic detector takes one per IP family"
            )
        if not nets:
            return None, None
        return ("-s", str(nets[0])), ("!", "-s", str(nets[0]))
    if detector.mode is LocalMode.BRIDGE_INTERFACE:
        return ("-i", detector.interface), ("!", "-i", detector.interface)
    if detector.mode is LocalMode.INTERFACE_NAME_PREFIX:
        return ("-i", f"{detector.interface}+"), ("!", "-i", f"{detector.interface}+")
    return None, None


def is_large_cluster(state: ProxyState) -> bool:
    total = sum(len(state.endpoints_of(name)) for name in state.services)
    return total > LARGE_CLUSTER_ENDPOINTS_THRESHOLD


def probability(n: int) -> str:
    """The statistic match's probability for the first of n remaining endpoints, as kube-proxy prints it."""
    return f"{1.0 / n:0.10f}"


def _quote(text: str) -> str:
    return f'"{text}"' if " " in text else text


def _comment(text: str) -> tuple[str, ...]:
    return ("-m", "comment", "--comment", _quote(text))


def _line(chain: str, *tokens: str) -> str:
    return " ".join(("-A", chain, *tokens))


@dataclass(frozen=True)
class ServiceRules:
    """Everything one service port contributes to the ruleset.

    `nat_chains` are the chains the service owns (EXT, FW, SVC, SVL, SEP); the other fields are
    its lines in the shared top-level chains, in the order kube-proxy writes them.
    """

    nat_services: tuple[str, ...] = ()
    nat_nodeports: tuple[str, ...] = ()
    filter_rules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    nat_chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class _Builder:
    """Collects lines per chain in insertion order (chain order = first mention)."""

    def __init__(self) -> None:
        self.chains: dict[str, list[str]] = {}

    def declare(self, chain: str) -> None:
        self.chains.setdefault(chain, [])

    def add(self, chain: str, *tokens: str) -> None:
        self.chains.setdefault(chain, []).append(_line(chain, *tokens))

    def frozen(self) -> dict[str, tuple[str, ...]]:
        return {c: tuple(lines) for c, lines in self.chains.items()}


def render_service(
    ctx: RenderContext, svc: ServicePort, endpoints: tuple[Endpoint, ...], topology: NodeTopology = NodeTopology()
) -> ServiceRules | None:
    """One service port's rules, or None when kube-proxy programs nothing for it (headless, or a
    cluster IP of the other family: that family's proxier programs it)."""
    family = ctx.family
    if svc.cluster_ip is None or ip_family(svc.cluster_ip) != family:
        return None
    name = svc.name
    label = str(name)
    proto = svc.protocol.lower
    port = str(svc.port)
    external_ips = of_family(svc.external_ips, family)
    lb_ips = of_family(svc.load_balancer_ips, family)
    sets = categorize(svc, tuple(ep for ep in endpoints if ip_family(ep.ip) == family), topology)

    cluster_chain, local_chain, external_chain, fw = ch.service_chains(name)
    seps: dict[tuple[str, int], str] = {}  # an endpoint's SEP chain (a hash), named up to three times

    def sep_of(ep: Endpoint) -> str:
        key = (ep.ip, ep.port)
        sep = seps.get(key)
        if sep is None:
            sep = seps[key] = ch.sep_chain(name, ep.ip, ep.port)
        return sep

    uses_cluster_chain = bool(sets.cluster) and svc.uses_cluster_endpoints
    uses_local_chain = bool(sets.local) and svc.uses_local_endpoints

    has_endpoints = sets.has_any
    internal_chain, has_internal = cluster_chain, has_endpoints
    if svc.internal_policy_local:
        internal_chain = local_chain
        has_internal = has_internal and bool(sets.local)
    external_policy_chain, has_external = cluster_chain, has_endpoints
    if svc.external_policy_local:
        external_policy_chain = local_chain
        has_external = has_external and bool(sets.local)
    # The EXT chain is needed even without externally-usable endpoints: it holds the short-circuits
    # for pods and for the node itself (SEMANTICS rules 6 and 7).
    uses_external_chain = has_endpoints and svc.externally_accessible
    source_ranges = tuple(str(n) for n in networks_of_family(svc.load_balancer_source_ranges, family))
    uses_fw = has_endpoints and bool(lb_ips) and bool(source_ranges)
    lb_chain = fw if uses_fw else external_chain

    if not has_endpoints:
        internal_target = external_target = "REJECT"
        internal_comment = external_comment = f"{label} has no endpoints"
    else:
        internal_target = external_target = "DROP"
        internal_comment = external_comment = f"{label} has no local endpoints"

    def verdict(target: str) -> tuple[str, ...]:
        # REJECT's default is icmp-port-unreachable (icmp6- for IPv6); spelled out as iptables-save prints it.
        return ("-j", "REJECT", "--reject-with", _REJECT_WITH[family]) if target == "REJECT" else ("-j", target)

    nat = _Builder()
    filt = _Builder()
    match = ("-m", proto, "-p", proto)

    # Capture the clusterIP.
    if has_internal:
        nat.add(ch.KUBE_SERVICES, *_comment(f"{label} cluster IP"), *match, "-d", svc.cluster_ip,
                "--dport", port, "-j", internal_chain)
    else:
        filt.add(ch.KUBE_SERVICES, *_comment(internal_comment), *match, "-d", svc.cluster_ip,
                 "--dport", port, *verdict(internal_target))

    # Capture externalIPs.
    for ip in external_ips:
        if has_endpoints:
            nat.add(ch.KUBE_SERVICES, *_comment(f"{label} external IP"), *match, "-d", ip, "--dport", port,
                    "-j", external_chain)
        if not has_external:
            filt.add(ch.KUBE_EXTERNAL_SERVICES, *_comment(external_comment), *match, "-d", ip, "--dport", port,
                     *verdict(external_target))

    # Capture load-balancer ingress.
    for ip in lb_ips:
        if has_endpoints:
            nat.add(ch.KUBE_SERVICES, *_comment(f"{label} loadbalancer IP"), *match, "-d", ip, "--dport", port,
                    "-j", lb_chain)
        if uses_fw:
            filt.add(ch.KUBE_PROXY_FIREWALL, *_comment(f"{label} traffic not accepted by {fw}"), *match,
                     "-d", ip, "--dport", port, "-j", "DROP")
    if not has_external:
        for ip in lb_ips:
            filt.add(ch.KUBE_EXTERNAL_SERVICES, *_comment(external_comment), *match, "-d", ip, "--dport", port,
                     *verdict(external_target))

    # Capture nodeports. (Localhost NodePorts reach this chain through KUBE-SERVICES' final jump,
    # whose destination match includes 127.0.0.0/8 when they are enabled.)
    if svc.node_port:
        if has_endpoints:
            nat.add(ch.KUBE_NODEPORTS, *_comment(label), *match, "--dport", str(svc.node_port), "-j", external_chain)
        if not has_external:
            filt.add(ch.KUBE_EXTERNAL_SERVICES, *_comment(external_comment), "-m", "addrtype", "--dst-type", "LOCAL",
                     *match, "--dport", str(svc.node_port), *verdict(external_target))

    # Accept healthCheckNodePort connections whether or not there are local endpoints.
    if svc.health_check_node_port:
        filt.add(ch.KUBE_NODEPORTS, *_comment(f"{label} health check node port"), "-m", "tcp", "-p", "tcp",
                 "--dport", str(svc.health_check_node_port), "-j", "ACCEPT")

    own = _Builder()

    # Internal traffic: masquerade what does not come from a pod (or everything with --masquerade-all).
    if has_internal:
        args = (*_comment(f"{label} cluster IP"), *match, "-d", svc.cluster_ip, "--dport", port)
        if ctx.masquerade_all:
            own.add(internal_chain, *args, "-j", ch.KUBE_MARK_MASQ)
        elif ctx.if_not_local:
            own.add(internal_chain, *args, *ctx.if_not_local, "-j", ch.KUBE_MARK_MASQ)

    # External traffic (NodePort, externalIPs, LB IPs) enters through the EXT chain.
    if uses_external_chain:
        own.declare(external_chain)
        if not svc.external_policy_local:
            own.add(external_chain, *_comment(f"masquerade traffic for {label} external destinations"),
                    "-j", ch.KUBE_MARK_MASQ)
        else:
            if ctx.if_local:
                own.add(external_chain, *_comment(f"pod traffic for {label} external destinations"),
                        *ctx.if_local, "-j", cluster_chain)
            own.add(external_chain, *_comment(f"masquerade LOCAL traffic for {label} external destinations"),
                    "-m", "addrtype", "--src-type", "LOCAL", "-j", ch.KUBE_MARK_MASQ)
            own.add(external_chain, *_comment(f"route LOCAL traffic for {label} external destinations"),
                    "-m", "addrtype", "--src-type", "LOCAL", "-j", cluster_chain)
        if has_external:
            own.add(external_chain, "-j", external_policy_chain)

    # loadBalancerSourceRanges: listed sources continue to EXT; the rest falls through unDNATed
    # and meets the DROP in filter KUBE-PROXY-FIREWALL.
    if uses_fw:
        own.declare(fw)
        for cidr in source_ranges:
            own.add(fw, *_comment(f"{label} loadbalancer IP"), "-s", cidr, "-j", external_chain)
        if svc.lb_ips_admitted_as_source(ctx.node_ips):
            # A VIP bound locally makes node -> VIP traffic loop back with the VIP as source.
            for ip in lb_ips:
                own.add(fw, *_comment(f"{label} loadbalancer IP"), "-s", ip, "-j", external_chain)
        own.add(fw, *_comment(f"other traffic to {label} will be dropped by KUBE-PROXY-FIREWALL"))

    if uses_cluster_chain:
        _endpoint_dispatch(ctx, own, svc, cluster_chain, sets.cluster, sep_of)
    if uses_local_chain:
        _endpoint_dispatch(ctx, own, svc, local_chain, sets.local, sep_of)

    for ep in sets.all_reachable:
        sep = sep_of(ep)
        comment = () if ctx.large_cluster else _comment(label)
        # Hairpin: an endpoint reaching itself through the service must be masqueraded.
        own.add(sep, *comment, "-s", ep.ip, "-j", ch.KUBE_MARK_MASQ)
        affinity = ("-m", "recent", "--name", sep, "--set") if svc.session_affinity else ()
        own.add(sep, *comment, *affinity, *match, "-j", "DNAT", "--to-destination", ch.join_host_port(ep.ip, ep.port))

    return ServiceRules(
        nat_services=tuple(nat.chains.get(ch.KUBE_SERVICES, ())),
        nat_nodeports=tuple(nat.chains.get(ch.KUBE_NODEPORTS, ())),
        filter_rules=filt.frozen(),
        nat_chains=own.frozen(),
    )


def _endpoint_dispatch(
    ctx: RenderContext, out: _Builder, svc: ServicePort, chain: str, endpoints: tuple[Endpoint, ...],
    sep_of: Callable[[Endpoint], str],
) -> None:
    """SVC/SVL chain body: affinity checks first, then the 1/n, 1/(n-1), ... random spread."""
    out.declare(chain)
    label = str(svc.name)

    def comment(ep: Endpoint) -> tuple[str, ...]:
        return () if ctx.large_cluster else _comment(f"{label} -> {ch.join_host_port(ep.ip, ep.port)}")

    if svc.session_affinity:
        for ep in endpoints:
            sep = sep_of(ep)
            out.add(chain, *comment(ep), "-m", "recent", "--name", sep, "--rcheck",
                    "--seconds", str(svc.affinity_timeout_seconds), "--reap", "-j", sep)
    n = len(endpoints)
    for i, ep in enumerate(endpoints):
        stat = ("-m", "statistic", "--mode", "random", "--probability", probability(n - i)) if i < n - 1 else ()
        out.add(chain, *comment(ep), *stat, "-j", sep_of(ep))


def render_fragments(
    ctx: RenderContext, state: ProxyState, names: set[ServicePortName] | None = None
) -> dict[ServicePortName, ServiceRules]:
    """Render `names` (default: every service port of `state`) that `state` still has."""
    wanted = state.services.keys() if names is None else (n for n in names if n in state.services)
    out: dict[ServicePortName, ServiceRules] = {}
    for name in wanted:
        rules = render_service(ctx, state.services[name], state.endpoints_of(name), state.topology)
        if rules is not None:
            out[name] = rules
    return out


def _fixed_rules(ctx: RenderContext) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The chains whose content does not depend on services: masquerade plumbing, forward, firewall."""
    mark = f"{ctx.masq_mark}/{ctx.masq_mark}"
    nat = {
        ch.KUBE_POSTROUTING: [
            _line(ch.KUBE_POSTROUTING, "-m", "mark", "!", "--mark", mark, "-j", "RETURN"),
            # Clear the mark so a packet re-traversing the stack is not masqueraded twice.
            _line(ch.KUBE_POSTROUTING, "-j", "MARK", "--xor-mark", ctx.masq_mark),
            _line(ch.KUBE_POSTROUTING, *_comment("kubernetes service traffic requiring SNAT"),
                  "-j", "MASQUERADE", "--random-fully"),
        ],
        ch.KUBE_MARK_MASQ: [_line(ch.KUBE_MARK_MASQ, "-j", "MARK", "--or-mark", ctx.masq_mark)],
    }
    forward = []
    if ctx.drop_invalid:
        # INVALID packets would otherwise reach the pod un-DNATed and reset the connection.
        forward.append(_line(ch.KUBE_FORWARD, "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"))
    forward += [
        _line(ch.KUBE_FORWARD, *_comment("kubernetes forwarding rules"), "-m", "mark", "--mark", mark, "-j", "ACCEPT"),
        _line(ch.KUBE_FORWARD, *_comment("kubernetes forwarding conntrack rule"), "-m", "conntrack",
              "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"),
    ]
    firewall = []
    if ctx.family == 4 and ctx.localhost_nodeports:
        # route_localnet=1 lets outsiders send to 127.0.0.0/8; only DNATed (NodePort) flows may pass.
        firewall.append(_line(ch.KUBE_FIREWALL, *_comment("block incoming localnet connections"),
                              "-d", LOOPBACK_NET, "!", "-s", LOOPBACK_NET, "-m", "conntrack",
                              "!", "--ctstate", "RELATED,ESTABLISHED,DNAT", "-j", "DROP"))
    filt = {ch.KUBE_FORWARD: forward, ch.KUBE_FIREWALL: firewall}
    return nat, filt


def _nodeports_jumps(ctx: RenderContext) -> list[str]:
    """KUBE-SERVICES' last rule(s): anything addressed to the node goes on to KUBE-NODEPORTS."""
    comment = _comment(_NODEPORTS_JUMP_COMMENT)
    if ctx.nodeport_match_all:
        dest = ("-m", "addrtype", "--dst-type", "LOCAL")
        # Block localhost NodePorts where they do not work: always on IPv6, on IPv4 unless enabled.
        if ctx.family == 6:
            dest += ("!", "-d", LOOPBACK_NET6)
        elif not ctx.localhost_nodeports:
            dest += ("!", "-d", LOOPBACK_NET)
        return [_line(ch.KUBE_SERVICES, *comment, *dest, "-j", ch.KUBE_NODEPORTS)]
    return [_line(ch.KUBE_SERVICES, *comment, "-d", ip, "-j", ch.KUBE_NODEPORTS) for ip in ctx.nodeport_ips]


def assemble(ctx: RenderContext, fragments: Mapping[ServicePortName, ServiceRules]) -> Ruleset:
    """Stitch per-service fragments (in service-name order) and the fixed chains into a Ruleset."""
    nat_fixed, filter_fixed = _fixed_rules(ctx)
    nat: dict[str, list[str]] = {c: [] for c in ch.TOP_LEVEL_CHAINS[ch.NAT]}
    filt: dict[str, list[str]] = {c: [] for c in ch.TOP_LEVEL_CHAINS[ch.FILTER]}
    nat.update(nat_fixed)
    filt.update(filter_fixed)
    own: dict[str, tuple[str, ...]] = {}
    for name in sorted(fragments):
        frag = fragments[name]
        nat[ch.KUBE_SERVICES].extend(frag.nat_services)
        nat[ch.KUBE_NODEPORTS].extend(frag.nat_nodeports)
        for chain, lines in frag.filter_rules.items():
            filt[chain].extend(lines)
        for chain, lines in frag.nat_chains.items():
            if chain in own:
                raise ValueError(f"chain {chain} rendered twice (second time for {name}): hash collision?")
            own[chain] = lines
    nat[ch.KUBE_SERVICES].extend(_nodeports_jumps(ctx))
    nat_tables: dict[str, tuple[str, ...]] = {c: tuple(lines) for c, lines in nat.items()}
    nat_tables.update(own)
    return Ruleset(tables={
        ch.FILTER: {c: tuple(lines) for c, lines in filt.items()},
        ch.NAT: nat_tables,
    })


def render(node: NodeConfig, state: ProxyState, *, drop_invalid: bool = True) -> Ruleset:
    """The whole ruleset for `state`, as a full sync writes it."""
    ctx = RenderContext.for_node(node, drop_invalid=drop_invalid, large_cluster=is_large_cluster(state))
    return assemble(ctx, render_fragments(ctx, state))
