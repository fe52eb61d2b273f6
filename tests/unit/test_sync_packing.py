"""The shortcuts a full sync of 100,000 Services takes (issue 12) make exactly what the general code
makes: backends packed from the addresses' bytes (Backends.of_v4 ≡ Backends.of), service port names
sorted as strings (sorted_names ≡ sorted), slot ids packed without a Python loop (SlotIds.pack),
and the slots of a new service (stable_slots without a previous order)."""

from __future__ import annotations

import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from ebpf_proxy.datapath.ebpf.maps import Backends
from ebpf_proxy.datapath.ebpf.services import SlotIds, in_place, sorted_names, stable_slots
from ebpf_proxy.model import Protocol, ServicePortName

V4 = st.ip_addresses(v=4).map(str)
ROWS = st.lists(st.tuples(V4, st.sampled_from([0, 1, 80, 8080, 65535, 65536]), st.booleans(), st.booleans()),
                max_size=12)
IDS = st.lists(st.sampled_from([0, 1, 2, 7, 1000, (1 << 32) - 1, 1 << 32, -1]), max_size=12)


@settings(max_examples=400, deadline=None)
@given(rows=ROWS, ids=IDS)
def test_backends_packed_from_address_bytes_are_what_of_packs(rows, ids):
    ids = (ids + list(range(100, 100 + len(rows))))[:len(rows)]  # repeated or out-of-range ids, sometimes
    v4 = b"".join(socket.inet_aton(ip) for ip, *_ in rows)
    ports, in_cluster, in_local = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    want = Backends.of(zip(ids, (ip for ip, *_ in rows), ports, in_cluster, in_local))
    got = Backends.of_v4(ids, v4, ports, in_cluster, in_local)
    assert type(got) is type(want) and got == want
    if isinstance(want, Backends):
        assert got._packed == want._packed, "byte for byte what epx_backend is written"


TEXT = st.sampled_from(["", "a", "ab", "a b", "a\0", "a\0b", "b", "A", "é", "default", "kube-system", "x-1", "x-10"])
NAMES = st.builds(ServicePortName, TEXT, TEXT, TEXT, st.sampled_from(list(Protocol)))


@settings(max_examples=400, deadline=None)
@given(names=st.sets(NAMES, max_size=30))
def test_names_sorted_as_strings_are_in_their_own_order(names):
    assert sorted_names(names) == sorted(names)


def test_many_names_sort_as_their_fields():
    names = {ServicePortName(f"ns-{i % 7}", f"svc-{i}", "" if i % 3 else "http", Protocol.UDP if i % 5 else Protocol.TCP)
             for i in range(2000)}
    assert sorted_names(names) == sorted(names)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(min_value=-2, max_value=(1 << 32) + 2) | st.booleans(), max_size=8))
def test_slot_ids_pack_only_plain_u32s(ids):
    packed = SlotIds.pack(ids)
    fits = bool(ids) and all(type(i) is int and 0 <= i < 1 << 32 for i in ids)
    assert type(packed) is (SlotIds if fits else tuple)
    assert packed == tuple(ids)


@given(wanted=st.lists(st.integers(min_value=1, max_value=50), max_size=12))
def test_a_new_services_slots_are_its_backends_in_id_order(wanted):
    assert stable_slots((), wanted) == tuple(sorted(set(wanted)))
    # the general path, through a previous order whose one backend left: the same slots
    assert stable_slots((0,), wanted) == tuple(sorted(set(wanted)))


@given(ids=st.lists(st.integers(min_value=1, max_value=(1 << 32) + 2), max_size=8))
def test_fresh_slot_ids_pack_as_any_others(ids):
    fresh, packed = SlotIds.of_fresh(ids), SlotIds.pack(ids)
    assert type(fresh) is type(packed) and fresh == packed


