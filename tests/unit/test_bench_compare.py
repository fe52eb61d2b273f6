"""`bench --compare`: ratios NEW/OLD, and whether a change is better, worse or noise."""

import copy
import json

from click.testing import CliRunner

from ebpf_proxy.bench.compare import compare, verdict
from ebpf_proxy.cli.bench import bench
from tests.unit.test_bench_results import synthetic_doc


def _row(rows, metric, path, mode, services):
    return next(r for r in rows if (r.metric, r.path, r.mode, r.services) == (metric, path, mode, services))


def test_ratios_and_verdicts():
    old = synthetic_doc(("direct", "iptables"), (1, 1000))
    new = copy.deepcopy(old)
    for row in new["summary"]:
        if row["metric"] == "conn_rate" and row["mode"] == "iptables":
            row["value"] *= 2  # faster: better
        if row["metric"] == "update_latency":
            row["value"] *= 3  # slower: worse
        if row["metric"] == "udp_rate":
            row["value"] *= 1.02  # within the noise: same
    rows = compare(old, new)
    assert len(rows) == len(old["summary"])
    fast = _row(rows, "conn_rate", "clusterip", "iptables", 1000)
    assert fast.ratio == 2 and fast.verdict == "better"
    slow = _row(rows, "update_latency", None, "iptables", 1)
    assert slow.ratio == 3 and slow.verdict == "worse"
    assert _row(rows, "udp_rate", "direct", "direct", 1).verdict == "same"
    assert _row(rows, "full_sync", None, "iptables", 1).ratio == 1


def test_rows_on_one_side_only():
    old = synthetic_doc(("direct",), (1,))
    new = synthetic_doc(("direct", "iptables"), (1,))
    rows = compare(old, new)
    only_new = [r for r in rows if r.verdict == "only new"]
    assert only_new and all(r.mode == "iptables" and r.ratio is None and r.old is None for r in only_new)
    assert [r for r in compare(new, old) if r.verdict == "only old"]


def test_verdict_direction():
    assert verdict("conn_rate", 100, 200, 0.0) == "better"
    assert verdict("full_sync", 100, 200, 0.0) == "worse"
    assert verdict("rss", 100, 50, 0.0) == "better"
    assert verdict("conn_rate", 100, 130, 0.4) == "same"  # inside the runs' own spread


def test_cli_prints_the_ratio_table(tmp_path):
    old = synthetic_doc(("direct", "iptables"), (1,))
    new = copy.deepcopy(old)
    for row in new["summary"]:
        row["value"] *= 1.5
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    result = CliRunner().invoke(bench, ["--compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")])
    assert result.exit_code == 0, result.output
    assert "conn_rate" in result.output and "1.500" in result.output
    assert "better" in result.output and "worse" in result.output
