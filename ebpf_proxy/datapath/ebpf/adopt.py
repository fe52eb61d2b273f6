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

import heapq
import logging
import socket
import struct
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, Sequence, ValuesView
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import (
    BACKEND4, IPPROTO, Backend, BackendValues, Backends, Frontend, Maps, Service, slot_bank,
)
from ebpf_proxy.datapath.ebpf.services import ServiceEntries, ServicePrograms, sorted_names
from ebpf_proxy.model import ProxyState
from ebpf_proxy.model.compact import OneEntry

log = logging.getLogger(__name__)

_NOWHERE = 0xFFFFFFFF  # BackendTable._where: no backend has this id; SlotTable._flat: a hole
_U32_ARRAY = "I"  # array typecode of a backend id, epx_backend's u32 key (as maps.Backends packs them)
# sorted_pairs' groups: keys that agree above these bits are sorted together. Service and backend
# ids are handed out densely from 1, so a group is up to 4,096 service ids' slots (~60,000 at 10
# endpoints each, cluster and local) or 65,536 backends
_SLOT_GROUP_SHIFT = 32 + 12
_BACKEND_GROUP_SHIFT = 16


def sorted_groups(rows: Iterable[tuple[int, int]], key_type: str, group_shift: int) -> Iterator[tuple[array, array]]:
    """(key, u32 value) rows, each key once, in any order (a hash map's), as groups of two
    arrays sorted by key (keys of `key_type`, values "I"), the groups in key order: together,
    every row sorted by key.

    Sorting them all at once (sorted() of key << 32 | value) held one Python int an entry,
    ~45 bytes: at 100,000 Services x 10 endpoints ~100 MiB for epx_slot's 1.5 million entries
    and ~70 MiB for epx_backend's million, at the peak of every restart and drift audit (a lab
    agent restarted there: 350 MiB synced, 445 MiB at each audit). Here the rows are first split, packed
    (12 bytes an entry), into groups by their key's bits above `group_shift`, and the groups are
    sorted one at a time in key order: only one group's ints exist at once, and each group's
    packed rows are freed as it is handed out."""
    groups: dict[int, tuple[array, array]] = {}
    for key, value in rows:
        group = groups.get(key >> group_shift)
        if group is None:
            group = groups[key >> group_shift] = (array(key_type), array("I"))
        group[0].append(key)
        group[1].append(value)
    for top in sorted(groups):
        group_keys, group_values = groups.pop(top)
        merged = sorted(k << 32 | v for k, v in zip(group_keys, group_values))
        del group_keys, group_values
        yield array(key_type, [m >> 32 for m in merged]), array("I", [m & 0xFFFFFFFF for m in merged])


def sorted_pairs(rows: Iterable[tuple[int, int]], key_type: str, group_shift: int) -> tuple[array, array]:
    """sorted_groups() joined: the rows as two arrays sorted by key."""
    # the results grow as the groups are freed, one at a time: both never exist whole at once
    keys, values = array(key_type), array("I")
    for group_keys, group_values in sorted_groups(rows, key_type, group_shift):
        keys.extend(group_keys)
        values.extend(group_values)
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

    def _packed_keys(self) -> Iterable:
        """The packed keys, in order."""
        return self._keys

    def __iter__(self) -> Iterator:
        return map(self._unpack_key, self._packed_keys())

    def _ordered_values(self) -> Iterator:
        """The values, in key order."""
        return map(self._value, range(len(self)))

    def items(self) -> ItemsView:
        return _Items(self)

    def values(self) -> ValuesView:
        return _Values(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} entries)"


class _Items(ItemsView):
    def __iter__(self) -> Iterator:
        table = self._mapping
        return zip(iter(table), table._ordered_values())


class _Values(ValuesView):
    def __iter__(self) -> Iterator:
        return self._mapping._ordered_values()


