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

LIBBPF_SONAMES = ("libbpf.so.1", "libbpf.so")

# enum bpf_prog_type / enum bpf_attach_type (include/uapi/linux/bpf.h): stable kernel ABI.
PROG_TYPE_SOCKET_FILTER = 1
PROG_TYPE_SCHED_CLS = 3
PROG_TYPE_XDP = 6
PROG_TYPE_CGROUP_SOCK_ADDR = 18
ATTACH_CGROUP_INET4_CONNECT = 10
ATTACH_CGROUP_UDP4_SENDMSG = 14
ATTACH_CGROUP_UDP4_RECVMSG = 19
BPF_F_ALLOW_MULTI = 2  # other programs (another agent's, systemd's) may share the cgroup


class LibbpfMissing(RuntimeError):
    """libbpf.so.1 is not installed (Debian package `libbpf1`, pulled in by `libbpf-dev`)."""


class _ProgLoadOpts(ctypes.Structure):
    # struct bpf_prog_load_opts, up to expected_attach_type.
    _fields_ = [("sz", ctypes.c_size_t), ("attempts", ctypes.c_int), ("expected_attach_type", ctypes.c_uint32)]


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
        handle.libbpf_num_possible_cpus.restype = ctypes.c_int
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


def obj_get(path: str) -> int:
    """Open a pinned object; returns its fd (caller closes it). Raises OSError."""
    fd = lib().bpf_obj_get(path.encode())
    if fd < 0:
        raise _error(fd)
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
