"""The one Python mirror of bpf/lib/common.h: map key/value structs, reasons and flag constants.

Field names, types and order follow the C structs exactly; tests/bpf/test_structs.py compares
every struct's offsets and sizes with the ctypes types bcc derives from the compiled C, and every
constant here with its `#define`/enum in common.h. Fields the C types as __be32/__be16 hold
network byte order (the raw bytes read as a native integer); only maps.py converts them.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
from dataclasses import dataclass

u8, u16, u32, u64 = ctypes.c_ubyte, ctypes.c_ushort, ctypes.c_uint, ctypes.c_ulonglong
be16, be32 = ctypes.c_ushort, ctypes.c_uint  # same layout; the name records the byte order


class Reason(enum.IntEnum):
    """enum epx_reason: why a program passed, translated or dropped a packet (stats map index)."""

    CONTINUE = 0  # helpers' "not mine, go on"; never counted
    PASS_NOT_IPV4 = 1
    PASS_NOT_L4 = 2
    PASS_NO_SERVICE = 3
    PASS_FRAG_UNKNOWN = 4
    FWD_NEW = 5
    FWD_ESTABLISHED = 6
    SNAT = 7
    REV_SNAT = 8
    REV_DNAT = 9
    REJECT = 10
    DROP_MALFORMED_IP = 11
    DROP_MALFORMED_L4 = 12
    DROP_NO_LOCAL_EXTERNAL = 13
    DROP_NO_LOCAL_INTERNAL = 14
    DROP_SOURCE_RANGE = 15
    DROP_NO_BACKEND = 16
    DROP_CT_FAILED = 17
    DROP_SNAT_NO_ADDR = 18
    DROP_SNAT_NO_PORT = 19
    DROP_NAT_FAILED = 20
    DROP_REJECT_FAILED = 21
    SOCK_FWD = 22
    SOCK_REV = 23
    SOCK_REJECT = 24
    ARP_MASQ = 25
    PASS_SOCK_EXTERNAL = 26
    DROP_CT_FULL = 27
    EV_CT_EARLY_DROP = 28  # an event (one eviction), not a packet verdict
    ICMP_RELATED = 29
    PASS_ICMP_NO_CT = 30
    PASS_ICMP_MALFORMED = 31
    PASS_HANDOVER = 32
    DROP_HANDOVER_HELD = 33
    # host routing (bpf/lib/fib4.h): events beside a packet's verdict, one per packet it looked at
    EV_HOST_ROUTED_PEER = 34  # fast path into a local pod
    EV_HOST_ROUTED_NEIGH = 35  # fast path to the next hop
    EV_HOST_STACK_FIB = 36  # slow path: the route lookup said so
    EV_HOST_STACK_MTU = 37  # slow path: larger than the route's MTU
    EV_HOST_STACK_SKIP = 38  # slow path: not a packet the fast path routes
    PASS_IPV6_FRAG = 39
    PASS_IPV6_NOT_L4 = 40
    DROP_MALFORMED_IPV6 = 41
    DROP_IPV6_EXTHDRS = 42
    PASS_IPV6_UNTRACED = 43
    PASS_IPV6_OFF = 44
    DROP_SCTP_FRAG = 45
    PASS_ICMP6_EXTHDRS = 46
    PASS_ICMP6_FRAG = 47
    DROP_LOCALHOST6_NO_LOCAL = 48
    EV_CT_PORT_REMAP = 49  # an event (one connection leaving with another source port), not a packet verdict
    EV_CT_CLOSED_FORGOTTEN = 50  # an event (a closed connection forgotten for a new SYN on its tuple), not a verdict

    @property
    def is_drop(self) -> bool:
        return self.name.startswith("DROP_")

    @property
    def description(self) -> str:
        """What the reason means, in common.h's words (for `ebpf-proxy stats` and the docs)."""
        return REASON_DESCRIPTIONS[self]


