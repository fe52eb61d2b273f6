"""Typed access to the datapath's maps, and the only place byte order is converted.

Callers speak Python (dotted-quad strings, port numbers, dataclasses); this module packs them
into the ctypes mirrors of structs.py (network order for the __be fields) and reads them back.
It works on map file descriptors through libbpf, not through bcc, so that it can also open the
pinned maps of a running datapath without compiling anything (after an agent restart, for stats).
The caller decides what changed and writes only that: one entry at a time, or (set_backends,
set_slot_entries, set_services, put_entries) a run of entries of one map in one
BPF_MAP_UPDATE_BATCH, in order.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import ipaddress
import os
import socket
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.datapath.ebpf import ctscan, libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.model.endpoints import v4_texts

IPPROTO = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": 132}
_CLOSABLE = (IPPROTO["TCP"], IPPROTO["SCTP"])  # protocols whose closing connections the gc may drop early
# Array maps: a fixed number of entries that are never deleted (config, counters, trace records,
# the early-drop queues).
ARRAY_MAPS = tuple(name for name, spec in s.MAPS.items() if spec.kind in ("array", "percpu_array"))


# ---- byte order: the only conversions in the project ----


def be32(ip: str) -> int:
    """Dotted quad -> the native integer whose memory is the address in network order."""
    return int.from_bytes(socket.inet_aton(ip), sys.byteorder)


def ip_str(raw: int) -> str:
    return socket.inet_ntoa(raw.to_bytes(4, sys.byteorder))


def in6(ip: str | None) -> s.In6:
    """IPv6 address (None: ::) -> struct epx_in6, its 16 bytes in network order as in the packet."""
    return s.In6.from_buffer_copy(socket.inet_pton(socket.AF_INET6, ip or "::"))


def ip6_str(raw: s.In6) -> str:
    return socket.inet_ntop(socket.AF_INET6, bytes(raw))


def be16(port: int) -> int:
    return socket.htons(port)


def port_int(raw: int) -> int:
    return socket.ntohs(raw)


# ---- Python-side values ----


@dataclass(frozen=True, slots=True)
class Frontend:
    """Where a service is reached: addr None means its nodePort on every node address."""

    addr: str | None
    port: int
    proto: int = socket.IPPROTO_TCP


@dataclass(frozen=True, slots=True)
class Service:
    id: int
    count: int  # cluster slots
    local_count: int = 0  # local slots
    affinity_timeout: int = 0  # seconds
    flags: int = 0  # structs.LB4_F_*


@dataclass(frozen=True, slots=True)
class Backend:
    addr: str
    port: int
    in_cluster: bool = True
    in_local: bool = False


_ID = "I"  # array typecode of a backend id: a u32 (epx_backend's key)
_LITTLE_ENDIAN = sys.byteorder == "little"


def _canonical_v4(addr: object) -> bool:
    """Whether `addr` is the one dotted quad inet_ntoa gives back for its bytes (so packing loses nothing)."""
    try:
        return type(addr) is str and socket.inet_ntoa(socket.inet_aton(addr)) == addr
    except OSError:
        return False


def _network_ports(ports: Sequence[int]) -> array | None:
    """`ports` as u16s in network order, as lb4_backend holds them (checked in C: None when one is
    not an int in a u16)."""
    try:
        words = array("H", ports)
    except (OverflowError, TypeError):
        return None
    if _LITTLE_ENDIAN:
        words.byteswap()
    return words


def _backend_flags(in_cluster: bool, in_local: bool) -> int:
    return (s.LB4_BE_IN_CLUSTER if in_cluster else 0) | (s.LB4_BE_IN_LOCAL if in_local else 0)


def _flag_bytes(in_cluster: Sequence[bool], in_local: Sequence[bool]) -> bytes:
    """The lb4_backend flags byte of each backend, in order."""
    if all(in_cluster) and not any(in_local):  # the common case: one flag for all
        return bytes((s.LB4_BE_IN_CLUSTER,)) * len(in_cluster)
    return bytes(map(_backend_flags, in_cluster, in_local))


class MapEntries(Sequence[tuple[bytes, bytes]]):
    """Packed (key, value) entries of one map held as its keys back to back and its values back
    to back: what BPF_MAP_UPDATE_BATCH takes, so _put_packed hands both over as they are, with
    no per-entry work (Backends.map_entries: a million backends in a full sync at 100,000
    Services). Reads as the list of (key, value) pairs it stands for."""

    __slots__ = ("keys", "values", "_key_size", "_value_size")

    def __init__(self, keys: bytes, values: bytes, key_size: int, value_size: int) -> None:
        if len(keys) * value_size != len(values) * key_size or len(keys) % key_size:
            raise ValueError(f"{len(keys)} bytes of {key_size}-byte keys and {len(values)} bytes of "
                             f"{value_size}-byte values are not whole pairs")
        self.keys, self.values, self._key_size, self._value_size = keys, values, key_size, value_size

    def __len__(self) -> int:
        return len(self.keys) // self._key_size

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(index)
        index %= n
        k, v = self._key_size, self._value_size
        return self.keys[index * k:(index + 1) * k], self.values[index * v:(index + 1) * v]

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        k, v = self._key_size, self._value_size
        for i in range(len(self)):
            yield self.keys[i * k:(i + 1) * k], self.values[i * v:(i + 1) * v]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MapEntries):
            return (self.keys, self.values) == (other.keys, other.values)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


class Backends(Mapping[int, Backend]):
    """A service port's backends (backend id -> Backend), packed: 12 bytes each in one bytes object.

    ServiceEntries held them as a dict of Backend records: at 100,000 Services x 10 endpoints
    ~1.3 KiB a service port (dict, records, id ints), ~130 MiB of the agent's 637 MiB
    (bench/cpscale.py). Reading is a Mapping as before, in the order given (the order
    ServicePrograms writes them); values are Backend records built on access, equal to the ones
    packed. Lookups by id scan (a service port's backends are few; _write takes dict(items())
    once for its lookups). Build with `pack` or `of`, which keep a plain dict for what the packed
    form cannot hold exactly (an address not in canonical dotted-quad form, a port beyond 16 bits).

    The bytes are what epx_backend takes: the ids (its u32 keys) back to back, then the
    lb4_backend values back to back, so writing them (map_entries) costs nothing per backend."""

    __slots__ = ("_packed",)

    def __init__(self, packed: bytes) -> None:
        self._packed = packed

    @classmethod
    def pack(cls, backends: Mapping[int, Backend] | Iterable[tuple[int, Backend]]) -> "Backends | dict[int, Backend]":
        if isinstance(backends, Backends):
            return backends
        items = list(dict(backends).items())  # a dict's keys: one entry per id, the last one given
        if not all(type(be) is Backend for _, be in items):
            return dict(items)
        packed = cls._packed_rows([(bid, be.addr, be.port, be.in_cluster, be.in_local) for bid, be in items])
        return dict(items) if packed is None else cls(packed)

    @classmethod
    def of(cls, rows: Iterable[tuple[int, str, int, bool, bool]]) -> "Backends | dict[int, Backend]":
        """pack() of {id: Backend(addr, port, in_cluster, in_local)} for (id, addr, port,
        in_cluster, in_local) rows (a repeated id: the last row, as in a dict), without making the
        Backend records (a million of them in a 100,000-Service full sync)."""
        rows = list(rows)
        packed = cls._packed_rows(rows) if len({row[0] for row in rows}) == len(rows) else None
        if packed is None:
            return cls.pack({bid: Backend(addr, port, c, loc) for bid, addr, port, c, loc in rows})
        return cls(packed)

    @classmethod
    def of_v4(cls, ids: Sequence[int], v4: bytes, ports: Sequence[int], in_cluster: Sequence[bool],
              in_local: Sequence[bool]) -> "Backends | dict[int, Backend]":
        """of() of the rows (ids[i], inet_ntoa(v4[4i:4i+4]), ports[i], in_cluster[i], in_local[i]),
        the same value, packed straight from the addresses' bytes (model.categorize.Reachable.v4:
        every one a canonical dotted quad's, so nothing to check or convert): a full sync at
        100,000 Services x 10 endpoints packs a million backends. The columns are as Reachable
        gives them: ids and ports ints, the flags bools (what of() would keep as a dict, ids or
        ports out of range or repeated ids, is made by of())."""
        n = len(ids)
        raw_ids = port_words = None
        if n and len(v4) == 4 * n and len(ports) == len(in_cluster) == len(in_local) == n and len(set(ids)) == n:
            port_words = _network_ports(ports)
            try:  # ids in u32s, checked in C (an OverflowError beyond)
                raw_ids = array(_ID, ids).tobytes()
            except (OverflowError, TypeError):
                pass
        if raw_ids is None or port_words is None:
            return cls.of(zip(ids, v4_texts(v4), ports, in_cluster, in_local))
        # the lb4_backend values filled field by field, each with one strided copy in C (a
        # struct pack per backend was ~30% more): addr (the 4 bytes as given) at 0, port in
        # network order at 4, flags at 6, pad 0
        values = bytearray(_LB4_BACKEND.size * n)
        view = memoryview(values)
        view.cast(_ID)[0::2] = memoryview(v4).cast(_ID)
        view.cast("H")[2::4] = port_words
        values[6::8] = _flag_bytes(in_cluster, in_local)
        return cls(raw_ids + values)

    @staticmethod
    def _packed_rows(rows: list[tuple[int, str, int, bool, bool]]) -> bytes | None:
        """The packed bytes of rows with distinct ids; None when one does not fit them exactly."""
        aton, ntoa, htons, value = socket.inet_aton, socket.inet_ntoa, socket.htons, _LB4_BACKEND.pack
        values = []
        for bid, addr, port, c, loc in rows:
            if not (type(bid) is int and 0 <= bid < 1 << 32 and type(addr) is str and type(port) is int
                    and 0 <= port < 1 << 16 and type(c) is bool and type(loc) is bool):
                return None
            try:
                raw = aton(addr)
            except OSError:
                return None
            if ntoa(raw) != addr:  # not canonical: the packed form would read back another text
                return None
            values.append(value(raw, htons(port), _backend_flags(c, loc)))
        return array(_ID, [row[0] for row in rows]).tobytes() + b"".join(values)

    def _split(self) -> tuple[memoryview, bytes]:
        cut = len(self) * _U32.size
        return memoryview(self._packed)[:cut].cast(_ID), self._packed[cut:]

    def id_bytes(self) -> bytes:
        """The backend ids, in order, as the u32s (native order) they are kept as."""
        return self._packed[:len(self) * _U32.size]

    def map_entries(self) -> MapEntries:
        """(epx_backend key, value) of each backend, packed, in order: what Maps.set_backends()
        writes for items(), as the bytes this holds."""
        cut = len(self) * _U32.size
        return MapEntries(self._packed[:cut], self._packed[cut:], _U32.size, _LB4_BACKEND.size)

    def __len__(self) -> int:
        return len(self._packed) // (_U32.size + _LB4_BACKEND.size)

    def __iter__(self) -> Iterator[int]:
        return iter(self._split()[0].tolist())

    def items(self):  # type: ignore[override]
        ids, values = self._split()
        ntoa, ntohs = socket.inet_ntoa, socket.ntohs
        return [(bid, Backend(ntoa(addr), ntohs(port), bool(flags & s.LB4_BE_IN_CLUSTER), bool(flags & s.LB4_BE_IN_LOCAL)))
                for bid, (addr, port, flags) in zip(ids.tolist(), _LB4_BACKEND.iter_unpack(values))]

    def values(self):  # type: ignore[override]
        return [be for _, be in self.items()]

    def ids_if_same(self, v4: bytes, ports: Sequence[int]) -> list[int] | None:
        """The ids, in order, when these backends are exactly the addresses `v4` (4 bytes each,
        as model.categorize.Reachable.v4 holds them) with `ports`, in that order; else None.
        A full sync of a service whose endpoints did not change (every service, after a restart
        or hourly) then keeps its ids by two byte comparisons in C, where ids_by_address made a
        text key of each backend, and of each endpoint to look it up."""
        ids, values = self._split()
        n = len(ids)
        if len(v4) != 4 * n or len(ports) != n:
            return None
        view = memoryview(values)  # as of_v4 lays the values out: addr at 0, port at 4
        if view.cast(_ID)[0::2].tobytes() != v4:
            return None
        wanted = _network_ports(ports)
        return ids.tolist() if wanted is not None and view.cast("H")[2::4].tobytes() == wanted.tobytes() else None

    def same_v4(self, v4: bytes, ports: Sequence[int], in_cluster: Sequence[bool],
                in_local: Sequence[bool]) -> bool:
        """Whether of_v4(ids_if_same(v4, ports), v4, ports, in_cluster, in_local) would be these
        very bytes: the same backends in the same order (ids_if_same) and the same flags, pad 0.
        A restart's full sync then keeps this object for each unchanged service port rather than
        packing a million backends again only to find them equal."""
        n = len(self)
        if len(in_cluster) != n or len(in_local) != n:
            return False
        values = self._packed[n * _U32.size:]
        return values[6::8] == _flag_bytes(in_cluster, in_local) and not any(values[7::8])

    def ids_by_address(self) -> dict[tuple[str, int], int]:
        """{(addr, port): id for id, backend in items()}, without making the Backend records (a
        full sync over services the maps already hold, after a restart or hourly, asks it of
        every service port)."""
        ids, values = self._split()
        ntoa, ntohs = socket.inet_ntoa, socket.ntohs
        rows = zip(ids.tolist(), _LB4_BACKEND.iter_unpack(values))
        return {(ntoa(addr), ntohs(port)): bid for bid, (addr, port, _) in rows}

    def __getitem__(self, backend_id: int) -> Backend:
        for bid, be in self.items():
            if bid == backend_id:
                return be
        raise KeyError(backend_id)

    def __contains__(self, backend_id: object) -> bool:
        return backend_id in self._split()[0].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Backends):  # a dict's equality: the order does not count
            if self._packed == other._packed:
                return True
            if len(self._packed) != len(other._packed):
                return False
            mine, theirs = self._split(), other._split()
            return sorted(zip(mine[0].tolist(), _LB4_BACKEND.iter_unpack(mine[1]))) == \
                sorted(zip(theirs[0].tolist(), _LB4_BACKEND.iter_unpack(theirs[1])))
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a dict's

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    def __reduce__(self) -> tuple:
        return (Backends, (self._packed,))


# NodeSettings.local_detect: how the local-traffic detector decides (lb4_local_pod in bpf/lib/lb4.h)
DETECT_CIDR, DETECT_IFACE, DETECT_NONE = "cidr", "iface", "none"
_DETECT_FLAGS = {DETECT_CIDR: 0, DETECT_IFACE: s.CFG_F_DETECT_IFACE, DETECT_NONE: s.CFG_F_DETECT_NONE}


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """epx_config: the node's masquerade address, port range, flags and conntrack timeouts.

    Timeouts follow nf_conntrack with kube-proxy's settings (agent/conntrack.py: established TCP
    86400 s, CLOSE_WAIT 3600 s; UDP as the kernel's 30 s / 120 s unless set); the masquerade
    range defaults above Linux's ip_local_port_range so it never collides with the node's own
    sockets.
    """

    snat_addr: str | None = None
    snat_port_min: int = 61000
    snat_port_max: int = 65535
    masquerade_all: bool = False
    localhost_nodeports: bool = True
    local_detect: str = DETECT_CIDR  # how the local-traffic detector decides: DETECT_CIDR, _IFACE or _NONE
    tcp_syn_timeout: int = 120
    tcp_est_timeout: int = 86400
    tcp_close_timeout: int = 10
    udp_timeout: int = 30
    udp_stream_timeout: int = 120
    tcp_close_wait_timeout: int = 3600
    # SCTP: nf_conntrack's defaults (kube-proxy sets none): COOKIE_WAIT/ECHOED, ESTABLISHED, CLOSED
    sctp_timeout: int = 3
    sctp_est_timeout: int = 210
    sctp_close_timeout: int = 10
    host_netns_cookie: int = 0
    handover: int = 0  # structs.CFG_F_NETFILTER_* while a mode switch moves connections (agent/handover.py)
    adopted_masq: bool = False  # structs.CFG_F_ADOPTED_MASQ: such connections are in epx_ct4
    host_routing: bool = False  # structs.CFG_F_HOST_ROUTING: tc_ingress forwards what it translated (fib4.h)


@dataclass(frozen=True, slots=True)
class Connection:
    """One epx_ct4 (or epx_ct6) entry, decoded."""

    kind: int  # structs.CT4_*
    proto: int
    saddr: str
    sport: int
    daddr: str
    dport: int
    nat_addr: str
    nat_port: int
    svc_addr: str
    svc_port: int
    backend_id: int
    snat_addr: str
    snat_port: int
    flags: int
    expires_ns: int
    state: int = 0  # structs.CT4_S_*


PRESSURE_FILL = 0.95  # nf_conntrack's gc worker: above 95 % full, closing TCP connections go too


@dataclass(frozen=True, slots=True)
class ConntrackUsage:
    """epx_ct4's fill level after a garbage-collection pass (Maps.collect_connections)."""

    entries: int  # entries left, every kind (a connection holds 2, or 4 when masqueraded)
    capacity: int  # the map's max_entries
    connections: int  # live connections (CT4_SVC entries not expired)
    collected: int  # entries this pass removed


