"""Hostile packets through every packet program (xdp_lb, tc_ingress, tc_egress) with BPF_PROG_TEST_RUN.

The property, for each program and each generated frame: the program never mistranslates. Its
output is one of
- the input, byte for byte, under a pass reason (or, for XDP, uncounted);
- a translation the state allows: a packet to a service frontend DNATed to one of that service's
  backends (FWD_NEW), or a packet of one of the connections set up before it translated the
  way that connection says (FWD_ESTABLISHED, SNAT, REV_SNAT, REV_DNAT); only the rewritten
  address and port and the two checksums differ from the input, and the checksums are updated
  exactly (RFC 1624: the one's complement sum over the IP header, and over pseudo-header + L4
  bytes, is what it was, so a valid checksum stays valid and a broken one stays broken);
- kube-proxy's REJECT for the service without endpoints: an ICMP port unreachable from the
  frontend, quoting the packet, with valid checksums;
- for an ICMP error (bpf/lib/icmp4_err.h): translated (ICMP_RELATED) exactly when its reversed
  quote is a packet of a set-up connection that this program translates, and then only the
  outer address, the quote's address and port and the four checksums (outer IP, quoted IP,
  quoted L4 when quoted, ICMP) change, each checksum updated exactly; else untouched, under
  PASS_ICMP_MALFORMED exactly when an independent parser finds the quote cut short or not IPv4;
- for an ICMPv6 error (bpf/lib/icmp6_err.h; this world has no IPv6 connection): untouched, under
  the reason an independent parser (classify_icmp6) gives its quote: cut short or not IPv6, an
  extension-header chain longer than the walk, a fragment, or no connection;
- a drop whose named reason counted once, and only the drops the frame calls for: MALFORMED_IP /
  MALFORMED_L4 exactly when an independent parser (`classify`, the rules of bpf/lib/pkt4.h:
  what the kernel's own IPv4 input would refuse) says the frame is malformed, and the policy
  drops (eTP=Local without a local endpoint) only for that service's frontend.

Frames: well-formed TCP/UDP/SCTP (valid CRC32c) built here (every byte controlled, IP options included), to
frontends, backends, clients, the masquerade address and elsewhere, then mutated: truncated at
any length, IHL, version or total length rewritten, bad IP or L4 checksums, fragments (first and
later), other protocols, other ethertypes (IPv6, ARP, VLAN and QinQ tags), bytes flipped, or
random bytes altogether; and ICMP errors (and other ICMP) quoting such a packet, or a packet of
a set-up connection as it travels, cut at any length or damaged; ICMPv6 errors quoting IPv6
packets behind random extension-header chains. Before each example six connections are set up by real packets (a pod
to the clusterIP and an outside client to the NodePort, masqueraded; TCP, UDP and SCTP), so generated
replies and forward packets hit the reverse paths too.

The cgroup sock_addr programs (connect4, sendmsg4, recvmsg4) see socket calls, not packets:
BPF_PROG_TEST_RUN cannot run them on a frame, so they are not part of this fuzzing.

Bounded: 1,000 examples x 3 programs in ~10 s; EPX_FUZZ_EXAMPLES raises it (see
tests/fuzzing.py).
"""

from __future__ import annotations

import socket
import struct
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from scapy.layers.sctp import crc32c

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf import testrun
from ebpf_proxy.datapath.ebpf.maps import Maps, Maps6
from tests.bpf import world as w
from tests.bpf.packets import MAC_NODE, MAC_PEER, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_PASS
from tests.fuzzing import fuzz, fuzz_examples, fuzz_settings

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
PROGRAMS = ("xdp_lb", "tc_egress", "tc_ingress")  # ingress last: it is the one that creates connections
TCP, UDP, SCTP = socket.IPPROTO_TCP, socket.IPPROTO_UDP, 132
ETH_HLEN = 14

# The world: web (TCP, UDP and SCTP: clusterIP, NodePort, externalIP, LB IP), a service without
# endpoints (REJECT), an eTP=Local NodePort without a local endpoint (DROP from outside), and an
# LB IP with loadBalancerSourceRanges and session affinity (DROP for clients outside the range).
NO_EP_VIP = "10.96.0.20"
LOCAL_ONLY_PORT = 30090
WEB_TCP = w.web()
WEB_UDP = w.web(id=2, proto=UDP)
WEB_SCTP = w.web(id=6, proto=SCTP)
NO_EP = w.Svc(id=3, frontends=((NO_EP_VIP, 80, 0),), flags=0)
ETP_LOCAL = w.Svc(id=4, frontends=((None, LOCAL_ONLY_PORT, w.EXT | s.LB4_F_ETP_LOCAL),), cluster=(w.REMOTE_EP,))
RANGED_LB_IP = "192.0.2.81"
RANGED = w.Svc(id=5, frontends=((RANGED_LB_IP, 443, w.EXT | s.LB4_F_SOURCE_RANGES),), cluster=(w.REMOTE_EP2,),
               ranges=("203.0.113.0/24",), affinity=60)  # loadBalancerSourceRanges and ClientIP affinity
SERVICES = (WEB_TCP, WEB_UDP, WEB_SCTP, NO_EP, ETP_LOCAL, RANGED)
NODE_ADDRS = (w.NODE_IP, w.NODE_IP2)


def frontend_of(daddr: str, dport: int, proto: int) -> w.Svc | None:
    """The service a packet to daddr:dport/proto addresses (lb4_lookup_service's rule)."""
    for svc in SERVICES:
        if svc.proto != proto:
            continue
        for addr, port, _ in svc.frontends:
            if port == dport and (addr == daddr or (addr is None and daddr in NODE_ADDRS)):
                return svc
    return None


# ---- frames, byte by byte ------------------------------------------------------------------------