# The comment of each enum epx_reason member in common.h, verbatim: whoever reads a counter should
# get the C author's explanation without opening the C. tests/unit/test_stats_render.py compares
# the two, so a reworded comment without this mirror fails a test.
REASON_DESCRIPTIONS: dict[Reason, str] = {
    Reason.CONTINUE: 'not a verdict: "not mine, go on" between helpers; never counted',
    Reason.PASS_NOT_IPV4: "neither IPv4 nor IPv6 (ARP, LLDP, ...): untouched",
    Reason.PASS_NOT_L4: "IPv4 but neither TCP, UDP nor SCTP (ICMP, ...): untouched",
    Reason.PASS_NO_SERVICE: "no connection, no service frontend: untouched",
    Reason.PASS_FRAG_UNKNOWN: "later fragment whose first fragment was not seen here: untouched",
    Reason.FWD_NEW: "new connection: backend chosen, DNAT",
    Reason.FWD_ESTABLISHED: "connection table hit: DNAT to the same backend",
    Reason.SNAT: "masquerade on the way to the backend",
    Reason.REV_SNAT: "reply of a masqueraded connection: client restored as destination",
    Reason.REV_DNAT: "reply: frontend restored as source",
    Reason.REJECT: "no usable endpoint: ICMP port unreachable sent back (kube-proxy REJECT)",
    Reason.DROP_MALFORMED_IP: "bad version/IHL/total length, truncated IP header",
    Reason.DROP_MALFORMED_L4: "truncated TCP/UDP/SCTP header, bad TCP data offset",
    Reason.DROP_NO_LOCAL_EXTERNAL: "externalTrafficPolicy=Local, from outside, no local endpoint",
    Reason.DROP_NO_LOCAL_INTERNAL: "internalTrafficPolicy=Local, no local endpoint",
    Reason.DROP_SOURCE_RANGE: "loadBalancerSourceRanges does not admit the client",
    Reason.DROP_NO_BACKEND: "slot or backend entry missing (maps mid-update)",
    Reason.DROP_CT_FAILED: "connection table update failed (a kernel error other than a full table)",
    Reason.DROP_SNAT_NO_ADDR: "masquerade needed but no masquerade address configured",
    Reason.DROP_SNAT_NO_PORT: "no free masquerade port for this backend",
    Reason.DROP_NAT_FAILED: "a rewrite or checksum helper failed",
    Reason.DROP_REJECT_FAILED: "the ICMP reject could not be built",
    Reason.SOCK_FWD: "socket LB: connect/sendmsg rewritten to a backend",
    Reason.SOCK_REV: "socket LB: recvmsg source restored to the frontend",
    Reason.SOCK_REJECT: "socket LB: no usable endpoint, call fails with ECONNREFUSED",
    Reason.ARP_MASQ: "ARP request announcing 127.0.0.0/8: sender set to the masquerade address",
    Reason.PASS_SOCK_EXTERNAL: "socket LB: the node's own call to an externalIP/LB IP of a service without endpoints, left alone (kube-proxy rejects it only in INPUT/FORWARD)",
    Reason.DROP_CT_FULL: 'new connection, connection table full and no connection to early-drop (nf_conntrack: "table full, dropping packet")',
    Reason.EV_CT_EARLY_DROP: "not a verdict: a connection dropped to make room for a new one (ct4_early_drop), counted once per eviction",
    Reason.ICMP_RELATED: "ICMP error about a tracked connection: quoted and outer headers translated, as conntrack NAT does",
    Reason.PASS_ICMP_NO_CT: "ICMP error quoting no connection this hook translates: untouched",
    Reason.PASS_ICMP_MALFORMED: "ICMP error whose quoted header is truncated or invalid: untouched, never translated",
    Reason.PASS_HANDOVER: "mode switch: no connection here, left to netfilter's conntrack, which holds the other mode's connections (CFG_F_NETFILTER_*)",
    Reason.DROP_HANDOVER_HELD: "mode switch: the connection is being moved between epx_ct4 and the kernel's conntrack (CT4_S_HELD), for microseconds; TCP retransmits",
    Reason.EV_HOST_ROUTED_PEER: "not a verdict: fast path, delivered straight into a local pod (bpf_fib_lookup, bpf_redirect_peer), the host stack skipped",
    Reason.EV_HOST_ROUTED_NEIGH: "not a verdict: fast path, sent straight to the route's next hop (bpf_fib_lookup, bpf_redirect_neigh), the host stack skipped",
    Reason.EV_HOST_STACK_FIB: "not a verdict: slow path, the route lookup gave no decision to act on (no neighbour yet, local, unreachable, forwarding off, reverse-path check, ICMP redirect due)",
    Reason.EV_HOST_STACK_MTU: "not a verdict: slow path, larger than the route's MTU: the kernel fragments it or answers fragmentation needed",
    Reason.EV_HOST_STACK_SKIP: "not a verdict: slow path, not a packet to route here (fragment, IP options, TTL <= 1, not for this host, mark, mode switch)",
    Reason.PASS_IPV6_FRAG: "IPv6 packet with a fragment header: untouched (no IPv6 fragment tracking; the ip6tables mode reassembles)",
    Reason.PASS_IPV6_NOT_L4: "IPv6 but neither TCP, UDP nor SCTP after the extension headers (ICMPv6, neighbour discovery, ESP, ...): untouched",
    Reason.DROP_MALFORMED_IPV6: "bad IPv6 version or payload length, truncated IPv6 or extension header",
    Reason.DROP_IPV6_EXTHDRS: "IPv6 extension header chain longer than the parser walks (pkt6.h): dropped, so that no chain carries a packet past the service rules",
    Reason.PASS_IPV6_UNTRACED: "no longer recorded (IPv6 trace runs are explained since): was \"trace run of an IPv6 packet, nothing decided\"; kept so that no number moves",
    Reason.PASS_IPV6_OFF: "IPv6 while the eBPF datapath does not serve it (CFG6_F_ON unset: ip6tables does): untouched",
    Reason.DROP_SCTP_FRAG: "SCTP first fragment whose port must change: its CRC32c covers the whole datagram, whose length a first fragment does not tell (sctp.h)",
    Reason.PASS_ICMP6_EXTHDRS: "ICMPv6 error whose quoted packet has a longer extension header chain than the parser walks (pkt6.h): untouched, never translated",
    Reason.PASS_ICMP6_FRAG: "ICMPv6 error quoting a packet with a fragment header: untouched (no IPv6 fragment tracking: such a packet was never translated)",
    Reason.DROP_LOCALHOST6_NO_LOCAL: "[::1]:<nodePort> of an externalTrafficPolicy=Local NodePort without a local endpoint, on the node's lo (kube-proxy's IPv6 rules never DNAT ::1; its INPUT rule \"has no local endpoints\" drops it)",
    Reason.EV_CT_PORT_REMAP: "not a verdict: a new connection's client port was taken toward its backend by another live connection (same client port, another frontend): it leaves with another source port, as netfilter's NAT remaps a clashing tuple (ct4.h: ct4_port_alloc); counted once per connection",
    Reason.EV_CT_CLOSED_FORGOTTEN: "not a verdict: a SYN (SCTP: INIT) met the entries of a connection that had closed (FIN or RST seen): that connection was forgotten whole, so the new one, a reused client port, starts afresh (lb4_forward), or passes as it came where another node translated it (nat4_snat, nat4_rev_dnat); counted once per connection forgotten",
}

