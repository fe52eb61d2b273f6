"""SCTP Services in the eBPF datapath (issue 10): what TCP and UDP get, with SCTP's CRC32c kept valid.

SCTP's checksum is a CRC32c over the whole SCTP packet (no pseudo-header): an address rewrite
leaves it, a port rewrite updates it incrementally (bpf/lib/sctp.h: crc(M ^ D) = crc(M) ^
crc_raw(D), crc_raw(D) = d * x^(8 L) mod P). Every packet a program translates here is checked
with a CRC32c computed from scratch (packets.sctp_crc_valid, scapy's crc32c).
"""

from __future__ import annotations

import random
import re
import socket
import struct
import time

import pytest
from scapy.layers.inet import ICMP, IP, IPerror
from scapy.layers.inet6 import ICMPv6DestUnreach, ICMPv6PacketTooBig, IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop, PadN
from scapy.layers.l2 import Ether
from scapy.layers.sctp import SCTP, SCTPChunkAbort, SCTPChunkData, SCTPChunkInitAck, SCTPChunkSACK
from scapy.packet import Raw

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf import structs as s
from tests.bpf import world as w
from tests.bpf import world6 as w6
from tests.bpf.world6 import rewritten
from tests.bpf.packets import (
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    XDP_DROP,
    assert_checksums_valid,
    counted,
    endpoints,
    run,
    sctp,
    sctp_crc_valid,
    sctp_data,
    step,
)

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
SCTP_P = socket.IPPROTO_SCTP if hasattr(socket, "IPPROTO_SCTP") else 132
SCTP_H = loader.BPF_SRC_DIR / "lib" / "sctp.h"
POLY = 0x82F63B78  # CRC32c, reflected


def diameter(**kw) -> w.Svc:
    """An SCTP service: clusterIP 10.96.0.10:80 (and nodePort, externalIP, LB IP) -> :8080."""
    return w.web(proto=SCTP_P, **kw)


# ---- the math: the constants in sctp.h, and the update itself ------------------------------------


def gf2_mul(a: int, b: int) -> int:
    """a * b mod P, reflected representation (bit 31 is x^0), as sctp4_crc32c_mul."""
    p = 0
    for i in range(32):
        if (a >> (31 - i)) & 1:
            p ^= b
        b = (b >> 1) ^ (POLY if b & 1 else 0)
    return p


def test_the_power_table_in_sctp_h_is_x_to_the_2_to_the_k_plus_3():
    steps = {int(k): int(c, 16) for k, c in re.findall(r"SCTP4_X8POW_STEP\((\d+), (0x[0-9a-fA-F]+)u\);", SCTP_H.read_text())}
    assert sorted(steps) == list(range(16)), "one constant per bit of a 16-bit length"
    power = 0x80000000 >> 8  # x^8
    for k in range(16):
        assert steps[k] == power, f"x^(2^{k + 3}) mod P"
        power = gf2_mul(power, power)


def test_the_update_rule_itself_against_scapy():
    """crc(M') = crc(M) ^ d * x^(8 L), with d the xored port bytes read little-endian: the identity
    the C relies on, on random packets, in Python (both ports changed at once included, which no
    single program run does: the C sees one side per run, and the update is linear in d)."""
    from scapy.layers.sctp import crc32c

    rng = random.Random(10)
    for _ in range(300):
        length = rng.randrange(12, 1500)
        m = bytearray(rng.randbytes(length))
        m[8:12] = bytes(4)
        new = bytearray(m)
        new[0:4] = rng.randbytes(4) if rng.random() < 0.5 else m[0:2] + rng.randbytes(2)
        d = int.from_bytes(bytes(a ^ b for a, b in zip(m[0:4], new[0:4])), "little")
        xpow = 0x80000000
        for k in range(16):
            if length >> k & 1:
                xpow = gf2_mul(xpow, _x2k(k + 3))
        # scapy returns the CRC byte-swapped (the stored bytes read big-endian)
        old_le = int.from_bytes(crc32c(bytes(m)).to_bytes(4, "big"), "little")
        new_le = int.from_bytes(crc32c(bytes(new)).to_bytes(4, "big"), "little")
        assert new_le == old_le ^ gf2_mul(d, xpow)


def _x2k(e: int) -> int:
    """x^(2^e) mod P."""
    v = 0x80000000 >> 1  # x
    for _ in range(e):
        v = gf2_mul(v, v)
    return v


