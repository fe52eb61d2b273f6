"""`ebpf-proxy stats` and the live datapath metrics, from synthetic counters (no root, no BPF).

The reading of real pinned maps is covered by tests/e2e/test_stats.py; here: the reason
descriptions against common.h, the verdict of every reason, the table and JSON renderings, the
error when nothing is pinned, and the Prometheus collector reading counters at scrape time.
"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from ebpf_proxy.agent.agent import Agent
from ebpf_proxy.agent.config import load_config
from ebpf_proxy.agent.metrics import Metrics
from ebpf_proxy.cli import main
from ebpf_proxy.cli import stats as stats_cli
from ebpf_proxy.datapath.ebpf import inspect as epx_inspect
from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf.structs import Reason
from ebpf_proxy.datapath.fake import FakeDatapath

R = Reason
COUNTERS = {
    R.DROP_NO_LOCAL_EXTERNAL: (3, 180),
    R.DROP_MALFORMED_IP: (1, 20),
    R.FWD_NEW: (5, 300),
    R.PASS_NO_SERVICE: (40, 4000),
    R.REJECT: (2, 120),
}
MAPS = {"epx_svc": (4, 65536), "epx_backend": (2, 65536), "epx_ct4": (950, 1000)}


def snap() -> epx_inspect.Snapshot:
    return epx_inspect.snapshot(COUNTERS, MAPS, pin_dir=None)


# ---- the mirror of common.h and the verdicts ----


def test_every_reason_description_is_the_c_comment_verbatim():
    text = (loader.BPF_SRC_DIR / "lib" / "common.h").read_text()
    body = text[text.index("enum epx_reason {"):text.index("};", text.index("enum epx_reason {"))]
    comments = dict(re.findall(r"EPX_(\w+) = \d+,\s*/\* (.*?) \*/", body))
    assert len(comments) == len(Reason)
    assert {r.name: r.description for r in Reason} == comments


def test_verdicts_follow_the_reason_families():
    verdicts = {r: epx_inspect.verdict(r) for r in Reason}
    assert set(verdicts.values()) <= set(epx_inspect.VERDICTS)
    assert [r for r, v in verdicts.items() if v == "none"] == [R.CONTINUE]
    assert [r for r, v in verdicts.items() if v == "event"] == [
        R.EV_CT_EARLY_DROP, R.EV_HOST_ROUTED_PEER, R.EV_HOST_ROUTED_NEIGH, R.EV_HOST_STACK_FIB, R.EV_HOST_STACK_MTU,
        R.EV_HOST_STACK_SKIP, R.EV_CT_PORT_REMAP, R.EV_CT_CLOSED_FORGOTTEN]
    assert {r for r, v in verdicts.items() if v == "drop"} == {r for r in Reason if r.is_drop}
    assert {r for r, v in verdicts.items() if v == "reject"} == {R.REJECT, R.SOCK_REJECT}
    assert {r for r, v in verdicts.items() if v == "pass"} == {r for r in Reason if r.name.startswith("PASS_")}
    assert verdicts[R.FWD_NEW] == verdicts[R.REV_SNAT] == verdicts[R.ARP_MASQ] == "translate"
    assert R.CONTINUE not in epx_inspect.COUNTED_REASONS


# ---- JSON ----


def test_json_lists_every_counted_reason_with_its_drop_flag():
    data = snap().to_json()
    assert set(data["reasons"]) == {r.name for r in Reason} - {"CONTINUE"}
    assert data["reasons"]["DROP_NO_LOCAL_EXTERNAL"] == {"packets": 3, "bytes": 180, "drop": True, "verdict": "drop"}
    assert data["reasons"]["FWD_NEW"] == {"packets": 5, "bytes": 300, "drop": False, "verdict": "translate"}
    assert data["reasons"]["DROP_SOURCE_RANGE"] == {"packets": 0, "bytes": 0, "drop": True, "verdict": "drop"}
    assert data["maps"] == {"epx_svc": {"entries": 4, "max_entries": 65536},
                            "epx_backend": {"entries": 2, "max_entries": 65536},
                            "epx_ct4": {"entries": 950, "max_entries": 1000}}
    assert snap().dropped_packets == 4


@pytest.fixture
def fake_read(monkeypatch):
    seen = []

    def read(bpffs=None):
        seen.append(bpffs)
        return snap()

    monkeypatch.setattr(epx_inspect, "read", read)
    return seen


def run_cli(*args: str):
    return CliRunner().invoke(main, ["stats", *args], env={"COLUMNS": "200"}, catch_exceptions=False)


def test_cli_json_prints_exactly_one_object(fake_read):
    result = run_cli("--json", "--bpffs", "/somewhere")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == snap().to_json()
    assert fake_read == ["/somewhere"]


# ---- the table ----


def test_table_shows_only_nonzero_reasons_with_their_meaning(fake_read):
    result = run_cli()
    assert result.exit_code == 0, result.output
    out = result.output
    for name in ("DROP_NO_LOCAL_EXTERNAL", "DROP_MALFORMED_IP", "FWD_NEW", "PASS_NO_SERVICE", "REJECT"):
        assert name in out
    assert "DROP_SOURCE_RANGE" not in out and "SOCK_FWD" not in out
    assert R.DROP_NO_LOCAL_EXTERNAL.description in out
    assert "4,000" in out  # PASS_NO_SERVICE's bytes, thousands separated
    assert "4 packets dropped: DROP_NO_LOCAL_EXTERNAL, DROP_MALFORMED_IP" in out
    assert "epx_ct4" in out and "950" in out and "1,000" in out
    assert fake_read == [None]  # no --bpffs: the reader locates the pin dir itself


def test_all_lists_every_counted_reason(fake_read):
    out = run_cli("--all").output
    assert all(r.name in out for r in epx_inspect.COUNTED_REASONS)
    assert "CONTINUE" not in out


def test_drops_come_first_and_only_counted_drops_are_highlighted():
    table = stats_cli.reason_table(snap(), show_all=True)
    names = list(table.columns[0].cells)
    verdicts = list(table.columns[1].cells)
    first_other = next(i for i, v in enumerate(verdicts) if v != "drop")
    assert all(v == "drop" for v in verdicts[:first_other]) and "drop" not in verdicts[first_other:]
    styles = {name: row.style for name, row in zip(names, table.rows)}
    assert styles["DROP_NO_LOCAL_EXTERNAL"] == styles["DROP_MALFORMED_IP"] == "bold red"
    assert styles["DROP_SOURCE_RANGE"] == ""  # a drop reason that never dropped anything is not alarming
    assert styles["REJECT"] == "yellow"


def test_nothing_counted_says_so(monkeypatch):
    monkeypatch.setattr(epx_inspect, "read", lambda bpffs=None: epx_inspect.snapshot({}, MAPS))
    out = run_cli().output
    assert "no packet counted yet" in out and "no packet dropped" in out and "epx_svc" in out


def test_no_pinned_maps_is_an_error_naming_the_path(tmp_path):
    result = CliRunner().invoke(main, ["stats", "--bpffs", str(tmp_path)])
    assert result.exit_code == 1
    assert (f"no ebpf-proxy maps pinned under {tmp_path}/ebpf-proxy: is the agent running in ebpf mode "
            "on this node?") in result.output


# ---- live metrics ----


class CountingDatapath(FakeDatapath):
    """A datapath whose counters move without any sync, as the kernel's do."""

    def __init__(self, node, **opts) -> None:
        super().__init__(node)
        self.values = dict(COUNTERS)
        self.fail = False

    def counters(self):
        if self.fail:
            raise OSError(9, "Bad file descriptor")
        return {R.CONTINUE: (0, 0), **self.values}


