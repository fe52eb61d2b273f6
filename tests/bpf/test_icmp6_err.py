"""ICMPv6 errors about translated connections (bpf/lib/icmp6_err.h): conntrack's "related" NAT
for IPv6, the twin of test_tc_icmp_errors.py.

Each case opens a real connection through the programs (its epx_ct6 entries are the datapath's
own), sends an ICMPv6 error about one of its packets through tc_ingress then tc_egress, as a node
passes it on, and compares the result byte for byte with the error scapy builds from scratch
with the expected addresses and quote (ICMPv6 checksum recomputed by scapy over the
pseudo-header): once translated, the quote must be *exactly* the packet the receiver of the
error sent (or its prefix), checksums included, because that is what the receiver's stack
matches the error against.

Reference: the kernel's nf_nat_icmpv6_reply_translation (net/netfilter/nf_nat_proto.c): the
quote gets the reverse manip, the outer header the manip of its hook (a router's address becomes
the frontend), the quoted L4 checksum is updated when quoted (TCP: whole header quoted; UDP: when
not 0), the ICMPv6 checksum made valid.
"""

from __future__ import annotations

import pytest
from scapy.layers.inet6 import (
    ICMPv6DestUnreach,
    ICMPv6EchoRequest,
    ICMPv6PacketTooBig,
    ICMPv6ParamProblem,
    ICMPv6TimeExceeded,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    PadN,
)
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps6
from tests.bpf import world6 as w6
from tests.bpf.packets import MAC_NODE, MAC_PEER, counted, hop, run
from tests.bpf.world6 import LB_IP6, NODE6, NODE_PORT, OUTSIDE6, POD6, VIP6, tcp6, udp6

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ROUTER6 = "fd00:77::1"  # a router on the backend's path
LINUX_QUOTE6 = 1280 - 40 - 8  # icmp6_send quotes the offending packet up to a 1280-byte error (IPV6_MIN_MTU)
BIG = b"x" * 1400


def ptb(mtu: int = 1280) -> Packet:
    return ICMPv6PacketTooBig(mtu=mtu)


def port_unreach() -> Packet:
    return ICMPv6DestUnreach(code=4)


def time_exceeded() -> Packet:
    return ICMPv6TimeExceeded(code=0)


def param_problem() -> Packet:
    return ICMPv6ParamProblem(code=0, ptr=7)  # the hop limit: a translation moves no field


def icmp6_error(src: str, dst: str, msg: Packet, offending: bytes, quote: int = LINUX_QUOTE6, ext=()) -> bytes:
    """The frame of an ICMPv6 error src -> dst (`msg`: its type, code and 4-byte field) quoting the
    first `quote` bytes of `offending` (an IPv6 packet), with extension headers `ext` before it;
    every length and the ICMPv6 checksum computed by scapy."""
    l3 = IPv6(src=src, dst=dst, hlim=64, tc=0xE0, fl=0x54321)
    for hdr in ext:
        l3 = l3 / hdr.copy()
    return bytes(Ether(src=MAC_PEER, dst=MAC_NODE) / l3 / msg.copy() / Raw(offending[:quote]))


def ip6_bytes(frame) -> bytes:
    return bytes(Ether(bytes(frame))[IPv6])


@pytest.fixture
def maps6(maps):
    w6.install_node6(maps)
    return maps


def connect(datapath, maps, first: Packet, masq: bool) -> tuple[bytes, bytes, bytes]:
    """Open a connection with `first`: (what the client sent, what tc_ingress made of it (DNAT),
    what reached the backend (masquerade too)), IPv6 packets."""
    dnat = hop(datapath, maps, "tc_ingress", bytes(first), R.FWD_NEW)
    fwd = hop(datapath, maps, "tc_egress", dnat, R.SNAT if masq else R.PASS_NO_SERVICE)
    return ip6_bytes(first), ip6_bytes(dnat), ip6_bytes(fwd)