# ---- the real program on random packets ------------------------------------------------------------


def _random_chunks(rng: random.Random):
    chunks = []
    for _ in range(rng.randrange(1, 4)):  # multi-chunk packets (bundling)
        kind = rng.random()
        if kind < 0.6:
            chunks.append(SCTPChunkData(tsn=rng.randrange(2**32), data=rng.randbytes(rng.randrange(0, 600))))
        elif kind < 0.8:
            chunks.append(SCTPChunkSACK(cumul_tsn_ack=rng.randrange(2**32)))
        else:
            chunks.append(SCTPChunkData(tsn=1, data=rng.randbytes(rng.randrange(1, 8))))  # padded: odd lengths
    return chunks


def test_dnat_and_masquerade_keep_the_crc_valid_on_random_packets(datapath, maps):
    """Destination port (DNAT at ingress) and source port (masquerade at egress) changed by the
    real programs on random SCTP packets of many lengths, odd and multi-chunk; every output's
    CRC32c is checked from scratch."""
    w.install(maps, diameter(cluster=(w.REMOTE_EP,), local=()))
    rng = random.Random(132)
    lengths = set()
    for i in range(60):
        built = sctp(w.OUTSIDE, 20000 + i, w.NODE_IP, w.NODE_PORT, *_random_chunks(rng), tag=rng.randrange(2**32))
        if rng.random() < 0.3:  # bytes past the chunks that the CRC still covers: lengths not a multiple of 4
            built = built / Raw(rng.randbytes(rng.randrange(1, 4)))
        pkt = Ether(bytes(built))
        lengths.add(len(pkt[SCTP]))
        assert sctp_crc_valid(pkt)
        fwd = step(datapath, maps, "tc_ingress", pkt, R.FWD_NEW)
        assert endpoints(fwd)[1] == w.REMOTE_EP  # dport 30080 -> 8080: the CRC was updated
        out = step(datapath, maps, "tc_egress", fwd, R.SNAT)
        (src, sport), _ = endpoints(out)
        assert src == w.NODE_IP and w.SNAT_MIN <= sport <= w.SNAT_MAX and sport != 20000 + i
        assert bytes(out[SCTP])[12:] == bytes(pkt[SCTP])[12:], "chunks untouched"
    assert len({n % 4 for n in lengths}) > 1 and max(lengths) > 1024, "odd lengths and long ones covered"


# ---- the service rules over SCTP ---------------------------------------------------------------------


