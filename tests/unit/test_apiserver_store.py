"""The Store in-process: CRUD semantics, resourceVersions, watches, history and 410s."""

from __future__ import annotations

import threading
import time

import pytest

from ebpf_proxy.apiserver import ApiError, Store


@pytest.fixture
def store():
    s = Store(bookmark_interval=0.2)
    yield s
    s.close()


def svc(name, labels=None, **spec):
    spec.setdefault("ports", [{"port": 80}])
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def pod(name, labels=None, ip=None, ns="default"):
    body = {"metadata": {"name": name, "namespace": ns, "labels": labels or {}},
            "spec": {"containers": [{"name": "c"}]}}
    if ip:
        body["status"] = {"podIP": ip}
    return body


def drain(watcher, n, timeout=5.0):
    events, deadline = [], time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        ev = watcher.get(0.1)
        if ev is not None:
            events.append(ev)
    return events


# --- CRUD -----------------------------------------------------------------------------------

def test_create_sets_server_fields_and_get_returns_a_copy(store):
    created = store.create("Service", svc("web"))
    meta = created["metadata"]
    assert meta["namespace"] == "default"
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    assert int(meta["resourceVersion"]) == int(store.resource_version)
    assert created["apiVersion"] == "v1" and created["kind"] == "Service"
    got = store.get("Service", "default", "web")
    got["spec"]["ports"] = []
    assert store.get("Service", "default", "web")["spec"]["ports"], "get must not hand out the stored object"


def test_resource_versions_are_one_global_counter(store):
    a = int(store.create("Service", svc("a"))["metadata"]["resourceVersion"])
    b = int(store.create("Node", {"metadata": {"name": "n1"}})["metadata"]["resourceVersion"])
    c = int(store.create("Pod", pod("p"))["metadata"]["resourceVersion"])
    assert a < b < c == int(store.resource_version)


def test_generate_name(store):
    created = store.create("Pod", {"metadata": {"generateName": "web-"}, "spec": {"containers": [{"name": "c"}]}})
    name = created["metadata"]["name"]
    assert name.startswith("web-") and len(name) == len("web-") + 5


def test_errors_name_the_object_and_field(store):
    store.create("Service", svc("web"))
    with pytest.raises(ApiError) as exc:
        store.create("Service", svc("web"))
    assert (exc.value.code, exc.value.reason) == (409, "AlreadyExists")
    assert 'services "web" already exists' in exc.value.message

    with pytest.raises(ApiError) as exc:
        store.get("Service", "default", "nope")
    assert (exc.value.code, exc.value.reason) == (404, "NotFound")
    assert exc.value.message == 'services "nope" not found'

    with pytest.raises(ApiError) as exc:
        store.create("Service", svc("Bad_Name"))
    assert exc.value.code == 422
    assert exc.value.details["causes"][0]["field"] == "metadata.name"

    with pytest.raises(ApiError) as exc:
        store.create("Pod", pod("p", ns="missing"))
    assert exc.value.code == 404 and 'namespaces "missing" not found' in exc.value.message


def test_update_conflict_on_stale_resource_version(store):
    created = store.create("Service", svc("web"))
    store.patch("Service", "default", "web", {"metadata": {"labels": {"x": "1"}}})
    created["metadata"]["labels"] = {"y": "2"}
    with pytest.raises(ApiError) as exc:
        store.update("Service", created)
    assert exc.value.code == 409 and exc.value.reason == "Conflict"


def test_update_bumps_generation_only_for_spec_changes(store):
    store.create("Service", svc("web"))
    labelled = store.patch("Service", "default", "web", {"metadata": {"labels": {"x": "1"}}})
    assert labelled["metadata"]["generation"] == 1
    changed = store.patch("Service", "default", "web", {"spec": {"sessionAffinity": "ClientIP"}})
    assert changed["metadata"]["generation"] == 2


def test_noop_update_does_not_bump_the_resource_version(store):
    created = store.create("Service", svc("web"))
    again = store.update("Service", created)
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


def test_status_is_only_written_through_the_status_subresource(store):
    store.create("Pod", pod("p", ip="10.0.0.5"))
    current = store.get("Pod", "default", "p")
    current["status"]["podIP"] = "10.0.0.6"
    assert store.update("Pod", current)["status"]["podIP"] == "10.0.0.5"
    assert store.update_status("Pod", current)["status"]["podIP"] == "10.0.0.6"
    patched = store.patch("Pod", "default", "p", {"status": {"phase": "Running"}}, subresource="status")
    assert patched["status"]["phase"] == "Running"


