"""From the model to map entries: what one service port puts in the maps, and how to get from
one version of it to the next with as few writes as possible.

The endpoint sets come from model.categorize, the same function the iptables datapath uses, so
both datapaths choose among the same backends. Ids are allocated here and never reused within a
process: a service port keeps its id while it exists, and a backend id names one (service port,
endpoint) for as long as that endpoint stays, so CT and affinity entries that outlive it can never
point at someone else. (An endpoint that leaves and comes back gets a new id.)

Memory: the only per-service state is `current`, one compact ServiceEntries per service port (the
ids live in it): backends packed (maps.Backends), slots packed (SlotIds), a lone frontend in a
OneEntry; ~650 bytes a service port of 10 endpoints (100,000 of them: ~64 MiB of RSS, was ~186,
bench/cpscale.py). Nothing is kept for what was deleted, so endpoint and service churn never
accumulate.

Slots are kept stable: a backend keeps its slot while it stays, a leaving backend's slot is
taken by a newcomer or by the last slot's backend. Writes are ordered so that a packet never
picks an empty slot: slots are written before the count that exposes them grows, and deleted
after it shrank.

No frontend ever sees a partial backend set, wherever the writer stops (a kill -9 halfway through
a full sync): at every write, each frontend's slots hold exactly the old backend set or the new
one, and every backend id in them exists. A change whose in-place writes keep that true (see
in_place(): appending, truncating, a leaving backend's hole filled by the last one) is written in
place: appended slots before the counts grow, dropped ones after they shrank. Any other change (a
backend replaced while others change) writes the service's whole new slot array in its other
bank (epx_slot keys carry a bank, 0 or 1), then switches each frontend to that bank with one
atomic epx_svc write (LB4_F_SLOT_BANK), then deletes the old bank. Backends are written before
the slots that name them and deleted after the last frontend stopped reaching them; a new
service's frontends are written last, a deleted service's first (new services in groups, each
map's entries of many in one batch, every one's order kept: NewPorts). tests/bpf/test_kill_mid_sync.py
stops the writer after every possible number of writes of a full sync and checks exactly this.
"""

from __future__ import annotations

import ipaddress
import itertools
import operator
from collections import Counter
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import (
    DETECT_CIDR,
    DETECT_IFACE,
    DETECT_NONE,
    IPPROTO,
    Backend,
    Backends,
    Frontend,
    MapFull,
    Maps,
    NodeSettings,
    Service,
    pack_service_fields,
    slot_array_keys,
)
from ebpf_proxy.model import NodeConfig, ProxyState
from ebpf_proxy.model.categorize import reachable
from ebpf_proxy.model.compact import OneEntry, compact_mapping
from ebpf_proxy.model.types import Endpoint, NodeTopology, Protocol, ServicePort, ServicePortName, ip_family, of_family

# SCTP's CRC32c is updated incrementally on a port rewrite (bpf/lib/sctp.h: a CRC is linear over GF(2))
SUPPORTED = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)


_ID_SIZE = array("I").itemsize


class SlotIds(Sequence[int]):
    """A scope's backend ids by slot, packed as u32s: a tuple of ids held an int object per slot
    (~45 MiB of the agent at 100,000 Services x 10 endpoints, bench/cpscale.py), this ~7 MiB.
    Reads as the tuple it replaces: indexing, iteration, len, and equal (and hashing alike) to a
    tuple of the same ids. Build with `pack`, which keeps () and ids beyond 32 bits as a tuple."""

    __slots__ = ("_packed",)

    def __init__(self, packed: bytes) -> None:
        self._packed = packed

    @classmethod
    def pack(cls, ids: Iterable[int]) -> "SlotIds | tuple[int, ...]":
        if isinstance(ids, SlotIds):
            return ids
        ids = tuple(ids)
        # every one an int (exactly) in a u32, checked in C: set, min, max (no Python loop)
        if not ids or set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= 1 << (8 * _ID_SIZE):
            return ids
        return cls(array("I", ids).tobytes())

    @classmethod
    def of_fresh(cls, ids: list[int]) -> "SlotIds | tuple[int, ...]":
        """pack() of ids the ServicePrograms counters handed out (plain ints, at least 1): only
        their range is left to check, which array() does (OverflowError beyond a u32)."""
        try:
            return cls(array("I", ids).tobytes()) if ids else ()
        except OverflowError:
            return tuple(ids)

    def __len__(self) -> int:
        return len(self._packed) // _ID_SIZE

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self._packed).cast("I"))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self)[index]
        return memoryview(self._packed).cast("I")[index]

    def __contains__(self, value: object) -> bool:
        return value in memoryview(self._packed).cast("I").tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SlotIds):
            return self._packed == other._packed
        if isinstance(other, tuple):  # as a tuple: equal to a tuple of the same, never to a list
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple:
        return (SlotIds, (self._packed,))


