"""A small keep-alive JSON client for the lab's API server, for the bench's thousands of writes.

The bench installs up to tens of thousands of objects and times single writes; the official
client (KubeApi) costs a GET before each apply and a few milliseconds of its own per call. This
client does one HTTP/1.1 request per write on a persistent connection per thread, so a write
costs what the server takes, and several threads can write at once (`Rest.map`).

It speaks only what the bench needs: create, replace, get, list, delete (one or by label), and the
server's current resourceVersion.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from ebpf_proxy.lab.kubeapi import RESOURCES

T = TypeVar("T")
R = TypeVar("R")


def _quickack(conn: http.client.HTTPConnection) -> None:
    """ACK the response's first segment at once. A server that writes its headers and its body
    in two send()s (Python's http.server does) holds the body back under Nagle until the headers
    are ACKed, and a delayed ACK takes 40 ms: every request would cost 40 ms. Quick-ACK mode
    lasts a few segments only, so it is re-armed before each response."""
    if conn.sock is not None:
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


class RestError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")


def object_path(kind: str, namespace: str | None, name: str | None = None) -> str:
    prefix, namespaced, plural = RESOURCES[kind]
    path = prefix
    if namespaced:
        path += f"/namespaces/{quote(namespace or 'default')}"
    path += f"/{plural}"
    if name:
        path += f"/{quote(name)}"
    return path


class Rest:
    """JSON over HTTP/1.1 to `server_url` (http://host:port), one connection per calling thread."""

    def __init__(self, server_url: str, timeout: float = 30.0) -> None:
        parts = urlsplit(server_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"server url {server_url!r}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout = timeout
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()

    def request(self, method: str, path: str, body: Any = None, ok: Iterable[int] = (200, 201)) -> Any:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):  # a kept-alive connection the server closed meanwhile: reconnect once
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                _quickack(conn)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if attempt == 2:
                    raise
        if resp.status not in tuple(ok):
            raise RestError(method, path, resp.status, raw.decode(errors="replace"))
        return json.loads(raw) if raw else None

    # ---- objects ------------------------------------------------------------------------------
    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return self.request("POST", object_path(obj["kind"], meta.get("namespace")), obj)

    def replace(self, obj: dict) -> dict:
        """PUT without a resourceVersion: an unconditional update (the bench is the only writer)."""
        meta = obj["metadata"]
        return self.request("PUT", object_path(obj["kind"], meta.get("namespace"), meta["name"]), obj)

    def get(self, kind: str, name: str, namespace: str = "default") -> dict | None:
        try:
            return self.request("GET", object_path(kind, namespace, name))
        except RestError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str = "default", label_selector: str = "") -> list[dict]:
        path = object_path(kind, namespace)
        if label_selector:
            path += "?" + urlencode({"labelSelector": label_selector})
        return self.request("GET", path).get("items") or []

    def count_all(self, kind: str, label_selector: str = "", page: int = 500) -> int:
        """Objects of `kind` in every namespace, read as an agent lists them (pages of `page`,
        following `continue`): timing this is the API server's own share of an agent's start."""
        prefix, _namespaced, plural = RESOURCES[kind]
        query = {"limit": str(page), **({"labelSelector": label_selector} if label_selector else {})}
        count = 0
        while True:
            doc = self.request("GET", f"{prefix}/{plural}?{urlencode(query)}")
            count += len(doc.get("items") or ())
            token = (doc.get("metadata") or {}).get("continue")
            if not token:
                return count
            query["continue"] = token

    def delete(self, kind: str, name: str, namespace: str = "default") -> bool:
        try:
            self.request("DELETE", object_path(kind, namespace, name), ok=(200, 202))
            return True
        except RestError as exc:
            if exc.status == 404:
                return False
            raise

    def delete_by_label(self, kind: str, label_selector: str, namespace: str = "default") -> None:
        path = object_path(kind, namespace) + "?" + urlencode({"labelSelector": label_selector})
        self.request("DELETE", path, ok=(200, 202))

    def resource_version(self) -> int:
        """The server's current resourceVersion; the lab's server numbers every change from one counter."""
        doc = self.request("GET", object_path("Node", None) + "?limit=1")
        return int(doc["metadata"]["resourceVersion"])

    # ---- many at once -----------------------------------------------------------------------------
    def map(self, fn: Callable[[T], R], items: Iterable[T], threads: int = 4) -> list[R]:
        """fn(item) for each item, on `threads` threads (each with its own connection), in order."""
        items = list(items)
        if threads <= 1 or len(items) < 2:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-rest") as pool:
            return list(pool.map(fn, items))
