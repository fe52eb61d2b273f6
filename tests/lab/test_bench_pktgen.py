"""The bench's raw-packet generator (bench/pktgen.c), between two scratch namespaces: every frame
it sends must be a well-formed SYN to the asked address and port, each a new connection, with
IPv4 and TCP checksums the receiving kernel accepts (a first version summed the headers through
a uint16_t pointer, which C's aliasing rules let -O2 reorder: every TCP checksum was wrong and
iptables never saw a packet, while BPF, which does not check, counted them all)."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from ebpf_proxy.bench import xdppps
from tests.netns_util import add_netns, del_netns, nsenter

pytestmark = pytest.mark.root

SRC, DST, DPORT = "203.0.113.5", "172.20.20.16", 30088


@pytest.fixture
def pair():
    a, b = f"pkga{os.getpid() % 100000}", f"pkgb{os.getpid() % 100000}"
    for ns in (a, b):
        del_netns(ns)
        add_netns(ns)
    try:
        subprocess.run(nsenter(a) + ["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
                                     "netns", f"/run/netns/{b}"], check=True, capture_output=True)
        for ns, ip in ((a, SRC), (b, DST)):
            subprocess.run(nsenter(ns) + ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"], check=True)
            subprocess.run(nsenter(ns) + ["ip", "link", "set", "eth0", "up"], check=True)
        yield a, b
    finally:
        del_netns(a)
        del_netns(b)


def _mac(ns: str) -> str:
    out = subprocess.run(nsenter(ns) + ["ip", "-j", "link", "show", "eth0"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)[0]["address"]


def _nstat(ns: str) -> dict[str, int]:
    out = subprocess.run(nsenter(ns) + ["nstat", "-az", "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["kernel"]


def test_every_frame_is_a_new_valid_syn_the_kernel_accepts(pair):
    a, b = pair
    binary = xdppps.build()
    # a capture socket in b, made before sending, sees the first frames
    capture = subprocess.Popen(
        nsenter(b) + ["python3", "-c", (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_PACKET,socket.SOCK_RAW,socket.htons(3)); s.bind(('eth0',0)); s.settimeout(5)\n"
            "print('ready',flush=True)\n"
            "for _ in range(200): sys.stdout.write(s.recv(2048).hex()+'\\n')\n")],
        stdout=subprocess.PIPE, text=True)
    assert capture.stdout.readline().strip() == "ready"
    before = _nstat(b)
    sent = subprocess.run(nsenter(a) + [str(binary), "--ifname", "eth0", "--dst-mac", _mac(b), "--src-ip", SRC,
                                        "--dst-ip", DST, "--dport", str(DPORT), "--seconds", "0.3"],
                          check=True, capture_output=True, text=True)
    report = json.loads(sent.stdout)
    frames, _ = capture.communicate(timeout=10)
    after = _nstat(b)

    assert report["sent"] > 1000 and report["errors"] == 0, report
    syns = [Ether(bytes.fromhex(line)) for line in frames.split()]
    syns = [f for f in syns if f.haslayer(TCP) and f[TCP].dport == DPORT]
    assert len(syns) >= 100
    for frame in syns:
        ip, tcp = frame[IP], frame[TCP]
        assert (ip.src, ip.dst, tcp.flags, ip.flags) == (SRC, DST, "S", "DF")
        wire_ip, wire_tcp = ip.chksum, tcp.chksum
        del ip.chksum, tcp.chksum
        rebuilt = Ether(bytes(frame))
        assert (wire_ip, wire_tcp) == (rebuilt[IP].chksum, rebuilt[TCP].chksum)
    assert len({f[TCP].sport for f in syns}) == len(syns)  # a new connection each
    # b's kernel took every one: no checksum error, one RST per SYN (nothing listens)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("TcpInSegs", "TcpInCsumErrors", "TcpOutRsts")}
    assert grew["TcpInCsumErrors"] == 0 and grew["TcpInSegs"] >= report["sent"], grew
    assert grew["TcpOutRsts"] >= report["sent"], grew


def test_bad_arguments_name_the_argument():
    binary = xdppps.build()
    done = subprocess.run([str(binary), "--ifname", "eth0", "--dst-mac", "02:00:00:00:00:zz"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--dst-mac is not a MAC address: 02:00:00:00:00:zz" in done.stderr
    done = subprocess.run([str(binary), "--ifname", "eth0", "--dst-mac", "02:00:00:00:00:01", "--src-ip", SRC,
                           "--dst-ip", DST, "--dport", "70000", "--seconds", "1"], capture_output=True, text=True)
    assert done.returncode == 2 and "--dport is not a port (1-65535): 70000" in done.stderr
