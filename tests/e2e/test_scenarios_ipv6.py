"""The IPv6 twin of the scenario table is the IPv4 table translated (scenarios_ipv6.py), plus the
listed IPv6 differences, and the translation keeps every address in exactly the ranges that held
it. No lab, no root: these run with the unit tests' speed, beside the table they guard (the
table itself runs in test_scenarios.py)."""

import ipaddress

import pytest
import yaml

from tests.e2e import scenarios_ipv6 as v6
from tests.e2e.scenario_runner import SCENARIOS as SCENARIOS_FILE
from tests.e2e.scenario_runner import IPV6_DIFFERENCES, TOPOLOGY, TOPOLOGY_IPV6, load_ipv6_scenarios, load_scenarios

SCENARIOS = load_scenarios()
IPV6_SCENARIOS = load_ipv6_scenarios()


def test_ipv6_topology_is_the_translation_of_topology_yaml():
    """topology_ipv6.yaml is checked in for `lab up` by hand; it must stay the translation."""
    want = v6.translate_topology(yaml.safe_load(TOPOLOGY.read_text()))
    assert yaml.safe_load(TOPOLOGY_IPV6.read_text()) == want, \
        "regenerate tests/e2e/topology_ipv6.yaml: python -m tests.e2e.scenarios_ipv6"


def test_ipv6_table_is_the_ipv4_table_translated_plus_the_listed_differences():
    assert [s["name"] for s in IPV6_SCENARIOS] == [s["name"] for s in SCENARIOS]
    for v4, v6s in zip(SCENARIOS, IPV6_SCENARIOS):
        assert v6s.get("ipv6_difference", None) == (IPV6_DIFFERENCES.get(v4["name"]) or {}).get("reason")
        changed = (IPV6_DIFFERENCES.get(v4["name"]) or {}).get("steps", {})
        assert len(v6s["steps"]) == len(v4["steps"])
        for i, (a, b) in enumerate(zip(v4["steps"], v6s["steps"])):
            assert set(a) == set(b), (v4["name"], i)
            if i not in changed:
                assert b == v6.translate_scenario({"steps": [a]})["steps"][0], (v4["name"], i)
        left = [m.group(0) for m in v6._IPV4.finditer(repr(v6s))]
        assert not left, f"{v4['name']}: IPv4 left untranslated: {left}"


def _v4_literals() -> tuple[set[str], set[str]]:
    text = TOPOLOGY.read_text() + SCENARIOS_FILE.read_text()
    ips, cidrs = set(), set()
    for m in v6._IPV4.finditer(text):
        (cidrs if m.group(2) else ips).add(m.group(1) + (f"/{m.group(2)}" if m.group(2) else ""))
    return ips, cidrs


def test_the_translation_keeps_every_address_in_exactly_the_ranges_that_held_it():
    ips, cidrs = _v4_literals()
    assert len(ips) > 20 and len(cidrs) > 5
    assert len({v6.translate_ip(ip) for ip in ips}) == len(ips), "two IPv4 addresses → one IPv6 address"
    for ip in ips:
        for cidr in cidrs:
            inside = ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)
            ip6, cidr6 = v6.translate_ip(ip), v6.translate_cidr(cidr)
            assert (ipaddress.ip_address(ip6) in ipaddress.ip_network(cidr6)) == inside, (ip, cidr, ip6, cidr6)
    rules = [r.v6 for r in v6.RULES]
    assert not any(a.overlaps(b) for i, a in enumerate(rules) for b in rules[i + 1:]), "overlapping IPv6 ranges"


def test_the_translation_by_example():
    assert v6.translate_ip("10.96.100.10") == "fd00:10:96::640a"
    assert v6.translate_ip("10.244.5.4") == "fd00:10:244:5::4"
    assert v6.translate_cidr("10.244.5.0/24") == "fd00:10:244:5::/64"
    assert v6.translate_cidr("10.244.0.0/16") == "fd00:10:244::/56"
    assert v6.translate_cidr("10.96.0.0/12") == "fd00:10:96::/112"
    assert v6.translate_cidr("192.0.2.128/25") == "2001:db8:192:0:2::80/121"
    assert v6.translate_text("10.96.100.10:53/udp") == "[fd00:10:96::640a]:53/udp"
    assert v6.translate_text("http://${worker1}:32100/") == "http://[${worker1}]:32100/"
    assert v6.translate_text("127.0.0.1:30080") == "[::1]:30080"
    with pytest.raises(v6.TranslationError):
        v6.translate_ip("10.97.0.1")  # no rule: a new range in the IPv4 files needs one
