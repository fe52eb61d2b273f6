"""One address family's share of a BPF test (world.py's or world6.py's node, addresses, frame
builders and map view), so that a test whose steps are the same for IPv4 and IPv6 is written once
and runs for both, its ids naming the family (`ipv4-...`, `ipv6-...`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import pytest
from scapy.layers.inet import IP
from scapy.layers.inet6 import IPv6
from scapy.packet import Packet

from ebpf_proxy.datapath.ebpf.maps import Maps, Maps6
from tests.bpf import packets
from tests.bpf import world as w
from tests.bpf import world6 as w6


@dataclass(frozen=True)
class Family:
    name: str
    ip: type[Packet]  # the scapy network layer
    node: Callable[[Maps], None]  # what the family's node needs beyond the `maps` fixture's IPv4 node
    install: Callable[..., None]  # install(maps, *services)
    web: Callable[..., object]  # the family's `web` service (world.web / world6.web6 keywords)
    tcp: Callable[..., Packet]  # tcp(src, sport, dst, dport, flags="S", payload=b"")
    udp: Callable[..., Packet]
    connections: Callable[[Maps], list]  # the family's connection table, decoded
    affinity_ids: Callable[[Maps], Iterable]  # (service id, backend id) of its affinity entries
    set_slots: Callable[..., None]  # set_slots(maps, svc_id, scope, backend_ids, previous=0)
    untouched: tuple[str, ...]  # its maps besides those that a dry run must leave alone (entry counts)
    outside: str  # a client outside the cluster
    pod: str  # a pod on this node
    node_addr: str
    vip: str

    def __str__(self) -> str:
        return self.name


IPV4 = Family(
    name="ipv4", ip=IP, node=lambda maps: None, install=w.install, web=w.web, tcp=packets.tcp, udp=packets.udp,
    connections=Maps.connections, affinity_ids=Maps.affinity_ids, set_slots=Maps.set_slots,
    untouched=("epx_frag4", "epx_sock_rev"), outside=w.OUTSIDE, pod=w.POD_CLIENT, node_addr=w.NODE_IP, vip=w.VIP,
)
IPV6 = Family(
    name="ipv6", ip=IPv6, node=w6.install_node6, install=w6.install6, web=w6.web6, tcp=w6.tcp6, udp=w6.udp6,
    connections=Maps.connections6, affinity_ids=lambda maps: Maps6(maps).affinity_ids(), set_slots=Maps.set_slots6,
    untouched=("epx_sock_rev6",), outside=w6.OUTSIDE6, pod=w6.POD6, node_addr=w6.NODE6, vip=w6.VIP6,
)
FAMILIES = (IPV4, IPV6)
NODE_PORT = w.NODE_PORT
assert w6.NODE_PORT == NODE_PORT


def cases(tables: Mapping[Family, Iterable[str]]) -> list:
    """pytest params (family, case name) of each family's table, with ids `<family>-<name>`."""
    return [pytest.param(fam, name, id=f"{fam}-{name}") for fam, table in tables.items() for name in table]