class SlotTable(_Packed):
    """epx_slot as read back: (service id, bank, scope, slot) -> backend id.

    Two parts, disjoint, together every entry:

    - the flat part (only when made with the spans epx_svc's records claim: with_spans, as read()
      does): for each (service id, bank, scope) a record names, slots 0..count-1 (the largest count
      its frontends give) laid out in key order in one array of backend ids, 4 bytes a slot, a
      hole (a slot the map does not hold, after a crash) marked _NOWHERE; the spans indexed by
      their sorted keys and where each starts. Each entry goes straight to its place as the map's
      batches stream in: nothing is grouped or sorted. At 1.5 million slots (100,000 Services x
      (10 cluster + 5 local)) the table took 23.3 MiB at its peak (8.4 MiB held) as the sorted
      part alone; this way 8.1 MiB, peak and held (see with_spans). A hole is marked in the array
      itself (a backend id no entry has: one that has it goes to the sorted part), not in a
      bytearray beside it (1.5 MB more).
    - the sorted part: everything else (no record claims it, another bank, a slot past the count,
      a backend id of _NOWHERE): strays, usually none. Its packed keys come in runs of
      consecutive numbers, held as the run's first key and where its backend ids start (12 bytes a
      run), not as a key each.
    """

    __slots__ = ("_starts", "_offsets", "_values", "_span_keys", "_span_at", "_flat", "_placed")

    def __init__(self, rows: Iterable[tuple[int, int]] = ()) -> None:
        """`rows`: (packed key, backend id) pairs, in any order, each key once: all in the sorted part."""
        self._span_keys, self._span_at, self._flat, self._placed = array("Q"), array("I", [0]), array("I"), 0
        self._sort_rest(rows)

    def _sort_rest(self, rows: Iterable[tuple[int, int]]) -> None:
        # the runs are found group by group as the keys come sorted: the sorted keys are never
        # held whole (12 MiB at 1.5 million slots, and as much again in a list of run starts,
        # at the peak of every restart and drift audit at 100,000 Services x 10 endpoints)
        starts, offsets, values = array("Q"), array("I"), array("I")
        last = -2  # the key before: none yet (no key is last + 1)
        for keys, group_values in sorted_groups(rows, "Q", _SLOT_GROUP_SHIFT):
            at = len(values)
            for i, key in enumerate(keys):
                # a run ends where the next key is not the next slot of the same (service, bank, scope)
                if key != last + 1 or not key & 0xFFFF:
                    starts.append(key)
                    offsets.append(at + i)
                last = key
            values.extend(group_values)
        offsets.append(len(values))
        self._starts, self._values = starts, values
        self._offsets = offsets  # run r: values[offsets[r]:offsets[r + 1]]

    @classmethod
    def of(cls, slots: Iterable[tuple[int, int, int, int, int]]) -> "SlotTable":
        """From (service id, bank, scope, slot, backend id) rows (Maps.slots)."""
        return cls((svc_id << 32 | bank << 24 | scope << 16 | slot, bid) for svc_id, bank, scope, slot, bid in slots)

    @classmethod
    def with_spans(cls, spans: Iterable[tuple[int, int]],
                   batches: Iterable[tuple[Sequence[int], Sequence[int]]]) -> "SlotTable":
        """From (packed keys, backend ids) batches (Maps.slot_batches: keys packed as this table
        packs them), each entry inside one of `spans` put in the flat part, the rest sorted (all
        of them without spans).

        `spans`: (span key: svc_id << 32 | bank << 24 | scope << 16, slot count) in increasing key
        order, each key once (Records.slot_spans). At 1.5 million slots, 100,000 Services x (10
        cluster + 5 local), shuffled, in batches of 10,000: 8.1 MiB traced at the peak (the flat
        array 5.7 MiB, the span index 2.3 MiB), where sorting them all took 23.3 MiB, the peak of every
        restart and drift audit; CPU 1.05 s where sorting them all took 0.82 s (a bisection of the
        span keys an entry; no tracemalloc). A dict by span would be ~20 MiB at 200,000 spans."""
        table = cls.__new__(cls)
        span_keys, span_at, total, last = array("Q"), array("I", [0]), 0, -1
        for key, count in spans:
            if key & 0xFFFF or not 0 <= key < 1 << 64 or key <= last:
                raise ValueError(f"slot spans: {key:#x} is not a span key above the one before")
            count = min(count, 1 << 16)
            if count <= 0:
                continue
            last = key
            span_keys.append(key)
            total += count
            span_at.append(total)
        flat = array("I", [_NOWHERE]) * total
        rest_keys, rest_ids = array("Q"), array("I")
        for keys, ids in batches:
            for key, bid in zip(keys, ids):
                r = bisect_right(span_keys, key) - 1  # the span at or below the key
                if r >= 0 and bid != _NOWHERE:
                    at = span_at[r] + key - span_keys[r]
                    if at < span_at[r + 1]:
                        flat[at] = bid
                        continue
                rest_keys.append(key)
                rest_ids.append(bid)
        table._span_keys, table._span_at, table._flat = span_keys, span_at, flat
        table._placed = len(flat) - flat.count(_NOWHERE)
        table._sort_rest(zip(rest_keys, rest_ids))
        return table

    def _pack_key(self, key: object) -> int:
        svc_id, bank, scope, slot = key  # type: ignore[misc]
        if not (0 <= svc_id < 1 << 32 and 0 <= bank < 256 and 0 <= scope < 256 and 0 <= slot < 1 << 16):
            raise ValueError(key)
        return svc_id << 32 | bank << 24 | scope << 16 | slot

    def _unpack_key(self, packed: int) -> tuple[int, int, int, int]:
        return packed >> 32, packed >> 24 & 0xFF, packed >> 16 & 0xFF, packed & 0xFFFF

    def _value(self, index: int) -> int:
        return self._values[index]

    def _span_of(self, packed: int) -> tuple[int, int] | None:
        """(the span holding `packed`, where it would be in the flat part: held or a hole), None
        when no span has it."""
        r = bisect_right(self._span_keys, packed) - 1
        if r < 0:
            return None
        at = packed - self._span_keys[r]
        return (r, self._span_at[r] + at) if at < self._span_at[r + 1] - self._span_at[r] else None

    def _run_of(self, packed: int) -> tuple[int, int] | None:
        """(the sorted part's run holding `packed`, its place in it), None when no run does."""
        r = bisect_right(self._starts, packed) - 1
        if r < 0:
            return None
        at = packed - self._starts[r]
        return (r, at) if at < self._offsets[r + 1] - self._offsets[r] else None

    def _index(self, key: object) -> int | None:
        """`key`'s index in the sorted part's values (None if it is not there)."""
        try:
            found = self._run_of(self._pack_key(key))
        except (TypeError, ValueError):
            return None
        return None if found is None else self._offsets[found[0]] + found[1]

    def _lookup(self, key: object) -> int | None:
        try:
            packed = self._pack_key(key)
        except (TypeError, ValueError):
            return None
        span = self._span_of(packed)
        if span is not None and self._flat[span[1]] != _NOWHERE:
            return self._flat[span[1]]
        found = self._run_of(packed)
        return None if found is None else self._values[self._offsets[found[0]] + found[1]]

    def __getitem__(self, key: object) -> int:
        bid = self._lookup(key)
        if bid is None:
            raise KeyError(key)
        return bid

    def __contains__(self, key: object) -> bool:
        return self._lookup(key) is not None

    def __len__(self) -> int:
        return self._placed + len(self._values)

    def _flat_pairs(self) -> Iterator[tuple[int, int]]:
        flat, span_at = self._flat, self._span_at
        for r, span in enumerate(self._span_keys):
            first = span_at[r]
            for i in range(span_at[r + 1] - first):
                bid = flat[first + i]
                if bid != _NOWHERE:
                    yield span + i, bid

    def _rest_pairs(self) -> Iterator[tuple[int, int]]:
        offsets, values = self._offsets, self._values
        for r, start in enumerate(self._starts):
            first = offsets[r]
            for i in range(offsets[r + 1] - first):
                yield start + i, values[first + i]

    def _pairs(self) -> Iterator[tuple[int, int]]:
        """(packed key, backend id) of every entry, in key order (the parts merged: no key is in both)."""
        if not self._placed:
            return self._rest_pairs()
        if not self._values:
            return self._flat_pairs()
        return heapq.merge(self._flat_pairs(), self._rest_pairs())

    def _packed_keys(self) -> Iterator[int]:
        return (key for key, _ in self._pairs())

    def _ordered_values(self) -> Iterator[int]:
        return (bid for _, bid in self._pairs())

    def _piece(self, packed: int, most: int) -> array:
        """The backend ids of `packed` and the slots after it, up to the first one missing from
        the part holding `packed`, at most `most`."""
        span = self._span_of(packed)
        if span is not None and self._flat[span[1]] != _NOWHERE:
            r, at = span
            piece = self._flat[at:min(self._span_at[r + 1], at + most)]
            try:
                return piece[:piece.index(_NOWHERE)]
            except ValueError:
                return piece
        found = self._run_of(packed)
        if found is None:
            return array("I")
        first = self._offsets[found[0]] + found[1]
        return self._values[first:min(self._offsets[found[0] + 1], first + most)]

    def run(self, svc_id: int, bank: int, scope: int, most: int) -> tuple[int, ...]:
        """The backend ids in slots 0, 1, ... of (svc_id, bank, scope), up to the first missing
        slot, at most `most`: the flat span's, continued from the sorted part where it stops
        (a slot past the span, or held there)."""
        packed = self._pack_key((svc_id, bank, scope, 0))
        out = array("I")
        while len(out) < most:
            piece = self._piece(packed, most - len(out))
            if not piece:
                break
            out.extend(piece)
            packed += len(piece)
            if not packed & 0xFFFF:  # past slot 65535
                break
        return tuple(out)

    def slots_past(self, limit: Callable[[int, int, int], int]) -> Iterator[tuple[int, int, int, int]]:
        """Every key (service id, bank, scope, slot), in order, whose slot is not below
        limit(service id, bank, scope). A flat span within its limit is skipped whole, without a
        key made for each of its slots: 0.04 s CPU at 1.5 million slots (100,000 Services x 10
        endpoints) where a tuple a slot took 0.32 s before strays()' own test of each."""
        def flat() -> Iterator[int]:
            table, span_at = self._flat, self._span_at
            for r, span in enumerate(self._span_keys):
                first, count = span_at[r], span_at[r + 1] - span_at[r]
                lowest = max(0, limit(span >> 32, span >> 24 & 0xFF, span >> 16 & 0xFF))
                for i in range(lowest, count):
                    if table[first + i] != _NOWHERE:
                        yield span + i

        def rest() -> Iterator[int]:
            offsets = self._offsets
            for r, start in enumerate(self._starts):
                slot, length = start & 0xFFFF, offsets[r + 1] - offsets[r]
                lowest = max(slot, limit(start >> 32, start >> 24 & 0xFF, start >> 16 & 0xFF))
                yield from range(start + lowest - slot, start + length)

        return map(self._unpack_key, heapq.merge(flat(), rest()))

    def max_service_id(self) -> int:
        top = self._starts[-1] >> 32 if self._starts else 0
        flat, span_at = self._flat, self._span_at
        for r in range(len(self._span_keys) - 1, -1, -1):  # the highest span holding a slot
            if self._span_keys[r] >> 32 <= top:
                break
            if flat[span_at[r]:span_at[r + 1]].count(_NOWHERE) < span_at[r + 1] - span_at[r]:
                return self._span_keys[r] >> 32
        return top

    def max_backend_id(self) -> int:
        flat = max(self._flat, default=0)
        if flat == _NOWHERE:  # holes
            flat = max((bid for bid in self._flat if bid != _NOWHERE), default=0)
        return max(flat, max(self._values, default=0))


