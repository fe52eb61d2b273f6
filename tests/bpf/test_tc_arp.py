"""tc_egress on ARP: a request announcing 127.0.0.0/8 (the first packet of a loopback-bound node
socket the socket LB sent to a backend, before its neighbour is known) announces the masquerade
address instead; every other ARP packet leaves untouched."""

from __future__ import annotations

import pytest
from scapy.layers.l2 import ARP, Ether

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import MAC_NODE, TC_ACT_OK, counted, run

pytestmark = [pytest.mark.bpf, pytest.mark.root]


def arp(op: int, psrc: str, pdst: str = "10.244.1.31") -> Ether:
    return Ether(src=MAC_NODE, dst="ff:ff:ff:ff:ff:ff") / ARP(op=op, hwsrc=MAC_NODE, psrc=psrc, pdst=pdst)


def test_request_from_loopback_announces_the_masquerade_address(datapath, maps):
    out = run(datapath, "tc_egress", arp(1, "127.0.0.1"))
    assert out.verdict == TC_ACT_OK
    got = out.pkt[ARP]
    assert got.psrc == w.NODE_IP and got.pdst == "10.244.1.31" and got.hwsrc == MAC_NODE
    assert counted(maps) == {s.Reason.ARP_MASQ: 1}


@pytest.mark.parametrize("pkt", [arp(1, w.NODE_IP2), arp(2, "127.0.0.1")], ids=["request from a node address", "reply"])
def test_other_arp_leaves_untouched(datapath, maps, pkt):
    out = run(datapath, "tc_egress", pkt)
    assert out.verdict == TC_ACT_OK and out.raw == bytes(pkt)
    assert counted(maps) == {s.Reason.PASS_NOT_IPV4: 1}


def test_ingress_never_rewrites_arp(datapath, maps):
    pkt = arp(1, "127.0.0.1")
    out = run(datapath, "tc_ingress", pkt)
    assert out.raw == bytes(pkt)
    assert counted(maps) == {s.Reason.PASS_NOT_IPV4: 1}