REASON_MAX = 51

# Origins (EPX_ORIGIN_*)
ORIGIN_POD, ORIGIN_NODE, ORIGIN_EXTERNAL, ORIGIN_LOCALHOST = 0, 1, 2, 3

# lb4_service.flags
LB4_F_EXTERNAL = 0x01
LB4_F_ETP_LOCAL = 0x02
LB4_F_ITP_LOCAL = 0x04
LB4_F_SOURCE_RANGES = 0x08
LB4_F_HAS_ENDPOINTS = 0x10
LB4_F_SLOT_BANK = 0x20  # the service's slots are in bank 1 (services.py: the bank swap)

# slot scopes and backend membership
LB4_SCOPE_CLUSTER, LB4_SCOPE_LOCAL = 0, 1
LB4_BE_IN_CLUSTER, LB4_BE_IN_LOCAL = 0x01, 0x02

# connection table kinds and flags
CT4_SVC, CT4_REV_DNAT, CT4_SNAT, CT4_REV_SNAT = 0, 1, 2, 3
CT4_F_MASQ, CT4_F_SEEN_REPLY, CT4_F_CLOSING, CT4_F_SOCK_MASQ = 0x01, 0x02, 0x04, 0x08
CT4_F_FIN_ORIG, CT4_F_FIN_REPLY, CT4_F_TIME_WAIT, CT4_F_DONE = 0x10, 0x20, 0x40, 0x80

# lb4_config.flags
CFG_F_MASQ_ALL = 0x01
CFG_F_LOCALHOST_NODEPORTS = 0x02
CFG_F_DETECT_NONE = 0x04
CFG_F_DETECT_IFACE = 0x08
CFG_F_NETFILTER_MIDSTREAM = 0x10  # a mode switch: only a SYN without an entry is ours (agent/handover.py)
CFG_F_NETFILTER_FIRST = 0x20  # a mode switch: nothing without an entry is ours
CFG_F_ADOPTED_MASQ = 0x40  # adopted connections masqueraded outside the port range (nat4_is_masq_dest)
CFG_F_HOST_ROUTING = 0x80  # --bpf-host-routing: tc_ingress forwards what it translated (bpf/lib/fib4.h)

