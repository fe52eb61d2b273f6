"""reachable(): categorize's answer as the columns the eBPF datapath writes, read from the packed
endpoints without an Endpoint value each in the common case (issue 12: a full sync at 100,000
Services). It must be exactly categorize's answer, whatever the input."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ebpf_proxy.model import Endpoint, NodeTopology, Protocol, ServicePort, ServicePortName, categorize
from ebpf_proxy.model.categorize import reachable
from ebpf_proxy.model.endpoints import EndpointList, MergedEndpoints, PortlessEndpoints, merge
from ebpf_proxy.model.types import ip_family

SPN = ServicePortName("default", "web", "", Protocol.TCP)

# canonical dotted quads (packed as 4 bytes), other text (packed as text), IPv6
IPS = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.10", "10.0.0.9", "192.168.1.1", "10.1", "fd00::1", "fd00::a"])
V4 = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.10", "10.0.0.9", "192.168.1.1", "0.0.0.0", "255.255.255.255"])
NAMES = st.sampled_from([None, "node-a", "node-b"])
HINTS = st.sampled_from([(), ("zone-a",), ("zone-a", "zone-b"), ("node-a",)])
CONDITIONS = st.sampled_from([(True, True, False), (False, True, True), (False, False, True), (False, False, False),
                              (True, True, True), (False, True, False)])  # ready, serving, terminating


@st.composite
def row(draw, ips=IPS, plain: bool = False):
    """(ip, node, ready, serving, terminating, is_local, zone hints, node hints); `plain`: ready, no hints."""
    ready, serving, terminating = (True, True, False) if plain else draw(CONDITIONS)
    hints = ((), ()) if plain else (draw(HINTS), draw(HINTS))
    return (draw(ips), draw(NAMES), ready, serving, terminating, draw(st.booleans()), *hints)


SERVICES = st.sampled_from([
    {},
    {"internal_policy_local": True},
    {"node_port": 30080},
    {"node_port": 30080, "external_policy_local": True},
    {"external_ips": ("203.0.113.1",), "external_policy_local": True},
    {"node_port": 30080, "external_policy_local": True, "internal_policy_local": True},
    {"external_policy_local": True},  # not externally accessible: eTP=Local does not apply
])
NODES = st.sampled_from([NodeTopology(), NodeTopology("node-a", "zone-a"), NodeTopology("node-b", "zone-b"),
                         NodeTopology("node-a", "")])


def svc(**kw) -> ServicePort:
    return ServicePort(name=SPN, cluster_ip="10.96.0.10", port=80, protocol=Protocol.TCP, **kw)


def assert_same_answer(service: ServicePort, endpoints, node: NodeTopology) -> None:
    sets = categorize(service, endpoints, node)
    got = reachable(service, endpoints, node)
    everything = list(sets.all_reachable)
    assert got.ips() == [ep.ip for ep in everything]
    assert list(got.ports) == [ep.port for ep in everything]
    assert len(got.in_cluster) == len(got.in_local) == len(everything)
    assert [ep for ep, c in zip(everything, got.in_cluster) if c] == list(sets.cluster)
    assert [ep for ep, loc in zip(everything, got.in_local) if loc] == list(sets.local)
    assert all(type(flag) is bool for flag in (*got.in_cluster, *got.in_local))
    assert got.has_any == sets.has_any
    if got.v4 is not None:  # the addresses' own bytes, only where each is a canonical dotted quad
        assert got.v4 == b"".join(socket.inet_aton(ip) for ip in got.ips())
        assert all(socket.inet_ntoa(socket.inet_aton(ip)) == ip for ip in got.ips())


@settings(max_examples=400, deadline=None)
@given(slices=st.lists(st.tuples(st.lists(row(), max_size=6), st.sampled_from([80, 81])), min_size=1, max_size=3),
       form=st.sampled_from(["merged", "tuple", "list"]), service=SERVICES, node=NODES)
def test_reachable_is_categorize_for_any_endpoints(slices, form, service, node):
    lists = [PortlessEndpoints(rows).with_port(port) for rows, port in slices]
    if form == "merged":  # what the tracker holds: packed, sorted, deduplicated (or a tuple when it cannot be)
        endpoints = merge(lists)
    elif form == "tuple":  # any order, equal values twice, as a caller may pass them
        merged = tuple(merge(lists))
        endpoints = tuple(reversed(merged)) + merged
    else:  # one slice's packed list, not merged (categorize orders it: one endpoint an address)
        assume(len({r[0] for r in slices[0][0]}) == len(slices[0][0]))
        endpoints = lists[0]
    assert_same_answer(svc(**service), endpoints, node)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(row(ips=V4 | IPS, plain=True), min_size=1, max_size=12), port=st.sampled_from([80, 8080, 65535]),
       service=SERVICES, node=NODES)
def test_reachable_is_categorize_in_the_common_case(rows, port, service, node):
    """All ready, no hints: the case read from the packed rows (a MergedEndpoints)."""
    endpoints = merge([PortlessEndpoints(rows).with_port(port)])
    assert type(endpoints) is MergedEndpoints
    assert_same_answer(svc(**service), endpoints, node)


@pytest.mark.parametrize("service", [{}, {"internal_policy_local": True},
                                     {"node_port": 30080, "external_policy_local": True}])
def test_the_common_case_builds_no_endpoint_value(monkeypatch, service):
    rows = [(f"10.0.0.{i}", "node-a" if i % 2 else "node-b", True, True, False, bool(i % 2), (), ()) for i in range(10)]
    endpoints = merge([PortlessEndpoints(rows).with_port(8080)])
    want = categorize(svc(**service), endpoints, NodeTopology("node-a"))

    def no_endpoints(self):
        raise AssertionError("an Endpoint value was built")

    monkeypatch.setattr(EndpointList, "__iter__", no_endpoints)
    got = reachable(svc(**service), endpoints, NodeTopology("node-a"))
    assert got.v4 == b"".join(socket.inet_aton(ep.ip) for ep in want.all_reachable)
    assert [loc for loc in got.in_local] == [ep in want.local for ep in want.all_reachable]
    assert got.has_any


@pytest.mark.parametrize("ip", ["10.96.0.10", "0.0.0.0", "255.255.255.255", "fd00::1", "::", "::ffff:10.0.0.1",
                                "2001:db8::a:b", "fe80::1%eth0"])
def test_ip_family_is_ipaddress_version(ip):
    assert ip_family(ip) == ipaddress.ip_address(ip).version


@pytest.mark.parametrize("garbage", ["", "10.96.0", "010.96.0.10", "10.96.0.10 ", " 10.96.0.10", "10.96.0.256",
                                     "0x7f.0.0.1", "1", "10.96.0.10\0", "fd00::1::2", "nonsense", "10.96.0.10/32"])
def test_ip_family_rejects_what_ipaddress_rejects(garbage):
    with pytest.raises(ValueError):
        ipaddress.ip_address(garbage)
    with pytest.raises(ValueError):
        ip_family(garbage)


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses())
def test_ip_family_of_any_address_text(addr):
    assert ip_family(str(addr)) == addr.version
    assert ip_family(addr.exploded) == addr.version


def test_endpoint_lists_other_than_the_trackers_are_categorized_as_they_are():
    """A tuple with duplicates in any order, as callers may pass: categorize sorts and deduplicates."""
    a, b = Endpoint("10.0.0.2", 80), Endpoint("10.0.0.1", 80, is_local=True)
    got = reachable(svc(internal_policy_local=True), (a, b, a), NodeTopology("n"))
    assert got.ips() == ["10.0.0.1"] and got.in_local == [True] and got.in_cluster == [False] and got.has_any