class BackendTable(_Packed):
    """epx_backend (epx_backend6 for Maps6) as read back: backend id -> Backend, made on access
    from the raw map value, kept as the map holds it (lb4_backend or lb6_backend: `family`, the
    Maps' BACKEND_VALUES, says its size and how it reads).

    The values stay in the order the map gave them (`_raw`); where each id's value is comes from
    a position by id (`_where`, 4 bytes an id from the lowest to the highest) when the ids are
    dense, as ServicePrograms hands them out, else from the ids sorted with their positions
    (`_keys`, `_order`: 8 bytes an entry). Sorting them (and reordering the values to match)
    was ~16 MiB more at the peak of every restart and drift audit at a million IPv4 backends."""

    __slots__ = ("_raw", "_family", "_where", "_base", "_order", "_count")

    def __init__(self, family: BackendValues = BACKEND4, ids: Iterable[int] = (), raw: bytes = b"") -> None:
        """`ids` and `raw`: the backend ids, each once, in any order, and their values back to back
        in the same order (`raw` may still be filled while `ids` is iterated: see of()); `raw`
        is kept, not copied, and so are `ids` given as an array of u32s (of_batches)."""
        size = family.size
        given = ids if isinstance(ids, array) and ids.typecode == _U32_ARRAY else array(_U32_ARRAY, ids)
        self._count = n = len(given)
        if len(raw) != n * size:
            raise ValueError(f"epx_backend: {len(raw)} bytes of values for {n} ids, "
                             f"not {size} bytes each ({family.name})")
        self._raw, self._family = raw, family
        self._keys, self._order, self._where, self._base = array(_U32_ARRAY), array("I"), array("I"), 0
        low, high = (min(given), max(given)) if n else (0, -1)
        if high - low + 1 <= 2 * n + 1024:  # dense: a position by id
            where = array("I", [_NOWHERE]) * (high - low + 1)
            for pos, bid in enumerate(given):
                where[bid - low] = pos
            self._where, self._base = where, low
        else:
            self._keys, self._order = sorted_pairs(zip(given, range(n)), _U32_ARRAY, _BACKEND_GROUP_SHIFT)

    @classmethod
    def of(cls, rows: Iterable[tuple[int, bytes]], family: BackendValues = BACKEND4) -> "BackendTable":
        """From (backend id, raw value) rows (Maps.backend_rows), streamed into two flat buffers."""
        raw = bytearray()

        def ids() -> Iterator[int]:
            for bid, value in rows:
                raw.extend(value)
                yield bid

        return cls(family, ids(), raw)  # raw is kept as it is: nobody else holds it

    @classmethod
    def of_batches(cls, batches: Iterable[tuple[bytes, bytes]], family: BackendValues = BACKEND4) -> "BackendTable":
        """From (ids, values) batches as the map holds them (Maps.backend_batches: u32 ids back to
        back, `family`'s values back to back), each appended whole to the two flat buffers: no
        object per backend, where of() takes a tuple and a bytes value each."""
        ids, raw = array(_U32_ARRAY), bytearray()
        for batch_ids, values in batches:
            ids.frombytes(batch_ids)
            raw += values
        return cls(family, ids, raw)

    def _pack_key(self, key: object) -> int:
        if type(key) is not int or not 0 <= key < 1 << 32:
            raise TypeError(key)
        return key

    def _unpack_key(self, packed: int) -> int:
        return packed

    def _index(self, key: object) -> int | None:
        """Where `key`'s value is in `_raw` (not its rank: see _value)."""
        try:
            bid = self._pack_key(key)
        except TypeError:
            return None
        return self._position(bid)

    def _position(self, bid: int) -> int | None:
        if self._where:
            i = bid - self._base
            return self._where[i] if 0 <= i < len(self._where) and self._where[i] != _NOWHERE else None
        keys = self._keys
        i = bisect_left(keys, bid)
        return self._order[i] if i < len(keys) and keys[i] == bid else None

    def __len__(self) -> int:
        return self._count

    def _pairs(self) -> Iterator[tuple[int, int]]:
        """(id, where its value is), in id order."""
        if self._where:
            base = self._base
            return ((base + i, pos) for i, pos in enumerate(self._where) if pos != _NOWHERE)
        return zip(self._keys, self._order)

    def _packed_keys(self) -> Iterator[int]:
        return (bid for bid, _ in self._pairs())

    def _ordered_values(self) -> Iterator[Backend]:
        return (self._value(pos) for _, pos in self._pairs())

    def _raw_at(self, pos: int) -> bytes:
        size = self._family.size
        return self._raw[pos * size:(pos + 1) * size]

    def _value(self, pos: int) -> Backend:
        return self._family.record(self._raw_at(pos))

    def max_id(self) -> int:
        if self._where:
            return self._base + len(self._where) - 1  # the highest id given has a position
        return self._keys[-1] if self._keys else 0

    def _positions(self, ids: Iterable[int]) -> Iterator[tuple[int, int]]:
        """(id, where its value is) of each of `ids` held (the others skipped), streamed. The
        dense table's lookup is inline: a restart and every drift audit look up each of a million
        backend ids twice (pick, ids_except), and a method call each was ~0.4 s of them at
        100,000 Services."""
        where = self._where
        if not where:
            position = self._position
            return ((bid, pos) for bid in ids if (pos := position(bid)) is not None)
        base, end = self._base, self._base + len(where)
        return ((bid, pos) for bid in ids if base <= bid < end and (pos := where[bid - base]) != _NOWHERE)

    def pick(self, ids: Iterable[int]) -> Mapping[int, Backend]:
        """The backends of those of `ids` held, in the order given (each id once), as
        ServiceEntries keeps them (IPv4: packed maps.Backends, no record made)."""
        hits = list(self._positions(dict.fromkeys(ids)))
        raw, size = self._raw, self._family.size
        return self._family.collect(array(_U32_ARRAY, [bid for bid, _ in hits]).tobytes(),
                                    b"".join([raw[pos * size:(pos + 1) * size] for _, pos in hits]))

    def ids_except(self, used: Iterable[int]) -> Iterator[int]:
        """The backend ids, in order, that `used` does not name: marked in a bytearray (a byte an
        entry) rather than collected in sets of a million ints. When every one is named (a
        restart, an audit that finds nothing stray), counted in C and not walked again."""
        seen = bytearray(self._count)
        if self._where:  # the dense table's lookup, inline: a million ids at 100,000 Services
            where, base, end = self._where, self._base, self._base + len(self._where)
            for bid in used:
                if base <= bid < end and (pos := where[bid - base]) != _NOWHERE:
                    seen[pos] = 1
        else:
            for _, pos in self._positions(used):
                seen[pos] = 1
        if 0 not in seen:
            return iter(())
        return (bid for bid, pos in self._pairs() if not seen[pos])


