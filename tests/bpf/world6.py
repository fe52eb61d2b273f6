"""The IPv6 node, services and packets of the IPv6 BPF tests (world.py's and packets.py's twin).

The node has two IPv6 addresses and the pod CIDR fd10:244::/56; the IPv4 settings of world.py
(flags, masquerade port range, lifetimes: epx_config, shared by both families) stay as the `maps`
fixture writes them, and epx_config6 gets the IPv6 masquerade address. Services are written into
the epx_*6 maps with Maps' IPv6 writer (set_service6, set_backend6, set_slots6, ...).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import ICMPv6DestUnreach, IPv6
from scapy.layers.sctp import SCTP, SCTPChunkData, SCTPChunkInit
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Maps, Maps6, Service
from tests.bpf.packets import MAC_NODE, MAC_PEER, TC_ACT_OK, counted, once_each, run

NODE6 = "fd00:50::10"
NODE6_2 = "fd00:20::10"
POD_CIDR6 = "fd10:244::/56"

POD6 = "fd10:244::7"  # a pod on this node
OUTSIDE6 = "2001:db8:113::9"  # a client outside the cluster
OUTSIDE6_2 = "2001:db8:51::4"
LOCAL_EP6 = ("fd10:244::21", 8080)  # endpoint on this node
REMOTE_EP6 = ("fd10:244:1::31", 8080)  # endpoints on other nodes (still in the pod CIDR: the whole cluster's)
REMOTE_EP6_2 = ("fd10:244:2::41", 8080)

VIP6 = "fd00:96::10"
LB_IP6 = "2001:db8:80::80"
NODE_PORT = 30080

TCP_P, UDP_P, SCTP_P = socket.IPPROTO_TCP, socket.IPPROTO_UDP, 132
EXT = s.LB4_F_EXTERNAL
HAS = s.LB4_F_HAS_ENDPOINTS


def install_node6(maps: Maps, snat_addr: str | None = NODE6, detect_none: bool = False) -> None:
    Maps6(maps).set_config6(snat_addr, on=True, detect_none=detect_none)
    maps.set_node_addrs6([NODE6, NODE6_2])
    maps.set_pod_cidrs6([POD_CIDR6])


@dataclass(frozen=True)
class Svc6:
    """One IPv6 service port, as the IPv6 writer would program it."""

    id: int
    frontends: tuple[tuple[str | None, int, int], ...]  # (addr, or None for the nodePort; port; LB4_F_* of it)
    cluster: tuple[tuple[str, int], ...] = ()
    local: tuple[tuple[str, int], ...] = ()
    flags: int = HAS
    affinity: int = 0
    ranges: tuple[str, ...] = ()
    proto: int = TCP_P

    def backend_id(self, ep: tuple[str, int]) -> int:
        return self.id * 100 + sorted({*self.cluster, *self.local}).index(ep) + 1


def install6(maps: Maps, *svcs: Svc6) -> None:
    for svc in svcs:
        for ep in sorted({*svc.cluster, *svc.local}):
            maps.set_backend6(svc.backend_id(ep), Backend(ep[0], ep[1], in_cluster=ep in svc.cluster,
                                                          in_local=ep in svc.local))
        maps.set_slots6(svc.id, s.LB4_SCOPE_CLUSTER, [svc.backend_id(ep) for ep in svc.cluster])
        maps.set_slots6(svc.id, s.LB4_SCOPE_LOCAL, [svc.backend_id(ep) for ep in svc.local])
        for addr, port, flags in svc.frontends:
            maps.set_service6(Frontend(addr, port, svc.proto),
                              Service(svc.id, len(svc.cluster), len(svc.local), svc.affinity, svc.flags | flags))
        for cidr in svc.ranges:
            maps.add_source_range6(svc.id, cidr)


def web6(**kw) -> Svc6:
    """clusterIP [fd00:96::10]:80 -> two remote endpoints and one local, plus the NodePort and an LB IP."""
    base = dict(
        id=1,
        frontends=((VIP6, 80, 0), (None, NODE_PORT, EXT), (LB_IP6, 80, EXT)),
        cluster=(LOCAL_EP6, REMOTE_EP6, REMOTE_EP6_2),
        local=(LOCAL_EP6,),
    )
    base.update(kw)
    return Svc6(**base)


ALL6 = (LOCAL_EP6, REMOTE_EP6, REMOTE_EP6_2)


# ---- packets ----


def tcp6(src: str, sport: int, dst: str, dport: int, flags: str = "S", payload: bytes = b"", ext=(), **ip) -> Packet:
    """Ether / IPv6 / extension headers (scapy layers, in order) / TCP [/ payload]."""
    l3 = IPv6(src=src, dst=dst, **ip)
    for hdr in ext:
        l3 = l3 / hdr
    pkt = Ether(src=MAC_PEER, dst=MAC_NODE) / l3 / TCP(sport=sport, dport=dport, flags=flags)
    return Ether(bytes(pkt / Raw(payload) if payload else pkt))  # every length and checksum filled in


def udp6(src: str, sport: int, dst: str, dport: int, payload: bytes = b"ping", ext=()) -> Packet:
    l3 = IPv6(src=src, dst=dst)
    for hdr in ext:
        l3 = l3 / hdr
    return Ether(bytes(Ether(src=MAC_PEER, dst=MAC_NODE) / l3 / UDP(sport=sport, dport=dport) / Raw(payload)))


def sctp6(src: str, sport: int, dst: str, dport: int, *chunks: Packet, tag: int = 0, chksum: int | None = None,
          ext=()) -> Packet:
    """Ether / IPv6 / extension headers / SCTP (an INIT unless chunks are given), its CRC32c
    computed by scapy unless `chksum` is given (packets.sctp's IPv6 twin)."""
    chunks = chunks or (SCTPChunkInit(init_tag=0x1234, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=7),)
    l3 = IPv6(src=src, dst=dst)
    for hdr in ext:
        l3 = l3 / hdr
    pkt = Ether(src=MAC_PEER, dst=MAC_NODE) / l3 / SCTP(sport=sport, dport=dport, tag=tag, chksum=chksum)
    for chunk in chunks:
        pkt = pkt / chunk
    return Ether(bytes(pkt))


def sctp6_data(src: str, sport: int, dst: str, dport: int, payload: bytes = b"hello") -> Packet:
    return sctp6(src, sport, dst, dport, SCTPChunkData(tsn=8, data=payload), tag=0x1234)


def l4(pkt: Packet):
    return pkt[TCP] if TCP in pkt else pkt[SCTP] if SCTP in pkt else pkt[UDP]


def endpoints6(pkt: Packet) -> tuple[tuple[str, int], tuple[str, int]]:
    """((src, sport), (dst, dport)) of a TCP, UDP or SCTP packet."""
    return (pkt[IPv6].src, l4(pkt).sport), (pkt[IPv6].dst, l4(pkt).dport)


def rewritten(pkt: Packet, src: tuple[str, int] | None = None, dst: tuple[str, int] | None = None) -> bytes:
    """`pkt` with its source and/or destination address and port replaced and the L4 checksum
    recomputed by scapy from scratch (SCTP: its CRC32c): what a correct translation must produce,
    byte for byte."""
    out = Ether(bytes(pkt))
    seg = l4(out)
    if src:
        out[IPv6].src, seg.sport = src
    if dst:
        out[IPv6].dst, seg.dport = dst
    seg.chksum = None
    return bytes(Ether(bytes(out)))


def assert_l4_checksum_valid(pkt: Packet) -> None:
    """The TCP/UDP/ICMPv6 checksum equals scapy's recomputation over the IPv6 pseudo-header (SCTP:
    its CRC32c, over the SCTP packet alone)."""
    for layer, field in ((TCP, "chksum"), (UDP, "chksum"), (SCTP, "chksum"), (ICMPv6DestUnreach, "cksum")):
        if layer in pkt:
            fresh = Ether(bytes(pkt))
            setattr(fresh[layer], field, None)
            assert getattr(Ether(bytes(fresh))[layer], field) == getattr(pkt[layer], field), f"{layer.__name__} checksum invalid"
            return
    raise AssertionError("no TCP, UDP, SCTP or ICMPv6 error to check")


def step6(datapath, maps, prog: str, pkt: Packet, reason: s.Reason, expect: bytes | None = None,
          events: tuple[s.Reason, ...] = ()) -> Packet:
    """Run one hop: it must pass, count `reason` once (and each of `events`, EV_* reasons, once,
    and nothing else), keep the L4 checksum valid and, with `expect`, produce exactly those bytes."""
    maps.reset_stats()
    out = run(datapath, prog, pkt)
    assert out.verdict == TC_ACT_OK
    assert counted(maps) == once_each(reason, events)
    assert_l4_checksum_valid(out.pkt)
    if expect is not None:
        assert out.raw == expect
    return out.pkt


def reply6(pkt: Packet, flags: str = "SA", payload: bytes = b"") -> Packet:
    """The peer's answer to `pkt` (addresses and ports swapped)."""
    (src, sport), (dst, dport) = endpoints6(pkt)
    if TCP in pkt:
        return tcp6(dst, dport, src, sport, flags=flags, payload=payload)
    if SCTP in pkt:
        return sctp6_data(dst, dport, src, sport, payload=payload or b"pong")
    return udp6(dst, dport, src, sport, payload=payload or b"pong")
