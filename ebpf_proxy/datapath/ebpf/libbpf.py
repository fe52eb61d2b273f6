"""The one ctypes binding of libbpf (Debian `libbpf1`): what bcc does not expose.

bcc compiles and loads our programs, but it has no wrapper for `BPF_PROG_TEST_RUN` and loading a
two-instruction program through it would need a compile. libbpf's stable low-level API
(`bpf_prog_load`, `bpf_prog_test_run_opts`) fills both gaps: the kernel feature probe loads
trivial programs with it, and `testrun.py` runs compiled programs on crafted packets.
Only the fields we use are declared; libbpf accepts a shorter `sz` (the rest reads as zero).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import struct
from pathlib import Path

LIBBPF_SONAMES = ("libbpf.so.1", "libbpf.so")

# enum bpf_prog_type / enum bpf_attach_type (include/uapi/linux/bpf.h): stable kernel ABI.
PROG_TYPE_SOCKET_FILTER = 1
PROG_TYPE_SCHED_CLS = 3
PROG_TYPE_XDP = 6
PROG_TYPE_CGROUP_SOCK_ADDR = 18
ATTACH_CGROUP_INET4_CONNECT = 10
ATTACH_CGROUP_UDP4_SENDMSG = 14
ATTACH_CGROUP_UDP4_RECVMSG = 19
ATTACH_CGROUP_INET6_CONNECT = 11
ATTACH_CGROUP_UDP6_SENDMSG = 15
ATTACH_CGROUP_UDP6_RECVMSG = 20
ATTACH_TCX_INGRESS = 46  # tcx (Linux 6.6): SCHED_CLS programs on a device's hook without cls_bpf
ATTACH_TCX_EGRESS = 47
BPF_F_ALLOW_MULTI = 2  # other programs (another agent's, systemd's) may share the cgroup
LINK_TYPE_CGROUP = 3  # enum bpf_link_type
BPF_OBJ_NAME_LEN = 16
BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type


class LibbpfMissing(RuntimeError):
    """libbpf.so.1 is not installed (Debian package `libbpf1`, pulled in by `libbpf-dev`)."""


class _ProgLoadOpts(ctypes.Structure):
    # struct bpf_prog_load_opts, up to expected_attach_type.
    _fields_ = [("sz", ctypes.c_size_t), ("attempts", ctypes.c_int), ("expected_attach_type", ctypes.c_uint32)]


class _MapCreateOpts(ctypes.Structure):
    # struct bpf_map_create_opts, up to map_extra.
    _fields_ = [("sz", ctypes.c_size_t), ("btf_fd", ctypes.c_uint32), ("btf_key_type_id", ctypes.c_uint32),
                ("btf_value_type_id", ctypes.c_uint32), ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("inner_map_fd", ctypes.c_uint32), ("map_flags", ctypes.c_uint32), ("map_extra", ctypes.c_uint64)]


class MapInfo(ctypes.Structure):
    """struct bpf_map_info, up to `name` (the kernel fills as much as we give room for)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class ProgInfo(ctypes.Structure):
    """struct bpf_prog_info, up to `run_cnt`: enough to tell our programs and their maps apart,
    and what they cost while BPF statistics are on (enable_stats). The pointer fields other than
    map_ids stay 0, so the kernel fills none of their arrays."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),
        ("ifindex", ctypes.c_uint32),
        ("gpl_compatible", ctypes.c_uint32),  # a 1-bit field and 31 bits of padding
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("nr_jited_ksyms", ctypes.c_uint32),
        ("nr_jited_func_lens", ctypes.c_uint32),
        ("jited_ksyms", ctypes.c_uint64),
        ("jited_func_lens", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("func_info", ctypes.c_uint64),
        ("nr_func_info", ctypes.c_uint32),
        ("nr_line_info", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64),
        ("jited_line_info", ctypes.c_uint64),
        ("nr_jited_line_info", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("jited_line_info_rec_size", ctypes.c_uint32),
        ("nr_prog_tags", ctypes.c_uint32),
        ("prog_tags", ctypes.c_uint64),
        ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64),
    ]


class LinkInfo(ctypes.Structure):
    """struct bpf_link_info, with the cgroup member of its union (the only link kind we make)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("cgroup_id", ctypes.c_uint64),
        ("attach_type", ctypes.c_uint32),
        ("pad2", ctypes.c_uint32),
    ]


class TestRunOpts(ctypes.Structure):
    """struct bpf_test_run_opts (libbpf 1.x, bpf/bpf.h), every field: the kernel fills several."""

    __test__ = False  # not a pytest class
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


