"""IPv6 in tc_ingress / tc_egress (issue 10): kube-proxy's decisions over the IPv6 maps, every
translated packet compared byte for byte with what scapy builds (checksums recomputed from
scratch), extension headers, and the counted verdicts of what the parser does not take (the
REJECT's ICMPv6 error: test_tc_reject.py, with IPv4's). Rule numbers refer to the shared
SEMANTICS.md."""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.inet6 import (
    ICMPv6ND_NS,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
    PadN,
)
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf import testrun
from ebpf_proxy.datapath.ebpf.maps import DETECT_NONE
from tests.bpf import world as w
from tests.bpf import world6 as w6
from tests.bpf.packets import MAC_NODE, MAC_PEER, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, counted, run, tcp
from tests.bpf.world6 import ALL6, LOCAL_EP6, NODE6, NODE_PORT, OUTSIDE6, POD6, VIP6, endpoints6, rewritten, step6, tcp6, udp6

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ETP, ITP, HAS = s.LB4_F_ETP_LOCAL, s.LB4_F_ITP_LOCAL, s.LB4_F_HAS_ENDPOINTS
LOCAL6 = (LOCAL_EP6,)
SCTP_P = socket.IPPROTO_SCTP


@pytest.fixture
def maps6(maps):
    w6.install_node6(maps)
    return maps


def conns6(maps) -> dict[int, object]:
    return {c.kind: c for c in maps.connections6()}


# ---- first packets: the policy, table-driven ----


@dataclass(frozen=True)
class Case:
    desc: str
    svc: w6.Svc6
    pkt: Packet
    reason: s.Reason
    backends: tuple[tuple[str, int], ...] = ()
    masq: bool = False


def etp_local(**kw) -> w6.Svc6:
    return w6.web6(flags=HAS | ETP, **kw)


RANGED = w6.web6(frontends=((w6.LB_IP6, 80, w6.EXT | s.LB4_F_SOURCE_RANGES),), ranges=("2001:db8:113::/48",))

CASES = [
    Case("clusterIP from a pod: any endpoint, client kept", w6.web6(), tcp6(POD6, 40000, VIP6, 80), R.FWD_NEW, ALL6),
    Case("clusterIP UDP from a pod", w6.web6(proto=w6.UDP_P), udp6(POD6, 5353, VIP6, 80), R.FWD_NEW, ALL6),
    Case("clusterIP from outside the pod CIDR: masquerade", w6.web6(), tcp6(OUTSIDE6, 40000, VIP6, 80), R.FWD_NEW, ALL6, masq=True),
    Case("clusterIP from a node address: masquerade", w6.web6(), tcp6(w6.NODE6_2, 40000, VIP6, 80), R.FWD_NEW, ALL6, masq=True),
    Case("hairpin: a pod landing on itself is masqueraded", w6.web6(cluster=LOCAL6), tcp6(LOCAL_EP6[0], 40000, VIP6, 80),
         R.FWD_NEW, LOCAL6, masq=True),
    Case("NodePort eTP=Cluster from outside: masquerade", w6.web6(), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT), R.FWD_NEW, ALL6, masq=True),
    Case("NodePort on the node's second address", w6.web6(), tcp6(OUTSIDE6, 40000, w6.NODE6_2, NODE_PORT), R.FWD_NEW, ALL6, masq=True),
    Case("nodePort on an address that is not the node's", w6.web6(), tcp6(OUTSIDE6, 40000, "fd00:50::99", NODE_PORT), R.PASS_NO_SERVICE),
    Case(":: is never a node address", w6.web6(), tcp6(OUTSIDE6, 40000, "::", NODE_PORT), R.PASS_NO_SERVICE),
    Case("eTP=Local from outside: the local endpoint, client kept", etp_local(), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT), R.FWD_NEW, LOCAL6),
    Case("eTP=Local from outside, no local endpoint: dropped", etp_local(local=()), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT),
         R.DROP_NO_LOCAL_EXTERNAL),
    Case("eTP=Local from a pod, no local endpoint: short-circuited", etp_local(local=()), tcp6(POD6, 40000, NODE6, NODE_PORT), R.FWD_NEW, ALL6),
    Case("eTP=Local from a node address: any endpoint, masquerade", etp_local(local=()), tcp6(w6.NODE6_2, 40000, NODE6, NODE_PORT),
         R.FWD_NEW, ALL6, masq=True),
    Case("iTP=Local, no local endpoint: dropped", w6.web6(flags=HAS | ITP, cluster=(), local=()), tcp6(POD6, 40000, VIP6, 80),
         R.DROP_NO_LOCAL_INTERNAL),
    Case("LB source range admits the client", RANGED, tcp6(OUTSIDE6, 40000, w6.LB_IP6, 80), R.FWD_NEW, ALL6, masq=True),
    Case("LB source range denies the client", RANGED, tcp6(w6.OUTSIDE6_2, 40000, w6.LB_IP6, 80), R.DROP_SOURCE_RANGE),
    Case("no endpoints: rejected", w6.web6(flags=0, cluster=(), local=()), tcp6(POD6, 40000, VIP6, 80), R.REJECT),
    Case("a port the service does not have", w6.web6(), tcp6(POD6, 40000, VIP6, 81), R.PASS_NO_SERVICE),
    Case("an IPv4 service is not an IPv6 one", w6.web6(frontends=()), tcp6(POD6, 40000, VIP6, 80), R.PASS_NO_SERVICE),
]