def _rev_dnat_client_port(k: s.CT4Key, v: s.CT4Entry) -> int:
    """The client's own port of the connection a CT4_REV_DNAT half (`k`, `v`) answers: the key's,
    or for a remapped connection (CT4_S_REMAP: keyed by the port it leaves with) the one the half
    keeps in snat_port (bpf/lib/ct4.h: ct4_rev_dnat_cport). Network order, as the fields."""
    return v.snat_port if v.state & s.CT4_S_REMAP else k.dport


def _snat_client_port(k: s.CT4Key, v: s.CT4Entry) -> int:
    """The client's own port of the connection a CT4_SNAT half (`k`, `v`) belongs to: the key's,
    or for a remapped (and masqueraded) connection, keyed by its masquerade port, the one the half
    keeps in snat_port (bpf/lib/ct4.h: ct4_snat_cport)."""
    return v.snat_port if v.state & s.CT4_S_REMAP else k.sport


def _wire_port(owner: s.CT4Entry, client_port: int) -> int:
    """The source port connection `owner` (a CT4_SVC entry of client port `client_port`) leaves
    with toward its backend, and so the port its CT4_REV_DNAT half is keyed by: snat_port when
    remapped (CT4_S_REMAP), else the client's own (bpf/lib/ct4.h: ct4_wire_port). Either byte
    order, as long as `client_port` is in the entry's."""
    return owner.snat_port if owner.state & s.CT4_S_REMAP else client_port


def _owner_tuple(k: s.CT4Key, v: s.CT4Entry) -> tuple | None:
    """The CT4_SVC key (saddr, daddr, sport, dport, proto) of the connection owning half `k`."""
    if k.kind == s.CT4_REV_DNAT:  # backend -> client; owner: client -> frontend
        return (k.daddr, v.svc_addr, _rev_dnat_client_port(k, v), v.svc_port, k.proto)
    if k.kind == s.CT4_SNAT:  # client -> backend; owner: client -> frontend
        return (k.saddr, v.svc_addr, _snat_client_port(k, v), v.svc_port, k.proto)
    if k.kind == s.CT4_REV_SNAT:  # backend -> masquerade addr:port; owner: client (nat_*) -> frontend
        return (v.nat_addr, v.svc_addr, v.nat_port, v.svc_port, k.proto)
    return None  # an unknown kind: nothing reads it


def _half_is_live(k: s.CT4Key, v: s.CT4Entry, owner: s.CT4Entry | None, now_ns: int) -> bool:
    """Whether the datapath would still honour half-entry `k` of connection `owner` (bpf/lib/nat4.h's
    owner checks): the connection exists, has not expired, and still points at this half."""
    if owner is None or owner.expires <= now_ns:
        return False
    if k.kind == s.CT4_REV_DNAT:  # the same backend, and keyed by the port the connection leaves with
        return (owner.nat_addr, owner.nat_port) == (k.saddr, k.sport) and \
            _wire_port(owner, _rev_dnat_client_port(k, v)) == k.dport
    if k.kind == s.CT4_SNAT:  # masqueraded to the same backend, keyed by the port it leaves with
        return bool(owner.flags & s.CT4_F_MASQ) and \
            (owner.nat_addr, owner.nat_port, owner.snat_port) == (k.daddr, k.dport, v.nat_port) and \
            _wire_port(owner, _snat_client_port(k, v)) == k.sport
    if k.kind == s.CT4_REV_SNAT:  # masqueraded: a remapped connection's snat_port is no masquerade port
        return bool(owner.flags & s.CT4_F_MASQ) and \
            (owner.nat_addr, owner.nat_port, owner.snat_port) == (k.saddr, k.sport, k.dport)
    return False


def live_owner(maps: "Maps", key: s.CT4Key, now_ns: int) -> tuple[s.CT4Entry, s.CT4Key, s.CT4Entry] | None:
    """(the epx_ct4 half at `key`, its connection's CT4_SVC key, that connection's entry) when the
    half answers a live connection by the datapath's owner checks (_half_is_live), else None:
    another connection must not take the key over then (bpf/lib/ct4.h: ct4_rev_dnat_taken). One
    read of the half and one of its connection."""
    half = maps.connection_entry(key)
    owner_key = _owner_tuple(key, half) if half is not None else None
    if owner_key is None:
        return None
    svc_key = _svc_key(owner_key)
    owner = maps.connection_entry(svc_key)
    return (half, svc_key, owner) if _half_is_live(key, half, owner, now_ns) else None