_RECORD_KEY = struct.Struct("!B16sHB")  # a frontend, sortable: address kind (0 node, 4, 6), address, port, proto
_KEY_SIZE = _RECORD_KEY.size
_RECORD_KEY_V4 = struct.Struct("!BI12xHB")  # the same key, its address read as an IPv4 one (Records._v4_keys)
_RECORD_FIELDS = 5  # a Service's fields, each a u32 in Records._values
_ADDR_KIND = {4: socket.AF_INET, 16: socket.AF_INET6}


def record_key_of(fe: Frontend) -> bytes:
    """Records' key of frontend `fe`."""
    if fe.addr is None:
        return _RECORD_KEY.pack(0, b"", fe.port, fe.proto)
    family = socket.AF_INET6 if ":" in fe.addr else socket.AF_INET
    addr = socket.inet_pton(family, fe.addr)
    return _RECORD_KEY.pack(len(addr), addr, fe.port, fe.proto)


def record_key_of_row(addr: bytes, port: int, proto: int) -> bytes:
    """Records' key of a frontend as Maps.service_rows gives it (the same as record_key_of's)."""
    return _RECORD_KEY.pack(len(addr), addr, port, proto)


def _record_frontend(key: bytes) -> Frontend:
    size, addr, port, proto = _RECORD_KEY.unpack(key)
    return Frontend(socket.inet_ntop(_ADDR_KIND[size], addr[:size]) if size else None, port, proto)


