"""Where a full sync's seconds and bytes go, in one process: `python -m ebpf_proxy.bench.cpscale` (issue 12).

The lab bench (`bench/controlplane.py`) times a full sync from outside: agent start to /healthz,
with the API server, HTTP and the kernel's programs in the way. This harness takes the same path
inside one process, phase by phase, so that each cost has a number:

- `list+convert`: the agent's real first-list path, KubeListWatch.stream (each page decoded once,
  as it arrives), fed by a simulated API server that builds each page on request (the Services
  and EndpointSlices a bench of N Services x E endpoints installs, with the fields kube-apiserver
  defaults); the Reflectors deliver each page to the agent's own handlers (k8s/convert.py, the
  trackers) as it comes, as `ebpf-proxy run` does, the three collections concurrently.
  The CPU seconds the simulated server spends building pages are counted apart (`api_server_s`):
  subtract them for the agent's own share (on a real node the API server runs elsewhere);
- `sync`: Agent.sync(full=True), the agent's first sync: tracker.take, the datapath, commit,
  health bookkeeping and the heap settle `ebpf-proxy run` does after a full sync.

With `--restart --mode iptables --apply`, an `audit` phase (whose clean result is the proof a
restart keeps, datapath/iptables/proof.py, in a directory of the run's own) and then a `restart`
phase follow: a new IptablesDatapath, as a restarted agent has it, syncs over the ruleset in the
namespace (`tables_proven`: the tables it did not restore).

With `--restart` (ebpf mode) two more phases follow, over the maps the sync filled:
- `restart`: the first full sync of an agent restarted over pinned maps: the datapath drops its
  ServicePrograms (what a new process would not have) and syncs again through a fresh one, which
  takes over what the maps hold (adopt.adopt: the read-back, every port matched, strays removed)
  before the sync writes the differences (none);
- `audit`: one drift audit (the agent's DriftAuditor.run_once, every --audit-period): the maps
  read back and compared with what the last sync wrote; `drifts` must be 0.

The datapath is real up to the kernel boundary. `ebpf`: ServicePrograms writes real BPF maps,
created for this run and never pinned or attached (they vanish with their fds; nothing in the
kernel sees a packet through them), in the order EbpfDatapath.sync writes them. `iptables`: the
ruleset is rendered (render_fragments), never applied; with `--apply`, the real IptablesDatapath
renders it and loads it with one iptables-restore into a network namespace made for the run
(`epx-cpscale-<pid>`, deleted afterwards with its rules): the phase's wall time is then kube-proxy's
full sync, the restore's own CPU and memory (a child process) not counted in the agent's. `none`:
the datapath is skipped (the model's cost alone).

Every phase reports wall and CPU seconds, RSS at its end and the peak RSS during it (the kernel's
high-water mark, reset at the start of each phase through /proc/self/clear_refs). With
`--tracemalloc` the Python allocations are traced as well (slower: ~2x) and the top allocation
sites held at the end of each phase are listed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from ebpf_proxy.bench import procstat
from ebpf_proxy.datapath.base import Datapath, SyncResult
from ebpf_proxy.model import ChangeSet, NodeConfig, ProxyState

NODE = "worker1"
NODE_IP = "172.20.20.15"
NODES = ("worker1", "worker2", "worker3")
NAMESPACE = "default"
SERVICE_CIDR_BASE = 10 << 24 | 96 << 16  # 10.96.0.0/12: ClusterIPs from 10.96.0.10 on
ENDPOINT_BASE = 100 << 24 | 64 << 16  # 100.64.0.0/10: one address per endpoint, never reused
FILLER_PORT, SERVICE_PORT = 8080, 80
PAGE_SIZE = 500  # what the agent asks for (k8s.client.PAGE_SIZE)
MIB = 1024 * 1024


class CpScaleError(RuntimeError):
    pass


def _ip(value: int) -> str:
    return f"{value >> 24 & 255}.{value >> 16 & 255}.{value >> 8 & 255}.{value & 255}"


# ---- the simulated API server -------------------------------------------------------------------


def service_object(index: int, rv: int) -> dict:
    """Service `index` as kube-apiserver serves it after defaulting (a ClusterIP service, one
    port): what the bench's filler Services look like in a LIST."""
    name = f"filler-{index}"
    cluster_ip = _ip(SERVICE_CIDR_BASE + 10 + index)
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"00000000-0000-4000-8000-{index:012d}",
                     "resourceVersion": str(rv), "creationTimestamp": "2026-11-26T03:40:24Z",
                     "labels": {"bench.ebpf-proxy.io/role": "filler"}},
        "spec": {"ports": [{"protocol": "TCP", "port": SERVICE_PORT, "targetPort": FILLER_PORT}],
                 "clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "type": "ClusterIP",
                 "sessionAffinity": "None", "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                 "internalTrafficPolicy": "Cluster"},
        "status": {"loadBalancer": {}},
    }