def half_is_held(maps: "Maps", key: s.CT4Key, now_ns: int) -> bool:
    """Whether the epx_ct4 half at `key` answers a live connection (live_owner)."""
    return live_owner(maps, key, now_ns) is not None


def half_owner(key: s.CT4Key, half: s.CT4Entry) -> tuple | None:
    """The CT4_SVC key (saddr, daddr, sport, dport, proto, raw fields) of the connection half
    `key`, `half` belongs to, whether or not it is alive."""
    return _owner_tuple(key, half)


def _svc_key(t: tuple) -> s.CT4Key:
    return s.CT4Key(saddr=t[0], daddr=t[1], sport=t[2], dport=t[3], proto=t[4], kind=s.CT4_SVC)


_NO_BATCH = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, 524)  # 524: ENOTSUPP (kernel): the map type cannot batch


def _walk(fd: int, key_type: type) -> Iterator:
    key = None
    while True:
        nxt = key_type()
        if not libbpf.map_next_key(fd, key, nxt):
            return
        yield nxt
        key = nxt


def count_entries(fd: int, name: str) -> int:
    """Entries in hash/LRU/LPM map `name` behind `fd`: batched reads where the map type allows,
    else a key walk."""
    spec = s.MAPS[name]
    try:
        return libbpf.map_count_batched(fd, ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf))
    except OSError as exc:
        if exc.errno not in _NO_BATCH:
            raise
    return sum(1 for _ in _walk(fd, spec.key))


def ct_key(saddr: str, daddr: str, sport: int, dport: int, proto: int, kind: int) -> s.CT4Key:
    """The epx_ct4 key of one entry (addresses and ports as strings and host-order numbers)."""
    return s.CT4Key(saddr=be32(saddr), daddr=be32(daddr), sport=be16(sport), dport=be16(dport), proto=proto, kind=kind)


def _connection(k: s.CT4Key, v: s.CT4Entry) -> Connection:
    return Connection(
        kind=k.kind, proto=k.proto,
        saddr=ip_str(k.saddr), sport=port_int(k.sport), daddr=ip_str(k.daddr), dport=port_int(k.dport),
        nat_addr=ip_str(v.nat_addr), nat_port=port_int(v.nat_port),
        svc_addr=ip_str(v.svc_addr), svc_port=port_int(v.svc_port), backend_id=v.backend_id,
        snat_addr=ip_str(v.snat_addr), snat_port=port_int(v.snat_port), flags=v.flags,
        expires_ns=v.expires, state=v.state,
    )


def _batches(fd: int, key_type: type, value_type: type, chunk: int = 4096) -> Iterator[tuple]:
    """Every entry of the map behind `fd` as (keys, values, n) batches of ctypes arrays of
    `key_type` and `value_type` that the next batch overwrites: BPF_MAP_LOOKUP_BATCH, `chunk`
    entries per syscall, where the map type allows, else a key walk (batches of one). Each entry
    at most once, as both give it for a map written meanwhile. Every reader of a whole map
    (stream_items, raw_batches, the connection table's) reads through this one fallback."""
    batches = libbpf.map_batches(fd, key_type, value_type, chunk)
    try:
        first = next(batches, None)
    except OSError as exc:  # the first read tells whether the kernel can batch this map
        if exc.errno not in _NO_BATCH:
            raise
    else:
        if first is not None:
            yield first
            yield from batches
        return
    for key in list(_walk(fd, key_type)):
        value = value_type()
        if libbpf.map_lookup(fd, key, value):
            # arrays of one, as a batch's: an entry reads the same whichever way it came
            yield (key_type * 1)(key), (value_type * 1)(value), 1


def stream_items(fd: int, name: str) -> Iterator[tuple]:
    """Every (key, value) of map `name` behind `fd`, streamed: batched reads where the map type
    allows (4096 entries per syscall, nothing held but the batch), else a key walk."""
    spec = s.MAPS[name]
    return libbpf.batch_items(_batches(fd, spec.key, spec.leaf), spec.key, spec.leaf)


def raw_batches(fd: int, name: str, chunk: int = 4096) -> Iterator[tuple[bytes, bytes, int]]:
    """Every entry of map `name` behind `fd` as (keys, values, n) batches of raw bytes: the batch's
    n keys back to back, its n values back to back, as the kernel holds them (structs.py's
    layouts), the caller's to keep. Reading a million entries this way costs a copy per batch
    (`chunk` entries), where stream_items makes two ctypes objects per entry (and its readers a
    Python object per field): adopt.read of 100,000 Services x 10 endpoints reads 2.5 million
    entries at every restart and drift audit. Batched where the map type allows, else a key walk
    (see _batches); only one batch is held at a time."""
    spec = s.MAPS[name]
    key_size, value_size = ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf)
    for keys, values, n in _batches(fd, spec.key, spec.leaf, chunk):
        yield ctscan.raw(keys, n, key_size), ctscan.raw(values, n, value_size), n


def _connection6(k: s.CT6Key, v: s.CT6Entry) -> Connection:
    """An epx_ct6 entry as a Connection (its addresses are strings: either family)."""
    return Connection(
        kind=k.kind, proto=k.proto,
        saddr=ip6_str(k.saddr), sport=port_int(k.sport), daddr=ip6_str(k.daddr), dport=port_int(k.dport),
        nat_addr=ip6_str(v.nat_addr), nat_port=port_int(v.nat_port),
        svc_addr=ip6_str(v.svc_addr), svc_port=port_int(v.svc_port), backend_id=v.backend_id,
        snat_addr=ip6_str(v.snat_addr), snat_port=port_int(v.snat_port), flags=v.flags,
        expires_ns=v.expires, state=v.state,
    )


def _lpm6(cidr: str) -> tuple[int, s.In6]:
    net = ipaddress.IPv6Network(cidr, strict=False)
    return net.prefixlen, in6(str(net.network_address))


def _frontend_key(fe: Frontend) -> s.LB4Key:
    return s.LB4Key(addr=be32(fe.addr) if fe.addr else 0, port=be16(fe.port), proto=fe.proto)


# ---- packed entries, for batched writes ----
# The entries a sync writes by the million (backends, slots, frontends) are packed with struct,
# not built as ctypes objects: ~0.3 µs an entry instead of ~2. The layouts are the structs.py
# mirrors' (sizes checked below, and compared byte for byte in tests/unit/test_map_packing.py); the
# __be fields go in as socket.inet_aton's bytes and htons'd ports, as everywhere in this module.
_U32 = struct.Struct("=I")
_LB4_KEY = struct.Struct("=4sHBx")  # lb4_key: addr (network order), port (network order), proto, pad
_LB4_SERVICE = struct.Struct("=IHHII")  # lb4_service: id, count, local_count, affinity_timeout, flags
_LB4_SLOT_KEY = struct.Struct("=IHBB")  # lb4_slot_key: svc_id, slot, scope, bank
_SLOT_TAIL = struct.Struct("=HBB")  # lb4_slot_key after its svc_id: slot, scope, bank
_LB4_BACKEND = struct.Struct("=4sHBx")  # lb4_backend: addr, port (network order), flags, pad
for _packer, _mirror in ((_LB4_KEY, s.LB4Key), (_LB4_SERVICE, s.LB4Service), (_LB4_SLOT_KEY, s.LB4SlotKey),
                         (_LB4_BACKEND, s.LB4Backend), (_U32, s.u32)):
    if _packer.size != ctypes.sizeof(_mirror):  # structs.py changed: the packers must follow
        raise ImportError(f"maps.py packs {_mirror.__name__} in {_packer.size} bytes, structs.py has "
                          f"{ctypes.sizeof(_mirror)}")
if _U32.size + _SLOT_TAIL.size != _LB4_SLOT_KEY.size:
    raise ImportError("maps.py: lb4_slot_key is not its svc_id followed by (slot, scope, bank)")
# lb4_key as read back: the same layout as _LB4_KEY, the port (network order) read as its number
_LB4_KEY_READ = struct.Struct("!4sHBx")
if array(_ID).itemsize != _U32.size or array("Q").itemsize != 2 * _U32.size:  # lb4_key's: checked below, with lb6_key's
    raise ImportError("maps.py: the read-back arrays (u32 and u64) do not match the packers'")
_NO_ADDR = bytes(4)


def packed_slot_keys(raw: bytes, little_endian: bool = _LITTLE_ENDIAN) -> array:
    """epx_slot keys (lb4_slot_key: u32 svc_id, u16 slot, u8 scope, u8 bank, host order), back to
    back, as one u64 each: svc_id << 32 | bank << 24 | scope << 16 | slot, in an array "Q" (the
    order of adopt.SlotTable's keys: a service's slots in a run).

    On a little-endian host the 4 bytes after svc_id, read as a u32, are exactly
    slot | scope << 16 | bank << 24: the u64s are the keys' two u32 halves swapped, done by two
    strided copies in C, no Python object per key (adopt.read packs 1.5 million slot keys at
    every restart and drift audit at 100,000 Services x 10 endpoints). Elsewhere each key is
    unpacked."""
    if not little_endian:
        return array("Q", [svc_id << 32 | bank << 24 | scope << 16 | slot
                           for svc_id, slot, scope, bank in _LB4_SLOT_KEY.iter_unpack(raw)])
    if len(raw) % _LB4_SLOT_KEY.size:
        raise ValueError(f"{len(raw)} bytes are not whole {_LB4_SLOT_KEY.size}-byte lb4_slot_keys")
    words = memoryview(raw).cast(_ID)  # svc_id, tail, svc_id, tail, ...
    packed = array("Q", bytes(len(raw)))
    halves = memoryview(packed).cast("B").cast(_ID)  # each u64: its low u32, then its high u32
    halves[0::2] = words[1::2]
    halves[1::2] = words[0::2]
    return packed


@dataclass(frozen=True, slots=True)
class BackendValues:
    """How one family's epx_backend values read (Maps.BACKEND_VALUES): adopt.BackendTable keeps
    a read-back's values raw, a million at 100,000 Services x 10 endpoints, and makes a Backend
    only for the one asked for."""

    name: str  # the C struct, for error messages
    size: int  # bytes a value
    record: Callable[[bytes], Backend]  # one raw value -> its Backend
    collect: Callable[[bytes, bytes], Mapping[int, Backend]]  # (u32 ids, raw values) -> as ServiceEntries keeps them

    def __reduce__(self) -> str:
        """Pickled as the module's constant it is (BACKEND4, BACKEND6): its functions are not
        picklable, and a read-back crosses from a helper process (readback.py)."""
        return _BACKEND_VALUES_NAMES[self.name]


