"""Packets in and out of BPF_PROG_TEST_RUN: scapy builders, the run itself, and the checks.

Checksums are checked the strict way: scapy recomputes every checksum of the output packet from
scratch and it must equal what the program left in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import struct

from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.layers.sctp import SCTP, SCTPChunkData, SCTPChunkInit, crc32c
from scapy.packet import Packet, Raw

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf import testrun
from ebpf_proxy.datapath.ebpf.maps import Maps

MAC_PEER = "02:00:00:00:00:0a"
MAC_NODE = "02:00:00:00:00:0b"

TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
XDP_DROP, XDP_PASS = 1, 2


def tcp(src: str, sport: int, dst: str, dport: int, flags: str = "S", payload: bytes = b"", **ip) -> Packet:
    pkt = Ether(src=MAC_PEER, dst=MAC_NODE) / IP(src=src, dst=dst, **ip) / TCP(sport=sport, dport=dport, flags=flags)
    return pkt / Raw(payload) if payload else pkt


def udp(src: str, sport: int, dst: str, dport: int, payload: bytes = b"ping", **kw) -> Packet:
    udp_kw = {k: kw.pop(k) for k in ("chksum",) if k in kw}
    return Ether(src=MAC_PEER, dst=MAC_NODE) / IP(src=src, dst=dst, **kw) / UDP(sport=sport, dport=dport, **udp_kw) / Raw(payload)


def sctp(src: str, sport: int, dst: str, dport: int, *chunks: Packet, tag: int = 0, chksum: int | None = None,
         **ip) -> Packet:
    """An SCTP packet (an INIT unless chunks are given), its CRC32c computed by scapy unless
    `chksum` is given (0: left to the device, as an offloading stack leaves it)."""
    chunks = chunks or (SCTPChunkInit(init_tag=0x1234, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=7),)
    pkt = Ether(src=MAC_PEER, dst=MAC_NODE) / IP(src=src, dst=dst, **ip) / SCTP(sport=sport, dport=dport, tag=tag,
                                                                               chksum=chksum)
    for chunk in chunks:
        pkt = pkt / chunk
    return pkt


def sctp_data(src: str, sport: int, dst: str, dport: int, payload: bytes = b"hello", **kw) -> Packet:
    return sctp(src, sport, dst, dport, SCTPChunkData(tsn=8, data=payload), tag=0x1234, **kw)


def sctp_crc_valid(pkt: Packet) -> bool:
    """Whether the SCTP packet's CRC32c is right: computed here over the SCTP bytes as the IP
    header bounds them, the field taken as zero (RFC 4960 appendix B), stored as scapy and the
    kernel store it."""
    ip = bytes(pkt[IP])
    hlen, tot = (ip[0] & 15) * 4, struct.unpack("!H", ip[2:4])[0]
    l4 = ip[hlen:tot]
    return crc32c(l4[:8] + bytes(4) + l4[12:]) == struct.unpack(">I", l4[8:12])[0]


@dataclass
class Outcome:
    verdict: int
    raw: bytes

    @property
    def pkt(self) -> Packet:
        return Ether(self.raw)


def run(datapath, prog: str, pkt: Packet | bytes) -> Outcome:
    result = testrun.run(datapath.prog_fds[prog], bytes(pkt))
    return Outcome(result.retval, result.packet)


def hop(datapath, maps: Maps, prog: str, frame: bytes, reason: s.Reason) -> bytes:
    """One program run on raw bytes: it must pass the frame and count `reason` once. Returns the
    output frame's bytes."""
    maps.reset_stats()
    out = run(datapath, prog, frame)
    assert out.verdict == TC_ACT_OK
    assert counted(maps) == {reason: 1}
    return out.raw


def counted(maps: Maps) -> dict[s.Reason, int]:
    """Packets counted per reason (only reasons with a count)."""
    return {reason: packets for reason, (packets, _) in maps.stats().items() if packets}


def assert_checksums_valid(pkt: Packet) -> None:
    """IP checksum always; the L4 one unless the packet is a fragment (it covers the datagram)."""
    ip = pkt[IP]
    fresh = IP(bytes(ip))
    fresh.chksum = None
    assert IP(bytes(fresh)).chksum == ip.chksum, "IP checksum invalid"
    if ip.flags.MF or ip.frag:
        return
    if SCTP in ip:
        assert sctp_crc_valid(pkt), "SCTP CRC32c invalid"
        return
    for layer in (TCP, UDP, ICMP):
        if layer in ip:
            if layer is UDP and ip[UDP].chksum == 0:
                return  # "no checksum" must stay 0
            fresh = IP(bytes(ip))
            fresh[layer].chksum = None
            assert IP(bytes(fresh))[layer].chksum == ip[layer].chksum, f"{layer.__name__} checksum invalid"
            return


def endpoints(pkt: Packet) -> tuple[tuple[str, int], tuple[str, int]]:
    """((src, sport), (dst, dport)) of a TCP, UDP or SCTP packet."""
    ip = pkt[IP]
    l4 = ip[TCP] if TCP in ip else ip[SCTP] if SCTP in ip else ip[UDP]
    return (ip.src, l4.sport), (ip.dst, l4.dport)


def once_each(reason, events=()) -> dict:
    """What one hop should count: `reason` once, each of `events` (EV_* reasons) once, nothing else."""
    return {reason: 1, **dict.fromkeys(events, 1)}


def step(datapath, maps, prog, pkt, reason, events=()):
    """Run one hop; it must pass, count `reason` once (and each of `events`, EV_* reasons, once, and
    nothing else) and keep checksums valid."""
    maps.reset_stats()
    out = run(datapath, prog, pkt)
    assert out.verdict == TC_ACT_OK
    assert counted(maps) == once_each(reason, events)
    assert_checksums_valid(out.pkt)
    return out.pkt


def reply_to(pkt, flags="SA", payload=b""):
    """The peer's answer to `pkt` (addresses and ports swapped)."""
    (src, sport), (dst, dport) = endpoints(pkt)
    if pkt.haslayer("TCP"):
        return tcp(dst, dport, src, sport, flags=flags, payload=payload)
    return udp(dst, dport, src, sport, payload=payload or b"pong")
