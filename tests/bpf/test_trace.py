"""Trace mode (bpf/lib/common.h): a dry run of the real programs decides exactly as a live packet
would, writes nothing (connections, affinity, counters), and live packets never write the record.

The decision table is test_tc_ingress's and test_xdp's own (xdp: both families', family.py): every
case is run twice, first as a trace (which must leave the maps as they were), then live, and the
two must agree on the verdict, the reason and the set of backends chosen among.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from dataclasses import replace
import pytest
from scapy.layers.inet import IP
from scapy.layers.l2 import Ether

from ebpf_proxy.datapath.ebpf import libbpf, loader, testrun
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Service, ip_str, port_int
from tests.bpf import test_tc_ingress as tci
from tests.bpf import test_xdp as txdp
from tests.bpf import world as w
from tests.bpf.family import FAMILIES, IPV4, Family, cases
from tests.bpf.packets import TC_ACT_OK, XDP_DROP, XDP_PASS, counted, endpoints, run, tcp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
NONCE = 0x1234567  # a magic-carrying context that is not a trace (_cb_only)
# Every trace run gets a nonce of its own: epx_trace is per-CPU, and a record an earlier run left
# on another CPU with the same nonce would be read instead of this run's when the test process
# migrates between CPUs (it did, under load).
_nonces = itertools.count(0x2000000)
_last_nonce = 0


def last_nonce() -> int:
    """The nonce of the latest trace_tc/trace_xdp run: where its record is found."""
    return _last_nonce


def _fresh_nonce() -> int:
    global _last_nonce
    _last_nonce = next(_nonces)
    return _last_nonce


def trace_tc(datapath, prog: str, pkt, ifindex: int = 0):
    ctx = testrun.SkBuffCtx(mark=s.TRACE_MARK, ifindex=ifindex)
    ctx.cb[0], ctx.cb[1] = s.TRACE_MAGIC, _fresh_nonce()
    return testrun.run(datapath.prog_fds[prog], bytes(pkt), ctx=ctx)


def trace_xdp(datapath, pkt):
    meta = bytes(s.EpxTraceMeta(magic=s.TRACE_MAGIC, nonce=_fresh_nonce()))
    frame = bytes(pkt)
    ctx = testrun.XdpMd(data=len(meta), data_end=len(meta) + len(frame))
    return testrun.run(datapath.prog_fds["xdp_lb"], meta + frame, ctx=ctx)


def slot_backends(maps, rec: s.EpxTraceRec) -> set[tuple[str, int]]:
    """The backends of the scope the trace chose (what ebpf_trace reports as `backends`)."""
    count = rec.svc_local_count if rec.scope == s.LB4_SCOPE_LOCAL else rec.svc_count
    out = set()
    for slot in range(count):
        backend_id = maps.slot(rec.svc_id, rec.scope, slot)
        be = maps.backends()[backend_id]
        out.add((be.addr, be.port))
    return out


def state(maps, fam: Family = IPV4) -> tuple:
    """Everything a dry run must leave alone, of the family's maps."""
    return (sorted(map(repr, fam.connections(maps))), sorted(map(repr, fam.affinity_ids(maps))), counted(maps),
            *(maps.count(name) for name in fam.untouched))


def zero_trace_map(maps) -> None:
    maps._put("epx_trace", s.u32(0), (s.EpxTraceRec * libbpf.num_possible_cpus())())


def all_trace_records(maps) -> bytes:
    per_cpu = (s.EpxTraceRec * libbpf.num_possible_cpus())()
    assert libbpf.map_lookup(maps._fd("epx_trace"), s.u32(0), per_cpu)
    return bytes(per_cpu)


