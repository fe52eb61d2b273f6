"""The bench's load generator: loadgen.c, compiled at run time with the system cc, run in a netns.

Why a purpose-built C client: the lab's echo server speaks its own protocol (a JSON line on
accept, then an echo), not HTTP, so wrk cannot drive it; and a Python client would measure
Python. The C source ships with the package and is compiled once (lab/cbuild.py).

`LoadResult` is the parsed output. Its rate and percentiles are what the bench reports; the
error counts and the per-pod answer counts are kept so that a figure can be checked (a point
whose connections mostly timed out is a broken point, not a slow one). `cpu_s` is the machine's
CPU time over the measured window (every CPU; the lab's nodes share one kernel), from which the
kernel's cost per operation is given (`kernel_us_per_op`).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ebpf_proxy.lab import cbuild, nsexec

SOURCE_NAME = "loadgen.c"
ERROR_KINDS = ("connect", "refused", "reset", "timeout", "eof", "bad_reply", "other")
LATENCY_KEYS = ("samples", "min", "mean", "p50", "p90", "p99", "p999", "max")


class LoadgenError(RuntimeError):
    pass


def build(cc: str | None = None, directory: Path | None = None) -> Path:
    """The compiled binary's path, compiling it if this source has not been compiled yet."""
    try:
        return cbuild.build("ebpf_proxy.bench", SOURCE_NAME, libs=("-lm", "-lpthread"), cc=cc, directory=directory)
    except cbuild.BuildError as exc:
        raise LoadgenError(str(exc)) from None


@dataclass(frozen=True)
class LoadSpec:
    """One load generator run: what to hit, how, for how long."""

    proto: str  # "tcp" | "udp"
    targets: tuple[str, ...]  # "IP:PORT", round-robin per new connection/flow
    duration: float
    warmup: float = 0.0
    concurrency: int = 16
    threads: int = 1  # each with its own epoll set and share of `concurrency`
    timeout_ms: int = 1000
    payload: str = "bench"

    def argv(self, binary: str | os.PathLike[str]) -> list[str]:
        if self.proto not in ("tcp", "udp"):
            raise ValueError(f"proto: {self.proto!r} is not tcp or udp")
        if not self.targets:
            raise ValueError("targets: at least one IP:PORT")
        argv = [str(binary), "--proto", self.proto, "--duration", f"{self.duration:g}",
                "--warmup", f"{self.warmup:g}", "--concurrency", str(self.concurrency),
                "--threads", str(self.threads),
                "--timeout-ms", str(self.timeout_ms), "--payload", self.payload]
        for target in self.targets:
            argv += ["--target", target]
        return argv

    @property
    def deadline(self) -> float:
        """Seconds after which the run is certainly stuck (the C program alarms itself earlier)."""
        return self.warmup + self.duration + 20


@dataclass(frozen=True)
class LoadResult:
    proto: str
    duration: float
    completed: int
    started: int
    rate: float  # completed operations per second of the measured window
    latency_us: dict[str, float]
    errors: dict[str, int]
    backends: dict[str, int]  # answers per pod name
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    # the machine's CPU seconds over the measured window: user, kernel (system + irq + softirq),
    # idle, and the load generator's own ("loadgen"), with "cpus" the machine's CPU count; None
    # where /proc/stat could not be read
    cpu_s: dict[str, float] | None = None

    @property
    def threads(self) -> int:
        """How many threads generated the load (1 for an older loadgen that did not say)."""
        return int(self.raw.get("threads", 1))

    @property
    def kernel_us_per_op(self) -> float | None:
        """Kernel CPU (every CPU's system + irq + softirq time) per completed operation, µs: what
        the network stack and the datapath spent on each connection or request, the servers' and
        the load generator's own system calls included (the same in every mode)."""
        if not self.cpu_s or not self.completed:
            return None
        return self.cpu_s["kernel"] * 1e6 / self.completed

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def latency_ms(self, key: str) -> float:
        return self.latency_us[key] / 1000.0

    def problems(self) -> list[str]:
        """Why this run's figure should not be trusted (empty if it can be)."""
        out = []
        if self.completed == 0:
            out.append(f"no {self.proto} operation completed ({self._error_text()})")
        elif self.error_count > 0.01 * (self.completed + self.error_count):
            out.append(f"{self.error_count} errors for {self.completed} completed ({self._error_text()})")
        return out

    def _error_text(self) -> str:
        errs = ", ".join(f"{k} {v}" for k, v in self.errors.items() if v)
        return errs or "no errors reported"


def parse_output(text: str) -> LoadResult:
    """The LoadResult in loadgen's stdout (one JSON object); LoadgenError naming what is wrong."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise LoadgenError("loadgen printed nothing")
    try:
        doc = json.loads(lines[-1])
    except ValueError as exc:
        raise LoadgenError(f"loadgen output is not JSON ({exc}): {lines[-1][:200]!r}") from None
    if not isinstance(doc, dict):
        raise LoadgenError(f"loadgen output is not a JSON object: {lines[-1][:200]!r}")
    try:
        latency = {k: float(doc["latency_us"][k]) for k in LATENCY_KEYS}
        errors = {k: int(doc["errors"][k]) for k in ERROR_KINDS}
        return LoadResult(
            proto=str(doc["proto"]), duration=float(doc["duration_s"]), completed=int(doc["completed"]),
            started=int(doc["started"]), rate=float(doc["rate"]), latency_us=latency, errors=errors,
            backends={str(k): int(v) for k, v in dict(doc["backends"]).items()}, raw=doc,
            cpu_s=_cpu(doc["cpu_s"]) if doc.get("cpu_s") else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise LoadgenError(f"loadgen output lacks or mangles {exc}: {lines[-1][:200]!r}") from None


def _cpu(doc: dict) -> dict[str, float]:
    """cpu_s: user, kernel and idle always; the machine's CPU count and the load generator's own
    CPU seconds when the program reports them."""
    out = {k: float(doc[k]) for k in ("user", "kernel", "idle")}
    out.update({k: float(doc[k]) for k in ("cpus", "loadgen") if k in doc})
    return out


def run(netns: str | None, spec: LoadSpec, binary: Path | None = None,
        cgroup: str | None = None) -> LoadResult:
    """Run one load generator inside `netns` (None: here) and return its parsed result."""
    binary = binary or build()
    try:
        done = nsexec.run(netns, spec.argv(binary), cgroup=cgroup, timeout=spec.deadline)
    except subprocess.TimeoutExpired:
        raise LoadgenError(f"loadgen in {netns} did not finish within {spec.deadline:.0f}s") from None
    if done.returncode != 0:
        raise LoadgenError(f"loadgen in {netns} exited {done.returncode}: {(done.stderr or '').strip()[:500]}")
    return parse_output(done.stdout)

