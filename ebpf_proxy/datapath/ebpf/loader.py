"""Compile the datapath with bcc, pin its maps under bpffs, attach and detach its programs.

Loading happens in two steps because bcc turns `table.lookup()` into a map access only in a
program's main file, while our logic lives in shared headers (see bpf/lib/maps.h):
  1. bpf/maps.c declares every map pinned under `pin_dir`; bcc re-opens maps already pinned
     there (the connection table survives an agent restart) or creates and pins them;
  2. each entry program is compiled with -DEPX_FD_<map>=<fd> of those maps and loaded.
A pinned map whose key size, value size, type or capacity no longer matches this build (an
upgrade changed common.h) is unpinned first, so bcc recreates it instead of misreading it.

The loaded programs are pinned too, under <pin_dir>/progs/<build id>/ (the id hashes the C
sources, map capacities and kernel release). A restarted agent of the same build re-opens them
instead of compiling: a restart in well under a second, and the very programs that are attached
stay attached. They are reused only if every map they use is still the one pinned next to them
(a recreated map means: compile again).

The compile itself runs in a short-lived child process (compile.py) that pins what it built and
exits; the caller then opens the pins, as after a restart. bcc's LLVM never enters the agent:
importing bcc costs ~60 MiB of RSS, a compile leaves ~250 MiB behind, and neither is returned
(shared/PLATFORM.md, pitfall 5). `in_process=True` compiles here instead and keeps bcc's tables
(the child itself, and the tests that compare structs.py with bcc's reflection of the C).

A start that finds no pinned programs of its build (after a reboot, on a new node, after
`cleanup`) first looks in the node's program cache (objcache.py, `cache_dir`): the bytecode the
compiler produced for this build id, loaded with this process's map fds in milliseconds instead
of a multi-second compile. bcc stays the fallback for a build the cache does not have, and
every compile refreshes the cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf, objcache, structs, toolchain

log = logging.getLogger(__name__)

# The C sources: a checkout's bpf/, or where the image puts them (EBPF_PROXY_BPF_DIR), since an
# installed wheel has no source tree around it.
BPF_SRC_DIR = Path(os.environ.get("EBPF_PROXY_BPF_DIR") or Path(__file__).resolve().parents[3] / "bpf")

# Capacity of each map (passed as -DEPX_<MAP>_MAX); epx_config, epx_stats, epx_trace and
# epx_ct4_ring are fixed-size. EbpfDatapath sizes epx_ct4 from kube-proxy's conntrack settings
# (agent/conntrack.py); this default is their minimum, 131072 connections at 2 entries each.
MAX_ENTRIES: dict[str, int] = {
    "epx_svc": 65536,
    "epx_backend": 65536,
    "epx_slot": 262144,
    "epx_affinity": 65536,
    "epx_src_range": 16384,
    "epx_node_addr": 256,
    "epx_pod_cidr": 64,
    "epx_iface": 4096,
    "epx_ct4": 262144,
    "epx_frag4": 8192,
    "epx_sock_rev": 65536,
    # IPv6 (bpf/maps.c): the same roles, their own maps, so the IPv6 writer's ids are its own
    "epx_svc6": 65536,
    "epx_backend6": 65536,
    "epx_slot6": 262144,
    "epx_affinity6": 65536,
    "epx_src_range6": 16384,
    "epx_node_addr6": 256,
    "epx_pod_cidr6": 64,
    "epx_ct6": 262144,
    "epx_sock_rev6": 65536,
}
# the arrays' sizes are the datapath's own, never configured
FIXED_ENTRIES = {"epx_config": 1, "epx_stats": structs.REASON_MAX, "epx_trace": 1, "epx_ct4_ring": 1,
                  "epx_config6": 1, "epx_scratch6": 1}

# bcc program type names (BPF.<name>) and attach types (BPFAttachType.<name>)
PROGRAMS: dict[str, tuple[str, str, str | None]] = {
    "tc_ingress": ("tc_lb.c", "SCHED_CLS", None),
    "tc_egress": ("tc_lb.c", "SCHED_CLS", None),
    "tc_lo": ("tc_lb.c", "SCHED_CLS", None),  # the node's lo, ingress only (bpf/lib/lo6.h)
    "xdp_lb": ("xdp_lb.c", "XDP", None),
    "sock_connect4": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_INET4_CONNECT"),
    "sock_sendmsg4": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_UDP4_SENDMSG"),
    "sock_recvmsg4": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_UDP4_RECVMSG"),
    # AF_INET6 sockets: IPv6 destinations, and IPv4-mapped ones (bpf/lib/sock6.h)
    "sock_connect6": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_INET6_CONNECT"),
    "sock_sendmsg6": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_UDP6_SENDMSG"),
    "sock_recvmsg6": ("sock_lb.c", "CGROUP_SOCK_ADDR", "CGROUP_UDP6_RECVMSG"),
}

_TC_INGRESS_PARENT = "ffff:fff2"
_TC_EGRESS_PARENT = "ffff:fff3"
# Our filters' fixed identity on each clsact hook: with a fixed priority and handle, attaching
# again replaces the filter in place (atomically) instead of stacking a second one next to it.
TC_PRIO, TC_HANDLE, TC_PROTOCOL_ALL = 1, 1, 0x0003  # ETH_P_ALL
TC_FILTER_NAMES = {_TC_INGRESS_PARENT: "epx_ingress", _TC_EGRESS_PARENT: "epx_egress"}
_XDP_FLAGS = {"generic": 2, "native": 4}  # XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE
XDP_PROGRAM_NAME = "xdp_lb"


# bpf/lib/fib4.h's helpers (enum bpf_func_id) and the first kernel with all of them in the form it
# calls: bpf_redirect_neigh took its next-hop parameters in 5.11
_HOST_ROUTING_HELPERS = {"bpf_fib_lookup": 69, "bpf_redirect_neigh": 152, "bpf_redirect_peer": 155}
HOST_ROUTING_MIN_KERNEL = (5, 11)


def _kernel_version(release: str) -> tuple[int, int]:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _helper_probe(helper: int, with_params: bool) -> bytes:
    """A SCHED_CLS program calling `helper` with arguments its verifier accepts: the context in r1
    and 64 zeroed stack bytes as r2/r3 (bpf_fib_lookup's params), or zeros (null, 0) in r1..r4."""
    ins = functools.partial(struct.pack, "<BBhi")
    if with_params:
        code = b"".join(ins(0x7A, 10, -8 * i, 0) for i in range(1, 9))  # *(u64 *)(r10 - 8i) = 0
        code += ins(0xBF, 0xA2, 0, 0) + ins(0x07, 2, 0, -64)  # r2 = r10 - 64
        code += ins(0xB7, 3, 0, 64) + ins(0xB7, 4, 0, 0)  # r3 = 64, r4 = 0
    else:
        code = b"".join(ins(0xB7, reg, 0, 0) for reg in (1, 2, 3, 4))
    return code + ins(0x85, 0, 0, helper) + libbpf.return_constant_program(0)


def host_routing_unsupported(release: str | None = None) -> str | None:
    """None when this kernel can run the host-routing fast path (--bpf-host-routing=auto turns it on),
    else what is missing. Each helper is probed with a SCHED_CLS program that calls it (the verifier
    refuses a program calling a helper the kernel lacks), and the release must be 5.11 or later."""
    release = release or os.uname().release
    if _kernel_version(release) < HOST_ROUTING_MIN_KERNEL:
        return f"kernel {release} is older than {'.'.join(map(str, HOST_ROUTING_MIN_KERNEL))}"
    missing = []
    for name, helper in _HOST_ROUTING_HELPERS.items():
        insns = _helper_probe(helper, with_params=name == "bpf_fib_lookup")
        try:
            os.close(libbpf.prog_load(libbpf.PROG_TYPE_SCHED_CLS, insns, name="epx_probe_fib"))
        except OSError as exc:
            missing.append(f"{name}: {exc.strerror}")
        except libbpf.LibbpfMissing as exc:
            return str(exc)
    return ("the kernel refuses " + ", ".join(missing)) if missing else None


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


class _StatFs(ctypes.Structure):
    # struct statfs (64-bit glibc): only f_type is read, the rest is room for the kernel to fill.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]


BPF_FS_MAGIC = 0xCAFE4A11


def on_bpffs(path: Path) -> bool:
    """Whether `path` lies on a bpf filesystem (pins can be made there), mount point or not."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = _StatFs()
    if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) == BPF_FS_MAGIC


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


def _expected_sizes(max_entries: Mapping[str, int]) -> dict[str, tuple[int, int, int, int]]:
    """(map type, key size, value size, capacity) of each map of this build."""
    sizes = {**max_entries, **FIXED_ENTRIES}
    return {
        name: (spec.type_id, ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf), sizes[name])
        for name, spec in structs.MAPS.items()
    }


def _layout(info: libbpf.MapInfo) -> tuple[int, int, int, int]:
    return (info.type, info.key_size, info.value_size, info.max_entries)


def drop_incompatible_pins(pin_dir: Path, max_entries: Mapping[str, int]) -> list[str]:
    """Unpin maps whose type, key/value size or capacity differ from this build (an upgrade
    that turned epx_ct4 from an LRU into a hash must not keep the LRU). Returns their names."""
    dropped = []
    for name, expected in _expected_sizes(max_entries).items():
        pin = pin_dir / name
        if not pin.exists():
            continue
        found = _layout(libbpf.pinned_map_info(str(pin)))
        if found != expected:
            log.warning("map %s pinned with type/key/value/entries %s, this build needs %s: recreating it",
                        name, "/".join(map(str, found)), "/".join(map(str, expected)))
            pin.unlink()
            dropped.append(name)
    return dropped


PROGS_SUBDIR = "progs"


@dataclass
class Loaded:
    """The loaded datapath: map and program fds (and, when compiled here, bcc's tables).
    close() keeps every pin."""

    pin_dir: Path
    tables: dict[str, object]  # bcc tables (empty when the programs were re-opened from pins)
    prog_fds: dict[str, int]
    map_fds: dict[str, int] = field(default_factory=dict)
    source: str = "compiler"  # where the programs came from: compiler | cache | pins
    _modules: list = field(default_factory=list, repr=False)
    _fds: list[int] = field(default_factory=list, repr=False)  # opened from pins: ours to close

    @property
    def compiled(self) -> bool:
        return self.source == "compiler"

    def close(self) -> None:
        for module in self._modules:
            module.cleanup()
        self._modules.clear()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def build_id(programs: Iterable[str], max_entries: Mapping[str, int]) -> str:
    """What a compiled program depends on: every C source, the map capacities, the program list
    and the kernel release. Same id, same programs."""
    digest = hashlib.sha256()
    for path in sorted(BPF_SRC_DIR.rglob("*")):
        if path.suffix in (".c", ".h"):
            digest.update(path.relative_to(BPF_SRC_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr(sorted(max_entries.items())).encode())
    digest.update(repr(sorted((n, PROGRAMS[n]) for n in programs)).encode())
    digest.update(os.uname().release.encode())
    return digest.hexdigest()[:16]


def _open_pinned(pin_dir: Path, bid: str, programs: Iterable[str], sizes: Mapping[str, int]) -> Loaded | None:
    """The pinned maps and programs of build `bid`, or None (with the reason logged) if they
    cannot be reused as they are."""
    prog_dir = pin_dir / PROGS_SUBDIR / bid
    if not prog_dir.is_dir():
        return None
    fds: list[int] = []
    try:
        map_fds, map_ids = {}, set()
        for name, expected in _expected_sizes(sizes).items():
            fd = libbpf.obj_get(str(pin_dir / name))
            fds.append(fd)
            info = libbpf.map_info(fd)
            if _layout(info) != expected:
                raise LookupError(f"map {name} does not match this build")
            map_fds[name], map_ids = fd, map_ids | {info.id}
        prog_fds = {}
        for name in programs:
            fd = libbpf.obj_get(str(prog_dir / name))
            fds.append(fd)
            if not set(libbpf.prog_info(fd)[1]) <= map_ids:
                raise LookupError(f"program {name} uses maps that are no longer pinned")
            prog_fds[name] = fd
    except (OSError, LookupError) as exc:
        log.info("pinned programs of build %s not reused (%s): compiling", bid, exc)
        for fd in fds:
            os.close(fd)
        return None
    return Loaded(pin_dir=pin_dir, tables={}, prog_fds=prog_fds, map_fds=map_fds, source="pins", _fds=fds)


def _pin_programs(pin_dir: Path, bid: str, prog_fds: Mapping[str, int]) -> None:
    """Pin this build's programs (replacing any other build's pins: attached programs stay)."""
    progs = pin_dir / PROGS_SUBDIR
    progs.mkdir(exist_ok=True)
    for other in progs.iterdir():
        if other.name != bid:
            shutil.rmtree(other)
    target = progs / bid
    target.mkdir(exist_ok=True)
    for name, fd in prog_fds.items():
        with contextlib.suppress(FileNotFoundError):
            (target / name).unlink()
        libbpf.obj_pin(fd, str(target / name))


COMPILE_TIMEOUT = 300.0  # seconds: a compile takes ~3 s; a stuck one must not hang the agent forever


def load(
    pin_dir: Path,
    programs: Iterable[str] = PROGRAMS,
    max_entries: Mapping[str, int] | None = None,
    reuse: bool = False,
    in_process: bool = False,
    cache_dir: Path | None = None,
) -> Loaded:
    """The datapath's maps (pinned in `pin_dir`, a directory on bpffs) and the given programs,
    compiled from bpf/ and pinned. With `reuse`, this build's pinned programs are re-opened instead
    when they are there and still use the pinned maps (no compile). With `cache_dir`, a build the
    node's program cache has is loaded from there (no compile), and a compile stores its build
    there. The compile runs in a child process (see the module docstring) unless `in_process`;
    only then are bcc's tables kept."""
    programs = list(programs)
    sizes = {**MAX_ENTRIES, **(max_entries or {})}
    if not on_bpffs(pin_dir):
        raise LoadError(f"{pin_dir} is not on a bpf filesystem (mount -t bpf bpf <dir>)")
    bid = build_id(programs, sizes)
    if reuse:
        loaded = _open_pinned(pin_dir, bid, programs, sizes)
        if loaded is not None:
            log.info("re-opened the pinned programs of build %s (no compile)", bid)
            return loaded
    if cache_dir is not None and not in_process:
        loaded = _load_cached(pin_dir, bid, programs, sizes, cache_dir)
        if loaded is not None:
            return loaded
    toolchain.ensure_kernel_headers()  # here: its errors keep their type and message
    if in_process:
        return _compile_here(pin_dir, programs, sizes, bid, cache_dir)
    report = _compile_in_child(pin_dir, programs, max_entries or {}, bid, cache_dir)
    loaded = _open_pinned(pin_dir, bid, programs, sizes)
    if loaded is None:
        raise LoadError(f"the compiler process pinned build {bid} under {pin_dir}, but its pins cannot be "
                        "opened (removed meanwhile?)")
    loaded.source = "compiler"
    log.info("compiled build %s in a child process (%.1f s, its peak RSS %.0f MiB)", bid,
             report.get("seconds", 0.0), report.get("peak_rss_mib", 0.0))
    return loaded


def _load_cached(pin_dir: Path, bid: str, programs: list[str], sizes: Mapping[str, int],
                 cache_dir: Path) -> Loaded | None:
    """Build `bid` from the node's program cache, pinned as a compile pins it; None (with the
    reason logged) when the cache cannot provide it."""
    start = time.monotonic()
    try:
        entry = objcache.read(cache_dir, bid, programs)
    except (objcache.CacheError, OSError) as exc:
        log.warning("program cache not used for build %s (%s): compiling", bid, exc)
        return None
    if entry is None:
        log.info("build %s is not in the program cache %s: compiling", bid, cache_dir)
        return None
    if drop_incompatible_pins(pin_dir, sizes):
        shutil.rmtree(pin_dir / PROGS_SUBDIR, ignore_errors=True)  # they use the maps just dropped
    fds: list[int] = []
    try:
        map_fds = objcache.open_or_create_maps(pin_dir, entry["maps"])
        fds += map_fds.values()
        prog_fds = objcache.load_programs(entry, programs, map_fds)
        fds += prog_fds.values()
        _pin_programs(pin_dir, bid, prog_fds)
    except (objcache.CacheError, OSError) as exc:
        log.warning("program cache entry of build %s not loadable (%s): compiling", bid, exc)
        return None
    finally:
        for fd in fds:
            os.close(fd)
    loaded = _open_pinned(pin_dir, bid, programs, sizes)
    if loaded is not None:
        loaded.source = "cache"
        log.info("loaded build %s from the program cache in %.3f s (no compile)", bid, time.monotonic() - start)
    return loaded


def _compile_in_child(pin_dir: Path, programs: list[str], max_entries: Mapping[str, int], bid: str,
                      cache_dir: Path | None = None) -> dict:
    """Run compile.py in a fresh interpreter; returns its report. Raises LoadError with its error."""
    argv = [sys.executable, "-m", "ebpf_proxy.datapath.ebpf.compile", "--pin-dir", str(pin_dir),
            "--src-dir", str(BPF_SRC_DIR), "--build", bid]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    argv += [f"--program={name}" for name in programs]
    argv += [f"--max-entries={name}={n}" for name, n in sorted(max_entries.items())]
    env = dict(os.environ)
    # the child imports this very package, wherever it was imported from here
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LoadError(f"compiling the datapath took longer than {COMPILE_TIMEOUT:.0f} s (killed)") from None
    except OSError as exc:
        raise LoadError(f"cannot start the compiler process {sys.executable}: {exc}") from exc
    for line in done.stderr.splitlines():
        log.debug("compiler: %s", line)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        report = json.loads(lines[-1]) if lines else {}
    except ValueError:
        report = {}
    if done.returncode == 0 and report.get("ok"):
        return report
    stderr = [line for line in done.stderr.splitlines() if line.strip()]
    error = report.get("error") or (stderr[-1] if stderr else f"exit status {done.returncode}")
    # bcc's exception names only the file; the compiler's own diagnostics are on stderr
    diagnostics = [line.strip() for line in stderr if "error:" in line and line.strip() not in error][-5:]
    raise LoadError("compiling the datapath failed: " + "\n  ".join([error, *diagnostics]))


def _compile_here(pin_dir: Path, programs: list[str], sizes: Mapping[str, int], bid: str,
                  cache_dir: Path | None = None) -> Loaded:
    """Compile bpf/maps.c (pinning maps in `pin_dir`) and the programs with bcc in this process,
    pin the programs under build `bid`, and store the build in the program cache `cache_dir`."""
    try:
        from bcc import BPF, BPFAttachType  # noqa: PLC0415 (the package imports without bcc)
    except ImportError as exc:
        raise LoadError(f"python bcc not importable ({exc}): install python3-bpfcc") from exc

    if drop_incompatible_pins(pin_dir, sizes):
        shutil.rmtree(pin_dir / PROGS_SUBDIR, ignore_errors=True)  # they use the maps just dropped
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
        _pin_programs(pin_dir, bid, prog_fds)
        if cache_dir is not None:
            compiled = {name: (getattr(BPF, PROGRAMS[name][1]),
                               getattr(BPFAttachType, PROGRAMS[name][2]) if PROGRAMS[name][2] else 0,
                               by_source[PROGRAMS[name][0]].dump_func(name.encode()))
                        for name in programs}
            _store_cached(cache_dir, bid, tables, compiled)
    except Exception as exc:
        for module in modules:
            module.cleanup()
        if isinstance(exc, LoadError):
            raise
        raise LoadError(f"loading the datapath failed: {exc}") from exc
    map_fds = {name: table.get_fd() for name, table in tables.items()}
    return Loaded(pin_dir=pin_dir, tables=tables, prog_fds=prog_fds, map_fds=map_fds, _modules=modules)


def _store_cached(cache_dir: Path, bid: str, tables: Mapping[str, object],
                  compiled: Mapping[str, tuple[int, int, bytes]]) -> None:
    """Put a fresh compile in the program cache; a failure costs the next cold start a compile,
    nothing else, so it is logged, never raised."""
    fds = {name: table.get_fd() for name, table in tables.items()}
    try:
        path = objcache.store(cache_dir, bid, {name: libbpf.map_info(fd) for name, fd in fds.items()}, compiled,
                              {fd: name for name, fd in fds.items()})
    except (objcache.CacheError, OSError) as exc:
        log.warning("build %s not stored in the program cache %s: %s", bid, cache_dir, exc)
        return
    log.info("stored build %s in the program cache: %s", bid, path)


# ---- attachment (network devices: pyroute2, in the caller's chosen netns) ----


def attach_tc(ipr, ifindex: int, ingress_fd: int | None, egress_fd: int | None, tcx: bool | None = None) -> None:
    """Attach the TC programs to `ifindex`'s ingress and egress, replacing ours if present.

    Through tcx where the kernel has it (`tcx` None: tcx_supported()): the programs run without
    cls_bpf's layer around them (~2.9 µs of kernel CPU less per ClusterIP connection on the
    bench's lab, docs/benchmarks/2026-11-28-tcx-ab), and stay attached without an fd, as filters
    do. A program of ours already there (another build, or an older agent's cls_bpf filter) is
    removed only after the new one is in: the old one keeps deciding until then (tcx's verdict
    ends the hook, so cls_bpf behind it is skipped), and no packet meets neither or both.
    Otherwise, direct-action cls_bpf filters on clsact, replaced in place.

    `ipr` is a pyroute2 IPRoute already bound to the device's network namespace. tcx takes the
    device by ifindex in the calling thread's namespace, so it is used only where `ipr` was opened
    there too (IPRoute() from a thread inside that namespace, as devices.Devices does); an
    IPRoute(netns=...) of another namespace gets cls_bpf filters (asking for tcx then raises).
    """
    own_netns = _in_callers_netns(ipr)
    if tcx is None:
        tcx = own_netns and tcx_supported()
    elif tcx and not own_netns:
        raise ValueError(f"tcx attach to ifindex {ifindex}: ipr is bound to netns {ipr.status.get('netns')!r}, "
                         "not the calling thread's: tcx would take the ifindex in the wrong namespace")
    if tcx:
        for attach_type, fd in ((libbpf.ATTACH_TCX_INGRESS, ingress_fd), (libbpf.ATTACH_TCX_EGRESS, egress_fd)):
            if fd is None:
                continue
            new_id, present = libbpf.object_id(fd, "prog"), _ours_on_tcx(ifindex, attach_type)
            if new_id not in present:
                libbpf.prog_attach(fd, ifindex, attach_type)
            for prog_id in present:
                if prog_id != new_id:
                    _tcx_detach_id(ifindex, attach_type, prog_id)
        _remove_filters(ipr, ifindex)
        return
    with contextlib.suppress(Exception):  # clsact may exist already (ours or someone's)
        ipr.tc("add", "clsact", index=ifindex)
    for parent, fd in ((_TC_INGRESS_PARENT, ingress_fd), (_TC_EGRESS_PARENT, egress_fd)):
        if fd is None:
            continue
        ipr.tc("replace-filter", "bpf", index=ifindex, handle=TC_HANDLE, prio=TC_PRIO, protocol=TC_PROTOCOL_ALL,
               fd=fd, name=TC_FILTER_NAMES[parent], parent=parent, classid=1, direct_action=True)


def _in_callers_netns(ipr) -> bool:
    """Whether `ipr` was opened in the calling thread's network namespace (not IPRoute(netns=X))."""
    return not (getattr(ipr, "status", None) or {}).get("netns")


_tcx: bool | None = None


def tcx_supported() -> bool:
    """Whether this kernel attaches SCHED_CLS programs through tcx (Linux 6.6): asked once, of the
    loopback device of the calling thread's netns (a kernel without tcx refuses the query)."""
    global _tcx  # noqa: PLW0603 (one answer per process: the kernel does not change under it)
    if _tcx is None:
        try:
            libbpf.prog_query(1, libbpf.ATTACH_TCX_INGRESS)
            _tcx = True
        except OSError:
            _tcx = False
    return _tcx


# our TC programs by name (bcc names a program after its function): how a fresh process (cleanup,
# a restarted agent, the audit) knows which tcx programs of a device are ours
TC_PROGRAM_NAMES = frozenset({"tc_ingress", "tc_egress", "tc_lo"})
_TCX_NAMES = {libbpf.ATTACH_TCX_INGRESS: TC_FILTER_NAMES[_TC_INGRESS_PARENT],
              libbpf.ATTACH_TCX_EGRESS: TC_FILTER_NAMES[_TC_EGRESS_PARENT]}


def _ours_on_tcx(ifindex: int, attach_type: int) -> list[int]:
    """Ids of our programs on `ifindex`'s tcx hook, in the order they run ([] without tcx)."""
    try:
        ids = libbpf.prog_query(ifindex, attach_type)
    except OSError:
        return []
    return [prog_id for prog_id in ids if _program_name(prog_id) in TC_PROGRAM_NAMES]


def _program_name(prog_id: int) -> str | None:
    """The name of program `prog_id` (how a fresh process knows ours), None when it is gone."""
    try:
        fd = libbpf.prog_fd_by_id(prog_id)
    except OSError:
        return None  # replaced or gone meanwhile
    try:
        return libbpf.prog_info(fd)[0].name.decode()
    finally:
        os.close(fd)


def _tcx_detach_id(ifindex: int, attach_type: int, prog_id: int) -> bool:
    try:
        fd = libbpf.prog_fd_by_id(prog_id)
    except OSError:
        return False  # gone meanwhile
    try:
        libbpf.prog_detach(fd, ifindex, attach_type)
        return True
    except OSError:
        return False  # detached meanwhile
    finally:
        os.close(fd)


def _our_filters(ipr, ifindex: int, parent: str) -> list:
    parent_id = int(parent.replace(":", ""), 16)
    found = []
    for msg in ipr.get_filters(index=ifindex, parent=parent_id):
        options = msg.get("TCA_OPTIONS")
        if msg.get("TCA_KIND") == "bpf" and options is not None and options.get("TCA_BPF_NAME") == TC_FILTER_NAMES[parent]:
            found.append(msg)
    return found


def tc_attached(ipr, ifindex: int) -> list[str]:
    """What of ours is on `ifindex`'s TC hooks: "epx_ingress" and "epx_egress" for each program
    of ours there, through tcx or as a cls_bpf filter (the names the drift audit reports)."""
    found = [_TCX_NAMES[t] for t in _TCX_NAMES for _ in _ours_on_tcx(ifindex, t)] if _in_callers_netns(ipr) else []
    found += [TC_FILTER_NAMES[p] for p in TC_FILTER_NAMES for _ in _our_filters(ipr, ifindex, p)]
    return found


def tc_attached_by_device() -> dict[str, list[str]]:
    """Device name -> tc_attached() of it, for every device of the calling thread's netns: what
    `tc filter show` would say of cls_bpf, for tcx too (which neither tc nor this bpftool lists)."""
    from pyroute2.iproute import IPRoute  # noqa: PLC0415

    with IPRoute() as ipr:
        return {link.get_attr("IFLA_IFNAME"): tc_attached(ipr, link["index"]) for link in ipr.get_links()}


def missing_tc(ipr, ifindex: int, ingress_only: bool = False) -> list[str]:
    """Our TC hooks' names with none of our programs on `ifindex` (somebody detached it): [] when
    both have one (`ingress_only`: the loopback device, which has only tc_lo on ingress)."""
    parents = [_TC_INGRESS_PARENT] if ingress_only else list(TC_FILTER_NAMES)
    attached = tc_attached(ipr, ifindex)
    return [TC_FILTER_NAMES[p] for p in parents if TC_FILTER_NAMES[p] not in attached]


def detach_tc(ipr, ifindex: int) -> int:
    """Remove our programs from `ifindex`'s TC hooks, through tcx and as cls_bpf filters (others'
    stay), and clsact if nothing else uses it.

    Returns how many were removed. Idempotent: a device without them is left as it is.
    """
    removed = 0
    if _in_callers_netns(ipr):  # tcx takes the ifindex in the calling thread's namespace
        for attach_type in _TCX_NAMES:
            for prog_id in _ours_on_tcx(ifindex, attach_type):
                removed += _tcx_detach_id(ifindex, attach_type, prog_id)
    return removed + _remove_filters(ipr, ifindex)


def _remove_filters(ipr, ifindex: int) -> int:
    """Remove our cls_bpf filters from `ifindex` (others' stay), and clsact if nothing else uses
    it. Returns how many were removed."""
    removed = 0
    for parent in TC_FILTER_NAMES:
        for msg in _our_filters(ipr, ifindex, parent):
            info = msg["info"]
            with contextlib.suppress(Exception):  # gone meanwhile
                ipr.tc("del-filter", "bpf", index=ifindex, handle=msg["handle"], prio=info >> 16,
                       protocol=TC_PROTOCOL_ALL, parent=parent)
                removed += 1
    if removed:
        others = [m for parent in TC_FILTER_NAMES for m in ipr.get_filters(index=ifindex, parent=int(parent.replace(":", ""), 16))]
        if not others:
            with contextlib.suppress(Exception):
                ipr.tc("del", "clsact", index=ifindex)
    return removed


# socket-LB program -> the cgroup hook it goes on (pins.CGROUP_PROGRAMS is this very table)
CGROUP_ATTACH = {
    "sock_connect4": libbpf.ATTACH_CGROUP_INET4_CONNECT,
    "sock_sendmsg4": libbpf.ATTACH_CGROUP_UDP4_SENDMSG,
    "sock_recvmsg4": libbpf.ATTACH_CGROUP_UDP4_RECVMSG,
    "sock_connect6": libbpf.ATTACH_CGROUP_INET6_CONNECT,
    "sock_sendmsg6": libbpf.ATTACH_CGROUP_UDP6_SENDMSG,
    "sock_recvmsg6": libbpf.ATTACH_CGROUP_UDP6_RECVMSG,
}


def attach_cgroup(loaded: Loaded, cgroup_dir: Path) -> None:
    """Attach the socket-LB programs to a cgroup v2 directory (and so to every process below it)."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, attach_type in CGROUP_ATTACH.items():
            libbpf.prog_attach(loaded.prog_fds[name], fd, attach_type, libbpf.BPF_F_ALLOW_MULTI)
    finally:
        os.close(fd)


def detach_cgroup(loaded: Loaded, cgroup_dir: Path) -> None:
    """Detach what attach_cgroup attached. Idempotent."""
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, attach_type in CGROUP_ATTACH.items():
            with contextlib.suppress(OSError):
                libbpf.prog_detach(loaded.prog_fds[name], fd, attach_type)
    finally:
        os.close(fd)


def attach_xdp(ipr, ifindex: int, fd: int, mode: str = "generic") -> None:
    ipr.link("set", index=ifindex, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", _XDP_FLAGS[mode])]})


def xdp_program_id(ipr, ifindex: int) -> int:
    """Id of the XDP program on `ifindex` (0: none)."""
    links = ipr.get_links(ifindex)
    xdp = links[0].get("xdp") if links else None
    return (xdp.get("IFLA_XDP_PROG_ID") or 0) if xdp is not None else 0


def xdp_program_is_ours(ipr, ifindex: int) -> bool:
    """Whether `ifindex` carries our XDP program (by program name, any build): what the agent
    attaches in --bpf-xdp-mode generic or native, and what a trace runs before tc_ingress."""
    prog_id = xdp_program_id(ipr, ifindex)
    return bool(prog_id) and _program_name(prog_id) == XDP_PROGRAM_NAME


def detach_xdp(ipr, ifindex: int, mode: str = "generic", only_ours: bool = True) -> bool:
    """Remove the XDP program of `ifindex` (by default only if it is ours, by program name).
    Returns whether one was removed. Idempotent."""
    prog_id = xdp_program_id(ipr, ifindex)
    if not prog_id or (only_ours and _program_name(prog_id) != XDP_PROGRAM_NAME):
        return False
    detached = False
    for flags in (_XDP_FLAGS[mode], *(f for m, f in _XDP_FLAGS.items() if m != mode)):
        with contextlib.suppress(Exception):
            ipr.link("set", index=ifindex, xdp={"attrs": [("IFLA_XDP_FD", -1), ("IFLA_XDP_FLAGS", flags)]})
            detached = True
        if not xdp_program_id(ipr, ifindex):
            break
    return detached
