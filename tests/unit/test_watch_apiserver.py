"""The watch and the agent against the embedded API server: the real list/watch protocol over HTTP,
through the official kubernetes client (no root: everything on 127.0.0.1).

Waiting here is polling for a condition with a generous limit (a watch is asynchronous by
nature); no test asserts how long anything took.
"""

from __future__ import annotations

import threading
import time

import pytest
from ebpf_proxy.agent.agent import EXIT_OK, Agent
from ebpf_proxy.agent.config import load_config
from ebpf_proxy.apiserver import ApiServer, Store
from ebpf_proxy.datapath.fake import FakeDatapath
from ebpf_proxy.k8s.client import PROXY_LABEL_SELECTOR, CollectionGet, KubeListWatch, agent_collections, make_api_client
from ebpf_proxy.k8s.watch import Backoff, Handler, Reflector
from ebpf_proxy.model import Protocol, ServicePortName


def wait_for(predicate, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def svc(name: str, port: int = 80, **labels) -> dict:
    return {"metadata": {"name": name, "namespace": "default", "labels": labels},
            "spec": {"ports": [{"name": "http", "port": port}], "selector": {"app": name}}}


def eps(name: str, service: str, *ips: str, node: str = "n2") -> dict:
    return {"metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "endpoints": [{"addresses": [ip], "nodeName": node} for ip in ips],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


class Cache(Handler):
    """What a handler sees, as a dict name → resourceVersion."""

    def __init__(self) -> None:
        self.objects: dict[str, str] = {}
        self.deletes: list[str] = []
        self.lock = threading.Lock()

    def on_add(self, obj):
        with self.lock:
            self.objects[obj["metadata"]["name"]] = obj["metadata"]["resourceVersion"]

    def on_update(self, old, new):
        self.on_add(new)

    def on_delete(self, obj):
        with self.lock:
            self.objects.pop(obj["metadata"]["name"], None)
            self.deletes.append(obj["metadata"]["name"])

    def names(self) -> set[str]:
        with self.lock:
            return set(self.objects)


@pytest.fixture
def apiserver():
    store = Store()
    server = ApiServer(store).start()
    try:
        yield store, server
    finally:
        server.stop()
        store.close()


def test_list_watch_paginates_and_follows_changes(apiserver):
    store, server = apiserver
    for i in range(5):
        store.create("Service", svc(f"s{i}"))
    store.create("Service", svc("other-proxy", **{"service.kubernetes.io/service-proxy-name": "foo"}))
    services = CollectionGet(make_api_client(master=server.url), "/api/v1/services")  # as the agent's
    pages = []

    def list_services(**kwargs):
        if not kwargs.get("watch"):
            pages.append(kwargs.get("_continue"))
        return services(**kwargs)

    lw = KubeListWatch("Service", list_services, label_selector=PROXY_LABEL_SELECTOR, page_size=2)
    items, rv = lw.list()
    assert sorted(i["metadata"]["name"] for i in items) == ["s0", "s1", "s2", "s3", "s4"]  # selector honoured
    assert len(items) == 5 and list(items) == list(items), "pages decode again on every pass, the same"
    assert len(pages) == 3 and pages[0] is None and all(pages[1:])  # 2 + 2 + 1, with continue tokens

    cache = Cache()
    reflector = Reflector(lw, cache)
    reflector.start()
    try:
        wait_for(lambda: cache.names() == {"s0", "s1", "s2", "s3", "s4"}, "the initial list")
        store.create("Service", svc("s5"))
        store.delete("Service", "default", "s0")
        wait_for(lambda: cache.names() == {"s1", "s2", "s3", "s4", "s5"}, "watch events")
    finally:
        reflector.stop()


def test_compacted_history_relists_after_a_reconnect(apiserver):
    """The API server goes away; meanwhile history is compacted and an object deleted. On reconnect
    the watch gets 410 Gone, the reflector relists and delivers the delete."""
    store, server = apiserver
    for name in ("a", "b", "c"):
        store.create("Service", svc(name))
    host, port = server.addresses[0]
    api = make_api_client(master=server.url)
    cache = Cache()
    reflector = Reflector(agent_collections(api, "n1")["Service"], cache, backoff=Backoff(initial=0.05, cap=0.2))
    reflector.start()
    try:
        wait_for(lambda: cache.names() == {"a", "b", "c"}, "the initial list")
        server.stop()
        store.delete("Service", "default", "b")
        store.create("Service", svc("d"))
        store.compact()
        restarted = ApiServer(store, [f"{host}:{port}"]).start()
        try:
            wait_for(lambda: cache.names() == {"a", "c", "d"}, "the relist after 410")
            assert cache.deletes == ["b"]
            assert reflector.lists >= 2
        finally:
            reflector.stop()
            restarted.stop()
    finally:
        reflector.stop()


def test_agent_against_the_api_server(apiserver):
    store, server = apiserver
    store.create("Node", {"metadata": {"name": "n1"},
                          "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.10"}]}})
    web = store.create("Service", svc("web"))
    store.create("EndpointSlice", eps("web-a", "web", "10.244.1.5", node="n1"))
    created: list[FakeDatapath] = []

    def factory(mode, node, **opts):
        created.append(FakeDatapath(node))
        return created[-1]

    config = load_config({"hostname_override": "n1", "master": server.url, "mode": "iptables",
                          "min_sync_period": "0s", "metrics_bind_address": "", "healthz_bind_address": ""})
    agent = Agent(config, datapath_factory=factory, local_addresses=lambda: ["192.168.1.10"])
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", agent.run()), daemon=True)
    thread.start()
    name = ServicePortName("default", "web", "http", Protocol.TCP)
    api = ServicePortName("default", "api", "http", Protocol.TCP)
    try:
        wait_for(lambda: created and created[0].last_state and name in created[0].last_state.endpoints,
                 "the first sync")
        dp = created[0]
        state = dp.last_state
        assert state.services[name].cluster_ip == web["spec"]["clusterIP"]
        assert [(e.ip, e.is_local) for e in state.endpoints_of(name)] == [("10.244.1.5", True)]

        store.create("Service", svc("api", 8080))
        store.create("EndpointSlice", eps("api-a", "api", "10.244.2.7", "10.244.2.8"))
        store.delete("EndpointSlice", "default", "web-a")
        wait_for(lambda: api in dp.last_state.endpoints and name not in dp.last_state.endpoints,
                 "the watched changes")
        assert [e.ip for e in dp.last_state.endpoints_of(api)] == ["10.244.2.7", "10.244.2.8"]
        assert not dp.syncs[-1][1].full
    finally:
        agent.stop()
        thread.join(timeout=30)
    assert result["code"] == EXIT_OK and created[0].cleanups == 0
