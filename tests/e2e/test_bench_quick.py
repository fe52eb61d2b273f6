"""`ebpf-proxy bench --quick` end to end: a real lab, real agents, real load; then its files' shape.

Runs the CLI as a user would (a subprocess, so the bench's own lab set-up and teardown are what
is tested), with every mode this checkout can run: direct and iptables always, ebpf once
`ebpf_proxy.datapath.ebpf` provides EbpfDatapath (EBPF_PROXY_BENCH_MODES overrides the list).
`--quick` with fewer and shorter runs (SMALLER: 2 repeats of 0.3 s after a 0.1 s warm-up
instead of 3 of 1 s after 0.5 s, bursts of 250 changes instead of 1,000; options given
explicitly win over the profile's): every row, every file and every check of the quick profile,
in well under two thirds of its time (figures are not what this test is about, and two repeats
still have a median and a spread). A 0.3 s run is still thousands of connections or requests
per point (the load generator's figures here are 5,000-30,000 per second), and the in-kernel
statistics check below still asks each program for over 1,000 runs per run.
A point whose runs saw errors fails the bench (exit 1), so a broken path fails this test.
Asserts shape and sanity only — every figure positive and finite, every summary row complete,
every expected point present, the report and plots written — never a speed: a slow machine is
not a failure. The wall time is printed. The subprocess timeout is a guard against a hang, not
a performance bound.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ebpf_proxy.bench.report import PLOT_FILES
from ebpf_proxy.bench.results import SUMMARY_KEYS, check

HANG_GUARD_SECONDS = 900
SMALLER = ["--repeats", "2", "--duration", "0.3s", "--warmup", "0.1s", "--burst-changes", "250"]

pytestmark = [
    pytest.mark.root,
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="the bench builds a lab: needs root"),
    pytest.mark.timeout(HANG_GUARD_SECONDS + 120),  # the module's bench run counts against the first test
]


def available_modes() -> list[str]:
    """EBPF_PROXY_BENCH_MODES if set (e.g. "direct,iptables"), else every mode this checkout has."""
    if os.environ.get("EBPF_PROXY_BENCH_MODES"):
        return [m for m in os.environ["EBPF_PROXY_BENCH_MODES"].split(",") if m]
    modes = ["direct", "iptables"]
    try:
        module = importlib.import_module("ebpf_proxy.datapath.ebpf")
        if hasattr(module, "EbpfDatapath"):
            modes.append("ebpf")
    except ImportError:
        pass
    return modes


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-quick")
    modes = available_modes()
    argv = [sys.executable, "-m", "ebpf_proxy", "bench", "--quick", *SMALLER, "--modes", ",".join(modes),
            "--out", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_SECONDS)
    except BaseException:
        # SIGTERM, not SIGKILL: the bench then removes its lab on the way out
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        raise
    took = time.monotonic() - start
    print(f"\nbench --quick ({','.join(modes)}): {took:.0f} s\n{stdout}\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{stdout}\n{stderr[-5000:]}"
    return out, modes, json.loads((out / "results.json").read_text())


def test_results_are_sane(quick_run):
    _, _, doc = quick_run
    assert check(doc) == []
    for row in doc["summary"]:
        assert set(SUMMARY_KEYS) <= set(row), row
    assert doc["parameters"]["services"] == [1, 1000]  # the --quick profile's, with SMALLER's runs
    assert (doc["parameters"]["repeats"], doc["parameters"]["duration_s"], doc["parameters"]["warmup_s"],
            doc["parameters"]["burst_changes"]) == (2, 0.3, 0.1, 250)
    assert doc["machine"]["kernel"] and doc["versions"]["python"]
    # every point repeated as asked (rss's values are its phases' peaks, not repeats)
    assert all(len(p["values"]) == 2 for p in doc["points"] if p["metric"] != "rss"), "every point repeated twice"
    assert all(row["repeats"] == 2 for row in doc["summary"] if row["metric"] != "rss")


def test_every_point_was_measured(quick_run):
    _, modes, doc = quick_run
    rows = {(r["metric"], r["path"], r["mode"], r["services"]) for r in doc["summary"]}
    running = [m for m in modes if doc["modes"][m]["status"] == "ok"]
    assert "direct" in running and "iptables" in running, doc["modes"]
    unavailable = {(u["mode"], u["metric"]) for u in doc["unavailable"]}
    for n in (1, 1000):
        for metric in ("conn_rate", "udp_rate", "cpu_per_conn", "cpu_per_req"):
            assert (metric, "direct", "direct", n) in rows
        for mode in (m for m in running if m != "direct"):
            for path in ("clusterip", "nodeport-cluster", "nodeport-local", "podip"):
                assert ("conn_rate", path, mode, n) in rows
                assert ("cpu_per_conn", path, mode, n) in rows
            assert ("udp_rate", "clusterip", mode, n) in rows
            assert ("cpu_per_req", "clusterip", mode, n) in rows
            for metric in ("full_sync", "rss"):
                assert (metric, None, mode, n) in rows
            for metric in ("update_latency", "burst_converge"):
                assert (metric, None, mode, n) in rows or (mode, metric) in unavailable
        if "ebpf" in running:
            for path in ("clusterip_syn", "established", "nodeport", "load_tc_ingress", "load_tc_egress"):
                assert ("bpf_ns_per_packet", path, "ebpf", n) in rows
    if "ebpf" in running:
        cost = {(r["path"], r["services"]): r for r in doc["summary"] if r["metric"] == "bpf_ns_per_packet"}
        # a connection-table hit is cheaper than a lookup, a backend choice and a new entry
        assert cost[("established", 1)]["value"] < cost[("clusterip_syn", 1)]["value"], cost
        load = [p for p in doc["points"] if p["metric"] == "bpf_ns_per_packet" and p["path"].startswith("load_")]
        for p in load:  # the kernel's statistics: every run of the program under the ClusterIP load
            assert p["node"] == "worker2" and all(r["run_cnt"] > 1000 for r in p["runs"]), p
    iptables_state = [k for k in doc["kernel_state"] if k["mode"] == "iptables"]
    assert {k["services"] for k in iptables_state} == {1, 1000}
    small = max(k["counts"]["total"] for k in iptables_state if k["services"] == 1)
    big = max(k["counts"]["total"] for k in iptables_state if k["services"] == 1000)
    assert big > small > 0, "1,000 Services take more rules than 1"


def test_traffic_reached_the_expected_backends(quick_run):
    _, _, doc = quick_run
    for point in doc["points"]:
        if point["metric"] not in ("conn_rate", "udp_rate"):
            continue
        pods = set(point["backends"])
        where = f"{point['metric']} {point['path']} {point['mode']}"
        # each run says what each side used: the servers' and the load generator's cores, the idle share
        assert len(point["limits"]) == len(point["runs"]), where
        for limit in point["limits"]:
            assert set(limit["server_cores"]) == {"backend-1", "backend-2"}, where
            assert limit["client_cores"] > 0 and 0 <= limit["machine_idle"] <= 1, where
        if point["path"] == "nodeport-local":
            assert pods == {"backend-1"}, where  # eTP=Local via worker1: only its own pod
        else:
            assert pods == {"backend-1", "backend-2"}, where


def test_cpu_per_operation_is_the_runs_kernel_time_over_their_operations(quick_run):
    _, _, doc = quick_run
    rates = {(p["metric"], p["path"], p["mode"], p["services"]): p for p in doc["points"]}
    cpu_points = [p for p in doc["points"] if p["metric"] in ("cpu_per_conn", "cpu_per_req")]
    assert cpu_points
    for p in cpu_points:
        rate = rates[("conn_rate" if p["metric"] == "cpu_per_conn" else "udp_rate", p["path"], p["mode"], p["services"])]
        assert p["completed"] == [run["completed"] for run in rate["runs"]]
        for value, cpu, completed in zip(p["values"], p["cpu_s"], p["completed"]):
            assert value == pytest.approx(cpu["kernel"] * 1e6 / completed, rel=1e-3)


def test_report_and_plots(quick_run):
    out, modes, doc = quick_run
    report = (out / "report.md").read_text()
    assert "Kernel CPU per operation" in report
    assert "- burst: 250-change burst written at once" in report  # the run's own burst size, as asked
    for heading in ("## Data path", "## Control plane", "## Kernel state"):
        assert heading in report
    if doc["modes"].get("ebpf", {}).get("status") == "ok":
        assert "## eBPF program cost per packet" in report
    for mode, status in doc["modes"].items():
        if status["status"] != "ok":
            assert f"Mode {mode} was skipped" in report
    for name in PLOT_FILES.values():
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
