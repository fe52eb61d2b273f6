"""A hung watch is detected: an API server that keeps the connection open and says nothing (frozen,
overloaded) makes the watch fail after the idle timeout, once, and the Reflector reconnects from
the same resourceVersion after a backoff, without relisting. No root: a silent server on 127.0.0.1."""

from __future__ import annotations

import socket
import threading

import pytest
from ebpf_proxy.k8s.client import CollectionGet, KubeListWatch, WatchIdleTimeout, make_api_client
from ebpf_proxy.k8s.watch import Backoff
from tests.unit.test_watch import Advance, bookmark, ev, run
from tests.unit.kobjects import service

IDLE = 0.3


class SilentServer:
    """Accepts connections and reads requests; answers each with `preamble` (maybe nothing), then
    keeps the connection open without another byte, like a SIGSTOPped API server."""

    def __init__(self, preamble: bytes = b"") -> None:
        self.preamble = preamble
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            self._conns.append(conn)
            request = conn.recv(65536)
            self.requests.append(request)
            if self.preamble:
                conn.sendall(self.preamble)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._conns:
            conn.close()
        self._sock.close()


@pytest.fixture
def lw_for():
    servers: list[SilentServer] = []

    def make(preamble: bytes = b"") -> tuple[SilentServer, KubeListWatch]:
        server = SilentServer(preamble)
        servers.append(server)
        services = CollectionGet(make_api_client(master=server.url), "/api/v1/services")  # as the agent's
        return server, KubeListWatch("Service", services, idle_timeout=IDLE)

    yield make
    for server in servers:
        server.close()


def test_no_answer_at_all_is_an_idle_timeout_and_the_request_is_not_resent(lw_for):
    server, lw = lw_for()
    with pytest.raises(WatchIdleTimeout) as exc:
        lw.watch("42")
    assert str(exc.value) == f"Service watch: no answer within {IDLE:g}s: the connection is hung"
    # urllib3 would by default re-send a timed-out GET 3 times: 4 idle timeouts before anyone notices
    assert len(server.requests) == 1
    assert b"watch=true" in server.requests[0] and b"resourceVersion=42" in server.requests[0]
    assert b"timeoutSeconds=" in server.requests[0], "the server is asked to end the watch too, as client-go does"


def test_a_stream_that_goes_silent_is_an_idle_timeout_after_what_it_delivered(lw_for):
    line = b'{"type":"BOOKMARK","object":{"kind":"Service","metadata":{"resourceVersion":"43"}}}\n'
    chunk = f"{len(line):x}\r\n".encode() + line + b"\r\n"
    headers = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, lw = lw_for(headers + chunk)
    stream = lw.watch("42")
    try:
        assert next(stream)["object"]["metadata"]["resourceVersion"] == "43"
        with pytest.raises(WatchIdleTimeout) as exc:
            next(stream)
        assert str(exc.value) == f"Service watch: no event or bookmark within {IDLE:g}s: the connection is hung"
    finally:
        stream.close()


def test_reflector_reconnects_a_hung_watch_from_its_version_without_relisting():
    """client-go's Reflector on a watch error that is not 410: back off, re-watch from the last RV."""
    hung = WatchIdleTimeout("Service watch: no event or bookmark within 5s: the connection is hung")
    reflector, fake, rec, waits = run(
        lists=[([service("a", rv="5")], "10")],
        watches=[[bookmark("11"), hung], hung, [ev("ADDED", "b", "12"), Advance(300)]],
    )
    assert fake.list_calls == 1 and reflector.lists == 1, "a hung watch is no reason to relist"
    assert fake.watch_rvs[:3] == ["10", "11", "11"]
    assert waits == [0.8, 1.6], "backoff between the reconnects, growing while nothing comes"
    assert ("add", "b", "12") in rec.events


def test_the_first_event_after_an_outage_resets_the_backoff():
    """Otherwise the next outage would start at the long waits the last one ended with."""
    refused = ConnectionRefusedError("connection refused")
    reflector, fake, rec, waits = run(
        lists=[([service("a", rv="5")], "10")],
        watches=[refused, refused, refused, [bookmark("11"), refused], refused],
    )
    assert waits == [0.8, 1.6, 3.2, 0.8, 1.6]


def test_backoff_cap_is_what_the_agent_is_given():
    backoff = Backoff(cap=1.0, rng=lambda: 0.5)
    assert [backoff.next() for _ in range(4)] == [0.8, 1.0, 1.0, 1.0]


def test_the_agent_hands_its_settings_to_every_watch(monkeypatch):
    """--watch-idle-timeout reaches each list-watch, --watch-backoff-max each Reflector's backoff;
    the Reflectors share one `turn`, so their first lists are handed on in turns."""
    from ebpf_proxy.agent.agent import Agent
    from ebpf_proxy.agent.config import load_config
    from ebpf_proxy.k8s import client as k8s_client

    config = load_config({"hostname_override": "n1", "watch_idle_timeout": "7s", "watch_backoff_max": "2s",
                          "master": "http://127.0.0.1:1"})
    agent = Agent(config, serve_http=False)
    monkeypatch.setattr("ebpf_proxy.k8s.watch.Reflector.start", lambda self: None)  # no thread, no connection
    agent.start_watches()
    assert sorted(r.kind for r in agent.reflectors) == ["EndpointSlice", "Node", "Service"]
    assert {r.lw.idle_timeout for r in agent.reflectors} == {7.0}
    assert {r.backoff.cap for r in agent.reflectors} == {2.0}
    assert len({id(r._turn) for r in agent.reflectors}) == 1
    assert {lw.idle_timeout for lw in k8s_client.agent_collections(make_api_client(master="http://x"), "n1").values()} \
        == {k8s_client.WATCH_IDLE_TIMEOUT_SECONDS}