@pytest.mark.parametrize("case", CASES, ids=[c.desc for c in CASES])
def test_first_packet(datapath, maps6, case: Case):
    w6.install6(maps6, case.svc)
    out = run(datapath, "tc_ingress", case.pkt)

    expect_verdict = TC_ACT_REDIRECT if case.reason == R.REJECT else TC_ACT_SHOT if case.reason.is_drop else TC_ACT_OK
    assert out.verdict == expect_verdict
    assert counted(maps6) == {case.reason: 1}
    conns = conns6(maps6)
    if case.reason != R.FWD_NEW:
        assert not conns, "no connection may be recorded"
        if out.verdict == TC_ACT_OK:
            assert out.raw == bytes(case.pkt), "a packet that is not ours passes unchanged"
        return
    src, dst = endpoints6(out.pkt)
    assert dst in case.backends
    assert src == endpoints6(case.pkt)[0], "ingress never rewrites the source (masquerade happens on egress)"
    assert out.raw == rewritten(case.pkt, dst=dst), "exactly the DNAT, checksum as scapy computes it"
    svc = conns[s.CT4_SVC]
    assert (svc.nat_addr, svc.nat_port) == dst
    assert bool(svc.flags & s.CT4_F_MASQ) == case.masq
    assert (s.CT4_SNAT in conns) == case.masq and (s.CT4_REV_SNAT in conns) == case.masq
    assert s.CT4_REV_DNAT in conns
    if case.masq:
        assert svc.snat_addr == NODE6 and w.SNAT_MIN <= svc.snat_port <= w.SNAT_MAX


# ---- connections across packets and directions ----


def test_clusterip_from_a_pod_round_trip(datapath, maps6):
    """Rule 1: DNAT, client kept; the next packet takes the same backend; the reply gets the
    clusterIP back as its source on egress."""
    w6.install6(maps6, w6.web6())
    syn = tcp6(POD6, 40000, VIP6, 80)
    fwd = step6(datapath, maps6, "tc_ingress", syn, R.FWD_NEW)
    backend = endpoints6(fwd)[1]
    assert bytes(fwd) == rewritten(syn, dst=backend)
    step6(datapath, maps6, "tc_egress", fwd, R.PASS_NO_SERVICE, expect=bytes(fwd))  # not masqueraded: untouched

    answer = tcp6(*backend, POD6, 40000, flags="SA")
    step6(datapath, maps6, "tc_ingress", answer, R.PASS_NO_SERVICE, expect=bytes(answer))
    step6(datapath, maps6, "tc_egress", answer, R.REV_DNAT, expect=rewritten(answer, src=(VIP6, 80)))

    ack = tcp6(POD6, 40000, VIP6, 80, flags="A", payload=b"GET /")
    step6(datapath, maps6, "tc_ingress", ack, R.FWD_ESTABLISHED, expect=rewritten(ack, dst=backend))
    svc = conns6(maps6)[s.CT4_SVC]
    assert svc.flags & s.CT4_F_SEEN_REPLY and svc.state & s.CT4_S_ASSURED


