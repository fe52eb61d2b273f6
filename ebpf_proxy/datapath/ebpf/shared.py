"""What the IP families' eBPF datapaths of one process share: one load of the programs, one
epx_config, the device attachments and their link watcher, the socket-LB attachment, and the
connection tables' garbage collector.

The agent keeps one datapath per IP family (agent.py FamilyProxier, as kube-proxy's metaproxier
keeps one proxier per family), but one set of programs serves both families: tc_ingress, tc_egress
and xdp_lb parse IPv4 and IPv6 and read each family's maps (epx_svc... and epx_svc6...). So every
EbpfDatapath of a process joins the SharedNode of its pin directory when it is created (`join`),
and the first one to sync loads the programs for all. Each family then adopts, writes and audits
its own maps (Maps, or Maps6 for IPv6: separate maps, so each family's ids are its own).

When to attach. The programs attach once the first family's first sync has written its maps, not
once every family's has: a family whose sync fails (a full map) must not keep the other one
unserved. IPv6 has a gate: the programs leave IPv6 untouched (EPX_PASS_IPV6_OFF) until
epx_config6 carries CFG6_F_ON, which the IPv6 datapath sets only after its own first sync wrote
the IPv6 maps. IPv4 has no gate: where the IPv6 family syncs first (an IPv6-primary node), IPv4
packets meet the programs a few milliseconds before their services are in epx_svc, and pass
untouched (EPX_PASS_NO_SERVICE) as on a node that serves none yet; after a restart both families'
maps are pinned and adopted, so nothing is missing at any time.

epx_config (flags, timeouts, the IPv4 masquerade address, the mode-switch state) is written from
the IPv4 datapath's NodeConfig, or from the IPv6 one's on an IPv6-only node. A process without an
IPv6 datapath switches CFG6_F_ON off and removes what an earlier agent left in the IPv6 maps: a
family it does not serve is not served with stale entries.

The "lead" family (IPv4 if present) reconciles the devices on full syncs and audits the devices
and epx_iface, so that nothing is done twice. `close()` of the last member releases the handles
(everything stays attached); `cleanup()` removes everything, once, whichever member asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ebpf_proxy.datapath.ebpf import adopt, devices, loader, pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import ConntrackUsage, Maps, Maps6, NodeSettings
from ebpf_proxy.datapath.ebpf.services import ServicePrograms, node_settings
from ebpf_proxy.model import NodeConfig, ProxyState

if TYPE_CHECKING:
    from ebpf_proxy.datapath.ebpf.datapath import EbpfDatapath

log = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True)
class Options:
    """How the programs are loaded and attached: the first member's datapath options."""

    bpffs: Path
    cgroup_path: Path | None
    pod_patterns: tuple[str, ...]
    xdp_mode: str
    watch: bool
    max_entries: Mapping[str, int]
    cache_dir: Path | None
    host_routing: str
    ct_gc_period: float
    clock: Callable[[], float]


_REGISTRY: dict[Path, "SharedNode"] = {}
_REGISTRY_LOCK = threading.Lock()


