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
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
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
    key = (ep.node_name, ep.ready, ep.serving, ep.terminating, ep.is_local, ep.zone_hints, ep.node_hints)
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
    return (type(ep) is Endpoint and type(ep.ip) is str and ep.ip.isascii() and _SEPARATOR not in ep.ip and "\0" not in ep.ip
            and bool(ep.ip) and type(ep.port) is int and 0 <= ep.port < 1 << 16
            and (ep.node_name is None or type(ep.node_name) is str)
            and type(ep.zone_hints) is tuple and type(ep.node_hints) is tuple
            and all(type(flag) is bool for flag in (ep.ready, ep.serving, ep.terminating, ep.is_local)))


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
        rows = b"".join(_ROW.pack(ep.port, _extra(ep)) for ep in endpoints)
        if all(_canonical_v4(ep.ip) for ep in endpoints):
            return cls(b"\0" + b"".join(socket.inet_aton(ep.ip) for ep in endpoints) + rows)
        return cls(_SEPARATOR.join(ep.ip for ep in endpoints).encode("ascii") + b"\0" + rows)

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
            return tuple(self) == other
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
