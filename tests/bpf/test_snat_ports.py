"""Masquerade ports under connection churn: a port is busy while the backend may still hold its
tuple, not for as long as the closed connection's entry lives.

The bench's NodePort eTP=Cluster point (one client, ~10k new connections/s, masqueraded) lost
3-5% of its connections: each closed connection kept its port for tcp_close_timeout (10 s), the
4536 ports toward a backend ran out, and SYNs were dropped as SNAT_NO_PORT. These tests replay
whole TCP connections through tc_ingress/tc_egress against a tiny port range, so a port that is
not handed back fails them at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pytest

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import (
    TC_ACT_OK,
    TC_ACT_SHOT,
    assert_checksums_valid,
    counted,
    endpoints,
    once_each,
    run,
    tcp,
)

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
BACKEND = w.REMOTE_EP  # one backend: every connection competes for the same ports


def hop(datapath, maps, prog, pkt, reason, events=()):
    maps.reset_stats()
    out = run(datapath, prog, pkt)
    assert counted(maps) == once_each(reason, events), f"{prog}: {pkt.summary()}"
    assert out.verdict == TC_ACT_OK
    assert_checksums_valid(out.pkt)
    return out.pkt


@dataclass
class Conn:
    """One masqueraded NodePort connection from `client`:`cport`, packet by packet."""

    datapath: object
    maps: object
    client: str
    cport: int
    snat_port: int | None = None

    def forward(self, flags: str, new: bool = False, forgets: bool = False) -> None:
        """`forgets`: this SYN comes on a closed connection's tuple, which it forgets (counted)."""
        pkt = tcp(self.client, self.cport, w.NODE_IP, w.NODE_PORT, flags=flags)
        out = hop(self.datapath, self.maps, "tc_ingress", pkt, R.FWD_NEW if new else R.FWD_ESTABLISHED,
                  events=(R.EV_CT_CLOSED_FORGOTTEN,) if forgets else ())
        out = hop(self.datapath, self.maps, "tc_egress", out, R.SNAT)
        (addr, port), dst = endpoints(out)
        assert addr == w.NODE_IP and dst == BACKEND
        if self.snat_port is None:
            self.snat_port = port
        assert port == self.snat_port, "a connection keeps its masquerade port"

    def reply(self, flags: str) -> None:
        pkt = tcp(*BACKEND, w.NODE_IP, self.snat_port, flags=flags)
        out = hop(self.datapath, self.maps, "tc_ingress", pkt, R.REV_SNAT)
        out = hop(self.datapath, self.maps, "tc_egress", out, R.REV_DNAT)
        assert endpoints(out) == ((w.NODE_IP, w.NODE_PORT), (self.client, self.cport))

    def open(self, reusing: bool = False) -> Conn:
        """`reusing`: the client port's last connection to the NodePort closed and is still tracked."""
        self.forward("S", new=True, forgets=reusing)
        self.reply("SA")
        self.forward("A")
        self.forward("PA")  # the request
        self.reply("PA")  # the answer
        return self

    def client_closes(self) -> None:
        """The loadgen's (and most clients') way: client FIN, backend FIN, client's last ACK."""
        self.forward("FA")
        self.reply("FA")
        self.forward("A")

    def backend_closes(self) -> None:
        """An HTTP server with Connection: close: the backend ends in TIME_WAIT."""
        self.reply("FA")
        self.forward("FA")
        self.reply("A")

    def entry(self):
        return next(c for c in self.maps.connections()
                    if c.kind == s.CT4_SVC and c.saddr == self.client and c.sport == self.cport)


def new_syn(datapath, maps, client, cport):
    """A SYN of a new connection: (verdict, counted reasons, masquerade port or None)."""
    maps.reset_stats()
    out = run(datapath, "tc_ingress", tcp(client, cport, w.NODE_IP, w.NODE_PORT))
    if out.verdict != TC_ACT_OK:
        return out.verdict, counted(maps), None
    reasons = counted(maps)
    fwd = run(datapath, "tc_egress", out.pkt)
    return out.verdict, reasons, endpoints(fwd.pkt)[0][1]


@pytest.fixture
def ports(maps):
    """Masquerade over `n` ports toward the one backend."""
    def use(n: int) -> None:
        maps.set_settings(replace(w.SETTINGS, snat_port_min=61000, snat_port_max=61000 + n - 1))
        w.install(maps, w.web(cluster=(BACKEND,), local=()))
    return use


def test_many_sequential_connections_through_few_ports(datapath, maps, ports):
    """200 connections, one after the other, through 4 ports: each closed connection hands its port
    back at once; the client reuses its own ports too (as tcp_tw_reuse does), so closing entries
    are met by new SYNs on the same tuple. Without the fix the 5th connection is dropped."""
    ports(4)
    used = set()
    for i in range(200):
        conn = Conn(datapath, maps, w.OUTSIDE, 20000 + i % 37).open(reusing=i >= 37)
        used.add(conn.snat_port)
        conn.client_closes()
    assert used <= {61000, 61001, 61002, 61003}
    assert conn.entry().flags & s.CT4_F_DONE
    # the connection table still knows each closed connection (late retransmissions are translated)
    assert any(c.kind == s.CT4_SVC and c.flags & s.CT4_F_CLOSING for c in maps.connections())


