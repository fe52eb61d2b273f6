"""The soak: minutes of Service and endpoint churn at the API server's pace, with steady traffic
to a few stable Services, in each mode one after the other; then the claim "no connection
failed, and the kernel and the agent are back to where they were (no leak)" is checked.

Why a soak and not the bench: the bench times single changes and bursts on an otherwise quiet
cluster. What breaks in production after hours is different: a map entry or rule not removed
when a Service goes while its slice is being rewritten, an id never freed, a cache in the agent
that only grows, a sync that drops the stable Services' entries for a moment while it rewrites
others. Those show only as (a) a failed connection to a Service nobody touched, or (b) kernel
objects or agent memory above the baseline once the churn is gone.

Per mode, on a lab built from the bench topology (ebpf_proxy/bench/topology.yaml):

1. agents started from a clean kernel; the bench's measured Services (services.BenchServices)
   are the stable ones, pointed at the backend pods on this mode's ports;
2. baseline: each agent's RSS, and each node's datapath objects (kernelstate.kernel_counts);
3. churn for `duration` seconds: `writers` threads, each owning `slots_per_writer` Service
   names, create Services (a quarter NodePort) with hand-written EndpointSlices, rewrite the
   slices with 1..`max_endpoints` endpoints (scaling up and down), delete slice and Service;
   every successful write is one API change. Meanwhile a lab.prober.Prober opens fresh
   connections to the stable Services (ClusterIP from a pod, NodePort eTP=Cluster and Local from
   outside), and a sampler reads the datapath objects every `sample_period` for their peak;
4. the churned objects are deleted, the agents converge (they have programmed the API server's
   resourceVersion), the probes stop, and the connection table is given time to drain: closed
   TCP connections live 10 s (nf_conntrack's tcp_timeout_close, fixed in the datapath), then the
   agent's GC collects them in two passes (a connection, then its halves), one every
   `ct_gc_period` (the agents' --bpf-conntrack-gc-period, 10 s unless the soak sets it);
5. after: RSS and datapath objects again. The peak RSS is the kernel's high-water mark (VmHWM,
   reset at the baseline), so no sample can miss it.

The churned endpoints are phantom addresses (198.18.0.0/15, the benchmarking range): they are
real entries in the datapath, and nothing connects to them.
"""

from __future__ import annotations

import ipaddress
import random
import secrets
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ebpf_proxy.bench import kernelstate, procstat, traffic
from ebpf_proxy.bench.rest import Rest, RestError
from ebpf_proxy.bench.runner import TOPOLOGY, start_agents, terminate
from ebpf_proxy.bench.services import (NAMESPACE, ROLE_LABEL, BenchServices, measured_targets, range_address,
                                       service_object, slice_object)
from ebpf_proxy.lab.cluster import Lab, LabError
from ebpf_proxy.lab.prober import Prober

CHURN_ROLE = "soak-churn"
CHURN_PREFIX = "soak-c"
SOAK_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
CHURN_PORT = 7100  # nothing listens: nobody connects to churned endpoints
RSS_BOUND_MIB = 30.0  # "after" within this of the baseline: RSS is noisy (allocator, GC timing)

# What the table reports per mode: (label, counts key). Exact ones must be back to baseline;
# the connection table must be back at or below it once closed connections are collected.
EXACT_OBJECTS = {
    "iptables": [("iptables rules", "iptables_rules"), ("iptables chains", "iptables_chains")],
    "ebpf": [("services (epx_svc)", "bpf_entries_epx_svc"), ("backends (epx_backend)", "bpf_entries_epx_backend"),
             ("backend slots (epx_slot)", "bpf_entries_epx_slot")],
}
DRAINING_OBJECTS = {"iptables": [], "ebpf": [("connections (epx_ct4)", "bpf_entries_epx_ct4")]}


class SoakError(RuntimeError):
    pass


