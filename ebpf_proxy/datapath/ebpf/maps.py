"""Typed access to the datapath's maps, and the only place byte order is converted.

Callers speak Python (dotted-quad strings, port numbers, dataclasses); this module packs them
into the ctypes mirrors of structs.py (network order for the __be fields) and reads them back.
It works on map file descriptors through libbpf, not through bcc, so that it can also open the
pinned maps of a running datapath without compiling anything (after an agent restart, for stats).
Writes are single-entry operations: the caller decides what changed and writes only that.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s

IPPROTO = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": 132}


# ---- byte order: the only conversions in the project ----


def be32(ip: str) -> int:
    """Dotted quad -> the native integer whose memory is the address in network order."""
    return int.from_bytes(socket.inet_aton(ip), sys.byteorder)


def ip_str(raw: int) -> str:
    return socket.inet_ntoa(raw.to_bytes(4, sys.byteorder))


def be16(port: int) -> int:
    return socket.htons(port)


def port_int(raw: int) -> int:
    return socket.ntohs(raw)


# ---- Python-side values ----


@dataclass(frozen=True)
class Frontend:
    """Where a service is reached: addr None means its nodePort on every node address."""

    addr: str | None
    port: int
    proto: int = socket.IPPROTO_TCP


@dataclass(frozen=True)
class Service:
    id: int
    count: int  # cluster slots
    local_count: int = 0  # local slots
    affinity_timeout: int = 0  # seconds
    flags: int = 0  # structs.LB4_F_*


@dataclass(frozen=True)
class Backend:
    addr: str
    port: int
    in_cluster: bool = True
    in_local: bool = False


@dataclass(frozen=True)
class NodeSettings:
    """epx_config: the node's masquerade address, port range, flags and conntrack timeouts.

    Timeouts follow nf_conntrack with kube-proxy's settings (established TCP 86400 s); the
    masquerade range defaults above Linux's ip_local_port_range so it never collides with the
    node's own sockets.
    """

    snat_addr: str | None = None
    snat_port_min: int = 61000
    snat_port_max: int = 65535
    masquerade_all: bool = False
    localhost_nodeports: bool = True
    has_cluster_cidr: bool = True  # False: no --cluster-cidr, so no off-cluster masquerade (kube-proxy)
    tcp_syn_timeout: int = 120
    tcp_est_timeout: int = 86400
    tcp_close_timeout: int = 10
    udp_timeout: int = 30
    udp_stream_timeout: int = 120
    host_netns_cookie: int = 0


@dataclass(frozen=True)
class Connection:
    """One epx_ct4 entry, decoded."""

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


def _frontend_key(fe: Frontend) -> s.LB4Key:
    return s.LB4Key(addr=be32(fe.addr) if fe.addr else 0, port=be16(fe.port), proto=fe.proto)


def _lpm(cidr: str) -> tuple[int, int]:
    net = ipaddress.IPv4Network(cidr, strict=False)
    return net.prefixlen, be32(str(net.network_address))


class Maps:
    """The datapath's maps by name -> fd (from loader.Loaded, or opened from pins)."""

    def __init__(self, fds: Mapping[str, int], owned: bool = False) -> None:
        missing = set(s.MAPS) - set(fds)
        if missing:
            raise KeyError(f"maps missing: {sorted(missing)}")
        self._fds = dict(fds)
        self._owned = owned

    @classmethod
    def from_loaded(cls, loaded) -> Maps:
        return cls(dict(loaded.map_fds))

    @classmethod
    def open_pinned(cls, pin_dir: Path) -> Maps:
        fds: dict[str, int] = {}
        try:
            for name in s.MAPS:
                fds[name] = libbpf.obj_get(str(pin_dir / name))
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

    def _put(self, name: str, key, value) -> None:
        libbpf.map_update(self._fd(name), key, value)

    def _get(self, name: str, key):
        value = s.MAPS[name].leaf()
        return value if libbpf.map_lookup(self._fd(name), key, value) else None

    def keys(self, name: str) -> Iterator:
        """Every key of a map (as its structs mirror)."""
        key_type = s.MAPS[name].key
        key = None
        while True:
            nxt = key_type()
            if not libbpf.map_next_key(self._fd(name), key, nxt):
                return
            yield nxt
            key = nxt

    def _items(self, name: str) -> Iterator[tuple]:
        for key in list(self.keys(name)):
            value = self._get(name, key)
            if value is not None:
                yield key, value

    def clear(self, name: str) -> int:
        """Delete every entry of a hash/LRU/LPM map; returns how many."""
        keys = list(self.keys(name))
        for key in keys:
            libbpf.map_delete(self._fd(name), key)
        return len(keys)

    # -- node --

    def set_settings(self, cfg: NodeSettings) -> bool:
        """Write epx_config; returns False (and writes nothing) when it already holds `cfg`."""
        flags = (s.CFG_F_MASQ_ALL if cfg.masquerade_all else 0) | (
            s.CFG_F_LOCALHOST_NODEPORTS if cfg.localhost_nodeports else 0
        ) | (0 if cfg.has_cluster_cidr else s.CFG_F_NO_CLUSTER_CIDR)
        value = s.LB4Config(
            snat_addr=be32(cfg.snat_addr) if cfg.snat_addr else 0,
            snat_port_min=cfg.snat_port_min,
            snat_port_max=cfg.snat_port_max,
            flags=flags,
            tcp_syn_timeout=cfg.tcp_syn_timeout,
            tcp_est_timeout=cfg.tcp_est_timeout,
            tcp_close_timeout=cfg.tcp_close_timeout,
            udp_timeout=cfg.udp_timeout,
            udp_stream_timeout=cfg.udp_stream_timeout,
            host_netns_cookie=cfg.host_netns_cookie,
        )
        current = self._get("epx_config", s.u32(0))
        if current is not None and bytes(current) == bytes(value):
            return False
        self._put("epx_config", s.u32(0), value)
        return True

    def set_node_addrs(self, addrs: Iterable[str]) -> int:
        """Make epx_node_addr exactly `addrs`, touching only what differs. Returns the writes."""
        wanted = {be32(a) for a in addrs}
        present = {key.value for key in self.keys("epx_node_addr")}
        for raw in present - wanted:
            libbpf.map_delete(self._fd("epx_node_addr"), s.be32(raw))
        for raw in wanted - present:
            self._put("epx_node_addr", s.be32(raw), s.u32(1))
        return len(present ^ wanted)

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

    def services(self) -> Iterator[tuple[Frontend, Service]]:
        """Every frontend in epx_svc with the service it leads to."""
        for k, v in self._items("epx_svc"):
            fe = Frontend(ip_str(k.addr) if k.addr else None, port_int(k.port), k.proto)
            yield fe, Service(v.id, v.count, v.local_count, v.affinity_timeout, v.flags)

    def backends(self) -> dict[int, Backend]:
        """Every epx_backend entry: backend id -> backend."""
        return {
            k.value: Backend(ip_str(v.addr), port_int(v.port), in_cluster=bool(v.flags & s.LB4_BE_IN_CLUSTER),
                             in_local=bool(v.flags & s.LB4_BE_IN_LOCAL))
            for k, v in self._items("epx_backend")
        }

    def slots(self) -> Iterator[tuple[int, int, int, int]]:
        """Every epx_slot entry as (service id, scope, slot, backend id)."""
        for k, v in self._items("epx_slot"):
            yield k.svc_id, k.scope, k.slot, v.value

    def source_ranges(self) -> Iterator[tuple[int, str]]:
        """Every epx_src_range entry as (service id, CIDR)."""
        for k in self.keys("epx_src_range"):
            yield k.svc_id, f"{ip_str(k.addr)}/{k.prefixlen - 32}"

    def affinity_ids(self) -> Iterator[tuple[int, int]]:
        """(service id, backend id) of every affinity entry: ids that must not be handed out again."""
        for k, v in self._items("epx_affinity"):
            yield k.svc_id, v.backend_id

    def count(self, name: str) -> int:
        """Entries in a hash/LRU/LPM map: batched reads where the map type allows, else a key walk."""
        spec = s.MAPS[name]
        try:
            return libbpf.map_count_batched(self._fd(name), ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, 524):  # 524: ENOTSUPP (kernel)
                raise
        return sum(1 for _ in self.keys(name))

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

    def delete_backend(self, backend_id: int) -> bool:
        return libbpf.map_delete(self._fd("epx_backend"), s.u32(backend_id))

    def set_slot(self, svc_id: int, scope: int, slot: int, backend_id: int) -> None:
        self._put("epx_slot", s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope), s.u32(backend_id))

    def slot(self, svc_id: int, scope: int, slot: int) -> int | None:
        value = self._get("epx_slot", s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope))
        return None if value is None else value.value

    def delete_slot(self, svc_id: int, scope: int, slot: int) -> bool:
        return libbpf.map_delete(self._fd("epx_slot"), s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope))

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

    def connections(self) -> list[Connection]:
        out = []
        for k, v in self._items("epx_ct4"):
            out.append(
                Connection(
                    kind=k.kind, proto=k.proto,
                    saddr=ip_str(k.saddr), sport=port_int(k.sport), daddr=ip_str(k.daddr), dport=port_int(k.dport),
                    nat_addr=ip_str(v.nat_addr), nat_port=port_int(v.nat_port),
                    svc_addr=ip_str(v.svc_addr), svc_port=port_int(v.svc_port), backend_id=v.backend_id,
                    snat_addr=ip_str(v.snat_addr), snat_port=port_int(v.snat_port), flags=v.flags,
                    expires_ns=v.expires,
                )
            )
        return out

    def delete_connection(self, c: Connection) -> bool:
        key = s.CT4Key(
            saddr=be32(c.saddr), daddr=be32(c.daddr), sport=be16(c.sport), dport=be16(c.dport),
            proto=c.proto, kind=c.kind,
        )
        return libbpf.map_delete(self._fd("epx_ct4"), key)

    def set_connection_expiry(self, c: Connection, expires_ns: int) -> None:
        """Move a connection's deadline (tests and the conntrack GC use it)."""
        key = s.CT4Key(
            saddr=be32(c.saddr), daddr=be32(c.daddr), sport=be16(c.sport), dport=be16(c.dport),
            proto=c.proto, kind=c.kind,
        )
        value = self._get("epx_ct4", key)
        if value is None:
            raise KeyError(c)
        value.expires = expires_ns
        self._put("epx_ct4", key, value)

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

    def reset_stats(self) -> None:
        ncpu = libbpf.num_possible_cpus()
        zero = (s.EpxStat * ncpu)()
        for reason in s.Reason:
            self._put("epx_stats", s.u32(reason), zero)

    def reset(self) -> None:
        """Empty every map and zero the counters and settings: a blank datapath."""
        for name in s.MAPS:
            if name not in ("epx_config", "epx_stats"):
                self.clear(name)
        self._put("epx_config", s.u32(0), s.LB4Config())
        self.reset_stats()