@settings(max_examples=200, deadline=None)
@given(rows=ROWS)
def test_backend_ids_by_address_are_those_of_the_records(rows):
    backends = Backends.of([(100 + i, ip, port % (1 << 16), c, loc) for i, (ip, port, c, loc) in enumerate(rows)])
    if isinstance(backends, Backends):
        assert backends.ids_by_address() == {(be.addr, be.port): bid for bid, be in backends.items()}


@settings(max_examples=300, deadline=None)
@given(rows=ROWS, other=ROWS)
def test_backend_ids_if_same_are_those_the_address_lookup_gives(rows, other):
    """ids_if_same answers a resync's lookup of unchanged backends (ServicePrograms._entries)
    without text keys: the ids by_address gives, in order, when the addresses and ports are the
    same in the same order (keys distinct, as a service's are); None whenever they differ."""
    rows = [(ip, port % (1 << 16), c, loc) for ip, port, c, loc in rows]
    backends = Backends.of([(100 + i, ip, port, c, loc) for i, (ip, port, c, loc) in enumerate(rows)])
    if not isinstance(backends, Backends):
        return
    for asked in (rows, [(ip, port % (1 << 17), c, loc) for ip, port, c, loc in other], rows[::-1], rows[1:]):
        v4, ports = b"".join(socket.inet_aton(r[0]) for r in asked), [r[1] for r in asked]
        same = [(r[0], r[1]) for r in asked] == [(r[0], r[1]) for r in rows]
        got = backends.ids_if_same(v4, ports)
        if same and len({(r[0], r[1]) for r in rows}) == len(rows):
            known = backends.ids_by_address()
            assert got == [known[(r[0], r[1])] for r in asked]
        elif not same:
            assert got is None


@settings(max_examples=300, deadline=None)
@given(rows=ROWS, flags=st.lists(st.tuples(st.booleans(), st.booleans()), max_size=12))
def test_backends_kept_as_they_are_only_where_packing_them_again_gives_the_same_bytes(rows, flags):
    """A restart's full sync keeps a service port's packed backends (same_v4) instead of packing
    them again: exactly when of_v4 of the same ids, addresses, ports and flags would equal them."""
    rows = [(ip, port % (1 << 16), c, loc) for ip, port, c, loc in rows]
    backends = Backends.of([(100 + i, ip, port, c, loc) for i, (ip, port, c, loc) in enumerate(rows)])
    if not isinstance(backends, Backends):
        return
    v4, ports = b"".join(socket.inet_aton(r[0]) for r in rows), [r[1] for r in rows]
    ids = backends.ids_if_same(v4, ports)
    if ids is None:
        return
    asked = [(c, loc) for _, _, c, loc in rows]
    for in_cluster, in_local in ([c for c, _ in asked], [loc for _, loc in asked]), \
            ([c for c, _ in flags][:len(rows)], [loc for _, loc in flags][:len(rows)]):
        kept = backends.same_v4(v4, ports, in_cluster, in_local)
        if len(in_cluster) == len(rows):
            assert kept == (Backends.of_v4(ids, v4, ports, in_cluster, in_local) == backends)
        else:
            assert not kept
    assert backends.same_v4(v4, ports, [c for c, _ in asked], [loc for _, loc in asked])


@given(previous=st.lists(st.integers(min_value=1, max_value=(1 << 32) - 1), min_size=1, max_size=12, unique=True),
       seed=st.randoms(use_true_random=False))
def test_the_same_backends_keep_their_slots_and_change_in_place(previous, seed):
    """A restart or a resync recomputes every service's slots from the same backends: they keep
    their order (nothing moves), and the change is in place (the bank stays), packed or not."""
    wanted = list(previous)
    seed.shuffle(wanted)
    for before in (tuple(previous), SlotIds.pack(previous)):
        assert stable_slots(before, wanted) == tuple(previous)
        assert in_place(before, stable_slots(before, wanted))
    # one backend fewer or one more is not "the same": the general path decides
    assert stable_slots(tuple(previous), wanted[1:]) != tuple(previous)
    assert stable_slots(tuple(previous), [*wanted, 0]) == (*previous, 0)
