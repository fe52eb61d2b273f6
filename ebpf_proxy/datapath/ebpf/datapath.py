"""The eBPF datapath behind the Datapath interface, one per IP family: maps written as deltas,
programs attached once.

The agent creates one EbpfDatapath per IP family it serves (IPv4, IPv6 or both); one set of
programs serves both families, so the datapaths of a process share it through a SharedNode
(shared.py: one load, one epx_config, one device attachment and link watcher, one socket-LB
attachment, one conntrack GC; read it for when the programs attach). Each family has maps of its
own: IPv4 the epx_* maps (Maps), IPv6 the epx_*6 maps (Maps6), with service and backend ids of
their own. The programs leave IPv6 untouched until the IPv6 datapath's first sync wrote its maps
and set CFG6_F_ON in epx_config6.

First sync (per process; the steps marked * happen once, for every family):
  1*. bpffs at `bpffs` (mounted if it is not one), pinned maps under <bpffs>/ebpf-proxy/
     re-opened (or created), programs compiled against them with bcc in a short-lived child
     process that pins them (kernel headers prepared first; LLVM never enters the agent) -- or,
     after a restart of the same build, the pinned programs re-opened (loader.py); epx_config;
  2. take over what the family's maps hold (adopt.py): after an agent restart nothing is flushed
     or renumbered, connections and affinity survive, and only differences are written (the
     maps' read-back made by a helper process while the agent listed, see prefetch() and
     readback.py);
  3. the family's node facts into the maps (addresses, cluster CIDRs; IPv6: the masquerade
     address in epx_config6), then the services;
  4*. only then programs onto devices (devices.py: TC on pod and external devices, XDP on the
     external ones) and the socket-LB programs onto `cgroup_path` (pins.py, pinned links), so a
     fresh node never runs programs over empty maps; on restart this swaps each attached program
     for the new build atomically. A link watcher then follows devices as pods come and go.
     IPv6: CFG6_F_ON.
Later syncs write only the services in the ChangeSet (services.py); full syncs also re-check the
devices. `close()` (SIGTERM) leaves everything attached and pinned: traffic keeps flowing while
the agent is away. `cleanup()` removes everything, also from a fresh process that never synced
(it finds its objects by name and by the netns cookie recorded in epx_config, see pins.py).

The datapath acts in the network namespace of the thread that first calls `sync()` (the agent's
own); call `cleanup()` from that namespace too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ebpf_proxy.datapath.base import Datapath, SyncResult
from ebpf_proxy.datapath.ebpf import adopt, devices, handover, pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import ConntrackUsage, MapFull, Maps, Maps6
from ebpf_proxy.datapath.ebpf.readback import ReadAhead
from ebpf_proxy.datapath.ebpf.services import (
    ServiceEntries,
    ServicePrograms,
    detector_cidrs,
    detector_is_noop,
    node_addresses,
    program_node,
)
from ebpf_proxy.datapath.ebpf.shared import HOST_ROUTING_MODES, Options, SharedNode, resolve_host_routing
from ebpf_proxy.datapath.kernel_nat import NatConnection
from ebpf_proxy.model import ChangeSet, NodeConfig, ProxyState, ServicePortName
from ebpf_proxy.model.types import of_family

__all__ = ["HOST_ROUTING_MODES", "Believed", "EbpfDatapath", "ServicesDidNotFit", "resolve_host_routing"]

log = logging.getLogger(__name__)
PROGRESS_EVERY = 64  # service ports between two progress reports (a gauge set: ~1 µs)

DEFAULT_BPFFS = "/sys/fs/bpf"
CT_GC_PERIOD = 10.0  # seconds between two passes of the connection table's garbage collector
# epx_ct4 (epx_ct6) entries per connection of kube-proxy's conntrack limit: an unmasqueraded
# connection takes 2 (its entry, the reply half), a masqueraded one 4, so the limit holds for
# unmasqueraded traffic and half of it for masqueraded traffic (nf_conntrack also stores two
# tuples per connection). Each family's table gets the limit: nf_conntrack's is shared by both.
CT_ENTRIES_PER_CONNECTION = 2


@dataclass(frozen=True)
class Believed:
    """What the datapath believes the kernel holds since its last sync: the drift audit
    (explain/audit_ebpf.py) compares the family's maps and, for the lead family, the devices."""

    maps: Maps  # the family's (Maps6 for IPv6)
    services: Mapping[ServicePortName, ServiceEntries]
    config: s.LB4Config | s.LB6Config  # epx_config (IPv4), epx_config6 (IPv6)
    node_addrs: frozenset[str]
    pod_cidrs: frozenset[str]
    devices: devices.Devices | None  # None: another family's audit checks them (SharedNode.lead)


