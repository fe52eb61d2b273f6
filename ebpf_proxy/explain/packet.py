"""The packet a trace asks about: who sends it, to where, and where it meets the node.

`origin` says which path of the node the packet takes, because kube-proxy's rules and our
programs treat them differently:
  pod       from a pod of this node: enters through the pod's device (TC ingress there)
  external  from another host (another node, a remote pod, a client outside): enters through an
            uplink (XDP, then TC ingress there)
  host      from a process on the node itself: no packet crosses a device before the decision
            (iptables nat OUTPUT; in eBPF the cgroup connect/sendmsg program)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ebpf_proxy.model import Protocol

ORIGINS = ("pod", "external", "host")


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
        for what, ip in (("--from", self.src), ("--to", self.dst)):
            try:
                ipaddress.IPv4Address(ip)
            except ValueError:
                raise FlowError(f"{what}: {ip!r} is not an IPv4 address") from None
        for what, port in (("--to port", self.dport), ("--from port", self.sport)):
            if not 1 <= port <= 65535:
                raise FlowError(f"{what}: {port} is not within 1..65535")
        if self.origin not in ORIGINS:
            raise FlowError(f"origin: {self.origin!r} is not one of {', '.join(ORIGINS)}")

    @property
    def label(self) -> str:
        return f"{self.src}:{self.sport} → {self.dst}:{self.dport}/{self.protocol.lower} ({self.origin})"


def parse_endpoint(text: str, what: str, default_port: int | None = None) -> tuple[str, int | None, Protocol]:
    """"IP[:PORT][/tcp|udp|sctp]" → (ip, port, protocol); errors name `what` (the option)."""
    body, _, proto = text.partition("/")
    try:
        protocol = Protocol(proto.upper()) if proto else Protocol.TCP
    except ValueError:
        raise FlowError(f"{what}: protocol {proto!r} is not tcp, udp or sctp") from None
    host, sep, port = body.rpartition(":")
    if not sep:
        host, port = body, ""
    if port and not port.isdigit():
        raise FlowError(f"{what}: port {port!r} is not a number")
    return host, int(port) if port else default_port, protocol
