"""EndpointSlices per IP family, as kube-controller-manager's reconcileByAddressType: a
dual-stack Service gets an IPv4 and an IPv6 set, each endpoint the Pod's address of that family;
a family the Service drops loses its slices. (Upstream behaviour matched: the endpointslice
reconciler's `reconcile` looping over `getAddressTypesForService` and deleting slices of other
address types, and `reconcileByAddressType`'s one placeholder per address type.)"""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import Store
from ebpf_proxy.lab.slicecontroller import SERVICE_NAME_LABEL, EndpointSliceController, address_types


@pytest.fixture
def store():
    s = Store(service_cidr="10.96.0.0/16,fd00:10:96::/112")
    yield s
    s.close()


@pytest.fixture
def controller(store):
    c = EndpointSliceController(store).start()
    assert c.wait_synced()
    yield c
    c.stop()


def service(store, name="web", **spec):
    return store.create("Service", {"metadata": {"name": name},
                                    "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}], **spec}})


def pod(store, name, *ips, node="node-1"):
    return store.create("Pod", {
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {"nodeName": node, "containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips]},
    })


def by_type(store, controller, name="web") -> dict[str, list[str]]:
    assert controller.wait_synced()
    items, _ = store.list("EndpointSlice", "default", label_selector={SERVICE_NAME_LABEL: name})
    out: dict[str, list[str]] = {}
    for s in items:
        out.setdefault(s["addressType"], []).extend(a for ep in s["endpoints"] for a in ep["addresses"])
    return {k: sorted(v) for k, v in out.items()}


def test_dual_stack_service_gets_a_slice_per_family(store, controller):
    service(store, ipFamilyPolicy="RequireDualStack")
    pod(store, "a", "10.244.1.2", "fd00:10:244:1::2")
    pod(store, "b", "fd00:10:244:2::2", "10.244.2.2", node="node-2")  # IPv6-primary pod: same result
    pod(store, "c", "10.244.3.2")  # IPv4 only: in the IPv4 slice only
    assert by_type(store, controller) == {
        "IPv4": ["10.244.1.2", "10.244.2.2", "10.244.3.2"],
        "IPv6": ["fd00:10:244:1::2", "fd00:10:244:2::2"],
    }


def test_single_stack_services_get_their_family_only(store, controller):
    service(store, "v4")
    service(store, "v6", ipFamilies=["IPv6"])
    pod(store, "a", "10.244.1.2", "fd00:10:244:1::2")
    assert by_type(store, controller, "v4") == {"IPv4": ["10.244.1.2"]}
    assert by_type(store, controller, "v6") == {"IPv6": ["fd00:10:244:1::2"]}


def test_empty_placeholder_per_family(store, controller):
    service(store, ipFamilyPolicy="PreferDualStack")
    assert by_type(store, controller) == {"IPv4": [], "IPv6": []}


def test_downgrade_deletes_the_dropped_familys_slices(store, controller):
    service(store, ipFamilyPolicy="PreferDualStack")
    pod(store, "a", "10.244.1.2", "fd00:10:244:1::2")
    assert set(by_type(store, controller)) == {"IPv4", "IPv6"}
    current = store.get("Service", "default", "web")
    current["spec"]["ipFamilyPolicy"] = "SingleStack"
    store.update("Service", current)
    assert by_type(store, controller) == {"IPv4": ["10.244.1.2"]}


def test_address_types_default_to_ipv4_for_old_objects():
    assert address_types({"spec": {}}) == ["IPv4"]
    assert address_types({"spec": {"ipFamilies": ["IPv6", "IPv4"]}}) == ["IPv6", "IPv4"]
