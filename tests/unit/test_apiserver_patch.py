"""PATCH bodies: merge patch, strategic merge patch (with merge keys and directives), JSON patch."""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import ApiError
from ebpf_proxy.apiserver.patch import apply, json_patch, merge_patch, strategic_merge_patch

SVC = {
    "metadata": {"name": "web", "labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
    "spec": {
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}, {"name": "https", "port": 443, "targetPort": 8443}],
        "externalIPs": ["1.1.1.1", "2.2.2.2"],
    },
}


def test_merge_patch_replaces_lists_and_null_deletes():
    out = merge_patch(SVC, {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"ports": [{"port": 81}]}})
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["ports"] == [{"port": 81}]
    assert SVC["metadata"]["labels"] == {"a": "1", "b": "2"}, "the target must not be modified"


def test_strategic_merge_merges_service_ports_by_port():
    out = strategic_merge_patch(SVC, {"spec": {"ports": [{"port": 80, "targetPort": 9090}]}}, "Service")
    assert out["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 9090},
                                    {"name": "https", "port": 443, "targetPort": 8443}]


def test_strategic_merge_directives():
    patch = {
        "$setElementOrder/ports": [{"port": 443}, {"port": 80}],
        "ports": [{"port": 80, "$patch": "delete"}, {"port": 8080, "name": "alt"}],
        "$retainKeys": ["ports"],
    }
    out = strategic_merge_patch(SVC, {"spec": patch}, "Service")
    assert [p["port"] for p in out["spec"]["ports"]] == [443, 8080]
    assert "externalIPs" not in out["spec"]


def test_strategic_merge_replaces_lists_without_a_merge_key():
    out = strategic_merge_patch(SVC, {"spec": {"externalIPs": ["3.3.3.3"]}}, "Service")
    assert out["spec"]["externalIPs"] == ["3.3.3.3"]


def test_strategic_merge_unions_finalizers_and_deletes_from_primitive_lists():
    out = strategic_merge_patch(SVC, {"metadata": {"finalizers": ["y"]}}, "Service")
    assert out["metadata"]["finalizers"] == ["x", "y"]
    out = strategic_merge_patch(SVC, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}}, "Service")
    assert out["metadata"]["finalizers"] == []


def test_strategic_merge_pod_conditions_by_type():
    pod = {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}]}}
    out = strategic_merge_patch(pod, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, "Pod")
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}]


def test_strategic_merge_element_without_merge_key_is_a_400():
    with pytest.raises(ApiError) as exc:
        strategic_merge_patch(SVC, {"spec": {"ports": [{"targetPort": 1}]}}, "Service")
    assert exc.value.code == 400 and "spec.ports" in exc.value.message


def test_json_patch_operations():
    ops = [
        {"op": "replace", "path": "/spec/ports/0/targetPort", "value": 1},
        {"op": "add", "path": "/metadata/labels/c~1d", "value": "x"},
        {"op": "remove", "path": "/spec/externalIPs/0"},
        {"op": "test", "path": "/metadata/name", "value": "web"},
        {"op": "copy", "from": "/metadata/name", "path": "/metadata/generateName"},
        {"op": "move", "from": "/metadata/finalizers", "path": "/metadata/kept"},
    ]
    out = json_patch(SVC, ops)
    assert out["spec"]["ports"][0]["targetPort"] == 1
    assert out["metadata"]["labels"]["c/d"] == "x"
    assert out["spec"]["externalIPs"] == ["2.2.2.2"]
    assert out["metadata"]["generateName"] == "web"
    assert out["metadata"]["kept"] == ["x"] and "finalizers" not in out["metadata"]


def test_json_patch_failed_test_is_422():
    with pytest.raises(ApiError) as exc:
        json_patch(SVC, [{"op": "test", "path": "/metadata/name", "value": "other"}])
    assert exc.value.code == 422


def test_apply_dispatches_on_content_type_and_refuses_server_side_apply():
    assert apply("application/merge-patch+json", SVC, {"spec": {"ports": []}})["spec"]["ports"] == []
    with pytest.raises(ApiError) as exc:
        apply("application/apply-patch+yaml", SVC, {})
    assert exc.value.code == 415
    with pytest.raises(ApiError) as exc:
        apply("text/plain", SVC, {})
    assert exc.value.code == 415
