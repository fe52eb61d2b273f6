"""API objects (plain dicts, as the API server sent them) → model values, the way kube-proxy reads them.

Why dicts and not the client's generated models: a malformed object must be skipped with a log
line, not blow up inside a deserializer we do not control. Every accessor here checks the type of
what it reads, and any problem becomes one `Invalid` report naming namespace/name and the field.
Nothing in this module raises on API content.

What is skipped, and how much of it, follows kube-proxy (servicechangetracker.go, serviceport.go,
endpointslicecache.go):
- Services: ExternalName and headless ones are not proxied; a Service whose fields are broken is
  dropped whole (a half-programmed service is worse than none); a bad or wrong-family external IP
  or load-balancer ingress IP drops just that IP, as kube-proxy filters them.
- EndpointSlices: a port without a number, or an endpoint without a usable address, drops just
  that port or endpoint (kube-proxy's "ignoring invalid endpoint port"); a slice without the
  `kubernetes.io/service-name` label or with a broken structure is dropped whole.
Families: one conversion per IP family proxier, as kube-proxy's metaproxier: a Service gives each
family its cluster IP of that family and the addresses of that family; an EndpointSlice belongs to
the family of its addressType. What belongs to a family not served is skipped with a debug log,
never counted as invalid.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ebpf_proxy.k8s import invalid as inv
from ebpf_proxy.k8s.invalid import Invalid, Reporter
from ebpf_proxy.model import ipsloppy
from ebpf_proxy.model.endpoints import PortlessEndpoints, extra_index
from ebpf_proxy.model import (
    DEFAULT_AFFINITY_TIMEOUT_SECONDS,
    Endpoint,
    NodeState,
    Protocol,
    ServicePort,
    ServicePortName,
    networks_of_family,
    of_family,
)
from ebpf_proxy.model.types import is_dotted_quad

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
ZONE_LABEL = "topology.kubernetes.io/zone"
MAX_AFFINITY_TIMEOUT_SECONDS = 86400  # the API server's validation bound

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
TRAFFIC_POLICIES = ("Cluster", "Local")
AFFINITIES = ("None", "ClientIP")
ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")


class _Reject(Exception):
    """Internal: unwinds out of a conversion step; always caught in this module."""

    def __init__(self, field: str, reason: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field, self.reason, self.detail = field, reason, detail


_MISSING = object()


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _get(obj: dict, key: str, path: str, types: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """obj[key] checked against `types`; a missing or null key gives `default` (or rejects if none)."""
    value = obj.get(key)
    if type(value) is types:  # the common case, decided at once (a bool only where bool is asked for)
        return value
    if value is None:
        if default is _MISSING:
            raise _Reject(path, inv.MISSING_FIELD, "is missing")
        return default
    # bool is an int in Python; a JSON `true` is never a valid port or count.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _Reject(path, inv.WRONG_TYPE, f"expected {_type_names(types)}, got {_describe(value)}")
    if not isinstance(value, types):
        raise _Reject(path, inv.WRONG_TYPE, f"expected {_type_names(types)}, got {_describe(value)}")
    return value


def _type_names(types: type | tuple[type, ...]) -> str:
    names = {dict: "object", list: "list", str: "string", int: "integer", bool: "boolean"}
    seq = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in seq)


def _port(value: Any, path: str, allow_zero: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Reject(path, inv.WRONG_TYPE, f"expected integer, got {_describe(value)}")
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise _Reject(path, inv.PORT_OUT_OF_RANGE, f"{value} is not in {low}..65535")
    return value


def _optional_port(obj: dict, key: str, path: str) -> int:
    """A port that may be unset (null or absent: 0). Only null means unset: `false`, "" or []
    are wrong types, not "no port" (they were read as 0 and nothing said why the port was gone)."""
    value = obj.get(key)
    return 0 if value is None else _port(value, path, allow_zero=True)


def _protocol(value: Any, path: str) -> Protocol:
    if value is None:
        return Protocol.TCP  # the API server's default
    if not isinstance(value, str):
        raise _Reject(path, inv.WRONG_TYPE, f"expected string, got {_describe(value)}")
    try:
        return Protocol(value)
    except ValueError:
        raise _Reject(path, inv.UNKNOWN_PROTOCOL, f"{value!r} is not TCP, UDP or SCTP") from None


def _ip(value: Any, path: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """Parsed as kube-proxy parses every IP it reads (netutils.ParseIPSloppy): legacy forms the API
    server accepts with a warning (`10.180.00.001`, `::ffff:10.180.0.1`) are that IPv4 address."""
    if not isinstance(value, str):
        raise _Reject(path, inv.WRONG_TYPE, f"expected string, got {_describe(value)}")
    ip = ipsloppy.parse_ip(value)
    if ip is None:
        raise _Reject(path, inv.INVALID_IP, f"{value!r} is not an IP address")
    return ip


def _choice(obj: dict, key: str, path: str, choices: tuple[str, ...], default: str) -> str:
    value = _get(obj, key, path, str, default)
    if value == "":
        return default
    if value not in choices:
        raise _Reject(path, inv.INVALID_VALUE, f"{value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class ObjectRef:
    """namespace/name of an API object, read defensively (for keys and log lines)."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


