"""objcache.py without the kernel: relocations, the entry format, and when an entry is refused."""

from __future__ import annotations

import json
import os
import struct

import pytest

from ebpf_proxy.datapath.ebpf import libbpf, objcache


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def ld_map(fd: int, dst: int = 1) -> bytes:
    """`r<dst> = map fd` as bcc emits it: a 64-bit load (two slots) with src_reg 1."""
    return insn(objcache.LD_IMM64, dst, objcache.PSEUDO_MAP_FD, 0, fd) + insn(0, 0, 0, 0, 0)


MOV_R0_0, EXIT = insn(0xB7), insn(0x95)
PROGRAM = MOV_R0_0 + ld_map(7) + MOV_R0_0 + ld_map(9, dst=2) + EXIT  # map refs at slots 1 and 4


def test_relocations_name_every_map_reference():
    assert objcache.relocations(PROGRAM, {7: "epx_svc", 9: "epx_ct4"}) == [(1, "epx_svc"), (4, "epx_ct4")]


def test_the_second_slot_of_a_64_bit_load_is_not_read_as_an_instruction():
    # the upper half of an address can look like anything, even another 64-bit load
    tricky = insn(objcache.LD_IMM64, 1, 0, 0, 5) + insn(objcache.LD_IMM64, 0, objcache.PSEUDO_MAP_FD, 0, 99) + EXIT
    assert objcache.relocations(tricky, {}) == []


def test_code_that_cannot_be_replayed_is_refused():
    with pytest.raises(objcache.CacheError, match="fd 8, not one of the datapath's maps"):
        objcache.relocations(ld_map(8), {7: "epx_svc"})
    map_value = insn(objcache.LD_IMM64, 1, 2, 0, 7) + insn(0)  # BPF_PSEUDO_MAP_VALUE
    with pytest.raises(objcache.CacheError, match="64-bit load of kind 2"):
        objcache.relocations(map_value, {7: "epx_svc"})
    with pytest.raises(objcache.CacheError, match="not a whole number"):
        objcache.relocations(PROGRAM[:-3], {})


def test_relocate_writes_this_process_fds():
    refs = objcache.relocations(PROGRAM, {7: "epx_svc", 9: "epx_ct4"})
    out = objcache.relocate(PROGRAM, refs, {"epx_svc": 31, "epx_ct4": 32})
    assert objcache.relocations(out, {31: "epx_svc", 32: "epx_ct4"}) == refs
    assert len(out) == len(PROGRAM) and out[:8] == PROGRAM[:8] and out[-8:] == EXIT
    with pytest.raises(objcache.CacheError, match="map epx_ct4, which this datapath does not have"):
        objcache.relocate(PROGRAM, refs, {"epx_svc": 31})


def _map(type_=1, key=8, value=16, entries=64, flags=0) -> libbpf.MapInfo:
    return libbpf.MapInfo(type=type_, key_size=key, value_size=value, max_entries=entries, map_flags=flags)


def _store(cache, build="b1"):
    return objcache.store(cache, build, {"epx_svc": _map(), "epx_ct4": _map(entries=128, flags=1)},
                          {"tc_ingress": (3, 0, PROGRAM)}, {7: "epx_svc", 9: "epx_ct4"})


def test_an_entry_round_trips(tmp_path):
    cache = tmp_path / "cache"
    path = _store(cache)
    assert path == objcache.entry_path(cache, "b1") and oct(cache.stat().st_mode & 0o777) == oct(0o700)
    entry = objcache.read(cache, "b1", ["tc_ingress"])
    assert entry["programs"]["tc_ingress"]["insns"] == PROGRAM
    assert entry["programs"]["tc_ingress"]["type"] == 3
    assert entry["maps"]["epx_ct4"] == {"type": 1, "key_size": 8, "value_size": 16, "max_entries": 128, "flags": 1}
    assert objcache.read(cache, "other", ["tc_ingress"]) is None  # a miss, not an error
    assert [p.name for p in cache.iterdir()] == ["b1.json"]  # no temporary file left


@pytest.mark.parametrize("damage, message", [
    (lambda e: e["programs"]["tc_ingress"].update(sha256="0" * 64), "do not match their checksum"),
    (lambda e: e.update(format=0), "not a format-1 entry"),
    (lambda e: e.update(build="b2"), "not a format-1 entry of build b1"),
    (lambda e: e["programs"].pop("tc_ingress"), "has no program tc_ingress"),
])
def test_an_entry_that_cannot_be_used_says_why(tmp_path, damage, message):
    path = _store(tmp_path / "cache")
    entry = json.loads(path.read_text())
    damage(entry)
    path.write_text(json.dumps(entry))
    with pytest.raises(objcache.CacheError, match=message):
        objcache.read(tmp_path / "cache", "b1", ["tc_ingress"])


def test_a_truncated_entry_says_why(tmp_path):
    path = _store(tmp_path / "cache")
    path.write_text(path.read_text()[:100])
    with pytest.raises(objcache.CacheError, match="unreadable"):
        objcache.read(tmp_path / "cache", "b1", ["tc_ingress"])


def test_a_directory_others_can_write_is_not_trusted(tmp_path):
    cache = tmp_path / "cache"
    _store(cache)
    cache.chmod(0o775)
    with pytest.raises(objcache.CacheError, match=r"writable by group or others \(mode 775\)"):
        objcache.read(cache, "b1", ["tc_ingress"])
    with pytest.raises(objcache.CacheError, match="writable by group or others"):
        _store(cache, "b2")


def test_only_the_newest_entries_are_kept(tmp_path):
    cache = tmp_path / "cache"
    for n in range(objcache.KEEP + 3):
        path = _store(cache, f"b{n}")
        os.utime(path, (1000 + n, 1000 + n))
    _store(cache, "b-last")
    kept = {p.stem for p in cache.glob("*.json")}
    assert len(kept) == objcache.KEEP and "b-last" in kept and "b0" not in kept
