"""Compile the datapath with bcc, pin its maps under bpffs, attach and detach its programs.

Loading happens in two steps because bcc turns `table.lookup()` into a map access only in a
program's main file, while our logic lives in shared headers (see bpf/lib/maps.h):
  1. bpf/maps.c declares every map pinned under `pin_dir`; bcc re-opens maps already pinned
     there (the connection table survives an agent restart) or creates and pins them;
  2. each entry program is compiled with -DEPX_FD_<map>=<fd> of those maps and loaded.
A pinned map whose key size, value size, type or capacity no longer matches this build (an
upgrade changed common.h) is unpinned first, so bcc recreates it instead of misreading it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf, structs, toolchain

log = logging.getLogger(__name__)

# The C sources: a checkout's bpf/, or where the image puts them (EBPF_PROXY_BPF_DIR), since an
# installed wheel has no source tree around it.
BPF_SRC_DIR = Path(os.environ.get("EBPF_PROXY_BPF_DIR") or Path(__file__).resolve().parents[3] / "bpf")

# Capacity of each map (passed as -DEPX_<MAP>_MAX); epx_config and epx_stats are fixed-size.
MAX_ENTRIES: dict[str, int] = {
    "epx_svc": 65536,
    "epx_backend": 65536,
    "epx_slot": 262144,
    "epx_affinity": 65536,
    "epx_src_range": 16384,
    "epx_node_addr": 256,
    "epx_pod_cidr": 64,
    "epx_ct4": 262144,
    "epx_frag4": 8192,
    "epx_sock_rev": 65536,
}
_FIXED_ENTRIES = {"epx_config": 1, "epx_stats": structs.REASON_MAX}

# bcc program type names (BPF.<name>) and attach types (BPFAttachType.<name>)
PROGRAMS: dict[str, tuple[str, str, str | None]] = {
    "tc_ingress": ("tc_lb.c", "SCHED_CLS", None),
    "tc_egress": ("tc_lb.c", "SCHED_CLS", None),
    "xdp_lb": ("xdp_lb.c", "XDP", None),
    "sock_connect4": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_INET4_CONNECT"),
    "sock_sendmsg4": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_UDP4_SENDMSG"),
    "sock_recvmsg4": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_UDP4_RECVMSG"),
}

_TC_INGRESS_PARENT = "ffff:fff2"
_TC_EGRESS_PARENT = "ffff:fff3"
_XDP_FLAGS = {"generic": 2, "native": 4}  # XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE


class LoadError(RuntimeError):
    """The datapath could not be compiled or loaded; the message says which part and why."""


def map_macro(name: str) -> str:
    """-D name of a map's capacity: epx_ct4 -> EPX_CT4_MAX."""
    return f"{name.upper()}_MAX"


def is_bpffs(path: Path) -> bool:
    """Whether `path` is a bpf filesystem mount point (pinning works only there)."""
    target = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        return any(f[1] == target and f[2] == "bpf" for f in (line.split() for line in mounts) if len(f) > 2)


def mount_bpffs(path: Path) -> None:
    """Mount a bpf filesystem at `path` (created if missing) unless one is there already."""
    path.mkdir(parents=True, exist_ok=True)
    if is_bpffs(path):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", str(path).encode(), b"bpf", 0, None) != 0:
        err = ctypes.get_errno()
        raise LoadError(f"mount -t bpf {path}: {os.strerror(err)}")


def unmount_bpffs(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if is_bpffs(path) and libc.umount2(str(path).encode(), 0) != 0:
        err = ctypes.get_errno()
        raise LoadError(f"umount {path}: {os.strerror(err)}")


def _expected_sizes(max_entries: Mapping[str, int]) -> dict[str, tuple[int, int, int]]:
    sizes = {**max_entries, **_FIXED_ENTRIES}
    return {
        name: (ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf), sizes[name]) for name, spec in structs.MAPS.items()
    }


def drop_incompatible_pins(pin_dir: Path, max_entries: Mapping[str, int]) -> list[str]:
    """Unpin maps whose key/value size or capacity differ from this build. Returns their names."""
    dropped = []
    for name, (key_size, value_size, entries) in _expected_sizes(max_entries).items():
        pin = pin_dir / name
        if not pin.exists():
            continue
        info = libbpf.pinned_map_info(str(pin))
        if (info.key_size, info.value_size, info.max_entries) != (key_size, value_size, entries):
            log.warning(
                "map %s pinned with key/value/entries %d/%d/%d, this build needs %d/%d/%d: recreating it",
                name, info.key_size, info.value_size, info.max_entries, key_size, value_size, entries,
            )
            pin.unlink()
            dropped.append(name)
    return dropped


@dataclass
class Loaded:
    """The compiled datapath: its maps (bcc tables) and program fds. close() keeps the pins."""

    pin_dir: Path
    tables: dict[str, object]
    prog_fds: dict[str, int]
    _modules: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for module in self._modules:
            module.cleanup()
        self._modules.clear()


