"""Whether a load run measured the proxy, or ran into a CPU limit first.

A rate is the proxy's figure only if nothing else was saturated. Three things can be, on the
bench's lab: the load generator (busy about one core-second per second per thread, it could not
offer more), an echo server (the Python server is one thread: the same; the native one has one
thread per CPU, so its limit is that many cores, and on the bench's machine the machine's own
limit comes first), or the whole machine (every CPU busy: the nodes, pods and clients all share
it). Each run's limits are recorded beside its figures, and the report names the runs that hit
one, so that a figure set by the echo server is not read as the datapath's.
"""

from __future__ import annotations

import time
from typing import Any

from ebpf_proxy.bench import procstat
from ebpf_proxy.bench.loadgen import LoadResult
from ebpf_proxy.lab.cluster import Lab

BUSY_CORES = 0.9  # a process this busy per thread (core-seconds per second) was the bottleneck
IDLE_FLOOR = 0.05  # under 5 % of the machine's CPU time idle: the machine was


def server_pids(lab: Lab, pods: list[str]) -> dict[str, int]:
    """The echo server of each of `pods` (the lab records their pids), those that have one."""
    known = lab.data.get("pods", {})
    return {pod: known[pod]["pid"] for pod in pods if known.get(pod, {}).get("pid")}


def server_threads(lab: Lab, pods: list[str]) -> dict[str, int]:
    """How many threads serve each of `pods` (1: the Python server, or a lab from before
    the lab recorded it)."""
    known = lab.data.get("pods", {})
    return {pod: int(known.get(pod, {}).get("threads") or 1) for pod in pods}


class ServerMeter:
    """CPU cores each server used over a stretch of wall time (utime + stime per second)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.start_time = time.monotonic()
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for pod, pid in self.pids.items():
            try:
                out[pod] = procstat.read(pid).cpu_seconds
            except OSError:  # the server is gone: the run's errors will say so
                pass
        return out

    def stop(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.start_time, 1e-9)
        end = self._read()
        return {pod: round((end[pod] - self.start[pod]) / wall, 3) for pod in end if pod in self.start}


def run_limits(run: LoadResult, server_cores: dict[str, float],
               server_threads: dict[str, int] | None = None) -> dict[str, Any]:
    """What each side used during `run`, and `limited_by`: every one that hit its limit (a
    server with N threads at N × BUSY_CORES; one thread where `server_threads` does not say)."""
    out: dict[str, Any] = {"server_cores": dict(server_cores), "client_cores": None, "machine_idle": None}
    threads = server_threads or {}
    limited = [f"server {pod} ({cores:.2f} cores)" for pod, cores in sorted(server_cores.items())
               if cores >= BUSY_CORES * threads.get(pod, 1)]
    cpu = run.cpu_s
    if cpu and run.duration > 0:
        if "loadgen" in cpu:
            out["client_cores"] = round(cpu["loadgen"] / run.duration, 3)
            if out["client_cores"] >= BUSY_CORES * run.threads:
                limited.insert(0, f"client ({out['client_cores']:.2f} cores)")
        total = cpu["user"] + cpu["kernel"] + cpu["idle"]
        if total > 0:
            out["machine_idle"] = round(cpu["idle"] / total, 3)
            if out["machine_idle"] < IDLE_FLOOR:
                limited.append(f"machine ({out['machine_idle']:.0%} idle)")
    out["limited_by"] = limited
    return out
