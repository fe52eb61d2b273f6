"""Service IP families on single-stack and dual-stack API servers, rule by rule against
kube-apiserver.

Upstream tests matched (kubernetes/kubernetes):
* `pkg/registry/core/service/storage/storage_test.go` TestCreateInitIPFields (defaults per
  policy, families and cluster: single-stack v4, v6, dual-stack v4-primary and v6-primary) and
  TestCreateInitClusterIPsFromClusterIP (clusterIP only fills clusterIPs);
* `pkg/apis/core/validation/validation_test.go` TestValidateServiceCreate (the clusterIPs and
  ipFamilies rules of ValidateServiceClusterIPsRelatedFields: more than 2 IPs, two of one family,
  a family mismatch, duplicate families, 'None' not alone) and TestValidateServiceUpdate (the
  upgrade/downgrade rules: the primary never changes, releasing the secondary needs SingleStack).
"""

from __future__ import annotations

import ipaddress

import pytest

from ebpf_proxy.apiserver import ApiError, Store

V4, V6 = "10.96.0.0/24", "fd00:10:96::/112"


@pytest.fixture
def dual():
    s = Store(service_cidr=f"{V4},{V6}")
    yield s
    s.close()


@pytest.fixture
def dual6():  # IPv6 primary
    s = Store(service_cidr=f"{V6},{V4}")
    yield s
    s.close()


@pytest.fixture
def single():
    s = Store(service_cidr=V4)
    yield s
    s.close()


@pytest.fixture
def single6():
    s = Store(service_cidr=V6)
    yield s
    s.close()


def create(store, name="web", **spec):
    spec.setdefault("ports", [{"port": 80}])
    spec.setdefault("selector", {"app": "web"})
    return store.create("Service", {"metadata": {"name": name}, "spec": spec})["spec"]


def rejected(store, **spec) -> list[tuple[str, str]]:
    with pytest.raises(ApiError) as exc:
        create(store, "bad", **spec)
    assert exc.value.code == 422, exc.value.message
    return [(c["field"], c["message"]) for c in exc.value.details["causes"]]


def in_range(ip, cidr):
    return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)


def test_single_stack_ipv4_cluster_defaults(single):
    spec = create(single)
    assert spec["ipFamilies"] == ["IPv4"] and spec["ipFamilyPolicy"] == "SingleStack"
    assert spec["clusterIPs"] == [spec["clusterIP"]] and in_range(spec["clusterIP"], V4)


def test_single_stack_ipv6_cluster_allocates_ipv6(single6):
    spec = create(single6)
    assert spec["ipFamilies"] == ["IPv6"] and in_range(spec["clusterIP"], V6)


@pytest.mark.parametrize("policy", [None, "SingleStack"])
def test_dual_stack_cluster_single_stack_gets_the_primary_family(dual, dual6, policy):
    extra = {"ipFamilyPolicy": policy} if policy else {}
    spec = create(dual, **extra)
    assert spec["ipFamilies"] == ["IPv4"] and spec["ipFamilyPolicy"] == "SingleStack"
    spec6 = create(dual6, **extra)
    assert spec6["ipFamilies"] == ["IPv6"] and in_range(spec6["clusterIP"], V6)


@pytest.mark.parametrize("policy", ["PreferDualStack", "RequireDualStack"])
def test_dual_stack_policies_get_both_primary_first(dual, dual6, policy):
    spec = create(dual, ipFamilyPolicy=policy)
    assert spec["ipFamilies"] == ["IPv4", "IPv6"] and spec["ipFamilyPolicy"] == policy
    assert in_range(spec["clusterIPs"][0], V4) and in_range(spec["clusterIPs"][1], V6)
    assert spec["clusterIP"] == spec["clusterIPs"][0]
    spec6 = create(dual6, ipFamilyPolicy=policy)
    assert spec6["ipFamilies"] == ["IPv6", "IPv4"] and in_range(spec6["clusterIP"], V6)


def test_asked_families_order_wins_over_the_primary(dual):
    spec = create(dual, ipFamilyPolicy="PreferDualStack", ipFamilies=["IPv6"])
    assert spec["ipFamilies"] == ["IPv6", "IPv4"] and in_range(spec["clusterIP"], V6)
    spec = create(dual, "v6only", ipFamilies=["IPv6"])
    assert spec["ipFamilies"] == ["IPv6"] and spec["ipFamilyPolicy"] == "SingleStack"


def test_prefer_dual_stack_on_a_single_stack_cluster_is_single(single):
    spec = create(single, ipFamilyPolicy="PreferDualStack")
    assert spec["ipFamilies"] == ["IPv4"] and len(spec["clusterIPs"]) == 1