def object_ref(obj: Any) -> ObjectRef | None:
    """The object's namespace/name, or None when it has no usable metadata.name."""
    if not isinstance(obj, dict):
        return None
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return None
    name, namespace = meta.get("name"), meta.get("namespace", "")
    if not isinstance(name, str) or not name or not isinstance(namespace, (str, type(None))):
        return None
    return ObjectRef(sys.intern(namespace or ""), name)  # a few namespaces, thousands of objects


def _ref_text(obj: Any) -> str:
    ref = object_ref(obj)
    return str(ref) if ref else "?"


def _reject(reporter: Reporter | None, kind: str, obj: str, err: _Reject, skipped: str) -> None:
    inv.report(reporter, Invalid(kind=kind, obj=obj, field=err.field, reason=err.reason, detail=err.detail,
                                 skipped=skipped))


def _unnamed(obj: dict, kind: str) -> Invalid:
    """Why object_ref found no namespace/name: the name, or (with a usable name) the namespace."""
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if isinstance(name, str) and name:
        return Invalid(kind, "?", "metadata.namespace", inv.WRONG_TYPE,
                       f"expected string, got {_describe(meta.get('namespace'))} (name {_describe(name)})", "object")
    return Invalid(kind, "?", "metadata.name", inv.MISSING_FIELD, "missing or not a string", "object")


def _require_ref(obj: Any, kind: str, reporter: Reporter | None) -> ObjectRef | None:
    if not isinstance(obj, dict):
        inv.report(reporter, Invalid(kind, "?", "", inv.MALFORMED, f"expected an object, got {_describe(obj)}",
                                     "object"))
        return None
    ref = object_ref(obj)
    if ref is None:
        inv.report(reporter, _unnamed(obj, kind))
        return None
    if kind != "Node" and not ref.namespace:
        inv.report(reporter, Invalid(kind, str(ref), "metadata.namespace", inv.MISSING_FIELD, "is missing",
                                     "object"))
        return None
    # Names end up in iptables rules (comments) and metric labels: only what the API server
    # allows (DNS-1123 labels), so a quote or newline can never reach an iptables-restore input.
    checks = (("metadata.namespace", ref.namespace), ("metadata.name", ref.name)) if kind == "Service" else \
        (("metadata.namespace", ref.namespace),) if kind == "EndpointSlice" else ()
    for field, value in checks:
        if not is_dns_label(value):
            inv.report(reporter, Invalid(kind, str(ref), field, inv.INVALID_VALUE,
                                         f"{_describe(value)} is not a DNS-1123 label", "object"))
            return None
    return ref


_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def is_dns_label(value: str) -> bool:
    """A DNS-1123 label, what kube-apiserver requires of namespaces, Service names (DNS-1035, a
    subset) and port names. kube-proxy relies on that validation; the agent checks it, since
    these names are written into iptables rules."""
    return _DNS1123_LABEL.fullmatch(value) is not None


def _port_name(obj: dict, path: str) -> str:
    """A port's name: "" or a DNS-1123 label (ValidateDNS1123Label on Service and EndpointSlice ports),
    interned (_shared_name)."""
    name = _get(obj, "name", path, str, "")
    if name and not is_dns_label(name):
        raise _Reject(path, inv.INVALID_VALUE, f"{_describe(name)} is not a DNS-1123 label")
    return _shared_name(name)


def _shared_name(name: str) -> str:
    """One string object per distinct port name. A cluster's ports have a handful of names ("",
    "http", "dns", ...), but each decoded port brought its own copy, kept by its ServicePortName:
    one per Service port and one per EndpointSlice port, ~53 bytes each: 1.0 MiB traced for 10,000
    Services with a port "http" and their slices (10 MiB at 100,000). Interned strings leave the
    table when nothing holds them any more, so names seen once do not pile up."""
    return sys.intern(name)


# ---- Services ------------------------------------------------------------------------------------


def service_ports(svc: Any, reporter: Reporter | None = None, family: int = 4) -> list[ServicePort]:
    """Every programmable port of a Service in IP `family`; [] when it is not proxied in that
    family (no cluster IP of it), or is invalid."""
    return service_ports_by_family(svc, reporter, (family,))[family]


def service_ports_by_family(svc: Any, reporter: Reporter | None = None,
                            families: tuple[int, ...] = (4,)) -> dict[int, list[ServicePort]]:
    """A Service's ports for each IP family proxier, as kube-proxy's metaproxier hands one Service
    to the IPv4 and the IPv6 proxier, each taking its family's cluster IP, external IPs, load-balancer
    IPs and source ranges (serviceport.go newBaseServiceInfo). The object is read and reported on
    once, whatever the number of families."""
    empty: dict[int, list[ServicePort]] = {f: [] for f in families}
    ref = _require_ref(svc, "Service", reporter)
    if ref is None:
        return empty
    plain = _plain_service_ports(svc, ref, families)
    if plain is not None:
        return plain
    try:
        return _service_ports(svc, ref, reporter, families)
    except _Reject as err:
        _reject(reporter, "Service", str(ref), err, "object")
        return empty


