"""When to sync: kube-proxy's BoundedFrequencyRunner, with an injectable clock.

A burst of API changes must not become a burst of syncs (each one rewrites iptables or walks BPF
maps), yet a change must not wait long, and the kernel state must be re-checked regularly even
when nothing changes. So:

- `request()` asks for a sync as soon as allowed: syncs *start* at least `min_interval` apart, so
  a burst of 1,000 changes becomes one sync now plus one sync `min_interval` later;
- a sync runs at least every `max_interval` (kube-proxy's --sync-period) even when nothing
  changed; it is a *partial* one (only what changed, usually nothing), as in kube-proxy;
- a *full* sync (everything re-rendered and re-written, repairing anything that drifted) runs at
  least every `full_interval` (kube-proxy's fullSyncPeriod, one hour): at 10,000 services a full
  iptables restore takes over a minute on 2 cores, so it cannot be the 30-second tick;
- a failed sync is retried after a backoff (doubling from `retry_initial`, capped at
  `max_interval`), and the retry and every sync until one succeeds are full.

The scheduling decisions (`due_at`, `run_if_due`) are separate from the thread that waits
(`loop`), so tests drive them with a fake clock and never sleep.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


FULL_SYNC_PERIOD = 3600.0  # kube-proxy's iptables proxier: fullSyncPeriod = 1 * time.Hour


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class BoundedFrequencyRunner:
    """Calls `fn(full)` no more often than `min_interval`, at least every `max_interval`, with
    `full` true at least every `full_interval`."""

    def __init__(self, fn: Callable[[bool], None], min_interval: float, max_interval: float, *,
                 clock: MonotonicClock | None = None, retry_initial: float = 1.0, name: str = "sync",
                 full_interval: float = FULL_SYNC_PERIOD) -> None:
        if max_interval <= 0:
            raise ValueError(f"{name}: max_interval must be > 0, got {max_interval}")
        if full_interval <= 0:
            raise ValueError(f"{name}: full_interval must be > 0, got {full_interval}")
        self.fn = fn
        self.min_interval = max(0.0, min_interval)
        self.max_interval = max_interval
        self.full_interval = full_interval
        self.clock = clock or MonotonicClock()
        self.retry_initial = max(retry_initial, self.min_interval, 1e-3)
        self.name = name
        self._cond = threading.Condition()
        self._stopped = False
        self._requested = True  # the first sync happens as soon as the loop runs
        self._last_start: float | None = None
        self._last_full: float | None = None
        self._retry_at: float | None = None
        self._retry_delay = 0.0
        self._need_full = True
        self.runs = 0
        self.failures = 0

    # ---- inputs ----------------------------------------------------------------------------------

    def request(self, full: bool = False) -> None:
        """Something changed: sync soon (subject to min_interval and any retry backoff)."""
        with self._cond:
            self._requested = True
            self._need_full |= full
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # ---- scheduling (pure, clock-driven) ---------------------------------------------------------

    def due_at(self) -> float:
        """Monotonic time of the next sync."""
        with self._cond:
            return self._due_at_locked()

    def _due_at_locked(self) -> float:
        if self._retry_at is not None:
            return self._retry_at  # failing: only the backoff decides
        earliest = -math.inf if self._last_start is None else self._last_start + self.min_interval
        periodic = -math.inf if self._last_start is None else self._last_start + self.max_interval
        due = earliest if self._requested else periodic
        return max(due, earliest)

    def run_if_due(self) -> bool:
        """Run one sync if it is due now; returns whether one ran."""
        with self._cond:
            now = self.clock.now()
            if self._stopped or now < self._due_at_locked():
                return False
            full = (self._need_full or self._last_full is None
                    or now - self._last_full >= self.full_interval)
            self._requested = False
            self._last_start = now
        try:
            self.fn(full)
        except Exception as exc:
            with self._cond:
                self.failures += 1
                self._retry_delay = min(self.max_interval, self._retry_delay * 2 or self.retry_initial)
                self._retry_at = self.clock.now() + self._retry_delay
                self._need_full = True
            log.error("%s failed; retrying in %.1fs with a full sync: %s", self.name, self._retry_delay, exc,
                      extra={"retry_in_s": round(self._retry_delay, 3), "full": full})
            log.debug("%s failure traceback", self.name, exc_info=exc)
            return True
        with self._cond:
            self.runs += 1
            self._retry_at, self._retry_delay = None, 0.0
            if full:
                self._last_full = now
                self._need_full = False
        return True

    # ---- the real-time driver --------------------------------------------------------------------

    def loop(self) -> None:
        """Run until stop(): sleep until the next sync is due or a request arrives."""
        while True:
            with self._cond:
                if self._stopped:
                    return
                delay = self._due_at_locked() - self.clock.now()
                if delay > 0:
                    self._cond.wait(min(delay, self.max_interval))
                    continue
            self.run_if_due()
