"""The agent's DriftAuditor without a kernel: the audit itself is replaced by a scripted one, so
what is checked here is what the agent does with reports (metrics, logging once, repair, HTTP)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from ebpf_proxy.agent import audit as agent_audit
from ebpf_proxy.agent.audit import DriftAuditor
from ebpf_proxy.agent.config import ConfigError, load_config
from ebpf_proxy.agent.metrics import Metrics
from ebpf_proxy.explain.audit import EXTRA, MISSING, STALE, AuditReport, AuditUnavailable, Drift
from ebpf_proxy.lab.topology import TopologyError, parse_topology

GONE = Drift(MISSING, "iptables rule", "nat KUBE-SERVICES rule 3", "`-A KUBE-SERVICES ...`")
ODD = Drift(EXTRA, "backend", "77", "no service port uses it")


class _Scripted:
    """Stands in for explain.audit.audit: returns the next scripted drifts, records repair flags."""

    def __init__(self, *drift_lists):
        self.drift_lists = list(drift_lists)
        self.calls: list[bool] = []

    def __call__(self, datapath, repair=False, memo=None):
        self.calls.append(repair)
        return AuditReport(mode="iptables", drifts=list(self.drift_lists.pop(0)), repaired=repair and True,
                           writes=2 if repair else 0, checked={"rules": 10})


def _auditor(monkeypatch, script, repair=False, datapath=object()):
    monkeypatch.setattr(agent_audit, "audit", script)
    metrics = Metrics()
    return DriftAuditor(lambda: [(4, datapath)], threading.Lock(), metrics, period=60, repair=repair), metrics


def _gauge(metrics, kind):
    return metrics.registry.get_sample_value("ebpfproxy_datapath_drift_entries", {"kind": kind})


def test_drift_is_exported_and_logged_once_while_it_lasts(monkeypatch, caplog):
    script = _Scripted([GONE], [GONE, ODD], [ODD], [])
    auditor, metrics = _auditor(monkeypatch, script)
    caplog.set_level(logging.WARNING, logger="ebpf_proxy.agent.audit")

    auditor.run_once()
    assert _gauge(metrics, MISSING) == 1 and _gauge(metrics, EXTRA) == 0 and _gauge(metrics, STALE) == 0
    auditor.run_once()
    auditor.run_once()
    auditor.run_once()
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [f"datapath drift: {GONE}", f"datapath drift: {ODD}"], "each drift once, not per audit"
    assert _gauge(metrics, MISSING) == 0 and _gauge(metrics, EXTRA) == 0
    assert metrics.registry.get_sample_value("ebpfproxy_datapath_audits_total", {"result": "drift"}) == 3
    assert metrics.registry.get_sample_value("ebpfproxy_datapath_audits_total", {"result": "clean"}) == 1
    assert script.calls == [False] * 4


def test_a_repaired_drift_that_comes_back_is_logged_again(monkeypatch, caplog):
    script = _Scripted([GONE], [GONE])
    auditor, _ = _auditor(monkeypatch, script, repair=True)
    caplog.set_level(logging.WARNING, logger="ebpf_proxy.agent.audit")
    auditor.run_once()
    auditor.run_once()
    assert [r.getMessage() for r in caplog.records] == [f"datapath drift: {GONE}"] * 2
    assert script.calls == [True, True]


def test_http_answers(monkeypatch):
    script = _Scripted([GONE], [])
    auditor, _ = _auditor(monkeypatch, script)
    status, ctype, body, _ = auditor.respond("/audit/repair")
    doc = json.loads(body)
    assert status == 200 and ctype == "application/json"
    assert doc["clean"] is False and doc["repaired"] is True and doc["drifts"][0]["key"] == GONE.key
    assert AuditReport.from_json(doc).drifts == [GONE]
    assert json.loads(auditor.respond("/audit")[2])["clean"] is True
    assert script.calls == [True, False]
    assert auditor.respond("/metrics") is None, "other paths are the metrics server's"


def test_http_before_the_first_sync_is_503(monkeypatch):
    def unavailable(datapath, repair=False, memo=None):
        raise AuditUnavailable("iptables datapath: no sync has completed yet, nothing to compare")

    auditor, _ = _auditor(monkeypatch, unavailable)
    status, _, body, _ = auditor.respond("/audit")
    assert status == 503 and "no sync has completed" in json.loads(body)["error"]
    auditor_without, _ = _auditor(monkeypatch, unavailable, datapath=None)
    assert auditor_without.respond("/audit")[0] == 503


def test_a_failing_audit_is_counted_and_answered_500(monkeypatch):
    def broken(datapath, repair=False, memo=None):
        raise RuntimeError("iptables-save exited 4")

    auditor, metrics = _auditor(monkeypatch, broken)
    status, _, body, _ = auditor.respond("/audit")
    assert status == 500 and "iptables-save exited 4" in json.loads(body)["error"]
    assert metrics.registry.get_sample_value("ebpfproxy_datapath_audits_total", {"result": "error"}) == 1


def test_report_lines():
    report = AuditReport(mode="ebpf", drifts=[GONE, ODD], checked={"frontends": 4}, repaired=True, writes=3)
    assert report.lines() == [str(GONE), str(ODD),
                              "ebpf: 2 drifted (1 missing, 1 extra, 0 stale; 4 frontends checked)",
                              "repaired with 3 writes"]
    assert AuditReport(mode="ebpf", checked={"frontends": 4}).lines() == ["ebpf: no drift (4 frontends checked)"]


def test_audit_flags():
    config = load_config({"audit_period": "10s", "audit_repair": "false"})
    assert config.audit_period == 10.0 and config.audit_repair is False
    assert load_config({}).audit_period == 60.0 and load_config({}).audit_repair is True
    with pytest.raises(ConfigError, match="--audit-period: must be greater than or equal to 0"):
        load_config({"audit_period": "-1s"})
    with pytest.raises(ConfigError, match="--audit-repair: expected true or false"):
        load_config({"audit_repair": "sometimes"})


def test_topology_agent_args():
    base = {"nodes": [{"name": "w1", "ip": "172.20.20.15"}]}
    topo = parse_topology({**base, "agentArgs": ["--audit-period", "10s"]})
    assert topo.agent_args == ("--audit-period", "10s")
    assert parse_topology(topo.to_dict()) == topo
    with pytest.raises(TopologyError, match=r"agentArgs\[1\]"):
        parse_topology({**base, "agentArgs": ["--audit-period", 10]})


def test_a_dual_stack_node_audits_each_family_and_names_the_secondary_ones_drifts(monkeypatch):
    """One report for both family datapaths (kube-proxy's per-family proxiers each have their
    rules); a drift of the IPv6 ip6tables rules says IPv6, each family keeps its own memo."""
    v4, v6 = object(), object()
    memos = {}

    def scripted(datapath, repair=False, memo=None):
        memos.setdefault(id(datapath), memo)
        assert memos[id(datapath)] is memo  # the same memo every time for the same datapath
        drifts = [GONE] if datapath is v6 else []
        return AuditReport(mode="ebpf" if datapath is v4 else "iptables", drifts=drifts, repaired=repair,
                           writes=1 if repair and drifts else 0, checked={"rules": 10})

    monkeypatch.setattr(agent_audit, "audit", scripted)
    metrics = Metrics()
    auditor = DriftAuditor(lambda: [(4, v4), (6, v6)], threading.Lock(), metrics, period=60, repair=True)
    report = auditor.run_once()
    auditor.run_once()
    assert report.mode == "ebpf (IPv4) + iptables (IPv6)"
    assert [str(d) for d in report.drifts] == [f"missing IPv6 iptables rule {GONE.key}: {GONE.detail}"]
    assert report.checked == {"rules": 10, "IPv6 rules": 10} and report.writes == 1 and report.repaired
    assert _gauge(metrics, MISSING) == 1


def test_no_audit_before_every_family_has_its_datapath(monkeypatch):
    monkeypatch.setattr(agent_audit, "audit", _Scripted([]))
    auditor = DriftAuditor(lambda: [(4, object()), (6, None)], threading.Lock(), Metrics(), period=60, repair=False)
    with pytest.raises(AuditUnavailable, match="still starting"):
        auditor.run_once()


class _Syncs:
    """The agent's count of syncs begun, and the lock they hold; `during` scripts, per audit call,
    whether a sync begins while that audit reads (or what it raises)."""

    def __init__(self, during=()):
        self.lock = threading.Lock()
        self.count = 0
        self.during = list(during)
        self.calls: list[tuple[bool, bool]] = []  # (repair, whether the lock was held)

    def audit(self, drifts):
        def scripted(datapath, repair=False, memo=None):
            self.calls.append((repair, self.lock.locked()))
            what = self.during.pop(0) if self.during else None
            if isinstance(what, Exception):
                raise what
            if what == "sync":
                self.count += 1  # as Agent.sync does, under the lock it would then hold
            return AuditReport(mode="ebpf", drifts=list(drifts), repaired=repair, checked={"frontends": 1})
        return scripted

    def auditor(self, monkeypatch, drifts=(), repair=True):
        monkeypatch.setattr(agent_audit, "audit", self.audit(drifts))
        return DriftAuditor(lambda: [(4, object())], self.lock, Metrics(), period=60, repair=repair,
                            syncs=lambda: self.count)


def test_a_clean_audit_does_not_hold_syncs_off(monkeypatch):
    """An endpoint change must not wait for the audit's read-back (seconds at 100,000 Services):
    with the agent's count of syncs, the audit reads without the lock, and its finding stands when
    no sync began meanwhile."""
    syncs = _Syncs()
    report = syncs.auditor(monkeypatch).run_once()
    assert report.clean and syncs.calls == [(False, False)]


def test_a_drift_found_without_the_lock_is_audited_again_and_repaired_under_it(monkeypatch):
    syncs = _Syncs()
    report = syncs.auditor(monkeypatch, drifts=[ODD]).run_once()
    assert syncs.calls == [(False, False), (True, True)] and report.repaired and report.drifts == [ODD]
    syncs = _Syncs()
    report = syncs.auditor(monkeypatch, drifts=[ODD], repair=False).run_once()
    assert syncs.calls == [(False, False)] and not report.repaired, "report only: nothing needs the lock"


def test_an_audit_a_sync_overlapped_is_not_a_finding(monkeypatch):
    """A sync that began while the audit read: what it read may mix two states. Tried again; when
    syncs keep coming, the audit runs under the lock, as without a count of syncs."""
    syncs = _Syncs(during=["sync", None])
    syncs.auditor(monkeypatch).run_once()
    assert syncs.calls == [(False, False), (False, False)]
    syncs = _Syncs(during=["sync", "sync", None])
    syncs.auditor(monkeypatch).run_once()
    assert syncs.calls == [(False, False), (False, False), (True, True)]
    syncs = _Syncs(during=[RuntimeError("dictionary changed size during iteration"), None])
    syncs.auditor(monkeypatch).run_once()
    assert syncs.calls == [(False, False), (False, False)]


def test_an_early_first_audit_tries_until_a_sync_then_keeps_the_period(monkeypatch):
    """first_delay (an iptables agent's proof, agent.first_audit_delay): tried at its pace while
    nothing has synced, once it ran the period again."""
    script = _Scripted([], [])
    monkeypatch.setattr(agent_audit, "audit", script)
    box: dict[str, object | None] = {"datapath": None}
    auditor = DriftAuditor(lambda: [(4, box["datapath"])], threading.Lock(), Metrics(), period=30, repair=False,
                           first_delay=0.02)
    auditor.start()
    try:
        time.sleep(0.2)
        assert script.calls == [], "no datapath yet: skipped"
        box["datapath"] = object()
        deadline = time.monotonic() + 10
        while not script.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert script.calls == [False], "the first audit came at the early pace"
        time.sleep(0.3)
        assert script.calls == [False], "then the period"
    finally:
        auditor.stop()