@dataclass(frozen=True, slots=True)
class ServiceEntries:
    """Everything one service port puts in the maps (ids already allocated)."""

    svc_id: int
    # frontend -> its LB4_F_* flags; read-only (a one-frontend dict given is kept as a OneEntry)
    frontends: Mapping[Frontend, int]
    affinity_timeout: int
    # backend id -> backend, packed (maps.Backends, a Mapping: ~130 MiB less at 100,000 Services
    # x 10 endpoints); a dict given is packed here
    backends: Mapping[int, Backend]
    cluster_slots: Sequence[int]  # backend ids by slot (SlotIds: packed; a tuple given is packed here)
    local_slots: Sequence[int]
    source_ranges: frozenset[str]
    bank: int = 0  # which epx_slot bank holds the slots (the module docstring: the bank swap)

    def __post_init__(self) -> None:
        # what ServicePrograms.entries gives is in these forms already: nothing to redo for it
        if type(self.frontends) is not OneEntry:
            object.__setattr__(self, "frontends", compact_mapping(self.frontends))
        if type(self.backends) is not Backends:
            object.__setattr__(self, "backends", Backends.pack(self.backends))
        if type(self.cluster_slots) is not SlotIds:
            object.__setattr__(self, "cluster_slots", SlotIds.pack(self.cluster_slots))
        if type(self.local_slots) is not SlotIds:
            object.__setattr__(self, "local_slots", SlotIds.pack(self.local_slots))

    def __reduce__(self) -> tuple:
        # its fields as a tuple, made again by __init__ (whose __post_init__ finds them packed
        # already), not the slots dataclass's field-by-field state: with OneEntry's own, the
        # 100,000 a restart's read-back helper sends (readback.py) pickled in 0.59 s, 1.3 s before
        return (ServiceEntries, (self.svc_id, self.frontends, self.affinity_timeout, self.backends,
                                 self.cluster_slots, self.local_slots, self.source_ranges, self.bank))

    def service(self, flags: int) -> Service:
        """The epx_svc record of a frontend with LB4_F_* `flags` (without LB4_F_SLOT_BANK: the bank is ours)."""
        flags = (flags & ~s.LB4_F_SLOT_BANK) | (s.LB4_F_SLOT_BANK if self.bank else 0)
        return Service(self.svc_id, len(self.cluster_slots), len(self.local_slots), self.affinity_timeout, flags)


