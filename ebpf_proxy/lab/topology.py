"""The lab's topology file: which nodes, pods and outside clients the lab builds.

A topology is a YAML mapping; only these keys are accepted (a misspelt key is an error,
not a silently ignored setting)::

    serviceCIDR: 10.96.0.0/12       # optional, default 10.96.0.0/12: ClusterIPs come from here
    clusterCIDR: 10.244.0.0/16      # optional, default 10.244.0.0/16: every podCIDR lies inside
    apiServerIP: 192.0.2.1          # optional, default 192.0.2.1: the embedded API server's
                                    #   address on the underlay, reachable from every node
    nodes:                          # required, at least one
      - name: worker1               # required, DNS label; unique
        ip: 172.20.20.15            # required, the node's InternalIP; unique in the whole file
        extraIPs: [192.168.99.11]   # optional, more addresses on the node's uplink
        podCIDR: 10.244.5.0/24      # optional, default: the (index+1)-th free /24 of clusterCIDR
        podBridge: cbr0             # optional: pods hang off a Linux bridge of this name (kubenet-
                                    #   style) instead of one routed veth each (Calico-style)
        zone: zone-a                # optional: the Node's topology.kubernetes.io/zone label
                                    #   (a label value), for topology-aware routing
    pods:                           # optional
      - name: web-1                 # required, DNS-1123 name up to 63 characters; unique
        node: worker1               # required, a node above
        namespace: default          # optional, default "default"
        ip: 10.244.5.4              # optional: allocated from the node's podCIDR (skipping the
                                    #   .0 network and .1 gateway addresses and taken ones);
                                    #   a fixed IP may lie outside the podCIDR
        labels: {app: web}          # optional, string values
        listen: [80/tcp, 53/udp]    # optional, default [80/tcp]: what the pod's server serves;
                                    #   PORT/sctp too (python server only; served where the
                                    #   kernel has SCTP sockets, else logged and skipped)
        server: native              # optional, default python: the echo server that answers;
                                    #   native is echod.c, one thread per CPU (the bench's
                                    #   backends, so the server is not what a rate measures)
    clients:                        # optional: machines outside the cluster
      - name: outside               # required, DNS label; unique
        ip: 203.0.113.5             # required
        gateway: worker1            # optional, default the first node: the client's default
                                    #   route, so traffic to externalIPs/LoadBalancer IPs
                                    #   reaches a node
    kubeProxyConfiguration: {...}   # optional: a KubeProxyConfiguration handed to every agent
    serviceNodePortRange: 30000-32767  # optional (default shown): kube-apiserver's
                                    #   --service-node-port-range, "FIRST-LAST"
    agentArgs: [--audit-repair=false]  # optional: more `ebpf-proxy run` options for every agent
                                    #   (ebpf-proxy's own, e.g. --audit-period 10s, --log-level debug)

Dual-stack, the kube-apiserver/kubelet convention: every address or CIDR key (serviceCIDR,
clusterCIDR, apiServerIP, a node's ip and podCIDR, a pod's or client's ip) takes one value or a
comma-separated pair of different families, in either order (``ip: "172.20.20.15,fd00:20::15"``).
clusterCIDR's families are the cluster's (the first written is its primary family) and
serviceCIDR must have the same ones; one family only (IPv4 or IPv6) is a single-stack cluster.
Every node then needs an address and a podCIDR of each family (defaults: the next free /24 or /64),
every pod gets one address of each (allocated where not given); clients and apiServerIP may
have any of the cluster's families. The first value of a pair is the object's primary one (the
``ip``/``pod_cidr``/``service_cidr`` attribute; ``ips``/``pod_cidrs``/``service_cidrs`` hold all).

Nodes, pods and clients need not share a subnet: the lab routes every address explicitly
(see ``ebpf_proxy.lab.netns``). Addresses must be unique across the file, usable unicast
(no loopback, link-local, multicast or reserved), and outside serviceCIDR; node, client
and API server addresses must also be outside clusterCIDR, which belongs to pods. A fixed pod
IP may not lie in another node's podCIDR.

Parsing yields frozen dataclasses; every error is a :class:`TopologyError` naming the field at
fault, e.g. ``nodes[1].ip: '172.20.20.300' is not an IPv4 address``.
"""

from __future__ import annotations

import copy
import difflib
import importlib.resources
import ipaddress
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import yaml

IPv4Address = ipaddress.IPv4Address
IPv4Network = ipaddress.IPv4Network