def test_given_cluster_ips_imply_families(dual):
    # No policy on create means SingleStack, even with two IPs (initIPFamilyFields): refused.
    errs = rejected(dual, clusterIP="fd00:10:96::50", clusterIPs=["fd00:10:96::50", "10.96.0.50"])
    assert any(f == "spec.ipFamilyPolicy" and "multiple cluster IPs" in m for f, m in errs), errs
    spec = create(dual, clusterIP="fd00:10:96::50", clusterIPs=["fd00:10:96::50", "10.96.0.50"],
                  ipFamilyPolicy="RequireDualStack")
    assert spec["ipFamilies"] == ["IPv6", "IPv4"] and spec["ipFamilyPolicy"] == "RequireDualStack"
    assert spec["clusterIPs"] == ["fd00:10:96::50", "10.96.0.50"]


def test_cluster_ip_alone_fills_cluster_ips(dual):
    spec = create(dual, clusterIP="fd00:10:96::51")
    assert spec["clusterIPs"] == ["fd00:10:96::51"] and spec["ipFamilies"] == ["IPv6"]


@pytest.mark.parametrize("spec, field, message", [
    ({"ipFamilyPolicy": "RequireDualStack"}, "spec.ipFamilyPolicy", "this cluster is not configured for dual-stack services"),
    ({"ipFamilies": ["IPv6"]}, "spec.ipFamilies[0]", "not configured on this cluster"),
    ({"clusterIP": "fd00:10:96::5"}, "spec.clusterIPs[0]", "IPv6 is not configured on this cluster"),
    ({"ipFamilyPolicy": "Sometimes"}, "spec.ipFamilyPolicy", "Unsupported value"),
    ({"ipFamilies": ["IPv5"]}, "spec.ipFamilies[0]", "Unsupported value"),
])
def test_single_stack_cluster_rejects(single, spec, field, message):
    errs = rejected(single, **spec)
    assert any(f == field and message in m for f, m in errs), errs


@pytest.mark.parametrize("spec, field, message", [
    ({"ipFamilies": ["IPv4", "IPv4"], "ipFamilyPolicy": "PreferDualStack"}, "spec.ipFamilies[1]", "Duplicate value"),
    ({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "SingleStack"}, "spec.ipFamilyPolicy",
     "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9", "fd00:10:96::9"], "ipFamilyPolicy": "SingleStack"},
     "spec.ipFamilyPolicy", "when multiple cluster IPs are specified"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9", "10.96.0.10"]}, "spec.clusterIPs",
     "may specify no more than one IP for each IP family"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9", "fd00:10:96::9", "10.96.0.10"]}, "spec.clusterIPs",
     "may only hold up to 2 values"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.8"]}, "spec.clusterIPs", "first value must match `clusterIP`"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9"], "ipFamilies": ["IPv6"]}, "spec.clusterIPs[0]",
     "expected an IPv6 value as indicated by `ipFamilies[0]`"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9", "fd00:10:96::9"], "ipFamilies": ["IPv4", "IPv4"]},
     "spec.ipFamilies[1]", "Duplicate value"),
    ({"clusterIP": "None", "clusterIPs": ["None", "10.96.0.9"]}, "spec.clusterIPs", "'None' must be the first and only value"),
    ({"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9", "fd00:10:97::9"], "ipFamilyPolicy": "RequireDualStack"},
     "spec.clusterIPs[1]", "provided IP is not in the valid range. The range of valid IPs is fd00:10:96::/112"),
])
def test_dual_stack_cluster_rejects(dual, spec, field, message):
    errs = rejected(dual, **spec)
    assert any(f == field and message in m for f, m in errs), errs


def test_external_name_may_not_carry_families(dual):
    errs = rejected(dual, type="ExternalName", externalName="example.com", ports=[], ipFamilies=["IPv4"])
    assert ("spec.ipFamilies", "Forbidden: may not be set for ExternalName services") in errs


def test_headless_selectorless_defaults_to_both_families_even_single_stack(single, dual):
    spec = create(single, clusterIP="None", selector=None)
    assert spec["clusterIPs"] == ["None"] and spec["ipFamilyPolicy"] == "RequireDualStack"
    assert spec["ipFamilies"] == ["IPv4", "IPv6"]  # upstream: headless selectorless takes any family
    spec = create(dual, "with-selector", clusterIP="None")
    assert spec["ipFamilyPolicy"] == "SingleStack" and spec["ipFamilies"] == ["IPv4"]


def update(store, name, **spec_changes):
    current = store.get("Service", "default", name)
    current["spec"].update(spec_changes)
    for key, value in list(current["spec"].items()):
        if value is None:
            del current["spec"][key]
    return store.update("Service", current)["spec"]


