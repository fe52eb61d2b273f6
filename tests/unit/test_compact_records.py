"""The packed forms kept for memory (issue 12) read back exactly what was packed, compare like the
forms they replace, and share nothing mutable."""

import copy
import pickle

import pytest

from ebpf_proxy.datapath.ebpf.maps import _U32, Backend, Backends, pack_backend
from ebpf_proxy.datapath.ebpf.services import ServiceEntries, ServicePrograms, SlotIds
from ebpf_proxy.model import ChangeTracker, Endpoint, Protocol, ServicePort, ServicePortName, categorize
from ebpf_proxy.model.endpoints import EndpointList
from ebpf_proxy.model.compact import OneEntry

SPN = ServicePortName("default", "web", "", Protocol.TCP)
SVC = ServicePort(SPN, "10.96.0.10", 80, Protocol.TCP)
ENDPOINTS = (
    Endpoint("10.244.1.2", 8080, "node-a", zone_hints=("zone-a",), node_hints=("node-a",)),
    Endpoint("10.244.1.3", 8080, None, ready=False, serving=True, terminating=True),
    Endpoint("10.244.2.4", 65535, "node-b", ready=False, serving=False, terminating=True, is_local=True),
    Endpoint("fd00::5", 1, "node-b", zone_hints=("zone-a", "zone-b")),
)


def test_an_endpoint_list_reads_back_what_was_packed():
    packed = EndpointList.pack(ENDPOINTS)
    assert isinstance(packed, EndpointList)
    assert tuple(packed) == ENDPOINTS and list(packed) == list(ENDPOINTS)
    assert packed == ENDPOINTS and ENDPOINTS == packed and not packed != ENDPOINTS
    assert packed != list(ENDPOINTS), "as a tuple: never equal to a list"
    assert hash(packed) == hash(ENDPOINTS)
    assert len(packed) == 4 and packed[1] == ENDPOINTS[1] and packed[-1] == ENDPOINTS[-1]
    assert packed[1:3] == ENDPOINTS[1:3]
    assert repr(packed) == repr(ENDPOINTS)
    assert packed + (ENDPOINTS[0],) == ENDPOINTS + (ENDPOINTS[0],)
    assert (ENDPOINTS[0],) + packed == (ENDPOINTS[0],) + ENDPOINTS
    assert packed == EndpointList.pack(list(ENDPOINTS)) and packed != EndpointList.pack(ENDPOINTS[:3])
    assert packed != EndpointList.pack((*ENDPOINTS[:3], Endpoint("fd00::5", 1, "node-b")))  # hints count


def test_an_endpoint_list_hands_out_new_immutable_endpoints_each_time():
    packed = EndpointList.pack(ENDPOINTS)
    first, second = tuple(packed), tuple(packed)
    assert first == second and all(a is not b for a, b in zip(first, second))
    with pytest.raises(AttributeError):
        first[0].ready = False  # type: ignore[misc]
    assert tuple(packed) == ENDPOINTS


@pytest.mark.parametrize("ips", [("10.244.1.2", "10.244.1.3", "255.255.255.255", "0.0.0.0"),  # the IPv4 form
                                 ("10.1", "10.244.1.3"),  # not canonical: kept as text
                                 ("fd00::1", "10.0.0.1"), ("fd00::1",)])
def test_both_address_forms_read_back_exactly(ips):
    endpoints = tuple(Endpoint(ip, 80 + i, f"node-{i % 2}", ready=bool(i % 2)) for i, ip in enumerate(ips))
    packed = EndpointList.pack(endpoints)
    assert isinstance(packed, EndpointList) and tuple(packed) == endpoints and len(packed) == len(ips)