DEFAULT_SERVICE_CIDR = "10.96.0.0/12"
DEFAULT_NODE_PORT_RANGE = "30000-32767"  # kube-apiserver's --service-node-port-range default
DEFAULT_CLUSTER_CIDR = "10.244.0.0/16"
DEFAULT_API_SERVER_IP = "192.0.2.1"
# The IPv6 defaults, for a family only the other key names (kind's dual-stack shapes).
DEFAULTS_BY_VERSION = {
    "serviceCIDR": {4: DEFAULT_SERVICE_CIDR, 6: "fd00:10:96::/112"},
    "clusterCIDR": {4: DEFAULT_CLUSTER_CIDR, 6: "fd00:10:244::/56"},
    "apiServerIP": {4: DEFAULT_API_SERVER_IP, 6: "fd00:192:0:2::1"},
}
DEFAULT_POD_CIDR_PREFIXES = {4: 24, 6: 64}
DEFAULT_NAMESPACE = "default"
DEFAULT_LISTEN = ("80/tcp",)
DEFAULT_POD_CIDR_PREFIX = 24
PROTOCOLS = ("tcp", "udp", "sctp")

_TOP_KEYS = ("serviceCIDR", "serviceNodePortRange", "clusterCIDR", "apiServerIP", "nodes", "pods", "clients",
             "kubeProxyConfiguration", "agentArgs")
_NODE_KEYS = ("name", "ip", "extraIPs", "podCIDR", "podBridge", "zone")
_IFNAME = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,14}$")  # a Linux interface name (IFNAMSIZ 16)
_POD_KEYS = ("name", "node", "namespace", "ip", "labels", "listen", "server")
SERVERS = ("python", "native")  # the pod's echo server: lab/echo.py, or lab/echod.c
_CLIENT_KEYS = ("name", "ip", "gateway")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LISTEN = re.compile(r"^(\d+)/([A-Za-z]+)$")


class TopologyError(ValueError):
    """An invalid topology; ``field`` is the path of the offending value (``nodes[1].ip``)."""

    def __init__(self, field: str, problem: str, source: str | None = None):
        self.field = field
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: {problem}" if field else f"{where}{problem}")


# Addresses and CIDRs are kept as canonical strings ("10.244.1.0/24"): they go straight into
# JSON, argv and API objects; code that computes with them wraps them in ipaddress itself.


@dataclass(frozen=True)
class NodeSpec:
    name: str
    ip: str
    extra_ips: tuple[str, ...] = ()
    pod_cidr: str = ""
    pod_bridge: str = ""  # "": every pod on its own routed veth; else the bridge pods are ports of
    zone: str = ""  # label topology.kubernetes.io/zone; "" = the Node has no zone label
    ips: tuple[str, ...] = ()  # InternalIPs, one per family, primary (== ip) first
    pod_cidrs: tuple[str, ...] = ()  # spec.podCIDRs, one per family, primary (== pod_cidr) first

    def __post_init__(self) -> None:
        if not self.ips:
            object.__setattr__(self, "ips", (self.ip,))
        if not self.pod_cidrs and self.pod_cidr:
            object.__setattr__(self, "pod_cidrs", (self.pod_cidr,))

    @property
    def all_ips(self) -> tuple[str, ...]:
        return (*self.ips, *self.extra_ips)


@dataclass(frozen=True)
class PodSpec:
    """A pod. ``ip`` is None only in a spec not yet added to a Topology (then allocated)."""

    name: str
    node: str
    ip: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    listen: tuple[str, ...] = DEFAULT_LISTEN  # canonical "PORT/tcp" / "PORT/udp"
    ips: tuple[str, ...] = ()  # status.podIPs: one per cluster family, in the cluster's order
    server: str = "python"  # one of SERVERS

    def __post_init__(self) -> None:
        # `ip` decides: None (allocate every family) drops `ips`, and an `ip` that `ips` does not
        # hold replaces them, so dataclasses.replace(pod, ip=...) never keeps stale addresses
        if self.ip is None:
            object.__setattr__(self, "ips", ())
        elif self.ip not in self.ips:
            object.__setattr__(self, "ips", (self.ip,))


@dataclass(frozen=True)
class ClientSpec:
    name: str
    ip: str
    gateway: str  # node name
    ips: tuple[str, ...] = ()  # one per family, primary (== ip) first

    def __post_init__(self) -> None:
        if not self.ips:
            object.__setattr__(self, "ips", (self.ip,))


