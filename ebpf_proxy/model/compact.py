"""Compact read-only forms of the small mappings kept per service (issue 12: agent memory at
100,000 Services). Pure Python, like the rest of model/."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class OneEntry(Mapping):
    """A read-only mapping of one key to its value, for the many one-entry mappings held per
    service: the tracker's ports and endpoints of a one-port Service (most are), the eBPF
    datapath's frontends of a ClusterIP-only service port. A one-entry dict costs ~200 bytes, this
    ~48: at 100,000 Services, three per Service, ~45 MiB (bench/cpscale.py). Equal to any mapping
    of the same one entry, as a dict would be; iterates, reads and copies (dict(), dict.update)
    like one. Built by `compact_mapping`."""

    __slots__ = ("_key", "_value")

    def __init__(self, key: Hashable, value: object) -> None:
        self._key, self._value = key, value

    def __getitem__(self, key: object) -> object:
        if key == self._key:
            return self._value
        raise KeyError(key)

    def __iter__(self):
        yield self._key

    def __len__(self) -> int:
        return 1

    def __contains__(self, key: object) -> bool:
        return key == self._key

    def get(self, key: object, default: object = None) -> object:
        return self._value if key == self._key else default

    def items(self):  # type: ignore[override]
        return ((self._key, self._value),)

    def values(self):  # type: ignore[override]
        return (self._value,)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OneEntry):
            return self._key == other._key and self._value == other._value
        if isinstance(other, Mapping):
            return len(other) == 1 and self._key in other and other[self._key] == self._value
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a dict's

    def __reduce__(self) -> tuple:
        # not copyreg's generic __slots__ state: 100,000 pickle in 0.044 s, 0.12 s that way
        return (OneEntry, (self._key, self._value))

    def __repr__(self) -> str:
        return repr({self._key: self._value})


def compact_mapping(mapping: Mapping[K, V]) -> Mapping[K, V]:
    """`mapping` as kept for long: a OneEntry for one entry, else `mapping` itself (a OneEntry given
    stays as it is). Only for mappings nobody changes afterwards: a OneEntry is read-only."""
    if len(mapping) == 1 and not isinstance(mapping, OneEntry):
        ((key, value),) = mapping.items()
        return OneEntry(key, value)
    return mapping