class _KeyRows(Sequence):
    """Records' packed keys as a sequence of bytes, for bisect."""

    __slots__ = ("_blob",)

    def __init__(self, blob: bytes) -> None:
        self._blob = blob

    def __len__(self) -> int:
        return len(self._blob) // _KEY_SIZE

    def __getitem__(self, i):  # type: ignore[override]
        # bisect's ~17 reads a frontend, for each of a restart's and audit's 100,000: the slice
        # tells an index past the end (empty), no len() each
        start = i * _KEY_SIZE
        row = self._blob[start:start + _KEY_SIZE] if i >= 0 else b""
        if not row:
            raise IndexError(i)
        return row

    def __iter__(self) -> Iterator[bytes]:
        return (self._blob[i:i + _KEY_SIZE] for i in range(0, len(self._blob), _KEY_SIZE))


class Records(_Packed):
    """epx_svc (epx_svc6) as read back: frontend -> Service, packed: the frontends as sorted
    20-byte keys, the records as five u32s each, and (service id, index) pairs sorted by id for a
    service id's frontends. A dict of Frontend and Service objects (with a tuple of frontends
    by service id) took ~35 MiB at 100,000 Services, at the peak of every restart and drift
    audit; this ~4 MiB. Frontends and Services are made on access."""

    __slots__ = ("_values", "_owners", "_ids", "_v4")

    def __init__(self, rows: Iterable[tuple[Frontend, Service]] = ()) -> None:
        self._fill((record_key_of(fe), (svc.id, svc.count, svc.local_count, svc.affinity_timeout, svc.flags))
                   for fe, svc in rows)

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[bytes, int, int, Sequence[int]]]) -> "Records":
        """From (address bytes, b"" for a nodePort's; port; proto; the record's five fields) rows
        (Maps.service_rows): keyed straight from the address bytes, no Frontend and no address
        text made for each (record_key_of's key for the same frontend)."""
        pack = _RECORD_KEY.pack  # record_key_of_row's, inline: a restart reads 100,000 rows
        records = cls.__new__(cls)
        records._fill((pack(len(addr), addr, port, proto), record) for addr, port, proto, record in rows)
        return records

    def _fill(self, keyed: Iterable[tuple[bytes, Sequence[int]]]) -> None:
        """Hold (record key, five record fields) rows, each frontend once, in any order."""
        keys: list[bytes] = []
        values = array("I")
        for key, record in keyed:
            keys.append(key)
            values.extend(record)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self._keys = _KeyRows(b"".join(keys[i] for i in order))
        del keys
        f = _RECORD_FIELDS
        self._values = array("I")
        for i in order:
            self._values.extend(values[i * f:(i + 1) * f])
        del values, order
        ids = self._values[::f]
        self._owners = array("Q", sorted(svc_id << 32 | i for i, svc_id in enumerate(ids)))
        self._ids = len(set(ids))  # how many service ids
        self._v4: tuple[int, array] | None = None  # _v4_keys(), made at the first IPv4 lookup

    def _v4_keys(self) -> tuple[int, array]:
        """(where the IPv4 frontends start, their keys as u64s: address << 24 | port << 8 | proto,
        in the same order). Sorted keys put the nodePorts' (kind 0) first, then every IPv4
        frontend's (kind 4), whose bytes sort as these ints do; a bisection of the array runs in
        C, where one of _KeyRows reads each step through Python: 0.30 -> 0.10 s for a restart's
        100,000 lookups (owner_of). 8 bytes a frontend, made in ~25 ms at that size."""
        if self._v4 is None:
            rows = list(_RECORD_KEY_V4.iter_unpack(self._keys._blob))
            start = sum(1 for row in rows if row[0] == 0)
            self._v4 = start, array("Q", [addr << 24 | port << 8 | proto for kind, addr, port, proto in rows if kind == 4])
        return self._v4

    def _index(self, key: object) -> int | None:
        if type(key) is Frontend and key.addr and ":" not in key.addr and 0 <= key.port < 1 << 16 and 0 <= key.proto < 256:
            try:
                addr = int.from_bytes(socket.inet_pton(socket.AF_INET, key.addr), "big")
            except OSError:  # not an address: none of ours
                return None
            start, keys = self._v4_keys()
            packed = addr << 24 | key.port << 8 | key.proto
            j = bisect_left(keys, packed)
            return start + j if j < len(keys) and keys[j] == packed else None
        return super()._index(key)

    def _pack_key(self, fe: object) -> bytes:
        if not isinstance(fe, Frontend):
            raise TypeError(fe)
        try:
            return record_key_of(fe)
        except (OSError, struct.error) as exc:  # not an address, a port beyond 16 bits
            raise ValueError(fe) from exc

    def _unpack_key(self, packed: bytes) -> Frontend:
        return _record_frontend(packed)

    def _value(self, i: int) -> Service:
        f = _RECORD_FIELDS
        return Service(*self._values[i * f:(i + 1) * f])

    def owner_of(self, fe: Frontend) -> int | None:
        i = self._index(fe)
        return None if i is None else self._values[i * _RECORD_FIELDS]

    def of_service(self, svc_id: int) -> Iterator[tuple[Frontend, Service]]:
        """The frontends (in key order) leading to `svc_id`, with their records."""
        owners = self._owners
        j = bisect_left(owners, svc_id << 32)
        while j < len(owners) and owners[j] >> 32 == svc_id:
            i = owners[j] & 0xFFFFFFFF
            yield _record_frontend(self._keys[i]), self._value(i)
            j += 1

    def service_ids(self) -> Iterator[int]:
        """Every service id a frontend leads to, each once, in order."""
        last = None
        for packed in self._owners:
            if packed >> 32 != last:
                last = packed >> 32
                yield last

    def has_service(self, svc_id: int) -> bool:
        j = bisect_left(self._owners, svc_id << 32)
        return j < len(self._owners) and self._owners[j] >> 32 == svc_id

    def service_count(self) -> int:
        return self._ids

    def slot_spans(self) -> Iterator[tuple[int, int]]:
        """Where the records say each service's slots are: (svc_id << 32 | bank << 24 | scope << 16,
        the largest count that service id's frontends give in that bank and scope), in key order,
        counts of 0 left out (SlotTable.with_spans). A half-done sync can leave two versions of a
        service (entries_of): both are spans."""
        values, f = self._values, _RECORD_FIELDS
        owners, j = self._owners, 0
        while j < len(owners):
            svc_id = owners[j] >> 32
            counts: dict[int, int] = {}
            while j < len(owners) and owners[j] >> 32 == svc_id:
                i = (owners[j] & 0xFFFFFFFF) * f
                bank = slot_bank(values[i + 4])
                for scope, count in ((s.LB4_SCOPE_CLUSTER, values[i + 1]), (s.LB4_SCOPE_LOCAL, values[i + 2])):
                    key = svc_id << 32 | bank << 24 | scope << 16
                    counts[key] = max(counts.get(key, 0), count)
                j += 1
            for key in sorted(counts):
                if counts[key]:
                    yield key, counts[key]


