"""The agent end to end with FakeDatapath: watch events → tracker → runner → datapath, metrics, health.

Most tests drive the agent step by step (handlers fed with canned objects, the runner with a fake
clock); one runs the real threads (Reflectors over canned list/watch streams) and stops it the way
SIGTERM does.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.request

import pytest
from click.testing import CliRunner

from ebpf_proxy.agent import cleanup as agent_cleanup
from ebpf_proxy.agent import heap
from ebpf_proxy.agent.agent import EXIT_FAILED, EXIT_OK, Agent
from ebpf_proxy.agent.config import load_config
from ebpf_proxy.agent.metrics import Metrics, metrics_server
from ebpf_proxy.cli import main
from ebpf_proxy.datapath import DatapathUnavailable, create_datapath, resolve_auto_mode
from ebpf_proxy.datapath.fake import FakeDatapath
from ebpf_proxy.model import LocalDetector, LocalMode, NodeConfig, Protocol, ServicePortName
from tests.unit.kobjects import endpoint, endpoint_slice, node, port, service

NODE = "n1"
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("default", "web", "dns", Protocol.UDP)
START = 1714557600.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 50.0

    def now(self) -> float:
        return self.t


class Wall:
    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        return self.t


class RecordingDatapath(FakeDatapath):
    """FakeDatapath that also records close() and can be told to fail the next syncs."""

    created: list["RecordingDatapath"] = []

    def __init__(self, node, **opts) -> None:
        super().__init__(node)
        self.opts = opts
        self.closed = 0
        self.prefetched: list[int] = []  # syncs made before each prefetch()
        RecordingDatapath.created.append(self)

    def close(self) -> None:
        self.closed += 1

    def prefetch(self) -> None:
        self.prefetched.append(len(self.syncs))

    def fail_next(self, times: int) -> None:
        self._fail_times = times

    def stats(self) -> dict[str, int]:
        return {"iptables_rules_nat": 10 * len(self.last_state.services) if self.last_state else 0}


class FakeHealthServer:
    opened: list["FakeHealthServer"] = []

    def __init__(self, host, port, respond, name=""):
        self.host, self.port, self.respond, self.stopped = host, port, respond, False
        FakeHealthServer.opened.append(self)

    def start(self):
        return self

    def stop(self):
        self.stopped = True


def web_service(**spec) -> dict:
    return service("web", ports=[port("http", 80, "TCP"), port("dns", 53, "UDP")], **spec)


def web_slice(*eps, rv="1", trigger=None) -> dict:
    return endpoint_slice("web-a", endpoints=list(eps), rv=rv, trigger=trigger,
                          ports=[{"name": "http", "port": 8080, "protocol": "TCP"},
                                 {"name": "dns", "port": 5353, "protocol": "UDP"}])


@pytest.fixture
def agent_parts():
    RecordingDatapath.created = []
    FakeHealthServer.opened = []
    clock, wall = FakeClock(), Wall()

    def make(flags=None, **kw):
        config = load_config({"hostname_override": NODE, "mode": "iptables", "cluster_cidrs": "10.244.0.0/16",
                              "min_sync_period": "1s", "sync_period": "30s", **(flags or {})})
        kw.setdefault("datapath_factory", lambda mode, node, **opts: RecordingDatapath(node, mode=mode, **opts))
        kw.setdefault("local_addresses", lambda: ["127.0.0.1", "192.168.1.10", "10.244.1.1"])
        return Agent(config, clock=clock, wall=wall, serve_http=False, health_check_server=FakeHealthServer, **kw)

    return make, clock, wall


def listed(agent: Agent, services=(), slices=(), nodes=()) -> None:
    """What the initial lists deliver: every object as an add."""
    handlers = agent.handlers()
    for kind, objs in (("Node", nodes), ("Service", services), ("EndpointSlice", slices)):
        for obj in objs:
            handlers[kind].on_add(obj)


def metric(agent: Agent, name: str, **labels) -> float | None:
    return agent.metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize("field, value, option, want", [
    ("bpf_map_sizes", "epx_svc=262144,epx_backend=1048576", "max_entries", {"epx_svc": 262144, "epx_backend": 1048576}),
    ("bpf_xdp_mode", "native", "xdp_mode", "native"),
    ("bpf_host_routing", "off", "host_routing", "off"),
    ("bpf_conntrack_gc_period", "1s", "ct_gc_period", 1.0),
])
def test_bpf_options_reach_the_datapath(agent_parts, field, value, option, want):
    make, _, _ = agent_parts
    agent = make({field: value})
    agent.resolve_mode()
    listed(agent, nodes=[node(NODE)])
    assert agent.prepare_datapath().opts[option] == want


def test_the_ebpf_datapath_takes_the_gc_period():
    """What the agent passes as ct_gc_period is the period the connection table's GC thread runs at
    (create_datapath would drop, with a debug log, an option the class did not take)."""
    datapath = create_datapath("ebpf", NodeConfig(node_name=NODE), bpffs="/nonexistent",
                               ct_gc_period=load_config({"bpf_conntrack_gc_period": "1s"}).bpf_conntrack_gc_period)
    try:
        assert datapath._shared.options.ct_gc_period == 1.0
    finally:
        datapath.close()


def test_first_sync_programs_the_listed_state(agent_parts):
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    listed(agent, services=[web_service(), service("broken", cluster_ip="not-an-ip")],
           slices=[web_slice(endpoint("10.244.1.5", NODE), endpoint("10.244.2.6", "n2"))], nodes=[node(NODE)])
    dp = agent.prepare_datapath()
    assert dp.opts == {"mode": "iptables", "cgroup_path": None, "bpffs": "/sys/fs/bpf",
                       "bpf_cache_dir": "/var/cache/ebpf-proxy/bpf", "backend": "auto", "max_entries": None,
                       "xdp_mode": "off", "host_routing": "auto", "ct_gc_period": 10.0,
                       "proof_dir": "/var/cache/ebpf-proxy/iptables"}
    assert agent.node_config == NodeConfig(node_name=NODE, node_ips=("192.168.1.10", "10.244.1.1"),
                                           cluster_cidrs=("10.244.0.0/16",),
                                           local_detector=LocalDetector(LocalMode.CLUSTER_CIDR, ("10.244.0.0/16",)))
    assert agent.runner.run_if_due()
    ((state, changes),) = dp.syncs
    assert changes.full and changes.services == {WEB, DNS}
    assert [(e.ip, e.port, e.is_local) for e in state.endpoints_of(WEB)] == [("10.244.1.5", 8080, True),
                                                                              ("10.244.2.6", 8080, False)]
    assert metric(agent, "ebpf_proxy_datapath_info", mode="iptables") == 1
    assert metric(agent, "ebpf_proxy_invalid_objects_total", kind="Service", reason="invalid_ip") == 1
    assert metric(agent, "kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert metric(agent, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 1
    assert metric(agent, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == START
    assert metric(agent, "kubeproxy_sync_proxy_rules_iptables_total", table="nat") == 20
    assert metric(agent, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert agent.health.healthz()[0] == 200


def test_the_heap_is_settled_after_full_syncs_only(agent_parts, monkeypatch):
    make, clock, _ = agent_parts
    settled = []
    monkeypatch.setattr(heap, "settle", lambda: settled.append(1) or (0.0, 0))
    agent = make(settle_heap=True)
    agent.resolve_mode()
    listed(agent, services=[web_service()], slices=[web_slice(endpoint("10.244.1.5", NODE))], nodes=[node(NODE)])
    agent.prepare_datapath()
    agent.sync(full=True)
    assert settled == [1]
    listed(agent, slices=[web_slice(endpoint("10.244.1.6", NODE), rv="2")])
    agent.sync(full=False)
    assert settled == [1], "a partial sync (one change) must not pay a collection"
    assert make()._settle_heap is False  # agents made without asking (tests') never freeze the heap


def test_settle_collects_and_freezes_the_survivors():
    import gc
    try:
        seconds, frozen = heap.settle()
        assert seconds >= 0 and frozen == gc.get_freeze_count() > 0
        assert heap.settle()[1] >= frozen * 0.9  # settle again unfreezes first: the same survivors
    finally:
        gc.unfreeze()


def test_nothing_is_queued_until_every_first_list_is_in(agent_parts):
    """kube-proxy's proxier syncs on a change only once initialized (every first list in): the
    first sync takes the lists whole. So a first list longer than the health timeout (2 x
    --sync-period) is not a stuck proxier: /livez stays healthy while starting up."""
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()

    class Listing:  # a reflector whose first list is under way
        kind = "Service"
        synced = threading.Event()

    agent.reflectors.append(Listing())
    listed(agent, services=[web_service()], slices=[web_slice(endpoint("10.244.1.5", NODE))], nodes=[node(NODE)])
    wall.t += 10 * agent.config.sync_period  # a long first list
    assert agent.health.livez()[0] == 200
    assert metric(agent, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") in (None, 0.0)
    Listing.synced.set()
    listed(agent, slices=[web_slice(endpoint("10.244.1.6", NODE), rv="2")])  # after the lists: queued
    assert metric(agent, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") == wall.t
    wall.t += 3 * agent.config.sync_period
    assert agent.health.livez()[0] == 503, "a change queued and never programmed is stuck"


def test_changes_are_synced_partially_and_bounded_in_frequency(agent_parts):
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    old = web_slice(endpoint("10.244.1.5", NODE), endpoint("10.244.2.6", "n2"))
    listed(agent, services=[web_service()], slices=[old], nodes=[node(NODE)])
    dp = agent.prepare_datapath()
    agent.runner.run_if_due()

    handlers = agent.handlers()
    new = web_slice(endpoint("10.244.1.5", NODE), rv="2")
    handlers["EndpointSlice"].on_update(old, new)  # 10.244.2.6 gone
    assert agent.health.healthz()[0] == 200  # queued, not late
    clock.t += 0.5
    assert not agent.runner.run_if_due()  # --min-sync-period 1s
    clock.t += 0.5
    assert agent.runner.run_if_due()
    state, changes = dp.syncs[-1]
    assert not changes.full and changes.services == {WEB, DNS}
    assert changes.stale_udp_endpoints == {(DNS, "10.244.2.6")}
    assert [e.ip for e in state.endpoints_of(WEB)] == ["10.244.1.5"]

    handlers["Service"].on_delete(web_service())
    clock.t += 1
    agent.runner.run_if_due()
    state, changes = dp.syncs[-1]
    assert state.services == {} and changes.services == {WEB, DNS}


def test_failed_sync_is_retried_full_with_the_same_changes(agent_parts):
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    listed(agent, services=[web_service()], slices=[web_slice(endpoint("10.244.1.5", NODE))], nodes=[node(NODE)])
    dp = agent.prepare_datapath()
    agent.runner.run_if_due()
    wall.t += 100
    agent.handlers()["Service"].on_add(service("api", cluster_ip="10.96.0.11"))
    dp.fail_next(1)
    clock.t += 1
    agent.runner.run_if_due()
    assert metric(agent, "ebpf_proxy_sync_errors_total") == 1
    assert len(dp.syncs) == 1
    clock.t += 60  # after the retry backoff
    agent.runner.run_if_due()
    state, changes = dp.syncs[-1]
    assert changes.full
    assert ServicePortName("default", "api", "http", Protocol.TCP) in changes.services
    assert metric(agent, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == START + 100


def test_health_check_node_port_follows_local_endpoints(agent_parts):
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    lb = service("web", svc_type="LoadBalancer", ports=[port("http", 80, "TCP", node_port=30080)],
                 externalTrafficPolicy="Local", healthCheckNodePort=32000)
    sl = web_slice(endpoint("10.244.1.5", NODE), endpoint("10.244.1.6", NODE), endpoint("10.244.2.6", "n2"))
    listed(agent, services=[lb], slices=[sl], nodes=[node(NODE)])
    agent.prepare_datapath()
    agent.runner.run_if_due()
    (server,) = FakeHealthServer.opened
    assert (server.host, server.port) == ("0.0.0.0", 32000)
    status, _, raw, _ = server.respond("/")
    assert status == 200 and json.loads(raw)["localEndpoints"] == 2

    agent.handlers()["EndpointSlice"].on_update(sl, web_slice(endpoint("10.244.2.6", "n2"), rv="2"))
    clock.t += 1
    agent.runner.run_if_due()
    status, _, raw, _ = server.respond("/")
    assert status == 503 and json.loads(raw)["localEndpoints"] == 0

    agent.handlers()["Service"].on_delete(lb)
    clock.t += 1
    agent.runner.run_if_due()
    assert server.stopped


def test_network_programming_latency_from_the_trigger_time(agent_parts):
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    listed(agent, services=[web_service()], slices=[web_slice(endpoint("10.244.1.5", NODE))], nodes=[node(NODE)])
    agent.prepare_datapath()
    agent.runner.run_if_due()
    wall.t = START + 10
    agent.handlers()["EndpointSlice"].on_add(
        web_slice(endpoint("10.244.1.7", NODE), rv="3", trigger="2024-05-01T10:00:07Z"))
    clock.t += 1
    agent.runner.run_if_due()
    assert metric(agent, "kubeproxy_network_programming_duration_seconds_count") == 1
    assert metric(agent, "kubeproxy_network_programming_duration_seconds_sum") == pytest.approx(3.0)


def test_nodeport_addresses_primary_uses_the_node_object(agent_parts):
    make, clock, wall = agent_parts
    agent = make({"nodeport_addresses": "primary"})
    listed(agent, nodes=[node(NODE, internal="192.168.1.10"), node("someone-else", internal="192.168.1.99")])
    agent.resolve_mode()
    agent.prepare_datapath()
    assert agent.node_config.node_ips == ("192.168.1.10",)
    assert agent.node_config.nodeport_addresses == ("192.168.1.10/32",)
    assert not agent.node_config.localhost_nodeports
    assert agent.service_health.hosts == ("192.168.1.10",)


def test_node_object_addresses_are_the_fallback_without_netlink(agent_parts):
    make, clock, wall = agent_parts

    def no_netlink():
        raise OSError("netlink not available")

    config = load_config({"hostname_override": NODE, "mode": "iptables"})
    agent = Agent(config, local_addresses=no_netlink, datapath_factory=lambda m, n, **o: RecordingDatapath(n),
                  clock=clock, wall=wall, serve_http=False)
    listed(agent, nodes=[node(NODE, internal="192.168.1.10", external="203.0.113.10")])
    agent.resolve_mode()
    agent.prepare_datapath()
    assert agent.node_config.node_ips == ("192.168.1.10", "203.0.113.10")


def test_node_being_deleted_makes_healthz_fail(agent_parts):
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    listed(agent, nodes=[node(NODE)])
    agent.prepare_datapath()
    agent.runner.run_if_due()
    assert agent.health.healthz()[0] == 200
    agent.handlers()["Node"].on_update(node(NODE), node(NODE, rv="2", deletionTimestamp="2024-05-01T10:00:00Z"))
    assert agent.health.healthz()[0] == 503


def test_node_address_change_after_start_is_logged(agent_parts, caplog):
    make, clock, wall = agent_parts
    agent = make({"nodeport_addresses": "primary"})
    listed(agent, nodes=[node(NODE, internal="192.168.1.10")])
    agent.resolve_mode()
    agent.prepare_datapath()
    with caplog.at_level(logging.WARNING):
        agent.handlers()["Node"].on_update(node(NODE), node(NODE, internal="10.244.1.1", rv="2"))
    assert any("restart the agent" in r.getMessage() for r in caplog.records)


# ---- the whole run, with threads ------------------------------------------------------------------


class CannedListWatch:
    """A collection that lists `items`, streams `events`, then blocks like an idle watch until interrupted."""

    def __init__(self, kind: str, items: list, events: list) -> None:
        self.kind = kind
        self.items, self.events = items, events
        self.interrupted = threading.Event()

    def list(self):
        return list(self.items), "100"

    def watch(self, rv):
        lw = self

        class Stream:
            def __iter__(self):
                yield from lw.events
                lw.events = []
                lw.interrupted.wait()
                raise ConnectionResetError("watch interrupted")

            def interrupt(self):
                lw.interrupted.set()

        return Stream()


def wait_for(predicate, what: str, limit: float = 20.0) -> None:
    """Poll until `predicate()`; the limit only bounds a broken run, no timing is asserted."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def run_in_thread(agent: Agent):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", agent.run()), daemon=True)
    thread.start()
    return thread, result