def test_clusterip_from_a_pod_init_data_and_reply(datapath, maps):
    """Rule 1 over SCTP: the INIT is DNATed to a backend, later packets follow it, the backend's
    replies come back from clusterIP:80; each with a valid CRC32c."""
    w.install(maps, diameter())
    fwd = step(datapath, maps, "tc_ingress", sctp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    backend = endpoints(fwd)[1]
    assert backend in (w.LOCAL_EP, w.REMOTE_EP, w.REMOTE_EP2)
    assert endpoints(fwd)[0] == (w.POD_CLIENT, 40000), "no masquerade from a pod"
    step(datapath, maps, "tc_egress", fwd, R.PASS_NO_SERVICE)

    ack = sctp(*backend, w.POD_CLIENT, 40000, SCTPChunkInitAck(init_tag=0x55, a_rwnd=65535, n_out_streams=1,
                                                               n_in_streams=1, init_tsn=3), tag=0x1234)
    back = step(datapath, maps, "tc_egress", ack, R.REV_DNAT)
    assert endpoints(back) == ((w.VIP, 80), (w.POD_CLIENT, 40000))

    for payload in (b"x", b"diameter request", bytes(999)):
        data = step(datapath, maps, "tc_ingress", sctp_data(w.POD_CLIENT, 40000, w.VIP, 80, payload), R.FWD_ESTABLISHED)
        assert endpoints(data)[1] == backend
    conn = next(c for c in maps.connections() if c.kind == s.CT4_SVC)
    assert conn.proto == SCTP_P and conn.flags & s.CT4_F_SEEN_REPLY


def test_nodeport_from_outside_is_masqueraded_and_its_replies_restored(datapath, maps):
    """Rule 4 over SCTP: DNAT at ingress, masquerade (a new source port: CRC updated) at egress;
    the reply is given its client back at ingress and the nodePort as source at egress."""
    w.install(maps, diameter())
    fwd = step(datapath, maps, "tc_ingress", sctp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW)
    backend = endpoints(fwd)[1]
    fwd = step(datapath, maps, "tc_egress", fwd, R.SNAT)
    (snat_addr, snat_port), dst = endpoints(fwd)
    assert (snat_addr, dst) == (w.NODE_IP, backend) and w.SNAT_MIN <= snat_port <= w.SNAT_MAX

    reply = sctp_data(*backend, snat_addr, snat_port)
    back = step(datapath, maps, "tc_ingress", reply, R.REV_SNAT)
    assert endpoints(back) == (backend, (w.OUTSIDE, 40000))
    back = step(datapath, maps, "tc_egress", back, R.REV_DNAT)
    assert endpoints(back) == ((w.NODE_IP, w.NODE_PORT), (w.OUTSIDE, 40000))

    again = step(datapath, maps, "tc_ingress", sctp_data(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_ESTABLISHED)
    again = step(datapath, maps, "tc_egress", again, R.SNAT)
    assert endpoints(again) == ((snat_addr, snat_port), backend)


def test_a_pending_crc_stays_zero(datapath, maps):
    """A pod's SCTP stack leaves the CRC to its veth (0 in the field, CHECKSUM_PARTIAL): the field
    must stay 0, for the device or the kernel computes it later over the packet as it then is
    (nf_nat's sctp_manip_pkt does not touch it either)."""
    w.install(maps, diameter())
    out = run(datapath, "tc_ingress", sctp(w.POD_CLIENT, 40000, w.VIP, 80, chksum=0))
    assert out.verdict == TC_ACT_OK and counted(maps) == {R.FWD_NEW: 1}
    assert endpoints(out.pkt)[1][1] == 8080 and out.pkt[SCTP].chksum == 0


def test_an_invalid_crc_stays_invalid(datapath, maps):
    """The delta carries a corruption along: the receiver drops the packet, as it would have."""
    w.install(maps, diameter())
    pkt = Ether(bytes(sctp(w.POD_CLIENT, 40000, w.VIP, 80)))
    pkt[SCTP].chksum ^= 0x00010000
    out = run(datapath, "tc_ingress", Ether(bytes(pkt)))
    assert out.verdict == TC_ACT_OK and endpoints(out.pkt)[1][1] == 8080
    assert not sctp_crc_valid(out.pkt)


@pytest.mark.parametrize("prog", ["tc_ingress", "xdp_lb"])
def test_etp_local_without_a_local_endpoint_drops(datapath, maps, prog):
    """Rule 5 over SCTP: dropped, in TC and already in XDP, under its reason."""
    w.install(maps, diameter(local=(), flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ETP_LOCAL))
    out = run(datapath, prog, sctp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT))
    assert out.verdict == (XDP_DROP if prog == "xdp_lb" else TC_ACT_SHOT)
    assert counted(maps) == {R.DROP_NO_LOCAL_EXTERNAL: 1}


def test_source_ranges_and_affinity(datapath, maps):
    """Rules 11 and 13 over SCTP: an unlisted client is dropped at the LB IP, a listed one always
    lands on the same backend."""
    w.install(maps, diameter(ranges=("203.0.113.0/24",), affinity=10800,
                             frontends=((w.VIP, 80, 0), (w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES))))
    out = run(datapath, "tc_ingress", sctp(w.OUTSIDE2, 40000, w.LB_IP, 80))
    assert out.verdict == TC_ACT_SHOT and counted(maps) == {R.DROP_SOURCE_RANGE: 1}
    backends = {endpoints(step(datapath, maps, "tc_ingress", sctp(w.OUTSIDE, 40000 + i, w.LB_IP, 80), R.FWD_NEW))[1]
                for i in range(12)}
    assert len(backends) == 1


@pytest.mark.parametrize("src, dst, dport, partial", [
    (w.POD_CLIENT, w.VIP, 80, True),
    (w.OUTSIDE, w.NODE_IP, w.NODE_PORT, False),
])
def test_no_endpoints_rejects_with_port_unreachable(datapath, maps, src, dst, dport, partial):
    """Rule 9 over SCTP: ICMP port unreachable quoting the IP header and the first 8 SCTP bytes
    (ports and verification tag: what the client's SCTP looks its association up by)."""
    w.install(maps, diameter(flags=0, cluster=(), local=()))
    pkt = Ether(bytes(sctp(src, 40000, dst, dport, tag=0xABCD)))
    out = run(datapath, "tc_ingress", pkt)
    assert out.verdict == TC_ACT_REDIRECT and counted(maps) == {R.REJECT: 1}
    ip = out.pkt[IP]
    assert (ip.src, ip.dst, ip[ICMP].type, ip[ICMP].code) == (dst, src, 3, 3)
    assert_checksums_valid(out.pkt)
    assert (ip.ihl * 4 > 20) == partial  # the padded layout for a pod's packet (icmp4.h)
    quote = bytes(ip[ICMP].payload)
    assert quote == bytes(pkt[IP])[:28]
    assert (ip[IPerror].src, ip[IPerror].dst) == (src, dst)
    assert struct.unpack("!HHI", quote[20:28]) == (40000, dport, 0xABCD)
    assert not maps.connections()


@pytest.mark.parametrize("prog", ["tc_ingress", "xdp_lb"])
def test_a_truncated_sctp_header_is_a_malformed_drop(datapath, maps, prog):
    w.install(maps, diameter())
    whole = bytes(sctp(w.POD_CLIENT, 40000, w.VIP, 80))
    cut = Ether(whole[:14 + 20 + 11])
    cut[IP].len = 20 + 11
    out = run(datapath, prog, Ether(bytes(cut)))
    assert out.verdict == (XDP_DROP if prog == "xdp_lb" else TC_ACT_SHOT)
    assert counted(maps) == {R.DROP_MALFORMED_L4: 1}


def test_first_fragments(datapath, maps):
    """A first fragment whose port must change is refused under its reason (its CRC covers a
    datagram whose length it does not tell); one whose ports stay (service port = target port)
    is translated by address, which the CRC does not cover, and its later fragments follow."""
    w.install(maps, diameter())
    first = Ether(bytes(sctp_data(w.POD_CLIENT, 40000, w.VIP, 80, bytes(64), flags="MF", id=77)))
    out = run(datapath, "tc_ingress", first)
    assert out.verdict == TC_ACT_SHOT and counted(maps) == {R.DROP_SCTP_FRAG: 1}

    maps.reset_stats()
    same_port = w.web(id=2, proto=SCTP_P, frontends=(("10.96.0.20", 8080, 0),), cluster=(w.REMOTE_EP,), local=())
    w.install(maps, same_port)
    first = Ether(bytes(sctp_data(w.POD_CLIENT, 40001, "10.96.0.20", 8080, bytes(64), flags="MF", id=78)))
    out = run(datapath, "tc_ingress", first)
    assert out.verdict == TC_ACT_OK and counted(maps) == {R.FWD_NEW: 1}
    assert endpoints(out.pkt)[1] == w.REMOTE_EP
    assert bytes(out.pkt[IP].payload) == bytes(first[IP].payload), "the SCTP bytes are untouched"
    later = Ether(bytes(Ether(src=first.src, dst=first.dst) / IP(src=w.POD_CLIENT, dst="10.96.0.20", proto=SCTP_P,
                                                                  frag=5, id=78) / Raw(bytes(16))))
    maps.reset_stats()
    out = run(datapath, "tc_ingress", later)
    assert out.verdict == TC_ACT_OK and counted(maps) == {R.FWD_ESTABLISHED: 1}
    assert out.pkt[IP].dst == w.REMOTE_EP[0]


def _svc_entry(maps, sport):
    return next(c for c in maps.connections() if c.kind == s.CT4_SVC and c.sport == sport)


def test_lifetimes_are_nf_conntracks_sctp_ones(datapath, maps):
    """Before a reply nf_conntrack's COOKIE_WAIT (3 s), after one ESTABLISHED (210 s), after an
    ABORT CLOSED (10 s), and the masquerade port is free at once (DONE)."""
    w.install(maps, diameter())
    run(datapath, "tc_ingress", sctp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT))
    now = time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
    init = _svc_entry(maps, 40000)
    assert abs(init.expires_ns - now - w.SETTINGS.sctp_timeout * 10**9) < 2 * 10**9
    fwd = run(datapath, "tc_egress", run(datapath, "tc_ingress", sctp_data(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT)).raw)
    (snat, sport), backend = endpoints(fwd.pkt)
    back = run(datapath, "tc_ingress", sctp_data(*backend, snat, sport))
    run(datapath, "tc_egress", back.raw)  # the reply counts where its source is restored
    est = _svc_entry(maps, 40000)
    assert est.flags & s.CT4_F_SEEN_REPLY
    assert abs(est.expires_ns - now - w.SETTINGS.sctp_est_timeout * 10**9) < 5 * 10**9

    run(datapath, "tc_ingress", sctp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT, SCTPChunkAbort(), tag=0x55))
    closed = _svc_entry(maps, 40000)
    assert closed.flags & s.CT4_F_CLOSING and closed.flags & s.CT4_F_DONE
    assert abs(closed.expires_ns - now - w.SETTINGS.sctp_close_timeout * 10**9) < 5 * 10**9


