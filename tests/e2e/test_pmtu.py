"""Path MTU discovery through a Service: the too-big error must name the Service (IPv4 and IPv6).

A client sends a large request (64 KiB, TCP with DF: Linux's default PMTU discovery; IPv6
routers never fragment) to a Service whose only backend sits behind a hop with a smaller MTU. The
node forwarding into that hop answers each too-large segment with ICMP fragmentation needed
(IPv4) or ICMPv6 Packet Too Big (IPv6), quoting the segment as it saw it: addressed to the
backend, perhaps from the masquerade address. Only if the proxy translates the error back (outer
and quoted headers) does the client's stack find its socket, lower its path MTU *for the Service
address* and resend; otherwise the connection stalls (checked once by hand on the IPv4 lab with
the datapath before bpf/lib/icmp4_err.h: both transfers timed out, no PMTU cached).

Checked for each case, in every mode: the echo of the whole request comes back; the client read
too-big errors (raw socket) whose sender *and* quoted destination are the frontend it connected
to, with the hop's MTU; its kernel caches that MTU for the frontend (`ip route get`).
  IPv4 (pmtu_topology.yaml), hop MTU 1200 (a route MTU, which IPv4 forwarding honours);
      iptables: conntrack's related NAT; ebpf: icmp4_err.h, and worker1 counted at least as many
      ICMP_RELATED translations as the client read errors.
  IPv6 (pmtu6_topology.yaml, the same cluster IPv6-only), hop MTU 1280 (IPv6's minimum) as a
      *locked* route MTU: ip6_forward honours a route MTU only when locked (unlocked, the packet
      is refused later, by ip6_fragment after POSTROUTING, i.e. already masqueraded), and the
      hop's node counts its answers in Ip6InTooBigErrors, which ip6_forward alone increments.
      Both modes are ip6tables with conntrack's related NAT (ebpf mode serves IPv6 with
      ip6tables for now).

Cases (connections are proxied at worker1, web-1 is on worker2):
  hop "worker2->web-1": a router between the proxying node and the backend answers (worker2);
  hop "worker1->worker2": the proxying node itself answers, from its forwarding path, after its
      ingress translated the segment (the quote is the DNATed one);
and clients: client-a (pod on worker1) to the clusterIP, not masqueraded; outside to worker1's
nodePort, masqueraded (the error comes back to the masquerade address first).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.e2e.conftest import E2E_MODES

pytestmark = [pytest.mark.root, pytest.mark.e2e]

HERE = Path(__file__).parent
NODE_PORT = 30400


@dataclass(frozen=True)
class Family:
    version: int
    topology: Path
    cluster_ip: str
    worker1: str  # worker1's address: the nodePort frontend of `outside`
    hops: dict[str, tuple[str, str]]  # the hop whose MTU is lowered: (node, the route's destination)
    mtu: int
    mtu_args: tuple[str, ...]  # what lowers a route's MTU to `mtu`
    ip: tuple[str, ...]  # the `ip` command for this family
    too_big: tuple[int, int]  # (type, code) of the error the hop's node answers with

    @property
    def clients(self) -> dict[str, tuple[str, int]]:  # client: (frontend host, port)
        return {"client-a": (self.cluster_ip, 80), "outside": (self.worker1, NODE_PORT)}

    @property
    def manifest(self) -> str:
        return f"""
