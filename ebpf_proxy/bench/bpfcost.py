"""What the eBPF programs themselves cost per packet, with N Services in the maps.

Connection rates through a lab include the echo server, the load generator and the kernel's
whole stack; this is the program alone, timed by the kernel: BPF_PROG_TEST_RUN runs the real,
verified tc_ingress on a packet and reports the nanoseconds of that run. Three packets, the ones
a Service's traffic is made of:

- `clusterip_syn`: a pod's SYN to a ClusterIP: service lookup, backend choice, a new connection
  entry, DNAT;
- `established`: the next packet of that connection: one connection-table hit, DNAT;
- `nodeport`: an outside client's SYN to a NodePort: node-address check, service lookup,
  backend choice, masquerade decision and SNAT port allocation.

Every sample is its own run on a fresh packet (another source port): a test run with `repeat`
runs the program on the same buffer over and over, so from the second run on it would see the
packet it had already translated. One run's time includes the kernel's timer reads (tens of ns);
the median of many runs is the figure.

The maps are private (a bpffs mounted for this measurement, removed afterwards), filled with
N Services of `endpoints` backends each as the agent writes them; the programs are loaded
through the node's program cache, so only the first size of a run may compile.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ebpf_proxy.bench.results import BPF_COST_PATHS
from ebpf_proxy.bench.stats import median, percentile
from ebpf_proxy.datapath.ebpf import loader, testrun
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Maps, NodeSettings, Service

ROOT = Path("/run/ebpf-proxy/bench-bpfcost")

NODE_IP = "192.168.50.10"
POD_CIDR = "10.244.0.0/16"
POD_CLIENT = "10.244.0.7"
OUTSIDE = "203.0.113.9"
SERVICE_BASE = ipaddress.IPv4Address("10.96.0.0")
ENDPOINT_BASE = ipaddress.IPv4Address("10.245.0.0")  # remote pods: never this node's
PORT, TARGET_PORT, NODE_PORT = 80, 8080, 30080
TC_ACT_OK = 0


class BpfCostError(RuntimeError):
    pass


# ---- packets (raw bytes: the bench does not depend on scapy) ---------------------------------------

def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def tcp_packet(src: str, sport: int, dst: str, dport: int, flags: int) -> bytes:
    """Ethernet + IPv4 + TCP (no options, no payload), every checksum valid."""
    saddr, daddr = socket.inet_aton(src), socket.inet_aton(dst)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 1000, 0 if flags == 0x02 else 2000, 5 << 4, flags, 64240, 0, 0)
    pseudo = saddr + daddr + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", _checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0x4000, 64, socket.IPPROTO_TCP, 0, saddr, daddr)
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    eth = bytes.fromhex("02000000000b" "02000000000a") + struct.pack("!H", 0x0800)
    return eth + ip + tcp


SYN, ACK = 0x02, 0x10


# ---- the maps ---------------------------------------------------------------------------------------

MAX_SAMPLES = 20000  # samples × repeats: 6 connection entries each fit the default connection table


def map_sizes(services: int, endpoints: int) -> dict[str, int]:
    """Capacities for N services of `endpoints` backends (the connection table keeps the
    agent's default size: a measurement's connections fit, and the build id stays the same)."""
    backends = services * endpoints
    return {"epx_svc": max(services + 16, 1024), "epx_backend": max(backends + 16, 1024),
            "epx_slot": max(backends + 16, 1024)}


def service_vip(index: int) -> str:
    return str(SERVICE_BASE + 10 + index)


def fill(maps: Maps, services: int, endpoints: int) -> None:
    """The node and N Services as the agent writes them (eTP=Cluster; no endpoint on this node):
    service i has ClusterIP 10.96.0.10+i, `endpoints` remote backends; service 0 also a NodePort."""
    maps.set_settings(NodeSettings(snat_addr=NODE_IP))
    maps.set_node_addrs([NODE_IP])
    maps.set_pod_cidrs([POD_CIDR])
    for i in range(services):
        svc_id = i + 1
        ids = []
        for j in range(endpoints):
            backend_id = i * endpoints + j + 1
            maps.set_backend(backend_id, Backend(str(ENDPOINT_BASE + backend_id), TARGET_PORT,
                                                 in_cluster=True, in_local=False))
            ids.append(backend_id)
        maps.set_slots(svc_id, s.LB4_SCOPE_CLUSTER, ids)
        service = Service(svc_id, endpoints, 0, 0, s.LB4_F_HAS_ENDPOINTS)
        maps.set_service(Frontend(service_vip(i), PORT, socket.IPPROTO_TCP), service)
        if i == 0:
            maps.set_service(Frontend(None, NODE_PORT, socket.IPPROTO_TCP),
                             Service(svc_id, endpoints, 0, 0, s.LB4_F_HAS_ENDPOINTS | s.LB4_F_EXTERNAL))


@contextlib.contextmanager
def private_datapath(sizes: dict[str, int], cache_dir: Path | None) -> Iterator[loader.Loaded]:
    ROOT.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=ROOT))
    loaded = None
    try:
        loader.mount_bpffs(path)
        loaded = loader.load(path, ("tc_ingress",), sizes, cache_dir=cache_dir)
        yield loaded
    finally:
        if loaded is not None:
            loaded.close()
        with contextlib.suppress(loader.LoadError):
            loader.unmount_bpffs(path)
        with contextlib.suppress(OSError):
            path.rmdir()
        with contextlib.suppress(OSError):
            ROOT.rmdir()


# ---- the measurement ----------------------------------------------------------------------------------

def _run(prog_fd: int, packet: bytes, path: str) -> int:
    result = testrun.run(prog_fd, packet)
    if result.retval != TC_ACT_OK or result.packet[30:34] == packet[30:34]:
        raise BpfCostError(f"{path}: tc_ingress did not translate the packet (verdict {result.retval})")
    return result.duration_ns


def sample(loaded: loader.Loaded, services: int, samples: int, first_port: int) -> dict[str, list[int]]:
    """`samples` runs of each path (a distinct connection each); ns per run. The ClusterIP is
    the last Service's, so the lookup is of an entry written last into a full map."""
    fd = loaded.prog_fds["tc_ingress"]
    vip = service_vip(services - 1)
    out: dict[str, list[int]] = {path: [] for path in BPF_COST_PATHS}
    for k in range(samples):
        sport = first_port + k
        out["clusterip_syn"].append(_run(fd, tcp_packet(POD_CLIENT, sport, vip, PORT, SYN), "clusterip_syn"))
        out["established"].append(_run(fd, tcp_packet(POD_CLIENT, sport, vip, PORT, ACK), "established"))
        out["nodeport"].append(_run(fd, tcp_packet(OUTSIDE, sport, NODE_IP, NODE_PORT, SYN), "nodeport"))
    return out