class _Frontends(Mapping):
    """Snapshot.frontends: service id -> {frontend: its flags, the slot bank left out (that is
    ServiceEntries.bank)}, each made on access from the records."""

    __slots__ = ("_records",)

    def __init__(self, records: Records) -> None:
        self._records = records

    def __getitem__(self, svc_id: int) -> dict[Frontend, int]:
        found = {fe: rec.flags & ~s.LB4_F_SLOT_BANK for fe, rec in self._records.of_service(svc_id)}
        if not found:
            raise KeyError(svc_id)
        return found

    def __contains__(self, svc_id: object) -> bool:
        return type(svc_id) is int and 0 <= svc_id < 1 << 32 and self._records.has_service(svc_id)

    def __iter__(self) -> Iterator[int]:
        return self._records.service_ids()

    def __len__(self) -> int:
        return self._records.service_count()


@dataclass
class Snapshot:
    """The service maps as read back: by service id.

    Each frontend's record is held once, packed (`records`, see Records); the flags by frontend
    (`frontends`) and a frontend's service id (`owner_of`) are read from the records."""

    records: Records = field(default_factory=Records)  # frontend -> its epx_svc entry
    slots: SlotTable = field(default_factory=SlotTable)  # (id, bank, scope, slot) -> backend id
    backends: BackendTable = field(default_factory=BackendTable)
    ranges: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    max_svc_id: int = 0
    max_backend_id: int = 0
    # made_ahead(self, id), indexed by service id (None: not made), made by the helper that read
    # the maps while the agent listed (readback.py); adopt() takes each instead of making it
    # again. Not part of what was read: a snapshot equals another of the same maps whatever was
    # made ahead
    made: list[ServiceEntries | None] = field(default_factory=list, compare=False)

    @property
    def frontends(self) -> Mapping[int, dict[Frontend, int]]:
        """service id -> {frontend: flags without the slot bank}."""
        return _Frontends(self.records)

    def owner_of(self, fe: Frontend) -> int | None:
        """The service id frontend `fe` leads to, None if the maps do not hold it."""
        return self.records.owner_of(fe)


def read(maps: Maps) -> Snapshot:
    snap = Snapshot()
    # each map read as raw batches, one at a time, into the packed tables (no ctypes object, no
    # tuple of fields per entry: ~2.5 million entries at 100,000 Services x 10 endpoints)
    snap.records = Records.of_rows(maps.service_rows())
    # epx_slot straight into the spans epx_svc's records claim (SlotTable.with_spans)
    snap.slots = SlotTable.with_spans(snap.records.slot_spans(), maps.slot_batches())
    snap.backends = BackendTable.of_batches(maps.backend_batches(), maps.BACKEND_VALUES)
    for svc_id, cidr in maps.source_ranges():
        snap.ranges[svc_id].add(cidr)
    max_svc_id = max(max(snap.frontends, default=0), snap.slots.max_service_id(), max(snap.ranges, default=0))
    max_backend_id = max(snap.backends.max_id(), snap.slots.max_backend_id(), maps.max_connection_backend_id())
    for svc_id, backend_id in maps.affinity_ids():
        max_svc_id, max_backend_id = max(max_svc_id, svc_id), max(max_backend_id, backend_id)
    snap.max_svc_id, snap.max_backend_id = max_svc_id, max_backend_id
    return snap


