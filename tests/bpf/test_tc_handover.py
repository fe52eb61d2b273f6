"""A mode switch as the programs see it (agent/handover.py): CFG_F_NETFILTER_MIDSTREAM / _OUT leave what
has no connection entry to netfilter, and a connection moved in with ebpf/handover.adopt is
translated exactly as one the programs made themselves; moved out, it leaves nothing behind."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from ebpf_proxy.datapath.ebpf import handover
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import ct_key
from tests.bpf import world as w
from tests.bpf.packets import TC_ACT_SHOT, counted, endpoints, reply_to, run, step, tcp, udp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason


def with_flag(maps, flag):
    w.install_node(maps, replace(w.SETTINGS, handover=flag))


def test_taking_over_a_syn_is_ours_anything_else_netfilters(datapath, maps):
    """CFG_F_NETFILTER_MIDSTREAM: the kernel's conntrack still translates the iptables mode's connections,
    so a mid-connection packet without an entry passes untouched; a SYN opens one of ours."""
    w.install(maps, w.web(), w.web(id=2, proto=w.UDP))
    with_flag(maps, s.CFG_F_NETFILTER_MIDSTREAM)
    ack = tcp(w.POD_CLIENT, 40001, w.VIP, 80, flags="A")
    out = step(datapath, maps, "tc_ingress", ack, R.PASS_HANDOVER)
    assert endpoints(out) == endpoints(ack)
    dns = udp(w.POD_CLIENT, 40002, w.VIP, 80)
    assert endpoints(step(datapath, maps, "tc_ingress", dns, R.PASS_HANDOVER)) == endpoints(dns)
    syn = tcp(w.POD_CLIENT, 40003, w.VIP, 80)
    assert endpoints(step(datapath, maps, "tc_ingress", syn, R.FWD_NEW))[1] != (w.VIP, 80)
    # its next packet has an entry: translated, the flag notwithstanding
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40003, w.VIP, 80, flags="A"), R.FWD_ESTABLISHED)
    with_flag(maps, 0)
    step(datapath, maps, "tc_ingress", ack, R.FWD_NEW)  # the flag cleared: a mid-stream pickup is ours again


def test_handing_over_only_known_connections_are_translated(datapath, maps):
    """CFG_F_NETFILTER_FIRST: the iptables rules are in place, so nothing new is ours, not even a SYN."""
    w.install(maps, w.web())
    known = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40010, w.VIP, 80), R.FWD_NEW)
    with_flag(maps, s.CFG_F_NETFILTER_FIRST)
    again = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40010, w.VIP, 80, flags="A"), R.FWD_ESTABLISHED)
    assert endpoints(again)[1] == endpoints(known)[1]
    syn = tcp(w.OUTSIDE, 40011, w.NODE_IP, w.NODE_PORT)
    assert endpoints(step(datapath, maps, "tc_ingress", syn, R.PASS_HANDOVER)) == endpoints(syn)


def test_xdp_leaves_a_switch_to_tc(datapath, maps):
    """XDP's early drops (eTP=Local without a local endpoint) wait for TC's decision during a
    switch: the packet may belong to a connection netfilter still translates."""
    w.install(maps, w.web(local=(), flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ETP_LOCAL))
    syn = tcp(w.OUTSIDE, 40020, w.NODE_IP, w.NODE_PORT)
    maps.reset_stats()
    run(datapath, "xdp_lb", syn)
    assert counted(maps) == {R.DROP_NO_LOCAL_EXTERNAL: 1}
    for flag in (s.CFG_F_NETFILTER_MIDSTREAM, s.CFG_F_NETFILTER_FIRST):
        with_flag(maps, flag)
        maps.reset_stats()
        run(datapath, "xdp_lb", syn)
        assert counted(maps) == {}, f"flag {flag:#x}"


def _established(datapath, maps, client, frontend, masq: bool):
    """A connection the programs made and saw answered; returns its forward packet at the backend."""
    syn = tcp(*client, *frontend)
    fwd = step(datapath, maps, "tc_ingress", syn, R.FWD_NEW)
    fwd = step(datapath, maps, "tc_egress", fwd, R.SNAT if masq else R.PASS_NO_SERVICE)
    back = step(datapath, maps, "tc_ingress", reply_to(fwd, "SA"), R.REV_SNAT if masq else R.PASS_NO_SERVICE)
    step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    step(datapath, maps, "tc_ingress", tcp(*client, *frontend, flags="A"), R.FWD_ESTABLISHED)
    return fwd


def _table(maps):
    """epx_ct4 without the deadlines (adopt sets its own from the kernel's timeout)."""
    return sorted((replace(c, expires_ns=0) for c in maps.connections()), key=repr)


@pytest.mark.parametrize("client, frontend, masq", [
    ((w.POD_CLIENT, 40030), (w.VIP, 80), False),
    ((w.OUTSIDE, 40031), (w.NODE_IP, w.NODE_PORT), True),
], ids=["pod->clusterIP", "outside->nodePort (masqueraded)"])
def test_a_connection_moved_out_and_back_in_is_the_same_connection(datapath, maps, client, frontend, masq):
    """outgoing() reads the connection as the kernel must hold it; forget() leaves no entry; adopt()
    writes back exactly what ct4_create and the packets wrote, and the next packets are
    translated to the same backend, masquerade address and port, both ways."""
    svc = w.web()
    w.install(maps, svc)
    fwd = _established(datapath, maps, client, frontend, masq)
    before = _table(maps)
    now = time.monotonic_ns()
    [conn] = handover.outgoing(maps, now)
    assert (conn.client, conn.client_port, conn.frontend, conn.frontend_port) == (*client, *frontend)
    assert (conn.source, conn.source_port) == endpoints(fwd)[0]
    assert (conn.backend, conn.backend_port) == endpoints(fwd)[1]
    assert conn.masqueraded == masq and conn.seen_reply and not conn.half_open
    assert 86000 < conn.timeout <= 86400  # established: kube-proxy's tcpEstablishedTimeout

    handover.forget(maps, conn)
    assert maps.connections() == [], "forget left entries behind"
    assert handover.adopt(maps, conn, handover.backend_ids(maps), {w.NODE_IP, w.NODE_IP2}, now, held=True) is None
    # held while the kernel's entry goes: dropped, counted, then released
    maps.reset_stats()
    step_drop = run(datapath, "tc_ingress", tcp(*client, *frontend, flags="A"))
    assert step_drop.verdict == TC_ACT_SHOT and counted(maps) == {R.DROP_HANDOVER_HELD: 1}
    assert handover.hold(maps, conn, held=False)
    assert _table(maps) == before

    data = step(datapath, maps, "tc_ingress", tcp(*client, *frontend, flags="PA", payload=b"x"), R.FWD_ESTABLISHED)
    data = step(datapath, maps, "tc_egress", data, R.SNAT if masq else R.PASS_NO_SERVICE)
    assert endpoints(data) == endpoints(fwd)
    back = step(datapath, maps, "tc_ingress", reply_to(data, "A"), R.REV_SNAT if masq else R.PASS_NO_SERVICE)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == (frontend, client)


def test_adopt_refuses_what_is_not_programmed_here(datapath, maps):
    w.install(maps, w.web())
    fwd = _established(datapath, maps, (w.POD_CLIENT, 40040), (w.VIP, 80), False)
    [conn] = handover.outgoing(maps, time.monotonic_ns())
    handover.forget(maps, conn)
    backends = handover.backend_ids(maps)
    gone = replace(conn, frontend="10.96.0.99")
    assert "not a service here" in handover.adopt(maps, gone, backends, set(), time.monotonic_ns())
    moved = replace(conn, backend="10.244.9.9")
    assert "not programmed here" in handover.adopt(maps, moved, backends, set(), time.monotonic_ns())
    assert maps.connections() == [] and endpoints(fwd)


def test_a_handshake_under_way_is_handed_over_as_one(datapath, maps):
    """Only the SYN went through: the kernel must expect a SYN-ACK (SYN_SENT), not see it as
    invalid in ESTABLISHED."""
    from ebpf_proxy.datapath.kernel_nat import TCP_SYN_SENT

    w.install(maps, w.web())
    step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40050, w.VIP, 80), R.FWD_NEW)
    [conn] = handover.outgoing(maps, time.monotonic_ns())
    assert conn.half_open and conn.tcp_state == TCP_SYN_SENT and not conn.seen_reply


