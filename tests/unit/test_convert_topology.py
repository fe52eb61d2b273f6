"""k8s/convert.py, topology: EndpointSlice hints and the node's zone label, read as kube-proxy reads
them (endpointslicecache.go: hints.forZones[].name and hints.forNodes[].name; the Node's
topology.kubernetes.io/zone label). Kept apart from test_convert.py so the topology work merges
cleanly with other changes there."""

from __future__ import annotations

import pytest

from ebpf_proxy.k8s import convert
from ebpf_proxy.k8s.invalid import Invalid
from ebpf_proxy.model import ServicePortName, Protocol
from tests.unit.kobjects import endpoint, endpoint_slice, node

HTTP = ServicePortName("default", "web", "http", Protocol.TCP)


class Reports(list):
    def __call__(self, problem: Invalid) -> None:
        self.append(problem)


def converted(*endpoints, reports=None):
    sl = convert.endpoint_slice(endpoint_slice(endpoints=list(endpoints)), "n1", reports)
    return sl.endpoints[HTTP]


def test_zone_and_node_hints_are_read_sorted_and_deduplicated():
    reports = Reports()
    (ep,) = converted(endpoint("10.244.1.5", "n1", hints={
        "forZones": [{"name": "zone-b"}, {"name": "zone-a"}, {"name": "zone-b"}],
        "forNodes": [{"name": "n1"}]}), reports=reports)
    assert ep.zone_hints == ("zone-a", "zone-b") and ep.node_hints == ("n1",)
    assert reports == []


def test_endpoints_without_hints_have_none_and_share_the_empty_tuple():
    a, b = converted(endpoint("10.244.1.5", "n1"), endpoint("10.244.1.6", "n1", hints={}))
    assert a.zone_hints == () and a.node_hints == () and b.zone_hints == ()


def test_endpoints_with_the_same_hints_share_one_tuple():
    """Memory at 10,000 Services: a zone's hint tuple exists once, not once per endpoint."""
    a, b = converted(endpoint("10.244.1.5", "n1", hints={"forZones": [{"name": "zone-a"}]}),
                     endpoint("10.244.1.6", "n2", hints={"forZones": [{"name": "zone-a"}]}))
    assert a.zone_hints is b.zone_hints


@pytest.mark.parametrize("hints,field,reason", [
    ("zone-a", "endpoints[0].hints", "wrong_type"),
    ({"forZones": {"name": "zone-a"}}, "endpoints[0].hints.forZones", "wrong_type"),
    ({"forZones": ["zone-a"]}, "endpoints[0].hints.forZones[0]", "wrong_type"),
    ({"forZones": [{}]}, "endpoints[0].hints.forZones[0].name", "missing_field"),
    ({"forNodes": [{"name": 7}]}, "endpoints[0].hints.forNodes[0].name", "wrong_type"),
])
def test_malformed_hints_are_reported_once_and_the_endpoint_kept_without_hints(hints, field, reason, caplog):
    """Dropping the endpoint would lose capacity; without hints it turns topology off for the service
    (kube-proxy's rule for any unhinted ready endpoint), so traffic still reaches every endpoint."""
    reports = Reports()
    bad = endpoint("10.244.1.5", "n1", hints=hints)
    good = endpoint("10.244.1.6", "n2", hints={"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "n2"}]})
    first, second = converted(bad, good, reports=reports)
    assert (first.ip, first.zone_hints, first.node_hints) == ("10.244.1.5", (), ())
    assert second.zone_hints == ("zone-a",) and second.node_hints == ("n2",)
    assert [(r.kind, r.obj, r.field, r.reason, r.skipped) for r in reports] == [
        ("EndpointSlice", "default/web-abc", field, reason, "hints")]
    assert sum(field in r.getMessage() for r in caplog.records) == 1


def test_node_zone_label():
    state = convert.node_info(node("n1", labels={"topology.kubernetes.io/zone": "zone-a", "other": "x"}))
    assert state.zone == "zone-a"
    assert convert.node_info(node("n1")).zone == ""


def test_node_zone_label_that_is_not_a_string_is_reported_and_means_no_zone():
    reports = Reports()
    state = convert.node_info(node("n1", labels={"topology.kubernetes.io/zone": 3}), reports)
    assert state is not None and state.zone == "" and state.addresses == ("192.168.1.10",)
    assert [(r.kind, r.field, r.skipped) for r in reports] == [
        ("Node", "metadata.labels[topology.kubernetes.io/zone]", "label")]