@functools.cache
def lib() -> ctypes.CDLL:
    """Load libbpf once; raise LibbpfMissing naming the Debian package when it is absent."""
    names = list(LIBBPF_SONAMES)
    found = ctypes.util.find_library("bpf")
    if found:
        names.append(found)
    for name in names:
        try:
            handle = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        handle.bpf_prog_load.restype = ctypes.c_int
        handle.bpf_prog_load.argtypes = [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(_ProgLoadOpts),
        ]
        handle.bpf_map_create.restype = ctypes.c_int
        handle.bpf_map_create.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32,
                                          ctypes.c_uint32, ctypes.POINTER(_MapCreateOpts)]
        handle.bpf_obj_get.restype = ctypes.c_int
        handle.bpf_obj_get.argtypes = [ctypes.c_char_p]
        handle.bpf_obj_get_info_by_fd.restype = ctypes.c_int
        handle.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
        for fn in ("bpf_map_update_elem",):
            getattr(handle, fn).restype = ctypes.c_int
            getattr(handle, fn).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        for fn in ("bpf_map_lookup_elem", "bpf_map_get_next_key"):
            getattr(handle, fn).restype = ctypes.c_int
            getattr(handle, fn).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        handle.bpf_map_delete_elem.restype = ctypes.c_int
        handle.bpf_map_delete_elem.argtypes = [ctypes.c_int, ctypes.c_void_p]
        handle.bpf_prog_attach.restype = ctypes.c_int
        handle.bpf_prog_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint]
        handle.bpf_prog_detach2.restype = ctypes.c_int
        handle.bpf_prog_detach2.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        handle.bpf_link_create.restype = ctypes.c_int
        handle.bpf_link_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        handle.bpf_link_update.restype = ctypes.c_int
        handle.bpf_link_update.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        handle.bpf_link_detach.restype = ctypes.c_int
        handle.bpf_link_detach.argtypes = [ctypes.c_int]
        handle.bpf_obj_pin.restype = ctypes.c_int
        handle.bpf_obj_pin.argtypes = [ctypes.c_int, ctypes.c_char_p]
        for fn in ("bpf_prog_get_fd_by_id", "bpf_map_get_fd_by_id", "bpf_link_get_fd_by_id"):
            getattr(handle, fn).restype = ctypes.c_int
            getattr(handle, fn).argtypes = [ctypes.c_uint32]
        for fn in ("bpf_prog_get_next_id", "bpf_map_get_next_id", "bpf_link_get_next_id"):
            getattr(handle, fn).restype = ctypes.c_int
            getattr(handle, fn).argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
        handle.bpf_map_update_batch.restype = ctypes.c_int
        handle.bpf_map_update_batch.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p,
        ]
        handle.bpf_map_lookup_batch.restype = ctypes.c_int
        handle.bpf_map_lookup_batch.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p,
        ]
        handle.bpf_prog_query.restype = ctypes.c_int
        handle.bpf_prog_query.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ]
        handle.libbpf_num_possible_cpus.restype = ctypes.c_int
        handle.bpf_enable_stats.restype = ctypes.c_int
        handle.bpf_enable_stats.argtypes = [ctypes.c_int]
        handle.bpf_prog_test_run_opts.restype = ctypes.c_int
        handle.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(TestRunOpts)]
        return handle
    raise LibbpfMissing("libbpf.so.1 not found: install the Debian package libbpf1 (apt-get install libbpf-dev)")


def _error(ret: int) -> OSError:
    # libbpf 1.x returns -errno and also sets errno.
    code = -ret if ret < 0 else ctypes.get_errno() or errno.EINVAL
    return OSError(code, f"{os.strerror(code)}")


def return_constant_program(value: int) -> bytes:
    """Two instructions: `r0 = value; exit`. The smallest program every program type accepts."""
    mov_r0_imm = struct.pack("<BBhi", 0xB7, 0, 0, value)  # BPF_ALU64 | BPF_MOV | BPF_K, dst r0
    exit_insn = struct.pack("<BBhi", 0x95, 0, 0, 0)  # BPF_JMP | BPF_EXIT
    return mov_r0_imm + exit_insn