# sock4_rev.flags
SOCK4_F_MASQ = 0x01

# epx_iface values
EPX_IF_POD = 0x01
EPX_IF_LOCAL = 0x02
EPX_IF_PEER = 0x04  # a veth with its other end in another netns: bpf_redirect_peer delivers into it
EPX_IF_NO_REDIRECTS = 0x08  # sends no ICMP redirects: the fast path may route back out of it
EPX_IF_MTU_SHIFT = 16  # bits 16-31: the smallest MTU metric of a route out of the device (0: none)

# trace mode (common.h): the signal, the hooks and what a record says
TRACE_MARK = 0x65707874
TRACE_MAGIC = 0x54524143
HOOK_XDP, HOOK_TC_INGRESS, HOOK_TC_EGRESS, HOOK_SOCK_CONNECT4, HOOK_SOCK_SENDMSG4 = 1, 2, 3, 4, 5
HOOK_SOCK_CONNECT6, HOOK_SOCK_SENDMSG6 = 6, 7  # AF_INET6 sockets, IPv6 and IPv4-mapped destinations
TRACE_F_SERVICE, TRACE_F_POLICY, TRACE_F_BACKEND, TRACE_F_ESTABLISHED = 0x01, 0x02, 0x04, 0x08
TRACE_F_AFFINITY, TRACE_F_SNAT, TRACE_F_NETNS = 0x10, 0x20, 0x40
TRACE_F_IPV6 = 0x80  # an IPv6 decision: backend_addr6 / snat_addr6 hold the addresses
TRACE_MASQ_POLICY, TRACE_MASQ_HAIRPIN = 0x01, 0x02


class _Struct(ctypes.Structure):
    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name, *_ in self._fields_ if name != "pad")
        return f"{type(self).__name__}({fields})"


class LB4Key(_Struct):
    _fields_ = [("addr", be32), ("port", be16), ("proto", u8), ("pad", u8)]


class LB4Service(_Struct):
    _fields_ = [
        ("id", u32),
        ("count", u16),
        ("local_count", u16),
        ("affinity_timeout", u32),
        ("flags", u32),
    ]


class LB4SlotKey(_Struct):
    _fields_ = [("svc_id", u32), ("slot", u16), ("scope", u8), ("bank", u8)]


class LB4Backend(_Struct):
    _fields_ = [("addr", be32), ("port", be16), ("flags", u8), ("pad", u8)]


class LB4AffinityKey(_Struct):
    _fields_ = [("svc_id", u32), ("client", be32)]


class LB4Affinity(_Struct):
    _fields_ = [("last_used", u64), ("backend_id", u32), ("pad", u32)]


class LPM4Key(_Struct):
    _fields_ = [("prefixlen", u32), ("addr", be32)]


class LB4RangeKey(_Struct):
    _fields_ = [("prefixlen", u32), ("svc_id", u32), ("addr", be32)]


class CT4Key(_Struct):
    _fields_ = [
        ("saddr", be32),
        ("daddr", be32),
        ("sport", be16),
        ("dport", be16),
        ("proto", u8),
        ("kind", u8),
        ("pad", u16),
    ]


class CT4Entry(_Struct):
    _fields_ = [
        ("expires", u64),
        ("nat_addr", be32),
        ("svc_addr", be32),
        ("nat_port", be16),
        ("svc_port", be16),
        ("backend_id", u32),
        ("snat_addr", be32),
        ("snat_port", be16),
        ("flags", u8),
        ("state", u8),
    ]


CT4_S_ASSURED = 0x01  # ct4_entry.state
CT4_S_HELD = 0x02  # ct4_entry.state: being moved by a mode switch (ebpf/handover.py)
# ct4_entry.state: the client's port was taken toward the backend by another live connection, so this
# one leaves with another source port. CT4_SVC: snat_port = the port on the wire, snat_addr = the
# client (masqueraded: the masquerade address, the port its masquerade port from DNAT on); its
# CT4_REV_DNAT and CT4_SNAT halves are keyed by that port and hold the client's own port in
# snat_port (see maps._owner_tuple)
CT4_S_REMAP = 0x04

