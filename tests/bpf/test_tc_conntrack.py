"""Connections across packets and directions: established DNAT, masquerade and both reverse
translations (rules 1-5, "What the reverse path must do"), lifetimes, affinity (rule 13),
scaling (rule 10) and the masquerade port allocator."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import be16, be32
from tests.bpf import world as w
from tests.bpf.packets import (
    TC_ACT_SHOT,
    assert_checksums_valid,
    counted,
    endpoints,
    reply_to,
    run,
    step,
    tcp,
    udp,
)

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason


def test_pod_to_clusterip_round_trip(datapath, maps):
    """Rule 1: no masquerade; the reply reaches the pod from clusterIP:port."""
    w.install(maps, w.web())
    syn = tcp(w.POD_CLIENT, 40000, w.VIP, 80)
    fwd = step(datapath, maps, "tc_ingress", syn, R.FWD_NEW)
    backend = endpoints(fwd)[1]
    fwd = step(datapath, maps, "tc_egress", fwd, R.PASS_NO_SERVICE)  # not masqueraded: untouched
    assert endpoints(fwd) == ((w.POD_CLIENT, 40000), backend)

    back = step(datapath, maps, "tc_ingress", reply_to(fwd), R.PASS_NO_SERVICE)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))

    ack = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="A", payload=b"GET /"), R.FWD_ESTABLISHED)
    assert endpoints(ack)[1] == backend
    svc = next(c for c in maps.connections() if c.kind == s.CT4_SVC)
    assert svc.flags & s.CT4_F_SEEN_REPLY


@pytest.mark.parametrize("proto", [w.TCP, w.UDP])
def test_nodeport_masquerade_round_trip(datapath, maps, proto):
    """Rule 4: backend sees node:port; the client gets its answer from nodeIP:nodePort."""
    w.install(maps, w.web(proto=proto))
    make = tcp if proto == w.TCP else udp
    first = make(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT)
    fwd = step(datapath, maps, "tc_ingress", first, R.FWD_NEW)
    backend = endpoints(fwd)[1]
    fwd = step(datapath, maps, "tc_egress", fwd, R.SNAT)
    (snat_addr, snat_port), dst = endpoints(fwd)
    assert snat_addr == w.NODE_IP and w.SNAT_MIN <= snat_port <= w.SNAT_MAX and dst == backend

    back = step(datapath, maps, "tc_ingress", reply_to(fwd), R.REV_SNAT)
    assert endpoints(back) == (backend, (w.OUTSIDE, 40000))
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP, w.NODE_PORT), (w.OUTSIDE, 40000))

    # the next forward packet takes the same backend and the same masquerade port
    again = step(datapath, maps, "tc_ingress", make(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_ESTABLISHED)
    again = step(datapath, maps, "tc_egress", again, R.SNAT)
    assert endpoints(again) == ((w.NODE_IP, snat_port), backend)


def test_hairpin_round_trip(datapath, maps):
    """Rule 3: the pod reaches itself through the service and sees the node as the peer."""
    w.install(maps, w.web(cluster=(w.LOCAL_EP,)))
    me = w.LOCAL_EP[0]
    fwd = step(datapath, maps, "tc_ingress", tcp(me, 40000, w.VIP, 80), R.FWD_NEW)
    fwd = step(datapath, maps, "tc_egress", fwd, R.SNAT)
    (snat_addr, snat_port), _ = endpoints(fwd)
    assert snat_addr == w.NODE_IP
    back = step(datapath, maps, "tc_ingress", tcp(me, 8080, w.NODE_IP, snat_port, flags="SA"), R.REV_SNAT)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (me, 40000))


def test_etp_local_keeps_client_ip_on_the_way_back(datapath, maps):
    """Rule 5: no masquerade, the local endpoint answers the real client directly."""
    w.install(maps, w.web(flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ETP_LOCAL))
    fwd = step(datapath, maps, "tc_ingress", tcp(w.OUTSIDE, 40000, w.NODE_IP2, w.NODE_PORT), R.FWD_NEW)
    assert endpoints(fwd) == ((w.OUTSIDE, 40000), w.LOCAL_EP)
    step(datapath, maps, "tc_egress", fwd, R.PASS_NO_SERVICE)
    back = step(datapath, maps, "tc_egress", tcp(*w.LOCAL_EP, w.OUTSIDE, 40000, flags="SA"), R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP2, w.NODE_PORT), (w.OUTSIDE, 40000))


def test_established_connection_survives_endpoint_changes(datapath, maps):
    """Rule 10: new connections use the new endpoint set, established ones keep theirs."""
    svc = w.web(cluster=(w.REMOTE_EP,), local=())
    w.install(maps, svc)
    old = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    assert endpoints(old)[1] == w.REMOTE_EP

    maps.delete_backend(svc.backend_id(w.REMOTE_EP))
    w.install(maps, replace(svc, id=2, cluster=(w.REMOTE_EP2,)))
    again = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="A"), R.FWD_ESTABLISHED)
    assert endpoints(again)[1] == w.REMOTE_EP
    new = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40001, w.VIP, 80), R.FWD_NEW)
    assert endpoints(new)[1] == w.REMOTE_EP2


def _svc_entry(maps, sport):
    return next(c for c in maps.connections() if c.kind == s.CT4_SVC and c.sport == sport)


def test_lifetimes_follow_the_connection_state(datapath, maps):
    w.install(maps, w.web())
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    now = time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
    syn = _svc_entry(maps, 40000)
    assert abs(syn.expires_ns - now - w.SETTINGS.tcp_syn_timeout * 10**9) < 5 * 10**9

    fwd_backend = (syn.nat_addr, syn.nat_port)
    run(datapath, "tc_egress", tcp(*fwd_backend, w.POD_CLIENT, 40000, flags="SA"))
    est = _svc_entry(maps, 40000)
    assert est.flags & s.CT4_F_SEEN_REPLY
    assert abs(est.expires_ns - now - w.SETTINGS.tcp_est_timeout * 10**9) < 5 * 10**9

    # half closed (kube-proxy's --conntrack-tcp-timeout-close-wait), then closed both ways
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="FA"))
    half = _svc_entry(maps, 40000)
    assert half.flags & s.CT4_F_CLOSING
    assert abs(half.expires_ns - now - w.SETTINGS.tcp_close_wait_timeout * 10**9) < 5 * 10**9
    run(datapath, "tc_egress", tcp(*fwd_backend, w.POD_CLIENT, 40000, flags="FA"))
    closed = _svc_entry(maps, 40000)
    assert closed.flags & s.CT4_F_FIN_REPLY
    assert abs(closed.expires_ns - now - w.SETTINGS.tcp_close_timeout * 10**9) < 5 * 10**9


def test_syn_on_a_closing_connection_starts_a_new_one(datapath, maps):
    w.install(maps, w.web())
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="R"))
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW,
         events=(R.EV_CT_CLOSED_FORGOTTEN,))  # the closed connection, forgotten for the new one
    assert not _svc_entry(maps, 40000).flags & s.CT4_F_CLOSING
    # its SYN retransmitted: the connection it started, open, forgets nothing
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_ESTABLISHED)


def test_expired_connection_is_a_new_one(datapath, maps):
    w.install(maps, w.web(proto=w.UDP))
    run(datapath, "tc_ingress", udp(w.POD_CLIENT, 5000, w.VIP, 80))
    maps.set_connection_expiry(_svc_entry(maps, 5000), 1)
    step(datapath, maps, "tc_ingress", udp(w.POD_CLIENT, 5000, w.VIP, 80), R.FWD_NEW)


def test_reply_half_without_its_connection_is_ignored_and_removed(datapath, maps):
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    maps.delete_connection(_svc_entry(maps, 40000))
    reply = tcp(*w.REMOTE_EP, w.POD_CLIENT, 40000, flags="SA")
    out = step(datapath, maps, "tc_egress", reply, R.PASS_NO_SERVICE)
    assert bytes(out) == bytes(reply)
    assert not maps.connections() or all(c.kind != s.CT4_REV_DNAT for c in maps.connections())


@pytest.mark.parametrize("closed_by", ["client first", "backend first", "reset"])
def test_a_syn_ack_of_a_connection_another_node_translated_is_not_taken_by_a_closed_ones_half(datapath, maps,
                                                                                            closed_by):
    """A pod's connection through the clusterIP ends; the pod reuses its port toward another
    frontend, which another node translates to the same backend (connect() picks ports per
    destination). Both are one tuple at the backend: the new one's packets pass here as they
    came, and the closed one's reply half must not give the backend's SYN-ACK the old frontend.
    netfilter keeps the second apart (nf_nat_core.c get_unique_tuple: its null binding gets
    another source port); the truth table (tests/e2e/test_local_traffic.py) lost an attempt so,
    now and then, until the closed connection was forgotten on such a SYN-ACK."""
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    client, backend = (w.POD_CLIENT, 40000), w.REMOTE_EP
    step(datapath, maps, "tc_ingress", tcp(*client, w.VIP, 80), R.FWD_NEW)
    step(datapath, maps, "tc_egress", tcp(*backend, *client, flags="SA"), R.REV_DNAT)
    closing = {"client first": [("tc_ingress", "FA"), ("tc_egress", "FA"), ("tc_ingress", "A")],
               "backend first": [("tc_egress", "FA"), ("tc_ingress", "FA"), ("tc_egress", "A")],
               "reset": [("tc_ingress", "R")]}[closed_by]
    for prog, flags in closing:
        pkt = tcp(*client, w.VIP, 80, flags=flags) if prog == "tc_ingress" else tcp(*backend, *client, flags=flags)
        run(datapath, prog, pkt)
    assert _svc_entry(maps, 40000).flags & s.CT4_F_CLOSING

    # the new connection: its SYN already addresses the backend (another node's DNAT)
    step(datapath, maps, "tc_ingress", tcp(*client, *backend), R.PASS_NO_SERVICE)
    for flags, payload in (("SA", b""), ("PA", b'{"pod": "web"}\n')):
        reply = tcp(*backend, *client, flags=flags, payload=payload)
        # the SYN-ACK forgets the closed connection (counted once), the data finds nothing left
        forgotten = (R.EV_CT_CLOSED_FORGOTTEN,) if flags == "SA" else ()
        out = step(datapath, maps, "tc_egress", reply, R.PASS_NO_SERVICE, events=forgotten)
        assert bytes(out) == bytes(reply), f"{flags}: the closed connection's half rewrote it"
    assert not maps.connections(), "the closed connection, or a half of it, is left"


def test_a_syn_of_a_connection_another_node_translated_is_not_taken_by_a_closed_masqueraded_ones_half(datapath,
                                                                                                        maps):
    """The masqueraded form of the test above (the lab's NodeCIDR truth table: a NodePort
    connection masqueraded here, then one through an LB IP that another node sent to the same
    backend unmasqueraded): the new connection's tuple toward the backend is the closed one's
    CT4_SNAT half, which gave its SYN the old masquerade port, so the backend's SYN-ACK went back
    through the closed connection and the client's ACK got an RST."""
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    client, backend = (w.OUTSIDE, 40000), w.REMOTE_EP
    step(datapath, maps, "tc_ingress", tcp(*client, w.NODE_IP, w.NODE_PORT), R.FWD_NEW)
    masq = endpoints(step(datapath, maps, "tc_egress", tcp(*client, *backend), R.SNAT))[0]
    step(datapath, maps, "tc_ingress", tcp(*backend, *masq, flags="SA"), R.REV_SNAT)
    for prog, pkt in (("tc_ingress", tcp(*client, w.NODE_IP, w.NODE_PORT, flags="FA")),
                      ("tc_egress", tcp(*client, *backend, flags="FA")),
                      ("tc_ingress", tcp(*backend, *masq, flags="FA")),
                      ("tc_ingress", tcp(*client, w.NODE_IP, w.NODE_PORT, flags="A"))):
        run(datapath, prog, pkt)
    assert _svc_entry(maps, 40000).flags & s.CT4_F_CLOSING

    syn = tcp(*client, *backend)
    out = step(datapath, maps, "tc_egress", syn, R.PASS_NO_SERVICE, events=(R.EV_CT_CLOSED_FORGOTTEN,))
    assert bytes(out) == bytes(syn), "the closed connection's masquerade half rewrote the new SYN"
    assert not maps.connections(), "the closed connection, or a half of it, is left"
    reply = tcp(*backend, *client, flags="SA")
    assert bytes(step(datapath, maps, "tc_egress", reply, R.PASS_NO_SERVICE)) == bytes(reply)


