"""agent/heap.py: the collector paused while lists and full syncs build the model, and glibc's
mmap threshold pinned."""

from __future__ import annotations

import gc
import threading

from ebpf_proxy.agent import heap


def test_paused_bodies_nest_across_threads_and_restore_the_collector():
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with heap.paused():
            inside.set()
            release.wait(5)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    assert not gc.isenabled()
    with heap.paused():
        with heap.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled(), "the other thread is still inside"
    release.set()
    t.join(5)
    assert gc.isenabled()


def test_paused_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with heap.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_paused_restores_the_collector_when_the_body_raises():
    try:
        with heap.paused():
            raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled()


def test_the_mmap_threshold_is_pinned_on_glibc():
    assert heap.pin_mmap_threshold() is True  # Debian: glibc's mallopt accepts it


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_trim_gives_freed_pages_below_a_live_block_back():
    """Blocks freed below one still in use stay resident until trim() (glibc's malloc_trim)."""
    blocks = [bytearray(b"x" * 4000) for _ in range(10_000)]  # ~40 MB of malloc'd (not pymalloc) blocks
    pinned = bytearray(b"y" * 4000)  # allocated last: above them, so glibc cannot shrink the heap's top
    del blocks
    before = _rss_kib()
    assert heap.trim() is True
    assert before - _rss_kib() > 20_000, "most of the ~40 MB freed went back"
    assert pinned[0] == ord("y")


def test_what_a_paused_body_built_is_frozen_not_left_for_the_next_collection():
    gc.collect()
    gc.unfreeze()
    before = gc.get_freeze_count()
    try:
        with heap.paused():
            built = [[i] for i in range(10_000)]  # tracked containers, built while paused
        assert gc.get_freeze_count() >= before + 10_000
        assert gc.get_count()[0] < 10_000, "the young generation does not hold them"
        assert gc.isenabled()
        assert len(built) == 10_000
    finally:
        gc.unfreeze()
