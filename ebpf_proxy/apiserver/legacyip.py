"""Legacy IP and CIDR fields: accepted as kube-apiserver accepts them, with its warnings.

Without strict IP validation (the default), kube-apiserver validates the IP fields of Services
and EndpointSlices with the sloppy parser (k8s.io/apimachinery util/validation/ip.go,
IsValidIPForLegacyField / IsValidCIDRForLegacyField): `10.180.00.001` is accepted and stored as
written, and the response carries a `Warning: 299 - "..."` header from GetWarningsForIP /
GetWarningsForCIDR (pkg/api/service/warnings.go, the Service status strategy, and the
EndpointSlice strategy). Clients such as kube-proxy must then cope with the stored value, which is
the point: the lab has to be able to hold such objects.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from ebpf_proxy.model import ipsloppy

INVALID_IP = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)"
INVALID_CIDR = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)"

# Slices written by these controllers get no warnings (the EndpointSlice strategy skips them).
_CONTROLLERS = ("endpointslice-controller.k8s.io", "endpointslicemirroring-controller.k8s.io")
_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"


def _q(value: str) -> str:
    """Go's %q for the ASCII strings involved."""
    return json.dumps(value)


def ip_warnings(field: str, value: Any) -> list[str]:
    """GetWarningsForIP: a non-standard form (leading zeros, IPv4-mapped) or non-canonical IPv6."""
    ip = ipsloppy.parse_ip(value)
    if ip is None:
        return []  # invalid, not merely non-standard: validation reports it
    if not ipsloppy.is_standard_ip(value):
        return [f"{field}: non-standard IP address {_q(value)} will be considered invalid in a future "
                f"Kubernetes release: use {_q(str(ip))}"]
    if ip.version == 6 and str(ip) != value:
        return [f"{field}: IPv6 address {_q(value)} should be in RFC 5952 canonical format ({_q(str(ip))})"]
    return []


def cidr_warnings(field: str, value: Any) -> list[str]:
    """GetWarningsForCIDR: bits set past the prefix, non-standard forms, non-canonical IPv6."""
    parsed = ipsloppy.parse_cidr(value)
    if parsed is None:
        return []
    addr, net = parsed
    warnings = []
    if addr != net.network_address:
        warnings.append(f"{field}: CIDR value {_q(value)} is ambiguous in this context "
                        f"(should be {_q(str(net))} or {_q(f'{addr}/{net.max_prefixlen}')}?)")
    addr_text, _, bits_text = value.partition("/")
    if not ipsloppy.is_standard_ip(addr_text) or (len(bits_text) > 1 and bits_text.startswith("0")):
        warnings.append(f"{field}: non-standard CIDR value {_q(value)} will be considered invalid in a future "
                        f"Kubernetes release: use {_q(str(net))}")
    if not warnings and net.version == 6 and str(ipaddress.ip_interface(value)) != value:
        canonical = str(ipaddress.ip_interface(value))
        warnings.append(f"{field}: IPv6 CIDR value {_q(value)} should be in RFC 5952 canonical format ({_q(canonical)})")
    return warnings


def service_warnings(svc: dict[str, Any]) -> list[str]:
    """The IP warnings of GetWarningsForService, for a create or an update of the Service."""
    spec = svc.get("spec") or {}
    out: list[str] = []
    if spec.get("clusterIP") not in (None, "", "None"):
        for i, ip in enumerate(spec.get("clusterIPs") or []):
            out += ip_warnings(f"spec.clusterIPs[{i}]", ip)
    for i, ip in enumerate(spec.get("externalIPs") or []):
        out += ip_warnings(f"spec.externalIPs[{i}]", ip)
    if spec.get("loadBalancerIP"):
        out += ip_warnings("spec.loadBalancerIP", spec["loadBalancerIP"])
    for i, cidr in enumerate(spec.get("loadBalancerSourceRanges") or []):
        out += cidr_warnings(f"spec.loadBalancerSourceRanges[{i}]", cidr)
    return out


def service_status_warnings(svc: dict[str, Any]) -> list[str]:
    """The Service status strategy's warnings (its field path stops at the ingress entry)."""
    out: list[str] = []
    ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    for i, entry in enumerate(ingress):
        if isinstance(entry, dict) and entry.get("ip"):
            out += ip_warnings(f"status.loadBalancer.ingress[{i}]", entry["ip"])
    return out


def endpoint_slice_warnings(obj: dict[str, Any]) -> list[str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if labels.get(_MANAGED_BY) in _CONTROLLERS:
        return []
    out: list[str] = []
    for i, ep in enumerate(obj.get("endpoints") or []):
        for j, addr in enumerate((ep or {}).get("addresses") or []):
            out += ip_warnings(f"endpoints[{i}].addresses[{j}]", addr)
    return out


def warnings_for_write(kind: str, obj: dict[str, Any], subresource: str | None, created: bool) -> list[str]:
    """What kube-apiserver would warn about for this successful write of `obj`.

    A Service create warns about status too: the lab keeps the status a create sends (a real
    server resets it), so it checks it the way the status strategy would."""
    if kind == "Service":
        if subresource == "status":
            return service_status_warnings(obj)
        return service_warnings(obj) + (service_status_warnings(obj) if created else [])
    if kind == "EndpointSlice":
        return endpoint_slice_warnings(obj)
    return []
