"""The node and the services the BPF tests run against, written into the maps like a sync would.

One node (two addresses, pod CIDR 10.244.0.0/16), a pod client on it, an outside client, and
endpoints on this node and on others. A service is a declarative `Svc`; `install` writes its
frontends, backends and slots.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Maps, NodeSettings, Service

NODE_IP = "192.168.50.10"
NODE_IP2 = "172.20.0.10"
POD_CIDR = "10.244.0.0/16"
SNAT_MIN, SNAT_MAX = 61000, 61999

POD_CLIENT = "10.244.0.7"  # a pod on this node
OUTSIDE = "203.0.113.9"  # a client outside the cluster
OUTSIDE2 = "198.51.100.4"
LOCAL_EP = ("10.244.0.21", 8080)  # endpoint on this node
LOCAL_EP2 = ("10.244.0.22", 8080)
REMOTE_EP = ("10.244.1.31", 8080)  # endpoints on other nodes
REMOTE_EP2 = ("10.244.2.41", 8080)

VIP = "10.96.0.10"
EXTERNAL_IP = "192.0.2.50"
LB_IP = "192.0.2.80"
NODE_PORT = 30080

TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP

SETTINGS = NodeSettings(snat_addr=NODE_IP, snat_port_min=SNAT_MIN, snat_port_max=SNAT_MAX)


def install_node(maps: Maps, settings: NodeSettings = SETTINGS) -> None:
    maps.set_settings(settings)
    maps.set_node_addrs([NODE_IP, NODE_IP2])
    maps.set_pod_cidrs([POD_CIDR])


@dataclass(frozen=True)
class Svc:
    """One service port: its frontends and endpoint sets, as the sync would compute them."""

    id: int
    frontends: tuple[tuple[str | None, int, int], ...]  # (addr, or None for the nodePort; port; LB4_F_* of it)
    cluster: tuple[tuple[str, int], ...] = ()  # endpoints for traffic policy Cluster
    local: tuple[tuple[str, int], ...] = ()  # this node's endpoints
    flags: int = s.LB4_F_HAS_ENDPOINTS  # flags of every frontend
    affinity: int = 0
    ranges: tuple[str, ...] = ()
    proto: int = TCP

    def backend_id(self, ep: tuple[str, int]) -> int:
        return self.id * 100 + sorted({*self.cluster, *self.local}).index(ep) + 1


def install(maps: Maps, *svcs: Svc) -> None:
    for svc in svcs:
        for ep in sorted({*svc.cluster, *svc.local}):
            maps.set_backend(
                svc.backend_id(ep), Backend(ep[0], ep[1], in_cluster=ep in svc.cluster, in_local=ep in svc.local)
            )
        maps.set_slots(svc.id, s.LB4_SCOPE_CLUSTER, [svc.backend_id(ep) for ep in svc.cluster])
        maps.set_slots(svc.id, s.LB4_SCOPE_LOCAL, [svc.backend_id(ep) for ep in svc.local])
        for addr, port, flags in svc.frontends:
            maps.set_service(
                Frontend(addr, port, svc.proto),
                Service(svc.id, len(svc.cluster), len(svc.local), svc.affinity, svc.flags | flags),
            )
        for cidr in svc.ranges:
            maps.add_source_range(svc.id, cidr)


EXT = s.LB4_F_EXTERNAL


def web(**kw) -> Svc:
    """clusterIP 10.96.0.10:80 -> two remote endpoints and one local, plus NodePort, externalIP, LB IP."""
    base = dict(
        id=1,
        frontends=((VIP, 80, 0), (None, NODE_PORT, EXT), (EXTERNAL_IP, 80, EXT), (LB_IP, 80, EXT)),
        cluster=(LOCAL_EP, REMOTE_EP, REMOTE_EP2),
        local=(LOCAL_EP,),
    )
    base.update(kw)
    return Svc(**base)
