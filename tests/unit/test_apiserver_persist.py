"""The API server's state file: objects survive a restart, versions keep increasing, the old
instance's versions are 410 Expired (so clients relist), and a bad file is named precisely."""

from __future__ import annotations

import json

import pytest

from ebpf_proxy.apiserver import ApiError, Store
from ebpf_proxy.apiserver import persist


def svc(name: str, **spec) -> dict:
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"ports": [{"name": "http", "port": 80}], "selector": {"app": name}, **spec}}


def test_round_trip_keeps_objects_and_versions_increase(tmp_path):
    path = tmp_path / "state.json"
    old = Store()
    a = old.create("Service", svc("a", type="NodePort"))
    old.create("Service", svc("b"))
    old.delete("Service", "default", "b")
    persist.save(old, path)
    old_rv = int(old.resource_version)
    old.close()

    new = persist.load_store(path)
    try:
        restored = new.get("Service", "default", "a")
        assert restored == a, "uid, clusterIP, nodePort, resourceVersion: all as saved"
        with pytest.raises(ApiError) as gone:
            new.get("Service", "default", "b")
        assert gone.value.code == 404
        assert int(new.resource_version) > old_rv
        assert {n["metadata"]["name"] for n in new.list("Namespace")[0]} >= {"default", "kube-system"}
        # the allocations came back with the objects: a's clusterIP and nodePort are taken
        port = a["spec"]["ports"][0]["nodePort"]
        with pytest.raises(ApiError) as taken:
            new.create("Service", svc("c", type="NodePort", clusterIP=a["spec"]["clusterIP"],
                                      ports=[{"port": 80, "nodePort": port}]))
        assert taken.value.code == 422
        assert "spec.clusterIP" in taken.value.message and "already allocated" in taken.value.message
        assert "spec.ports[0].nodePort" in taken.value.message
        created = new.create("Service", svc("d"))
        assert int(created["metadata"]["resourceVersion"]) > old_rv
    finally:
        new.close()


def test_a_save_is_the_state_document_byte_for_byte_from_the_kept_encodings(tmp_path):
    """persist.save joins the objects' kept JSON (Store.encoded) instead of encoding them again:
    the file is json.dumps of the state document exactly, and an object changed since its bytes
    were kept is written as it is now."""
    path = tmp_path / "state.json"
    store = Store()
    try:
        store.create("Service", svc("a"))
        b = store.create("Service", svc("b", type="NodePort"))
        for obj in store.list("Service")[0]:
            store.encoded("Service", obj)  # kept, as a list keeps them
        b["metadata"]["labels"] = {"changed": "yes"}
        store.update("Service", b)
        rv = persist.save(store, path)
        assert rv == store.resource_version
        text = path.read_bytes()
        rv_now, objects = store.export_objects()
        document = {"apiVersion": persist.API_VERSION, "kind": persist.KIND, "resourceVersion": rv_now, "objects": objects}
        assert text == json.dumps(document, separators=(",", ":")).encode()
        saved = {o["metadata"]["name"]: o for o in json.loads(text)["objects"] if o["kind"] == "Service"}
        assert saved["b"]["metadata"]["labels"] == {"changed": "yes"}
    finally:
        store.close()


def test_watch_from_a_version_of_the_old_instance_is_410_expired(tmp_path):
    """What kube-apiserver answers a watch whose resourceVersion is older than its watch cache
    (etcd compacted, or a restore): 410 with reason Expired. client-go's Reflector relists on it."""
    path = tmp_path / "state.json"
    old = Store()
    old.create("Service", svc("a"))
    resume_from = old.resource_version
    persist.save(old, path)
    old.close()

    new = persist.load_store(path)
    try:
        with pytest.raises(ApiError) as exc:
            new.watch("Service", resource_version=resume_from)
        assert exc.value.code == 410 and exc.value.reason == "Expired"
        assert exc.value.message.startswith(f"too old resource version: {resume_from} (")
        # a fresh list and a watch from its version work as usual
        items, rv = new.list("Service")
        assert [i["metadata"]["name"] for i in items] == ["a"]
        watcher = new.watch("Service", resource_version=rv)
        watcher.stop()
    finally:
        new.close()


def test_versions_stay_above_the_saved_one_even_if_the_clock_is_behind(tmp_path):
    path = tmp_path / "state.json"
    far_future = 10 ** 15  # the clock-based start (ms since 1970) is far below this
    old = Store(initial_resource_version=far_future)
    old.create("Service", svc("a"))
    persist.save(old, path)
    saved = int(old.resource_version)
    old.close()
    new = persist.load_store(path)
    try:
        assert int(new.compacted_resource_version) > saved, "a resume from the saved version must be 410"
        assert int(new.create("Service", svc("b"))["metadata"]["resourceVersion"]) > saved
    finally:
        new.close()


