"""The proxy's view of Kubernetes: service ports and their endpoints, as plain immutable values.

This is the contract between the control plane (which builds these from API objects) and every
datapath (which turns them into iptables rules or BPF map entries). It mirrors kube-proxy's
`ServicePort`/`Endpoint` interfaces, keeps only what a datapath needs, and stays free of the
`kubernetes` client and of bcc so the semantics can be unit-tested without root.
"""

from __future__ import annotations

import enum
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_AFFINITY_TIMEOUT_SECONDS = 10800  # kube's default for sessionAffinity=ClientIP


class Protocol(str, enum.Enum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    @property
    def lower(self) -> str:
        return self.value.lower()


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def is_dotted_quad(text: object) -> bool:
    """Whether `text` is an IPv4 address in its one canonical form, as inet_pton reads it: four
    decimal parts without leading zeros, nothing around it (what inet_ntoa and str(ipaddress)
    give back for its bytes). Cheap (~0.2 µs): k8s/convert.py's fast readings and ip_family ask
    it of every cluster IP and endpoint address."""
    try:
        socket.inet_pton(socket.AF_INET, text)  # type: ignore[arg-type]
        return True
    except (OSError, TypeError, ValueError):  # ValueError: a NUL or a lone surrogate in the text
        return False


def ip_family(ip: str) -> int:
    """The IP family (4 or 6) of address `ip`, as ipaddress.ip_address(ip).version, which raises
    ValueError for anything else. A canonical dotted quad (is_dotted_quad) is IPv4 without the
    parse (~1.3 µs; a full sync asks for every service port's clusterIP, ~3% of it at 100,000
    Services); anything else is parsed, and rejected, as before."""
    return 4 if is_dotted_quad(ip) else ipaddress.ip_address(ip).version


def of_family(ips: Iterable[str], family: int) -> tuple[str, ...]:
    """The addresses of `ips` in IP `family` (4 or 6), in order: what one family's proxier takes of
    a list of both (kube-proxy's MapIPsByIPFamily)."""
    return tuple(ip for ip in ips if ip_family(ip) == family)


def networks_of_family(cidrs: Iterable[str], family: int) -> list[IPNetwork]:
    """The CIDRs of `cidrs` in IP `family`, parsed (host bits allowed; kube-proxy's MapCIDRsByIPFamily)."""
    nets = (ipaddress.ip_network(c, strict=False) for c in cidrs)
    return [n for n in nets if n.version == family]


@dataclass(frozen=True, order=True, slots=True)
class ServicePortName:
    """Identifies one port of one service, like kube-proxy's `ServicePortName` (ns/name:port)."""

    namespace: str
    name: str
    port: str  # the service port's name ("" for an unnamed single port)
    protocol: Protocol

    def __str__(self) -> str:
        port = f":{self.port}" if self.port else ""
        return f"{self.namespace}/{self.name}{port}"

    @property
    def service(self) -> str:
        """namespace/name of the owning Service."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of a Service, with every field that changes how a packet is handled."""

    name: ServicePortName
    cluster_ip: str | None  # None for headless services (kube-proxy does not program those)
    port: int
    protocol: Protocol
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    load_balancer_source_ranges: tuple[str, ...] = ()
    external_policy_local: bool = False  # only True when externally accessible (as kube-proxy sets it)
    internal_policy_local: bool = False
    affinity_timeout_seconds: int = 0  # 0: no session affinity; else ClientIP with this timeout
    health_check_node_port: int = 0

    @property
    def externally_accessible(self) -> bool:
        return bool(self.node_port or self.external_ips or self.load_balancer_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        # Even with externalTrafficPolicy=Local, cluster endpoints are needed to short-circuit
        # traffic from pods and from the node itself (SEMANTICS rules 6 and 7).
        return not self.internal_policy_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or (self.external_policy_local and self.externally_accessible)

    @property
    def session_affinity(self) -> bool:
        return self.affinity_timeout_seconds > 0

    def lb_ips_admitted_as_source(self, node_ips: tuple[str, ...]) -> bool:
        """kube-proxy's "implicitly allowed" sources: when loadBalancerSourceRanges admit one of the
        node's addresses, the LB IPs are admitted as sources too, since a VIP bound on the node
        makes the node's own traffic to it leave with the VIP as source (pkg/proxy/iptables
        proxier.go, KUBE-FW; upstream TestLoadBalancer "same node to LB1, SNATted to LB1")."""
        nets = [ipaddress.ip_network(r.strip(), strict=False) for r in self.load_balancer_source_ranges]
        addrs = [ipaddress.ip_address(ip) for ip in node_ips]
        return any(a.version == n.version and a in n for n in nets for a in addrs)


@dataclass(frozen=True, order=True, slots=True)
class Endpoint:
    """One backend address:port of a service port, with EndpointSlice conditions already defaulted."""

    ip: str
    port: int
    node_name: str | None = None
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    is_local: bool = False  # node_name == this node; set by the control plane
    # EndpointSlice hints (hints.forZones[].name, hints.forNodes[].name): sorted tuples of interned
    # names, () when absent. Tuples, not frozensets: an empty tuple is one shared object (10,000
    # Services' endpoints cost no extra memory without hints) and tuples keep Endpoint orderable.
    zone_hints: tuple[str, ...] = ()
    node_hints: tuple[str, ...] = ()

    @property
    def addr(self) -> str:
        return f"{self.ip}:{self.port}"


class LocalMode(str, enum.Enum):
    """kube-proxy's --detect-local-mode: how traffic from this node's pods is told apart."""

    CLUSTER_CIDR = "ClusterCIDR"  # source inside --cluster-cidr
    NODE_CIDR = "NodeCIDR"  # source inside the Node's spec.podCIDRs
    BRIDGE_INTERFACE = "BridgeInterface"  # arrived through --pod-bridge-interface
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"  # arrived through a device named --pod-interface-name-prefix*


@dataclass(frozen=True)
class LocalDetector:
    """kube-proxy's LocalTrafficDetector: "does this packet come from a pod of this node?".

    kube-proxy asks it twice (pkg/proxy/iptables/proxier.go): traffic to a clusterIP that is
    *not* local is masqueraded, and local traffic to an externalTrafficPolicy=Local NodePort,
    externalIP or load-balancer IP is short-circuited to every endpoint. When the mode has
    nothing to match on (ClusterCIDR without --cluster-cidr, NodeCIDR on a Node without
    podCIDRs) kube-proxy uses a no-op detector, which is `mode=None`: neither rule exists then.

    `cidrs` are what the CIDR modes match sources against (IPv4 and IPv6 as given); `interface`
    is the bridge's name (BridgeInterface) or the name prefix (InterfaceNamePrefix).
    """

    mode: LocalMode | None = None
    cidrs: tuple[str, ...] = ()
    interface: str = ""

    def __post_init__(self) -> None:
        for cidr in self.cidrs:
            ipaddress.ip_network(cidr, strict=False)  # ValueError names the bad CIDR
        if self.mode in (LocalMode.BRIDGE_INTERFACE, LocalMode.INTERFACE_NAME_PREFIX) and not self.interface:
            raise ValueError(f"detect-local-mode {self.mode.value} needs an interface name")

    @property
    def implemented(self) -> bool:
        return self.mode is not None

    @property
    def by_cidr(self) -> bool:
        return self.mode in (LocalMode.CLUSTER_CIDR, LocalMode.NODE_CIDR)

    @property
    def by_interface(self) -> bool:
        return self.mode in (LocalMode.BRIDGE_INTERFACE, LocalMode.INTERFACE_NAME_PREFIX)

    def matches_l3_device(self, name: str) -> bool:
        """Whether a packet that enters the IP layer through device `name` is local (interface modes).
        A bridged pod's packets enter through the bridge, not through the pod's veth port."""
        if self.mode is LocalMode.BRIDGE_INTERFACE:
            return name == self.interface
        if self.mode is LocalMode.INTERFACE_NAME_PREFIX:
            return name.startswith(self.interface)
        return False

    def __str__(self) -> str:
        if self.mode is None:
            return "none (no-op)"
        return f"{self.mode.value} {','.join(self.cidrs) if self.by_cidr else self.interface}"

    @classmethod
    def cluster_cidr(cls, cidrs: tuple[str, ...]) -> "LocalDetector":
        """kube-proxy's default: ClusterCIDR with --cluster-cidr, a no-op detector without one."""
        return cls(LocalMode.CLUSTER_CIDR, tuple(cidrs)) if cidrs else cls()
@dataclass(frozen=True, slots=True)
class NodeTopology:
    """Where this node sits, as topology-aware routing needs it (kube-proxy: nodeName plus the Node's
    `topology.kubernetes.io/zone` label). Part of the desired state: when the zone changes, every
    service's endpoint choice may change, so the tracker asks for a full sync."""

    node_name: str = ""
    zone: str = ""  # "" when the Node has no zone label (then zone hints are never used)


@dataclass(frozen=True)
class ConntrackLimits:
    """kube-proxy's conntrack settings resolved for this node (agent/conntrack.py): what the
    eBPF datapath's connection table holds and for how long. Seconds; `max_connections` is
    kube-proxy's max(maxPerCore x CPUs, min)."""

    max_connections: int = 131072
    tcp_established: int = 86400
    tcp_close_wait: int = 3600
    udp: int = 30
    udp_stream: int = 120


@dataclass(frozen=True)
class NodeConfig:
    """What a datapath needs to know about the node it runs on (kube-proxy's flags and node state).

    One NodeConfig per IP family the node serves, as kube-proxy builds one proxier per family
    (metaproxier): `family` is the one its datapath programs (4 or 6). `node_ips` hold only that
    family's addresses; the CIDR fields keep every family as configured, and each datapath takes
    its own family's (kube-proxy's NewNodePortAddresses and local detectors filter the same way).
    """

    node_name: str
    family: int = 4
    node_ips: tuple[str, ...] = ()  # every LOCAL address usable for NodePorts (after --nodeport-addresses)
    cluster_cidrs: tuple[str, ...] = ()  # --cluster-cidr (the pod network; finds routed pod veths)
    nodeport_addresses: tuple[str, ...] = ()  # CIDRs; empty: all local addresses
    masquerade_all: bool = False
    masquerade_bit: int = 14  # mark 0x4000, as kube-proxy
    localhost_nodeports: bool = True
    # None: kube-proxy's default, ClusterCIDR over `cluster_cidrs` (no-op when there are none)
    local_detector: LocalDetector | None = None
    conntrack: ConntrackLimits = ConntrackLimits()

    def __post_init__(self) -> None:
        if self.family not in (4, 6):
            raise ValueError(f"node {self.node_name}: IP family {self.family!r} is not 4 or 6")
        for cidr in (*self.cluster_cidrs, *self.nodeport_addresses):
            ipaddress.ip_network(cidr, strict=False)  # ValueError names the bad CIDR

    def of_family(self, ips: Iterable[str]) -> tuple[str, ...]:
        """The addresses of `ips` in this config's family."""
        return of_family(ips, self.family)

    def networks(self, cidrs: Iterable[str]) -> list[IPNetwork]:
        """The CIDRs of `cidrs` in this config's family, parsed."""
        return networks_of_family(cidrs, self.family)

    @property
    def detector(self) -> LocalDetector:
        """The local-traffic detector in force (see LocalDetector)."""
        return self.local_detector if self.local_detector is not None else LocalDetector.cluster_cidr(self.cluster_cidrs)

    def in_cluster_cidr(self, ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        return any(addr in ipaddress.ip_network(c, strict=False) for c in self.cluster_cidrs)


@dataclass(frozen=True)
class ProxyState:
    """A whole desired state: every programmable service port and its endpoints."""

    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    # a tuple, or (from the change tracker) a model.endpoints.EndpointList: a packed Sequence of
    # Endpoint equal to the tuple; readers iterate it
    endpoints: dict[ServicePortName, Sequence[Endpoint]] = field(default_factory=dict)
    topology: NodeTopology = NodeTopology()

    def endpoints_of(self, name: ServicePortName) -> Sequence[Endpoint]:
        return self.endpoints.get(name, ())


@dataclass(frozen=True)
class ChangeSet:
    """What changed since the previous sync, as kube-proxy's change trackers report it.

    `full` asks the datapath to reconcile everything (first sync, periodic resync, after an error);
    otherwise `services` lists the service ports whose service or endpoints changed (added,
    updated or deleted: a name absent from the new ProxyState was deleted).
    `stale_udp_endpoints` are (service port, endpoint IP) pairs whose conntrack entries must go
    because the endpoint went away; `stale_udp_services` are UDP service ports that went from no
    endpoints to some, whose old (black-holed) conntrack entries must go too.
    """

    full: bool = True
    services: frozenset[ServicePortName] = frozenset()
    stale_udp_endpoints: frozenset[tuple[ServicePortName, str]] = frozenset()
    stale_udp_services: frozenset[ServicePortName] = frozenset()
