"""One bench run: build (or reuse) a lab, then for each size, for each mode, measure everything.

Order: sizes ascending on the outside (Services are only ever added), modes inside, in the
order asked. For a proxy mode, the agents are stopped and every mode's kernel state removed,
the measured Services are pointed at that mode's backend ports, every node's agent starts in
the mode and the bench waits until all have programmed everything; then: full syncs (restarts
of worker1's agent), kernel state size, data path points, single-change latency, the burst. `direct` turns
the agents off (lab mode none, kernel state cleaned) and measures the pod IPs.

A mode that cannot run here (not implemented, toolchain missing, agent fails to start) is
recorded as unavailable with its reason, and so is a metric a mode cannot be measured on yet;
nothing is ever filled in. A measurement that breaks (a timeout, a tool failing) is recorded
as failed with its error and the run goes on; the command then exits non-zero. A lab the bench
created is removed at the end whatever happens; a reused lab gets its bench objects removed and
its mode restored.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ebpf_proxy.bench import (
    bpfcost,
    controlplane,
    kernelstate,
    livecost,
    loadgen,
    ports,
    procstat,
    report,
    traffic,
    xdppps,
)
from ebpf_proxy.bench.display import Display
from ebpf_proxy.bench.results import Results, check
from ebpf_proxy.bench.rest import Rest, RestError
from ebpf_proxy.bench.services import BenchServices, measured_targets
from ebpf_proxy.bench.stats import median, percentile
from ebpf_proxy.datapath import DatapathUnavailable, datapath_class
from ebpf_proxy.datapath.ebpf.loader import MAX_ENTRIES as MAP_DEFAULTS
from ebpf_proxy.datapath.ebpf.pins import PIN_SUBDIR
from ebpf_proxy.k8s.client import PAGE_SIZE, PROXY_LABEL_SELECTOR
from ebpf_proxy.lab.cluster import Lab, LabError
from ebpf_proxy.lab.state import BPF_CACHE

TOPOLOGY = Path(__file__).with_name("topology.yaml")
OBSERVED_NODE = traffic.ENTRY_NODE  # the node whose agent restarts and whose kernel is polled
# The reference mode: if its agents do not start, that is a failure, not "not available here".
MUST_RUN = ("iptables",)
MEASUREMENT_ERRORS = (controlplane.ControlPlaneError, kernelstate.KernelStateError, loadgen.LoadgenError,
                      LabError, RestError, subprocess.TimeoutExpired, OSError, bpfcost.BpfCostError, xdppps.XdpPpsError,
                      bpfcost.loader.LoadError, livecost.LiveCostError)


@dataclass
class BenchConfig:
    modes: list[str]
    services: list[int]
    out_dir: Path
    endpoints_per_service: int = 2
    duration: float = 5.0
    warmup: float = 1.0
    repeats: int = 3
    concurrency: int = 16
    client_threads: int = 0  # load generator threads; 0: one per CPU (at most `concurrency`)
    update_changes: int = 20  # per repeat
    burst_changes: int = 1000
    lab_name: str | None = None  # reuse this lab instead of building one
    topology_path: str | None = None
    quick: bool = False
    sync_timeout: float = 600.0
    change_timeout: float = 120.0
    writers: int = 4
    bpf_samples: int = 1000  # test runs per path and repeat of bpf_ns_per_packet
    bpf_endpoints: int = 10  # backends per Service in bpf_ns_per_packet's maps
    xdp_seconds: float = 2.0  # each xdp_pps run's flood (0: no xdp_pps rows)
    # the ebpf agents' --bpf-host-routing (auto|on|off): the fast path (bpf/lib/fib4.h) measured on
    # and off in two runs; None leaves the agent's default (auto)
    bpf_host_routing: str | None = None

    def parameters(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["duration_s"] = d.pop("duration")
        d["warmup_s"] = d.pop("warmup")
        d["topology"] = str(self.topology_path or TOPOLOGY)
        d["measured_services"] = len(ports.MEASURED_SERVICES)
        d["observed_node"] = OBSERVED_NODE
        d["client_threads"] = client_threads(self)
        d["ebpf_agent_args"] = agent_args(self)
        return d


def api_list_cost(rest: Rest, server_pid: int | None = None) -> dict[str, float]:
    """What serving an agent's start costs the lab API server (every Service and EndpointSlice,
    paged as the agent pages), so that the agent's own time can be told apart from the server's:
    listed twice, as the first list after the installs (the server encodes each object's JSON
    once, then keeps it with its version) and as every later one (each restart's: the kept bytes
    joined). Per list: `list_<first|later>_s`, the wall seconds of a client's list, its own JSON
    decoding included; `api_cpu_<first|later>_s`, the server process's CPU seconds (utime +
    stime of `server_pid`, left out when it is not known). `list_seconds`: the first list's wall
    (what earlier results.json files hold)."""
    def server_cpu() -> float | None:
        try:
            return procstat.read(server_pid).cpu_seconds if server_pid else None
        except OSError:  # the server is not (or no longer) that process: no figure, not a wrong one
            return None

    cost: dict[str, float] = {}
    for which in ("first", "later"):
        before = server_cpu()
        started = time.monotonic()
        for kind in ("Service", "EndpointSlice"):
            rest.count_all(kind, PROXY_LABEL_SELECTOR, page=PAGE_SIZE)
        cost[f"list_{which}_s"] = round(time.monotonic() - started, 4)
        after = server_cpu()
        if before is not None and after is not None:
            cost[f"api_cpu_{which}_s"] = round(after - before, 3)
    cost["list_seconds"] = cost["list_first_s"]
    return cost


def agent_args(config: BenchConfig) -> list[str]:
    """The ebpf agents' options: `--bpf-host-routing` when the run sets it, and `--bpf-map-sizes`
    for the run's largest size where the agent's default capacities do not hold it (100k Services
    × 10 endpoints need a million backends), else nothing: one size for the whole run, so every size uses one build of the programs. A quarter's room, in steps of
    65,536: an endpoint change writes its new backend before it frees the old one."""
    services = max(config.services) + len(ports.MEASURED_SERVICES)
    backends = services * config.endpoints_per_service + 1024
    need = {"epx_svc": services + 64, "epx_backend": backends, "epx_slot": backends}
    step = 65536
    sizes = {name: -(-(n + n // 4) // step) * step for name, n in need.items()}
    grow = {name: n for name, n in sizes.items() if n > MAP_DEFAULTS[name]}
    routing = ["--bpf-host-routing", config.bpf_host_routing] if config.bpf_host_routing else []
    return (["--bpf-map-sizes", ",".join(f"{k}={v}" for k, v in grow.items())] if grow else []) + routing


def client_threads(config: BenchConfig) -> int:
    """The load generator's threads: as asked, or one per CPU this process may use; never more
    than the operations in flight (each thread keeps at least one)."""
    wanted = config.client_threads or len(os.sched_getaffinity(0))
    return max(1, min(wanted, config.concurrency))


def mode_unavailable_reason(mode: str) -> str | None:
    """Why `mode` cannot run on this machine, before trying (None: try it)."""
    if mode == "direct":
        return None
    if mode == "iptables" and shutil.which("iptables-save") is None:
        return "iptables-save is not installed"
    try:
        datapath_class(mode)
    except DatapathUnavailable as exc:
        return str(exc)
    return None


def mode_steps(mode: str) -> int:
    """Progress steps of one mode at one size: its IPv4 points (direct: TCP and UDP; a proxy
    mode: four ClusterIP/NodePort/UDP points and podip), then a proxy mode's full sync, kernel
    state, update latency and burst, and ebpf's BPF cost."""
    return 2 if mode == "direct" else 10 if mode == "ebpf" else 9


