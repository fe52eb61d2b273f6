"""bench/limits.py: which side of a load run was saturated."""

import json
import os
import time

from ebpf_proxy.bench import limits
from ebpf_proxy.bench.loadgen import parse_output
from tests.unit.test_bench_loadgen import SAMPLE


def _run(**cpu):
    return parse_output(json.dumps({**SAMPLE, "cpu_s": {"user": 0.5, "kernel": 0.5, "idle": 1.0, "cpus": 2,
                                                        "loadgen": 0.3, **cpu}}))


def test_nothing_saturated():
    out = limits.run_limits(_run(), {"backend-1": 0.4, "backend-2": 0.5})
    assert out == {"server_cores": {"backend-1": 0.4, "backend-2": 0.5}, "client_cores": 0.3,
                   "machine_idle": 0.5, "limited_by": []}


def test_each_limit_is_named_with_its_figure():
    out = limits.run_limits(_run(loadgen=0.95, idle=0.05), {"backend-1": 0.99, "backend-2": 0.2})
    assert out["limited_by"] == ["client (0.95 cores)", "server backend-1 (0.99 cores)", "machine (5% idle)"]
    assert out["machine_idle"] == 0.048


def test_a_server_with_threads_is_limited_at_that_many_cores():
    out = limits.run_limits(_run(), {"backend-1": 1.5, "backend-2": 1.9}, {"backend-1": 2, "backend-2": 2})
    assert out["limited_by"] == ["server backend-2 (1.90 cores)"]  # 1.5 of 2 threads' cores: not saturated


def test_a_run_without_cpu_figures_can_still_name_a_busy_server():
    run = parse_output(json.dumps(SAMPLE))
    out = limits.run_limits(run, {"backend-1": 1.0})
    assert out["client_cores"] is None and out["machine_idle"] is None
    assert out["limited_by"] == ["server backend-1 (1.00 cores)"]


def test_server_meter_reads_real_processes():
    meter = limits.ServerMeter({"me": os.getpid(), "gone": 2 ** 22 + 12345})  # above pid_max: never a process
    start = time.process_time()
    while time.process_time() - start < 0.05:  # burn CPU: 5 clock ticks, so /proc sees it
        sum(i * i for i in range(10_000))
    cores = meter.stop()
    assert set(cores) == {"me"} and cores["me"] > 0


def test_a_threaded_client_is_limited_at_that_many_cores():
    def run(loadgen):
        return parse_output(json.dumps({**SAMPLE, "threads": 2, "cpu_s": {"user": 0.5, "kernel": 0.5, "idle": 1.0,
                                                                         "cpus": 2, "loadgen": loadgen}}))
    assert limits.run_limits(run(1.5), {})["limited_by"] == []
    assert limits.run_limits(run(1.85), {})["limited_by"] == ["client (1.85 cores)"]
