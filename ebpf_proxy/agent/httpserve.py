"""A small HTTP server in a daemon thread: the base of /metrics, /healthz and health-check NodePorts.

The agent serves a handful of tiny GET endpoints; the standard library is enough, and one shared
base keeps bind-address parsing, IPv6, thread handling and shutdown in one place.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

# (status, content type, body, extra headers)
Response = tuple[int, str, bytes, dict[str, str]]


def split_host_port(address: str) -> tuple[str, int]:
    """"0.0.0.0:10256" / "[::]:10256" → (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _Handler(BaseHTTPRequestHandler):
    server: "BackgroundHTTPServer"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        status, ctype, body, headers = self.server.respond(self.path.split("?", 1)[0])
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (probes every few seconds are not news)
        return


class BackgroundHTTPServer(ThreadingHTTPServer):
    """Answers GET requests with `respond(path) -> Response`, from a daemon thread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, respond: Callable[[str], Response], name: str = "http") -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self.respond = respond
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)

    def server_bind(self) -> None:
        # http.server's version resolves the host's FQDN (a reverse DNS lookup) just to fill
        # server_name: on a node whose resolver is unreachable that blocks start-up for seconds.
        if self.address_family == socket.AF_INET6:
            # IPv6 only, whatever net.ipv6.bindv6only says: a dual-stack node binds "::" beside
            # "0.0.0.0" on the same port, one server per family, as kube-proxy's per-family proxiers
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> "BackgroundHTTPServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.shutdown()
        self.server_close()
