"""The packet a trace asks about: who sends it, to where, and where it meets the node.

`origin` says which path of the node the packet takes, because kube-proxy's rules and our
programs treat them differently:
  pod       from a pod of this node: enters through the pod's device (TC ingress there)
  external  from another host (another node, a remote pod, a client outside): enters through an
            uplink (XDP, then TC ingress there)
  host      from a process on the node itself: no packet crosses a device before the decision
            (iptables nat OUTPUT; in eBPF the cgroup connect/sendmsg program)

A flow is IPv4 or IPv6, both ends of one family: a node runs one proxier per family (ip6tables
rules for IPv6), and a trace asks the one that owns the flow's family. Addresses with a port are
spelt `IP:PORT`, an IPv6 address in brackets (`[fd00:10:96::a]:80`), as everywhere else.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ebpf_proxy.model import Protocol

ORIGINS = ("pod", "external", "host")
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


class FlowError(ValueError):
    """A flow that cannot be traced; the message names the argument at fault."""


@dataclass(frozen=True)
class FlowSpec:
    src: str
    dst: str
    dport: int
    protocol: Protocol = Protocol.TCP
    sport: int = 40000
    origin: str = "external"
    in_iface: str | None = None  # the device it enters through, when known (pod veth, uplink)

    def __post_init__(self) -> None:
        src, dst = ip_of("--from", self.src), ip_of("--to", self.dst)
        # the canonical spelling (fd00:10:96::a, not fd00:10:96:0::a), as the API and the rules have it
        object.__setattr__(self, "src", str(src))
        object.__setattr__(self, "dst", str(dst))
        if src.version != dst.version:
            raise FlowError(f"--from {self.src} is IPv{src.version} but --to {self.dst} is IPv{dst.version}: "
                            "a packet has one IP family")
        for what, port in (("--to port", self.dport), ("--from port", self.sport)):
            if not 1 <= port <= 65535:
                raise FlowError(f"{what}: {port} is not within 1..65535")
        if self.origin not in ORIGINS:
            raise FlowError(f"origin: {self.origin!r} is not one of {', '.join(ORIGINS)}")

    @property
    def family(self) -> int:
        """4 or 6: which of the node's proxiers (and rule sets) owns this flow."""
        return ipaddress.ip_address(self.dst).version

    @property
    def label(self) -> str:
        return (f"{host_port(self.src, self.sport)} → {host_port(self.dst, self.dport)}/{self.protocol.lower} "
                f"({self.origin})")


def host_port(ip: str, port: int) -> str:
    """`IP:PORT`, an IPv6 address in brackets: how traces spell a backend or an endpoint."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split_host_port(text: str) -> tuple[str, str | None]:
    """`IP:PORT`, `[IPv6]:PORT`, or an address alone → (ip, port text or None). A bare IPv6 address
    (more than one colon, no brackets) has no port: `fd00::1:80` is an address, not fd00::1 port 80."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return text, None  # not bracketed as [IPv6]:PORT: ip_of names it
        return host, rest[1:] if rest else None
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, None


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1: local on every node, whatever its addresses."""
    addr = ipaddress.ip_address(ip)
    return any(addr in net for net in LOOPBACK)


def ip_of(what: str, text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """`text` as an IP address; the error names the option `what`."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise FlowError(f"{what}: {text!r} is not an IPv4 or IPv6 address") from None


def parse_endpoint(text: str, what: str, default_port: int | None = None) -> tuple[str, int | None, Protocol]:
    """"IP[:PORT][/tcp|udp|sctp]" (IPv6 with a port: "[IP]:PORT") → (ip, port, protocol); errors
    name `what` (the option)."""
    body, _, proto = text.partition("/")
    try:
        protocol = Protocol(proto.upper()) if proto else Protocol.TCP
    except ValueError:
        raise FlowError(f"{what}: protocol {proto!r} is not tcp, udp or sctp") from None
    host, port = split_host_port(body)
    if port is not None and not port.isdigit():
        raise FlowError(f"{what}: port {port!r} is not a number")
    return host, int(port) if port else default_port, protocol