def ones_sum(data: bytes) -> int:
    """The 16-bit one's complement sum (end-around carry) of `data`, zero-padded to even length."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def checksum(data: bytes) -> int:
    return ~ones_sum(data) & 0xFFFF


def ip4(addr: str) -> bytes:
    return socket.inet_aton(addr)


def pseudo(src: bytes, dst: bytes, proto: int, length: int) -> bytes:
    return src + dst + struct.pack("!BBH", 0, proto, length)


@dataclass(frozen=True)
class Spec:
    """A well-formed IPv4 frame before mutation."""

    src: str
    sport: int
    dst: str
    dport: int
    proto: int
    options: bytes = b""
    payload: bytes = b""
    ip_id: int = 1
    frag: int = 0  # fragment offset (8-byte units)
    more: bool = False
    tcp_flags: int = 0x02
    udp_no_csum: bool = False

    def frame(self) -> bytes:
        src, dst = ip4(self.src), ip4(self.dst)
        if self.proto == TCP:
            l4 = struct.pack("!HHIIBBHHH", self.sport, self.dport, 1000, 0, 5 << 4, self.tcp_flags, 65535, 0, 0)
            csum_at = 16
        elif self.proto == UDP:
            l4 = struct.pack("!HHHH", self.sport, self.dport, 8 + len(self.payload), 0)
            csum_at = 6
        elif self.proto == SCTP:
            l4, csum_at = struct.pack("!HHII", self.sport, self.dport, 1, 0), None  # CRC32c below
        else:
            l4, csum_at = struct.pack("!HH", self.sport, self.dport), None
        l4 += self.payload
        if self.proto == SCTP:
            l4 = l4[:8] + struct.pack(">I", crc32c(l4)) + l4[12:]
        if csum_at is not None and not (self.proto == UDP and self.udp_no_csum):
            c = checksum(pseudo(src, dst, self.proto, len(l4)) + l4)
            if self.proto == UDP and c == 0:
                c = 0xFFFF
            l4 = l4[:csum_at] + struct.pack("!H", c) + l4[csum_at + 2:]
        if self.frag:
            l4 = self.payload  # a later fragment carries no L4 header
        hlen = 20 + len(self.options)
        flags = (0x2000 if self.more else 0) | self.frag
        hdr = struct.pack("!BBHHHBBH4s4s", 0x40 | hlen // 4, 0, hlen + len(l4), self.ip_id, flags, 64, self.proto, 0,
                          src, dst) + self.options
        hdr = hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:]
        return eth(0x0800) + hdr + l4


def eth(ethertype: int) -> bytes:
    return bytes.fromhex(MAC_NODE.replace(":", "")) + bytes.fromhex(MAC_PEER.replace(":", "")) + \
        struct.pack("!H", ethertype)


def patch(frame: bytes, offset: int, data: bytes) -> bytes:
    if offset >= len(frame):
        return frame
    return frame[:offset] + data[:len(frame) - offset] + frame[offset + len(data):]


# ---- the independent parser: what the frame is ----------------------------------------------------

NOT_IPV4, MALFORMED_IP, NOT_L4, MALFORMED_L4 = "not-ipv4", "malformed-ip", "not-l4", "malformed-l4"


@dataclass(frozen=True)
class Parsed:
    src: str
    dst: str
    proto: int
    ip_id: int
    hlen: int
    later: bool  # a later fragment: no L4 header
    first: bool  # a first fragment (MF set, offset 0)
    sport: int = 0
    dport: int = 0

    @property
    def l4_off(self) -> int:
        return ETH_HLEN + self.hlen


def classify(frame: bytes) -> str | Parsed:
    """The frame as the IPv4 input path sees it (RFC 791/793/768; the kernel's ip_rcv_core checks):
    not IPv4; a malformed IP header (version, IHL < 5, total length below the header or beyond
    the frame); not TCP/UDP/SCTP; a TCP/UDP/SCTP header cut short (or data offset < 5); else the tuple."""
    if len(frame) < ETH_HLEN or frame[12:14] != b"\x08\x00":
        return NOT_IPV4
    ip = frame[ETH_HLEN:]
    if len(ip) < 20:
        return MALFORMED_IP
    hlen, tot = (ip[0] & 15) * 4, struct.unpack("!H", ip[2:4])[0]
    if ip[0] >> 4 != 4 or hlen < 20 or tot < hlen or tot > len(ip):
        return MALFORMED_IP
    proto, frag = ip[9], struct.unpack("!H", ip[6:8])[0]
    base = dict(src=socket.inet_ntoa(ip[12:16]), dst=socket.inet_ntoa(ip[16:20]), proto=proto,
                ip_id=struct.unpack("!H", ip[4:6])[0], hlen=hlen, later=bool(frag & 0x1FFF),
                first=bool(frag & 0x2000) and not frag & 0x1FFF)
    if proto not in (TCP, UDP, SCTP):
        return NOT_L4
    if base["later"]:
        return Parsed(**base)
    l4 = ip[hlen:]
    need = 20 if proto == TCP else 12 if proto == SCTP else 8
    if len(l4) < need or tot < hlen + need or (proto == TCP and l4[12] >> 4 < 5):
        return MALFORMED_L4
    sport, dport = struct.unpack("!HH", l4[:4])
    return Parsed(**base, sport=sport, dport=dport)


IPV6_EXTHDRS = {0: 8, 43: 8, 60: 8, 51: 4}  # hop-by-hop, routing, destination options, AH: their length unit
IPV6_MAX_EXTHDRS, IPV6_MAX_EXTLEN = 4, 256  # bpf/lib/pkt6.h: what the walk takes
ICMP6 = 58


def walk6(ip: bytes, off: int, nh: int, end: int) -> tuple[int, int, str]:
    """bpf/lib/pkt6.h's extension-header walk over `ip` from `off` (next header `nh`), the packet
    (or quote) ending at `end`: (next header, L4 offset, "") when it reached an upper layer; "cut"
    for a header cut short, "long" for a chain longer than the walk takes, "frag" for a fragment
    header."""
    ext_end = off + IPV6_MAX_EXTLEN
    for _ in range(IPV6_MAX_EXTHDRS):
        if nh not in IPV6_EXTHDRS:
            break
        if off + 2 > end:
            return nh, off, "cut"
        nh, off = ip[off], off + (ip[off + 1] + (2 if nh == 51 else 1)) * IPV6_EXTHDRS[nh]
        if off > end:
            return nh, off, "cut"
        if off > ext_end:
            return nh, off, "long"
    if nh == 44:
        return nh, off, "frag"
    return nh, off, "long" if nh in IPV6_EXTHDRS else ""


def classify6(frame: bytes) -> R:
    """What the IPv6 path (bpf/lib/pkt6.h, RFC 8200) must count for an IPv6 frame when no IPv6
    service or connection exists (this world programs IPv4 only): a malformed IPv6 or extension
    header, a chain longer than the walk, a fragment, an ICMPv6 message (classify_icmp6), not
    TCP/UDP/SCTP, a TCP/UDP/SCTP header cut short, else nothing of ours."""
    ip = frame[ETH_HLEN:]
    if len(ip) < 40 or ip[0] >> 4 != 6 or 40 + struct.unpack("!H", ip[4:6])[0] > len(ip):
        return R.DROP_MALFORMED_IPV6
    end = 40 + struct.unpack("!H", ip[4:6])[0]
    nh, off, walk = walk6(ip, 40, ip[6], end)
    if walk:
        return {"cut": R.DROP_MALFORMED_IPV6, "long": R.DROP_IPV6_EXTHDRS, "frag": R.PASS_IPV6_FRAG}[walk]
    if nh == ICMP6:
        return classify_icmp6(ip, off, end)
    if nh not in (TCP, UDP, SCTP):
        return R.PASS_IPV6_NOT_L4
    need = 20 if nh == TCP else 12 if nh == SCTP else 8
    if end < off + need or (nh == TCP and ip[off + 12] >> 4 < 5):
        return R.DROP_MALFORMED_L4
    return R.PASS_NO_SERVICE


def classify_icmp6(ip: bytes, off: int, end: int) -> R:
    """What the IPv6 path must count for an ICMPv6 message at `off` of the IPv6 packet `ip` whose
    payload ends at `end` (bpf/lib/icmp6_err.h; this world has no IPv6 connection, so an error is
    never translated): not an error (type >= 128, RFC 4443) or too short for its header; a quote
    cut short or not IPv6; a quoted chain longer than the walk takes (pkt6.h's limits), a quoted
    fragment; else no connection."""
    if end < off + 8 or ip[off] >= 128:
        return R.PASS_IPV6_NOT_L4
    q = off + 8
    if end < q + 40 or ip[q] >> 4 != 6:
        return R.PASS_ICMP_MALFORMED
    nh, qoff, walk = walk6(ip, q + 40, ip[q + 6], end)
    if walk:
        return {"cut": R.PASS_ICMP_MALFORMED, "long": R.PASS_ICMP6_EXTHDRS, "frag": R.PASS_ICMP6_FRAG}[walk]
    if nh in (TCP, UDP, SCTP) and end < qoff + 8:
        return R.PASS_ICMP_MALFORMED
    return R.PASS_ICMP_NO_CT


# ---- the state the example runs against ----------------------------------------------------------


@dataclass
class Conn:
    """A connection set up before the example: client -> frontend, DNATed to backend, and (when
    masqueraded) leaving toward the backend as snat_addr:snat_port."""

    proto: int
    client: tuple[str, int]
    frontend: tuple[str, int]
    backend: tuple[str, int]
    snat: tuple[str, int] | None = None


@dataclass
class World:
    conns: list[Conn] = field(default_factory=list)
    # first fragments translated in this example: (src, dst, id, proto, program) -> new address
    fragments: dict[tuple, str] = field(default_factory=dict)


def _tuple(frame: bytes) -> tuple[tuple[str, int], tuple[str, int]]:
    p = classify(frame)
    assert isinstance(p, Parsed), p
    return (p.src, p.sport), (p.dst, p.dport)


def _run(datapath, prog: str, frame: bytes) -> testrun.RunResult:
    return testrun.run(datapath.prog_fds[prog], frame)


def set_up(datapath, maps: Maps) -> World:
    """Blank connection state, then six connections made by real packets (TCP, UDP, SCTP)."""
    for name in ("epx_ct4", "epx_frag4", "epx_affinity"):
        maps.clear(name)
    Maps6(maps).set_config6(None, on=True)  # the IPv6 path on (CFG6_F_ON), no IPv6 service: its parser is what is fuzzed
    world = World()
    for proto in (TCP, UDP, SCTP):
        for client, frontend in (((w.POD_CLIENT, 40000), (w.VIP, 80)),
                                 ((w.OUTSIDE, 40001), (w.NODE_IP, w.NODE_PORT))):
            syn = Spec(client[0], client[1], frontend[0], frontend[1], proto, payload=b"x").frame()
            fwd = _run(datapath, "tc_ingress", syn)
            assert fwd.retval == TC_ACT_OK
            backend = _tuple(fwd.packet)[1]
            out = _run(datapath, "tc_egress", fwd.packet)
            src = _tuple(out.packet)[0]
            world.conns.append(Conn(proto, client, frontend, backend, snat=src if src != client else None))
    assert [c.snat is not None for c in world.conns] == [False, True] * 3
    return world


def allowed(world: World, reason: R, p: Parsed, prog: str) -> tuple[str, set[tuple[str, int]]]:
    """Which side `reason` may rewrite for the packet `p`, and to what (address, port)."""
    src, dst = (p.src, p.sport), (p.dst, p.dport)
    if p.later:  # no ports: follows its first fragment's translation in this program, if any
        addr = world.fragments.get((p.src, p.dst, p.ip_id, p.proto, prog))
        side = "src" if reason in (R.SNAT, R.REV_DNAT) else "dst"
        addrs = addr if isinstance(addr, set) else {addr} if addr else set()  # a set: see DROP_SCTP_FRAG
        return side, {(a, 0) for a in addrs}
    mine = [c for c in world.conns if c.proto == p.proto]
    if reason == R.FWD_NEW:
        svc = frontend_of(p.dst, p.dport, p.proto)
        return "dst", set(svc.cluster) | set(svc.local) if svc else set()
    if reason == R.FWD_ESTABLISHED:
        return "dst", {c.backend for c in mine if (c.client, c.frontend) == (src, dst)}
    if reason == R.REV_SNAT:
        return "dst", {c.client for c in mine if c.snat and (c.backend, c.snat) == (src, dst)}
    if reason == R.SNAT:
        return "src", {c.snat for c in mine if c.snat and (c.client, c.backend) == (src, dst)}
    if reason == R.REV_DNAT:
        return "src", {c.frontend for c in mine if (c.backend, c.client) == (src, dst)}
    return "", set()


# ---- the oracle ----------------------------------------------------------------------------------

TRANSLATIONS = (R.FWD_NEW, R.FWD_ESTABLISHED, R.SNAT, R.REV_SNAT, R.REV_DNAT)


def check_translation(frame: bytes, out: bytes, p: Parsed, side: str, targets: set[tuple[str, int]]) -> None:
    """`out` is `frame` with `side`'s address (and port) rewritten to one of `targets`, checksums
    updated exactly, nothing else touched."""
    assert len(out) == len(frame), "a translation must not change the length"
    addr_at = ETH_HLEN + (12 if side == "src" else 16)
    port_at = p.l4_off + (0 if side == "src" else 2)
    new_addr = socket.inet_ntoa(out[addr_at:addr_at + 4])
    new_port = 0 if p.later else struct.unpack("!H", out[port_at:port_at + 2])[0]
    assert (new_addr, new_port) in targets, f"{side} rewritten to {new_addr}:{new_port}, allowed: {sorted(targets)}"
    csum_at = p.l4_off + (16 if p.proto == TCP else 8 if p.proto == SCTP else 6)
    csum_len = 4 if p.proto == SCTP else 2
    may_change = set(range(addr_at, addr_at + 4)) | {ETH_HLEN + 10, ETH_HLEN + 11}
    if not p.later:
        may_change |= {port_at, port_at + 1, *range(csum_at, csum_at + csum_len)}
    changed = {i for i in range(len(frame)) if frame[i] != out[i]}
    assert changed <= may_change, f"bytes {sorted(changed - may_change)} changed beyond the rewritten fields"
    ip_end = ETH_HLEN + p.hlen
    assert ones_sum(frame[ETH_HLEN:ip_end]) % 0xFFFF == ones_sum(out[ETH_HLEN:ip_end]) % 0xFFFF, \
        "IP checksum not updated for the rewrite"
    if p.later:
        return
    tot = struct.unpack("!H", frame[ETH_HLEN + 2:ETH_HLEN + 4])[0]
    end = ETH_HLEN + tot
    if p.proto == SCTP:  # CRC32c over the SCTP packet, no pseudo-header; a 0 field stays 0 (offloaded)
        def valid(f: bytes) -> bool:
            return crc32c(f[p.l4_off:p.l4_off + 8] + bytes(4) + f[p.l4_off + 12:end]) == \
                struct.unpack(">I", f[csum_at:csum_at + 4])[0]
        if frame[csum_at:csum_at + 4] == bytes(4):
            assert out[csum_at:csum_at + 4] == bytes(4), "a pending (0) CRC32c must stay 0"
        elif not p.first:
            assert valid(out) == valid(frame), "SCTP CRC32c not updated for the rewrite"
        return
    old_csum = struct.unpack("!H", frame[csum_at:csum_at + 2])[0]
    new_csum = struct.unpack("!H", out[csum_at:csum_at + 2])[0]
    if p.proto == UDP and old_csum == 0:
        assert new_csum == 0, "UDP without a checksum must stay without one"
        return
    if p.proto == UDP:
        assert new_csum != 0, "a UDP checksum must not become 0 (no checksum)"

    def l4_sum(f: bytes) -> int:
        return ones_sum(pseudo(f[ETH_HLEN + 12:ETH_HLEN + 16], f[ETH_HLEN + 16:ETH_HLEN + 20], p.proto, tot - p.hlen)
                        + f[p.l4_off:end])
    assert l4_sum(frame) % 0xFFFF == l4_sum(out) % 0xFFFF, "L4 checksum not updated for the rewrite"


def check_reject(frame: bytes, out: bytes, p: Parsed) -> None:
    """kube-proxy's REJECT: ICMP port unreachable from the frontend to the client, quoting the IP
    header and 8 bytes of the packet, every checksum valid."""
    assert out[:6] == frame[6:12] and out[6:12] == frame[:6], "Ethernet addresses not swapped"
    ihl = (out[ETH_HLEN] & 15) * 4
    ip, icmp = out[ETH_HLEN:ETH_HLEN + ihl], out[ETH_HLEN + ihl:]
    assert checksum(ip) == 0, "ICMP error's IP checksum invalid"
    assert ip[9] == socket.IPPROTO_ICMP and socket.inet_ntoa(ip[12:16]) == p.dst and socket.inet_ntoa(ip[16:20]) == p.src
    assert icmp[:2] == b"\x03\x03", "not a port unreachable"
    assert checksum(icmp) == 0, "ICMP checksum invalid"
    assert icmp[8:] == frame[ETH_HLEN:ETH_HLEN + p.hlen + 8], "quote is not the packet's header + 8 bytes"


ICMP_ERRORS = (3, 4, 5, 11, 12)  # the kernel's icmp_is_err
ICMP_MALFORMED, ICMP_OTHER, ICMP_NOT_ERROR = "icmp-malformed", "icmp-other", "icmp-not-error"


@dataclass(frozen=True)
class Quote:
    """An ICMP error's quoted packet: its tuple and where its fields lie in the frame."""

    src: str
    dst: str
    sport: int
    dport: int
    proto: int
    ip_off: int  # the quoted IP header
    l4_off: int
    icmp_off: int
    end: int  # the end of the outer datagram
    l4_csum_at: int | None  # the quoted L4 checksum, when quoted and in use


def classify_icmp(frame: bytes, p_hlen: int) -> str | Quote:
    """An IPv4 ICMP frame (classify said NOT_L4) as an ICMP error (RFC 792): not an error (or a
    fragment of one, or too short for its ICMP header); a quote that is cut short (an IP header
    and 8 bytes of L4 are required) or not IPv4 with IHL >= 5; a quote of a later fragment or of
    neither TCP, UDP nor SCTP; else the quote (SCTP's CRC32c is never rewritten: icmp4_err.h)."""
    ip = frame[ETH_HLEN:]
    tot = struct.unpack("!H", ip[2:4])[0]
    end = ETH_HLEN + tot
    icmp_off = ETH_HLEN + p_hlen
    if struct.unpack("!H", ip[6:8])[0] & 0x3FFF or end < icmp_off + 8 or frame[icmp_off] not in ICMP_ERRORS:
        return ICMP_NOT_ERROR
    q = icmp_off + 8
    if end < q + 20 or frame[q] >> 4 != 4 or (frame[q] & 15) < 5:
        return ICMP_MALFORMED
    qhlen = (frame[q] & 15) * 4
    proto = frame[q + 9]
    if proto not in (TCP, UDP, SCTP) or struct.unpack("!H", frame[q + 6:q + 8])[0] & 0x1FFF:
        return ICMP_OTHER
    l4 = q + qhlen
    if end < l4 + 8:
        return ICMP_MALFORMED
    sport, dport = struct.unpack("!HH", frame[l4:l4 + 4])
    csum_at = None
    if proto == UDP and frame[l4 + 6:l4 + 8] != b"\0\0":
        csum_at = l4 + 6
    elif proto == TCP and end >= l4 + 20:
        csum_at = l4 + 16
    return Quote(socket.inet_ntoa(frame[q + 12:q + 16]), socket.inet_ntoa(frame[q + 16:q + 20]), sport, dport, proto,
                 q, l4, icmp_off, end, csum_at)


def icmp_targets(world: World, q: Quote, prog: str) -> tuple[str, set[tuple[str, int]]]:
    """The translation an error quoting `q` may get in `prog`: the one the reversed quote (the
    packet the error answers) gets, first of the program's two lookups that applies."""
    reversed_quote = Parsed(q.dst, q.src, q.proto, 0, 20, later=False, first=False, sport=q.dport, dport=q.sport)
    order = (R.SNAT, R.REV_DNAT) if prog == "tc_egress" else (R.REV_SNAT, R.FWD_ESTABLISHED)
    for reason in order:
        side, targets = allowed(world, reason, reversed_quote, prog)
        if targets:
            return side, targets
    return "", set()


def check_icmp_translation(frame: bytes, out: bytes, p_hlen: int, q: Quote, side: str,
                           targets: set[tuple[str, int]]) -> None:
    """The outer `side` and the quote's other side rewritten to one of `targets`; nothing else
    but the four checksums changed, each updated exactly (its one's complement sum kept)."""
    assert len(out) == len(frame), "a translation must not change the length"
    outer_at = ETH_HLEN + (12 if side == "src" else 16)
    q_addr_at = q.ip_off + (16 if side == "src" else 12)
    q_port_at = q.l4_off + (2 if side == "src" else 0)
    new = (socket.inet_ntoa(out[q_addr_at:q_addr_at + 4]), struct.unpack("!H", out[q_port_at:q_port_at + 2])[0])
    assert new in targets, f"quote rewritten to {new}, allowed: {sorted(targets)}"
    assert out[outer_at:outer_at + 4] == ip4(new[0]), "the outer address is not the quote's new one"
    may_change = {*range(outer_at, outer_at + 4), ETH_HLEN + 10, ETH_HLEN + 11, *range(q_addr_at, q_addr_at + 4),
                  q_port_at, q_port_at + 1, q.ip_off + 10, q.ip_off + 11, q.icmp_off + 2, q.icmp_off + 3}
    if q.l4_csum_at:
        may_change |= {q.l4_csum_at, q.l4_csum_at + 1}
    changed = {i for i in range(len(frame)) if frame[i] != out[i]}
    assert changed <= may_change, f"bytes {sorted(changed - may_change)} changed beyond the rewritten fields"
    same = lambda a, b: ones_sum(a) % 0xFFFF == ones_sum(b) % 0xFFFF  # noqa: E731
    assert same(frame[ETH_HLEN:ETH_HLEN + p_hlen], out[ETH_HLEN:ETH_HLEN + p_hlen]), "outer IP checksum"
    qhlen = q.l4_off - q.ip_off
    assert same(frame[q.ip_off:q.ip_off + qhlen], out[q.ip_off:q.ip_off + qhlen]), "quoted IP checksum"
    assert same(frame[q.icmp_off:q.end], out[q.icmp_off:q.end]), "ICMP checksum"
    if q.l4_csum_at:  # the fields the quoted L4 checksum covers that changed: addresses, ports
        covered = lambda f: f[q.ip_off + 12:q.ip_off + 20] + f[q.l4_off:q.l4_off + 4] + \
            f[q.l4_csum_at:q.l4_csum_at + 2]  # noqa: E731
        assert same(covered(frame), covered(out)), "quoted L4 checksum"
        if q.proto == UDP:
            assert out[q.l4_csum_at:q.l4_csum_at + 2] != b"\0\0", "a UDP checksum must not become 0"
    elif q.proto == UDP:
        csum_at = q.l4_off + 6
        assert out[csum_at:csum_at + 2] == frame[csum_at:csum_at + 2], "UDP without a checksum must stay so"


def judge_icmp(world: World, prog: str, frame: bytes, out: bytes, reason: R) -> None:
    p_hlen = (frame[ETH_HLEN] & 15) * 4
    q = classify_icmp(frame, p_hlen)
    if q == ICMP_NOT_ERROR:
        assert reason == R.PASS_NOT_L4, f"ICMP that is no error got {reason.name}"
    elif q == ICMP_MALFORMED:
        assert reason == R.PASS_ICMP_MALFORMED, f"error with a damaged quote got {reason.name}"
    elif q == ICMP_OTHER:
        assert reason == R.PASS_ICMP_NO_CT, f"error quoting a fragment or another protocol got {reason.name}"
    else:
        side, targets = icmp_targets(world, q, prog)
        assert reason == (R.ICMP_RELATED if targets else R.PASS_ICMP_NO_CT), \
            f"error quoting {q.src}:{q.sport} -> {q.dst}:{q.dport} got {reason.name}, translations: {targets}"
        if targets:
            check_icmp_translation(frame, out, p_hlen, q, side, targets)
            return
    assert out == frame, f"{reason.name} modified the frame"


def judge(world: World, prog: str, frame: bytes, verdict: int, out: bytes, counted: dict[R, int]) -> None:
    """Raise AssertionError unless (verdict, output, counters) is an outcome the frame allows."""
    kind = classify(frame)
    xdp = prog == "xdp_lb"
    if xdp and verdict == XDP_PASS:
        assert counted == {}, f"XDP passed and counted {counted}"
        assert out == frame, "XDP passed a modified frame"
        return
    assert len(counted) == 1 and sum(counted.values()) == 1, f"expected one reason counted once, got {counted}"
    (reason,) = counted
    expect_verdict = (XDP_DROP if xdp else TC_ACT_SHOT) if reason.is_drop else \
        TC_ACT_REDIRECT if reason == R.REJECT else TC_ACT_OK
    assert verdict == expect_verdict, f"verdict {verdict} for {reason.name}"
    if kind in (MALFORMED_IP, MALFORMED_L4):
        assert reason == (R.DROP_MALFORMED_IP if kind == MALFORMED_IP else R.DROP_MALFORMED_L4), \
            f"{kind} frame got {reason.name}"
        return
    assert reason not in (R.DROP_MALFORMED_IP, R.DROP_MALFORMED_L4), f"well-formed frame ({kind}) dropped as malformed"
    if kind == NOT_L4 and frame[ETH_HLEN + 9] == socket.IPPROTO_ICMP:
        judge_icmp(world, prog, frame, out, reason)
        return
    if kind == NOT_IPV4 and frame[12:14] == b"\x86\xdd":  # the IPv6 path: this world has no IPv6 service
        assert reason == classify6(frame), f"IPv6 frame got {reason.name}, expected {classify6(frame).name}"
        if not reason.is_drop:
            assert out == frame, f"{reason.name} modified the frame"
        return
    if not isinstance(kind, Parsed):
        assert reason in (R.PASS_NOT_IPV4, R.PASS_NOT_L4, R.ARP_MASQ), f"{kind} frame got {reason.name}"
        if reason != R.ARP_MASQ:
            assert out == frame, f"{reason.name} modified the frame"
        return
    p = kind
    if reason in (R.PASS_NO_SERVICE, R.PASS_FRAG_UNKNOWN):
        assert out == frame, f"{reason.name} modified the frame"
    elif reason in TRANSLATIONS:
        side, targets = allowed(world, reason, p, prog)
        check_translation(frame, out, p, side, targets)
        if p.first:
            addr_at = ETH_HLEN + (12 if side == "src" else 16)
            world.fragments[(p.src, p.dst, p.ip_id, p.proto, prog)] = socket.inet_ntoa(out[addr_at:addr_at + 4])
    elif reason == R.DROP_SCTP_FRAG:
        assert p.proto == SCTP and p.first, "only an SCTP first fragment is refused for its CRC"
        sides = [allowed(world, r, p, prog) for r in TRANSLATIONS]
        would = {t for _, targets in sides for t in targets}
        # a port changes when a target's differs from the port of the side it rewrites
        assert any(port != (p.sport if side == "src" else p.dport) for side, targets in sides for _, port in targets), \
            "refused though no port would change"
        # the ports were remembered at parse: its later fragments follow the connection's addresses
        world.fragments[(p.src, p.dst, p.ip_id, p.proto, prog)] = {addr for addr, _ in would}
    elif reason == R.REJECT:
        assert frontend_of(p.dst, p.dport, p.proto) is NO_EP and not p.later, "REJECT for a service with endpoints"
        check_reject(frame, out, p)
    elif reason == R.DROP_SOURCE_RANGE:
        assert frontend_of(p.dst, p.dport, p.proto) is RANGED, "source-range drop for a service without ranges"
        assert not p.src.startswith("203.0.113."), "source-range drop of an admitted client"
    elif reason == R.DROP_NO_LOCAL_EXTERNAL:
        assert frontend_of(p.dst, p.dport, p.proto) is ETP_LOCAL, "eTP=Local drop for another service"
        assert p.src not in (w.POD_CLIENT, *NODE_ADDRS), "eTP=Local drop of a pod's or the node's own packet"
    else:
        raise AssertionError(f"unexpected {reason.name} for a well-formed frame to {p.dst}:{p.dport}")


# ---- generation ----------------------------------------------------------------------------------

ADDRS = [w.POD_CLIENT, w.OUTSIDE, w.OUTSIDE2, w.NODE_IP, w.NODE_IP2, w.VIP, w.EXTERNAL_IP, w.LB_IP, RANGED_LB_IP,
         NO_EP_VIP, w.LOCAL_EP[0], w.REMOTE_EP[0], w.REMOTE_EP2[0], "8.8.8.8", "127.0.0.1", "0.0.0.0",
         "255.255.255.255", None]  # None: any address
PORTS = [80, 443, w.NODE_PORT, LOCAL_ONLY_PORT, 8080, 40000, 40001, w.SNAT_MIN, w.SNAT_MAX, 0, 65535, None]


def addr(draw) -> str:
    return pick(draw, ADDRS) or str(draw(st.ip_addresses(v=4)))


def port(draw) -> int:
    chosen = pick(draw, PORTS)
    return draw(st.integers(0, 65535)) if chosen is None else chosen


OPTIONS = st.integers(0, 10).flatmap(lambda n: st.binary(min_size=4 * n, max_size=4 * n))


def legs(world: World) -> list[tuple[tuple[str, int], tuple[str, int], int]]:
    """Every (src, dst, proto) a packet of the set-up connections has, on either side of the node."""
    out = []
    for c in world.conns:
        out += [(c.client, c.frontend, c.proto), (c.backend, c.client, c.proto)]
        if c.snat:
            out += [(c.client, c.backend, c.proto), (c.backend, c.snat, c.proto), (c.snat, c.backend, c.proto)]
    return out


FRONTENDS = [(addr or node, port, svc.proto) for svc in (*SERVICES, NO_EP, NO_EP, RANGED, RANGED)
             for addr, port, _ in svc.frontends for node in ((None,) if addr else NODE_ADDRS)]
# (the REJECT and source-range services thrice: they have one frontend each)


def pick(draw, choices: list):
    """One of `choices`, close to uniformly: hypothesis' sampled_from (and its Randoms) favour the
    first elements, which left whole kinds of packet (a masqueraded fragment, a REJECT) unseen."""
    return choices[draw(st.integers(0, 2 ** 32 - 1)) % len(choices)]


@st.composite
def specs(draw, world: World) -> Spec:
    aim = pick(draw, ["leg", "leg", "frontend", "anywhere"])
    if aim == "leg":  # a packet of a set-up connection, either direction, either side
        (src, sport), (dst, dport), proto = pick(draw, legs(world))
    elif aim == "frontend":  # a new connection to a service, from anywhere
        dst, dport, proto = pick(draw, FRONTENDS)
        src, sport = addr(draw), port(draw)
    else:
        src, sport, dst, dport = addr(draw), port(draw), addr(draw), port(draw)
        proto = pick(draw, [TCP, UDP, TCP, UDP, socket.IPPROTO_ICMP, 132, 0, 255])
    frag = pick(draw, ["none", "none", "first", "later"])
    return Spec(src, sport, dst, dport, proto, options=draw(OPTIONS), payload=draw(st.binary(max_size=64)),
                ip_id=draw(st.integers(0, 65535)), frag=draw(st.integers(1, 8191)) if frag == "later" else 0,
                more=frag == "first" or (frag == "later" and draw(st.booleans())),
                tcp_flags=pick(draw, [0x02, 0x10, 0x18, 0x11, 0x04, 0x12, 0xFF, 0x00]),
                udp_no_csum=proto == UDP and draw(st.booleans()))


@st.composite
def icmp_frames(draw, world: World) -> bytes:
    """An ICMP error (mostly) quoting a packet of a set-up connection as it travels (the reverse
    of a leg: the packet an error answers is a reply to the quote) or any generated packet, cut
    at a random length or as Linux and RFC 792 cut it, the quote's first bytes sometimes damaged."""
    if pick(draw, ["leg", "leg", "any"]) == "leg":
        (dst, dport), (src, sport), proto = pick(draw, legs(world))
        quoted = Spec(src, sport, dst, dport, proto, options=draw(OPTIONS), payload=draw(st.binary(max_size=64)),
                      tcp_flags=0x18, udp_no_csum=proto == UDP and draw(st.booleans())).frame()[ETH_HLEN:]
    else:
        quoted = draw(specs(world)).frame()[ETH_HLEN:]
    hlen = (quoted[0] & 15) * 4
    cut = pick(draw, ["all", "rfc792", "any"])
    if cut == "rfc792":
        quoted = quoted[:hlen + 8]
    elif cut == "any":
        quoted = quoted[:draw(st.integers(0, len(quoted)))]
    if quoted and draw(st.integers(0, 5)) == 0:  # version / IHL / protocol / fragment offset damaged
        at = pick(draw, [0, 6, 9])
        quoted = patch(quoted, at, bytes([draw(st.integers(0, 255))]))
    icmp_type = pick(draw, [3, 3, 3, 11, 12, 4, 5, 0, 8, None])
    icmp_type = draw(st.integers(0, 255)) if icmp_type is None else icmp_type
    body = struct.pack("!BBHI", icmp_type, draw(st.integers(0, 15)), 0, draw(st.integers(0, 2 ** 32 - 1))) + quoted
    body = body[:2] + struct.pack("!H", checksum(body)) + body[4:]
    src, dst = addr(draw), addr(draw)
    options = draw(OPTIONS) if draw(st.integers(0, 4)) == 0 else b""
    hlen = 20 + len(options)
    flags = pick(draw, [0, 0, 0, 0x4000, 0x2000, 1])  # DF; rarely a fragment
    hdr = struct.pack("!BBHHHBBH4s4s", 0x40 | hlen // 4, 0xC0, hlen + len(body), 7, flags, 64, socket.IPPROTO_ICMP, 0,
                      ip4(src), ip4(dst)) + options
    hdr = hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:]
    return eth(0x0800) + hdr + body


def ipv6_frame(draw) -> bytes:
    payload = struct.pack("!HHIIBBHHH", port(draw), 80, 1, 0, 0x50, 0x02, 1024, 0, 0)
    hdr = struct.pack("!IHBB16s16s", 6 << 28, len(payload), TCP, 64, socket.inet_pton(socket.AF_INET6, "fd00::1"),
                      socket.inet_pton(socket.AF_INET6, "fd00::a"))
    return eth(0x86DD) + hdr + payload


IPV6_ADDRS = ["fd00::1", "fd00::a", "fd10:244::7", "2001:db8::9", "::", "ff02::1"]


def ext_chain(draw, last: int) -> tuple[int, bytes]:
    """0-6 extension headers (hop-by-hop, routing, destination options, AH, fragment) of random
    lengths ending in next header `last`: (the first header's type, the bytes)."""
    types = [pick(draw, [0, 60, 60, 43, 51, 44]) for _ in range(draw(st.integers(0, 6)))]
    out = b""
    for kind, nxt in zip(types, [*types[1:], last]):
        if kind == 44:
            out += struct.pack("!BBHI", nxt, 0, draw(st.integers(0, 65535)), 9)
        else:
            hdrlen = draw(st.integers(0, 40))
            out += struct.pack("!BB", nxt, hdrlen) + bytes(((hdrlen + 2) * 4 if kind == 51 else (hdrlen + 1) * 8) - 2)
    return (types[0] if types else last), out


def icmp6_frame(draw) -> bytes:
    """An ICMPv6 message (mostly an error, bpf/lib/icmp6_err.h) quoting an IPv6 packet behind a
    random extension-header chain, cut at any length, its version sometimes damaged."""
    proto = pick(draw, [TCP, UDP, TCP, UDP, ICMP6, 132])
    l4 = struct.pack("!HHIIBBHHH", port(draw), port(draw), 1, 0, 0x50, 0x18, 1024, 0, 0)
    first, exts = ext_chain(draw, proto)
    rest = exts + l4 + draw(st.binary(max_size=32))
    quoted = struct.pack("!IHBB16s16s", 6 << 28, len(rest), first, 64,
                         socket.inet_pton(socket.AF_INET6, pick(draw, IPV6_ADDRS)),
                         socket.inet_pton(socket.AF_INET6, pick(draw, IPV6_ADDRS))) + rest
    cut = pick(draw, ["all", "rfc", "any"])
    if cut == "rfc":
        quoted = quoted[:40 + len(exts) + 8]
    elif cut == "any":
        quoted = quoted[:draw(st.integers(0, len(quoted)))]
    if quoted and draw(st.integers(0, 5)) == 0:
        quoted = patch(quoted, 0, bytes([draw(st.integers(0, 255))]))
    icmp_type = pick(draw, [1, 2, 3, 4, 1, 2, 128, 135, None])
    icmp_type = draw(st.integers(0, 255)) if icmp_type is None else icmp_type
    body = struct.pack("!BBHI", icmp_type, draw(st.integers(0, 7)), 0, draw(st.integers(0, 2 ** 32 - 1))) + quoted
    first, exts = (ICMP6, b"") if draw(st.integers(0, 4)) else ext_chain(draw, ICMP6)  # on the error itself
    hdr = struct.pack("!IHBB16s16s", 6 << 28, len(exts) + len(body), first, 64,
                      socket.inet_pton(socket.AF_INET6, pick(draw, IPV6_ADDRS)),
                      socket.inet_pton(socket.AF_INET6, pick(draw, IPV6_ADDRS)))
    return eth(0x86DD) + hdr + exts + body


@st.composite
def frames(draw, world: World) -> bytes:
    """A frame: well-formed, then (mostly) mutated one way."""
    how = pick(draw, [
        "clean", "clean", "clean", "truncate", "truncate_l4", "ihl", "version", "tot_len", "ip_csum", "l4_csum",
        "ethertype", "vlan", "ipv6", "flip", "random", "pad", "icmp", "icmp", "icmp", "icmp6"])
    if how == "icmp":
        return draw(icmp_frames(world))
    if how == "random":
        return draw(st.binary(min_size=0, max_size=128))
    if how == "ipv6":
        return ipv6_frame(draw)
    if how == "icmp6":
        return icmp6_frame(draw)
    frame = draw(specs(world)).frame()
    hlen = (frame[ETH_HLEN] & 15) * 4
    if how == "truncate":
        return frame[:draw(st.integers(0, len(frame)))]
    if how == "truncate_l4":  # within the L4 header, with or without the total length agreeing
        cut = draw(st.integers(ETH_HLEN + hlen, min(len(frame), ETH_HLEN + hlen + 20)))
        if draw(st.booleans()):
            frame = patch(frame, ETH_HLEN + 2, struct.pack("!H", cut - ETH_HLEN))
        return frame[:cut]
    if how == "ihl":
        return patch(frame, ETH_HLEN, bytes([0x40 | draw(st.integers(0, 15))]))
    if how == "version":
        return patch(frame, ETH_HLEN, bytes([draw(st.integers(0, 15)) << 4 | (frame[ETH_HLEN] & 15)]))
    if how == "tot_len":
        return patch(frame, ETH_HLEN + 2, struct.pack("!H", draw(st.integers(0, 65535))))
    if how == "ip_csum":
        return patch(frame, ETH_HLEN + 10, struct.pack("!H", draw(st.integers(0, 65535))))
    if how == "l4_csum":
        at = ETH_HLEN + hlen + (16 if frame[ETH_HLEN + 9] == TCP else 6)
        return patch(frame, at, struct.pack("!H", draw(st.integers(0, 65535))))
    if how == "ethertype":
        return patch(frame, 12, struct.pack("!H", draw(st.sampled_from([0x86DD, 0x0806, 0x8847, 0x0000, 0xFFFF]))))
    if how in ("vlan",):
        tpid = draw(st.sampled_from([0x8100, 0x88A8]))
        return frame[:12] + struct.pack("!HH", tpid, draw(st.integers(0, 4095))) + frame[12:]
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(frame) - 1))
            frame = patch(frame, i, bytes([frame[i] ^ draw(st.integers(1, 255))]))
        return frame
    if how == "pad":
        return frame + bytes(draw(st.integers(1, 40)))
    return frame


