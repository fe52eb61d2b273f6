"""The lab's two echo servers, the Python one (echo.py) and the native one (echod.c), held to one
behaviour: every test here runs against both, and the native server's replies are compared byte for
byte with the Python wire format (echo.reply_line), the definition the probe and loadgen parse.

Topology (made here, removed in a finalizer even when tests fail; nothing touches the root netns):
"client" 10.99.1.1/24, fd00:99:1::1/64 --veth-- "pod" 10.99.1.2/24, fd00:99:1::2/64.
"""

import json
import os
import socket
import subprocess

import pytest

from tests.lab.echo_util import SERVERS, stop
from tests.lab.echo_util import start as start_in
from tests.netns_util import add_netns, del_netns, nsenter

from ebpf_proxy.lab import echod, nsexec
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.lab.echo import reply_line
from ebpf_proxy.lab.probe import ProbeError, probe, wait_until_ok
from ebpf_proxy.lab.sctp import sctp_available

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

PREFIX = f"epxt-echo-{os.getpid()}-"
CLIENT = PREFIX + "client"
POD = PREFIX + "pod"
POD_IP, CLIENT_IP = "10.99.1.2", "10.99.1.1"
POD_IP6, CLIENT_IP6 = "fd00:99:1::2", "fd00:99:1::1"


def start(kind: str, pod: str, ready_file, *listens: str, **kw) -> subprocess.Popen:
    return start_in(kind, POD, pod, ready_file, *listens, **kw)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def net():
    made: list[str] = []
    try:
        for ns in (CLIENT, POD):
            add_netns(ns)
            made.append(ns)
        sh(*nsenter(CLIENT), "ip", "link", "add", "c0", "type", "veth", "peer", "name", "p0", "netns", POD)
        for ns, dev, ip4, ip6 in ((CLIENT, "c0", CLIENT_IP, CLIENT_IP6), (POD, "p0", POD_IP, POD_IP6)):
            sh(*nsenter(ns), "ip", "addr", "add", f"{ip4}/24", "dev", dev)
            sh(*nsenter(ns), "ip", "addr", "add", f"{ip6}/64", "dev", dev, "nodad")
            sh(*nsenter(ns), "ip", "link", "set", dev, "up")
        yield
    finally:
        for ns in made:
            del_netns(ns)


@pytest.fixture(scope="module", params=SERVERS)
def server(request, net, tmp_path_factory):
    """web-1 on 80/tcp and 53/udp, over IPv4 and IPv6, run by the server under test."""
    ready = tmp_path_factory.mktemp(f"echo-{request.param}") / "ready"
    proc = start(request.param, "web-1", ready, "80/tcp", "53/udp", ipv6=True)
    try:
        wait_until_ok(CLIENT, f"{POD_IP}:80", timeout=10)  # the veth needs a moment to come up
        yield request.param
    finally:
        stop(proc)


def _udp_exchange(payload: bytes, ip: str = POD_IP) -> bytes:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2)
        sock.sendto(payload, (ip, 53))
        data, peer = sock.recvfrom(65535)
        assert peer[:2] == (ip, 53), "the reply must come from the address the request went to"
        return data


def test_udp_payloads_are_echoed_capped(server):
    reply = json.loads(run_in_netns(CLIENT, _udp_exchange, b"ping 123"))
    assert reply["echo"] == "ping 123"
    assert reply["pod"] == "web-1" and reply["proto"] == "udp" and reply["local"] == f"{POD_IP}:53"
    assert reply["peer"].startswith(f"{CLIENT_IP}:")
    assert len(json.loads(run_in_netns(CLIENT, _udp_exchange, b"y" * 4000))["echo"]) == 1024


# Payloads whose escaping is easy to get wrong: quotes, controls, DEL, non-ASCII (BMP and beyond,
# as a surrogate pair), invalid UTF-8 (lone continuation, truncated sequences, an encoded
# surrogate, an overlong form), and a multi-byte character cut by the 1024-byte cap.
TRICKY = [b'say "hi" \\ there\n\t\r\b\f\x00\x1f\x7f', "zoë → 日本 🚀".encode(), b"\x80abc\xe2\x82", b"\xed\xa0\x80\xc0\xaf\xf4\x90",
          b"x" * 1023 + "é".encode()]


@pytest.mark.parametrize("payload", TRICKY, ids=["escapes", "unicode", "invalid-utf8", "surrogate-overlong", "cut"])
def test_udp_reply_is_byte_for_byte_the_wire_format(server, payload):
    data = run_in_netns(CLIENT, _udp_exchange, payload)
    peer = json.loads(data)["peer"]
    assert data == reply_line("web-1", f"{POD_IP}:53", peer, "udp", payload)


def _tcp_echo_session(chunks: list[bytes], ip: str = POD_IP) -> tuple[bytes, bytes]:
    with socket.create_connection((ip, 80), timeout=5) as sock:
        reader = sock.makefile("rb")
        hello = reader.readline()
        for chunk in chunks:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        return hello, reader.read()  # until the server closes after our EOF


def test_tcp_is_echoed_until_eof(server):
    chunks = [b"GET / HTTP/1.0\r\n", b"x" * 300_000, b"end\n"]
    hello, echoed = run_in_netns(CLIENT, _tcp_echo_session, chunks)
    peer = json.loads(hello)["peer"]
    assert peer.startswith(f"{CLIENT_IP}:")
    assert hello == reply_line("web-1", f"{POD_IP}:80", peer, "tcp")
    assert echoed == b"".join(chunks)


