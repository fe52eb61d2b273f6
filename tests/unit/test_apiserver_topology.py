"""The embedded API server accepts and validates what topology-aware routing needs: Service
spec.trafficDistribution (pkg/apis/core/validation) and EndpointSlice endpoint hints
(pkg/apis/discovery/validation), with kube-apiserver's messages."""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import ApiError, Store


@pytest.fixture
def store():
    s = Store(service_cidr="10.96.0.0/24", node_port_range=(30000, 30099))
    yield s
    s.close()


def service(name, **spec):
    return {"metadata": {"name": name}, "spec": {"ports": [{"port": 80}], **spec}}


def eps(hints):
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"port": 80}],
            "endpoints": [{"addresses": ["10.244.1.5"], "hints": hints}]}


@pytest.mark.parametrize("value", ["PreferClose", "PreferSameZone", "PreferSameNode"])
def test_traffic_distribution_values_are_accepted_and_kept(store, value):
    created = store.create("Service", service("web", trafficDistribution=value))
    assert created["spec"]["trafficDistribution"] == value


def test_bad_traffic_distribution_is_rejected_like_kube_apiserver(store):
    with pytest.raises(ApiError) as exc:
        store.create("Service", service("bad", trafficDistribution="Nearby"))
    assert exc.value.code == 422
    assert exc.value.message == ('Service "bad" is invalid: spec.trafficDistribution: Unsupported value: "Nearby": '
                                 'supported values: "PreferClose", "PreferSameZone", "PreferSameNode"')


def test_endpoint_hints_are_accepted_and_kept(store):
    hints = {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "worker-1"}]}
    created = store.create("EndpointSlice", eps(hints))
    assert created["endpoints"][0]["hints"] == hints


@pytest.mark.parametrize("hints,message", [
    ({"forZones": [{"name": "zone-a"}, {"name": "zone-a"}]},
     'endpoints[0].hints.forZones[1].name: Duplicate value: "zone-a"'),
    ({"forZones": [{"name": "bad zone"}]}, 'endpoints[0].hints.forZones[0].name: Invalid value: "bad zone"'),
    ({"forNodes": [{"name": "Worker_1"}]}, 'endpoints[0].hints.forNodes[0].name: Invalid value: "Worker_1"'),
    ({"forZones": [{"name": f"z{i}"} for i in range(9)]},
     "endpoints[0].hints.forZones: Too many: 9: must have at most 8 items"),
    ({"forZones": "zone-a"}, 'endpoints[0].hints.forZones: Invalid value: "zone-a": must be a list'),
])
def test_bad_hints_are_rejected_naming_the_field(store, hints, message):
    with pytest.raises(ApiError) as exc:
        store.create("EndpointSlice", eps(hints))
    assert exc.value.code == 422
    assert message in exc.value.message, exc.value.message