def run_one(datapath, maps: Maps, world: World, prog: str, frame: bytes, seen: Counter) -> None:
    before = maps.stats()
    try:
        result = _run(datapath, prog, frame)
    except OSError as exc:
        # BPF_PROG_TEST_RUN takes no frame shorter than an Ethernet header, and for TC no IPv4 or
        # IPv6 frame too short for its IP header (measured on 6.18): nothing ran, nothing to judge
        ip_min = {b"\x08\x00": 20, b"\x86\xdd": 40}.get(frame[12:14], 0) if prog != "xdp_lb" else 0
        assert len(frame) < ETH_HLEN + ip_min, f"{prog} refused a {len(frame)}-byte frame: {exc}"
        return
    after = maps.stats()
    delta = {r: after[r][0] - before[r][0] for r in after if after[r][0] != before[r][0]}
    judge(world, prog, frame, result.retval, result.packet, delta)
    kind = classify(frame)
    shape = kind if isinstance(kind, str) else "later" if kind.later else "first" if kind.first else "whole"
    seen[(prog, next(iter(delta)) if delta else None, shape)] += 1


# What the generated frames must have exercised (a property that held only because nothing
# reached a branch proves nothing): every outcome of every program, translations of whole
# packets and of both kinds of fragment included.
MUST_SEE = [
    *[(prog, r, shape) for prog in ("tc_ingress", "tc_egress") for r, shape in (
        (R.DROP_MALFORMED_IP, MALFORMED_IP), (R.DROP_MALFORMED_L4, MALFORMED_L4), (R.PASS_NOT_IPV4, NOT_IPV4),
        (R.PASS_NOT_L4, NOT_L4), (R.PASS_NO_SERVICE, "whole"), (R.PASS_FRAG_UNKNOWN, "later"),
        (R.PASS_NO_SERVICE, NOT_IPV4), (R.DROP_MALFORMED_IPV6, NOT_IPV4))],  # IPv6 frames reached the IPv6 path
    *[("tc_ingress", r, shape) for r in (R.FWD_NEW, R.FWD_ESTABLISHED) for shape in ("whole", "first")],
    ("tc_ingress", R.FWD_ESTABLISHED, "later"), ("tc_ingress", R.REV_SNAT, "whole"),
    ("tc_ingress", R.REJECT, "whole"), ("tc_ingress", R.DROP_NO_LOCAL_EXTERNAL, "whole"),
    ("tc_ingress", R.DROP_SCTP_FRAG, "first"),
    ("tc_ingress", R.DROP_SOURCE_RANGE, "whole"), ("xdp_lb", R.DROP_SOURCE_RANGE, "whole"),
    *[("tc_egress", r, shape) for r in (R.SNAT, R.REV_DNAT) for shape in ("whole", "first", "later")],
    ("xdp_lb", None, "whole"), ("xdp_lb", None, NOT_IPV4), ("xdp_lb", R.DROP_MALFORMED_IP, MALFORMED_IP),
    ("xdp_lb", R.DROP_MALFORMED_L4, MALFORMED_L4), ("xdp_lb", R.DROP_NO_LOCAL_EXTERNAL, "whole"),
    *[(prog, r, NOT_L4) for prog in ("tc_ingress", "tc_egress")
      for r in (R.ICMP_RELATED, R.PASS_ICMP_NO_CT, R.PASS_ICMP_MALFORMED)],
    *[(prog, r, NOT_IPV4) for prog in ("tc_ingress", "tc_egress")  # ICMPv6 errors (icmp6_err.h)
      for r in (R.PASS_ICMP_NO_CT, R.PASS_ICMP_MALFORMED, R.PASS_ICMP6_EXTHDRS, R.PASS_ICMP6_FRAG)],
]


