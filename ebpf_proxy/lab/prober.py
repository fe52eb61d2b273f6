"""Continuous probes: fresh connections to a few targets, without pause, counted ok / failed.

Reliability claims ("no connection to an existing Service failed while X happened") need traffic
that runs *through* X, not a probe before and after it: the fault tests (API server frozen,
stopped, restored) and the soak (minutes of Service churn) run one of these around the event and
read its counts afterwards. Every attempt is a new connection (`Lab.probe`), so each one goes
through the datapath's service lookup and backend choice, which is what churn could break;
a kept-alive connection would only exercise the connection table.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Sequence

from ebpf_proxy.lab.probe import Outcome, ProbeError

MAX_FAILURES_KEPT = 200  # the first failures, with where and what; the count is always exact


class Prober:
    """Probes `targets` ((where, "IP:PORT[/proto]") pairs) in turn until stopped, one fresh
    connection each, `pause` seconds between rounds. `timeout` bounds one attempt: long enough
    for a SYN retransmitted once (1 s) on a busy machine to still count as a connection that
    worked, as it would for any application."""

    def __init__(self, lab, targets: Sequence[tuple[str, str]], timeout: float = 1.0, pause: float = 0.05) -> None:
        if not targets:
            raise ValueError("Prober: no targets to probe")
        self.lab = lab
        self.targets = list(targets)
        self.timeout = timeout
        self.pause = pause
        self.ok = 0
        self.failed_count = 0
        self.failed: list[str] = []  # the first MAX_FAILURES_KEPT, "where -> target: outcome"
        self.ok_by_target: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="prober")
        self._lock = threading.Lock()

    def _run(self) -> None:
        while not self._stop.is_set():
            for where, target in self.targets:
                try:
                    outcome = self.lab.probe(where, target, timeout=self.timeout).results[0].outcome
                    detail = str(outcome)
                except ProbeError as exc:  # the probe could not even be made: a failure, said why
                    outcome, detail = None, f"probe error: {exc}"
                with self._lock:
                    if outcome == Outcome.OK:
                        self.ok += 1
                        self.ok_by_target[target] += 1
                    else:
                        self.failed_count += 1
                        if len(self.failed) < MAX_FAILURES_KEPT:
                            self.failed.append(f"{time.strftime('%H:%M:%S')} {where} -> {target}: {detail}")
            self._stop.wait(self.pause)

    def counts(self) -> tuple[int, int]:
        """(ok, failed) so far."""
        with self._lock:
            return self.ok, self.failed_count

    def start(self) -> "Prober":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Prober":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
