"""bench/cpscale.py, the in-process control-plane scale harness: its simulated API server pages
like kube-apiserver, and its accounting covers every object and phase (figures are printed,
never asserted: no timing here)."""

from __future__ import annotations

import json
import os

import pytest

from ebpf_proxy.bench import cpscale
from ebpf_proxy.k8s import convert


def test_the_simulated_api_server_pages_with_continue_tokens_and_counts_its_time():
    api = cpscale.SimulatedApi("Service", 1203, lambda i, rv: cpscale.service_object(i, rv))
    items, rv = cpscale.SimulatedListWatch(api, page_size=500).list()
    assert len(items) == 1203 and rv == "1204"
    names = [obj["metadata"]["name"] for obj in items]
    assert names == [f"filler-{i}" for i in range(1203)]
    assert api.seconds > 0


def test_the_objects_convert_like_the_benchs():
    svc = json.loads(json.dumps(cpscale.service_object(7, 9)))
    (port,) = convert.service_ports(svc)
    assert port.cluster_ip == "10.96.0.17" and port.port == cpscale.SERVICE_PORT
    sl = convert.endpoint_slice(json.loads(json.dumps(cpscale.slice_object(7, 4, 9))), cpscale.NODE)
    (eps,) = sl.endpoints.values()
    assert sl.service == "filler-7" and len(eps) == 4 and len({ep.ip for ep in eps}) == 4
    assert sum(ep.is_local for ep in eps) == 1  # spread over the three nodes, this one among them


@pytest.mark.parametrize("mode", ["none", "iptables"])
def test_a_run_goes_through_every_phase_and_programs_every_service(mode):
    result = cpscale.run(120, 3, mode, page_size=50)
    assert [p.name for p in result.phases] == ["start", "list+convert", "prepare", "sync"]
    assert result.counts["service_ports"] == 120
    assert result.api_server_s > 0
    assert result.peak_rss_mib == max(p.peak_rss_mib for p in result.phases)
    for phase in result.phases:
        assert phase.peak_rss_mib >= phase.rss_mib > 0
        print(cpscale.format_phase(phase))


def test_tracemalloc_lists_the_top_sites():
    result = cpscale.run(30, 2, "none", trace=True, top=3)
    assert all(len(p.top) == 3 and p.traced_mib is not None for p in result.phases)


@pytest.mark.root
@pytest.mark.bpf
def test_a_restart_takes_the_maps_over_without_writing_and_the_audit_finds_no_drift():
    if os.geteuid() != 0:
        pytest.skip("BPF maps need root")
    result = cpscale.run(150, 3, "ebpf", page_size=50, restart=True)
    assert [p.name for p in result.phases] == ["start", "list+convert", "prepare", "sync", "restart", "audit"]
    restart, audit = result.phases[-2:]
    assert restart.extra["map_writes"] == 0, "every service port adopted as the maps hold it"
    assert audit.extra["drifts"] == 0
    assert result.counts["bpf_services"] == 150 and result.counts["bpf_backends"] == 450


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="restart: mode 'none'"):
        cpscale.run(1, 1, "none", restart=True)
    with pytest.raises(ValueError, match="mode"):
        cpscale.run(1, 1, "nft")
    with pytest.raises(ValueError, match="services=-1"):
        cpscale.run(-1, 1, "none")


@pytest.mark.root
def test_apply_loads_the_iptables_ruleset_into_a_netns_of_its_own_and_removes_it():
    """--apply: the real IptablesDatapath's full sync (render + one iptables-restore), in a netns
    the run makes and deletes; the rules the kernel then holds are counted."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    result = cpscale.run(40, 3, "iptables", page_size=20, apply=True)
    assert [p.name for p in result.phases] == ["start", "list+convert", "prepare", "sync"]
    # each Service: a KUBE-SERVICES jump, its KUBE-SVC chain's rules, 3 endpoint chains (2 rules each)
    assert result.counts["iptables_rules_nat"] > 40 * (1 + 3 + 2 * 3)
    assert set(os.listdir("/run/netns")) == before, "the run's netns is deleted"
    with pytest.raises(ValueError, match="apply: mode 'none'"):
        cpscale.run(1, 1, "none", apply=True)


@pytest.mark.root
def test_an_iptables_restart_over_the_audited_ruleset_restores_nothing():
    """--restart with iptables --apply: the audit proves the ruleset, and a restarted datapath's
    full sync finds both tables proved (datapath/iptables/proof.py) and writes no chain."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    result = cpscale.run(40, 3, "iptables", page_size=20, apply=True, restart=True)
    assert [p.name for p in result.phases] == ["start", "list+convert", "prepare", "sync", "audit", "restart"]
    audit, restart = result.phases[-2:]
    assert audit.extra["drifts"] == 0
    assert restart.extra == {"tables_proven": 2, "chains_written": 0}
    with pytest.raises(ValueError, match="restart: mode 'iptables'"):
        cpscale.run(1, 1, "iptables", restart=True)  # nothing applied: nothing to restart over