def test_a_syn_ack_of_a_connection_another_node_translated_is_not_taken_by_a_closed_ones_half(datapath, maps6):
    """IPv4's test_tc_conntrack twin: once a pod's connection through the clusterIP has closed,
    the backend's SYN-ACK to a new connection of that port (translated by another node, so it
    addresses the backend itself) passes as it came, and the closed connection is forgotten."""
    w6.install6(maps6, w6.web6(cluster=(w6.REMOTE_EP6,), local=()))
    client, backend = (POD6, 40000), w6.REMOTE_EP6
    step6(datapath, maps6, "tc_ingress", tcp6(*client, VIP6, 80), R.FWD_NEW)
    step6(datapath, maps6, "tc_egress", tcp6(*backend, *client, flags="SA"), R.REV_DNAT)
    run(datapath, "tc_ingress", tcp6(*client, VIP6, 80, flags="FA"))
    run(datapath, "tc_egress", tcp6(*backend, *client, flags="FA"))
    run(datapath, "tc_ingress", tcp6(*client, VIP6, 80, flags="A"))
    assert conns6(maps6)[s.CT4_SVC].flags & s.CT4_F_CLOSING

    step6(datapath, maps6, "tc_ingress", tcp6(*client, *backend), R.PASS_NO_SERVICE)
    for flags, payload in (("SA", b""), ("PA", b'{"pod": "web"}\n')):
        reply = tcp6(*backend, *client, flags=flags, payload=payload)
        forgotten = (R.EV_CT_CLOSED_FORGOTTEN,) if flags == "SA" else ()  # once, by the SYN-ACK
        step6(datapath, maps6, "tc_egress", reply, R.PASS_NO_SERVICE, expect=bytes(reply), events=forgotten)
    assert not maps6.connections6(), "the closed connection, or a half of it, is left"


def test_a_syn_of_a_connection_another_node_translated_is_not_taken_by_a_closed_masqueraded_ones_half(datapath,
                                                                                                        maps6):
    """IPv4's test_tc_conntrack twin: the new connection's SYN toward the backend is not given
    the closed, masqueraded connection's port, and that connection is forgotten."""
    w6.install6(maps6, w6.web6(cluster=(w6.REMOTE_EP6,), local=()))
    client, backend = (OUTSIDE6, 40000), w6.REMOTE_EP6
    step6(datapath, maps6, "tc_ingress", tcp6(*client, NODE6, NODE_PORT), R.FWD_NEW)
    masq = endpoints6(step6(datapath, maps6, "tc_egress", tcp6(*client, *backend), R.SNAT))[0]
    step6(datapath, maps6, "tc_ingress", tcp6(*backend, *masq, flags="SA"), R.REV_SNAT)
    for prog, pkt in (("tc_ingress", tcp6(*client, NODE6, NODE_PORT, flags="FA")),
                      ("tc_egress", tcp6(*client, *backend, flags="FA")),
                      ("tc_ingress", tcp6(*backend, *masq, flags="FA")),
                      ("tc_ingress", tcp6(*client, NODE6, NODE_PORT, flags="A"))):
        run(datapath, prog, pkt)
    assert conns6(maps6)[s.CT4_SVC].flags & s.CT4_F_CLOSING

    syn = tcp6(*client, *backend)
    step6(datapath, maps6, "tc_egress", syn, R.PASS_NO_SERVICE, expect=bytes(syn), events=(R.EV_CT_CLOSED_FORGOTTEN,))
    assert not maps6.connections6(), "the closed connection, or a half of it, is left"


def test_syn_on_a_closing_connection_starts_a_new_one(datapath, maps6):
    """IPv4's test_tc_conntrack twin: a client port that comes back through the same frontend
    after its connection was reset is a new connection, and the closed one is counted forgotten."""
    w6.install6(maps6, w6.web6())
    syn = tcp6(POD6, 40000, VIP6, 80)
    step6(datapath, maps6, "tc_ingress", syn, R.FWD_NEW)
    run(datapath, "tc_ingress", tcp6(POD6, 40000, VIP6, 80, flags="R"))
    assert conns6(maps6)[s.CT4_SVC].flags & s.CT4_F_CLOSING
    step6(datapath, maps6, "tc_ingress", syn, R.FWD_NEW, events=(R.EV_CT_CLOSED_FORGOTTEN,))
    assert not conns6(maps6)[s.CT4_SVC].flags & s.CT4_F_CLOSING
    step6(datapath, maps6, "tc_ingress", syn, R.FWD_ESTABLISHED)  # retransmitted: the new one, open