@pytest.mark.parametrize("case", tci.CASES, ids=[c.desc for c in tci.CASES])
def test_dry_run_decides_as_the_live_run(datapath, maps, case):
    maps.set_settings(case.settings)
    if case.ifaces:
        maps.set_ifaces(case.ifaces)
    if case.svc:
        w.install(maps, case.svc)
    before = state(maps)

    traced = trace_tc(datapath, "tc_ingress", case.pkt)
    rec = maps.trace_record(last_nonce())
    assert rec is not None and rec.hook == s.HOOK_TC_INGRESS
    assert state(maps) == before, "a trace run writes no connection, affinity entry or counter"

    live = run(datapath, "tc_ingress", case.pkt)
    assert traced.retval == live.verdict == case.verdict
    assert counted(maps) == {case.reason: 1}, "the live run counts, once"
    assert R(rec.reason) == case.reason
    if case.reason != R.FWD_NEW:
        if case.reason not in (R.DROP_SNAT_NO_ADDR, R.DROP_SNAT_NO_PORT):  # these fail after the choice
            assert not rec.flags & s.TRACE_F_BACKEND
        if case.verdict == TC_ACT_OK:
            assert traced.packet == bytes(case.pkt)
        return
    assert rec.flags & s.TRACE_F_POLICY and rec.flags & s.TRACE_F_BACKEND
    assert slot_backends(maps, rec) == set(case.backends), "the trace chose among the live run's set"
    picked = (ip_str(rec.backend_addr), port_int(rec.backend_port))
    assert picked in case.backends
    assert endpoints(Ether(traced.packet))[1] == picked, "the traced packet is DNATed to the recorded backend"
    assert bool(rec.masq) == case.masq
    live_conn = next(c for c in maps.connections() if c.kind == s.CT4_SVC)
    assert bool(live_conn.flags & s.CT4_F_MASQ) == bool(rec.masq)


@pytest.mark.parametrize("fam,name", cases({fam: [*txdp.DROPS[fam], *txdp.PASSES[fam]] for fam in FAMILIES}))
def test_xdp_dry_run_decides_as_the_live_run(datapath, maps, fam, name):
    svc, pkt, *reason = txdp.case(fam, name)
    fam.node(maps)
    fam.install(maps, svc)
    before = state(maps, fam)
    traced = trace_xdp(datapath, pkt)
    rec = maps.trace_record(last_nonce())
    assert rec is not None and rec.hook == s.HOOK_XDP
    assert state(maps, fam) == before
    live = run(datapath, "xdp_lb", pkt)
    assert traced.retval == live.verdict == (XDP_DROP if reason else XDP_PASS)
    assert R(rec.reason) == (reason[0] if reason else R.CONTINUE)


def test_affinity_is_read_not_written(datapath, maps):
    svc = w.web(affinity=10800)
    w.install(maps, svc)
    # a remembered client: the trace must pick its backend and leave last_used alone
    remote = svc.backend_id(w.REMOTE_EP)
    maps.set_affinity(svc.id, w.POD_CLIENT, remote, last_used_ns=_now_ns() - 1_000_000_000)
    before = maps.affinity(svc.id, w.POD_CLIENT)
    for sport in range(40000, 40020):
        trace_tc(datapath, "tc_ingress", tcp(w.POD_CLIENT, sport, w.VIP, 80))
        rec = maps.trace_record(last_nonce())
        assert rec.flags & s.TRACE_F_AFFINITY and rec.backend_id == remote
    assert maps.affinity(svc.id, w.POD_CLIENT) == before
    # a new client: no entry is created
    trace_tc(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.VIP, 80))
    assert not maps.trace_record(last_nonce()).flags & s.TRACE_F_AFFINITY
    assert maps.affinity(svc.id, w.OUTSIDE) is None
    assert list(maps.affinity_ids()) == [(svc.id, remote)]


def test_established_connection_is_reported_and_not_touched(datapath, maps):
    w.install(maps, w.web())
    syn = tcp(w.OUTSIDE, 40000, w.VIP, 80)
    live = run(datapath, "tc_ingress", syn)
    conns = {c.kind: c for c in maps.connections()}
    svc = conns[s.CT4_SVC]
    before = state(maps)

    traced = trace_tc(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.VIP, 80, flags="A"))
    rec = maps.trace_record(last_nonce())
    assert R(rec.reason) == R.FWD_ESTABLISHED and rec.flags & s.TRACE_F_ESTABLISHED
    assert (ip_str(rec.backend_addr), port_int(rec.backend_port)) == (svc.nat_addr, svc.nat_port)
    assert rec.masq and (ip_str(rec.snat_addr), port_int(rec.snat_port)) == (svc.snat_addr, svc.snat_port)
    assert state(maps) == before, "no deadline pushed, nothing counted"
    assert endpoints(Ether(traced.packet))[1] == endpoints(live.pkt)[1], "DNATed as the live packet was"

    # egress toward the backend: the connection's own masquerade, read, not refreshed
    out = trace_tc(datapath, "tc_egress", live.pkt)
    rec = maps.trace_record(last_nonce())
    assert rec.hook == s.HOOK_TC_EGRESS and R(rec.reason) == R.SNAT and rec.flags & s.TRACE_F_SNAT
    assert endpoints(Ether(out.packet))[0] == (svc.snat_addr, svc.snat_port)
    assert state(maps) == before


