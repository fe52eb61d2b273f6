"""Whether a process still runs, and its parent: one reading of /proc/PID/stat for everything
that keeps pids (the lab's agents, API server and pods and its teardown's own ancestors; the
bench's agents; the kubeconfig child's directories). A module of no layer, as bareimport.py:
k8s/ and lab/ both use it, and neither may import the other.

A zombie counts as gone: it has released its namespaces, cgroup and files, and only waits for its
parent to reap it. /proc answers for any user's process, where kill(pid, 0) would say EPERM.
"""

from __future__ import annotations


def _stat_fields(pid: int | None) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first, then the parent's pid), None
    if there is no such process."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # the command name may hold ") "
    except OSError:
        return None


def state(pid: int | None) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, Z, ...), None if there is no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def parent(pid: int | None) -> int | None:
    """The pid of `pid`'s parent, None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def alive(pid: int | None) -> bool:
    """Whether `pid` is a running process (None, a pid not running, or a zombie: False)."""
    return state(pid) not in (None, "Z", "X")


def stopped(pid: int | None) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP, as `lab apiserver freeze` sends) or traced:
    alive, but running nothing."""
    return state(pid) in ("T", "t")
