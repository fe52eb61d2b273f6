"""Endpoints built without Endpoint values (issue 12: a full sync at 100,000 Services) are the very
values the Endpoint-by-Endpoint code made: a slice's rows packed per port (PortlessEndpoints), the
tracker's merge of packed lists (merge), and categorize taking a merged list as it is."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ebpf_proxy.model import Endpoint, Protocol, ServicePort, ServicePortName, categorize
from ebpf_proxy.model.endpoints import EndpointList, MergedEndpoints, PortlessEndpoints, merge

SPN = ServicePortName("default", "web", "", Protocol.TCP)

IPS = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.10", "10.0.0.9", "192.168.1.1", "10.1", "fd00::1", "fd00::a"])
NAMES = st.sampled_from([None, "node-a", "node-b"])
HINTS = st.sampled_from([(), ("zone-a",), ("zone-a", "zone-b")])
ROWS = st.tuples(IPS, NAMES, st.booleans(), st.booleans(), st.booleans(), st.booleans(), HINTS, HINTS)


def reference_merge(lists) -> tuple[Endpoint, ...]:
    """What the tracker did Endpoint by Endpoint: first wins by ip:port, a local copy preferred, sorted."""
    seen: dict[str, Endpoint] = {}
    for eps in lists:
        for ep in eps:
            if ep.addr not in seen or (ep.is_local and not seen[ep.addr].is_local):
                seen[ep.addr] = ep
    return tuple(sorted(seen.values()))


def endpoints(rows, port: int) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(ip, port, *rest) for ip, *rest in rows)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(ROWS, max_size=8), port=st.sampled_from([0, 1, 80, 8080, 65535, 65536, 1 << 33]))
def test_a_slices_rows_packed_per_port_are_its_endpoints_in_order(rows, port):
    packed = PortlessEndpoints(rows).with_port(port)
    assert tuple(packed) == endpoints(rows, port) and packed == endpoints(rows, port)
    assert isinstance(packed, EndpointList) == (bool(rows) and 0 <= port < 1 << 16)
    if isinstance(packed, EndpointList):
        assert packed == EndpointList.pack(endpoints(rows, port))  # the same bytes as packing the Endpoints


@settings(max_examples=300, deadline=None)
@given(slices=st.lists(st.tuples(st.lists(ROWS, max_size=6), st.sampled_from([80, 81])), min_size=1, max_size=3),
       packed=st.booleans())
def test_merging_gives_the_deduplicated_sorted_endpoints(slices, packed):
    lists = [PortlessEndpoints(rows).with_port(port) if packed else endpoints(rows, port) for rows, port in slices]
    want = reference_merge(lists)
    merged = merge(lists)
    assert tuple(merged) == want and merged == want
    assert type(merged) is (MergedEndpoints if want else tuple)
    if want:
        assert merge([merged]) is merged, "a merged list merges to itself"
        assert merged == merge([tuple(want)]), "packed or not, the same bytes"


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(ROWS, max_size=8), local_policy=st.booleans(), zone=st.sampled_from(["", "zone-a"]))
def test_categorize_takes_a_merged_list_as_the_sorted_set_it_is(rows, local_policy, zone):
    from ebpf_proxy.model import NodeTopology

    merged = merge([PortlessEndpoints(rows).with_port(80)])
    svc = ServicePort(SPN, "10.96.0.10", 80, Protocol.TCP, internal_policy_local=local_policy)
    node = NodeTopology("node-a", zone)
    assert categorize(svc, merged, node) == categorize(svc, tuple(merged), node) == categorize(svc, reference_merge([merged]), node)


def test_a_lone_list_already_in_order_keeps_its_bytes():
    rows = [("10.0.0.1", "node-a", True, True, False, True, (), ()), ("10.0.0.2", None, True, True, False, False, (), ())]
    lone = PortlessEndpoints(rows).with_port(80)
    merged = merge([lone])
    assert type(merged) is MergedEndpoints and merged._packed is lone._packed


def test_an_endpoint_list_and_a_tuple_of_another_length_differ_without_unpacking():
    packed = PortlessEndpoints([("10.0.0.1", None, True, True, False, False, (), ())]).with_port(80)
    assert packed != () and () != packed and packed == (Endpoint("10.0.0.1", 80),)


def test_a_merged_list_knows_when_every_endpoint_is_ready_and_unhinted():
    for ips in (["10.0.0.1", "10.0.0.2"], ["fd00::1", "10.0.0.3"]):  # both address forms
        def merged(ready=True, zones=()):
            return merge([PortlessEndpoints([(ip, None, ready, True, False, False, zones, ()) for ip in ips]).with_port(80)])
        assert merged().all_ready_without_hints()
        assert not merged(ready=False).all_ready_without_hints()
        assert not merged(zones=("zone-a",)).all_ready_without_hints()