def _backend4_of(raw: bytes) -> Backend:
    addr, port, flags = _LB4_BACKEND.unpack(raw)
    return Backend(socket.inet_ntoa(addr), socket.ntohs(port), bool(flags & s.LB4_BE_IN_CLUSTER),
                   bool(flags & s.LB4_BE_IN_LOCAL))


# Backends holds the ids then the lb4_backend values as the map does: a read-back packs as it is.
BACKEND4 = BackendValues("lb4_backend", _LB4_BACKEND.size, _backend4_of, lambda ids, values: Backends(ids + values))
_BACKEND_VALUES_NAMES = {"lb4_backend": "BACKEND4", "lb6_backend": "BACKEND6"}  # BackendValues.__reduce__


def pack_frontend(fe: Frontend) -> bytes:
    """epx_svc's key for `fe`, packed."""
    return _LB4_KEY.pack(socket.inet_aton(fe.addr) if fe.addr else _NO_ADDR, socket.htons(fe.port), fe.proto)


def pack_service(svc: Service) -> bytes:
    """epx_svc's value for `svc`, packed."""
    return _LB4_SERVICE.pack(svc.id, svc.count, svc.local_count, svc.affinity_timeout, svc.flags)


# pack_service(Service(id, count, local_count, affinity_timeout, flags)), without the record
pack_service_fields: Callable[[int, int, int, int, int], bytes] = _LB4_SERVICE.pack


def pack_backend(be: Backend) -> bytes:
    """epx_backend's value for `be`, packed."""
    return _LB4_BACKEND.pack(socket.inet_aton(be.addr), socket.htons(be.port), _backend_flags(be.in_cluster, be.in_local))


def pack_slot_key(svc_id: int, scope: int, slot: int, bank: int = 0) -> bytes:
    """epx_slot's key, packed."""
    return _LB4_SLOT_KEY.pack(svc_id, slot, scope, bank)


_SLOT_TAILS: dict[tuple[int, int], list[bytes]] = {}  # (scope, bank) -> [b"", then slot, scope, bank of slot 0, 1, ...]


def slot_array_keys(svc_id: int, scope: int, bank: int, n: int) -> bytes:
    """The epx_slot keys of slots 0..n-1 of one scope and bank of service `svc_id`, packed back
    to back: pack_slot_key(svc_id, scope, slot, bank) for each slot, made by one join in C (the
    key is the id's 4 bytes, then the slot's (slot, scope, bank), which does not depend on the
    service: cached). A full sync at 100,000 Services x 10 endpoints writes a million slots."""
    tails = _SLOT_TAILS.get((scope, bank))
    if tails is None or len(tails) <= n:
        tails = [b""] + [_SLOT_TAIL.pack(slot, scope, bank) for slot in range(max(n, 64))]
        _SLOT_TAILS[(scope, bank)] = tails
    return _U32.pack(svc_id).join(tails[:n + 1])


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def _lpm(cidr: str) -> tuple[int, int]:
    net = ipaddress.IPv4Network(cidr, strict=False)
    return net.prefixlen, be32(str(net.network_address))


class MapFull(OSError):
    """A write found map `name` full (the kernel's E2BIG): a capacity question, not a bug, so the
    message names the map, its capacity and the setting that raises it."""

    def __init__(self, name: str, capacity: int, what: str = "") -> None:
        """`what`: what the full map cost, put before the message (e.g. the ports left out)."""
        self.name, self.capacity = name, capacity
        how = ("--conntrack-max-per-core / --conntrack-min" if name in ("epx_ct4", "epx_ct6")
               else f"--bpf-map-sizes {name}=N (N > {capacity:,})")
        super().__init__(errno.E2BIG,
                         f"{what}BPF map {name} is full ({capacity:,} entries): raise its capacity with {how}")