@pytest.mark.parametrize("proto", [w6.TCP_P, w6.UDP_P])
def test_one_client_port_through_two_frontends_to_one_backend_keeps_both_connections(datapath, maps6, proto):
    """IPv4's test_tc_conntrack twin: the second connection of a pod's port that reaches the same
    backend through another clusterIP leaves with another port (CT4_S_REMAP, as netfilter's NAT
    remaps a clashing tuple), each gets its own replies, and its later packets keep the port."""
    make = tcp6 if proto == w6.TCP_P else udp6
    other = "fd00:96::11"
    w6.install6(maps6, w6.web6(id=1, cluster=(w6.REMOTE_EP6,), proto=proto),
                w6.web6(id=2, frontends=((other, 80, 0),), cluster=(w6.REMOTE_EP6,), proto=proto))
    first = step6(datapath, maps6, "tc_ingress", make(POD6, 40000, VIP6, 80), R.FWD_NEW)
    assert endpoints6(first) == ((POD6, 40000), w6.REMOTE_EP6)
    maps6.reset_stats()
    out = run(datapath, "tc_ingress", make(POD6, 40000, other, 80))
    assert out.verdict == TC_ACT_OK and counted(maps6) == {R.FWD_NEW: 1, R.EV_CT_PORT_REMAP: 1}
    second = out.pkt
    w6.assert_l4_checksum_valid(second)
    (client, port), backend = endpoints6(second)
    assert (client, backend) == (POD6, w6.REMOTE_EP6) and w.SNAT_MIN <= port <= w.SNAT_MAX

    for fwd, frontend in ((first, (VIP6, 80)), (second, (other, 80))):
        answer = w6.reply6(fwd)
        back = step6(datapath, maps6, "tc_egress", answer, R.REV_DNAT)
        assert endpoints6(back) == (frontend, (POD6, 40000))
    again = step6(datapath, maps6, "tc_ingress", make(POD6, 40000, other, 80, payload=b"more"), R.FWD_ESTABLISHED)
    assert endpoints6(again) == ((POD6, port), w6.REMOTE_EP6)
    svc = next(c for c in maps6.connections6() if c.kind == s.CT4_SVC and c.daddr == other)
    assert svc.state & s.CT4_S_REMAP and (svc.snat_addr, svc.snat_port) == (POD6, port)


def test_a_masqueraded_connection_of_a_clashing_port_leaves_with_its_masquerade_port(datapath, maps6):
    """IPv4's test_tc_conntrack twin: a pod's port reaches a backend through a clusterIP, then
    through a NodePort (masqueraded) to the same backend: the second leaves with its masquerade
    port from DNAT on (CT4_S_REMAP), and each connection's replies come back from its frontend."""
    w6.install6(maps6, w6.web6(id=1, cluster=(w6.REMOTE_EP6,)),
                w6.web6(id=2, frontends=((None, NODE_PORT + 1, w6.EXT),), cluster=(w6.REMOTE_EP6,)))
    first = step6(datapath, maps6, "tc_ingress", tcp6(POD6, 40000, VIP6, 80), R.FWD_NEW)
    maps6.reset_stats()
    out = run(datapath, "tc_ingress", tcp6(POD6, 40000, NODE6, NODE_PORT + 1))
    assert out.verdict == TC_ACT_OK and counted(maps6) == {R.FWD_NEW: 1, R.EV_CT_PORT_REMAP: 1}
    (client, port), backend = endpoints6(out.pkt)
    assert (client, backend) == (POD6, w6.REMOTE_EP6) and w.SNAT_MIN <= port <= w.SNAT_MAX
    second = step6(datapath, maps6, "tc_egress", out.pkt, R.SNAT)
    assert endpoints6(second) == ((NODE6, port), w6.REMOTE_EP6)

    back = step6(datapath, maps6, "tc_ingress", w6.reply6(second), R.REV_SNAT)
    assert endpoints6(back) == (w6.REMOTE_EP6, (POD6, port))
    back = step6(datapath, maps6, "tc_egress", back, R.REV_DNAT)
    assert endpoints6(back) == ((NODE6, NODE_PORT + 1), (POD6, 40000))
    back = step6(datapath, maps6, "tc_egress", w6.reply6(first), R.REV_DNAT)
    assert endpoints6(back) == ((VIP6, 80), (POD6, 40000))
    again = step6(datapath, maps6, "tc_ingress", tcp6(POD6, 40000, NODE6, NODE_PORT + 1, flags="A"), R.FWD_ESTABLISHED)
    again = step6(datapath, maps6, "tc_egress", again, R.SNAT)
    assert endpoints6(again) == ((NODE6, port), w6.REMOTE_EP6)


