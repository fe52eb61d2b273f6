"""The agent's drift audit: every `--audit-period`, compare the kernel with the last sync.

kube-proxy rewrites everything in a full sync (hourly here, as there), so what another tool
changes in between stays wrong for up to an hour without a word. The auditor runs the audit
(explain/audit.py) between syncs, exports what it found as the gauge
`ebpfproxy_datapath_drift_entries{kind}` (missing/extra/stale, as of the last audit, before
any repair), logs each drift once (not again on every audit while it lasts), and with
`--audit-repair` (the default) writes back exactly what drifted. `GET /audit` and
`GET /audit/repair` on the metrics address run one on demand (`ebpf-proxy audit` calls them).

The audit reads every map back and compares it with the last sync: at 100,000 Services x 10
endpoints ~3.7 s of CPU. Run under the lock syncs hold, an endpoint change that came meanwhile
waited for it (a 2.7 s update in the 100k bench, 2026-11-27, against a 7.7 ms median). So the
auditor runs without holding syncs off and then checks, under the lock, that no sync began
meanwhile (`syncs`, a count the agent bumps under that lock): if none did, the maps and the
agent's belief were both still while it read, and its findings stand. Only what needs the lock
runs under it: the repair of a drift found, and, when syncs kept coming (two tries), the audit
itself, as before.

The first audit may come sooner than the period (`first_delay`, tried at that pace until a sync
has completed): an iptables agent's clean audit is what lets its next restart skip the restore
(datapath/iptables/proof.py), and with only the period a restart within a minute of the last
(a crash loop, a quick rollout) found no proof and restored every rule.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence

from ebpf_proxy.agent.metrics import Metrics
from ebpf_proxy.explain.audit import AuditReport, AuditUnavailable, Drift, audit, merge

log = logging.getLogger(__name__)


class DriftAuditor:
    """Runs audits of the datapaths `datapaths()` returns, as (IP family, datapath) pairs with the
    primary family first (one per family proxier), under `lock` (the one syncs hold); their
    reports are merged into one (explain.audit.merge)."""

    def __init__(self, datapaths: Callable[[], Sequence[tuple[int, object | None]]], lock: threading.Lock,
                 metrics: Metrics, *, period: float, repair: bool, syncs: Callable[[], int] | None = None,
                 first_delay: float | None = None) -> None:
        """`syncs`: how many syncs have begun, read under `lock` (None: every audit runs under
        the lock, as a caller without such a count needs). `first_delay`: the wait before the
        first audit, and between tries while there is nothing to audit yet (None: the period)."""
        self.first_delay = first_delay
        self._datapaths = datapaths
        self._lock = lock
        self._syncs = syncs
        self._metrics = metrics
        self.period = period
        self.repair = repair
        self._logged: set[Drift] = set()  # drifts already logged, until they are gone
        # what the audit keeps between runs of one datapath (explain.audit.audit's memo), by family,
        # with the datapath it is about
        self._memos: dict[int, tuple[object, dict]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def run_once(self, repair: bool | None = None) -> AuditReport:
        """One audit (repairing per `repair`, default the agent's setting). Raises AuditUnavailable
        before the first sync."""
        datapaths = list(self._datapaths())
        if not datapaths or any(dp is None for _family, dp in datapaths):
            raise AuditUnavailable("no datapath yet: the agent is still starting")
        do_repair = self.repair if repair is None else repair
        try:
            report = self._while_syncing(datapaths)
            if report is None or (report.drifts and do_repair):  # syncs kept coming, or a drift to repair
                with self._lock:
                    report = self._audit(datapaths, do_repair)
        except AuditUnavailable:
            raise
        except Exception:
            self._metrics.audits.labels(result="error").inc()
            raise
        self._record(report)
        return report

    def _audit(self, datapaths: Sequence[tuple[int, object | None]], repair: bool) -> AuditReport:
        reports = []
        for family, datapath in datapaths:
            if self._memos.get(family, (None,))[0] is not datapath:
                self._memos[family] = (datapath, {})
            # the memo holds only pairs of texts proven equal: true whenever it was filled
            reports.append((family, audit(datapath, repair=repair, memo=self._memos[family][1])))
        return merge(reports)

    def _while_syncing(self, datapaths: Sequence[tuple[int, object | None]], tries: int = 2) -> AuditReport | None:
        """An audit (no repair) that does not hold syncs off; None when a sync began during each
        of `tries` (what it read may then mix two syncs' states: not a finding) or there is no
        count of syncs to tell."""
        if self._syncs is None:
            return None
        for _ in range(tries):
            with self._lock:
                before = self._syncs()
            try:
                report = self._audit(datapaths, repair=False)
            except RuntimeError:  # e.g. a dict a sync changed while it was read: that sync is counted
                report = None
            with self._lock:
                if report is not None and self._syncs() == before:
                    return report
        return None

    def _record(self, report: AuditReport) -> None:
        for kind, n in report.counts().items():
            self._metrics.drift_entries.labels(kind=kind).set(n)
        self._metrics.audits.labels(result="drift" if report.drifts else "clean").inc()
        current = set(report.drifts)
        for drift in sorted(current - self._logged):
            log.warning("datapath drift: %s", drift, extra={"mode": report.mode, "drift_kind": drift.kind,
                                                             "object": drift.what, "key": drift.key})
        if report.repaired:
            log.info("drift repaired", extra={"mode": report.mode, "drifts": len(report.drifts),
                                              "writes": report.writes})
            self._logged = set()  # written back: if it drifts again, that is news again
        else:
            self._logged = current

    # ---- the periodic loop ----------------------------------------------------------------------

    def start(self) -> None:
        if self.period <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="drift-audit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        early = self.first_delay is not None and self.first_delay < self.period
        while not self._stop.wait(self.first_delay if early else self.period):
            try:
                self.run_once()
            except AuditUnavailable as exc:
                log.debug("drift audit skipped: %s", exc)
                continue  # nothing synced yet: an early first audit keeps trying at its pace
            except Exception:
                log.exception("drift audit failed")
            early = False

    # ---- on demand, over HTTP -------------------------------------------------------------------

    def respond(self, path: str) -> tuple[int, str, bytes, dict[str, str]] | None:
        """`/audit` (report) and `/audit/repair` (report and repair) for the metrics server."""
        if path not in ("/audit", "/audit/repair"):
            return None
        try:
            report = self.run_once(repair=path == "/audit/repair")
        except AuditUnavailable as exc:
            return 503, "application/json", json.dumps({"error": str(exc)}).encode(), {}
        except Exception as exc:  # the report says why; the agent keeps running
            return 500, "application/json", json.dumps({"error": f"audit failed: {exc}"}).encode(), {}
        return 200, "application/json", json.dumps(report.to_json(), indent=1).encode(), {}