def canned_collections():
    return {
        "Service": CannedListWatch("Service", [web_service()], [
            {"type": "ADDED", "object": service("api", cluster_ip="10.96.0.11", rv="101")}]),
        "EndpointSlice": CannedListWatch("EndpointSlice", [web_slice(endpoint("10.244.1.5", NODE))], [
            {"type": "ADDED", "object": endpoint_slice("api-x", service_name="api", rv="102",
                                                       endpoints=[endpoint("10.244.2.9", "n2")])},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}}]),
        "Node": CannedListWatch("Node", [node(NODE)], []),
    }


def threaded_agent():
    RecordingDatapath.created = []
    config = load_config({"hostname_override": NODE, "mode": "iptables", "min_sync_period": "0s",
                          "sync_period": "1h", "metrics_bind_address": "127.0.0.1:0",
                          "healthz_bind_address": "127.0.0.1:0"})
    return Agent(config, collections=canned_collections(), local_addresses=lambda: ["192.168.1.10"],
                 datapath_factory=lambda mode, n, **o: RecordingDatapath(n))


class _Listing:
    """What wait_until_listed reads of a Reflector: its kind, and whether its first list is in."""

    def __init__(self, kind: str) -> None:
        self.kind, self.synced = kind, threading.Event()


def test_waiting_for_the_lists_ends_when_the_last_one_is_in_not_at_the_next_poll(agent_parts):
    """The datapath's start waits for the Node list and the first sync for every list: each
    wait ends as the list it waits for is in, not up to a poll period later (`poll` is only how
    soon a stop is seen)."""
    make, _, _ = agent_parts
    agent = make()
    agent.reflectors = [_Listing("Node"), _Listing("Service"), _Listing("EndpointSlice")]
    agent.reflectors[0].synced.set()
    assert agent.wait_until_listed(poll=600, kinds=("Node",))
    later = [threading.Timer(0.05 * i, r.synced.set) for i, r in enumerate(agent.reflectors[1:], 1)]
    for timer in later:
        timer.start()
    started = time.monotonic()
    assert agent.wait_until_listed(poll=600)
    assert time.monotonic() - started < 60, "woken by the lists, not by the 600 s poll"


