"""Trace mode for IPv6 (bpf/lib/tc6.h, xdp_lb.c's xdp6_run): a dry run of the real programs decides
an IPv6 packet exactly as a live one, records it (the addresses in backend_addr6 / snat_addr6,
TRACE_F_IPV6), and writes nothing: no connection, affinity entry or counter.

The decision table is test_tc_ipv6's own: every case runs as a trace (which must leave the maps as
they were), then live, and the two must agree (xdp_lb's table: test_trace.py, for both families).
The frames `trace` builds itself (ebpf_trace.build_frame) are run through the programs too.
"""

from __future__ import annotations

import ipaddress

import pytest
from scapy.layers.l2 import Ether

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps6, port_int
from ebpf_proxy.explain.ebpf_trace import build_frame
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import Protocol
from tests.bpf import test_tc_ipv6 as tc6
from tests.bpf import world6 as w6
from tests.bpf.family import IPV6
from tests.bpf.packets import TC_ACT_OK, TC_ACT_REDIRECT, counted, run
from tests.bpf.test_tc_ipv6 import maps6  # noqa: F401 (the fixture)
from tests.bpf.test_trace import last_nonce, state, trace_tc
from tests.bpf.world6 import NODE6, NODE_PORT, OUTSIDE6, POD6, VIP6, assert_l4_checksum_valid, endpoints6, rewritten

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason


def state6(maps) -> tuple:
    """Everything a dry run must leave alone (the IPv6 maps' share of test_trace.state)."""
    return state(maps, IPV6)


def rec_addr(rec: s.EpxTraceRec, which: str) -> str:
    return str(ipaddress.IPv6Address(bytes(getattr(rec, f"{which}_addr6"))))


def traced_record(maps, hook: int) -> s.EpxTraceRec:
    rec = maps.trace_record(last_nonce())
    assert rec is not None and rec.hook == hook
    return rec


@pytest.mark.parametrize("case", tc6.CASES, ids=[c.desc for c in tc6.CASES])
def test_dry_run_decides_as_the_live_run(datapath, maps6, case):
    w6.install6(maps6, case.svc)
    before = state6(maps6)
    traced = trace_tc(datapath, "tc_ingress", case.pkt)
    rec = traced_record(maps6, s.HOOK_TC_INGRESS)
    assert state6(maps6) == before, "a trace run writes no connection, affinity entry or counter"

    live = run(datapath, "tc_ingress", case.pkt)
    assert counted(maps6) == {case.reason: 1}, "the live run counts, once"
    assert R(rec.reason) == case.reason
    if case.reason == R.REJECT:  # recorded; the ICMPv6 error is built by live runs only (tc6.h)
        assert (traced.retval, live.verdict) == (TC_ACT_OK, TC_ACT_REDIRECT)
    else:
        assert traced.retval == live.verdict
    if case.reason != R.FWD_NEW:
        assert not rec.flags & s.TRACE_F_BACKEND
        if traced.retval == TC_ACT_OK:
            assert traced.packet == bytes(case.pkt)
        return
    assert rec.flags & s.TRACE_F_POLICY and rec.flags & s.TRACE_F_BACKEND and rec.flags & s.TRACE_F_IPV6
    picked = (rec_addr(rec, "backend"), port_int(rec.backend_port))
    assert picked in case.backends
    assert traced.packet == rewritten(case.pkt, dst=picked), "the traced packet is DNATed to the recorded backend"
    view = Maps6(maps6)
    count = rec.svc_local_count if rec.scope == s.LB4_SCOPE_LOCAL else rec.svc_count
    chosen_among = {view.backend(view.slot(rec.svc_id, rec.scope, i)) for i in range(count)}
    assert {(b.addr, b.port) for b in chosen_among} == set(case.backends), "the trace chose among the live run's set"
    assert bool(rec.masq) == case.masq
    live_conn = next(c for c in maps6.connections6() if c.kind == s.CT4_SVC)
    assert bool(live_conn.flags & s.CT4_F_MASQ) == bool(rec.masq)


