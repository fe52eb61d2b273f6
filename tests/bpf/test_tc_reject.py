"""Rule 9: a service without usable endpoints answers port unreachable, like REJECT: ICMP for
IPv4, ICMPv6 for IPv6. One test body runs both families' tables (family.py); what differs, the
error's own IP header and layout, is checked by the family's function in ERROR_HEADER."""

from __future__ import annotations

import pytest
from scapy.layers.inet import ICMP, IP, IPerror, TCP, TCPerror, UDP, UDPerror
from scapy.layers.inet6 import ICMPv6DestUnreach, IPerror6, IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop, PadN
from scapy.layers.l2 import Ether
from scapy.utils import checksum

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf import world6 as w6
from tests.bpf.family import IPV4, IPV6, cases
from tests.bpf.packets import MAC_NODE, MAC_PEER, TC_ACT_REDIRECT, assert_checksums_valid, counted, run, tcp, udp
from tests.bpf.world6 import NODE6, NODE_PORT, OUTSIDE6, POD6, VIP6, tcp6, udp6

pytestmark = [pytest.mark.bpf, pytest.mark.root]

EMPTY = dict(flags=0, cluster=(), local=())
OPTS = b"\x94\x04\x00\x00"  # router alert
PAD124 = IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 124)])  # 128 bytes of destination options

CASES = {  # family: {name: (service, packet, from a pod: the CHECKSUM_PARTIAL-safe padded layout)}
    IPV4: {
        "TCP SYN from a pod": (w.web(**EMPTY), tcp(w.POD_CLIENT, 40000, w.VIP, 80), True),
        "TCP from a pod, payload and IP options": (
            w.web(**EMPTY), tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="PA", payload=b"x" * 300, options=OPTS), True),
        "UDP from a pod": (w.web(proto=w.UDP, **EMPTY), udp(w.POD_CLIENT, 5353, w.VIP, 80), True),
        "TCP from outside to a nodePort": (w.web(**EMPTY), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), False),
        "UDP from outside, IP options": (w.web(proto=w.UDP, **EMPTY), udp(w.OUTSIDE, 5353, w.NODE_IP2, w.NODE_PORT, options=OPTS), False),
        "UDP from outside, empty payload": (w.web(proto=w.UDP, **EMPTY), udp(w.OUTSIDE, 5353, w.LB_IP, 80, payload=b""), False),
    },
    IPV6: {
        "TCP SYN from a pod to the clusterIP": (w6.web6(**EMPTY), tcp6(POD6, 40000, VIP6, 80), True),
        "TCP with payload from outside to the nodePort": (
            w6.web6(**EMPTY), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT, flags="PA", payload=b"x" * 300), False),
        "UDP from a pod": (w6.web6(proto=w6.UDP_P, **EMPTY), udp6(POD6, 5353, VIP6, 80), True),
        "UDP from outside": (w6.web6(proto=w6.UDP_P, **EMPTY), udp6(OUTSIDE6, 5353, w6.LB_IP6, 80, payload=b""), False),
        "TCP from a pod behind hop-by-hop and destination options": (
            w6.web6(**EMPTY), tcp6(POD6, 40000, VIP6, 80, payload=b"y" * 40, ext=(IPv6ExtHdrHopByHop(), IPv6ExtHdrDestOpt())),
            True),
        "UDP from a pod behind 256 bytes of options": (
            w6.web6(proto=w6.UDP_P, **EMPTY), udp6(POD6, 5353, VIP6, 80, ext=(PAD124, PAD124)), True),
        "TCP from outside behind options": (
            w6.web6(**EMPTY), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT, ext=(IPv6ExtHdrDestOpt(),)), False),
    },
}


def complete_partial_checksum(frame: bytes, csum_start: int, csum_offset: int) -> bytes:
    """What the kernel does to a CHECKSUM_PARTIAL skb leaving a device without TX offload."""
    data = bytearray(frame)
    value = checksum(bytes(data[csum_start:]))
    data[csum_start + csum_offset : csum_start + csum_offset + 2] = value.to_bytes(2, "big")
    return bytes(data)