def test_waiting_for_the_lists_ends_when_the_agent_stops(agent_parts):
    make, _, _ = agent_parts
    agent = make()
    agent.reflectors = [_Listing("Service")]
    threading.Timer(0.05, agent.stop).start()
    assert agent.wait_until_listed(poll=0.01) is False


def test_run_until_stopped_leaves_the_datapath_in_place():
    agent = threaded_agent()
    thread, result = run_in_thread(agent)
    api = ServicePortName("default", "api", "http", Protocol.TCP)
    wait_for(lambda: RecordingDatapath.created and RecordingDatapath.created[0].last_state
             and api in RecordingDatapath.created[0].last_state.endpoints, "the watched service to be synced")
    (dp,) = RecordingDatapath.created
    assert [e.ip for e in dp.last_state.endpoints_of(api)] == ["10.244.2.9"]
    assert dp.syncs[0][1].full
    metrics_port = agent._servers[0].port
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "kubeproxy_sync_proxy_rules_duration_seconds_bucket" in text
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/proxyMode", timeout=10) as resp:
        assert resp.read() == b"iptables"
    with urllib.request.urlopen(f"http://127.0.0.1:{agent._servers[1].port}/healthz", timeout=10) as resp:
        assert resp.status == 200

    agent.stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and result["code"] == EXIT_OK
    assert dp.closed == 1 and dp.cleanups == 0  # traffic keeps flowing across restarts
    assert all(r.stopped for r in agent.reflectors)