class SharedNode:
    """The programs and node-wide state the family datapaths of one pin directory share."""

    def __init__(self, pin_dir: Path, options: Options) -> None:
        self.pin_dir = pin_dir
        self.options = options
        self.members: dict[int, EbpfDatapath] = {}
        self.loaded: loader.Loaded | None = None
        self.maps: Maps | None = None  # the IPv4 view; Maps6(maps) for IPv6
        self.devices: devices.Devices | None = None
        self.settings: NodeSettings | None = None  # epx_config as written
        self.attached = False
        self.handover_in = False  # the IPv4 mode switch in (EbpfDatapath.expect_handover)
        self._watcher: devices.LinkWatcher | None = None
        self._ct_usage: tuple[float, dict[int, ConntrackUsage]] | None = None  # (when, the last GC pass)
        # held by each pass over a whole table: a GC pass, the drift audit's read-back
        # (whole_map_pass). One at a time, so their peaks and CPU never add up
        self._pass_lock = threading.Lock()
        self._ct_gc_stop: threading.Event | None = None

    # -- membership --------------------------------------------------------------------------

    @classmethod
    def join(cls, datapath: "EbpfDatapath", options: Options) -> "SharedNode":
        """The shared node `datapath` belongs to: its pin directory's, unless that one has a member
        of `datapath`'s family already (another agent's datapath in this process, e.g. a test's
        restart after a kill): then a new one, which later joiners find."""
        with _REGISTRY_LOCK:
            node = _REGISTRY.get(datapath.pin_dir)
            if node is None or datapath.family in node.members:
                node = _REGISTRY[datapath.pin_dir] = cls(datapath.pin_dir, options)
            node.members[datapath.family] = datapath
            return node

    def leave(self, datapath: "EbpfDatapath") -> None:
        """`datapath` is closed: the last one out stops the threads and releases the handles
        (programs stay attached, maps pinned)."""
        with _REGISTRY_LOCK:
            if self.members.get(datapath.family) is datapath:
                del self.members[datapath.family]
            if self.members:
                return
            if _REGISTRY.get(self.pin_dir) is self:
                del _REGISTRY[self.pin_dir]
        self._stop_threads()
        self._release()

    @property
    def lead(self) -> int:
        """The family that does the node-wide work (IPv4 where there is one)."""
        return 4 if 4 in self.members or not self.members else min(self.members)

    def _node_config(self) -> NodeConfig:
        return self.members[self.lead].node

    # -- load ---------------------------------------------------------------------------------

    def load(self) -> bool:
        """Load (or re-open) the programs and maps, and write epx_config, unless done already.
        Returns whether this call loaded them."""
        if self.loaded is not None:
            return False
        opts = self.options
        pin_dir = pins.prepare(opts.bpffs)
        loaded = loader.load(pin_dir, max_entries=opts.max_entries, reuse=True, cache_dir=opts.cache_dir)
        try:
            maps = Maps.from_loaded(loaded)
            node = self._node_config()
            cluster_cidrs = tuple(c for member in self.members.values() for c in member.node.cluster_cidrs)
            self.devices = devices.Devices(
                devices.Programs(loaded.prog_fds["tc_ingress"], loaded.prog_fds["tc_egress"],
                                 loaded.prog_fds["xdp_lb"] if opts.xdp_mode != "off" else None,
                                 loaded.prog_fds["tc_lo"]),
                cluster_cidrs=cluster_cidrs, pod_patterns=opts.pod_patterns,
                xdp_mode=opts.xdp_mode if opts.xdp_mode != "off" else "generic",
                detector=node.detector, write_ifaces=maps.set_ifaces,
            )
            settings = node_settings(node, host_netns_cookie=pins.netns_cookie(),
                                     snat_addr=self.devices.primary_address() if node.family == 4 else None)
            settings = dataclasses.replace(settings, host_routing=resolve_host_routing(opts.host_routing))
            if self.handover_in:
                settings = dataclasses.replace(settings, handover=s.CFG_F_NETFILTER_FIRST)
            maps.set_settings(settings)
            self.settings = settings
            if 6 not in self.members:
                self._retire_ipv6(maps)
            log.info("ebpf programs loaded", extra={
                "pin_dir": str(pin_dir), "snat_addr": settings.snat_addr or "",
                "families": ",".join(f"IPv{f}" for f in sorted(self.members)),
                "cluster_cidrs": ",".join(cluster_cidrs), "detect_local": str(node.detector),
                # how the TC programs go on the devices: tcx (Linux 6.6+), or cls_bpf filters
                "tc_attach": "tcx" if loader.tcx_supported() else "cls_bpf"})
        except BaseException:
            loaded.close()
            self.devices = None
            raise
        self.loaded, self.maps = loaded, maps
        return True

    @staticmethod
    def _retire_ipv6(maps: Maps) -> None:
        """No IPv6 datapath in this process: IPv6 off, and what an earlier agent left removed."""
        maps6 = Maps6(maps)
        was_on = bool(maps6.config().flags & s.CFG6_F_ON)
        maps6.set_config6(None, on=False)
        removed = adopt.adopt(ServicePrograms(maps6, family=6), ProxyState())
        removed += maps6.set_node_addrs([]) + maps6.set_pod_cidrs([])
        if was_on or removed:
            log.info("IPv6 is not served by this agent: the programs' IPv6 path is off and %d IPv6 map entries "
                     "an earlier agent left were removed", removed)

    def update_settings(self, **changes) -> None:
        """Change fields of epx_config (the mode-switch flags, adopted_masq) and write it."""
        assert self.maps is not None and self.settings is not None
        settings = dataclasses.replace(self.settings, **changes)
        if settings != self.settings:
            self.settings = settings
            self.maps.set_settings(settings)

    # -- attach ---------------------------------------------------------------------------------

    def attach(self) -> None:
        """Devices, cgroup, the watcher that keeps devices current, and the GC thread (see the
        module docstring for when)."""
        assert self.devices is not None and self.loaded is not None
        self.devices.reconcile(required=True)
        pins.attach_cgroup(self.pin_dir, self.loaded.prog_fds, self.options.cgroup_path)
        if self.options.watch and self._watcher is None:
            self._watcher = devices.LinkWatcher(self.reconcile_devices)
            self._watcher.start()
        if self._ct_gc_stop is None:
            self._start_conntrack_gc()
        self.attached = True

    def reconcile_devices(self) -> int:
        return self.devices.reconcile() if self.devices is not None else 0

    # -- the connection tables' garbage collector ------------------------------------------------

    def forget_ct_usage(self) -> None:
        self._ct_usage = None

    def collect_conntrack(self, force: bool = False) -> dict[int, ConntrackUsage]:
        """One pass of the garbage collector over each member family's connection table (see
        EbpfDatapath.collect_conntrack), unless the last one is less than `ct_gc_period` old and
        not `force`d, or one is running: then the last pass's figures. By family."""
        maps = self.maps
        assert maps is not None
        now = self.options.clock()
        last = self._ct_usage
        if not force and last is not None and now - last[0] < self.options.ct_gc_period:
            return last[1]
        # a family no pass has counted yet (its first sync) waits for the pass under way
        counted = last is not None and all(f in last[1] for f, m in self.members.items() if m.family_maps() is not None)
        if not self._pass_lock.acquire(blocking=not counted):
            return last[1]  # the GC thread (or an audit) is at it: its figures come next time
        try:
            usage = {family: member.family_maps().collect_connections(time.monotonic_ns())  # bpf_ktime_get_ns()'s clock
                     for family, member in sorted(self.members.items()) if member.family_maps() is not None}
            self._ct_usage = (now, usage)
            if 4 in self.members:
                self.members[4].after_conntrack_gc()
        finally:
            self._pass_lock.release()
        for family, u in usage.items():
            if u.collected:
                log.debug("conntrack gc", extra={"family": f"IPv{family}", "collected": u.collected,
                                                 "entries": u.entries, "capacity": u.capacity})
        return usage

    @contextlib.contextmanager
    def whole_map_pass(self) -> Iterator[None]:
        """Hold off the connection GC while the caller reads whole tables into memory (the drift
        audit's read-back, when the sums differ: ~25 MiB more at 100,000 Services x 10 endpoints,
        measured). A GC pass over a full connection table holds ~2 MB of hashes (ctscan.Hashes)
        and a CPU for ~0.6 s: the two stay apart. A GC pass due meanwhile is skipped, as when one
        is already running: the next comes a period later."""
        with self._pass_lock:
            yield

    def _start_conntrack_gc(self) -> None:
        """nf_conntrack's gc worker for our tables: a pass every `ct_gc_period`, off the sync path."""
        stop = self._ct_gc_stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.options.ct_gc_period):
                try:
                    if self.maps is not None:
                        self.collect_conntrack(force=True)
                except Exception:  # e.g. the maps closed under us at shutdown: next period, or stop
                    log.warning("conntrack gc failed", exc_info=True)

        threading.Thread(target=loop, name="conntrack-gc", daemon=True).start()

    # -- cleanup, close -----------------------------------------------------------------------

    def cleanup(self, members_reset: Sequence["EbpfDatapath"] = ()) -> None:
        """Detach every program (devices of this netns, cgroup) and remove the pins, once for all
        families. Works in a fresh process too (see EbpfDatapath.cleanup)."""
        opts = self.options
        self._stop_threads()
        removed = devices.detach_all(opts.xdp_mode if opts.xdp_mode != "off" else "generic")
        targets = {self.pin_dir, *pins.find_pin_dirs(pins.netns_cookie())}
        for member in [*self.members.values(), *members_reset]:
            member.forget_handles()
        self._release()
        for pin_dir in sorted(targets):
            if pins.remove(pin_dir):
                log.info("removed pinned maps and links in %s", pin_dir)
        if opts.cgroup_path is not None:
            removed["cgroup_programs"] = pins.detach_cgroup_programs(opts.cgroup_path)
        log.info("ebpf datapath removed", extra={k: v for k, v in removed.items()})

    def _stop_threads(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._ct_gc_stop is not None:
            self._ct_gc_stop.set()
            self._ct_gc_stop = None

    def _release(self) -> None:
        """Forget the process-side handles; a later sync loads (and adopts) again."""
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None
        self.maps = None
        self.devices = None
        self.attached = False
        self._ct_usage = None
        self.settings = None
