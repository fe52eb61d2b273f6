"""Whether a process still runs: one answer for everything that keeps pids in files (the lab's
agents, API server and pods; the kubeconfig child's directories). A module of no layer, as
bareimport.py: k8s/ and lab/ both use it, and neither may import the other.

A zombie counts as gone: it has released its namespaces, cgroup and files, and only waits for its
parent to reap it. /proc answers for any user's process, where kill(pid, 0) would say EPERM.
"""

from __future__ import annotations


def state(pid: int | None) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, Z, ...; /proc/PID/stat), None if there
    is no such process."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # the command name may hold ") "
    except (OSError, IndexError):
        return None


def alive(pid: int | None) -> bool:
    """Whether `pid` is a running process (None, a pid not running, or a zombie: False)."""
    return state(pid) not in (None, "Z", "X")