def test_the_nodes_addresses_are_read_once_before_any_list_is_requested():
    """Reading them imports netlink's modules; imported while a list is decoded, each file read of
    an import waits for the list's thread to give the interpreter back (prepare_datapath's ~0.1 s
    became ~0.7 s of a 10,000-Service full sync). So run() reads them before the first list and
    the datapath's start uses that reading."""
    RecordingDatapath.created = []
    events: list[str] = []
    collections = canned_collections()
    for kind, lw in collections.items():
        lw.list = (lambda listed, kind: lambda: events.append(f"list {kind}") or listed())(lw.list, kind)
    config = load_config({"hostname_override": NODE, "mode": "iptables", "min_sync_period": "0s",
                          "sync_period": "1h", "metrics_bind_address": "", "healthz_bind_address": ""})
    agent = Agent(config, collections=collections,
                  local_addresses=lambda: events.append("addresses") or ["192.168.1.10"],
                  datapath_factory=lambda mode, n, **o: RecordingDatapath(n))
    thread, result = run_in_thread(agent)
    wait_for(lambda: RecordingDatapath.created and RecordingDatapath.created[0].last_state, "the first sync")
    agent.stop()
    thread.join(timeout=30)
    assert result["code"] == EXIT_OK
    assert events[0] == "addresses" and events.count("addresses") == 1, events
    assert sorted(events[1:]) == ["list EndpointSlice", "list Node", "list Service"]
    assert RecordingDatapath.created[0].node.node_ips == ("192.168.1.10",)