class Maps:
    """The datapath's maps by name -> fd (from loader.Loaded, or opened from pins)."""

    BACKEND_VALUES = BACKEND4  # what epx_backend's values are (Maps6: lb6_backend)

    def __init__(self, fds: Mapping[str, int], owned: bool = False) -> None:
        missing = set(s.MAPS) - set(fds)
        if missing:
            raise KeyError(f"maps missing: {sorted(missing)}")
        self._fds = dict(fds)
        self._owned = owned
        self._batch_ok = True  # BPF_MAP_UPDATE_BATCH works (until a kernel says it does not)
        # halves (key + entry bytes) the last conntrack GC pass found without their connection
        self._orphans = ctscan.Hashes()

    @classmethod
    def from_loaded(cls, loaded) -> Maps:
        return cls(dict(loaded.map_fds))

    @classmethod
    def open_pinned(cls, pin_dir: Path, readonly: bool = False) -> Maps:
        """Every map pinned in `pin_dir`; `readonly`: through fds that cannot write them."""
        get = libbpf.obj_get_readonly if readonly else libbpf.obj_get
        fds: dict[str, int] = {}
        try:
            for name in s.MAPS:
                fds[name] = get(str(pin_dir / name))
        except OSError:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(fds, owned=True)

    def close(self) -> None:
        if self._owned:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # -- generic --

    def _fd(self, name: str) -> int:
        return self._fds[name]

    def _name(self, name: str) -> str:
        """The map that plays role `name` (an IPv4 map's name) for this family (Maps6: its twin)."""
        return name

    def _put(self, name: str, key, value) -> None:
        fd = self._fd(name)
        try:
            libbpf.map_update(fd, key, value)
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                raise MapFull(name, libbpf.map_info(fd).max_entries) from None
            raise

    def _put_packed(self, name: str, entries: Sequence[tuple[bytes, bytes]]) -> None:
        """Write packed (key, value) entries of map `name` in order: one BPF_MAP_UPDATE_BATCH
        where the kernel has it (a single entry, or a kernel without it: one update each), so
        whoever reads the map sees the entries appear in the order given, as with single
        writes, and a full map raises MapFull with the entries before it written."""
        count = len(entries)
        if not count:
            return
        spec = s.MAPS[name]
        if count == 1 or not self._batch_ok:
            for key, value in entries:
                self._put(name, spec.key.from_buffer_copy(key), spec.leaf.from_buffer_copy(value))
            return
        fd = self._fd(name)
        if isinstance(entries, MapEntries):
            keys, values = entries.keys, entries.values
        else:
            keys, values = b"".join(k for k, _ in entries), b"".join(v for _, v in entries)
        try:
            libbpf.map_update_batch(fd, keys, values, count)
        except libbpf.BatchError as exc:
            if exc.errno == errno.E2BIG:
                raise MapFull(name, libbpf.map_info(fd).max_entries) from None
            if exc.errno not in _NO_BATCH or exc.done:
                raise
            self._batch_ok = False  # this kernel cannot batch: one by one from now on
            self._put_packed(name, entries)

    def _get(self, name: str, key):
        value = s.MAPS[name].leaf()
        return value if libbpf.map_lookup(self._fd(name), key, value) else None

    def map_id(self, name: str) -> int:
        """The kernel's id of map `name` (what a program's info lists among the maps it uses)."""
        return libbpf.map_info(self._fd(name)).id

    def keys(self, name: str) -> Iterator:
        """Every key of a map (as its structs mirror)."""
        return _walk(self._fd(name), s.MAPS[name].key)

    def _items(self, name: str) -> Iterator[tuple]:
        return stream_items(self._fd(name), name)

    def clear(self, name: str) -> int:
        """Delete every entry of a hash/LRU/LPM map; returns how many."""
        keys = list(self.keys(name))
        for key in keys:
            libbpf.map_delete(self._fd(name), key)
        return len(keys)

    # -- node --

    def set_settings(self, cfg: NodeSettings) -> bool:
        """Write epx_config; returns False (and writes nothing) when it already holds `cfg`."""
        value = self.config_of(cfg)
        current = self._get("epx_config", s.u32(0))
        if current is not None and bytes(current) == bytes(value):
            return False
        self._put("epx_config", s.u32(0), value)
        return True

    @staticmethod
    def config_of(cfg: NodeSettings) -> s.LB4Config:
        """The epx_config struct that holds `cfg`."""
        flags = (s.CFG_F_MASQ_ALL if cfg.masquerade_all else 0) | (
            s.CFG_F_LOCALHOST_NODEPORTS if cfg.localhost_nodeports else 0
        ) | _DETECT_FLAGS[cfg.local_detect] | cfg.handover | (s.CFG_F_ADOPTED_MASQ if cfg.adopted_masq else 0) | (
            s.CFG_F_HOST_ROUTING if cfg.host_routing else 0)
        return s.LB4Config(
            snat_addr=be32(cfg.snat_addr) if cfg.snat_addr else 0,
            snat_port_min=cfg.snat_port_min,
            snat_port_max=cfg.snat_port_max,
            flags=flags,
            tcp_syn_timeout=cfg.tcp_syn_timeout,
            tcp_est_timeout=cfg.tcp_est_timeout,
            tcp_close_timeout=cfg.tcp_close_timeout,
            udp_timeout=cfg.udp_timeout,
            udp_stream_timeout=cfg.udp_stream_timeout,
            tcp_close_wait_timeout=cfg.tcp_close_wait_timeout,
            sctp_timeout=cfg.sctp_timeout,
            sctp_est_timeout=cfg.sctp_est_timeout,
            sctp_close_timeout=cfg.sctp_close_timeout,
            host_netns_cookie=cfg.host_netns_cookie,
        )

    def config(self) -> s.LB4Config:
        """epx_config as it is (the raw struct: flags and addresses as the programs read them)."""
        return self._get("epx_config", s.u32(0)) or s.LB4Config()

    def set_config(self, value: s.LB4Config) -> None:
        """Write epx_config as given (ebpf/handover.py: one flag changed on a node whose agent is gone)."""
        self._put("epx_config", s.u32(0), value)

    def set_node_addrs(self, addrs: Iterable[str]) -> int:
        """Make epx_node_addr exactly `addrs`, touching only what differs. Returns the writes."""
        wanted = {be32(a) for a in addrs}
        present = {key.value for key in self.keys("epx_node_addr")}
        for raw in present - wanted:
            libbpf.map_delete(self._fd("epx_node_addr"), s.be32(raw))
        for raw in wanted - present:
            self._put("epx_node_addr", s.be32(raw), s.u32(1))
        return len(present ^ wanted)

    def node_addrs(self) -> set[str]:
        """What epx_node_addr holds."""
        return {ip_str(key.value) for key in self.keys("epx_node_addr")}

    def ifaces(self) -> dict[int, int]:
        """What epx_iface holds: ifindex -> EPX_IF_* flags."""
        return {key.value: self._get("epx_iface", key).value for key in self.keys("epx_iface")}

    def pod_cidrs(self) -> set[str]:
        """What epx_pod_cidr holds, as CIDR strings."""
        return {f"{ip_str(key.addr)}/{key.prefixlen}" for key in self.keys("epx_pod_cidr")}

    def set_ifaces(self, flags: Mapping[int, int]) -> int:
        """Make epx_iface exactly `flags` (ifindex -> EPX_IF_*, zero flags left out), touching only
        what differs. Returns the writes."""
        wanted = {index: value for index, value in flags.items() if value}
        present = {key.value: self._get("epx_iface", key).value for key in self.keys("epx_iface")}
        writes = 0
        for index in present.keys() - wanted.keys():
            libbpf.map_delete(self._fd("epx_iface"), s.u32(index))
            writes += 1
        for index, value in wanted.items():
            if present.get(index) != value:
                self._put("epx_iface", s.u32(index), s.u32(value))
                writes += 1
        return writes

    def set_pod_cidrs(self, cidrs: Iterable[str]) -> int:
        """Make epx_pod_cidr exactly `cidrs`, touching only what differs. Returns the writes."""
        wanted = {_lpm(c) for c in cidrs}
        present = {(key.prefixlen, key.addr) for key in self.keys("epx_pod_cidr")}
        for prefixlen, addr in present - wanted:
            libbpf.map_delete(self._fd("epx_pod_cidr"), s.LPM4Key(prefixlen=prefixlen, addr=addr))
        for prefixlen, addr in wanted - present:
            self._put("epx_pod_cidr", s.LPM4Key(prefixlen=prefixlen, addr=addr), s.u32(1))
        return len(present ^ wanted)

    # -- services --

    def set_service(self, fe: Frontend, svc: Service) -> None:
        value = s.LB4Service(
            id=svc.id,
            count=svc.count,
            local_count=svc.local_count,
            affinity_timeout=svc.affinity_timeout,
            flags=svc.flags,
        )
        self._put("epx_svc", _frontend_key(fe), value)

    def set_services(self, entries: Sequence[tuple[Frontend, Service]]) -> None:
        """set_service() of each (frontend, service), in order, batched (see _put_packed)."""
        key = self.frontend_key
        self._put_packed(self._name("epx_svc"), [(key(fe), pack_service(svc)) for fe, svc in entries])

    @staticmethod
    def frontend_key(fe: Frontend) -> bytes:
        """epx_svc's key for `fe`, packed (Maps6: epx_svc6's)."""
        return pack_frontend(fe)

    def put_entries(self, role: str, keys: bytes, values: bytes) -> None:
        """Write packed entries (their keys back to back, their values back to back), in order,
        batched (see _put_packed), to the map that plays `role` (an IPv4 map's name: Maps6
        writes its twin): what ServicePrograms gathers over many new service ports goes out in
        one call per map. Raises ValueError when the bytes are not whole entries of that map."""
        name = self._name(role)
        spec = s.MAPS[name]
        self._put_packed(name, MapEntries(keys, values, ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf)))

    # epx_svc's key as read back (Maps6: lb6_key's), and the address of a nodePort's key
    _FRONTEND_KEY_READ = _LB4_KEY_READ
    _NO_FRONTEND_ADDR = _NO_ADDR

    @staticmethod
    def _addr_text(addr: bytes) -> str:
        """A frontend key's address (network order) as text (Maps6: an IPv6 one)."""
        return socket.inet_ntoa(addr)

    def raw_entries(self, role: str, chunk: int = 4096) -> Iterator[tuple[bytes, bytes, int]]:
        """The map that plays `role` (an IPv4 map's name: Maps6 reads its twin) as raw batches:
        (keys, values, n), see raw_batches."""
        name = self._name(role)
        return raw_batches(self._fd(name), name, chunk)

    def service_rows(self) -> Iterator[tuple[bytes, int, int, tuple[int, int, int, int, int]]]:
        """Every epx_svc entry (epx_svc6 in Maps6) as (address, port, proto, (id, count,
        local_count, affinity_timeout, flags)): the address as its bytes in network order, b""
        for a nodePort's key (Frontend.addr None). Unpacked from the raw batches, no ctypes object
        and no address text made: adopt.read keeps the frontends packed."""
        key, nowhere, value = self._FRONTEND_KEY_READ, self._NO_FRONTEND_ADDR, _LB4_SERVICE
        for keys, values, _n in self.raw_entries("epx_svc"):
            for (addr, port, proto), record in zip(key.iter_unpack(keys), value.iter_unpack(values)):
                yield (b"" if addr == nowhere else addr), port, proto, record

    def services(self) -> Iterator[tuple[Frontend, Service]]:
        """Every frontend in epx_svc (epx_svc6 in Maps6) with the service it leads to."""
        text = self._addr_text
        for addr, port, proto, record in self.service_rows():
            yield Frontend(text(addr) if addr else None, port, proto), Service(*record)

    def backends(self) -> dict[int, Backend]:
        """Every epx_backend entry: backend id -> backend."""
        return {
            k.value: Backend(ip_str(v.addr), port_int(v.port), in_cluster=bool(v.flags & s.LB4_BE_IN_CLUSTER),
                             in_local=bool(v.flags & s.LB4_BE_IN_LOCAL))
            for k, v in self._items("epx_backend")
        }

    def backend_batches(self) -> Iterator[tuple[bytes, bytes]]:
        """epx_backend (epx_backend6 in Maps6) as (ids, values) batches: the ids as u32s back to
        back (host order), their values back to back as the map holds them (BACKEND_VALUES: their
        size and how one reads). For readers of a million entries that keep them packed
        (adopt.read): nothing made per entry."""
        for keys, values, _n in self.raw_entries("epx_backend"):
            yield keys, values

    def backend_rows(self) -> Iterator[tuple[int, bytes]]:
        """Every epx_backend entry (epx_backend6 in Maps6) as (backend id, raw value)."""
        size = self.BACKEND_VALUES.size
        for ids, values in self.backend_batches():
            for i, bid in enumerate(memoryview(ids).cast(_ID)):
                yield bid, values[i * size:(i + 1) * size]

    def slot_batches(self) -> Iterator[tuple[array, array]]:
        """epx_slot (epx_slot6 in Maps6) as (keys, backend ids) batches, two arrays in the same
        order: each key packed in a u64 (packed_slot_keys: svc_id << 32 | bank << 24 | scope << 16
        | slot, an array "Q"), its backend id a u32 (an array "I"). Made without an object per
        entry: adopt.read takes 1.5 million slots at 100,000 Services x 10 endpoints."""
        for keys, values, _n in self.raw_entries("epx_slot"):
            ids = array(_ID)
            ids.frombytes(values)
            yield packed_slot_keys(keys), ids

    def slots(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Every epx_slot entry as (service id, bank, scope, slot, backend id)."""
        for keys, ids in self.slot_batches():
            for key, bid in zip(keys, ids):
                yield key >> 32, key >> 24 & 0xFF, key >> 16 & 0xFF, key & 0xFFFF, bid

    def source_ranges(self) -> Iterator[tuple[int, str]]:
        """Every epx_src_range entry as (service id, CIDR)."""
        for k in self.keys("epx_src_range"):
            yield k.svc_id, f"{ip_str(k.addr)}/{k.prefixlen - 32}"

    def affinity_ids(self) -> Iterator[tuple[int, int]]:
        """(service id, backend id) of every affinity entry: ids that must not be handed out again."""
        for k, v in self._items(self._name("epx_affinity")):
            yield k.svc_id, v.backend_id

    def count(self, name: str) -> int:
        """Entries in a hash/LRU/LPM map: batched reads where the map type allows, else a key walk."""
        return count_entries(self._fd(name), name)

    def delete_service(self, fe: Frontend) -> bool:
        return libbpf.map_delete(self._fd("epx_svc"), _frontend_key(fe))

    def service(self, fe: Frontend) -> Service | None:
        v = self._get("epx_svc", _frontend_key(fe))
        if v is None:
            return None
        return Service(v.id, v.count, v.local_count, v.affinity_timeout, v.flags)

    def set_backend(self, backend_id: int, be: Backend) -> None:
        flags = (s.LB4_BE_IN_CLUSTER if be.in_cluster else 0) | (s.LB4_BE_IN_LOCAL if be.in_local else 0)
        self._put("epx_backend", s.u32(backend_id), s.LB4Backend(addr=be32(be.addr), port=be16(be.port), flags=flags))

    def set_backends(self, entries: Sequence[tuple[int, Backend]]) -> None:
        """set_backend() of each (backend id, backend), in order, batched (see _put_packed)."""
        entry = self.backend_entry
        self._put_packed(self._name("epx_backend"), [entry(bid, be) for bid, be in entries])

    @staticmethod
    def backend_entry(backend_id: int, be: Backend) -> tuple[bytes, bytes]:
        """epx_backend's (key, value) for backend `backend_id`, packed (Maps6: epx_backend6's)."""
        return _U32.pack(backend_id), pack_backend(be)

    def set_backend_entries(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        """set_backends() of entries already packed (Backends.map_entries), in order, batched."""
        self._put_packed("epx_backend", entries if isinstance(entries, MapEntries) else list(entries))

    def backend(self, backend_id: int) -> Backend | None:
        v = self._get("epx_backend", s.u32(backend_id))
        if v is None:
            return None
        return Backend(ip_str(v.addr), port_int(v.port), in_cluster=bool(v.flags & s.LB4_BE_IN_CLUSTER),
                       in_local=bool(v.flags & s.LB4_BE_IN_LOCAL))

    def delete_backend(self, backend_id: int) -> bool:
        return libbpf.map_delete(self._fd(self._name("epx_backend")), s.u32(backend_id))

    def set_slot(self, svc_id: int, scope: int, slot: int, backend_id: int, bank: int = 0) -> None:
        self._put(self._name("epx_slot"), s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank), s.u32(backend_id))

    def set_slot_entries(self, entries: Sequence[tuple[int, int, int, int, int]]) -> None:
        """set_slot() of each (svc_id, scope, slot, backend id, bank), in order, batched (see
        _put_packed)."""
        self._put_packed(self._name("epx_slot"), [(_LB4_SLOT_KEY.pack(svc_id, slot, scope, bank), _U32.pack(bid))
                                      for svc_id, scope, slot, bid, bank in entries])

    def set_slot_arrays(self, svc_id: int, bank: int, arrays: Sequence[tuple[int, bytes]]) -> None:
        """set_slot_entries() of every slot of each (scope, backend ids by slot as native u32s, as
        array("I") packs them), scope after scope, slot after slot: a whole new slot array (a new
        service, a bank swap) written without a tuple per slot."""
        keys = b"".join([slot_array_keys(svc_id, scope, bank, len(ids) // _U32.size) for scope, ids in arrays])
        values = b"".join([ids for _, ids in arrays])
        self._put_packed(self._name("epx_slot"), MapEntries(keys, values, _LB4_SLOT_KEY.size, _U32.size))

    def slot(self, svc_id: int, scope: int, slot: int, bank: int = 0) -> int | None:
        value = self._get(self._name("epx_slot"), s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank))
        return None if value is None else value.value

    def delete_slot(self, svc_id: int, scope: int, slot: int, bank: int = 0) -> bool:
        return libbpf.map_delete(self._fd(self._name("epx_slot")), s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank))

    def set_slots(self, svc_id: int, scope: int, backend_ids: Sequence[int], previous: int = 0) -> None:
        """Slots 0..n-1 of (svc_id, scope) -> backend_ids; slots n..previous-1 are deleted.

        Write the slots before raising the service's count, lower the count before deleting them,
        and a packet never picks a slot that is not there.
        """
        for slot, backend_id in enumerate(backend_ids):
            self.set_slot(svc_id, scope, slot, backend_id)
        for slot in range(len(backend_ids), previous):
            self.delete_slot(svc_id, scope, slot)

    def add_source_range(self, svc_id: int, cidr: str) -> None:
        prefixlen, addr = _lpm(cidr)
        self._put("epx_src_range", s.LB4RangeKey(prefixlen=32 + prefixlen, svc_id=svc_id, addr=addr), s.u32(1))

    def delete_source_range(self, svc_id: int, cidr: str) -> bool:
        prefixlen, addr = _lpm(cidr)
        return libbpf.map_delete(self._fd("epx_src_range"), s.LB4RangeKey(prefixlen=32 + prefixlen, svc_id=svc_id, addr=addr))

    # -- affinity --

    def affinity(self, svc_id: int, client: str) -> tuple[int, int] | None:
        """(backend id, last use in ns) remembered for a client, if any."""
        v = self._get("epx_affinity", s.LB4AffinityKey(svc_id=svc_id, client=be32(client)))
        return None if v is None else (v.backend_id, v.last_used)

    def set_affinity(self, svc_id: int, client: str, backend_id: int, last_used_ns: int) -> None:
        key = s.LB4AffinityKey(svc_id=svc_id, client=be32(client))
        self._put("epx_affinity", key, s.LB4Affinity(last_used=last_used_ns, backend_id=backend_id))

    # -- connections --

    # the connection table this class's connection methods read (Maps6: epx_ct6)
    _CT = None  # set below the class: _CT4

    def _ct_batches(self) -> Iterator[tuple]:
        """epx_ct4 (Maps6: epx_ct6) as (keys, values, n) batches whose arrays the next batch
        overwrites: a table of 262,144 entries is read in 64 syscalls and never decoded whole (a
        key walk where the kernel cannot batch)."""
        table = self._CT
        return _batches(self._fd(table.name), table.key, table.entry)

    def connections(self, kind: int | None = None, proto: int | None = None) -> list[Connection]:
        """The epx_ct4 entries (only those of `kind` and `proto` when given), decoded. Filtering
        happens on the raw batches: asking for a few entries of a full table decodes only those."""
        out = []
        for keys, values, n in self._ct_batches():
            for i in range(n):
                k = keys[i]
                if (kind is None or k.kind == kind) and (proto is None or k.proto == proto):
                    out.append(self._CT.decode(k, values[i]))
        return out

    def max_connection_backend_id(self) -> int:
        """The highest backend id a connection (CT4_SVC entry) refers to; 0 when none does."""
        best = 0
        for keys, values, n in self._ct_batches():
            for i in range(n):
                if keys[i].kind == s.CT4_SVC and values[i].backend_id > best:
                    best = values[i].backend_id
        return best

    def collect_connections(self, now_ns: int) -> ConntrackUsage:
        """The connection table's garbage collector, and its fill level.

        epx_ct4 is a plain hash (bpf/maps.c): nothing evicts an entry. The datapath removes a
        connection it finds expired, or early-drops one when the table is full, but a connection
        nobody sends to again would stay: so, as nf_conntrack's gc worker, this pass removes every
        expired connection (CT4_SVC entry past its deadline) and every half whose owner is gone,
        expired, or no longer points at it (the datapath honours none of those); and, when the
        table is PRESSURE_FILL full, TCP connections that are closing, as nf_conntrack's gc worker
        early-drops them above 95 %.

        The datapath writes a connection's halves first and the connection last (ct4_create), and
        the table is read while packets create connections: a half read before its connection was
        written looks orphaned. Deleting it would leave the new connection without its reply
        translation (at 40,000 new UDP flows/s, ~1 in 200 did, and their replies never arrived).
        So a half is only removed when the previous pass found it orphaned already, unchanged (the
        halves of a connection this pass removes go in the next one), and each entry is read again
        just before its deletion (a half: its connection too), so one a packet refreshed or
        re-created stays.
        `now_ns` is bpf_ktime_get_ns()'s clock (CLOCK_MONOTONIC). Maps6: the same pass over epx_ct6.

        The pass reads the table twice, each batch judged as it comes as raw bytes (ctscan.py):
        the first read removes the expired connections and hashes the halves the others honour,
        the second judges the halves against those hashes. Only hashes outlive a batch, 8 bytes a
        half: holding the halves' bytes until every connection was known raised a 1-Service
        agent's peak RSS by ~17 MiB under a NodePort load (~100,000 entries), and a full table's
        pass by as much (tests/bpf/test_ct_gc_full.py). A connection written between the two reads
        leaves its halves looking orphaned: the next pass, which finds it, keeps them."""
        table = self._CT
        fd = self._fd(table.name)
        layout = _ct_layout(table)
        ksz, vsz, kind_at = layout.key_size, layout.entry_size, layout.kind
        live = ctscan.Hashes()  # halves the live connections honour
        closing = ctscan.Hashes()  # halves closing TCP/SCTP connections honour: not when pressed
        entries = owners = gone = collected = 0
        for keys, values, n in self._ct_batches():
            entries += n
            kb, vb = ctscan.raw(keys, n, ksz), ctscan.raw(values, n, vsz)
            for i in range(n):
                if kb[i * ksz + kind_at] != s.CT4_SVC:
                    continue  # a half: the second read judges it
                owners += 1
                k, v = kb[i * ksz:(i + 1) * ksz], vb[i * vsz:(i + 1) * vsz]
                if layout.expires.unpack_from(v)[0] <= now_ns:
                    gone += 1  # the batch read is past it: deleting it disturbs nothing still to read
                    collected += self._delete_if_unchanged(table.key.from_buffer_copy(k), v)
                    continue
                into = closing if k[layout.proto] in _CLOSABLE and v[layout.flags] & s.CT4_F_CLOSING else live
                for identity in layout.owner_identities(k, v):
                    into.add(identity)
        live.seal()
        closing.seal()
        # nf_conntrack's gc worker, above 95 % full, also early-drops TCP and SCTP connections that
        # are closing (can_early_drop; ct4_evictable); their halves go in the next pass
        capacity = libbpf.map_info(fd).max_entries
        pressed = entries >= PRESSURE_FILL * capacity
        flat = table.flat
        orphans = ctscan.Hashes()
        for keys, values, n in self._ct_batches():
            kb, vb = ctscan.raw(keys, n, ksz), ctscan.raw(values, n, vsz)
            for i in range(n):
                is_connection = kb[i * ksz + kind_at] == s.CT4_SVC
                if is_connection and not pressed:
                    continue  # judged by the first read
                k, v = kb[i * ksz:(i + 1) * ksz], vb[i * vsz:(i + 1) * vsz]
                if is_connection:
                    if k[layout.proto] in _CLOSABLE and v[layout.flags] & s.CT4_F_CLOSING:
                        gone += 1
                        collected += self._delete_if_unchanged(table.key.from_buffer_copy(k), v)
                    continue
                identity = layout.half_identity(k, v)
                if identity is not None and (identity in live or (not pressed and identity in closing)):
                    continue
                half = k + v
                if half not in self._orphans:
                    orphans.add(half)  # perhaps a connection being (re-)created: next pass
                    continue
                key, entry = table.key.from_buffer_copy(k), table.entry.from_buffer_copy(v)
                fk, fv = flat(key), flat(entry)
                owner_key = _owner_tuple(fk, fv)
                if owner_key is not None:
                    owner = self.connection_entry(table.svc_key(owner_key))
                    if _half_is_live(fk, fv, flat(owner) if owner is not None else None, now_ns):
                        continue  # its connection was (re-)created since the read
                collected += self._delete_if_unchanged(key, entry)
        orphans.seal()
        self._orphans = orphans
        return ConntrackUsage(entries=entries - collected, capacity=capacity, connections=owners - gone,
                              collected=collected)

    def _delete_if_unchanged(self, key: s.CT4Key, seen: s.CT4Entry) -> bool:
        """Delete connection-table entry `key` if it still holds `seen`: one written again since the
        read (a packet refreshed or re-created it) is not ours to judge any more."""
        current = self.connection_entry(key)
        if current is None or bytes(current) != bytes(seen):
            return False
        return self.delete_connection_entry(key)

    def delete_connection(self, c: Connection) -> bool:
        return self.delete_connection_entry(self._CT.key_of(c))

    def put_connection_entry(self, key: s.CT4Key, entry: s.CT4Entry) -> None:
        """Write one epx_ct4 entry (ebpf/handover.py: a connection the kernel translated until now)."""
        self._put(self._CT.name, key, entry)

    def connection_entry(self, key: s.CT4Key) -> s.CT4Entry | None:
        return self._get(self._CT.name, key)

    def delete_connection_entry(self, key: s.CT4Key) -> bool:
        return libbpf.map_delete(self._fd(self._CT.name), key)

    def set_connection_expiry(self, c: Connection, expires_ns: int) -> None:
        """Move a connection's deadline (tests and the conntrack GC use it)."""
        key = self._CT.key_of(c)
        value = self._get(self._CT.name, key)
        if value is None:
            raise KeyError(c)
        value.expires = expires_ns
        self._put(self._CT.name, key, value)

    # -- IPv6 (the epx_*6 maps): a minimal writer with the IPv4 one's conventions. Service and
    # backend ids are the IPv6 writer's own: the maps are separate, so they never collide. --

    def set_node_addrs6(self, addrs: Iterable[str]) -> int:
        """Make epx_node_addr6 exactly `addrs`, touching only what differs. Returns the writes."""
        wanted = {bytes(in6(a)) for a in addrs}
        present = {bytes(key) for key in self.keys("epx_node_addr6")}
        for raw in present - wanted:
            libbpf.map_delete(self._fd("epx_node_addr6"), s.In6.from_buffer_copy(raw))
        for raw in wanted - present:
            self._put("epx_node_addr6", s.In6.from_buffer_copy(raw), s.u32(1))
        return len(present ^ wanted)

    def set_pod_cidrs6(self, cidrs: Iterable[str]) -> int:
        """Make epx_pod_cidr6 exactly `cidrs`, touching only what differs. Returns the writes."""
        wanted = {(plen, bytes(addr)) for plen, addr in map(_lpm6, cidrs)}
        present = {(key.prefixlen, bytes(key.addr)) for key in self.keys("epx_pod_cidr6")}
        for plen, raw in present - wanted:
            libbpf.map_delete(self._fd("epx_pod_cidr6"), s.LPM6Key(prefixlen=plen, addr=s.In6.from_buffer_copy(raw)))
        for plen, raw in wanted - present:
            self._put("epx_pod_cidr6", s.LPM6Key(prefixlen=plen, addr=s.In6.from_buffer_copy(raw)), s.u32(1))
        return len(present ^ wanted)

    def set_service6(self, fe: Frontend, svc: Service) -> None:
        """An IPv6 frontend (addr None: the nodePort on every node address) -> its service."""
        key = s.LB6Key(addr=in6(fe.addr), port=be16(fe.port), proto=fe.proto)
        value = s.LB4Service(id=svc.id, count=svc.count, local_count=svc.local_count,
                             affinity_timeout=svc.affinity_timeout, flags=svc.flags)
        self._put("epx_svc6", key, value)

    def set_backend6(self, backend_id: int, be: Backend) -> None:
        flags = (s.LB4_BE_IN_CLUSTER if be.in_cluster else 0) | (s.LB4_BE_IN_LOCAL if be.in_local else 0)
        self._put("epx_backend6", s.u32(backend_id), s.LB6Backend(addr=in6(be.addr), port=be16(be.port), flags=flags))

    def set_slots6(self, svc_id: int, scope: int, backend_ids: Sequence[int], previous: int = 0, bank: int = 0) -> None:
        """set_slots for epx_slot6 (same order rules: slots before the count that exposes them)."""
        for slot, backend_id in enumerate(backend_ids):
            self._put("epx_slot6", s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank), s.u32(backend_id))
        for slot in range(len(backend_ids), previous):
            libbpf.map_delete(self._fd("epx_slot6"), s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank))

    def add_source_range6(self, svc_id: int, cidr: str) -> None:
        prefixlen, addr = _lpm6(cidr)
        self._put("epx_src_range6", s.LB6RangeKey(prefixlen=32 + prefixlen, svc_id=svc_id, addr=addr), s.u32(1))

    def affinity6(self, svc_id: int, client: str) -> tuple[int, int] | None:
        """(backend id, last use in ns) remembered for an IPv6 client, if any."""
        v = self._get("epx_affinity6", s.LB6AffinityKey(svc_id=svc_id, client=in6(client)))
        return None if v is None else (v.backend_id, v.last_used)

    def connections6(self, kind: int | None = None) -> list[Connection]:
        """The epx_ct6 entries (only those of `kind` when given), decoded."""
        return [_connection6(k, v) for k, v in self._items("epx_ct6") if kind is None or k.kind == kind]

    def delete_connection6(self, c: Connection) -> bool:
        """Remove one epx_ct6 entry (delete_connection's IPv6 twin)."""
        key = s.CT6Key(saddr=in6(c.saddr), daddr=in6(c.daddr), sport=be16(c.sport), dport=be16(c.dport),
                       proto=c.proto, kind=c.kind)
        return libbpf.map_delete(self._fd("epx_ct6"), key)

    # -- counters --

    def stats(self) -> dict[s.Reason, tuple[int, int]]:
        """(packets, bytes) per reason, summed over CPUs."""
        ncpu = libbpf.num_possible_cpus()
        per_cpu = (s.EpxStat * ncpu)()
        out = {}
        for reason in s.Reason:
            if not libbpf.map_lookup(self._fd("epx_stats"), s.u32(reason), per_cpu):
                continue
            out[reason] = (sum(c.packets for c in per_cpu), sum(c.bytes for c in per_cpu))
        return out

    def trace_record(self, nonce: int) -> s.EpxTraceRec | None:
        """The trace record carrying `nonce` (trace mode, common.h): epx_trace is per-CPU and the
        run happened on whichever CPU the kernel chose, so every CPU's slot is looked at."""
        ncpu = libbpf.num_possible_cpus()
        per_cpu = (s.EpxTraceRec * ncpu)()
        if not libbpf.map_lookup(self._fd("epx_trace"), s.u32(0), per_cpu):
            return None
        for rec in per_cpu:
            if rec.nonce == nonce and rec.hook:
                return s.EpxTraceRec.from_buffer_copy(rec)
        return None

    def reset_stats(self) -> None:
        ncpu = libbpf.num_possible_cpus()
        zero = (s.EpxStat * ncpu)()
        for reason in s.Reason:
            self._put("epx_stats", s.u32(reason), zero)

    def reset(self) -> None:
        """Empty every map and zero the counters and settings: a blank datapath."""
        for name in s.MAPS:
            if name not in ARRAY_MAPS:
                self.clear(name)
        self._put("epx_config", s.u32(0), s.LB4Config())
        self._put("epx_config6", s.u32(0), s.LB6Config())
        self._put("epx_ct4_ring", s.u32(0), (s.CT4Ring * libbpf.num_possible_cpus())())
        self.reset_stats()


