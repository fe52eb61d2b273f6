"""A family's service maps summed: whether they hold exactly what the last sync wrote, without
holding them.

The drift audit compares the kernel with the last sync every minute, and almost always finds
nothing. Its detailed comparison needs the maps read back whole (adopt.read: ~22 MiB packed at
100,000 Services x 10 endpoints, measured +25 MiB of the agent's RSS while an audit ran, the
largest transient of a synced agent). A Digest streams them instead: per table (epx_svc,
epx_slot, epx_backend, epx_src_range, or the family's twins) the number of entries and the sum
of each entry's hash. The same digest made from the ServiceEntries the syncs keep (`of_entries`)
equals the maps' (`of_maps`) exactly when they hold the same entries; a difference keeps both
figures of a table alike about once in 2^64. Only when the two differ does the audit read the
maps back and name what drifted.

An entry hashes as the read-back keys it (adopt.Records, SlotTable, BackendTable): a frontend by
its record key with the record's five fields, a slot by its packed key with its backend id, a
backend by its id with its raw value, a source range by (service id, CIDR). Python's hash of
bytes is fixed for a process's life, so both sides, made in one process, agree.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.adopt import record_key_of, record_key_of_row
from ebpf_proxy.datapath.ebpf.maps import Backends, Maps
from ebpf_proxy.datapath.ebpf.services import ServiceEntries

_BACKEND_ID = "I"  # epx_backend's key, a u32 in host order, as the batches and Backends hold it


@dataclass
class Tally:
    """Entries counted and their hashes summed (a Python int: no overflow, no wrap)."""

    entries: int = 0
    total: int = 0

    def add(self, hashes: Iterable[int]) -> None:
        batch = list(hashes)
        self.entries += len(batch)
        self.total += sum(batch)


@dataclass
class Digest:
    """A family's service maps, a Tally per table; equal digests, equal tables (see above)."""

    records: Tally = field(default_factory=Tally)
    slots: Tally = field(default_factory=Tally)
    backends: Tally = field(default_factory=Tally)
    ranges: Tally = field(default_factory=Tally)


def of_maps(maps: Maps) -> Digest:
    """The digest of what the family's service maps hold (`maps`: Maps, or Maps6), streamed one
    batch at a time."""
    d = Digest()
    d.records.add(hash((record_key_of_row(addr, port, proto), record)) for addr, port, proto, record in maps.service_rows())
    for keys, ids in maps.slot_batches():
        d.slots.add(map(hash, zip(keys, ids)))
    value = _backend_value(maps)
    for ids, values in maps.backend_batches():
        d.backends.add(_backend_hashes(ids, values, value))
    d.ranges.add(map(hash, maps.source_ranges()))
    return d


def of_entries(entries: Iterable[ServiceEntries], maps: Maps) -> Digest:
    """The digest of what `entries` (every service port's, as the syncs keep them) put in the
    maps (`maps`, the family's, says how its backends pack)."""
    d = Digest()
    value = _backend_value(maps)
    for e in entries:
        d.records.add(hash((record_key_of(fe), _fields(e, flags))) for fe, flags in e.frontends.items())
        base = e.svc_id << 32 | e.bank << 24
        for scope, slots in ((s.LB4_SCOPE_CLUSTER, e.cluster_slots), (s.LB4_SCOPE_LOCAL, e.local_slots)):
            start = base | scope << 16
            d.slots.add(map(hash, zip(range(start, start + len(slots)), slots)))
        d.backends.add(_backend_hashes(*_packed_backends(e, maps), value))
        d.ranges.add(hash((e.svc_id, cidr)) for cidr in e.source_ranges)
    return d


def _backend_value(maps: Maps) -> struct.Struct:
    """One raw epx_backend value of the family (lb4_backend or lb6_backend), as bytes."""
    return struct.Struct(f"{maps.BACKEND_VALUES.size}s")


def _backend_hashes(ids: bytes, values: bytes, value: struct.Struct) -> Iterator[int]:
    """The hash of each (backend id, raw value) of ids and values packed back to back: the maps'
    batches and the syncs' entries hash alike."""
    return map(hash, zip(memoryview(ids).cast(_BACKEND_ID), value.iter_unpack(values)))


def _packed_backends(e: ServiceEntries, maps: Maps) -> tuple[bytes, bytes]:
    """`e`'s backend ids and values, each back to back, as the map holds them: IPv4's as Backends
    keeps them; others (IPv6's, an address Backends cannot pack) packed as the sync writes them."""
    if type(e.backends) is Backends:
        packed = e.backends.map_entries()
        return packed.keys, packed.values
    rows = [maps.backend_entry(bid, be) for bid, be in e.backends.items()]
    return b"".join(k for k, _ in rows), b"".join(v for _, v in rows)


def _fields(e: ServiceEntries, flags: int) -> tuple[int, int, int, int, int]:
    """The epx_svc record of one of `e`'s frontends as Maps.service_rows reads it."""
    svc = e.service(flags)
    return svc.id, svc.count, svc.local_count, svc.affinity_timeout, svc.flags
