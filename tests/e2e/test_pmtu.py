"""Path MTU discovery through a Service: the fragmentation-needed error must name the Service.

A client sends a large request (64 KiB, TCP with DF: Linux's default PMTU discovery) to a Service
whose only backend sits behind a hop with a smaller MTU (1200, a route MTU the forwarding path
honours). The node forwarding into that hop answers each too-large segment with ICMP
fragmentation needed, quoting the segment as it saw it: addressed to the backend, perhaps from
the masquerade address. Only if the proxy translates the error back (outer and quoted headers)
does the client's stack find its socket, lower its path MTU *for the Service address* and
resend; otherwise the connection stalls (checked once by hand on this lab with the datapath
before bpf/lib/icmp4_err.h: both transfers timed out, no PMTU cached).

Checked for each case, in every mode (iptables: conntrack's related NAT; ebpf: icmp4_err.h):
the echo of the whole request comes back; the client read fragmentation-needed errors (raw
socket) whose sender *and* quoted destination are the frontend it connected to, next-hop MTU
1200; its kernel caches MTU 1200 for the frontend (`ip route get`); in ebpf mode, worker1
counted at least as many ICMP_RELATED translations as the client read errors.

Cases (pmtu_topology.yaml: connections are proxied at worker1, web-1 is on worker2):
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
from pathlib import Path

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.e2e.conftest import E2E_MODES

pytestmark = [pytest.mark.root, pytest.mark.e2e]

HERE = Path(__file__).parent
TOPOLOGY = HERE / "pmtu_topology.yaml"
CLUSTER_IP, NODE_PORT, WORKER1 = "10.96.120.10", 30400, "172.20.20.15"
MTU = 1200
MANIFEST = f"""
apiVersion: v1
kind: Service
metadata: {{name: big}}
spec:
  type: NodePort
  clusterIP: {CLUSTER_IP}
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
"""
HOPS = {  # the hop whose MTU is lowered: (node, the route's destination)
    "worker2->web-1": ("worker2", "10.244.4.3"),
    "worker1->worker2": ("worker1", "10.244.4.0/24"),
}
CLIENTS = {  # client: (frontend host, port)
    "client-a": (CLUSTER_IP, 80),
    "outside": (WORKER1, NODE_PORT),
}

# Runs in the client's netns: one large request/response over TCP, reading every ICMP error that
# arrives meanwhile with a raw socket. Prints one JSON object.
TRANSFER = r"""
import json, socket, struct, sys
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
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
while True:
    try:
        pkt = raw.recv(65535, socket.MSG_DONTWAIT)
    except BlockingIOError:
        break
    hl = (pkt[0] & 15) * 4
    icmp, inner = pkt[hl:], pkt[hl + 8:]
    if icmp[0] != 3 or len(inner) < 24:
        continue
    ihl = (inner[0] & 15) * 4
    out["errors"].append({"src": socket.inet_ntoa(pkt[12:16]), "type": icmp[0], "code": icmp[1],
                          "mtu": struct.unpack("!H", icmp[6:8])[0], "quoted_dst": socket.inet_ntoa(inner[16:20]),
                          "quoted_dport": struct.unpack("!H", inner[ihl + 2:ihl + 4])[0]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=E2E_MODES)
def pmtu_lab(request):
    name = f"pmtu{request.param[:3]}{os.getpid() % 10000}"
    destroy(name)
    lab = Lab.up(name, str(TOPOLOGY), mode=request.param)
    try:
        lab.apply_manifests(MANIFEST, "test_pmtu")
        lab.wait_converged()
        yield lab
    finally:
        destroy(name)


def _route(lab: Lab, node: str, dst: str) -> str:
    line = lab.exec(node, ["ip", "-o", "route", "show", "exact", dst], check=True).stdout.strip()
    assert line, f"{node} has no route to {dst}"
    return line.replace("\\", " ").split(" mtu ")[0]


def _icmp_related(lab: Lab) -> int:
    """worker1's ICMP_RELATED packet count (ebpf mode): the translations behind what the client read."""
    if lab.mode != "ebpf":
        return 0
    done = lab.exec("worker1", [sys.executable, "-m", "ebpf_proxy", "stats", "--json", "--bpffs",
                                str(lab.dir / "bpffs" / "worker1")], check=True)
    return json.loads(done.stdout)["reasons"]["ICMP_RELATED"]["packets"]


def _flush_pmtu(lab: Lab, where: str) -> None:
    lab.exec(where, ["ip", "route", "flush", "cache"], check=True)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("hop", HOPS)
def test_large_request_learns_the_path_mtu_of_the_service(pmtu_lab, hop, client):
    lab = pmtu_lab
    node, dst = HOPS[hop]
    host, port = CLIENTS[client]
    route = _route(lab, node, dst)
    _flush_pmtu(lab, client)
    related_before = _icmp_related(lab)
    lab.exec(node, ["ip", "route", "replace", *route.split(), "mtu", str(MTU)], check=True)
    try:
        done = lab.exec(client, [sys.executable, "-c", TRANSFER, host, str(port), str(64 * 1024)], check=True)
        cached = lab.exec(client, ["ip", "route", "get", host], check=True).stdout
    finally:
        lab.exec(node, ["ip", "route", "replace", *route.split()], check=True)
        _flush_pmtu(lab, client)
    result = json.loads(done.stdout)
    senders = sorted({(e["src"], e["type"], e["code"], e["mtu"]) for e in result["errors"]})
    print(f"\n{lab.mode} {hop} {client}: ok={result['ok']}, {len(result['errors'])} ICMP errors from {senders}")

    assert result["ok"], f"the transfer did not complete: {result}"
    assert result["reply"]["pod"] == "web-1"
    frag_needed = [e for e in result["errors"] if (e["type"], e["code"]) == (3, 4)]
    assert frag_needed, f"no fragmentation-needed reached {client}: {result['errors']}"
    for e in frag_needed:
        assert (e["src"], e["quoted_dst"], e["quoted_dport"], e["mtu"]) == (host, host, port, MTU), e
    assert f"mtu {MTU}" in cached, f"{client} cached no path MTU for {host}: {cached}"
    if lab.mode == "ebpf":  # each error the client read was translated by worker1's icmp4_err.h
        assert _icmp_related(lab) - related_before >= len(frag_needed)
