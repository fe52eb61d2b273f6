"""A Service's IP families: `ipFamilyPolicy`, `ipFamilies` and `clusterIPs`, as kube-apiserver
validates and defaults them.

Why a module of its own: these three fields interact (a policy decides how many families, the
families decide which ranges the cluster IPs come from, given cluster IPs imply families) and
the rules differ between create and update (upgrade to dual-stack, downgrade to single-stack).
Keeping them here keeps `services.py` about the rest of the Service.

Sources, matched rule by rule and message by message (field paths included):

* `validate_cluster_ips_related_fields`: `ValidateServiceClusterIPsRelatedFields` in
  `pkg/apis/core/validation/validation.go`;
* `validate_upgrade_downgrade`: `validateUpgradeDowngradeClusterIPs` and
  `validateUpgradeDowngradeIPFamilies` of the same file (ValidateServiceUpdate);
* `init_ip_family_fields`: `(*Allocators).initIPFamilyFields` in
  `pkg/registry/core/service/storage/alloc.go`.

`families` below is the cluster's configured families, primary (the first of the
`--service-cluster-ip-range` pair) first, e.g. `("IPv4", "IPv6")`.
"""

from __future__ import annotations

from typing import Any

from ebpf_proxy.apiserver import legacyip
from ebpf_proxy.apiserver.errors import FieldError, duplicate, invalid, not_supported, required
from ebpf_proxy.model import ipsloppy

FAMILIES = ("IPv4", "IPv6")
POLICIES = ("PreferDualStack", "RequireDualStack", "SingleStack")  # sets.List order, as upstream prints


def family_of(ip: str) -> str | None:
    addr = ipsloppy.parse_ip(ip)
    return None if addr is None else f"IPv{addr.version}"


def other(family: str) -> str:
    return "IPv6" if family == "IPv4" else "IPv4"


def is_headless(spec: dict[str, Any]) -> bool:
    ips = spec.get("clusterIPs") or []
    return len(ips) == 1 and ips[0] == "None"


def _list(spec: dict[str, Any], key: str) -> list[Any]:
    value = spec.get(key)
    return value if isinstance(value, list) else []


def normalize_cluster_ips(spec: dict[str, Any], old_spec: dict[str, Any] | None) -> None:
    """NormalizeClusterIPs (the Service strategy): an old client writes `clusterIP` only; make
    `clusterIPs` follow it (on create; on update when it changed and `clusterIPs` did not)."""
    cluster_ip = spec.get("clusterIP") or ""
    if old_spec is None:
        if cluster_ip and not spec.get("clusterIPs"):
            spec["clusterIPs"] = [cluster_ip]
        return
    if cluster_ip != (old_spec.get("clusterIP") or "") and spec.get("clusterIPs") == old_spec.get("clusterIPs"):
        if cluster_ip:
            spec["clusterIPs"] = [cluster_ip]
        else:
            spec.pop("clusterIPs", None)


