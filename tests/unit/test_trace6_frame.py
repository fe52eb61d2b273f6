"""The IPv6 side of `trace`'s own packet handling (ebpf_trace.py), without root: the frames it builds
for a trace run (scapy's parse and checksums as the judge), where it reads a translated frame's
destination, and how it reads the IPv6 addresses of a trace record."""

from __future__ import annotations

import socket

import pytest
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import be16, be32, in6
from ebpf_proxy.explain import ebpf_trace as et
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import Protocol

FLOWS = {
    Protocol.TCP: FlowSpec("fd10:244::7", "fd00:96::10", 80, Protocol.TCP, 40000, "pod"),
    Protocol.UDP: FlowSpec("2001:db8:113::9", "fd00:50::10", 30080, Protocol.UDP, 5353, "external"),
}


@pytest.mark.parametrize("proto", FLOWS)
def test_ipv6_frame_is_the_flow_with_valid_checksums(proto):
    flow = FLOWS[proto]
    pkt = Ether(et.build_frame(flow))
    layer = TCP if proto == Protocol.TCP else UDP
    assert (pkt[IPv6].src, pkt[IPv6].dst, pkt[IPv6].nh, pkt[IPv6].plen) == \
        (flow.src, flow.dst, socket.IPPROTO_TCP if proto == Protocol.TCP else socket.IPPROTO_UDP, len(pkt[layer]))
    assert (pkt[layer].sport, pkt[layer].dport) == (flow.sport, flow.dport)
    if proto == Protocol.TCP:
        assert pkt[TCP].flags == "S"
    fresh = Ether(bytes(pkt))
    fresh[layer].chksum = None
    assert Ether(bytes(fresh))[layer].chksum == pkt[layer].chksum, "checksum over the IPv6 pseudo-header"


def test_frame_destination_of_both_families():
    six = FLOWS[Protocol.TCP]
    four = FlowSpec("10.244.0.7", "10.96.0.10", 53, Protocol.UDP, 40000, "pod")
    assert et._frame_dst(et.build_frame(six)) == (six.dst, six.dport)
    assert et._frame_dst(et.build_frame(four)) == (four.dst, four.dport)
    assert et._frame_dst(et.build_frame(six)[:50]) is None, "cut short: no answer rather than a wrong one"


def test_record_addresses_follow_the_family_flag():
    rec = s.EpxTraceRec(backend_port=be16(8080), snat_port=be16(61000))
    rec.backend_addr6[:] = in6("fd10:244:1::31").w[:]
    rec.snat_addr6[:] = in6("2001:db8:113::1").w[:]
    rec.flags = s.TRACE_F_IPV6 | s.TRACE_F_BACKEND
    assert et._rec_backend(rec) == "[fd10:244:1::31]:8080"
    assert et._rec_addr(rec, "snat") == "2001:db8:113::1"
    rec.flags = s.TRACE_F_BACKEND  # an IPv4 decision reads the 32-bit fields
    rec.backend_addr = be32("10.244.1.31")
    assert et._rec_backend(rec) == "10.244.1.31:8080"
