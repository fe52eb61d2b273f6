"""Topology keys for what the lab's API server must accept: serviceNodePortRange, listen: []."""

from __future__ import annotations

import pytest

from ebpf_proxy.lab.topology import TopologyError, node_port_range, parse_topology, topology_from_dict

BASE = {
    "nodes": [{"name": "worker1", "ip": "172.20.20.15"}],
    "pods": [{"name": "client-1", "node": "worker1", "listen": []}],
}


def test_node_port_range_defaults_to_kube_apiservers():
    assert parse_topology(BASE).service_node_port_range == "30000-32767"


def test_node_port_range_is_kept_and_round_trips():
    t = parse_topology({**BASE, "serviceNodePortRange": "3000-3100"})
    assert t.service_node_port_range == "3000-3100"
    assert t.to_dict()["serviceNodePortRange"] == "3000-3100"
    assert topology_from_dict(t.to_dict()) == t


@pytest.mark.parametrize("value, fragment", [
    ("3000", "'3000' is not FIRST-LAST"),
    ("3000:3100", "is not FIRST-LAST"),
    ([3000, 3100], "is not FIRST-LAST"),
    (True, "is not FIRST-LAST"),
    ("3100-3000", "need 1 <= FIRST <= LAST <= 65535"),
    ("0-100", "need 1 <= FIRST"),
    ("30000-70000", "LAST <= 65535"),
])
def test_invalid_node_port_range_names_the_field(value, fragment):
    with pytest.raises(TopologyError) as err:
        parse_topology({**BASE, "serviceNodePortRange": value})
    assert err.value.field == "serviceNodePortRange"
    assert str(err.value).startswith("serviceNodePortRange: ") and fragment in str(err.value)


def test_node_port_range_parses_like_the_flag():
    assert node_port_range(" 3000-3100 ") == (3000, 3100)


def test_a_pod_may_listen_on_nothing():
    assert parse_topology(BASE).pod("client-1").listen == ()