def validate_cluster_ips_related_fields(spec: dict[str, Any]) -> list[FieldError]:
    """ValidateServiceClusterIPsRelatedFields: clusterIP/clusterIPs in sync, families known and
    not repeated, at most two IPs of different families, each IP of its stated family."""
    if spec.get("type") == "ExternalName":
        return []
    errs: list[FieldError] = []
    cluster_ip = spec.get("clusterIP") or ""
    raw_ips = spec.get("clusterIPs")
    if raw_ips is not None and not isinstance(raw_ips, list):
        return [invalid("spec.clusterIPs", raw_ips, "must be a list")]
    ips = raw_ips or []
    if cluster_ip:
        if not ips:
            errs.append(required("spec.clusterIPs"))
        elif ips[0] != cluster_ip:
            errs.append(invalid("spec.clusterIPs", ips, "first value must match `clusterIP`"))
    elif ips:
        errs.append(invalid("spec.clusterIPs", ips, "must be empty when `clusterIP` is not specified"))

    raw_families = spec.get("ipFamilies")
    if raw_families is not None and not isinstance(raw_families, list):
        errs.append(invalid("spec.ipFamilies", raw_families, "must be a list"))
    seen: set[Any] = set()
    for i, family in enumerate(_list(spec, "ipFamilies")):
        if family not in FAMILIES:
            errs.append(not_supported(f"spec.ipFamilies[{i}]", family, FAMILIES))
        if isinstance(family, str) and family in seen:
            errs.append(duplicate(f"spec.ipFamilies[{i}]", family))
        if isinstance(family, str):
            seen.add(family)

    policy = spec.get("ipFamilyPolicy")
    if policy is not None and policy not in POLICIES:
        errs.append(not_supported("spec.ipFamilyPolicy", policy, POLICIES))

    bad_ips = False
    for i, ip in enumerate(ips):
        if i == 0 and ip == "None":
            if len(ips) > 1:
                bad_ips = True
                errs.append(invalid("spec.clusterIPs", ips, "'None' must be the first and only value"))
            continue
        if not isinstance(ip, str) or ipsloppy.parse_ip(ip) is None:
            bad_ips = True
            if not (i == 0 and ip == cluster_ip):  # services.validate reported it as spec.clusterIP
                errs.append(invalid(f"spec.clusterIPs[{i}]", ip, legacyip.INVALID_IP))
    if len(ips) > 2:
        errs.append(invalid("spec.clusterIPs", ips, "may only hold up to 2 values"))
    if bad_ips:
        return errs
    if len(ips) > 1 and len({family_of(ip) for ip in ips}) != len(ips):
        errs.append(invalid("spec.clusterIPs", ips, "may specify no more than one IP for each IP family"))
    families = _list(spec, "ipFamilies")
    if not is_headless(spec) and ips and families:
        for i, ip in enumerate(ips[:len(families)]):
            fam = family_of(ip)
            if families[i] in FAMILIES and fam != families[i]:
                errs.append(invalid(f"spec.clusterIPs[{i}]", ip, f"expected an {families[i]} value as indicated by `ipFamilies[{i}]`"))
    return errs


def validate_upgrade_downgrade(spec: dict[str, Any], old_spec: dict[str, Any]) -> list[FieldError]:
    """validateUpgradeDowngradeClusterIPs + validateUpgradeDowngradeIPFamilies: a secondary IP
    or family may be added or removed (removing needs SingleStack), the primary never changes.
    Upstream's quirks are kept: its family check tests clusterIPs for "can not be unset"."""
    if "ExternalName" in (spec.get("type"), old_spec.get("type")):
        return []
    errs: list[FieldError] = []
    old_ips, ips = _list(old_spec, "clusterIPs"), _list(spec, "clusterIPs")
    single = spec.get("ipFamilyPolicy") == "SingleStack"
    if not (is_headless(old_spec) and is_headless(spec)):
        if len(old_ips) == len(ips):
            for i, ip in enumerate(old_ips):
                if ip != ips[i]:
                    errs.append(invalid(f"spec.clusterIPs[{i}]", ips, "may not change once set"))
        elif len(old_ips) > len(ips):
            if not ips:
                errs.append(invalid("spec.clusterIPs[0]", ips, "primary clusterIP can not be unset"))
            if old_ips and ips and ips[0] != old_ips[0]:
                errs.append(invalid("spec.clusterIPs[0]", ips, "may not change once set"))
            if len(ips) == 1 and not single:
                errs.append(invalid("spec.ipFamilyPolicy", spec.get("ipFamilyPolicy"),
                                    "must be set to 'SingleStack' when releasing the secondary clusterIP"))
        elif old_ips and ips[0] != old_ips[0]:
            errs.append(invalid("spec.clusterIPs[0]", ips, "may not change once set"))
    if is_headless(old_spec) != is_headless(spec) or is_headless(spec):
        return errs
    old_fams, fams = _list(old_spec, "ipFamilies"), _list(spec, "ipFamilies")
    if len(old_fams) == len(fams):
        for i, fam in enumerate(old_fams):
            if fam != fams[i]:
                errs.append(invalid("spec.ipFamilies[0]", fams, "may not change once set"))
    elif len(old_fams) > len(fams):
        if not ips:
            errs.append(invalid("spec.ipFamilies[0]", fams, "primary ipFamily can not be unset"))
        if fams and fams[0] != old_fams[0]:
            errs.append(invalid("spec.ipFamilies[0]", ips, "may not change once set"))
        if len(fams) == 1 and not single:
            errs.append(invalid("spec.ipFamilyPolicy", spec.get("ipFamilyPolicy"),
                                "must be set to 'SingleStack' when releasing the secondary ipFamily"))
    elif old_fams and fams and fams[0] != old_fams[0]:
        errs.append(invalid("spec.ipFamilies[0]", ips, "may not change once set"))
    return errs