def test_upgrade_to_dual_stack_allocates_the_secondary_keeping_the_primary(dual):
    spec = create(dual)
    primary = spec["clusterIP"]
    up = update(dual, "web", ipFamilyPolicy="PreferDualStack")
    assert up["clusterIPs"][0] == primary and in_range(up["clusterIPs"][1], V6)
    assert up["ipFamilies"] == ["IPv4", "IPv6"]
    # the secondary is really held: asking for it elsewhere fails
    errs = rejected(dual, ipFamilyPolicy="RequireDualStack", clusterIP="10.96.0.77",
                    clusterIPs=["10.96.0.77", up["clusterIPs"][1]])
    assert ("spec.clusterIPs[1]", "Invalid value: \"%s\": provided IP is already allocated" % up["clusterIPs"][1]) in errs


def test_downgrade_needs_single_stack_and_releases_the_secondary(dual):
    spec = create(dual, ipFamilyPolicy="RequireDualStack")
    secondary = spec["clusterIPs"][1]
    current = dual.get("Service", "default", "web")
    current["spec"]["clusterIPs"] = current["spec"]["clusterIPs"][:1]
    current["spec"]["ipFamilies"] = current["spec"]["ipFamilies"][:1]
    with pytest.raises(ApiError) as exc:
        dual.update("Service", current)
    fields = {(c["field"], c["message"]) for c in exc.value.details["causes"]}
    assert ("spec.ipFamilyPolicy", "Invalid value: \"RequireDualStack\": must be set to 'SingleStack' "
            "when releasing the secondary clusterIP") in fields, fields
    down = update(dual, "web", ipFamilyPolicy="SingleStack")  # same fields + SingleStack: trims
    assert down["clusterIPs"] == spec["clusterIPs"][:1] and down["ipFamilies"] == ["IPv4"]
    again = create(dual, "reuse", clusterIP=secondary)  # released on commit
    assert again["clusterIPs"] == [secondary]


def test_primary_cluster_ip_and_family_never_change(dual):
    spec = create(dual, ipFamilyPolicy="PreferDualStack")
    current = dual.get("Service", "default", "web")
    current["spec"]["clusterIPs"] = [spec["clusterIPs"][0], "fd00:10:96::99"]
    with pytest.raises(ApiError) as exc:
        dual.update("Service", current)
    assert "spec.clusterIPs[1]" in [c["field"] for c in exc.value.details["causes"]]
    current = dual.get("Service", "default", "web")
    current["spec"]["ipFamilies"] = ["IPv6", "IPv4"]
    with pytest.raises(ApiError) as exc:
        dual.update("Service", current)
    assert "spec.ipFamilies[0]" in [c["field"] for c in exc.value.details["causes"]]


def test_untouched_prefer_dual_stack_update_keeps_its_fields(dual):
    spec = create(dual, ipFamilyPolicy="PreferDualStack")
    again = update(dual, "web", ports=[{"port": 81}])
    assert again["clusterIPs"] == spec["clusterIPs"] and again["ipFamilyPolicy"] == "PreferDualStack"


def test_delete_releases_both_families(dual):
    spec = create(dual, ipFamilyPolicy="RequireDualStack")
    dual.delete("Service", "default", "web")
    again = create(dual, "next", ipFamilyPolicy="RequireDualStack", clusterIP=spec["clusterIPs"][0],
                   clusterIPs=spec["clusterIPs"])
    assert again["clusterIPs"] == spec["clusterIPs"]


def test_restart_restores_both_families(dual):
    spec = create(dual, ipFamilyPolicy="RequireDualStack")
    _, objects = dual.export_objects()
    fresh = Store(service_cidr=f"{V4},{V6}")
    try:
        fresh.restore_objects(objects)
        errs = rejected(fresh, ipFamilyPolicy="RequireDualStack", clusterIP="10.96.0.78",
                        clusterIPs=["10.96.0.78", spec["clusterIPs"][1]])
        assert any(f == "spec.clusterIPs[1]" and "already allocated" in m for f, m in errs), errs
    finally:
        fresh.close()


@pytest.mark.parametrize("cidr, message", [
    ("10.96.0.0/24,10.97.0.0/24", "a pair must be one IPv4 and one IPv6 CIDR"),
    ("fd00::/64", "a /108 to a /126"),
    ("10.96.0.0/24,fd00::/112,fd01::/112", "one CIDR or a comma-separated pair"),
])
def test_bad_service_ranges_are_refused(cidr, message):
    with pytest.raises(ValueError, match=message):
        Store(service_cidr=cidr)
