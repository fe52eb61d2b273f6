"""`lab agent NODE kill`: SIGKILL a node's agent, now or at a chosen point of a sync.

A crash (kill -9, the OOM killer, a node losing power mid-write) runs no handler: the agent
leaves the kernel exactly as its last map write or iptables-restore left it. To make that moment
reproducible, the kill can wait for the agent's own progress report: /metrics shows
`ebpf_proxy_sync_in_progress{kind="full"}` 1 while a full sync is being written and
`ebpf_proxy_sync_progress` how far it is (ebpf: the fraction of service ports written; iptables:
0.5 once the ruleset is rendered and iptables-restore runs). The lab polls that, from inside the
node's namespace, and sends SIGKILL as soon as the sync has passed `at`. Nothing is cleaned:
the agent's entry stays in the lab's state (`lab status` shows it dead) and `lab agent NODE
start` starts a new one over what the dead one left.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from ebpf_proxy import procs
from ebpf_proxy.lab import naming
from ebpf_proxy.lab.cluster import AGENT_METRICS_PORT, Lab, LabError, host_port
from ebpf_proxy.lab.nshttp import http_get

DURING = ("full-sync", "sync")  # what `--during` accepts: a full sync only, or any sync
POLL = 0.01  # seconds between two looks at /metrics
_SAMPLE = re.compile(r'^(ebpf_proxy_sync_in_progress\{kind="(full|partial)"\}|ebpf_proxy_sync_progress) (\S+)$', re.M)


@dataclass(frozen=True)
class SyncProgress:
    """What an agent's /metrics says about the sync it is writing."""

    full: bool  # a full sync is being written
    partial: bool  # a partial one is
    fraction: float  # 0..1 of the running sync

    @property
    def running(self) -> bool:
        return self.full or self.partial


@dataclass(frozen=True)
class Killed:
    node: str
    pid: int
    progress: SyncProgress | None  # what /metrics said last before the kill (None: not waited for)
    waited: float  # seconds spent waiting for the chosen moment


def parse_progress(metrics_text: str) -> SyncProgress:
    """The sync progress in an agent's /metrics text (a sync not reported: none running)."""
    found = {"full": 0.0, "partial": 0.0, "fraction": 0.0}
    for match in _SAMPLE.finditer(metrics_text):
        found[match.group(2) or "fraction"] = float(match.group(3))
    return SyncProgress(full=found["full"] >= 1, partial=found["partial"] >= 1, fraction=found["fraction"])


def sync_progress(lab: Lab, node: str) -> SyncProgress | None:
    """Ask `node`'s agent how far its sync is; None when it does not answer."""
    status, body = http_get(naming.node_netns(lab.name, node),
                            f"http://{host_port(lab.topology.node(node).ip, AGENT_METRICS_PORT)}/metrics", timeout=1.0)
    return parse_progress(body) if status == 200 else None


def kill(lab: Lab, node: str, during: str | None = None, at: float = 0.5, timeout: float = 120.0) -> Killed:
    """SIGKILL `node`'s agent: at once, or (`during` "full-sync" or "sync") as soon as such a sync
    has written at least `at` (0..1) of itself. LabError naming the node when there is no agent, it
    died on its own, or the moment did not come within `timeout` seconds (the agent is then left
    running)."""
    lab.topology.node(node)
    if during is not None and during not in DURING:
        raise LabError(f"--during: {during!r} is not one of {', '.join(DURING)}")
    if not 0.0 <= at <= 1.0:
        raise LabError(f"--at: {at} is not a fraction between 0 and 1")
    pid = lab.data["agents"].get(node, {}).get("pid")
    if not procs.alive(pid):
        raise LabError(f"{node}: no agent running to kill")
    started = time.monotonic()
    seen = None
    if during is not None:
        while True:
            if not procs.alive(pid):
                raise LabError(f"{node}: the agent (pid {pid}) exited before its {during} reached {at:.0%}")
            seen = sync_progress(lab, node)
            running = seen is not None and (seen.full if during == "full-sync" else seen.running)
            if running and seen.fraction >= at:
                break
            if time.monotonic() - started > timeout:
                raise LabError(f"{node}: no {during} of the agent (pid {pid}) reached {at:.0%} within "
                               f"{timeout:.0f}s (last seen: {seen}); the agent was left running")
            time.sleep(POLL)
    os.kill(pid, signal.SIGKILL)
    _reap(pid)
    lab.data["agents"][node]["killed"] = True
    lab.save()
    return Killed(node, pid, seen, time.monotonic() - started)


def _reap(pid: int, timeout: float = 5.0) -> None:
    """Wait until `pid` is gone (reaped here when it is our child, by init otherwise)."""
    deadline = time.monotonic() + timeout
    while procs.alive(pid) and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)
