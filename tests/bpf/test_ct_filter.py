"""The connection table's presence filter (bpf/lib/common.h, datapath/ebpf/ctfilter.py): the
programs skip an epx_ct4 lookup the filter rules out, so a key the filter lacks is a connection
lost. These tests hold the agent's hash to the programs' (a connection whose only bit is the one
the agent computed keeps working) and show the filter is consulted (an entry no program noted is
not found while a bank is read, and is again once the agent's own write turns the filter off)."""

from __future__ import annotations

import time

import pytest

from ebpf_proxy.datapath.ebpf import ctfilter, libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import endpoints, reply_to, step, tcp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason


def _collect(maps, passes: int = 1) -> None:
    for _ in range(passes):
        maps.collect_connections(time.monotonic_ns())


def test_the_filter_is_off_until_a_collection_renews_a_bank(datapath, maps):
    assert maps.ct_filter().bank() == ctfilter.OFF, "a reset datapath reads no bank"
    _collect(maps)
    assert maps.ct_filter().bank() == 1
    _collect(maps)
    assert maps.ct_filter().bank() == 2, "each pass renews the bank the programs do not read"
    _collect(maps)
    assert maps.ct_filter().bank() == 1


def test_a_connection_vouched_for_only_by_the_agents_bits_keeps_working(datapath, maps):
    """Rule 1's round trip, across two renewals: by then both banks' `made` bits (the programs')
    were zeroed, and only the `seen` bits the agent hashed in Python say the entries exist."""
    w.install(maps, w.web())
    fwd = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    backend = endpoints(fwd)[1]
    _collect(maps, passes=2)
    f = maps.ct_filter()
    assert f.bank() == 2
    keys = [bytes(k) for k, _ in libbpf.map_items_batched(maps._fd("epx_ct4"), s.CT4Key, s.CT4Entry)]
    assert len(keys) == 2 and all(f.may_hold(k) for k in keys)

    ack = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="A"), R.FWD_ESTABLISHED)
    assert endpoints(ack)[1] == backend
    back = step(datapath, maps, "tc_ingress", reply_to(fwd), R.PASS_NO_SERVICE)
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))

    # and one made after the renewals, vouched for by the programs' own `made` bits
    fwd2 = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40001, w.VIP, 80), R.FWD_NEW)
    back2 = step(datapath, maps, "tc_egress", reply_to(fwd2), R.REV_DNAT)
    assert endpoints(back2) == ((w.VIP, 80), (w.POD_CLIENT, 40001))


def test_an_entry_no_program_noted_is_not_looked_up_until_the_agent_turns_the_filter_off(datapath, maps):
    w.install(maps, w.web())
    fwd = step(datapath, maps, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    fd = maps._fd("epx_ct4")
    entries = list(libbpf.map_items_batched(fd, s.CT4Key, s.CT4Entry))
    for key, _ in entries:
        libbpf.map_delete(fd, key)
    _collect(maps, passes=2)  # both banks renewed over an empty table
    for key, entry in entries:  # written behind the filter's back
        libbpf.map_update(fd, key, entry)
    f = maps.ct_filter()
    assert f.bank() != ctfilter.OFF and not any(f.may_hold(bytes(k)) for k, _ in entries)

    # the reply's CT4_REV_DNAT half is in the table, but the filter rules it out: untranslated
    back = step(datapath, maps, "tc_egress", reply_to(fwd), R.PASS_NO_SERVICE)
    assert endpoints(back) == endpoints(reply_to(fwd))

    # the agent's own writes (a mode switch's adopted connections) switch the filter off
    for key, entry in entries:
        maps.put_connection_entry(key, entry)
    assert f.bank() == ctfilter.OFF
    back = step(datapath, maps, "tc_egress", reply_to(fwd), R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))
    _collect(maps)
    assert f.bank() != ctfilter.OFF and all(f.may_hold(bytes(k)) for k, _ in entries), \
        "the next pass read them"


def test_packets_no_service_translates_pass_with_a_bank_read(datapath, maps):
    """Pod to pod, no Service: the filter rules every lookup out, the packet passes untouched."""
    w.install(maps, w.web())
    _collect(maps)
    pkt = tcp(w.POD_CLIENT, 40000, *w.LOCAL_EP)
    out = step(datapath, maps, "tc_ingress", pkt, R.PASS_NO_SERVICE)
    assert endpoints(out) == endpoints(pkt)
    out = step(datapath, maps, "tc_egress", reply_to(pkt), R.PASS_NO_SERVICE)
    assert endpoints(out) == endpoints(reply_to(pkt))


def test_a_pass_that_began_before_the_agents_own_write_leaves_the_filter_off(datapath, maps):
    """The write may have come after the pass's read: committing its bank would hide the entry."""
    _collect(maps)
    f = maps.ct_filter()
    renewal = f.begin()
    key = s.CT4Key(saddr=0x0700F40A, daddr=0x0A00600A, sport=1, dport=2, proto=6, kind=s.CT4_SVC)
    maps.put_connection_entry(key, s.CT4Entry(expires=2**63))
    assert f.commit(renewal) is False and f.bank() == ctfilter.OFF
    _collect(maps)
    assert f.bank() != ctfilter.OFF and f.may_hold(bytes(key)), "the next pass read it"