@dataclass(frozen=True)
class _CtTable:
    """One connection table as Maps' connection methods see it: epx_ct4, or epx_ct6 (Maps6)."""

    name: str
    key: type
    entry: type
    decode: Callable[[object, object], Connection]  # (key, entry) -> Connection
    key_of: Callable[[Connection], object]  # a Connection's key
    # a key or entry with addresses that compare and hash by value (epx_ct4's are integers
    # already; epx_ct6's In6 structs compare by identity, so they become bytes)
    flat: Callable[[object], object]
    svc_key: Callable[[tuple], object]  # the CT4_SVC key of an owner tuple (saddr, daddr, sport, dport, proto)


def _same(raw: object) -> object:
    return raw


class _Flat6:
    """An epx_ct6 key or entry with its In6 fields as bytes (see _CtTable.flat)."""

    def __init__(self, raw: ctypes.Structure) -> None:
        for name, _type in raw._fields_:
            value = getattr(raw, name)
            setattr(self, name, bytes(value) if isinstance(value, s.In6) else value)


def _svc_key6(t: tuple) -> s.CT6Key:
    return s.CT6Key(saddr=s.In6.from_buffer_copy(t[0]), daddr=s.In6.from_buffer_copy(t[1]), sport=t[2], dport=t[3],
                    proto=t[4], kind=s.CT4_SVC)