def test_an_init_on_an_aborted_association_starts_a_new_one(datapath, maps):
    w.install(maps, diameter(cluster=(w.REMOTE_EP,), local=()))
    step(datapath, maps, "tc_ingress", sctp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW)
    step(datapath, maps, "tc_ingress", sctp(w.POD_CLIENT, 40000, w.VIP, 80, SCTPChunkAbort(), tag=1), R.FWD_ESTABLISHED)
    assert _svc_entry(maps, 40000).flags & s.CT4_F_DONE
    step(datapath, maps, "tc_ingress", sctp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW, events=(R.EV_CT_CLOSED_FORGOTTEN,))
    assert not _svc_entry(maps, 40000).flags & s.CT4_F_CLOSING


def test_an_icmp_error_about_an_sctp_connection_is_translated(datapath, maps):
    """Fragmentation needed from the backend's path about a DNATed packet reaches the client from
    the frontend, quoting the packet as the client sent it (ports translated; the quoted CRC
    left, see icmp4_err.h)."""
    w.install(maps, diameter(cluster=(w.REMOTE_EP,), local=()))
    sent = Ether(bytes(sctp_data(w.POD_CLIENT, 40000, w.VIP, 80)))
    fwd = step(datapath, maps, "tc_ingress", sent, R.FWD_NEW)
    quote = bytes(fwd[IP])[:28]
    err = Ether(src=sent.src, dst=sent.dst) / IP(src="10.244.1.1", dst=w.POD_CLIENT) / ICMP(type=3, code=4, nexthopmtu=1400) \
        / Raw(quote)
    out = step(datapath, maps, "tc_egress", Ether(bytes(err)), R.ICMP_RELATED)
    ip = out[IP]
    assert ip.src == w.VIP
    assert bytes(ip[ICMP].payload) == bytes(sent[IP])[:28], "quote: the packet as the client sent it"


