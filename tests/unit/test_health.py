"""agent/health.py: /healthz and /livez staleness (fake clock), health-check NodePorts (kube-proxy's format)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from ebpf_proxy.agent.health import ProxierHealth, ServiceHealthServers, healthz_server, service_health_response
from ebpf_proxy.agent.httpserve import BackgroundHTTPServer

START = 1714557600.0  # 2024-05-01T10:00:00Z


class WallClock:
    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        return self.t


def make(timeout: float = 60.0):
    clock = WallClock()
    probes: list[tuple[str, int]] = []
    return ProxierHealth(timeout, clock=clock, on_probe=lambda e, s: probes.append((e, s))), clock, probes


def body(response) -> dict:
    return json.loads(response[2])


def test_not_healthy_before_the_first_sync_but_live():
    health, clock, probes = make()
    status, ctype, raw, headers = health.healthz()
    assert status == 503 and ctype == "application/json" and headers["X-Content-Type-Options"] == "nosniff"
    assert json.loads(raw) == {"lastUpdated": "0001-01-01T00:00:00Z", "currentTime": "2024-05-01T10:00:00Z",
                               "nodeEligible": True}
    assert health.livez()[0] == 200  # kube-proxy: live while starting up
    assert probes == [("healthz", 503), ("livez", 200)]


def test_healthy_after_a_sync():
    health, clock, _ = make()
    health.queued_update()
    clock.t += 5
    health.updated()
    clock.t += 1
    status, _, raw, _ = health.healthz()
    assert status == 200
    assert json.loads(raw) == {"lastUpdated": "2024-05-01T10:00:05Z", "currentTime": "2024-05-01T10:00:06Z",
                               "nodeEligible": True}
    assert json.loads(health.livez()[2]) == {"lastUpdated": "2024-05-01T10:00:05Z",
                                             "currentTime": "2024-05-01T10:00:06Z"}


def test_a_queued_update_not_programmed_within_the_timeout_is_unhealthy():
    health, clock, _ = make(timeout=60)
    health.updated()
    clock.t += 100
    health.queued_update()
    clock.t += 30
    assert health.healthz()[0] == 503  # the last sync is 130s old: syncs are not happening
    health.updated()
    health.queued_update()
    clock.t += 59
    assert health.healthz()[0] == 200  # pending, but not late yet
    clock.t += 2
    assert health.healthz()[0] == 503 and health.livez()[0] == 503
    health.updated()
    assert health.healthz()[0] == 200


def test_a_later_change_does_not_reset_the_oldest_pending_one():
    health, clock, _ = make(timeout=60)
    health.updated()
    health.queued_update()
    for _ in range(7):
        clock.t += 10
        health.queued_update()
    assert health.healthz()[0] == 503


def test_syncs_that_keep_failing_make_it_unhealthy_without_changes():
    health, clock, _ = make(timeout=60)
    health.updated()
    clock.t += 60
    assert health.healthz()[0] == 200
    clock.t += 1
    assert health.healthz()[0] == 503


def test_node_being_deleted_fails_healthz_not_livez():
    health, clock, _ = make()
    health.updated()
    health.sync_node(False)
    status, _, raw, _ = health.healthz()
    assert status == 503 and json.loads(raw)["nodeEligible"] is False
    assert health.livez()[0] == 200
    health.sync_node(True)
    assert health.healthz()[0] == 200


def test_unknown_path_is_404():
    health, _, _ = make()
    assert health.respond("/metrics")[0] == 404


def test_healthz_over_http():
    health, _, _ = make()
    server = healthz_server("127.0.0.1:0", health).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/healthz", timeout=10)
        assert err.value.code == 503
        health.updated()
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:
            assert resp.status == 200 and json.load(resp)["nodeEligible"] is True
        with urllib.request.urlopen(f"{url}/livez", timeout=10) as resp:
            assert resp.status == 200
    finally:
        server.stop()


# ---- health-check NodePorts -----------------------------------------------------------------------


def test_service_health_response_format():
    status, ctype, raw, headers = service_health_response(("default", "web"), 2, True)
    assert status == 200 and ctype == "application/json"
    assert json.loads(raw) == {"service": {"namespace": "default", "name": "web"}, "localEndpoints": 2,
                               "serviceProxyHealthy": True}
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"


@pytest.mark.parametrize("count,healthy,expected", [(0, True, 503), (1, True, 200), (3, False, 503)])
def test_service_health_status(count, healthy, expected):
    assert service_health_response(("ns", "svc"), count, healthy)[0] == expected


class FakeServer:
    """Records what ServiceHealthServers opens; `busy` ports fail to bind like a taken port."""

    busy: set[int] = set()
    opened: list["FakeServer"] = []

    def __init__(self, host, port, respond, name=""):
        if port in self.busy:
            raise OSError(98, "Address already in use")
        self.host, self.port, self.respond, self.stopped = host, port, respond, False
        FakeServer.opened.append(self)

    def start(self):
        return self

    def stop(self):
        self.stopped = True


@pytest.fixture
def fake_servers():
    FakeServer.busy, FakeServer.opened = set(), []
    return FakeServer


def live(fake_servers):
    return {(s.host, s.port) for s in fake_servers.opened if not s.stopped}


def test_servers_follow_services(fake_servers):
    hc = ServiceHealthServers(hosts=("192.168.1.10", "10.0.0.1"), server_factory=fake_servers)
    hc.sync_services({("default", "web"): 32000, ("default", "api"): 32001})
    assert live(fake_servers) == {("192.168.1.10", 32000), ("10.0.0.1", 32000),
                                  ("192.168.1.10", 32001), ("10.0.0.1", 32001)}
    hc.sync_services({("default", "web"): 32002})  # api gone, web moved to another port
    assert live(fake_servers) == {("192.168.1.10", 32002), ("10.0.0.1", 32002)}
    assert hc.ports() == {("default", "web"): 32002}
    hc.close()
    assert live(fake_servers) == set()


def test_counts_reach_the_right_server(fake_servers):
    hc = ServiceHealthServers(server_factory=fake_servers)
    hc.sync_services({("default", "web"): 32000, ("default", "api"): 32001})
    hc.sync_endpoints({("default", "web"): 2, ("default", "other"): 5})
    web = next(s for s in fake_servers.opened if s.port == 32000)
    api = next(s for s in fake_servers.opened if s.port == 32001)
    assert web.respond("/")[0] == 200 and json.loads(web.respond("/")[2])["localEndpoints"] == 2
    assert api.respond("/")[0] == 503 and json.loads(api.respond("/")[2])["localEndpoints"] == 0


def test_unhealthy_proxy_fails_every_health_check(fake_servers):
    healthy = [True]
    hc = ServiceHealthServers(proxy_healthy=lambda: healthy[0], server_factory=fake_servers)
    hc.sync_services({("default", "web"): 32000})
    hc.sync_endpoints({("default", "web"): 1})
    healthy[0] = False
    (server,) = fake_servers.opened
    status, _, raw, _ = server.respond("/")
    assert status == 503 and json.loads(raw)["serviceProxyHealthy"] is False


def test_a_taken_port_is_retried_at_the_next_sync(fake_servers):
    fake_servers.busy = {32000}
    hc = ServiceHealthServers(server_factory=fake_servers)
    hc.sync_services({("default", "web"): 32000})
    assert hc.ports() == {}
    fake_servers.busy = set()
    hc.sync_services({("default", "web"): 32000})
    assert hc.ports() == {("default", "web"): 32000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_check_node_port_over_http():
    hc = ServiceHealthServers(hosts=("127.0.0.1",), server_factory=BackgroundHTTPServer)
    port = _free_port()
    hc.sync_services({("default", "web"): port})
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert err.value.code == 503 and json.load(err.value)["localEndpoints"] == 0
        hc.sync_endpoints({("default", "web"): 1})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            assert resp.status == 200
            assert json.load(resp) == {"service": {"namespace": "default", "name": "web"}, "localEndpoints": 1,
                                       "serviceProxyHealthy": True}
    finally:
        hc.close()
    with pytest.raises(OSError):  # closed with the service
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