@dataclass
class SoakConfig:
    modes: list[str]
    duration: float  # seconds of churn per mode
    writers: int = 4
    slots_per_writer: int = 25  # churned Service names per writer: at most writers × this exist at once
    max_endpoints: int = 8
    max_rate: float = 0.0  # API changes per second over all writers; 0: as fast as the server takes them
    sample_period: float = 2.0
    probe_timeout: float = 3.0
    converge_timeout: float = 120.0
    drain_timeout: float = 90.0
    # the ebpf agents' --bpf-conntrack-gc-period, seconds (None: the agent's default, 10 s): how
    # soon the collector passes that bring the connection table back to its baseline come
    ct_gc_period: float | None = None
    lab_name: str | None = None  # default: sk<random>, built and removed here

    def parameters(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModeResult:
    mode: str
    duration_s: float = 0.0
    changes: int = 0
    api_errors: int = 0
    api_error_samples: list[str] = field(default_factory=list)
    probes_ok: int = 0
    probes_failed: int = 0
    failures: list[str] = field(default_factory=list)
    rss_mib: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> baseline/peak/after
    objects: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # node -> label -> b/p/a
    drained_s: float | None = None
    error: str | None = None

    @property
    def rate(self) -> float:
        return self.changes / self.duration_s if self.duration_s else 0.0

    def problems(self) -> list[str]:
        """Every way this mode's run breaks the soak's claim, each naming what is at fault."""
        out = []
        if self.error:
            out.append(f"{self.mode}: the soak did not complete: {self.error}")
        if self.probes_failed:
            out.append(f"{self.mode}: {self.probes_failed} connections to stable Services failed, first: "
                       + "; ".join(self.failures[:3]))
        if not self.error and self.probes_ok == 0:
            out.append(f"{self.mode}: no connection to a stable Service succeeded: the traffic did not run")
        if self.api_errors:
            out.append(f"{self.mode}: {self.api_errors} API writes failed, first: "
                       + "; ".join(self.api_error_samples[:3]))
        exact = {label for label, _ in EXACT_OBJECTS.get(self.mode, [])}
        for node, objects in self.objects.items():
            for label, v in objects.items():
                if label in exact and v["after"] != v["baseline"]:
                    out.append(f"{self.mode} {node}: {label} {v['after']} after the churn, {v['baseline']} before")
                elif label not in exact and v["after"] > v["baseline"]:
                    out.append(f"{self.mode} {node}: {label} {v['after']} after the churn, {v['baseline']} before "
                               f"(not collected within the drain time)")
        for node, rss in self.rss_mib.items():
            if rss["after"] > rss["baseline"] + RSS_BOUND_MIB:
                out.append(f"{self.mode} {node}: agent RSS {rss['after']:.1f} MiB after, {rss['baseline']:.1f} MiB "
                           f"before (bound: baseline + {RSS_BOUND_MIB:.0f} MiB)")
        return out


# ---- churn -----------------------------------------------------------------------------------------

class Churn:
    """Writers creating, scaling and deleting Services and their slices until stopped.

    Each writer owns its Service names (`soak-c<writer>-<slot>`), so no two writers touch one
    object and every write is expected to succeed: a failed write is an API error, recorded with
    the object it was for. A shared token bucket caps the total rate when `max_rate` is set."""

    def __init__(self, rest: Rest, nodes: list[str], config: SoakConfig, seed: int = 0) -> None:
        self.rest = rest
        self.nodes = nodes
        self.config = config
        self.changes = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seed = seed
        self._threads = [threading.Thread(target=self._writer, args=(w,), daemon=True, name=f"churn-{w}")
                         for w in range(config.writers)]
        self._next_slot_time = time.monotonic()

    def _addresses(self, count: int) -> list[str]:
        with self._lock:
            seq, self._seq = self._seq, self._seq + count
        hosts = SOAK_RANGE.num_addresses - 2
        return [range_address(SOAK_RANGE, (seq + k) % hosts) for k in range(count)]  # reuse is harmless here

    def _pace(self) -> None:
        if self.config.max_rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(self._next_slot_time, now)
            self._next_slot_time = slot + 1.0 / self.config.max_rate
        if slot > now:
            time.sleep(slot - now)

    def _write(self, what: str, fn: Callable[[], Any]) -> bool:
        self._pace()
        try:
            fn()
        except (RestError, OSError) as exc:
            with self._lock:
                self.errors += 1
                if len(self.error_samples) < 20:
                    self.error_samples.append(f"{what}: {exc}")
            return False
        with self._lock:
            self.changes += 1
        return True

    def _slice(self, name: str, rng: random.Random) -> dict:
        count = rng.randint(1, self.config.max_endpoints)
        endpoints = [(ip, self.nodes[k % len(self.nodes)]) for k, ip in enumerate(self._addresses(count))]
        return slice_object(name, CHURN_ROLE, endpoints, CHURN_PORT)

    def _writer(self, w: int) -> None:
        rng = random.Random(self._seed * 1000 + w)
        live: dict[str, bool] = {f"{CHURN_PREFIX}{w}-{i}": False for i in range(self.config.slots_per_writer)}
        names = list(live)
        created = 0
        while not self._stop.is_set():
            name = rng.choice(names)
            if not live[name]:
                svc_type = "NodePort" if created % 4 == 3 else "ClusterIP"
                created += 1
                if self._write(f"create Service {NAMESPACE}/{name}",
                               lambda: self.rest.create(service_object(name, CHURN_ROLE, svc_type=svc_type))):
                    live[name] = True
                    self._write(f"create EndpointSlice {NAMESPACE}/{name}-bench",
                                lambda: self.rest.create(self._slice(name, rng)))
            elif rng.random() < 0.75:
                self._write(f"update EndpointSlice {NAMESPACE}/{name}-bench",
                            lambda: self.rest.replace(self._slice(name, rng)))
            else:
                self._write(f"delete EndpointSlice {NAMESPACE}/{name}-bench",
                            lambda: self.rest.delete("EndpointSlice", f"{name}-bench", NAMESPACE))
                self._write(f"delete Service {NAMESPACE}/{name}",
                            lambda: self.rest.delete("Service", name, NAMESPACE))
                live[name] = False

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def remove_all(self) -> int:
        """Delete every churned object; returns how many are still listed afterwards (must be 0)."""
        selector = f"{ROLE_LABEL}={CHURN_ROLE}"
        for kind in ("EndpointSlice", "Service"):
            self.rest.delete_by_label(kind, selector, NAMESPACE)
        return sum(len(self.rest.list(kind, NAMESPACE, selector)) for kind in ("EndpointSlice", "Service"))


# ---- datapath objects ----------------------------------------------------------------------------

def object_counts(lab: Lab, node: str, mode: str) -> dict[str, int]:
    """The soak's datapath objects on `node` (label -> count): the table's rows for `mode`."""
    counts = kernelstate.kernel_counts(lab, node, mode)
    if mode == "iptables":  # summed over the tables the agent writes (nat, filter)
        counts["iptables_rules"] = sum(v for k, v in counts.items() if k.startswith("iptables_rules_"))
        counts["iptables_chains"] = sum(v for k, v in counts.items() if k.startswith("iptables_chains_"))
    out = {}
    for label, key in EXACT_OBJECTS[mode] + DRAINING_OBJECTS[mode]:
        if key not in counts:
            raise SoakError(f"{mode} on {node}: the kernel state has no {key!r} (have: {', '.join(sorted(counts))})")
        out[label] = counts[key]
    return out


class Sampler:
    """Reads every node's datapath objects every `period` seconds and keeps each one's peak."""

    def __init__(self, lab: Lab, mode: str, period: float) -> None:
        self.lab, self.mode, self.period = lab, mode, period
        self.peak: dict[str, dict[str, int]] = {}
        self.samples = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-sampler")

    def take(self) -> dict[str, dict[str, int]]:
        now = {n.name: object_counts(self.lab, n.name, self.mode) for n in self.lab.topology.nodes}
        for node, counts in now.items():
            peak = self.peak.setdefault(node, {})
            for label, v in counts.items():
                peak[label] = max(peak.get(label, 0), v)
        self.samples += 1
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.take()
            except (kernelstate.KernelStateError, SoakError, OSError) as exc:
                self.error = str(exc)  # reported; the soak's own before/after reads still decide
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# ---- one mode ---------------------------------------------------------------------------------------

def stable_targets(services: BenchServices, lab: Lab) -> list[tuple[str, str]]:
    """(where, IP:PORT) of the stable Services: the bench's ClusterIP from its client pod, and its
    NodePorts (eTP Cluster and Local) from outside through the entry node."""
    targets = measured_targets(services.measured, lab.topology, traffic.ENTRY_NODE)
    return [(traffic.CLIENT_POD, targets["clusterip"]), (traffic.OUTSIDE, targets["nodeport-cluster"]),
            (traffic.OUTSIDE, targets["nodeport-local"])]


def agent_args(mode: str, config: SoakConfig) -> list[str]:
    """The agents' options for `mode`: the ebpf agents' GC period when the soak sets one, else none
    (every agent setting at its default, as deployed)."""
    if mode == "ebpf" and config.ct_gc_period is not None:
        return ["--bpf-conntrack-gc-period", f"{config.ct_gc_period:g}s"]
    return []


def _agent_pids(lab: Lab) -> dict[str, int]:
    return {node: entry["pid"] for node, entry in lab.data["agents"].items() if entry.get("pid")}


def run_mode(lab: Lab, services: BenchServices, mode: str, config: SoakConfig,
             say: Callable[[str], None] = print) -> ModeResult:
    """One mode's soak, steps 1-5 of the module docstring. A broken claim is recorded in the
    result (see ModeResult.problems); what stops the run itself (a stable Service that does not
    answer before any churn, churned objects the API server keeps) raises SoakError naming it."""
    result = ModeResult(mode)
    say(f"[{mode}] starting agents")
    services.point_at_mode(mode)
    start_agents(lab, mode, config.converge_timeout, agent_args(mode, config))
    lab.wait_converged(timeout=config.converge_timeout)
    # the baseline before any traffic: the connection table holds none of the probes' connections
    pids = _agent_pids(lab)
    sampler = Sampler(lab, mode, config.sample_period)
    baseline = sampler.take()
    rss_base = {node: procstat.read(pid).rss_mib for node, pid in pids.items()}
    for pid in pids.values():
        procstat.reset_peak(pid)
    say(f"[{mode}] baseline: RSS {_fmt_nodes(rss_base)} MiB; {baseline}")
    targets = stable_targets(services, lab)
    for where, target in targets:  # the stable Services work before anything is asked of them
        report = lab.probe(where, target, timeout=config.probe_timeout)
        if not report.all_ok:
            raise SoakError(f"[{mode}] stable Service {target} from {where} does not answer before the churn: "
                            f"{report.summary}")

    churn = Churn(services.rest, [n.name for n in lab.topology.nodes], config, seed=len(mode))
    prober = Prober(lab, targets, timeout=config.probe_timeout)
    prober.start()
    try:
        sampler.start()
        started = time.monotonic()
        churn.start()
        try:
            next_say = started + 60
            while (left := started + config.duration - time.monotonic()) > 0:
                time.sleep(min(left, 1.0))
                if time.monotonic() >= next_say:
                    next_say += 60
                    ok, failed = prober.counts()
                    say(f"[{mode}] {time.monotonic() - started:.0f}s: {churn.changes} changes, "
                        f"{ok} connections ok, {failed} failed")
        finally:
            churn.stop()
            result.duration_s = time.monotonic() - started
        remaining = churn.remove_all()
        if remaining:
            raise SoakError(f"[{mode}] {remaining} churned objects still listed after deleting them")
        lab.wait_converged(timeout=config.converge_timeout)
        sampler.stop()
    finally:
        prober.stop()
        sampler.stop()
    result.changes, result.api_errors, result.api_error_samples = churn.changes, churn.errors, churn.error_samples
    result.probes_ok, result.probes_failed, result.failures = prober.ok, prober.failed_count, prober.failed
    if sampler.error:
        say(f"[{mode}] sampler stopped early: {sampler.error}")

    # the connection table: closed connections expire, then the agent's GC collects them
    say(f"[{mode}] churn over: {churn.changes} changes in {result.duration_s:.0f}s; waiting for the kernel to drain")
    drain_start = time.monotonic()
    while True:
        after = {n: object_counts(lab, n, mode) for n in baseline}
        draining = [label for label, _ in DRAINING_OBJECTS[mode]]
        if all(after[n][lb] <= baseline[n][lb] for n in baseline for lb in draining):
            result.drained_s = round(time.monotonic() - drain_start, 1)
            break
        if time.monotonic() - drain_start > config.drain_timeout:
            break
        time.sleep(1.0)
    # VmHWM since the baseline's reset covers the churn and the drain: never below "after"
    usage_after = {node: procstat.read(pid) for node, pid in pids.items()}
    for node, usage in usage_after.items():
        result.rss_mib[node] = {"baseline": round(rss_base[node], 1), "peak": round(usage.peak_rss_mib, 1),
                                "after": round(usage.rss_mib, 1)}
    for node in baseline:
        result.objects[node] = {label: {"baseline": baseline[node][label],
                                        "peak": max(sampler.peak[node][label], after[node][label]),
                                        "after": after[node][label]}
                                for label in baseline[node]}
    return result


def _fmt_nodes(values: dict[str, float]) -> str:
    return ", ".join(f"{node} {v:.1f}" for node, v in sorted(values.items()))


# ---- the run ------------------------------------------------------------------------------------------

def run_soak(config: SoakConfig, say: Callable[[str], None] = print) -> list[ModeResult]:
    """Every mode of `config` in turn on one lab (built here, removed at the end whatever happens).
    A mode that breaks is recorded with its error and the next mode still runs."""
    name = config.lab_name or f"sk{secrets.token_hex(3)}"
    say(f"building lab {name}")
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if in_main else None  # so `finally` removes the lab
    try:
        return _run_soak(config, name, say)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _run_soak(config: SoakConfig, name: str, say: Callable[[str], None]) -> list[ModeResult]:
    lab = Lab.up(name, str(TOPOLOGY), "none")
    results: list[ModeResult] = []
    rest = Rest(lab.data["apiserver"]["url"])
    try:
        services = BenchServices(rest, lab.topology)
        services.install_measured()
        for mode in config.modes:
            try:
                results.append(run_mode(lab, services, mode, config, say))
            except (SoakError, LabError, RestError, kernelstate.KernelStateError, OSError) as exc:
                say(f"[{mode}] FAILED: {exc}")
                results.append(ModeResult(mode, error=str(exc)))
                try:  # the next mode starts from no churned objects
                    Churn(rest, [], config).remove_all()
                except (RestError, OSError) as cleanup_exc:
                    say(f"[{mode}] could not delete the churned objects: {cleanup_exc}")
    finally:
        rest.close()
        lab.down()
    return results


# ---- the table -----------------------------------------------------------------------------------------

def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


def table(results: list[ModeResult]) -> str:
    """The soak's figures as Markdown: one summary row per mode, then each node's datapath objects."""
    lines = ["| mode | duration | API changes (rate) | stable connections ok / failed | "
             "agent RSS MiB, baseline / peak / after (per node) | result |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.error:
            lines.append(f"| {r.mode} | – | – | – | – | did not complete: {r.error} |")
            continue
        rss = "; ".join(f"{n}: {v['baseline']:.1f} / {v['peak']:.1f} / {v['after']:.1f}"
                        for n, v in sorted(r.rss_mib.items()))
        verdict = "ok" if not r.problems() else "FAILED"
        lines.append(f"| {r.mode} | {_minutes(r.duration_s)} | {r.changes:,} ({r.rate:,.0f}/s"
                     f"{f', {r.api_errors} errors' if r.api_errors else ''}) | {r.probes_ok:,} / {r.probes_failed} "
                     f"| {rss} | {verdict} |")
    lines += ["", "| mode | node | datapath objects | baseline | peak | after | back to baseline |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for node, objects in sorted(r.objects.items()):
            for label, v in objects.items():
                back = "yes" if v["after"] <= v["baseline"] and (
                    v["after"] == v["baseline"] or label in dict(DRAINING_OBJECTS[r.mode])) else "NO"
                if label in dict(DRAINING_OBJECTS[r.mode]) and r.drained_s is not None:
                    back += f" (drained {r.drained_s:.0f} s after the churn)"
                lines.append(f"| {r.mode} | {node} | {label} | {v['baseline']:,} | {v['peak']:,} | {v['after']:,} "
                             f"| {back} |")
    return "\n".join(lines)


def problems(results: list[ModeResult]) -> list[str]:
    return [p for r in results for p in r.problems()]


def write_json(results: list[ModeResult], config: SoakConfig, path: Path) -> None:
    import json

    doc = {"parameters": config.parameters(),
           "modes": [{**asdict(r), "rate": round(r.rate, 1), "problems": r.problems()} for r in results]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
