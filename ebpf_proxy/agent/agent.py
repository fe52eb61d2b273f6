"""The agent: watch → tracker → runner → datapath, plus metrics and health servers.

Lifecycle (`run()`):
1. resolve the mode (auto → ebpf or iptables, one log line why), open /metrics and /healthz;
2. list+watch Services, EndpointSlices and this Node (one Reflector thread each);
3. once this Node is listed, build the NodeConfig (local interface addresses, see nodeconfig.py)
   and create the datapath (load its programs) while Services and EndpointSlices still list;
4. wait until each collection has been listed once, as kube-proxy waits for its informers: a
   first sync from half the state would delete rules for services we have not seen yet;
5. sync through the BoundedFrequencyRunner until stopped, and audit the kernel against the last
   sync every --audit-period (audit.py);
6. SIGTERM/SIGINT: stop watching, `close()` the datapath *without* removing it (traffic keeps
   flowing while the agent restarts), exit 0.

Each step is a method, so tests can drive the agent without threads (fake list/watch, FakeDatapath,
a fake clock for the runner).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

from ebpf_proxy.agent import handover, heap
from ebpf_proxy.agent.audit import DriftAuditor
from ebpf_proxy.agent.config import AgentConfig
from ebpf_proxy.agent.health import ProxierHealth, ServiceHealthServers, healthz_server
from ebpf_proxy.agent.httpserve import BackgroundHTTPServer
from ebpf_proxy.agent.metrics import Metrics, metrics_server
from ebpf_proxy.agent.nodeconfig import build_node_config, local_addresses, served_families
from ebpf_proxy.agent.runner import BoundedFrequencyRunner, MonotonicClock
from ebpf_proxy.datapath import Datapath, SyncResult, create_datapath, datapath_class, resolve_auto_mode
from ebpf_proxy.k8s import convert
from ebpf_proxy.k8s.invalid import Invalid
from ebpf_proxy.k8s.watch import Backoff, Handler, ListWatch, Reflector, keep_version
from ebpf_proxy.model import ChangeSet, ChangeTracker, NodeConfig, ProxyState

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
# An iptables agent audits this long after its start (then every --audit-period), so that a
# restart soon after finds the proof that spares it the restore (datapath/iptables/proof.py).
PROOF_AUDIT_DELAY = 10.0


class _Events(Handler):
    """A watch handler where an add and an update mean the same: "this is the object now"."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def on_add(self, obj: dict) -> None:
        self._apply(obj)

    def on_update(self, old: dict, new: dict) -> None:
        self._apply(new)

    def _apply(self, obj: dict) -> None:
        raise NotImplementedError


class _ServiceEvents(_Events):
    def on_delete(self, obj: dict) -> None:
        ref = convert.object_ref(obj)
        self.agent.metrics.service_changes.inc()
        if ref and _any([t.delete_service(ref.namespace, ref.name) for t in self.agent.trackers.values()]):
            self.agent.queue_sync()

    def _apply(self, obj: dict) -> None:
        ref = convert.object_ref(obj)
        self.agent.metrics.service_changes.inc()
        trackers = self.agent.trackers
        by_family = convert.service_ports_by_family(obj, self.agent.report_invalid, tuple(trackers))
        if ref and _any([t.update_service(ref.namespace, ref.name, by_family[f]) for f, t in trackers.items()]):
            self.agent.queue_sync()


class _SliceEvents(_Events):
    def on_delete(self, obj: dict) -> None:
        ref = convert.object_ref(obj)
        self.agent.metrics.endpoint_changes.inc()
        if ref and _any([t.delete_slice(ref.namespace, ref.name) for t in self.agent.trackers.values()]):
            self.agent.queue_sync()

    def _apply(self, obj: dict) -> None:
        self.agent.metrics.endpoint_changes.inc()
        trackers = self.agent.trackers
        sl = convert.endpoint_slice(obj, self.agent.node_name, self.agent.report_invalid, tuple(trackers))
        # a slice converted names itself (namespace/name, as object_ref reads them)
        ref = convert.object_ref(obj) if sl is None else sl
        if ref is None:
            return
        # nothing usable (invalid, FQDN, a family not served): whatever an earlier version
        # contributed goes; else it goes to its family's tracker (addressType is immutable)
        changed = _any([t.update_slice(sl.namespace, sl.name, sl.service, sl.endpoints, sl.trigger_time)
                        if sl is not None and sl.family == family else t.delete_slice(ref.namespace, ref.name)
                        for family, t in trackers.items()])
        if changed:
            self.agent.queue_sync()


