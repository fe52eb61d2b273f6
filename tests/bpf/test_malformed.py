"""Malformed packets never crash, never get translated, and are dropped with their reason.

The same parser serves tc_ingress, tc_egress and xdp_lb, so every case runs through all three.
"""

from __future__ import annotations

import struct

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import MAC_NODE, MAC_PEER, TC_ACT_SHOT, XDP_DROP, counted, run, tcp, udp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ETH = bytes(Ether(src=MAC_PEER, dst=MAC_NODE, type=0x0800))


def good_tcp() -> bytes:
    return bytes(tcp(w.POD_CLIENT, 40000, w.VIP, 80)[IP])


def patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]


CASES = {
    "IP header cut short": (ETH + good_tcp()[:12], R.DROP_MALFORMED_IP),
    "IHL below 5": (ETH + patch(good_tcp(), 0, "B", 0x44), R.DROP_MALFORMED_IP),
    "IP version 6 in an IPv4 frame": (ETH + patch(good_tcp(), 0, "B", 0x65), R.DROP_MALFORMED_IP),
    "IHL beyond the total length": (ETH + patch(good_tcp(), 0, "B", 0x4F), R.DROP_MALFORMED_IP),
    "total length beyond the frame": (ETH + patch(good_tcp(), 2, "!H", 200), R.DROP_MALFORMED_IP),
    "total length below the header": (ETH + patch(good_tcp(), 2, "!H", 12), R.DROP_MALFORMED_IP),
    "TCP header cut short": (ETH + bytes(IP(src=w.POD_CLIENT, dst=w.VIP, proto=6) / (b"\x9c\x40\x00\x50" + b"\0" * 6)), R.DROP_MALFORMED_L4),
    "TCP data offset below 5": (ETH + bytes(IP(src=w.POD_CLIENT, dst=w.VIP) / TCP(sport=40000, dport=80, dataofs=2)), R.DROP_MALFORMED_L4),
    "UDP header cut short": (ETH + bytes(IP(src=w.POD_CLIENT, dst=w.VIP, proto=17) / b"\x13\x88\x00\x50"), R.DROP_MALFORMED_L4),
    "options claim more than the frame has": (ETH + bytes(IP(src=w.POD_CLIENT, dst=w.VIP, ihl=15, proto=17, options=b"\x01" * 4) / b"\x13\x88"), R.DROP_MALFORMED_IP),
}


# BPF_PROG_TEST_RUN refuses to build an skb whose IPv4 header is cut (EINVAL), so such frames run
# through XDP only; the parser is the same code for both.
RUNS = [
    (name, prog)
    for name, (frame, _) in CASES.items()
    for prog in ("tc_ingress", "tc_egress", "xdp_lb")
    if prog == "xdp_lb" or len(frame) >= 14 + 20
]


@pytest.mark.parametrize(("name", "prog"), RUNS)
def test_malformed_is_dropped(datapath, maps, name, prog):
    w.install(maps, w.web(proto=w.UDP), w.web(id=2))
    frame, reason = CASES[name]
    out = run(datapath, prog, frame)
    assert out.verdict == (XDP_DROP if prog == "xdp_lb" else TC_ACT_SHOT)
    assert counted(maps) == {reason: 1}
    assert not maps.connections()


@pytest.mark.parametrize("prog", ["tc_ingress", "tc_egress"])
def test_ethernet_padding_is_not_malformed(datapath, maps, prog):
    """Short frames are padded to 60 bytes: total length below the frame length is fine."""
    w.install(maps, w.web(proto=w.UDP))
    frame = bytes(udp(w.POD_CLIENT, 5000, w.VIP, 80, payload=b"a")) + b"\0" * 20
    out = run(datapath, prog, frame)
    assert out.verdict != TC_ACT_SHOT
    assert not any(r.is_drop for r in counted(maps))
