"""SCTP Services end to end, in every mode (iptables: netfilter's SCTP conntrack and NAT; ebpf: the
TC programs and bpf/lib/sctp.h's CRC32c update), on the lab's real nodes and agents.

Two tests, and on any kernel exactly one of them runs (lab/sctp.py's sctp_available() decides, and
the other is skipped giving its reason):

- with kernel SCTP sockets, the lab's own probe and echo server speak SCTP: real associations
  through a ClusterIP and a NodePort, answered by the echo server of each backend pod;
- without them (this machine: CONFIG_IP_SCTP unset, no module to `modprobe sctp`), neither can,
  but neither is needed to see what a service proxy does to SCTP: the raw test plays both ends of
  an association's opening itself, with raw IP sockets (protocol 132), which a kernel without SCTP
  delivers every SCTP packet to.

The raw test: a client sends an INIT to the Service; each backend pod answers an INIT that
reaches it with an INIT ACK. Both sides check what they got
against what kube-proxy would have made of it (addresses, ports, masquerade) and recompute its
CRC32c from scratch: a port rewrite that forgot the CRC, or got it wrong, is a packet the real
receiver drops.

Where the kernel does have SCTP, its own stack would answer the same INIT (an ABORT: no socket
listens) and race the test's answers, so the test is skipped there, saying so; the BPF tier
(tests/bpf/test_tc_sctp.py) covers the eBPF datapath on any kernel.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import dataclass

import pytest
from scapy.layers.inet import IP
from scapy.layers.sctp import SCTP, SCTPChunkInit, SCTPChunkInitAck

from ebpf_proxy.lab._setns import in_netns
from ebpf_proxy.lab.probe import Outcome
from ebpf_proxy.lab.sctp import sctp_available
from ebpf_proxy.lab.topology import PodSpec
from tests.bpf.packets import sctp_crc_valid
from tests.e2e.scenario_runner import substitute


NO_KERNEL_SCTP = sctp_available()  # None, or why this kernel has no SCTP sockets
RAW_SKIP = ("this kernel has SCTP sockets: its own SCTP stack would answer the raw test's INITs with ABORTs "
            "and race the raw answers; test_sctp_probe_through_a_service covers SCTP Services here with the "
            "lab's own probe and echo server (and tests/bpf/test_tc_sctp.py the eBPF datapath)")

pytestmark = [pytest.mark.root, pytest.mark.e2e]

SCTP_P = socket.IPPROTO_SCTP
VIP, PORT, TARGET, NODE_PORT = "10.96.122.10", 3868, 3869, 30122
CHUNK_INIT, CHUNK_INIT_ACK = 1, 2
BACKENDS = ("web-1", "web-2")
TRIES = 8
WAIT = 2.0


def _service(name: str, vip: str, app: str, node_port: int) -> str:
    """An SCTP NodePort Service (eTP=Cluster) on PORT -> TARGET of the pods labelled app=`app`."""
    return f"""
apiVersion: v1
kind: Service
metadata: {{name: {name}}}
spec:
  type: NodePort
  clusterIP: {vip}
  externalTrafficPolicy: Cluster
  selector: {{app: {app}}}
  ports: [{{name: diameter, protocol: SCTP, port: {PORT}, targetPort: {TARGET}, nodePort: {node_port}}}]
"""


MANIFESTS = _service("sctp-web", VIP, "web", NODE_PORT)


@dataclass(frozen=True)
class Seen:
    """One SCTP packet as a raw socket received it."""

    src: str
    sport: int
    dst: str
    dport: int
    chunk: int
    tag: int
    init_tag: int  # the INIT's or INIT ACK's initiate tag
    crc_ok: bool


def _parse(data: bytes) -> Seen | None:
    pkt = IP(data)
    if SCTP not in pkt or not bytes(pkt[SCTP].payload):
        return None
    sctp = pkt[SCTP]
    chunk = bytes(sctp.payload)[0]
    init_tag = int.from_bytes(bytes(sctp.payload)[4:8], "big") if chunk in (CHUNK_INIT, CHUNK_INIT_ACK) else 0
    return Seen(pkt.src, sctp.sport, pkt.dst, sctp.dport, chunk, sctp.tag, init_tag, sctp_crc_valid(pkt))


def _raw_socket(lab, where: str) -> socket.socket:
    """A raw SCTP socket inside `where`'s netns (a socket stays in the netns it was made in)."""
    with in_netns(lab.netns_of(where)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, SCTP_P)
    sock.settimeout(0.2)
    return sock