def total_steps(config: BenchConfig, modes: list[str]) -> int:
    per_size = 1 + sum(mode_steps(m) for m in modes)
    if config.xdp_seconds > 0:
        per_size += sum(len(xdppps.VARIANTS.get(m, ())) for m in modes)
    return per_size * len(config.services)


class Bench:
    def __init__(self, config: BenchConfig, display: Display, results: Results) -> None:
        self.config = config
        self.ui = display
        self.results = results
        self.lab: Lab | None = None
        self.services: BenchServices | None = None
        self.binary: Path | None = None
        self.settings = traffic.Settings(config.duration, config.warmup, config.repeats, config.concurrency,
                                         client_threads=client_threads(config))
        self.map_args = agent_args(config)  # the ebpf agents' (iptables agents have neither maps nor fast path)

    # ---- helpers --------------------------------------------------------------------------------
    def _save(self) -> None:
        self.results.write(self.config.out_dir)

    def _point(self, raw: dict) -> None:
        """Keep a raw point; a failed one gets no summary row, and a failure entry saying why."""
        row = self.results.add_point(raw)
        where = f"{raw['metric']} {raw.get('path') or ''} {raw['mode']} {raw['services']}"
        for note in raw.get("notes", []):
            self.results.add_note(f"{where}: {note}")
        if row is None:
            problems = raw.get("problems", [])
            self.results.add_failure(raw["mode"], raw["metric"], raw["services"], raw.get("path"),
                                     "; ".join(problems))
            self.ui.note(f"FAILED {where}: {problems[0] if problems else ''}")
        else:
            self.ui.row(row)
        self._save()

    @contextlib.contextmanager
    def _guard(self, metric: str, mode: str, size: int, path: str | None = None) -> Iterator[None]:
        """A measurement that breaks is recorded as failed (with why) and the run goes on: one
        stuck point must not cost the figures of every other. The command then exits non-zero."""
        try:
            yield
        except MEASUREMENT_ERRORS as exc:
            self.results.add_failure(mode, metric, size, path, str(exc))
            self.ui.note(f"FAILED {metric} {path or ''} {mode} {size}: {exc}")
            self._save()

    def _agent_pids(self) -> dict[str, int]:
        return {node: entry["pid"] for node, entry in self.lab.data["agents"].items() if entry.get("pid")}

    # ---- the run ----------------------------------------------------------------------------------
    def run(self, modes: list[str]) -> None:
        self.binary = loadgen.build()
        lab, created = self._lab()
        self.lab = lab
        rest = Rest(lab.data["apiserver"]["url"])
        previous_mode = lab.mode
        try:
            self.services = BenchServices(rest, lab.topology, self.config.endpoints_per_service,
                                          threads=self.config.writers)
            if not created:
                self.services.remove_all()
            self.services.install_measured()
            traffic.prepare_clients(lab)
            for size in sorted(self.config.services):
                self.ui.step(f"{size:,} services: installing")
                stats = self.services.ensure_size(size)
                self.results.doc["installs"].append({"services": size, "created": stats.created,
                                                     "deleted": stats.deleted, "seconds": round(stats.seconds, 3),
                                                     **api_list_cost(rest, lab.data["apiserver"].get("pid"))})
                self.ui.advance()
                for mode in modes:
                    if self.results.doc["modes"].get(mode, {}).get("status") == "unavailable":
                        self.ui.advance(mode_steps(mode))
                        continue
                    if mode == "direct":
                        self._direct(size)
                    else:
                        self._proxy_mode(mode, size)
        finally:
            try:
                if created:
                    lab.down()
                else:
                    if self.services is not None:
                        self.services.remove_all()
                    lab.set_mode(previous_mode)
            finally:
                rest.close()

    def _lab(self) -> tuple[Lab, bool]:
        if self.config.lab_name:
            lab = Lab.load(self.config.lab_name)
            missing = [p for p in ("backend-1", "backend-2", traffic.CLIENT_POD) if p not in
                       {pod.name for pod in lab.topology.pods}]
            if missing or traffic.OUTSIDE not in {c.name for c in lab.topology.clients}:
                raise LabError(f"lab {lab.name!r} was not built from the bench topology ({TOPOLOGY}): "
                               f"missing {', '.join(missing) or traffic.OUTSIDE}")
            return lab, False
        name = f"bench-{secrets.token_hex(3)}"
        self.ui.step(f"building lab {name}")
        self.results.doc["parameters"]["lab"] = name
        return Lab.up(name, str(self.config.topology_path or TOPOLOGY), "none"), True

    # ---- direct ---------------------------------------------------------------------------------------
    def _direct(self, size: int) -> None:
        self.ui.step(f"{size:,} services, direct: agents off")
        self.lab.set_mode("none")
        for point in traffic.direct_points(self.lab.topology):
            self._measure_point(point, size)

    def _measure_point(self, point: traffic.Point, size: int) -> None:
        label = f"{size:,} services, {point.mode}: {point.metric} {point.path}"
        self.ui.step(label)
        with self._guard(point.metric, point.mode, size, point.path):
            result = traffic.measure(self.lab, point, self.settings, self.binary,
                                     on_run=lambda i, run: self.ui.detail(f"{label} (run {i + 1}: {run.rate:,.0f}/s)"))
            self._point(result.raw(size))
            cpu = result.cpu_point(size)
            if cpu is not None:
                self._point(cpu)
        self.ui.advance()

    # ---- a proxy mode -------------------------------------------------------------------------------
    def _proxy_mode(self, mode: str, size: int) -> None:
        cfg = self.config
        self.ui.step(f"{size:,} services, {mode}: starting agents")
        try:
            self.services.point_at_mode(mode)
            self._start_agents(mode)
            self.lab.wait_converged(timeout=cfg.sync_timeout)
        except LabError as exc:
            measured_before = any(p["mode"] == mode for p in self.results.doc["points"])
            if measured_before or mode in MUST_RUN:  # it ran (or must run) here: a failure at this size
                self.results.add_failure(mode, "agent_start", size, None, str(exc))
            else:  # never started on this machine: not available here, say why and move on
                self.results.set_mode_status(mode, "unavailable", f"the {mode} agents did not start: {exc}")
            self.ui.note(f"{mode}: agents did not start: {exc}")
            self.ui.advance(mode_steps(mode))
            self._save()
            return
        phases: dict[str, dict[str, dict[str, float]]] = {}

        # full sync: restarts of one agent
        self.ui.step(f"{size:,} services, {mode}: full sync")
        runs: list[dict] = []
        with self._guard("full_sync", mode, size):
            audited = controlplane.audit(self.lab, OBSERVED_NODE)  # as the running agent does each period
            for i in range(cfg.repeats):
                runs.append(controlplane.full_sync(self.lab, OBSERVED_NODE, mode, cfg.sync_timeout,
                                                   self._agent_args(mode)))
                self.ui.detail(f"{size:,} services, {mode}: full sync (run {i + 1}: {runs[-1]['seconds']:.2f} s)")
            self.lab.wait_converged(timeout=cfg.sync_timeout)
            self._point({"metric": "full_sync", "path": None, "mode": mode, "services": size, "unit": "s",
                         "node": OBSERVED_NODE, "values": [r["seconds"] for r in runs], "runs": runs,
                         "audit_before": audited})
            phases["full_sync"] = {OBSERVED_NODE: {"cpu_seconds": median([r["cpu_seconds"] for r in runs]),
                                                   "peak_rss_mib": max(r["peak_rss_mib"] for r in runs)}}
        self.ui.advance()
        if "full_sync" not in phases:  # the agent did not come back: nothing else here can be measured
            self.ui.advance(mode_steps(mode) - 1)
            return

        self.ui.step(f"{size:,} services, {mode}: kernel state")
        self._kernel_state(mode, size)
        self.ui.advance()

        if mode == "ebpf":
            with self._guard("bpf_ns_per_packet", mode, size):
                self._bpf_cost(size)
            self.ui.advance()

        meter = procstat.PhaseMeter(self._agent_pids())
        targets = measured_targets(self.services.measured, self.lab.topology, traffic.ENTRY_NODE)
        points = [*traffic.proxy_points(mode, targets), traffic.podip_point(self.lab.topology, mode)]
        for point in points:
            self._measure_point(point, size)
        if mode == "ebpf":
            with self._guard("bpf_ns_per_packet", mode, size, "load_tc_ingress"):
                self._live_cost(points[0], size)  # the ClusterIP connection load
        phases["datapath"] = meter.stop()
        if cfg.xdp_seconds > 0:
            self._xdp_pps(mode, size)

        observer = controlplane.Observer(self.lab, OBSERVED_NODE, mode)
        meter = procstat.PhaseMeter(self._agent_pids())
        with self._guard("update_latency", mode, size):
            self._update_latency(observer, size)
        phases["update"] = meter.stop()
        self.ui.advance()

        meter = procstat.PhaseMeter(self._agent_pids())
        with self._guard("burst_converge", mode, size):
            self._burst(observer, size)
            self.lab.wait_converged(timeout=cfg.sync_timeout)
        phases["burst"] = meter.stop()
        self.ui.advance()

        self._resources(mode, size, phases)

    def _xdp_pps(self, mode: str, size: int) -> None:
        """xdp_pps rows: each variant's agents (bench/xdppps.py), then this mode's agents back as
        they were, so the control-plane figures that follow are measured as always."""
        try:
            binary = xdppps.build()
            node_port = xdppps.install(self.services.rest, self.lab)
        except (xdppps.XdpPpsError, RestError) as exc:
            self.results.add_failure(mode, "xdp_pps", size, None, str(exc))
            return
        try:
            for variant in xdppps.VARIANTS.get(mode, ()):
                self.ui.step(f"{size:,} services, {mode}: xdp_pps {variant.name}")
                self.ui.advance()
                with self._guard("xdp_pps", mode, size, variant.name):
                    restart_agents(self.lab, mode, self.config.sync_timeout,
                                   [*self._agent_args(mode), *variant.agent_args])
                    runs = [xdppps.measure(self.lab, binary, variant, node_port, self.config.xdp_seconds)
                            for _ in range(self.config.repeats)]
                    self._point({"metric": "xdp_pps", "path": variant.name, "mode": mode, "services": size,
                                 "unit": "pps", "node": xdppps.TARGET_NODE, "values": [r["pps"] for r in runs],
                                 "runs": runs})
        finally:
            xdppps.remove(self.services.rest)
            restart_agents(self.lab, mode, self.config.sync_timeout, self._agent_args(mode))

    def _start_agents(self, mode: str) -> None:
        start_agents(self.lab, mode, self.config.sync_timeout, self._agent_args(mode))

    def _agent_args(self, mode: str) -> list[str]:
        return self.map_args if mode == "ebpf" else []

    def _kernel_state(self, mode: str, size: int) -> None:
        for node in self.lab.topology.nodes:
            try:
                counts = kernelstate.kernel_counts(self.lab, node.name, mode)
            except NotImplementedError as exc:
                self.results.add_unavailable(mode, "kernel_state", str(exc))
                return
            except kernelstate.KernelStateError as exc:
                self.results.add_failure(mode, "kernel_state", size, None, str(exc))
                return
            self.results.doc["kernel_state"].append({"mode": mode, "services": size, "node": node.name,
                                                     "counts": counts})
        self._save()

    def _bpf_cost(self, size: int) -> None:
        cfg = self.config
        label = f"{size:,} services, ebpf: BPF ns/packet"
        self.ui.step(label)
        # one map capacity for every size of the run: one build, so at most one compile
        capacity = max(cfg.services)
        runs = bpfcost.measure(size, endpoints=cfg.bpf_endpoints, samples=cfg.bpf_samples, repeats=cfg.repeats,
                               capacity=capacity, cache_dir=BPF_CACHE,
                               on_repeat=lambda r, ns: self.ui.detail(
                                   f"{label} (repeat {r + 1}: " + ", ".join(f"{p} {v:.0f}" for p, v in ns.items()) + ")"))
        for path, per_repeat in runs.items():
            self._point({"metric": "bpf_ns_per_packet", "path": path, "mode": "ebpf", "services": size, "unit": "ns",
                         "values": [r["median"] for r in per_repeat], "runs": per_repeat,
                         "endpoints_per_service": cfg.bpf_endpoints, "samples": cfg.bpf_samples})

    def _live_cost(self, point: traffic.Point, size: int) -> None:
        """The programs' mean run time on the node the load enters, under `point`'s load run again
        with BPF statistics on (livecost.py): the cross-check of _bpf_cost's crafted packets. A
        run of its own, so that no rate figure pays for the statistics."""
        node = traffic.ENTRY_NODE if point.source == traffic.OUTSIDE else self.lab.topology.pod(point.source).node
        label = f"{size:,} services, ebpf: BPF ns/run under {point.metric} {point.path} load ({node})"
        self.ui.step(label)
        live = livecost.LiveCost(kernelstate.bpffs_dir(self.lab, node) / PIN_SUBDIR)
        try:
            with livecost.statistics_on():
                samples = [live.sample()]
                result = traffic.measure(self.lab, point, self.settings, self.binary,
                                         on_run=lambda i, run: samples.append(live.sample()))
        finally:
            live.close()
        if result.failed:
            raise livecost.LiveCostError(f"the load run failed: {'; '.join(result.problems)}")
        per_run = [livecost.ns_per_run(a, b) for a, b in zip(samples, samples[1:])]
        for program in livecost.PROGRAMS:
            values = [r[program] for r in per_run]
            if any(v is None for v in values):
                raise livecost.LiveCostError(f"{program} on {node} did not run during a {point.path} load run")
            self._point({"metric": "bpf_ns_per_packet", "path": f"load_{program}", "mode": "ebpf", "services": size,
                         "unit": "ns", "values": [round(v, 1) for v in values if v is not None], "node": node,
                         "load": f"{point.metric} {point.path}",
                         "runs": [{"run_time_ns": b[program].run_time_ns - a[program].run_time_ns,
                                   "run_cnt": b[program].run_cnt - a[program].run_cnt}
                                  for a, b in zip(samples, samples[1:])]})

    def _update_latency(self, observer: controlplane.Observer, size: int) -> None:
        mode, cfg = observer.mode, self.config
        label = f"{size:,} services, {mode}: update latency"
        self.ui.step(label)
        repeats = []
        try:
            for r in range(cfg.repeats):
                samples = controlplane.update_latency(
                    self.services, observer, cfg.update_changes, cfg.change_timeout,
                    on_sample=lambda k, ms, r=r: self.ui.detail(
                        f"{label} (repeat {r + 1}, change {k + 1}: {ms:.0f} ms)"))
                repeats.append(samples)
        except NotImplementedError as exc:
            self.results.add_unavailable(mode, "update_latency", str(exc))
            self.ui.note(f"{mode} update latency: unavailable: {exc}")
            return
        ms = [[s["ms"] for s in rep] for rep in repeats]
        self._point({"metric": "update_latency", "path": None, "mode": mode, "services": size, "unit": "ms",
                     "node": observer.node, "values": [percentile(rep, 50) for rep in ms], "samples": ms,
                     "runs": repeats})

    def _burst(self, observer: controlplane.Observer, size: int) -> None:
        mode, cfg = observer.mode, self.config
        self.ui.step(f"{size:,} services, {mode}: burst of {cfg.burst_changes} changes")
        runs = []
        try:
            for r in range(cfg.repeats):
                runs.append(controlplane.burst(self.services, observer, cfg.burst_changes,
                                               cfg.sync_timeout, threads=cfg.writers))
                self.ui.detail(f"{size:,} services, {mode}: burst {r + 1}: {runs[-1]['seconds']:.2f} s")
                self.lab.wait_converged(timeout=cfg.sync_timeout)
        except NotImplementedError as exc:
            self.results.add_unavailable(mode, "burst_converge", str(exc))
            self.ui.note(f"{mode} burst: unavailable: {exc}")
            return
        self._point({"metric": "burst_converge", "path": None, "mode": mode, "services": size, "unit": "s",
                     "node": observer.node, "values": [r["seconds"] for r in runs], "runs": runs})

    def _resources(self, mode: str, size: int, phases: dict[str, dict[str, dict[str, float]]]) -> None:
        """Per phase and node in `resources`; one rss point whose values are the phases' peaks (the
        highest of any agent in that phase): an agent may grow after its first sync (e.g. when it
        compiles or loads programs), so the peak after the full sync alone would understate it."""
        for phase, nodes in phases.items():
            for node, usage in nodes.items():
                self.results.doc["resources"].append({"mode": mode, "services": size, "phase": phase,
                                                      "node": node, **usage})
        self._point({
            "metric": "rss", "path": None, "mode": mode, "services": size, "unit": "MiB",
            "values": [max(u["peak_rss_mib"] for u in nodes.values()) for nodes in phases.values()],
            "by_phase": {ph: max(u["peak_rss_mib"] for u in nodes.values()) for ph, nodes in phases.items()},
            "cpu_seconds_by_phase": {ph: round(sum(u["cpu_seconds"] for u in nodes.values()), 3)
                                     for ph, nodes in phases.items()},
        })