def test_sigterm_stops_the_agent():
    agent = threaded_agent()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        agent.install_signal_handlers()
        thread, result = run_in_thread(agent)
        wait_for(lambda: RecordingDatapath.created and RecordingDatapath.created[0].syncs, "the first sync")
        signal.raise_signal(signal.SIGTERM)
        thread.join(timeout=30)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert result["code"] == EXIT_OK and RecordingDatapath.created[0].closed == 1


def test_run_fails_when_the_datapath_cannot_be_created():
    def unavailable(mode, node, **opts):
        raise DatapathUnavailable("mode ebpf: not here")

    config = load_config({"hostname_override": NODE, "mode": "ebpf", "metrics_bind_address": "",
                          "healthz_bind_address": ""})
    agent = Agent(config, collections=canned_collections(), datapath_factory=unavailable,
                  local_addresses=lambda: ["192.168.1.10"])
    assert agent.run() == EXIT_FAILED
    assert all(r.stopped for r in agent.reflectors)


# ---- the datapath registry and cleanup ------------------------------------------------------------


def test_create_datapath_passes_only_the_options_the_mode_takes(caplog):
    dp = create_datapath("fake", NodeConfig(node_name=NODE), fail_times=2, bpffs="/sys/fs/bpf", cgroup_path=None)
    assert isinstance(dp, FakeDatapath) and dp._fail_times == 2
    with pytest.raises(ValueError, match="^mode: 'ipvs'"):
        create_datapath("ipvs", NodeConfig(node_name=NODE))


