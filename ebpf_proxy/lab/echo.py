"""The lab's echo server: runs in every pod and tells each client who answered and what it saw.

    python -m ebpf_proxy.lab.echo --pod NAME --listen 80/tcp --listen 53/udp --listen 3868/sctp [--ready-file F]

Every answer is one JSON object, `{"pod", "local", "peer", "proto"}`: `local` is the address the
connection or datagram arrived on *after* any DNAT (the backend address), `peer` the source the
pod saw (so SNAT/masquerade is visible). That is what lets a probe check a service proxy's
packet-level decisions from outside. TCP: the line is sent on accept, then everything the client
sends is echoed back until EOF (benchmarks use that for request/response). SCTP (one-to-one
sockets) is served exactly as TCP, where the kernel has SCTP sockets; where it has not, the
server logs one line saying SCTP is not served and why, and serves the rest. UDP: each datagram gets
the same object, plus the request payload under "echo" (decoded as UTF-8 with replacement, cut to
ECHO_CAP bytes so the reply stays within one MTU-sized datagram).

One thread, one selector loop, non-blocking sockets: cheap enough to run in dozens of pods and
fast enough for thousands of connections per second. The wire format (reply_line/parse_reply)
lives here because the server defines it; the probe only reads it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import selectors
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field

from ebpf_proxy.lab.sctp import sctp_available

PROTOS = ("tcp", "udp", "sctp")
ECHO_CAP = 1024
REPLY_KEYS = ("pod", "local", "peer", "proto")

# Linux IP_PKTINFO (Python's socket module does not export it): the destination address of each
# received datagram, and the source address to use for the reply.
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
_PKTINFO = struct.Struct("=i4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr
IPV6_RECVPKTINFO = getattr(socket, "IPV6_RECVPKTINFO", 49)
IPV6_PKTINFO = getattr(socket, "IPV6_PKTINFO", 50)
_PKTINFO6 = struct.Struct("=16sI")  # struct in6_pktinfo: addr, ifindex

_READ_CHUNK = 65536
_OUTBUF_HIGH = 1 << 20  # stop reading from a client that does not read its echo
_UDP_BATCH = 64  # datagrams per wake-up, so one busy UDP port cannot starve the rest
_SCTP_NODELAY = getattr(socket, "SCTP_NODELAY", 3)  # linux/sctp.h; Python exports it only with SCTP headers


# --- wire format -------------------------------------------------------------------------------


def format_addr(host: str, port: int) -> str:
    """'IP:PORT', with IPv6 addresses bracketed, as every report and reply spells addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reply_line(pod: str, local: str, peer: str, proto: str, echo: bytes | None = None) -> bytes:
    """The newline-terminated JSON object the server sends (TCP) or returns (UDP)."""
    obj: dict[str, str] = {"pod": pod, "local": local, "peer": peer, "proto": proto}
    if echo:
        obj["echo"] = echo[:ECHO_CAP].decode("utf-8", "replace")
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def parse_reply(data: bytes) -> dict[str, str] | None:
    """The reply as a dict if `data` is one of ours (a JSON object with string REPLY_KEYS), else None."""
    try:
        obj = json.loads(data.split(b"\n", 1)[0])
    except ValueError:  # includes UnicodeDecodeError
        return None
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in REPLY_KEYS):
        return None
    return obj


# --- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Listen:
    """One port to serve; parsed from 'PORT[/tcp|udp|sctp]'."""

    port: int
    proto: str = "tcp"

    def __str__(self) -> str:
        return f"{self.port}/{self.proto}"


def parse_listen(spec: str) -> Listen:
    """Parse '--listen' values such as '80/tcp', '53/udp', '3868/sctp' or '8080' (tcp)."""
    port_s, _, proto = spec.strip().partition("/")
    proto = (proto or "tcp").lower()
    if proto not in PROTOS:
        raise ValueError(f"listen {spec!r}: protocol must be tcp, udp or sctp")
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"listen {spec!r}: port must be a number from 1 to 65535")
    return Listen(int(port_s), proto)


# --- server ------------------------------------------------------------------------------------


@dataclass
class _Conn:
    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)
    eof: bool = False