def test_a_retransmitted_syn_ack_of_an_open_handshake_is_still_translated(datapath, maps):
    """The other side of the rule above: a SYN-ACK whose connection has not closed is its own."""
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    for _ in range(2):
        back = step(datapath, maps, "tc_egress", tcp(*w.REMOTE_EP, w.POD_CLIENT, 40000, flags="SA"), R.REV_DNAT)
        assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))


def test_masquerade_half_of_another_connection_is_not_applied(datapath, maps):
    """A client talking to a backend directly must not be masqueraded by a stale SNAT entry."""
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    run(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.VIP, 80))
    maps.delete_connection(_svc_entry(maps, 40000))
    direct = tcp(w.OUTSIDE, 40000, *w.REMOTE_EP)
    out = step(datapath, maps, "tc_egress", direct, R.PASS_NO_SERVICE)
    assert bytes(out) == bytes(direct)


def remapped(datapath, maps, pkt, events=()):
    """tc_ingress on a new connection whose port clashes: FWD_NEW and one EV_CT_PORT_REMAP (and
    each of `events` once)."""
    return step(datapath, maps, "tc_ingress", pkt, R.FWD_NEW, events=(R.EV_CT_PORT_REMAP, *events))


def test_a_new_unmasqueraded_connection_on_the_same_tuple_is_not_masqueraded(datapath, maps):
    """A pod's port reused toward the same backend through another frontend while the first,
    masqueraded connection lives: the new one (eTP=Local, short-circuited: no masquerade) must
    leave with the pod's own address, and the first must keep its replies. Seen in the e2e
    truth table: a pod probing an eTP=Cluster then an eTP=Local NodePort of one node. The two
    share the client -> backend tuple here, so the new one leaves with another port
    (CT4_S_REMAP, see test_one_client_port_through_two_frontends_to_one_backend_...)."""
    etp_cluster = w.web(id=1, cluster=(w.LOCAL_EP,), local=(w.LOCAL_EP,))
    etp_local = w.web(id=2, frontends=((None, w.NODE_PORT + 1, w.EXT),), cluster=(w.LOCAL_EP,), local=(w.LOCAL_EP,),
                      flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ETP_LOCAL)
    w.install(maps, etp_cluster, etp_local)
    first = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW)
    first = step(datapath, maps, "tc_egress", first, R.SNAT)
    second = remapped(datapath, maps, tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT + 1))
    (client, port), backend = endpoints(second)
    assert (client, backend) == (w.POD_CLIENT, w.LOCAL_EP) and w.SNAT_MIN <= port <= w.SNAT_MAX
    out = step(datapath, maps, "tc_egress", second, R.PASS_NO_SERVICE)
    assert endpoints(out) == ((w.POD_CLIENT, port), w.LOCAL_EP)

    back = step(datapath, maps, "tc_ingress", reply_to(first), R.REV_SNAT)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP, w.NODE_PORT), (w.POD_CLIENT, 40000))
    back = step(datapath, maps, "tc_egress", reply_to(out), R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP, w.NODE_PORT + 1), (w.POD_CLIENT, 40000))


