"""Dual-stack and IPv6-only topologies: pairs in either order, per-family defaults and
allocation, and errors naming the field (the IPv4 behaviour is test_topology.py's)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ebpf_proxy.lab.topology import PodSpec, TopologyError, load_topology, parse_topology

DUAL = {
    "serviceCIDR": "10.96.0.0/12,fd00:10:96::/112",
    "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56",
    "nodes": [
        {"name": "w1", "ip": "172.20.20.15,fd00:20::15", "podCIDR": "10.244.5.0/24,fd00:10:244:5::/64"},
        {"name": "w2", "ip": "fd00:20::16,172.20.20.16"},
    ],
    "pods": [
        {"name": "a", "node": "w1", "ip": "fd00:10:244:5::4,10.244.5.4"},
        {"name": "b", "node": "w2"},
        {"name": "c", "node": "w2", "ip": "10.244.2.9"},
    ],
    "clients": [{"name": "out", "ip": "203.0.113.5,2001:db8:1::5"}, {"name": "v4", "ip": "203.0.113.6"}],
}


def dual(**changes):
    data = {k: (list(v) if isinstance(v, list) else v) for k, v in DUAL.items()}
    data.update(changes)
    return data


def test_pairs_in_either_order_primary_first():
    t = parse_topology(dual())
    assert t.families == ("IPv4", "IPv6") and t.dual_stack and t.has_ipv6
    assert t.service_cidrs == ("10.96.0.0/12", "fd00:10:96::/112") and t.service_cidr == "10.96.0.0/12"
    w1, w2 = t.nodes
    assert w1.ips == ("172.20.20.15", "fd00:20::15") and w1.ip == "172.20.20.15"
    assert w2.ips == ("fd00:20::16", "172.20.20.16") and w2.ip == "fd00:20::16"
    # defaults per family, in the node's own order (its primary IP's family first)
    assert w2.pod_cidrs == ("fd00:10:244:2::/64", "10.244.2.0/24")
    assert t.api_server_ips == ("192.0.2.1", "fd00:192:0:2::1")


def test_pods_get_one_address_per_cluster_family_in_cluster_order():
    t = parse_topology(dual())
    assert t.pod("a").ips == ("10.244.5.4", "fd00:10:244:5::4")
    assert t.pod("b").ips == ("10.244.2.2", "fd00:10:244:2::2")
    assert t.pod("c").ips == ("10.244.2.9", "fd00:10:244:2::3")  # the missing family allocated
    added = t.with_pod(PodSpec(name="d", node="w1"))
    assert added.pod("d").ips == ("10.244.5.2", "fd00:10:244:5::2")
    # a copy of a pod with ip=None (lab scale's template) allocates afresh in both families
    copied = t.with_pod(replace(t.pod("a"), name="e", node="w2", ip=None))
    assert copied.pod("e").ips == ("10.244.2.3", "fd00:10:244:2::4")


def test_round_trips_through_to_dict():
    t = parse_topology(dual())
    assert parse_topology(t.to_dict()) == t
    assert t.to_dict()["nodes"][1]["ip"] == "fd00:20::16,172.20.20.16"


def test_ipv6_only_cluster():
    t = parse_topology({"serviceCIDR": "fd00:10:96::/112", "nodes": [{"name": "w1", "ip": "fd00:20::15"}],
                        "pods": [{"name": "p", "node": "w1"}]})
    assert t.families == ("IPv6",) and t.cluster_cidrs == ("fd00:10:244::/56",)
    assert t.node("w1").pod_cidrs == ("fd00:10:244:1::/64",) and t.pod("p").ips == ("fd00:10:244:1::2",)
    assert t.api_server_ip == "fd00:192:0:2::1"


def test_pod_prefixes_cover_both_families_and_outside_addresses():
    t = parse_topology(dual(pods=[{"name": "odd", "node": "w1", "ip": "10.244.250.7,fd00:99::7"}]))
    # fixed addresses outside w1's podCIDRs: each gets its own host route
    assert t.pod_prefixes("w1") == ("10.244.5.0/24", "fd00:10:244:5::/64", "10.244.250.7/32", "fd00:99::7/128")


def test_the_dual_stack_example_file_loads():
    t = load_topology("examples/dualstack.yaml")
    assert t.dual_stack and all(len(n.ips) == 2 and len(n.pod_cidrs) == 2 for n in t.nodes)


@pytest.mark.parametrize("changes, field, message", [
    ({"serviceCIDR": "10.96.0.0/12,10.97.0.0/16"}, "serviceCIDR", "has two IPv4 values; a pair is one IPv4 and one IPv6"),
    ({"serviceCIDR": "10.96.0.0/12"}, "serviceCIDR", "must have the same IP families"),
    ({"clusterCIDR": "10.244.0.0/16,fd00:10:244::/56,fd01::/56"}, "clusterCIDR", "give one value or a comma-separated pair"),
    ({"clusterCIDR": "10.244.0.0/16,fd00:10:244::1/56"}, "clusterCIDR", "has host bits set"),
    ({"nodes": [{"name": "w1", "ip": "172.20.20.15"}]}, "nodes[0].ip",
     "'172.20.20.15' has no IPv6 address, but the cluster has IPv6"),
    ({"nodes": [{"name": "w1", "ip": "172.20.20.15,fd00:10:244::9"}]}, "nodes[0].ip",
     "lies inside clusterCIDR fd00:10:244::/56"),
    ({"nodes": [{"name": "w1", "ip": "172.20.20.15,fe80::1"}]}, "nodes[0].ip", "link-local"),
    ({"nodes": [{"name": "w1", "ip": "172.20.20.15,fd00:20::15", "podCIDR": "10.244.5.0/24,fd00:11::/64"}]},
     "nodes[0].podCIDR", "fd00:11::/64 is not inside clusterCIDR fd00:10:244::/56"),
    ({"pods": [{"name": "x", "node": "w1", "ip": "fd00:10:244:2::9"}]}, "pods[0].ip",
     "lies in podCIDR fd00:10:244:2::/64 of node 'w2'"),
    ({"clients": [{"name": "o", "ip": "fd00:20::15"}]}, "clients[0].ip", "already used by nodes[0].ip"),
    ({"clients": [{"name": "o", "ip": "2001:db8::zz"}]}, "clients[0].ip", "is not an IPv6 address"),
])
def test_errors_name_the_field(changes, field, message):
    with pytest.raises(TopologyError) as exc:
        parse_topology(dual(**changes))
    assert exc.value.field == field and message in exc.value.problem, str(exc.value)


def test_ipv6_sysctls_only_where_the_topology_has_ipv6():
    from ebpf_proxy.lab.netns import _netns_sysctls

    v4 = _netns_sysctls(forwarding=True)
    assert v4["net/ipv6/conf/all/disable_ipv6"] == 1 and not any("accept_dad" in k for k in v4)
    assert "net/ipv6/conf/all/forwarding" not in v4
    v6 = _netns_sysctls(forwarding=True, ipv6=True)
    assert v6["net/ipv6/conf/all/disable_ipv6"] == 0 and v6["net/ipv6/conf/default/accept_dad"] == 0
    assert v6["net/ipv6/conf/all/forwarding"] == 1
    assert "net/ipv6/conf/all/forwarding" not in _netns_sysctls(forwarding=False, ipv6=True)  # pods, clients