class _NodeEvents(_Events):
    def on_delete(self, obj: dict) -> None:
        ref = convert.object_ref(obj)
        if ref and ref.name == self.agent.node_name:
            for tracker in self.agent.trackers.values():
                tracker.update_node(None)
            self.agent.health.sync_node(False)  # a deleted node is not eligible for traffic
            self._sync_if_topology_changed()

    def _apply(self, obj: dict) -> None:
        node = convert.node_info(obj, self.agent.report_invalid)
        if node is None or node.name != self.agent.node_name:
            return
        if _any([t.update_node(node) for t in self.agent.trackers.values()]):
            self.agent.health.sync_node(node.eligible)
            self.agent.node_changed()
            self._sync_if_topology_changed()

    def _sync_if_topology_changed(self) -> None:
        # a new zone re-decides every service's endpoints: the tracker made the next sync full
        if self.agent.pending:
            self.agent.queue_sync()


def _health_check_hosts(node: NodeConfig | None) -> tuple[str, ...]:
    """Where a family's health-check NodePorts listen: its node IPs within --nodeport-addresses,
    or its unspecified address when the flag has none of the family (kube-proxy's per-family
    NodePortAddresses)."""
    assert node is not None
    if node.networks(node.nodeport_addresses) and node.node_ips:
        return node.node_ips
    return ("0.0.0.0",) if node.family == 4 else ("::",)


def _any(changed: list[bool]) -> bool:
    """any() of a list built in full first: every tracker must hear the event, not just the first
    that reports a change."""
    return any(changed)


@dataclass
class FamilyProxier:
    """What the agent keeps per IP family, as kube-proxy's metaproxier keeps one proxier per
    family: the family's change tracker, NodeConfig and datapath (and that datapath's mode)."""

    family: int
    tracker: ChangeTracker
    node_config: NodeConfig | None = None
    datapath: Datapath | None = None
    mode: str = ""