@pytest.mark.parametrize("proto", [w.TCP, w.UDP])
def test_one_client_port_through_two_frontends_to_one_backend_keeps_both_connections(datapath, maps, proto):
    """connect() reuses a source port toward another destination: a pod's two connections of one
    port, through two clusterIPs, that reach the same backend would be one tuple there. netfilter's
    NAT finds the clash when it confirms the second (nf_nat_core.c: get_unique_tuple, the null
    binding in POSTROUTING) and gives it another source port; so does ct4_create (CT4_S_REMAP,
    counted under EV_CT_PORT_REMAP). Each gets its own replies, its later packets keep the port,
    and its end removes its own reply half. Found by the e2e truth table (eTP=Local, a bridged
    pod's concurrent probes of two frontends: one attempt in a cell got no answer) and reproduced
    in the lab with two sockets bound to one port: 12 of 40 connections timed out before."""
    make = tcp if proto == w.TCP else udp
    a = w.web(id=1, cluster=(w.REMOTE_EP,), proto=proto)
    b = w.web(id=2, frontends=(("10.96.0.11", 80, 0),), cluster=(w.REMOTE_EP,), proto=proto)
    w.install(maps, a, b)
    first = step(datapath, maps, "tc_ingress", make(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    assert endpoints(first) == ((w.POD_CLIENT, 40000), w.REMOTE_EP)
    second = remapped(datapath, maps, make(w.POD_CLIENT, 40000, "10.96.0.11", 80))
    (client, port), backend = endpoints(second)
    assert (client, backend) == (w.POD_CLIENT, w.REMOTE_EP) and w.SNAT_MIN <= port <= w.SNAT_MAX

    for out, frontend in ((first, (w.VIP, 80)), (second, ("10.96.0.11", 80))):
        back = step(datapath, maps, "tc_egress", reply_to(out), R.REV_DNAT)
        assert endpoints(back) == (frontend, (w.POD_CLIENT, 40000))
        assert_checksums_valid(back)
    again = step(datapath, maps, "tc_ingress", make(w.POD_CLIENT, 40000, "10.96.0.11", 80), R.FWD_ESTABLISHED)
    assert endpoints(again) == ((w.POD_CLIENT, port), w.REMOTE_EP)  # step(): no second EV_CT_PORT_REMAP

    svc = next(c for c in maps.connections(kind=s.CT4_SVC) if c.daddr == "10.96.0.11")
    assert svc.state & s.CT4_S_REMAP and not svc.flags & s.CT4_F_MASQ
    assert (svc.snat_addr, svc.snat_port) == (w.POD_CLIENT, port)
    halves = {(c.daddr, c.dport) for c in maps.connections(kind=s.CT4_REV_DNAT)}
    assert halves == {(w.POD_CLIENT, 40000), (w.POD_CLIENT, port)}


@pytest.mark.parametrize("first_masqueraded", [False, True], ids=["first-clusterIP", "first-nodePort"])
def test_a_masqueraded_connection_of_a_clashing_port_leaves_with_its_masquerade_port(datapath, maps,
                                                                                     first_masqueraded):
    """The second connection of a pod's port, through a NodePort (masqueraded), to the backend
    the first already reaches from that port: its SNAT half and its reply half would be the
    first's. It leaves with its masquerade port from DNAT on (CT4_S_REMAP), so that every half
    is its own; replies come back to the client's own port from each frontend. netfilter keeps
    the client's port here (the masquerade makes the reply tuples differ): only the port
    between this node's hooks differs, which no end sees."""
    a = w.web(id=1, cluster=(w.REMOTE_EP,))
    b = w.web(id=2, frontends=((None, w.NODE_PORT + 1, w.EXT),), cluster=(w.REMOTE_EP,))
    w.install(maps, a, b)
    first_dst = (w.NODE_IP, w.NODE_PORT) if first_masqueraded else (w.VIP, 80)
    first = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, *first_dst), R.FWD_NEW)
    first = step(datapath, maps, "tc_egress", first, R.SNAT if first_masqueraded else R.PASS_NO_SERVICE)
    second = remapped(datapath, maps, tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT + 1))
    (client, port), backend = endpoints(second)
    assert (client, backend) == (w.POD_CLIENT, w.REMOTE_EP) and w.SNAT_MIN <= port <= w.SNAT_MAX
    second = step(datapath, maps, "tc_egress", second, R.SNAT)
    assert endpoints(second) == ((w.NODE_IP, port), w.REMOTE_EP)

    back = step(datapath, maps, "tc_ingress", reply_to(second), R.REV_SNAT)
    assert endpoints(back) == (w.REMOTE_EP, (w.POD_CLIENT, port))
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP, w.NODE_PORT + 1), (w.POD_CLIENT, 40000))
    back = reply_to(first)
    if first_masqueraded:
        back = step(datapath, maps, "tc_ingress", back, R.REV_SNAT)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == (first_dst, (w.POD_CLIENT, 40000))

    again = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT + 1, flags="A"),
                 R.FWD_ESTABLISHED)
    again = step(datapath, maps, "tc_egress", again, R.SNAT)
    assert endpoints(again) == ((w.NODE_IP, port), w.REMOTE_EP)
    again = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, *first_dst, flags="A"), R.FWD_ESTABLISHED)
    again = step(datapath, maps, "tc_egress", again, R.SNAT if first_masqueraded else R.PASS_NO_SERVICE)
    assert endpoints(again) == endpoints(first)