@pytest.mark.parametrize("proto", [w6.TCP_P, w6.UDP_P])
def test_nodeport_masquerade_round_trip(datapath, maps6, proto):
    """Rule 4: eTP=Cluster from outside: the backend sees [node]:port (SNAT on egress); its reply
    gets the client back on ingress (reverse SNAT) and leaves from [node]:nodePort (reverse DNAT)."""
    w6.install6(maps6, w6.web6(proto=proto))
    make = tcp6 if proto == w6.TCP_P else udp6
    first = make(OUTSIDE6, 40000, NODE6, NODE_PORT)
    fwd = step6(datapath, maps6, "tc_ingress", first, R.FWD_NEW)
    backend = endpoints6(fwd)[1]
    out = step6(datapath, maps6, "tc_egress", fwd, R.SNAT)
    (snat_addr, snat_port), dst = endpoints6(out)
    assert snat_addr == NODE6 and w.SNAT_MIN <= snat_port <= w.SNAT_MAX and dst == backend
    assert bytes(out) == rewritten(fwd, src=(NODE6, snat_port))

    answer = w6.reply6(out)
    back = step6(datapath, maps6, "tc_ingress", answer, R.REV_SNAT, expect=rewritten(answer, dst=(OUTSIDE6, 40000)))
    step6(datapath, maps6, "tc_egress", back, R.REV_DNAT, expect=rewritten(back, src=(NODE6, NODE_PORT)))

    again = make(OUTSIDE6, 40000, NODE6, NODE_PORT)
    fwd = step6(datapath, maps6, "tc_ingress", again, R.FWD_ESTABLISHED, expect=rewritten(again, dst=backend))
    step6(datapath, maps6, "tc_egress", fwd, R.SNAT, expect=rewritten(fwd, src=(NODE6, snat_port)))


def test_etp_local_keeps_the_client_both_ways(datapath, maps6):
    """Rule 5: the local endpoint, no masquerade; its reply goes straight back from [node]:nodePort."""
    w6.install6(maps6, w6.web6(flags=HAS | ETP))
    syn = tcp6(OUTSIDE6, 40000, w6.NODE6_2, NODE_PORT)
    fwd = step6(datapath, maps6, "tc_ingress", syn, R.FWD_NEW, expect=rewritten(syn, dst=LOCAL_EP6))
    step6(datapath, maps6, "tc_egress", fwd, R.PASS_NO_SERVICE, expect=bytes(fwd))
    answer = tcp6(*LOCAL_EP6, OUTSIDE6, 40000, flags="SA")
    step6(datapath, maps6, "tc_egress", answer, R.REV_DNAT, expect=rewritten(answer, src=(w6.NODE6_2, NODE_PORT)))


def test_hairpin_round_trip(datapath, maps6):
    """Rule 3: a pod reaching itself through the service sees the node as its peer."""
    w6.install6(maps6, w6.web6(cluster=LOCAL6))
    me = LOCAL_EP6[0]
    fwd = step6(datapath, maps6, "tc_ingress", tcp6(me, 40000, VIP6, 80), R.FWD_NEW)
    out = step6(datapath, maps6, "tc_egress", fwd, R.SNAT)
    (snat_addr, snat_port), _ = endpoints6(out)
    assert snat_addr == NODE6
    answer = tcp6(me, 8080, NODE6, snat_port, flags="SA")
    back = step6(datapath, maps6, "tc_ingress", answer, R.REV_SNAT, expect=rewritten(answer, dst=(me, 40000)))
    step6(datapath, maps6, "tc_egress", back, R.REV_DNAT, expect=rewritten(back, src=(VIP6, 80)))


