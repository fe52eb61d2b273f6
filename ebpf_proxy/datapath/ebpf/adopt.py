"""After an agent restart: take over what the pinned maps hold instead of rewriting it.

The maps outlive the agent (they are pinned), and the ids in them are referenced from entries the
agent never writes: connections carry backend ids, affinity entries carry service and backend
ids. A restarted agent must therefore neither flush nor renumber. It reads the maps back into
ServiceEntries, matches each to the desired service port owning its clusterIP frontend (unique per
service port, and present for every programmed one), and hands that to ServicePrograms as what
the port currently has: the first sync then writes only the differences, and an unchanged service
keeps its ids and its slots. What no desired service port claims (services deleted while the
agent was down, entries left half-written by a crash) is removed, and new ids are handed out
above every id still found anywhere in the maps, connections included.

An agent killed in the middle of a sync (kill -9, OOM) leaves each service port in one of the
states services.py's write order allows: every frontend leads to a complete slot array, but its
frontends may disagree (some already switched to the new version's record, with another slot
bank or count, or other service-wide flags, some not). Adoption settles such a port first: every
frontend is given the version most of them hold (entries_of), one write each; only then are the
slots no frontend reads any more deleted as strays. A port the kill did not catch is not written.
"""

from __future__ import annotations

import logging
from array import array
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field, replace

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import BACKEND4, IPPROTO, Backend, BackendValues, Frontend, Maps, Service, slot_bank
from ebpf_proxy.datapath.ebpf.services import ServiceEntries, ServicePrograms, sorted_names
from ebpf_proxy.model import ProxyState

log = logging.getLogger(__name__)

_U32_ARRAY = "I"  # array typecode of a backend id, epx_backend's u32 key (as maps.Backends packs them)
# sorted_pairs' groups: keys that agree above these bits are sorted together. Service and backend
# ids are handed out densely from 1, so a group is up to 4,096 service ids' slots (~60,000 at 10
# endpoints each, cluster and local) or 65,536 backends
_SLOT_GROUP_SHIFT = 32 + 12
_BACKEND_GROUP_SHIFT = 16


def sorted_pairs(rows: Iterable[tuple[int, int]], key_type: str, group_shift: int) -> tuple[array, array]:
    """(key, u32 value) rows, each key once, in any order (a hash map's), as two arrays sorted
    by key: keys of `key_type`, values "I".

    Sorting them all at once (sorted() of key << 32 | value) held one Python int an entry,
    ~45 bytes: at 100,000 Services x 10 endpoints ~100 MiB for epx_slot's 1.5 million entries
    and ~70 MiB for epx_backend's million, at the peak of every restart and drift audit (a lab
    agent restarted there: 350 MiB synced, 445 MiB at each audit). Here the rows are first split, packed
    (12 bytes an entry), into groups by their key's bits above `group_shift`, and the groups are
    sorted one at a time in key order: only one group's ints exist at once."""
    groups: dict[int, tuple[array, array]] = {}
    for key, value in rows:
        group = groups.get(key >> group_shift)
        if group is None:
            group = groups[key >> group_shift] = (array(key_type), array("I"))
        group[0].append(key)
        group[1].append(value)
    keys, values = array(key_type), array("I")
    for top in sorted(groups):
        group_keys, group_values = groups.pop(top)
        merged = sorted(k << 32 | v for k, v in zip(group_keys, group_values))
        del group_keys, group_values
        keys.extend(m >> 32 for m in merged)
        values.extend(m & 0xFFFFFFFF for m in merged)
    return keys, values