def test_a_masquerade_port_reused_while_the_old_connection_closes_goes_to_the_new_one(datapath, maps):
    """The programs hand a port whose old connection is closing (or over) to a new one toward the
    same backend; the kernel can hold one entry per tuple the backend sees: the live one's."""
    from ebpf_proxy.datapath.kernel_nat import TCP_CLOSE, TCP_TIME_WAIT

    w.install(maps, w.web())
    fwd = _established(datapath, maps, (w.OUTSIDE, 40060), (w.NODE_IP, w.NODE_PORT), True)
    now = time.monotonic_ns()
    [old] = handover.outgoing(maps, now)
    handover.forget(maps, old)
    ids, nodes = handover.backend_ids(maps), {w.NODE_IP, w.NODE_IP2}
    for state in (TCP_TIME_WAIT, TCP_CLOSE):
        for c in maps.connections():
            maps.delete_connection_entry(ct_key(c.saddr, c.daddr, c.sport, c.dport, c.proto, c.kind))
        assert handover.adopt(maps, replace(old, tcp_state=state), ids, nodes, now) is None
        assert handover.adopt(maps, replace(old, client_port=40061), ids, nodes, now) is None
        [kept] = handover.outgoing(maps, now)
        assert kept.client_port == 40061 and (kept.source, kept.source_port) == endpoints(fwd)[0], state
        # the other way round the live one keeps its port: adopt never overwrites a live half
        why = handover.adopt(maps, replace(old, tcp_state=state), ids, nodes, now)
        assert why is not None and "masquerade port" in why, state


