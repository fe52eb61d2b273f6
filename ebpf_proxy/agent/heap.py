"""Keep Python's cyclic garbage collector off the path of a change.

The agent's model is a few objects per endpoint: at 100,000 Services × 10 endpoints, ~1.7 million
long-lived objects, and one collection of the oldest generation walks all of them (~1 s there,
~45 ms at 10,000 Services × 2). The collector starts one on its own whenever enough objects have
survived, at any moment: an endpoint change that lands then waits for it (a 183 ms outlier among
7 ms changes at 10,000 Services, bench 2026-11-26). After each full sync (start, hourly resync,
after an error) `settle()` collects once, deliberately, on the sync thread after the kernel is
programmed, and freezes the survivors (gc.freeze): later collections walk only what is newer.
The model is acyclic (dataclasses, tuples, dicts), so frozen objects are freed by reference
counting when dropped; a cycle among them waits for the next settle, which unfreezes first.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from collections.abc import Iterator


def settle() -> tuple[float, int]:
    """Collect everything once, then exempt the survivors from automatic collections, and give
    what was freed back to the system (trim). Returns (seconds it took, objects frozen)."""
    started = time.monotonic()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    trim()
    return time.monotonic() - started, gc.get_freeze_count()


_pause_lock = threading.Lock()
_pausers = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection while the body runs (and while any other thread is inside one).

    A first LIST or a full sync builds the model's millions of long-lived objects at once, and
    every few thousand of them the collector walked all that had survived so far: at 100,000
    Services it took ~10 s of a ~26 s list (bench/cpscale.py). They are garbage-free as they are
    built (acyclic, freed by reference counting), and the full sync that follows settle()s them;
    nesting and concurrent bodies (one per collection) are counted, and the collector's state
    before the first one comes back after the last. What the bodies built is frozen then
    (gc.freeze, as settle() leaves it), not left young: the first collection after re-enabling
    would otherwise walk all of it (~3 million objects, ~0.1-0.3 s, on the first sync's path at
    100,000 Services), only for settle() to walk it again."""
    global _pausers, _was_enabled
    with _pause_lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pausers -= 1
            if _pausers == 0 and _was_enabled:
                gc.freeze()
                gc.enable()


def trim() -> bool:
    """Give the free pages inside glibc's heaps back to the system (malloc_trim(0)); True if any
    went back (False too where it is not glibc: nothing changes).

    glibc returns memory by itself only from the top of a heap, above its last block in use. A
    start (imports, loading the programs, the first list) frees much below long-lived blocks,
    which stays resident: ~1.3 MiB of a 1-Service agent's ~62.5 MiB (issue 12), given back here,
    after each full sync (settle)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))


M_MMAP_THRESHOLD = -3  # glibc malloc.h: mallopt's parameter number
MMAP_THRESHOLD = 128 * 1024  # glibc's own default, before it starts raising it


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Keep every allocation of `nbytes` or more in its own mapping, returned to the system when
    freed (glibc only; False elsewhere, and nothing changes).

    glibc raises its mmap threshold each time such a block is freed, up to 32 MiB, so after the
    first freed LIST page (~0.7 MB of JSON text) every later page is carved from the heap, where
    the long-lived blocks allocated between them keep the freed space from going back: ~130 MiB
    of a 100,000-Service agent's resident memory was such holes (bench/cpscale.py: 558 → 432 MiB
    after the first list, 769 → 636 MiB at its peak). A fixed threshold also stops the raising."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))
