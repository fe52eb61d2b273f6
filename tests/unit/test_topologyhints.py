"""Topology hints as the EndpointSlice controller writes them: trafficDistribution
(staging/src/k8s.io/endpointslice/trafficdist) and topology-mode Auto
(pkg/controller/endpointslice/topologycache), alone and through the lab's controller."""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import Store
from ebpf_proxy.lab.topologyhints import NodeInfo, add_hints, allocations, cpu_ratios
from tests.unit.slicectl import controller, endpoints  # noqa: F401 - controller is a fixture

A, B, C = "zone-a", "zone-b", "zone-c"


def nodes(*zones, cpu=1000):
    return {f"n{i}": NodeInfo(zone=z, cpu_milli=cpu, ready=True, excluded=False) for i, z in enumerate(zones)}


def eps(*zones, ready=True):
    return [{"addresses": [f"10.0.0.{i}"], "nodeName": f"n{i}", "conditions": {"ready": ready},
             **({"zone": z} if z else {})} for i, z in enumerate(zones)]


def hinted(endpoints):
    return [[h["name"] for h in ep["hints"]["forZones"]] if "hints" in ep else None for ep in endpoints]


def svc(distribution=None, mode=None):
    body = {"metadata": {"name": "web"}, "spec": {}}
    if distribution:
        body["spec"]["trafficDistribution"] = distribution
    if mode:
        body["metadata"]["annotations"] = {"service.kubernetes.io/topology-mode": mode}
    return body


@pytest.mark.parametrize("distribution", ["PreferClose", "PreferSameZone"])
def test_prefer_close_and_same_zone_hint_each_ready_endpoint_for_its_zone(distribution):
    endpoints = eps(A, B, None) + eps(C, ready=False)
    add_hints(svc(distribution), endpoints, nodes(A, B, C))
    assert hinted(endpoints) == [[A], [B], None, None]
    assert all("forNodes" not in ep.get("hints", {}) for ep in endpoints)


def test_prefer_same_node_adds_node_hints_and_keeps_zone_hints():
    endpoints = eps(A, None)
    add_hints(svc("PreferSameNode"), endpoints, nodes(A, B))
    assert endpoints[0]["hints"] == {"forZones": [{"name": A}], "forNodes": [{"name": "n0"}]}
    assert endpoints[1]["hints"] == {"forNodes": [{"name": "n1"}]}


def test_no_distribution_or_unknown_value_removes_hints():
    endpoints = eps(A, B)
    endpoints[0]["hints"] = {"forZones": [{"name": A}]}
    add_hints(svc(), endpoints, nodes(A, B))
    assert hinted(endpoints) == [None, None]


def test_auto_annotation_wins_over_traffic_distribution():
    endpoints = eps(A, A, A, A, B, B)  # 2 zones of equal CPU: 3 endpoints each desired
    add_hints(svc("PreferSameZone", mode="Auto"), endpoints, nodes(A, B))
    assert hinted(endpoints) == [[B], [A], [A], [A], [B], [B]]


def test_auto_same_zone_when_balanced():
    endpoints = eps(A, B, C)
    add_hints(svc(mode="auto"), endpoints, nodes(A, B, C))
    assert hinted(endpoints) == [[A], [B], [C]]


@pytest.mark.parametrize("why,endpoints,node_zones", [
    ("fewer endpoints than zones", eps(A, B), (A, B, C)),
    ("one zone only", eps(A, A), (A, A)),
    ("an endpoint without a zone", eps(A, B, None), (A, B)),
    ("a node without a zone", eps(A, B), (A, B, "")),
    ("a zone's minimum cannot be met", eps(A, A, A), (A, B)),  # B: ceil(1.5/1.2)=2 > 3-2
])
def test_auto_gives_no_hints_when_allocation_is_impossible(why, endpoints, node_zones):
    add_hints(svc(mode="Auto"), endpoints, nodes(*node_zones))
    assert hinted(endpoints) == [None] * len(endpoints), why


def test_auto_weighs_zones_by_cpu():
    infos = {"a": NodeInfo(A, 3000, True, False), "b": NodeInfo(B, 1000, True, False),
             "cp": NodeInfo("", 0, True, True), "down": NodeInfo("", 0, False, False)}
    assert cpu_ratios(infos.values()) == {A: 0.75, B: 0.25}
    assert allocations({A: 0.75, B: 0.25}, 4) == {A: 3.0, B: 1.0}


# ---- through the lab's controller -------------------------------------------------------------


@pytest.fixture
def store():
    s = Store()
    for name, zone in (("node-1", A), ("node-2", B), ("node-3", C)):
        s.create("Node", {"metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {"cpu": "1"}}})
    yield s
    s.close()


def make(store, **spec):
    store.create("Service", {"metadata": {"name": "web"},
                             "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}], **spec}})
    for i, node in enumerate(("node-1", "node-2", "node-3")):
        store.create("Pod", {"metadata": {"name": f"web-{i}", "labels": {"app": "web"}},
                             "spec": {"nodeName": node, "containers": [{"name": "c"}]},
                             "status": {"phase": "Running", "podIP": f"10.1.0.{i + 1}"}})


def test_controller_writes_zones_and_hints_and_follows_node_zone_changes(store, controller):
    make(store, trafficDistribution="PreferSameNode")
    got = endpoints(store, controller)
    assert [ep["zone"] for ep in got] == [A, B, C]
    assert got[0]["hints"] == {"forZones": [{"name": A}], "forNodes": [{"name": "node-1"}]}
    node = store.get("Node", "", "node-3")
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = A
    store.update("Node", node)
    got = endpoints(store, controller)
    assert got[2]["zone"] == A and got[2]["hints"]["forZones"] == [{"name": A}]


def test_controller_without_traffic_distribution_writes_zones_but_no_hints(store, controller):
    make(store)
    got = endpoints(store, controller)
    assert [ep.get("zone") for ep in got] == [A, B, C]
    assert all("hints" not in ep for ep in got)