def test_ipv6_peers_are_bracketed_and_ipv4_peers_stay_plain(server):
    hello, echoed = run_in_netns(CLIENT, _tcp_echo_session, [b"six"], POD_IP6)
    reply = json.loads(hello)
    assert reply["local"] == f"[{POD_IP6}]:80" and reply["peer"].startswith(f"[{CLIENT_IP6}]:")
    assert echoed == b"six"
    udp = json.loads(run_in_netns(CLIENT, _udp_exchange, b"six", POD_IP6))
    assert udp["local"] == f"[{POD_IP6}]:53" and udp["echo"] == "six"
    assert json.loads(run_in_netns(CLIENT, _udp_exchange, b"four"))["peer"].startswith(f"{CLIENT_IP}:")


def _many_concurrent(n: int) -> set[str]:
    socks = [socket.create_connection((POD_IP, 80), timeout=5) for _ in range(n)]
    try:
        return {json.loads(s.makefile("rb").readline())["peer"] for s in socks}
    finally:
        for s in socks:
            s.close()


def test_many_concurrent_clients_are_served(server):
    assert len(run_in_netns(CLIENT, _many_concurrent, 300)) == 300


@pytest.mark.parametrize("kind", SERVERS)
def test_exits_cleanly_on_sigterm_and_removes_its_ready_file(net, tmp_path, kind):
    ready = tmp_path / "ready"
    proc = start(kind, "web-2", ready, "9090/tcp", "9053/udp", threads=2 if kind == "native" else None)
    try:
        expected = {"pod": "web-2", "pid": proc.pid, "listen": ["9090/tcp", "9053/udp"]}
        if kind == "native":
            expected["threads"] = 2
            assert len(os.listdir(f"/proc/{proc.pid}/task")) == 3  # the signal waiter and two servers
        assert json.loads(ready.read_text()) == expected
        assert probe(CLIENT, f"{POD_IP}:9053/udp").pods == {"web-2"}
        assert probe(CLIENT, f"{POD_IP}:9090").pods == {"web-2"}
    finally:
        rc = stop(proc)
    assert rc == 0
    assert not ready.exists(), "the ready file must not outlive the server"


@pytest.mark.parametrize("holder", SERVERS)
@pytest.mark.parametrize("kind", SERVERS)
def test_a_port_another_server_holds_is_an_error(net, tmp_path, kind, holder):
    """Also native beside native: its own sockets share ports (SO_REUSEPORT), a stranger's may not."""
    held = start(holder, "holder", tmp_path / "held", "7070/tcp", "7053/udp")
    try:
        for listen in ("7070/tcp", "7053/udp"):
            run = nsexec.run(POD, echod.server_argv(kind, "dup", [listen], tmp_path / "ready"), timeout=10)
            assert run.returncode == 1 and "cannot bind" in run.stderr, (listen, run.stderr)
            assert not (tmp_path / "ready").exists()
    finally:
        stop(held)


def test_python_server_serves_sctp_where_the_kernel_has_it_and_says_why_not_elsewhere(net, tmp_path):
    """An sctp listen beside tcp and udp: with kernel SCTP, the probe's association is answered
    like a TCP connection (the pod, the backend address, the client seen); without it (this
    machine), the server says in one stderr line that SCTP is not served and why, and serves the
    rest, and a probe over SCTP is an error naming the same cause. The native server refuses sctp."""
    ready = tmp_path / "ready"
    proc = start("python", "web-s", ready, "9180/tcp", "9868/sctp", "9153/udp", ipv6=True)
    why = sctp_available()
    try:
        listening = json.loads(ready.read_text())["listen"]
        assert probe(CLIENT, f"{POD_IP}:9180").pods == {"web-s"}
        assert probe(CLIENT, f"{POD_IP}:9153/udp").pods == {"web-s"}
        if why is None:
            assert listening == ["9180/tcp", "9868/sctp", "9153/udp"]
            for ip, client in ((POD_IP, CLIENT_IP), (f"[{POD_IP6}]", f"[{CLIENT_IP6}]")):
                report = probe(CLIENT, f"{ip}:9868/sctp", count=3, timeout=2.0)
                assert report.all_ok and report.pods == {"web-s"}, report.summary
                assert report.backends == {f"{ip}:9868"} and report.source_ips == {client.strip("[]")}
            assert [r.outcome for r in probe(CLIENT, f"{POD_IP}:9869/sctp", timeout=2.0).results] == ["refused"]
        else:
            assert listening == ["9180/tcp", "9153/udp"]
            with pytest.raises(ProbeError, match="no SCTP sockets"):
                probe(CLIENT, f"{POD_IP}:9868/sctp")
    finally:
        assert stop(proc) == 0
    log = proc.stderr.read()
    if why is None:
        assert "sctp" not in log, log
    else:
        assert log.splitlines() == [f"echo[web-s]: not serving 9868/sctp: {why}"], log
    with pytest.raises(ValueError, match="native .* tcp and udp only"):
        echod.server_argv("native", "web-s", ["9180/tcp", "9868/sctp"])