def test_the_tracker_shares_one_name_object_between_a_service_and_its_endpoints():
    for service_first in (True, False):
        tracker = ChangeTracker()
        svc = ServicePort(ServicePortName("default", "web", "", Protocol.TCP), "10.96.0.10", 80, Protocol.TCP)
        slice_name = ServicePortName("default", "web", "", Protocol.TCP)  # equal, another object
        feeds = [lambda: tracker.update_service("default", "web", [svc]),
                 lambda: tracker.update_slice("default", "web-1", "web", {slice_name: ENDPOINTS})]
        for feed in feeds if service_first else reversed(feeds):
            assert feed()
        state, _ = tracker.take()
        (spn, port), = state.services.items()
        (ep_spn, endpoints), = state.endpoints.items()
        assert spn is ep_spn and port.name is spn and port == svc and endpoints == tuple(sorted(ENDPOINTS))


def test_what_the_packed_form_cannot_hold_stays_a_tuple():
    assert EndpointList.pack(()) == ()
    assert type(EndpointList.pack([Endpoint("10.0.0.1", 1 << 33)])) is tuple
    assert type(EndpointList.pack([Endpoint("10.0.0.1", 80, ready=1)])) is tuple  # type: ignore[arg-type]


def test_copies_and_pickles_of_an_endpoint_list_are_plain_tuples():
    packed = EndpointList.pack(ENDPOINTS)
    assert pickle.loads(pickle.dumps(packed)) == ENDPOINTS
    assert copy.deepcopy(packed) == ENDPOINTS


def test_categorize_chooses_the_same_endpoints_from_a_packed_list():
    for svc in (SVC, ServicePort(SPN, "10.96.0.10", 80, Protocol.TCP, internal_policy_local=True)):
        assert categorize(svc, EndpointList.pack(ENDPOINTS)) == categorize(svc, ENDPOINTS)


def test_the_tracker_hands_out_endpoints_equal_to_the_sorted_tuple():
    tracker = ChangeTracker(node_name="node-a")
    tracker.update_service("default", "web", [SVC])
    tracker.update_slice("default", "web-1", "web", {SPN: tuple(reversed(ENDPOINTS))})
    state, changes = tracker.take()
    assert state.endpoints == {SPN: tuple(sorted(ENDPOINTS))} and changes.full
    assert state.services == {SPN: SVC}
    tracker.commit()
    assert not tracker.update_slice("default", "web-1", "web", {SPN: ENDPOINTS})  # same endpoints: no change


def test_one_entry_compares_and_reads_like_a_one_entry_dict():
    one = OneEntry(SPN, SVC)
    assert one == {SPN: SVC} and {SPN: SVC} == one and one != {} and one != {SPN: SVC, "x": 1}
    assert one.get(SPN) is SVC and one.get("x") is None and SPN in one and list(one) == [SPN]
    assert dict(one) == {SPN: SVC} and one.keys() | {"x"} == {SPN, "x"}
    target = {}
    target.update(one)
    assert target == {SPN: SVC}
    with pytest.raises(KeyError):
        one["x"]  # noqa: B018


BACKENDS = {7: Backend("10.244.1.2", 8080), 3: Backend("10.244.1.3", 80, in_cluster=False, in_local=True),
            1 << 31: Backend("192.0.2.1", 65535, in_cluster=True, in_local=True)}


def test_backends_read_back_what_was_packed_in_order():
    packed = Backends.pack(BACKENDS)
    assert isinstance(packed, Backends)
    assert list(packed.items()) == list(BACKENDS.items()) and list(packed) == list(BACKENDS)
    assert packed == BACKENDS and BACKENDS == packed and dict(packed) == BACKENDS
    assert packed[3] == BACKENDS[3] and packed.get(4) is None and 7 in packed and 4 not in packed
    assert len(packed) == 3
    reordered = Backends.pack(dict(reversed(BACKENDS.items())))
    assert reordered == packed, "a dict's equality: the order does not count"
    assert packed != Backends.pack({**BACKENDS, 7: Backend("10.244.1.2", 8080, in_local=True)})
    assert pickle.loads(pickle.dumps(packed)) == packed


