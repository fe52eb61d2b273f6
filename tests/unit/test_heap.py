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
