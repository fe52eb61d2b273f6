"""Run programs, and Python code, inside a lab network namespace (and cgroup).

How a child gets into the netns: the calling *thread* switches to the netns with setns(2)
just for the fork, and the child inherits it (namespaces belong to threads in Linux, so other
threads of this process never notice). That keeps ``subprocess`` on its fast, thread-safe
path (no ``preexec_fn``, which may deadlock in a threaded parent).

How it gets into the cgroup *before* it runs any of its own code: when a cgroup is given,
the child is a tiny ``/bin/sh`` that writes its own pid (which exec keeps) to
``cgroup.procs`` and then execs the real program. Cgroup BPF hooks (socket-level load
balancing) therefore see the program's very first connect().

Gotcha, decided on purpose: ``ip netns exec`` also unshares the mount namespace and remounts
/sys so that /sys/class/net lists the netns's interfaces. We do not: our processes share the
host's mount namespace, so a bpffs mounted or pinned by one is visible to all (which the
agent's pinned maps need), and we avoid a mount per process. The price: /sys/class/net inside
a lab process shows the *root* namespace's interfaces. Use netlink (pyroute2, ip, ethtool)
or /proc/net and /proc/sys/net, which do follow the netns, never /sys/class/net.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Mapping, Sequence

from ebpf_proxy.lab._setns import call_in_netns, in_netns, netns_exists, netns_path, open_netns, setns_fd

_CGROUP_SHIM = 'echo $$ > "$0" && exec "$@"'

__all__ = ["call_in_netns", "in_netns", "netns_exists", "netns_path", "open_netns", "run", "setns_fd", "spawn"]


def _procs_file(cgroup: str) -> str:
    procs = os.path.join(cgroup, "cgroup.procs")
    if not os.path.isfile(procs):
        raise FileNotFoundError(f"cgroup {cgroup!r} does not exist (no {procs})")
    return procs


def _resolve(argv: Sequence[str], env: Mapping[str, str] | None) -> list[str]:
    if not argv:
        raise ValueError("argv: empty command")
    argv = [os.fspath(a) for a in argv]
    path = (env or os.environ).get("PATH", os.defpath)
    found = shutil.which(argv[0], path=path)
    if found is None:
        raise FileNotFoundError(f"argv[0]: command {argv[0]!r} not found on PATH")
    return [found, *argv[1:]]


def spawn(
    netns: str | None,
    argv: Sequence[str],
    cgroup: str | None = None,
    log_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **popen_kwargs: Any,
) -> subprocess.Popen:
    """Start ``argv`` inside ``netns`` (and ``cgroup``, entered before exec); return the Popen.

    ``netns`` None starts it in the caller's own netns (still honouring ``cgroup``).

    Output goes to ``log_path`` (appended, stdout and stderr together) if given, else to
    /dev/null unless ``stdout``/``stderr`` are passed. The child starts a new session, so it
    can be signalled as a group and does not get the terminal's Ctrl-C.
    """
    argv = _resolve(argv, env)
    if cgroup is not None:
        argv = ["/bin/sh", "-c", _CGROUP_SHIM, _procs_file(cgroup), *argv]
    kwargs: dict[str, Any] = {"start_new_session": True, "stdin": subprocess.DEVNULL}
    log = None
    if log_path is not None:
        log = open(log_path, "ab")
        kwargs["stdout"] = log
        kwargs["stderr"] = subprocess.STDOUT
    else:
        kwargs["stdout"] = subprocess.DEVNULL
        kwargs["stderr"] = subprocess.DEVNULL
    kwargs.update(popen_kwargs)
    if env is not None:
        kwargs["env"] = dict(env)
    try:
        if netns is None:
            return subprocess.Popen(argv, **kwargs)
        with in_netns(netns):
            return subprocess.Popen(argv, **kwargs)
    finally:
        if log is not None:
            log.close()


def run(
    netns: str | None,
    argv: Sequence[str],
    cgroup: str | None = None,
    timeout: float | None = 30.0,
    input: str | bytes | None = None,
    *,
    env: Mapping[str, str] | None = None,
    check: bool = False,
    text: bool = True,
    capture_output: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``argv`` to completion inside ``netns`` (and ``cgroup``).

    Like ``subprocess.run``, but capturing output by default (``capture_output=False``
    passes it through to ours): on timeout the child is killed and ``TimeoutExpired``
    raised; ``check=True`` raises ``CalledProcessError``.
    """
    out_pipe = subprocess.PIPE if capture_output else None
    proc = spawn(
        netns, argv, cgroup=cgroup, env=env,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=out_pipe, stderr=out_pipe, text=text,
    )
    with proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