def _matching_prefer_dual_stack(spec: dict[str, Any], old_spec: dict[str, Any] | None) -> bool:
    """isMatchingPreferDualStackClusterIPFields: an untouched PreferDualStack Service is left as
    it is, so a cluster gaining or losing a family never upgrades or downgrades it by itself."""
    if old_spec is None or old_spec.get("ipFamilyPolicy") != "PreferDualStack":
        return False
    if spec.get("ipFamilyPolicy") != "PreferDualStack":
        return False
    return (_list(spec, "clusterIPs") == _list(old_spec, "clusterIPs")
            and _list(spec, "ipFamilies") == _list(old_spec, "ipFamilies"))


def init_ip_family_fields(spec: dict[str, Any], old_spec: dict[str, Any] | None,
                          families: tuple[str, ...]) -> list[FieldError]:
    """initIPFamilyFields: default `ipFamilyPolicy` and `ipFamilies` against the cluster's
    `families`, in place; returns the errors (then the caller stores nothing)."""
    if spec.get("type") == "ExternalName":
        return []
    if _matching_prefer_dual_stack(spec, old_spec):
        return []
    if spec.get("ipFamilyPolicy") is None:
        if old_spec is not None and old_spec.get("ipFamilyPolicy") is not None:
            spec["ipFamilyPolicy"] = old_spec["ipFamilyPolicy"]
        elif spec.get("clusterIP") == "None" and not spec.get("selector"):
            spec["ipFamilyPolicy"] = "RequireDualStack"  # headless + selectorless defaults to dual
        else:
            spec["ipFamilyPolicy"] = "SingleStack"
    errs = validate_cluster_ips_related_fields(spec)
    if errs:
        return errs
    policy = spec["ipFamilyPolicy"]
    ips = list(_list(spec, "clusterIPs"))
    fams = list(_list(spec, "ipFamilies"))
    if old_spec is not None:
        if policy == "SingleStack":
            # Same fields as before plus SingleStack is a clear request to downgrade.
            if ips == _list(old_spec, "clusterIPs") and len(ips) > 1:
                ips = spec["clusterIPs"] = ips[:1]
            if fams == _list(old_spec, "ipFamilies") and len(fams) > 1:
                fams = spec["ipFamilies"] = fams[:1]
        else:
            if len(ips) < len(_list(old_spec, "clusterIPs")):
                errs.append(invalid("spec.ipFamilyPolicy", policy, "must be 'SingleStack' to release the secondary cluster IP"))
            if len(fams) < len(_list(old_spec, "ipFamilies")):
                errs.append(invalid("spec.ipFamilyPolicy", policy, "must be 'SingleStack' to release the secondary IP family"))
    if policy == "SingleStack":
        if len(ips) == 2:
            errs.append(invalid("spec.ipFamilyPolicy", policy,
                                "must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified"))
        if len(fams) == 2:
            errs.append(invalid("spec.ipFamilyPolicy", policy,
                                "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified"))
    for i, ip in enumerate(ips):
        if ip == "None":
            break
        fam = family_of(ip)
        if i >= len(fams):
            if fam not in families:
                errs.append(invalid(f"spec.clusterIPs[{i}]", ips, f"{fam} is not configured on this cluster"))
            else:
                fams.append(fam)
    if errs:
        return errs
    if fams:
        spec["ipFamilies"] = fams
    if spec.get("clusterIP") == "None" and not spec.get("selector"):
        # Headless and selectorless: any families, configured or not (the slices are hand-written).
        if not fams:
            fams = [families[0]]
        if len(fams) < 2 and policy != "SingleStack":
            fams.append(other(fams[0]))
        spec["ipFamilies"] = fams
        return []
    if policy == "RequireDualStack" and len(families) < 2:
        errs.append(invalid("spec.ipFamilyPolicy", policy, "this cluster is not configured for dual-stack services"))
    for i, fam in enumerate(fams):
        if fam not in families:
            errs.append(invalid(f"spec.ipFamilies[{i}]", fam, "not configured on this cluster"))
    if errs:
        return errs
    if not fams:
        fams = [families[0]]
    if policy != "SingleStack" and len(fams) == 1 and len(families) == 2:
        fams.append(other(fams[0]))
    spec["ipFamilies"] = fams
    return []