def _service_ports(svc: dict, ref: ObjectRef, reporter: Reporter | None,
                   families: tuple[int, ...]) -> dict[int, list[ServicePort]]:
    out: dict[int, list[ServicePort]] = {f: [] for f in families}
    spec = _get(svc, "spec", "spec", dict)
    svc_type = _choice(spec, "type", "spec.type", SERVICE_TYPES, "ClusterIP")
    if svc_type == "ExternalName":
        log.debug("skipping ExternalName service", extra={"object": str(ref)})
        return out
    cluster_ips = _cluster_ips(spec, ref)
    wanted = [f for f in families if f in cluster_ips]
    if not wanted:
        if cluster_ips:
            log.debug("service has no cluster IP of the families served here",
                      extra={"object": str(ref), "families": ",".join(map(str, families))})
        return out

    external_ips = _service_ips(_get(spec, "externalIPs", "spec.externalIPs", list, []), "spec.externalIPs",
                                ref, reporter)
    status = _get(svc, "status", "status", dict, {})
    lb = _get(status, "loadBalancer", "status.loadBalancer", dict, {})
    lb_ips = _ingress_ips(_get(lb, "ingress", "status.loadBalancer.ingress", list, []), ref, reporter)
    source_ranges = _source_ranges(spec)

    etp = _choice(spec, "externalTrafficPolicy", "spec.externalTrafficPolicy", TRAFFIC_POLICIES, "Cluster")
    itp = _choice(spec, "internalTrafficPolicy", "spec.internalTrafficPolicy", TRAFFIC_POLICIES, "Cluster")
    # kube-proxy's apiservice.ExternallyAccessible: NodePort, LoadBalancer, or ClusterIP with externalIPs.
    externally_accessible = svc_type in ("NodePort", "LoadBalancer") or bool(spec.get("externalIPs"))
    external_local = etp == "Local" and externally_accessible
    affinity_timeout = _affinity_timeout(spec)

    health_port = 0
    if svc_type == "LoadBalancer" and external_local:  # kube-proxy's apiservice.NeedsHealthCheck
        health_port = _optional_port(spec, "healthCheckNodePort", "spec.healthCheckNodePort")
        if health_port == 0:
            log.error("service needs a health check but has no healthCheckNodePort",
                      extra={"object": str(ref), "field": "spec.healthCheckNodePort"})

    ports = _service_port_numbers(_get(spec, "ports", "spec.ports", list, []), ref)
    for family in wanted:
        family_lb_ips = of_family(lb_ips, family)
        family_ranges = tuple(str(n) for n in networks_of_family(source_ranges, family))
        if source_ranges and not family_ranges and family_lb_ips:
            # ranges given, none of this family: no source of this family may reach its LB IPs
            log.info(f"service has no IPv{family} loadBalancerSourceRanges: not programming its IPv{family} "
                     "load-balancer IPs", extra={"object": str(ref), "field": "spec.loadBalancerSourceRanges"})
            family_lb_ips = ()
        family_external_ips = of_family(external_ips, family)
        out[family] = [ServicePort(
            name=spn, cluster_ip=cluster_ips[family], port=number, protocol=spn.protocol, node_port=node_port,
            external_ips=family_external_ips, load_balancer_ips=family_lb_ips,
            load_balancer_source_ranges=family_ranges, external_policy_local=external_local,
            internal_policy_local=itp == "Local", affinity_timeout_seconds=affinity_timeout,
            health_check_node_port=health_port,
        ) for spn, number, node_port in ports]
    return out


_PROTOCOLS = {p.value: p for p in Protocol}
_PLAIN_SERVICE_TYPES = (None, "", "ClusterIP")
_PLAIN_POLICIES = (None, "", *TRAFFIC_POLICIES)
_PLAIN_AFFINITIES = (None, "", "None")


def _plain_service_ports(svc: dict, ref: ObjectRef, families: tuple[int, ...]) -> dict[int, list[ServicePort]] | None:
    """_service_ports' answer for the usual Service, read without its per-field checks (100,000
    of them in a first list at 100,000 Services): a ClusterIP Service with one IPv4 cluster IP (a
    canonical dotted quad), IPv4 served, plain ports (_plain_ports), no external or load-balancer
    IP, no source range, no session affinity, every other field it reads unset or valid. None
    for anything else, which then takes the checked path: the same value where both apply
    (tests/unit/test_convert_plain.py), its reports and logs where they do not."""
    spec = svc.get("spec")
    if type(spec) is not dict or 4 not in families:
        return None
    ips, status = spec.get("clusterIPs"), svc.get("status")
    if spec.get("type") not in _PLAIN_SERVICE_TYPES or type(ips) is not list or len(ips) != 1 \
            or type(ips[0]) is not str or not is_dotted_quad(ips[0]) \
            or spec.get("externalIPs") not in (None, []) or spec.get("loadBalancerSourceRanges") not in (None, []) \
            or spec.get("externalTrafficPolicy") not in _PLAIN_POLICIES \
            or spec.get("internalTrafficPolicy") not in _PLAIN_POLICIES \
            or spec.get("sessionAffinity") not in _PLAIN_AFFINITIES:
        return None
    if status is not None and (type(status) is not dict or not _no_ingress(status.get("loadBalancer"))):
        return None
    ports = _plain_ports(spec.get("ports"), node_ports=True)
    if ports is None:
        return None
    out: dict[int, list[ServicePort]] = {f: [] for f in families}
    cluster_ip, internal_local = ips[0], spec.get("internalTrafficPolicy") == "Local"
    # not externally accessible (ClusterIP, no external IP): eTP does not apply, as in _service_ports
    out[4] = [ServicePort(name=ServicePortName(ref.namespace, ref.name, name, protocol), cluster_ip=cluster_ip,
                          port=number, protocol=protocol, node_port=node_port, internal_policy_local=internal_local)
              for name, protocol, number, node_port in ports]
    return out


def _no_ingress(lb: Any) -> bool:
    """Whether status.loadBalancer is unset or an object without ingress points."""
    return lb is None or (type(lb) is dict and lb.get("ingress") in (None, []))