EXAMPLES = 1000  # ~8 s; the rarest outcome (a masqueraded first fragment) comes up ~8 times


ROUNDS = 3  # the backends set_up's connections get are the kernel's random pick, so which rare
# outcomes 1000 frames reach varies from run to run; a round that misses one is followed by another
# from a fresh seed (an outcome the programs can no longer produce still fails, after 3 rounds)


def test_every_program_translates_correctly_or_leaves_alone_or_drops_with_a_reason(datapath, maps):
    seen: Counter = Counter()

    def examples(data):
        w.install(maps, *SERVICES)
        world = set_up(datapath, maps)
        frame = data.draw(frames(world), label="frame")
        for prog in PROGRAMS:
            run_one(datapath, maps, world, prog, frame, seen)
        p = classify(frame)
        if isinstance(p, Parsed) and p.first:  # and the rest of that datagram
            later = Spec(p.src, 0, p.dst, 0, p.proto, ip_id=p.ip_id, frag=data.draw(st.integers(1, 100)),
                         payload=data.draw(st.binary(min_size=8, max_size=32))).frame()
            for prog in PROGRAMS:
                run_one(datapath, maps, world, prog, later, seen)

    def missing() -> list:
        return [(prog, r.name if r else "pass", shape) for prog, r, shape in MUST_SEE if not seen[(prog, r, shape)]]

    for round_no in range(ROUNDS):
        if round_no == 0:
            run = fuzz(EXAMPLES)(given(data=st.data())(examples))
        else:  # other frames than the derandomized first round's
            run = seed(round_no)(settings(fuzz_settings(EXAMPLES), derandomize=False)(given(data=st.data())(examples)))
        run()
        if fuzz_examples(EXAMPLES) < EXAMPLES or not missing():  # a deliberately short run may miss some
            break
    if fuzz_examples(EXAMPLES) >= EXAMPLES:
        assert not missing(), f"never exercised in {ROUNDS} rounds of {EXAMPLES}: {missing()}"