def test_session_affinity_keeps_the_client_on_its_backend(datapath, maps6):
    """Rule 13: the same client's new connections go where its first one went."""
    svc = w6.web6(affinity=10800)
    w6.install6(maps6, svc)
    first = endpoints6(step6(datapath, maps6, "tc_ingress", tcp6(POD6, 40000, VIP6, 80), R.FWD_NEW))[1]
    assert maps6.affinity6(svc.id, POD6)[0] == svc.backend_id(first)
    for port in range(40001, 40021):
        assert endpoints6(step6(datapath, maps6, "tc_ingress", tcp6(POD6, port, VIP6, 80), R.FWD_NEW))[1] == first


def test_masquerade_without_an_ipv6_address_is_dropped(datapath, maps6):
    w6.install_node6(maps6, snat_addr=None)
    w6.install6(maps6, w6.web6())
    out = run(datapath, "tc_ingress", tcp6(OUTSIDE6, 40000, VIP6, 80))
    assert out.verdict == TC_ACT_SHOT and counted(maps6) == {R.DROP_SNAT_NO_ADDR: 1}
    assert not maps6.connections6()


def test_no_detector_masquerades_no_clusterip_traffic(datapath, maps6):
    """As IPv4: without a local-traffic detector kube-proxy has no rule telling pods apart. IPv6's
    detector is IPv6's own (CFG6_F_DETECT_NONE: the CIDR detector without an IPv6 CIDR)."""
    w6.install_node6(maps6, detect_none=True)
    w6.install6(maps6, w6.web6())
    step6(datapath, maps6, "tc_ingress", tcp6(OUTSIDE6, 40000, VIP6, 80), R.FWD_NEW)
    assert not conns6(maps6)[s.CT4_SVC].flags & s.CT4_F_MASQ


@pytest.mark.parametrize("v4_noop, v6_noop", [(True, False), (False, True)])
def test_each_family_has_its_own_local_traffic_detector(datapath, maps6, v4_noop, v6_noop):
    """A dual-stack node whose --cluster-cidr names one family only: kube-proxy gives the other
    family the no-op detector (cmd/kube-proxy/app/server_linux.go getLocalDetectors: a family
    without a cluster CIDR gets proxyutil.NewNoOpLocalDetector), so that family's off-cluster
    ClusterIP traffic is not masqueraded while the other family's is."""
    if v4_noop:
        maps6.set_settings(replace(w.SETTINGS, local_detect=DETECT_NONE))
    w6.install_node6(maps6, detect_none=v6_noop)
    w.install(maps6, w.web())
    w6.install6(maps6, w6.web6())
    step6(datapath, maps6, "tc_ingress", tcp6(OUTSIDE6, 40000, VIP6, 80), R.FWD_NEW)
    assert bool(conns6(maps6)[s.CT4_SVC].flags & s.CT4_F_MASQ) == (not v6_noop)
    run(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.VIP, 80))
    v4 = next(c for c in maps6.connections() if c.kind == s.CT4_SVC)
    assert bool(v4.flags & s.CT4_F_MASQ) == (not v4_noop)


def test_ipv4_and_ipv6_services_keep_their_own_ids(datapath, maps6):
    """The same service id in both families: each family reads its own maps."""
    w.install(maps6, w.web(cluster=(w.REMOTE_EP,), local=()))
    w6.install6(maps6, w6.web6(cluster=(w6.REMOTE_EP6,), local=()))
    v6 = step6(datapath, maps6, "tc_ingress", tcp6(POD6, 40000, VIP6, 80), R.FWD_NEW)
    assert endpoints6(v6)[1] == w6.REMOTE_EP6
    maps6.reset_stats()
    v4 = run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    assert counted(maps6) == {R.FWD_NEW: 1}
    assert (v4.pkt[IP].dst, v4.pkt[TCP].dport) == w.REMOTE_EP
    assert len(maps6.connections()) == 2 and len(maps6.connections6()) == 2


# ---- extension headers and what the parser does not take ----


def test_hop_by_hop_and_destination_options_are_walked(datapath, maps6):
    """Options before TCP do not hide a service packet: translated, and the reply too."""
    w6.install6(maps6, w6.web6())
    ext = (IPv6ExtHdrHopByHop(), IPv6ExtHdrDestOpt())
    syn = tcp6(POD6, 40000, VIP6, 80, ext=ext, payload=b"hello")
    fwd = step6(datapath, maps6, "tc_ingress", syn, R.FWD_NEW)
    backend = endpoints6(fwd)[1]
    assert bytes(fwd) == rewritten(syn, dst=backend)
    assert IPv6ExtHdrHopByHop in fwd and IPv6ExtHdrDestOpt in fwd and bytes(fwd[TCP].payload) == b"hello"
    answer = tcp6(*backend, POD6, 40000, flags="SA", ext=(IPv6ExtHdrDestOpt(),))
    step6(datapath, maps6, "tc_egress", answer, R.REV_DNAT, expect=rewritten(answer, src=(VIP6, 80)))


