"""report.md and the plots, from a synthetic results document (no lab, no root)."""

import pytest

from ebpf_proxy.bench.report import PLOT_FILES, render_markdown, write_report
from tests.unit.test_bench_results import synthetic_doc


def test_report_has_every_section_and_says_what_was_skipped(tmp_path):
    doc = synthetic_doc()
    doc["unavailable"].append({"mode": "iptables", "metric": "kernel_state", "reason": "because"})
    doc["notes"].append("conn_rate clusterip iptables 1: run 2: 12 errors")
    text = render_markdown(doc, ["conn_rate.png"])
    for heading in ("# ebpf-proxy bench", "## Data path", "## Control plane", "## Kernel state",
                    "## Not measured", "## Notes", "## Plots"):
        assert heading in text
    assert "**Mode ebpf was skipped**: ebpf_proxy.datapath.ebpf.EbpfDatapath is not available" in text
    assert "ebpf-proxy bench --quick" in text
    assert "iptables kernel_state: because" in text
    assert "![conn_rate](conn_rate.png)" in text
    # the 1,000-service iptables ClusterIP rate of the synthetic doc: median 15000/2
    assert "7,500 ±5%" in text
    # a mode that was not measured has dashes, never a number
    assert "| ClusterIP (from a pod) | 1 | 20,000" in text
    line = next(line for line in text.splitlines() if line.startswith("| ClusterIP (from a pod) | 1 |"))
    assert line.rstrip(" |").endswith("–")


def test_write_report_draws_the_plots(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_report(synthetic_doc(), tmp_path)
    assert path == tmp_path / "report.md"
    for name in PLOT_FILES.values():
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name})" in path.read_text()


def test_report_of_a_direct_only_run(tmp_path):
    doc = synthetic_doc(("direct",), (1,))
    text = render_markdown(doc, [])
    assert "## Data path" in text and "## Control plane" not in text