def _plain_ports(ports: Any, node_ports: bool) -> list[tuple[str, Protocol, int, int]] | None:
    """(name, protocol, port, nodePort) of each entry of a Service's or EndpointSlice's ports when
    every one is plain: an object whose name is unset or a DNS-1123 label, protocol unset or
    known, port a number in 1..65535, nodePort (read when `node_ports`, else 0) unset or in
    0..65535, no (name, protocol) twice. None when one is not (the checked paths then decide)."""
    if ports is None:
        return []
    if type(ports) is not list:
        return None
    result: list[tuple[str, Protocol, int, int]] = []
    seen: set[tuple[str, Protocol]] = set()
    for port in ports:
        if type(port) is not dict:
            return None
        name, protocol, number = port.get("name"), port.get("protocol"), port.get("port")
        node_port = port.get("nodePort") if node_ports else None
        if name is None:
            name = ""
        elif type(name) is not str or (name and not is_dns_label(name)):
            return None
        else:
            name = _shared_name(name)
        protocol = Protocol.TCP if protocol is None else _PROTOCOLS.get(protocol) if type(protocol) is str else None
        if node_port is None:
            node_port = 0
        elif type(node_port) is not int or not 0 <= node_port <= 65535:
            return None
        if protocol is None or type(number) is not int or not 0 < number <= 65535 or (name, protocol) in seen:
            return None
        seen.add((name, protocol))
        result.append((name, protocol, number, node_port))
    return result


def _service_port_numbers(ports: list, ref: ObjectRef) -> list[tuple[ServicePortName, int, int]]:
    """(name, port, nodePort) of each spec.ports entry; any broken entry rejects the Service."""
    result: list[tuple[ServicePortName, int, int]] = []
    seen: set[ServicePortName] = set()
    for i, port in enumerate(ports):
        path = f"spec.ports[{i}]"
        if not isinstance(port, dict):
            raise _Reject(path, inv.WRONG_TYPE, f"expected object, got {_describe(port)}")
        port_name = _port_name(port, f"{path}.name")
        protocol = _protocol(port.get("protocol"), f"{path}.protocol")
        number = _port(port.get("port"), f"{path}.port", allow_zero=False)
        node_port = _optional_port(port, "nodePort", f"{path}.nodePort")
        spn = ServicePortName(ref.namespace, ref.name, port_name, protocol)
        if spn in seen:
            raise _Reject(f"{path}.name", inv.INVALID_VALUE, f"duplicate port name {port_name!r}/{protocol.value}")
        seen.add(spn)
        result.append((spn, number, node_port))
    return result


def _cluster_ips(spec: dict, ref: ObjectRef) -> dict[int, str]:
    """The service's cluster IP per family ({} for headless/unallocated services), as kube-proxy's
    GetClusterIPByFamily reads spec.clusterIPs (spec.clusterIP on objects from before dual-stack).
    Every listed address must parse: a broken one rejects the Service."""
    ips = _get(spec, "clusterIPs", "spec.clusterIPs", list, [])
    paths = [f"spec.clusterIPs[{i}]" for i in range(len(ips))]
    if not ips:  # clusterIPs is newer (dual-stack); older objects only have clusterIP
        single = _get(spec, "clusterIP", "spec.clusterIP", str, "")
        ips, paths = ([single] if single else []), ["spec.clusterIP"]
    if not ips or ips[0] in ("None", ""):
        log.debug("skipping service without a cluster IP (headless)", extra={"object": str(ref)})
        return {}
    by_family: dict[int, str] = {}
    for ip, path in zip(ips, paths):
        parsed = _ip(ip, path)
        by_family.setdefault(parsed.version, str(parsed))
    return by_family


def _service_ips(values: list, path: str, ref: ObjectRef, reporter: Reporter | None) -> tuple[str, ...]:
    ips: dict[str, None] = {}  # ordered set: a list's `in` made 80,000 IPs (the object size limit) quadratic
    for i, value in enumerate(values):
        ip = _service_ip(value, f"{path}[{i}]", ref, reporter)
        if ip is not None:
            ips[ip] = None
    return tuple(ips)


def _service_ip(value: Any, path: str, ref: ObjectRef, reporter: Reporter | None) -> str | None:
    """One external or load-balancer IP, canonical; None (reported) when invalid. Each family's
    proxier keeps its own (kube-proxy's MapIPsByIPFamily)."""
    try:
        return str(_ip(value, path))
    except _Reject as err:
        _reject(reporter, "Service", str(ref), err, "ip")
        return None


def _ingress_ips(ingress: list, ref: ObjectRef, reporter: Reporter | None) -> tuple[str, ...]:
    ips: dict[str, None] = {}  # ordered set, as in _service_ips
    for i, entry in enumerate(ingress):
        path = f"status.loadBalancer.ingress[{i}]"
        if not isinstance(entry, dict):
            _reject(reporter, "Service", str(ref),
                    _Reject(path, inv.WRONG_TYPE, f"expected object, got {_describe(entry)}"), "ip")
            continue
        if entry.get("ip") in (None, ""):
            continue  # hostname-only ingress: nothing for a proxy to do
        if entry.get("ipMode") == "Proxy":
            # The load balancer proxies to the nodes itself; kube-proxy does not capture its IP.
            continue
        ip = _service_ip(entry["ip"], f"{path}.ip", ref, reporter)  # the report names ingress[i].ip itself
        if ip is not None:
            ips[ip] = None
    return tuple(ips)


