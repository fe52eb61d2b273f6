"""The lab's manifest client (`lab apply` / `lab delete`) against the embedded API server."""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import ApiServer, Store
from ebpf_proxy.lab.kubeapi import KubeApi, ManifestError, load_manifests, namespaces_last

MANIFEST = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: team-a}
spec: {ports: [{port: 80}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-a, labels: {team: a}}
"""


@pytest.fixture
def api():
    store = Store()
    srv = ApiServer(store, ["127.0.0.1:0"]).start()
    client = KubeApi(srv.url)
    yield client, store
    client.close()
    srv.stop()
    store.close()


def test_namespaces_are_applied_first_and_deleted_last():
    docs = load_manifests(MANIFEST, "m.yaml")
    assert [d["kind"] for d in docs] == ["Namespace", "Service"]
    assert [d["kind"] for d in namespaces_last(docs)] == ["Service", "Namespace"]


def test_unknown_kind_names_the_document():
    with pytest.raises(ManifestError, match=r"m.yaml\[0\].kind: 'Deployment' is not one of \['EndpointSlice', 'Namespace'"):
        load_manifests("kind: Deployment\nmetadata: {name: x}\n", "m.yaml")


def test_apply_namespace_and_a_service_in_it_twice(api):
    client, store = api
    for _ in range(2):  # the second pass updates in place
        for doc in load_manifests(MANIFEST, "m.yaml"):
            client.apply(doc)
    assert store.get("Namespace", None, "team-a")["metadata"]["labels"]["team"] == "a"
    assert store.get("Service", "team-a", "web")["spec"]["clusterIP"]
    for doc in namespaces_last(load_manifests(MANIFEST, "m.yaml")):
        assert client.delete(doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace"))
    assert client.get("Namespace", "team-a", None) is None