def test_dry_run_egress_of_a_new_connection_finds_nothing(datapath, maps):
    w.install(maps, w.web())
    traced = trace_tc(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.VIP, 80))
    rec = maps.trace_record(last_nonce())
    assert rec.masq == s.TRACE_MASQ_POLICY
    trace_tc(datapath, "tc_egress", traced.packet)
    assert R(maps.trace_record(last_nonce()).reason) == R.PASS_NO_SERVICE
    assert not maps.connections() and counted(maps) == {}


def test_hairpin_is_recorded(datapath, maps):
    w.install(maps, w.web(cluster=(w.LOCAL_EP,)))
    trace_tc(datapath, "tc_ingress", tcp(w.LOCAL_EP[0], 40000, w.VIP, 80))
    assert maps.trace_record(last_nonce()).masq == s.TRACE_MASQ_HAIRPIN


def test_live_packets_never_write_the_trace_map(datapath, maps):
    zero_trace_map(maps)
    blank = all_trace_records(maps)
    for case in tci.CASES:
        maps.set_settings(case.settings)
        if case.svc:
            w.install(maps, case.svc)
        run(datapath, "tc_ingress", case.pkt)
        run(datapath, "xdp_lb", case.pkt)
        if IP in case.pkt:
            run(datapath, "tc_egress", case.pkt)
    # a mark alone (another program's) or cb alone is not the signal
    w.install(maps, w.web())
    for ctx in (testrun.SkBuffCtx(mark=s.TRACE_MARK), _cb_only()):
        testrun.run(datapath.prog_fds["tc_ingress"], bytes(tcp(w.POD_CLIENT, 41000, w.VIP, 80)), ctx=ctx)
    assert all_trace_records(maps) == blank


def test_a_marked_packet_without_the_magic_is_live(datapath, maps):
    w.install(maps, w.web())
    testrun.run(datapath.prog_fds["tc_ingress"], bytes(tcp(w.POD_CLIENT, 41000, w.VIP, 80)),
                ctx=testrun.SkBuffCtx(mark=s.TRACE_MARK))
    assert counted(maps) == {R.FWD_NEW: 1} and maps.connections()


def _cb_only() -> testrun.SkBuffCtx:
    ctx = testrun.SkBuffCtx()
    ctx.cb[0], ctx.cb[1] = s.TRACE_MAGIC, NONCE
    return ctx


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def test_trace_record_layout_is_per_cpu_aligned():
    assert ctypes.sizeof(s.EpxTraceRec) % 8 == 0  # bcc: per-CPU values are 8-byte aligned


# ---- trace_ebpf on a real (throw-away) node: the answer matches what real traffic does ----

from ebpf_proxy.explain.ebpf_trace import TraceError, trace_ebpf  # noqa: E402
from ebpf_proxy.explain.packet import FlowSpec  # noqa: E402
from ebpf_proxy.lab._setns import run_in_netns  # noqa: E402
from ebpf_proxy.model import Protocol  # noqa: E402
from tests.bpf import netlab  # noqa: E402
from tests.bpf.test_attach import BACKEND_PORT, DEAD_VIP, LB_IP, NODE_PORT, PORT, SETTINGS, VIP  # noqa: E402
from tests.bpf.test_attach import lab  # noqa: E402,F401 (the fixture)
from pyroute2 import IPRoute  # noqa: E402

BACKEND = f"{netlab.BACKEND_IP}:{BACKEND_PORT}"


def quiet_state(maps) -> tuple:
    """state(), but without the IPv6 neighbour discovery the lab's veths carry on their own (ICMPv6:
    PASS_IPV6_OFF while the IPv6 path is off, PASS_IPV6_NOT_L4 when on; PASS_NOT_IPV4 for what else
    the veths say)."""
    conns, aff, counts, frag, rev = state(maps)
    noise = (R.PASS_NOT_IPV4, R.PASS_IPV6_NOT_L4, R.PASS_IPV6_OFF)
    return conns, aff, {r: n for r, n in counts.items() if r not in noise}, frag, rev


def node_trace(lab, pin_dir, flow: FlowSpec, **kw):
    return run_in_netns(lab.ns["node"], trace_ebpf, flow, pin_dir, **kw)


