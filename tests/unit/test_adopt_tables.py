"""The read-back of the service maps (adopt.read: a restart, every drift audit) holds epx_slot and
epx_backend packed (issue 12: ~470 MiB at 100,000 Services x 10 endpoints as dicts of tuples and
records). The packed tables must answer exactly what those dicts answered; the maps here are a
fake with the readers adopt.read uses, so the comparison runs without the kernel."""

import pickle
import random
import socket
import sys
from array import array

import pytest

from ebpf_proxy.datapath.ebpf import adopt
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import (
    BACKEND4,
    BACKEND6,
    Backend,
    Backends,
    Frontend,
    Maps,
    Maps6,
    Service,
    packed_slot_keys,
)

CLUSTER, LOCAL = s.LB4_SCOPE_CLUSTER, s.LB4_SCOPE_LOCAL


def raw_backend(bid: int, addr: str, port: int, flags: int) -> tuple[int, bytes]:
    """(id, lb4_backend or lb6_backend value) as epx_backend(6) holds them (Maps.backend_rows),
    built from structs.py's mirrors, not from the packers under test."""
    if ":" in addr:
        value = s.LB6Backend(addr=s.In6.from_buffer_copy(socket.inet_pton(socket.AF_INET6, addr)),
                             port=socket.htons(port), flags=flags)
    else:
        value = s.LB4Backend(addr=int.from_bytes(socket.inet_aton(addr), sys.byteorder), port=socket.htons(port), flags=flags)
    return bid, bytes(value)


def record(addr: str, port: int, flags: int) -> Backend:
    return Backend(addr, port, in_cluster=bool(flags & s.LB4_BE_IN_CLUSTER), in_local=bool(flags & s.LB4_BE_IN_LOCAL))


def packed_entries(name, rows):
    """(key, value) rows of map `name` as the kernel holds them: each packed by its structs.py
    mirror (ctypes), not by the readers under test."""
    spec = s.MAPS[name]
    if name in ("epx_svc", "epx_svc6"):
        for fe, svc in rows:
            if name == "epx_svc6":
                addr = s.In6.from_buffer_copy(socket.inet_pton(socket.AF_INET6, fe.addr or "::"))
            else:
                addr = int.from_bytes(socket.inet_aton(fe.addr or "0.0.0.0"), sys.byteorder)
            yield (spec.key(addr=addr, port=socket.htons(fe.port), proto=fe.proto),
                   spec.leaf(id=svc.id, count=svc.count, local_count=svc.local_count,
                             affinity_timeout=svc.affinity_timeout, flags=svc.flags))
    elif name in ("epx_slot", "epx_slot6"):
        for svc_id, bank, scope, slot, bid in rows:
            yield spec.key(svc_id=svc_id, slot=slot, scope=scope, bank=bank), spec.leaf(bid)
    else:  # epx_backend(6): the values are raw already
        for bid, value in rows:
            yield spec.key(bid), spec.leaf.from_buffer_copy(value)


class FakeMaps:
    """The readers adopt.read calls, over lists of rows: the maps' raw batches (`batch` entries
    each, as Maps.raw_entries gives them) made from the rows with structs.py's mirrors, read by
    Maps' (Maps6's for IPv6) own readers, so a wrong conversion of the raw bytes shows."""

    BACKEND_VALUES = Maps.BACKEND_VALUES

    def __init__(self, services, slots, backends, affinity=(), max_connection_backend_id=0, family=BACKEND4,
                 batch=3):
        self._services, self._slots, self._backends = services, slots, backends
        self.BACKEND_VALUES = family
        self._maps = Maps6 if family is BACKEND6 else Maps  # whose readers read the raw batches
        self._affinity, self._ct_max, self._batch = affinity, max_connection_backend_id, batch

    def __getattr__(self, name):  # the family's layouts (class attributes) the readers ask for
        return getattr(self._maps, name)

    def raw_entries(self, role, chunk=4096):
        name = self._maps._NAMES.get(role, role) if self._maps is Maps6 else role
        rows = {"epx_svc": self._services, "epx_slot": self._slots, "epx_backend": self._backends}[role]
        entries = list(packed_entries(name, rows))
        for i in range(0, len(entries), self._batch):
            batch = entries[i:i + self._batch]
            yield b"".join(bytes(k) for k, _ in batch), b"".join(bytes(v) for _, v in batch), len(batch)

    def service_rows(self):
        return self._maps.service_rows(self)

    def services(self):
        return self._maps.services(self)

    def slot_batches(self):
        return self._maps.slot_batches(self)

    def slots(self):
        return self._maps.slots(self)

    def backend_batches(self):
        return self._maps.backend_batches(self)

    def backend_rows(self):
        return self._maps.backend_rows(self)

    def backends(self):
        return {bid: self.BACKEND_VALUES.record(raw) for bid, raw in self._backends}

    def source_ranges(self):
        return iter(())

    def affinity_ids(self):
        return iter(self._affinity)

    def max_connection_backend_id(self):
        return self._ct_max