def test_delete_returns_the_object_and_it_is_gone(store):
    store.create("Service", svc("web"))
    deleted = store.delete("Service", "default", "web")
    assert deleted["metadata"]["name"] == "web"
    with pytest.raises(ApiError):
        store.get("Service", "default", "web")


def test_delete_precondition_uid(store):
    store.create("Node", {"metadata": {"name": "n1"}})
    with pytest.raises(ApiError) as exc:
        store.delete("Node", None, "n1", uid="not-the-uid")
    assert exc.value.code == 409


def test_graceful_pod_deletion_marks_then_removes(store):
    store.create("Pod", pod("p", ip="10.0.0.5"))
    marked = store.delete("Pod", "default", "p", grace_period_seconds=30)
    assert marked["metadata"]["deletionTimestamp"]
    assert store.get("Pod", "default", "p")["metadata"]["deletionGracePeriodSeconds"] == 30
    store.delete("Pod", "default", "p", grace_period_seconds=0)
    with pytest.raises(ApiError):
        store.get("Pod", "default", "p")


def test_graceful_pod_deletion_finishes_when_the_grace_period_ends(store):
    store.create("Pod", pod("p"))
    store.delete("Pod", "default", "p", grace_period_seconds=1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            store.get("Pod", "default", "p")
        except ApiError:
            return
        time.sleep(0.05)
    pytest.fail("pod was not removed after its grace period")


def test_finalizers_hold_deletion_until_removed(store):
    store.create("Node", {"metadata": {"name": "n1", "finalizers": ["lab/hold"]}})
    store.delete("Node", None, "n1")
    assert store.get("Node", None, "n1")["metadata"]["deletionTimestamp"]
    store.patch("Node", None, "n1", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiError):
        store.get("Node", None, "n1")


def test_namespace_deletion_cascades_and_default_is_protected(store):
    store.create("Namespace", {"metadata": {"name": "team"}})
    store.create("Service", svc("web"), namespace="team")
    store.delete("Namespace", None, "team")
    assert store.list("Service", "team")[0] == []
    with pytest.raises(ApiError) as exc:
        store.delete("Namespace", None, "default")
    assert exc.value.code == 403


def test_default_namespaces_exist(store):
    names = [n["metadata"]["name"] for n in store.list("Namespace")[0]]
    assert {"default", "kube-system"} <= set(names)


# --- list -----------------------------------------------------------------------------------

def test_list_filters_by_namespace_and_selectors(store):
    store.create("Namespace", {"metadata": {"name": "other"}})
    store.create("Service", svc("a", {"app": "a", "tier": "fe"}))
    store.create("Service", svc("b", {"app": "b"}))
    store.create("Service", svc("c", {"app": "a"}), namespace="other")
    names = lambda items: [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items]  # noqa: E731
    assert names(store.list("Service")[0]) == [("default", "a"), ("default", "b"), ("other", "c")]
    assert names(store.list("Service", "default")[0]) == [("default", "a"), ("default", "b")]
    assert names(store.list("Service", label_selector="app=a")[0]) == [("default", "a"), ("other", "c")]
    assert names(store.list("Service", label_selector="app in (a,b),!tier")[0]) == [("default", "b"), ("other", "c")]
    assert names(store.list("Service", field_selector="metadata.name=b")[0]) == [("default", "b")]
    assert names(store.list("Service", field_selector="metadata.namespace!=default")[0]) == [("other", "c")]


def test_list_pages_are_a_consistent_snapshot(store):
    for i in range(5):
        store.create("Node", {"metadata": {"name": f"n{i}"}})
    first = store.list_page("Node", limit=2)
    assert [n["metadata"]["name"] for n in first.items] == ["n0", "n1"]
    assert first.continue_token and first.remaining == 3
    store.delete("Node", None, "n3")
    store.create("Node", {"metadata": {"name": "n9"}})
    second = store.list_page("Node", limit=10, continue_token=first.continue_token)
    assert [n["metadata"]["name"] for n in second.items] == ["n2", "n3", "n4"]
    assert second.resource_version == first.resource_version and not second.continue_token


def _all_pages(store, kind, limit, **kwargs):
    pages = [store.list_page(kind, limit=limit, **kwargs)]
    while pages[-1].continue_token:
        pages.append(store.list_page(kind, limit=limit, continue_token=pages[-1].continue_token, **kwargs))
    return pages


def test_pages_within_a_namespace_and_with_selectors_cover_exactly_the_matches(store):
    store.create("Namespace", {"metadata": {"name": "a"}})
    store.create("Namespace", {"metadata": {"name": "ab"}})  # sorts right after "a": the range must stop
    for ns in ("a", "ab", "default"):
        for i in range(7):
            store.create("Service", {"metadata": {"name": f"s{i}", "namespace": ns, "labels": {"odd": str(i % 2)}},
                                     "spec": {"ports": [{"port": 80}]}})
    pages = _all_pages(store, "Service", 3, namespace="a")
    assert [[o["metadata"]["name"] for o in p.items] for p in pages] == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]
    assert [p.remaining for p in pages] == [4, 1, None]  # exact without selectors
    odd = _all_pages(store, "Service", 2, label_selector="odd=1")
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for p in odd for o in p.items] == \
        [(ns, f"s{i}") for ns in ("a", "ab", "default") for i in (1, 3, 5)]
    assert all(p.remaining is None for p in odd)  # unknown with a selector, as kube-apiserver omits it
    assert len(_all_pages(store, "Service", 1000)[0].items) == 21


