"""loader.py: programs pinned per build, re-opened only while the maps they use are the pinned ones."""

from __future__ import annotations

import contextlib
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


def test_pinned_programs_are_reused_only_with_their_maps(bpffs):
    first = loader.load(bpffs, SOME, SMALL_MAPS, reuse=True)
    first_ids = {name: loader.libbpf.prog_info(fd)[0].id for name, fd in first.prog_fds.items()}
    first.close()
    assert first.compiled and (bpffs / loader.PROGS_SUBDIR / loader.build_id(SOME, SMALL_MAPS)).is_dir()

    again = loader.load(bpffs, SOME, SMALL_MAPS, reuse=True)
    try:
        assert not again.compiled and not again.tables
        assert {name: loader.libbpf.prog_info(fd)[0].id for name, fd in again.prog_fds.items()} == first_ids
        assert set(again.map_fds) == set(loader.structs.MAPS)
    finally:
        again.close()

    (bpffs / "epx_ct4").unlink()  # a map the programs use is gone: they must not be reused
    third = loader.load(bpffs, SOME, SMALL_MAPS, reuse=True)
    try:
        assert third.compiled
        assert [p.name for p in (bpffs / loader.PROGS_SUBDIR).iterdir()] == [loader.build_id(SOME, SMALL_MAPS)]
    finally:
        third.close()