def prog_load(prog_type: int, insns: bytes, expected_attach_type: int = 0, name: str = "epx_probe") -> int:
    """Load raw instructions; returns the program fd (caller closes it). Raises OSError(errno)."""
    opts = _ProgLoadOpts(sz=ctypes.sizeof(_ProgLoadOpts), attempts=0, expected_attach_type=expected_attach_type)
    buf = ctypes.create_string_buffer(insns, len(insns))
    ret = lib().bpf_prog_load(prog_type, name.encode(), b"GPL", buf, len(insns) // 8, ctypes.byref(opts))
    if ret < 0:
        raise _error(ret)
    return ret


def map_create(map_type: int, name: str, key_size: int, value_size: int, max_entries: int, flags: int = 0) -> int:
    """Create a map (no BTF); returns its fd (caller closes it). Raises OSError(errno)."""
    opts = _MapCreateOpts(sz=ctypes.sizeof(_MapCreateOpts), map_flags=flags)
    ret = lib().bpf_map_create(map_type, name.encode()[: BPF_OBJ_NAME_LEN - 1], key_size, value_size, max_entries,
                               ctypes.byref(opts))
    if ret < 0:
        raise _error(ret)
    return ret


def prog_test_run(prog_fd: int, opts: TestRunOpts) -> None:
    """Call bpf_prog_test_run_opts; the kernel writes its results into `opts`. Raises OSError."""
    opts.sz = ctypes.sizeof(TestRunOpts)
    ret = lib().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts))
    if ret < 0:
        raise _error(ret)


def pinned_map_info(path: str) -> MapInfo:
    """Key/value sizes, type and capacity of the map pinned at `path`. Raises OSError."""
    fd = lib().bpf_obj_get(path.encode())
    if fd < 0:
        raise _error(fd)
    try:
        info = MapInfo()
        size = ctypes.c_uint32(ctypes.sizeof(info))
        ret = lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size))
        if ret < 0:
            raise _error(ret)
        return info
    finally:
        os.close(fd)


def _info_by_fd(fd: int, info: ctypes.Structure) -> None:
    size = ctypes.c_uint32(ctypes.sizeof(info))
    ret = lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size))
    if ret < 0:
        raise _error(ret)


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    _info_by_fd(fd, info)
    return info


def prog_info(fd: int) -> tuple[ProgInfo, list[int]]:
    """A program's info and the ids of the maps it uses. Raises OSError."""
    info = ProgInfo()
    _info_by_fd(fd, info)
    count = info.nr_map_ids
    ids = (ctypes.c_uint32 * max(count, 1))()
    info = ProgInfo(nr_map_ids=count, map_ids=ctypes.addressof(ids))
    _info_by_fd(fd, info)
    return info, list(ids[: min(count, info.nr_map_ids)])


def prog_run_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt): the nanoseconds a program has run and how many times, counted by
    the kernel only while BPF statistics are on (enable_stats). Raises OSError."""
    info = ProgInfo()
    _info_by_fd(fd, info)
    return info.run_time_ns, info.run_cnt


def enable_stats() -> int:
    """Turn on the kernel's BPF run-time statistics (BPF_ENABLE_STATS, BPF_STATS_RUN_TIME) until
    the returned fd is closed: the kernel then counts every program's runs and time (at a small
    cost per run), and stops by itself when the last holder closes, so a crash leaves nothing on,
    unlike the kernel.bpf_stats_enabled sysctl. Raises OSError."""
    fd = lib().bpf_enable_stats(BPF_STATS_RUN_TIME)
    if fd < 0:
        raise _error(fd)
    return fd


def link_info(fd: int) -> LinkInfo:
    info = LinkInfo()
    _info_by_fd(fd, info)
    return info


def prog_fd_by_id(prog_id: int) -> int:
    """Open a loaded program by id; returns its fd (caller closes it). Raises OSError."""
    fd = lib().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        raise _error(fd)
    return fd


def link_fd_by_id(link_id: int) -> int:
    """Open a link by id; returns its fd (caller closes it). Raises OSError."""
    fd = lib().bpf_link_get_fd_by_id(link_id)
    if fd < 0:
        raise _error(fd)
    return fd


def obj_pin(fd: int, path: str) -> None:
    ret = lib().bpf_obj_pin(fd, path.encode())
    if ret < 0:
        raise _error(ret)


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """Attach through a BPF link (it lives while an fd or a pin holds it); returns the link fd."""
    fd = lib().bpf_link_create(prog_fd, target_fd, attach_type, None)
    if fd < 0:
        raise _error(fd)
    return fd


def link_update(link_fd: int, prog_fd: int) -> None:
    """Swap the program behind a link atomically (no moment without a program)."""
    ret = lib().bpf_link_update(link_fd, prog_fd, None)
    if ret < 0:
        raise _error(ret)


def link_detach(link_fd: int) -> None:
    ret = lib().bpf_link_detach(link_fd)
    if ret < 0:
        raise _error(ret)


OBJECT_KINDS = ("prog", "map", "link")


def object_ids(kind: str) -> set[int]:
    """Ids of every BPF object of `kind` (prog, map or link) loaded on this machine, whoever made
    it (bpftool's `prog/map/link list`, without bpftool). Raises OSError, ValueError for a kind."""
    if kind not in OBJECT_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(OBJECT_KINDS)}")
    next_id = getattr(lib(), f"bpf_{kind}_get_next_id")
    ids, current, found = set(), 0, ctypes.c_uint32(0)
    while True:
        ret = next_id(current, ctypes.byref(found))
        if ret < 0:
            err = _error(ret)
            if err.errno == errno.ENOENT:  # past the last one
                return ids
            raise err
        current = found.value
        ids.add(current)