# ---- the same over IPv6 (tc6.h: the CRC update is family-free, sctp.h) ------------------------------
# Each output is compared byte for byte with the packet scapy builds with the translated
# addresses and ports and its CRC32c recomputed from scratch (world6.rewritten).


@pytest.fixture
def maps6(maps):
    w6.install_node6(maps)
    return maps


def diameter6(**kw) -> w6.Svc6:
    """An IPv6 SCTP service: clusterIP [fd00:96::10]:80 (and nodePort, LB IP) -> :8080."""
    return w6.web6(proto=SCTP_P, **kw)


@pytest.mark.parametrize("ext", [(), (IPv6ExtHdrHopByHop(), IPv6ExtHdrDestOpt(options=[PadN(optdata=bytes(60))]))],
                         ids=["plain", "behind-options"])
def test_ipv6_dnat_and_masquerade_keep_the_crc_valid_on_random_packets(datapath, maps6, ext):
    """IPv6 twin of the random-packet test, also behind extension headers (the SCTP header's
    offset then comes from the parser's walk): DNAT at ingress, masquerade at egress."""
    w6.install6(maps6, diameter6(cluster=(w6.REMOTE_EP6,), local=()))
    rng = random.Random(6132)
    for i in range(30):
        pkt = w6.sctp6(w6.OUTSIDE6, 20000 + i, w6.NODE6, w6.NODE_PORT, *_random_chunks(rng), tag=rng.randrange(2**32),
                       ext=ext)
        fwd = w6.step6(datapath, maps6, "tc_ingress", pkt, R.FWD_NEW, rewritten(pkt, dst=w6.REMOTE_EP6))
        maps6.reset_stats()
        out = run(datapath, "tc_egress", fwd)
        assert out.verdict == TC_ACT_OK and counted(maps6) == {R.SNAT: 1}
        (src, sport), _ = w6.endpoints6(out.pkt)
        assert src == w6.NODE6 and w.SNAT_MIN <= sport <= w.SNAT_MAX and sport != 20000 + i
        assert out.raw == rewritten(fwd, src=(w6.NODE6, sport))


