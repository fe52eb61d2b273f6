"""The eBPF datapath behind the Datapath interface: maps written as deltas, programs attached once.

First sync (per process):
  1. bpffs at `bpffs` (mounted if it is not one), pinned maps under <bpffs>/ebpf-proxy/
     re-opened (or created), programs compiled against them with bcc in a short-lived child
     process that pins them (kernel headers prepared first; LLVM never enters the agent) -- or,
     after a restart of the same build, the pinned programs re-opened (loader.py);
  2. take over what the maps hold (adopt.py): after an agent restart nothing is flushed or
     renumbered, connections and affinity survive, and only differences are written;
  3. node facts into the maps (addresses, cluster CIDRs, masquerade address and settings), then
     the services;
  4. only then programs onto devices (devices.py: TC on pod and external devices, XDP on the
     external ones) and the socket-LB programs onto `cgroup_path` (pins.py, pinned links), so a
     fresh node never runs programs over empty maps; on restart this swaps each attached program
     for the new build atomically. A link watcher then follows devices as pods come and go.
Later syncs write only the services in the ChangeSet (services.py); full syncs also re-check the
devices. `close()` (SIGTERM) leaves everything attached and pinned: traffic keeps flowing while
the agent is away. `cleanup()` removes everything, also from a fresh process that never synced
(it finds its objects by name and by the netns cookie recorded in epx_config, see pins.py).

The datapath acts in the network namespace of the thread that first calls `sync()` (the agent's
own); call `cleanup()` from that namespace too.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.datapath.base import Datapath, SyncResult
from ebpf_proxy.datapath.ebpf import adopt, devices, handover, loader, pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import ConntrackUsage, MapFull, Maps, NodeSettings
from ebpf_proxy.datapath.ebpf.services import (
    ServiceEntries,
    ServicePrograms,
    detector_cidrs,
    node_addresses,
    node_settings,
    program_node,
)
from ebpf_proxy.datapath.kernel_nat import NatConnection
from ebpf_proxy.model import ChangeSet, NodeConfig, ProxyState, ServicePortName

log = logging.getLogger(__name__)
PROGRESS_EVERY = 64  # service ports between two progress reports (a gauge set: ~1 µs)

DEFAULT_BPFFS = "/sys/fs/bpf"
CT_GC_PERIOD = 10.0  # seconds between two passes of the connection table's garbage collector
# epx_ct4 entries per connection of kube-proxy's conntrack limit: an unmasqueraded connection takes
# 2 (its entry, the reply half), a masqueraded one 4, so the limit holds for unmasqueraded traffic
# and half of it for masqueraded traffic (nf_conntrack also stores two tuples per connection).
CT_ENTRIES_PER_CONNECTION = 2
# --bpf-host-routing (bpf/lib/fib4.h): on, off, or auto (on where the kernel has the helpers)
HOST_ROUTING_MODES = ("auto", "on", "off")  # agent/config.py takes these (the agent layer sits above)


def resolve_host_routing(mode: str) -> bool:
    """Whether tc_ingress forwards translated packets itself (CFG_F_HOST_ROUTING), with one log line
    saying why. `auto` turns it on where the kernel has bpf_fib_lookup, bpf_redirect_peer and
    bpf_redirect_neigh with a next hop (5.11+); `on` without them is an error, not a silent off."""
    if mode == "off":
        log.info("bpf host routing: off (--bpf-host-routing=off): translated packets take the host stack",
                 extra={"host_routing": False})
        return False
    missing = loader.host_routing_unsupported()
    if missing is None:
        log.info("bpf host routing: on (--bpf-host-routing=%s): translated packets skip the host's routing "
                 "and netfilter stack where the FIB allows", mode, extra={"host_routing": True})
        return True
    if mode == "on":
        raise loader.LoadError(f"--bpf-host-routing=on: this kernel cannot ({missing})")
    log.info("bpf host routing: off (--bpf-host-routing=auto: %s)", missing, extra={"host_routing": False})
    return False


@dataclass(frozen=True)
class Believed:
    """What the datapath believes the kernel holds since its last sync: the drift audit
    (explain/audit_ebpf.py) compares the maps and devices with it."""

    maps: Maps
    services: Mapping[ServicePortName, ServiceEntries]
    config: s.LB4Config
    node_addrs: frozenset[str]
    pod_cidrs: frozenset[str]
    devices: devices.Devices


class ServicesDidNotFit(MapFull):
    """A sync programmed every service port but these, for which a map was full."""

    def __init__(self, failed: Mapping[ServicePortName, MapFull]) -> None:
        first = next(iter(failed.values()))
        names = sorted(str(n) for n in failed)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(first.name, first.capacity, f"{len(names)} service port(s) not programmed ({shown}): ")
        self.failed = dict(failed)


class EbpfDatapath(Datapath):
    """Service load balancing with TC/XDP programs on the node's devices and socket-LB programs
    on a cgroup, over pinned BPF maps (see the module docstring for the life cycle)."""

    mode = "ebpf"

    def __init__(
        self,
        node: NodeConfig,
        *,
        cgroup_path: str | None = None,
        bpffs: str = DEFAULT_BPFFS,
        pod_device_patterns: Sequence[str] = devices.DEFAULT_POD_PATTERNS,
        xdp_mode: str = "generic",
        watch_devices: bool = True,
        max_entries: Mapping[str, int] | None = None,
        ct_gc_period: float = CT_GC_PERIOD,
        bpf_cache_dir: str | None = None,
        host_routing: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(node)
        if node.family != 4:  # the agent serves IPv6 with ip6tables in ebpf mode (agent.py _mode_for)
            raise ValueError(f"node {node.node_name}: EbpfDatapath programs IPv4 only so far (the programs' "
                             f"IPv6 path has no writer here yet), not IPv{node.family} (NodeConfig.family)")
        if xdp_mode not in ("generic", "native", "off"):
            raise ValueError(f"xdp_mode: {xdp_mode!r} is not one of generic, native, off")
        if host_routing not in HOST_ROUTING_MODES:
            raise ValueError(f"host_routing: {host_routing!r} is not one of {', '.join(HOST_ROUTING_MODES)}")
        self._host_routing_mode = host_routing
        self.cgroup_path = Path(cgroup_path) if cgroup_path else None
        self.bpffs = Path(bpffs)
        self.pin_dir = pins.pin_dir(self.bpffs)
        self._cache_dir = Path(bpf_cache_dir) if bpf_cache_dir else None  # the node's program cache
        self._pod_patterns = tuple(pod_device_patterns)
        self._xdp_mode = xdp_mode
        self._watch = watch_devices
        # the connection table's size comes from kube-proxy's conntrack settings unless a caller
        # (tests: small maps) sizes it explicitly
        self._max_entries = {"epx_ct4": CT_ENTRIES_PER_CONNECTION * node.conntrack.max_connections,
                             **(max_entries or {})}
        self._loaded: loader.Loaded | None = None
        self._maps: Maps | None = None
        self._programs: ServicePrograms | None = None
        self._devices: devices.Devices | None = None
        self._watcher: devices.LinkWatcher | None = None
        self._attached = False
        self._ct_gc_period, self._clock = ct_gc_period, clock
        self._ct_usage: tuple[float, ConntrackUsage] | None = None  # (when, the last GC pass)
        self._ct_gc_lock = threading.Lock()  # one pass at a time
        self._ct_gc_stop: threading.Event | None = None  # the GC thread's, while it runs
        self._settings: NodeSettings | None = None  # epx_config as the first sync wrote it
        # taking over from the iptables mode (expect_handover): programs attach with
        # CFG_F_NETFILTER_FIRST, then take_new_connections, then end_handover
        self._handover_in = False

    # -- sync -----------------------------------------------------------------------------

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        first = self._programs is None
        counts = {"full_sync": int(changes.full or first), "map_writes": 0, "conntrack_deleted": 0}
        if first:
            counts["map_writes"] += self._load(state)
            counts["programs_compiled"] = int(self._loaded is not None and self._loaded.compiled)
            counts["programs_from_cache"] = int(self._loaded is not None and self._loaded.source == "cache")
        assert self._programs is not None
        if changes.full or first:
            names = set(state.services) | set(self._programs.current)
        else:
            # Only what changed: a partial sync must not cost O(services) (two 10,000-name sets
            # took ~9 ms, half the budget of one change). What the last sync failed to write is
            # among the changes again (the tracker re-dirties an aborted take), and full syncs
            # (start, hourly, after an error) reconcile everything else.
            names = set(changes.services)
        # a service port a full map refused does not stop the others (a deletion later frees room)
        writes, did_not_fit = self._programs.sync_names(state, names, self.report_progress, PROGRESS_EVERY)
        counts["map_writes"] += writes
        if not self._attached:
            self._attach()
        elif changes.full:
            counts["devices_attached"] = self._reconcile_devices()
        # as kube-proxy: stale UDP conntrack goes after the new endpoints are in place
        if changes.stale_udp_endpoints or changes.stale_udp_services:
            counts["conntrack_deleted"] += self._programs.flush_udp(changes.stale_udp_endpoints,
                                                                    changes.stale_udp_services)
        self._programs.sync_done()
        if changes.full or first:
            self._ct_usage = None  # full syncs collect, and report a fresh count
        if did_not_fit:
            # after the attach: what fits serves, even on a first sync; the sync fails, so the
            # agent retries these (and its health says so) until the map is made bigger
            raise ServicesDidNotFit(did_not_fit)
        counts.update(self.stats())
        log.debug("ebpf sync: %s", counts)
        return SyncResult(counts=counts)

    def _load(self, state: ProxyState) -> int:
        """Steps 1-3 of the first sync. Returns the map writes made."""
        pin_dir = pins.prepare(self.bpffs)
        loaded = loader.load(pin_dir, max_entries=self._max_entries, reuse=True, cache_dir=self._cache_dir)
        try:
            maps = Maps.from_loaded(loaded)
            programs = ServicePrograms(maps, self.node.node_ips)
            writes = adopt.adopt(programs, state)
            self._devices = devices.Devices(
                devices.Programs(loaded.prog_fds["tc_ingress"], loaded.prog_fds["tc_egress"],
                                 loaded.prog_fds["xdp_lb"] if self._xdp_mode != "off" else None),
                cluster_cidrs=self.node.cluster_cidrs, pod_patterns=self._pod_patterns,
                xdp_mode=self._xdp_mode if self._xdp_mode != "off" else "generic",
                detector=self.node.detector, write_ifaces=maps.set_ifaces,
            )
            settings = node_settings(self.node, host_netns_cookie=pins.netns_cookie(),
                                     snat_addr=self._devices.primary_address())
            settings = dataclasses.replace(settings, host_routing=resolve_host_routing(self._host_routing_mode))
            if self._handover_in:
                settings = dataclasses.replace(settings, handover=s.CFG_F_NETFILTER_FIRST)
            writes += program_node(maps, self.node, settings)
            self._settings = settings
            log.info("ebpf datapath loaded", extra={
                "pin_dir": str(pin_dir), "snat_addr": settings.snat_addr or "",
                "node_ips": ",".join(self.node.node_ips), "cluster_cidrs": ",".join(self.node.cluster_cidrs),
                "detect_local": str(self.node.detector)})
        except BaseException:
            loaded.close()
            self._devices = None
            raise
        self._loaded, self._maps, self._programs = loaded, maps, programs
        return writes

    def _attach(self) -> None:
        """Step 4 of the first sync: devices, cgroup, and the watcher that keeps devices current."""
        assert self._devices is not None and self._loaded is not None
        self._devices.reconcile(required=True)
        pins.attach_cgroup(self.pin_dir, self._loaded.prog_fds, self.cgroup_path)
        if self._watch and self._watcher is None:
            self._watcher = devices.LinkWatcher(self._reconcile_devices)
            self._watcher.start()
        if self._ct_gc_stop is None:
            self._start_conntrack_gc()
        self._attached = True

    def _reconcile_devices(self) -> int:
        return self._devices.reconcile() if self._devices is not None else 0

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
        rules keep making the new connections until the ones the kernel had are moved in."""
        if self._programs is not None:
            raise RuntimeError("expect_handover after the first sync: the programs are attached already")
        self._handover_in = True

    def adopt_connections(self, connections: Iterable[NatConnection],
                          adopted: Callable[[NatConnection], None]) -> dict[str, int]:
        """Write each connection the kernel translates into epx_ct4 (ebpf/handover.py), held,
        call `adopted` (the caller deletes the kernel's entry), then release it: with both in
        place, netfilter would take our translated packets for a new connection and its NAT
        would give them another source port. Left with the kernel,
        whose conntrack stops tracking once the iptables rules are gone (nothing then holds its
        hooks in this netns), so they break: the node's own connections (the socket LB balances at
        connect(), a connected socket is nobody's to translate), those masqueraded to another
        address than ours, and those of Services no longer here. Returns a count of each.
        """
        assert self._maps is not None and self._settings is not None, "adopt_connections before the first sync"
        counts = {"adopted": 0, "node": 0, "other_masquerade_address": 0, "unknown": 0}
        local = set(node_addresses(self.node))
        backends = handover.backend_ids(self._maps)
        for conn in connections:
            if conn.client in local:
                counts["node"] += 1
                continue
            if conn.masqueraded and conn.source != self._settings.snat_addr:
                counts["other_masquerade_address"] += 1
                continue
            if conn.masqueraded and not self._settings.adopted_masq and not (
                    self._settings.snat_port_min <= conn.source_port <= self._settings.snat_port_max):
                # the kernel's masquerade port is outside ours: the programs must look for its
                # replies on every port (nat4_is_masq_dest) before the kernel's entry goes
                self._set_adopted_masq(True)
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

    def _set_adopted_masq(self, on: bool) -> None:
        assert self._maps is not None and self._settings is not None
        self._settings = dataclasses.replace(self._settings, adopted_masq=on)
        self._maps.set_settings(self._settings)

    def _adopted_masq_left(self) -> bool:
        """Whether a connection masqueraded outside our port range (adopted) is still in epx_ct4."""
        assert self._maps is not None and self._settings is not None
        low, high = self._settings.snat_port_min, self._settings.snat_port_max
        return any(not low <= c.dport <= high for c in self._maps.connections(kind=s.CT4_REV_SNAT))

    def take_new_connections(self) -> None:
        """The kernel's connections are moved in: new connections (a SYN) are ours from now on;
        any other packet without an entry stays netfilter's until end_handover, since the
        connections its rules made meanwhile are still being moved (CFG_F_NETFILTER_MIDSTREAM)."""
        self._set_handover(s.CFG_F_NETFILTER_MIDSTREAM)

    def _set_handover(self, flag: int) -> None:
        if self._settings is not None and self._maps is not None and self._settings.handover != flag:
            self._settings = dataclasses.replace(self._settings, handover=flag)
            self._maps.set_settings(self._settings)

    def end_handover(self) -> None:
        """Every connection is moved in: from now on a packet without an entry is ours again."""
        self._handover_in = False
        self._set_handover(0)

    # -- drift audit ----------------------------------------------------------------------

    def believed(self) -> Believed | None:
        """What the maps and devices should hold (None before the first sync). Call it, and the
        repairs, between syncs (the agent holds its datapath lock)."""
        if self._programs is None or self._maps is None or self._devices is None or self._settings is None:
            return None
        return Believed(
            maps=self._maps, services=self._programs.current, config=Maps.config_of(self._settings),
            node_addrs=frozenset(node_addresses(self.node)),
            pod_cidrs=frozenset(str(ipaddress.ip_network(c, strict=False)) for c in detector_cidrs(self.node)),
            devices=self._devices)

    def repair_services(self, actual: Mapping[ServicePortName, ServiceEntries], strays: adopt.Strays) -> int:
        """Write back what drifted: each service port of `actual` (what the maps hold for it, read
        by the audit) is moved to what it should hold, writing only the differences, and `strays`
        are deleted. Returns the map writes made."""
        assert self._programs is not None
        writes = 0
        for name, held in actual.items():
            believed = self._programs.current.get(name)
            if believed is None:
                continue
            self._programs.take_over(name, held)
            writes += self._programs.apply(name, believed)
        return writes + adopt.remove_strays(self._programs, strays)

    def repair_node(self) -> int:
        """Write the node's facts (epx_config, addresses, detector CIDRs, device flags) again where they differ."""
        assert self._maps is not None and self._settings is not None and self._devices is not None
        return program_node(self._maps, self.node, self._settings) + self._maps.set_ifaces(self._devices.iface_flags())

    def repair_devices(self, indexes: Iterable[int]) -> int:
        """Attach our programs again to devices that lost them. Returns attachments made."""
        return self._devices.reattach(indexes) if self._devices is not None else 0

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Map sizes: services and backends from memory, connections from the connection table's
        garbage collector (collect_conntrack), whose pass also counts it. A full table (262,144
        entries) takes ~65 ms to read, and every sync asks twice (its counts, the agent's
        metrics): so a pass runs at most every `ct_gc_period` seconds, not on every call."""
        if self._programs is None or self._maps is None:
            return {}
        ct = self.collect_conntrack()
        out = {
            "bpf_services": self._programs.frontend_count,
            "bpf_backends": self._programs.backend_count,
            "bpf_ct_entries": ct.entries,
            "bpf_ct_capacity": ct.capacity,
            "bpf_ct_connections": ct.connections,
            "bpf_devices": len(self._devices.attached) if self._devices else 0,
        }
        # Per-reason counters are not here: the agent exports them live, read at scrape time
        # (ebpf_proxy_datapath_packets_total), not as a snapshot taken after the last sync.
        return out

    def collect_conntrack(self, force: bool = False) -> ConntrackUsage:
        """One pass of the connection table's garbage collector (Maps.collect_connections: the
        table does not evict, expired connections must be removed), unless the last one is less
        than `ct_gc_period` old and not `force`d, or one is running: then the last pass's figures.
        The GC thread calls it every `ct_gc_period`, so a sync rarely pays for a pass (a full
        table of 262,144 entries takes ~0.8 s, more when much is collected)."""
        maps = self._maps
        assert maps is not None
        now = self._clock()
        last = self._ct_usage
        if not force and last is not None and now - last[0] < self._ct_gc_period:
            return last[1]
        if not self._ct_gc_lock.acquire(blocking=last is None):
            return last[1]  # the GC thread is at it: its figures come next time
        try:
            usage = maps.collect_connections(time.monotonic_ns())  # bpf_ktime_get_ns()'s clock
            self._ct_usage = (now, usage)
            if self._settings is not None and self._settings.adopted_masq and not self._adopted_masq_left():
                self._set_adopted_masq(False)  # the last adopted one is gone: replies to our range only
        finally:
            self._ct_gc_lock.release()
        if usage.collected:
            log.debug("conntrack gc", extra={"collected": usage.collected, "entries": usage.entries,
                                             "capacity": usage.capacity})
        return usage

    def _start_conntrack_gc(self) -> None:
        """nf_conntrack's gc worker for our table: a pass every `ct_gc_period`, off the sync path."""
        stop = self._ct_gc_stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self._ct_gc_period):
                try:
                    if self._maps is not None:
                        self.collect_conntrack(force=True)
                except Exception:  # e.g. the maps closed under us at shutdown: next period, or stop
                    log.warning("conntrack gc failed", exc_info=True)

        threading.Thread(target=loop, name="conntrack-gc", daemon=True).start()

    def counters(self) -> dict[s.Reason, tuple[int, int]]:
        """(packets, bytes) per reason since the maps were created (every program, every CPU)."""
        if self._maps is None:
            return {}
        return self._maps.stats()

    # -- cleanup, close -------------------------------------------------------------------

    def cleanup(self) -> None:
        """Detach every program (devices of this netns, cgroup) and remove the pins. Idempotent,
        and works in a fresh process: TC filters and XDP are found by name, the pin directory at
        `bpffs` and through this netns' cookie, cgroup attachments through their pinned links
        (and, when `cgroup_path` is given, by program name on that cgroup)."""
        self._stop_watcher()
        removed = devices.detach_all(self._xdp_mode if self._xdp_mode != "off" else "generic")
        targets = {self.pin_dir, *pins.find_pin_dirs(pins.netns_cookie())}
        self._close_loaded()
        for pin_dir in sorted(targets):
            if pins.remove(pin_dir):
                log.info("removed pinned maps and links in %s", pin_dir)
        if self.cgroup_path is not None:
            removed["cgroup_programs"] = pins.detach_cgroup_programs(self.cgroup_path)
        log.info("ebpf datapath removed", extra={k: v for k, v in removed.items()})

    def close(self) -> None:
        """Stop following devices and release our handles; programs stay attached, maps pinned."""
        self._stop_watcher()
        self._close_loaded()

    def _stop_watcher(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._ct_gc_stop is not None:
            self._ct_gc_stop.set()
            self._ct_gc_stop = None

    def _close_loaded(self) -> None:
        """Forget the process-side handles; a later sync loads (and adopts) again."""
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None
        self._maps = None
        self._programs = None
        self._devices = None
        self._attached = False
        self._ct_usage = None
        self._settings = None
