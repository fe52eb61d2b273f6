"""results.json: summary rows from raw points, and the sanity check scripts and CI rely on."""

import copy
import json
import math

import pytest

from ebpf_proxy.bench import results
from ebpf_proxy.bench.report import render_markdown
from ebpf_proxy.bench.results import SUMMARY_KEYS, Results, check, load, summarize, summarize_point


def rate_point(metric="conn_rate", path="clusterip", mode="iptables", services=1, values=(1000, 1100, 900)):
    n = len(values)
    return {"metric": metric, "path": path, "mode": mode, "services": services,
            "unit": "conn/s" if metric == "conn_rate" else "req/s", "values": list(values),
            "latency_ms": {"p50": [0.5] * n, "p90": [0.8] * n, "p99": [1.0 + i for i in range(n)]},
            "runs": [{"rate": v} for v in values], "problems": []}


def cpu_point(metric="cpu_per_conn", path="clusterip", mode="iptables", services=1, values=(40.0, 42.0, 38.0)):
    return {"metric": metric, "path": path, "mode": mode, "services": services,
            "unit": "µs/conn" if metric == "cpu_per_conn" else "µs/req", "values": list(values)}


def synthetic_points(modes=("direct", "iptables"), sizes=(1, 1000)):
    """Raw points as a bench run of `modes` x `sizes` would record them (made-up figures)."""
    points = []
    for n in sizes:
        for mode in modes:
            if mode == "direct":
                points += [rate_point("conn_rate", "direct", mode, n, (20000, 21000, 19500)),
                           rate_point("udp_rate", "direct", mode, n, (30000, 31000, 29000)),
                           cpu_point("cpu_per_conn", "direct", mode, n, (30.0, 31.0, 29.0)),
                           cpu_point("cpu_per_req", "direct", mode, n, (10.0, 11.0, 9.0))]
                continue
            slow = 1 + n / 1000
            for path in ("clusterip", "nodeport-cluster", "nodeport-local"):
                points.append(rate_point("conn_rate", path, mode, n, (15000 / slow, 15500 / slow, 14000 / slow)))
                points.append(cpu_point("cpu_per_conn", path, mode, n, (40.0 * slow, 41.0 * slow, 39.0 * slow)))
            points.append(rate_point("udp_rate", "clusterip", mode, n, (25000 / slow,) * 3))
            points.append(cpu_point("cpu_per_req", "clusterip", mode, n, (12.0 * slow,) * 3))
            points += [
                {"metric": "full_sync", "path": None, "mode": mode, "services": n, "unit": "s",
                 "values": [1.2 * slow, 1.3 * slow, 1.25 * slow], "runs": []},
                {"metric": "update_latency", "path": None, "mode": mode, "services": n, "unit": "ms",
                 "values": [20 * slow] * 3, "samples": [[20 * slow, 25 * slow, 90 * slow]] * 3, "runs": []},
                {"metric": "burst_converge", "path": None, "mode": mode, "services": n, "unit": "s",
                 "values": [2.0 * slow, 2.1 * slow, 1.9 * slow], "runs": []},
                {"metric": "rss", "path": None, "mode": mode, "services": n, "unit": "MiB",
                 "values": [60.0 + n / 100] * 3, "by_phase": {"full_sync": 61.0, "datapath": 60.0},
                 "cpu_seconds_by_phase": {"full_sync": 0.9, "datapath": 0.01}},
            ]
    return points


def synthetic_doc(modes=("direct", "iptables", "ebpf"), sizes=(1, 1000)):
    r = Results({"modes": list(modes), "services": list(sizes), "endpoints_per_service": 2, "duration_s": 1,
                 "warmup_s": 0.5, "repeats": 3, "concurrency": 16, "update_changes": 10, "burst_changes": 1000,
                 "measured_services": 5}, "ebpf-proxy bench --quick")
    r.set_mode_status("direct", "ok")
    r.set_mode_status("iptables", "ok")
    if "ebpf" in modes:
        r.set_mode_status("ebpf", "unavailable", "ebpf_proxy.datapath.ebpf.EbpfDatapath is not available")
    for p in synthetic_points([m for m in modes if m != "ebpf"], sizes):
        r.add_point(p)
    r.doc["kernel_state"] = [{"mode": "iptables", "services": n, "node": "worker1",
                              "counts": {"iptables_rules_nat": 10 * n + 20, "total": 10 * n + 30}} for n in sizes]
    r.doc["installs"] = [{"services": n, "created": max(0, n - 5), "deleted": 0, "seconds": 0.01 * n + 0.1,
                          "list_seconds": 0.002 * n + 0.05, "list_first_s": 0.002 * n + 0.05,
                          "list_later_s": 0.001 * n + 0.05, "api_cpu_first_s": 0.001 * n, "api_cpu_later_s": 0.0005 * n}
                         for n in sizes]
    r.finish()
    return r.doc