# connection table pressure (struct ct4_ring)
CT4_RING_SLOTS = 512
CT4_EVICT_SCAN = 8
BPF_FIB_LOOKUP_SIZE = 64  # sizeof(struct bpf_fib_lookup)


class CT4Ring(_Struct):
    # fib: struct bpf_fib_lookup (the kernel's UAPI), scratch space of bpf/lib/fib4.h: only its size matters here
    _fields_ = [("head", u32), ("tail", u32), ("half", CT4Key), ("keys", CT4Key * CT4_RING_SLOTS),
                ("fib", u8 * BPF_FIB_LOOKUP_SIZE), ("rev_dnat", CT4Entry), ("snat", CT4Entry), ("rev_snat", CT4Entry)]


class Frag4Key(_Struct):
    _fields_ = [("saddr", be32), ("daddr", be32), ("id", be16), ("proto", u8), ("pad", u8)]


class Frag4Ports(_Struct):
    _fields_ = [("sport", be16), ("dport", be16)]


class Sock4RevKey(_Struct):
    _fields_ = [("cookie", u64), ("addr", be32), ("port", be16), ("pad", u16)]


class Sock4Rev(_Struct):
    _fields_ = [("addr", be32), ("port", be16), ("flags", u16)]


class LB4Config(_Struct):
    _fields_ = [
        ("snat_addr", be32),
        ("snat_port_min", u16),
        ("snat_port_max", u16),
        ("flags", u32),
        ("tcp_syn_timeout", u32),
        ("tcp_est_timeout", u32),
        ("tcp_close_timeout", u32),
        ("udp_timeout", u32),
        ("udp_stream_timeout", u32),
        ("tcp_close_wait_timeout", u32),
        ("sctp_timeout", u32),
        ("host_netns_cookie", u64),
        ("sctp_est_timeout", u32),
        ("sctp_close_timeout", u32),
    ]


class EpxStat(_Struct):
    _fields_ = [("packets", u64), ("bytes", u64)]


class EpxTraceMeta(_Struct):
    """struct epx_trace_meta: what an XDP trace run carries in data_meta."""

    _fields_ = [("magic", u32), ("nonce", u32)]


class EpxTraceRec(_Struct):
    _fields_ = [
        ("nonce", u32),
        ("reason", u32),
        ("svc_id", u32),
        ("svc_flags", u32),
        ("backend_id", u32),
        ("backend_addr", be32),
        ("backend_port", be16),
        ("svc_count", u16),
        ("svc_local_count", u16),
        ("hook", u8),
        ("origin", u8),
        ("scope", u8),
        ("masq", u8),
        ("flags", u8),
        ("pad", u8),
        ("snat_addr", be32),
        ("snat_port", be16),
        ("pad2", u16),
        ("ifindex", u32),
        ("backend_addr6", be32 * 4),  # TRACE_F_IPV6: struct epx_in6's words (bytes() is the address)
        ("snat_addr6", be32 * 4),
    ]


# ---- IPv6 (common.h's IPv6 section). Family-free structs are reused: epx_svc6 holds LB4Service,
# epx_slot6 is keyed by LB4SlotKey, epx_affinity6 holds LB4Affinity. ----


class In6(_Struct):
    """struct epx_in6: an IPv6 address as four __be32 words, the 16 bytes in network order."""

    _fields_ = [("w", be32 * 4)]

    def __repr__(self) -> str:  # bytes(self) is the address as in the packet
        return f"In6({ipaddress.IPv6Address(bytes(self))})"


class LB6Key(_Struct):
    _fields_ = [("addr", In6), ("port", be16), ("proto", u8), ("pad", u8)]


class LB6Backend(_Struct):
    _fields_ = [("addr", In6), ("port", be16), ("flags", u8), ("pad", u8)]


class LB6AffinityKey(_Struct):
    _fields_ = [("svc_id", u32), ("client", In6)]


class LPM6Key(_Struct):
    _fields_ = [("prefixlen", u32), ("addr", In6)]


class LB6RangeKey(_Struct):
    _fields_ = [("prefixlen", u32), ("svc_id", u32), ("addr", In6)]


class CT6Key(_Struct):
    _fields_ = [
        ("saddr", In6),
        ("daddr", In6),
        ("sport", be16),
        ("dport", be16),
        ("proto", u8),
        ("kind", u8),
        ("pad", u16),
    ]


class CT6Entry(_Struct):
    _fields_ = [
        ("expires", u64),
        ("nat_addr", In6),
        ("svc_addr", In6),
        ("nat_port", be16),
        ("svc_port", be16),
        ("backend_id", u32),
        ("snat_addr", In6),
        ("snat_port", be16),
        ("flags", u8),
        ("state", u8),
        ("pad", u32),
    ]


