"""xdp_lb: early drops of new connections that kube-proxy drops regardless of state; all else passes.

The decision must be the TC program's own: the same cases agree with tc_ingress.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import TC_ACT_SHOT, XDP_DROP, XDP_PASS, counted, run, tcp, udp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
HAS, ETP, ITP = s.LB4_F_HAS_ENDPOINTS, s.LB4_F_ETP_LOCAL, s.LB4_F_ITP_LOCAL
RANGED = w.web(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES),), ranges=("203.0.113.0/24",))

DROPS = {
    "source range denies": (RANGED, tcp(w.OUTSIDE2, 40000, w.LB_IP, 80), R.DROP_SOURCE_RANGE),
    "eTP=Local from outside, no local endpoint": (w.web(flags=HAS | ETP, local=()), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.DROP_NO_LOCAL_EXTERNAL),
    "iTP=Local, no local endpoint": (w.web(flags=HAS | ITP, cluster=(), local=(), proto=w.UDP), udp(w.POD_CLIENT, 5000, w.VIP, 80), R.DROP_NO_LOCAL_INTERNAL),
}

PASSES = {
    "source range admits": (RANGED, tcp(w.OUTSIDE, 40000, w.LB_IP, 80)),
    "eTP=Local with a local endpoint": (w.web(flags=HAS | ETP), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT)),
    "eTP=Local from a pod": (w.web(flags=HAS | ETP, local=()), tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT)),
    "no endpoints: the TC program rejects": (w.web(flags=0, cluster=(), local=()), tcp(w.OUTSIDE, 40000, w.VIP, 80)),
    "not a service": (w.web(), tcp(w.OUTSIDE, 40000, "192.0.2.99", 80)),
    # 0.0.0.0 is the NodePort key in epx_svc, not a node address (regression: it was dropped as
    # an eTP=Local NodePort packet; found by test_fuzz_packets.py)
    "0.0.0.0 is not a node address": (w.web(flags=HAS | ETP, local=()), tcp(w.OUTSIDE, 40000, "0.0.0.0", w.NODE_PORT)),
}


@pytest.mark.parametrize("name", DROPS)
def test_xdp_drops_like_tc(datapath, maps, name):
    svc, pkt, reason = DROPS[name]
    w.install(maps, svc)
    assert run(datapath, "xdp_lb", pkt).verdict == XDP_DROP
    assert counted(maps) == {reason: 1}
    maps.reset_stats()
    assert run(datapath, "tc_ingress", pkt).verdict == TC_ACT_SHOT
    assert counted(maps) == {reason: 1}


@pytest.mark.parametrize("name", PASSES)
def test_xdp_passes_untouched_and_uncounted(datapath, maps, name):
    svc, pkt = PASSES[name]
    w.install(maps, svc)
    out = run(datapath, "xdp_lb", pkt)
    assert out.verdict == XDP_PASS and out.raw == bytes(pkt)
    assert counted(maps) == {}
    assert not maps.connections()


def test_established_connection_passes_after_its_local_endpoint_left(datapath, maps):
    """kube-proxy drops only NEW connections for eTP=Local without local endpoints."""
    svc = w.web(flags=HAS | ETP)
    w.install(maps, svc)
    run(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT))
    maps.set_slots(svc.id, s.LB4_SCOPE_LOCAL, [], previous=1)
    w.install(maps, w.web(flags=HAS | ETP, local=()))
    assert run(datapath, "xdp_lb", tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT, flags="A")).verdict == XDP_PASS
    assert run(datapath, "xdp_lb", tcp(w.OUTSIDE, 40001, w.NODE_IP, w.NODE_PORT)).verdict == XDP_DROP