def test_backends_from_rows_and_as_map_entries_are_what_the_records_give():
    rows = [(bid, be.addr, be.port, be.in_cluster, be.in_local) for bid, be in BACKENDS.items()]
    assert Backends.of(rows) == Backends.pack(BACKENDS) and list(Backends.of(rows).items()) == list(BACKENDS.items())
    assert Backends.of([*rows, (7, "10.0.0.9", 81, True, False)])[7] == Backend("10.0.0.9", 81), "a dict's last one"
    assert Backends.of([(1, "10.1", 80, True, False)]) == {1: Backend("10.1", 80)}
    assert Backends.pack(BACKENDS).map_entries() == [(_U32.pack(bid), pack_backend(be)) for bid, be in BACKENDS.items()]


def test_backends_the_packed_form_cannot_hold_stay_a_dict():
    for odd in ({1: Backend("10.1", 80)}, {1: Backend("fd00::1", 80)}, {1: Backend("10.0.0.1", 1 << 16)},
                {1 << 32: Backend("10.0.0.1", 80)}):
        assert type(Backends.pack(odd)) is dict and Backends.pack(odd) == odd


def test_slot_ids_read_like_the_tuple_they_replace():
    ids = (9, 1 << 31, 3, 9)
    packed = SlotIds.pack(ids)
    assert isinstance(packed, SlotIds)
    assert tuple(packed) == ids and packed == ids and ids == packed and hash(packed) == hash(ids)
    assert packed != list(ids), "as a tuple: never equal to a list"
    assert packed[0] == 9 and packed[-1] == 9 and packed[1:3] == ids[1:3] and len(packed) == 4
    assert 3 in packed and 4 not in packed and repr(packed) == repr(ids)
    assert SlotIds.pack(()) == () and type(SlotIds.pack((1 << 40,))) is tuple


def test_service_entries_pack_what_they_are_given_and_equal_the_unpacked():
    plain = dict(svc_id=5, frontends={}, affinity_timeout=0, backends=dict(BACKENDS),
                 cluster_slots=(7, 3), local_slots=(), source_ranges=frozenset())
    entries = ServiceEntries(**plain)
    assert isinstance(entries.backends, Backends) and isinstance(entries.cluster_slots, SlotIds)
    assert entries.backends == BACKENDS and entries.cluster_slots == (7, 3) and entries.local_slots == ()
    assert entries == ServiceEntries(**plain)


def test_service_programs_entries_keep_ids_and_backends_across_versions():
    programs = ServicePrograms(maps=None)
    first = programs.entries(SVC, ENDPOINTS[:3])
    assert first is not None
    programs.current[SPN] = first
    again = programs.entries(SVC, EndpointList.pack(ENDPOINTS[:3]))
    assert again == first, "the same endpoints packed: the same entries, ids kept"
    assert {be.addr for be in again.backends.values()} == {ENDPOINTS[0].ip}  # the ready one: no fallback


def test_endpoints_of_a_missing_service_wait_aside_until_it_comes_back():
    tracker = ChangeTracker()
    assert tracker.update_slice("default", "web-1", "web", {SPN: ENDPOINTS})
    state, _ = tracker.take()
    assert state.endpoints == {} and state.services == {}
    tracker.commit()
    assert tracker.update_service("default", "web", [SVC])
    state, changes = tracker.take()
    assert state.endpoints == {SPN: tuple(sorted(ENDPOINTS))} and changes.services == {SPN}
    tracker.commit()
    assert tracker.delete_service("default", "web")
    state, _ = tracker.take()
    assert state.endpoints == {} and state.services == {}
    tracker.commit()
    assert tracker.update_service("default", "web", [SVC])
    assert tracker.update_slice("default", "web-1", "web", {SPN: ENDPOINTS[:2]})
    state, _ = tracker.take()
    assert state.endpoints == {SPN: tuple(sorted(ENDPOINTS[:2]))}
    tracker.commit()
    assert tracker.delete_slice("default", "web-1")
    state, _ = tracker.take()
    assert state.endpoints == {} and state.services == {SPN: SVC}