def test_trace_ebpf_explains_what_real_packets_do(lab, datapath, maps, pin_dir):
    names = {(VIP, PORT, "TCP"): "default/web:http"}
    before = quiet_state(maps)

    pod = node_trace(lab, pin_dir, FlowSpec(netlab.POD_IP, VIP, PORT, origin="pod"), names=names)
    assert pod.to_json() == {
        "datapath": "ebpf", "verdict": "dnat", "reason": "FWD_NEW: new connection: backend chosen, DNAT",
        "service": "default/web:http", "backends": [BACKEND], "masquerade": False,
        "sourceAfter": netlab.POD_IP, "steps": pod.to_json()["steps"],
    }
    assert [(st.hook, st.unit) for st in pod.steps] == [("tc-ingress", "tc_ingress@vpod"), ("tc-egress", "tc_egress@vbe")]

    out = node_trace(lab, pin_dir, FlowSpec(netlab.OUTSIDE_IP, netlab.NODE_OUTSIDE_SIDE, NODE_PORT, origin="external"))
    assert (out.verdict, out.backends, out.masquerade, out.source_after, out.service) == \
        ("dnat", (BACKEND,), True, netlab.NODE_OUTSIDE_SIDE, None)
    assert [st.hook for st in out.steps] == ["tc-ingress", "tc-egress"], "no XDP on vout: TC alone decides"

    denied = node_trace(lab, pin_dir, FlowSpec(netlab.OUTSIDE_IP, LB_IP, PORT, origin="external"))
    assert (denied.verdict, denied.reason.split(":")[0], [st.hook for st in denied.steps]) == \
        ("drop", "DROP_SOURCE_RANGE", ["tc-ingress"])
    assert "loadBalancerSourceRanges" in denied.sentence()

    dead = node_trace(lab, pin_dir, FlowSpec(netlab.POD_IP, DEAD_VIP, PORT, origin="pod"))
    assert (dead.verdict, dead.reason.split(":")[0], dead.backends) == ("reject", "REJECT", ())

    udp = node_trace(lab, pin_dir, FlowSpec(netlab.POD_IP, VIP, PORT, protocol=Protocol.UDP, origin="pod"))
    assert (udp.verdict, udp.backends) == ("dnat", (BACKEND,))

    assert quiet_state(maps) == before, "tracing wrote nothing"

    # the same flows for real
    assert lab.client("pod", "tcp", VIP, PORT)[1].split(":")[0] == netlab.POD_IP
    assert lab.client("outside", "tcp", netlab.NODE_OUTSIDE_SIDE, NODE_PORT)[1].split(":")[0] == netlab.NODE_OUTSIDE_SIDE
    assert lab.client("pod", "tcp", DEAD_VIP, PORT) == ["error", "ConnectionRefusedError"]


@pytest.mark.parametrize("xdp", ["off", "generic"])
def test_trace_ebpf_runs_xdp_lb_only_where_it_is_attached(lab, datapath, maps, pin_dir, xdp):
    """An outside packet meets xdp_lb only on a device that carries it (the agent's --bpf-xdp-mode
    generic or native; off, the default, attaches none): the trace names the hook that decides,
    and the same packet sent for real is dropped there, for the reason the trace gave."""
    with IPRoute(netns=lab.ns["node"]) as ipr:
        if xdp != "off":
            loader.attach_xdp(ipr, lab.ifindex("vout"), datapath.prog_fds["xdp_lb"], xdp)
        attached = loader.xdp_program_is_ours(ipr, lab.ifindex("vout"))
    assert attached == (xdp != "off")
    first = ["xdp"] if attached else []
    out = node_trace(lab, pin_dir, FlowSpec(netlab.OUTSIDE_IP, netlab.NODE_OUTSIDE_SIDE, NODE_PORT, origin="external"))
    assert (out.verdict, [st.hook for st in out.steps]) == ("dnat", first + ["tc-ingress", "tc-egress"])
    if attached:
        assert out.steps[0].action.startswith("XDP_PASS") and out.steps[0].unit == "xdp_lb@vout"
    denied = node_trace(lab, pin_dir, FlowSpec(netlab.OUTSIDE_IP, LB_IP, PORT, origin="external"))
    assert (denied.verdict, denied.reason.split(":")[0], [st.hook for st in denied.steps]) == \
        ("drop", "DROP_SOURCE_RANGE", first or ["tc-ingress"])
    maps.reset_stats()
    assert lab.client("outside", "tcp", LB_IP, PORT, timeout=1.0) == ["error", "TimeoutError"]
    assert maps.stats()[s.Reason.DROP_SOURCE_RANGE][0] >= 1  # the SYN (and its retransmissions), not answered