def test_a_remapped_connection_that_ends_takes_only_its_own_half(datapath, maps):
    """The remapped connection's RST removes it and the reply half at its remapped port (ct4_forget);
    the first connection of the port keeps its half and its replies."""
    a = w.web(id=1, cluster=(w.REMOTE_EP,))
    b = w.web(id=2, frontends=(("10.96.0.11", 80, 0),), cluster=(w.REMOTE_EP,))
    w.install(maps, a, b)
    first = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    second = remapped(datapath, maps, tcp(w.POD_CLIENT, 40000, "10.96.0.11", 80))
    port = endpoints(second)[0][1]
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, "10.96.0.11", 80, flags="R"), R.FWD_ESTABLISHED)
    # a new SYN on the closed tuple is a new connection: the old one is forgotten whole first
    third = remapped(datapath, maps, tcp(w.POD_CLIENT, 40000, "10.96.0.11", 80), events=(R.EV_CT_CLOSED_FORGOTTEN,))
    assert endpoints(third)[0][1] not in (40000,), "the first connection still holds the tuple"
    halves = {(c.daddr, c.dport) for c in maps.connections(kind=s.CT4_REV_DNAT)}
    assert (w.POD_CLIENT, port) not in halves or endpoints(third)[0][1] == port
    assert len(halves) == 2
    back = step(datapath, maps, "tc_egress", reply_to(first), R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))


