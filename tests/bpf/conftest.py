"""BPF unit-test fixtures: the datapath compiled once per session into a private bpffs mount.

Nothing touches the node: maps are pinned in a bpffs mounted at a directory this session
creates under /run/ebpf-proxy-test/ (unmounted and removed at the end, also on failure), and
programs run with BPF_PROG_TEST_RUN, attached nowhere. Each test starts from blank maps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf.maps import Maps

from tests.bpf import world

TEST_ROOT = Path("/run/ebpf-proxy-test")
# Small maps: creation is fast and an LRU this size is still far from evicting in a test.
SMALL_MAPS = {name: min(n, 4096) for name, n in loader.MAX_ENTRIES.items()}
# The node tests' datapaths (test_datapath, test_audit, test_ebpf6_datapath) share one program
# cache for the session, as the agents of a node share --bpf-cache-dir: a build's first load
# compiles (~12 s), the others load its bytecode. test_loader and test_objcache test the
# compile and the cache themselves.
PROGRAM_CACHE = TEST_ROOT / f"programs-{os.getpid()}"


@pytest.fixture(scope="session")
def pin_dir():
    if os.geteuid() != 0:
        pytest.skip("BPF tests need root")
    TEST_ROOT.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"pins-{os.getpid()}-", dir=TEST_ROOT))
    try:
        loader.mount_bpffs(path)
        yield path
    finally:
        loader.unmount_bpffs(path)
        path.rmdir()
        with contextlib.suppress(OSError):
            TEST_ROOT.rmdir()  # only when no other test run is using it


@pytest.fixture(scope="session", autouse=True)
def _program_cache_removed():
    yield
    shutil.rmtree(PROGRAM_CACHE, ignore_errors=True)
    with contextlib.suppress(OSError):
        TEST_ROOT.rmdir()  # only when no other test run is using it


@pytest.fixture(scope="session")
def tmp_bpffs_factory():
    """Fresh bpffs mounts under TEST_ROOT, as many as asked for; all unmounted and removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("BPF tests need root")
    made: list[Path] = []

    def make(prefix: str) -> Path:
        TEST_ROOT.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=TEST_ROOT))
        made.append(path)
        loader.mount_bpffs(path)
        return path

    yield make
    for path in made:
        with contextlib.suppress(loader.LoadError):
            loader.unmount_bpffs(path)
        path.rmdir()
    with contextlib.suppress(OSError):
        TEST_ROOT.rmdir()  # only when no other test run is using it


@pytest.fixture(scope="session")
def datapath(pin_dir):
    """The datapath as the agent loads it: compiled in a child process, opened from the pins."""
    loaded = loader.load(pin_dir, max_entries=SMALL_MAPS)
    yield loaded
    loaded.close()


@pytest.fixture
def maps(datapath):
    m = Maps.from_loaded(datapath)
    m.reset()
    world.install_node(m)
    return m