def test_rate_row():
    row = summarize_point(rate_point(values=(900, 1000, 1200)))
    assert all(k in row for k in SUMMARY_KEYS)
    assert row["value"] == 1000 and row["unit"] == "conn/s"
    assert row["repeats"] == 3
    assert row["spread"] == pytest.approx(0.3)
    assert row["p50"] == 0.5 and row["p99"] == 2.0 and row["p90"] == 0.8  # medians over the runs
    assert row["latency_unit"] == "ms"


def test_update_latency_row_pools_every_change():
    point = {"metric": "update_latency", "path": None, "mode": "iptables", "services": 1000, "unit": "ms",
             "values": [10, 12, 11], "samples": [[10, 9, 50], [12, 11, 13], [11, 10, 100]]}
    row = summarize_point(point)
    assert row["value"] == row["p50"] == 11
    assert row["p99"] == 100
    assert row["changes"] == 9
    assert row["spread"] == pytest.approx(2 / 11, abs=1e-3)


def test_control_rows_have_no_percentiles():
    rows = {r["metric"]: r for r in summarize(synthetic_points(("iptables",), (1,)))}
    for metric in ("full_sync", "burst_converge", "rss"):
        assert rows[metric]["p50"] is None and rows[metric]["p99"] is None
    assert rows["rss"]["by_phase"]["full_sync"] == 61.0


def test_a_full_sync_row_keeps_when_healthz_answered_beside_when_the_kernel_was_complete():
    point = {"metric": "full_sync", "path": None, "mode": "iptables", "services": 10000, "unit": "s",
             "values": [1.9, 2.0, 2.1], "runs": [{"seconds": v, "healthy_s": v + 0.1} for v in (1.9, 2.0, 2.1)]}
    row = summarize_point(point)
    assert row["value"] == 2.0 and row["healthy_s"] == 2.1
    assert "healthy_s" not in summarize_point({**point, "runs": [{"seconds": 2.0}]})  # runs before it was kept
    doc = synthetic_doc(("iptables",), (1,))
    doc["summary"] = [row if r["metric"] == "full_sync" else r for r in doc["summary"]]
    assert "| 2 ±5% (2.1) |" in render_markdown(doc, [])


def test_rss_is_the_peak_of_the_phases():
    point = {"metric": "rss", "path": None, "mode": "ebpf", "services": 1, "unit": "MiB",
             "values": [85.0, 244.0, 244.0, 246.0], "by_phase": {}, "cpu_seconds_by_phase": {}}
    row = summarize_point(point)
    assert row["value"] == 246.0 and row["repeats"] == 4


def test_summary_is_sorted_and_complete():
    doc = synthetic_doc()
    assert check(doc) == []
    metrics = [r["metric"] for r in doc["summary"]]
    assert metrics == sorted(metrics, key=results.METRICS.index)
    assert len(doc["summary"]) == len(doc["points"])
    assert doc["modes"]["ebpf"]["status"] == "unavailable"
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["kernel"]
    assert doc["versions"]["python"]


@pytest.mark.parametrize("mutate, complaint", [
    (lambda r: r.update(value=0), "value"),
    (lambda r: r.update(value=float("nan")), "value"),
    (lambda r: r.update(p99=float("inf")), "p99"),
    (lambda r: r.pop("spread"), "missing spread"),
    (lambda r: r.update(metric="throughput"), "metric"),
    (lambda r: r.update(path="loadbalancer"), "path"),
    (lambda r: r.update(services=0), "services"),
    (lambda r: r.update(p50=5.0, p99=1.0), "p50"),
    (lambda r: r.update(p50=None), "needs p50"),
    (lambda r: r.update(spread=math.nan), "spread"),
])
def test_check_catches_broken_rows(mutate, complaint):
    doc = synthetic_doc(("direct", "iptables"), (1,))
    doc = copy.deepcopy(doc)
    mutate(doc["summary"][0])
    problems = check(doc)
    assert problems and any(complaint in p for p in problems), problems


def test_check_needs_rows_and_keys():
    assert check({"summary": []})
    doc = synthetic_doc(("direct",), (1,))
    del doc["machine"]
    assert any("machine" in p for p in check(doc))


def test_write_and_load_round_trip(tmp_path):
    doc = synthetic_doc()
    r = Results(doc["parameters"], doc["command"])
    r.doc = doc
    path = r.write(tmp_path)
    assert path.name == "results.json"
    assert load(path) == json.loads(path.read_text())
    (tmp_path / "other.json").write_text('{"summary": []}')
    with pytest.raises(ValueError):
        load(tmp_path / "other.json")


def test_a_failed_point_is_kept_but_has_no_summary_row():
    r = Results({}, "ebpf-proxy bench")
    good = rate_point(path="nodeport-local")
    bad = dict(rate_point(path="nodeport-cluster", values=(156, 412, 149)), failed=True,
               problems=["run 1: 16 errors for 412 completed (timeout 16)"])
    assert r.add_point(good)["path"] == "nodeport-local"
    assert r.add_point(bad) is None
    assert [row["path"] for row in r.doc["summary"]] == ["nodeport-local"]
    assert len(r.doc["points"]) == 2