class Backend(threading.Thread):
    """A backend pod's end: records every INIT to TARGET and answers it with an INIT ACK (ports
    swapped, the INIT's initiate tag as verification tag), as an SCTP server would."""

    def __init__(self, lab, pod: str) -> None:
        super().__init__(daemon=True, name=f"sctp-{pod}")
        self.pod = pod
        self.sock = _raw_socket(lab, pod)
        self.inits: list[Seen] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                data, _ = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            seen = _parse(data)
            if seen is None or seen.chunk != CHUNK_INIT or seen.dport != TARGET:
                continue
            self.inits.append(seen)
            ack = SCTP(sport=seen.dport, dport=seen.sport, tag=seen.init_tag) / SCTPChunkInitAck(
                init_tag=random.getrandbits(32) or 1, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=1)
            self.sock.sendto(bytes(ack), (seen.src, 0))

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)
        self.sock.close()


def _associate(lab, client: str, dst: str, dport: int) -> tuple[int, Seen | None]:
    """Send one INIT from `client` to dst:dport; (the INIT's source port, the INIT ACK that came
    back to it or None)."""
    sock = _raw_socket(lab, client)
    try:
        sport, tag = random.randint(20000, 59999), random.getrandbits(32) or 1
        init = SCTP(sport=sport, dport=dport, tag=0) / SCTPChunkInit(init_tag=tag, a_rwnd=65535, n_out_streams=1,
                                                                     n_in_streams=1, init_tsn=7)
        sock.sendto(bytes(init), (dst, 0))
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                data, _ = sock.recvfrom(65535)
            except TimeoutError:
                continue
            seen = _parse(data)
            if seen and seen.chunk == CHUNK_INIT_ACK and seen.dport == sport and seen.tag == tag:
                return sport, seen
        return sport, None
    finally:
        sock.close()


def _check(lab, client: str, dst: str, dport: int, source: str, backends: list[Backend]) -> list[str]:
    """TRIES associations from `client` to dst:dport: each INIT reaches one backend on TARGET
    from `source` with a valid CRC32c, each INIT ACK comes back from dst:dport with a valid one."""
    problems: list[str] = []
    for _ in range(TRIES):
        before = {b.pod: len(b.inits) for b in backends}
        sport, ack = _associate(lab, client, dst, dport)
        what = f"{client} -> {dst}:{dport}/sctp from port {sport}"
        got = [(b.pod, seen) for b in backends for seen in b.inits[before[b.pod]:]]
        if len(got) != 1:
            problems.append(f"{what}: {len(got)} INITs reached the backends ({[p for p, _ in got]}), expected 1")
        for pod, seen in got:
            if (seen.src, seen.dport) != (source, TARGET) or not seen.crc_ok:
                problems.append(f"{what}: {pod} got {seen}, expected from {source} to port {TARGET} with a valid CRC32c")
        if ack is None:
            problems.append(f"{what}: no INIT ACK came back within {WAIT} s")
        elif (ack.src, ack.sport) != (dst, dport) or not ack.crc_ok:
            problems.append(f"{what}: INIT ACK {ack}, expected from {dst}:{dport} with a valid CRC32c")
    return problems