def _truncated(pkt: Packet, keep: int) -> bytes:
    return bytes(pkt)[:keep]


def _long_chain(n: int) -> Packet:
    return tcp6(POD6, 40000, VIP6, 80, ext=tuple(IPv6ExtHdrDestOpt() for _ in range(n)))


def _payload_len(pkt: Packet, plen: int) -> bytes:
    raw = bytearray(bytes(pkt))
    raw[14 + 4:14 + 6] = plen.to_bytes(2, "big")
    return bytes(raw)


UNTAKEN = {  # name: (frame, reason)
    "fragment header": (tcp6(POD6, 40000, VIP6, 80, ext=(IPv6ExtHdrFragment(m=1, id=7),)), R.PASS_IPV6_FRAG),
    "fragment header after hop-by-hop": (tcp6(POD6, 40000, VIP6, 80, ext=(IPv6ExtHdrHopByHop(), IPv6ExtHdrFragment(id=7))),
                                          R.PASS_IPV6_FRAG),
    "4 extension headers: still walked": (_long_chain(4), R.FWD_NEW),
    "5 extension headers: too long a chain": (_long_chain(5), R.DROP_IPV6_EXTHDRS),
    "routing header chain too long": (tcp6(POD6, 40000, VIP6, 80, ext=(IPv6ExtHdrHopByHop(), *(IPv6ExtHdrDestOpt() for _ in range(3)),
                                                                          IPv6ExtHdrRouting(addresses=[]))), R.DROP_IPV6_EXTHDRS),
    "extension headers longer than the parser reads": (
        tcp6(POD6, 40000, VIP6, 80, ext=(IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 250)]),
                                        IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 50)]))),
        R.DROP_IPV6_EXTHDRS),
    "extension header cut short by the frame": (_truncated(tcp6(POD6, 40000, VIP6, 80, ext=(IPv6ExtHdrHopByHop(),)), 14 + 40 + 1),
                                                R.DROP_MALFORMED_IPV6),
    "extension header longer than the payload": (_payload_len(tcp6(POD6, 40000, VIP6, 80, ext=(IPv6ExtHdrDestOpt(),)), 4),
                                                 R.DROP_MALFORMED_IPV6),
    "payload length beyond the frame": (_payload_len(tcp6(POD6, 40000, VIP6, 80), 200), R.DROP_MALFORMED_IPV6),
    "not version 6": (bytes([*bytes(tcp6(POD6, 40000, VIP6, 80))[:14], 0x40, *bytes(tcp6(POD6, 40000, VIP6, 80))[15:]]),
                      R.DROP_MALFORMED_IPV6),
    "TCP header cut short": (_payload_len(_truncated(tcp6(POD6, 40000, VIP6, 80), 14 + 40 + 10), 10), R.DROP_MALFORMED_L4),
    "neighbour solicitation": (Ether(bytes(Ether(src=MAC_PEER, dst=MAC_NODE) / IPv6(src=POD6, dst="ff02::1:ff00:10") /
                                           ICMPv6ND_NS(tgt=NODE6))), R.PASS_IPV6_NOT_L4),
    "no next header after options": (Ether(bytes(Ether(src=MAC_PEER, dst=MAC_NODE) / IPv6(src=POD6, dst=VIP6) /
                                                 IPv6ExtHdrDestOpt(nh=59))), R.PASS_IPV6_NOT_L4),
}


@pytest.mark.parametrize("prog", ["tc_ingress", "tc_egress"])
@pytest.mark.parametrize("name", UNTAKEN)
def test_what_the_parser_does_not_take_is_counted(datapath, maps6, prog, name):
    frame, reason = UNTAKEN[name]
    w6.install6(maps6, w6.web6())
    if prog == "tc_egress" and reason == R.FWD_NEW:
        reason = R.PASS_NO_SERVICE  # egress looks it up as a connection: none
    out = run(datapath, prog, frame)
    assert counted(maps6) == {reason: 1}
    assert out.verdict == (TC_ACT_SHOT if reason.is_drop else TC_ACT_OK)
    if reason != R.FWD_NEW:
        assert not maps6.connections6()
        if not reason.is_drop:
            assert out.raw == bytes(frame), "passed untouched"