def ct6_key(saddr: str, daddr: str, sport: int, dport: int, proto: int, kind: int) -> s.CT6Key:
    """The epx_ct6 key of one entry (ct_key's IPv6 twin)."""
    return s.CT6Key(saddr=in6(saddr), daddr=in6(daddr), sport=be16(sport), dport=be16(dport), proto=proto, kind=kind)


def _key_of(key: Callable[..., object]) -> Callable[[Connection], object]:
    return lambda c: key(c.saddr, c.daddr, c.sport, c.dport, c.proto, c.kind)


@functools.cache
def _ct_layout(table: _CtTable) -> ctscan.Layout:
    """Where `table`'s fields lie in its packed key and entry (the GC reads raw batches)."""
    return ctscan.Layout(table.key, table.entry)


_CT4 = _CtTable("epx_ct4", s.CT4Key, s.CT4Entry, _connection, _key_of(ct_key), _same, _svc_key)
_CT6 = _CtTable("epx_ct6", s.CT6Key, s.CT6Entry, _connection6, _key_of(ct6_key), _Flat6, _svc_key6)
Maps._CT = _CT4

_LB6_KEY = struct.Struct("=16sHBx")  # lb6_key: addr (network order), port (network order), proto, pad
_LB6_BACKEND = struct.Struct("=16sHBx")  # lb6_backend: addr, port (network order), flags, pad
for _packer, _mirror in ((_LB6_KEY, s.LB6Key), (_LB6_BACKEND, s.LB6Backend)):
    if _packer.size != ctypes.sizeof(_mirror):
        raise ImportError(f"maps.py packs {_mirror.__name__} in {_packer.size} bytes, structs.py has "
                          f"{ctypes.sizeof(_mirror)}")
_NO_ADDR6 = bytes(16)
_LB6_KEY_READ = struct.Struct("!16sHBx")  # lb6_key as read back: _LB6_KEY, the port read as its number
# the layouts Maps' raw readers (service_rows, slot_batches, backend_batches) read each map's
# entries with, in both families: they must be the sizes structs.py gives those maps
for _read_map, _layouts in {"epx_svc": (_LB4_KEY_READ, _LB4_SERVICE), "epx_svc6": (_LB6_KEY_READ, _LB4_SERVICE),
                        "epx_slot": (_LB4_SLOT_KEY, _U32), "epx_slot6": (_LB4_SLOT_KEY, _U32),
                        "epx_backend": (_U32, _LB4_BACKEND), "epx_backend6": (_U32, _LB6_BACKEND)}.items():
    _spec = s.MAPS[_read_map]
    if tuple(layout.size for layout in _layouts) != (ctypes.sizeof(_spec.key), ctypes.sizeof(_spec.leaf)):
        raise ImportError(f"maps.py reads {_read_map} entries as {_layouts[0].size}/{_layouts[1].size}-byte "
                          f"key/value, structs.py has {ctypes.sizeof(_spec.key)}/{ctypes.sizeof(_spec.leaf)}")


def _aton6(ip: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, ip)


def _frontend_key6(fe: Frontend) -> s.LB6Key:
    return s.LB6Key(addr=in6(fe.addr), port=be16(fe.port), proto=fe.proto)


def _backend6_of(raw: bytes) -> Backend:
    addr, port, flags = _LB6_BACKEND.unpack(raw)
    return Backend(socket.inet_ntop(socket.AF_INET6, addr), socket.ntohs(port), bool(flags & s.LB4_BE_IN_CLUSTER),
                   bool(flags & s.LB4_BE_IN_LOCAL))


def _backend6(v: s.LB6Backend) -> Backend:
    return _backend6_of(bytes(v))


# Backends packs IPv4 only: an IPv6 service port's backends are a dict of records (Backends.pack).
BACKEND6 = BackendValues("lb6_backend", _LB6_BACKEND.size, _backend6_of, lambda ids, values: {
    bid: _backend6_of(values[i * _LB6_BACKEND.size:(i + 1) * _LB6_BACKEND.size])
    for i, bid in enumerate(array(_ID, ids))})