def _source_ranges(spec: dict) -> tuple[str, ...]:
    """Every source range, canonical, all families (each proxier keeps its own).

    An unparsable range rejects the whole Service: dropping it would widen who can reach the
    load balancer, which is the opposite of what the user asked for."""
    values = _get(spec, "loadBalancerSourceRanges", "spec.loadBalancerSourceRanges", list, [])
    ranges: dict[str, None] = {}  # ordered set, as in _service_ips
    for i, value in enumerate(values):
        path = f"spec.loadBalancerSourceRanges[{i}]"
        if not isinstance(value, str):
            raise _Reject(path, inv.WRONG_TYPE, f"expected string, got {_describe(value)}")
        # kube-proxy: strings.TrimSpace (the API server accepts padded values), then ParseCIDRSloppy.
        parsed = ipsloppy.parse_cidr(value.strip())
        if parsed is None:
            raise _Reject(path, inv.INVALID_CIDR, f"{value!r} is not a CIDR")
        ranges[str(parsed[1])] = None
    return tuple(ranges)


def _affinity_timeout(spec: dict) -> int:
    affinity = _choice(spec, "sessionAffinity", "spec.sessionAffinity", AFFINITIES, "None")
    if affinity != "ClientIP":
        return 0
    config = _get(spec, "sessionAffinityConfig", "spec.sessionAffinityConfig", dict, {})
    client_ip = _get(config, "clientIP", "spec.sessionAffinityConfig.clientIP", dict, {})
    path = "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
    timeout = _get(client_ip, "timeoutSeconds", path, int, DEFAULT_AFFINITY_TIMEOUT_SECONDS)
    if not 0 < timeout <= MAX_AFFINITY_TIMEOUT_SECONDS:
        raise _Reject(path, inv.INVALID_VALUE, f"{timeout} is not in 1..{MAX_AFFINITY_TIMEOUT_SECONDS}")
    return timeout


# ---- EndpointSlices ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SliceEndpoints:
    """One EndpointSlice, reduced to what the proxy uses: endpoints per service port."""

    namespace: str
    name: str  # the slice's own name
    service: str  # the owning Service's name (label kubernetes.io/service-name)
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]]
    trigger_time: float | None = None  # epoch seconds of the change that caused this slice version
    family: int = 4  # addressType IPv4 or IPv6: the one proxier it belongs to

    @property
    def service_key(self) -> str:
        return f"{self.namespace}/{self.service}"


def endpoint_slice(obj: Any, node_name: str, reporter: Reporter | None = None,
                   families: tuple[int, ...] = (4,)) -> SliceEndpoints | None:
    """The slice's endpoints by service port; None when the slice contributes nothing here: it is
    invalid, FQDN, or of an address family not in `families` (kube-proxy's EndpointSliceCache of
    each family proxier only takes slices of its addressType).

    `node_name` is this node: endpoints whose nodeName matches are local (eTP/iTP=Local)."""
    ref = _require_ref(obj, "EndpointSlice", reporter)
    if ref is None:
        return None
    plain = _plain_ipv4_slice(obj, ref, node_name) if 4 in families else None
    if plain is not None:
        return plain
    try:
        return _endpoint_slice(obj, ref, node_name, reporter, families)
    except _Reject as err:
        _reject(reporter, "EndpointSlice", str(ref), err, "object")
        return None


_FAMILY_OF_ADDRESS_TYPE = {"IPv4": 4, "IPv6": 6}


def _endpoint_slice(obj: dict, ref: ObjectRef, node_name: str, reporter: Reporter | None,
                    families: tuple[int, ...]) -> SliceEndpoints | None:
    meta = obj["metadata"]
    labels = _get(meta, "labels", "metadata.labels", dict, {})
    service = labels.get(SERVICE_NAME_LABEL)
    if not isinstance(service, str) or not service:
        raise _Reject(f"metadata.labels[{SERVICE_NAME_LABEL}]", inv.MISSING_FIELD, "missing: no owning service")
    if not is_dns_label(service):  # it must name a Service, and so be one of their names
        raise _Reject(f"metadata.labels[{SERVICE_NAME_LABEL}]", inv.INVALID_VALUE,
                      f"{_describe(service)} is not a DNS-1123 label")
    address_type = _get(obj, "addressType", "addressType", str)
    if address_type not in ADDRESS_TYPES:
        raise _Reject("addressType", inv.INVALID_VALUE, f"{address_type!r} is not one of {', '.join(ADDRESS_TYPES)}")
    family = _FAMILY_OF_ADDRESS_TYPE.get(address_type)
    if family not in families:
        log.debug("ignoring endpoint slice of an address type not served here",
                  extra={"object": str(ref), "field": "addressType", "address_type": address_type})
        return None

    ports = _slice_ports(_get(obj, "ports", "ports", list, []), ref, reporter)
    endpoints = _slice_endpoints(_get(obj, "endpoints", "endpoints", list, []), ref, node_name, reporter, family)
    # each port's endpoints packed straight from the rows (an EndpointList, equal to the tuple of
    # Endpoint values in slice order), not built as a million Endpoint values at 100,000 Services
    rows = PortlessEndpoints(endpoints)
    by_port: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    for port_name, protocol, number in ports:
        by_port[ServicePortName(ref.namespace, service, port_name, protocol)] = rows.with_port(number)  # type: ignore[assignment]
    annotations = _get(meta, "annotations", "metadata.annotations", dict, {})
    return SliceEndpoints(namespace=ref.namespace, name=ref.name, service=service, endpoints=by_port,
                          trigger_time=_trigger_time(annotations.get(TRIGGER_TIME_ANNOTATION), ref), family=family)


