"""The eBPF datapath's map entries take topology from model.categorize: the cluster slots hold
only the endpoints hinted for this node (PreferSameNode) or zone; the local slots ignore hints.
Pure: ServicePrograms.entries() computes entries without touching maps."""

from __future__ import annotations

from ebpf_proxy.datapath.ebpf.services import ServicePrograms
from ebpf_proxy.model import Endpoint, NodeTopology, Protocol, ServicePort, ServicePortName

NAME = ServicePortName("default", "web", "http", Protocol.TCP)


def ep(ip, node, zone, local=False):
    return Endpoint(ip, 8080, node_name=node, is_local=local, zone_hints=(zone,), node_hints=(node,))


EPS = (ep("10.244.1.2", "me", "zone-a", local=True), ep("10.244.2.2", "other-a", "zone-a"),
       ep("10.244.3.2", "other-b", "zone-b"))


def cluster_ips(entries):
    return sorted(entries.backends[bid].addr for bid in entries.cluster_slots)


def test_cluster_slots_follow_node_then_zone_hints():
    web = ServicePort(name=NAME, cluster_ip="10.96.0.10", port=80, protocol=Protocol.TCP)
    programs = ServicePrograms(maps=None)
    assert cluster_ips(programs.entries(web, EPS, NodeTopology("me", "zone-a"))) == ["10.244.1.2"]
    assert cluster_ips(programs.entries(web, EPS, NodeTopology("elsewhere", "zone-a"))) == ["10.244.1.2", "10.244.2.2"]
    assert cluster_ips(programs.entries(web, EPS, NodeTopology("elsewhere", "zone-c"))) == [
        "10.244.1.2", "10.244.2.2", "10.244.3.2"]


def test_local_slots_ignore_hints_and_backends_merge():
    web = ServicePort(name=NAME, cluster_ip="10.96.0.10", port=80, protocol=Protocol.TCP, node_port=30080,
                      external_policy_local=True)
    # hinted for zone-b only (no node hint, so zone topology decides): still this node's local endpoint
    local = Endpoint("10.244.1.9", 8080, node_name="me", is_local=True, zone_hints=("zone-b",))
    e = ServicePrograms(maps=None).entries(web, (*EPS[1:], local), NodeTopology("me", "zone-a"))
    assert cluster_ips(e) == ["10.244.2.2"]
    assert [e.backends[b].addr for b in e.local_slots] == ["10.244.1.9"]
    assert sorted(b.addr for b in e.backends.values()) == ["10.244.1.9", "10.244.2.2"]
