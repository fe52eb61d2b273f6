"""Object validation for everything but Services (see services.py): metadata, Pods, Nodes,
EndpointSlices, Namespaces and core Events.

Deliberately close to the real rules where a client bug would otherwise slip through (an
EndpointSlice address that is not an IPv4 address for `addressType: IPv4`, a label that a real
server rejects), and deliberately lenient where the lab writes synthetic objects (a Pod needs
named containers but no image).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from ebpf_proxy.apiserver import events, names
from ebpf_proxy.apiserver.errors import FieldError, duplicate, invalid, not_supported, required, too_many
from ebpf_proxy.model import ipsloppy

ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
PROTOCOLS = ("TCP", "UDP", "SCTP")

# Name rules per storage kind (the real server's ValidateObjectMeta name functions).
_NAME_RULES = {
    "Service": names.dns1035_label,
    "Namespace": names.dns1123_label,
}


def _path_segment(value: str) -> str | None:
    if value in (".", ".."):
        return f"may not be {value!r}"
    for bad in ("/", "%"):
        if bad in value:
            return f"may not contain {bad!r}"
    return None


def validate_name(kind: str, name: str) -> str | None:
    if kind == "Event":
        return _path_segment(name)
    return _NAME_RULES.get(kind, names.dns1123_subdomain)(name)


def validate_metadata(kind: str, meta: dict[str, Any]) -> list[FieldError]:
    errs: list[FieldError] = []
    name = meta.get("name")
    if not name:
        errs.append(required("metadata.name", "name or generateName is required"))
    elif not isinstance(name, str):
        errs.append(invalid("metadata.name", name, "must be a string"))
    else:
        why = validate_name(kind, name)
        if why:
            errs.append(invalid("metadata.name", name, why))
    for field, check_values in (("labels", True), ("annotations", False)):
        values = meta.get(field)
        if values is None:
            continue
        if not isinstance(values, dict):
            errs.append(invalid(f"metadata.{field}", values, "must be a map of string keys to string values"))
            continue
        for key, value in values.items():
            why = names.label_key(key)
            if why:
                errs.append(invalid(f"metadata.{field}", key, why))
            elif not isinstance(value, str):
                errs.append(invalid(f"metadata.{field}[{key}]", value, "must be a string"))
            elif check_values:
                why = names.label_value(value)
                if why:
                    errs.append(invalid(f"metadata.{field}[{key}]", value, why))
    return errs


def _check_ip(field: str, value: Any, family: int, errs: list[FieldError]) -> None:
    """IsValidIPv4Address / IsValidIPv6Address: sloppy, so `10.180.00.001` is a valid IPv4
    address (stored as written, with a warning), and so is `::ffff:10.180.0.1`, as upstream."""
    addr = ipsloppy.parse_ip(value)
    if addr is None or addr.version != family:
        errs.append(invalid(field, value, f"must be a valid IPv{family} address"))


def validate_endpoint_slice(obj: dict[str, Any]) -> list[FieldError]:
    """Checks from `pkg/apis/discovery/validation`; also defaults port protocol and endpoints []."""
    errs: list[FieldError] = []
    address_type = obj.get("addressType")
    if not address_type:
        errs.append(required("addressType"))
    elif address_type not in ADDRESS_TYPES:
        errs.append(not_supported("addressType", address_type, ADDRESS_TYPES))
    endpoints = obj.setdefault("endpoints", [])
    if endpoints is None:
        endpoints = obj["endpoints"] = []
    if not isinstance(endpoints, list):
        errs.append(invalid("endpoints", endpoints, "must be a list"))
        endpoints = []
    if len(endpoints) > 1000:
        errs.append(invalid("endpoints", len(endpoints), "must have at most 1000 items"))
    for i, ep in enumerate(endpoints):
        at = f"endpoints[{i}]"
        if not isinstance(ep, dict):
            errs.append(invalid(at, ep, "must be an object"))
            continue
        addresses = ep.get("addresses")
        if not addresses:
            errs.append(required(f"{at}.addresses", "must contain at least 1 address"))
        elif not isinstance(addresses, list) or len(addresses) > 100:
            errs.append(invalid(f"{at}.addresses", addresses, "must be a list of 1 to 100 addresses"))
        else:
            for j, addr in enumerate(addresses):
                field = f"{at}.addresses[{j}]"
                if address_type == "IPv4":
                    _check_ip(field, addr, 4, errs)
                elif address_type == "IPv6":
                    _check_ip(field, addr, 6, errs)
                elif address_type == "FQDN":
                    why = names.dns1123_subdomain(str(addr))
                    if why:
                        errs.append(invalid(field, addr, why))
        for cond, value in (ep.get("conditions") or {}).items():
            if value is not None and not isinstance(value, bool):
                errs.append(invalid(f"{at}.conditions.{cond}", value, "must be a boolean"))
        node = ep.get("nodeName")
        if node is not None:
            why = names.dns1123_subdomain(str(node))
            if why:
                errs.append(invalid(f"{at}.nodeName", node, why))
        if ep.get("hints") is not None:
            _validate_hints(f"{at}.hints", ep["hints"], errs)
    ports = obj.get("ports")
    if ports is not None:
        if not isinstance(ports, list):
            errs.append(invalid("ports", ports, "must be a list"))
            ports = []
        if len(ports) > 20000:
            errs.append(invalid("ports", len(ports), "must have at most 20000 items"))
        seen: set[str] = set()
        for i, port in enumerate(ports):
            at = f"ports[{i}]"
            if not isinstance(port, dict):
                errs.append(invalid(at, port, "must be an object"))
                continue
            port.setdefault("name", "")
            port.setdefault("protocol", "TCP")
            name = port["name"]
            if name:
                why = names.dns1123_label(str(name))
                if why:
                    errs.append(invalid(f"{at}.name", name, why))
            if name in seen:
                errs.append(invalid(f"{at}.name", name, "duplicate port name"))
            seen.add(name)
            number = port.get("port")
            if number is not None and (not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535):
                errs.append(invalid(f"{at}.port", number, "must be between 1 and 65535, inclusive"))
            if port["protocol"] not in PROTOCOLS:
                errs.append(not_supported(f"{at}.protocol", port["protocol"], PROTOCOLS))
    return errs


MAX_HINTS = 8  # per kind, as pkg/apis/discovery/validation (maxZoneHints, maxNodeHints)


def _validate_hints(at: str, hints: Any, errs: list[FieldError]) -> None:
    """An endpoint's topology hints, as pkg/apis/discovery/validation's validateHints: at most 8
    of each, no duplicates, zone names valid label values, node names valid node names."""
    if not isinstance(hints, dict):
        errs.append(invalid(at, hints, "must be an object"))
        return
    for key, check in (("forZones", names.label_value), ("forNodes", names.dns1123_subdomain)):
        entries = hints.get(key)
        if entries is None:
            continue
        if not isinstance(entries, list):
            errs.append(invalid(f"{at}.{key}", entries, "must be a list"))
            continue
        if len(entries) > MAX_HINTS:
            errs.append(too_many(f"{at}.{key}", len(entries), MAX_HINTS))
            continue
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            field = f"{at}.{key}[{i}].name"
            name = entry.get("name") if isinstance(entry, dict) else None
            if not isinstance(name, str):
                errs.append(invalid(field, name, "must be a string"))
                continue
            if name in seen:
                errs.append(duplicate(field, name))
                continue
            seen.add(name)
            why = check(name)
            if why:
                errs.append(invalid(field, name, why))


def validate_pod(obj: dict[str, Any]) -> list[FieldError]:
    errs: list[FieldError] = []
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    containers = spec.get("containers")
    if not containers or not isinstance(containers, list):
        errs.append(required("spec.containers"))
        containers = []
    seen: set[str] = set()
    for i, container in enumerate(containers):
        at = f"spec.containers[{i}]"
        if not isinstance(container, dict):
            errs.append(invalid(at, container, "must be an object"))
            continue
        name = container.get("name")
        if not name:
            errs.append(required(f"{at}.name"))
        elif name in seen:
            errs.append(invalid(f"{at}.name", name, "duplicate container name"))
        seen.add(name or "")
        for j, port in enumerate(container.get("ports") or []):
            number = port.get("containerPort") if isinstance(port, dict) else None
            if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535:
                errs.append(invalid(f"{at}.ports[{j}].containerPort", number, "must be between 1 and 65535, inclusive"))
            port_name = port.get("name") if isinstance(port, dict) else None
            if port_name:
                why = names.iana_svc_name(str(port_name))
                if why:
                    errs.append(invalid(f"{at}.ports[{j}].name", port_name, why))
    status = obj.get("status") or {}
    if status.get("podIP"):
        try:
            ipaddress.ip_address(status["podIP"])
        except ValueError:
            errs.append(invalid("status.podIP", status["podIP"], "must be a valid IP address"))
    return errs


def validate_event(obj: dict[str, Any]) -> list[FieldError]:
    return events.validate_core(obj)


def default_namespace(obj: dict[str, Any]) -> None:
    obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    obj.setdefault("status", {}).setdefault("phase", "Active")


def default_pod(obj: dict[str, Any]) -> None:
    obj.setdefault("status", {}).setdefault("phase", "Pending")
