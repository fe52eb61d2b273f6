"""What the eBPF programs cost per run under the bench's real load: the kernel's own counters.

bpfcost.py times tc_ingress on crafted packets with BPF_PROG_TEST_RUN, over private maps. This is
the cross-check under load: while BPF statistics are on (libbpf.enable_stats: held by an fd, so
they stop by themselves when the bench ends or dies), the kernel adds each run's nanoseconds to
the program's run_time_ns and counts it in run_cnt. Reading both from a node's pinned programs
before and after a load run gives the mean cost of every run the load caused: SYNs, ACKs, data,
replies, FINs; every packet the node's devices saw, each one run of its hook.

The figures include the statistics' own cost (two clock reads per run), as bpftool prog's do.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf.loader import PROGS_SUBDIR

PROGRAMS = ("tc_ingress", "tc_egress")  # the hooks every Service packet of a node runs through


class LiveCostError(RuntimeError):
    pass


@dataclass(frozen=True)
class Sample:
    run_time_ns: int
    run_cnt: int


def program_pins(pin_dir: Path, names: tuple[str, ...] = PROGRAMS) -> dict[str, Path]:
    """The pinned programs `names` of the build loaded in `pin_dir` (<bpffs>/ebpf-proxy): the
    loader keeps one build's programs under progs/<build>/."""
    builds = sorted((pin_dir / PROGS_SUBDIR).glob("*/")) if (pin_dir / PROGS_SUBDIR).is_dir() else []
    found = {name: build / name for build in builds for name in names if (build / name).exists()}
    missing = [n for n in names if n not in found]
    if missing:
        raise LiveCostError(f"{pin_dir / PROGS_SUBDIR}: no pinned program {', '.join(missing)}")
    return found


class LiveCost:
    """A node's programs, opened from their pins; `sample()` reads their counters."""

    def __init__(self, pin_dir: Path, names: tuple[str, ...] = PROGRAMS) -> None:
        self.fds: dict[str, int] = {}
        try:
            for name, path in program_pins(pin_dir, names).items():
                self.fds[name] = libbpf.obj_get(str(path))
        except OSError as exc:
            self.close()
            raise LiveCostError(f"{pin_dir}: cannot open the pinned programs: {exc}") from exc

    def sample(self) -> dict[str, Sample]:
        return {name: Sample(*libbpf.prog_run_stats(fd)) for name, fd in self.fds.items()}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def ns_per_run(before: dict[str, Sample], after: dict[str, Sample]) -> dict[str, float | None]:
    """Each program's mean run time between two samples; None for one that did not run."""
    out: dict[str, float | None] = {}
    for name, end in after.items():
        start = before[name]
        runs = end.run_cnt - start.run_cnt
        out[name] = (end.run_time_ns - start.run_time_ns) / runs if runs > 0 else None
    return out


@contextlib.contextmanager
def statistics_on() -> Iterator[None]:
    """BPF run-time statistics on for the block (and off after it, unless someone else holds them)."""
    try:
        fd = libbpf.enable_stats()
    except OSError as exc:
        raise LiveCostError(f"cannot turn on BPF statistics (BPF_ENABLE_STATS): {exc}") from exc
    try:
        yield
    finally:
        os.close(fd)