def test_create_iptables_datapath_from_the_registry():
    from ebpf_proxy.datapath.iptables import IptablesDatapath

    dp = create_datapath("iptables", NodeConfig(node_name=NODE), cgroup_path="/sys/fs/cgroup", bpffs="/x")
    assert isinstance(dp, IptablesDatapath)


def test_auto_mode_falls_back_to_iptables_with_the_reason(monkeypatch, caplog):
    from ebpf_proxy.datapath.ebpf import toolchain

    class Report:
        ok = False
        missing = ["bcc", "root"]

    monkeypatch.setattr(toolchain, "probe", lambda prepare=False: Report())
    with caplog.at_level(logging.INFO, logger="ebpf_proxy.datapath"):
        assert resolve_auto_mode() == "iptables"
    (line,) = [r for r in caplog.records if r.name == "ebpf_proxy.datapath"]
    assert line.getMessage() == "mode auto: using iptables because the eBPF toolchain probe found missing: bcc, root"


def test_auto_mode_picks_ebpf_when_the_probe_passes_and_the_datapath_exists(monkeypatch):
    from ebpf_proxy import datapath
    from ebpf_proxy.datapath.ebpf import toolchain

    class Report:
        ok = True

    monkeypatch.setattr(toolchain, "probe", lambda prepare=False: Report())
    monkeypatch.setattr(datapath, "datapath_class", lambda mode: FakeDatapath)
    assert resolve_auto_mode() == "ebpf"
    monkeypatch.setattr(datapath, "datapath_class",
                        lambda mode: (_ for _ in ()).throw(DatapathUnavailable("mode ebpf: not written yet")))
    assert resolve_auto_mode() == "iptables"


