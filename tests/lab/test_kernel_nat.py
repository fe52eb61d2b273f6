"""The kernel's conntrack as a mode switch reads and writes it (datapath/kernel_nat.py), in a
network namespace of its own: a connection written with its NAT reads back the same, whatever
entry conntrack already had for its translated tuple; removed on request."""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import replace

import pytest

from ebpf_proxy.datapath.kernel_nat import TCP_SYN_SENT, KernelConntrack, NatConnection
from ebpf_proxy.lab._setns import run_in_netns
from tests.netns_util import add_netns, del_netns, nsenter

pytestmark = [pytest.mark.root]

TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
PLAIN = NatConnection(TCP, "10.244.1.5", 40000, "10.96.0.10", 80, "10.244.2.7", 8080, "10.244.1.5", 40000, 300,
                      assured=True)
MASQ = NatConnection(TCP, "203.0.113.5", 40001, "172.20.20.15", 30080, "10.244.2.7", 8080, "172.20.20.15", 61001, 300)
DNS = NatConnection(UDP, "10.244.1.5", 40002, "10.96.0.10", 53, "10.244.2.8", 5353, "10.244.1.5", 40002, 30,
                    seen_reply=False)
HANDSHAKE = replace(PLAIN, client_port=40003, source_port=40003, tcp_state=TCP_SYN_SENT, seen_reply=False)


@pytest.fixture
def netns():
    name = f"epx-knat-{os.getpid()}"
    add_netns(name)
    try:
        yield name
    finally:
        del_netns(name)


def in_ns(netns, fn):
    def call():
        with KernelConntrack() as kernel:
            return fn(kernel)
    return run_in_netns(netns, call)


def listing(netns) -> str:
    return subprocess.run([*nsenter(netns), "conntrack", "-L", "-o", "extended"], capture_output=True, text=True).stdout


def same(a: NatConnection, b: NatConnection) -> bool:
    return replace(a, timeout=0) == replace(b, timeout=0) and abs(a.timeout - b.timeout) <= 2


def test_installed_connections_read_back_the_same(netns):
    conns = [PLAIN, MASQ, DNS, HANDSHAKE]
    got = in_ns(netns, lambda k: ([k.install(c) for c in conns], list(k.dump()))[1])
    by_client = {(c.client, c.client_port): c for c in got}
    assert len(got) == len(conns), listing(netns)
    for conn in conns:
        assert same(by_client[(conn.client, conn.client_port)], conn), (conn, by_client)
    text = listing(netns)
    # the kernel's own view: translated both ways, masquerade included
    assert "src=10.244.2.7 dst=172.20.20.15 sport=8080 dport=61001" in text
    assert "src=10.244.1.5 dst=10.96.0.10 sport=40000 dport=80 src=10.244.2.7 dst=10.244.1.5 sport=8080" in text


def test_install_replaces_the_untranslated_entry_of_the_same_connection(netns):
    """The eBPF mode translated before netfilter looked: conntrack tracked client -> backend as is.
    That entry holds the reply tuple the translated one needs; install moves it out of the way."""
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    def plain_then_install(kernel):
        kernel._ct.entry("add", timeout=60,
                         tuple_orig=NFCTAttrTuple(saddr=PLAIN.client, daddr=PLAIN.backend, proto=TCP,
                                                  sport=PLAIN.client_port, dport=PLAIN.backend_port),
                         tuple_reply=NFCTAttrTuple(saddr=PLAIN.backend, daddr=PLAIN.client, proto=TCP,
                                                   sport=PLAIN.backend_port, dport=PLAIN.client_port))
        kernel.install(PLAIN)
        return list(kernel.dump())

    got = in_ns(netns, plain_then_install)
    assert len(got) == 1 and same(got[0], PLAIN), listing(netns)
    assert listing(netns).count("\n") == 1, "the untranslated entry is gone"


def test_remove(netns):
    def run(kernel):
        kernel.install(PLAIN)
        return kernel.remove(PLAIN), kernel.remove(PLAIN), list(kernel.dump())

    assert in_ns(netns, run) == (True, False, [])


def test_installing_a_connection_again_replaces_it(netns):
    """A clash on the original tuple (a packet made its own entry meanwhile) is retried after
    removing it: the connection written last wins."""
    def run(kernel):
        kernel.install(PLAIN)
        kernel.install(replace(PLAIN, backend="10.244.2.9"))
        return list(kernel.dump())

    assert [c.backend for c in in_ns(netns, run)] == ["10.244.2.9"]
