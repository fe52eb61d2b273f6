"""The connection table as the garbage collector reads it: raw bytes, not one object per entry.

Maps.collect_connections reads all of epx_ct4 (or epx_ct6) each pass, every 10 s. Decoding each
entry into ctypes copies and keeping them until the halves were judged cost ~100 MiB at the peak
of a pass over a full epx_ct4 (262,144 entries), most of it kept by the allocator afterwards
(issue 12). Here a batch stays the bytes the kernel wrote; the fields a pass needs are byte slices
at the offsets of the structs.py mirrors, and what outlives a batch is one 64-bit hash per half
a live connection honours, or per half found orphaned (Hashes): no Python object per entry, and
no entry's bytes beyond its batch.

A half is live when the connection owning it exists, has not expired and still points at it
(maps._half_is_live, bpf/lib/nat4.h's owner checks). Both sides of that test are byte strings
here: a connection names the identity of each half it honours (owner_identities), a half names
the one it needs (half_identity), and the half is live iff the two are equal. The two functions
are checked against maps._owner_tuple/_half_is_live by tests/unit/test_ctscan.py.
"""

from __future__ import annotations

import ctypes
import struct
from array import array
from bisect import bisect_left
from collections.abc import Iterable

from ebpf_proxy.datapath.ebpf import structs as s

_BUCKETS = 256  # Hashes: sorted per bucket, so sealing never sorts one big list


class Layout:
    """Where a connection table's key and entry fields lie in their packed bytes (CT4Key and
    CT4Entry, or CT6Key and CT6Entry: the same field names, IPv6 addresses 16 bytes wide)."""

    def __init__(self, key: type[ctypes.Structure], entry: type[ctypes.Structure]) -> None:
        def span(struct_type: type[ctypes.Structure], name: str) -> slice:
            field = getattr(struct_type, name)
            return slice(field.offset, field.offset + field.size)

        self.key_size, self.entry_size = ctypes.sizeof(key), ctypes.sizeof(entry)
        self.k_saddr, self.k_daddr, self.k_sport, self.k_dport, self.k_proto = (
            span(key, name) for name in ("saddr", "daddr", "sport", "dport", "proto"))
        self.kind = key.kind.offset
        self.proto = key.proto.offset
        self.v_nat_addr, self.v_svc_addr, self.v_nat_port, self.v_svc_port, self.v_snat_port = (
            span(entry, name) for name in ("nat_addr", "svc_addr", "nat_port", "svc_port", "snat_port"))
        self.flags = entry.flags.offset
        self.state = entry.state.offset
        self.expires = struct.Struct(f"={entry.expires.offset}xQ")  # u64, host order
        if entry.expires.size != 8:
            raise ImportError(f"ctscan reads {entry.__name__}.expires as a u64, structs.py has "
                              f"{entry.expires.size} bytes")

    def owner_identities(self, k: bytes, v: bytes) -> Iterable[bytes]:
        """The identities of the halves a connection (a CT4_SVC entry `k`, `v`) honours: its reply
        (CT4_REV_DNAT, to the backend it chose, keyed by the port the connection leaves with: the
        client's, or snat_port when remapped, CT4_S_REMAP), and when masqueraded its SNAT half
        (keyed by that port too) and that half's reply (a remapped connection's snat_port is no
        masquerade port unless it is masqueraded)."""
        owner = k[self.k_saddr] + k[self.k_daddr] + k[self.k_sport] + k[self.k_dport] + k[self.k_proto]
        nat = v[self.v_nat_addr] + v[self.v_nat_port]
        snat = nat + v[self.v_snat_port]
        wire = v[self.v_snat_port] if v[self.state] & s.CT4_S_REMAP else k[self.k_sport]
        yield bytes((s.CT4_REV_DNAT,)) + owner + nat + wire
        if v[self.flags] & s.CT4_F_MASQ:
            yield bytes((s.CT4_REV_SNAT,)) + owner + snat
            yield bytes((s.CT4_SNAT,)) + owner + snat + wire

    def half_identity(self, k: bytes, v: bytes) -> bytes | None:
        """The identity a half (`k`, `v`) needs its connection to honour: the connection's key as
        maps._owner_tuple finds it, then the fields maps._half_is_live compares. None for a kind
        no connection owns."""
        kind = k[self.kind]
        if kind == s.CT4_REV_DNAT:  # backend -> client; owner: client -> frontend; (nat, wire) == (saddr, sport, dport)
            # the client's own port: the key's, or kept in snat_port when remapped (keyed by the wire port)
            wire = k[self.k_dport]
            cport = v[self.v_snat_port] if v[self.state] & s.CT4_S_REMAP else wire
            owner = k[self.k_daddr] + v[self.v_svc_addr] + cport + v[self.v_svc_port]
            expected = k[self.k_saddr] + k[self.k_sport] + wire
        elif kind == s.CT4_SNAT:  # client -> backend; (nat_addr, nat_port, snat_port, wire) == (daddr, dport, v.nat_port, sport)
            wire = k[self.k_sport]
            cport = v[self.v_snat_port] if v[self.state] & s.CT4_S_REMAP else wire
            owner = k[self.k_saddr] + v[self.v_svc_addr] + cport + v[self.v_svc_port]
            expected = k[self.k_daddr] + k[self.k_dport] + v[self.v_nat_port] + wire
        elif kind == s.CT4_REV_SNAT:  # backend -> masquerade addr:port; (nat_addr, nat_port, snat_port) == (saddr, sport, dport)
            owner = v[self.v_nat_addr] + v[self.v_svc_addr] + v[self.v_nat_port] + v[self.v_svc_port]
            expected = k[self.k_saddr] + k[self.k_sport] + k[self.k_dport]
        else:
            return None
        return bytes((kind,)) + owner + k[self.k_proto] + expected


def raw(items: object, n: int, size: int) -> bytes:
    """The first `n` entries of a batch (a ctypes array that the next batch overwrites, as
    maps._batches gives batches and a key walk's entries alike, or a tuple of ctypes objects) as
    their packed bytes, back to back."""
    if isinstance(items, ctypes.Array):
        return bytes(memoryview(items).cast("B")[: n * size])
    return b"".join(bytes(item) for item in items[:n])  # type: ignore[index]


class Hashes:
    """A set of byte strings as 64-bit hashes in sorted arrays: 8 bytes a member where a set of
    bytes would take ~100. Add every member, seal, then ask. A string whose hash equals a member's
    (about 1 in 10^8 passes over a full table) is taken for that member:
    - as the identity of a half a live connection honours, it keeps an orphaned half for as long
      as that connection exists, or until the agent restarts (hash() of bytes is fixed for a
      process's life, so every pass repeats the collision): a few dozen bytes of table, never a
      live half deleted;
    - as a half the previous pass found orphaned, it spares that half no pass of grace: the half
      is still read again with its connection before it is deleted, so only a half whose
      connection is written in the microseconds between those reads could be lost."""

    def __init__(self) -> None:
        self._buckets = [array("q") for _ in range(_BUCKETS)]

    def add(self, identity: bytes) -> None:
        h = hash(identity)
        self._buckets[h % _BUCKETS].append(h)

    def seal(self) -> None:
        self._buckets = [array("q", sorted(bucket)) for bucket in self._buckets]

    def __contains__(self, identity: bytes) -> bool:
        h = hash(identity)
        bucket = self._buckets[h % _BUCKETS]
        i = bisect_left(bucket, h)
        return i < len(bucket) and bucket[i] == h