# The source ranges of a service port without any, shared: a frozenset() each was ~20 MiB at
# 100,000 Services, kept in ServicePrograms.current by a restart (Python makes a new empty one
# each call)
_NO_RANGES: frozenset[str] = frozenset()


# Marks, in ServiceEntries.frontends, a frontend whose epx_svc record differs from its service's
# (another bank or count: a sync stopped halfway): the flags of no real frontend, so the next
# apply() rewrites its record whatever the new flags are.
UNSETTLED = 1 << 31


# The LB4_F_* bits every frontend of one version of a service shares (the others say which kind of
# frontend it is: EXTERNAL, SOURCE_RANGES).
SERVICE_WIDE = s.LB4_F_ETP_LOCAL | s.LB4_F_ITP_LOCAL | s.LB4_F_HAS_ENDPOINTS


def entries_of(snap: Snapshot, svc_id: int, known: Iterable[Frontend] = ()) -> ServiceEntries:
    """What service `svc_id` holds in the maps, as ServiceEntries.

    Its frontends normally hold one record (bank, counts, affinity, service-wide flags). A sync
    stopped halfway can leave two, each a complete version of the service; the one most of its
    frontends hold (on a tie, the one with more slots) is taken as the service's, with that bank's
    slots 0..n-1 (no holes, no more than the record counts). Frontends that hold another record
    are marked UNSETTLED, with the flags they should have in the version taken (their own kind
    bits, the service-wide bits of that version).

    Frontends equal to one of `known` are given as that object (the model's, whose address text
    the model holds anyway): a restart keeps them in ServicePrograms.current, where a frontend
    made from the maps with its own address text each was ~12 MiB at 100,000 Services."""
    given = {fe: fe for fe in known}
    records = {given.get(fe, fe): rec for fe, rec in snap.records.of_service(svc_id)}
    fronts = {fe: rec.flags & ~s.LB4_F_SLOT_BANK for fe, rec in records.items()}
    versions = Counter((r.count, r.local_count, r.affinity_timeout, r.flags & (SERVICE_WIDE | s.LB4_F_SLOT_BANK))
                       for r in records.values())
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
        source_ranges=frozenset(snap.ranges[svc_id]) if svc_id in snap.ranges else _NO_RANGES,
        bank=bank,
    )
    unsettled = {fe: own | UNSETTLED for fe, own in entries.frontends.items() if records[fe] != entries.service(own)}
    if unsettled:  # ServiceEntries.frontends is read-only: a new one, in the same order
        entries = replace(entries, frontends={**dict(entries.frontends.items()), **unsettled})
    return entries


def made_ahead(snap: Snapshot, svc_id: int) -> ServiceEntries:
    """entries_of(snap, svc_id) as a helper makes it ahead for the agent's adopt() (Snapshot.made,
    readback.py): a service's one frontend given as None, as adopt() knows it (the frontend it
    looks the service up by) and gives its own object for it, whose address text the model holds
    anyway: 100,000 frontends and their address texts made and dropped again were ~13 MiB more
    at the peak of a restart at 100,000 Services."""
    entries = entries_of(snap, svc_id)
    if len(entries.frontends) != 1:
        return entries
    (flags,) = entries.frontends.values()
    return replace(entries, frontends=OneEntry(None, flags))


def _claim(snap: Snapshot, svc_id: int, fe: Frontend) -> ServiceEntries:
    """entries_of(snap, svc_id, (fe,)) for `fe`, a frontend of `svc_id`: made ahead where the
    snapshot has it (made_ahead), its frontend equal to `fe` then given as `fe` itself, as
    entries_of gives a known one."""
    made = snap.made[svc_id] if svc_id < len(snap.made) else None
    if made is None:
        return entries_of(snap, svc_id, (fe,))
    snap.made[svc_id] = None
    fronts = made.frontends
    if len(fronts) == 1:  # made_ahead's None: fe, the one frontend of svc_id
        (flags,) = fronts.values()
        shared: Mapping[Frontend, int] = OneEntry(fe, flags)
    else:
        shared = {fe if key == fe else key: flags for key, flags in fronts.items()}
    # made again field by field: dataclasses.replace() reads the fields' definitions each call
    # (~0.15 s of a restart's takeover at 100,000 Services)
    return ServiceEntries(made.svc_id, shared, made.affinity_timeout, made.backends, made.cluster_slots,
                          made.local_slots, made.source_ranges, made.bank)


def settle(programs: ServicePrograms, name, held: ServiceEntries) -> int:
    """Give every frontend of `held` (taken over for `name`) the record its service has, where a
    stopped sync left it another: one write each. Returns the writes."""
    if not any(flags & UNSETTLED for flags in held.frontends.values()):
        return 0
    clean = {fe: flags & ~UNSETTLED for fe, flags in held.frontends.items()}
    return programs.apply(name, ServiceEntries(held.svc_id, clean, held.affinity_timeout, held.backends,
                                               held.cluster_slots, held.local_slots, held.source_ranges, held.bank))