def slice_object(index: int, endpoints: int, rv: int) -> dict:
    """The EndpointSlice of Service `index`: `endpoints` ready endpoints spread over the nodes."""
    name = f"filler-{index}"
    first = ENDPOINT_BASE + index * endpoints
    return {
        "metadata": {"name": f"{name}-bench", "namespace": NAMESPACE,
                     "uid": f"00000000-0000-4000-9000-{index:012d}", "resourceVersion": str(rv),
                     "creationTimestamp": "2026-11-26T03:40:24Z", "generation": 1,
                     "labels": {"kubernetes.io/service-name": name,
                                "endpointslice.kubernetes.io/managed-by": "bench.ebpf-proxy.io",
                                "bench.ebpf-proxy.io/role": "filler"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [_ip(first + j)], "nodeName": NODES[(index + j) % len(NODES)],
                       "conditions": {"ready": True, "serving": True, "terminating": False}}
                      for j in range(endpoints)],
        "ports": [{"name": "", "port": FILLER_PORT, "protocol": "TCP"}],
    }


def node_object() -> dict:
    return {"metadata": {"name": NODE, "resourceVersion": "1", "labels": {}},
            "spec": {"podCIDR": "10.244.5.0/24", "podCIDRs": ["10.244.5.0/24"]},
            "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]}}


class _Response:
    """What the kubernetes client returns with _preload_content=False, as far as the agent reads it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def release_conn(self) -> None:
        pass


class SimulatedApi:
    """Pages of a LIST built on request (continue token: the next index), so the harness itself
    never holds the whole collection; the CPU seconds spent building them are counted apart."""

    def __init__(self, kind: str, count: int, build: Callable[[int, int], dict]) -> None:
        self.kind, self.count, self._build = kind, count, build
        self.seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self, *, limit: int = PAGE_SIZE, _continue: str | None = None, **_: Any) -> _Response:
        started = time.thread_time()  # CPU time: the list thread's waits for the GIL are not the server's
        start = int(_continue or 0)
        end = min(start + limit, self.count)
        meta: dict[str, str] = {"resourceVersion": str(self.count + 1)}
        if end < self.count:
            meta["continue"] = str(end)
        # orjson: the same compact text as json.dumps(separators=(",", ":")) for these ASCII
        # objects, in a fifth of the time: at 100,000 Services the server's json.dumps took the
        # GIL from the agent for ~5 s of a run that measures the agent
        body = orjson.dumps({"kind": f"{self.kind}List", "apiVersion": "v1", "metadata": meta,
                             "items": [self._build(i, i + 2) for i in range(start, end)]})
        with self._lock:
            self.seconds += time.thread_time() - started
        return _Response(body)


class _IdleWatch:
    """A watch with nothing to say until the Reflector interrupts it (the agent is stopped)."""

    def __init__(self) -> None:
        self._stopped = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        self._stopped.wait()
        return iter(())

    def interrupt(self) -> None:
        self._stopped.set()

    def close(self) -> None:
        self._stopped.set()


class SimulatedListWatch:
    """The agent's real KubeListWatch.list over a SimulatedApi; watches stay idle."""

    def __init__(self, api: SimulatedApi, page_size: int = PAGE_SIZE) -> None:
        from ebpf_proxy.k8s.client import KubeListWatch

        self.kind = api.kind
        self.api = api
        self._lw = KubeListWatch(api.kind, api, page_size=page_size)

    def list(self):
        return self._lw.list()

    def stream(self):
        return self._lw.stream()

    def watch(self, resource_version: str) -> _IdleWatch:
        return _IdleWatch()


# ---- datapaths up to the kernel boundary ----------------------------------------------------------


def private_maps(services: int, endpoints: int, sizes: dict[str, int] | None = None):
    """Every map of the datapath, created for this process only (not pinned: the kernel frees
    them when Maps.close() closes the last fd), sized for `services` x `endpoints` (both slot
    banks) unless `sizes` says otherwise. Raises OSError (not root, no BPF)."""
    from ebpf_proxy.datapath.ebpf import libbpf, loader
    from ebpf_proxy.datapath.ebpf import structs as s
    from ebpf_proxy.datapath.ebpf.maps import Maps

    backends = services * max(endpoints, 1)
    capacities = {**loader.MAX_ENTRIES, "epx_svc": max(services + 16, 1024),
                  "epx_backend": max(backends + 16, 1024), "epx_slot": max(2 * backends + 16, 1024),
                  **loader.FIXED_ENTRIES, **(sizes or {})}
    # as bpf/maps.c creates them: LPM tries (the kernel requires it) and the connection tables
    no_prealloc = {name for name, spec in s.MAPS.items() if spec.kind == "lpm_trie"} | {"epx_ct4", "epx_ct6"}
    fds: dict[str, int] = {}
    try:
        for name, spec in s.MAPS.items():
            fds[name] = libbpf.map_create(spec.type_id, name, ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf),
                                          capacities[name], 1 if name in no_prealloc else 0)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return Maps(fds, owned=True)


