"""IPv4 fragments: the first fragment decides, later ones follow it (see bpf/lib/pkt4.h).

iptables mode gets whole datagrams (conntrack defragments); here each fragment is translated on
its own, with the first fragment's ports remembered, and the result must reassemble into a valid
datagram at the backend and back at the client.
"""

from __future__ import annotations

import pytest
from scapy.layers.inet import IP, UDP, defragment, fragment
from scapy.layers.l2 import Ether

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import TC_ACT_OK, assert_checksums_valid, counted, endpoints, run, udp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason


def fragments_of(pkt, size=256):
    eth = pkt[Ether]
    return [Ether(src=eth.src, dst=eth.dst) / f for f in fragment(pkt[IP], fragsize=size)]


def reassemble(frames):
    whole = defragment([f[IP] for f in frames])
    assert len(whole) == 1
    return IP(bytes(whole[0]))


def test_fragmented_datagram_is_translated_both_ways(datapath, maps):
    w.install(maps, w.web(proto=w.UDP))
    big = udp(w.OUTSIDE, 5353, w.NODE_IP, w.NODE_PORT, payload=bytes(range(256)) * 4)
    frags = fragments_of(big)
    assert len(frags) >= 4

    # ingress: DNAT (first fragment decides the backend, the rest follow)
    outs = [run(datapath, "tc_ingress", f) for f in frags]
    assert all(o.verdict == TC_ACT_OK for o in outs)
    assert counted(maps) == {R.FWD_NEW: 1, R.FWD_ESTABLISHED: len(frags) - 1}
    backend = endpoints(outs[0].pkt)[1]
    assert {o.pkt[IP].dst for o in outs} == {backend[0]}
    for o in outs:
        assert_checksums_valid(o.pkt)

    # egress: masquerade
    maps.reset_stats()
    outs = [run(datapath, "tc_egress", o.pkt) for o in outs]
    assert counted(maps) == {R.SNAT: len(frags)}
    at_backend = reassemble([o.pkt for o in outs])
    assert_checksums_valid(Ether() / at_backend)
    assert (at_backend.src, at_backend[UDP].dport) == (w.NODE_IP, backend[1])
    assert bytes(at_backend[UDP].payload) == bytes(range(256)) * 4
    snat_port = at_backend[UDP].sport

    # the backend's fragmented answer: reverse masquerade on ingress, reverse DNAT on egress
    answer = udp(backend[0], backend[1], w.NODE_IP, snat_port, payload=b"A" * 900)
    maps.reset_stats()
    outs = [run(datapath, "tc_ingress", f) for f in fragments_of(answer)]
    outs = [run(datapath, "tc_egress", o.pkt) for o in outs]
    n = len(outs)
    assert counted(maps) == {R.REV_SNAT: n, R.REV_DNAT: n}
    at_client = reassemble([o.pkt for o in outs])
    assert_checksums_valid(Ether() / at_client)
    assert (at_client.src, at_client[UDP].sport) == (w.NODE_IP, w.NODE_PORT)
    assert (at_client.dst, at_client[UDP].dport) == (w.OUTSIDE, 5353)


def test_later_fragment_without_its_first_passes_untouched(datapath, maps):
    w.install(maps, w.web(proto=w.UDP))
    frags = fragments_of(udp(w.OUTSIDE, 5353, w.VIP, 80, payload=b"z" * 1000))
    out = run(datapath, "tc_ingress", frags[1])
    assert out.verdict == TC_ACT_OK and out.raw == bytes(frags[1])
    assert counted(maps) == {R.PASS_FRAG_UNKNOWN: 1}
    assert not maps.connections()