def test_ipv6_clusterip_from_a_pod_init_data_and_reply(datapath, maps6):
    w6.install6(maps6, diameter6())
    pkt = w6.sctp6(w6.POD6, 40000, w6.VIP6, 80)
    fwd = w6.step6(datapath, maps6, "tc_ingress", pkt, R.FWD_NEW)
    backend = w6.endpoints6(fwd)[1]
    assert backend in w6.ALL6 and bytes(fwd) == rewritten(pkt, dst=backend)
    w6.step6(datapath, maps6, "tc_egress", fwd, R.PASS_NO_SERVICE, bytes(fwd))

    ack = w6.sctp6(*backend, w6.POD6, 40000, SCTPChunkInitAck(init_tag=0x55, a_rwnd=65535, n_out_streams=1,
                                                               n_in_streams=1, init_tsn=3), tag=0x1234)
    w6.step6(datapath, maps6, "tc_egress", ack, R.REV_DNAT, rewritten(ack, src=(w6.VIP6, 80)))
    for payload in (b"x", b"diameter request", bytes(999)):
        data = w6.sctp6_data(w6.POD6, 40000, w6.VIP6, 80, payload)
        w6.step6(datapath, maps6, "tc_ingress", data, R.FWD_ESTABLISHED, rewritten(data, dst=backend))
    conn = next(c for c in maps6.connections6() if c.kind == s.CT4_SVC)
    assert conn.proto == SCTP_P and conn.flags & s.CT4_F_SEEN_REPLY


def test_ipv6_nodeport_from_outside_is_masqueraded_and_its_replies_restored(datapath, maps6):
    w6.install6(maps6, diameter6())
    pkt = w6.sctp6(w6.OUTSIDE6, 40000, w6.NODE6, w6.NODE_PORT)
    fwd = w6.step6(datapath, maps6, "tc_ingress", pkt, R.FWD_NEW)
    backend = w6.endpoints6(fwd)[1]
    assert bytes(fwd) == rewritten(pkt, dst=backend)
    out = w6.step6(datapath, maps6, "tc_egress", fwd, R.SNAT)
    (snat_addr, snat_port), _ = w6.endpoints6(out)
    assert snat_addr == w6.NODE6 and bytes(out) == rewritten(fwd, src=(snat_addr, snat_port))

    reply = w6.sctp6_data(*backend, snat_addr, snat_port)
    back = w6.step6(datapath, maps6, "tc_ingress", reply, R.REV_SNAT, rewritten(reply, dst=(w6.OUTSIDE6, 40000)))
    w6.step6(datapath, maps6, "tc_egress", back, R.REV_DNAT, rewritten(back, src=(w6.NODE6, w6.NODE_PORT)))


def test_ipv6_a_pending_crc_stays_zero(datapath, maps6):
    w6.install6(maps6, diameter6())
    out = run(datapath, "tc_ingress", w6.sctp6(w6.POD6, 40000, w6.VIP6, 80, chksum=0))
    assert out.verdict == TC_ACT_OK and counted(maps6) == {R.FWD_NEW: 1}
    assert w6.endpoints6(out.pkt)[1][1] == 8080 and out.pkt[SCTP].chksum == 0


@pytest.mark.parametrize("prog", ["tc_ingress", "xdp_lb"])
def test_ipv6_etp_local_without_a_local_endpoint_drops(datapath, maps6, prog):
    w6.install6(maps6, diameter6(local=(), flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ETP_LOCAL))
    out = run(datapath, prog, w6.sctp6(w6.OUTSIDE6, 40000, w6.NODE6, w6.NODE_PORT))
    assert out.verdict == (XDP_DROP if prog == "xdp_lb" else TC_ACT_SHOT)
    assert counted(maps6) == {R.DROP_NO_LOCAL_EXTERNAL: 1}
    assert not maps6.connections6()


