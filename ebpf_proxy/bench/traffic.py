"""Data path points: new TCP connections/s with request latency, and UDP request/response rate.

A point is one (mode, path, protocol) at one size: the load generator runs inside the source's
netns (a pod, or the client outside the cluster) against the path's address, `repeats` times,
the first run after a warm-up. Before each point the nodes' connection tables (the kernel's
conntrack, and ebpf mode's epx_ct4) are flushed, so a point never pays for the entries an earlier
one left (shared/PLATFORM.md pitfall 6).

Clients open many short connections, so their namespaces get the whole ephemeral port range and
TIME_WAIT reuse (per-netns sysctls, set on the lab's own namespaces only): without it a few
seconds at 10k conn/s would exhaust the default 28k ports and measure port exhaustion instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ebpf_proxy.bench import limits, loadgen, ports
from ebpf_proxy.bench.loadgen import LoadResult, LoadSpec
from ebpf_proxy.lab import nsexec
from ebpf_proxy.lab.cluster import Lab
from ebpf_proxy.lab.topology import PodSpec, Topology

CLIENT_POD = "client-1"
OUTSIDE = "outside"
ENTRY_NODE = "worker1"  # where the outside client's NodePort traffic enters
CLIENT_SYSCTLS = {"net.ipv4.ip_local_port_range": "1024 65535", "net.ipv4.tcp_tw_reuse": "1"}


@dataclass(frozen=True)
class Point:
    metric: str  # "conn_rate" | "udp_rate"
    path: str  # "clusterip" | "nodeport-cluster" | "nodeport-local" | "direct"
    mode: str
    source: str  # the lab place the load generator runs in
    targets: tuple[str, ...]

    @property
    def proto(self) -> str:
        return "tcp" if self.metric == "conn_rate" else "udp"


@dataclass(frozen=True)
class Settings:
    duration: float
    warmup: float
    repeats: int
    concurrency: int = 16
    timeout_ms: int = 1000
    client_threads: int = 1  # load generator threads, sharing `concurrency`


@dataclass
class PointResult:
    point: Point
    runs: list[LoadResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # runs that cannot be trusted: the point failed
    notes: list[str] = field(default_factory=list)
    cpu_limits: list[dict[str, Any]] = field(default_factory=list)  # per run: limits.run_limits

    @property
    def failed(self) -> bool:
        return bool(self.problems)

    def raw(self, services: int) -> dict[str, Any]:
        """The point as results.json keeps it: every run's full output, plus per-repeat figures."""
        p = self.point
        return {
            "metric": p.metric, "path": p.path, "mode": p.mode, "services": services, "proto": p.proto,
            "source": p.source, "targets": list(p.targets),
            "unit": "conn/s" if p.metric == "conn_rate" else "req/s",
            "values": [round(r.rate, 3) for r in self.runs],
            "latency_ms": {k: [round(r.latency_ms(k), 3) for r in self.runs] for k in ("p50", "p90", "p99")},
            "backends": _merge_backends(self.runs),
            "runs": [r.raw for r in self.runs],
            "problems": list(self.problems), "notes": list(self.notes), "failed": self.failed,
            "limits": list(self.cpu_limits),
        }

    def cpu_point(self, services: int) -> dict[str, Any] | None:
        """The kernel CPU each operation cost (LoadResult.kernel_us_per_op), one value per run, as
        results.json keeps it: `cpu_per_conn` for TCP, `cpu_per_req` for UDP. None when a run has
        no CPU figure (no /proc/stat) or the point failed."""
        per_op = [r.kernel_us_per_op for r in self.runs]
        if self.failed or not per_op or any(v is None for v in per_op):
            return None
        p = self.point
        tcp = p.metric == "conn_rate"
        return {
            "metric": "cpu_per_conn" if tcp else "cpu_per_req", "path": p.path, "mode": p.mode,
            "services": services, "proto": p.proto, "unit": "µs/conn" if tcp else "µs/req",
            "values": [round(v, 3) for v in per_op if v is not None],
            "cpu_s": [r.cpu_s for r in self.runs], "completed": [r.completed for r in self.runs],
        }