SLOT_ROWS = [  # (service id, bank, scope, slot, backend id); service 2 has a hole after slot 1
    (1, 0, CLUSTER, 0, 11), (1, 0, CLUSTER, 1, 12), (1, 0, LOCAL, 0, 12), (1, 1, CLUSTER, 0, 99),
    (2, 0, CLUSTER, 0, 21), (2, 0, CLUSTER, 1, 22), (2, 0, CLUSTER, 3, 24),
    ((1 << 32) - 1, 255, 255, (1 << 16) - 1, (1 << 32) - 1),  # every field at its widest
]
BACKEND_ROWS = [
    raw_backend(11, "10.244.1.11", 8080, s.LB4_BE_IN_CLUSTER),
    raw_backend(12, "10.244.1.12", 65535, s.LB4_BE_IN_CLUSTER | s.LB4_BE_IN_LOCAL),
    raw_backend(21, "0.0.0.0", 0, 0),
    raw_backend(22, "255.255.255.255", 1, s.LB4_BE_IN_LOCAL),
    raw_backend(77, "10.244.9.9", 53, s.LB4_BE_IN_CLUSTER),  # referenced by no slot
]
RECORDS = {  # what BACKEND_ROWS hold, written out
    11: record("10.244.1.11", 8080, s.LB4_BE_IN_CLUSTER),
    12: record("10.244.1.12", 65535, s.LB4_BE_IN_CLUSTER | s.LB4_BE_IN_LOCAL),
    21: record("0.0.0.0", 0, 0),
    22: record("255.255.255.255", 1, s.LB4_BE_IN_LOCAL),
    77: record("10.244.9.9", 53, s.LB4_BE_IN_CLUSTER),
}
BACKEND6_ROWS = [  # epx_backend6: the same ids, IPv6 addresses (lb6_backend, 20 bytes a value)
    raw_backend(11, "fd00:10:244::11", 8080, s.LB4_BE_IN_CLUSTER),
    raw_backend(12, "fd00:10:244:1::12", 65535, s.LB4_BE_IN_CLUSTER | s.LB4_BE_IN_LOCAL),
    raw_backend(21, "::", 0, 0),
    raw_backend(22, "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 1, s.LB4_BE_IN_LOCAL),
    raw_backend(77, "::ffff:10.244.9.9", 53, s.LB4_BE_IN_CLUSTER),
]
RECORDS6 = {
    11: record("fd00:10:244::11", 8080, s.LB4_BE_IN_CLUSTER),
    12: record("fd00:10:244:1::12", 65535, s.LB4_BE_IN_CLUSTER | s.LB4_BE_IN_LOCAL),
    21: record("::", 0, 0),
    22: record("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 1, s.LB4_BE_IN_LOCAL),
    77: record("::ffff:10.244.9.9", 53, s.LB4_BE_IN_CLUSTER),
}


def shuffled(rows, seed=12):
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows


def test_the_slot_table_answers_what_the_dict_it_replaces_answered():
    table = adopt.SlotTable.of(shuffled(SLOT_ROWS))
    plain = {row[:4]: row[4] for row in SLOT_ROWS}
    assert len(table) == len(plain)
    assert list(table) == sorted(plain), "iterated in key order (strays() relies on it)"
    assert list(table.items()) == sorted(plain.items()) and dict(table) == plain
    assert sorted(table.values()) == sorted(plain.values())
    for key, bid in plain.items():
        assert key in table and table[key] == bid and table.get(key) == bid
    for missing in ((1, 0, CLUSTER, 2), (2, 0, CLUSTER, 2), (3, 0, CLUSTER, 0), (1, 0, 2, 0), (-1, 0, 0, 0),
                    (1 << 32, 0, 0, 0), (1, 0, CLUSTER, 1 << 16), "junk"):
        assert missing not in table and table.get(missing) is None
    assert table.max_service_id() == (1 << 32) - 1 and table.max_backend_id() == (1 << 32) - 1


def test_a_slot_run_stops_at_the_first_missing_slot_and_at_most():
    table = adopt.SlotTable.of(shuffled(SLOT_ROWS))
    assert table.run(1, 0, CLUSTER, 10) == (11, 12)
    assert table.run(1, 0, CLUSTER, 1) == (11,)
    assert table.run(1, 0, LOCAL, 10) == (12,)
    assert table.run(1, 1, CLUSTER, 10) == (99,), "the other bank is apart"
    assert table.run(2, 0, CLUSTER, 1 << 16) == (21, 22), "slot 3 is past the hole"
    assert table.run(3, 0, CLUSTER, 10) == () and table.run(1, 0, CLUSTER, 0) == ()
    # a full run of 65,536 slots does not run on into the next scope's slot 0
    full = adopt.SlotTable.of([(5, 0, CLUSTER, i, i + 1) for i in range(1 << 16)] + [(5, 0, CLUSTER + 1, 0, 7)])
    assert len(full.run(5, 0, CLUSTER, 1 << 17)) == 1 << 16


def test_an_empty_read_back_has_no_ids():
    table, backends = adopt.SlotTable(), adopt.BackendTable()
    assert len(table) == 0 and list(table) == [] and table.get((1, 0, 0, 0)) is None
    assert table.max_service_id() == 0 and table.max_backend_id() == 0
    assert backends.max_id() == 0 and backends.get(1) is None and list(backends.ids_except([1])) == []


def test_the_backend_table_makes_the_records_the_map_reader_makes():
    table = adopt.BackendTable.of(shuffled(BACKEND_ROWS))
    plain = RECORDS
    assert list(table) == sorted(plain) and dict(table.items()) == plain and len(table) == len(plain)
    assert plain[12] == Backend("10.244.1.12", 65535, in_cluster=True, in_local=True)
    assert plain[21] == Backend("0.0.0.0", 0, in_cluster=False, in_local=False)
    for bid, be in plain.items():
        assert table[bid] == be and table.get(bid) == be and bid in table
    assert 13 not in table and table.get(13) is None and "11" not in table and table.get(-1) is None
    assert table.max_id() == 77


def test_picked_backends_are_packed_like_the_records_in_the_order_asked():
    table = adopt.BackendTable.of(shuffled(BACKEND_ROWS))
    plain = RECORDS
    picked = table.pick([22, 11, 13, 22, 12])
    assert isinstance(picked, Backends)
    assert list(picked.items()) == [(22, plain[22]), (11, plain[11]), (12, plain[12])], "each id once, missing skipped"
    assert picked == Backends.pack({22: plain[22], 11: plain[11], 12: plain[12]})
    assert picked.map_entries() == [(key, value) for bid in (22, 11, 12)
                                    for key, value in [(bid.to_bytes(4, sys.byteorder), dict(BACKEND_ROWS)[bid])]], \
        "the values as the map holds them"
    assert list(table.ids_except([11, 12, 13, 12])) == [21, 22, 77]


def test_read_matches_the_maps_and_counts_every_id_in_use():
    services = [(Frontend("10.96.0.1", 80), Service(1, 2, 1, flags=s.LB4_F_HAS_ENDPOINTS)),
                (Frontend("10.96.0.2", 53, socket.IPPROTO_UDP), Service(2, 2))]
    maps = FakeMaps(services, SLOT_ROWS[:-1], BACKEND_ROWS)
    snap = adopt.read(maps)
    assert dict(snap.slots) == {row[:4]: row[4] for row in SLOT_ROWS[:-1]}
    assert dict(snap.backends.items()) == RECORDS
    assert (snap.max_svc_id, snap.max_backend_id) == (2, 99), "slot 99 of bank 1 counts, though no backend"
    snap = adopt.read(FakeMaps(services, SLOT_ROWS[:-1], BACKEND_ROWS, affinity=[(9, 5)], max_connection_backend_id=300))
    assert (snap.max_svc_id, snap.max_backend_id) == (9, 300)
    entries = adopt.entries_of(snap, 1)
    assert entries.cluster_slots == (11, 12) and entries.local_slots == (12,)
    assert dict(entries.backends.items()) == {11: RECORDS[11], 12: RECORDS[12]}


def test_strays_are_what_no_claimed_service_reads_in_key_order():
    services = [(Frontend("10.96.0.1", 80), Service(1, 2, 1))]
    snap = adopt.read(FakeMaps(services, SLOT_ROWS[:-1], BACKEND_ROWS))
    found = adopt.strays(snap, {1: adopt.entries_of(snap, 1)})
    assert found.services == ()
    assert found.slots == ((1, 1, CLUSTER, 0), (2, 0, CLUSTER, 0), (2, 0, CLUSTER, 1), (2, 0, CLUSTER, 3))
    assert found.backends == (21, 22, 77), "service 1 reads 11 and 12; 21 and 22 only from slots of no service"


def test_ipv6_backends_are_held_raw_and_read_as_maps6_reads_them():
    assert Maps6.BACKEND_VALUES is BACKEND6 and Maps.BACKEND_VALUES is BACKEND4 and BACKEND6.size == 20
    table = adopt.BackendTable.of(shuffled(BACKEND6_ROWS), BACKEND6)
    assert list(table) == sorted(RECORDS6) and dict(table.items()) == RECORDS6
    assert table[22] == RECORDS6[22] and 13 not in table and table.max_id() == 77
    picked = table.pick([22, 11, 13, 22])
    assert list(picked.items()) == [(22, RECORDS6[22]), (11, RECORDS6[11])]
    assert picked == Backends.pack({22: RECORDS6[22], 11: RECORDS6[11]}), "as ServiceEntries keeps IPv6 backends"
    assert list(table.ids_except([11, 77])) == [12, 21, 22]


def test_an_ipv6_read_back_builds_the_entries_maps6_wrote():
    services = [(Frontend("fd00:96::1", 80), Service(1, 2, 1, flags=s.LB4_F_HAS_ENDPOINTS))]
    snap = adopt.read(FakeMaps(services, SLOT_ROWS[:-1], BACKEND6_ROWS, family=BACKEND6))
    entries = adopt.entries_of(snap, 1)
    assert entries.cluster_slots == (11, 12) and entries.local_slots == (12,)
    assert dict(entries.backends.items()) == {11: RECORDS6[11], 12: RECORDS6[12]}
    found = adopt.strays(snap, {1: entries})
    assert found.backends == (21, 22, 77)


def test_values_of_another_size_are_refused_naming_the_struct():
    try:
        adopt.BackendTable.of(BACKEND6_ROWS)  # lb6_backend values read as lb4_backend ones
    except ValueError as exc:
        assert "lb4_backend" in str(exc) and "epx_backend" in str(exc)
    else:
        raise AssertionError("20-byte values taken as 8-byte lb4_backend ones")


def test_pairs_sorted_group_by_group_are_sorted_as_a_whole():
    """sorted_pairs sorts groups of keys one at a time (a drift audit's peak at 100,000 Services):
    keys spread over many groups, in hash-map order, come out as one sort of them all would."""
    rng = random.Random(7)
    keys = rng.sample(range(1, 1 << 40), 5000) + [0, (1 << 40) - 1]  # the extremes of the key space too
    rows = [(key, rng.randrange(1 << 32)) for key in keys]
    rng.shuffle(rows)
    sorted_keys, values = adopt.sorted_pairs(iter(rows), "Q", group_shift=30)  # ~1,000 groups
    assert list(sorted_keys) == sorted(keys)
    assert list(zip(sorted_keys, values)) == sorted(rows)
    assert [list(a) for a in adopt.sorted_pairs(iter(()), "I", group_shift=16)] == [[], []]


def test_the_packed_records_answer_what_the_dict_they_replace_answered():
    rows = [(Frontend("10.96.0.1", 80), Service(7, 2, 1, 0, s.LB4_F_HAS_ENDPOINTS)),
            (Frontend("fd00::10", 443, socket.IPPROTO_UDP), Service(3, 1)),
            (Frontend(None, 30080), Service(7, 2, 1, 0, s.LB4_F_EXTERNAL | s.LB4_F_SLOT_BANK)),
            (Frontend("192.168.1.5", 30080), Service(7, 2, 1, 0, s.LB4_F_EXTERNAL)),
            (Frontend("10.96.0.2", 80, socket.IPPROTO_SCTP), Service(1 << 31, 0xFFFF, 0xFFFF, 10800, 0xFF))]
    records = adopt.Records(random.Random(5).sample(rows, len(rows)))
    assert dict(records) == dict(rows) and len(records) == len(rows)
    assert Frontend("10.96.0.1", 81) not in records and Frontend("not an address", 80) not in records
    assert records.get(Frontend("10.96.0.3", 80)) is None and 42 not in records
    assert records.owner_of(Frontend(None, 30080)) == 7 and records.owner_of(Frontend("10.96.0.1", 80, 17)) is None
    snap = adopt.Snapshot(records=records)
    assert list(snap.frontends) == [3, 7, 1 << 31] and len(snap.frontends) == 3
    assert snap.frontends[7] == {fe: svc.flags & ~s.LB4_F_SLOT_BANK for fe, svc in rows if svc.id == 7}
    assert 4 not in snap.frontends and snap.frontends.get(4) is None and "7" not in snap.frontends


def test_an_ipv4_frontend_is_found_as_the_bytes_search_finds_it():
    """Records._index looks IPv4 frontends up in an array of u64 keys (bisect in C): the same
    index as the search of the 20-byte keys for every frontend held, nothing for one not held,
    whatever the nodePorts and IPv6 frontends around them."""
    rng = random.Random(11)
    v4 = [Frontend(f"{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}",
                   rng.choice((0, 53, 80, 65535)), rng.choice((6, 17, 132))) for _ in range(3000)]
    others = [Frontend(None, 30000 + i, 6) for i in range(50)] + [Frontend(f"fd00::{i:x}", 80, 6) for i in range(50)]
    held = list(dict.fromkeys(v4 + others))
    records = adopt.Records([(fe, Service(i + 1, 1)) for i, fe in enumerate(held)])
    bytes_search = super(adopt.Records, records)._index  # _Packed's: a bisection of the 20-byte keys
    for i, fe in enumerate(held):
        assert records._index(fe) == bytes_search(fe) is not None
        assert records.owner_of(fe) == i + 1
    absent = [Frontend("10.0.0.1", 81, 6), Frontend("255.255.255.255", 65535, 255), Frontend("0.0.0.0", 0, 0),
              Frontend("1.2.3", 80, 6), Frontend("10.0.0.1", 1 << 16, 6)]
    for fe in absent:
        if fe not in held:
            assert records._index(fe) is None and records.owner_of(fe) is None
    assert adopt.Records([])._index(Frontend("10.0.0.1", 80, 6)) is None


def test_record_keys_read_as_a_sequence_for_bisect():
    rows = adopt._KeyRows(b"a" * adopt._KEY_SIZE + b"b" * adopt._KEY_SIZE)
    assert len(rows) == 2 and rows[1] == b"b" * adopt._KEY_SIZE and list(rows) == [rows[0], rows[1]]
    for past in (2, -1):
        with pytest.raises(IndexError):
            rows[past]


def test_a_known_frontend_is_given_as_the_object_known():
    fe = Frontend("10.96.0.1", 80)
    snap = adopt.read(FakeMaps([(fe, Service(1, 2, 1, flags=s.LB4_F_HAS_ENDPOINTS))], SLOT_ROWS[:-1], BACKEND_ROWS))
    model_fe = Frontend("".join(["10.96.", "0.1"]), 80)  # equal, another object
    (held,) = adopt.entries_of(snap, 1, (model_fe,)).frontends
    assert held == fe and held is model_fe
    (held,) = adopt.entries_of(snap, 1).frontends
    assert held == fe and held is not model_fe


def test_sparse_backend_ids_answer_as_dense_ones():
    """Ids far apart (a long-running node's churn) are found by sorted ids, dense ones by a
    position each: both answer the same."""
    far = {11: 11, 12: 1 << 20, 21: 3_000_000_000, 22: (1 << 32) - 1, 77: 77}
    rows = [(far[bid], value) for bid, value in BACKEND_ROWS]
    want = {far[bid]: be for bid, be in RECORDS.items()}
    dense, sparse = adopt.BackendTable.of(shuffled(BACKEND_ROWS)), adopt.BackendTable.of(shuffled(rows))
    for table, records in ((dense, RECORDS), (sparse, want)):
        assert list(table) == sorted(records) and dict(table.items()) == records and len(table) == 5
        assert list(table.values()) == [records[bid] for bid in sorted(records)]
        assert table.max_id() == max(records) and 13 not in table and -1 not in table and "11" not in table
    assert list(sparse.pick([(1 << 32) - 1, 11, 5])) == [(1 << 32) - 1, 11]
    # the dense table's inline lookup: ids below, inside and past its range alike
    assert list(dense.pick([77, 11, 5, 1000, 12, 11])) == [77, 11, 12]
    assert list(dense.ids_except([11, 5, 99_999, 21])) == [12, 22, 77]
    assert list(sparse.ids_except([11, 3_000_000_000])) == [77, 1 << 20, (1 << 32) - 1]
    for table, records in ((dense, RECORDS), (sparse, want)):  # every id named (and more): none left
        assert list(table.ids_except(array("I", [*records, 5]))) == [] == list(table.ids_except(iter(records)))
        assert list(table.ids_except(sorted(records)[1:])) == [min(records)]
    assert (adopt.BackendTable().max_id(), len(adopt.BackendTable()), list(adopt.BackendTable())) == (0, 0, [])


def slot_key_bytes(keys):
    """(service id, bank, scope, slot) keys packed back to back by structs.py's LB4SlotKey."""
    return b"".join(bytes(s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank))
                    for svc_id, bank, scope, slot in keys)


def test_raw_slot_keys_are_packed_as_the_slot_table_packs_them():
    """adopt.read packs epx_slot's raw keys with two strided copies (the second u32 of a key is
    slot | scope << 16 | bank << 24 on a little-endian host): every field must land where
    SlotTable's own packing puts it, each field at its widest and the others zero included."""
    rng = random.Random(3)
    keys = [row[:4] for row in SLOT_ROWS] + [(0, 0, 0, 0), (1 << 31, 0, 0, 0), (0, 255, 0, 0), (0, 0, 255, 0),
                                             (0, 0, 0, 0xFFFF), (0, 0x80, 0x01, 0x8001)]
    keys += [(rng.randrange(1 << 32), rng.randrange(256), rng.randrange(256), rng.randrange(1 << 16))
             for _ in range(2000)]
    want = [adopt.SlotTable()._pack_key(key) for key in keys]
    raw = slot_key_bytes(keys)
    paths = [False] + ([True] if sys.byteorder == "little" else [])  # the strided copies need little-endian
    for little_endian in paths:
        packed = packed_slot_keys(raw, little_endian)
        assert packed.typecode == "Q" and list(packed) == want, f"little_endian={little_endian}"
    assert list(packed_slot_keys(b"")) == []
    with pytest.raises(ValueError):
        packed_slot_keys(raw[:-1], sys.byteorder == "little")


SERVICES = [  # nodePorts (no address), every field at its widest
    (Frontend("10.96.0.1", 80), Service(1, 2, 1, flags=s.LB4_F_HAS_ENDPOINTS)),
    (Frontend(None, 30080, socket.IPPROTO_UDP), Service(2, 2, 0, 10800, s.LB4_F_EXTERNAL | s.LB4_F_SLOT_BANK)),
    (Frontend("255.255.255.255", 65535, 132), Service((1 << 32) - 1, 0xFFFF, 0xFFFF, (1 << 32) - 1, (1 << 32) - 1)),
    (Frontend("0.0.0.1", 0, socket.IPPROTO_TCP), Service(0, 0)),
]
SERVICES6 = [
    (Frontend("fd00:96::1", 80), Service(1, 2, 1, flags=s.LB4_F_HAS_ENDPOINTS)),
    (Frontend(None, 30080, socket.IPPROTO_UDP), Service(2, 2, 0, 10800, s.LB4_F_EXTERNAL)),
    (Frontend("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 65535, 132), Service((1 << 32) - 1, 0xFFFF, 0xFFFF)),
    (Frontend("::1", 1), Service(7, 1)),
]


@pytest.mark.parametrize("family", [BACKEND4, BACKEND6])
def test_the_raw_readers_give_back_the_rows_the_maps_hold(family):
    """Maps' readers of raw batches (services, slots, backends; adopt.read's packed forms), over
    batches of 3 entries packed by the ctypes mirrors: the rows written, for either family."""
    services, backends = (SERVICES, BACKEND_ROWS) if family is BACKEND4 else (SERVICES6, BACKEND6_ROWS)
    maps = FakeMaps(shuffled(services), shuffled(SLOT_ROWS), shuffled(backends), family=family)
    assert sorted(maps.services(), key=repr) == sorted(services, key=repr)
    assert sorted(maps.slots()) == sorted(SLOT_ROWS)
    assert sorted(maps.backend_rows()) == sorted(backends)
    keys, ids = [], []
    for batch_keys, batch_ids in maps.slot_batches():
        assert len(batch_keys) == len(batch_ids) <= 3
        keys += batch_keys
        ids += batch_ids
    assert sorted(zip(keys, ids)) == sorted((adopt.SlotTable()._pack_key(row[:4]), row[4]) for row in SLOT_ROWS)
    records = adopt.Records.of_rows(maps.service_rows())
    assert dict(records) == dict(services) and list(records) == list(adopt.Records(services))
    assert records.owner_of(Frontend(None, 30080, socket.IPPROTO_UDP)) == 2
    assert records.owner_of(Frontend(None, 30080)) is None, "another protocol"


def test_a_read_back_from_raw_batches_is_the_one_from_rows():
    """adopt.read (raw batches) and the tables built from decoded rows hold the same."""
    maps = FakeMaps(shuffled(SERVICES), shuffled(SLOT_ROWS), shuffled(BACKEND_ROWS), batch=2)
    snap = adopt.read(maps)
    assert list(snap.records.items()) == list(adopt.Records(SERVICES).items())
    assert list(snap.slots.items()) == list(adopt.SlotTable.of(SLOT_ROWS).items())
    assert list(snap.backends.items()) == list(adopt.BackendTable.of(BACKEND_ROWS).items())
    assert snap.max_svc_id == (1 << 32) - 1 and snap.max_backend_id == (1 << 32) - 1


@pytest.mark.parametrize("family", [BACKEND4, BACKEND6])
def test_a_read_back_crosses_a_pickle_whole(family):
    """readback.py hands a helper process's Snapshot over as a pickle: the same tables, the
    family's value reader the module's own (its functions are not picklable by value)."""
    services, backends = (SERVICES, BACKEND_ROWS) if family is BACKEND4 else (SERVICES6, BACKEND6_ROWS)
    snap = adopt.read(FakeMaps(shuffled(services), shuffled(SLOT_ROWS), shuffled(backends), family=family))
    copy = pickle.loads(pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy.backends._family is family
    assert copy == snap and (copy.max_svc_id, copy.max_backend_id) == (snap.max_svc_id, snap.max_backend_id)
    assert list(copy.backends.values()) == list(snap.backends.values())


@pytest.mark.parametrize("family", [BACKEND4, BACKEND6])
def test_entries_made_ahead_cross_a_pickle_whole_and_packed(family):
    """readback.py sends the entries a helper made ahead (adopt.made_ahead) as pickles: each
    comes back equal, in the packed forms it was made in (one-frontend OneEntry, Backends,
    SlotIds), not rebuilt into dicts and tuples."""
    services, backends = (SERVICES, BACKEND_ROWS) if family is BACKEND4 else (SERVICES6, BACKEND6_ROWS)
    snap = adopt.read(FakeMaps(shuffled(services), shuffled(SLOT_ROWS), shuffled(backends), family=family))
    made = [adopt.made_ahead(snap, svc_id) for svc_id in snap.frontends]
    assert any(len(e.frontends) == 1 for e in made)
    copies = pickle.loads(pickle.dumps(made, protocol=pickle.HIGHEST_PROTOCOL))
    assert copies == made
    for copy, entries in zip(copies, made):
        for field in ("frontends", "backends", "cluster_slots", "local_slots", "source_ranges"):
            assert type(getattr(copy, field)) is type(getattr(entries, field)), field
        if len(entries.frontends) == 1:
            assert list(copy.frontends) == [None], "the one frontend still left for the agent to give"


def random_slot_maps(rng):
    """A random epx_svc and epx_slot: (frontend, record) rows and (svc_id, bank, scope, slot, id)
    rows, with what a crash or a half-done sync leaves: holes, two versions (banks) of a service,
    slots past the counts, slots of service ids without records, an id of 0xFFFFFFFF, the widest slot."""
    services, slots = [], {}
    ids = rng.sample(range(0, 40), 12) + [(1 << 32) - 1]
    for n, svc_id in enumerate(ids):
        with_records = rng.random() < 0.8
        versions = [(rng.randrange(2), rng.randrange(0, 7), rng.randrange(0, 4))
                    for _ in range(rng.choice((1, 1, 2)))]
        if with_records:
            for f in range(rng.randrange(1, 4)):
                bank, count, local_count = rng.choice(versions)
                flags = s.LB4_F_SLOT_BANK if bank else 0
                record = Service(svc_id, count, local_count, flags=flags)
                services.append((Frontend(f"10.96.{n}.{f}", 80 + f), record))
        for bank, count, local_count in versions:
            for scope, k in ((CLUSTER, count), (LOCAL, local_count)):
                for slot in range(k + rng.choice((0, 0, 1, 3))):  # sometimes past the count
                    if rng.random() > 0.15:  # holes
                        slots[svc_id, bank, scope, slot] = rng.choice((rng.randrange(1, 500), 0, (1 << 32) - 1))
        if rng.random() < 0.2:
            slots[svc_id, rng.randrange(2), rng.randrange(3), (1 << 16) - 1] = rng.randrange(1, 500)
    return services, [(*key, bid) for key, bid in slots.items()]


def batches_of(rows, size=7):
    rows = [((svc_id << 32 | bank << 24 | scope << 16 | slot), bid) for svc_id, bank, scope, slot, bid in rows]
    from array import array
    return [(array("Q", [k for k, _ in rows[i:i + size]]), array("I", [v for _, v in rows[i:i + size]]))
            for i in range(0, len(rows), size)]


def old_strays_slots(snap, owners):
    """strays()' slots as it found them before the flat table: a key at a time."""
    out = []
    for svc_id, bank, scope, slot in snap.slots:
        owner = owners.get(svc_id)
        if owner is None or bank != owner.bank or \
                slot >= len(owner.cluster_slots if scope == CLUSTER else owner.local_slots):
            out.append((svc_id, bank, scope, slot))
    return tuple(out)


@pytest.mark.parametrize("seed", range(40))
def test_the_flat_slot_table_answers_what_the_sorted_one_answers(seed):
    """with_spans (read()'s: the spans the records claim laid flat, the rest sorted) against
    with no spans (everything sorted) on random maps: every query, the same answer."""
    rng = random.Random(seed)
    services, rows = random_slot_maps(rng)
    rows = shuffled(rows, seed)
    spans = list(adopt.Records(services).slot_spans())
    assert spans == sorted(spans) and all(count > 0 for _, count in spans)
    sorted_only = adopt.SlotTable.with_spans((), batches_of(rows))
    flat = adopt.SlotTable.with_spans(spans, batches_of(rows))
    plain = {row[:4]: row[4] for row in rows}
    assert dict(sorted_only) == plain
    assert len(flat) == len(plain) and list(flat) == list(sorted_only) == sorted(plain)
    assert list(flat.items()) == list(sorted_only.items()) and list(flat.values()) == list(sorted_only.values())
    probes = list(plain) + [(svc_id, bank, scope, slot) for svc_id in range(42) for bank in (0, 1)
                            for scope in (CLUSTER, LOCAL, 2) for slot in range(9)]
    for key in probes + [(1 << 32, 0, 0, 0), (-1, 0, 0, 0), "junk", (1, 0, 0)]:
        assert (key in flat) == (key in sorted_only) and flat.get(key) == sorted_only.get(key), key
    for svc_id in list(range(42)) + [(1 << 32) - 1]:
        for bank in (0, 1):
            for scope in (CLUSTER, LOCAL, 2):
                for most in (0, 1, 3, 8, 1 << 17):
                    assert flat.run(svc_id, bank, scope, most) == sorted_only.run(svc_id, bank, scope, most)
    assert flat.max_service_id() == sorted_only.max_service_id()
    assert flat.max_backend_id() == sorted_only.max_backend_id()
    limits = {(svc_id, bank, scope): rng.randrange(-1, 9)
              for svc_id in range(42) for bank in (0, 1) for scope in range(3)}

    def limit(svc_id, bank, scope):
        return limits.get((svc_id, bank, scope), 0)

    want = [key for key in sorted(plain) if key[3] >= limit(*key[:3])]
    assert list(flat.slots_past(limit)) == list(sorted_only.slots_past(limit)) == want


@pytest.mark.parametrize("seed", range(20))
def test_a_flat_read_back_finds_the_entries_and_strays_the_sorted_one_found(seed):
    rng = random.Random(100 + seed)
    services, rows = random_slot_maps(rng)
    snap = adopt.read(FakeMaps(shuffled(services, seed), shuffled(rows, seed), BACKEND_ROWS, batch=5))
    assert snap.slots._placed, "the records' spans are laid flat"
    old = adopt.read(FakeMaps(services, rows, BACKEND_ROWS))
    old.slots = adopt.SlotTable.of(rows)
    assert list(snap.slots.items()) == list(old.slots.items())
    assert (snap.max_svc_id, snap.max_backend_id) == (old.max_svc_id, old.max_backend_id)
    ids = sorted(set(snap.frontends))
    for svc_id in ids:
        assert adopt.entries_of(snap, svc_id) == adopt.entries_of(old, svc_id)
    claimed = {svc_id: adopt.entries_of(snap, svc_id) for svc_id in ids if rng.random() < 0.6}
    found, before = adopt.strays(snap, claimed), adopt.strays(old, claimed)
    assert found == before
    owners = {**{e.svc_id: e for e in before.services}, **claimed}
    assert found.slots == old_strays_slots(old, owners)


def test_slot_spans_take_the_largest_count_of_each_bank_and_scope():
    services = [(Frontend("10.96.0.1", 80), Service(3, 2, 1)),
                (Frontend("10.96.0.2", 80), Service(3, 4, 0)),
                (Frontend("10.96.0.3", 80), Service(3, 1, 5, flags=s.LB4_F_SLOT_BANK)),
                (Frontend("10.96.0.4", 80), Service(1, 0, 0))]
    assert list(adopt.Records(services).slot_spans()) == [
        (3 << 32 | CLUSTER << 16, 4), (3 << 32 | LOCAL << 16, 1),
        (3 << 32 | 1 << 24 | CLUSTER << 16, 1), (3 << 32 | 1 << 24 | LOCAL << 16, 5)]
    with pytest.raises(ValueError):
        adopt.SlotTable.with_spans([(2 << 32, 1), (1 << 32, 1)], [])


def test_by_id_is_a_mapping_of_service_ids_like_a_dict():
    """adopt.ById holds what adopt() claimed by service id in a list (ids are dense): it must
    answer as the dict it replaces, ids beyond the highest given and overwrites included."""
    import random

    from ebpf_proxy.datapath.ebpf.adopt import ById
    from ebpf_proxy.datapath.ebpf.services import ServiceEntries

    rng = random.Random(7)
    entries = {i: ServiceEntries(i, {}, 0, {}, (), (), frozenset()) for i in rng.sample(range(1, 60), 25)}
    table, plain = ById(40), {}
    for svc_id, e in entries.items():
        table[svc_id] = e
        plain[svc_id] = e
    table[next(iter(entries))] = plain[next(iter(entries))]  # an overwrite is not a new entry
    assert len(table) == len(plain) and sorted(table) == sorted(plain)
    assert all(table[i] is plain[i] for i in plain) and all(i in table for i in plain)
    assert 0 not in table and 200 not in table and "x" not in table and table.get(61) is None
    for i in (*range(-1, 62), "x", None):  # in the list's range, past it, not an id: as the dict
        assert (i in table) == (i in plain) and table.get(i, "none") == plain.get(i, "none"), i
    assert sorted(e.svc_id for e in table.values()) == sorted(plain)
    assert dict(ById(0, entries.values())) == plain