def object_kind(fd: int) -> str | None:
    """What a BPF object fd refers to (prog, map or link), from /proc/self/fdinfo; None if none."""
    try:
        text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except OSError:
        return None
    for kind in OBJECT_KINDS:
        if f"\n{kind}_type:" in text or text.startswith(f"{kind}_type:"):
            return kind
    return None


def object_id(fd: int, kind: str) -> int:
    """The id of the `kind` object behind `fd` (kind as object_kind says). Raises OSError."""
    info = {"prog": ProgInfo, "map": MapInfo, "link": LinkInfo}[kind]()
    _info_by_fd(fd, info)
    return info.id


BPF_F_QUERY_EFFECTIVE = 1  # include/uapi/linux/bpf.h: what runs there, ancestors' programs included


def prog_query(target_fd: int, attach_type: int, query_flags: int = 0) -> list[int]:
    """Ids of the programs attached to `target_fd` (a cgroup; for tcx, a device's ifindex in the
    caller's netns) for `attach_type` (with BPF_F_QUERY_EFFECTIVE: every program that runs for it),
    in the order they run. Raises OSError."""
    ids = (ctypes.c_uint32 * 64)()
    count = ctypes.c_uint32(len(ids))
    flags = ctypes.c_uint32(0)
    ret = lib().bpf_prog_query(target_fd, attach_type, query_flags, ctypes.byref(flags), ids, ctypes.byref(count))
    if ret < 0:
        raise _error(ret)
    return list(ids[: count.value])


def obj_get(path: str) -> int:
    """Open a pinned object; returns its fd (caller closes it). Raises OSError."""
    fd = lib().bpf_obj_get(path.encode())
    if fd < 0:
        raise _error(fd)
    return fd


BPF_F_RDONLY = 1 << 3  # include/uapi/linux/bpf.h: the fd may read the map, not write it


class _ObjGetOpts(ctypes.Structure):
    # struct bpf_obj_get_opts (libbpf >= 0.8): sz, file_flags; later members read as zero.
    _fields_ = [("sz", ctypes.c_size_t), ("file_flags", ctypes.c_uint32)]


def obj_get_readonly(path: str) -> int:
    """Open a pinned map for reading only (BPF_F_RDONLY: writes through the fd fail). Raises OSError
    (with the path as its filename)."""
    opts = _ObjGetOpts(sz=ctypes.sizeof(_ObjGetOpts), file_flags=BPF_F_RDONLY)
    fd = lib().bpf_obj_get_opts(path.encode(), ctypes.byref(opts))
    if fd < 0:
        code = -fd
        raise OSError(code, os.strerror(code), path)
    return fd


def num_possible_cpus() -> int:
    """Per-CPU map values hold one slot per possible CPU."""
    n = lib().libbpf_num_possible_cpus()
    if n < 0:
        raise _error(n)
    return n


BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2


def map_update(fd: int, key: ctypes._CData, value: ctypes._CData, flags: int = BPF_ANY) -> None:
    ret = lib().bpf_map_update_elem(fd, ctypes.addressof(key), ctypes.addressof(value), flags)
    if ret < 0:
        raise _error(ret)


class BatchError(OSError):
    """A BPF_MAP_UPDATE_BATCH stopped at an entry: the `done` entries before it were written, in
    order, and none after it."""

    def __init__(self, code: int, done: int) -> None:
        super().__init__(code, os.strerror(code))
        self.done = done


def map_update_batch(fd: int, keys: bytes, values: bytes, count: int) -> None:
    """Write `count` entries in one syscall (BPF_MAP_UPDATE_BATCH, kernel >= 5.6; flags BPF_ANY):
    `keys` and `values` are the entries' packed structs, back to back. The kernel writes them in
    order, each as a single update would (a program sees each entry appear in turn), and stops at
    the first that fails: BatchError says how many went in. EINVAL/EOPNOTSUPP/ENOTSUPP: the map
    type cannot batch (callers then write one by one)."""
    n = ctypes.c_uint32(count)
    ret = lib().bpf_map_update_batch(fd, keys, values, ctypes.byref(n), None)
    if ret < 0:
        err = _error(ret)
        raise BatchError(err.errno, min(n.value, count))


