"""One service port's endpoints, packed: what the change tracker holds between syncs (issue 12).

At 100,000 Services x 10 endpoints an Endpoint object (a slotted dataclass, ~104 bytes) and its
IP string (~60 bytes) per endpoint were 165 MiB of the agent's 637 MiB (bench/cpscale.py,
tracemalloc). An EndpointList keeps a service port's endpoints in one bytes object instead,
~10 bytes an endpoint: each IPv4 address in 4 bytes (other addresses as ASCII text), and a row
per endpoint: its port and an index into a process-wide table of the combinations of its other
fields (node name, conditions, hints), which are few.

It is an immutable Sequence of Endpoint: iterating builds the Endpoint values again, equal to the
ones packed, in the same order; it compares equal to a tuple of the same endpoints (and hashes
like it; as a tuple, never equal to a list; a copy or pickle is the tuple), so every reader of ProxyState.endpoints (categorize, both datapaths, explain) is
unchanged. The objects built are new on every iteration and immutable: nothing a reader does to
them reaches the packed form, or another reader.

Built without Endpoint values where they would only be packed again: k8s/convert.py packs a
slice's rows (PortlessEndpoints), the change tracker merges packed lists row by row (merge), and
what it holds (MergedEndpoints: deduplicated and sorted) categorize takes as it is.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from itertools import islice, repeat
from typing import Any, overload

from ebpf_proxy.model.types import Endpoint

_ROW = struct.Struct("=HI")  # port, index of the endpoint's other fields in _extras
_SEPARATOR = ","  # never in an IP address

# An endpoint's fields but its IP and port, (node name, ready, serving, terminating, is_local,
# zone hints, node hints) -> index, and back. Grows with the distinct combinations ever seen
# (nodes x conditions x hint sets: a few thousand in a large cluster, ~150 bytes each), never
# shrinks: an index must stay valid for as long as any list holds it.
_Extra = tuple[str | None, bool, bool, bool, bool, tuple[str, ...], tuple[str, ...]]
_extras_index: dict[_Extra, int] = {}
_extras: list[_Extra] = []
_extras_lock = threading.Lock()


def _extra(ep: Endpoint) -> int:
    return extra_index((ep.node_name, ep.ready, ep.serving, ep.terminating, ep.is_local, ep.zone_hints, ep.node_hints))


def extra_index(key: _Extra) -> int:
    """The index of `key` (an endpoint's fields but its IP and port, as _Extra orders them) in
    the process-wide table, added on first sight."""
    index = _extras_index.get(key)
    if index is None:
        with _extras_lock:
            index = _extras_index.get(key)
            if index is None:
                index = len(_extras)
                _extras.append(key)
                _extras_index[key] = index
    return index


def _canonical_v4(ip: str) -> bool:
    """Whether `ip` is the dotted quad inet_ntoa gives back for its 4 bytes (so they hold it exactly)."""
    try:
        return socket.inet_ntoa(socket.inet_aton(ip)) == ip
    except OSError:
        return False


def _packable(ep: Endpoint) -> bool:
    return (type(ep) is Endpoint and type(ep.port) is int and 0 <= ep.port < 1 << 16
            and _packable_row((ep.ip, ep.node_name, ep.ready, ep.serving, ep.terminating, ep.is_local,
                               ep.zone_hints, ep.node_hints)))


def _packable_row(row: tuple) -> bool:
    """Whether an endpoint but its port, (ip, *extra), fits the packed form exactly."""
    ip, node, ready, serving, terminating, is_local, zones, nodes = row
    return (type(ip) is str and ip.isascii() and _SEPARATOR not in ip and "\0" not in ip and bool(ip)
            and (node is None or type(node) is str) and type(zones) is tuple and type(nodes) is tuple
            and type(ready) is bool and type(serving) is bool and type(terminating) is bool and type(is_local) is bool)


def _ip_head(ips: Sequence[str]) -> bytes:
    """The packed form's addresses (its head; the rows follow): a NUL and 4 bytes each when every IP
    is a dotted quad inet_ntoa gives back as it is, else the IPs joined by "," and a NUL."""
    if all(map(_canonical_v4, ips)):
        return b"\0" + b"".join(map(socket.inet_aton, ips))
    return _SEPARATOR.join(ips).encode("ascii") + b"\0"


def _fast_endpoint():
    """An Endpoint constructor that sets its slots directly: half the CPU of Endpoint(...) (whose
    frozen __init__ goes through object.__setattr__ per field), for the million endpoints a full
    sync reads at 100,000 Services. The value is the same (tests/unit/test_compact_records.py);
    should Endpoint ever validate in __post_init__, the real constructor is used."""
    if hasattr(Endpoint, "__post_init__"):
        return Endpoint
    names = ("ip", "port", "node_name", "ready", "serving", "terminating", "is_local", "zone_hints", "node_hints")
    assert tuple(f.name for f in fields(Endpoint)) == names, "Endpoint's fields changed: update endpoints.py"
    s_ip, s_port, s_node, s_ready, s_serving, s_terminating, s_local, s_zones, s_nodes = (
        Endpoint.__dict__[name].__set__ for name in names)
    new = object.__new__

    def endpoint(ip, port, node, ready, serving, terminating, is_local, zones, nodes) -> Endpoint:
        ep = new(Endpoint)
        s_ip(ep, ip), s_port(ep, port), s_node(ep, node), s_ready(ep, ready), s_serving(ep, serving)
        s_terminating(ep, terminating), s_local(ep, is_local), s_zones(ep, zones), s_nodes(ep, nodes)
        return ep

    return endpoint


_endpoint = _fast_endpoint()


class EndpointList(Sequence[Endpoint]):
    """A service port's endpoints, packed (see the module docstring). Build with `pack`."""

    # One bytes object (not an IP string and a rows bytes: ~60 bytes less a service port), in
    # one of two forms: a NUL, each IPv4 address in 4 bytes, then the rows, when every IP is a
    # dotted quad inet_ntoa gives back as it is (~70 bytes less again at 10 endpoints); else the
    # IPs joined by "," in ASCII, a NUL (never in an IP), then the rows.
    __slots__ = ("_packed",)

    def __init__(self, packed: bytes) -> None:
        self._packed = packed

    def _split(self) -> tuple[list[str], memoryview]:
        packed = self._packed
        if packed[0] == 0:
            end = 1 + (len(packed) - 1) // (4 + _ROW.size) * 4
            ntoa = socket.inet_ntoa
            return [ntoa(packed[i:i + 4]) for i in range(1, end, 4)], memoryview(packed)[end:]
        end = packed.index(0)
        return packed[:end].decode("ascii").split(_SEPARATOR), memoryview(packed)[end + 1:]

    @classmethod
    def pack(cls, endpoints: Iterable[Endpoint]) -> "EndpointList | tuple[Endpoint, ...]":
        """`endpoints`, in this order, packed; the plain tuple when empty or when one of them does
        not fit the packed form exactly (an Endpoint subclass, a port beyond 16 bits, ...)."""
        endpoints = tuple(endpoints)
        if not endpoints or not all(map(_packable, endpoints)):
            return endpoints
        return cls(_ip_head([ep.ip for ep in endpoints]) + b"".join(_ROW.pack(ep.port, _extra(ep)) for ep in endpoints))

    def _entries(self) -> list[tuple[str, int, int]]:
        """(ip, port, index in _extras) of each endpoint, in order: the packed form, read without
        building the Endpoint values."""
        ips, rows = self._split()
        return [(ip, port, extra) for ip, (port, extra) in zip(ips, _ROW.iter_unpack(rows))]

    def __len__(self) -> int:
        if self._packed[0] == 0:
            return (len(self._packed) - 1) // (4 + _ROW.size)
        return (len(self._packed) - self._packed.index(0) - 1) // _ROW.size

    def __iter__(self) -> Iterator[Endpoint]:
        extras = _extras
        ips, rows = self._split()
        for ip, (port, extra) in zip(ips, _ROW.iter_unpack(rows)):
            yield _endpoint(ip, port, *extras[extra])

    @overload
    def __getitem__(self, index: int) -> Endpoint: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Endpoint, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        return tuple(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EndpointList):
            return self._packed == other._packed
        if isinstance(other, tuple):  # as a tuple: equal to a tuple of the same, never to a list
            return len(other) == len(self) and tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to a tuple of the same endpoints: hashes like it

    def __add__(self, other: object) -> tuple[Endpoint, ...]:
        if isinstance(other, (tuple, EndpointList)):
            return tuple(self) + tuple(other)
        return NotImplemented

    def __radd__(self, other: object) -> tuple[Endpoint, ...]:
        if isinstance(other, tuple):
            return other + tuple(self)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple:
        # the table indexes are this process's: a copy or a pickle is the plain tuple
        return (tuple, (tuple(self),))


class MergedEndpoints(EndpointList):
    """An EndpointList whose endpoints are deduplicated by address (ip:port) and sorted: what
    `merge` makes of a service port's slices, and so what the change tracker holds. Sorted and
    without duplicates, it is its own `sorted(set(...))`: categorize takes it as it is, instead of
    hashing and ordering a million Endpoint values (Python-level __hash__ and __lt__) at every
    full sync of 100,000 Services."""

    __slots__ = ()

    def all_ready_without_hints(self) -> bool:
        """Whether every endpoint is ready and has no topology hints (read from the packed rows):
        then every one of them is a cluster endpoint, whatever the node (categorize's fast path)."""
        extras = _extras
        packed = self._packed
        rows_at = 1 + (len(packed) - 1) // (4 + _ROW.size) * 4 if packed[0] == 0 else packed.index(0) + 1
        for _, extra in _ROW.iter_unpack(memoryview(packed)[rows_at:]):
            _, ready, _, _, _, zones, nodes = extras[extra]
            if not ready or zones or nodes:
                return False
        return True


def merge(lists: Sequence[Sequence[Endpoint]]) -> MergedEndpoints | tuple[Endpoint, ...]:
    """One service port's endpoints from each of its slices (in slice name order), deduplicated
    by ip:port and sorted, packed: a MergedEndpoints, or the sorted tuple where one of them does
    not fit the packed form; () for none.

    The same endpoint may transiently appear in two slices; the first one wins, except that a
    local copy is preferred (kube-proxy's EndpointSliceCache does the same). Packed lists (what
    k8s/convert.py makes) are merged as their packed rows, without building Endpoint values; a
    lone list already merged is returned as it is."""
    if len(lists) == 1 and type(lists[0]) is MergedEndpoints:
        return lists[0]
    if all(isinstance(eps, EndpointList) for eps in lists):
        return _merge_packed(lists)  # type: ignore[arg-type]
    seen: dict[str, Endpoint] = {}
    for eps in lists:
        for ep in eps:
            if ep.addr not in seen or (ep.is_local and not seen[ep.addr].is_local):
                seen[ep.addr] = ep
    # (ip, port) is unique: the sorted order is that of (ip, port), as in _merge_packed
    return MergedEndpoints.pack(sorted(seen.values()))  # type: ignore[return-value]


def _merge_packed(lists: Sequence[EndpointList]) -> MergedEndpoints | tuple[Endpoint, ...]:
    extras = _extras
    seen: dict[tuple[str, int], tuple[str, int, int]] = {}
    given = [eps._entries() for eps in lists]
    for entries in given:
        for entry in entries:
            key = entry[:2]  # ip:port, as Endpoint.addr (the port has no ":": one pair per text)
            held = seen.get(key)
            if held is None or (extras[entry[2]][4] and not extras[held[2]][4]):  # [4]: is_local
                seen[key] = entry
    if not seen:
        return ()
    # (ip, port) is unique, so the rows sort as the Endpoints (ordered by ip, then port) would
    rows = sorted(seen.values())
    if len(lists) == 1 and rows == given[0]:  # one list, already merged: its bytes as they are
        return MergedEndpoints(lists[0]._packed)
    return MergedEndpoints(_ip_head([ip for ip, _, _ in rows]) + b"".join(_ROW.pack(port, extra) for _, port, extra in rows))


class PortlessEndpoints:
    """One EndpointSlice's endpoints before their port: rows of (ip, node name, ready, serving,
    terminating, is_local, zone hints, node hints), packed once for all the slice's ports.
    `with_port(port)` is then the EndpointList of Endpoint(ip, port, ...) for each row, in order,
    without building the Endpoint values (k8s/convert.py: a million of them at 100,000 Services
    x 10 endpoints), or their tuple where a row does not fit the packed form.

    Where the rows' IPs are in increasing order (as text) with no repeat, which is how the
    EndpointSlice controller lists them in most slices, one port's endpoints are already what
    `merge` makes of them: `with_port` then gives the MergedEndpoints (the same bytes), and the
    change tracker's merge of a Service's lone slice takes it as it is instead of unpacking and
    sorting it again (issue 12: a first list at 100,000 Services).

    `packed_ipv4` builds it from rows the caller has already packed and checked (k8s/convert.py's
    plain IPv4 slice), without a tuple per row."""

    __slots__ = ("_rows", "_head", "_extras", "_merged")

    def __init__(self, rows: Iterable[tuple]) -> None:
        self._rows: tuple[tuple, ...] | None
        self._rows = rows = tuple(rows)
        self._head: bytes | None = None
        self._extras: list[int] = []
        self._merged = False
        if rows and all(map(_packable_row, rows)):
            self._extras = [extra_index(row[1:]) for row in rows]
            ips = [row[0] for row in rows]
            self._head = _ip_head(ips)
            self._merged = all(map(str.__lt__, ips, islice(ips, 1, None)))

    @classmethod
    def packed_ipv4(cls, ips: Sequence[str], v4: bytes, extras: list[int]) -> "PortlessEndpoints":
        """The rows already packed (k8s/convert.py's plain IPv4 slice, a million endpoints at
        100,000 Services): `ips` canonical dotted quads, `v4` their 4 bytes each in order (as
        inet_pton gives them), `extras` each row's index of its other fields (`extra_index`).
        The same value as PortlessEndpoints of the rows, without building a tuple per row."""
        self = cls.__new__(cls)
        self._rows, self._extras, self._merged, self._head = (None if ips else ()), extras, False, None
        if ips:
            self._head = b"\0" + v4
            self._merged = all(map(str.__lt__, ips, islice(ips, 1, None)))
        return self

    def _row_tuples(self) -> tuple[tuple, ...]:
        if self._rows is None:  # packed_ipv4: the rows from the packed form
            extras = _extras
            self._rows = tuple((ip, *extras[i]) for ip, i in zip(v4_texts(self._head[1:]), self._extras))  # type: ignore[index]
        return self._rows

    def with_port(self, port: int) -> EndpointList | tuple[Endpoint, ...]:
        if self._head is None or type(port) is not int or not 0 <= port < 1 << 16:
            return tuple(Endpoint(ip, port, node, ready, serving, terminating, is_local, zones, nodes)
                         for ip, node, ready, serving, terminating, is_local, zones, nodes in self._row_tuples())
        packed = self._head + b"".join(map(_ROW.pack, repeat(port), self._extras))
        return MergedEndpoints(packed) if self._merged else EndpointList(packed)


class PackedColumns:
    """A packed list's endpoints read as columns, without building an Endpoint value each (what
    model/categorize.py's `reachable` reads, a million endpoints at every full sync of 100,000
    Services): `ports` of each endpoint in order, its other fields (node name, ready, serving,
    terminating, is_local, zone hints, node hints) through `extras()`, the distinct ones
    through `kinds()` (a few for many endpoints), and the addresses either as `v4`, 4 bytes each
    (socket.inet_aton's, when every address is a canonical dotted quad: what the list holds
    then) or as text (`ips()`, made from `v4` on demand). Build with `columns`."""

    __slots__ = ("v4", "ports", "_extra_ids", "_ips")

    def __init__(self, v4: bytes | None, ips: list[str] | None, ports: Sequence[int], extra_ids: Sequence[int]) -> None:
        self.v4, self._ips, self.ports, self._extra_ids = v4, ips, ports, extra_ids

    def ips(self) -> list[str]:
        """Every endpoint's address, in order."""
        if self._ips is None:
            self._ips = v4_texts(self.v4)  # type: ignore[arg-type]
        return self._ips

    def extras(self) -> list[_Extra]:
        """Every endpoint's other fields, in order."""
        extras = _extras
        return [extras[i] for i in self._extra_ids]

    def kinds(self) -> list[_Extra]:
        """The distinct values of extras(), in no particular order."""
        extras = _extras
        return [extras[i] for i in set(self._extra_ids)]


def v4_texts(v4: bytes) -> list[str]:
    """The dotted quads of IPv4 addresses packed 4 bytes each (as PackedColumns.v4 holds them)."""
    ntoa = socket.inet_ntoa
    return [ntoa(v4[i:i + 4]) for i in range(0, len(v4), 4)]


def columns(eps: EndpointList) -> PackedColumns:
    """`eps` as a PackedColumns: the same endpoints, in the same order."""
    packed = eps._packed
    if packed[0] == 0:
        end = 1 + (len(packed) - 1) // (4 + _ROW.size) * 4
        v4, ips, rows = packed[1:end], None, memoryview(packed)[end:]
    else:
        end = packed.index(0)
        v4, ips, rows = None, packed[:end].decode("ascii").split(_SEPARATOR), memoryview(packed)[end + 1:]
    ports, extra_ids = zip(*_ROW.iter_unpack(rows)) if len(rows) else ((), ())
    return PackedColumns(v4, ips, ports, extra_ids)
