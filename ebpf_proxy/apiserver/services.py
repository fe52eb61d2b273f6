"""Service defaulting, validation and IP/port allocation, as kube-apiserver does them.

Standard Service YAML leaves most fields out; the proxy under test must see what a real
cluster would store (a cluster IP, `targetPort` equal to `port`, node ports, traffic policies).
The rules and their error wording follow `pkg/apis/core/validation` and
`pkg/registry/core/service/storage` (including `patchAllocatedValues` and
`dropTypeDependentFields`, which make `kubectl apply` of a Service without `clusterIP` work).

IPv4, IPv6 or dual-stack, as the service CIDR given says (one CIDR or a pair, primary first):
`ipFamilyPolicy`, `ipFamilies` and `clusterIPs` follow kube-apiserver (see ipfamilies.py), and
each family's cluster IPs come from that family's range.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from ebpf_proxy.apiserver import ipfamilies, legacyip, names
from ebpf_proxy.apiserver.allocate import AlreadyAllocated, NotInRange, PortAllocator, RangeFull, service_ranges
from ebpf_proxy.apiserver.errors import (
    FieldError,
    InvalidFields,
    duplicate,
    forbidden,
    invalid,
    not_supported,
    required,
)
from ebpf_proxy.model import ipsloppy

TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
PROTOCOLS = ("TCP", "UDP", "SCTP")
TRAFFIC_POLICIES = ("Cluster", "Local")
AFFINITIES = ("ClientIP", "None")
# spec.trafficDistribution (PreferSameZone/PreferSameNode: PreferSameTrafficDistribution, on by default)
TRAFFIC_DISTRIBUTIONS = ("PreferClose", "PreferSameZone", "PreferSameNode")
DEFAULT_AFFINITY_TIMEOUT = 10800
DEFAULT_NODE_PORTS = (30000, 32767)


def needs_cluster_ip(spec: dict[str, Any]) -> bool:
    return spec.get("type", "ClusterIP") != "ExternalName"


def needs_node_ports(spec: dict[str, Any]) -> bool:
    kind = spec.get("type", "ClusterIP")
    return kind == "NodePort" or (kind == "LoadBalancer" and spec.get("allocateLoadBalancerNodePorts", True) is not False)


def needs_health_check_node_port(spec: dict[str, Any]) -> bool:
    return spec.get("type") == "LoadBalancer" and spec.get("externalTrafficPolicy") == "Local"


def _externally_accessible(spec: dict[str, Any]) -> bool:
    return spec.get("type") in ("NodePort", "LoadBalancer") or bool(spec.get("externalIPs"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def apply_defaults(svc: dict[str, Any]) -> None:
    """Fill what the real server's defaulting fills (types.go `SetDefaults_Service`)."""
    spec = svc.setdefault("spec", {})
    if not isinstance(spec, dict):
        raise InvalidFields([invalid("spec", spec, "must be an object")])
    kind = spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["sessionAffinity"] == "ClientIP":
        cfg = spec.setdefault("sessionAffinityConfig", {})
        if isinstance(cfg, dict):
            client_ip = cfg.setdefault("clientIP", {})
            if isinstance(client_ip, dict):
                client_ip.setdefault("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT)
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            if port.get("targetPort") in (None, 0, ""):
                port["targetPort"] = port.get("port")
    if kind in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
    if kind != "ExternalName":
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if kind == "LoadBalancer":
        spec.setdefault("allocateLoadBalancerNodePorts", True)
    if not spec.get("clusterIP") and spec.get("clusterIPs"):
        spec["clusterIP"] = spec["clusterIPs"][0]
    status = svc.setdefault("status", {})
    if isinstance(status, dict):
        status.setdefault("loadBalancer", {})


def patch_allocated_values(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Carry allocated values the update left out (a PUT or apply without `clusterIP`)."""
    spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    if needs_cluster_ip(old_spec) and needs_cluster_ip(spec) and not spec.get("clusterIP") and not spec.get("clusterIPs"):
        for field in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if field in old_spec and field not in spec:
                spec[field] = copy.deepcopy(old_spec[field])
    if needs_node_ports(old_spec) and needs_node_ports(spec):
        old_by_name = {p.get("name", ""): p.get("nodePort") for p in old_spec.get("ports") or [] if isinstance(p, dict)}
        used_old = {p.get("nodePort") for p in old_spec.get("ports") or [] if isinstance(p, dict)}
        used_new = {p.get("nodePort") for p in spec.get("ports") or [] if isinstance(p, dict)}
        in_both = used_old & used_new
        for port in spec.get("ports") or []:
            if isinstance(port, dict) and not port.get("nodePort"):
                value = old_by_name.get(port.get("name", ""))
                if value and value not in in_both:
                    port["nodePort"] = value
    if needs_health_check_node_port(old_spec) and needs_health_check_node_port(spec):
        if not spec.get("healthCheckNodePort") and old_spec.get("healthCheckNodePort"):
            spec["healthCheckNodePort"] = old_spec["healthCheckNodePort"]


def drop_type_dependent_fields(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Clear fields the new type no longer uses when the user did not change them."""
    spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    if needs_cluster_ip(old_spec) and not needs_cluster_ip(spec):
        for field in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if field in spec and spec[field] == old_spec.get(field):
                del spec[field]
    if needs_node_ports(old_spec) and not needs_node_ports(spec):
        old_ports = {p.get("name", ""): p.get("nodePort") for p in old_spec.get("ports") or [] if isinstance(p, dict)}
        for port in spec.get("ports") or []:
            if isinstance(port, dict) and port.get("nodePort") and old_ports.get(port.get("name", "")) == port["nodePort"]:
                del port["nodePort"]
    if needs_health_check_node_port(old_spec) and not needs_health_check_node_port(spec):
        if spec.get("healthCheckNodePort") == old_spec.get("healthCheckNodePort"):
            spec.pop("healthCheckNodePort", None)
    if spec.get("type") != "LoadBalancer":
        for field in ("allocateLoadBalancerNodePorts", "loadBalancerClass"):
            if field in spec and spec[field] == old_spec.get(field):
                del spec[field]
    if not _externally_accessible(spec) and "externalTrafficPolicy" in spec:
        if spec["externalTrafficPolicy"] == old_spec.get("externalTrafficPolicy"):
            del spec["externalTrafficPolicy"]


def _validate_ip(field: str, value: Any, errs: list[FieldError]) -> None:
    """IsValidIPForLegacyField without strict validation: legacy forms (leading zeros) pass.
    Either family: whether the cluster has it is the allocator's question (ipfamilies.py)."""
    if ipsloppy.parse_ip(value) is None:
        errs.append(invalid(field, value, legacyip.INVALID_IP))


def _validate_source_ranges(spec: dict[str, Any], errs: list[FieldError]) -> None:
    """kube-apiserver trims each entry first ("a historical accident" it keeps) and stores it as
    given; the field path keeps its historical capital L too."""
    ranges = spec.get("loadBalancerSourceRanges") or []
    if not ranges:
        return
    if spec.get("type") != "LoadBalancer":
        errs.append(forbidden("spec.LoadBalancerSourceRanges", "may only be used when `type` is 'LoadBalancer'"))
    for i, cidr in enumerate(ranges):
        value = cidr.strip() if isinstance(cidr, str) else cidr
        if ipsloppy.parse_cidr(value) is None:
            errs.append(invalid(f"spec.LoadBalancerSourceRanges[{i}]", value, legacyip.INVALID_CIDR))


def validate_status(svc: dict[str, Any]) -> list[FieldError]:
    """ValidateLoadBalancerStatus: ingress IPs in legacy form are fine, hostnames may not be IPs."""
    errs: list[FieldError] = []
    ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    for i, entry in enumerate(ingress if isinstance(ingress, list) else []):
        if not isinstance(entry, dict):
            continue
        at = f"status.loadBalancer.ingress[{i}]"
        if entry.get("ip"):
            _validate_ip(f"{at}.ip", entry["ip"], errs)
        if entry.get("hostname") and ipsloppy.parse_ip(entry["hostname"]) is not None:
            errs.append(invalid(f"{at}.hostname", entry["hostname"], "must be a DNS name, not an IP address"))
    return errs


def _validate_ports(spec: dict[str, Any], errs: list[FieldError]) -> None:
    ports = spec.get("ports")
    kind = spec.get("type")
    if ports is None:
        ports = []
    if not isinstance(ports, list):
        errs.append(invalid("spec.ports", ports, "must be a list"))
        return
    if not ports and kind != "ExternalName" and spec.get("clusterIP") != "None":
        errs.append(required("spec.ports"))
    seen_names: set[str] = set()
    seen_ports: set[tuple[Any, Any]] = set()
    for i, port in enumerate(ports):
        at = f"spec.ports[{i}]"
        if not isinstance(port, dict):
            errs.append(invalid(at, port, "must be an object"))
            continue
        name = port.get("name", "")
        if len(ports) > 1 and not name:
            errs.append(required(f"{at}.name"))
        if name:
            why = names.dns1123_label(name) if isinstance(name, str) else "must be a string"
            if why:
                errs.append(invalid(f"{at}.name", name, why))
            elif name in seen_names:
                errs.append(duplicate(f"{at}.name", name))
            seen_names.add(name)
        number = port.get("port")
        if number is None:
            errs.append(required(f"{at}.port"))
        elif not _is_int(number) or not 1 <= number <= 65535:
            errs.append(invalid(f"{at}.port", number, "must be between 1 and 65535, inclusive"))
        protocol = port.get("protocol", "TCP")
        if protocol not in PROTOCOLS:
            errs.append(not_supported(f"{at}.protocol", protocol, PROTOCOLS))
        key = (number, protocol)
        if key in seen_ports:
            errs.append(duplicate(at, {"port": number, "protocol": protocol}))
        seen_ports.add(key)
        target = port.get("targetPort")
        if _is_int(target):
            if not 1 <= target <= 65535:
                errs.append(invalid(f"{at}.targetPort", target, "must be between 1 and 65535, inclusive"))
        elif isinstance(target, str):
            why = names.iana_svc_name(target)
            if why:
                errs.append(invalid(f"{at}.targetPort", target, why))
        elif target is not None:
            errs.append(invalid(f"{at}.targetPort", target, "must be a port number or a port name"))
        node_port = port.get("nodePort")
        if node_port:
            if not _is_int(node_port):
                errs.append(invalid(f"{at}.nodePort", node_port, "must be an integer"))
            elif not needs_node_ports(spec):
                errs.append(forbidden(f"{at}.nodePort", f"may not be used when `type` is '{kind}'"))


def validate(svc: dict[str, Any]) -> list[FieldError]:
    """Every field error of a defaulted Service (not the allocation ones)."""
    spec = svc.get("spec") or {}
    errs: list[FieldError] = []
    kind = spec.get("type")
    if kind not in TYPES:
        errs.append(not_supported("spec.type", kind, TYPES))
        return errs
    cluster_ip = spec.get("clusterIP", "")
    if kind == "ExternalName":
        external = spec.get("externalName")
        if not external:
            errs.append(required("spec.externalName"))
        else:
            why = names.dns1123_subdomain(str(external).rstrip("."))
            if why:
                errs.append(invalid("spec.externalName", external, why))
        if cluster_ip:
            errs.append(invalid("spec.clusterIP", cluster_ip, "may not be set for ExternalName services"))
        for field in ("ipFamilies", "ipFamilyPolicy"):
            if spec.get(field):
                errs.append(forbidden(f"spec.{field}", "may not be set for ExternalName services"))
    elif cluster_ip == "None":
        if kind in ("NodePort", "LoadBalancer"):
            errs.append(invalid("spec.clusterIP", cluster_ip, f"may not be set to 'None' for {kind} services"))
    elif cluster_ip:
        _validate_ip("spec.clusterIP", cluster_ip, errs)
    errs += ipfamilies.validate_cluster_ips_related_fields(spec)
    _validate_ports(spec, errs)
    etp = spec.get("externalTrafficPolicy")
    if etp is not None:
        if etp not in TRAFFIC_POLICIES:
            errs.append(not_supported("spec.externalTrafficPolicy", etp, TRAFFIC_POLICIES))
        elif not _externally_accessible(spec):
            errs.append(
                invalid("spec.externalTrafficPolicy", etp, "may only be set for externally-accessible services "
                        "(`type` 'NodePort' or 'LoadBalancer', or with externalIPs)")
            )
    itp = spec.get("internalTrafficPolicy")
    if itp is not None and itp not in TRAFFIC_POLICIES:
        errs.append(not_supported("spec.internalTrafficPolicy", itp, TRAFFIC_POLICIES))
    distribution = spec.get("trafficDistribution")
    if distribution is not None and distribution not in TRAFFIC_DISTRIBUTIONS:
        errs.append(not_supported("spec.trafficDistribution", distribution, TRAFFIC_DISTRIBUTIONS))
    affinity = spec.get("sessionAffinity")
    if affinity not in AFFINITIES:
        errs.append(not_supported("spec.sessionAffinity", affinity, AFFINITIES))
    elif affinity == "ClientIP":
        timeout = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}).get("timeoutSeconds")
        if not _is_int(timeout) or not 0 < timeout <= 86400:
            errs.append(invalid("spec.sessionAffinityConfig.clientIP.timeoutSeconds", timeout, "must be greater than 0 and less than 86400"))
    elif spec.get("sessionAffinityConfig"):
        errs.append(forbidden("spec.sessionAffinityConfig", "must not be set when session affinity is None"))
    selector = spec.get("selector")
    if selector is not None:
        if not isinstance(selector, dict):
            errs.append(invalid("spec.selector", selector, "must be a map of label keys to values"))
        else:
            for key, value in selector.items():
                why = names.label_key(key) or (names.label_value(value) if isinstance(value, str) else "must be a string")
                if why:
                    errs.append(invalid(f"spec.selector[{key}]", value, why))
    hcnp = spec.get("healthCheckNodePort")
    if hcnp and not needs_health_check_node_port(spec):
        errs.append(invalid("spec.healthCheckNodePort", hcnp, "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'"))
    if "allocateLoadBalancerNodePorts" in spec and kind != "LoadBalancer":
        errs.append(forbidden("spec.allocateLoadBalancerNodePorts", "may only be used when `type` is 'LoadBalancer'"))
    for i, ip in enumerate(spec.get("externalIPs") or []):
        _validate_ip(f"spec.externalIPs[{i}]", ip, errs)
    if spec.get("loadBalancerIP"):
        _validate_ip("spec.loadBalancerIP", spec["loadBalancerIP"], errs)
    _validate_source_ranges(spec, errs)
    return errs + validate_status(svc)