@dataclass(frozen=True)
class Topology:
    service_cidr: str
    cluster_cidr: str
    api_server_ip: str
    nodes: tuple[NodeSpec, ...]
    pods: tuple[PodSpec, ...] = ()
    clients: tuple[ClientSpec, ...] = ()
    kube_proxy_configuration: Mapping[str, Any] | None = field(default=None, hash=False)
    service_node_port_range: str = DEFAULT_NODE_PORT_RANGE  # "FIRST-LAST"
    agent_args: tuple[str, ...] = ()  # more `ebpf-proxy run` options for every agent
    service_cidrs: tuple[str, ...] = ()  # all families, primary (== service_cidr) first
    cluster_cidrs: tuple[str, ...] = ()  # all families, primary (== cluster_cidr) first
    api_server_ips: tuple[str, ...] = ()  # the API server's underlay addresses, primary first

    def __post_init__(self) -> None:
        for many, one in (("service_cidrs", self.service_cidr), ("cluster_cidrs", self.cluster_cidr),
                          ("api_server_ips", self.api_server_ip)):
            if not getattr(self, many):
                object.__setattr__(self, many, (one,))

    @property
    def families(self) -> tuple[str, ...]:
        """The cluster's IP families, primary first: ("IPv4",), ("IPv6",) or both."""
        return tuple(f"IPv{ipaddress.ip_network(c).version}" for c in self.cluster_cidrs)

    @property
    def dual_stack(self) -> bool:
        return len(self.cluster_cidrs) == 2

    @property
    def has_ipv6(self) -> bool:
        return "IPv6" in self.families

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"node {name!r} is not in the topology")

    def pod(self, name: str) -> PodSpec:
        for pod in self.pods:
            if pod.name == name:
                return pod
        raise KeyError(f"pod {name!r} is not in the topology")

    def client(self, name: str) -> ClientSpec:
        for client in self.clients:
            if client.name == name:
                return client
        raise KeyError(f"client {name!r} is not in the topology")

    def pods_on(self, node: str) -> tuple[PodSpec, ...]:
        return tuple(p for p in self.pods if p.node == node)

    def pod_prefixes(self, node: str) -> tuple[str, ...]:
        """Destinations the rest of the lab routes via ``node``: its podCIDR, plus a /32 for
        each of its pods whose fixed IP lies outside that podCIDR."""
        cidrs = [ipaddress.ip_network(c) for c in self.node(node).pod_cidrs]
        extra = []
        for pod in self.pods_on(node):
            for ip in pod.ips:
                addr = ipaddress.ip_address(ip)
                if not any(addr in c for c in cidrs if c.version == addr.version):
                    extra.append(f"{ip}/{addr.max_prefixlen}")
        return (*(str(c) for c in cidrs), *extra)

    def with_pod(self, pod: PodSpec) -> "Topology":
        """A copy with ``pod`` added, validated like a file; ``pod.ip`` None allocates one."""
        data = self.to_dict()
        entry: dict[str, Any] = {
            "name": pod.name, "node": pod.node, "namespace": pod.namespace,
            "labels": dict(pod.labels), "listen": [str(x) for x in pod.listen],
            **({"server": pod.server} if pod.server != "python" else {}),
        }
        if pod.ips:
            entry["ip"] = ",".join(pod.ips)
        data["pods"].append(entry)
        return parse_topology(data)

    def without_pod(self, name: str) -> "Topology":
        """A copy without pod ``name``; KeyError if there is no such pod."""
        self.pod(name)
        data = self.to_dict()
        data["pods"] = [p for p in data["pods"] if p["name"] != name]
        return parse_topology(data)

    def to_dict(self) -> dict[str, Any]:
        """The topology as a file would write it, allocated IPs and podCIDRs included, so
        that ``parse_topology(t.to_dict()) == t`` (and JSON can hold it)."""
        data: dict[str, Any] = {
            "serviceCIDR": ",".join(self.service_cidrs),
            "clusterCIDR": ",".join(self.cluster_cidrs),
            "apiServerIP": ",".join(self.api_server_ips),
            "nodes": [
                {"name": n.name, "ip": ",".join(n.ips), "extraIPs": list(n.extra_ips),
                 "podCIDR": ",".join(n.pod_cidrs), **({"podBridge": n.pod_bridge} if n.pod_bridge else {}),
                 **({"zone": n.zone} if n.zone else {})}
                for n in self.nodes
            ],
            "pods": [
                {"name": p.name, "node": p.node, "namespace": p.namespace, "ip": ",".join(p.ips),
                 "labels": dict(p.labels), "listen": list(p.listen),
                 **({"server": p.server} if p.server != "python" else {})}
                for p in self.pods
            ],
            "clients": [
                {"name": c.name, "ip": ",".join(c.ips), "gateway": c.gateway} for c in self.clients
            ],
        }
        if self.kube_proxy_configuration is not None:
            data["kubeProxyConfiguration"] = copy.deepcopy(dict(self.kube_proxy_configuration))
        data["serviceNodePortRange"] = self.service_node_port_range
        if self.agent_args:
            data["agentArgs"] = list(self.agent_args)
        return data


def with_pod(topology: Topology, pod: PodSpec) -> Topology:
    """``topology`` plus ``pod`` (its IP allocated if None); see :meth:`Topology.with_pod`."""
    return topology.with_pod(pod)


