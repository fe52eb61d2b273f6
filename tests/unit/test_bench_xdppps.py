"""The xdp_pps rows (bench/xdppps.py): their summary and report, and reading kube-proxy's DROP rule
counter out of `iptables-save -c`. The flood itself runs for real in tests/lab/test_bench_pktgen.py."""

import pytest

from ebpf_proxy.bench import xdppps
from ebpf_proxy.bench.report import render_markdown
from ebpf_proxy.bench.results import Results, check, summarize_point
from tests.unit.test_bench_results import synthetic_doc


def xdp_point(path="xdp-native", mode="ebpf", services=1, pps=(200000.0, 210000.0, 190000.0)):
    runs = [{"sent": int(p * 2), "dropped": int(p * 2), "seconds": 2.0, "sent_pps": p + 50000, "pps": p} for p in pps]
    return {"metric": "xdp_pps", "path": path, "mode": mode, "services": services, "unit": "pps",
            "node": "worker2", "values": list(pps), "runs": runs}


def test_an_xdp_row_carries_what_was_sent():
    row = summarize_point(xdp_point())
    assert (row["value"], row["sent_pps"], row["unit"], row["p50"]) == (200000.0, 250000.0, "pps", None)


def test_xdp_rows_pass_the_check_and_get_their_report_section():
    doc = synthetic_doc()
    r = Results(doc["parameters"], doc["command"])
    r.doc = doc
    for variant in (*xdppps.VARIANTS["ebpf"], *xdppps.VARIANTS["iptables"]):
        r.add_point(xdp_point(variant.name, variant.mode, 1000))
    r.finish()
    assert check(r.doc) == []
    text = render_markdown(r.doc, [])
    assert "## NodePort flood: packets dropped per second" in text
    for title in ("ebpf, XDP native", "ebpf, TC only (XDP off)", "iptables (filter KUBE-EXTERNAL-SERVICES)"):
        assert f"| {title} | 200,000 (250,000) ±5% |" in text


SAVED = """*filter
:KUBE-EXTERNAL-SERVICES - [0:0]
[12:480] -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "default/other has no local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30001 -j DROP
[98752:3950080] -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "default/bench-np-drop has no local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30088 -j DROP
COMMIT
"""


def test_the_drop_rule_counter_of_one_node_port():
    assert xdppps.drop_rule_packets(SAVED, 30088) == 98752
    assert xdppps.drop_rule_packets(SAVED, 30001) == 12
    with pytest.raises(xdppps.XdpPpsError, match="no KUBE-EXTERNAL-SERVICES DROP rule for nodePort 30002"):
        xdppps.drop_rule_packets(SAVED, 30002)
