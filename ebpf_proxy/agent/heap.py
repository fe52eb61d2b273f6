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

import gc
import time


def settle() -> tuple[float, int]:
    """Collect everything once, then exempt the survivors from automatic collections. Returns
    (seconds it took, objects frozen)."""
    started = time.monotonic()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.monotonic() - started, gc.get_freeze_count()
