"""Rule 9: a service without usable endpoints answers ICMP port unreachable, like REJECT."""

from __future__ import annotations

import pytest
from scapy.layers.inet import ICMP, IP, IPerror, TCP, TCPerror, UDP, UDPerror
from scapy.layers.l2 import Ether
from scapy.utils import checksum

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import MAC_NODE, MAC_PEER, TC_ACT_REDIRECT, assert_checksums_valid, counted, run, tcp, udp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

EMPTY = dict(flags=0, cluster=(), local=())
OPTS = b"\x94\x04\x00\x00"  # router alert

CASES = {  # name: (service, packet, from a pod: padded layout)
    "TCP SYN from a pod": (w.web(**EMPTY), tcp(w.POD_CLIENT, 40000, w.VIP, 80), True),
    "TCP from a pod, payload and IP options": (
        w.web(**EMPTY), tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="PA", payload=b"x" * 300, options=OPTS), True),
    "UDP from a pod": (w.web(proto=w.UDP, **EMPTY), udp(w.POD_CLIENT, 5353, w.VIP, 80), True),
    "TCP from outside to a nodePort": (w.web(**EMPTY), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), False),
    "UDP from outside, IP options": (w.web(proto=w.UDP, **EMPTY), udp(w.OUTSIDE, 5353, w.NODE_IP2, w.NODE_PORT, options=OPTS), False),
    "UDP from outside, empty payload": (w.web(proto=w.UDP, **EMPTY), udp(w.OUTSIDE, 5353, w.LB_IP, 80, payload=b""), False),
}


def complete_partial_checksum(frame: bytes, csum_start: int, csum_offset: int) -> bytes:
    """What the kernel does to a CHECKSUM_PARTIAL skb leaving a device without TX offload."""
    data = bytearray(frame)
    value = checksum(bytes(data[csum_start:]))
    data[csum_start + csum_offset : csum_start + csum_offset + 2] = value.to_bytes(2, "big")
    return bytes(data)


@pytest.mark.parametrize("name", CASES)
def test_reject_builds_port_unreachable(datapath, maps, name):
    svc, built, from_pod = CASES[name]
    pkt = Ether(bytes(built))  # fields (ihl, len) filled in
    w.install(maps, svc)
    out = run(datapath, "tc_ingress", pkt)

    assert out.verdict == TC_ACT_REDIRECT  # bounced out of the device it came in on
    assert counted(maps) == {s.Reason.REJECT: 1}
    reply = out.pkt
    assert (reply.src, reply.dst) == (MAC_NODE, MAC_PEER)
    ip = reply[IP]
    assert (ip.src, ip.dst, ip.proto, ip.ttl) == (pkt[IP].dst, pkt[IP].src, 1, 64)
    assert (ip[ICMP].type, ip[ICMP].code) == (3, 3)
    assert_checksums_valid(reply)
    orig_hlen = pkt[IP].ihl * 4
    pad = orig_hlen - 20 + 12 if from_pod else 0
    assert ip.ihl * 4 == 20 + pad and bytes(ip)[20 : 20 + pad] == bytes(pad), "zero (EOL) options only"
    quoted_len = orig_hlen + 8
    assert len(reply) == 14 + 20 + pad + 8 + quoted_len
    assert bytes(ip[ICMP].payload) == bytes(pkt[IP])[:quoted_len], "original IP header + 8 bytes quoted"
    inner = ip[IPerror]
    assert (inner.src, inner.dst) == (pkt[IP].src, pkt[IP].dst)
    layer, l4 = (TCPerror, TCP) if TCP in pkt else (UDPerror, UDP)
    assert (inner[layer].sport, inner[layer].dport) == (pkt[l4].sport, pkt[l4].dport)
    assert not maps.connections()

    if from_pod:
        # the pod's packet may have been CHECKSUM_PARTIAL: the kernel's pending completion at
        # the original L4 checksum position must leave the reply exactly as it is
        csum_offset = 16 if TCP in pkt else 6
        assert complete_partial_checksum(out.raw, 14 + orig_hlen, csum_offset) == out.raw


def test_no_endpoints_then_endpoints(datapath, maps):
    """Once an endpoint appears the same client connects (no state kept from the reject)."""
    w.install(maps, w.web(**EMPTY))
    assert run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80)).verdict == TC_ACT_REDIRECT
    w.install(maps, w.web())
    out = run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    assert out.verdict == 0 and out.pkt[IP].dst != w.VIP