class PrivateMapsDatapath(Datapath):
    """The eBPF datapath's map writing (ServicePrograms over real maps) without its programs:
    maps created for this run, unpinned, closed by close(). The sync follows EbpfDatapath.sync:
    take over what the maps hold (adopt), the node's facts, then every service port in name order
    (ServicePrograms.sync_names, the loop EbpfDatapath.sync runs)."""

    mode = "ebpf"

    def __init__(self, node: NodeConfig, capacity: int, endpoints: int) -> None:
        super().__init__(node)
        self.maps = private_maps(capacity, endpoints)
        self._programs = None
        self.map_writes = 0
        self.last_writes = 0  # of the last sync

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        from ebpf_proxy.datapath.ebpf import adopt
        from ebpf_proxy.datapath.ebpf.services import ServicePrograms, node_settings, program_node

        writes = 0
        if self._programs is None:
            self._programs = ServicePrograms(self.maps, self.node.node_ips)
            writes += adopt.adopt(self._programs, state)
            writes += program_node(self.maps, self.node, node_settings(self.node))
        programs = self._programs
        names = set(state.services) | set(programs.current) if changes.full else set(changes.services)
        done, did_not_fit = programs.sync_names(state, names)
        writes += done
        full = len(did_not_fit)
        programs.sync_done()
        self.map_writes += writes
        self.last_writes = writes
        if full:
            raise CpScaleError(f"{full} service port(s) did not fit the maps: capacity too small")
        return SyncResult({"map_writes": writes})

    def stats(self) -> dict[str, int]:
        if self._programs is None:
            return {}
        return {"bpf_services": self._programs.frontend_count, "bpf_backends": self._programs.backend_count}

    def forget(self) -> None:
        """Drop what the syncs wrote (the ServicePrograms), keep the maps: the next sync is a
        restarted agent's first, which takes over the maps (adopt) as EbpfDatapath's does."""
        self._programs = None

    def believed(self):
        """What the maps should hold since the last sync, for the drift audit (audit_ebpf.audit),
        as EbpfDatapath.believed says it; no devices (none attached). None before the first sync."""
        import ipaddress

        from ebpf_proxy.datapath.ebpf.datapath import Believed
        from ebpf_proxy.datapath.ebpf.maps import Maps
        from ebpf_proxy.datapath.ebpf.services import detector_cidrs, node_addresses, node_settings

        if self._programs is None:
            return None
        return Believed(maps=self.maps, services=self._programs.current,
                        config=Maps.config_of(node_settings(self.node)),
                        node_addrs=frozenset(node_addresses(self.node)),
                        pod_cidrs=frozenset(str(ipaddress.ip_network(c, strict=False)) for c in detector_cidrs(self.node)),
                        devices=None)

    def whole_map_pass(self) -> contextlib.AbstractContextManager[None]:
        """EbpfDatapath's, for the audit: here no connection GC runs to hold off."""
        return contextlib.nullcontext()

    def cleanup(self) -> None:
        self.close()

    def close(self) -> None:
        self.maps.close()