def test_cleanup_reports_each_mode(monkeypatch):
    monkeypatch.setattr(agent_cleanup.shutil, "which", lambda name: f"/usr/sbin/{name}")
    cleaned = []

    class Cleans(FakeDatapath):
        def cleanup(self):
            cleaned.append(self.mode_name)

    def factory(mode, node, **opts):
        if mode == "ebpf":
            raise DatapathUnavailable("mode ebpf: no bcc")
        if mode == "broken":
            dp = Cleans(node)
            dp.cleanup = lambda: (_ for _ in ()).throw(RuntimeError("iptables-restore: exit 4"))
            return dp
        dp = Cleans(node)
        dp.mode_name = f"{mode}/{opts.get('backend')}/IPv{node.family}"
        return dp

    results = agent_cleanup.cleanup_all(NODE, modes=("ebpf", "iptables", "broken"), factory=factory)
    # iptables once per installed backend and IP family: rules left in any keep acting on packets
    assert [(r.mode, r.outcome) for r in results] == [
        ("ebpf", "skipped"), ("iptables (legacy)", "cleaned"), ("iptables (nft)", "cleaned"),
        ("iptables (legacy, IPv6)", "cleaned"), ("iptables (nft, IPv6)", "cleaned"), ("broken", "failed")]
    assert cleaned == ["iptables/legacy/IPv4", "iptables/nft/IPv4", "iptables/legacy/IPv6", "iptables/nft/IPv6"]
    assert results[5].line() == "broken: failed (iptables-restore: exit 4)"


