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
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import IPPROTO, Backend, Frontend, Maps, Service, slot_bank
from ebpf_proxy.datapath.ebpf.services import ServiceEntries, ServicePrograms
from ebpf_proxy.model import ProxyState

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """The service maps as read back: by service id."""

    frontends: dict[int, dict[Frontend, int]] = field(default_factory=lambda: defaultdict(dict))  # id -> fe -> flags
    slots: dict[tuple[int, int, int, int], int] = field(default_factory=dict)  # (id, bank, scope, slot) -> backend id
    backends: dict[int, Backend] = field(default_factory=dict)
    ranges: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    owner: dict[Frontend, int] = field(default_factory=dict)  # frontend -> service id
    records: dict[Frontend, Service] = field(default_factory=dict)  # frontend -> its epx_svc entry
    max_svc_id: int = 0
    max_backend_id: int = 0


def read(maps: Maps) -> Snapshot:
    snap = Snapshot()
    for fe, svc in maps.services():
        snap.frontends[svc.id][fe] = svc.flags & ~s.LB4_F_SLOT_BANK  # the bank is ServiceEntries.bank
        snap.owner[fe] = svc.id
        snap.records[fe] = svc
    for svc_id, bank, scope, slot, backend_id in maps.slots():
        snap.slots[(svc_id, bank, scope, slot)] = backend_id
    snap.backends = maps.backends()
    for svc_id, cidr in maps.source_ranges():
        snap.ranges[svc_id].add(cidr)
    svc_ids = {*snap.frontends, *(k[0] for k in snap.slots), *snap.ranges}
    backend_ids = {*snap.backends, *snap.slots.values()}
    for svc_id, backend_id in maps.affinity_ids():
        svc_ids.add(svc_id)
        backend_ids.add(backend_id)
    backend_ids.add(maps.max_connection_backend_id())
    snap.max_svc_id = max(svc_ids, default=0)
    snap.max_backend_id = max(backend_ids, default=0)
    return snap


# Marks, in ServiceEntries.frontends, a frontend whose epx_svc record differs from its service's
# (another bank or count: a sync stopped halfway): the flags of no real frontend, so the next
# apply() rewrites its record whatever the new flags are.
UNSETTLED = 1 << 31


def _contiguous(snap: Snapshot, svc_id: int, bank: int, scope: int, most: int) -> tuple[int, ...]:
    out: list[int] = []
    while len(out) < most and (bid := snap.slots.get((svc_id, bank, scope, len(out)))) is not None:
        out.append(bid)
    return tuple(out)


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
    cluster = _contiguous(snap, svc_id, bank, s.LB4_SCOPE_CLUSTER, count)
    local = _contiguous(snap, svc_id, bank, s.LB4_SCOPE_LOCAL, local_count)
    entries = ServiceEntries(
        svc_id=svc_id,
        frontends={fe: (own & ~SERVICE_WIDE) | (flags & SERVICE_WIDE) for fe, own in fronts.items()},
        affinity_timeout=affinity,
        backends={bid: snap.backends[bid] for bid in (*cluster, *local) if bid in snap.backends},
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
    for name, svc in sorted(state.services.items()):
        if not programs.serves(svc):  # not in this family's maps (programs.maps: Maps or Maps6)
            continue
        svc_id = snap.owner.get(Frontend(svc.cluster_ip, svc.port, IPPROTO[svc.protocol.value]))
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
    for svc_id, bank, scope, slot in sorted(snap.slots):
        owner = owners.get(svc_id)
        if owner is None or bank != owner.bank or \
                slot >= len(owner.cluster_slots if scope == s.LB4_SCOPE_CLUSTER else owner.local_slots):
            slots.append((svc_id, bank, scope, slot))
    kept_backends = {bid for e in claimed.values() for bid in e.backends}
    orphan_backends = {bid for e in orphans for bid in e.backends}
    backends = tuple(sorted(set(snap.backends) - kept_backends - orphan_backends))
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
