"""xdp_lb: early drops of new connections that kube-proxy drops regardless of state (eTP=Local /
iTP=Local without a local endpoint, loadBalancerSourceRanges) and, for IPv6, of malformed IPv6;
all else passes untouched and uncounted (the TC program counts it).

The decision must be the TC program's own: the same cases agree with tc_ingress. Each family has
its table; the tests run both (ids `ipv4-...`, `ipv6-...`, family.py).
"""

from __future__ import annotations

import pytest
from scapy.layers.inet6 import IPv6ExtHdrDestOpt, IPv6ExtHdrFragment

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf import testrun
from tests.bpf import world as w
from tests.bpf import world6 as w6
from tests.bpf.family import IPV4, IPV6, NODE_PORT, Family, cases
from tests.bpf.packets import TC_ACT_SHOT, XDP_DROP, XDP_PASS, counted, run, tcp, udp
from tests.bpf.world6 import NODE6, OUTSIDE6, POD6, VIP6, tcp6, udp6

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
HAS, ETP, ITP = s.LB4_F_HAS_ENDPOINTS, s.LB4_F_ETP_LOCAL, s.LB4_F_ITP_LOCAL
RANGED = w.web(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES),), ranges=("203.0.113.0/24",))
RANGED6 = w6.web6(frontends=((w6.LB_IP6, 80, w6.EXT | s.LB4_F_SOURCE_RANGES),), ranges=("2001:db8:113::/48",))

DROPS = {  # family: {name: (service, packet, reason)}
    IPV4: {
        "source range denies": (RANGED, tcp(w.OUTSIDE2, 40000, w.LB_IP, 80), R.DROP_SOURCE_RANGE),
        "eTP=Local from outside, no local endpoint": (w.web(flags=HAS | ETP, local=()), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.DROP_NO_LOCAL_EXTERNAL),
        "iTP=Local, no local endpoint": (w.web(flags=HAS | ITP, cluster=(), local=(), proto=w.UDP), udp(w.POD_CLIENT, 5000, w.VIP, 80), R.DROP_NO_LOCAL_INTERNAL),
    },
    IPV6: {
        "eTP=Local from outside, no local endpoint": (w6.web6(flags=HAS | ETP, local=()), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT),
                                                      R.DROP_NO_LOCAL_EXTERNAL),
        "eTP=Local behind a destination-options header": (w6.web6(flags=HAS | ETP, local=()),
                                                          tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT, ext=(IPv6ExtHdrDestOpt(),)),
                                                          R.DROP_NO_LOCAL_EXTERNAL),
        "iTP=Local, no local endpoint": (w6.web6(flags=HAS | ITP, cluster=(), local=(), proto=w6.UDP_P), udp6(POD6, 5000, VIP6, 80),
                                         R.DROP_NO_LOCAL_INTERNAL),
        "source range denies": (RANGED6, tcp6(w6.OUTSIDE6_2, 40000, w6.LB_IP6, 80), R.DROP_SOURCE_RANGE),
        "5 extension headers": (w6.web6(), tcp6(OUTSIDE6, 40000, VIP6, 80, ext=tuple(IPv6ExtHdrDestOpt() for _ in range(5))),
                                R.DROP_IPV6_EXTHDRS),
        "payload length beyond the frame": (w6.web6(), bytes(tcp6(OUTSIDE6, 40000, VIP6, 80))[:-4], R.DROP_MALFORMED_IPV6),
    },
}

PASSES = {  # family: {name: (service, packet)}
    IPV4: {
        "source range admits": (RANGED, tcp(w.OUTSIDE, 40000, w.LB_IP, 80)),
        "eTP=Local with a local endpoint": (w.web(flags=HAS | ETP), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT)),
        "eTP=Local from a pod": (w.web(flags=HAS | ETP, local=()), tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT)),
        "no endpoints: the TC program rejects": (w.web(flags=0, cluster=(), local=()), tcp(w.OUTSIDE, 40000, w.VIP, 80)),
        "not a service": (w.web(), tcp(w.OUTSIDE, 40000, "192.0.2.99", 80)),
        # 0.0.0.0 is the NodePort key in epx_svc, not a node address (regression: it was dropped as
        # an eTP=Local NodePort packet; found by test_fuzz_packets.py)
        "0.0.0.0 is not a node address": (w.web(flags=HAS | ETP, local=()), tcp(w.OUTSIDE, 40000, "0.0.0.0", w.NODE_PORT)),
    },
    IPV6: {
        "eTP=Local with a local endpoint": (w6.web6(flags=HAS | ETP), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT)),
        "eTP=Local from a pod": (w6.web6(flags=HAS | ETP, local=()), tcp6(POD6, 40000, NODE6, NODE_PORT)),
        "source range admits": (RANGED6, tcp6(OUTSIDE6, 40000, w6.LB_IP6, 80)),
        "no endpoints: the TC program rejects": (w6.web6(flags=0, cluster=(), local=()), tcp6(OUTSIDE6, 40000, VIP6, 80)),
        "not a service": (w6.web6(), tcp6(OUTSIDE6, 40000, "2001:db8::99", 80)),
        ":: is not a node address": (w6.web6(flags=HAS | ETP, local=()), tcp6(OUTSIDE6, 40000, "::", NODE_PORT)),
        "fragment: the TC program counts it": (w6.web6(flags=HAS | ETP, local=()),
                                               tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT, ext=(IPv6ExtHdrFragment(m=1),))),
    },
}