def answer(datapath, maps, at_backend: bytes, masq: bool) -> tuple[bytes, bytes, bytes]:
    """The backend answers: (what it sent, what tc_ingress made of it (the masquerade undone), what
    reached the client), IPv6 packets."""
    back = w6.reply6(Ether() / IPv6(at_backend))
    unmasq = hop(datapath, maps, "tc_ingress", bytes(back), R.REV_SNAT if masq else R.PASS_NO_SERVICE)
    out = hop(datapath, maps, "tc_egress", unmasq, R.REV_DNAT)
    return ip6_bytes(back), ip6_bytes(unmasq), ip6_bytes(out)


def src_dst(ip6: bytes) -> tuple[str, str]:
    pkt = IPv6(ip6)
    return pkt.src, pkt.dst


# Errors about the client's packets, travelling toward the client. (service, the client's first
# packet, masqueraded, who sends the error, the error, bytes quoted)
HOPS_EXT = (IPv6ExtHdrHopByHop(), IPv6ExtHdrDestOpt())
TOWARD_CLIENT = {
    "packet too big, TCP, pod to clusterIP, from a router": (
        w6.web6(), tcp6(POD6, 40000, VIP6, 80, flags="PA", payload=BIG), False, "router", ptb(), LINUX_QUOTE6),
    "packet too big, TCP, outside to nodePort, masqueraded, from a router": (
        w6.web6(), tcp6(OUTSIDE6, 40000, NODE6, NODE_PORT, flags="PA", payload=BIG), True, "router", ptb(1400),
        LINUX_QUOTE6),
    "packet too big, TCP, outside to LB IP, masqueraded, from the backend": (
        w6.web6(), tcp6(OUTSIDE6, 40000, LB_IP6, 80, flags="PA", payload=BIG), True, "backend", ptb(), LINUX_QUOTE6),
    "port unreachable, UDP, outside to nodePort, masqueraded, from the backend": (
        w6.web6(proto=w6.UDP_P), udp6(OUTSIDE6, 40000, NODE6, NODE_PORT), True, "backend", port_unreach(),
        LINUX_QUOTE6),
    "port unreachable, UDP, pod to clusterIP, from the backend, extension headers quoted": (
        w6.web6(proto=w6.UDP_P), udp6(POD6, 5353, VIP6, 80, ext=HOPS_EXT), False, "backend", port_unreach(),
        LINUX_QUOTE6),
    "time exceeded, TCP SYN, pod to clusterIP, 8 L4 bytes quoted (no TCP checksum)": (
        w6.web6(), tcp6(POD6, 40000, VIP6, 80), False, "router", time_exceeded(), 48),
    "time exceeded, UDP, outside to LB IP, masqueraded, 8 L4 bytes quoted": (
        w6.web6(proto=w6.UDP_P), udp6(OUTSIDE6, 40000, LB_IP6, 80), True, "router", time_exceeded(), 48),
    "parameter problem, TCP, outside to clusterIP, masqueraded, from the backend": (
        w6.web6(), tcp6(OUTSIDE6, 40000, VIP6, 80, flags="PA", payload=b"GET /"), True, "backend", param_problem(),
        LINUX_QUOTE6),
}


