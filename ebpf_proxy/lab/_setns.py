"""Enter a named network namespace (/run/netns/NAME, as `ip netns add` or lab.netns.create_netns make).

Python 3.11 has no os.setns, so this calls libc's setns(2) through ctypes.

The network namespace is a per-thread attribute on Linux, and setns(CLONE_NEWNET) is allowed in
a multithreaded process. That gives the cheap way to act inside a namespace without forking:
`run_in_netns` runs a function in a fresh thread that enters the namespace once and then exits,
so the caller's own thread never moves and no fork happens in a process that may hold locks in
other threads. Sockets keep the namespace they were created in, whichever thread uses them later.

`enter_netns` moves only the calling thread; it is meant for a process that is about to become
a namespace's resident (the echo server's `--netns`, a child before exec), where that thread is
the whole process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import contextlib
import threading
from typing import Any, Callable, Iterator, TypeVar

NETNS_RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000

T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.setns.restype = ctypes.c_int


def netns_path(name: str) -> str:
    """The bind-mount path of netns NAME; rejects names that would escape /run/netns."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid netns name {name!r}")
    return os.path.join(NETNS_RUN_DIR, name)


def setns_fd(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def open_netns(name: str) -> int:
    path = netns_path(name)
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no network namespace named {name!r}", path) from None


_SELF_NETNS = "/proc/thread-self/ns/net"


def netns_exists(name: str) -> bool:
    return os.path.exists(netns_path(name))


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the body with the calling thread inside netns NAME, then switch back.

    Only this thread moves. Sockets created in the body stay bound to that netns afterwards;
    threads started in the body stay there for good. Never await or yield inside the body.
    """
    target = open_netns(name)
    saved = os.open(_SELF_NETNS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_fd(target)
        try:
            yield
        finally:
            try:
                setns_fd(saved)
            except OSError as exc:  # pragma: no cover - cannot happen with a valid fd
                # Half of this process in the wrong namespace is worse than stopping.
                raise SystemExit(f"cannot return from netns {name!r}: {exc}; aborting") from exc
    finally:
        os.close(saved)
        os.close(target)


def call_in_netns(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) run by this very thread inside netns NAME."""
    with in_netns(name):
        return fn(*args, **kwargs)


def enter_netns(name: str) -> None:
    """Move the calling thread (the whole process, if it has one thread) into netns NAME."""
    fd = open_netns(name)
    try:
        setns_fd(fd)
    finally:
        os.close(fd)


def run_in_netns(name: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return fn(*args, **kwargs) computed inside netns NAME (None: right here, no switch).

    The namespace is entered once, by a throwaway thread; exceptions from fn (or from entering
    the namespace) are re-raised in the caller.
    """
    if name is None:
        return fn(*args, **kwargs)
    fd = open_netns(name)  # opened here so a missing namespace fails in the caller's thread
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            setns_fd(fd)
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller verbatim
            outcome["error"] = exc

    try:
        worker = threading.Thread(target=body, name=f"netns:{name}", daemon=True)
        worker.start()
        worker.join()
    finally:
        os.close(fd)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
