"""Health, as kube-proxy reports it: the proxier's /healthz and /livez, and health-check NodePorts.

/healthz and /livez (--healthz-bind-address): kube-proxy's ProxierHealthServer. The proxier is
unhealthy when an update has been queued for longer than `timeout` (2 × --sync-period, as
kube-proxy) without being programmed, or when the last successful sync is older than that (syncs
keep failing). /healthz also needs the node to be eligible (not being deleted), and, unlike
kube-proxy, at least one successful sync: a load balancer or the lab must not send traffic to a
node whose rules are not programmed yet. /livez is kube-proxy's: healthy while starting up.

Health-check NodePorts (SEMANTICS rule 14): for each eTP=Local LoadBalancer service, an HTTP server
on its healthCheckNodePort answers 200 when the node has at least one ready local endpoint and
503 otherwise, so the cloud load balancer only sends traffic to nodes that will not drop it. The
body is kube-proxy's service_health.go JSON.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from typing import Callable, Mapping

from ebpf_proxy.agent.httpserve import BackgroundHTTPServer, Response, split_host_port

log = logging.getLogger(__name__)

JSON = "application/json"
_HEADERS = {"X-Content-Type-Options": "nosniff"}
_ZERO_TIME = "0001-01-01T00:00:00Z"  # Go's zero time, which kube-proxy prints before the first sync

ServiceKey = tuple[str, str]  # (namespace, name)


def _rfc3339(epoch: float | None) -> str:
    if epoch is None:
        return _ZERO_TIME
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc).isoformat().replace("+00:00", "Z")


class ProxierHealth:
    """kube-proxy's ProxierHealthServer state; `clock` is wall time (it is printed)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.time,
                 on_probe: Callable[[str, int], None] | None = None) -> None:
        self.timeout = timeout
        self.clock = clock
        self._on_probe = on_probe  # (endpoint, status) for the healthz/livez counters
        self._lock = threading.Lock()
        self._last_updated: float | None = None
        self._oldest_queued: float | None = None
        self._node_eligible = True

    synced_resource_version: Callable[[], str] | None = None

    def queued_update(self) -> None:
        """A change is waiting to be programmed (kube-proxy's QueuedUpdate)."""
        with self._lock:
            if self._oldest_queued is None:
                self._oldest_queued = self.clock()

    def updated(self) -> None:
        """A sync succeeded: everything queued so far is programmed."""
        with self._lock:
            self._last_updated = self.clock()
            self._oldest_queued = None

    def sync_node(self, eligible: bool) -> None:
        with self._lock:
            self._node_eligible = eligible

    def _stale(self, now: float) -> bool:
        if self._oldest_queued is not None and now - self._oldest_queued > self.timeout:
            return True
        return self._last_updated is not None and now - self._last_updated > self.timeout

    def live(self) -> bool:
        with self._lock:
            return not self._stale(self.clock())

    def healthy(self) -> bool:
        with self._lock:
            return self._healthy(self.clock())

    def _healthy(self, now: float) -> bool:
        return self._last_updated is not None and not self._stale(now) and self._node_eligible

    def healthz(self) -> Response:
        with self._lock:
            now = self.clock()
            ok = self._healthy(now)
            doc = {"lastUpdated": _rfc3339(self._last_updated), "currentTime": _rfc3339(now),
                   "nodeEligible": self._node_eligible}
        if self.synced_resource_version is not None:
            # Ours, beside kube-proxy's fields: the API resourceVersion up to which the datapath is
            # programmed, so a test or the lab can wait for "this change is in the kernel".
            doc["syncedResourceVersion"] = self.synced_resource_version()
        return self._answer("healthz", ok, doc)

    def livez(self) -> Response:
        with self._lock:
            now = self.clock()
            ok = not self._stale(now)
            doc = {"lastUpdated": _rfc3339(self._last_updated), "currentTime": _rfc3339(now)}
        return self._answer("livez", ok, doc)

    def _answer(self, endpoint: str, ok: bool, doc: dict) -> Response:
        status = 200 if ok else 503
        if self._on_probe is not None:
            self._on_probe(endpoint, status)
        return status, JSON, json.dumps(doc).encode(), dict(_HEADERS)

    def respond(self, path: str) -> Response:
        if path == "/healthz":
            return self.healthz()
        if path == "/livez":
            return self.livez()
        return 404, "text/plain; charset=utf-8", b"404 page not found\n", {}