_NO_HINTS: tuple[tuple, tuple] = ((), ())


def _plain_ipv4_slice(obj: dict, ref: ObjectRef, node_name: str) -> SliceEndpoints | None:
    """_endpoint_slice's answer for the usual IPv4 slice, read without its per-field checks
    (100,000 slices, a million endpoints, in a first list at 100,000 Services): labels naming
    the Service, plain ports (_plain_ports), plain endpoints (_plain_ipv4_endpoint) without
    hints, annotations unset or an object. None for anything else, which then takes the checked
    path: the same value where both apply (tests/unit/test_convert_plain.py), its reports where
    they do not."""
    meta = obj["metadata"]
    labels, annotations, endpoints = meta.get("labels"), meta.get("annotations"), obj.get("endpoints")
    if type(labels) is not dict or (annotations is not None and type(annotations) is not dict) \
            or obj.get("addressType") != "IPv4" or (endpoints is not None and type(endpoints) is not list):
        return None
    service = labels.get(SERVICE_NAME_LABEL)
    ports = _plain_ports(obj.get("ports"), node_ports=False)
    if type(service) is not str or not is_dns_label(service) or ports is None:
        return None
    packed = _plain_ipv4_rows(endpoints or (), node_name)
    if packed is None:
        return None
    by_port = {ServicePortName(ref.namespace, service, name, protocol): packed.with_port(number)
               for name, protocol, number, _ in ports}
    trigger = annotations.get(TRIGGER_TIME_ANNOTATION) if annotations else None
    return SliceEndpoints(namespace=ref.namespace, name=ref.name, service=service, endpoints=by_port,  # type: ignore[arg-type]
                          trigger_time=_trigger_time(trigger, ref), family=4)


# (this node, nodeName, ready, serving, terminating) as an endpoint gives them -> the index of
# its fields but IP and port (model.endpoints.extra_index): a handful of nodes x conditions,
# looked up a million times at 100,000 Services x 10 endpoints
_plain_extras: dict[tuple, int] = {}


def _plain_ipv4_rows(endpoints: list, node_name: str) -> PortlessEndpoints | None:
    """The endpoints of a plain IPv4 slice packed as _plain_ipv4_endpoint reads each one (every
    field exactly of its JSON type, the first address a canonical dotted quad, no hints), in one
    loop without a tuple per endpoint: their fields are looked up by (nodeName, conditions) in
    _plain_extras. None when one of them is not plain (the checked path then decides)."""
    ips: list[str] = []
    v4: list[bytes] = []
    extras: list[int] = []
    pton, af_inet, known = socket.inet_pton, socket.AF_INET, _plain_extras
    for ep in endpoints:
        if type(ep) is not dict:
            return None
        addresses, conditions, node = ep.get("addresses"), ep.get("conditions"), ep.get("nodeName")
        if type(addresses) is not list or not addresses or ep.get("hints") is not None:
            return None
        ip = addresses[0]
        if type(ip) is not str:
            return None
        try:  # is_dotted_quad (model.types), inline: canonical, as str(ipaddress) gives it back
            v4.append(pton(af_inet, ip))
        except (OSError, ValueError):
            return None
        if conditions is None:
            ready = serving = terminating = None
        elif type(conditions) is dict:
            ready, serving, terminating = conditions.get("ready"), conditions.get("serving"), conditions.get("terminating")
            # exactly true, false or null: 1 == True, so the key's lookup alone would not tell
            if (ready is not None and ready is not True and ready is not False) \
                    or (serving is not None and serving is not True and serving is not False) \
                    or (terminating is not None and terminating is not True and terminating is not False):
                return None
        else:
            return None
        if node is not None and type(node) is not str:
            return None
        key = (node_name, node, ready, serving, terminating)
        index = known.get(key)
        if index is None:
            row = _plain_ipv4_endpoint({"addresses": ["0.0.0.0"], "conditions": conditions, "nodeName": node}, node_name)
            if row is None:  # pragma: no cover - the checks above are _plain_ipv4_endpoint's
                return None
            if len(known) > 4096:  # nodes and conditions are few; bound it anyway
                known.clear()
            index = known[key] = extra_index(row[1:] + _NO_HINTS)
        ips.append(ip)
        extras.append(index)
    return PortlessEndpoints.packed_ipv4(ips, b"".join(v4), extras)


def _slice_ports(ports: list, ref: ObjectRef, reporter: Reporter | None) -> list[tuple[str, Protocol, int]]:
    result: list[tuple[str, Protocol, int]] = []
    seen: set[tuple[str, Protocol]] = set()
    for i, port in enumerate(ports):
        path = f"ports[{i}]"
        try:
            if not isinstance(port, dict):
                raise _Reject(path, inv.WRONG_TYPE, f"expected object, got {_describe(port)}")
            name = _port_name(port, f"{path}.name")
            protocol = _protocol(port.get("protocol"), f"{path}.protocol")
            number = _port(port.get("port"), f"{path}.port", allow_zero=False)
            if (name, protocol) in seen:
                raise _Reject(f"{path}.name", inv.INVALID_VALUE, f"duplicate port name {name!r}/{protocol.value}")
        except _Reject as err:
            _reject(reporter, "EndpointSlice", str(ref), err, "port")
            continue
        seen.add((name, protocol))
        result.append((name, protocol, number))
    return result


