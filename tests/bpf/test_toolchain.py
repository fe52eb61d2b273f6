"""toolchain: kernel-header resolution (on fake trees, no root) and the machine probe."""

from __future__ import annotations

import os
import time

import pytest

from ebpf_proxy.datapath.ebpf import toolchain
from ebpf_proxy.datapath.ebpf.toolchain import Check, KernelHeadersMissing, Report


def make_debian_headers(src, version, arch="amd64"):
    common = src / f"linux-headers-{version}-common"
    (common / "include" / "linux").mkdir(parents=True)
    (common / "include" / "linux" / "bpf.h").write_text(f"/* common {version} */")
    (common / "include" / "linux" / "shared.h").write_text("/* from common */")
    arch_tree = src / f"linux-headers-{version}-{arch}"
    (arch_tree / "include" / "generated").mkdir(parents=True)
    (arch_tree / "include" / "generated" / "autoconf.h").write_text(f"/* {arch} {version} */")
    (arch_tree / "include" / "linux").mkdir(parents=True)
    (arch_tree / "include" / "linux" / "shared.h").write_text("/* arch overrides common */")
    return common, arch_tree


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "_debian_arch", lambda: "amd64")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", "unset")
    dirs = {name: tmp_path / name for name in ("modules", "src", "cache")}
    for d in dirs.values():
        d.mkdir()
    return {"release": "6.18.0-test", "modules_dir": dirs["modules"], "src_dir": dirs["src"], "cache_dir": dirs["cache"]}


def test_running_kernel_build_tree_wins(fake):
    build = fake["modules_dir"] / fake["release"] / "build"
    (build / "include").mkdir(parents=True)
    make_debian_headers(fake["src_dir"], "6.1.0-9")
    headers = toolchain.find_kernel_headers(**fake)
    assert headers.path == build.resolve() and headers.ready and headers.origin == "running kernel"


def test_fallback_picks_the_newest_complete_pair(fake):
    make_debian_headers(fake["src_dir"], "6.1.0-9")
    make_debian_headers(fake["src_dir"], "6.1.0-12")
    make_debian_headers(fake["src_dir"], "6.5.0-1", arch="arm64")  # another architecture only
    headers = toolchain.find_kernel_headers(**fake)
    assert headers.sources[0].name == "linux-headers-6.1.0-12-common"
    assert headers.path == fake["cache_dir"] / "kernel-headers-6.1.0-12-amd64"
    assert not headers.ready


def test_no_headers_names_the_package(fake):
    with pytest.raises(KernelHeadersMissing, match="linux-headers-amd64"):
        toolchain.find_kernel_headers(**fake)


def test_ensure_builds_the_merged_tree_once(fake):
    make_debian_headers(fake["src_dir"], "6.1.0-12")
    path = toolchain.ensure_kernel_headers(**fake)
    assert os.environ["BCC_KERNEL_SOURCE"] == str(path)
    assert (path / "include" / "linux" / "bpf.h").read_text() == "/* common 6.1.0-12 */"
    assert (path / "include" / "generated" / "autoconf.h").read_text() == "/* amd64 6.1.0-12 */"
    assert (path / "include" / "linux" / "shared.h").read_text() == "/* arch overrides common */"
    assert (path / "include" / "linux" / "bpf.h").is_symlink(), "a symlink tree, not a copy"
    stamp = path.stat().st_mtime_ns
    time.sleep(0.01)
    assert toolchain.ensure_kernel_headers(**fake) == path
    assert path.stat().st_mtime_ns == stamp, "a complete tree is reused"
    assert [p.name for p in fake["cache_dir"].iterdir()] == [path.name], "no temp dirs left behind"


def test_ensure_rebuilds_a_half_built_tree(fake):
    make_debian_headers(fake["src_dir"], "6.1.0-12")
    half = fake["cache_dir"] / "kernel-headers-6.1.0-12-amd64"
    (half / "include").mkdir(parents=True)  # interrupted run: no completion mark
    path = toolchain.ensure_kernel_headers(**fake)
    assert (path / "include" / "linux" / "bpf.h").exists()


def test_report_lines_name_what_is_missing():
    report = Report([Check("bcc", True, "bcc 0.26"), Check("xdp", False, "attach failed")])
    assert not report.ok and report.missing == ["xdp"]
    lines = report.lines()
    assert lines[0] == "ebpf: NOT ready (missing: xdp)"
    assert any(line.split()[:2] == ["MISSING", "xdp"] for line in lines)


@pytest.mark.root
@pytest.mark.bpf
def test_probe_on_this_machine():
    if os.geteuid() != 0:
        pytest.skip("the kernel checks need root")
    start = time.monotonic()
    report = toolchain.probe()
    assert time.monotonic() - start < 1.0
    names = [c.name for c in report.checks]
    for name in ("bcc", "kernel-headers", "bpffs", "bpf-syscall", "tc-clsact", "xdp", "prog-test-run", "cgroup-sock-addr"):
        assert name in names
    assert report.ok, report.lines()