class ServicesDidNotFit(MapFull):
    """A sync programmed every service port but these, for which a map was full."""

    def __init__(self, failed: Mapping[ServicePortName, MapFull]) -> None:
        first = next(iter(failed.values()))
        names = sorted(str(n) for n in failed)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(first.name, first.capacity, f"{len(names)} service port(s) not programmed ({shown}): ")
        self.failed = dict(failed)


class EbpfDatapath(Datapath):
    """Service load balancing of one IP family (node.family) with TC/XDP programs on the node's
    devices and socket-LB programs on a cgroup, over pinned BPF maps (see the module docstring for
    the life cycle)."""

    mode = "ebpf"

    def __init__(
        self,
        node: NodeConfig,
        *,
        cgroup_path: str | None = None,
        bpffs: str = DEFAULT_BPFFS,
        pod_device_patterns: Sequence[str] = devices.DEFAULT_POD_PATTERNS,
        xdp_mode: str = "off",
        watch_devices: bool = True,
        max_entries: Mapping[str, int] | None = None,
        ct_gc_period: float = CT_GC_PERIOD,
        bpf_cache_dir: str | None = None,
        host_routing: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(node)
        if xdp_mode not in ("generic", "native", "off"):
            raise ValueError(f"xdp_mode: {xdp_mode!r} is not one of generic, native, off")
        if host_routing not in HOST_ROUTING_MODES:
            raise ValueError(f"host_routing: {host_routing!r} is not one of {', '.join(HOST_ROUTING_MODES)}")
        self.family = node.family
        self.cgroup_path = Path(cgroup_path) if cgroup_path else None
        self.bpffs = Path(bpffs)
        self.pin_dir = pins.pin_dir(self.bpffs)
        # the connection tables' size comes from kube-proxy's conntrack settings unless a caller
        # (tests: small maps) sizes them explicitly
        ct_size = CT_ENTRIES_PER_CONNECTION * node.conntrack.max_connections
        self._shared = SharedNode.join(self, Options(
            bpffs=self.bpffs, cgroup_path=self.cgroup_path, pod_patterns=tuple(pod_device_patterns),
            xdp_mode=xdp_mode, watch=watch_devices,
            max_entries={"epx_ct4": ct_size, "epx_ct6": ct_size, **(max_entries or {})},
            cache_dir=Path(bpf_cache_dir) if bpf_cache_dir else None, host_routing=host_routing,
            ct_gc_period=ct_gc_period, clock=clock))
        self._maps: Maps | None = None  # this family's view of the shared maps (Maps6 for IPv6)
        self._programs: ServicePrograms | None = None
        self._closed = False
        self._snat6: str | None = None  # IPv6: epx_config6's masquerade address
        self._served6 = False  # IPv6: CFG6_F_ON set by this datapath's first sync
        self._noop6 = detector_is_noop(node)  # IPv6: CFG6_F_DETECT_NONE
        self._read_ahead: ReadAhead | None = None  # prefetch(): the pins' read-back, by a helper

    def prefetch(self) -> None:
        """Restarted over pinned maps: have a helper process read them back now (readback.py),
        while the agent still lists, for the first sync's takeover. Nothing to read on a fresh
        node, after the first sync, or when the other mode's datapath is to be handed over."""
        if self._programs is not None or self._read_ahead is not None or self._shared.handover_in:
            return
        pin_dir = self.serving_pin_dir()
        if pin_dir is not None:
            self._read_ahead = ReadAhead.start(pin_dir, self.family)

    def family_maps(self) -> Maps | None:
        """This family's maps (Maps, or Maps6), None before the first sync."""
        return self._maps

    # -- sync -----------------------------------------------------------------------------

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        first = self._programs is None
        counts = {"full_sync": int(changes.full or first), "map_writes": 0, "conntrack_deleted": 0}
        if first:
            writes, loaded_here, read_ahead = self._load(state)
            counts["map_writes"] += writes
            loaded = self._shared.loaded
            counts["programs_compiled"] = int(loaded_here and loaded is not None and loaded.compiled)
            counts["programs_from_cache"] = int(loaded_here and loaded is not None and loaded.source == "cache")
            counts["maps_read_ahead"] = int(read_ahead)
        assert self._programs is not None
        if changes.full or first:
            names = state.services.keys() | self._programs.current.keys()  # one set, not three
        else:
            # Only what changed: a partial sync must not cost O(services) (two 10,000-name sets
            # took ~9 ms, half the budget of one change). What the last sync failed to write is
            # among the changes again (the tracker re-dirties an aborted take), and full syncs
            # (start, hourly, after an error) reconcile everything else.
            names = set(changes.services)
        # a service port a full map refused does not stop the others (a deletion later frees room)
        writes, did_not_fit = self._programs.sync_names(state, names, self.report_progress, PROGRESS_EVERY)
        counts["map_writes"] += writes
        if self.family == 6 and not self._served6:  # the IPv6 maps are written: the programs may serve IPv6
            counts["map_writes"] += int(self._maps.set_config6(  # type: ignore[union-attr]
                self._snat6, on=True, detect_none=self._noop6))
            self._served6 = True
        if not self._shared.attached:
            self._shared.attach()
        elif changes.full and self._is_lead():
            counts["devices_attached"] = self._shared.reconcile_devices()
        # as kube-proxy: stale UDP conntrack goes after the new endpoints are in place
        if changes.stale_udp_endpoints or changes.stale_udp_services:
            counts["conntrack_deleted"] += self._programs.flush_udp(changes.stale_udp_endpoints,
                                                                    changes.stale_udp_services)
        self._programs.sync_done()
        if changes.full or first:
            self._shared.forget_ct_usage()  # full syncs collect, and report a fresh count
        if did_not_fit:
            # after the attach: what fits serves, even on a first sync; the sync fails, so the
            # agent retries these (and its health says so) until the map is made bigger
            raise ServicesDidNotFit(did_not_fit)
        counts.update(self.stats())
        log.debug("ebpf sync: %s", counts)
        return SyncResult(counts=counts)

    def _is_lead(self) -> bool:
        return self._shared.lead == self.family

    def _load(self, state: ProxyState) -> tuple[int, bool, bool]:
        """Steps 1-3 of the first sync. Returns the map writes made, whether this call loaded
        the programs (the first family to sync in this process does, for all), and whether the
        takeover used a helper's read-back (prefetch())."""
        if self._closed:  # closed, then synced again (a test's restart): back in the shared node
            self._closed = False
            self._shared = SharedNode.join(self, self._shared.options)
        shared = self._shared
        loaded_here = shared.load()
        assert shared.maps is not None
        maps = shared.maps if self.family == 4 else Maps6(shared.maps)
        programs = ServicePrograms(maps, self.node.node_ips, family=self.family)
        ahead, self._read_ahead = self._read_ahead, None
        snap = ahead.take(maps) if ahead is not None else None
        writes = adopt.adopt(programs, state, snap)
        writes += program_node(maps, self.node, None)
        if isinstance(maps, Maps6):
            assert shared.devices is not None
            v6_ips = of_family(self.node.node_ips, 6)
            self._snat6 = shared.devices.primary_address(6) or (v6_ips[0] if v6_ips else None)
            # what a previous agent switched on stays on while this one catches up (its maps are
            # adopted, not rewritten); a fresh node's stays off until the first sync is done
            writes += int(maps.set_config6(self._snat6, on=bool(maps.config().flags & s.CFG6_F_ON),
                                           detect_none=self._noop6))
            log.info("ebpf datapath IPv6 loaded", extra={
                "snat_addr": self._snat6 or "", "node_ips": ",".join(self.node.node_ips),
                "cluster_cidrs": ",".join(self.node.cluster_cidrs), "detect_local": str(self.node.detector)})
        else:
            log.info("ebpf datapath loaded", extra={
                "pin_dir": str(shared.pin_dir), "snat_addr": (shared.settings.snat_addr if shared.settings else "") or "",
                "node_ips": ",".join(self.node.node_ips), "cluster_cidrs": ",".join(self.node.cluster_cidrs),
                "detect_local": str(self.node.detector)})
        self._maps, self._programs = maps, programs
        return writes, loaded_here, snap is not None

    # -- a mode switch (agent/handover.py) --------------------------------------------------

    def installed(self) -> bool:
        """Whether a datapath's maps are pinned for this node (at `bpffs`, or found through this
        netns' cookie)."""
        return self.serving_pin_dir() is not None

    def serving_pin_dir(self) -> Path | None:
        if (self.pin_dir / "epx_config").exists():
            return self.pin_dir
        found = [d for d in pins.find_pin_dirs(pins.netns_cookie()) if (d / "epx_config").exists()]
        return found[0] if found else None

    def expect_handover(self) -> None:
        """The iptables mode's datapath is still in place: attach in CFG_F_NETFILTER_FIRST, its
        rules keep making the new connections until the ones the kernel had are moved in. (An IPv4
        matter: the programs' IPv6 path does not move connections, see bpf/lib/lb6.h.)"""
        if self._programs is not None or self._shared.loaded is not None:
            raise RuntimeError("expect_handover after the first sync: the programs are attached already")
        self._shared.handover_in = True

    def adopt_connections(self, connections: Iterable[NatConnection],
                          adopted: Callable[[NatConnection], None]) -> dict[str, int]:
        """Write each connection the kernel translates into epx_ct4 (ebpf/handover.py), held,
        call `adopted` (the caller deletes the kernel's entry), then release it: with both in
        place, netfilter would take our translated packets for a new connection and its NAT
        would give them another source port. Left with the kernel,
        whose conntrack stops tracking once the iptables rules are gone (nothing then holds its
        hooks in this netns), so they break: the node's own connections (the socket LB balances at
        connect(), a connected socket is nobody's to translate), those masqueraded to another
        address than ours, and those of Services no longer here. One whose port only netfilter's
        NAT changed (a clashing tuple) is not masqueraded: it is adopted as remapped
        (CT4_S_REMAP, see handover.adopt). Returns a count of each.
        The IPv6 datapath adopts none (the kernel's are IPv4 connections, kernel_nat.py): each
        counts as `unknown`.
        """
        settings = self._shared.settings
        assert self._maps is not None and settings is not None, "adopt_connections before the first sync"
        counts = {"adopted": 0, "node": 0, "other_masquerade_address": 0, "unknown": 0}
        if self.family != 4:
            counts["unknown"] = sum(1 for _ in connections)
            return counts
        local = set(node_addresses(self.node))
        backends = handover.backend_ids(self._maps)
        # the kernel's unmasqueraded connections first: the backend knows each by the client's own
        # port, which a masqueraded one sharing it gives way from (handover.adopt: CT4_S_REMAP)
        for conn in sorted(connections, key=lambda c: c.masqueraded):
            if conn.client in local:
                counts["node"] += 1
                continue
            if conn.masqueraded and conn.source != settings.snat_addr:
                counts["other_masquerade_address"] += 1
                continue
            if conn.masqueraded and not settings.adopted_masq and not (
                    settings.snat_port_min <= conn.source_port <= settings.snat_port_max):
                # the kernel's masquerade port is outside ours: the programs must look for its
                # replies on every port (nat4_is_masq_dest) before the kernel's entry goes
                self._shared.update_settings(adopted_masq=True)
                settings = self._shared.settings
            # held while both the kernel and epx_ct4 know it (common.h: CT4_S_HELD)
            why = handover.adopt(self._maps, conn, backends, local, time.monotonic_ns(), held=True)
            if why is None:
                try:
                    adopted(conn)
                finally:
                    handover.hold(self._maps, conn, held=False)
                counts["adopted"] += 1
            else:
                log.info("connection %s left to the kernel: %s", conn.describe(), why)
                counts["unknown"] += 1
        return counts

    def after_conntrack_gc(self) -> None:
        """A GC pass is done (SharedNode.collect_conntrack): the last adopted connection
        masqueraded outside our port range gone, replies are looked for in our range only."""
        settings = self._shared.settings
        if settings is not None and settings.adopted_masq and not self._adopted_masq_left():
            self._shared.update_settings(adopted_masq=False)

    def _adopted_masq_left(self) -> bool:
        """Whether a connection masqueraded outside our port range (adopted) is still in epx_ct4."""
        settings = self._shared.settings
        assert self._maps is not None and settings is not None
        low, high = settings.snat_port_min, settings.snat_port_max
        return any(not low <= c.dport <= high for c in self._maps.connections(kind=s.CT4_REV_SNAT))

    def take_new_connections(self) -> None:
        """The kernel's connections are moved in: new connections (a SYN) are ours from now on;
        any other packet without an entry stays netfilter's until end_handover, since the
        connections its rules made meanwhile are still being moved (CFG_F_NETFILTER_MIDSTREAM)."""
        self._set_handover(s.CFG_F_NETFILTER_MIDSTREAM)

    def _set_handover(self, flag: int) -> None:
        if self._shared.settings is not None and self._shared.maps is not None:
            self._shared.update_settings(handover=flag)

    def end_handover(self) -> None:
        """Every connection is moved in: from now on a packet without an entry is ours again."""
        self._shared.handover_in = False
        self._set_handover(0)

    # -- drift audit ----------------------------------------------------------------------

    def believed(self) -> Believed | None:
        """What the maps and devices should hold (None before the first sync). Call it, and the
        repairs, between syncs (the agent holds its datapath lock)."""
        shared = self._shared
        if self._programs is None or self._maps is None or shared.devices is None or shared.settings is None:
            return None
        if isinstance(self._maps, Maps6):
            config: s.LB4Config | s.LB6Config = Maps6.config6_of(self._snat6, self._served6, self._noop6)
        else:
            config = Maps.config_of(shared.settings)
        return Believed(
            maps=self._maps, services=self._programs.current, config=config,
            node_addrs=frozenset(node_addresses(self.node)),
            pod_cidrs=frozenset(str(ipaddress.ip_network(c, strict=False)) for c in detector_cidrs(self.node)),
            devices=shared.devices if self._is_lead() else None)

    def repair_services(self, actual: Mapping[ServicePortName, ServiceEntries], strays: adopt.Strays) -> int:
        """Write back what drifted: each service port of `actual` (what the maps hold for it, read
        by the audit) is moved to what it should hold, writing only the differences, and `strays`
        are deleted. Returns the map writes made."""
        assert self._programs is not None
        writes = 0
        owned: bytearray | None = None  # by backend id: another service port holds it (made once, if needed)
        for name, held in actual.items():
            believed = self._programs.current.get(name)
            if believed is None:
                continue
            foreign = [bid for bid in held.backends if bid not in believed.backends]
            if foreign:  # its slots reach backends it should not have: moving it back deletes them
                owned = owned if owned is not None else self._backend_owners()
                theirs = {bid for bid in foreign if bid < len(owned) and owned[bid]}
                if theirs:  # unless another port holds them: then they stay, only the slots move
                    held = replace(held, backends={bid: be for bid, be in held.backends.items() if bid not in theirs})
            self._programs.take_over(name, held)
            writes += self._programs.apply(name, believed)
        return writes + adopt.remove_strays(self._programs, strays)

    def _backend_owners(self) -> bytearray:
        """A byte per backend id, 1 where a service port of the last sync holds it: a bytearray,
        not a set (a million ids at 100,000 Services x 10 endpoints: 1 MB against ~40 MiB)."""
        assert self._programs is not None
        entries = self._programs.current.values()
        owned = bytearray(max((max(e.backends, default=0) for e in entries), default=0) + 1)
        for e in entries:
            for bid in e.backends:
                owned[bid] = 1
        return owned

    def repair_node(self) -> int:
        """Write the family's node facts (epx_config or epx_config6, addresses, detector CIDRs;
        the lead family: device flags) again where they differ."""
        shared = self._shared
        assert self._maps is not None and shared.settings is not None and shared.devices is not None
        if isinstance(self._maps, Maps6):
            writes = program_node(self._maps, self.node, None)
            writes += int(self._maps.set_config6(self._snat6, self._served6, self._noop6))
        else:
            writes = program_node(self._maps, self.node, shared.settings)
        if self._is_lead():
            writes += self._maps.set_ifaces(shared.devices.iface_flags())
        return writes

    def repair_devices(self, indexes: Iterable[int]) -> int:
        """Attach our programs again to devices that lost them. Returns attachments made."""
        return self._shared.devices.reattach(indexes) if self._shared.devices is not None else 0

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Map sizes of this family: services and backends from memory, connections from the
        connection table's garbage collector (collect_conntrack), whose pass also counts it. A full
        table (262,144 entries) takes ~65 ms to read, and every sync asks twice (its counts, the
        agent's metrics): so a pass runs at most every `ct_gc_period` seconds, not on every call."""
        if self._programs is None or self._maps is None or self._shared.maps is None:
            return {}
        ct = self.collect_conntrack()
        devs = self._shared.devices
        out = {
            "bpf_services": self._programs.frontend_count,
            "bpf_backends": self._programs.backend_count,
            "bpf_ct_entries": ct.entries,
            "bpf_ct_capacity": ct.capacity,
            "bpf_ct_connections": ct.connections,
            "bpf_devices": len(devs.attached) if devs else 0,
        }
        # Per-reason counters are not here: the agent exports them live, read at scrape time
        # (ebpf_proxy_datapath_packets_total), not as a snapshot taken after the last sync.
        return out

    def collect_conntrack(self, force: bool = False) -> ConntrackUsage:
        """This family's figures from a pass of the connection tables' garbage collector
        (Maps.collect_connections: the tables do not evict, expired connections must be removed;
        SharedNode.collect_conntrack runs one pass over every family's table), unless the last one
        is less than `ct_gc_period` old and not `force`d, or one is running: then the last pass's
        figures. The GC thread runs one every `ct_gc_period`, so a sync rarely pays for a pass (a
        full table of 262,144 entries takes ~0.8 s, more when much is collected)."""
        assert self._maps is not None
        usage = self._shared.collect_conntrack(force).get(self.family)
        if usage is None:  # the pass ran before this family's first sync: collect it now
            usage = self._shared.collect_conntrack(force=True)[self.family]
        return usage

    def whole_map_pass(self) -> contextlib.AbstractContextManager[None]:
        """Held while the caller reads whole maps into memory: the connection GC (every family's)
        waits its turn (SharedNode.whole_map_pass)."""
        return self._shared.whole_map_pass()

    def counters(self) -> dict[s.Reason, tuple[int, int]]:
        """(packets, bytes) per reason since the maps were created (every program, every CPU, both
        families: the counters are shared)."""
        if self._shared.maps is None:
            return {}
        return self._shared.maps.stats()

    # -- cleanup, close -------------------------------------------------------------------

    def cleanup(self) -> None:
        """Detach every program (devices of this netns, cgroup) and remove the pins, for every
        family. Idempotent, and works in a fresh process: TC filters and XDP are found by name, the
        pin directory at `bpffs` and through this netns' cookie, cgroup attachments through their
        pinned links (and, when `cgroup_path` is given, by program name on that cgroup)."""
        self._shared.cleanup(members_reset=(self,))

    def close(self) -> None:
        """Release our handles (the last family to close stops following devices); programs stay
        attached, maps pinned."""
        self.forget_handles()
        if self._read_ahead is not None:
            self._read_ahead.stop()
            self._read_ahead = None
        if not self._closed:
            self._closed = True
            self._shared.leave(self)

    def forget_handles(self) -> None:
        """The shared handles are gone (close, cleanup): a later sync loads (and adopts) again."""
        self._maps = None
        self._programs = None
        self._served6 = False