def map_lookup(fd: int, key: ctypes._CData, value: ctypes._CData) -> bool:
    """Fill `value` from the map; False when the key is absent."""
    ret = lib().bpf_map_lookup_elem(fd, ctypes.addressof(key), ctypes.addressof(value))
    if ret < 0:
        if -ret == errno.ENOENT:
            return False
        raise _error(ret)
    return True


def map_delete(fd: int, key: ctypes._CData) -> bool:
    """Delete a key; False when it was absent."""
    ret = lib().bpf_map_delete_elem(fd, ctypes.addressof(key))
    if ret < 0:
        if -ret == errno.ENOENT:
            return False
        raise _error(ret)
    return True


def map_count_batched(fd: int, key_size: int, value_size: int, chunk: int = 4096) -> int:
    """Entries of a hash map, read `chunk` at a time (BPF_MAP_LOOKUP_BATCH): a few syscalls where a
    key walk makes one per entry. Raises OSError (EINVAL/EOPNOTSUPP: the map type cannot batch)."""
    keys = ctypes.create_string_buffer(key_size * chunk)
    values = ctypes.create_string_buffer(value_size * chunk)
    token_in = None
    token_out = ctypes.create_string_buffer(max(key_size, 8))
    total = 0
    while True:
        count = ctypes.c_uint32(chunk)
        ret = lib().bpf_map_lookup_batch(fd, token_in, token_out, keys, values, ctypes.byref(count), None)
        total += count.value
        if ret < 0:
            if -ret == errno.ENOENT:  # the last batch
                return total
            raise _error(ret)
        token_in = ctypes.create_string_buffer(token_out.raw, len(token_out.raw))


def map_batches(fd: int, key_type: type, value_type: type, chunk: int = 4096):
    """A hash map's entries `chunk` at a time (BPF_MAP_LOOKUP_BATCH): yields (keys, values, n) with
    ctypes arrays that the next batch overwrites (copy what you keep). Raises OSError
    (EINVAL/EOPNOTSUPP: the map type cannot batch). A map written meanwhile yields each entry at
    most once, as a key walk does."""
    keys = (key_type * chunk)()
    values = (value_type * chunk)()
    token_in = None
    token_out = ctypes.create_string_buffer(max(ctypes.sizeof(key_type), 8))
    while True:
        count = ctypes.c_uint32(chunk)
        ret = lib().bpf_map_lookup_batch(fd, token_in, token_out, keys, values, ctypes.byref(count), None)
        if ret < 0 and -ret != errno.ENOENT:
            raise _error(ret)
        if count.value:
            yield keys, values, count.value
        if ret < 0:  # ENOENT: that was the last batch
            return
        token_in = ctypes.create_string_buffer(token_out.raw, len(token_out.raw))


def map_items_batched(fd: int, key_type: type, value_type: type, chunk: int = 4096):
    """Every (key, value) of a hash map, read `chunk` per syscall (see map_batches), as fresh ctypes
    objects of `key_type` and `value_type` (as a key walk gives them)."""
    return batch_items(map_batches(fd, key_type, value_type, chunk), key_type, value_type)


def batch_items(batches, key_type: type, value_type: type):
    """The (key, value) entries of (keys, values, n) batches of ctypes arrays of `key_type` and
    `value_type` (map_batches'), each copied into fresh ctypes objects that outlive the batch."""
    copy_key = key_type.from_buffer_copy if issubclass(key_type, ctypes.Structure) else key_type
    copy_value = value_type.from_buffer_copy if issubclass(value_type, ctypes.Structure) else value_type
    for keys, values, n in batches:
        for i in range(n):
            yield copy_key(keys[i]), copy_value(values[i])


def map_next_key(fd: int, key: ctypes._CData | None, next_key: ctypes._CData) -> bool:
    """Fill `next_key` with the key after `key` (the first one for None); False at the end."""
    ret = lib().bpf_map_get_next_key(fd, ctypes.addressof(key) if key is not None else None, ctypes.addressof(next_key))
    if ret < 0:
        if -ret == errno.ENOENT:
            return False
        raise _error(ret)
    return True


def prog_attach(prog_fd: int, target_fd: int, attach_type: int, flags: int = 0) -> None:
    ret = lib().bpf_prog_attach(prog_fd, target_fd, attach_type, flags)
    if ret < 0:
        raise _error(ret)


def prog_detach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    ret = lib().bpf_prog_detach2(prog_fd, target_fd, attach_type)
    if ret < 0:
        raise _error(ret)