def test_session_affinity_pins_a_client(datapath, maps):
    """Rule 13: every new connection of a client goes to its first backend."""
    svc = w.web(affinity=10800)
    w.install(maps, svc)
    picks = {endpoints(run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 30000 + i, w.VIP, 80)).pkt)[1] for i in range(40)}
    assert len(picks) == 1
    others = {endpoints(run(datapath, "tc_ingress", tcp("10.244.3.3", 30000 + i, w.VIP, 80)).pkt)[1] for i in range(40)}
    assert len(others) == 1
    backend_id, _ = maps.affinity(svc.id, w.POD_CLIENT)
    assert backend_id == svc.backend_id(picks.pop())


def test_session_affinity_expires(datapath, maps):
    svc = w.web(affinity=60)
    w.install(maps, svc)
    pinned = svc.backend_id(w.REMOTE_EP2)
    maps.set_affinity(svc.id, w.POD_CLIENT, pinned, time.monotonic_ns() - 61 * 10**9)
    picks = set()
    for i in range(30):
        maps.set_affinity(svc.id, w.POD_CLIENT, pinned, time.monotonic_ns() - 61 * 10**9)
        picks.add(endpoints(run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 30000 + i, w.VIP, 80)).pkt)[1])
    assert len(picks) > 1, "an expired affinity must not pin the client"
    maps.set_affinity(svc.id, w.POD_CLIENT, pinned, time.monotonic_ns() - 59 * 10**9)
    assert endpoints(run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 31000, w.VIP, 80)).pkt)[1] == w.REMOTE_EP2


