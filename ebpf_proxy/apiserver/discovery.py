"""Discovery and OpenAPI documents: what kubectl and client libraries read before any request.

kubectl maps `svc` to `/api/v1/namespaces/default/services` from the APIResourceList
documents served here. Before `kubectl create`, it asks OpenAPI v3 whether the target
accepts the `fieldValidation` query parameter; when it does, kubectl leaves validation to the
server instead of downloading the full schema, so a small OpenAPI v3 document that lists our
paths and that parameter (no schemas) is what lets `kubectl create -f` work without
`--validate=false`.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from ebpf_proxy.apiserver.kinds import GROUPS, RESOURCES, ResourceType, resources_in

SERVER_VERSION = {
    "major": "1",
    "minor": "34",
    "gitVersion": "v1.34.0-ebpf-proxy-lab",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def version() -> dict[str, Any]:
    return dict(SERVER_VERSION)


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _group(name: str) -> dict[str, Any]:
    versions = [{"groupVersion": f"{name}/{v}", "version": v} for v in GROUPS[name]]
    return {"name": name, "versions": versions, "preferredVersion": versions[0]}


def api_group_list() -> dict[str, Any]:
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g) for g in GROUPS]}


def api_group(name: str) -> dict[str, Any] | None:
    if name not in GROUPS:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name)}


def _storage_version_hash(rt: ResourceType) -> str:
    digest = hashlib.sha256(f"{rt.group}/{rt.version}/{rt.kind}".encode()).digest()
    return base64.b64encode(digest[:8]).decode()


def api_resource_list(group: str, version: str) -> dict[str, Any] | None:
    types = resources_in(group, version)
    if not types:
        return None
    resources: list[dict[str, Any]] = []
    for rt in types:
        entry: dict[str, Any] = {
            "name": rt.plural,
            "singularName": rt.singular,
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": list(rt.verbs),
            "storageVersionHash": _storage_version_hash(rt),
        }
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        if rt.categories:
            entry["categories"] = list(rt.categories)
        resources.append(entry)
        if rt.status_subresource:
            resources.append(
                {"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                 "kind": rt.kind, "verbs": ["get", "patch", "update"]}
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


# ---------------------------------------------------------------------------------------
# OpenAPI v3


def _group_versions() -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for rt in RESOURCES:
        if (rt.group, rt.version) not in seen:
            seen.append((rt.group, rt.version))
    return seen


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _query(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "description": description, "schema": {"type": "string"}, "uniqueItems": True}


_WRITE_PARAMS = [
    _query("dryRun", "When present, indicates that modifications should not be persisted."),
    _query("fieldManager", "A name associated with the actor or entity that is making these changes."),
    _query(
        "fieldValidation",
        "Accepted values: Ignore (drop unknown fields), Warn (drop them with a Warning header, the default), "
        "Strict (reject the request).",
    ),
]


def _op(rt: ResourceType, action: str, params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": f"{action}{rt.kind}",
        "responses": {"200": {"description": "OK"}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": rt.group, "version": rt.version, "kind": rt.kind},
    }
    if params:
        op["parameters"] = params
    return op


def openapi_v3_doc(group: str, version: str) -> dict[str, Any] | None:
    types = resources_in(group, version)
    if not types:
        return None
    paths: dict[str, Any] = {}
    for rt in types:
        collections = [rt.collection_path("{namespace}")] if rt.namespaced else [rt.collection_path()]
        if rt.namespaced:
            paths[rt.collection_path()] = {"get": _op(rt, "list")}
        for coll in collections:
            paths[coll] = {
                "get": _op(rt, "list"),
                "post": _op(rt, "post", _WRITE_PARAMS),
                "delete": _op(rt, "deletecollection"),
            }
            item = {
                "get": _op(rt, "get"),
                "put": _op(rt, "put", _WRITE_PARAMS),
                "patch": _op(rt, "patch", _WRITE_PARAMS),
                "delete": _op(rt, "delete", [_WRITE_PARAMS[0]]),
            }
            paths[coll + "/{name}"] = item
            if rt.status_subresource:
                paths[coll + "/{name}/status"] = {
                    "get": _op(rt, "get"),
                    "put": _op(rt, "put", _WRITE_PARAMS),
                    "patch": _op(rt, "patch", _WRITE_PARAMS),
                }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (ebpf-proxy lab API server)", "version": SERVER_VERSION["gitVersion"]},
        "paths": paths,
        "components": {"schemas": {}},
    }


def _hash(doc: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:128].upper()


def openapi_v3_root() -> dict[str, Any]:
    paths = {}
    for group, version in _group_versions():
        doc = openapi_v3_doc(group, version)
        assert doc is not None
        paths[_gv_path(group, version)] = {"serverRelativeURL": f"/openapi/v3/{_gv_path(group, version)}?hash={_hash(doc)}"}
    return {"paths": paths}
