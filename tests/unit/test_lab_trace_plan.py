"""`lab trace` asks the node a connection first reaches, with the origin and device it arrives by."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ebpf_proxy.explain.packet import FlowError
from ebpf_proxy.lab import naming
from ebpf_proxy.lab.topology import load_topology
from ebpf_proxy.lab.trace import follow, plan

TOPOLOGY = Path(__file__).parents[1] / "e2e" / "local_traffic_topology.yaml"  # worker1's pods on bridge cbr0


@pytest.fixture
def lab():
    return SimpleNamespace(name="t", topology=load_topology(TOPOLOGY), dir=Path("/run/ebpf-proxy/labs/t"))


def test_a_client_enters_at_the_node_it_addresses_else_at_its_gateway(lab):
    p = plan(lab, "outside", "172.20.20.16:30320", as_json=True)
    assert p.node == "worker2"
    assert p.argv == ("--from", "203.0.113.5", "--in-iface", "eth0", "--to", "172.20.20.16:30320/tcp",
                      "--mode", "auto", "--bpffs", "/run/ebpf-proxy/labs/t/bpffs/worker2",
                      "--kubeconfig", "/run/ebpf-proxy/labs/t/kubeconfig-node", "--json")
    assert plan(lab, "outside", "10.96.110.10:80/udp").node == "worker1"  # outside's gateway


def test_a_pod_enters_through_its_veth_or_its_nodes_bridge(lab):
    routed = plan(lab, "client-b", "10.96.110.10:80")
    assert routed.node == "worker2" and routed.argv[:5] == (
        "--from", next(p.ip for p in lab.topology.pods if p.name == "client-b"), "--from-pod", "--in-iface", naming.pod_host_ifname("client-b"))
    bridged = plan(lab, "client-a", "10.96.110.10:80")
    assert bridged.node == "worker1" and bridged.argv[3:5] == ("--in-iface", "cbr0")


def test_a_node_sends_from_its_address_or_from_loopback(lab):
    assert plan(lab, "worker3", "172.20.20.17:30320").argv[:3] == ("--from", "172.20.20.17", "--from-host")
    assert plan(lab, "worker3", "127.0.0.1:30320").argv[:3] == ("--from", "127.0.0.1", "--from-host")


@pytest.mark.parametrize("where, target, message", [
    ("mars", "10.96.0.1:80", "--from: 'mars' is not a node, pod or client of lab 't'"),
    ("outside", "10.96.0.1", "--to: '10.96.0.1' has no port"),
    ("outside", "web:80", "--to: 'web' is not an IPv4 or IPv6 address"),
])
def test_errors_name_the_option(lab, where, target, message):
    with pytest.raises(FlowError, match=message):
        plan(lab, where, target)


def test_a_packet_passed_on_to_another_nodes_address_is_asked_there(lab):
    first = plan(lab, "worker1", "172.20.20.16:30320", as_json=True)
    nxt = follow(lab, first, "172.20.20.16:30320", "auto", True)
    assert nxt.node == "worker2" and nxt.argv[:4] == ("--from", "172.20.20.15", "--in-iface", "eth0")
    assert nxt.argv[-1] == "--json"
    assert follow(lab, first, "10.96.110.20:80", "auto", True) is None  # not a node's address
    assert follow(lab, plan(lab, "worker2", "172.20.20.16:30320"), "172.20.20.16:30320", "auto", False) is None