@pytest.mark.parametrize("proto", [Protocol.TCP, Protocol.UDP])
def test_trace_ebpf_asks_the_socket_lb_for_node_traffic(lab, datapath, maps, pin_dir, proto):
    cgroup = lab.cgroup()
    maps.set_settings(replace(SETTINGS, host_netns_cookie=lab.netns_cookie("node")))
    loader.attach_cgroup(datapath, cgroup)
    try:
        before = quiet_state(maps)
        host = node_trace(lab, pin_dir, FlowSpec(netlab.NODE_OUTSIDE_SIDE, VIP, PORT, protocol=proto, origin="host"),
                          cgroup=cgroup)
        dead = node_trace(lab, pin_dir, FlowSpec(netlab.NODE_OUTSIDE_SIDE, DEAD_VIP, PORT, protocol=proto,
                                                 origin="host"), cgroup=cgroup)
        assert quiet_state(maps) == before, "the trace socket sent nothing and the program wrote nothing"
        live = lab.client("node", proto.lower, VIP, PORT, cgroup=cgroup)
    finally:
        loader.detach_cgroup(datapath, cgroup)
    hook = "cgroup/sendmsg4" if proto == Protocol.UDP else "cgroup/connect4"
    assert (host.verdict, host.backends, host.masquerade) == ("dnat", (BACKEND,), True)
    assert [st.hook for st in host.steps] == [hook]
    assert host.reason.startswith("SOCK_FWD")
    assert live[0] == "ok" and live[1].split(":")[0] == host.source_after == netlab.NODE_BACKEND_SIDE
    assert (dead.verdict, dead.reason.split(":")[0]) == ("reject", "SOCK_REJECT")


def test_trace_ebpf_explains_sctp(lab, datapath, maps, pin_dir):
    """An SCTP INIT traced like TCP and UDP: DNAT from a pod, masquerade from outside, REJECT
    without endpoints; node-originated SCTP is refused with the reason (no socket LB for it)."""
    sctp = 132
    maps.set_service(Frontend(VIP, PORT, sctp), Service(10 + 6, 1, 0, 0, s.LB4_F_HAS_ENDPOINTS))
    maps.set_service(Frontend(None, NODE_PORT, sctp), Service(10 + 6, 1, 0, 0, s.LB4_F_HAS_ENDPOINTS | s.LB4_F_EXTERNAL))
    maps.set_service(Frontend(DEAD_VIP, PORT, sctp), Service(99, 0, 0, 0, 0))
    before = quiet_state(maps)
    pod = node_trace(lab, pin_dir, FlowSpec(netlab.POD_IP, VIP, PORT, protocol=Protocol.SCTP, origin="pod"))
    assert (pod.verdict, pod.backends, pod.masquerade, pod.reason.split(":")[0]) == ("dnat", (BACKEND,), False, "FWD_NEW")
    assert f"DNAT to {BACKEND}" in pod.steps[0].action
    out = node_trace(lab, pin_dir, FlowSpec(netlab.OUTSIDE_IP, netlab.NODE_OUTSIDE_SIDE, NODE_PORT,
                                            protocol=Protocol.SCTP, origin="external"))
    assert (out.verdict, out.masquerade, [st.hook for st in out.steps]) == ("dnat", True, ["tc-ingress", "tc-egress"])
    dead = node_trace(lab, pin_dir, FlowSpec(netlab.POD_IP, DEAD_VIP, PORT, protocol=Protocol.SCTP, origin="pod"))
    assert (dead.verdict, dead.reason.split(":")[0]) == ("reject", "REJECT")
    with pytest.raises(TraceError, match="node-originated SCTP"):
        node_trace(lab, pin_dir, FlowSpec(netlab.NODE_OUTSIDE_SIDE, VIP, PORT, protocol=Protocol.SCTP, origin="host"))
    assert quiet_state(maps) == before, "tracing wrote nothing"


ITP_VIP, LOCAL_NODE_PORT = "10.96.0.77", 30081  # iTP=Local and eTP=Local, neither with a local endpoint
SOCK_CASES = {  # frontend: (trace verdict, reason, what the live connect() gets)
    "clusterIP": ((VIP, PORT), "dnat", "SOCK_FWD", "ok"),
    "eTP=Local NodePort from the node: any endpoint": ((netlab.NODE_OUTSIDE_SIDE, LOCAL_NODE_PORT), "dnat", "SOCK_FWD", "ok"),
    "iTP=Local without a local endpoint": ((ITP_VIP, PORT), "drop", "DROP_NO_LOCAL_INTERNAL", "PermissionError"),
    "no endpoints": ((DEAD_VIP, PORT), "reject", "SOCK_REJECT", "ConnectionRefusedError"),
}


