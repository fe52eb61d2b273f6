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
"""

from __future__ import annotations

import ipaddress
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import IPPROTO, Backend, Frontend, Maps, Service
from ebpf_proxy.datapath.ebpf.services import SUPPORTED, ServiceEntries, ServicePrograms
from ebpf_proxy.model import ProxyState

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """The service maps as read back: by service id."""

    frontends: dict[int, dict[Frontend, int]] = field(default_factory=lambda: defaultdict(dict))  # id -> fe -> flags
    affinity: dict[int, int] = field(default_factory=dict)  # id -> affinity timeout
    slots: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (id, scope, slot) -> backend id
    backends: dict[int, Backend] = field(default_factory=dict)
    ranges: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    owner: dict[Frontend, int] = field(default_factory=dict)  # frontend -> service id
    records: dict[Frontend, Service] = field(default_factory=dict)  # frontend -> its epx_svc entry
    max_svc_id: int = 0
    max_backend_id: int = 0


def read(maps: Maps) -> Snapshot:
    snap = Snapshot()
    for fe, svc in maps.services():
        snap.frontends[svc.id][fe] = svc.flags
        snap.affinity[svc.id] = svc.affinity_timeout
        snap.owner[fe] = svc.id
        snap.records[fe] = svc
    for svc_id, scope, slot, backend_id in maps.slots():
        snap.slots[(svc_id, scope, slot)] = backend_id
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


def _contiguous(snap: Snapshot, svc_id: int, scope: int) -> tuple[int, ...]:
    out = []
    while (bid := snap.slots.get((svc_id, scope, len(out)))) is not None:
        out.append(bid)
    return tuple(out)


def entries_of(snap: Snapshot, svc_id: int) -> ServiceEntries:
    """What service `svc_id` holds in the maps, as ServiceEntries (slots 0..n-1 without holes)."""
    cluster = _contiguous(snap, svc_id, s.LB4_SCOPE_CLUSTER)
    local = _contiguous(snap, svc_id, s.LB4_SCOPE_LOCAL)
    return ServiceEntries(
        svc_id=svc_id,
        frontends=snap.frontends.get(svc_id) or {},  # not copied: the snapshot is thrown away
        affinity_timeout=snap.affinity.get(svc_id, 0),
        backends={bid: snap.backends[bid] for bid in (*cluster, *local) if bid in snap.backends},
        cluster_slots=cluster,
        local_slots=local,
        source_ranges=frozenset(snap.ranges.get(svc_id, ())),
    )


def adopt(programs: ServicePrograms, state: ProxyState) -> int:
    """Give `programs` the maps' current content for every service port of `state` it can match;
    remove the rest. Returns the map writes made (deletions only)."""
    maps = programs.maps
    snap = read(maps)
    programs.reserve_ids(snap.max_svc_id, snap.max_backend_id)
    claimed: dict[int, ServiceEntries] = {}
    for name, svc in sorted(state.services.items()):
        if svc.cluster_ip is None or svc.protocol not in SUPPORTED or ipaddress.ip_address(svc.cluster_ip).version != 4:
            continue
        svc_id = snap.owner.get(Frontend(svc.cluster_ip, svc.port, IPPROTO[svc.protocol.value]))
        if svc_id is None or svc_id in claimed:
            continue
        claimed[svc_id] = entries_of(snap, svc_id)
        programs.take_over(name, claimed[svc_id])

    writes = remove_strays(programs, strays(snap, claimed))
    if snap.frontends:
        log.info("adopted %d service ports from the pinned maps, removed %d orphans (%d writes)",
                 len(claimed), len(set(snap.frontends) - set(claimed)), writes)
    return writes


@dataclass(frozen=True)
class Strays:
    """What the maps hold that no service port of `claimed` accounts for (see strays())."""

    services: tuple[ServiceEntries, ...] = ()  # frontends (with their slots, backends, ranges) of unknown ids
    slots: tuple[tuple[int, int, int], ...] = ()  # (service id, scope, slot) beyond a service's count or of no service
    backends: tuple[int, ...] = ()  # backend ids no service's slots or entries reach
    ranges: tuple[tuple[int, str], ...] = ()  # (service id, CIDR) of no service


def strays(snap: Snapshot, claimed: Mapping[int, ServiceEntries]) -> Strays:
    """Everything in `snap` outside the entries of `claimed` (service id -> what it should hold):
    services whose id nobody claims, slots past a claimed service's count (or of an id without
    frontends), backends nobody references, source ranges of ids without frontends. Used after a
    restart (adopt: delete them) and by the drift audit (report them, then delete them)."""
    orphans = tuple(entries_of(snap, svc_id) for svc_id in sorted(set(snap.frontends) - set(claimed)))
    slots = []
    for svc_id, scope, slot in sorted(snap.slots):
        owner = claimed.get(svc_id)
        if owner is not None:
            if slot >= len(owner.cluster_slots if scope == s.LB4_SCOPE_CLUSTER else owner.local_slots):
                slots.append((svc_id, scope, slot))
        elif svc_id not in snap.frontends:
            slots.append((svc_id, scope, slot))
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
    for svc_id, scope, slot in found.slots:
        writes += maps.delete_slot(svc_id, scope, slot)
    for bid in found.backends:
        writes += maps.delete_backend(bid)
    for svc_id, cidr in found.ranges:
        writes += maps.delete_source_range(svc_id, cidr)
    return writes