@pytest.mark.skipif(NO_KERNEL_SCTP is None, reason=RAW_SKIP)
def test_sctp_associations_open_through_a_service(e2e_lab):
    """pod -> ClusterIP (DNAT, the port too: 3868 -> 3869) and outside -> NodePort with
    externalTrafficPolicy=Cluster (DNAT and masquerade: both ports may change), both backends."""
    lab = e2e_lab
    lab.apply_manifests(MANIFESTS, "sctp")
    backends = [Backend(lab, pod) for pod in BACKENDS]
    for b in backends:
        b.start()
    try:
        lab.wait_converged()
        problems = _check(lab, "client-1", VIP, PORT, substitute("${client-1}", lab), backends)
        w1 = substitute("${worker1}", lab)
        problems += _check(lab, "outside", w1, NODE_PORT, w1, backends)
        assert not problems, f"{lab.mode} mode:\n" + "\n".join(problems)
        assert all(b.inits for b in backends), f"every backend gets associations: {[len(b.inits) for b in backends]}"
    finally:
        for b in backends:
            b.stop()
        lab.delete_manifests(MANIFESTS, "sctp")
        lab.wait_converged()


# --- with kernel SCTP: the lab's probe and echo server speak it ----------------------------------

PROBE_VIP, PROBE_NODE_PORT = "10.96.122.11", 30123
PROBE_PODS = (("sctp-1", "worker1"), ("sctp-2", "worker3"))
PROBE_MANIFESTS = _service("sctp-echo", PROBE_VIP, "sctp-echo", PROBE_NODE_PORT)


@pytest.mark.skipif(NO_KERNEL_SCTP is not None,
                    reason=f"{NO_KERNEL_SCTP}: the lab's probe and echo server cannot speak SCTP here "
                           "(test_sctp_associations_open_through_a_service covers SCTP Services with raw sockets)")
def test_sctp_probe_through_a_service(e2e_lab):
    """`lab probe --to VIP:PORT/sctp` from a pod (ClusterIP: DNAT 3868 -> 3869, the pod's own address
    kept as the source) and `--to NODE:NODEPORT/sctp` from outside (NodePort, eTP=Cluster), answered
    by the echo server of SCTP pods on two nodes, in every mode."""
    lab = e2e_lab
    for name, node in PROBE_PODS:
        lab.add_pod(PodSpec(name=name, node=node, labels={"app": "sctp-echo"}, listen=(f"{TARGET}/sctp",)))
    lab.apply_manifests(PROBE_MANIFESTS, "sctp-probe")
    try:
        lab.wait_converged()
        names = {name for name, _node in PROBE_PODS}
        pod_ips = {lab.topology.pod(name).ip for name in names}
        client = substitute("${client-1}", lab)
        via_vip = lab.probe("client-1", f"{PROBE_VIP}:{PORT}/sctp", count=TRIES, timeout=WAIT)
        assert via_vip.all_ok, f"{lab.mode}: ClusterIP over SCTP: {via_vip.summary}"
        assert via_vip.pods <= names and {b.rsplit(":", 1)[1] for b in via_vip.backends} == {str(TARGET)}
        assert {b.rsplit(":", 1)[0] for b in via_vip.backends} <= pod_ips
        assert via_vip.source_ips == {client}, f"{lab.mode}: a pod's SCTP to a ClusterIP is not masqueraded"
        w1 = substitute("${worker1}", lab)
        via_node = lab.probe("outside", f"{w1}:{PROBE_NODE_PORT}/sctp", count=TRIES, timeout=WAIT)
        assert via_node.all_ok, f"{lab.mode}: NodePort over SCTP: {via_node.summary}"
        assert via_node.pods <= names
        assert via_vip.pods | via_node.pods == names, "every backend answers some association"
        closed = lab.probe("client-1", f"{lab.topology.pod('sctp-1').ip}:{TARGET + 1}/sctp", timeout=WAIT)
        assert [r.outcome for r in closed.results] == [Outcome.REFUSED], "an ABORT is refused, like a TCP RST"
    finally:
        lab.delete_manifests(PROBE_MANIFESTS, "sctp-probe")
        for name, _node in PROBE_PODS:
            lab.remove_pod(name)
        lab.wait_converged()