def healthz_server(address: str, health: ProxierHealth) -> BackgroundHTTPServer:
    """/healthz and /livez on `address` (host:port), not started yet."""
    host, port = split_host_port(address)
    return BackgroundHTTPServer(host, port, health.respond, name="healthz-http")


def service_health_response(key: ServiceKey, local_endpoints: int, proxy_healthy: bool) -> Response:
    """kube-proxy's service_health.go answer for one health-check NodePort."""
    namespace, name = key
    body = json.dumps({
        "service": {"namespace": namespace, "name": name},
        "localEndpoints": local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    }, indent="\t")
    status = 200 if local_endpoints > 0 and proxy_healthy else 503
    headers = dict(_HEADERS, **{"X-Load-Balancing-Endpoint-Weight": str(local_endpoints)})
    return status, JSON, body.encode(), headers


class ServiceHealthServers:
    """One HTTP server per (health-check NodePort, listen address), opened and closed as services
    come and go (kube-proxy's ServiceHealthServer.SyncServices / SyncEndpoints)."""

    def __init__(self, hosts: tuple[str, ...] = ("0.0.0.0",), proxy_healthy: Callable[[], bool] = lambda: True,
                 server_factory: Callable[..., BackgroundHTTPServer] = BackgroundHTTPServer) -> None:
        self.hosts = hosts
        self._proxy_healthy = proxy_healthy
        self._factory = server_factory
        self._lock = threading.Lock()
        self._ports: dict[ServiceKey, int] = {}
        self._servers: dict[ServiceKey, list[BackgroundHTTPServer]] = {}
        self._counts: dict[ServiceKey, int] = {}

    def sync_services(self, ports: Mapping[ServiceKey, int]) -> None:
        """The services that need a health-check NodePort now, and their ports."""
        wanted = {key: port for key, port in ports.items() if port > 0}
        with self._lock:
            for key in [k for k, port in self._ports.items() if wanted.get(k) != port]:
                self._close(key)
            for key, port in wanted.items():
                if key not in self._servers:
                    self._open(key, port)

    def sync_endpoints(self, counts: Mapping[ServiceKey, int]) -> None:
        """Ready local endpoints per service; services without a server are ignored."""
        with self._lock:
            self._counts = {key: counts.get(key, 0) for key in self._ports}

    def respond(self, key: ServiceKey, path: str) -> Response:
        with self._lock:
            count = self._counts.get(key, 0)
        return service_health_response(key, count, self._proxy_healthy())

    def ports(self) -> dict[ServiceKey, int]:
        with self._lock:
            return {key: port for key, port in self._ports.items() if key in self._servers}

    def close(self) -> None:
        with self._lock:
            for key in list(self._ports):
                self._close(key)

    def _open(self, key: ServiceKey, port: int) -> None:
        servers = []
        try:
            for host in self.hosts:
                servers.append(self._factory(host, port, lambda path, key=key: self.respond(key, path),
                                             name=f"healthcheck-{port}").start())
        except OSError as exc:
            # Retried at the next sync: the port may be freed meanwhile (kube-proxy does the same).
            log.error("cannot open health-check NodePort %d for %s/%s: %s", port, *key, exc,
                      extra={"object": f"{key[0]}/{key[1]}", "field": "spec.healthCheckNodePort", "port": port})
            for server in servers:
                server.stop()
            return
        self._ports[key] = port
        self._servers[key] = servers
        self._counts.setdefault(key, 0)
        log.info("opened health-check NodePort %d for %s/%s", port, *key,
                 extra={"object": f"{key[0]}/{key[1]}", "port": port})

    def _close(self, key: ServiceKey) -> None:
        port = self._ports.pop(key, None)
        for server in self._servers.pop(key, []):
            server.stop()
        self._counts.pop(key, None)
        log.info("closed health-check NodePort %s for %s/%s", port, *key,
                 extra={"object": f"{key[0]}/{key[1]}", "port": port})
