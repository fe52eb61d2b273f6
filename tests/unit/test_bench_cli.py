"""The bench command line: report regeneration and option checking (nothing that needs root)."""

import json

from click.testing import CliRunner

from ebpf_proxy.cli import main
from ebpf_proxy.cli.bench import PROFILES, _pick
from tests.unit.test_bench_results import synthetic_doc


def test_bench_is_registered():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    assert "--compare OLD NEW" in result.output and "--quick" in result.output


def test_report_from_results(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(synthetic_doc()))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench", "--report-from", str(tmp_path / "results.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "report.md").read_text().startswith("# ebpf-proxy bench")


def test_bad_options_are_refused_before_anything_runs():
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--modes", "ipvs"])
    assert result.exit_code == 2 and "ipvs" in result.output
    result = runner.invoke(main, ["bench", "--modes", ""])
    assert result.exit_code == 2


def test_quick_profile_defaults_and_explicit_options_win():
    assert _pick("services", None, quick=True) == "1,1000"
    assert _pick("services", None, quick=False) == "1,1000,10000"
    assert _pick("duration", "3s", quick=True) == "3s"
    assert all(len(v) == 2 for v in PROFILES.values())


def test_soak_is_registered_and_takes_proxy_modes_only():
    runner = CliRunner()
    result = runner.invoke(main, ["soak", "--help"])
    assert result.exit_code == 0 and "--minutes" in result.output and "--max-rate" in result.output
    result = runner.invoke(main, ["soak", "--modes", "direct"])  # nothing to soak without a proxy
    assert result.exit_code == 2 and "modes are iptables, ebpf" in result.output
    assert runner.invoke(main, ["soak", "--minutes", "0"]).exit_code == 2
