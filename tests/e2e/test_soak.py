"""The soak's short form (issue 13): EPX_SOAK_SECONDS (default 15) of Service and endpoint churn
per mode, at whatever rate the lab's API server takes (about a thousand changes per second here,
so each of the at most 100 churned Services is created, rescaled and deleted many times over),
with fresh connections to stable Services throughout; `make soak` is the long form.

Asserted, per mode: no connection to a stable Service failed; every API write succeeded; the
churn reached the kernel (the peak is above the baseline, else "back to baseline" would prove
nothing) and every churned object is gone from it afterwards (rules, services, backends and
slots exactly at their baseline; the eBPF connection table collected back to it); the agent's
RSS afterwards within RSS_BOUND_MIB of its baseline (RSS is noisy: the exact figures are
printed, run with -s). The whole run is one lab, both modes in turn, as `make soak` does.

The ebpf agents run with --bpf-conntrack-gc-period=1s (GC_PERIOD; `make soak` keeps the default
10 s): the table drains in the 10 s closed connections live plus two passes of the collector,
~12 s instead of ~25 s, and the claim (back to the baseline) is the same.
"""

from __future__ import annotations

import os

import pytest

from ebpf_proxy.bench.soak import DRAINING_OBJECTS, EXACT_OBJECTS, RSS_BOUND_MIB, SoakConfig, run_soak, table
from tests.e2e.conftest import E2E_MODES

SECONDS = float(os.environ.get("EPX_SOAK_SECONDS", "15"))
GC_PERIOD = 1.0  # the ebpf agents' --bpf-conntrack-gc-period, seconds

pytestmark = [pytest.mark.root, pytest.mark.e2e,
              # the module's whole soak counts against its first test: churn, set-up and drain per mode
              pytest.mark.timeout(len(E2E_MODES) * (SECONDS + 240))]


@pytest.fixture(scope="module")
def soak():
    results = run_soak(SoakConfig(modes=E2E_MODES, duration=SECONDS, ct_gc_period=GC_PERIOD,
                                  lab_name=f"sk{os.getpid() % 100000}"))
    print(f"\nsoak, {SECONDS:.0f} s per mode:\n{table(results)}")
    return {r.mode: r for r in results}


@pytest.fixture(params=E2E_MODES)
def result(request, soak):
    r = soak[request.param]
    assert r.error is None, r.error
    return r


def test_no_connection_to_a_stable_service_failed(result):
    assert result.probes_ok > 0, "no probe got through: the stable Services were not reached at all"
    assert result.probes_failed == 0, result.failures[:10]
    assert result.changes > 0 and result.api_errors == 0, result.api_error_samples[:5]


def test_every_churned_object_is_gone_from_the_kernel(result):
    for node, objects in result.objects.items():
        for label, _ in EXACT_OBJECTS[result.mode]:
            v = objects[label]
            assert v["peak"] > v["baseline"], f"{node} {label}: the churn never reached the kernel ({v})"
            assert v["after"] == v["baseline"], f"{node} {label}: {v}"
        for label, _ in DRAINING_OBJECTS[result.mode]:
            v = objects[label]
            assert v["peak"] > v["baseline"], f"{node} {label}: the probes made no connection entry ({v})"
            assert v["after"] <= v["baseline"], f"{node} {label}: not collected ({v})"


def test_agent_memory_is_back_near_its_baseline(result):
    for node, rss in result.rss_mib.items():
        print(f"\n[{result.mode}] {node} agent RSS MiB: baseline {rss['baseline']}, peak {rss['peak']}, "
              f"after {rss['after']}")
        assert rss["after"] < rss["baseline"] + RSS_BOUND_MIB, f"{node}: {rss}"
