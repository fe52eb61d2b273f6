"""ICMP errors about translated connections (bpf/lib/icmp4_err.h): conntrack's "related" NAT.

Each case opens a real connection through the programs (its CT entries are the datapath's own),
sends an ICMP error about one of its packets through tc_ingress then tc_egress, as a node passes
it on, and checks the result byte for byte: outer addresses, the quote, every checksum. The
strongest check is the quote itself: once translated it must be *exactly* the packet the
receiver of the error sent (or the prefix of it the error quotes), checksums included, because
that is what the receiver's stack matches the error against.

Reference: the kernel's nf_nat_icmp_reply_translation (net/netfilter/nf_nat_proto.c): the quote
gets the reverse manip, the outer header the manip of its hook (so a router's address becomes
the frontend), the quoted L4 checksum is updated when quoted (TCP: whole header quoted; UDP:
when not 0), the ICMP checksum made valid.
"""

from __future__ import annotations

import struct

import pytest
from scapy.layers.inet import IP
from scapy.layers.l2 import Ether
from scapy.utils import checksum

from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf.packets import MAC_NODE, MAC_PEER, counted, endpoints, hop, run, tcp, udp

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ROUTER = "192.168.77.1"  # a router on the backend's path
LINUX_QUOTE = 576 - 20 - 8  # icmp_send quotes the offending packet up to a 576-byte error
FRAG_NEEDED, PORT_UNREACH, TIME_EXCEEDED = (3, 4), (3, 3), (11, 0)
OPTS = b"\x94\x04\x00\x00"  # router alert: a quoted header with options


def icmp_error(src: str, dst: str, kind: tuple[int, int], offending: bytes, quote: int = LINUX_QUOTE,
               mtu: int = 0, ttl: int = 64) -> bytes:
    """The frame of an ICMP error about `offending` (an IP packet), quoting its first `quote` bytes."""
    quoted = offending[:quote]
    body = struct.pack("!BBHHH", kind[0], kind[1], 0, 0, mtu) + quoted
    body = body[:2] + struct.pack("!H", checksum(body)) + body[4:]
    outer = IP(src=src, dst=dst, proto=1, ttl=ttl, tos=0xC0, id=4242, flags="DF")
    return bytes(Ether(src=MAC_PEER, dst=MAC_NODE) / IP(bytes(outer / body)))


def ip_bytes(frame) -> bytes:
    return bytes(Ether(bytes(frame))[IP])


def assert_error(frame: bytes, src: str, dst: str, kind: tuple[int, int], quote: bytes, mtu: int = 0) -> None:
    """`frame` is the ICMP error src -> dst quoting exactly `quote`, every checksum valid."""
    ip = Ether(frame)[IP]
    assert (ip.src, ip.dst, ip.proto) == (src, dst, 1)
    fresh = IP(bytes(ip))
    fresh.chksum = None
    assert IP(bytes(fresh)).chksum == ip.chksum, "outer IP checksum"
    icmp = bytes(ip)[ip.ihl * 4 : ip.len]
    assert checksum(icmp) == 0, "ICMP checksum"
    assert (icmp[0], icmp[1]) == kind and struct.unpack("!H", icmp[6:8])[0] == mtu
    assert icmp[8:] == quote, "the quote is not what its receiver sent"
    inner = IP(icmp[8:])
    assert checksum(icmp[8 : 8 + inner.ihl * 4]) == 0, "quoted IP checksum"


def connect(datapath, maps, first, masq: bool) -> tuple[bytes, bytes]:
    """Open a connection with `first`: (what the client sent, what reached the backend)."""
    fwd = hop(datapath, maps, "tc_ingress", first, R.FWD_NEW)
    fwd = hop(datapath, maps, "tc_egress", fwd, R.SNAT if masq else R.PASS_NO_SERVICE)
    return ip_bytes(first), ip_bytes(fwd)


