"""An agent's CPU seconds and peak RSS, per phase of the bench, from /proc.

CPU is utime + stime of /proc/PID/stat (the agent's threads included), read before and after a
phase. Peak RSS is VmHWM of /proc/PID/status, the kernel's high-water mark; writing 5 to
/proc/PID/clear_refs resets it to the current RSS, so each phase gets its own peak rather than
the process's lifetime one. Only processes the lab started (the agents) are read or reset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    cpu_seconds: float
    rss_mib: float
    peak_rss_mib: float


def parse_stat_cpu(stat_text: str) -> float:
    """utime + stime in seconds from the text of /proc/PID/stat (the comm field may hold spaces)."""
    fields = stat_text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def parse_status_kib(status_text: str, key: str) -> int:
    """A 'Key:   123 kB' value of /proc/PID/status, in KiB."""
    for line in status_text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(f"{key} not in /proc/PID/status")


def read(pid: int) -> Usage:
    with open(f"/proc/{pid}/stat") as f:
        cpu = parse_stat_cpu(f.read())
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    return Usage(cpu, parse_status_kib(status, "VmRSS") / 1024, parse_status_kib(status, "VmHWM") / 1024)


def reset_peak(pid: int) -> None:
    """Start a new peak-RSS window (clear_refs 5: VmHWM := current RSS)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class PhaseMeter:
    """CPU seconds and peak RSS of a set of processes (node -> pid) over one phase."""

    def __init__(self, pids: dict[str, int], reset: bool = True) -> None:
        self.pids = dict(pids)
        if reset:
            for pid in self.pids.values():
                reset_peak(pid)
        self.start = {node: read(pid) for node, pid in self.pids.items()}

    def stop(self) -> dict[str, dict[str, float]]:
        """node -> {"cpu_seconds", "peak_rss_mib", "rss_mib"} for the phase."""
        out = {}
        for node, pid in self.pids.items():
            end = read(pid)
            out[node] = {"cpu_seconds": round(end.cpu_seconds - self.start[node].cpu_seconds, 3),
                         "peak_rss_mib": round(end.peak_rss_mib, 1), "rss_mib": round(end.rss_mib, 1)}
        return out
