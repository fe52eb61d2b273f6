"""The REST protocol, exercised with the official Kubernetes Python client."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

import pytest
from kubernetes import client, watch

from ebpf_proxy.apiserver import ApiServer, Store


@pytest.fixture
def store():
    s = Store(bookmark_interval=0.2)
    yield s
    s.close()


@pytest.fixture
def server(store):
    srv = ApiServer(store, ["127.0.0.1:0"]).start()
    yield srv
    srv.stop()


@pytest.fixture
def api(server):
    cfg = client.Configuration()
    cfg.host = server.url
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def core(api):
    return client.CoreV1Api(api)


@pytest.fixture
def disc(api):
    return client.DiscoveryV1Api(api)


def service(name, labels=None, **spec):
    spec.setdefault("ports", [{"port": 80}])
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def raw(server, path, method="GET", body=None, headers=None):
    req = urllib.request.Request(server.url + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def stream_events(server, path, limit, timeout=10):
    """Raw watch stream: the JSON events, one per line, as the server sent them."""
    events = []
    with urllib.request.urlopen(server.url + path, timeout=timeout) as resp:
        assert resp.status == 200
        for line in resp:
            if line.strip():
                events.append(json.loads(line))
            if len(events) >= limit:
                break
    return events


# --- CRUD -----------------------------------------------------------------------------------

def test_create_get_list_update_delete(core):
    created = core.create_namespaced_service("default", service("web", {"app": "web"}, selector={"app": "web"}))
    assert created.spec.cluster_ip and created.metadata.uid
    got = core.read_namespaced_service("web", "default")
    assert got.spec.ports[0].target_port == 80
    listed = core.list_namespaced_service("default")
    assert [s.metadata.name for s in listed.items] == ["web"]
    assert listed.metadata.resource_version == got.metadata.resource_version
    got.spec.session_affinity = "ClientIP"
    replaced = core.replace_namespaced_service("web", "default", got)
    assert replaced.spec.session_affinity == "ClientIP"
    assert int(replaced.metadata.resource_version) > int(got.metadata.resource_version)
    patched = core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"tier": "fe"}}})
    assert patched.metadata.labels == {"app": "web", "tier": "fe"}
    core.delete_namespaced_service("web", "default")
    assert core.list_namespaced_service("default").items == []


def test_list_response_shape(server, core):
    core.create_namespaced_service("default", service("web"))
    status, headers, body = raw(server, "/api/v1/services")
    doc = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert doc["kind"] == "ServiceList" and doc["apiVersion"] == "v1"
    assert doc["metadata"]["resourceVersion"]
    status, _, body = raw(server, "/apis/discovery.k8s.io/v1/endpointslices")
    assert json.loads(body)["kind"] == "EndpointSliceList"
    assert json.loads(body)["apiVersion"] == "discovery.k8s.io/v1"


def test_a_listed_object_is_what_get_returns_also_after_it_changed(server, store, core):
    """List items are sent from per-version encodings (Store.encoded): each must be the object
    as stored at its current version, never an older encoding."""
    for name in ("a", "b", "c"):
        core.create_namespaced_service("default", service(name, {"v": "1"}))

    def listed(query=""):
        status, _, body = raw(server, "/api/v1/namespaces/default/services" + query)
        assert status == 200
        return json.loads(body)

    first = listed()
    assert [o["metadata"]["name"] for o in first["items"]] == ["a", "b", "c"]
    assert first["items"][1] == store.get("Service", "default", "b")
    core.patch_namespaced_service("b", "default", {"metadata": {"labels": {"v": "2"}}})
    core.delete_namespaced_service("c", "default")
    again = listed()
    assert [o["metadata"]["labels"]["v"] for o in again["items"]] == ["1", "2"]
    assert again["items"] == [store.get("Service", "default", n) for n in ("a", "b")]
    page = listed("?limit=1")
    assert page["metadata"]["remainingItemCount"] == 1 and page["metadata"]["continue"]
    assert "remainingItemCount" not in listed("?limit=1&labelSelector=v%3D1")["metadata"]


def test_errors_are_status_objects(core):
    core.create_namespaced_service("default", service("web"))
    with pytest.raises(client.ApiException) as exc:
        core.create_namespaced_service("default", service("web"))
    status = json.loads(exc.value.body)
    assert exc.value.status == 409 and status["kind"] == "Status" and status["reason"] == "AlreadyExists"
    with pytest.raises(client.ApiException) as exc:
        core.read_namespaced_service("nope", "default")
    assert exc.value.status == 404 and json.loads(exc.value.body)["message"] == 'services "nope" not found'
    with pytest.raises(client.ApiException) as exc:
        core.create_namespaced_service("default", service("bad", clusterIP="10.200.0.1"))
    status = json.loads(exc.value.body)
    assert exc.value.status == 422 and status["details"]["causes"][0]["field"] == "spec.clusterIPs[0]"


def test_update_with_stale_resource_version_conflicts(core):
    created = core.create_namespaced_service("default", service("web"))
    core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"x": "1"}}})
    with pytest.raises(client.ApiException) as exc:
        core.replace_namespaced_service("web", "default", created)
    assert exc.value.status == 409 and json.loads(exc.value.body)["reason"] == "Conflict"


def test_label_and_field_selectors(core):
    core.create_namespaced_service("default", service("a", {"app": "a", "tier": "fe"}))
    core.create_namespaced_service("default", service("b", {"app": "b"}))
    names = lambda resp: [s.metadata.name for s in resp.items]  # noqa: E731
    assert names(core.list_namespaced_service("default", label_selector="app=a")) == ["a"]
    assert names(core.list_namespaced_service("default", label_selector="app notin (a)")) == ["b"]
    assert names(core.list_namespaced_service("default", label_selector="tier")) == ["a"]
    assert names(core.list_service_for_all_namespaces(field_selector="metadata.name=b")) == ["b"]
    assert names(core.list_service_for_all_namespaces(field_selector="metadata.namespace=kube-system")) == []
    with pytest.raises(client.ApiException) as exc:
        core.list_namespaced_service("default", field_selector="spec.nodeName=x")
    assert exc.value.status == 400


def test_nodes_are_cluster_scoped_and_field_selectable(core):
    core.create_node({"metadata": {"name": "n1"}})
    core.create_node({"metadata": {"name": "n2"}})
    assert [n.metadata.name for n in core.list_node(field_selector="metadata.name=n2").items] == ["n2"]
    assert core.read_node("n1").metadata.namespace is None


def test_pods_and_status_subresource(core):
    core.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    core.patch_namespaced_pod_status("p", "default", {"status": {"podIP": "10.0.0.7", "phase": "Running"}})
    assert core.read_namespaced_pod("p", "default").status.pod_ip == "10.0.0.7"


def test_endpoint_slices(disc):
    body = {"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}, "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}], "ports": [{"port": 8080}]}
    disc.create_namespaced_endpoint_slice("default", body)
    got = disc.list_namespaced_endpoint_slice("default", label_selector="kubernetes.io/service-name=web").items[0]
    assert got.ports[0].protocol == "TCP" and got.endpoints[0].addresses == ["10.0.0.1"]
    with pytest.raises(client.ApiException) as exc:
        disc.create_namespaced_endpoint_slice("default", {**body, "metadata": {"name": "bad"},
                                                          "endpoints": [{"addresses": ["not-ip"]}]})
    assert json.loads(exc.value.body)["details"]["causes"][0]["field"] == "endpoints[0].addresses[0]"


def test_namespaces_exist_and_can_be_read(core):
    names = {n.metadata.name for n in core.list_namespace().items}
    assert {"default", "kube-system"} <= names
    assert core.read_namespace("kube-system").status.phase == "Active"


def test_events_through_both_api_groups(server, api, core):
    events_v1 = client.EventsV1Api(api)
    created = events_v1.create_namespaced_event("default", {
        "metadata": {"generateName": "n1."}, "eventTime": "2024-01-01T00:00:00.000000Z",
        "reportingController": "ebpf-proxy", "reportingInstance": "ebpf-proxy-n1", "action": "Sync",
        "reason": "Synced", "type": "Normal", "note": "programmed 3 services", "regarding": {"kind": "Node", "name": "n1"},
    })
    name = created.metadata.name
    events_v1.patch_namespaced_event(name, "default", {"series": {"count": 2, "lastObservedTime": "2024-01-01T00:00:05.000000Z"}})
    legacy = core.read_namespaced_event(name, "default")
    assert legacy.message == "programmed 3 services" and legacy.involved_object.name == "n1"
    assert legacy.reporting_component == "ebpf-proxy" and legacy.series.count == 2
    core.create_namespaced_event("default", {"metadata": {"name": "old-style"}, "involvedObject": {"kind": "Node", "name": "n1"},
                                             "reason": "Started", "message": "hello", "type": "Normal"})
    # Read raw: like the real server, an old-style event has no eventTime, which this client's model requires.
    _, _, body = raw(server, "/apis/events.k8s.io/v1/namespaces/default/events/old-style")
    converted = json.loads(body)
    assert (converted["apiVersion"], converted["note"], converted["regarding"]["name"]) == ("events.k8s.io/v1", "hello", "n1")
    # Raw again: this client refuses to send an event without eventTime at all.
    status, _, body = raw(server, "/apis/events.k8s.io/v1/namespaces/default/events", "POST",
                          {"metadata": {"name": "bad"}, "reason": "x", "regarding": {}})
    assert status == 422
    fields = {c["field"] for c in json.loads(body)["details"]["causes"]}
    assert {"eventTime", "reportingController", "reportingInstance", "action"} <= fields


def test_unknown_fields_are_dropped_warned_or_rejected(server):
    body = {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80, "targetport": 8080}]}}
    status, _, text = raw(server, "/api/v1/namespaces/default/services?fieldValidation=Strict", "POST", body)
    assert status == 400 and 'unknown field \\"spec.ports[0].targetport\\"' in text.decode()
    status, headers, text = raw(server, "/api/v1/namespaces/default/services", "POST", body)
    assert status == 201 and "unknown field" in headers["Warning"]
    assert "targetport" not in json.loads(text)["spec"]["ports"][0]


def test_table_output_for_kubectl(server, core):
    core.create_namespaced_service("default", service("web", type="NodePort"))
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    status, _, body = raw(server, "/api/v1/namespaces/default/services", headers={"Accept": accept})
    table = json.loads(body)
    assert table["kind"] == "Table" and table["apiVersion"] == "meta.k8s.io/v1"
    assert [c["name"] for c in table["columnDefinitions"]][:5] == ["Name", "Type", "Cluster-IP", "External-IP", "Port(s)"]
    cells = table["rows"][0]["cells"]
    assert cells[0] == "web" and cells[1] == "NodePort" and cells[4].startswith("80:3")
    assert table["rows"][0]["object"]["metadata"]["namespace"] == "default"


def test_protobuf_only_clients_are_told_406(server):
    status, _, body = raw(server, "/api/v1/services", headers={"Accept": "application/vnd.kubernetes.protobuf"})
    assert status == 406 and json.loads(body)["reason"] == "NotAcceptable"


def test_pagination_with_limit_and_continue(core):
    for i in range(5):
        core.create_node({"metadata": {"name": f"n{i}"}})
    first = core.list_node(limit=2)
    assert len(first.items) == 2 and first.metadata._continue
    rest = core.list_node(limit=10, _continue=first.metadata._continue)
    assert [n.metadata.name for n in first.items + rest.items] == [f"n{i}" for i in range(5)]


# --- watch ----------------------------------------------------------------------------------

def test_watch_streams_events_in_order(core):
    rv = core.list_namespaced_service("default").metadata.resource_version
    got = []

    def writer():
        core.create_namespaced_service("default", service("a"))
        core.patch_namespaced_service("a", "default", {"metadata": {"labels": {"x": "1"}}})
        core.delete_namespaced_service("a", "default")

    threading.Thread(target=writer).start()
    w = watch.Watch()
    for event in w.stream(core.list_namespaced_service, "default", resource_version=rv, timeout_seconds=10):
        got.append((event["type"], event["object"].metadata.name, int(event["object"].metadata.resource_version)))
        if len(got) == 3:
            w.stop()
    assert [(t, n) for t, n, _ in got] == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    assert [r for _, _, r in got] == sorted(r for _, _, r in got)


def test_watch_resumes_from_a_resource_version(core):
    core.create_namespaced_service("default", service("a"))
    rv = core.list_namespaced_service("default").metadata.resource_version
    core.create_namespaced_service("default", service("b"))
    core.delete_namespaced_service("a", "default")
    events = list(watch.Watch().stream(core.list_namespaced_service, "default", resource_version=rv, timeout_seconds=1))
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "b"), ("DELETED", "a")]


def test_watch_bookmarks(core):
    rv = core.list_namespaced_service("default").metadata.resource_version
    w = watch.Watch()
    types = []
    for event in w.stream(core.list_namespaced_service, "default", resource_version=rv,
                          allow_watch_bookmarks=True, timeout_seconds=10):
        types.append(event["type"])
        if event["type"] == "BOOKMARK":
            assert event["raw_object"]["metadata"]["resourceVersion"] == rv
            assert event["raw_object"]["kind"] == "Service"
            w.stop()
    assert types == ["BOOKMARK"]


def test_watch_without_bookmarks_gets_none(server, core):
    rv = core.list_namespaced_service("default").metadata.resource_version
    status, _, body = raw(server, f"/api/v1/services?watch=true&resourceVersion={rv}&timeoutSeconds=1")
    assert status == 200 and body == b""


def test_watch_timeout_seconds_ends_the_stream(core):
    rv = core.list_namespaced_service("default").metadata.resource_version
    events = list(watch.Watch().stream(core.list_namespaced_service, "default", resource_version=rv, timeout_seconds=1))
    assert events == []


def test_watch_with_field_selector_of_one_node(server, core):
    core.create_node({"metadata": {"name": "n1"}})
    core.create_node({"metadata": {"name": "n2"}})
    events = stream_events(server, "/api/v1/nodes?watch=true&fieldSelector=metadata.name%3Dn2&timeoutSeconds=1", 5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "n2")]


def test_watch_gone_after_compact_is_an_error_event(server, store, core):
    rv = core.create_namespaced_service("default", service("a")).metadata.resource_version
    core.create_namespaced_service("default", service("b"))
    store.compact()
    events = stream_events(server, f"/api/v1/namespaces/default/services?watch=true&resourceVersion={rv}", 2)
    assert len(events) == 1
    assert events[0]["type"] == "ERROR"
    status = events[0]["object"]
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
    with pytest.raises(client.ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_service, "default", resource_version=rv, timeout_seconds=2))
    assert exc.value.status == 410


def test_list_gone_after_compact(server, store, core):
    rv = core.create_namespaced_service("default", service("a")).metadata.resource_version
    core.create_namespaced_service("default", service("b"))
    store.compact()
    with pytest.raises(client.ApiException) as exc:
        core.list_namespaced_service("default", resource_version=rv)
    assert exc.value.status == 410 and json.loads(exc.value.body)["reason"] == "Expired"


def test_send_initial_events_watch(server, core):
    core.create_namespaced_service("default", service("a"))
    events = stream_events(server, "/api/v1/services?watch=true&sendInitialEvents=true&allowWatchBookmarks=true"
                                   "&resourceVersionMatch=NotOlderThan&timeoutSeconds=5", 2)
    assert events[0]["type"] == "ADDED" and events[0]["object"]["metadata"]["name"] == "a"
    assert events[1]["type"] == "BOOKMARK"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


# --- discovery and lifecycle ---------------------------------------------------------------

def test_discovery_documents(api):
    assert client.VersionApi(api).get_code().major == "1"
    core_resources = {r.name: r for r in client.CoreV1Api(api).get_api_resources().resources}
    assert core_resources["services"].short_names == ["svc"] and core_resources["services"].namespaced
    assert core_resources["nodes"].short_names == ["no"] and not core_resources["nodes"].namespaced
    assert core_resources["pods"].short_names == ["po"]
    assert "watch" in core_resources["services"].verbs
    groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    assert {"discovery.k8s.io", "events.k8s.io"} <= groups
    slices = client.DiscoveryV1Api(api).get_api_resources().resources
    assert [r.kind for r in slices] == ["EndpointSlice"]


def test_serves_pre_bound_sockets_from_one_store(store):
    socks = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        socks.append(s)
    srv = ApiServer(store, socks).start()
    try:
        assert [a[1] for a in srv.addresses] == [s.getsockname()[1] for s in socks]
        store.create("Node", {"metadata": {"name": "n1"}})
        for _, port in srv.addresses:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nodes", timeout=5) as resp:
                assert [n["metadata"]["name"] for n in json.load(resp)["items"]] == ["n1"]
    finally:
        srv.stop()


def test_stop_ends_open_watches_and_closes_the_port(store):
    srv = ApiServer(store, ["127.0.0.1:0"]).start()
    port = srv.addresses[0][1]
    rv = store.resource_version
    resp = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nodes?watch=true&resourceVersion={rv}", timeout=10)
    srv.stop()
    assert resp.read() == b"", "the watch stream must end cleanly (final chunk), not hang or break"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not [t for t in threading.enumerate() if t.name.startswith(f"apiserver-{port}")]