def test_established_connection_is_reported_and_not_touched(datapath, maps6):
    w6.install6(maps6, w6.web6())
    fwd = run(datapath, "tc_ingress", w6.tcp6(POD6, 40000, VIP6, 80))
    backend = endpoints6(fwd.pkt)[1]
    before = state6(maps6)
    ack = w6.tcp6(POD6, 40000, VIP6, 80, flags="A")
    traced = trace_tc(datapath, "tc_ingress", ack)
    rec = traced_record(maps6, s.HOOK_TC_INGRESS)
    assert state6(maps6) == before, "the connection's lifetime is not refreshed by a trace"
    assert R(rec.reason) == R.FWD_ESTABLISHED and rec.flags & s.TRACE_F_ESTABLISHED
    assert (rec_addr(rec, "backend"), port_int(rec.backend_port)) == backend
    assert traced.packet == rewritten(ack, dst=backend)


def test_egress_of_a_masqueraded_connection_shows_its_source(datapath, maps6):
    """An established NodePort connection from outside: tc_egress's dry run masquerades the packet
    to the connection's own port and records it (TRACE_F_SNAT, snat_addr6)."""
    w6.install6(maps6, w6.web6())
    fwd = run(datapath, "tc_ingress", w6.tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT)).pkt
    snat_port = endpoints6(run(datapath, "tc_egress", fwd).pkt)[0][1]
    before = state6(maps6)
    traced = trace_tc(datapath, "tc_egress", fwd)
    rec = traced_record(maps6, s.HOOK_TC_EGRESS)
    assert state6(maps6) == before
    assert R(rec.reason) == R.SNAT and rec.flags & s.TRACE_F_SNAT and rec.flags & s.TRACE_F_IPV6
    assert (rec_addr(rec, "snat"), port_int(rec.snat_port)) == (NODE6, snat_port)
    assert traced.packet == rewritten(fwd, src=(NODE6, snat_port))


def test_a_new_connection_finds_nothing_on_egress(datapath, maps6):
    w6.install6(maps6, w6.web6())
    fwd = trace_tc(datapath, "tc_ingress", w6.tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT))
    trace_tc(datapath, "tc_egress", fwd.packet)
    rec = traced_record(maps6, s.HOOK_TC_EGRESS)
    assert R(rec.reason) == R.PASS_NO_SERVICE and not rec.flags & s.TRACE_F_SNAT


def test_affinity_is_read_not_written(datapath, maps6):
    w6.install6(maps6, w6.web6(affinity=10800))
    trace_tc(datapath, "tc_ingress", w6.tcp6(OUTSIDE6, 40000, VIP6, 80))
    assert maps6.affinity6(1, OUTSIDE6) is None
    live = run(datapath, "tc_ingress", w6.tcp6(OUTSIDE6, 40001, VIP6, 80))
    remembered = endpoints6(live.pkt)[1]
    trace_tc(datapath, "tc_ingress", w6.tcp6(OUTSIDE6, 40002, VIP6, 80))
    rec = traced_record(maps6, s.HOOK_TC_INGRESS)
    assert rec.flags & s.TRACE_F_AFFINITY
    assert (rec_addr(rec, "backend"), port_int(rec.backend_port)) == remembered


@pytest.mark.parametrize("proto", [Protocol.TCP, Protocol.UDP])
def test_the_frames_trace_builds_are_decided(datapath, maps6, proto):
    """ebpf_trace.build_frame's IPv6 frames: valid checksums, and the programs take them as the
    packets they stand for (a new connection to the clusterIP)."""
    w6.install6(maps6, w6.web6(proto=w6.TCP_P if proto == Protocol.TCP else w6.UDP_P))
    frame = build_frame(FlowSpec(POD6, VIP6, 80, protocol=proto, origin="pod"))
    assert_l4_checksum_valid(Ether(frame))
    traced = trace_tc(datapath, "tc_ingress", frame)
    rec = traced_record(maps6, s.HOOK_TC_INGRESS)
    assert R(rec.reason) == R.FWD_NEW
    assert endpoints6(Ether(traced.packet))[1] in w6.ALL6
    assert_l4_checksum_valid(Ether(traced.packet))


def test_ipv6_off_is_recorded_and_nothing_decided(datapath, maps6):
    w6.install6(maps6, w6.web6())
    Maps6(maps6).set_config6(NODE6, on=False)
    traced = trace_tc(datapath, "tc_ingress", w6.tcp6(POD6, 40000, VIP6, 80))
    rec = traced_record(maps6, s.HOOK_TC_INGRESS)
    assert R(rec.reason) == R.PASS_IPV6_OFF and not rec.flags & s.TRACE_F_SERVICE
    assert traced.packet == bytes(w6.tcp6(POD6, 40000, VIP6, 80))