def _merge_backends(runs: list[LoadResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for run in runs:
        for pod, n in run.backends.items():
            out[pod] = out.get(pod, 0) + n
    return out


def _backends(topology: Topology) -> list[PodSpec]:
    return [p for p in sorted(topology.pods, key=lambda p: p.name) if p.labels.get("app") == "bench-backend"]


def backend_addresses(topology: Topology, family: int = 4) -> list[str]:
    """The backend pods' addresses of `family` ([] when they have none of it)."""
    return [ip for p in _backends(topology) for ip in p.ips if (":" in ip) == (family == 6)]


def backend_pods(topology: Topology) -> list[str]:
    return [p.name for p in _backends(topology)]


def direct_points(topology: Topology) -> list[Point]:
    """The physical-limit baseline: the client pod straight to both backend pod IPs."""
    ips = backend_addresses(topology)
    tcp = tuple(f"{ip}:{ports.tcp_port('direct', ports.DIRECT)}" for ip in ips)
    udp = tuple(f"{ip}:{ports.udp_port('direct')}" for ip in ips)
    points = [Point("conn_rate", ports.DIRECT, "direct", CLIENT_POD, tcp),
              Point("udp_rate", ports.DIRECT, "direct", CLIENT_POD, udp)]
    ips6 = backend_addresses(topology, 6)
    if ips6 and len(ips6) == len(ips):  # a dual-stack topology: the IPv6 baseline too
        points.append(Point("conn_rate", ports.DIRECT6, "direct", CLIENT_POD,
                            tuple(f"[{ip}]:{ports.tcp_port('direct', ports.DIRECT6)}" for ip in ips6)))
    return points


def podip_point(topology: Topology, mode: str) -> Point:
    """`direct`'s traffic (the client pod straight to both backend pod IPs) with `mode`'s agents
    on: no Service translates it, so what it loses against `direct` is what the mode costs every
    pod's traffic. kube-proxy's iptables mode walks KUBE-SERVICES, one rule per Service port, for
    each new connection on every node it crosses (nat PREROUTING); the ebpf programs look it up in
    a few maps."""
    port = ports.tcp_port(mode, ports.PODIP)
    return Point("conn_rate", ports.PODIP, mode, CLIENT_POD,
                 tuple(f"{ip}:{port}" for ip in backend_addresses(topology)))


def proxy_points(mode: str, targets: dict[str, str]) -> list[Point]:
    """`targets` from services.measured_targets: path -> VIP or node:nodePort."""
    return [
        Point("conn_rate", "clusterip", mode, CLIENT_POD, (targets["clusterip"],)),
        Point("conn_rate", "nodeport-cluster", mode, OUTSIDE, (targets["nodeport-cluster"],)),
        Point("conn_rate", "nodeport-local", mode, OUTSIDE, (targets["nodeport-local"],)),
        Point("udp_rate", "clusterip", mode, CLIENT_POD, (targets["udp"],)),
    ] + ([Point("conn_rate", "clusterip6", mode, CLIENT_POD, (targets["clusterip6"],))] if "clusterip6" in targets else [])


def prepare_clients(lab: Lab) -> None:
    for where in (CLIENT_POD, OUTSIDE):
        for key, value in CLIENT_SYSCTLS.items():
            nsexec.run(lab.netns_of(where), ["sysctl", "-q", "-w", f"{key}={value}"], check=True)


def measure(lab: Lab, point: Point, settings: Settings, binary: Path,
            on_run: Callable[[int, LoadResult], None] | None = None) -> PointResult:
    """Run the point: connection tables flushed, warm-up, then `settings.repeats` measured runs.

    A run with more than 1% of its operations failing (timeouts, resets, refusals) makes the point
    failed: such a rate measures a broken path, not a fast or slow one."""
    result = PointResult(point)
    if not lab.flush_connections():
        result.notes.append("conntrack not installed: the kernel's conntrack tables not flushed between points")
    netns = lab.netns_of(point.source)
    backends = backend_pods(lab.topology)
    servers, threads = limits.server_pids(lab, backends), limits.server_threads(lab, backends)
    for i in range(settings.repeats):
        spec = LoadSpec(point.proto, point.targets, settings.duration,
                        warmup=settings.warmup if i == 0 else min(settings.warmup, 0.25),
                        concurrency=settings.concurrency, threads=settings.client_threads,
                        timeout_ms=settings.timeout_ms)
        meter = limits.ServerMeter(servers)
        run = loadgen.run(netns, spec, binary)
        result.cpu_limits.append(limits.run_limits(run, meter.stop(), threads))
        result.runs.append(run)
        result.problems.extend(f"run {i + 1}: {p}" for p in run.problems())
        if on_run:
            on_run(i, run)
    return result