@pytest.mark.parametrize("name", SOCK_CASES)
def test_socket_lb_dry_run_decides_as_the_live_call(lab, datapath, maps, pin_dir, name):
    (addr, port), verdict, reason, live_outcome = SOCK_CASES[name]
    has, ext = s.LB4_F_HAS_ENDPOINTS, s.LB4_F_EXTERNAL
    maps.set_service(Frontend(None, LOCAL_NODE_PORT, 6), Service(16, 1, 0, 0, has | ext | s.LB4_F_ETP_LOCAL))
    maps.set_service(Frontend(ITP_VIP, PORT, 6), Service(16, 1, 0, 0, has | s.LB4_F_ITP_LOCAL))
    cgroup = lab.cgroup()
    maps.set_settings(replace(SETTINGS, host_netns_cookie=lab.netns_cookie("node")))
    loader.attach_cgroup(datapath, cgroup)
    try:
        before = quiet_state(maps)
        t = node_trace(lab, pin_dir, FlowSpec(netlab.NODE_OUTSIDE_SIDE, addr, port, origin="host"), cgroup=cgroup)
        assert quiet_state(maps) == before
        zero_trace_map(maps)
        live = lab.client("node", "tcp", addr, port, cgroup=cgroup, timeout=1)
        assert all_trace_records(maps) == bytes(len(all_trace_records(maps))), "a live connect() records nothing"
    finally:
        loader.detach_cgroup(datapath, cgroup)
    assert (t.verdict, t.reason.split(":")[0]) == (verdict, reason)
    assert (live[0] if live[0] == "ok" else live[1]) == live_outcome
    if verdict == "dnat":
        assert t.backends == (BACKEND,) and live[1].split(":")[0] == t.source_after


def test_hairpin_backend_set_is_masqueraded(lab, datapath, maps, pin_dir):
    """Rule 3: a pod whose service's only endpoint is itself is masqueraded to the node."""
    maps.set_backend(50, Backend(netlab.POD_IP, 80))
    maps.set_slots(50, s.LB4_SCOPE_CLUSTER, [50])
    maps.set_service(Frontend("10.96.0.50", 80, 6), Service(50, 1, 0, 0, s.LB4_F_HAS_ENDPOINTS))
    t = node_trace(lab, pin_dir, FlowSpec(netlab.POD_IP, "10.96.0.50", 80, origin="pod"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == \
        ("dnat", (f"{netlab.POD_IP}:80",), True, SETTINGS.snat_addr)
    assert "hairpin" in t.steps[-1].action


def test_programs_without_trace_mode_are_refused(datapath, maps):
    """Such a program would take the trace packet for a live one: it must never be run."""
    from ebpf_proxy.explain import ebpf_trace

    fd = libbpf.prog_load(libbpf.PROG_TYPE_SCHED_CLS, libbpf.return_constant_program(0))
    try:
        with pytest.raises(ebpf_trace.TraceError, match="no trace mode"):
            ebpf_trace._check_traceable(maps, fd, "old tc_ingress")
    finally:
        os.close(fd)
    ebpf_trace._check_traceable(maps, datapath.prog_fds["tc_ingress"], "tc_ingress")  # ours passes


def test_a_cgroup_without_the_socket_lb_is_refused(lab, pin_dir):
    """A marked socket in a cgroup the socket LB does not cover would really connect."""
    from ebpf_proxy.explain.ebpf_trace import TraceError

    with pytest.raises(TraceError, match="no sock_connect4 program runs"):
        node_trace(lab, pin_dir, FlowSpec(netlab.NODE_OUTSIDE_SIDE, VIP, PORT, origin="host"), cgroup=lab.cgroup())


def test_a_trace_outside_the_datapaths_netns_is_refused(lab, maps, pin_dir):
    from ebpf_proxy.explain.ebpf_trace import TraceError

    maps.set_settings(replace(SETTINGS, host_netns_cookie=lab.netns_cookie("node")))
    with pytest.raises(TraceError, match="not the network namespace"):
        trace_ebpf(FlowSpec(netlab.POD_IP, VIP, PORT, origin="pod"), pin_dir)  # from this (the test's) netns