class EchoServer:
    """A single-threaded selector loop serving every Listen of one pod.

    bind() creates the sockets (so readiness can be reported right after), serve_forever() runs
    until stop() — which is safe to call from a signal handler or another thread.
    """

    def __init__(self, pod: str, listens: list[Listen], host: str = "0.0.0.0", ipv6: bool = False,
                 log=None) -> None:
        """`ipv6`: serve every listen on IPv6 (`::`, IPv6 only) as well, for a pod with an IPv6
        address; separate sockets, so IPv4 peers are reported as plain IPv4, never ::ffff:a.b.c.d.
        `log(line)` receives the one line saying SCTP listens are not served (default: stderr)."""
        if not listens:
            raise ValueError("nothing to listen on")
        self.pod = pod
        self.listens = listens
        self.host = host
        self.ipv6 = ipv6
        self._sel = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        self._conns: dict[int, _Conn] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.unserved: list[Listen] = []  # SCTP listens this kernel cannot serve (see bind)

    # lifecycle

    def bind(self) -> None:
        """Bind and register every listening socket; raises OSError if any port is taken."""
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        families = [socket.AF_INET, socket.AF_INET6] if self.ipv6 else [socket.AF_INET]
        listens = self.listens
        if any(listen.proto == "sctp" for listen in listens):
            why = sctp_available()
            if why is not None:  # serve the rest: a pod's TCP and UDP do not depend on SCTP
                self.unserved = [listen for listen in listens if listen.proto == "sctp"]
                listens = [listen for listen in listens if listen.proto != "sctp"]
                self._log(f"echo[{self.pod}]: not serving {', '.join(map(str, self.unserved))}: {why}")
        for listen in listens:
            for family in families:
                if listen.proto == "udp":
                    self._listeners.append(self._udp_socket(listen.port, family))
                else:
                    proto = socket.IPPROTO_SCTP if listen.proto == "sctp" else socket.IPPROTO_TCP
                    self._listeners.append(self._stream_listener(listen.port, family, proto))

    def serve_forever(self) -> None:
        while not self._stopping:
            for key, events in self._sel.select():
                key.data(key.fileobj, events)

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # already closed, or the wake-up buffer is full: either way we wake
            pass

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        for sock in self._listeners:
            self._sel.unregister(sock)
            sock.close()
        self._listeners.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def addresses(self) -> list[tuple[str, int, str]]:
        """(host, bound port, proto) of each listener, e.g. to learn ports bound as 0."""
        out = []
        for sock in self._listeners:
            host, port = sock.getsockname()[:2]
            out.append((host, port, _proto_name(sock)))
        return out

    # sockets

    def _host(self, family: int) -> str:
        return self.host if family == socket.AF_INET else "::"

    def _stream_listener(self, port: int, family: int = socket.AF_INET,
                         proto: int = socket.IPPROTO_TCP) -> socket.socket:
        """A listening TCP or one-to-one SCTP socket: both accept() connections served alike."""
        sock = socket.socket(family, socket.SOCK_STREAM, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((self._host(family), port))
        sock.listen(1024)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, self._on_accept)
        return sock

    def _udp_socket(self, port: int, family: int = socket.AF_INET) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_DGRAM)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        sock.bind((self._host(family), port))
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, self._on_datagram)
        return sock

    # event handlers: each is called as handler(fileobj, events)

    def _on_wake(self, sock: socket.socket, _events: int) -> None:
        try:
            sock.recv(4096)
        except BlockingIOError:
            pass

    def _on_accept(self, listener: socket.socket, _events: int) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ECONNABORTED, EMFILE: skip this one, keep serving
                return
            sock.setblocking(False)
            proto = _proto_name(listener)
            if proto == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:  # SCTP_NODELAY: the same option number, at SCTP's level
                sock.setsockopt(socket.IPPROTO_SCTP, _SCTP_NODELAY, 1)
            local = sock.getsockname()
            conn = _Conn(sock, bytearray(reply_line(self.pod, format_addr(*local[:2]), format_addr(*peer[:2]), proto)))
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, self._on_conn)
            self._flush(conn)

    def _on_conn(self, sock: socket.socket, events: int) -> None:
        conn = self._conns.get(sock.fileno())
        if conn is None:
            return
        if events & selectors.EVENT_READ and not conn.eof:
            try:
                data = sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._drop(conn)
                return
            if data == b"":
                conn.eof = True
            elif data:
                conn.out += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what is pending, then re-arm the selector for what the connection needs next."""
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._drop(conn)
                return
        if conn.eof and not conn.out:
            self._drop(conn)
            return
        events = 0
        if not conn.eof and len(conn.out) < _OUTBUF_HIGH:
            events |= selectors.EVENT_READ
        if conn.out:
            events |= selectors.EVENT_WRITE
        self._sel.modify(conn.sock, events, self._on_conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _on_datagram(self, sock: socket.socket, _events: int) -> None:
        port = sock.getsockname()[1]
        for _ in range(_UDP_BATCH):
            try:
                data, ancdata, _flags, peer = sock.recvmsg(65535, socket.CMSG_SPACE(_PKTINFO6.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error queued on the socket by an earlier reply: ignore
                continue
            local_ip = self._pktinfo_dst(ancdata) or sock.getsockname()[0]
            reply = reply_line(self.pod, format_addr(local_ip, port), format_addr(*peer[:2]), "udp", data)
            # Answer from the address the request was sent to, whatever the routing would pick.
            if sock.family == socket.AF_INET6:
                cmsg = (socket.IPPROTO_IPV6, IPV6_PKTINFO, _PKTINFO6.pack(socket.inet_pton(socket.AF_INET6, local_ip), 0))
            else:
                cmsg = (socket.IPPROTO_IP, IP_PKTINFO, _PKTINFO.pack(0, socket.inet_aton(local_ip), bytes(4)))
            try:
                sock.sendmsg([reply], [cmsg], 0, peer)
            except OSError:  # unreachable peer, full buffer: a lost datagram, as UDP allows
                pass

    @staticmethod
    def _pktinfo_dst(ancdata: list[tuple[int, int, bytes]]) -> str | None:
        for level, kind, payload in ancdata:
            if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(payload) >= _PKTINFO.size:
                _ifindex, _spec_dst, addr = _PKTINFO.unpack_from(payload)
                return str(ipaddress.IPv4Address(addr))
            if level == socket.IPPROTO_IPV6 and kind == IPV6_PKTINFO and len(payload) >= _PKTINFO6.size:
                addr6, _ifindex = _PKTINFO6.unpack_from(payload)
                return str(ipaddress.IPv6Address(addr6))
        return None


def _proto_name(sock: socket.socket) -> str:
    """"tcp", "udp" or "sctp": the listen protocol a server socket serves."""
    if sock.type == socket.SOCK_DGRAM:
        return "udp"
    return "sctp" if sock.proto == socket.IPPROTO_SCTP else "tcp"


# --- command line ------------------------------------------------------------------------------


def write_ready_file(path: str, server: EchoServer) -> None:
    """Write path atomically (rename), so a reader never sees a half-written file."""
    listening = list(dict.fromkeys(f"{port}/{proto}" for _host, port, proto in server.addresses))
    body = {"pod": server.pod, "pid": os.getpid(), "listen": listening}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ebpf_proxy.lab.echo", description=__doc__.split("\n")[0])
    parser.add_argument("--pod", required=True, help="name reported in every reply")
    parser.add_argument("--listen", action="append", required=True, type=parse_listen, metavar="PORT[/tcp|udp|sctp]")
    parser.add_argument("--ready-file", help="written (atomically) once every socket is bound; removed on exit")
    parser.add_argument("--host", default="0.0.0.0", help="IPv4 address to bind (default: all)")
    parser.add_argument("--ipv6", action="store_true", help="serve on IPv6 (::) as well")
    parser.add_argument("--netns", help="enter this named netns first (when not started inside it)")
    args = parser.parse_args(argv)

    if args.netns:
        from ebpf_proxy.lab._setns import enter_netns

        enter_netns(args.netns)
    server = EchoServer(args.pod, args.listen, host=args.host, ipv6=args.ipv6)
    try:
        server.bind()
    except OSError as exc:
        print(f"echo[{args.pod}]: cannot bind: {exc}", file=sys.stderr)
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    try:
        if args.ready_file:
            write_ready_file(args.ready_file, server)
        server.serve_forever()
    finally:
        server.close()
        if args.ready_file:
            try:
                os.unlink(args.ready_file)
            except FileNotFoundError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