# ---- the oracle catches mistranslations ----------------------------------------------------------


def corrupt(frame: bytes, at: int, value: bytes) -> bytes:
    return frame[:at] + value + frame[at + len(value):]


def test_the_oracle_accepts_real_outcomes_and_catches_corrupted_ones(datapath, maps):
    """Real outputs of the programs pass `judge`; the same outputs hand-corrupted the way a buggy
    program would (wrong backend, stale or wrong checksum, another byte touched, the reason
    counted twice, a pass that modified the packet) do not."""
    w.install(maps, *SERVICES)
    world = set_up(datapath, maps)
    frame = Spec(w.OUTSIDE, 42000, w.VIP, 80, TCP, options=b"\x01\x01\x01\x00", payload=b"hello").frame()
    before = maps.stats()
    result = _run(datapath, "tc_ingress", frame)
    counted = {r: maps.stats()[r][0] - before[r][0] for r in before if maps.stats()[r][0] != before[r][0]}
    assert counted == {R.FWD_NEW: 1}
    out = result.packet
    judge(world, "tc_ingress", frame, result.retval, out, counted)  # the real thing passes

    l4 = ETH_HLEN + 24
    wrong_backend = corrupt(out, ETH_HLEN + 16, ip4("10.244.9.9"))
    ip_csum = struct.unpack("!H", out[ETH_HLEN + 10:ETH_HLEN + 12])[0]
    stale_ip_csum = corrupt(out, ETH_HLEN + 10, frame[ETH_HLEN + 10:ETH_HLEN + 12])
    stale_l4_csum = corrupt(out, l4 + 16, frame[l4 + 16:l4 + 18])
    off_by_one_ip_csum = corrupt(out, ETH_HLEN + 10, struct.pack("!H", (ip_csum + 1) & 0xFFFF))
    payload_touched = corrupt(out, len(out) - 1, b"X")
    ttl_touched = corrupt(out, ETH_HLEN + 8, b"\x01")
    for name, bad in [("wrong backend", wrong_backend), ("stale IP checksum", stale_ip_csum),
                      ("stale L4 checksum", stale_l4_csum), ("IP checksum off by one", off_by_one_ip_csum),
                      ("payload touched", payload_touched), ("TTL touched", ttl_touched)]:
        with pytest.raises(AssertionError):
            judge(world, "tc_ingress", frame, result.retval, bad, counted)
            pytest.fail(f"judge accepted: {name}")
    with pytest.raises(AssertionError, match="counted once"):
        judge(world, "tc_ingress", frame, result.retval, out, {R.FWD_NEW: 2})
    with pytest.raises(AssertionError, match="verdict"):
        judge(world, "tc_ingress", frame, TC_ACT_SHOT, out, counted)
    with pytest.raises(AssertionError, match="modified the frame"):
        judge(world, "tc_ingress", frame, TC_ACT_OK, out, {R.PASS_NO_SERVICE: 1})
    malformed = corrupt(frame, ETH_HLEN, b"\x44")
    with pytest.raises(AssertionError, match="malformed-ip frame got PASS_NO_SERVICE"):
        judge(world, "tc_ingress", malformed, TC_ACT_OK, malformed, {R.PASS_NO_SERVICE: 1})
    with pytest.raises(AssertionError, match="dropped as malformed"):
        judge(world, "tc_ingress", frame, TC_ACT_SHOT, frame, {R.DROP_MALFORMED_IP: 1})
    with pytest.raises(AssertionError, match="XDP passed a modified frame"):
        judge(world, "xdp_lb", frame, XDP_PASS, out, {})