class Maps6(Maps):
    """The IPv6 maps (epx_*6) with Maps' interface, over the same fds: what ServicePrograms,
    adopt.py and the drift audit use for the IPv6 family, so one writer serves both families.

    Family-free methods (slots, affinity ids, counts, the connection table's reads and its
    garbage collector) are Maps' own over the IPv6 map names (_NAMES) and epx_ct6; those that
    pack or read an address are overridden here. The node's IPv4-only facts (epx_config's
    flags, epx_iface) stay the parent's: config() here is epx_config6."""

    _CT = _CT6
    BACKEND_VALUES = BACKEND6
    _FRONTEND_KEY_READ = _LB6_KEY_READ
    _NO_FRONTEND_ADDR = _NO_ADDR6
    _NAMES = {"epx_svc": "epx_svc6", "epx_backend": "epx_backend6", "epx_slot": "epx_slot6",
              "epx_affinity": "epx_affinity6", "epx_src_range": "epx_src_range6",
              "epx_node_addr": "epx_node_addr6", "epx_pod_cidr": "epx_pod_cidr6"}

    def __init__(self, parent: Maps) -> None:
        super().__init__(parent._fds)
        self.parent = parent

    def _name(self, name: str) -> str:
        return self._NAMES.get(name, name)

    @staticmethod
    def _addr_text(addr: bytes) -> str:
        return socket.inet_ntop(socket.AF_INET6, addr)

    # -- node (IPv6) --

    def config(self) -> s.LB6Config:  # type: ignore[override]
        """epx_config6 as it is."""
        return self._get("epx_config6", s.u32(0)) or s.LB6Config()

    @staticmethod
    def config6_of(snat_addr: str | None, on: bool, detect_none: bool = False) -> s.LB6Config:
        """The epx_config6 struct set_config6 writes: the IPv6 masquerade address, CFG6_F_ON, and
        CFG6_F_DETECT_NONE when IPv6's local-traffic detector is kube-proxy's no-op one
        (services.detector_is_noop: the CIDR detector without an IPv6 CIDR)."""
        flags = (s.CFG6_F_ON if on else 0) | (s.CFG6_F_DETECT_NONE if detect_none else 0)
        return s.LB6Config(snat_addr=in6(snat_addr), flags=flags)

    def set_config6(self, snat_addr: str | None, on: bool, detect_none: bool = False) -> bool:
        """Write epx_config6; returns False (and writes nothing) when it already holds that."""
        value = self.config6_of(snat_addr, on, detect_none)
        if bytes(self.config()) == bytes(value):
            return False
        self._put("epx_config6", s.u32(0), value)
        return True

    def set_node_addrs(self, addrs: Iterable[str]) -> int:
        return self.set_node_addrs6(addrs)

    def node_addrs(self) -> set[str]:
        return {ip6_str(key) for key in self.keys("epx_node_addr6")}

    def set_pod_cidrs(self, cidrs: Iterable[str]) -> int:
        return self.set_pod_cidrs6(cidrs)

    def pod_cidrs(self) -> set[str]:
        return {f"{ip6_str(key.addr)}/{key.prefixlen}" for key in self.keys("epx_pod_cidr6")}

    # -- services --

    def set_service(self, fe: Frontend, svc: Service) -> None:
        self.set_service6(fe, svc)

    @staticmethod
    def frontend_key(fe: Frontend) -> bytes:
        return _LB6_KEY.pack(_aton6(fe.addr) if fe.addr else _NO_ADDR6, socket.htons(fe.port), fe.proto)

    def service(self, fe: Frontend) -> Service | None:
        v = self._get("epx_svc6", _frontend_key6(fe))
        return None if v is None else Service(v.id, v.count, v.local_count, v.affinity_timeout, v.flags)

    def delete_service(self, fe: Frontend) -> bool:
        return libbpf.map_delete(self._fd("epx_svc6"), _frontend_key6(fe))

    def set_backend(self, backend_id: int, be: Backend) -> None:
        self.set_backend6(backend_id, be)

    @staticmethod
    def backend_entry(backend_id: int, be: Backend) -> tuple[bytes, bytes]:
        return _U32.pack(backend_id), _LB6_BACKEND.pack(_aton6(be.addr), socket.htons(be.port),
                                                        _backend_flags(be.in_cluster, be.in_local))

    def set_backend_entries(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        """Only ever empty here: Backends packs IPv4 addresses, so an IPv6 service port's backends
        are a dict (Backends.pack), but one without endpoints is an empty Backends."""
        if entries:
            raise TypeError("Backends.map_entries() packs IPv4 backends: use set_backends for epx_backend6")

    def backends(self) -> dict[int, Backend]:
        return {k.value: _backend6(v) for k, v in self._items("epx_backend6")}

    def backend(self, backend_id: int) -> Backend | None:
        v = self._get("epx_backend6", s.u32(backend_id))
        return None if v is None else _backend6(v)

    def add_source_range(self, svc_id: int, cidr: str) -> None:
        self.add_source_range6(svc_id, cidr)

    def delete_source_range(self, svc_id: int, cidr: str) -> bool:
        prefixlen, addr = _lpm6(cidr)
        return libbpf.map_delete(self._fd("epx_src_range6"),
                                 s.LB6RangeKey(prefixlen=32 + prefixlen, svc_id=svc_id, addr=addr))

    def source_ranges(self) -> Iterator[tuple[int, str]]:
        for k in self.keys("epx_src_range6"):
            yield k.svc_id, f"{ip6_str(k.addr)}/{k.prefixlen - 32}"

    def affinity(self, svc_id: int, client: str) -> tuple[int, int] | None:
        return self.affinity6(svc_id, client)

    def set_affinity(self, svc_id: int, client: str, backend_id: int, last_used_ns: int) -> None:
        self._put("epx_affinity6", s.LB6AffinityKey(svc_id=svc_id, client=in6(client)),
                  s.LB4Affinity(last_used=last_used_ns, backend_id=backend_id))


def slot_bank(flags: int) -> int:
    """The epx_slot bank a frontend with epx_svc flags `flags` reads (services.py: the bank swap)."""
    return 1 if flags & s.LB4_F_SLOT_BANK else 0


# ---- read-only queries of a running datapath (the bench, debugging): pins only, no compile ----

PIN_SUBDIR = "ebpf-proxy"  # pins.PIN_SUBDIR (pins imports this module, so it is not imported here)


class PinnedMapError(RuntimeError):
    """A pinned map cannot be read as this build's: missing, or of another layout."""


def _pinned_map(bpffs_dir: str | Path, name: str) -> Path:
    """Where map `name` is pinned for the datapath whose bpffs is `bpffs_dir` (the agent's --bpffs;
    its pin directory <bpffs>/ebpf-proxy/ is accepted too)."""
    root = Path(bpffs_dir)
    for candidate in (root / PIN_SUBDIR / name, root / name):
        if candidate.exists():
            return candidate
    raise PinnedMapError(f"no map {name} pinned under {root / PIN_SUBDIR}: is an ebpf-mode agent running there?")


def _open_checked(path: Path) -> int:
    """A read-only fd of the map at `path`, after checking its key/value sizes against structs."""
    spec = s.MAPS[path.name]
    fd = libbpf.obj_get_readonly(str(path))
    try:
        info = libbpf.map_info(fd)
        want = (ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf))
        if (info.key_size, info.value_size) != want:
            raise PinnedMapError(f"{path}: key/value size {info.key_size}/{info.value_size}, this build reads "
                                 f"{want[0]}/{want[1]}: pinned by another version of ebpf-proxy")
    except BaseException:
        os.close(fd)
        raise
    return fd


def programmed_backends(bpffs_dir: str | Path) -> set[tuple[str, int]]:
    """Every backend (ip, port) the datapath pinned under `bpffs_dir` holds in epx_backend, read
    read-only from the pin (no compile, no agent involved). The sync writes a backend before the
    slots that expose it, so an endpoint in this set is one step from taking traffic; it leaves
    the set only after no slot points at it any more. Raises PinnedMapError, or OSError."""
    fd = _open_checked(_pinned_map(bpffs_dir, "epx_backend"))
    try:
        return _backend_addrs(fd)
    finally:
        os.close(fd)


def frontend_backends(bpffs_dir: str | Path, addr: str | None, port: int,
                      proto: int = socket.IPPROTO_TCP) -> set[tuple[str, int]] | None:
    """The backends (ip, port) the cluster slots of one frontend lead to, read read-only from the
    pins: the frontend's epx_svc entry, its slots, their epx_backend entries. A few lookups
    whatever the number of services (programmed_backends() dumps every backend: ~40 ms at
    20,000), so the bench can poll it while timing one change without the poll dominating the
    figure. None when the frontend is not programmed. Raises PinnedMapError, or OSError."""
    fds = {name: _open_checked(_pinned_map(bpffs_dir, name)) for name in ("epx_svc", "epx_slot", "epx_backend")}
    try:
        svc = s.LB4Service()
        if not libbpf.map_lookup(fds["epx_svc"], _frontend_key(Frontend(addr, port, proto)), svc):
            return None
        out: set[tuple[str, int]] = set()
        backend_id, backend = s.u32(), s.LB4Backend()
        for slot in range(svc.count):
            key = s.LB4SlotKey(svc_id=svc.id, slot=slot, scope=s.LB4_SCOPE_CLUSTER, bank=slot_bank(svc.flags))
            if libbpf.map_lookup(fds["epx_slot"], key, backend_id) and \
                    libbpf.map_lookup(fds["epx_backend"], backend_id, backend):
                out.add((ip_str(backend.addr), port_int(backend.port)))
        return out
    finally:
        for fd in fds.values():
            os.close(fd)


_BACKEND_ADDR = struct.Struct("!4sH2x")  # struct lb4_backend: addr, port (network order), flags, pad


def _backend_addrs(fd: int) -> set[tuple[str, int]]:
    """(ip, port) of every epx_backend entry, unpacked from the raw batches: the bench polls this
    while it times a change, so it must cost little (20,000 backends: ~17 ms, 27 ms decoded
    field by field)."""
    assert _BACKEND_ADDR.size == ctypes.sizeof(s.LB4Backend)
    out: set[tuple[str, int]] = set()
    ntoa = socket.inet_ntoa
    for _, values, _n in raw_batches(fd, "epx_backend"):
        out.update((ntoa(addr), port) for addr, port in _BACKEND_ADDR.iter_unpack(values))
    return out


# Maps whose entries exist only when written: their counts are the datapath's state (arrays
# always hold max_entries slots).
COUNTED_MAPS = tuple(name for name in s.MAPS if name not in ARRAY_MAPS)


def entry_counts(bpffs_dir: str | Path) -> dict[str, int]:
    """Entries in each hash-like map pinned under `bpffs_dir` (map name -> count), read-only."""
    out = {}
    for name in COUNTED_MAPS:
        fd = _open_checked(_pinned_map(bpffs_dir, name))
        try:
            out[name] = count_entries(fd, name)
        finally:
            os.close(fd)
    return out
