"""bench/bpfcost.py: the per-packet cost measurement runs the real program on the paths it names."""

from __future__ import annotations

import socket

import pytest
from scapy.layers.l2 import Ether

from ebpf_proxy.bench import bpfcost
from ebpf_proxy.bench.results import BPF_COST_PATHS
from ebpf_proxy.datapath.ebpf.maps import Frontend
from tests.bpf.packets import assert_checksums_valid

pytestmark = [pytest.mark.bpf, pytest.mark.root]


def test_its_packets_are_valid():
    for flags in (bpfcost.SYN, bpfcost.ACK):
        pkt = Ether(bpfcost.tcp_packet("10.244.0.7", 40000, "10.96.0.10", 80, flags))
        assert_checksums_valid(pkt)
        assert pkt["TCP"].flags == flags and pkt["IP"].dst == "10.96.0.10"


def test_measures_each_path_and_cleans_up(tmp_path):
    runs = bpfcost.measure(50, endpoints=3, samples=40, repeats=2, capacity=100, cache_dir=tmp_path / "cache")
    assert set(runs) == set(BPF_COST_PATHS)
    for path, per_repeat in runs.items():
        assert len(per_repeat) == 2
        assert all(0 < r["median"] <= r["p99"] for r in per_repeat), (path, per_repeat)
    # measure() itself checks the counters: 80 new connections per path pair, 80 established hits
    assert not bpfcost.ROOT.exists() or not any(bpfcost.ROOT.iterdir())  # the private bpffs is gone


def test_a_run_that_does_not_translate_is_an_error(tmp_path, monkeypatch):
    original = bpfcost.fill

    def fill_without_the_measured_clusterip(maps, services, endpoints):
        original(maps, services, endpoints)
        maps.delete_service(Frontend(bpfcost.service_vip(services - 1), bpfcost.PORT, socket.IPPROTO_TCP))

    monkeypatch.setattr(bpfcost, "fill", fill_without_the_measured_clusterip)
    with pytest.raises(bpfcost.BpfCostError, match="clusterip_syn: tc_ingress did not translate"):
        bpfcost.measure(5, endpoints=2, samples=5, repeats=1, cache_dir=tmp_path / "cache")