def test_live_connections_keep_their_ports(datapath, maps, ports):
    """Reuse is for connections that are over: live ones, half-closed ones included, never lose theirs."""
    ports(2)
    live = Conn(datapath, maps, w.OUTSIDE, 40000).open()
    half = Conn(datapath, maps, w.OUTSIDE, 40001).open()
    half.forward("FA")  # the client is done sending; the backend (CLOSE_WAIT) still holds the tuple
    verdict, reasons, _ = new_syn(datapath, maps, w.OUTSIDE2, 40002)
    assert verdict == TC_ACT_SHOT and reasons == {R.DROP_SNAT_NO_PORT: 1}

    half.reply("FA")  # both FINs, but the backend waits in LAST_ACK for the client's ACK
    verdict, reasons, _ = new_syn(datapath, maps, w.OUTSIDE2, 40002)
    assert verdict == TC_ACT_SHOT and reasons == {R.DROP_SNAT_NO_PORT: 1}

    half.forward("A")  # its last ACK: the backend forgets the tuple
    verdict, reasons, port = new_syn(datapath, maps, w.OUTSIDE2, 40003)
    assert verdict == TC_ACT_OK and reasons == {R.FWD_NEW: 1} and port == half.snat_port
    live.forward("PA")  # and the live one still has its port (forward() checks it)
    live.reply("PA")


def test_reset_connection_frees_its_port(datapath, maps, ports):
    ports(1)
    conn = Conn(datapath, maps, w.OUTSIDE, 40000).open()
    conn.forward("R")
    verdict, reasons, port = new_syn(datapath, maps, w.OUTSIDE2, 40000)
    assert verdict == TC_ACT_OK and reasons == {R.FWD_NEW: 1} and port == 61000


def test_backend_time_wait_ports_are_the_last_resort(datapath, maps, ports):
    """A backend that closed first keeps the tuple in TIME_WAIT (60 s) and refuses a SYN into it
    unless its sequence number or timestamp is newer: its port goes to a new connection only when
    no other is free, and then it is reused rather than the SYN dropped (conntrack lets a new SYN
    reopen a TIME_WAIT tuple the same way)."""
    ports(2)
    waiting = Conn(datapath, maps, w.OUTSIDE, 40000).open()
    waiting.backend_closes()
    entry = waiting.entry()
    assert entry.flags & s.CT4_F_TIME_WAIT and not entry.flags & s.CT4_F_DONE
    assert entry.expires_ns - time.monotonic_ns() > 55 * 10**9, "the entry outlives the backend's TIME_WAIT"

    other = 61001 if waiting.snat_port == 61000 else 61000
    for i in range(20):  # random starts land on the TIME_WAIT port half the time: it is passed over
        conn = Conn(datapath, maps, w.OUTSIDE2, 41000 + i).open()
        assert conn.snat_port == other
        conn.client_closes()

    busy = Conn(datapath, maps, w.OUTSIDE2, 42000).open()
    assert busy.snat_port == other
    last = Conn(datapath, maps, w.OUTSIDE2, 42001).open()  # nothing else is free: TIME_WAIT is reused
    assert last.snat_port == waiting.snat_port
    verdict, reasons, _ = new_syn(datapath, maps, w.OUTSIDE2, 42002)  # now both are live
    assert verdict == TC_ACT_SHOT and reasons == {R.DROP_SNAT_NO_PORT: 1}


def test_close_states(datapath, maps, ports):
    """Lifetimes after the close: conntrack's close timeout when the backend forgot the tuple,
    the backend's TIME_WAIT when it did not."""
    ports(8)
    client_first = Conn(datapath, maps, w.OUTSIDE, 40000).open()
    client_first.client_closes()
    e = client_first.entry()
    assert e.flags & (s.CT4_F_FIN_ORIG | s.CT4_F_FIN_REPLY | s.CT4_F_DONE) == (
        s.CT4_F_FIN_ORIG | s.CT4_F_FIN_REPLY | s.CT4_F_DONE)
    assert not e.flags & s.CT4_F_TIME_WAIT
    left = e.expires_ns - time.monotonic_ns()
    assert 0 < left <= w.SETTINGS.tcp_close_timeout * 10**9

    backend_first = Conn(datapath, maps, w.OUTSIDE, 40001).open()
    backend_first.reply("FA")
    e = backend_first.entry()
    assert e.flags & s.CT4_F_TIME_WAIT and e.flags & s.CT4_F_FIN_REPLY and not e.flags & s.CT4_F_FIN_ORIG
    backend_first.forward("R")  # a reset ends TIME_WAIT on the backend too
    e = backend_first.entry()
    assert e.flags & s.CT4_F_DONE
    assert e.expires_ns - time.monotonic_ns() <= w.SETTINGS.tcp_close_timeout * 10**9