def ipv4_error_header(pkt, reply, from_pod: bool) -> tuple[int, int]:
    """ICMP port unreachable from the frontend, TTL 64, valid checksums; a pod's packet gets zero
    (EOL) IP options as padding. Returns (the original's L4 offset, the error's IP header length)."""
    ip = reply[IP]
    assert (ip.src, ip.dst, ip.proto, ip.ttl) == (pkt[IP].dst, pkt[IP].src, 1, 64)
    assert (ip[ICMP].type, ip[ICMP].code) == (3, 3)
    assert_checksums_valid(reply)
    orig_hlen = pkt[IP].ihl * 4
    pad = orig_hlen - 20 + 12 if from_pod else 0
    assert ip.ihl * 4 == 20 + pad and bytes(ip)[20 : 20 + pad] == bytes(pad), "zero (EOL) options only"
    assert bytes(ip[ICMP].payload) == bytes(pkt[IP])[: orig_hlen + 8], "original IP header + 8 bytes quoted"
    inner = ip[IPerror]
    assert (inner.src, inner.dst) == (pkt[IP].src, pkt[IP].dst)
    layer, l4 = (TCPerror, TCP) if TCP in pkt else (UDPerror, UDP)
    assert (inner[layer].sport, inner[layer].dport) == (pkt[l4].sport, pkt[l4].dport)
    return 14 + orig_hlen, 20 + pad


def ipv6_error_header(pkt, reply, from_pod: bool) -> tuple[int, int]:
    """ICMPv6 port unreachable from the frontend, hop limit 64, valid checksum; a pod's packet gets
    a destination-options header of skippable options as padding. Returns as ipv4_error_header."""
    ip6 = reply[IPv6]
    assert (ip6.src, ip6.dst, ip6.hlim, ip6.version) == (pkt[IPv6].dst, pkt[IPv6].src, 64, 6)
    icmp = reply[ICMPv6DestUnreach]
    assert (icmp.type, icmp.code) == (1, 4)
    w6.assert_l4_checksum_valid(reply)
    l4_off = len(pkt) - len(pkt[TCP] if TCP in pkt else pkt[UDP])
    quoted_len = l4_off - 14 + 8
    opts_len = l4_off - 14 - 40 + 24 if from_pod else 0
    if from_pod:  # the padded layout: a destination-options header the receiver skips
        assert ip6.nh == 60 and IPv6ExtHdrDestOpt in reply and reply[IPv6ExtHdrDestOpt].nh == 58
        assert len(reply[IPv6ExtHdrDestOpt]) - len(reply[IPv6ExtHdrDestOpt].payload) == opts_len
        assert all(o.otype in (0x1E, 1) for o in reply[IPv6ExtHdrDestOpt].options), "only skippable options"
    else:
        assert ip6.nh == 58
    assert ip6.plen == opts_len + 8 + quoted_len
    inner = reply[IPerror6]
    assert (inner.src, inner.dst) == (pkt[IPv6].src, pkt[IPv6].dst)
    return l4_off, 40 + opts_len


ERROR_HEADER = {IPV4: ipv4_error_header, IPV6: ipv6_error_header}


@pytest.mark.parametrize("fam,name", cases(CASES))
def test_reject_builds_port_unreachable(datapath, maps, fam, name):
    svc, built, from_pod = CASES[fam][name]
    pkt = Ether(bytes(built))  # fields (ihl, len) filled in
    fam.node(maps)
    fam.install(maps, svc)
    out = run(datapath, "tc_ingress", pkt)

    assert out.verdict == TC_ACT_REDIRECT  # bounced out of the device it came in on
    assert counted(maps) == {s.Reason.REJECT: 1}
    reply = out.pkt
    assert (reply.src, reply.dst) == (MAC_NODE, MAC_PEER)
    l4_off, hlen = ERROR_HEADER[fam](pkt, reply, from_pod)
    quoted_len = l4_off - 14 + 8
    assert len(out.raw) == 14 + hlen + 8 + quoted_len
    # (raw bytes: scapy reads an ICMPv6 quote past 128 bytes as RFC 4884 extensions)
    assert out.raw[14 + hlen + 8 :] == bytes(pkt[fam.ip])[:quoted_len], \
        "the original IP header, its options or extension headers, and 8 L4 bytes"
    assert not fam.connections(maps)

    if from_pod:
        # the pod's packet may have been CHECKSUM_PARTIAL: the kernel's pending completion at
        # the original L4 checksum position must leave the reply exactly as it is
        csum_offset = 16 if TCP in pkt else 6
        assert complete_partial_checksum(out.raw, l4_off, csum_offset) == out.raw


def test_no_endpoints_then_endpoints(datapath, maps):
    """Once an endpoint appears the same client connects (no state kept from the reject)."""
    w.install(maps, w.web(**EMPTY))
    assert run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80)).verdict == TC_ACT_REDIRECT
    w.install(maps, w.web())
    out = run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    assert out.verdict == 0 and out.pkt[IP].dst != w.VIP