def sample(metrics: Metrics, what: str, reason: str, verdict: str) -> float | None:
    return metrics.registry.get_sample_value(f"ebpf_proxy_datapath_{what}_total", {"reason": reason, "verdict": verdict})


def make_agent(datapath_factory) -> Agent:
    config = load_config({"hostname_override": "n1", "mode": "iptables", "cluster_cidrs": "10.244.0.0/16"})
    return Agent(config, datapath_factory=datapath_factory, local_addresses=lambda: ["192.168.1.10"],
                 serve_http=False, health_check_server=lambda *a, **k: None)


def test_agent_exports_the_datapath_counters_at_scrape_time():
    created = []
    agent = make_agent(lambda mode, node, **opts: created.append(CountingDatapath(node)) or created[-1])
    assert sample(agent.metrics, "packets", "DROP_NO_LOCAL_EXTERNAL", "drop") is None  # no datapath yet
    agent.resolve_mode()
    agent.prepare_datapath()
    m = agent.metrics
    assert sample(m, "packets", "DROP_NO_LOCAL_EXTERNAL", "drop") == 3
    assert sample(m, "bytes", "DROP_NO_LOCAL_EXTERNAL", "drop") == 180
    assert sample(m, "packets", "FWD_NEW", "translate") == 5
    assert sample(m, "packets", "REJECT", "reject") == 2
    assert sample(m, "packets", "CONTINUE", "none") is None
    created[0].values[R.DROP_NO_LOCAL_EXTERNAL] = (7, 420)  # the kernel counted more; no sync ran
    assert sample(m, "packets", "DROP_NO_LOCAL_EXTERNAL", "drop") == 7
    text = m.render().decode()
    assert 'ebpf_proxy_datapath_packets_total{reason="DROP_NO_LOCAL_EXTERNAL",verdict="drop"} 7.0' in text


def test_datapath_without_counters_exports_none_and_a_failing_read_does_not_break_the_scrape():
    agent = make_agent(lambda mode, node, **opts: FakeDatapath(node))
    agent.resolve_mode()
    agent.prepare_datapath()
    text = agent.metrics.render().decode()
    assert "ebpf_proxy_datapath_packets_total{" not in text and "kubeproxy_sync_proxy_rules_duration" in text

    dp = CountingDatapath(None)
    agent.metrics.read_counters_from(dp)
    dp.fail = True
    text = agent.metrics.render().decode()
    assert "ebpf_proxy_datapath_packets_total{" not in text and "kubeproxy_sync_proxy_rules_duration" in text


def test_conntrack_pressure_metrics():
    """Entries against capacity (gauges, from the GC's count) and evictions (a counter, live)."""
    created = []
    agent = make_agent(lambda mode, node, **opts: created.append(CountingDatapath(node)) or created[-1])
    agent.resolve_mode()
    agent.prepare_datapath()
    m = agent.metrics
    created[0].values[R.EV_CT_EARLY_DROP] = (897, 0)
    created[0].values[R.DROP_CT_FULL] = (3, 180)
    assert m.registry.get_sample_value("ebpf_proxy_datapath_events_total", {"reason": "EV_CT_EARLY_DROP"}) == 897
    assert sample(m, "packets", "EV_CT_EARLY_DROP", "event") is None, "an eviction is not a packet"
    assert sample(m, "packets", "DROP_CT_FULL", "drop") == 3
    m.set_datapath_stats({"bpf_ct_entries": 250, "bpf_ct_capacity": 256, "bpf_ct_connections": 125})
    assert m.registry.get_sample_value("ebpf_proxy_conntrack_entries") == 250
    assert m.registry.get_sample_value("ebpf_proxy_conntrack_capacity") == 256
