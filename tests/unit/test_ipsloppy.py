"""ParseIPSloppy / ParseCIDRSloppy (k8s.io/utils/net), as kube-apiserver and kube-proxy read legacy IPs."""

from __future__ import annotations

import ipaddress

import pytest

from ebpf_proxy.model.ipsloppy import is_standard_ip, parse_cidr, parse_ip


@pytest.mark.parametrize("text, expected", [
    ("10.180.0.1", "10.180.0.1"),
    ("10.180.00.001", "10.180.0.1"),        # leading zeros are decimal, never octal
    ("010.0.0.010", "10.0.0.10"),
    ("0000192.168.0.1", "192.168.0.1"),     # Go's dtoi takes any number of them
    ("::ffff:1.2.3.4", "1.2.3.4"),          # IPv4-mapped is IPv4 (Go's To4)
    ("::ffff:001.002.003.004", "1.2.3.4"),
    ("2001:db8::1", "2001:db8::1"),
    ("2001:0db8:0000::00001", "2001:db8::1"),
])
def test_parse_ip_accepts_legacy_forms(text, expected):
    assert parse_ip(text) == ipaddress.ip_address(expected)


@pytest.mark.parametrize("text", [
    "", " 10.0.0.1", "10.0.0.1 ", "10.0.0.256", "10.0.0", "10.0.0.1.2", "10.0.0.-1", "10.0.0.x",
    "fe80::1%eth0", "::ffff:1.2.3.256", "1.2.3.4/32", "١٠.0.0.1", None, 167772161,
])
def test_parse_ip_rejects(text):
    assert parse_ip(text) is None


@pytest.mark.parametrize("text, addr, net", [
    ("203.0.113.0/25", "203.0.113.0", "203.0.113.0/25"),
    ("203.0.113.000/025", "203.0.113.0", "203.0.113.0/25"),
    ("10.0.0.5/8", "10.0.0.5", "10.0.0.0/8"),                 # host bits cleared, as IPNet is
    ("::ffff:10.0.0.0/104", "10.0.0.0", "10.0.0.0/8"),
    ("2001:db8::/32", "2001:db8::", "2001:db8::/32"),
])
def test_parse_cidr(text, addr, net):
    assert parse_cidr(text) == (ipaddress.ip_address(addr), ipaddress.ip_network(net))


@pytest.mark.parametrize("text", ["10.0.0.0", "10.0.0.0/33", "10.0.0.0/-1", "10.0.0.0/8 ", " 10.0.0.0/8",
                                  "10.0.0.0/x", "2001:db8::/129", None])
def test_parse_cidr_rejects(text):
    assert parse_cidr(text) is None


def test_standard_forms():
    assert is_standard_ip("10.180.0.1") and is_standard_ip("2001:db8::1")
    assert not is_standard_ip("10.180.00.001") and not is_standard_ip("::ffff:1.2.3.4")
