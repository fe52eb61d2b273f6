"""The node's cache of compiled programs: a cold start loads bytecode instead of running the compiler.

A bcc compile costs 4-5 s of CPU (and, in the child that runs it, ~250 MiB) on every start that
finds no pinned programs of its build: after a reboot, on a new node, after `cleanup`. The
bytecode bcc produces for one build id (loader.build_id: sources, map capacities, program list,
kernel release) is always the same, except for one thing: the programs name their maps by file
descriptor (bpf/lib/maps.h: `bpf_pseudo_fd(1, EPX_FD_<map>)`, a 64-bit load whose immediate is
the fd). So the compiler stores, per build, each program's instructions with those immediates
replaced by the map's name (a relocation), plus every map's shape; a later start with the same
build id creates or re-opens the pinned maps, writes its own fds into the relocations and hands
the instructions to the kernel with bpf_prog_load. The kernel's verifier checks them exactly as
it checks a fresh compile: the cache saves the compiler, never the verification.

Nothing here imports bcc. The cache is a directory of `<build id>.json` files, written atomically
and only trusted when root owns the directory and nobody else can write to it (whoever can write
there chooses the code the kernel runs). Any problem with an entry (unreadable, another format, a
checksum mismatch, a load the kernel refuses) is a cache miss with its reason: the caller compiles
with bcc as before and replaces the entry. The KEEP most recently written entries are kept.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf

log = logging.getLogger(__name__)

FORMAT = 1
KEEP = 8  # entries kept: an upgrade's old build, other map sizes; the oldest go first
INSN_SIZE = 8
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
PSEUDO_MAP_FD = 1  # src_reg of a 64-bit load whose immediate is a map fd


class CacheError(Exception):
    """An entry that cannot be used (the message says why); the caller compiles instead."""


def entry_path(cache_dir: Path, build: str) -> Path:
    return cache_dir / f"{build}.json"


# ---- relocations --------------------------------------------------------------------------------

def relocations(insns: bytes, map_names_by_fd: Mapping[int, str]) -> list[tuple[int, str]]:
    """(instruction index, map name) of every map reference in `insns`. Raises CacheError for
    anything else the instructions refer to by a process-local number (map values, BTF ids,
    other programs): such code cannot be replayed in another process."""
    if len(insns) % INSN_SIZE:
        raise CacheError(f"{len(insns)} bytes of instructions is not a whole number of instructions")
    out = []
    index = 0
    while index < len(insns) // INSN_SIZE:
        code, regs, _off, imm = struct.unpack_from("<BBhi", insns, index * INSN_SIZE)
        if code == LD_IMM64:
            src = regs >> 4
            if src == PSEUDO_MAP_FD:
                if imm not in map_names_by_fd:
                    raise CacheError(f"instruction {index} refers to fd {imm}, not one of the datapath's maps")
                out.append((index, map_names_by_fd[imm]))
            elif src:
                raise CacheError(f"instruction {index} is a 64-bit load of kind {src}, which the cache cannot relocate")
            index += 2
        else:
            index += 1
    return out


def relocate(insns: bytes, refs: Iterable[tuple[int, str]], map_fds: Mapping[str, int]) -> bytes:
    """`insns` with each reference's immediate set to this process's fd of the named map."""
    out = bytearray(insns)
    for index, name in refs:
        if name not in map_fds:
            raise CacheError(f"instruction {index} refers to map {name}, which this datapath does not have")
        struct.pack_into("<i", out, index * INSN_SIZE + 4, map_fds[name])
    return bytes(out)


# ---- the directory ----------------------------------------------------------------------------------

def _check_trusted(cache_dir: Path) -> None:
    info = cache_dir.stat()
    if info.st_uid != os.geteuid():
        raise CacheError(f"{cache_dir} is owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}: "
                         "not trusted (whoever writes there chooses the code the kernel runs)")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(f"{cache_dir} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): "
                         "not trusted (whoever writes there chooses the code the kernel runs)")


def store(cache_dir: Path, build: str, maps: Mapping[str, libbpf.MapInfo],
          programs: Mapping[str, tuple[int, int, bytes]], map_names_by_fd: Mapping[int, str]) -> Path:
    """Write the entry of `build`: every map's shape and, per program name, (prog type, expected
    attach type, instructions as compiled). Creates `cache_dir` (mode 0700). Raises CacheError or
    OSError; an entry is either whole or absent (written to a temporary file, then renamed)."""
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_trusted(cache_dir)
    entry = {
        "format": FORMAT,
        "build": build,
        "kernel": os.uname().release,
        "maps": {name: {"type": info.type, "key_size": info.key_size, "value_size": info.value_size,
                        "max_entries": info.max_entries, "flags": info.map_flags}
                 for name, info in sorted(maps.items())},
        "programs": {name: {"type": prog_type, "attach_type": attach_type,
                            "sha256": hashlib.sha256(insns).hexdigest(),
                            "insns": base64.b64encode(insns).decode(),
                            "maps": relocations(insns, map_names_by_fd)}
                     for name, (prog_type, attach_type, insns) in sorted(programs.items())},
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{build}.", suffix=".tmp", dir=cache_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, entry_path(cache_dir, build))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _prune(cache_dir)
    return entry_path(cache_dir, build)


def _prune(cache_dir: Path) -> None:
    """Keep the KEEP newest entries (by the time they were last written)."""
    entries = sorted(cache_dir.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()


def read(cache_dir: Path, build: str, programs: Iterable[str]) -> dict | None:
    """The entry of `build` with at least `programs`, or None when there is none. Raises
    CacheError when there is one that cannot be used."""
    path = entry_path(cache_dir, build)
    if not path.exists():
        return None
    _check_trusted(cache_dir)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: unreadable ({exc})") from None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("build") != build:
        raise CacheError(f"{path}: not a format-{FORMAT} entry of build {build}")
    missing = [name for name in programs if name not in entry.get("programs", {})]
    if missing:
        raise CacheError(f"{path}: has no program {', '.join(missing)}")
    for name, prog in entry["programs"].items():
        prog["insns"] = base64.b64decode(prog["insns"])
        if hashlib.sha256(prog["insns"]).hexdigest() != prog["sha256"]:
            raise CacheError(f"{path}: program {name}: instructions do not match their checksum")
    return entry


# ---- loading from an entry ------------------------------------------------------------------------------

def open_or_create_maps(pin_dir: Path, maps: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """This process's fds of the entry's maps: the pinned map where one is pinned (the caller has
    already removed pins of another shape), else a new map, pinned (what bpf/maps.c does when bcc
    compiles it; the maps get no BTF, which nothing here reads). Caller closes the fds."""
    fds: dict[str, int] = {}
    try:
        for name, shape in maps.items():
            pin = str(pin_dir / name)
            try:
                fds[name] = libbpf.obj_get(pin)
                continue
            except FileNotFoundError:
                pass
            fd = libbpf.map_create(shape["type"], name, shape["key_size"], shape["value_size"],
                                   shape["max_entries"], shape["flags"])
            try:
                libbpf.obj_pin(fd, pin)
            except FileExistsError:  # another process pinned it meanwhile: use theirs
                os.close(fd)
                fd = libbpf.obj_get(pin)
            fds[name] = fd
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def load_programs(entry: Mapping, programs: Iterable[str], map_fds: Mapping[str, int]) -> dict[str, int]:
    """Load each program of the entry with this process's map fds; returns their fds (caller
    closes them). Raises CacheError naming the program the kernel refused."""
    prog_fds: dict[str, int] = {}
    try:
        for name in programs:
            prog = entry["programs"][name]
            insns = relocate(prog["insns"], prog["maps"], map_fds)
            try:
                prog_fds[name] = libbpf.prog_load(prog["type"], insns, prog["attach_type"], name=name)
            except OSError as exc:
                raise CacheError(f"the kernel refused cached program {name}: {exc}") from None
    except BaseException:
        for fd in prog_fds.values():
            os.close(fd)
        raise
    return prog_fds