@pytest.mark.parametrize("name", TOWARD_CLIENT)
def test_error_about_a_client_packet_reaches_the_client_naming_the_frontend(datapath, maps6, name):
    svc, first, masq, sender, msg, quote = TOWARD_CLIENT[name]
    w6.install6(maps6, svc)
    sent, dnat, at_backend = connect(datapath, maps6, first, masq)
    before = sorted(map(repr, maps6.connections6()))
    client, frontend = src_dst(sent)
    seen_src, backend = src_dst(at_backend)
    origin = ROUTER6 if sender == "router" else backend

    error = icmp6_error(origin, seen_src, msg, at_backend, quote)
    # ingress: a masqueraded client is found again (outer destination and quoted source)
    out = hop(datapath, maps6, "tc_ingress", error, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    assert out == (icmp6_error(origin, client, msg, dnat, quote) if masq else error)
    # egress toward the client: the frontend back, in the quote and as the sender
    out = hop(datapath, maps6, "tc_egress", out, R.ICMP_RELATED)
    assert out == icmp6_error(frontend, client, msg, sent, quote)
    assert sorted(map(repr, maps6.connections6())) == before, "an error changes no connection"


# Errors the client's host sends about a reply, travelling toward the backend (it sent the reply,
# so it must recognise the quote).
TOWARD_BACKEND = {
    "port unreachable, UDP, pod client": (w6.web6(proto=w6.UDP_P), udp6(POD6, 5353, VIP6, 80), False),
    "port unreachable, UDP, outside client via nodePort, masqueraded": (
        w6.web6(proto=w6.UDP_P), udp6(OUTSIDE6, 40000, NODE6, NODE_PORT), True),
    "port unreachable about a TCP SYN-ACK, outside client via LB IP, masqueraded": (
        w6.web6(), tcp6(OUTSIDE6, 40000, LB_IP6, 80), True),
    "port unreachable about a TCP SYN-ACK, pod client": (w6.web6(), tcp6(POD6, 40000, VIP6, 80), False),
}


@pytest.mark.parametrize("name", TOWARD_BACKEND)
def test_error_about_a_reply_reaches_the_backend_naming_its_own_packet(datapath, maps6, name):
    svc, first, masq = TOWARD_BACKEND[name]
    w6.install6(maps6, svc)
    _, _, at_backend = connect(datapath, maps6, first, masq)
    sent, unmasq, at_client = answer(datapath, maps6, at_backend, masq)
    client, frontend = src_dst(ip6_bytes(first))
    seen_src, backend = src_dst(at_backend)

    error = icmp6_error(client, frontend, port_unreach(), at_client)
    # ingress: to the backend, quoting its reply as it left the masquerade behind
    out = hop(datapath, maps6, "tc_ingress", error, R.ICMP_RELATED)
    assert out == icmp6_error(client, backend, port_unreach(), unmasq)
    # egress: a masqueraded backend sees the error come from the masquerade address, about its own packet
    out = hop(datapath, maps6, "tc_egress", out, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    assert out == icmp6_error(seen_src, backend, port_unreach(), sent)


def test_extension_headers_on_the_error_itself_are_walked(datapath, maps6):
    """The error's own hop-by-hop and destination options: the ICMPv6 header lies behind them."""
    w6.install6(maps6, w6.web6())
    sent, _, at_backend = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80, flags="PA", payload=BIG), False)
    error = icmp6_error(ROUTER6, POD6, ptb(), at_backend, ext=HOPS_EXT)
    out = hop(datapath, maps6, "tc_egress", error, R.ICMP_RELATED)
    assert out == icmp6_error(VIP6, POD6, ptb(), sent, ext=HOPS_EXT)


def with_ext(ip6: bytes, ext) -> bytes:
    """The IPv6 packet `ip6` with extension headers `ext` put before its L4 header."""
    pkt = IPv6(ip6)
    l3 = IPv6(src=pkt.src, dst=pkt.dst, hlim=pkt.hlim)
    for hdr in ext:
        l3 = l3 / hdr.copy()
    return bytes(l3 / pkt.payload)


def dest_opts(n: int, pad: int = 4) -> tuple[Packet, ...]:
    """n destination-options headers of pad + 4 bytes each (one PadN option; pad + 4 a multiple of 8)."""
    return tuple(IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * pad)]) for _ in range(n))


# The walk's limits (pkt6.h: EPX_IPV6_MAX_EXTHDRS = 4 headers, EPX_IPV6_MAX_EXTLEN = 256 bytes):
# within them a quote is translated, beyond them it passes untouched, counted.
LIMITS = {
    "4 headers": (dest_opts(4), R.ICMP_RELATED),
    "5 headers": (dest_opts(5), R.PASS_ICMP6_EXTHDRS),
    "256 bytes": (dest_opts(2, pad=124), R.ICMP_RELATED),
    "264 bytes": (dest_opts(2, pad=124) + dest_opts(1), R.PASS_ICMP6_EXTHDRS),
}


@pytest.mark.parametrize("name", LIMITS)
def test_quoted_extension_headers_within_the_walk_are_translated(datapath, maps6, name):
    ext, reason = LIMITS[name]
    w6.install6(maps6, w6.web6())
    sent, _, at_backend = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80, flags="PA", payload=b"y" * 200), False)
    error = icmp6_error(ROUTER6, POD6, ptb(), with_ext(at_backend, ext))
    out = hop(datapath, maps6, "tc_egress", error, reason)
    if reason == R.ICMP_RELATED:
        assert out == icmp6_error(VIP6, POD6, ptb(), with_ext(sent, ext))
    else:
        assert out == error


