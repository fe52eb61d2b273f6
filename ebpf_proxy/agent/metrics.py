"""Prometheus metrics, under kube-proxy's names where the meaning is the same.

Dashboards and alerts written for kube-proxy (sync latency, network programming latency, last
sync timestamp) keep working when ebpf-proxy replaces it. Our own additions are prefixed
`ebpf_proxy_`. Each Metrics object has its own CollectorRegistry: tests create as many agents as
they like, and nothing leaks into the process-global default registry.

Served over HTTP on --metrics-bind-address at /metrics (and /proxyMode, as kube-proxy does).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ebpf_proxy.agent.httpserve import BackgroundHTTPServer, Response, split_host_port

log = logging.getLogger(__name__)


def _exponential(start: float, factor: float, count: int) -> list[float]:
    return [start * factor**i for i in range(count)]


# kube-proxy's buckets: 1ms doubling (sync) and 0.25s .. 5min (network programming).
SYNC_BUCKETS = _exponential(0.001, 2, 15)
PROGRAMMING_BUCKETS = ([0.25, 0.5] + [float(s) for s in range(1, 60)] + [float(s) for s in range(60, 120, 5)]
                       + [float(s) for s in range(120, 330, 30)])

IPTABLES_STAT_PREFIX = "iptables_rules_"  # IptablesDatapath.stats(): iptables_rules_<table>


# (packets, bytes) per reason, as EbpfDatapath.counters() returns them (keys: structs.Reason).
CounterSource = Callable[[], Mapping[Any, tuple[int, int]]]


class DatapathCounters(Collector):
    """ebpf_proxy_datapath_{packets,bytes}_total{reason, verdict}, read from the datapath at scrape
    time: a drop shows on /metrics the moment it happened, not after the next sync (which may be
    `--sync-period` away). Datapaths without per-reason counters (iptables) export nothing.

    Labels use the C enum's names (`reason="DROP_NO_LOCAL_EXTERNAL"`), as `ebpf-proxy stats` does,
    so a graph, the stats table and bpf/lib/common.h can be grepped for the same word.
    """

    PACKETS = "ebpf_proxy_datapath_packets"
    BYTES = "ebpf_proxy_datapath_bytes"
    EVENTS = "ebpf_proxy_datapath_events"  # EV_* slots: things that happened, not packets (evictions)

    def __init__(self) -> None:
        self.source: CounterSource | None = None

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        labels = ["reason", "verdict"]
        return (CounterMetricFamily(self.PACKETS, "Packets the datapath counted, by reason and verdict", labels=labels),
                CounterMetricFamily(self.BYTES, "Bytes the datapath counted, by reason and verdict", labels=labels),
                CounterMetricFamily(self.EVENTS, "Events the datapath counted, by reason (EV_CT_EARLY_DROP: a "
                                    "connection dropped to make room in a full connection table; EV_CT_PORT_REMAP: "
                                    "a new connection given another source port, its client port toward that "
                                    "backend being another live connection's; EV_CT_CLOSED_FORGOTTEN: a closed "
                                    "connection forgotten because a new SYN came on its tuple (a reused client port); "
                                    "EV_HOST_ROUTED_*: "
                                    "packets the host-routing fast path forwarded; EV_HOST_STACK_*: packets it left "
                                    "to the host stack, and why)", labels=["reason"]))

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[CounterMetricFamily]:
        packets, nbytes, events = self._families()
        source = self.source
        try:
            counters = source() if source is not None else {}
        except Exception as exc:  # e.g. the maps closed under us at shutdown: never fail the whole scrape
            log.debug("datapath counters unavailable: %s", exc)
            counters = {}
        if counters:
            # Only ebpf datapaths have counters: an iptables-only agent never imports the eBPF package.
            from ebpf_proxy.datapath.ebpf.inspect import verdict

            for reason, (npackets, nb) in sorted(counters.items()):
                kind = verdict(reason)
                if kind == "none":  # CONTINUE: not a verdict, never counted
                    continue
                if kind == "event":  # not packets: one count per event
                    events.add_metric([reason.name], npackets)
                    continue
                packets.add_metric([reason.name, kind], npackets)
                nbytes.add_metric([reason.name, kind], nb)
        yield packets
        yield nbytes
        yield events


class Metrics:
    """Every metric the agent exports, in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds",
            buckets=SYNC_BUCKETS, registry=r)
        self.sync_full_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs",
            buckets=SYNC_BUCKETS, registry=r)
        self.sync_partial_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs", buckets=SYNC_BUCKETS, registry=r)
        self.last_sync_timestamp = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced",
            registry=r)
        self.last_queued_timestamp = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued", registry=r)
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds",
            buckets=PROGRAMMING_BUCKETS, registry=r)
        self.iptables_rules = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_total", "Total number of iptables rules owned by the proxy",
            ["table"], registry=r)
        self.datapath_objects = Gauge(
            "ebpf_proxy_datapath_objects", "Kernel objects the datapath holds (rules, map entries), by kind",
            ["kind"], registry=r)
        self.endpoint_changes = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes_total", "Cumulative proxy rules EndpointSlice changes",
            registry=r)
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes",
            registry=r)
        self.healthz = Counter("kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status", ["code"],
                               registry=r)
        self.livez = Counter("kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status", ["code"],
                             registry=r)
        self.invalid_objects = Counter(
            "ebpf_proxy_invalid_objects_total", "API objects (or parts of them) skipped as invalid",
            ["kind", "reason"], registry=r)
        self.sync_errors = Counter("ebpf_proxy_sync_errors_total", "Datapath syncs that failed", registry=r)
        self.sync_in_progress = Gauge(
            "ebpf_proxy_sync_in_progress", "1 while a sync of this kind (full, partial) is being written", ["kind"],
            registry=r)
        self.sync_progress = Gauge(
            "ebpf_proxy_sync_progress", "How far the running sync is, 0..1 (ebpf: service ports written; "
            "iptables: 0.5 once rendered, while iptables-restore runs); 0 when none runs", registry=r)
        self.datapath_info = Gauge("ebpf_proxy_datapath_info", "The datapath in use (value 1)", ["mode"],
                                   registry=r)
        self.drift_entries = Gauge(
            "ebpfproxy_datapath_drift_entries",
            "Kernel objects that differed from the last sync at the last drift audit, by kind "
            "(missing, extra, changed)", ["kind"], registry=r)
        self.audits = Counter("ebpfproxy_datapath_audits_total", "Drift audits run, by result (clean, drift, error)",
                              ["result"], registry=r)
        self.conntrack_entries = Gauge(
            "ebpf_proxy_conntrack_entries", "Entries in the eBPF connection table at the last garbage collection "
            "(2 per connection, 4 if masqueraded)", registry=r)
        self.conntrack_capacity = Gauge(
            "ebpf_proxy_conntrack_capacity", "Entries the eBPF connection table holds at most (kube-proxy's "
            "conntrack max x 2); full, new connections early-drop unanswered ones, then are dropped", registry=r)
        self.handover_connections = Counter(
            "ebpf_proxy_handover_connections_total", "Connections a mode switch found in the other mode's "
            "datapath, by that mode and outcome (adopted, moved, failed, and those left: node, "
            "other_masquerade_address, unknown)", ["from_mode", "outcome"], registry=r)
        self.tables_proven = Counter(
            "ebpf_proxy_iptables_tables_proven_total", "Tables a full sync of the iptables datapath did not restore: "
            "a clean drift audit had proved the kernel holds them as this sync renders them (a restart's "
            "saving; datapath/iptables/proof.py)", registry=r)
        self.datapath_counters = DatapathCounters()
        r.register(self.datapath_counters)

    def sync_started(self, full: bool) -> None:
        self.sync_progress.set(0)
        self.sync_in_progress.labels("full" if full else "partial").set(1)

    def sync_ended(self, full: bool) -> None:
        self.sync_in_progress.labels("full" if full else "partial").set(0)
        self.sync_progress.set(0)

    def observe_sync(self, seconds: float, full: bool, now_wall: float) -> None:
        self.sync_duration.observe(seconds)
        (self.sync_full_duration if full else self.sync_partial_duration).observe(seconds)
        self.last_sync_timestamp.set(now_wall)

    def observe_sync_counts(self, counts: dict[str, int]) -> None:
        """What one family's sync reported doing (SyncResult.counts) that has a metric."""
        self.tables_proven.inc(counts.get("tables_proven", 0))

    def observe_programming(self, trigger_times: list[float], now_wall: float) -> None:
        """kube-proxy's network programming latency: from the EndpointSlice change's trigger time
        (its last-change-trigger-time annotation) to the moment the change was programmed."""
        for trigger in trigger_times:
            if now_wall >= trigger:
                self.network_programming.observe(now_wall - trigger)

    def set_datapath(self, mode: str) -> None:
        self.datapath_info.clear()
        self.datapath_info.labels(mode=mode).set(1)

    def read_counters_from(self, datapath: object) -> None:
        """Export `datapath.counters()` live at every scrape (see DatapathCounters); a datapath
        without that method exports no per-reason counters. Replaces an earlier datapath."""
        counters = getattr(datapath, "counters", None)
        self.datapath_counters.source = counters if callable(counters) else None

    def set_datapath_stats(self, stats: dict[str, int]) -> None:
        if "bpf_ct_capacity" in stats:  # map pressure: entries against capacity
            self.conntrack_entries.set(stats.get("bpf_ct_entries", 0))
            self.conntrack_capacity.set(stats["bpf_ct_capacity"])
        for kind, value in stats.items():
            self.datapath_objects.labels(kind=kind).set(value)
            if kind.startswith(IPTABLES_STAT_PREFIX):
                self.iptables_rules.labels(table=kind[len(IPTABLES_STAT_PREFIX):]).set(value)

    def observe_handover(self, from_mode: str, counts: Mapping[str, int]) -> None:
        for outcome, n in counts.items():
            self.handover_connections.labels(from_mode=from_mode, outcome=outcome).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_server(address: str, metrics: Metrics, mode: Callable[[], str],
                   extra: Callable[[str], Response | None] | None = None) -> BackgroundHTTPServer:
    """/metrics and /proxyMode on `address` (host:port), not started yet; `extra` answers the
    other paths it knows (the drift audit's), returning None for the rest."""

    def respond(path: str) -> Response:
        answer = extra(path) if extra is not None else None
        if answer is not None:
            return answer
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, metrics.render(), {}
        if path == "/proxyMode":
            return 200, "text/plain; charset=utf-8", mode().encode(), {}
        return 404, "text/plain; charset=utf-8", b"404 page not found\n", {}

    host, port = split_host_port(address)
    return BackgroundHTTPServer(host, port, respond, name="metrics-http")