class _Packed(Mapping):
    """A read-only Mapping held as sorted keys (an array of ints) and their values in the same
    order, searched by bisection.

    A restart (adopt) and every drift audit read the whole of epx_slot and epx_backend back: at
    100,000 Services x 10 endpoints a million entries each, which as a dict of tuples and a dict
    of Backend records took ~470 MiB for the read and ~630 MiB at its peak with strays(), on top
    of the agent's ~330 MiB (the bench's 890-968 MiB agent peaks, 2026-11-26-100k-compact). Held
    here they take ~12 (slots) and ~16 (IPv4 backends) bytes an entry, plus one int per entry
    while they are sorted. Subclasses say how a key is packed and how the i-th value reads;
    iteration is in key order."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: array = array("Q")

    def _pack_key(self, key: object) -> int:
        raise NotImplementedError

    def _unpack_key(self, packed: int) -> object:
        raise NotImplementedError

    def _value(self, index: int) -> object:
        raise NotImplementedError

    def _index(self, key: object) -> int | None:
        try:
            packed = self._pack_key(key)
        except (TypeError, ValueError):
            return None
        i = bisect_left(self._keys, packed)
        return i if i < len(self._keys) and self._keys[i] == packed else None

    def __getitem__(self, key: object) -> object:
        i = self._index(key)
        if i is None:
            raise KeyError(key)
        return self._value(i)

    def __contains__(self, key: object) -> bool:
        return self._index(key) is not None

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator:
        return map(self._unpack_key, self._keys)

    def items(self) -> ItemsView:
        return _Items(self)

    def values(self) -> ValuesView:
        return _Values(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} entries)"


class _Items(ItemsView):
    def __iter__(self) -> Iterator:
        table = self._mapping
        return zip(map(table._unpack_key, table._keys), map(table._value, range(len(table._keys))))


class _Values(ValuesView):
    def __iter__(self) -> Iterator:
        return map(self._mapping._value, range(len(self._mapping._keys)))


class SlotTable(_Packed):
    """epx_slot as read back: (service id, bank, scope, slot) -> backend id."""

    __slots__ = ("_values",)

    def __init__(self, rows: Iterable[tuple[int, int]] = ()) -> None:
        """`rows`: (packed key, backend id) pairs, in any order, each key once."""
        self._keys, self._values = sorted_pairs(rows, "Q", _SLOT_GROUP_SHIFT)

    @classmethod
    def of(cls, slots: Iterable[tuple[int, int, int, int, int]]) -> "SlotTable":
        """From (service id, bank, scope, slot, backend id) rows (Maps.slots)."""
        return cls((svc_id << 32 | bank << 24 | scope << 16 | slot, bid) for svc_id, bank, scope, slot, bid in slots)

    def _pack_key(self, key: object) -> int:
        svc_id, bank, scope, slot = key  # type: ignore[misc]
        if not (0 <= svc_id < 1 << 32 and 0 <= bank < 256 and 0 <= scope < 256 and 0 <= slot < 1 << 16):
            raise ValueError(key)
        return svc_id << 32 | bank << 24 | scope << 16 | slot

    def _unpack_key(self, packed: int) -> tuple[int, int, int, int]:
        return packed >> 32, packed >> 24 & 0xFF, packed >> 16 & 0xFF, packed & 0xFFFF

    def _value(self, index: int) -> int:
        return self._values[index]

    def run(self, svc_id: int, bank: int, scope: int, most: int) -> tuple[int, ...]:
        """The backend ids in slots 0, 1, ... of (svc_id, bank, scope), up to the first missing
        slot, at most `most`: one search, then the neighbours (the keys are in slot order)."""
        first, most = self._pack_key((svc_id, bank, scope, 0)), min(most, 1 << 16)  # slot: 16 bits
        keys, i, out = self._keys, bisect_left(self._keys, first), []
        while len(out) < most and i < len(keys) and keys[i] == first + len(out):
            out.append(self._values[i])
            i += 1
        return tuple(out)

    def max_service_id(self) -> int:
        return self._keys[-1] >> 32 if self._keys else 0

    def max_backend_id(self) -> int:
        return max(self._values, default=0)


class BackendTable(_Packed):
    """epx_backend (epx_backend6 for Maps6) as read back: backend id -> Backend, made on access
    from the raw map value, kept as the map holds it (lb4_backend or lb6_backend: `family`, the
    Maps' BACKEND_VALUES, says its size and how it reads)."""

    __slots__ = ("_raw", "_family")

    def __init__(self, family: BackendValues = BACKEND4, ids: Iterable[int] = (), raw: bytes = b"") -> None:
        """`ids` and `raw`: the backend ids, each once, in any order, and their values back to back
        in the same order."""
        size, view = family.size, memoryview(raw)
        keys, order = sorted_pairs(((bid, i) for i, bid in enumerate(ids)), _U32_ARRAY, _BACKEND_GROUP_SHIFT)
        if len(view) != len(order) * size:
            raise ValueError(f"epx_backend: {len(view)} bytes of values for {len(order)} ids, "
                             f"not {size} bytes each ({family.name})")
        out = bytearray(len(view))
        for j, i in enumerate(order):
            out[j * size:(j + 1) * size] = view[i * size:(i + 1) * size]
        del order
        self._keys = keys
        self._raw, self._family = bytes(out), family

    @classmethod
    def of(cls, rows: Iterable[tuple[int, bytes]], family: BackendValues = BACKEND4) -> "BackendTable":
        """From (backend id, raw value) rows (Maps.backend_rows), streamed into two flat buffers."""
        ids, raw = array(_U32_ARRAY), bytearray()
        for bid, value in rows:
            ids.append(bid)
            raw += value
        return cls(family, ids, raw)

    def _pack_key(self, key: object) -> int:
        if type(key) is not int or not 0 <= key < 1 << 32:
            raise TypeError(key)
        return key

    def _unpack_key(self, packed: int) -> int:
        return packed

    def _raw_at(self, index: int) -> bytes:
        size = self._family.size
        return self._raw[index * size:(index + 1) * size]

    def _value(self, index: int) -> Backend:
        return self._family.record(self._raw_at(index))

    def max_id(self) -> int:
        return self._keys[-1] if self._keys else 0

    def _positions(self, ids: Iterable[int]) -> Iterator[tuple[int, int]]:
        """(id, its index) of each of `ids` held (the others skipped): the lookups of a whole
        read-back in one loop, without a Mapping call each."""
        keys, n = self._keys, len(self._keys)
        for bid in ids:
            i = bisect_left(keys, bid)
            if i < n and keys[i] == bid:
                yield bid, i

    def pick(self, ids: Iterable[int]) -> Mapping[int, Backend]:
        """The backends of those of `ids` held, in the order given (each id once), as
        ServiceEntries keeps them (IPv4: packed maps.Backends, no record made)."""
        hits = list(self._positions(dict.fromkeys(ids)))
        return self._family.collect(array(_U32_ARRAY, [bid for bid, _ in hits]).tobytes(),
                                    b"".join(self._raw_at(i) for _, i in hits))

    def ids_except(self, used: Iterable[int]) -> Iterator[int]:
        """The backend ids, in order, that `used` does not name: marked in a bytearray (a byte an
        entry) rather than collected in sets of a million ints."""
        seen = bytearray(len(self._keys))
        for _, i in self._positions(used):
            seen[i] = 1
        return (bid for bid, hit in zip(self._keys, seen) if not hit)


class _Frontends(Mapping):
    """Snapshot.frontends: service id -> {frontend: its flags, the slot bank left out (that is
    ServiceEntries.bank)}, each made on access from the records."""

    __slots__ = ("_snap",)

    def __init__(self, snap: "Snapshot") -> None:
        self._snap = snap

    def __getitem__(self, svc_id: int) -> dict[Frontend, int]:
        records = self._snap.records
        return {fe: records[fe].flags & ~s.LB4_F_SLOT_BANK for fe in self._snap.by_id[svc_id]}

    def __contains__(self, svc_id: object) -> bool:
        return svc_id in self._snap.by_id

    def __iter__(self) -> Iterator[int]:
        return iter(self._snap.by_id)

    def __len__(self) -> int:
        return len(self._snap.by_id)


@dataclass
class Snapshot:
    """The service maps as read back: by service id.

    Each frontend's record is held once (`records`); which frontends a service id has is a tuple
    (most have one), and the flags by frontend (`frontends`) and a frontend's service id
    (`owner_of`) are read from the records: with a dict of flags and an owner entry each, this
    took ~59 MiB at 100,000 Services (now ~37), at every restart and drift audit."""

    records: dict[Frontend, Service] = field(default_factory=dict)  # frontend -> its epx_svc entry
    by_id: dict[int, tuple[Frontend, ...]] = field(default_factory=dict)  # service id -> its frontends
    slots: SlotTable = field(default_factory=SlotTable)  # (id, bank, scope, slot) -> backend id
    backends: BackendTable = field(default_factory=BackendTable)
    ranges: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    max_svc_id: int = 0
    max_backend_id: int = 0

    @property
    def frontends(self) -> Mapping[int, dict[Frontend, int]]:
        """service id -> {frontend: flags without the slot bank}."""
        return _Frontends(self)

    def owner_of(self, fe: Frontend) -> int | None:
        """The service id frontend `fe` leads to, None if the maps do not hold it."""
        record = self.records.get(fe)
        return None if record is None else record.id


def read(maps: Maps) -> Snapshot:
    snap = Snapshot()
    by_id = snap.by_id
    for fe, svc in maps.services():
        snap.records[fe] = svc
        by_id[svc.id] = by_id.get(svc.id, ()) + (fe,)
    snap.slots = SlotTable.of(maps.slots())
    snap.backends = BackendTable.of(maps.backend_rows(), maps.BACKEND_VALUES)
    for svc_id, cidr in maps.source_ranges():
        snap.ranges[svc_id].add(cidr)
    max_svc_id = max(max(snap.frontends, default=0), snap.slots.max_service_id(), max(snap.ranges, default=0))
    max_backend_id = max(snap.backends.max_id(), snap.slots.max_backend_id(), maps.max_connection_backend_id())
    for svc_id, backend_id in maps.affinity_ids():
        max_svc_id, max_backend_id = max(max_svc_id, svc_id), max(max_backend_id, backend_id)
    snap.max_svc_id, snap.max_backend_id = max_svc_id, max_backend_id
    return snap


# Marks, in ServiceEntries.frontends, a frontend whose epx_svc record differs from its service's
# (another bank or count: a sync stopped halfway): the flags of no real frontend, so the next
# apply() rewrites its record whatever the new flags are.
UNSETTLED = 1 << 31


# The LB4_F_* bits every frontend of one version of a service shares (the others say which kind of
# frontend it is: EXTERNAL, SOURCE_RANGES).
SERVICE_WIDE = s.LB4_F_ETP_LOCAL | s.LB4_F_ITP_LOCAL | s.LB4_F_HAS_ENDPOINTS


def entries_of(snap: Snapshot, svc_id: int) -> ServiceEntries:
    """What service `svc_id` holds in the maps, as ServiceEntries.

    Its frontends normally hold one record (bank, counts, affinity, service-wide flags). A sync
    stopped halfway can leave two, each a complete version of the service; the one most of its
    frontends hold (on a tie, the one with more slots) is taken as the service's, with that bank's
    slots 0..n-1 (no holes, no more than the record counts). Frontends that hold another record
    are marked UNSETTLED, with the flags they should have in the version taken (their own kind
    bits, the service-wide bits of that version)."""
    fronts = snap.frontends.get(svc_id) or {}
    versions = Counter((r.count, r.local_count, r.affinity_timeout, r.flags & (SERVICE_WIDE | s.LB4_F_SLOT_BANK))
                       for r in (snap.records[fe] for fe in fronts))
    if versions:
        count, local_count, affinity, flags = max(versions, key=lambda v: (versions[v], v))
    else:  # slots without a frontend: take them all
        count, local_count, affinity, flags = 1 << 16, 1 << 16, 0, 0
    bank = slot_bank(flags)
    cluster = snap.slots.run(svc_id, bank, s.LB4_SCOPE_CLUSTER, count)
    local = snap.slots.run(svc_id, bank, s.LB4_SCOPE_LOCAL, local_count)
    entries = ServiceEntries(
        svc_id=svc_id,
        frontends={fe: (own & ~SERVICE_WIDE) | (flags & SERVICE_WIDE) for fe, own in fronts.items()},
        affinity_timeout=affinity,
        backends=snap.backends.pick((*cluster, *local)),
        cluster_slots=cluster,
        local_slots=local,
        source_ranges=frozenset(snap.ranges.get(svc_id, ())),
        bank=bank,
    )
    unsettled = {fe: own | UNSETTLED for fe, own in entries.frontends.items() if snap.records[fe] != entries.service(own)}
    if unsettled:  # ServiceEntries.frontends is read-only: a new one, in the same order
        entries = replace(entries, frontends={**dict(entries.frontends.items()), **unsettled})
    return entries


def settle(programs: ServicePrograms, name, held: ServiceEntries) -> int:
    """Give every frontend of `held` (taken over for `name`) the record its service has, where a
    stopped sync left it another: one write each. Returns the writes."""
    if not any(flags & UNSETTLED for flags in held.frontends.values()):
        return 0
    clean = {fe: flags & ~UNSETTLED for fe, flags in held.frontends.items()}
    return programs.apply(name, ServiceEntries(held.svc_id, clean, held.affinity_timeout, held.backends,
                                               held.cluster_slots, held.local_slots, held.source_ranges, held.bank))


def adopt(programs: ServicePrograms, state: ProxyState) -> int:
    """Give `programs` the maps' current content for every service port of `state` it can match;
    remove the rest. Returns the map writes made (deletions only)."""
    maps = programs.maps
    snap = read(maps)
    programs.reserve_ids(snap.max_svc_id, snap.max_backend_id)
    claimed: dict[int, ServiceEntries] = {}
    writes = unsettled = 0
    services = state.services
    for name in sorted_names(services):  # the names' order (dataclass __lt__), sorted as strings
        svc = services[name]
        if not programs.serves(svc):  # not in this family's maps (programs.maps: Maps or Maps6)
            continue
        svc_id = snap.owner_of(Frontend(svc.cluster_ip, svc.port, IPPROTO[svc.protocol.value]))
        if svc_id is None or svc_id in claimed:
            continue
        claimed[svc_id] = entries_of(snap, svc_id)
        programs.take_over(name, claimed[svc_id])
        settled = settle(programs, name, claimed[svc_id])
        if settled:
            claimed[svc_id] = programs.current[name]
            writes += settled
            unsettled += 1

    writes += remove_strays(programs, strays(snap, claimed))
    if snap.frontends:
        log.info("adopted %d service ports from the pinned maps (%d left halfway by a stopped sync, settled), "
                 "removed %d orphans (%d writes)",
                 len(claimed), unsettled, len(set(snap.frontends) - set(claimed)), writes)
    return writes


@dataclass(frozen=True)
class Strays:
    """What the maps hold that no service port of `claimed` accounts for (see strays())."""

    services: tuple[ServiceEntries, ...] = ()  # frontends (with their slots, backends, ranges) of unknown ids
    slots: tuple[tuple[int, int, int, int], ...] = ()  # (service id, bank, scope, slot) no frontend reads
    backends: tuple[int, ...] = ()  # backend ids no service's slots or entries reach
    ranges: tuple[tuple[int, str], ...] = ()  # (service id, CIDR) of no service


def strays(snap: Snapshot, claimed: Mapping[int, ServiceEntries]) -> Strays:
    """Everything in `snap` outside the entries of `claimed` (service id -> what it should hold):
    services whose id nobody claims, slots past a claimed service's count (or of an id without
    frontends), backends nobody references, source ranges of ids without frontends. Used after a
    restart (adopt: delete them) and by the drift audit (report them, then delete them)."""
    orphans = tuple(entries_of(snap, svc_id) for svc_id in sorted(set(snap.frontends) - set(claimed)))
    owners = {**{e.svc_id: e for e in orphans}, **claimed}  # an orphan's own slots go with it (remove())
    slots = []
    for svc_id, bank, scope, slot in snap.slots:  # in key order
        owner = owners.get(svc_id)
        if owner is None or bank != owner.bank or \
                slot >= len(owner.cluster_slots if scope == s.LB4_SCOPE_CLUSTER else owner.local_slots):
            slots.append((svc_id, bank, scope, slot))
    backends = tuple(snap.backends.ids_except(bid for e in (*claimed.values(), *orphans) for bid in e.backends))
    ranges = tuple((svc_id, cidr) for svc_id, cidrs in sorted(snap.ranges.items())
                   if svc_id not in snap.frontends and svc_id not in claimed for cidr in sorted(cidrs))
    return Strays(orphans, tuple(slots), backends, ranges)


def remove_strays(programs: ServicePrograms, found: Strays) -> int:
    """Delete what strays() found. Returns the map writes made."""
    maps = programs.maps
    writes = sum(programs.remove(entries) for entries in found.services)
    for svc_id, bank, scope, slot in found.slots:
        writes += maps.delete_slot(svc_id, scope, slot, bank=bank)
    for bid in found.backends:
        writes += maps.delete_backend(bid)
    for svc_id, cidr in found.ranges:
        writes += maps.delete_source_range(svc_id, cidr)
    return writes


def broken_chains(maps: Maps) -> list[str]:
    """Every frontend whose chain the programs would find broken: a slot below its record's count
    (in its bank) or that slot's backend missing. Empty for any state services.py's write order
    leaves, a kill -9 included; the lab and the tests read it right after killing an agent."""
    out = []
    for fe, rec in maps.services():
        bank = slot_bank(rec.flags)
        for scope, count in ((s.LB4_SCOPE_CLUSTER, rec.count), (s.LB4_SCOPE_LOCAL, rec.local_count)):
            for slot in range(count):
                bid = maps.slot(rec.id, scope, slot, bank=bank)
                if bid is None:
                    out.append(f"{fe}: service id {rec.id} bank {bank} scope {scope} slot {slot} is missing")
                elif maps.backend(bid) is None:
                    out.append(f"{fe}: backend {bid} (service id {rec.id} slot {slot}) is missing")
    return out