def reply(datapath, maps, to_backend: bytes, proto: int, masq: bool) -> tuple[bytes, bytes]:
    """The backend answers: (what it sent, what reached the client)."""
    pkt = IP(to_backend)
    l4 = pkt.payload
    make = tcp if proto == w.TCP else udp
    kw = dict(flags="SA") if proto == w.TCP else dict(payload=b"pong")
    back = make(pkt.dst, l4.dport, pkt.src, l4.sport, **kw)
    out = hop(datapath, maps, "tc_ingress", back, R.REV_SNAT if masq else R.PASS_NO_SERVICE)
    out = hop(datapath, maps, "tc_egress", out, R.REV_DNAT)
    return ip_bytes(back), ip_bytes(out)


# Errors about the client's packets, travelling toward the client. (name: service, the client's
# first packet, masqueraded, who sends the error: "router" or "backend", kind, quoted bytes)
BIG = b"x" * 1400
TOWARD_CLIENT = {
    "frag needed, TCP, pod to clusterIP, from a router (or this node's forwarding)": (
        w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 80, flags="PA", payload=BIG), False, "router", FRAG_NEEDED, LINUX_QUOTE),
    "frag needed, TCP, outside to nodePort, masqueraded, from a router": (
        w.web(), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT, flags="PA", payload=BIG), True, "router", FRAG_NEEDED,
        LINUX_QUOTE),
    "port unreachable, UDP, outside to nodePort, masqueraded, from the backend": (
        w.web(proto=w.UDP), udp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), True, "backend", PORT_UNREACH, LINUX_QUOTE),
    "port unreachable, UDP, pod to clusterIP, from the backend, IP options quoted": (
        w.web(proto=w.UDP), udp(w.POD_CLIENT, 5353, w.VIP, 80, options=OPTS), False, "backend", PORT_UNREACH,
        LINUX_QUOTE),
    "time exceeded, TCP SYN, pod to clusterIP, 8 bytes quoted (RFC 792)": (
        w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 80), False, "router", TIME_EXCEEDED, 28),
    "time exceeded, UDP, outside to externalIP, masqueraded, 8 bytes quoted": (
        w.web(proto=w.UDP), udp(w.OUTSIDE, 40000, w.EXTERNAL_IP, 80), True, "router", TIME_EXCEEDED, 28),
    "port unreachable, UDP without checksum, outside to LB IP, masqueraded": (
        w.web(proto=w.UDP), udp(w.OUTSIDE, 40000, w.LB_IP, 80, chksum=0), True, "backend", PORT_UNREACH, LINUX_QUOTE),
}


@pytest.mark.parametrize("name", TOWARD_CLIENT)
def test_error_about_a_client_packet_reaches_the_client_naming_the_frontend(datapath, maps, name):
    svc, first, masq, sender, kind, quote = TOWARD_CLIENT[name]
    w.install(maps, svc)
    sent, at_backend = connect(datapath, maps, first, masq)
    before = sorted(map(repr, maps.connections()))
    (client, _), (frontend, _) = endpoints(Ether(bytes(first)))
    seen_src, backend = IP(at_backend).src, IP(at_backend).dst
    mtu = 1200 if kind == FRAG_NEEDED else 0

    error = icmp_error(ROUTER if sender == "router" else backend, seen_src, kind, at_backend, quote, mtu)
    # ingress: a masqueraded client is found again (outer destination and quoted source)
    out = hop(datapath, maps, "tc_ingress", error, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    if not masq:
        assert out == error
    # egress toward the client: the frontend back, in the quote and as the sender
    out = hop(datapath, maps, "tc_egress", out, R.ICMP_RELATED)
    assert_error(out, frontend, client, kind, sent[:quote], mtu)
    assert sorted(map(repr, maps.connections())) == before, "an error changes no connection"


# Errors the client's host sends about a reply, travelling toward the backend (as the backend
# sent the reply, it must recognise the quote).
TOWARD_BACKEND = {
    "port unreachable, UDP, pod client": (w.web(proto=w.UDP), udp(w.POD_CLIENT, 5353, w.VIP, 80), False),
    "port unreachable, UDP, outside client via nodePort, masqueraded": (
        w.web(proto=w.UDP), udp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), True),
    "port unreachable about a TCP SYN-ACK, outside client via LB IP, masqueraded": (
        w.web(), tcp(w.OUTSIDE, 40000, w.LB_IP, 80), True),
}


