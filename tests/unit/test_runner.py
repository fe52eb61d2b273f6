"""agent/runner.py: bounded-frequency syncing, driven by a fake clock (no sleeping)."""

from __future__ import annotations

import threading

import pytest

from ebpf_proxy.agent.runner import BoundedFrequencyRunner


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Recorder:
    def __init__(self, clock: FakeClock, fail: int = 0) -> None:
        self.clock = clock
        self.calls: list[tuple[float, bool]] = []
        self.fail = fail

    def __call__(self, full: bool) -> None:
        self.calls.append((self.clock.now(), full))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("datapath says no")


def make(min_interval=1.0, max_interval=30.0, fail=0, **kw):
    clock = FakeClock()
    rec = Recorder(clock, fail)
    return BoundedFrequencyRunner(rec, min_interval, max_interval, clock=clock, **kw), clock, rec


def drive(runner: BoundedFrequencyRunner, clock: FakeClock, seconds: float) -> None:
    """Let `seconds` of fake time pass, running each sync exactly when it is due (what loop() does in
    real time, minus the sleeping)."""
    end = clock.now() + seconds
    while True:
        runner.run_if_due()
        due = runner.due_at()
        if due > end:
            clock.t = end
            return
        clock.t = max(clock.t, due)


def test_first_sync_runs_at_once_and_is_full():
    runner, clock, rec = make()
    assert runner.run_if_due()
    assert rec.calls == [(100.0, True)]
    assert not runner.run_if_due()  # nothing requested


def test_min_interval_between_syncs():
    runner, clock, rec = make(min_interval=2.0)
    runner.run_if_due()
    runner.request()
    clock.advance(1.9)
    assert not runner.run_if_due()
    assert runner.due_at() == pytest.approx(102.0)
    clock.advance(0.1)
    assert runner.run_if_due()
    assert rec.calls[-1] == (pytest.approx(102.0), False)


def test_burst_of_a_thousand_changes_becomes_a_handful_of_syncs():
    runner, clock, rec = make(min_interval=1.0)
    drive(runner, clock, 0.5)
    before = len(rec.calls)
    for i in range(1000):  # 1,000 changes spread over 2 seconds, with the runner reacting live
        runner.request()
        if i % 10 == 0:
            clock.advance(0.02)
            runner.run_if_due()
    drive(runner, clock, 3.0)
    syncs = len(rec.calls) - before
    assert 1 <= syncs <= 4, rec.calls
    starts = [t for t, _ in rec.calls]
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(starts, starts[1:]))


def test_periodic_sync_without_changes_is_partial_and_full_comes_hourly():
    runner, clock, rec = make(min_interval=1.0, max_interval=30.0)
    drive(runner, clock, 95.0)
    assert [t - 100.0 for t, _ in rec.calls] == pytest.approx([0.0, 30.0, 60.0, 90.0])
    assert [full for _, full in rec.calls] == [True, False, False, False]
    drive(runner, clock, 3600.0)
    fulls = [t - 100.0 for t, full in rec.calls if full]
    assert fulls == pytest.approx([0.0, 3600.0])  # kube-proxy's fullSyncPeriod


def test_periodic_tick_counts_from_the_last_sync_of_any_kind():
    runner, clock, rec = make(min_interval=1.0, max_interval=30.0)
    runner.run_if_due()
    clock.advance(20.0)
    runner.request()
    runner.run_if_due()
    assert runner.due_at() == pytest.approx(150.0)  # 30 s after the change's sync, not the first


def test_partial_syncs_do_not_postpone_the_full_resync():
    runner, clock, rec = make(min_interval=1.0, max_interval=10.0, full_interval=10.0)
    runner.run_if_due()
    for _ in range(12):  # a change every second
        clock.advance(1.0)
        runner.request()
        runner.run_if_due()
    fulls = [t - 100.0 for t, full in rec.calls if full]
    assert fulls == pytest.approx([0.0, 10.0])  # the sync at +10s is full although +9s was a sync
    assert sum(1 for _, full in rec.calls if not full) == 11


def test_request_full():
    runner, clock, rec = make()
    runner.run_if_due()
    clock.advance(5)
    runner.request(full=True)
    runner.run_if_due()
    assert rec.calls[-1][1] is True


def test_retry_after_error_with_backoff_then_full():
    runner, clock, rec = make(min_interval=1.0, max_interval=30.0, fail=3, retry_initial=2.0)
    runner.run_if_due()  # fails
    drive(runner, clock, 20.0)
    times = [t - 100.0 for t, _ in rec.calls]
    # retries after 2s, then 4s, then 8s (doubling); the 4th attempt succeeds
    assert times == pytest.approx([0.0, 2.0, 6.0, 14.0])
    assert all(full for _, full in rec.calls)
    assert runner.failures == 3 and runner.runs == 1


def test_requests_do_not_bypass_the_retry_backoff():
    runner, clock, rec = make(min_interval=0.0, max_interval=30.0, fail=1, retry_initial=5.0)
    runner.run_if_due()
    for _ in range(39):  # 4.875s of requests, every 0.125s
        clock.advance(0.125)
        runner.request()
        runner.run_if_due()
    assert len(rec.calls) == 1
    clock.advance(0.125)
    assert runner.run_if_due()  # exactly at the retry time


def test_backoff_is_capped_at_max_interval():
    runner, clock, rec = make(min_interval=1.0, max_interval=10.0, fail=10, retry_initial=4.0)
    drive(runner, clock, 60.0)
    gaps = [b - a for (a, _), (b, _) in zip(rec.calls, rec.calls[1:])]
    assert max(gaps) == pytest.approx(10.0)
    assert gaps[:2] == pytest.approx([4.0, 8.0])


def test_success_after_failure_resets_the_backoff():
    runner, clock, rec = make(min_interval=1.0, max_interval=30.0, fail=1, retry_initial=2.0)
    runner.run_if_due()
    drive(runner, clock, 3.0)
    assert runner.runs == 1
    rec.fail = 1
    runner.request()
    drive(runner, clock, 5.0)
    gaps = [b - a for (a, _), (b, _) in zip(rec.calls, rec.calls[1:])]
    assert gaps[-1] == pytest.approx(2.0)  # back to the initial retry delay


def test_stopped_runner_does_not_run():
    runner, clock, rec = make()
    runner.stop()
    assert not runner.run_if_due()
    assert rec.calls == []


def test_loop_returns_after_stop():
    """The real-time driver: stop() from another thread ends loop() (bounded by join, not asserted)."""
    calls = []
    runner = BoundedFrequencyRunner(lambda full: calls.append(full), 0.0, 3600.0)
    thread = threading.Thread(target=runner.loop, daemon=True)
    thread.start()
    runner.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_invalid_max_interval():
    with pytest.raises(ValueError, match="max_interval"):
        BoundedFrequencyRunner(lambda full: None, 1.0, 0.0)