def test_a_udp_flow_moved_out_and_back_in_is_the_same_flow(datapath, maps):
    """UDP has no handshake: the flow, answered once, is read out as seen_reply and written back
    exactly; the next datagram goes to the same backend."""
    w.install(maps, w.web(proto=w.UDP))
    client, frontend = (w.POD_CLIENT, 40070), (w.VIP, 80)
    fwd = step(datapath, maps, "tc_ingress", udp(*client, *frontend), R.FWD_NEW)
    step(datapath, maps, "tc_egress", reply_to(fwd), R.REV_DNAT)
    before = _table(maps)
    now = time.monotonic_ns()
    [conn] = handover.outgoing(maps, now)
    assert conn.proto == w.UDP and conn.seen_reply and not conn.half_open and not conn.closing
    assert (conn.backend, conn.backend_port) == endpoints(fwd)[1]
    handover.forget(maps, conn)
    assert maps.connections() == []
    assert handover.adopt(maps, conn, handover.backend_ids(maps), {w.NODE_IP, w.NODE_IP2}, now) is None
    assert _table(maps) == before
    again = step(datapath, maps, "tc_ingress", udp(*client, *frontend), R.FWD_ESTABLISHED)
    assert endpoints(again) == endpoints(fwd)


def test_a_masquerade_that_steps_aside_for_a_later_adopted_connection_keeps_translating(datapath, maps):
    """The kernel holds a pod's port through a NodePort (masqueraded) and through a clusterIP (not),
    to one backend; the masquerade is adopted first, the other later (its handshake was under
    way). The masquerade moves to its masquerade port (handover._step_aside, CT4_S_REMAP) and the
    programs translate both: each packet and reply as ct4_create's own layout would."""
    from ebpf_proxy.datapath.kernel_nat import TCP_ESTABLISHED, NatConnection

    w.install(maps, w.web(id=1, cluster=(w.REMOTE_EP,)),
              w.web(id=2, frontends=((None, w.NODE_PORT + 1, w.EXT),), cluster=(w.REMOTE_EP,)))
    now, backends, local = time.monotonic_ns(), handover.backend_ids(maps), {w.NODE_IP, w.NODE_IP2}
    masq = NatConnection(w.TCP, w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT + 1, *w.REMOTE_EP, w.NODE_IP, 61234, 300,
                         tcp_state=TCP_ESTABLISHED, seen_reply=True)
    plain = NatConnection(w.TCP, w.POD_CLIENT, 40000, w.VIP, 80, *w.REMOTE_EP, w.POD_CLIENT, 40000, 300,
                          tcp_state=TCP_ESTABLISHED, seen_reply=True)
    assert handover.adopt(maps, masq, backends, local, now) is None
    assert handover.adopt(maps, plain, backends, local, now) is None

    out = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT + 1, flags="A"),
               R.FWD_ESTABLISHED)
    out = step(datapath, maps, "tc_egress", out, R.SNAT)
    assert endpoints(out) == ((w.NODE_IP, 61234), w.REMOTE_EP)
    back = step(datapath, maps, "tc_ingress", reply_to(out, "A"), R.REV_SNAT)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP, w.NODE_PORT + 1), (w.POD_CLIENT, 40000))

    out = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="A"), R.FWD_ESTABLISHED)
    out = step(datapath, maps, "tc_egress", out, R.PASS_NO_SERVICE)
    assert endpoints(out) == ((w.POD_CLIENT, 40000), w.REMOTE_EP)
    back = step(datapath, maps, "tc_egress", reply_to(out, "A"), R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))