apiVersion: v1
kind: Service
metadata: {{name: big}}
spec:
  type: NodePort
  clusterIP: "{self.cluster_ip}"
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
"""


IPV4 = Family(
    version=4, topology=HERE / "pmtu_topology.yaml", cluster_ip="10.96.120.10", worker1="172.20.20.15",
    hops={"worker2->web-1": ("worker2", "10.244.4.3"), "worker1->worker2": ("worker1", "10.244.4.0/24")},
    mtu=1200, mtu_args=("mtu", "1200"), ip=("ip",), too_big=(3, 4))  # fragmentation needed
IPV6 = Family(
    version=6, topology=HERE / "pmtu6_topology.yaml", cluster_ip="fd00:10:96::120", worker1="fd00:20::15",
    hops={"worker2->web-1": ("worker2", "fd00:10:244:4::3"),
          "worker1->worker2": ("worker1", "fd00:10:244:4::/64")},
    mtu=1280, mtu_args=("mtu", "lock", "1280"), ip=("ip", "-6"), too_big=(2, 0))  # Packet Too Big

# Runs in the client's netns: one large request/response over TCP, reading every ICMP(v6) error
# that arrives meanwhile with a raw socket. Prints one JSON object.
TRANSFER = r"""
import json, socket, struct, sys
family, host, port, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if family == 4:
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
else:
    raw = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
payload = bytes(i % 251 for i in range(size))
out = {"ok": False, "errors": []}
try:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    data = bytearray()
    while chunk := s.recv(65536):
        data += chunk
    line, _, echo = bytes(data).partition(b"\n")
    out.update(ok=echo == payload, reply=json.loads(line))
except OSError as e:
    out["failure"] = repr(e)

def error4(pkt, sender):  # an IPv4 raw socket reads the IP header too
    hl = (pkt[0] & 15) * 4
    icmp, inner = pkt[hl:], pkt[hl + 8:]
    if icmp[0] != 3 or len(inner) < 24:  # destination unreachable quoting an IP header and ports
        return None
    ihl = (inner[0] & 15) * 4
    return {"src": socket.inet_ntoa(pkt[12:16]), "type": icmp[0], "code": icmp[1],
            "mtu": struct.unpack("!H", icmp[6:8])[0], "quoted_dst": socket.inet_ntoa(inner[16:20]),
            "quoted_dport": struct.unpack("!H", inner[ihl + 2:ihl + 4])[0]}

def error6(icmp, sender):  # an ICMPv6 raw socket reads from the ICMPv6 header; the sender is apart
    inner = icmp[8:]
    if icmp[0] >= 128 or len(inner) < 44 or inner[6] != socket.IPPROTO_TCP:  # errors quoting TCP
        return None
    return {"src": sender[0], "type": icmp[0], "code": icmp[1], "mtu": struct.unpack("!I", icmp[4:8])[0],
            "quoted_dst": socket.inet_ntop(socket.AF_INET6, inner[24:40]),
            "quoted_dport": struct.unpack("!H", inner[42:44])[0]}

while True:
    try:
        pkt, sender = raw.recvfrom(65535, socket.MSG_DONTWAIT)
    except BlockingIOError:
        break
    if (error := (error4 if family == 4 else error6)(pkt, sender)) is not None:
        out["errors"].append(error)