def test_edited_state_file_is_what_the_server_starts_with(tmp_path):
    """A restore from backup: objects removed from the file while the server was down are gone."""
    path = tmp_path / "state.json"
    old = Store()
    for name in ("keep", "drop"):
        old.create("Service", svc(name))
    persist.save(old, path)
    old.close()
    doc = json.loads(path.read_text())
    doc["objects"] = [o for o in doc["objects"] if o["metadata"]["name"] != "drop"]
    path.write_text(json.dumps(doc))
    new = persist.open_store(path)
    try:
        assert [i["metadata"]["name"] for i in new.list("Service")[0]] == ["keep"]
    finally:
        new.close()


def test_open_store_without_a_file_is_a_new_store(tmp_path):
    store = persist.open_store(tmp_path / "missing.json")
    try:
        assert store.list("Service")[0] == []
    finally:
        store.close()


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ('{"apiVersion": "v1", "kind": "ApiServerState", "resourceVersion": "1", "objects": []}', "apiVersion: expected"),
    ('{"apiVersion": "ebpf-proxy.lab/v1", "kind": "ApiServerState", "resourceVersion": "x", "objects": []}',
     "resourceVersion: 'x' is not a non-negative integer"),
    ('{"apiVersion": "ebpf-proxy.lab/v1", "kind": "ApiServerState", "resourceVersion": "1", "objects": {}}',
     "objects: expected a list, got dict"),
    ('{"apiVersion": "ebpf-proxy.lab/v1", "kind": "ApiServerState", "resourceVersion": "1", '
     '"objects": [{"kind": "Secret", "metadata": {"name": "s"}}]}', "objects[0]: not a stored object"),
    ('{"apiVersion": "ebpf-proxy.lab/v1", "kind": "ApiServerState", "resourceVersion": "1", "objects": ['
     '{"kind": "Service", "metadata": {"name": "a", "namespace": "default"}, "spec": {"clusterIP": "10.96.0.9"}},'
     '{"kind": "Service", "metadata": {"name": "b", "namespace": "default"}, "spec": {"clusterIP": "10.96.0.9"}}]}',
     "objects[1] (Service default/b): spec.clusterIPs[0]: Invalid value: \"10.96.0.9\": provided IP is already allocated"),
])
def test_bad_state_files_are_named(tmp_path, text, message):
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(persist.StateFileError) as exc:
        persist.load_store(path)
    assert str(exc.value).startswith(f"{path}: ")
    assert message in str(exc.value)


def test_saver_writes_after_changes_and_at_stop(tmp_path):
    path = tmp_path / "state.json"
    store = Store()
    saver = persist.StateSaver(store, path, interval=3600).start()  # the thread never fires in this test
    try:
        assert persist.read(path)[1], "the start writes the initial state"
        assert not saver.save_if_changed(), "nothing changed: no write"
        store.create("Service", svc("a"))
    finally:
        saver.stop()
        store.close()
    rv, objects = persist.read(path)
    assert rv == int(store.resource_version)
    assert "a" in {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    assert not list(tmp_path.glob("*.tmp.*")), "no temporary file left behind"


def test_a_reflector_relists_against_a_server_restarted_from_an_edited_state(tmp_path):
    """The whole path over HTTP with the official client: the agent's Service list-watch is
    connected, the server goes down, comes back from a state file without "b" and with "c", and
    the watch's 410 makes the Reflector relist and deliver exactly that difference."""
    from ebpf_proxy.apiserver import ApiServer
    from ebpf_proxy.k8s.client import agent_collections, make_api_client
    from ebpf_proxy.k8s.watch import Backoff, Reflector
    from tests.unit.test_watch_apiserver import Cache, wait_for

    path = tmp_path / "state.json"
    store = Store()
    for name in ("a", "b"):
        store.create("Service", svc(name))
    server = ApiServer(store).start()
    host, port = server.addresses[0]
    cache = Cache()
    reflector = Reflector(agent_collections(make_api_client(master=server.url), "n1")["Service"], cache,
                          backoff=Backoff(initial=0.05, cap=0.2))
    reflector.start()
    restarted = None
    try:
        wait_for(lambda: cache.names() == {"a", "b"}, "the initial list")
        server.stop()
        store.delete("Service", "default", "b")
        store.create("Service", svc("c"))
        persist.save(store, path)
        store.close()
        restored = persist.load_store(path)
        restarted = ApiServer(restored, [f"{host}:{port}"]).start()
        wait_for(lambda: cache.names() == {"a", "c"}, "the relist after the restart")
        assert cache.deletes == ["b"]
        assert reflector.lists == 2, "one relist, caused by 410 Expired"
    finally:
        reflector.stop()
        if restarted is not None:
            restarted.stop()
            restarted.store.close()