@pytest.mark.parametrize("outcomes,code", [(["cleaned", "skipped"], 0), (["cleaned", "failed"], 1)])
def test_cleanup_command_exit_status(monkeypatch, outcomes, code):
    results = [agent_cleanup.CleanupResult(m, o) for m, o in zip(("iptables", "ebpf"), outcomes)]
    seen = {}

    def fake_cleanup_all(node_name, **opts):
        seen.update(opts, node=node_name)
        return results

    monkeypatch.setattr("ebpf_proxy.cli.cleanup.cleanup_all", fake_cleanup_all)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        result = CliRunner().invoke(main, ["cleanup", "--hostname-override", "N1", "--bpffs", "/tmp/bpffs"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert result.exit_code == code
    assert "iptables: cleaned" in result.output
    assert seen == {"node": "n1", "cgroup_path": None, "bpffs": "/tmp/bpffs"}


def test_metrics_server_serves_kube_proxy_names():
    metrics = Metrics()
    metrics.observe_sync(0.02, full=True, now_wall=START)
    metrics.set_datapath_stats({"iptables_rules_filter": 4, "map_entries": 7})
    server = metrics_server("127.0.0.1:0", metrics, lambda: "ebpf").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.stop()
    assert 'kubeproxy_sync_proxy_rules_iptables_total{table="filter"} 4.0' in text
    assert 'ebpf_proxy_datapath_objects{kind="map_entries"} 7.0' in text
    assert "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7145576e+09" in text


def test_zone_label_change_resyncs_fully_and_moves_traffic_to_the_new_zone(agent_parts):
    """The node's zone comes from its Node object's topology.kubernetes.io/zone label; changing it
    must re-decide every service's endpoints (a full sync) without any service changing."""
    make, clock, wall = agent_parts
    agent = make()
    agent.resolve_mode()
    zoned = web_slice(endpoint("10.244.1.5", NODE, hints={"forZones": [{"name": "zone-a"}]}),
                      endpoint("10.244.2.6", "n2", hints={"forZones": [{"name": "zone-b"}]}))
    in_a = node(NODE, labels={"topology.kubernetes.io/zone": "zone-a"})
    listed(agent, services=[web_service()], slices=[zoned], nodes=[in_a])
    dp = agent.prepare_datapath()
    agent.runner.run_if_due()
    state, _ = dp.syncs[-1]
    assert state.topology.node_name == NODE and state.topology.zone == "zone-a"
    assert [e.zone_hints for e in state.endpoints_of(WEB)] == [("zone-a",), ("zone-b",)]

    in_b = node(NODE, rv="2", labels={"topology.kubernetes.io/zone": "zone-b"})
    agent.handlers()["Node"].on_update(in_a, in_b)
    clock.t += 1
    assert agent.runner.run_if_due()
    state, changes = dp.syncs[-1]
    assert changes.full and changes.services == frozenset()
    assert state.topology.zone == "zone-b"


class KernelModeDatapath(RecordingDatapath):
    """A recording datapath that passes for a kernel mode (the agent asks those about a switch)."""

    installed_modes: set[str] = set()

    def __init__(self, node, mode: str = "", **opts) -> None:
        super().__init__(node, mode=mode, **opts)
        self.mode = mode
        self.expected_handover = False

    def installed(self) -> bool:
        return self.mode in self.installed_modes

    def expect_handover(self) -> None:
        assert not self.prefetched, "told before it starts reading ahead (a handover has nothing to read)"
        self.expected_handover = True


def test_an_agent_finding_the_other_mode_in_place_takes_it_over_after_its_first_sync(agent_parts, monkeypatch):
    """Make before break (agent/handover.py): asked before the first sync, moved after it, once,
    counted in ebpf_proxy_handover_connections_total."""
    from ebpf_proxy.agent import handover

    calls = []

    def hand_over(mode, previous, datapath, node, factory, **opts):
        calls.append((mode, previous, len(datapath.syncs)))
        return handover.HandoverResult(previous, mode, counts={"adopted": 3, "node": 1})

    monkeypatch.setattr(handover, "hand_over", hand_over)
    KernelModeDatapath.installed_modes = {"iptables"}
    make, _clock, _wall = agent_parts
    agent = make({"mode": "ebpf"}, datapath_factory=lambda mode, node, **opts: KernelModeDatapath(node, mode, **opts))
    agent.resolve_mode()
    listed(agent, services=[web_service()], nodes=[node(NODE)])
    dp = agent.prepare_datapath()
    assert dp.mode == "ebpf" and dp.expected_handover and calls == []
    assert dp.prefetched == [0], "once, before the first sync, after being told of the handover"
    agent.sync(full=True)
    agent.sync(full=False)
    assert calls == [("ebpf", "iptables", 1)], "once, right after the first sync"
    assert metric(agent, "ebpf_proxy_handover_connections_total", from_mode="iptables", outcome="adopted") == 3
    assert metric(agent, "ebpf_proxy_handover_connections_total", from_mode="iptables", outcome="node") == 1


def test_an_agent_alone_on_its_node_hands_nothing_over(agent_parts, monkeypatch):
    from ebpf_proxy.agent import handover

    monkeypatch.setattr(handover, "hand_over", lambda *a, **k: pytest.fail("nothing to take over"))
    KernelModeDatapath.installed_modes = {"ebpf"}  # its own mode only: a restart, not a switch
    make, _clock, _wall = agent_parts
    agent = make({"mode": "ebpf"}, datapath_factory=lambda mode, node, **opts: KernelModeDatapath(node, mode, **opts))
    agent.resolve_mode()
    listed(agent, services=[web_service()], nodes=[node(NODE)])
    assert not agent.prepare_datapath().expected_handover
    agent.sync(full=True)


def test_tables_a_full_sync_found_proven_are_counted(agent_parts):
    """The iptables datapath's `tables_proven` (datapath/iptables/proof.py) reaches /metrics, so
    an operator sees whether restarts skip their restore."""
    class Proving(RecordingDatapath):
        def sync(self, state, changes):
            result = super().sync(state, changes)
            result.counts["tables_proven"] = 2 if changes.full else 0
            return result

    make, _, _ = agent_parts
    agent = make(datapath_factory=lambda mode, node, **opts: Proving(node, mode=mode, **opts))
    agent.resolve_mode()
    listed(agent, services=[web_service()], slices=[web_slice(endpoint("10.244.1.5", NODE))], nodes=[node(NODE)])
    agent.prepare_datapath()
    assert metric(agent, "ebpf_proxy_iptables_tables_proven_total") == 0
    agent.sync(full=True)
    assert metric(agent, "ebpf_proxy_iptables_tables_proven_total") == 2
    listed(agent, slices=[web_slice(endpoint("10.244.1.6", NODE), rv="2")])
    agent.sync(full=False)
    agent.sync(full=True)
    assert metric(agent, "ebpf_proxy_iptables_tables_proven_total") == 4


@pytest.mark.parametrize("proof_dir, want", [("/var/cache/ebpf-proxy/iptables", 10.0), ("", None)])
def test_an_iptables_agent_that_keeps_proofs_audits_early(agent_parts, proof_dir, want):
    """A restart within --audit-period of the last found no proof and restored every rule."""
    make, _, _ = agent_parts
    agent = make(flags={"iptables_proof_dir": proof_dir})
    agent.resolve_mode()
    assert agent.mode == "iptables" and agent.first_audit_delay() == want