def load(
    pin_dir: Path,
    programs: Iterable[str] = PROGRAMS,
    max_entries: Mapping[str, int] | None = None,
) -> Loaded:
    """Compile bpf/maps.c (pinning maps in `pin_dir`, a bpffs dir) and the given programs."""
    toolchain.ensure_kernel_headers()
    try:
        from bcc import BPF, BPFAttachType  # noqa: PLC0415 (the package imports without bcc)
    except ImportError as exc:
        raise LoadError(f"python bcc not importable ({exc}): install python3-bpfcc") from exc

    sizes = {**MAX_ENTRIES, **(max_entries or {})}
    if not is_bpffs(pin_dir):
        raise LoadError(f"{pin_dir} is not a bpf filesystem mount (mount -t bpf bpf {pin_dir})")
    drop_incompatible_pins(pin_dir, sizes)
    cflags = [f'-DEPX_PIN_DIR="{pin_dir}"', f"-I{BPF_SRC_DIR}"]
    cflags += [f"-D{map_macro(name)}={n}" for name, n in sizes.items()]

    modules = []
    try:
        maps = BPF(src_file=str(BPF_SRC_DIR / "maps.c").encode(), cflags=cflags)
        modules.append(maps)
        tables = {name: maps[name.encode()] for name in structs.MAPS}
        fd_flags = [f"-DEPX_FD_{name}={table.get_fd()}" for name, table in tables.items()]

        prog_fds: dict[str, int] = {}
        by_source: dict[str, object] = {}
        for name in programs:
            source, prog_type, attach = PROGRAMS[name]
            if source not in by_source:
                by_source[source] = BPF(src_file=str(BPF_SRC_DIR / source).encode(), cflags=cflags + fd_flags)
                modules.append(by_source[source])
            kwargs = {"attach_type": getattr(BPFAttachType, attach)} if attach else {}
            fn = by_source[source].load_func(name.encode(), getattr(BPF, prog_type), **kwargs)
            prog_fds[name] = fn.fd
    except Exception as exc:
        for module in modules:
            module.cleanup()
        if isinstance(exc, LoadError):
            raise
        raise LoadError(f"loading the datapath failed: {exc}") from exc
    return Loaded(pin_dir=pin_dir, tables=tables, prog_fds=prog_fds, _modules=modules)


# ---- attachment (network devices: pyroute2, in the caller's chosen netns) ----


def attach_tc(ipr, ifindex: int, ingress_fd: int | None, egress_fd: int | None) -> None:
    """Attach direct-action cls_bpf filters on clsact of `ifindex` (replacing ours if present).

    `ipr` is a pyroute2 IPRoute already bound to the device's network namespace.
    """
    with contextlib.suppress(Exception):  # clsact may exist already (ours or someone's)
        ipr.tc("add", "clsact", index=ifindex)
    for parent, fd, name in ((_TC_INGRESS_PARENT, ingress_fd, "epx_ingress"), (_TC_EGRESS_PARENT, egress_fd, "epx_egress")):
        if fd is None:
            continue
        ipr.tc("replace-filter", "bpf", index=ifindex, handle=":1", fd=fd, name=name, parent=parent,
               classid=1, direct_action=True)


def detach_tc(ipr, ifindex: int) -> None:
    """Remove clsact from `ifindex` (and with it our filters). Idempotent."""
    with contextlib.suppress(Exception):
        ipr.tc("del", "clsact", index=ifindex)


_CGROUP_ATTACH = {
    "sock_connect4": libbpf.ATTACH_CGROUP_INET4_CONNECT,
    "sock_sendmsg4": libbpf.ATTACH_CGROUP_UDP4_SENDMSG,
    "sock_recvmsg4": libbpf.ATTACH_CGROUP_UDP4_RECVMSG,
}


def attach_cgroup(loaded: Loaded, cgroup_dir: Path) -> None:
    """Attach the socket-LB programs to a cgroup v2 directory (and so to every process below it)."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, attach_type in _CGROUP_ATTACH.items():
            libbpf.prog_attach(loaded.prog_fds[name], fd, attach_type, libbpf.BPF_F_ALLOW_MULTI)
    finally:
        os.close(fd)


def detach_cgroup(loaded: Loaded, cgroup_dir: Path) -> None:
    """Detach what attach_cgroup attached. Idempotent."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, attach_type in _CGROUP_ATTACH.items():
            with contextlib.suppress(OSError):
                libbpf.prog_detach(loaded.prog_fds[name], fd, attach_type)
    finally:
        os.close(fd)


def attach_xdp(ipr, ifindex: int, fd: int, mode: str = "generic") -> None:
    ipr.link("set", index=ifindex, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", _XDP_FLAGS[mode])]})


def detach_xdp(ipr, ifindex: int, mode: str = "generic") -> None:
    with contextlib.suppress(Exception):
        ipr.link("set", index=ifindex, xdp={"attrs": [("IFLA_XDP_FD", -1), ("IFLA_XDP_FLAGS", _XDP_FLAGS[mode])]})