def measure(services: int, endpoints: int = 10, samples: int = 1000, repeats: int = 3,
            capacity: int | None = None, cache_dir: Path | None = None,
            on_repeat: Callable[[int, dict[str, float]], None] | None = None,
            ) -> dict[str, list[dict[str, float]]]:
    """Per path, one {"median", "p99"} (ns) per repeat. The maps are sized for `capacity`
    Services (default `services`): one capacity for every size of a run is one build, one
    compile at most. Raises BpfCostError, loader.LoadError."""
    capacity = max(capacity or services, services)
    if services < 1 or samples < 1 or samples * repeats > MAX_SAMPLES:
        raise ValueError(f"services={services}, samples={samples}, repeats={repeats}: out of range")
    per_path: dict[str, list[dict[str, float]]] = {path: [] for path in BPF_COST_PATHS}
    with private_datapath(map_sizes(capacity, endpoints), cache_dir) as loaded:
        maps = Maps.from_loaded(loaded)
        fill(maps, services, endpoints)
        counted_before = maps.stats()
        for r in range(repeats):
            ns = sample(loaded, services, samples, first_port=20000 + r * samples)
            figures = {}
            for path, values in ns.items():
                per_path[path].append({"median": median(values), "p99": percentile(values, 99)})
                figures[path] = per_path[path][-1]["median"]
            if on_repeat:
                on_repeat(r, figures)
        counted = {reason: n - counted_before.get(reason, (0, 0))[0] for reason, (n, _) in maps.stats().items()}
        expected_new = 2 * samples * repeats  # clusterip_syn + nodeport
        if counted.get(s.Reason.FWD_NEW, 0) != expected_new or \
                counted.get(s.Reason.FWD_ESTABLISHED, 0) != samples * repeats:
            raise BpfCostError(f"the programs did not take the measured paths: counters {counted}")
    return per_path