def test_error_about_no_connection_passes_untouched(datapath, maps6):
    w6.install6(maps6, w6.web6())
    sent, _, _ = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80), False)
    stranger = ip6_bytes(tcp6(POD6, 40001, *w6.REMOTE_EP6))  # another port
    for quoted in (stranger, sent):  # the client's own untranslated packet is no error to translate either
        error = icmp6_error(ROUTER6, POD6, ptb(), quoted)
        for prog in ("tc_ingress", "tc_egress"):
            assert hop(datapath, maps6, prog, error, R.PASS_ICMP_NO_CT) == error


def test_error_about_an_expired_connection_passes_untouched(datapath, maps6):
    """A half left behind by its connection never translates (nat6.h's *_owns predicates)."""
    w6.install6(maps6, w6.web6())
    _, _, at_backend = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80), False)
    for conn in maps6.connections6(kind=s.CT4_SVC):
        assert maps6.delete_connection6(conn)
    assert maps6.connections6(kind=s.CT4_REV_DNAT), "the half is still there"
    error = icmp6_error(ROUTER6, POD6, ptb(), at_backend)
    assert hop(datapath, maps6, "tc_egress", error, R.PASS_ICMP_NO_CT) == error


def damaged_quotes(at_backend: bytes) -> dict[str, tuple[bytes, R]]:
    """Damaged quotes of a real connection's packet, and the reason each must pass under."""
    v4 = bytes([0x45]) + at_backend[1:]
    icmp_in = bytearray(at_backend)
    icmp_in[6] = 58
    fragment = with_ext(at_backend, (IPv6ExtHdrFragment(offset=0, m=1, id=9),))
    long_opt = with_ext(at_backend, dest_opts(1, pad=60))  # 64 bytes of options
    return {
        "IPv6 header cut short": (at_backend[:20], R.PASS_ICMP_MALFORMED),
        "IPv6 header only": (at_backend[:40], R.PASS_ICMP_MALFORMED),
        "4 bytes of the L4 header": (at_backend[:44], R.PASS_ICMP_MALFORMED),
        "not IPv6": (v4, R.PASS_ICMP_MALFORMED),
        "extension header cut short": (long_opt[:40 + 32], R.PASS_ICMP_MALFORMED),
        "extension header's first byte only": (long_opt[:40 + 1], R.PASS_ICMP_MALFORMED),
        "L4 cut short after an extension header": (long_opt[:40 + 64 + 4], R.PASS_ICMP_MALFORMED),
        "a fragment": (fragment, R.PASS_ICMP6_FRAG),
        "an ICMPv6 packet": (bytes(icmp_in), R.PASS_ICMP_NO_CT),
        "5 extension headers": (with_ext(at_backend, dest_opts(5)), R.PASS_ICMP6_EXTHDRS),
        "a chain past 256 bytes": (with_ext(at_backend, dest_opts(1, pad=124) + dest_opts(1, pad=252)),
                                   R.PASS_ICMP6_EXTHDRS),
        "a chain past 256 bytes, cut short in it": (
            with_ext(at_backend, dest_opts(1, pad=124) + dest_opts(1, pad=252))[:40 + 200], R.PASS_ICMP_MALFORMED),
    }


@pytest.mark.parametrize("variant", list(damaged_quotes(ip6_bytes(tcp6(POD6, 40000, *w6.REMOTE_EP6)))))
def test_damaged_quote_passes_untouched_with_its_reason(datapath, maps6, variant):
    w6.install6(maps6, w6.web6())
    _, _, at_backend = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80, payload=b"y" * 40), False)
    quoted, reason = damaged_quotes(at_backend)[variant]
    error = icmp6_error(ROUTER6, POD6, ptb(), quoted)
    for prog in ("tc_ingress", "tc_egress"):
        assert hop(datapath, maps6, prog, error, reason) == error


