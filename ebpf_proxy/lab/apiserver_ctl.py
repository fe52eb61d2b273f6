"""Control-plane faults for the lab: `ebpf-proxy lab apiserver stop|start|restart|freeze|thaw`.

A service proxy must keep forwarding while its API server is away, and catch up when it is back.
Two ways an API server goes away, and both are made here for real:

- **stop / start / restart**: the process exits (SIGTERM; its objects are saved in the lab's
  `apiserver-state.json`) and later starts again with them. Clients get "connection refused"
  meanwhile; after the start their old resourceVersions are 410 Expired, so they relist.
- **freeze / thaw**: SIGSTOP / SIGCONT of the process, like an API server that is overloaded or
  stuck in a GC pause: the kernel still accepts connections and ACKs requests, but nothing is
  answered and open watches go silent without being closed. Only a client-side read timeout
  notices this (the agent's `--watch-idle-timeout`); on thaw, queued requests are answered.

Stopping a frozen server continues it first, so that it saves its state and exits cleanly.
"""

from __future__ import annotations

import os
import signal
import time

from ebpf_proxy import procs
from ebpf_proxy.lab.cluster import Lab, LabError, _stop_pid

ACTIONS = ("stop", "start", "restart", "freeze", "thaw")


def state(lab: Lab) -> str:
    """"running", "frozen" or "stopped"."""
    pid = lab.data.get("apiserver", {}).get("pid")
    if not procs.alive(pid):
        return "stopped"
    return "frozen" if procs.stopped(pid) else "running"


def _pid(lab: Lab) -> int:
    return lab.data["apiserver"]["pid"]


def stop(lab: Lab) -> None:
    """SIGTERM (after SIGCONT if frozen): the server saves its objects and exits. Idempotent."""
    if state(lab) != "stopped":
        _stop_pid(_pid(lab), timeout=10)
    lab.data.setdefault("apiserver", {})["pid"] = None
    lab.save()


def start(lab: Lab) -> None:
    """Start it again with its saved objects, on the same addresses. Idempotent when running."""
    now = state(lab)
    if now == "frozen":
        raise LabError(f"lab {lab.name}: the API server (pid {_pid(lab)}) is frozen: "
                       f"`ebpf-proxy lab apiserver thaw --name {lab.name}` continues it")
    if now == "running":
        return
    url = lab.data.get("apiserver", {}).get("url", "")
    port = int(url.rsplit(":", 1)[1]) if url.count(":") == 2 else 0
    lab._start_apiserver(local_port=port)
    lab.save()


def restart(lab: Lab) -> None:
    stop(lab)
    start(lab)


def _signal(lab: Lab, sig: signal.Signals, want: str, need: str) -> None:
    now = state(lab)
    if now == want:
        return
    if now != need:
        raise LabError(f"lab {lab.name}: the API server is {now}, not {need}")
    os.kill(_pid(lab), sig)
    deadline = time.monotonic() + 5
    while state(lab) != want:  # signals are delivered asynchronously
        if time.monotonic() > deadline:
            raise LabError(f"lab {lab.name}: the API server (pid {_pid(lab)}) is not {want} 5s after {sig.name}")
        time.sleep(0.01)


def freeze(lab: Lab) -> None:
    """SIGSTOP: connections stay open, nothing is answered. Idempotent."""
    _signal(lab, signal.SIGSTOP, "frozen", "running")


def thaw(lab: Lab) -> None:
    """SIGCONT: it answers again, queued requests first. Idempotent."""
    _signal(lab, signal.SIGCONT, "running", "frozen")


def act(lab: Lab, action: str) -> str:
    """Do `action` (one of ACTIONS); returns the server's state afterwards."""
    steps = {"stop": stop, "start": start, "restart": restart, "freeze": freeze, "thaw": thaw}
    if action not in steps:
        raise LabError(f"apiserver action {action!r} is not one of {', '.join(ACTIONS)}")
    steps[action](lab)
    return state(lab)
