"""Kubernetes' "sloppy" IP and CIDR parsing (k8s.io/utils/net ParseIPSloppy / ParseCIDRSloppy).

Go 1.17 stopped accepting leading zeros in IPv4 octets ("10.180.00.001"), but Kubernetes kept the
old parser for fields that may hold such values from before: kube-apiserver validates the legacy
IP fields of Services and EndpointSlices with it (accepting the value with a warning), and
kube-proxy reads those fields with it, normalising `10.180.00.001` to `10.180.0.1`. Python's
`ipaddress` rejects leading zeros (and, unlike Go, accepts IPv6 zone ids), so both the lab's API
server and the agent parse such fields here, to agree with both.

What Go's old `net.ParseIP` did, and so what this does:
- IPv4: four dot-separated decimal numbers, each at most 255; any number of leading zeros, read
  as decimal (never octal). No surrounding spaces.
- IPv6: as `ipaddress`, plus leading zeros in a group and in an embedded dotted quad; no zone.
- An IPv4-mapped IPv6 address (`::ffff:1.2.3.4`) *is* the IPv4 address (Go's `To4()`), which is
  how both kube-apiserver's IPv4 checks and kube-proxy's family filters see it.
"""

from __future__ import annotations

import ipaddress
import re
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_DECIMAL = re.compile(r"[0-9]+")
_HEX = re.compile(r"[0-9A-Fa-f]+")


def _ipv4(text: str) -> ipaddress.IPv4Address | None:
    try:  # a canonical dotted quad (inet_pton refuses leading zeros): nearly every address, fast
        return ipaddress.IPv4Address(socket.inet_pton(socket.AF_INET, text))
    except (OSError, ValueError):  # ValueError: a NUL or a lone surrogate, which is no address either
        pass
    parts = text.split(".")
    if len(parts) != 4 or not all(_DECIMAL.fullmatch(p) for p in parts):
        return None
    octets = [int(p) for p in parts]
    if any(o > 255 for o in octets):
        return None
    return ipaddress.IPv4Address(bytes(octets))


def _ipv6(text: str) -> ipaddress.IPv6Address | None:
    if "%" in text:
        return None  # Go's ParseIP has no zones
    head, _, tail = text.rpartition(":")
    if "." in tail:  # an embedded dotted quad may carry leading zeros too
        v4 = _ipv4(tail)
        if v4 is None:
            return None
        text = f"{head}:{v4}"
    groups = text.split(":")
    # A group may have more than four hex digits when the extra ones are leading zeros.
    groups = [g.lstrip("0").rjust(1, "0") if len(g) > 4 and _HEX.fullmatch(g) else g for g in groups]
    try:
        return ipaddress.IPv6Address(":".join(groups))
    except ValueError:
        return None


def parse_ip(text: object) -> IPAddress | None:
    """The address `text` denotes as ParseIPSloppy reads it, or None if it is not one."""
    if not isinstance(text, str) or not text:
        return None
    if ":" not in text:
        return _ipv4(text)
    addr = _ipv6(text)
    if addr is not None and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def parse_cidr(text: object) -> tuple[IPAddress, IPNetwork] | None:
    """(address as written, network with host bits cleared) as ParseCIDRSloppy gives them, or None."""
    if not isinstance(text, str) or "/" not in text:
        return None
    addr_text, _, bits_text = text.partition("/")
    if not _DECIMAL.fullmatch(bits_text):
        return None
    bits = int(bits_text)
    if ":" not in addr_text:
        v4 = _ipv4(addr_text)
        if v4 is None or bits > 32:
            return None
        return v4, ipaddress.IPv4Network((v4, bits), strict=False)
    v6 = _ipv6(addr_text)
    if v6 is None or bits > 128:
        return None
    net = ipaddress.IPv6Network((v6, bits), strict=False)
    mapped = net.network_address.ipv4_mapped
    if mapped is not None and bits >= 96:  # Go sees a mapped network as the IPv4 one
        return v6.ipv4_mapped or mapped, ipaddress.IPv4Network((mapped, bits - 96))
    return v6, net


def is_standard_ip(text: str) -> bool:
    """False for forms Go 1.17+ (netip.ParseAddr) rejects or maps: leading zeros, ::ffff:a.b.c.d."""
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    return not (isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None)