def _slice_endpoints(endpoints: list, ref: ObjectRef, node_name: str, reporter: Reporter | None,
                     family: int) -> list[tuple]:
    result = []
    for i, ep in enumerate(endpoints):
        path = f"endpoints[{i}]"
        try:
            result.append(_slice_endpoint(ep, path, node_name, family) + _endpoint_hints(ep, path, ref, reporter))
        except _Reject as err:
            _reject(reporter, "EndpointSlice", str(ref), err, "endpoint")
    return result


def _slice_endpoint(ep: Any, path: str, node_name: str, family: int) -> tuple:
    fast = _plain_ipv4_endpoint(ep, node_name) if family == 4 else None
    if fast is not None:
        return fast
    if not isinstance(ep, dict):
        raise _Reject(path, inv.WRONG_TYPE, f"expected object, got {_describe(ep)}")
    addresses = _get(ep, "addresses", f"{path}.addresses", list)
    if not addresses:
        raise _Reject(f"{path}.addresses", inv.MISSING_FIELD, "is empty")
    ip = _endpoint_ip(addresses[0], f"{path}.addresses[0]", family)  # kube-proxy uses the first address only
    conditions = _get(ep, "conditions", f"{path}.conditions", dict, {})
    # EndpointSlice defaulting: ready nil → true; serving nil → ready; terminating nil → false.
    ready = _get(conditions, "ready", f"{path}.conditions.ready", bool, True)
    serving = _get(conditions, "serving", f"{path}.conditions.serving", bool, ready)
    terminating = _get(conditions, "terminating", f"{path}.conditions.terminating", bool, False)
    # interned: a handful of node names, each repeated by thousands of endpoints
    node = sys.intern(_get(ep, "nodeName", f"{path}.nodeName", str, None) or "") or None
    return ip, node, ready, serving, terminating, node is not None and node == node_name


def _plain_ipv4_endpoint(ep: Any, node_name: str) -> tuple | None:
    """_slice_endpoint's answer for the usual IPv4 endpoint, read without its per-field checks
    (a million endpoints at 100,000 Services x 10): every field present is exactly of its JSON
    type and the first address is a canonical dotted quad. None for anything else, which then
    takes the checked path (the same values where both apply; its reports where they do not)."""
    if type(ep) is not dict:
        return None
    addresses, conditions, node = ep.get("addresses"), ep.get("conditions"), ep.get("nodeName")
    if type(addresses) is not list or not addresses or type(addresses[0]) is not str \
            or (conditions is not None and type(conditions) is not dict) or (node is not None and type(node) is not str):
        return None
    ip = addresses[0]
    try:  # is_dotted_quad (model.types), inline: a million calls
        socket.inet_pton(socket.AF_INET, ip)  # canonical: as str(ipaddress) gives it back (_endpoint_ip)
    except (OSError, ValueError):
        return None
    ready, serving, terminating = True, None, False  # EndpointSlice defaulting, as in _slice_endpoint
    if conditions:
        ready, serving, terminating = conditions.get("ready", True), conditions.get("serving"), conditions.get("terminating", False)
        if ready is None:
            ready = True
        if terminating is None:
            terminating = False
        if type(ready) is not bool or type(terminating) is not bool or (serving is not None and type(serving) is not bool):
            return None
    if serving is None:
        serving = ready
    node = sys.intern(node) if node else None
    return ip, node, ready, serving, terminating, node is not None and node == node_name


def _endpoint_ip(value: Any, path: str, family: int) -> str:
    """An endpoint's address of `family`, canonical. A dotted quad inet_pton takes (no leading
    zeros, nothing around it: nearly every IPv4 endpoint) is its own canonical form, which is
    what str(ipaddress) would give for it; everything else is parsed as every IP (_ip)."""
    if family == 4 and type(value) is str and is_dotted_quad(value):
        return value
    ip = _ip(value, path)
    if ip.version != family:
        raise _Reject(path, inv.WRONG_FAMILY, f"{value!r} is not IPv{family} in an IPv{family} slice")
    return str(ip)


_HINT_KEYS = ("forZones", "forNodes")
_hint_names: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple per distinct hint set


def _endpoint_hints(ep: Any, path: str, ref: ObjectRef, reporter: Reporter | None) -> tuple[tuple, tuple]:
    """(zone hints, node hints) of one endpoint, as kube-proxy reads them (endpointslicecache.go:
    hints.forZones[].name, hints.forNodes[].name; forNodes always, as PreferSameTrafficDistribution
    is on by default). Malformed hints are reported and the endpoint keeps *no* hints, rather than
    being dropped: one unhinted ready endpoint turns topology off for the whole service, so traffic
    spreads over every endpoint instead of losing one."""
    if not isinstance(ep, dict) or ep.get("hints") is None:
        return (), ()
    try:
        hints = _get(ep, "hints", f"{path}.hints", dict)
        found = []
        for key in _HINT_KEYS:
            names = set()
            for i, entry in enumerate(_get(hints, key, f"{path}.hints.{key}", list, [])):
                at = f"{path}.hints.{key}[{i}]"
                if not isinstance(entry, dict):
                    raise _Reject(at, inv.WRONG_TYPE, f"expected object, got {_describe(entry)}")
                # "" is kept as kube-proxy keeps it (a valid label value; the API server allows it)
                names.add(sys.intern(_get(entry, "name", f"{at}.name", str)))
            found.append(_shared(tuple(sorted(names))))
    except _Reject as err:
        _reject(reporter, "EndpointSlice", str(ref), err, "hints")
        return (), ()
    return found[0], found[1]