def without_pod(topology: Topology, name: str) -> Topology:
    return topology.without_pod(name)


def topology_to_dict(topology: Topology) -> dict[str, Any]:
    return topology.to_dict()


def topology_from_dict(data: Any, source: str | None = None) -> Topology:
    return parse_topology(data, source)


def parse_listen(entry: str) -> tuple[int, str]:
    """``"53/udp"`` -> ``(53, "udp")``; TopologyError if malformed."""
    return _listen_entry(entry, "listen")


def node_port_range(value: Any, where: str = "serviceNodePortRange") -> tuple[int, int]:
    """``"30000-32767"`` -> ``(30000, 32767)``: kube-apiserver's --service-node-port-range, which
    the lab hands to its API server (node ports such as 3001 need a range that holds them)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    match = re.fullmatch(r"(\d+)-(\d+)", text or "")
    if not match:
        raise TopologyError(where, f"{value!r} is not FIRST-LAST (e.g. \"30000-32767\")")
    first, last = int(match.group(1)), int(match.group(2))
    if not 1 <= first <= last <= 65535:
        raise TopologyError(where, f"{value!r}: need 1 <= FIRST <= LAST <= 65535")
    return first, last


def allocate_pod_ip(topology: Topology, node: str) -> str:
    """The first free address of ``node``'s podCIDR (never .0, .1 or the broadcast address)."""
    spec = topology.node(node)
    found = _first_free(ipaddress.ip_network(spec.pod_cidr), _taken_ips(topology))
    if found is None:
        raise TopologyError(f"nodes[{topology.nodes.index(spec)}].podCIDR",
                            f"{spec.pod_cidr} of node {node!r} has no free address left")
    return str(found)


def load_topology(path: str | os.PathLike[str] | None = None) -> Topology:
    """Read and validate a topology file; ``None`` means the packaged default topology."""
    if path is None:
        resource = importlib.resources.files("ebpf_proxy.lab") / "default_topology.yaml"
        return topology_from_yaml(resource.read_text(), source="default topology")
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TopologyError("", f"cannot read topology file: {e.strerror}", source) from e
    return topology_from_yaml(text, source=source)


def topology_from_yaml(text: str, source: str | None = None) -> Topology:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise TopologyError("", f"not valid YAML: {where}{problem}", source) from e
    return parse_topology(data, source=source)


def parse_topology(data: Any, source: str | None = None) -> Topology:
    """Validate a topology given as plain data (the parsed YAML) and build the dataclasses."""
    try:
        return _Parser(data).parse()
    except TopologyError as e:
        if source is None:
            raise
        raise TopologyError(e.field, e.problem, source) from None


# --- parsing --------------------------------------------------------------------------------


def _taken_ips(topology: Topology) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    taken = [*topology.api_server_ips, *(ip for c in topology.clients for ip in c.ips)]
    for n in topology.nodes:
        taken.extend(n.all_ips)
    taken.extend(ip for p in topology.pods for ip in p.ips)
    return {ipaddress.ip_address(x) for x in taken}


def _first_free(cidr, taken: set) -> Any:
    """The first free address of ``cidr`` (either family), skipping the network (.0) and gateway
    (.1) addresses and, for IPv4, the broadcast address; None when full. Looks at no more than
    ``len(taken) + 1`` candidates, so a /64 costs no more than a /24."""
    first = int(cidr.network_address) + 2
    last = int(cidr.broadcast_address) - (1 if cidr.version == 4 else 0)
    make = IPv4Address if cidr.version == 4 else ipaddress.IPv6Address
    for value in range(first, min(last, first + len(taken)) + 1):
        candidate = make(value)
        if candidate not in taken:
            return candidate
    return None


