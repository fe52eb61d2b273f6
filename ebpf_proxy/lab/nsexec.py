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

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import subprocess
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from ebpf_proxy.lab import naming

CLONE_NEWNET = 0x40000000
_SELF_NETNS = "/proc/thread-self/ns/net"
_CGROUP_SHIM = 'echo $$ > "$0" && exec "$@"'

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

T = TypeVar("T")


def netns_path(netns: str) -> str:
    """/run/netns/NAME; rejects names that would point anywhere else."""
    if not isinstance(netns, str) or not netns or "/" in netns or netns in (".", ".."):
        raise ValueError(f"netns name {netns!r} is not a plain file name under {naming.NETNS_DIR}")
    return os.path.join(naming.NETNS_DIR, netns)


def netns_exists(netns: str) -> bool:
    return os.path.exists(netns_path(netns))


def setns_fd(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET) failed: {os.strerror(err)}")


def open_netns(netns: str) -> int:
    """An O_RDONLY fd on a named netns; FileNotFoundError naming it if it does not exist."""
    try:
        return os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"network namespace {netns!r} does not exist ({netns_path(netns)})"
        ) from None


@contextlib.contextmanager
def in_netns(netns: str) -> Iterator[None]:
    """Run the body with the calling thread inside ``netns``, then switch back.

    Only this thread moves. Sockets (netlink, TCP, ...) created in the body stay bound to
    ``netns`` after the block ends; /proc/sys/net files opened in it address that netns.
    Threads started in the body stay in ``netns`` for good. Do not await or yield to other
    code in the body (an asyncio task switch would run unrelated code in the wrong netns).
    """
    target = open_netns(netns)
    saved = os.open(_SELF_NETNS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_fd(target)
        try:
            yield
        finally:
            try:
                setns_fd(saved)
            except OSError as e:  # pragma: no cover - cannot happen with a valid fd
                raise SystemExit(f"cannot return from netns {netns!r}: {e}; aborting") from e
    finally:
        os.close(saved)
        os.close(target)


def call_in_netns(netns: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run by this thread inside ``netns``."""
    with in_netns(netns):
        return fn(*args, **kwargs)


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