class Agent:
    """One node's service proxy. `run()` blocks until `stop()` (or a signal) and returns an exit code."""

    def __init__(self, config: AgentConfig, *, collections: Mapping[str, ListWatch] | None = None,
                 datapath_factory: Callable[..., Datapath] = create_datapath,
                 local_addresses: Callable[[], list[str]] = local_addresses,
                 metrics: Metrics | None = None, clock: MonotonicClock | None = None,
                 wall: Callable[[], float] = time.time, serve_http: bool = True,
                 health_check_server: Callable[..., Any] = BackgroundHTTPServer,
                 backoff: Callable[[], Backoff] | None = None, settle_heap: bool = False) -> None:
        self.config = config
        self.node_name = config.node_name
        self.metrics = metrics or Metrics()
        self.wall = wall
        # one tracker per IP family; until the node's families are known (prepare_datapath) both
        # listen, then only the served ones stay, the primary family first
        self.proxiers: dict[int, FamilyProxier] = {
            family: FamilyProxier(family, ChangeTracker(start_time=wall(), node_name=config.node_name))
            for family in (4, 6)}
        self.health = ProxierHealth(timeout=2 * config.sync_period, clock=wall, on_probe=self._count_probe)
        self.runner = BoundedFrequencyRunner(self.sync, config.min_sync_period, config.sync_period, clock=clock,
                                             name="sync")
        self.mode: str = ""
        self.service_health: ServiceHealthServers | None = None
        self.reflectors: list[Reflector] = []
        self._collections = collections
        self._datapath_factory = datapath_factory
        self._local_addresses = local_addresses
        self._serve_http = serve_http
        # heap.settle() after each full sync: what `ebpf-proxy run` does; off by default, as it
        # freezes the whole process's heap (a test process's too) and collects it once per sync
        self._settle_heap = settle_heap
        self._initialized = False  # every first list is in (queue_sync)
        if settle_heap:  # the process's heap is the agent's: large blocks go back when freed
            heap.pin_mmap_threshold()
        self._health_check_server = health_check_server
        # client-go's Reflector backoff (0.8s doubling), capped at --watch-backoff-max
        self._backoff = backoff or (lambda: Backoff(cap=config.watch_backoff_max))
        self._servers: list[BackgroundHTTPServer] = []
        self._stop = threading.Event()
        self._runner_thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()  # guards _syncing/_synced_rv against the /healthz reader
        self._datapath_lock = threading.Lock()  # one sync at a time (and a drift audit's checks: audit.py)
        self._datapath_syncs = 0  # syncs begun, counted under _datapath_lock: the audit's "did one run meanwhile"
        self._handover_from: str | None = None  # the other mode, still in place until the first sync
        self._ip6tables_checked = False  # ebpf mode: ip6tables leftovers looked for (after IPv6's first sync)
        self.handover: handover.HandoverResult | None = None  # what that first sync moved over
        self.auditor = DriftAuditor(lambda: [(f, p.datapath) for f, p in self.proxiers.items()],
                                    self._datapath_lock, self.metrics,
                                    period=config.audit_period, repair=config.audit_repair,
                                    syncs=lambda: self._datapath_syncs)
        self._syncing = False
        self._synced_rv = ""
        self.health.synced_resource_version = self.synced_resource_version

    # ---- the family proxiers ---------------------------------------------------------------------

    @property
    def families(self) -> tuple[int, ...]:
        """The IP families proxied, primary first (both until the node's are known)."""
        return tuple(self.proxiers)

    @property
    def trackers(self) -> dict[int, ChangeTracker]:
        return {family: p.tracker for family, p in self.proxiers.items()}

    @property
    def primary(self) -> FamilyProxier:
        return next(iter(self.proxiers.values()))

    @property
    def tracker(self) -> ChangeTracker:
        """The primary family's tracker (the Node, the zone: the same in every tracker)."""
        return self.primary.tracker

    @property
    def datapath(self) -> Datapath | None:
        """The primary family's datapath: what the drift audit and the counters read."""
        return self.primary.datapath

    @property
    def node_config(self) -> NodeConfig | None:
        return self.primary.node_config

    @property
    def pending(self) -> bool:
        return any(p.tracker.pending for p in self.proxiers.values())

    # ---- events from the watches -----------------------------------------------------------------

    def report_invalid(self, problem: Invalid) -> None:
        self.metrics.invalid_objects.labels(kind=problem.kind, reason=problem.reason).inc()

    def queue_sync(self) -> None:
        """A change to program (kube-proxy's proxier.Sync()): not before every first list is in
        (its isInitialized), as the first sync takes them all anyway: a first list longer than the
        health timeout (minutes at 100,000 Services on a slow API server) must not read as a stuck
        proxier on /livez, nor 200,000 objects each queue a sync."""
        if not self._initialized:
            if not all(r.synced.is_set() for r in self.reflectors):
                return
            self._initialized = True
        self.health.queued_update()
        self.metrics.last_queued_timestamp.set(self.wall())
        self.runner.request()

    def node_changed(self) -> None:
        """The Node object changed. The NodeConfig is built once, at start: say so if it would differ."""
        if self.node_config is None:
            return
        fresh = self._build_node_config(self.primary.family)
        if fresh != self.node_config:
            # kube-proxy exits when a NodeCIDR detector's podCIDRs change; we keep serving with the
            # programmed configuration and say what differs
            log.warning("this node's addresses or podCIDRs changed since the agent started; restart the agent "
                        "to use them",
                        extra={"node": self.node_name, "node_ips": ",".join(fresh.node_ips),
                               "programmed_node_ips": ",".join(self.node_config.node_ips),
                               "detect_local": str(fresh.detector),
                               "programmed_detect_local": str(self.node_config.detector)})

    def _count_probe(self, endpoint: str, status: int) -> None:
        counter = self.metrics.healthz if endpoint == "healthz" else self.metrics.livez
        counter.labels(code=str(status)).inc()

    # ---- steps -----------------------------------------------------------------------------------

    def resolve_mode(self) -> str:
        self.mode = resolve_auto_mode() if self.config.mode == "auto" else self.config.mode
        return self.mode

    def start_servers(self) -> None:
        """/metrics and /healthz (if their bind addresses are set). Raises OSError if a port is taken."""
        if not self._serve_http:
            return
        if self.config.metrics_bind_address:
            self._servers.append(metrics_server(self.config.metrics_bind_address, self.metrics,
                                                lambda: self.mode, extra=self.auditor.respond).start())
        if self.config.healthz_bind_address:
            self._servers.append(healthz_server(self.config.healthz_bind_address, self.health).start())

    def handlers(self) -> dict[str, Handler]:
        """The watch handlers, by kind: what each Reflector feeds (tests feed them directly)."""
        return {"Service": _ServiceEvents(self), "EndpointSlice": _SliceEvents(self), "Node": _NodeEvents(self)}

    def start_watches(self) -> None:
        collections = self._collections
        if collections is None:
            from ebpf_proxy.k8s.client import agent_collections, make_api_client

            api = make_api_client(self.config.kubeconfig, self.config.master)
            collections = agent_collections(api, self.node_name, idle_timeout=self.config.watch_idle_timeout)
        turn = threading.Lock()  # the reflectors' lists are handed on in turns (Reflector `turn`)
        for kind, handler in self.handlers().items():
            # the handlers turn each object into the model at once: the cache needs only what a
            # delete after a relist names (keep_version), not ~50 MB of API objects at 10,000 Services
            # and, where the heap is settled after full syncs, no collector walks while a list
            # builds the model (heap.paused: ~10 of 26 s of a first list at 100,000 Services)
            reflector = Reflector(collections[kind], handler, backoff=self._backoff(), reporter=self.report_invalid,
                                  keep=keep_version, bulk=heap.paused if self._settle_heap else contextlib.nullcontext,
                                  intern_keys=kind == "Service",  # the trackers' key too: held once
                                  turn=turn)
            self.reflectors.append(reflector)
            reflector.start()

    def wait_until_listed(self, poll: float = 0.2, kinds: Collection[str] | None = None) -> bool:
        """Block until every collection (of `kinds`, if given) was listed once; False if stopped first.

        Listed means a LIST that succeeded to its last page (Reflector.synced). A first list is
        handed to the trackers page by page as it arrives (k8s/watch.py); one that fails half
        way has left part of the collection there, and does not count: the first sync waits for
        the retry, whose difference removes what the failed attempt left and the API no longer
        has."""
        waiting_since = time.monotonic()
        logged = False
        reflectors = [r for r in self.reflectors if kinds is None or r.kind in kinds]
        while not self._stop.is_set():
            pending = [r for r in reflectors if not r.synced.is_set()]
            if not pending:
                return True
            if not logged and time.monotonic() - waiting_since > 5:
                kinds_pending = [r.kind for r in pending]
                log.info("waiting for the first list of %s", ", ".join(kinds_pending),
                         extra={"pending": ",".join(kinds_pending)})
                logged = True
            # woken the moment that list is in (the datapath's start and the first sync wait
            # for it: polling added ~0.1 s to each on average); `poll` is how soon a stop is seen
            pending[0].synced.wait(poll)
        return False

    def _read_local_addresses(self) -> list[str]:
        try:
            return self._local_addresses()
        except Exception as exc:  # no netlink: fall back to the Node object's addresses
            log.warning("cannot read local addresses: %s", exc)
            return []

    def _build_node_config(self, family: int, local: list[str] | None = None) -> NodeConfig:
        local = self._read_local_addresses() if local is None else local
        return build_node_config(self.config, local, self.tracker.node, family)

    def _datapath_where(self) -> dict[str, str | None]:
        """Where a datapath of either mode finds its kernel objects (the cgroup, the bpffs)."""
        return {"cgroup_path": self.config.cgroup_path or None, "bpffs": self.config.bpffs or None}

    def _warm_up(self) -> list[str]:
        """Before the lists start: this node's addresses (netlink) and the mode's datapath module,
        imported. Both import modules, and an import reads files: each read gives up the
        interpreter lock, and while a list is decoded, each taking it back waits up to a switch
        interval (5 ms) for the list's thread. Imported by prepare_datapath during the lists, the
        ~100 modules took ~0.7 s instead of ~0.1 (10,000 Services), on the full sync's path.
        Here they overlap the kubeconfig's child instead. Returns the addresses read."""
        local = self._read_local_addresses()
        if self._datapath_factory is create_datapath:
            with contextlib.suppress(Exception):  # not available: prepare_datapath says why
                datapath_class(self.mode)
        return local

    def prepare_datapath(self, local: list[str] | None = None) -> Datapath:
        """The served families, their NodeConfigs and datapaths, the health-check servers. Raises
        if a datapath cannot be created. Returns the primary family's datapath. `local`: this
        node's addresses, read now when not given."""
        local = self._read_local_addresses() if local is None else local
        families = served_families(self.tracker.node, local)
        self.proxiers = {family: self.proxiers[family] for family in families}
        for proxier in self.proxiers.values():
            self._prepare_family(proxier, local)
        primary = self.primary
        assert primary.datapath is not None and primary.node_config is not None
        self.metrics.set_datapath(self.mode)
        self.metrics.read_counters_from(primary.datapath)
        hosts = tuple(host for p in self.proxiers.values() for host in _health_check_hosts(p.node_config))
        self.service_health = ServiceHealthServers(hosts=hosts, proxy_healthy=self.health.live,
                                                   server_factory=self._health_check_server)
        return primary.datapath

    def _prepare_family(self, proxier: FamilyProxier, local: list[str]) -> None:
        node_config = proxier.node_config = self._build_node_config(proxier.family, local)
        proxier.mode = self.mode  # every family in the agent's mode (ebpf: the programs serve IPv6 too)
        log.info("node configuration", extra={
            "node": self.node_name, "mode": proxier.mode, "family": f"IPv{proxier.family}",
            "node_ips": ",".join(node_config.node_ips),
            "cluster_cidrs": ",".join(node_config.cluster_cidrs),
            "nodeport_addresses": ",".join(node_config.nodeport_addresses) or "all",
            "masquerade_all": node_config.masquerade_all,
            "detect_local": str(node_config.detector),
            "localhost_nodeports": node_config.localhost_nodeports})
        where = self._datapath_where()
        datapath = proxier.datapath = self._datapath_factory(
            proxier.mode, node_config, **where, bpf_cache_dir=self.config.bpf_cache_dir or None,
            max_entries=dict(self.config.bpf_map_sizes) or None, xdp_mode=self.config.bpf_xdp_mode,
            host_routing=self.config.bpf_host_routing, ct_gc_period=self.config.bpf_conntrack_gc_period,
            backend=self.config.iptables_backend or None, proof_dir=self.config.iptables_proof_dir or None)
        # a kernel datapath: is the other mode's still here? Asked once, of the handover family's
        if datapath.mode in handover.OTHER_MODE and proxier is self._handover_proxier():
            self._handover_from = handover.previous_mode(self.mode, node_config, self._datapath_factory, **where)
            if self._handover_from:
                log.info("the %s datapath is in place: its connections move over after the first sync",
                         self._handover_from, extra={"from_mode": self._handover_from})
                datapath.expect_handover()
        datapath.progress = self.metrics.sync_progress.set
        datapath.prefetch()  # e.g. a restart's read-back of the pinned maps, while the list goes on

    def _handover_proxier(self) -> FamilyProxier:
        """The family a mode switch is made in: IPv4 where there is one (the kernel's connections
        that move are IPv4's, agent/handover.py), else the primary (an IPv6-only node)."""
        return self.proxiers.get(4) or self.primary

    def _after_first_syncs(self, synced: Collection[int]) -> None:
        """What waits for families' first syncs (make before break): the mode switch, once the
        handover family is programmed; in ebpf mode, removing ip6tables rules an earlier agent
        left, once the IPv6 family is."""
        proxier = self._handover_proxier()
        if self._handover_from and proxier.family in synced:
            assert proxier.datapath is not None and proxier.node_config is not None
            previous, self._handover_from = self._handover_from, None
            self.handover = handover.hand_over(
                self.mode, previous, proxier.datapath, proxier.node_config, self._datapath_factory,
                **self._datapath_where())
            self.metrics.observe_handover(previous, self.handover.counts)
        if self.mode == "ebpf" and 6 in synced and not self._ip6tables_checked:
            self._ip6tables_checked = True
            handover.remove_ip6tables_leftovers(self.node_name, self._datapath_factory, **self._datapath_where())

    def sync(self, full: bool) -> None:
        """One sync (the runner's function): for each family, take from its tracker, program its
        datapath, commit (or abort that family's changes: they are retried with the next sync).
        A family that fails does not hold the others back, but the sync raises, and /healthz is
        not refreshed, until every family programmed its state."""
        if any(p.datapath is None for p in self.proxiers.values()):
            raise RuntimeError("sync before prepare_datapath(): no datapath yet")
        with self._sync_lock:
            observed_rv = self.observed_resource_version()
            taken = {family: p.tracker.take(full=full) for family, p in self.proxiers.items()}
            self._syncing = True
        any_full = any(changes.full for _state, changes in taken.values())
        started = time.monotonic()
        self.metrics.sync_started(any_full)
        results: dict[int, SyncResult | None] = {}
        failure: Exception | None = None
        # a full sync makes an entry per service port and backend: no collector walks meanwhile
        # (the settle below collects once), as during a list
        pause = heap.paused() if any_full and self._settle_heap else contextlib.nullcontext()
        try:
            with self._datapath_lock, pause:
                self._datapath_syncs += 1
                for family, (state, changes) in taken.items():
                    try:
                        results[family] = self._sync_family(self.proxiers[family], state, changes)
                    except Exception as exc:
                        self.proxiers[family].tracker.abort()
                        failure = failure or exc
                        log.error("sync of the IPv%d datapath failed: %s", family, exc,
                                  extra={"family": f"IPv{family}"})
                self._after_first_syncs(results)
        finally:
            self.metrics.sync_ended(any_full)
        elapsed = time.monotonic() - started
        triggers = [t for family in results for t in self.proxiers[family].tracker.commit()]
        with self._sync_lock:
            self._syncing = False
            if failure is None:
                self._synced_rv = observed_rv
        if failure is not None:
            self.metrics.sync_errors.inc()
            raise failure
        now = self.wall()
        self.metrics.observe_sync(elapsed, any_full, now)
        self.metrics.observe_programming(triggers, now)
        self.health.updated()
        self._update_stats()
        self._sync_service_health([state for state, _changes in taken.values()])
        for family, (state, changes) in taken.items():
            result = results[family]
            if result is not None:
                self.metrics.observe_sync_counts(result.counts)
            log.info("synced", extra={
                "family": f"IPv{family}", "full": changes.full, "services": len(state.services),
                "changed": len(changes.services), "stale_udp_endpoints": len(changes.stale_udp_endpoints),
                "duration_ms": round(elapsed * 1000, 1), "counts": result.counts if result is not None else {}})
        if any_full and self._settle_heap:
            del taken, state, changes, result  # not kept alive by this frame through the collection
            seconds, frozen = heap.settle()
            log.debug("heap settled", extra={"duration_ms": round(seconds * 1000, 1), "objects": frozen})

    def _sync_family(self, proxier: FamilyProxier, state: ProxyState, changes: ChangeSet) -> SyncResult | None:
        assert proxier.datapath is not None and proxier.node_config is not None
        return proxier.datapath.sync(state, changes)

    def observed_resource_version(self) -> str:
        """The oldest resourceVersion among the watches: every event up to it was handed to the tracker.

        Numeric on the lab's API server (one counter); on a real cluster resourceVersions are
        opaque, and this is only reported, never compared.
        """
        rvs = [r.resource_version for r in self.reflectors]
        if not rvs or not all(rv.isdigit() for rv in rvs):
            return rvs[0] if len(rvs) == 1 else ""
        return str(min(int(rv) for rv in rvs))

    def synced_resource_version(self) -> str:
        """Up to which resourceVersion the datapath is programmed (reported on /healthz).

        With no change pending and no sync running, everything the watches delivered is in the
        kernel, so the watches' own position (advanced by bookmarks) counts.
        """
        with self._sync_lock:
            if not self._synced_rv:
                return ""
            if not self._syncing and not self.pending:
                return self.observed_resource_version()
            return self._synced_rv

    def _update_stats(self) -> None:
        """Each datapath's object counts; a secondary family's under an `ipv6_`/`ipv4_` prefix."""
        stats: dict[str, int] = {}
        try:
            for i, proxier in enumerate(self.proxiers.values()):
                prefix = "" if i == 0 else f"ipv{proxier.family}_"
                if proxier.datapath is not None:
                    stats.update({prefix + k: v for k, v in proxier.datapath.stats().items()})
            self.metrics.set_datapath_stats(stats)
        except Exception:
            log.warning("datapath stats failed", exc_info=True)

    def _sync_service_health(self, states: list[ProxyState]) -> None:
        """Health-check NodePorts of every family's Services. A dual-stack Service's pods are in
        both families' slices: its local endpoints are counted in the family that has the most,
        not summed (that would count each pod twice)."""
        if self.service_health is None:
            return
        ports = {(spn.namespace, spn.name): svc.health_check_node_port
                 for state in states for spn, svc in state.services.items() if svc.health_check_node_port}
        self.service_health.sync_services(ports)
        counts: dict[tuple[str, str], int] = {}
        for state in states:
            for key, n in local_ready_endpoints(state, ports).items():
                counts[key] = max(counts.get(key, 0), n)
        self.service_health.sync_endpoints(counts)

    # ---- the whole run ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the agent cleanly (main thread only)."""
        def handle(signum: int, _frame: Any) -> None:
            log.info("received %s: stopping (the datapath stays in place)", signal.Signals(signum).name)
            self.stop()
        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def run(self) -> int:
        log.info("starting", extra={"node": self.node_name, "mode": self.config.mode})
        try:
            self.resolve_mode()
            self.start_servers()
            local = self._warm_up()
            self.start_watches()
            # the datapath needs the Node alone (its families and addresses): its programs load
            # while the Services and EndpointSlices still list (seconds at 100,000 Services)
            if not self.wait_until_listed(kinds=("Node",)):  # stopped before the API answered
                self.shutdown()
                return EXIT_OK
            self.prepare_datapath(local)
            if not self.wait_until_listed():
                self.shutdown()
                return EXIT_OK
        except Exception as exc:
            log.error("cannot start: %s", exc, extra={"mode": self.mode or self.config.mode})
            log.debug("start failure", exc_info=True)
            self.shutdown()
            return EXIT_FAILED
        self._runner_thread = threading.Thread(target=self.runner.loop, name="sync-runner", daemon=True)
        self._runner_thread.start()
        self.auditor.first_delay = self.first_audit_delay()
        self.auditor.start()
        self._stop.wait()
        self.shutdown()
        return EXIT_OK

    def first_audit_delay(self) -> float | None:
        """When the drift audit first runs, if sooner than --audit-period: an iptables agent that
        keeps proofs audits early, since its clean audit is what spares its next restart the
        restore. None: the period."""
        return PROOF_AUDIT_DELAY if self.mode == "iptables" and self.config.iptables_proof_dir else None

    def stop(self) -> None:
        self._stop.set()
        self.runner.stop()

    def shutdown(self) -> None:
        """Stop everything we started; keep the datapath's kernel state (close(), not cleanup())."""
        self._stop.set()
        self.runner.stop()
        for reflector in self.reflectors:
            reflector.stop()
        if self._runner_thread is not None:
            self._runner_thread.join(timeout=30)
        self.auditor.stop()
        if self.service_health is not None:
            self.service_health.close()
        for server in self._servers:
            server.stop()
        self._servers.clear()
        for proxier in self.proxiers.values():
            if proxier.datapath is not None:
                try:
                    proxier.datapath.close()
                except Exception:
                    log.exception("closing the IPv%d datapath failed", proxier.family)
        log.info("stopped", extra={"node": self.node_name})


def local_ready_endpoints(state: ProxyState, services: Collection[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """(namespace, name) → ready local endpoints over all its ports, as kube-proxy's
    EndpointsMap.LocalReadyEndpoints counts them for health-check NodePorts, for `services` only
    (the ones with a health-check server, the only ones it is asked for): counting every
    endpoint of 10,000 Services on every sync took longer than programming the change itself."""
    counts: dict[tuple[str, str], int] = {}
    if not services:
        return counts
    for spn in state.services:
        key = (spn.namespace, spn.name)
        if key in services:
            n = sum(1 for ep in state.endpoints_of(spn) if ep.is_local and ep.ready)
            if n:
                counts[key] = counts.get(key, 0) + n
    return counts