def test_icmpv6_that_is_not_an_error_passes_as_before(datapath, maps6):
    """Echo is not an error (type >= 128): it quotes nothing and keeps its PASS_IPV6_NOT_L4; so does
    an error too short for its ICMPv6 header."""
    w6.install6(maps6, w6.web6())
    _, _, at_backend = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80), False)
    backend = src_dst(at_backend)[1]
    echo = icmp6_error(backend, POD6, ICMPv6EchoRequest(id=1, seq=1), at_backend)  # an echo carrying those bytes
    short = bytes(Ether(src=MAC_PEER, dst=MAC_NODE) / IPv6(src=ROUTER6, dst=POD6, nh=58) / Raw(b"\x02\x00\x00\x00"))
    for frame in (echo, short):
        for prog in ("tc_ingress", "tc_egress"):
            assert hop(datapath, maps6, prog, frame, R.PASS_IPV6_NOT_L4) == frame


def test_errors_are_left_alone_while_the_ipv6_path_is_off(datapath, maps6):
    """CFG6_F_ON unset (ip6tables serves IPv6): not even parsed."""
    w6.install6(maps6, w6.web6())
    _, _, at_backend = connect(datapath, maps6, tcp6(POD6, 40000, VIP6, 80), False)
    Maps6(maps6).set_config6(NODE6, on=False)
    error = icmp6_error(ROUTER6, POD6, ptb(), at_backend)
    for prog in ("tc_ingress", "tc_egress"):
        assert hop(datapath, maps6, prog, error, R.PASS_IPV6_OFF) == error


@pytest.mark.parametrize("masq", [False, True], ids=["pod-to-clusterIPs", "outside-to-nodePorts"])
def test_errors_about_a_remapped_connection_name_the_port_each_end_knows(datapath, maps6, masq):
    """IPv4's test_tc_icmp_errors twin: a connection whose client port clashed toward its backend
    leaves with another port (CT4_S_REMAP; masqueraded: its masquerade port from DNAT on). An error
    about its packet reaches the client quoting the client's own port, one about its reply reaches
    the backend quoting the port the backend knows, byte for byte."""
    if masq:
        client, first_dst, other = OUTSIDE6, (NODE6, NODE_PORT), (NODE6, NODE_PORT + 1)
        frontends = ((None, NODE_PORT + 1, w6.EXT),)
    else:
        client, first_dst, other = POD6, (VIP6, 80), ("fd00:96::11", 80)
        frontends = ((other[0], 80, 0),)
    w6.install6(maps6, w6.web6(id=1, cluster=(w6.REMOTE_EP6,), proto=w6.UDP_P),
                w6.web6(id=2, frontends=frontends, cluster=(w6.REMOTE_EP6,), proto=w6.UDP_P))
    connect(datapath, maps6, udp6(client, 5353, *first_dst), masq)
    first = udp6(client, 5353, *other)
    maps6.reset_stats()
    out = run(datapath, "tc_ingress", first)
    assert counted(maps6) == {R.FWD_NEW: 1, R.EV_CT_PORT_REMAP: 1}
    dnat = ip6_bytes(out.raw)
    at_backend = ip6_bytes(hop(datapath, maps6, "tc_egress", out.raw, R.SNAT if masq else R.PASS_NO_SERVICE))
    sent = ip6_bytes(first)
    seen_src, backend = src_dst(at_backend)

    error = icmp6_error(backend, seen_src, port_unreach(), at_backend)
    relayed = hop(datapath, maps6, "tc_ingress", error, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    assert relayed == (icmp6_error(backend, client, port_unreach(), dnat) if masq else error)
    relayed = hop(datapath, maps6, "tc_egress", relayed, R.ICMP_RELATED)
    assert relayed == icmp6_error(other[0], client, port_unreach(), sent)

    back, unmasq, at_client = answer(datapath, maps6, at_backend, masq)
    error = icmp6_error(client, other[0], port_unreach(), at_client)
    relayed = hop(datapath, maps6, "tc_ingress", error, R.ICMP_RELATED)
    assert relayed == icmp6_error(client, backend, port_unreach(), unmasq)
    relayed = hop(datapath, maps6, "tc_egress", relayed, R.ICMP_RELATED if masq else R.PASS_ICMP_NO_CT)
    assert relayed == icmp6_error(seen_src, backend, port_unreach(), back)
