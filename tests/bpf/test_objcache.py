"""The program cache (objcache.py) with the real compiler and the real kernel: a cold start on a
fresh bpffs loads the build the compiler stored, the kernel gets the very same code, and any
entry that cannot be used costs a compile, never a broken datapath."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ebpf_proxy.datapath.ebpf import libbpf, loader, objcache
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps
from tests.bpf import world as w
from tests.bpf.conftest import SMALL_MAPS
from tests.bpf.packets import TC_ACT_OK, assert_checksums_valid, endpoints, run, tcp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

PROGRAMS = tuple(loader.PROGRAMS)  # every program: all three sources, every program type


def _tags(loaded: loader.Loaded) -> dict[str, tuple[bytes, int]]:
    """Per program, the kernel's tag (a hash of the verified code with map fds left out) and
    the verified length: equal tags mean the kernel runs the same instructions."""
    out = {}
    for name, fd in loaded.prog_fds.items():
        info, _maps = libbpf.prog_info(fd)
        out[name] = (bytes(info.tag), info.xlated_prog_len)
    return out


@pytest.fixture(scope="module")
def compiled(tmp_bpffs_factory, tmp_path_factory):
    """One compile (in the child, as the agent does) that fills a fresh cache."""
    cache = tmp_path_factory.mktemp("cache")
    bpffs = tmp_bpffs_factory("oc-compile")
    start = time.monotonic()
    loaded = loader.load(bpffs, PROGRAMS, SMALL_MAPS, reuse=True, cache_dir=cache)
    seconds = time.monotonic() - start
    yield cache, loaded, seconds
    loaded.close()


def test_a_compile_stores_its_build(compiled):
    cache, loaded, _ = compiled
    assert loaded.source == "compiler"
    entry = objcache.read(cache, loader.build_id(PROGRAMS, {**loader.MAX_ENTRIES, **SMALL_MAPS}), PROGRAMS)
    assert entry is not None and set(entry["programs"]) == set(PROGRAMS)
    assert set(entry["maps"]) == set(loader.structs.MAPS)
    # every program reaches its maps through relocations only (map fds are process-local)
    assert all(prog["maps"] for prog in entry["programs"].values())
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)


def test_a_cold_start_loads_the_same_code_from_the_cache(compiled, tmp_bpffs_factory):
    cache, first, compile_seconds = compiled
    bpffs = tmp_bpffs_factory("oc-cold")  # nothing pinned: a node after a reboot
    start = time.monotonic()
    again = loader.load(bpffs, PROGRAMS, SMALL_MAPS, reuse=True, cache_dir=cache)
    seconds = time.monotonic() - start
    try:
        assert again.source == "cache" and not again.compiled
        assert _tags(again) == _tags(first)
        # the maps were created and pinned as bpf/maps.c would, with the same shapes
        for name in loader.structs.MAPS:
            a, b = libbpf.map_info(first.map_fds[name]), libbpf.map_info(again.map_fds[name])
            assert (a.type, a.key_size, a.value_size, a.max_entries, a.map_flags) == \
                   (b.type, b.key_size, b.value_size, b.max_entries, b.map_flags), name
            assert a.id != b.id  # a map of its own, not the first bpffs's
        assert (bpffs / loader.PROGS_SUBDIR / loader.build_id(PROGRAMS, {**loader.MAX_ENTRIES, **SMALL_MAPS})).is_dir()
    finally:
        again.close()
    print(f"\ncold start: compile {compile_seconds:.2f} s, from the program cache {seconds:.3f} s")

    # and a restart on that bpffs re-opens the pins, as before
    third = loader.load(bpffs, PROGRAMS, SMALL_MAPS, reuse=True, cache_dir=cache)
    try:
        assert third.source == "pins"
    finally:
        third.close()


def test_cached_programs_translate_like_compiled_ones(compiled, tmp_bpffs_factory):
    """Same tag is same code; this runs it: a ClusterIP SYN through the cached tc_ingress, into
    the maps the cache created."""
    cache, _first, _ = compiled
    bpffs = tmp_bpffs_factory("oc-run")
    loaded = loader.load(bpffs, PROGRAMS, SMALL_MAPS, reuse=True, cache_dir=cache)
    try:
        assert loaded.source == "cache"
        maps = Maps.from_loaded(loaded)
        w.install_node(maps)
        w.install(maps, w.web())
        out = run(loaded, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
        assert out.verdict == TC_ACT_OK
        assert endpoints(out.pkt)[1] in {w.LOCAL_EP, w.REMOTE_EP, w.REMOTE_EP2}
        assert_checksums_valid(out.pkt)
        assert maps.stats()[s.Reason.FWD_NEW][0] == 1
    finally:
        loaded.close()


def test_an_entry_that_cannot_be_used_costs_a_compile(compiled, tmp_bpffs_factory, tmp_path):
    cache, _first, _ = compiled
    bid = loader.build_id(PROGRAMS, {**loader.MAX_ENTRIES, **SMALL_MAPS})
    broken = tmp_path / "cache"
    broken.mkdir(mode=0o700)
    entry = json.loads(objcache.entry_path(cache, bid).read_text())
    entry["programs"]["tc_ingress"]["sha256"] = "0" * 64  # as if the file had been altered
    objcache.entry_path(broken, bid).write_text(json.dumps(entry))

    bpffs = tmp_bpffs_factory("oc-broken")
    loaded = loader.load(bpffs, PROGRAMS, SMALL_MAPS, reuse=True, cache_dir=broken)
    try:
        assert loaded.source == "compiler"
    finally:
        loaded.close()
    assert objcache.read(broken, bid, PROGRAMS) is not None  # the compile replaced the entry


def test_a_cache_others_can_write_is_not_trusted(compiled, tmp_bpffs_factory, tmp_path):
    cache, _first, _ = compiled
    bid = loader.build_id(PROGRAMS, {**loader.MAX_ENTRIES, **SMALL_MAPS})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    objcache.entry_path(shared, bid).write_bytes(objcache.entry_path(cache, bid).read_bytes())
    with pytest.raises(objcache.CacheError, match="writable by group or others"):
        objcache.read(shared, bid, PROGRAMS)
    bpffs = tmp_bpffs_factory("oc-shared")
    loaded = loader.load(bpffs, ("tc_ingress",), SMALL_MAPS, reuse=True, cache_dir=shared)
    try:
        assert loaded.source == "compiler"  # and nothing was loaded from the untrusted file
    finally:
        loaded.close()


_AGENT_LIKE = r"""
import json, sys
from pathlib import Path
from ebpf_proxy.datapath.ebpf import loader, toolchain
toolchain.ensure_kernel_headers = lambda: (_ for _ in ()).throw(RuntimeError("compiler needed"))
loaded = loader.load(Path(sys.argv[1]), tuple(loader.PROGRAMS), json.loads(sys.argv[2]), reuse=True,
                     cache_dir=Path(sys.argv[3]))
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"source": loaded.source, "bcc_imported": "bcc" in sys.modules, "peak_rss_kib": hwm}))
"""


def test_a_cold_start_from_the_cache_needs_no_compiler(compiled, tmp_bpffs_factory):
    """The agent's path: no bcc import, no kernel headers, no child process."""
    cache, _first, _ = compiled
    bpffs = tmp_bpffs_factory("oc-agent")
    done = subprocess.run([sys.executable, "-c", _AGENT_LIKE, str(bpffs), json.dumps(SMALL_MAPS), str(cache)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["source"] == "cache" and not report["bcc_imported"]
    print(f"\nagent-like cold start from the cache: peak RSS {report['peak_rss_kib'] / 1024:.0f} MiB")
