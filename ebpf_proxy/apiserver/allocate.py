"""Allocators for service cluster IPs and node ports.

Like the real API server, each range has a small *static band* at its bottom that dynamic
allocation only uses once the rest is full, so a manifest asking for a well-known address
(`10.96.0.10` for DNS) does not collide with an automatically chosen one. Dynamic allocation
walks forward from the last handed-out value instead of reusing the lowest free one, so an
address freed by a deleted Service is not immediately given to the next one (stale conntrack
entries would otherwise send traffic to the wrong service).

Not thread-safe on purpose: the store serialises every write under its own lock.
"""

from __future__ import annotations

import ipaddress

from ebpf_proxy.model import ipsloppy


class RangeFull(Exception):
    pass


class NotInRange(Exception):
    pass


class AlreadyAllocated(Exception):
    pass


class RangeAllocator:
    """Hands out integers from [first, last]; `claim` takes a specific one."""

    def __init__(self, first: int, last: int, static_band: int = 0) -> None:
        if last < first:
            raise ValueError(f"empty range [{first}, {last}]")
        self.first = first
        self.last = last
        self.static_band = static_band if static_band * 2 < last - first + 1 else 0
        self._used: set[int] = set()
        self._cursor = first + self.static_band

    def __contains__(self, value: int) -> bool:
        return self.first <= value <= self.last

    def used(self, value: int) -> bool:
        return value in self._used

    def claim(self, value: int) -> None:
        if value not in self:
            raise NotInRange(value)
        if value in self._used:
            raise AlreadyAllocated(value)
        self._used.add(value)

    def allocate(self) -> int:
        """The next free value after the cursor in the dynamic band, then the static band."""
        dynamic = range(self.first + self.static_band, self.last + 1)
        if dynamic:
            start = self._cursor - dynamic.start
            for i in range(len(dynamic)):
                value = dynamic[(start + i) % len(dynamic)]
                if value not in self._used:
                    self._used.add(value)
                    self._cursor = value + 1 if value < self.last else dynamic.start
                    return value
        for value in range(self.first, self.first + self.static_band):
            if value not in self._used:
                self._used.add(value)
                return value
        raise RangeFull()

    def release(self, value: int) -> None:
        self._used.discard(value)


class IPAllocator:
    """Cluster IPs from one service CIDR of either family.

    As kube-apiserver's ipallocator: the network address is never handed out, nor (IPv4 only)
    the broadcast address; an IPv6 range may be no larger than a /108 (its
    --service-cluster-ip-range check), which keeps the used-set small."""

    def __init__(self, cidr: str) -> None:
        try:
            self.network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as exc:
            raise ValueError(f"service CIDR {cidr!r} is not an IP network: {exc}") from None
        self.version = self.network.version
        self.family = f"IPv{self.version}"
        if self.version == 4 and self.network.num_addresses < 4:
            raise ValueError(f"service CIDR {cidr!r} is too small (need at least a /30)")
        if self.version == 6 and not 108 <= self.network.prefixlen <= 126:
            raise ValueError(f"service CIDR {cidr!r}: an IPv6 service range must be a /108 to a /126")
        base = int(self.network.network_address)
        size = self.network.num_addresses - (2 if self.version == 4 else 1)
        # kube-apiserver: min(max(16, size/16), 256) addresses reserved for explicit requests.
        self._range = RangeAllocator(base + 1, base + size, min(max(16, size // 16), 256))
        self.cidr = str(self.network)

    def claim(self, ip: str) -> None:
        """Take `ip`; NotInRange / AlreadyAllocated / ValueError (not an address of this family).

        `ip` may be in a legacy form (`10.96.00.010`): it is the address that is taken."""
        self._range.claim(self._value(ip))

    def _value(self, ip: str) -> int:
        addr = ipsloppy.parse_ip(ip)
        if addr is None or addr.version != self.version:
            raise ValueError(f"{ip!r} is not an {self.family} address")
        return int(addr)

    def allocate(self) -> str:
        return str(ipaddress.ip_address(self._range.allocate()) if self.version == 4
                   else ipaddress.IPv6Address(self._range.allocate()))

    def release(self, ip: str) -> None:
        try:
            self._range.release(self._value(ip))
        except ValueError:
            pass

    def used(self, ip: str) -> bool:
        return self._range.used(self._value(ip))


def service_ranges(cidrs: str) -> dict[str, IPAllocator]:
    """kube-apiserver's --service-cluster-ip-range: one CIDR, or two of different families
    (`10.96.0.0/12,fd00:10:96::/112`), the first being the cluster's primary family. Returns
    the allocators by family ("IPv4"/"IPv6"), primary first."""
    parts = [c.strip() for c in cidrs.split(",")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"service CIDR {cidrs!r}: give one CIDR or a comma-separated pair")
    out: dict[str, IPAllocator] = {}
    for part in parts:
        alloc = IPAllocator(part)
        if alloc.family in out:
            raise ValueError(f"service CIDR {cidrs!r}: a pair must be one IPv4 and one IPv6 CIDR")
        out[alloc.family] = alloc
    return out


class PortAllocator(RangeAllocator):
    """Node ports (and health-check node ports), 30000-32767 by default."""

    def __init__(self, first: int, last: int) -> None:
        # kube-apiserver: min(max(16, size/32), 128) ports reserved for explicit requests.
        super().__init__(first, last, min(max(16, (last - first + 1) // 32), 128))