class RenderOnlyDatapath(Datapath):
    """The iptables datapath's rendering (every service port's chains), never applied."""

    mode = "iptables"

    def __init__(self, node: NodeConfig) -> None:
        super().__init__(node)
        self.rules = 0

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        from ebpf_proxy.datapath.iptables.render import RenderContext, is_large_cluster, render_fragments

        ctx = RenderContext.for_node(self.node, large_cluster=is_large_cluster(state))
        fragments = render_fragments(ctx, state)
        self.rules = sum(len(f.nat_services) + len(f.nat_nodeports) + sum(map(len, f.nat_chains.values()))
                         + sum(map(len, f.filter_rules.values())) for f in fragments.values())
        return SyncResult({"rules": self.rules})

    def stats(self) -> dict[str, int]:
        return {"rules": self.rules}

    def cleanup(self) -> None:
        pass


class NoDatapath(Datapath):
    mode = "none"

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        return SyncResult({"services": len(state.services)})

    def cleanup(self) -> None:
        pass


# ---- measuring ----------------------------------------------------------------------------------


@dataclass
class Phase:
    """One phase's figures. peak_rss_mib: the highest RSS during the phase (with a reset high-water
    mark), else since process start; traced_*: Python allocations (only with tracemalloc)."""

    name: str
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    traced_mib: float | None = None
    traced_peak_mib: float | None = None
    top: list[str] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)


@contextmanager
def measured(phase: Phase, top: int = 0) -> Iterator[Phase]:
    """Time `phase` (wall and process CPU) and record its memory when it ends."""
    with contextlib.suppress(OSError):  # not allowed: the peak is then the process's so far
        procstat.reset_peak(os.getpid())
    if tracemalloc.is_tracing():
        tracemalloc.reset_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield phase
    finally:
        phase.seconds = round(time.perf_counter() - wall, 3)
        phase.cpu_seconds = round(time.process_time() - cpu, 3)
        usage = procstat.read(os.getpid())
        phase.rss_mib, phase.peak_rss_mib = round(usage.rss_mib, 1), round(usage.peak_rss_mib, 1)
        if tracemalloc.is_tracing():
            current, peak = tracemalloc.get_traced_memory()
            phase.traced_mib, phase.traced_peak_mib = round(current / MIB, 1), round(peak / MIB, 1)
            if top:
                phase.top = top_sites(top)