def _shared(names: tuple[str, ...]) -> tuple[str, ...]:
    """The one tuple for this set of names: thousands of endpoints hinted for the same zone share it."""
    if not names:
        return ()
    if len(_hint_names) > 4096:  # zones and nodes are few; bound it anyway
        _hint_names.clear()
    return _hint_names.setdefault(names, names)


def _trigger_time(value: Any, ref: ObjectRef) -> float | None:
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        stamp = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.timezone.utc)
        return stamp.timestamp()
    except ValueError:
        log.warning("ignoring unparsable change-trigger time %r", value,
                    extra={"object": str(ref), "field": f"metadata.annotations[{TRIGGER_TIME_ANNOTATION}]"})
        return None


def slice_service_key(obj: Any) -> str | None:
    """namespace/service of a slice (for deletes, where the rest of the object does not matter)."""
    ref = object_ref(obj)
    labels = obj.get("metadata", {}).get("labels") if ref else None
    service = labels.get(SERVICE_NAME_LABEL) if isinstance(labels, dict) else None
    if ref is None or not isinstance(service, str) or not service:
        return None
    return f"{ref.namespace}/{service}"


# ---- Nodes ---------------------------------------------------------------------------------------


def node_info(obj: Any, reporter: Reporter | None = None) -> NodeState | None:
    """The Node's addresses (every family) and whether it is eligible for traffic; None if malformed."""
    ref = _require_ref(obj, "Node", reporter)
    if ref is None:
        return None
    try:
        return _node_info(obj, ref, reporter)
    except _Reject as err:
        _reject(reporter, "Node", str(ref), err, "object")
        return None


def _node_info(obj: dict, ref: ObjectRef, reporter: Reporter | None) -> NodeState:
    status = _get(obj, "status", "status", dict, {})
    internal: list[str] = []
    external: list[str] = []
    for i, entry in enumerate(_get(status, "addresses", "status.addresses", list, [])):
        path = f"status.addresses[{i}]"
        if not isinstance(entry, dict) or entry.get("type") not in ("InternalIP", "ExternalIP"):
            continue  # Hostname, InternalDNS, ...: not addresses we can match packets on
        try:
            ip = _ip(entry.get("address"), f"{path}.address")
        except _Reject as err:
            _reject(reporter, "Node", str(ref), err, "ip")
            continue
        (internal if entry["type"] == "InternalIP" else external).append(str(ip))
    addresses = tuple(dict.fromkeys(internal + external))
    primary = internal[0] if internal else (external[0] if external else None)

    eligible = obj["metadata"].get("deletionTimestamp") is None
    spec = _get(obj, "spec", "spec", dict, {})
    for taint in _get(spec, "taints", "spec.taints", list, []):
        if isinstance(taint, dict) and taint.get("key") == TO_BE_DELETED_TAINT:
            eligible = False
    return NodeState(name=ref.name, addresses=addresses, primary_ip=primary, eligible=eligible,
                     pod_cidrs=_pod_cidrs(spec, ref, reporter), zone=_node_zone(obj, ref, reporter))


def _pod_cidrs(spec: dict, ref: ObjectRef, reporter: Reporter | None) -> tuple[str, ...]:
    """spec.podCIDRs (kube-controller-manager keeps spec.podCIDR equal to its first entry; an
    older object may have only that). A malformed entry is skipped and reported. Parsed as
    kube-proxy parses them (ParseCIDRSloppy): a bare address such as "10.0.0.0", which Python's
    ip_network took for a /32, is not a CIDR."""
    raw = _get(spec, "podCIDRs", "spec.podCIDRs", list, [])
    where = "spec.podCIDRs"
    if not raw and spec.get("podCIDR"):
        raw, where = [spec["podCIDR"]], "spec.podCIDR"
    out: list[str] = []
    for i, value in enumerate(raw):
        path = f"{where}[{i}]" if where == "spec.podCIDRs" else where
        try:
            if not isinstance(value, str):
                raise _Reject(path, inv.WRONG_TYPE, f"expected string, got {_describe(value)}")
            parsed = ipsloppy.parse_cidr(value.strip())
            if parsed is None:
                raise _Reject(path, inv.INVALID_CIDR, f"{value!r} is not a CIDR")
            out.append(str(parsed[1]))
        except _Reject as err:
            _reject(reporter, "Node", str(ref), err, "cidr")
    return tuple(dict.fromkeys(out))


def _node_zone(obj: dict, ref: ObjectRef, reporter: Reporter | None) -> str:
    """The node's topology.kubernetes.io/zone label ("" without one): which zone hints are ours.
    A label that is not a string is reported and read as no zone (topology then stays off)."""
    labels = obj["metadata"].get("labels")
    zone = labels.get(ZONE_LABEL, "") if isinstance(labels, dict) else ""
    if not isinstance(zone, str):
        _reject(reporter, "Node", str(ref), _Reject(f"metadata.labels[{ZONE_LABEL}]", inv.WRONG_TYPE,
                                                    f"expected string, got {_describe(zone)}"), "label")
        return ""
    return sys.intern(zone)