def test_a_list_after_a_change_sees_the_new_keys(store):
    for name in ("b", "d"):
        store.create("Node", {"metadata": {"name": name}})
    assert [n["metadata"]["name"] for n in store.list_page("Node").items] == ["b", "d"]
    store.create("Node", {"metadata": {"name": "a"}})
    store.create("Node", {"metadata": {"name": "c"}})
    store.delete("Node", None, "d")
    assert [n["metadata"]["name"] for n in store.list_page("Node").items] == ["a", "b", "c"]
    first = store.list_page("Node", limit=2)
    store.create("Node", {"metadata": {"name": "bb"}})  # after the snapshot: not in its pages
    rest = store.list_page("Node", limit=2, continue_token=first.continue_token)
    assert [n["metadata"]["name"] for n in first.items + rest.items] == ["a", "b", "c"]


def test_exact_list_reconstructs_an_old_state(store):
    store.create("Node", {"metadata": {"name": "n1", "labels": {"v": "1"}}})
    rv = store.resource_version
    store.patch("Node", None, "n1", {"metadata": {"labels": {"v": "2"}}})
    store.create("Node", {"metadata": {"name": "n2"}})
    items, list_rv = store.list("Node", resource_version=rv, resource_version_match="Exact")
    assert list_rv == rv
    assert [(n["metadata"]["name"], n["metadata"]["labels"]["v"]) for n in items] == [("n1", "1")]


def test_list_with_a_compacted_resource_version_is_gone(store):
    rv = store.create("Node", {"metadata": {"name": "n1"}})["metadata"]["resourceVersion"]
    store.create("Node", {"metadata": {"name": "n2"}})
    store.compact()
    for kwargs in ({}, {"resource_version_match": "Exact"}):
        with pytest.raises(ApiError) as exc:
            store.list("Node", resource_version=rv, **kwargs)
        assert (exc.value.code, exc.value.reason) == (410, "Expired")
    assert len(store.list("Node", resource_version=rv, resource_version_match="NotOlderThan")[0]) == 2


def test_history_limit_compacts_on_its_own():
    s = Store(history_limit=3)
    try:
        rv = s.create("Node", {"metadata": {"name": "n0"}})["metadata"]["resourceVersion"]
        for i in range(1, 5):
            s.create("Node", {"metadata": {"name": f"n{i}"}})
        with pytest.raises(ApiError) as exc:
            s.watch("Node", resource_version=rv)
        assert exc.value.code == 410
    finally:
        s.close()


# --- watch ----------------------------------------------------------------------------------