def test_session_affinity_only_within_the_allowed_set(datapath, maps):
    """eTP=Local from outside: a remembered remote backend is not used."""
    svc = w.web(affinity=10800, flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ETP_LOCAL)
    w.install(maps, svc)
    maps.set_affinity(svc.id, w.OUTSIDE, svc.backend_id(w.REMOTE_EP), time.monotonic_ns())
    out = run(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT))
    assert endpoints(out.pkt)[1] == w.LOCAL_EP
    assert maps.affinity(svc.id, w.OUTSIDE)[0] == svc.backend_id(w.LOCAL_EP)


def test_masquerade_ports_exhausted_then_reclaimed(datapath, maps):
    one_port = replace(w.SETTINGS, snat_port_min=61000, snat_port_max=61000)
    maps.set_settings(one_port)
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    step(datapath, maps, "tc_ingress", tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW)

    maps.reset_stats()
    out = run(datapath, "tc_ingress", tcp(w.OUTSIDE2, 40000, w.NODE_IP, w.NODE_PORT))
    assert out.verdict == TC_ACT_SHOT
    assert counted(maps) == {R.DROP_SNAT_NO_PORT: 1}

    maps.set_connection_expiry(_svc_entry(maps, 40000), 1)  # the first connection is over
    fwd = step(datapath, maps, "tc_ingress", tcp(w.OUTSIDE2, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW)
    fwd = step(datapath, maps, "tc_egress", fwd, R.SNAT)
    assert endpoints(fwd)[0] == (w.NODE_IP, 61000)


def test_masquerade_ports_differ_per_connection(datapath, maps):
    w.install(maps, w.web(cluster=(w.REMOTE_EP,), local=()))
    ports = set()
    for i in range(50):
        fwd = run(datapath, "tc_ingress", tcp(w.OUTSIDE, 1000 + i, w.VIP, 80)).pkt
        ports.add(endpoints(run(datapath, "tc_egress", fwd).pkt)[0][1])
    assert len(ports) == 50 and all(w.SNAT_MIN <= p <= w.SNAT_MAX for p in ports)


def test_an_expired_remapped_connection_forgotten_later_leaves_the_half_another_took_over(datapath, maps):
    """A remapped connection (client port 40000, leaving with port w) expires; a connection of the
    client's port w through the same frontend then takes the reply half at w over. When the
    expired one is forgotten (its client reconnects from 40000), only halves with its own client
    port go: the newer connection keeps its replies (ct4_forget_half)."""
    other = "10.96.0.11"
    w.install(maps, w.web(id=1, cluster=(w.REMOTE_EP,)), w.web(id=2, frontends=((other, 80, 0),), cluster=(w.REMOTE_EP,)))
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    wire = endpoints(remapped(datapath, maps, tcp(w.POD_CLIENT, 40000, other, 80)))[0][1]
    key = s.CT4Key(saddr=be32(w.POD_CLIENT), daddr=be32(other), sport=be16(40000), dport=be16(80), proto=w.TCP,
                   kind=s.CT4_SVC)
    entry = maps.connection_entry(key)
    entry.expires = 1
    maps.put_connection_entry(key, entry)
    taken_over = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, wire, other, 80), R.FWD_NEW)
    assert endpoints(taken_over) == ((w.POD_CLIENT, wire), w.REMOTE_EP)
    remapped(datapath, maps, tcp(w.POD_CLIENT, 40000, other, 80))  # forgets the expired one first
    back = step(datapath, maps, "tc_egress", reply_to(taken_over), R.REV_DNAT)
    assert endpoints(back) == ((other, 80), (w.POD_CLIENT, wire))