def test_the_oracle_catches_mistranslated_icmp_errors(datapath, maps):
    """A real translated error (frag needed about the pod's TCP packet, on its way back through
    tc_egress) passes `judge`; hand-corrupted copies (a stale checksum of each of the four, the
    wrong frontend, the outer address left alone, the payload touched), a translation that did
    not happen or should not have, do not."""
    w.install(maps, *SERVICES)
    world = set_up(datapath, maps)
    conn = world.conns[0]  # the pod to the clusterIP, TCP, not masqueraded
    quoted = Spec(*conn.client, *conn.backend, TCP, payload=b"q" * 40, tcp_flags=0x18).frame()[ETH_HLEN:]
    body = struct.pack("!BBHHH", 3, 4, 0, 0, 1200) + quoted
    body = body[:2] + struct.pack("!H", checksum(body)) + body[4:]
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0xC0, 20 + len(body), 7, 0, 64, 1, 0, ip4("192.168.77.1"),
                      ip4(conn.client[0]))
    frame = eth(0x0800) + hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:] + body
    before = maps.stats()
    result = _run(datapath, "tc_egress", frame)
    counted = {r: maps.stats()[r][0] - before[r][0] for r in before if maps.stats()[r][0] != before[r][0]}
    assert counted == {R.ICMP_RELATED: 1}
    out = result.packet
    judge(world, "tc_egress", frame, result.retval, out, counted)  # the real thing passes

    icmp, q = ETH_HLEN + 20, ETH_HLEN + 28
    bad = {
        "stale outer IP checksum": corrupt(out, ETH_HLEN + 10, frame[ETH_HLEN + 10:ETH_HLEN + 12]),
        "stale ICMP checksum": corrupt(out, icmp + 2, frame[icmp + 2:icmp + 4]),
        "stale quoted IP checksum": corrupt(out, q + 10, frame[q + 10:q + 12]),
        "stale quoted TCP checksum": corrupt(out, q + 20 + 16, frame[q + 36:q + 38]),
        "wrong frontend": corrupt(out, q + 16, ip4(w.EXTERNAL_IP)),
        "outer source left alone": corrupt(out, ETH_HLEN + 12, frame[ETH_HLEN + 12:ETH_HLEN + 16]),
        "quoted payload touched": corrupt(out, len(out) - 1, b"X"),
    }
    for name, frame_out in bad.items():
        with pytest.raises(AssertionError):
            judge(world, "tc_egress", frame, result.retval, frame_out, counted)
            pytest.fail(f"judge accepted: {name}")
    with pytest.raises(AssertionError, match="got PASS_ICMP_NO_CT"):
        judge(world, "tc_egress", frame, TC_ACT_OK, frame, {R.PASS_ICMP_NO_CT: 1})
    stranger = frame.replace(ip4(conn.backend[0]), ip4("10.244.9.9"))
    with pytest.raises(AssertionError, match="got ICMP_RELATED"):
        judge(world, "tc_egress", stranger, TC_ACT_OK, stranger, {R.ICMP_RELATED: 1})
    cut = corrupt(frame, ETH_HLEN + 2, struct.pack("!H", 20 + 8 + 24))  # the quote cut after 4 L4 bytes
    with pytest.raises(AssertionError, match="damaged quote got PASS_ICMP_NO_CT"):
        judge(world, "tc_egress", cut, TC_ACT_OK, cut, {R.PASS_ICMP_NO_CT: 1})


