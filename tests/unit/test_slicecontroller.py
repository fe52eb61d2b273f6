"""The lab's EndpointSlice controller against an in-process Store."""

from __future__ import annotations

import pytest

from ebpf_proxy.lab.slicecontroller import MANAGED_BY, MANAGED_BY_LABEL, SERVICE_NAME_LABEL
from tests.unit.slicectl import controller, endpoints, running_controller, slices, store  # noqa: F401 - fixtures


def service(store, name="web", selector=None, ports=None, **spec):
    body = {"metadata": {"name": name, "labels": {"team": "lab"}},
            "spec": {"ports": ports or [{"name": "http", "port": 80, "targetPort": 8080}], **spec}}
    if selector is not None:
        body["spec"]["selector"] = selector
    return store.create("Service", body)


def pod(store, name, ip, labels=None, node="node-1", ready=None, container_ports=None):
    body = {"metadata": {"name": name, "labels": labels if labels is not None else {"app": "web"}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "ports": container_ports or []}]},
            "status": {"phase": "Running"}}
    if ip:
        body["status"]["podIP"] = ip
    if ready is not None:
        body["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return store.create("Pod", body)


def test_slice_for_a_service_with_ready_pods(store, controller):
    svc = service(store, selector={"app": "web"})
    p1 = pod(store, "web-1", "10.1.0.1")
    pod(store, "web-2", "10.1.0.2", node="node-2")
    pod(store, "other", "10.1.0.9", labels={"app": "other"})
    pod(store, "no-ip", None)
    (slice_,) = slices(store, controller)
    meta = slice_["metadata"]
    assert meta["labels"][SERVICE_NAME_LABEL] == "web"
    assert meta["labels"][MANAGED_BY_LABEL] == MANAGED_BY
    assert meta["labels"]["team"] == "lab", "service labels are copied, as upstream"
    assert meta["name"].startswith("web-")
    assert meta["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
    assert slice_["addressType"] == "IPv4"
    assert slice_["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    assert slice_["endpoints"][0] == {
        "addresses": ["10.1.0.1"],
        "conditions": {"ready": True, "serving": True, "terminating": False},
        "targetRef": {"kind": "Pod", "namespace": "default", "name": "web-1", "uid": p1["metadata"]["uid"]},
        "nodeName": "node-1",
    }
    assert [ep["nodeName"] for ep in slice_["endpoints"]] == ["node-1", "node-2"]


def test_pod_added_and_removed(store, controller):
    service(store, selector={"app": "web"})
    assert endpoints(store, controller) == []
    pod(store, "web-1", "10.1.0.1")
    assert [ep["addresses"] for ep in endpoints(store, controller)] == [["10.1.0.1"]]
    pod(store, "web-2", "10.1.0.2")
    assert [ep["addresses"] for ep in endpoints(store, controller)] == [["10.1.0.1"], ["10.1.0.2"]]
    store.delete("Pod", "default", "web-1")
    assert [ep["addresses"] for ep in endpoints(store, controller)] == [["10.1.0.2"]]
    assert len(slices(store, controller)) == 1


def test_pod_gets_its_ip_later(store, controller):
    service(store, selector={"app": "web"})
    pod(store, "web-1", None)
    assert endpoints(store, controller) == []
    store.patch("Pod", "default", "web-1", {"status": {"podIP": "10.1.0.1"}}, subresource="status")
    assert [ep["addresses"] for ep in endpoints(store, controller)] == [["10.1.0.1"]]


def test_readiness_change(store, controller):
    service(store, selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1", ready=True)
    assert endpoints(store, controller)[0]["conditions"] == {"ready": True, "serving": True, "terminating": False}
    store.patch("Pod", "default", "web-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                subresource="status")
    assert endpoints(store, controller)[0]["conditions"] == {"ready": False, "serving": False, "terminating": False}


def test_publish_not_ready_addresses(store, controller):
    service(store, selector={"app": "web"}, publishNotReadyAddresses=True)
    pod(store, "web-1", "10.1.0.1", ready=False)
    assert endpoints(store, controller)[0]["conditions"] == {"ready": True, "serving": False, "terminating": False}


def test_terminating_pod_stays_as_terminating_until_gone(store, controller):
    service(store, selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1")
    store.delete("Pod", "default", "web-1", grace_period_seconds=60)
    assert endpoints(store, controller)[0]["conditions"] == {"ready": False, "serving": True, "terminating": True}
    store.delete("Pod", "default", "web-1", grace_period_seconds=0)
    assert endpoints(store, controller) == []


def test_finished_pods_are_left_out(store, controller):
    service(store, selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1")
    store.patch("Pod", "default", "web-1", {"status": {"phase": "Succeeded"}}, subresource="status")
    assert endpoints(store, controller) == []


def test_pod_label_change_moves_it_between_services(store, controller):
    service(store, "web", selector={"app": "web"})
    service(store, "api", selector={"app": "api"})
    pod(store, "p", "10.1.0.1", labels={"app": "web"})
    assert len(endpoints(store, controller, "web")) == 1 and endpoints(store, controller, "api") == []
    store.patch("Pod", "default", "p", {"metadata": {"labels": {"app": "api"}}})
    assert endpoints(store, controller, "web") == [] and len(endpoints(store, controller, "api")) == 1


def test_named_target_port_resolved_per_pod(store, controller):
    service(store, selector={"app": "web"}, ports=[{"name": "http", "port": 80, "targetPort": "web"},
                                                   {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"}])
    pod(store, "web-1", "10.1.0.1", container_ports=[{"name": "web", "containerPort": 8080},
                                                     {"name": "dns", "containerPort": 5353, "protocol": "UDP"}])
    pod(store, "web-2", "10.1.0.2", container_ports=[{"name": "web", "containerPort": 9090}])
    by_ports = {tuple((p["name"], p["port"], p["protocol"]) for p in s["ports"]): [ep["addresses"][0] for ep in s["endpoints"]]
                for s in slices(store, controller)}
    assert by_ports == {
        (("http", 8080, "TCP"), ("dns", 5353, "UDP")): ["10.1.0.1"],
        (("http", 9090, "TCP"),): ["10.1.0.2"],
    }


def test_selectorless_services_are_left_to_the_user(store, controller):
    service(store, "manual")
    user_slice = store.create("EndpointSlice", {
        "metadata": {"name": "manual-1", "labels": {SERVICE_NAME_LABEL: "manual"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["192.0.2.1"]}], "ports": [{"port": 80}],
    })
    pod(store, "web-1", "10.1.0.1")
    (only,) = slices(store, controller, "manual")
    assert only["metadata"]["resourceVersion"] == user_slice["metadata"]["resourceVersion"]


def test_selectorless_services_cost_no_slice_scan(store, controller, monkeypatch):
    """The bench creates 10,000 selector-less Services at once: reconciling each must not scan
    every EndpointSlice (that was O(N^2) and kept the API server busy for minutes), while a
    Service that had managed slices still gets them removed when its selector goes (see below)."""
    scans = []
    real_list = store.list
    monkeypatch.setattr(store, "list", lambda kind, *a, **kw: (scans.append(kind), real_list(kind, *a, **kw))[1])
    for i in range(20):
        service(store, f"manual-{i}")
    assert controller.wait_synced()
    assert "EndpointSlice" not in scans


def test_service_without_pods_gets_an_empty_placeholder(store, controller):
    service(store, selector={"app": "none"})
    (slice_,) = slices(store, controller)
    assert slice_["endpoints"] == [] and slice_["ports"] == []


def test_service_deleted_or_selector_removed_deletes_managed_slices(store, controller):
    service(store, "web", selector={"app": "web"})
    service(store, "api", selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1")
    assert slices(store, controller, "web") and slices(store, controller, "api")
    store.delete("Service", "default", "web")
    store.patch("Service", "default", "api", {"spec": {"selector": None}})
    assert slices(store, controller, "web") == [] and slices(store, controller, "api") == []


def test_service_port_change_updates_the_slice(store, controller):
    service(store, selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1")
    assert slices(store, controller)[0]["ports"][0]["port"] == 8080
    store.patch("Service", "default", "web", {"spec": {"ports": [{"port": 80, "name": "http", "targetPort": 9000}]}},
                "application/strategic-merge-patch+json")
    assert slices(store, controller)[0]["ports"][0]["port"] == 9000


def test_only_writes_when_content_changes(store, controller):
    service(store, selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1")
    (before,) = slices(store, controller)
    writes = controller.writes
    store.patch("Pod", "default", "web-1", {"metadata": {"annotations": {"note": "irrelevant"}}})
    store.patch("Service", "default", "web", {"metadata": {"annotations": {"note": "irrelevant"}}})
    (after,) = slices(store, controller)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert controller.writes == writes


def test_large_services_split_at_the_slice_limit(store):
    with running_controller(store, max_endpoints_per_slice=3) as c:
        service(store, selector={"app": "web"})
        for i in range(7):
            pod(store, f"web-{i}", f"10.1.0.{i + 1}")
        sizes = sorted(len(s["endpoints"]) for s in slices(store, c))
        assert sizes == [1, 3, 3]


def test_existing_state_is_reconciled_at_start(store):
    service(store, selector={"app": "web"})
    pod(store, "web-1", "10.1.0.1")
    store.create("EndpointSlice", {
        "metadata": {"name": "stale", "labels": {SERVICE_NAME_LABEL: "gone", MANAGED_BY_LABEL: MANAGED_BY}},
        "addressType": "IPv4", "endpoints": [],
    })
    with running_controller(store) as c:
        assert [ep["addresses"] for ep in endpoints(store, c)] == [["10.1.0.1"]]
        assert slices(store, c, "gone") == []


def test_recovers_after_history_is_compacted(store, controller):
    service(store, selector={"app": "web"})
    store.compact()
    pod(store, "web-1", "10.1.0.1")
    assert [ep["addresses"] for ep in endpoints(store, controller)] == [["10.1.0.1"]]