def validate_update(new: dict[str, Any], old: dict[str, Any]) -> list[FieldError]:
    spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    errs: list[FieldError] = []
    if needs_cluster_ip(old_spec) and needs_cluster_ip(spec):
        if spec.get("clusterIP", "") != old_spec.get("clusterIP", ""):
            errs.append(invalid("spec.clusterIP", spec.get("clusterIP", ""), "field is immutable"))
    return errs + ipfamilies.validate_upgrade_downgrade(spec, old_spec)


class Transaction:
    """Values taken for one write: released again on rollback; the old ones released on commit."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._on_commit: list[Callable[[], None]] = []

    def on_rollback(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def on_commit(self, release: Callable[[], None]) -> None:
        self._on_commit.append(release)

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def commit(self) -> None:
        for release in self._on_commit:
            release()
        self._on_commit.clear()


def _cluster_ips(spec: dict[str, Any]) -> list[str]:
    ips = spec.get("clusterIPs")
    if isinstance(ips, list) and ips:
        return list(ips)
    return [spec["clusterIP"]] if spec.get("clusterIP") else []


def _owned(spec: dict[str, Any]) -> tuple[dict[str, str], set[int]]:
    """The cluster IPs a Service holds, by family, and its node ports."""
    ips: dict[str, str] = {}
    if needs_cluster_ip(spec):
        for ip in _cluster_ips(spec):
            family = ipfamilies.family_of(ip) if isinstance(ip, str) and ip != "None" else None
            if family:
                ips[family] = ip
    ports = {p["nodePort"] for p in spec.get("ports") or [] if isinstance(p, dict) and _is_int(p.get("nodePort")) and p["nodePort"]}
    if _is_int(spec.get("healthCheckNodePort")) and spec["healthCheckNodePort"]:
        ports.add(spec["healthCheckNodePort"])
    return ips, ports


class ServiceAllocator:
    """The cluster-IP ranges (one per family, primary first) and node-port range of one API server."""

    def __init__(self, service_cidr: str = "10.96.0.0/12", node_ports: tuple[int, int] = DEFAULT_NODE_PORTS) -> None:
        self.by_family = service_ranges(service_cidr)
        self.families = tuple(self.by_family)
        self.ips = self.by_family[self.families[0]]  # the primary range
        self.service_cidr = ",".join(a.cidr for a in self.by_family.values())
        self.ports = PortAllocator(*node_ports)
        self.node_port_range = node_ports

    def prepare_create(self, svc: dict[str, Any]) -> Transaction:
        """Default, validate and allocate; raises InvalidFields with nothing left allocated."""
        apply_defaults(svc)
        ipfamilies.normalize_cluster_ips(svc["spec"], None)
        errs = validate(svc) or ipfamilies.init_ip_family_fields(svc["spec"], None, self.families)
        if errs:
            raise InvalidFields(errs)
        return self._allocate(svc["spec"], None)

    def prepare_update(self, svc: dict[str, Any], old: dict[str, Any]) -> Transaction:
        patch_allocated_values(svc, old)
        drop_type_dependent_fields(svc, old)
        apply_defaults(svc)
        old_spec = old.get("spec") or {}
        ipfamilies.normalize_cluster_ips(svc["spec"], old_spec)
        errs = validate(svc) + validate_update(svc, old)
        if not errs:
            prior = old_spec if needs_cluster_ip(old_spec) else None  # from ExternalName: as a create
            errs = ipfamilies.init_ip_family_fields(svc["spec"], prior, self.families)
        if errs:
            raise InvalidFields(errs)
        return self._allocate(svc["spec"], old_spec)

    def restore(self, svc: dict[str, Any]) -> None:
        """Claim the clusterIP and nodePorts a stored Service already holds (a restarted API
        server reading its persisted state); InvalidFields if another Service holds them."""
        self._allocate(svc.get("spec") or {}, None).commit()

    def release(self, svc: dict[str, Any]) -> None:
        ips, ports = _owned(svc.get("spec") or {})
        for family, ip in ips.items():
            if family in self.by_family:
                self.by_family[family].release(ip)
        for port in ports:
            self.ports.release(port)

    def _allocate(self, spec: dict[str, Any], old_spec: dict[str, Any] | None) -> Transaction:
        txn = Transaction()
        old_ips, old_ports = _owned(old_spec) if old_spec is not None else ({}, set())
        try:
            errs = self._allocate_ips(spec, old_ips, txn) + self._allocate_node_ports(spec, old_ports, txn)
        except BaseException:
            txn.rollback()
            raise
        if errs:
            txn.rollback()
            raise InvalidFields(errs)
        new_ips, new_ports = _owned(spec)
        for family, old_ip in old_ips.items():
            if new_ips.get(family) != old_ip and family in self.by_family:
                txn.on_commit(lambda old_ip=old_ip, alloc=self.by_family[family]: alloc.release(old_ip))
        for port in old_ports - new_ports:
            txn.on_commit(lambda port=port: self.ports.release(port))
        return txn

    def _allocate_ips(self, spec: dict[str, Any], old_ips: dict[str, str], txn: Transaction) -> list[FieldError]:
        """allocClusterIPs: one cluster IP per entry of ipFamilies, from that family's range;
        given ones are claimed, missing ones (an upgrade's secondary) allocated, kept ones left."""
        if not needs_cluster_ip(spec):
            return []
        ips = _cluster_ips(spec)
        if ips[:1] == ["None"]:
            spec["clusterIP"], spec["clusterIPs"] = "None", ["None"]
            return []
        families = spec.get("ipFamilies") or [ipfamilies.family_of(ip) for ip in ips] or [self.families[0]]
        ips += [""] * (len(families) - len(ips))
        for i, family in enumerate(families):
            alloc = self.by_family.get(family)
            if alloc is None:
                return [invalid(f"spec.ipFamilies[{i}]", family, "not configured on this cluster")]
            ip = ips[i]
            field = f"spec.clusterIPs[{i}]"
            if ip == "":
                try:
                    ip = ips[i] = alloc.allocate()
                except RangeFull:
                    where = "spec.clusterIP" if i == 0 else field
                    return [invalid(where, "", f"failed to allocate a service IP: range {alloc.cidr} is full")]
                txn.on_rollback(lambda ip=ip, alloc=alloc: alloc.release(ip))
            elif ip != old_ips.get(family):
                try:
                    alloc.claim(ip)
                except (NotInRange, ValueError):
                    return [invalid(field, ip, f"provided IP is not in the valid range. The range of valid IPs is {alloc.cidr}")]
                except AlreadyAllocated:
                    return [invalid(field, ip, "provided IP is already allocated")]
                txn.on_rollback(lambda ip=ip, alloc=alloc: alloc.release(ip))
        spec["clusterIP"], spec["clusterIPs"] = ips[0], ips
        spec["ipFamilies"] = list(families)
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        return []

    def _claim_port(self, field: str, value: int, old: set[int], taken: set[int], txn: Transaction) -> FieldError | None:
        if value in old or value in taken:
            taken.add(value)
            return None
        try:
            self.ports.claim(value)
        except NotInRange:
            lo, hi = self.node_port_range
            return invalid(field, value, f"provided port is not in the valid range. The range of valid ports is {lo}-{hi}")
        except AlreadyAllocated:
            return invalid(field, value, "provided port is already allocated")
        taken.add(value)
        txn.on_rollback(lambda: self.ports.release(value))
        return None

    def _new_port(self, field: str, txn: Transaction) -> tuple[int | None, FieldError | None]:
        try:
            value = self.ports.allocate()
        except RangeFull:
            lo, hi = self.node_port_range
            return None, invalid(field, 0, f"failed to allocate a node port: range {lo}-{hi} is full")
        txn.on_rollback(lambda: self.ports.release(value))
        return value, None

    def _allocate_node_ports(self, spec: dict[str, Any], old: set[int], txn: Transaction) -> list[FieldError]:
        errs: list[FieldError] = []
        taken: set[int] = set()
        ports = [p for p in spec.get("ports") or [] if isinstance(p, dict)]
        if needs_node_ports(spec):
            by_protocol: set[tuple[int, str]] = set()
            for i, port in enumerate(ports):
                value = port.get("nodePort")
                if not value:
                    continue
                key = (value, port.get("protocol", "TCP"))
                if key in by_protocol:
                    errs.append(duplicate(f"spec.ports[{i}].nodePort", value))
                    continue
                by_protocol.add(key)
                err = self._claim_port(f"spec.ports[{i}].nodePort", value, old, taken, txn)
                if err:
                    errs.append(err)
            for i, port in enumerate(ports):
                if port.get("nodePort"):
                    continue
                # A TCP and a UDP port with the same number share one node port, as upstream does.
                sibling = next(
                    (p["nodePort"] for p in ports if p is not port and p.get("port") == port.get("port")
                     and p.get("nodePort") and p.get("protocol") != port.get("protocol")),
                    None,
                )
                if sibling:
                    port["nodePort"] = sibling
                    continue
                value, err = self._new_port(f"spec.ports[{i}].nodePort", txn)
                if err:
                    errs.append(err)
                else:
                    port["nodePort"] = value
                    taken.add(value)  # type: ignore[arg-type]
        if needs_health_check_node_port(spec):
            value = spec.get("healthCheckNodePort")
            if value:
                if value in taken:  # the same allocator as the node ports, so its wording
                    errs.append(invalid("spec.healthCheckNodePort", value, "provided port is already allocated"))
                else:
                    err = self._claim_port("spec.healthCheckNodePort", value, old, taken, txn)
                    if err:
                        errs.append(err)
            else:
                value, err = self._new_port("spec.healthCheckNodePort", txn)
                if err:
                    errs.append(err)
                else:
                    spec["healthCheckNodePort"] = value
        return errs