def _check_keys(obj: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in allowed:
            lowered = {k.lower(): k for k in allowed}
            close = difflib.get_close_matches(str(key).lower(), list(lowered), n=1)
            hint = [lowered[close[0]]] if close else []
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            prefix = f"{where}." if where else ""
            raise TopologyError(
                f"{prefix}{key}",
                f"unknown key{suggestion}; allowed keys: {', '.join(allowed)}",
            )


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TopologyError(where, f"expected a mapping, got {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise TopologyError(where, f"expected a list, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"


def _required(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj or obj[key] is None:
        raise TopologyError(f"{where}.{key}", "is required")
    return obj[key]


def _name(value: Any, where: str, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str):
        raise TopologyError(where, f"{_kind(value)} is not a string")
    if len(value) > 63 or not pattern.match(value):
        raise TopologyError(where, f"{value!r} is not a valid {what}")
    return value


def _family_word(value: Any) -> str:
    """Which family a malformed value was probably meant to be, for the message."""
    return "IPv6" if isinstance(value, str) and ":" in value else "IPv4"


def _ip(value: Any, where: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        ip = ipaddress.ip_address(value) if isinstance(value, str) else None
    except ValueError:
        ip = None
    if ip is None:
        raise TopologyError(where, f"{value!r} is not an {_family_word(value)} address")
    for bad, what in (
        (ip.is_unspecified, "unspecified"),
        (ip.is_loopback, "loopback"),
        (ip.is_link_local, "link-local (the lab uses 169.254.0.0/16 and fe80::/64 for pod gateways)"),
        (ip.is_multicast, "multicast"),
        (ip.is_reserved, "reserved"),
    ):
        if bad:
            raise TopologyError(where, f"{value!r} is a {what} address, not a usable host address")
    return ip


def _cidr(value: Any, where: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    example = "fd00:10:244::/56" if _family_word(value) == "IPv6" else "10.244.0.0/16"
    if not isinstance(value, str):
        raise TopologyError(where, f"{value!r} is not an IPv4 CIDR like 10.244.0.0/16")
    try:
        return ipaddress.ip_network(value)
    except ValueError as e:
        try:
            loose = ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise TopologyError(where, f"{value!r} is not an {_family_word(value)} CIDR like {example}") from e
        raise TopologyError(where, f"{value!r} has host bits set (did you mean {loose}?)") from e


def _pair(value: Any, where: str, one) -> list[Any]:
    """One value, or a comma-separated pair of different families in either order
    (``"10.244.0.0/16,fd00:10:244::/56"``), each parsed by ``one(text, where)``."""
    if not (isinstance(value, str) and "," in value):
        return [one(value, where)]
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2:
        raise TopologyError(where, f"{value!r}: give one value or a comma-separated pair (one IPv4, one IPv6)")
    items = [one(p, where) for p in parts]
    if items[0].version == items[1].version:
        raise TopologyError(where, f"{value!r} has two IPv{items[0].version} values; "
                                   "a pair is one IPv4 and one IPv6 value")
    return items


def _listen_entry(value: Any, where: str) -> tuple[int, str]:
    match = _LISTEN.match(value) if isinstance(value, str) else None
    if not match:
        raise TopologyError(where, f"{value!r} is not PORT/tcp, PORT/udp or PORT/sctp")
    port, proto = int(match.group(1)), match.group(2).lower()
    if not 1 <= port <= 65535:
        raise TopologyError(where, f"{value!r}: port {port} is outside 1-65535")
    if proto not in PROTOCOLS:
        raise TopologyError(where, f"{value!r}: protocol {proto!r} is not tcp, udp or sctp")
    return port, proto


def _labels(value: Any, where: str) -> Mapping[str, str]:
    labels = _mapping(value, where)
    out: dict[str, str] = {}
    for key, val in labels.items():
        if not isinstance(key, str) or not _label_key_ok(key):
            raise TopologyError(f"{where}", f"{key!r} is not a valid label key")
        if not isinstance(val, str):
            raise TopologyError(f"{where}.{key}",
                                f"{val!r} is not a string (quote it in YAML: '{val}')")
        if val and (len(val) > 63 or not _LABEL_NAME.match(val)):
            raise TopologyError(f"{where}.{key}", f"{val!r} is not a valid label value")
        out[key] = val
    return MappingProxyType(out)


def _zone(value: Any, where: str) -> str:
    """A node's zone: it becomes a label value, so it must be one (and not empty: leave it out)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TopologyError(where, f"{value!r} is not a string (quote it in YAML: '{value}')")
    if not value or len(value) > 63 or not _LABEL_NAME.match(value):
        raise TopologyError(where, f"{value!r} is not a valid zone name (a label value: up to 63 letters, "
                                   "digits, '-', '_' or '.', starting and ending with a letter or digit)")
    return value


def _label_key_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.match(name))


class _Parser:
    """One validation pass; keeps the owner of every address for collision messages.

    ``service`` and ``cluster`` map an IP version (4, 6) to that family's CIDR; ``versions``
    is the cluster's families in clusterCIDR's order (the first is the primary)."""

    def __init__(self, data: Any):
        self.data = data
        self.owners: dict[Any, str] = {}

    def claim(self, ip, where: str) -> None:
        if ip in self.owners:
            raise TopologyError(where, f"{ip} is already used by {self.owners[ip]}")
        self.owners[ip] = where

    def ranges(self, top: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """serviceCIDR and clusterCIDR; a key left out takes the defaults of the other's families."""
        raw = {key: top.get(key) for key in ("serviceCIDR", "clusterCIDR")}
        given = {key: _pair(v, key, _cidr) for key, v in raw.items() if v is not None}
        versions = [n.version for n in next(iter(given.values()), [])] or [4]
        for key in raw:
            if key not in given:
                given[key] = [ipaddress.ip_network(DEFAULTS_BY_VERSION[key][v]) for v in versions]
        service, cluster = given["serviceCIDR"], given["clusterCIDR"]
        if sorted(n.version for n in service) != sorted(n.version for n in cluster):
            raise TopologyError("serviceCIDR", f"{','.join(map(str, service))} and clusterCIDR "
                                               f"{','.join(map(str, cluster))} must have the same IP families")
        return service, cluster

    def family_check(self, ip, where: str) -> None:
        if ip.version not in self.versions:
            raise TopologyError(where, f"{ip} is an IPv{ip.version} address, but the cluster has no IPv{ip.version} "
                                       f"(clusterCIDR {self.cluster_text})")

    def parse(self) -> Topology:
        top = _mapping(self.data, "topology")
        _check_keys(top, _TOP_KEYS, "")
        service, cluster = self.ranges(top)
        for s_net in service:
            for c_net in cluster:
                if s_net.version == c_net.version and s_net.overlaps(c_net):
                    raise TopologyError("serviceCIDR", f"{s_net} overlaps clusterCIDR {c_net}")
        self.service = {n.version: n for n in service}
        self.cluster = {n.version: n for n in cluster}
        self.versions = tuple(n.version for n in cluster)
        self.cluster_text = ",".join(map(str, cluster))
        api_raw = top.get("apiServerIP")
        if api_raw is None:
            api_ips = [ipaddress.ip_address(DEFAULTS_BY_VERSION["apiServerIP"][v]) for v in self.versions]
        else:
            api_ips = _pair(api_raw, "apiServerIP", self.host_ip)
        for ip in api_ips:
            self.claim(ip, "apiServerIP")

        nodes = self.parse_nodes(top.get("nodes"))
        clients = self.parse_clients(top.get("clients", []), nodes)
        pods = self.parse_pods(top.get("pods", []), nodes)

        kpc = top.get("kubeProxyConfiguration")
        if kpc is not None:
            kpc = _mapping(kpc, "kubeProxyConfiguration")
            kind = kpc.get("kind", "KubeProxyConfiguration")
            if kind != "KubeProxyConfiguration":
                raise TopologyError("kubeProxyConfiguration.kind",
                                    f"{kind!r} is not KubeProxyConfiguration")
            kpc = MappingProxyType(copy.deepcopy(dict(kpc)))
        node_ports = node_port_range(top.get("serviceNodePortRange", DEFAULT_NODE_PORT_RANGE))
        agent_args = tuple(_list(top.get("agentArgs", []), "agentArgs"))
        for i, arg in enumerate(agent_args):
            if not isinstance(arg, str) or not arg:
                raise TopologyError(f"agentArgs[{i}]", f"{arg!r} is not a command-line word (a non-empty string)")
        return Topology(str(service[0]), str(cluster[0]), str(api_ips[0]), nodes, pods, clients, kpc,
                        f"{node_ports[0]}-{node_ports[1]}", agent_args,
                        service_cidrs=tuple(map(str, service)), cluster_cidrs=tuple(map(str, cluster)),
                        api_server_ips=tuple(map(str, api_ips)))

    def host_ip(self, value: Any, where: str):
        """An address of the underlay (node, client, API server): outside the cluster ranges."""
        ip = _ip(value, where)
        self.family_check(ip, where)
        if ip in self.service[ip.version]:
            raise TopologyError(where, f"{ip} lies inside serviceCIDR {self.service[ip.version]}")
        if ip in self.cluster[ip.version]:
            raise TopologyError(where, f"{ip} lies inside clusterCIDR {self.cluster[ip.version]}, "
                                       "which is reserved for pods")
        return ip

    def parse_nodes(self, raw: Any) -> tuple[NodeSpec, ...]:
        if raw is None:
            raise TopologyError("nodes", "is required: a list of at least one node")
        items = _list(raw, "nodes")
        if not items:
            raise TopologyError("nodes", "must list at least one node")
        names: dict[str, int] = {}
        partial = []
        for i, item in enumerate(items):
            where = f"nodes[{i}]"
            obj = _mapping(item, where)
            _check_keys(obj, _NODE_KEYS, where)
            name = _name(_required(obj, "name", where), f"{where}.name", _DNS_LABEL, "node name")
            if name in names:
                raise TopologyError(f"{where}.name",
                                    f"{name!r} duplicates nodes[{names[name]}].name")
            names[name] = i
            raw_ip = _required(obj, "ip", where)
            ips = _pair(raw_ip, f"{where}.ip", self.host_ip)
            missing = [v for v in self.versions if v not in {ip.version for ip in ips}]
            if missing:
                raise TopologyError(f"{where}.ip", f"{raw_ip!r} has no IPv{missing[0]} address, but the cluster "
                                                   f"has IPv{missing[0]} (clusterCIDR {self.cluster_text}): give a "
                                                   "pair like \"172.20.20.15,fd00:20::15\"")
            for ip in ips:
                self.claim(ip, f"{where}.ip")
            extra = []
            for j, x in enumerate(_list(obj.get("extraIPs", []) or [], f"{where}.extraIPs")):
                eip = self.host_ip(x, f"{where}.extraIPs[{j}]")
                self.claim(eip, f"{where}.extraIPs[{j}]")
                extra.append(eip)
            cidrs: dict[int, Any] = {}
            if obj.get("podCIDR") is not None:
                for cidr in _pair(obj["podCIDR"], f"{where}.podCIDR", _cidr):
                    own = self.cluster.get(cidr.version)
                    if own is None or not cidr.subnet_of(own):
                        raise TopologyError(f"{where}.podCIDR",
                                            f"{cidr} is not inside clusterCIDR {own or self.cluster_text}")
                    cidrs[cidr.version] = cidr
            bridge = ""
            if obj.get("podBridge") is not None:
                bridge = obj["podBridge"]
                if not isinstance(bridge, str) or not _IFNAME.match(bridge) or bridge in ("eth0", "lo"):
                    raise TopologyError(f"{where}.podBridge",
                                        f"{bridge!r} is not a free interface name (up to 15 letters, digits, "
                                        "'-', '_', '.'; not eth0 or lo)")
            zone = _zone(obj.get("zone"), f"{where}.zone")
            partial.append((name, ips, tuple(extra), cidrs, bridge, zone))
        by_version = {v: self.assign_pod_cidrs([p[3].get(v) for p in partial], v) for v in self.versions}
        out = []
        for i, (name, ips, extra, _, bridge, zone) in enumerate(partial):
            # the podCIDRs in the node's own order of families (its primary IP's family first)
            order = [ip.version for ip in ips] + [v for v in self.versions if v not in [ip.version for ip in ips]]
            pod_cidrs = tuple(str(by_version[v][i]) for v in order if v in by_version)
            out.append(NodeSpec(name, str(ips[0]), tuple(str(x) for x in extra), pod_cidrs[0], bridge, zone,
                                ips=tuple(map(str, ips)), pod_cidrs=pod_cidrs))
        return tuple(out)

    def assign_pod_cidrs(self, given: list[Any], version: int) -> list[Any]:
        for i, a in enumerate(given):
            for j in range(i):
                b = given[j]
                if a is not None and b is not None and a.overlaps(b):
                    raise TopologyError(f"nodes[{i}].podCIDR",
                                        f"{a} overlaps nodes[{j}].podCIDR {b}")
        out: list[Any] = []
        used = [c for c in given if c is not None]
        for i, cidr in enumerate(given):
            if cidr is None:
                cidr = self.default_pod_cidr(i, used, version)
                used.append(cidr)
            out.append(cidr)
        return out

    def default_pod_cidr(self, index: int, used: list[Any], version: int) -> Any:
        where = f"nodes[{index}].podCIDR"
        cluster = self.cluster[version]
        prefix = DEFAULT_POD_CIDR_PREFIXES[version]
        if cluster.prefixlen > prefix:
            raise TopologyError(where, f"cannot pick a default: clusterCIDR {cluster} is "
                                       f"smaller than a /{prefix}; set podCIDR")
        count = 1 << (prefix - cluster.prefixlen)
        size = 1 << (cluster.max_prefixlen - prefix)
        base = int(cluster.network_address)
        make = IPv4Network if version == 4 else ipaddress.IPv6Network
        for k in range(index + 1, min(count, 1 << 16)):  # a /48's 65536 /64s at most: enough for a lab
            candidate = make((base + k * size, prefix))
            if not any(candidate.overlaps(u) for u in used):
                return candidate
        raise TopologyError(where, f"cannot pick a default: no free /{prefix} "
                                   f"left in clusterCIDR {cluster}; set podCIDR")

    def parse_clients(self, raw: Any, nodes: tuple[NodeSpec, ...]) -> tuple[ClientSpec, ...]:
        items = _list(raw if raw is not None else [], "clients")
        node_names = [n.name for n in nodes]
        names: dict[str, int] = {}
        out = []
        for i, item in enumerate(items):
            where = f"clients[{i}]"
            obj = _mapping(item, where)
            _check_keys(obj, _CLIENT_KEYS, where)
            name = _name(_required(obj, "name", where), f"{where}.name", _DNS_LABEL,
                         "client name")
            if name in names:
                raise TopologyError(f"{where}.name",
                                    f"{name!r} duplicates clients[{names[name]}].name")
            names[name] = i
            ips = _pair(_required(obj, "ip", where), f"{where}.ip", self.host_ip)
            for ip in ips:
                self.claim(ip, f"{where}.ip")
            gateway = obj.get("gateway", node_names[0])
            if gateway not in node_names:
                raise TopologyError(f"{where}.gateway", f"{gateway!r} is not a node "
                                                        f"(nodes: {', '.join(node_names)})")
            out.append(ClientSpec(name, str(ips[0]), gateway, ips=tuple(map(str, ips))))
        return tuple(out)

    def parse_pods(self, raw: Any, nodes: tuple[NodeSpec, ...]) -> tuple[PodSpec, ...]:
        items = _list(raw if raw is not None else [], "pods")
        by_name = {n.name: n for n in nodes}
        names: dict[str, int] = {}
        partial = []
        for i, item in enumerate(items):
            where = f"pods[{i}]"
            obj = _mapping(item, where)
            _check_keys(obj, _POD_KEYS, where)
            name = _name(_required(obj, "name", where), f"{where}.name", _DNS_SUBDOMAIN,
                         "pod name (lowercase DNS-1123, at most 63 characters)")
            if name in names:
                raise TopologyError(f"{where}.name",
                                    f"{name!r} duplicates pods[{names[name]}].name")
            names[name] = i
            node_name = _required(obj, "node", where)
            if node_name not in by_name:
                raise TopologyError(f"{where}.node", f"{node_name!r} is not a node "
                                                     f"(nodes: {', '.join(by_name)})")
            namespace = _name(obj.get("namespace", DEFAULT_NAMESPACE), f"{where}.namespace",
                              _DNS_LABEL, "namespace")
            labels = _labels(obj.get("labels") or {}, f"{where}.labels")
            listen_raw = obj.get("listen", list(DEFAULT_LISTEN))
            listen: list[str] = []
            for j, entry in enumerate(_list(listen_raw, f"{where}.listen")):
                port, proto = _listen_entry(entry, f"{where}.listen[{j}]")
                canonical = f"{port}/{proto}"
                if canonical in listen:
                    raise TopologyError(f"{where}.listen[{j}]", f"{canonical} is listed twice")
                listen.append(canonical)
            server = obj.get("server", "python")
            if server not in SERVERS:
                raise TopologyError(f"{where}.server", f"{server!r} is not one of {', '.join(SERVERS)}")
            if server == "native" and any(entry.endswith("/sctp") for entry in listen):
                raise TopologyError(f"{where}.listen", "server native (echod.c) serves tcp and udp only; "
                                                       "an sctp listen needs server python")
            ips: dict[int, Any] = {}
            if obj.get("ip") is not None:
                node = by_name[node_name]
                for ip in _pair(obj["ip"], f"{where}.ip", lambda v, w: self.pod_ip(v, w, node, nodes)):
                    self.claim(ip, f"{where}.ip")
                    ips[ip.version] = ip
            partial.append([name, node_name, ips, namespace, labels, tuple(listen), server])
        for i, entry in enumerate(partial):  # allocate once every fixed address is known
            node = by_name[entry[1]]
            for version in self.versions:
                if version in entry[2]:
                    continue
                cidr = next(ipaddress.ip_network(c) for c in node.pod_cidrs
                            if ipaddress.ip_network(c).version == version)
                ip = _first_free(cidr, set(self.owners))
                if ip is None:
                    raise TopologyError(f"pods[{i}].ip", f"podCIDR {cidr} of node "
                                                         f"{node.name!r} has no free address")
                self.claim(ip, f"pods[{i}].ip")
                entry[2][version] = ip
        out = []
        for name, node, ips, namespace, labels, listen, server in partial:
            ordered = tuple(str(ips[v]) for v in self.versions)
            out.append(PodSpec(name, node, ordered[0], namespace, labels, listen, ips=ordered, server=server))
        return tuple(out)

    def pod_ip(self, value: Any, where: str, node: NodeSpec, nodes: tuple[NodeSpec, ...]):
        ip = _ip(value, where)
        self.family_check(ip, where)
        if ip in self.service[ip.version]:
            raise TopologyError(where, f"{ip} lies inside serviceCIDR {self.service[ip.version]}")
        for cidr_text in node.pod_cidrs:
            own = ipaddress.ip_network(cidr_text)
            if own.version == ip.version and ip in (own.network_address, own.broadcast_address):
                raise TopologyError(where, f"{ip} is the network or broadcast address of "
                                           f"podCIDR {cidr_text} of node {node.name!r}")
        for other in nodes:
            for cidr_text in other.pod_cidrs:
                if other is not node and ip in ipaddress.ip_network(cidr_text):
                    raise TopologyError(where, f"{ip} lies in podCIDR {cidr_text} of node "
                                               f"{other.name!r}, but the pod runs on {node.name!r}")
        return ip