def adopt(programs: ServicePrograms, state: ProxyState, snap: Snapshot | None = None) -> int:
    """Give `programs` the maps' current content for every service port of `state` it can match;
    remove the rest. Returns the map writes made (deletions only). `snap`: read(programs.maps),
    read already (readback.py: by a helper, while the agent listed)."""
    maps = programs.maps
    if snap is None:
        snap = read(maps)
    programs.reserve_ids(snap.max_svc_id, snap.max_backend_id)
    claimed = ById(snap.max_svc_id)
    writes = unsettled = 0
    services = state.services
    for name in sorted_names(services):  # the names' order (dataclass __lt__), sorted as strings
        svc = services[name]
        if not programs.serves(svc):  # not in this family's maps (programs.maps: Maps or Maps6)
            continue
        fe = Frontend(svc.cluster_ip, svc.port, IPPROTO[svc.protocol.value])
        svc_id = snap.owner_of(fe)
        if svc_id is None or svc_id in claimed:
            continue
        claimed[svc_id] = held = _claim(snap, svc_id, fe)
        programs.take_over(name, held)
        settled = settle(programs, name, held)
        if settled:
            claimed[svc_id] = programs.current[name]
            writes += settled
            unsettled += 1
    snap.made = []  # what is left was made for ids no service port claims: strays() reads them whole

    found = strays(snap, claimed)
    writes += remove_strays(programs, found)
    if snap.frontends:
        log.info("adopted %d service ports from the pinned maps (%d left halfway by a stopped sync, settled), "
                 "removed %d orphans (%d writes)", len(claimed), unsettled, len(found.services), writes)
    return writes


class ById(Mapping):
    """Service id -> ServiceEntries, for ids handed out densely from 1 (ServicePrograms does):
    a list by id, 8 bytes an id up to the highest, where a dict took ~50 bytes an entry (5 MiB
    at 100,000 Services, at the peak of every restart, beside everything taken over). Ids
    above `highest` (none, from read()'s max_svc_id) go to a dict."""

    __slots__ = ("_by_id", "_more", "_count")

    def __init__(self, highest: int, entries: Iterable[ServiceEntries] = ()) -> None:
        self._by_id: list[ServiceEntries | None] = [None] * (max(highest, 0) + 1)
        self._more: dict[int, ServiceEntries] = {}
        self._count = 0
        for e in entries:
            self[e.svc_id] = e

    def __setitem__(self, svc_id: int, entries: ServiceEntries) -> None:
        if 0 <= svc_id < len(self._by_id):
            self._count += self._by_id[svc_id] is None
            self._by_id[svc_id] = entries
        else:
            self._count += svc_id not in self._more
            self._more[svc_id] = entries

    def __getitem__(self, svc_id: object) -> ServiceEntries:
        if type(svc_id) is int and 0 <= svc_id < len(self._by_id):
            found = self._by_id[svc_id]
            if found is None:
                raise KeyError(svc_id)
            return found
        return self._more[svc_id]  # type: ignore[index]

    def __contains__(self, svc_id: object) -> bool:
        # Mapping's own tries __getitem__ and catches its KeyError: adopt() asks once a service port
        if type(svc_id) is int and 0 <= svc_id < len(self._by_id):
            return self._by_id[svc_id] is not None
        return svc_id in self._more

    def get(self, svc_id: object, default: Any = None) -> Any:
        if type(svc_id) is int and 0 <= svc_id < len(self._by_id):
            found = self._by_id[svc_id]
            return default if found is None else found
        return self._more.get(svc_id, default)  # type: ignore[call-overload]

    def __iter__(self) -> Iterator[int]:
        yield from (i for i, e in enumerate(self._by_id) if e is not None)
        yield from self._more

    def __len__(self) -> int:
        return self._count

    def values(self) -> ValuesView:
        return _ByIdValues(self)


class _ByIdValues(ValuesView):
    def __iter__(self) -> Iterator[ServiceEntries]:
        table = self._mapping
        yield from (e for e in table._by_id if e is not None)
        yield from table._more.values()


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
    # the service ids the records hold come sorted, each once: no set of them (and none of
    # `claimed`'s keys) made to subtract, ~11 MiB at 100,000 Services at the peak of every
    # restart and drift audit; nor a copy of `claimed` to add the orphans to
    orphans = tuple(entries_of(snap, svc_id) for svc_id in snap.records.service_ids() if svc_id not in claimed)
    orphan_of = {e.svc_id: e for e in orphans}  # an orphan's own slots go with it (remove())

    def limit(svc_id: int, bank: int, scope: int) -> int:
        """The slots of (svc_id, bank, scope) its owner accounts for: slots 0..limit-1."""
        owner = claimed.get(svc_id)
        if owner is None:
            owner = orphan_of.get(svc_id)
        if owner is None or bank != owner.bank:
            return 0
        return len(owner.cluster_slots if scope == s.LB4_SCOPE_CLUSTER else owner.local_slots)

    # in key order; a span the records claim and its owner accounts for is skipped whole
    slots = list(snap.slots.slots_past(limit))
    backends = tuple(snap.backends.ids_except(_backend_ids(chain(claimed.values(), orphans))))
    ranges = tuple((svc_id, cidr) for svc_id, cidrs in sorted(snap.ranges.items())
                   if svc_id not in snap.frontends and svc_id not in claimed for cidr in sorted(cidrs))
    return Strays(orphans, tuple(slots), backends, ranges)


def _backend_ids(entries: Iterable[ServiceEntries]) -> array:
    """The backend ids of every one of `entries`, as one array: IPv4's packed Backends append
    their ids' bytes whole (a million ids a generator handed on one by one were ~0.1 s more)."""
    ids = array(_U32_ARRAY)
    for e in entries:
        backends = e.backends
        if type(backends) is Backends:
            ids.frombytes(backends.id_bytes())
        else:
            ids.extend(backends)
    return ids


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