def test_the_classifier_agrees_with_hand_made_frames():
    """The independent parser on frames whose nature is known by construction."""
    good = Spec(w.POD_CLIENT, 40000, w.VIP, 80, TCP).frame()
    assert isinstance(classify(good), Parsed) and classify(good).dport == 80
    assert classify(good[:ETH_HLEN + 19]) == MALFORMED_IP
    assert classify(good[:ETH_HLEN + 20 + 19]) == MALFORMED_IP  # total length now beyond the frame
    assert classify(corrupt(good, ETH_HLEN + 2, struct.pack("!H", 39))[:ETH_HLEN + 39]) == MALFORMED_L4
    assert classify(corrupt(good, ETH_HLEN + 32, b"\x40")) == MALFORMED_L4  # data offset 4
    assert classify(corrupt(good, 12, b"\x86\xdd")) == NOT_IPV4
    assert classify(Spec(w.POD_CLIENT, 0, w.VIP, 0, socket.IPPROTO_ICMP).frame()) == NOT_L4
    later = classify(Spec(w.POD_CLIENT, 0, w.VIP, 0, UDP, frag=3, payload=b"12345678").frame())
    assert isinstance(later, Parsed) and later.later
    options = Spec(w.POD_CLIENT, 1, w.VIP, 80, UDP, options=bytes(40)).frame()
    assert classify(options).hlen == 60 and classify(options).dport == 80
    assert checksum(options[ETH_HLEN:ETH_HLEN + 60]) == 0