@pytest.mark.parametrize("name", TOWARD_BACKEND)
def test_error_about_a_reply_reaches_the_backend_naming_its_own_packet(datapath, maps, name):
    svc, first, masq = TOWARD_BACKEND[name]
    w.install(maps, svc)
    proto = w.TCP if first.haslayer("TCP") else w.UDP
    _, at_backend = connect(datapath, maps, first, masq)
    sent, at_client = reply(datapath, maps, at_backend, proto, masq)
    (client, _), (frontend, _) = endpoints(Ether(bytes(first)))
    seen_src, backend = IP(at_backend).src, IP(at_backend).dst

    error = icmp_error(client, frontend, PORT_UNREACH, at_client)
    out = hop(datapath, maps, "tc_ingress", error, R.ICMP_RELATED)  # to the backend, quoting its reply
    out = hop(datapath, maps, "tc_egress", out, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    assert_error(out, seen_src, backend, PORT_UNREACH, sent[:LINUX_QUOTE])


def test_error_about_no_connection_passes_untouched(datapath, maps):
    w.install(maps, w.web())
    sent, _ = connect(datapath, maps, tcp(w.POD_CLIENT, 40000, w.VIP, 80), False)
    stranger = ip_bytes(tcp(w.POD_CLIENT, 40001, w.REMOTE_EP[0], w.REMOTE_EP[1]))  # another port
    for quoted in (stranger, sent):  # the client's own untranslated packet is no error to translate either
        error = icmp_error(ROUTER, w.POD_CLIENT, FRAG_NEEDED, quoted, mtu=1200)
        for prog in ("tc_ingress", "tc_egress"):
            assert hop(datapath, maps, prog, error, R.PASS_ICMP_NO_CT) == error


def test_error_about_an_expired_connection_passes_untouched(datapath, maps):
    """A half left behind by its connection never translates (nat4.h's *_owns predicates)."""
    w.install(maps, w.web())
    _, at_backend = connect(datapath, maps, tcp(w.POD_CLIENT, 40000, w.VIP, 80), False)
    for conn in maps.connections(kind=s.CT4_SVC):
        maps.delete_connection(conn)
    error = icmp_error(ROUTER, w.POD_CLIENT, FRAG_NEEDED, at_backend, mtu=1200)
    assert hop(datapath, maps, "tc_egress", error, R.PASS_ICMP_NO_CT) == error


def quoted_variants(at_backend: bytes) -> dict[str, tuple[bytes, R]]:
    """Damaged quotes of a real connection's packet, and the reason each must pass under."""
    hdr = bytearray(at_backend[:20])
    bad_ihl = bytes([0x44]) + at_backend[1:]
    v6 = bytes([0x65]) + at_backend[1:]
    later_frag = bytearray(at_backend)
    later_frag[6:8] = struct.pack("!H", 185)  # offset 1480: no ports
    icmp_in = bytearray(at_backend)
    icmp_in[9] = 1
    return {
        "IP header cut short": (bytes(hdr[:12]), R.PASS_ICMP_MALFORMED),
        "IP header only": (bytes(hdr), R.PASS_ICMP_MALFORMED),
        "4 bytes of the L4 header": (at_backend[:24], R.PASS_ICMP_MALFORMED),
        "IHL 4": (bad_ihl, R.PASS_ICMP_MALFORMED),
        "not IPv4": (v6, R.PASS_ICMP_MALFORMED),
        "a later fragment": (bytes(later_frag), R.PASS_ICMP_NO_CT),
        "an ICMP packet": (bytes(icmp_in), R.PASS_ICMP_NO_CT),
    }


@pytest.mark.parametrize("variant", list(quoted_variants(b"\x45" + b"\0" * 59)))
def test_damaged_quote_passes_untouched_with_its_reason(datapath, maps, variant):
    w.install(maps, w.web())
    _, at_backend = connect(datapath, maps, tcp(w.POD_CLIENT, 40000, w.VIP, 80, payload=b"y" * 40), False)
    quoted, reason = quoted_variants(at_backend)[variant]
    error = icmp_error(ROUTER, w.POD_CLIENT, FRAG_NEEDED, quoted, mtu=1200)
    for prog in ("tc_ingress", "tc_egress"):
        assert hop(datapath, maps, prog, error, reason) == error


def test_icmp_that_is_not_an_error_passes_as_before(datapath, maps):
    """Echo is not an error: it quotes nothing, and keeps its PASS_NOT_L4."""
    w.install(maps, w.web())
    _, at_backend = connect(datapath, maps, tcp(w.POD_CLIENT, 40000, w.VIP, 80), False)
    echo = icmp_error(w.REMOTE_EP[0], w.POD_CLIENT, (8, 0), at_backend)  # an echo request carrying those bytes
    for prog in ("tc_ingress", "tc_egress"):
        assert hop(datapath, maps, prog, echo, R.PASS_NOT_L4) == echo
    frag = bytearray(icmp_error(w.REMOTE_EP[0], w.POD_CLIENT, FRAG_NEEDED, at_backend, mtu=1200))
    frag[14 + 6] |= 0x20  # more fragments: a fragmented error is not looked into
    frag = _refresh_ip_checksum(bytes(frag))
    for prog in ("tc_ingress", "tc_egress"):
        assert hop(datapath, maps, prog, frag, R.PASS_NOT_L4) == frag


def _refresh_ip_checksum(frame: bytes) -> bytes:
    ip = IP(frame[14:])
    ip.chksum = None
    return frame[:14] + bytes(IP(bytes(ip)))


@pytest.mark.parametrize("masq", [False, True], ids=["pod-to-clusterIPs", "outside-to-nodePorts"])
@pytest.mark.parametrize("proto", [w.TCP, w.UDP])
def test_errors_about_a_remapped_connection_name_the_port_each_end_knows(datapath, maps, proto, masq):
    """A connection whose client port clashed toward its backend leaves with another port
    (CT4_S_REMAP, test_tc_conntrack.py; a masqueraded one with its masquerade port). As
    conntrack's related NAT translates the port with the address (nf_nat_icmp_reply_translation),
    an error about its packet reaches the client quoting the client's own port, and an error
    about its reply reaches the backend quoting the port the backend knows."""
    make = tcp if proto == w.TCP else udp
    if masq:
        client, first_dst, other = w.OUTSIDE, (w.NODE_IP, w.NODE_PORT), (w.NODE_IP, w.NODE_PORT + 1)
        second_svc = w.web(id=2, frontends=((None, w.NODE_PORT + 1, w.EXT),), cluster=(w.REMOTE_EP,), proto=proto)
    else:
        client, first_dst, other = w.POD_CLIENT, (w.VIP, 80), ("10.96.0.11", 80)
        second_svc = w.web(id=2, frontends=((other[0], 80, 0),), cluster=(w.REMOTE_EP,), proto=proto)
    w.install(maps, w.web(id=1, cluster=(w.REMOTE_EP,), proto=proto), second_svc)
    connect(datapath, maps, make(client, 40000, *first_dst), masq)
    first = make(client, 40000, *other)
    maps.reset_stats()
    fwd = run(datapath, "tc_ingress", first)
    assert counted(maps) == {R.FWD_NEW: 1, R.EV_CT_PORT_REMAP: 1}
    at_backend = ip_bytes(hop(datapath, maps, "tc_egress", fwd.raw, R.SNAT if masq else R.PASS_NO_SERVICE))
    sent = ip_bytes(first)
    assert IP(at_backend).payload.sport != 40000

    error = icmp_error(w.REMOTE_EP[0], IP(at_backend).src, PORT_UNREACH, at_backend)
    out = hop(datapath, maps, "tc_ingress", error, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    out = hop(datapath, maps, "tc_egress", out, R.ICMP_RELATED)
    assert_error(out, other[0], client, PORT_UNREACH, sent[:LINUX_QUOTE])

    back, at_client = reply(datapath, maps, at_backend, proto, masq)
    assert IP(at_client).payload.dport == 40000 and (IP(at_client).src, IP(at_client).payload.sport) == other
    error = icmp_error(client, other[0], PORT_UNREACH, at_client)
    out = hop(datapath, maps, "tc_ingress", error, R.ICMP_RELATED)
    out = hop(datapath, maps, "tc_egress", out, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    assert_error(out, IP(at_backend).src, w.REMOTE_EP[0], PORT_UNREACH, back[:LINUX_QUOTE])
