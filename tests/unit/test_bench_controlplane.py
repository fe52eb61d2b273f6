"""Control-plane measurement logic, with a fake kernel (no lab, no agent)."""

import os

import pytest

from ebpf_proxy.bench import controlplane, procstat
from ebpf_proxy.bench.controlplane import (
    ControlPlaneError, first_sync_seconds, metric_value, programmed_seconds, wait_until,
)
from ebpf_proxy.bench.runner import TOPOLOGY
from ebpf_proxy.bench.services import BenchServices
from ebpf_proxy.lab.topology import load_topology
from tests.unit.test_bench_services import FakeRest

METRICS = """# HELP kubeproxy_sync_full_proxy_rules_duration_seconds SyncProxyRules latency
# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{le="0.001"} 0.0
kubeproxy_sync_full_proxy_rules_duration_seconds_sum 0.75
kubeproxy_sync_full_proxy_rules_duration_seconds_count 1.0
kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e+09
"""


def test_metrics_parsing():
    assert metric_value(METRICS, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1.0
    assert metric_value(METRICS, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == 1.7e9
    assert metric_value(METRICS, "nope") is None
    assert first_sync_seconds(METRICS) == 0.75
    assert first_sync_seconds("") is None


def test_the_full_sync_ends_when_the_agent_last_synced_after_its_start():
    """The kernel is complete when the first sync ends (the agent's last-sync timestamp), not
    when /healthz is next polled; no sync since the start (an agent that never synced, or a
    timestamp of the agent before) is no figure."""
    assert programmed_seconds(METRICS, 1.7e9 - 2.25) == pytest.approx(2.25)
    assert programmed_seconds(METRICS, 1.7e9) is None and programmed_seconds(METRICS, 1.7e9 + 5) is None
    assert programmed_seconds("", 1.0) is None


def test_wait_until():
    calls = iter([False, False, True])
    seconds, polls, per_check = wait_until(lambda: next(calls), timeout=10, min_interval=0)
    assert polls == 3 and seconds >= 0 and per_check >= 0
    with pytest.raises(ControlPlaneError):
        wait_until(lambda: False, timeout=0.05, min_interval=0.01)


class FakeKernel:
    """Programs every slice written, at once (what a perfect agent would do)."""

    def __init__(self, rest: FakeRest):
        self.rest = rest
        self.polls = 0

    def endpoints(self):
        self.polls += 1
        out = set()
        for (kind, _), obj in list(self.rest.objects.items()):
            if kind == "EndpointSlice":
                out |= {(e["addresses"][0], obj["ports"][0]["port"]) for e in obj["endpoints"]}
        return out

    def prepare(self, services, names):
        pass

    def has(self, ip, port, service):
        obj = self.rest.get("EndpointSlice", f"{service}-bench")
        return (ip, port) in self.endpoints() and any(e["addresses"] == [ip] for e in obj["endpoints"])


@pytest.fixture
def setup():
    rest = FakeRest()
    services = BenchServices(rest, load_topology(str(TOPOLOGY)))
    services.ensure_size(20)
    return rest, services, FakeKernel(rest)


def test_update_latency_measures_each_change(setup):
    rest, services, kernel = setup
    samples = controlplane.update_latency(services, kernel, changes=4, timeout=5, settle=0)
    assert len(samples) == 4
    assert all(s["ms"] >= 0 and s["polls"] == 1 for s in samples)
    assert len({s["service"] for s in samples}) == 4  # spread over the fillers
    # the next measurement starts where this one stopped
    more = controlplane.update_latency(services, kernel, changes=2, timeout=5, settle=0)
    assert {s["service"] for s in more}.isdisjoint({s["service"] for s in samples})


def test_update_latency_times_out_when_the_kernel_never_changes(setup):
    _, services, _ = setup

    class Stuck:
        node = "worker1"

        def prepare(self, services, names):
            pass

        def has(self, ip, port, service):
            return False

    with pytest.raises(ControlPlaneError, match="worker1"):
        controlplane.update_latency(services, Stuck(), changes=1, timeout=0.05, settle=0)


def test_burst_converges_on_the_last_change_of_each_service(setup):
    rest, services, kernel = setup
    before = len(rest.writes)
    out = controlplane.burst(services, kernel, count=40, timeout=5, threads=1)
    assert out["changes"] == 40 and out["services"] == len(services.churn_targets())
    assert len(rest.writes) - before == 40
    assert out["seconds"] >= out["write_seconds"] >= 0
    assert out["missing_when_last_seen"] == 0
    # every filler's slice now holds its last change: two changes each, chained
    final = kernel.endpoints()
    for name in services.churn_targets():
        obj = rest.get("EndpointSlice", f"{name}-bench")
        assert services.expected_endpoints(obj) <= final


def test_burst_waits_for_every_endpoint_when_the_last_one_comes_early(setup):
    """If the kernel showed the last change before the others (the ordering argument failing),
    the clock runs on until the full dump holds everything, and the result says so."""
    rest, services, kernel = setup

    class LastFirst(FakeKernel):
        def __init__(self, rest):
            super().__init__(rest)
            self.dumps = 0

        def endpoints(self):
            self.dumps += 1
            full = super().endpoints()
            return full if self.dumps > 2 else set(list(full)[:3])

        def has(self, ip, port, service):
            return True

    out = controlplane.burst(services, LastFirst(rest), count=10, timeout=5, threads=1)
    assert out["missing_when_last_seen"] > 0


def test_ebpf_observer_checks_the_frontend_it_learnt_before_the_clock(setup, monkeypatch):
    """In ebpf mode the check reads one service's frontend (ClusterIP, port): prepare() learns
    the ClusterIPs with one LIST, before a measurement starts, and not again while they are known."""
    rest, services, _ = setup
    asked = []
    monkeypatch.setattr(controlplane.kernelstate, "kernel_has_endpoint",
                        lambda lab, node, mode, ip, port, spn, frontend=None: asked.append((spn.name, frontend)) or True)
    lists = []
    real_list = rest.list
    monkeypatch.setattr(rest, "list", lambda *a, **kw: lists.append(a) or real_list(*a, **kw))
    observer = controlplane.Observer(None, "worker1", "ebpf")
    controlplane.update_latency(services, observer, changes=3, timeout=5, settle=0)
    assert len(lists) == 1, "one LIST for every change"
    assert len(asked) == 3 and len({ip for _, (ip, _) in asked}) == 3
    for name, frontend in asked:
        assert frontend == (rest.get("Service", name)["spec"]["clusterIP"], 80)
    iptables = controlplane.Observer(None, "worker1", "iptables")
    iptables.prepare(services, ["bench-f00000"])
    assert iptables.cluster_ips == {} and len(lists) == 1, "iptables checks by chain name: nothing to learn"


def test_procstat_parsing_and_reading():
    stat = "1234 (a) b) c) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 4 0 100 0 0"
    ticks = os.sysconf("SC_CLK_TCK")
    assert procstat.parse_stat_cpu(stat) == pytest.approx(300 / ticks)
    assert procstat.parse_status_kib("Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n", "VmHWM") == 2048
    with pytest.raises(KeyError):
        procstat.parse_status_kib("Name: x\n", "VmHWM")
    usage = procstat.read(os.getpid())
    assert usage.cpu_seconds > 0 and usage.peak_rss_mib >= usage.rss_mib > 0
    meter = procstat.PhaseMeter({"self": os.getpid()}, reset=False)
    sum(range(200000))
    out = meter.stop()["self"]
    assert out["cpu_seconds"] >= 0 and out["peak_rss_mib"] > 0