IPV6_MAX_EXTLEN = 256
ICMP6_QUOTE_MAX = 40 + IPV6_MAX_EXTLEN + 8
ICMP6_PARTIAL_PAD = 24
ICMP6_OPTS_MAX = IPV6_MAX_EXTLEN + ICMP6_PARTIAL_PAD


class Scratch6(_Struct):
    """struct scratch6: per-CPU working space of the IPv6 path (no state)."""

    _fields_ = [("key", CT6Key), ("owner", CT6Key), ("half", CT6Key), ("gone", CT6Entry), ("val", CT6Entry),
                ("quote", u8 * ICMP6_QUOTE_MAX), ("opts", u8 * ICMP6_OPTS_MAX)]


class Sock6RevKey(_Struct):
    _fields_ = [("cookie", u64), ("addr", In6), ("port", be16), ("pad", u16), ("pad2", u32)]


class Sock6Rev(_Struct):
    _fields_ = [("addr", In6), ("port", be16), ("pad", u16)]


CFG6_F_ON = 0x01  # lb6_config.flags: the programs act on IPv6 (common.h)
CFG6_F_DETECT_NONE = 0x02  # lb6_config.flags: IPv6's local-traffic detector is the no-op one (common.h)


class LB6Config(_Struct):
    _fields_ = [("snat_addr", In6), ("flags", ctypes.c_uint32)]


# enum bpf_map_type (include/uapi/linux/bpf.h), by the names bcc's BPF_TABLE takes in maps.c
MAP_TYPES = {"hash": 1, "array": 2, "percpu_array": 6, "lru_hash": 9, "lpm_trie": 11}


@dataclass(frozen=True)
class MapSpec:
    """One map of bpf/maps.c: its name (table and pin file), its key/value mirror and its type
    (bcc's name for it: a pinned map of another type is recreated, not reused, see loader.py)."""

    name: str
    key: type
    leaf: type
    kind: str = "hash"

    @property
    def type_id(self) -> int:
        return MAP_TYPES[self.kind]


MAPS: dict[str, MapSpec] = {
    spec.name: spec
    for spec in (
        MapSpec("epx_svc", LB4Key, LB4Service),
        MapSpec("epx_backend", u32, LB4Backend),
        MapSpec("epx_slot", LB4SlotKey, u32),
        MapSpec("epx_affinity", LB4AffinityKey, LB4Affinity, "lru_hash"),
        MapSpec("epx_src_range", LB4RangeKey, u32, "lpm_trie"),
        MapSpec("epx_node_addr", be32, u32),
        MapSpec("epx_pod_cidr", LPM4Key, u32, "lpm_trie"),
        MapSpec("epx_iface", u32, u32),
        MapSpec("epx_ct4", CT4Key, CT4Entry),  # a plain hash: an LRU would evict established connections
        MapSpec("epx_ct4_ring", u32, CT4Ring, "percpu_array"),
        MapSpec("epx_frag4", Frag4Key, Frag4Ports, "lru_hash"),
        MapSpec("epx_sock_rev", Sock4RevKey, Sock4Rev, "lru_hash"),
        MapSpec("epx_config", u32, LB4Config, "array"),
        MapSpec("epx_stats", u32, EpxStat, "percpu_array"),
        MapSpec("epx_trace", u32, EpxTraceRec, "percpu_array"),
        # IPv6
        MapSpec("epx_svc6", LB6Key, LB4Service),
        MapSpec("epx_backend6", u32, LB6Backend),
        MapSpec("epx_slot6", LB4SlotKey, u32),
        MapSpec("epx_affinity6", LB6AffinityKey, LB4Affinity, "lru_hash"),
        MapSpec("epx_src_range6", LB6RangeKey, u32, "lpm_trie"),
        MapSpec("epx_node_addr6", In6, u32),
        MapSpec("epx_pod_cidr6", LPM6Key, u32, "lpm_trie"),
        MapSpec("epx_ct6", CT6Key, CT6Entry),  # a plain hash, as epx_ct4
        MapSpec("epx_config6", u32, LB6Config, "array"),
        MapSpec("epx_sock_rev6", Sock6RevKey, Sock6Rev, "lru_hash"),
        MapSpec("epx_scratch6", u32, Scratch6, "percpu_array"),
    )
}
