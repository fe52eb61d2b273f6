"""report.md and the plots, from a synthetic results document (no lab, no root)."""

import pytest

from ebpf_proxy.bench.report import PLOT_FILES, render_markdown, write_report
from ebpf_proxy.bench.results import check, summarize
from tests.unit.test_bench_results import synthetic_doc


def test_report_has_every_section_and_says_what_was_skipped(tmp_path):
    doc = synthetic_doc()
    doc["unavailable"].append({"mode": "iptables", "metric": "kernel_state", "reason": "because"})
    doc["notes"].append("conn_rate clusterip iptables 1: run 2: 12 errors")
    text = render_markdown(doc, ["conn_rate.png"])
    for heading in ("# ebpf-proxy bench", "## Targets", "## Data path", "## Control plane", "## Kernel state",
                    "## Not measured", "## Notes", "## Plots"):
        assert heading in text
    # every target is listed, the ones this 1 / 1,000-Service run cannot answer as such
    assert "| iptables full sync (agent start → kernel complete) at 10,000 Services < 2 s | not measured" in text
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
    # kernel CPU per operation, modes side by side: direct 30, iptables 40 × (1 + 1,000/1,000)
    assert "Kernel CPU per operation" in text
    assert "| ClusterIP (from a pod) | 1,000 | 30.0 ±3% | 80.0 ±2% | – |" in text
    assert "| UDP, ClusterIP (from a pod) | 1 | 10.0 ±10% | 12.0 ±0% | – |" in text
    # beside each install, a full list's wall (0.002 × 1,000 + 0.05 s, then 0.001 × 1,000 + 0.05 s)
    # and the API server's own CPU for it (0.001 × 1,000 s, then 0.0005 × 1,000 s)
    assert "| 1,000 | 995 | 0 | 10.1 s | 2.05 / 1.05 | 1 / 0.5 |" in text
    # a results.json from before the CPU was taken: its one wall figure, dashes for the rest
    for install in doc["installs"]:
        for key in ("list_first_s", "list_later_s", "api_cpu_first_s", "api_cpu_later_s"):
            del install[key]
    assert "| 1,000 | 995 | 0 | 10.1 s | 2.05 / – | – / – |" in render_markdown(doc, [])


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


def test_report_shows_the_programs_cost_under_load():
    doc = synthetic_doc(("direct", "iptables"), (1,))
    doc["modes"]["ebpf"] = {"status": "ok"}
    doc["parameters"]["modes"] = ["direct", "iptables", "ebpf"]
    for path, ns in (("clusterip_syn", 1200.0), ("established", 430.0), ("nodeport", 1700.0)):
        doc["points"].append({"metric": "bpf_ns_per_packet", "path": path, "mode": "ebpf", "services": 1,
                              "unit": "ns", "values": [ns] * 3, "runs": [{"median": ns, "p99": 2 * ns}] * 3})
    for path, ns in (("load_tc_ingress", 310.0), ("load_tc_egress", 150.0)):
        doc["points"].append({"metric": "bpf_ns_per_packet", "path": path, "mode": "ebpf", "services": 1,
                              "unit": "ns", "values": [ns] * 3, "runs": [{"run_time_ns": 1, "run_cnt": 1}] * 3})
    doc["summary"] = summarize(doc["points"])
    assert check(doc) == []
    text = render_markdown(doc, [])
    assert "| ClusterIP, established | 430 / 860 ±0% |" in text
    assert "Under load, as a cross-check" in text
    assert "| tc_ingress | 310 ±0% |" in text and "| tc_egress | 150 ±0% |" in text


def test_report_names_the_runs_that_hit_a_cpu_limit():
    doc = synthetic_doc(("direct", "iptables"), (1,))
    text = render_markdown(doc, [])
    assert "No run hit a CPU limit" in text
    point = next(p for p in doc["points"] if p["metric"] == "conn_rate" and p["mode"] == "iptables")
    point["limits"] = [{"limited_by": ["server backend-1 (0.97 cores)"]},
                       {"limited_by": ["server backend-1 (0.95 cores)", "machine (2% idle)"]},
                       {"limited_by": []}]
    text = render_markdown(doc, [])
    assert ("- conn_rate clusterip iptables at 1 services: machine in 1 of 3 runs, "
            "server backend-1 in 2 of 3 runs") in text


def test_the_ipv6_cluster_ip_row_compares_with_the_ipv6_pod_ips():
    from ebpf_proxy.bench.results import Results
    from tests.unit.test_bench_results import rate_point

    doc = synthetic_doc()
    assert "ClusterIP over IPv6" not in render_markdown(doc, [])  # an IPv4-only run: no such row
    r = Results(doc["parameters"], doc["command"])
    r.doc = doc
    r.add_point(rate_point("conn_rate", "clusterip6", "iptables", 1, (9000, 9100, 8900)))
    r.add_point(rate_point("conn_rate", "direct6", "direct", 1, (12000, 12100, 11900)))
    r.finish()
    row = next(line for line in render_markdown(r.doc, []).splitlines()
               if line.startswith("| ClusterIP over IPv6") and "| 1 |" in line)
    assert "12,000" in row.split("|")[3] and "9,000" in row.split("|")[4], row  # direct6, then iptables


def test_the_pod_ip_row_puts_each_proxy_mode_beside_the_direct_baseline():
    """podip (the pod IPs with a proxy mode's agents on) is direct's traffic: its row's direct cell is
    the direct baseline, the others each mode's podip point; runs from before it have no such row."""
    from ebpf_proxy.bench.results import Results
    from tests.unit.test_bench_results import rate_point

    doc = synthetic_doc()
    assert "pod IPs, no Service" not in render_markdown(doc, [])  # no such row, nor its explanation
    r = Results(doc["parameters"], doc["command"])
    r.doc = doc
    r.add_point(rate_point("conn_rate", "podip", "iptables", 1, (4600, 4700, 4500)))
    r.add_point(rate_point("conn_rate", "podip", "ebpf", 1, (19000, 19100, 18900)))
    r.finish()
    assert "what the mode costs traffic no Service translates" in render_markdown(r.doc, [])
    rows = [line for line in render_markdown(r.doc, []).splitlines() if line.startswith("| pod IPs, no Service")]
    row = next(line for line in rows if "| 1 |" in line)
    direct = next(line for line in render_markdown(r.doc, []).splitlines() if line.startswith("| ClusterIP (from a pod)")
                  and "| 1 |" in line).split("|")[3]
    cells = row.split("|")
    assert cells[3] == direct and "4,600" in cells[4] and "19,000" in cells[5], row  # direct, iptables, ebpf
