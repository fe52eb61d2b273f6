"""The soak's judgement and its churn, without a lab: what counts as a broken claim, what the
table says, and that the writers create, scale and delete only their own objects."""

from __future__ import annotations

import threading
import time

from ebpf_proxy.bench.rest import RestError
from ebpf_proxy.bench.soak import CHURN_PREFIX, Churn, ModeResult, SoakConfig, problems, table


def clean(mode: str = "ebpf") -> ModeResult:
    objects = {"services (epx_svc)": {"baseline": 7, "peak": 110, "after": 7},
               "connections (epx_ct4)": {"baseline": 0, "peak": 900, "after": 0}}
    if mode == "iptables":
        objects = {"iptables rules": {"baseline": 72, "peak": 1500, "after": 72}}
    return ModeResult(mode, duration_s=60, changes=60000, probes_ok=2000,
                      rss_mib={"worker1": {"baseline": 80.0, "peak": 85.0, "after": 84.0}},
                      objects={"worker1": objects}, drained_s=15)


def test_a_clean_run_has_no_problem_and_says_ok():
    results = [clean("iptables"), clean("ebpf")]
    assert problems(results) == []
    text = table(results)
    assert "| ebpf | 60 s | 60,000 (1,000/s) | 2,000 / 0 |" in text and "FAILED" not in text and "| NO" not in text


def test_each_broken_claim_is_named():
    r = clean()
    r.probes_failed, r.failures = 2, ["09:00:00 client-1 -> 10.96.0.5:80: timeout"]
    r.objects["worker1"]["services (epx_svc)"]["after"] = 8  # one frontend left behind
    r.objects["worker1"]["connections (epx_ct4)"]["after"] = 3  # never collected
    r.rss_mib["worker1"]["after"] = 111.0
    found = problems([r])
    assert any("2 connections to stable Services failed" in p and "10.96.0.5:80" in p for p in found)
    assert "ebpf worker1: services (epx_svc) 8 after the churn, 7 before" in found
    assert any(p.startswith("ebpf worker1: connections (epx_ct4) 3 after") for p in found)
    assert any("agent RSS 111.0 MiB after, 80.0 MiB before" in p for p in found)
    assert "FAILED" in table([r]) and "| NO" in table([r])


def test_a_run_without_any_successful_probe_is_broken():
    r = clean()
    r.probes_ok = 0
    assert problems([r]) == ["ebpf: no connection to a stable Service succeeded: the traffic did not run"]


class Api:
    """Records writes; fails the writes whose object name is in `fail`."""

    def __init__(self, fail=()):
        self.lock = threading.Lock()
        self.live = set()
        self.writes = []
        self.fail = set(fail)

    def _do(self, verb, kind, name):
        with self.lock:
            self.writes.append((verb, kind, name))
            if name in self.fail:
                raise RestError(verb, f"/{kind}/{name}", 500, "boom")
            if verb == "create":
                assert (kind, name) not in self.live, f"{kind} {name} created twice"
                self.live.add((kind, name))
            elif verb == "delete":
                self.live.discard((kind, name))

    def create(self, obj):
        self._do("create", obj["kind"], obj["metadata"]["name"])

    def replace(self, obj):
        assert (obj["kind"], obj["metadata"]["name"]) in self.live, "an update of an object that does not exist"
        self._do("replace", obj["kind"], obj["metadata"]["name"])

    def delete(self, kind, name, namespace="default"):
        self._do("delete", kind, name)


def run_churn(api, seconds=0.3, **kw):
    churn = Churn(api, ["worker1", "worker2"], SoakConfig(modes=["ebpf"], duration=seconds, **kw))
    churn.start()
    time.sleep(seconds)
    churn.stop()
    return churn


def test_churn_creates_scales_and_deletes_only_its_own_objects():
    api = Api()
    churn = run_churn(api, writers=3, slots_per_writer=4)
    verbs = {(v, k) for v, k, _ in api.writes}
    assert {("create", "Service"), ("create", "EndpointSlice"), ("replace", "EndpointSlice"),
            ("delete", "Service"), ("delete", "EndpointSlice")} <= verbs
    names = {n.removesuffix("-bench") for _, _, n in api.writes}
    assert names <= {f"{CHURN_PREFIX}{w}-{i}" for w in range(3) for i in range(4)}
    assert churn.changes == len(api.writes) and churn.errors == 0


def test_a_failed_write_is_counted_and_names_its_object():
    api = Api(fail={f"{CHURN_PREFIX}0-0"})
    churn = run_churn(api, writers=1, slots_per_writer=1)
    assert churn.changes == 0 and churn.errors > 0
    assert churn.error_samples[0].startswith(f"create Service default/{CHURN_PREFIX}0-0: ")


def test_max_rate_caps_the_writes():
    api = Api()
    churn = run_churn(api, seconds=0.5, writers=2, max_rate=40)
    assert churn.changes <= 0.5 * 40 + 3


def test_the_gc_period_goes_to_the_ebpf_agents_only():
    """The short soak shortens the drain through a setting an operator has too; the agent takes it."""
    from ebpf_proxy.agent.config import load_config
    from ebpf_proxy.bench.soak import agent_args

    short = SoakConfig(modes=["iptables", "ebpf"], duration=1, ct_gc_period=1.0)
    assert agent_args("ebpf", short) == ["--bpf-conntrack-gc-period", "1s"]
    assert load_config({"bpf_conntrack_gc_period": agent_args("ebpf", short)[1]}).bpf_conntrack_gc_period == 1.0
    assert agent_args("iptables", short) == []
    assert agent_args("ebpf", SoakConfig(modes=["ebpf"], duration=1)) == []  # `make soak`: the default