print(json.dumps(out))
"""


def _lab(name: str, family: Family, mode: str):
    destroy(name)
    lab = Lab.up(name, str(family.topology), mode=mode)
    try:
        lab.apply_manifests(family.manifest, "test_pmtu")
        lab.wait_converged()
        yield lab
    finally:
        destroy(name)


@pytest.fixture(scope="module", params=E2E_MODES)
def pmtu_lab(request):
    yield from _lab(f"pmtu{request.param[:3]}{os.getpid() % 10000}", IPV4, request.param)


@pytest.fixture(scope="module", params=E2E_MODES)
def pmtu6_lab(request):
    yield from _lab(f"pmtu6{request.param[:3]}{os.getpid() % 10000}", IPV6, request.param)


def _route(lab: Lab, family: Family, node: str, dst: str) -> str:
    line = lab.exec(node, [*family.ip, "-o", "route", "show", "exact", dst], check=True).stdout.strip()
    assert line, f"{node} has no route to {dst}"
    return line.replace("\\", " ").split(" mtu ")[0]


def _icmp_related(lab: Lab, family: Family) -> int:
    """worker1's ICMP_RELATED packet count (IPv4, ebpf mode): the translations behind what the
    client read. IPv6 has no such counter: in ebpf mode IPv6 is served by ip6tables for now
    (conntrack's related NAT), and an IPv6-only node has no eBPF datapath to ask."""
    if lab.mode != "ebpf" or family.version != 4:
        return 0
    done = lab.exec("worker1", [sys.executable, "-m", "ebpf_proxy", "stats", "--json", "--bpffs",
                                str(lab.dir / "bpffs" / "worker1")], check=True)
    return json.loads(done.stdout)["reasons"]["ICMP_RELATED"]["packets"]


def _forward_too_big(lab: Lab, family: Family, node: str) -> int:
    """The node's Ip6InTooBigErrors (IPv6): packets ip6_forward refused as too big for the route."""
    if family.version != 6:
        return 0
    snmp6 = lab.exec(node, ["cat", "/proc/net/snmp6"], check=True).stdout
    return int(dict(line.split() for line in snmp6.splitlines())["Ip6InTooBigErrors"])


def _flush_pmtu(lab: Lab, family: Family, where: str) -> None:
    lab.exec(where, [*family.ip, "route", "flush", "cache"], check=True)


def _check_path_mtu(lab: Lab, family: Family, hop: str, client: str) -> None:
    node, dst = family.hops[hop]
    host, port = family.clients[client]
    route = _route(lab, family, node, dst)
    _flush_pmtu(lab, family, client)
    related_before = _icmp_related(lab, family)
    too_big_before = _forward_too_big(lab, family, node)
    lab.exec(node, [*family.ip, "route", "replace", *route.split(), *family.mtu_args], check=True)
    try:
        done = lab.exec(client, [sys.executable, "-c", TRANSFER, str(family.version), host, str(port),
                                 str(64 * 1024)], check=True)
        cached = lab.exec(client, [*family.ip, "route", "get", host], check=True).stdout
    finally:
        lab.exec(node, [*family.ip, "route", "replace", *route.split()], check=True)
        _flush_pmtu(lab, family, client)
    result = json.loads(done.stdout)
    senders = sorted({(e["src"], e["type"], e["code"], e["mtu"]) for e in result["errors"]})
    print(f"\n{lab.mode} {hop} {client}: ok={result['ok']}, {len(result['errors'])} ICMP errors from {senders}")

    assert result["ok"], f"the transfer did not complete: {result}"
    assert result["reply"]["pod"] == "web-1"
    too_big = [e for e in result["errors"] if (e["type"], e["code"]) == family.too_big]
    assert too_big, f"no {family.too_big} error reached {client}: {result['errors']}"
    for e in too_big:
        assert (e["src"], e["quoted_dst"], e["quoted_dport"], e["mtu"]) == (host, host, port, family.mtu), e
    assert f"mtu {family.mtu}" in cached, f"{client} cached no path MTU for {host}: {cached}"
    if family.version == 6:  # the hop's node answered from ip6_forward (the route MTU is locked)
        assert _forward_too_big(lab, family, node) - too_big_before >= len(too_big)
    # IPv4 in ebpf mode: each error the client read was translated by worker1's icmp4_err.h (no
    # such counter for IPv6: in ebpf mode IPv6 is served by ip6tables for now)
    if lab.mode == "ebpf" and family.version == 4:
        assert _icmp_related(lab, family) - related_before >= len(too_big)


@pytest.mark.parametrize("client", IPV4.clients)
@pytest.mark.parametrize("hop", IPV4.hops)
def test_large_request_learns_the_path_mtu_of_the_service(pmtu_lab, hop, client):
    _check_path_mtu(pmtu_lab, IPV4, hop, client)


@pytest.mark.parametrize("client", IPV6.clients)
@pytest.mark.parametrize("hop", IPV6.hops)
def test_large_request_learns_the_path_mtu_of_the_service_over_ipv6(pmtu6_lab, hop, client):
    """ICMPv6 Packet Too Big about a translated connection reaches the client from the frontend."""
    _check_path_mtu(pmtu6_lab, IPV6, hop, client)