def in_place(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether slots `before` can become `after` in place with every frontend seeing, at every
    step, exactly the old backend set or the new one.

    In place, _write overwrites the changed slots below both lengths in slot order, appends the
    new tail (unseen: the counts are still old), switches the counts, then deletes the old tail
    (unseen: the counts are new). Only a frontend still at the old count can see a mixture: after
    each overwrite, the backends its `len(before)` slots hold must be the old set or the new one.
    A backend moved into a leaving one's hole passes ([a, X, c, d] -> [a, d, c]: d is briefly
    counted twice, X is gone at once), as do appending and truncating; a replaced backend next to
    another change does not ([a, b] -> [c, d] would show {c, b}): that takes the other bank.
    Unchanged slots (most of a restart's or a resync's 200,000 at 100,000 Services) pass at once.
    """
    if before == after:
        return True
    old_set, new_set = set(before), set(after)
    seen = Counter(before)
    for i in range(min(len(before), len(after))):
        if before[i] == after[i]:
            continue
        seen[before[i]] -= 1
        if not seen[before[i]]:
            del seen[before[i]]
        seen[after[i]] += 1
        if seen.keys() != old_set and seen.keys() != new_set:
            return False
    return True


def next_bank(old: ServiceEntries | None, cluster: tuple[int, ...], local: tuple[int, ...]) -> int:
    """The bank the new slots go to: the current one when the change is in place, else the other."""
    if old is None:
        return 0
    if in_place(old.cluster_slots, cluster) and in_place(old.local_slots, local):
        return old.bank
    return 1 - old.bank


def stable_slots(previous: Sequence[int], wanted: Iterable[int]) -> Sequence[int]:
    """Slot order for `wanted` that moves as few of `previous`'s backends as possible: a tuple,
    or `previous` itself when it is packed (SlotIds, which reads as a tuple) and nothing moves."""
    wanted = set(wanted)
    if not previous:  # every one a newcomer: what the loops below make of them
        return tuple(sorted(wanted))
    if len(wanted) == len(previous) and wanted.issuperset(previous):  # the same backends: no hole, no newcomer
        # packed slots as they are (a restart's 200,000 unchanged scopes: no tuple made and packed again)
        return previous if type(previous) is SlotIds else tuple(previous)
    newcomers = sorted(wanted.difference(previous))
    slots: list[int | None] = [b if b in wanted else None for b in previous]
    for i, b in enumerate(slots):
        if b is None and newcomers:
            slots[i] = newcomers.pop(0)
    slots.extend(newcomers)
    while None in slots:  # fill the remaining holes from the end
        last = slots.pop()
        if last is not None:
            slots[slots.index(None)] = last
    return tuple(slots)  # type: ignore[arg-type]


_NAME_FIELDS = operator.attrgetter("namespace", "name", "port", "protocol")  # ServicePortName's, in order


def sorted_names(names: Iterable[ServicePortName]) -> list[ServicePortName]:
    """`names` in ServicePortName's order (its dataclass __lt__: namespace, name, port, protocol
    compared as a tuple), sorted as one string each: the fields joined by NUL, which sorts as the
    tuple does (NUL is below every other character, so a field that is a prefix of another still
    sorts first), as long as no field holds a NUL itself (else, or for fields that are not text,
    the tuples). Sorting 100,000 names through the Python-level __lt__ was ~3% of a full sync;
    strings sort in C. (With exactly three NULs in each, two names have the same string only
    when they are equal: the positions sorted by string are the names' order.)"""
    names = list(names)
    try:
        keys = list(map("\0".join, map(_NAME_FIELDS, names)))
    except TypeError:
        return sorted(names)
    if sum(map(str.count, keys, itertools.repeat("\0"))) != 3 * len(keys):
        return sorted(names)
    return [names[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]


LOCALHOST = "127.0.0.1"
_NO_RANGES: frozenset[str] = frozenset()


def node_settings(node: NodeConfig, host_netns_cookie: int = 0, snat_addr: str | None = None,
                  **overrides) -> NodeSettings:
    """epx_config for a node.

    The masquerade address is `snat_addr` when given (devices.primary_address: the address
    MASQUERADE would pick), else the first IPv4 node IP (none on an IPv6-only node: epx_config's
    address is IPv4's, IPv6's is epx_config6's). The local-traffic detector decides by source
    CIDR (epx_pod_cidr/epx_pod_cidr6, see detector_cidrs) or by device (epx_iface, see
    devices.py); a CIDR detector without a CIDR of the node's family is kube-proxy's no-op
    detector (detector_is_noop). The flags are shared by both families' programs (one
    epx_config), but for IPv6 epx_config6 says whether its detector is the no-op one. Connection
    timeouts are kube-proxy's conntrack settings (node.conntrack).
    """
    v4_ips = of_family(node.node_ips, 4)
    if node.detector.by_interface:
        local_detect = DETECT_IFACE
    else:
        local_detect = DETECT_NONE if detector_is_noop(node) else DETECT_CIDR
    ct = node.conntrack
    return NodeSettings(
        snat_addr=snat_addr or (v4_ips[0] if v4_ips else None),
        tcp_est_timeout=ct.tcp_established,
        tcp_close_wait_timeout=ct.tcp_close_wait,
        udp_timeout=ct.udp,
        udp_stream_timeout=ct.udp_stream,
        masquerade_all=node.masquerade_all,
        localhost_nodeports=node.localhost_nodeports,
        local_detect=local_detect,
        host_netns_cookie=host_netns_cookie,
        **overrides,
    )


def node_addresses(node: NodeConfig) -> list[str]:
    """What epx_node_addr (epx_node_addr6 for an IPv6 NodeConfig) holds: the node's addresses of
    its family, plus 127.0.0.1 on IPv4 when NodePorts answer on localhost (a LOCAL address to
    kube-proxy's addrtype match, as source and as destination; kube-proxy has none on IPv6)."""
    addrs = list(of_family(node.node_ips, node.family))
    if node.family == 4 and node.localhost_nodeports and LOCALHOST not in addrs:
        addrs.append(LOCALHOST)
    return addrs


def program_node(maps: Maps, node: NodeConfig, settings: NodeSettings | None) -> int:
    """Write what the datapath needs to know about the node (settings, addresses, pod CIDRs),
    only where the maps differ. `maps` is the family's (Maps, or Maps6 for an IPv6 NodeConfig);
    `settings` None: epx_config is not this family's to write (the shared node's, see
    shared.py). Returns the writes made."""
    writes = int(maps.set_settings(settings)) if settings is not None else 0
    writes += maps.set_node_addrs(node_addresses(node))
    writes += maps.set_pod_cidrs(detector_cidrs(node))
    return writes


def detector_is_noop(node: NodeConfig) -> bool:
    """Whether the node's local-traffic detector is, for its family, kube-proxy's no-op one: a CIDR
    detector without a CIDR of that family (a dual-stack node whose --cluster-cidr names one family
    only: pkg/proxy/util/localdetector.go's NewNoOpLocalDetector for the other). The detector's
    kind is shared by both families' programs (epx_config); this is per family (epx_config's
    CFG_F_DETECT_NONE for IPv4, epx_config6's CFG6_F_DETECT_NONE for IPv6)."""
    return not node.detector.by_interface and not detector_cidrs(node)


def detector_cidrs(node: NodeConfig) -> list[str]:
    """What epx_pod_cidr (epx_pod_cidr6) holds: the CIDR detector's prefixes of the node's family
    (--cluster-cidr for ClusterCIDR, the Node's podCIDRs for NodeCIDR); nothing for the other
    detectors."""
    detector = node.detector
    if not detector.by_cidr:
        return []
    return [c for c in detector.cidrs if ipaddress.ip_network(c, strict=False).version == node.family]


def _normalized(cidrs: Iterable[str], family: int = 4) -> frozenset[str]:
    """CIDRs as the maps give them back ("203.0.113.5/24" -> "203.0.113.0/24"), of `family` only,
    so that two spellings of one prefix never look like an addition and a deletion of the same key."""
    nets = (ipaddress.ip_network(c, strict=False) for c in cidrs)
    return frozenset(str(n) for n in nets if n.version == family)


GROUP = 4096  # new service ports whose writes sync_names sends out together (NewPorts)


class NewPorts:
    """New service ports' writes (none of their entries in the maps yet), gathered over up to
    GROUP of them and written as one batch per map: their backends, then their slots, then their
    frontends. Written one service port at a time, a full sync at 100,000 Services x 10
    endpoints made three syscalls per port (~300,000, and the Python around each): sync_names
    took 4.0 s of CPU there, 2.9 s in groups (1.0 s of it the kernel's 2.1 million updates;
    bench/cpscale.py, 2026-11-26).

    Each map gets the same entries in the same order as apply() one port at a time would write
    them; only the interleaving of the maps changes, and not within a port: every port's backends
    still go before its slots, its slots before its frontends (the module docstring's order), so
    a writer stopped anywhere leaves each of them in a state its own single writes pass through
    (tests/bpf/test_kill_mid_sync.py kills this path at every write too). A port is remembered
    (`current`) only once its frontends are in. A full map (MapFull), or any other error, in a
    group's batch: the group is written again one port at a time by apply() (what went in is
    rewritten with the same bytes), so which ports did not fit, or which one raises, is decided
    exactly as single writes decide it. (An error that stays raises at the first port: what
    the batch wrote of the ports after it stays in the maps unclaimed, complete but under ids
    no port holds, until the next drift audit (or a restart's adopt) removes it as strays, as a
    port's own half-written entries would be.)"""

    def __init__(self, programs: "ServicePrograms") -> None:
        self._programs = programs
        self._reset()

    def _reset(self) -> None:
        self._ports: list[tuple[ServicePortName, ServiceEntries]] = []
        self._writes = 0
        self._backend_keys: list[bytes] = []
        self._backend_values: list[bytes] = []
        self._slot_keys: list[bytes] = []
        self._slot_values: list[bytes] = []
        self._frontend_keys: list[bytes] = []
        self._frontend_values: list[bytes] = []
        self._frontend_count = self._backend_count = 0

    def __len__(self) -> int:
        return len(self._ports)

    def take(self, name: ServicePortName, new: ServiceEntries) -> bool:
        """Gather the writes of `new`, a service port the maps do not hold; False (nothing taken)
        when its entries are not in the packed forms this writes (apply() writes those)."""
        backends, cluster, local = new.backends, new.cluster_slots, new.local_slots
        if new.source_ranges or not (type(cluster) is SlotIds or not cluster) or \
                not (type(local) is SlotIds or not local):
            return False
        if type(backends) is Backends:  # packed as epx_backend holds them
            packed = backends.map_entries()
            keys, values = packed.keys, packed.values
        else:  # IPv6 (Backends packs IPv4 only), or an address Backends cannot hold exactly
            entry = self._programs.maps.backend_entry
            pairs = [entry(bid, be) for bid, be in backends.items()]
            keys, values = b"".join([k for k, _ in pairs]), b"".join([v for _, v in pairs])
        self._backend_keys.append(keys)
        self._backend_values.append(values)
        svc_id, bank = new.svc_id, new.bank
        n_cluster, n_local, n_frontends, n_backends = len(cluster), len(local), len(new.frontends), len(backends)
        if n_cluster:
            self._slot_keys.append(slot_array_keys(svc_id, s.LB4_SCOPE_CLUSTER, bank, n_cluster))
            self._slot_values.append(cluster._packed)  # type: ignore[union-attr]
        if n_local:
            self._slot_keys.append(slot_array_keys(svc_id, s.LB4_SCOPE_LOCAL, bank, n_local))
            self._slot_values.append(local._packed)  # type: ignore[union-attr]
        key, bank_flag = self._programs.maps.frontend_key, s.LB4_F_SLOT_BANK if bank else 0
        for fe, flags in new.frontends.items():  # new.service(flags), packed without the record
            self._frontend_keys.append(key(fe))
            self._frontend_values.append(pack_service_fields(
                svc_id, n_cluster, n_local, new.affinity_timeout, (flags & ~s.LB4_F_SLOT_BANK) | bank_flag))
        self._writes += n_backends + n_cluster + n_local + n_frontends
        self._frontend_count += n_frontends
        self._backend_count += n_backends
        self._ports.append((name, new))
        return True

    def flush(self, did_not_fit: dict[ServicePortName, MapFull]) -> int:
        """Write what was gathered; returns the map writes made. A port a full map refused goes
        into `did_not_fit`, as in sync_names."""
        ports, writes, counts = self._ports, self._writes, (self._frontend_count, self._backend_count)
        if not ports:
            return 0
        batches = (("epx_backend", self._backend_keys, self._backend_values),
                   ("epx_slot", self._slot_keys, self._slot_values),
                   ("epx_svc", self._frontend_keys, self._frontend_values))
        self._reset()  # empty again, whatever happens below
        programs, m = self._programs, self._programs.maps
        try:
            for role, keys, values in batches:
                m.put_entries(role, b"".join(keys), b"".join(values))
        except OSError:  # MapFull among them: one port at a time decides which ports failed, and how
            writes = 0
            for name, new in ports:
                try:
                    writes += programs.apply(name, new)
                except MapFull as exc:
                    did_not_fit[name] = exc
            return writes
        programs.remember_new(ports, *counts)
        return writes


class ServicePrograms:
    """Keeps the maps equal to the desired service ports, one service port at a time."""

    def __init__(self, maps: Maps, node_ips: tuple[str, ...] = (), family: int = 4) -> None:
        self.maps = maps  # the family's: Maps, or Maps6 for IPv6 (its ids are its own: separate maps)
        self.node_ips = node_ips  # for the LB IPs a node address admits as sources (ServicePort)
        self.family = family
        self._next_svc = itertools.count(1)
        self._next_backend = itertools.count(1)
        self.current: dict[ServicePortName, ServiceEntries] = {}
        # frontends and backends over `current`, kept in step by every change: the agent reports
        # them after each sync, and summing 100,000 entries twice cost more than the sync
        self.frontend_count = 0
        self.backend_count = 0
        # frontends of UDP service ports deleted since the last completed sync: their stale
        # connections are flushed after the deletion (ChangeSet.stale_udp_*), see sync_done()
        self._deleted_udp: dict[ServicePortName, tuple[Frontend, ...]] = {}

    def reserve_ids(self, max_svc_id: int, max_backend_id: int) -> None:
        """Hand out only ids above these (ids found in the maps after a restart)."""
        self._next_svc = itertools.count(max(max_svc_id + 1, next(self._next_svc)))
        self._next_backend = itertools.count(max(max_backend_id + 1, next(self._next_backend)))

    def take_over(self, name: ServicePortName, entries: ServiceEntries) -> None:
        """Adopt entries the maps already hold for `name` (read back after a restart) as what
        `name` currently has: the next apply() writes only the difference, ids stay."""
        self._count(self.current.get(name), entries)
        self.current[name] = entries

    def remove(self, entries: ServiceEntries) -> int:
        """Delete entries no service port claims (found in the maps after a restart)."""
        return self._write(entries, None)

    def entries(self, svc: ServicePort, endpoints: Sequence[Endpoint],
                topology: NodeTopology = NodeTopology()) -> ServiceEntries | None:
        """The map entries for `svc` seen from this node (`topology`: its name and zone, for the
        endpoints' hints), or None when it is not programmed (headless, another family)."""
        return self._entries(svc, endpoints, topology, self.current.get(svc.name))

    def _entries(self, svc: ServicePort, endpoints: Sequence[Endpoint], topology: NodeTopology,
                 old: ServiceEntries | None) -> ServiceEntries | None:
        """entries(), given what `svc` has now (sync_names looks it up once for both its uses)."""
        if not self.serves(svc):
            return None
        family = self.family
        # categorize's sets as columns over all_reachable: the model's choice, read from the
        # packed endpoints without an Endpoint value each in the common case (building them,
        # categorizing them and packing them again as backends were ~30% of a 100,000-Service
        # full sync, bench/cpscale.py)
        sets = reachable(svc, endpoints, topology)
        n = len(sets.ports)
        kept: Backends | None = None  # old's backends, when they are what would be packed
        if old is None or not old.backends:  # every backend new: ids in order, as next() hands them
            ids = list(itertools.islice(self._next_backend, n))
        elif sets.v4 is not None and type(old.backends) is Backends \
                and (same := old.backends.ids_if_same(sets.v4, sets.ports)) is not None:
            ids = same  # the same backends in the same order: their ids as they are
            if old.backends.same_v4(sets.v4, sets.ports, sets.in_cluster, sets.in_local):
                kept = old.backends
        else:
            known = old.backends.ids_by_address() if type(old.backends) is Backends else \
                {(be.addr, be.port): bid for bid, be in old.backends.items()}
            next_id = self._next_backend.__next__
            ids = [known.get(key) or next_id() for key in zip(sets.ips(), sets.ports)]
        if kept is not None:
            backends: Mapping[int, Backend] = kept
        elif sets.v4 is not None:  # canonical dotted quads: packed from their bytes (Backends.of_v4)
            backends = Backends.of_v4(ids, sets.v4, sets.ports, sets.in_cluster, sets.in_local)
        else:
            backends = Backends.of(zip(ids, sets.ips(), sets.ports, sets.in_cluster, sets.in_local))

        base = (s.LB4_F_HAS_ENDPOINTS if sets.has_any else 0)
        base |= s.LB4_F_ETP_LOCAL if svc.external_policy_local else 0
        base |= s.LB4_F_ITP_LOCAL if svc.internal_policy_local else 0
        proto = IPPROTO[svc.protocol]  # a str enum: its own text as the key (.value is a Python property)
        clusterip = Frontend(svc.cluster_ip, svc.port, proto)
        ranges = frozenset(svc.load_balancer_source_ranges) if svc.load_balancer_source_ranges else _NO_RANGES
        if ranges and svc.lb_ips_admitted_as_source(self.node_ips):
            ranges |= {f"{ip}/{32 if ip_family(ip) == 4 else 128}" for ip in svc.load_balancer_ips}
        frontends: Mapping[Frontend, int]
        if not (svc.node_port or svc.external_ips or svc.load_balancer_ips):
            frontends = OneEntry(clusterip, base)  # most service ports: no dict to hash it into
        else:
            more = {clusterip: base}
            external = base | s.LB4_F_EXTERNAL
            if svc.node_port:
                more[Frontend(None, svc.node_port, proto)] = external
            for ip in svc.external_ips:
                if ip_family(ip) == family:
                    more[Frontend(ip, svc.port, proto)] = external
            for ip in svc.load_balancer_ips:
                if ip_family(ip) == family:
                    more[Frontend(ip, svc.port, proto)] = external | (s.LB4_F_SOURCE_RANGES if ranges else 0)
            frontends = more

        cluster_ids = ids if all(sets.in_cluster) else [bid for bid, c in zip(ids, sets.in_cluster) if c]
        local_ids = [bid for bid, loc in zip(ids, sets.in_local) if loc] if any(sets.in_local) else []
        if old is None:  # fresh ids, ascending: already what stable_slots((), ...) makes of them
            cluster_slots, local_slots = SlotIds.of_fresh(cluster_ids), SlotIds.of_fresh(local_ids)
            svc_id, bank = next(self._next_svc), 0
        else:
            cluster_slots = stable_slots(old.cluster_slots, cluster_ids)
            local_slots = stable_slots(old.local_slots, local_ids)
            svc_id, bank = old.svc_id, next_bank(old, cluster_slots, local_slots)
        return ServiceEntries(
            svc_id=svc_id,
            frontends=frontends,
            affinity_timeout=svc.affinity_timeout_seconds,
            backends=backends,
            cluster_slots=cluster_slots,
            local_slots=local_slots,
            source_ranges=_normalized(ranges, family) if svc.load_balancer_ips else _NO_RANGES,
            bank=bank,
        )

    def serves(self, svc: ServicePort) -> bool:
        """Whether `svc` is programmed here: a clusterIP of this family, a protocol the programs
        translate."""
        return svc.cluster_ip is not None and svc.protocol in SUPPORTED and ip_family(svc.cluster_ip) == self.family

    def apply(self, name: ServicePortName, new: ServiceEntries | None) -> int:
        """Move the maps from what `name` had to `new` (None: delete). Returns the map writes made."""
        old = self.current.get(name)
        if old is new or (old is not None and old == new):
            return 0
        writes = self._write(old, new)
        self.remember(name, old, new)
        return writes

    def remember(self, name: ServicePortName, old: ServiceEntries | None, new: ServiceEntries | None) -> None:
        """`name` went from `old` to `new` in the maps: what `current` and the counts say."""
        self._count(old, new)
        if new:
            self.current[name] = new
            if self._deleted_udp:
                self._deleted_udp.pop(name, None)
        else:
            del self.current[name]
            if name.protocol is Protocol.UDP:
                self._deleted_udp[name] = tuple(old.frontends)  # type: ignore[union-attr]

    def sync_names(self, state: ProxyState, names: Iterable[ServicePortName],
                   progress: Callable[[float], None] | None = None,
                   every: int = 64) -> tuple[int, dict[ServicePortName, MapFull]]:
        """Bring each of `names` to what `state` wants (absent: deleted), in name order, so a sync
        writes in the same order every time. Returns the map writes made, and the service ports a
        full map refused (the others are still written: a deletion later may free room).
        `progress` hears the fraction done every `every` service ports. New service ports' writes
        go out GROUP at a time (NewPorts); a service port the maps hold already is written after
        the new ones before it, so every map still sees its writes in name order. A name given
        twice is synced once (a new port taken twice into one group would be written twice,
        and counted twice); a set, as the syncs give, is taken as it is (deduplicating 100,000
        names is a 5 MiB dict at the peak of a restart)."""
        ordered = sorted_names(names if isinstance(names, AbstractSet) else dict.fromkeys(names))
        writes, did_not_fit = 0, {}
        services, endpoints, topology, current = state.services, state.endpoints, state.topology, self.current
        group = NewPorts(self)
        try:
            for done, name in enumerate(ordered):
                svc, old = services.get(name), current.get(name)
                entries = self._entries(svc, endpoints.get(name, ()), topology, old) if svc else None
                if entries is not None and old is None and group.take(name, entries):
                    if len(group) >= GROUP:
                        writes += group.flush(did_not_fit)
                elif entries is None and old is None:
                    pass  # not programmed here (another family, headless): nothing to write, the group goes on
                else:
                    writes += group.flush(did_not_fit)
                    try:
                        writes += self.apply(name, entries)
                    except MapFull as exc:
                        did_not_fit[name] = exc
                if progress is not None and done % every == 0:
                    progress(done / len(ordered))
            writes += group.flush(did_not_fit)
        finally:  # an error on the way: what was gathered before it is written, as one by one
            group.flush(did_not_fit)
        return writes, did_not_fit

    def remember_new(self, ports: list[tuple[ServicePortName, ServiceEntries]], frontends: int, backends: int) -> None:
        """remember(name, None, new) of each (name, new) of service ports that were not in
        `current`, whose frontends and backends number `frontends` and `backends` in all."""
        self.current.update(ports)
        self.frontend_count += frontends
        self.backend_count += backends
        if self._deleted_udp:
            for name, _ in ports:
                self._deleted_udp.pop(name, None)

    def _count(self, old: ServiceEntries | None, new: ServiceEntries | None) -> None:
        for entries, sign in ((old, -1), (new, 1)):
            if entries is not None:
                self.frontend_count += sign * len(entries.frontends)
                self.backend_count += sign * len(entries.backends)

    def sync_done(self) -> None:
        """The sync that deleted service ports has flushed their connections: forget them."""
        self._deleted_udp.clear()

    def _write(self, old: ServiceEntries | None, new: ServiceEntries | None) -> int:
        writes = 0
        m = self.maps
        old_backends = dict(old.backends.items()) if old else {}  # looked up by id: once, not a scan each
        svc_id = new.svc_id if new else old.svc_id  # type: ignore[union-attr]

        # a bank swap: the new slots go to the other bank whole, the old bank goes after the flip
        swapped = old is not None and new is not None and old.bank != new.bank
        if new:
            # each map's writes in one batch, in the order single writes would make them (a
            # batch is written entry by entry, in order: readers see the same sequence)
            if old is None and isinstance(new.backends, Backends):  # every one new: packed as they are
                backends = new.backends.map_entries()
                m.set_backend_entries(backends)
            else:
                backends = [(bid, be) for bid, be in new.backends.items() if old_backends.get(bid) != be]
                m.set_backends(backends)
            same_bank = old is not None and not swapped
            cluster, local = new.cluster_slots, new.local_slots
            if not same_bank and (type(cluster) is SlotIds or not cluster) and (type(local) is SlotIds or not local):
                # a whole slot array in a bank of its own (a new service, a bank swap): every slot
                # written, in the order below, straight from the packed ids
                m.set_slot_arrays(svc_id, new.bank, [
                    (scope, slots._packed if type(slots) is SlotIds else b"")  # type: ignore[union-attr]
                    for scope, slots in ((s.LB4_SCOPE_CLUSTER, cluster), (s.LB4_SCOPE_LOCAL, local))])
                writes += len(cluster) + len(local)
            else:
                slot_writes = []
                for scope, slots, before in (
                    (s.LB4_SCOPE_CLUSTER, new.cluster_slots, old.cluster_slots if same_bank else ()),
                    (s.LB4_SCOPE_LOCAL, new.local_slots, old.local_slots if same_bank else ()),
                ):
                    for slot, bid in enumerate(slots):
                        if slot >= len(before) or before[slot] != bid:
                            slot_writes.append((svc_id, scope, slot, bid, new.bank))
                m.set_slot_entries(slot_writes)
                writes += len(slot_writes)
            writes += len(backends)
            for cidr in new.source_ranges - (old.source_ranges if old else frozenset()):
                m.add_source_range(svc_id, cidr)
                writes += 1
            old_fe = old.frontends if old else {}
            same_service = old is not None and old.service(0) == new.service(0)
            frontends = [(fe, new.service(flags)) for fe, flags in new.frontends.items()
                         if not same_service or old_fe.get(fe) != flags]
            m.set_services(frontends)
            writes += len(frontends)

        if old is None:  # nothing to remove
            return writes
        # removals, after nothing new points at what they remove; a frontend another service
        # port took over in this sync (a nodePort moving between services) is no longer ours
        for fe in old.frontends:
            if not new or fe not in new.frontends:
                held = m.service(fe)
                if held is not None and held.id == svc_id:
                    m.delete_service(fe)
                    writes += 1
        kept = new is not None and not swapped  # the old bank stays: only its tail goes
        for scope, before, now in (
            (s.LB4_SCOPE_CLUSTER, old.cluster_slots, new.cluster_slots if kept else ()),
            (s.LB4_SCOPE_LOCAL, old.local_slots, new.local_slots if kept else ()),
        ):
            for slot in range(len(now), len(before)):
                m.delete_slot(svc_id, scope, slot, bank=old.bank)
                writes += 1
        for cidr in old.source_ranges - (new.source_ranges if new else frozenset()):
            m.delete_source_range(svc_id, cidr)
            writes += 1
        new_ids = set(new.backends) if new else set()
        for bid in old_backends:
            if bid not in new_ids:
                m.delete_backend(bid)
                writes += 1
        return writes

    def frontends_of(self, name: ServicePortName) -> set[Frontend]:
        entries = self.current.get(name)
        return set(entries.frontends) if entries else set()

    def flush_udp_connections(self, name: ServicePortName, endpoint_ip: str | None = None) -> int:
        """Forget UDP connections to `name` (only those to `endpoint_ip` if given), as kube-proxy
        clears conntrack for stale UDP endpoints; `name` may have been deleted in this sync.
        Returns how many were removed."""
        if endpoint_ip is None:
            return self.flush_udp((), (name,))
        return self.flush_udp(((name, endpoint_ip),), ())

    def flush_udp(self, endpoints: Iterable[tuple[ServicePortName, str]], services: Iterable[ServicePortName]) -> int:
        """Forget the UDP connections of every (service port, endpoint IP) in `endpoints` and of
        every service port in `services`, in one read of the connection table (a full table is
        262,144 entries: one read per stale endpoint would cost a sync ~65 ms each). Deleting a
        connection's CT4_SVC entry is enough: its translation halves are honoured only while it
        exists. Returns how many were removed."""
        udp = IPPROTO["UDP"]
        # (frontend port, frontend addr or None for a nodePort) -> endpoint IPs to flush (None: all)
        wanted: dict[tuple[int, str | None], set[str | None]] = {}
        for name, ip in [*endpoints, *((name, None) for name in services)]:
            entries = self.current.get(name)
            for fe in (tuple(entries.frontends) if entries else self._deleted_udp.get(name, ())):
                if fe.proto == udp:
                    wanted.setdefault((fe.port, fe.addr), set()).add(ip)
        if not wanted:
            return 0
        removed = 0
        for conn in self.maps.connections(kind=s.CT4_SVC, proto=udp):
            ips = wanted.get((conn.dport, conn.daddr), set()) | wanted.get((conn.dport, None), set())
            if None in ips or conn.nat_addr in ips:
                removed += self.maps.delete_connection(conn)
        return removed