def case(fam: Family, name: str) -> tuple:
    """(service, packet, *reason) of a DROPS or PASSES case (also test_trace.py's xdp table)."""
    return DROPS[fam].get(name) or PASSES[fam][name]


@pytest.fixture
def maps6(maps):
    w6.install_node6(maps)
    return maps


@pytest.mark.parametrize("fam,name", cases(DROPS))
def test_xdp_drops_like_tc(datapath, maps, fam, name):
    svc, pkt, reason = DROPS[fam][name]
    fam.node(maps)
    fam.install(maps, svc)
    assert run(datapath, "xdp_lb", pkt).verdict == XDP_DROP
    assert counted(maps) == {reason: 1}
    maps.reset_stats()
    assert run(datapath, "tc_ingress", pkt).verdict == TC_ACT_SHOT
    assert counted(maps) == {reason: 1}


@pytest.mark.parametrize("fam,name", cases(PASSES))
def test_xdp_passes_untouched_and_uncounted(datapath, maps, fam, name):
    svc, pkt = PASSES[fam][name]
    fam.node(maps)
    fam.install(maps, svc)
    out = run(datapath, "xdp_lb", pkt)
    assert out.verdict == XDP_PASS and out.raw == bytes(pkt)
    assert counted(maps) == {}
    assert not fam.connections(maps)


@pytest.mark.parametrize("fam", [IPV4, IPV6], ids=str)
def test_established_connection_passes_after_its_local_endpoint_left(datapath, maps, fam):
    """kube-proxy drops only NEW connections for eTP=Local without local endpoints."""
    fam.node(maps)
    svc = fam.web(flags=HAS | ETP)
    fam.install(maps, svc)
    run(datapath, "tc_ingress", fam.tcp(fam.outside, 40000, fam.node_addr, NODE_PORT))
    fam.set_slots(maps, svc.id, s.LB4_SCOPE_LOCAL, [], previous=1)
    fam.install(maps, fam.web(flags=HAS | ETP, local=()))
    assert run(datapath, "xdp_lb", fam.tcp(fam.outside, 40000, fam.node_addr, NODE_PORT, flags="A")).verdict == XDP_PASS
    assert run(datapath, "xdp_lb", fam.tcp(fam.outside, 40001, fam.node_addr, NODE_PORT)).verdict == XDP_DROP


def test_an_xdp_trace_run_of_an_ipv6_packet_decides_and_writes_nothing(datapath, maps6):
    """(every case of this file as a dry run: test_trace.py)"""
    w6.install6(maps6, w6.web6(flags=HAS | ETP, local=()))
    meta = bytes(s.EpxTraceMeta(magic=s.TRACE_MAGIC, nonce=0x3000002))
    frame = bytes(tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT))
    ctx = testrun.XdpMd(data=len(meta), data_end=len(meta) + len(frame))
    out = testrun.run(datapath.prog_fds["xdp_lb"], meta + frame, ctx=ctx)
    assert out.retval == XDP_DROP
    rec = maps6.trace_record(0x3000002)
    assert rec is not None and rec.reason == R.DROP_NO_LOCAL_EXTERNAL
    assert counted(maps6) == {}


def test_an_xdp_trace_run_of_arp_still_passes_it_on(datapath, maps6):
    """A frame of neither family is passed on to TC, as before."""
    from scapy.layers.l2 import ARP, Ether  # noqa: PLC0415

    meta = bytes(s.EpxTraceMeta(magic=s.TRACE_MAGIC, nonce=0x3000003))
    frame = bytes(Ether(dst="ff:ff:ff:ff:ff:ff") / ARP(pdst="10.96.0.10"))
    ctx = testrun.XdpMd(data=len(meta), data_end=len(meta) + len(frame))
    out = testrun.run(datapath.prog_fds["xdp_lb"], meta + frame, ctx=ctx)
    assert out.retval == XDP_PASS
    rec = maps6.trace_record(0x3000003)
    assert rec is not None and rec.reason == R.CONTINUE