def restart_agents(lab: Lab, mode: str, timeout: float, agent_args: Sequence[str] = ()) -> None:
    """start_agents with `agent_args` (from a clean kernel: XDP's attach mode changes only so),
    then converged."""
    start_agents(lab, mode, timeout, agent_args)
    lab.wait_converged(timeout=timeout)


def start_agents(lab: Lab, mode: str, timeout: float, agent_args: Sequence[str] = ()) -> None:
    """Every node's agent in `mode`, from a clean kernel, waiting as long as a sync at this size
    takes. Lab.set_mode(mode) would wait only AGENT_READY_TIMEOUT (2 min), less than an agent needs to
    list and program 10,000 Services; so: mode none (stops the agents and removes every mode's
    kernel state), then start and wait here."""
    lab.set_mode("none")
    for node in lab.topology.nodes:
        lab.start_agent(node.name, mode, wait=False, extra_args=agent_args)
    for node in lab.topology.nodes:
        lab.wait_agent_ready(node.name, timeout=timeout)


def run_bench(config: BenchConfig, argv: list[str] | None = None,
              display_factory: Callable[[int], Display] = Display) -> tuple[dict, Path]:
    """Run the whole bench; returns (results document, report path). Files land in config.out_dir.
    `argv`: the command line after the program name, recorded in the results ("bench --quick")."""
    command = "ebpf-proxy " + shlex.join(argv if argv is not None else sys.argv[1:])
    results = Results(config.parameters(), command)
    modes = list(dict.fromkeys(config.modes))
    for mode in modes:
        reason = mode_unavailable_reason(mode)
        results.set_mode_status(mode, "unavailable" if reason else "ok", reason)
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, terminate)  # so `finally` removes the lab on SIGTERM too
    try:
        return _run(config, results, modes, started, display_factory)
    finally:
        signal.signal(signal.SIGTERM, previous)


def terminate(signum: int, _frame: Any) -> None:
    """SIGTERM as SystemExit, so a run's `finally` removes its lab (the soak installs it too)."""
    raise SystemExit(128 + signum)


def _run(config: BenchConfig, results: Results, modes: list[str], started: float,
         display_factory: Callable[[int], Display]) -> tuple[dict, Path]:
    with display_factory(total_steps(config, modes)) as ui:
        for mode, status in results.doc["modes"].items():
            if status["status"] != "ok":
                ui.note(f"mode {mode} skipped: {status['reason']}")
        bench = Bench(config, ui, results)
        try:
            bench.run(modes)
        finally:
            results.doc["parameters"]["wall_seconds"] = round(time.monotonic() - started, 1)
            results.finish()
            results.write(config.out_dir)
            report_path = report.write_report(results.doc, config.out_dir)
    for problem in check(results.doc):
        results.add_note(f"check: {problem}")
    if results.doc["notes"]:
        results.write(config.out_dir)
        report_path = report.write_report(results.doc, config.out_dir)
    return results.doc, report_path


def default_out_dir() -> Path:
    return Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")

