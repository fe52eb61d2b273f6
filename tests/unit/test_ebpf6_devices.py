"""devices.py for IPv6 nodes (pure): a routed CNI's pod veth is found by its IPv6 host route too,
and the IPv6 masquerade address is the external device's first usable global IPv6 address."""

from __future__ import annotations

import pytest

from ebpf_proxy.datapath.ebpf.devices import EXTERNAL, POD, Device, Link, Route, classify, primary_address

CIDRS = ("10.244.0.0/16", "fd00:10:244::/56")


@pytest.mark.parametrize("route, role", [
    (Route("fd00:10:244:5::4/128", 5), POD),  # a routed CNI's veth, any name, on an IPv6-only node
    (Route("fd00:10:245::4/128", 5), EXTERNAL),  # a host route outside the cluster CIDRs
    (Route("fd00:10:244:5::/64", 5), EXTERNAL),  # not a host route
    (Route("fd00:10:244:5::4/128", 5, "fe80::1"), EXTERNAL),  # a gateway route
], ids=["routed-veth", "outside-cidr", "prefix", "gateway"])
def test_ipv6_host_routes_classify_pod_veths(route, role):
    link = Link(5, "pod-a", "veth", True)
    assert classify([link], [route], CIDRS) == {5: Device(5, "pod-a", role)}
    assert classify([link], [route], ("10.244.0.0/16",))[5].role == EXTERNAL, "an IPv4 CIDR never holds an IPv6 route"


class _Ipr:
    """get_addr of a fake IPRoute: (family, ifindex) -> [(address, IFA flags)]."""

    def __init__(self, addrs: dict[tuple[int, int], list[tuple[str, int]]]) -> None:
        self.addrs = addrs

    def get_addr(self, family: int, index: int) -> list[dict]:
        return [{"flags": flags, "IFA_ADDRESS": addr} for addr, flags in self.addrs.get((family, index), [])]


def test_the_ipv6_masquerade_address_is_a_global_one_of_the_default_route_device():
    import socket

    devs = {2: Device(2, "eth0", EXTERNAL), 3: Device(3, "eth1", EXTERNAL), 4: Device(4, "lxc1", POD)}
    routes = [Route("0.0.0.0/0", 2, "172.20.20.1"), Route("::/0", 3, "fe80::1")]
    ipr = _Ipr({(socket.AF_INET6, 3): [("fe80::5", 0), ("fd00:20::9", 0x20), ("fd00:20::15", 0)],
                (socket.AF_INET6, 2): [("fd00:30::1", 0)],
                (socket.AF_INET, 2): [("172.20.20.15", 0)]})
    # link-local and deprecated (0x20) skipped; the device of the IPv6 default route, not IPv4's
    assert primary_address(ipr, devs, routes, 6) == "fd00:20::15"
    assert primary_address(ipr, devs, routes) == "172.20.20.15"
    assert primary_address(_Ipr({}), devs, routes, 6) is None
    # no primary IPv6 address: the one the kernel would pick as the source toward the backends
    # (RFC 6724 rule 8: the longest shared prefix), here the node's address, not an extra one
    extra = _Ipr({(socket.AF_INET6, 3): [("fd00:192:168:99::b", 0), ("fd00:20::f", 0)]})
    assert primary_address(extra, devs, routes, 6, toward="fd00:10:244::") == "fd00:20::f"
    assert primary_address(extra, devs, routes, 6) == "fd00:192:168:99::b"