def test_sctp_over_ipv6_is_served(datapath, maps6):
    """SCTP over IPv6 takes TCP's steps (the cases by family: test_tc_sctp.py): an INIT to an IPv6
    SCTP Service's clusterIP is DNATed, its CRC32c updated for the new port, byte for byte what
    scapy builds with the backend's address and port."""
    w6.install6(maps6, w6.web6(proto=SCTP_P))
    pkt = w6.sctp6(POD6, 40000, VIP6, 80)
    maps6.reset_stats()
    out = run(datapath, "tc_ingress", pkt)
    assert (out.verdict, counted(maps6)) == (TC_ACT_OK, {R.FWD_NEW: 1})
    backend = endpoints6(out.pkt)[1]
    assert backend in ALL6
    assert out.raw == rewritten(pkt, dst=backend)
    assert [c.proto for c in maps6.connections6() if c.kind == s.CT4_SVC] == [SCTP_P]


def test_a_trace_run_of_an_ipv6_packet_decides_and_writes_nothing(datapath, maps6):
    """(every case of this file as a dry run: test_trace6_dry_run.py)"""
    w6.install6(maps6, w6.web6(affinity=10800))
    ctx = testrun.SkBuffCtx(mark=s.TRACE_MARK)
    ctx.cb[0], ctx.cb[1] = s.TRACE_MAGIC, 0x3000001
    pkt = tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT)
    out = testrun.run(datapath.prog_fds["tc_ingress"], bytes(pkt), ctx=ctx)
    rec = maps6.trace_record(0x3000001)
    assert rec is not None and rec.reason == R.FWD_NEW and rec.flags & s.TRACE_F_IPV6
    assert out.retval == TC_ACT_OK and endpoints6(Ether(out.packet))[1] in ALL6, "DNATed, as a live run would"
    assert counted(maps6) == {} and not maps6.connections6() and maps6.affinity6(1, OUTSIDE6) is None


# ---- a full connection table: no early drop for IPv6, the new connection is refused ----

CT6_CAPACITY = 8  # entries: 4 connections that are not masqueraded (2 entries each)


@pytest.fixture(scope="module")
def small_ct6(tmp_bpffs_factory):
    from ebpf_proxy.datapath.ebpf import loader  # noqa: PLC0415
    from tests.bpf.conftest import SMALL_MAPS  # noqa: PLC0415

    loaded = loader.load(tmp_bpffs_factory("ct6-full"), max_entries={**SMALL_MAPS, "epx_ct6": CT6_CAPACITY})
    yield loaded
    loaded.close()


def test_a_full_table_refuses_new_connections_and_keeps_the_old(small_ct6):
    from ebpf_proxy.datapath.ebpf.maps import Maps  # noqa: PLC0415

    maps = Maps.from_loaded(small_ct6)
    maps.reset()
    w.install_node(maps)
    w6.install_node6(maps)
    w6.install6(maps, w6.web6(cluster=(w6.REMOTE_EP6,), local=()))
    for port in range(40000, 40004):
        step6(small_ct6, maps, "tc_ingress", tcp6(POD6, port, VIP6, 80), R.FWD_NEW)
    maps.reset_stats()
    assert run(small_ct6, "tc_ingress", tcp6(POD6, 40004, VIP6, 80)).verdict == TC_ACT_SHOT
    assert counted(maps) == {R.DROP_CT_FULL: 1}
    assert len(maps.connections6()) == CT6_CAPACITY, "the refused connection left nothing behind"
    maps.reset_stats()
    assert run(small_ct6, "tc_ingress", tcp6(OUTSIDE6, 40000, VIP6, 80)).verdict == TC_ACT_SHOT  # masqueraded: same
    assert counted(maps) == {R.DROP_CT_FULL: 1}
    assert len(maps.connections6()) == CT6_CAPACITY
    ack = tcp6(POD6, 40000, VIP6, 80, flags="A")
    step6(small_ct6, maps, "tc_ingress", ack, R.FWD_ESTABLISHED, expect=rewritten(ack, dst=w6.REMOTE_EP6))