@pytest.mark.parametrize("src, dst, dport", [(w6.POD6, w6.VIP6, 80), (w6.OUTSIDE6, w6.NODE6, w6.NODE_PORT)])
def test_ipv6_no_endpoints_rejects_with_port_unreachable(datapath, maps6, src, dst, dport):
    """ICMPv6 port unreachable quoting the IPv6 header and the first 8 SCTP bytes (ports and
    verification tag); the CRC fix-up leaves the error alone."""
    w6.install6(maps6, diameter6(flags=0, cluster=(), local=()))
    pkt = w6.sctp6(src, 40000, dst, dport, tag=0xABCD)
    out = run(datapath, "tc_ingress", pkt)
    assert out.verdict == TC_ACT_REDIRECT and counted(maps6) == {R.REJECT: 1}
    icmp = out.pkt[ICMPv6DestUnreach]
    assert (out.pkt[IPv6].src, out.pkt[IPv6].dst, icmp.type, icmp.code) == (dst, src, 1, 4)
    w6.assert_l4_checksum_valid(out.pkt)
    assert out.raw.endswith(bytes(pkt[IPv6])[:48]), "the IPv6 header and 8 SCTP bytes, untouched"
    assert not maps6.connections6()


@pytest.mark.parametrize("prog", ["tc_ingress", "xdp_lb"])
def test_ipv6_a_truncated_sctp_header_is_a_malformed_drop(datapath, maps6, prog):
    w6.install6(maps6, diameter6())
    cut = Ether(bytes(w6.sctp6(w6.POD6, 40000, w6.VIP6, 80))[:14 + 40 + 11])
    cut[IPv6].plen = 11
    out = run(datapath, prog, Ether(bytes(cut)))
    assert out.verdict == (XDP_DROP if prog == "xdp_lb" else TC_ACT_SHOT)
    assert counted(maps6) == {R.DROP_MALFORMED_L4: 1}


def test_ipv6_an_abort_closes_and_an_init_starts_anew(datapath, maps6):
    """ABORT closes the association (CLOSING, DONE), a new INIT on its tuple is a new one."""
    w6.install6(maps6, diameter6(cluster=(w6.REMOTE_EP6,), local=()))

    def entry():
        return next(c for c in maps6.connections6() if c.kind == s.CT4_SVC)

    w6.step6(datapath, maps6, "tc_ingress", w6.sctp6(w6.POD6, 40000, w6.VIP6, 80), R.FWD_NEW)
    w6.step6(datapath, maps6, "tc_ingress", w6.sctp6(w6.POD6, 40000, w6.VIP6, 80, SCTPChunkAbort(), tag=1),
             R.FWD_ESTABLISHED)
    assert entry().flags & s.CT4_F_DONE
    w6.step6(datapath, maps6, "tc_ingress", w6.sctp6(w6.POD6, 40000, w6.VIP6, 80), R.FWD_NEW,
             events=(R.EV_CT_CLOSED_FORGOTTEN,))
    assert not entry().flags & s.CT4_F_CLOSING


def test_ipv6_an_icmpv6_error_about_an_sctp_connection_is_translated(datapath, maps6):
    """Packet too big from the backend's path about a DNATed packet reaches the client from the
    frontend, quoting the packet as the client sent it (the quoted CRC left, as IPv4's)."""
    w6.install6(maps6, diameter6(cluster=(w6.REMOTE_EP6,), local=()))
    sent = w6.sctp6_data(w6.POD6, 40000, w6.VIP6, 80)
    fwd = w6.step6(datapath, maps6, "tc_ingress", sent, R.FWD_NEW)
    err = Ether(bytes(Ether(src=sent.src, dst=sent.dst) / IPv6(src="fd10:244:1::1", dst=w6.POD6) /
                      ICMPv6PacketTooBig(mtu=1280) / Raw(bytes(fwd[IPv6]))))
    maps6.reset_stats()
    res = run(datapath, "tc_egress", err)
    assert res.verdict == TC_ACT_OK and counted(maps6) == {R.ICMP_RELATED: 1}
    out = res.pkt
    assert out[IPv6].src == w6.VIP6
    quote, sent6, fwd6 = res.raw[14 + 40 + 8:], bytes(sent[IPv6]), bytes(fwd[IPv6])
    assert quote == sent6[:48] + fwd6[48:52] + sent6[52:], "quote: the packet as the client sent it, its CRC left"
    fresh = Ether(res.raw)
    fresh[ICMPv6PacketTooBig].cksum = None
    assert Ether(bytes(fresh))[ICMPv6PacketTooBig].cksum == out[ICMPv6PacketTooBig].cksum, "ICMPv6 checksum valid"