def top_sites(n: int) -> list[str]:
    """The n allocation sites holding the most traced memory now, one line each."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")))
    out = []
    for stat in snapshot.statistics("lineno")[:n]:
        frame = stat.traceback[0]
        where = frame.filename.split("/site-packages/")[-1].split("/ebpf_proxy/")[-1]
        out.append(f"{stat.size / MIB:8.1f} MiB {stat.count:>9,} blocks  {where}:{frame.lineno}")
    return out


@dataclass
class Result:
    services: int
    endpoints: int
    mode: str
    phases: list[Phase]
    total_seconds: float
    peak_rss_mib: float
    api_server_s: float
    counts: dict[str, int]


def make_agent(mode: str, services: int, endpoints: int, page_size: int,
               netns: str | None = None, proof_dir: str | None = None) -> tuple[Any, dict[str, SimulatedApi]]:
    """An Agent (no HTTP servers) over simulated collections and a harness datapath for `mode`
    (iptables with `netns`: the real IptablesDatapath, applying in that named netns, keeping its
    audits' proofs in `proof_dir`)."""
    from ebpf_proxy.agent.agent import Agent
    from ebpf_proxy.agent.config import load_config

    apis = {"Service": SimulatedApi("Service", services, lambda i, rv: service_object(i, rv)),
            "EndpointSlice": SimulatedApi("EndpointSlice", services if endpoints else 0,
                                          lambda i, rv: slice_object(i, endpoints, rv)),
            "Node": SimulatedApi("Node", 1, lambda i, rv: node_object())}
    collections = {kind: SimulatedListWatch(api, page_size) for kind, api in apis.items()}

    def factory(_mode: str, node: NodeConfig, **_: Any) -> Datapath:
        if mode == "ebpf" and node.family == 4:
            return PrivateMapsDatapath(node, services, endpoints)
        if mode == "iptables" and netns is not None:
            from ebpf_proxy.datapath.iptables.datapath import IptablesDatapath

            return IptablesDatapath(node, netns=netns, proof_dir=proof_dir)
        if mode == "iptables":
            return RenderOnlyDatapath(node)
        return NoDatapath(node)

    config = load_config({"hostname_override": NODE, "mode": "iptables", "cluster_cidrs": "10.244.0.0/16",
                          "min_sync_period": "1s", "sync_period": "30s"})
    agent = Agent(config, collections=collections, datapath_factory=factory,
                  local_addresses=lambda: ["127.0.0.1", NODE_IP, "10.244.5.1"], serve_http=False,
                  settle_heap=True)
    return agent, apis


def run(services: int, endpoints: int = 10, mode: str = "ebpf", trace: bool = False, top: int = 10,
        page_size: int = PAGE_SIZE, on_phase: Callable[[Phase], None] | None = None,
        restart: bool = False, apply: bool = False) -> Result:
    """Build an agent, list N Services x E endpoints, sync once (with `restart`: then sync again
    as a restarted agent and audit once; with `apply`, iptables: the ruleset loaded into a netns
    made for the run); figures per phase."""
    if services < 0 or endpoints < 0:
        raise ValueError(f"services={services}, endpoints={endpoints}: must not be negative")
    if mode not in ("ebpf", "iptables", "none"):
        raise ValueError(f"mode: {mode!r} is not one of ebpf, iptables, none")
    if restart and not (mode == "ebpf" or (mode == "iptables" and apply)):
        raise ValueError(f"restart: mode {mode!r} has nothing in the kernel to restart over (ebpf, or iptables with apply)")
    if apply and mode != "iptables":
        raise ValueError(f"apply: mode {mode!r} (only iptables applies a ruleset)")
    with _run_netns() if apply else contextlib.nullcontext() as netns, tempfile.TemporaryDirectory() as proofs:
        return _run(services, endpoints, mode, trace, top, page_size, on_phase, restart, netns, proofs)


@contextmanager
def _run_netns() -> Iterator[str]:
    """A network namespace of this run's own, deleted afterwards (its rules with it)."""
    from ebpf_proxy.lab import naming
    from ebpf_proxy.lab.netns import create_netns, delete_netns

    name = f"{naming.PREFIX}-cpscale-{os.getpid()}"
    create_netns(name)
    try:
        yield name
    finally:
        delete_netns(name)


def _run(services: int, endpoints: int, mode: str, trace: bool, top: int, page_size: int,
         on_phase: Callable[[Phase], None] | None, restart: bool, netns: str | None, proof_dir: str) -> Result:
    if trace:
        tracemalloc.start(1)
    phases: list[Phase] = []
    agent = None
    started = time.perf_counter()
    try:
        with measured(Phase("start"), top) as phase:
            agent, apis = make_agent(mode, services, endpoints, page_size, netns, proof_dir)
            agent.resolve_mode()
        phases.append(phase)
        _done(phase, on_phase)
        with measured(Phase("list+convert"), top) as phase:
            agent.start_watches()
            if not agent.wait_until_listed(poll=0.01):
                raise CpScaleError("the agent stopped before listing")
            phase.extra["api_server_s"] = round(sum(a.seconds for a in apis.values()), 3)
        phases.append(phase)
        _done(phase, on_phase)
        with measured(Phase("prepare"), top) as phase:
            agent.prepare_datapath()
        phases.append(phase)
        _done(phase, on_phase)
        with measured(Phase("sync"), top) as phase:
            agent.sync(full=True)
        phases.append(phase)
        _done(phase, on_phase)
        if restart:
            phases += restart_and_audit(agent, top, on_phase, netns, proof_dir)
        counts = dict(agent.datapath.stats()) if agent.datapath is not None else {}
        counts["service_ports"] = sum(len(p.tracker.take()[0].services) for p in agent.proxiers.values())
        for p in agent.proxiers.values():
            p.tracker.abort()
    finally:
        if agent is not None:
            agent.shutdown()
        if trace:
            tracemalloc.stop()
    total = round(time.perf_counter() - started, 3)
    api_s = phases[1].extra.get("api_server_s", 0.0) if len(phases) > 1 else 0.0
    return Result(services=services, endpoints=endpoints, mode=mode, phases=phases, total_seconds=total,
                  peak_rss_mib=max((p.peak_rss_mib for p in phases), default=0.0),
                  api_server_s=api_s, counts=counts)


def restart_and_audit(agent: Any, top: int, on_phase: Callable[[Phase], None] | None,
                      netns: str | None = None, proof_dir: str | None = None) -> list[Phase]:
    """The `restart` and `audit` phases (see the module's docstring) over `agent`'s synced maps,
    or (iptables) the ruleset it applied in `netns`."""
    datapath = agent.datapath
    if not isinstance(datapath, PrivateMapsDatapath):
        return _audit_and_restart_iptables(agent, top, on_phase, netns, proof_dir)
    datapath.forget()
    gc.collect()  # the old ServicePrograms is gone before the restart is measured
    with measured(Phase("restart"), top) as restarted:
        agent.sync(full=True)
        restarted.extra["map_writes"] = datapath.last_writes
    _done(restarted, on_phase)
    with measured(Phase("audit"), top) as audited:
        report = agent.auditor.run_once(repair=False)
        audited.extra["drifts"] = len(report.drifts)
    _done(audited, on_phase)
    return [restarted, audited]


def _audit_and_restart_iptables(agent: Any, top: int, on_phase: Callable[[Phase], None] | None,
                                netns: str | None, proof_dir: str | None) -> list[Phase]:
    from ebpf_proxy.datapath.iptables.datapath import IptablesDatapath

    class Restarted(IptablesDatapath):
        """The datapath a restarted agent makes, keeping its sync's counts for the phase."""

        counts: dict[str, int] = {}

        def sync(self, state: Any, changes: Any) -> SyncResult:
            result = super().sync(state, changes)
            self.counts = dict(result.counts)
            return result

    assert isinstance(agent.datapath, IptablesDatapath) and netns, "restart: iptables needs the applied netns"
    with measured(Phase("audit"), top) as audited:
        audited.extra["drifts"] = len(agent.auditor.run_once(repair=False).drifts)
    _done(audited, on_phase)
    restarted_datapath = Restarted(agent.datapath.node, netns=netns, proof_dir=proof_dir)
    agent.primary.datapath = restarted_datapath
    restarted_datapath.prefetch()  # as a starting agent does, while it lists
    with measured(Phase("restart"), top) as restarted:
        agent.sync(full=True)
    restarted.extra.update({k: restarted_datapath.counts.get(k, 0) for k in ("tables_proven", "chains_written")})
    _done(restarted, on_phase)
    return [audited, restarted]


def _done(phase: Phase, on_phase: Callable[[Phase], None] | None) -> None:
    gc.collect()  # what a phase leaves behind, not what it has not yet freed, is the next one's base
    if on_phase is not None:
        on_phase(phase)


def format_phase(phase: Phase) -> str:
    line = (f"{phase.name:<13} {phase.seconds:8.2f} s  cpu {phase.cpu_seconds:7.2f} s  "
            f"rss {phase.rss_mib:7.1f} MiB  peak {phase.peak_rss_mib:7.1f} MiB")
    if phase.traced_mib is not None:
        line += f"  py {phase.traced_mib:6.1f} MiB (peak {phase.traced_peak_mib:.1f})"
    for key, value in phase.extra.items():
        line += f"  {key} {value}"
    return "\n".join([line, *("    " + t for t in phase.top)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ebpf_proxy.bench.cpscale", description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10, help="endpoints per Service")
    parser.add_argument("--mode", choices=("ebpf", "iptables", "none"), default="ebpf")
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slower)")
    parser.add_argument("--top", type=int, default=10, help="allocation sites listed per phase (--tracemalloc)")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE)
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object")
    parser.add_argument("--restart", action="store_true",
                        help="ebpf: then sync again as an agent restarted over the maps, and audit once; "
                             "iptables with --apply: audit once, then sync again as a restarted agent")
    parser.add_argument("--apply", action="store_true",
                        help="iptables: load the ruleset (iptables-restore) into a netns made for the run")
    args = parser.parse_args(argv)
    if args.restart and not (args.mode == "ebpf" or (args.mode == "iptables" and args.apply)):
        parser.error("--restart restarts over what the kernel holds: only with --mode ebpf, or iptables --apply")
    if args.apply and args.mode != "iptables":
        parser.error("--apply loads an iptables ruleset: only with --mode iptables")
    if args.apply and os.geteuid() != 0:
        parser.error("--apply makes a network namespace: run as root")
    if args.mode == "ebpf" and os.geteuid() != 0:
        parser.error("--mode ebpf creates BPF maps: run as root, or use --mode iptables / none")
    result = run(args.services, args.endpoints, args.mode, args.tracemalloc, args.top, args.page_size,
                 on_phase=None if args.json else lambda p: print(format_phase(p), flush=True), restart=args.restart,
                 apply=args.apply)
    if args.json:
        print(json.dumps(asdict(result), indent=1))
    else:
        print(f"total {result.total_seconds:.2f} s (simulated API server {result.api_server_s:.2f} s of it), "
              f"peak RSS {result.peak_rss_mib:.1f} MiB; {result.counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
