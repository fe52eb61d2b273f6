"""loader.py: programs pinned per build, re-opened only while the maps they use are the pinned ones."""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
from pathlib import Path

import pytest

from ebpf_proxy.datapath.ebpf import loader
from tests.bpf.conftest import SMALL_MAPS, TEST_ROOT

pytestmark = [pytest.mark.bpf, pytest.mark.root]

SOME = ("tc_ingress", "tc_egress")


@pytest.fixture
def bpffs():
    TEST_ROOT.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"ld-{os.getpid()}-", dir=TEST_ROOT))
    try:
        loader.mount_bpffs(path)
        yield path
    finally:
        loader.unmount_bpffs(path)
        path.rmdir()
        with contextlib.suppress(OSError):
            TEST_ROOT.rmdir()


def test_build_id_follows_what_programs_depend_on():
    base = loader.build_id(SOME, SMALL_MAPS)
    assert loader.build_id(SOME, SMALL_MAPS) == base
    assert loader.build_id(SOME, {**SMALL_MAPS, "epx_ct4": 2048}) != base
    assert loader.build_id(("tc_ingress",), SMALL_MAPS) != base


def _prog_ids(loaded: loader.Loaded) -> dict[str, int]:
    return {name: loader.libbpf.prog_info(fd)[0].id for name, fd in loaded.prog_fds.items()}


def test_pinned_programs_are_reused_only_with_their_maps(bpffs, tmp_path):
    # One compile: it also fills a program cache, so that the load which must not reuse the pins
    # gets fresh programs from there (no second compile) and still says where they came from.
    cache = tmp_path / "cache"
    first = loader.load(bpffs, SOME, SMALL_MAPS, reuse=True, cache_dir=cache)
    first_ids = _prog_ids(first)
    first.close()
    assert first.compiled and (bpffs / loader.PROGS_SUBDIR / loader.build_id(SOME, SMALL_MAPS)).is_dir()

    again = loader.load(bpffs, SOME, SMALL_MAPS, reuse=True, cache_dir=cache)
    try:
        assert again.source == "pins" and not again.tables
        assert _prog_ids(again) == first_ids
        assert set(again.map_fds) == set(loader.structs.MAPS)
    finally:
        again.close()

    (bpffs / "epx_ct4").unlink()  # a map the programs use is gone: they must not be reused
    third = loader.load(bpffs, SOME, SMALL_MAPS, reuse=True, cache_dir=cache)
    try:
        assert third.source == "cache", "the pinned programs were reused without their map"
        assert not set(_prog_ids(third).values()) & set(first_ids.values()), "new programs, for the new map"
        ct4 = loader.libbpf.obj_get(str(bpffs / "epx_ct4"))  # pinned again, and the programs use it
        try:
            ct4_id = loader.libbpf.map_info(ct4).id
        finally:
            os.close(ct4)
        assert all(ct4_id in loader.libbpf.prog_info(fd)[1] for fd in third.prog_fds.values())
        assert [p.name for p in (bpffs / loader.PROGS_SUBDIR).iterdir()] == [loader.build_id(SOME, SMALL_MAPS)]
    finally:
        third.close()


_AGENT_LIKE = r"""
import json, sys
from pathlib import Path
from ebpf_proxy.datapath.ebpf import loader, libbpf
loaded = loader.load(Path(sys.argv[1]), ("tc_ingress", "tc_egress"), json.loads(sys.argv[2]), reuse=True)
with open("/proc/self/maps") as f:
    mapped = sorted({line.split()[-1] for line in f if "libbcc" in line or "LLVM" in line})
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"compiled": loaded.compiled, "tables": len(loaded.tables), "mapped": mapped,
                  "bcc_imported": "bcc" in sys.modules, "peak_rss_kib": hwm,
                  "prog": libbpf.prog_info(loaded.prog_fds["tc_ingress"])[0].name.decode()}))
"""


def test_the_loading_process_never_maps_llvm(bpffs):
    """The agent's load compiles in a child: the calling process neither imports bcc nor maps
    libbcc/LLVM (PLATFORM.md pitfall 5: ~250 MiB that are never given back)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _AGENT_LIKE, str(bpffs), json.dumps(SMALL_MAPS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["compiled"] and report["prog"] == "tc_ingress"
    assert report["tables"] == 0 and not report["bcc_imported"] and report["mapped"] == []
    assert report["peak_rss_kib"] < 120 * 1024, f"peak RSS {report['peak_rss_kib'] // 1024} MiB"
    assert (bpffs / loader.PROGS_SUBDIR / loader.build_id(SOME, SMALL_MAPS) / "tc_ingress").exists()


def test_a_failed_compile_says_why(bpffs, tmp_path, monkeypatch):
    import shutil

    broken = tmp_path / "bpf"
    shutil.copytree(loader.BPF_SRC_DIR, broken)
    with open(broken / "tc_lb.c", "a") as f:
        f.write('\n#error "broken on purpose by test_loader"\n')
    monkeypatch.setattr(loader, "BPF_SRC_DIR", broken)
    with pytest.raises(loader.LoadError, match="(?s)compiling the datapath failed.*error: \"broken on purpose by test_loader\""):
        loader.load(bpffs, SOME, SMALL_MAPS)
    assert not (bpffs / loader.PROGS_SUBDIR / loader.build_id(SOME, SMALL_MAPS)).exists()


def test_a_pinned_map_of_another_type_is_recreated(bpffs):
    """An upgrade from the LRU connection table: same key, value and capacity, another type. Kept,
    it would evict established connections under pressure and never report a full table."""
    from bcc import BPF

    from ebpf_proxy.datapath.ebpf import libbpf, structs

    pin_dir = bpffs / "ebpf-proxy"
    pin_dir.mkdir()
    ct = pin_dir / "epx_ct4"
    old = BPF(text=f"""
        struct k {{ char b[{ctypes.sizeof(structs.CT4Key)}]; }};
        struct v {{ char b[{ctypes.sizeof(structs.CT4Entry)}]; }};
        BPF_TABLE_PINNED("lru_hash", struct k, struct v, epx_ct4, {SMALL_MAPS["epx_ct4"]}, "{ct}");
    """.encode())
    old.cleanup()
    assert libbpf.pinned_map_info(str(ct)).type == structs.MAP_TYPES["lru_hash"]
    assert loader.drop_incompatible_pins(pin_dir, SMALL_MAPS) == ["epx_ct4"]
    assert not ct.exists()
    loaded = loader.load(pin_dir, programs=(), max_entries=SMALL_MAPS, in_process=True)
    try:
        assert libbpf.pinned_map_info(str(ct)).type == structs.MAP_TYPES["hash"]
    finally:
        loaded.close()