def test_watch_from_now_sees_changes_in_order(store):
    with store.watch("Service", resource_version=store.resource_version) as w:
        store.create("Service", svc("a"))
        store.patch("Service", "default", "a", {"metadata": {"labels": {"x": "1"}}})
        store.delete("Service", "default", "a")
        events = drain(w, 3)
    assert [e.type for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    rvs = [e.resource_version for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    assert events[2].object["metadata"]["resourceVersion"] == str(rvs[2])


def test_watch_without_resource_version_starts_with_the_current_state(store):
    store.create("Service", svc("a"))
    store.create("Service", svc("b"))
    with store.watch("Service") as w:
        events = drain(w, 2)
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [("ADDED", "a"), ("ADDED", "b")]


def test_watch_resumes_from_a_resource_version(store):
    store.create("Service", svc("a"))
    rv = store.resource_version
    store.create("Service", svc("b"))
    store.delete("Service", "default", "a")
    with store.watch("Service", resource_version=rv) as w:
        events = drain(w, 2)
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("DELETED", "a")]


def test_watch_from_a_compacted_version_is_gone(store):
    rv = store.create("Service", svc("a"))["metadata"]["resourceVersion"]
    store.create("Service", svc("b"))
    store.compact()
    with pytest.raises(ApiError) as exc:
        store.watch("Service", resource_version=rv)
    assert (exc.value.code, exc.value.reason) == (410, "Expired")
    assert "too old resource version" in exc.value.message
    store.watch("Service", resource_version=store.resource_version).stop()


def test_watch_from_a_future_version_is_refused(store):
    with pytest.raises(ApiError) as exc:
        store.watch("Service", resource_version=int(store.resource_version) + 10)
    assert exc.value.code == 504 and "Too large resource version" in exc.value.message


def test_a_restarted_store_sends_clients_with_old_versions_to_relist():
    old = Store()
    rv = old.create("Node", {"metadata": {"name": "n1"}})["metadata"]["resourceVersion"]
    old.close()
    time.sleep(0.01)
    new = Store()
    try:
        with pytest.raises(ApiError) as exc:
            new.watch("Node", resource_version=rv)
        assert exc.value.code == 410
    finally:
        new.close()


def test_watch_bookmarks_carry_the_current_version(store):
    with store.watch("Service", resource_version=store.resource_version, allow_bookmarks=True) as w:
        store.create("Service", svc("a"))
        events = drain(w, 3)
    assert events[0].type == "ADDED"
    bookmarks = [e for e in events if e.type == "BOOKMARK"]
    assert bookmarks, "no BOOKMARK within the bound"
    assert bookmarks[0].object["metadata"]["resourceVersion"] == store.resource_version


def test_send_initial_events_ends_with_an_annotated_bookmark(store):
    store.create("Service", svc("a"))
    with store.watch("Service", send_initial_events=True, allow_bookmarks=True) as w:
        events = drain(w, 2)
    assert events[0].type == "ADDED"
    assert events[1].type == "BOOKMARK"
    assert events[1].object["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_label_selected_watch_sees_objects_enter_and_leave(store):
    store.create("Service", svc("a", {"app": "x"}))
    with store.watch("Service", resource_version=store.resource_version, label_selector="app=y") as w:
        store.patch("Service", "default", "a", {"metadata": {"labels": {"app": "y"}}})
        store.patch("Service", "default", "a", {"metadata": {"labels": {"team": "t"}}})
        store.patch("Service", "default", "a", {"metadata": {"labels": {"app": "z"}}})
        events = drain(w, 3)
    assert [e.type for e in events] == ["ADDED", "MODIFIED", "DELETED"]


def test_field_selected_watch_of_one_node(store):
    with store.watch("Node", resource_version=store.resource_version, field_selector="metadata.name=n2") as w:
        store.create("Node", {"metadata": {"name": "n1"}})
        store.create("Node", {"metadata": {"name": "n2"}})
        events = drain(w, 1)
        assert w.get(0.2) is None
    assert [e.object["metadata"]["name"] for e in events] == ["n2"]


def test_multi_kind_watch_for_controllers(store):
    with store.watch(("Service", "Pod"), send_initial_events=False) as w:
        store.create("Pod", pod("p"))
        store.create("Node", {"metadata": {"name": "n1"}})
        store.create("Service", svc("a"))
        events = drain(w, 2)
    assert [(e.kind, e.type) for e in events] == [("Pod", "ADDED"), ("Service", "ADDED")]


def test_concurrent_writers_get_distinct_versions(store):
    def writer(i):
        for j in range(20):
            store.create("Node", {"metadata": {"name": f"n{i}-{j}"}})

    with store.watch("Node", resource_version=store.resource_version) as w:
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = drain(w, 80)
    rvs = [e.resource_version for e in events]
    assert len(rvs) == 80 and rvs == sorted(rvs) and len(set(rvs)) == 80


def test_slow_watcher_is_dropped_not_unbounded():
    s = Store(watch_queue_limit=5)
    try:
        w = s.watch("Node", resource_version=s.resource_version)
        for i in range(10):
            s.create("Node", {"metadata": {"name": f"n{i}"}})
        assert len(drain(w, 10, timeout=0.5)) == 5
        assert w.stopped and "behind" in w.stop_reason
    finally:
        s.close()


def test_close_stops_watchers():
    s = Store()
    w = s.watch("Node", resource_version=s.resource_version)
    s.close()
    assert w.get(1.0) is None and w.stopped
