"""The lab's own API client: apply/delete standard manifests at the embedded API server.

The lab talks to its API server through the official client, like any other client would; this
module only maps a manifest's kind to its REST path and does create-or-update ("apply").
"""

from __future__ import annotations

import json
from typing import Any, Iterable
from urllib.parse import urlencode

import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

# kind -> (path prefix, namespaced, plural)
RESOURCES: dict[str, tuple[str, bool, str]] = {
    "Service": ("/api/v1", True, "services"),
    "Pod": ("/api/v1", True, "pods"),
    "Node": ("/api/v1", False, "nodes"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", True, "endpointslices"),
    "Namespace": ("/api/v1", False, "namespaces"),
}


class ManifestError(ValueError):
    pass


def load_manifests(text: str, source: str = "<manifest>") -> list[dict[str, Any]]:
    """Parse multi-document YAML (and `kind: List`), naming the document at fault on errors."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{source}: not valid YAML: {exc}") from None
    out: list[dict[str, Any]] = []
    for index, doc in enumerate(docs):
        where = f"{source}[{index}]"
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: expected a mapping, got {type(doc).__name__}")
        if doc.get("kind") == "List":
            out.extend(doc.get("items") or [])
            continue
        kind = doc.get("kind")
        if kind not in RESOURCES:
            raise ManifestError(f"{where}.kind: {kind!r} is not one of {sorted(RESOURCES)}")
        name = (doc.get("metadata") or {}).get("name")
        if not name:
            raise ManifestError(f"{where}.metadata.name: required")
        out.append(doc)
    return namespaces_first(out)


def namespaces_first(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Namespaces before everything else (stable otherwise): objects in a new namespace need it first."""
    return sorted(docs, key=lambda doc: doc.get("kind") != "Namespace")


def namespaces_last(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For deletion: the objects in a namespace before the namespace itself."""
    return sorted(docs, key=lambda doc: doc.get("kind") == "Namespace")


class KubeApi:
    """Create/update/delete/get by manifest, through the official client's ApiClient."""

    def __init__(self, server_url: str) -> None:
        config = k8s.Configuration()
        config.host = server_url
        self.api = k8s.ApiClient(config)

    def close(self) -> None:
        self.api.close()

    def _path(self, kind: str, namespace: str | None, name: str | None = None) -> str:
        prefix, namespaced, plural = RESOURCES[kind]
        path = prefix
        if namespaced:
            path += f"/namespaces/{namespace or 'default'}"
        path += f"/{plural}"
        if name:
            path += f"/{name}"
        return path

    def _call(self, method: str, path: str, body: Any = None, query: Iterable[tuple[str, str]] = ()) -> Any:
        url = self.api.configuration.host + path
        query = list(query)
        if query:
            url += "?" + urlencode(query)
        response = self.api.call_api(method, url, header_params={"Content-Type": "application/json",
                                                                 "Accept": "application/json"},
                                     body=body)
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(response.data or b"null")

    def get(self, kind: str, name: str, namespace: str | None = "default") -> dict | None:
        try:
            return self._call("GET", self._path(kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str | None = None, label_selector: str = "") -> list[dict]:
        prefix, namespaced, plural = RESOURCES[kind]
        path = self._path(kind, namespace) if namespace else f"{prefix}/{plural}"
        query = [("labelSelector", label_selector)] if label_selector else []
        return self._call("GET", path, query=query).get("items") or []

    def resource_version(self) -> int:
        """The server's current resourceVersion (a list's), as a number: the lab's server counts."""
        return int(self._call("GET", "/api/v1/nodes", query=[("limit", "1")])["metadata"]["resourceVersion"])

    def apply(self, obj: dict) -> dict:
        """Create, or replace keeping what the server allocated (clusterIP, nodePorts) — like `kubectl apply`."""
        kind = obj["kind"]
        meta = obj.setdefault("metadata", {})
        namespace = meta.get("namespace", "default") if RESOURCES[kind][1] else None
        existing = self.get(kind, meta["name"], namespace)
        if existing is None:
            return self._call("POST", self._path(kind, namespace), body=obj)  # create keeps status
        meta["resourceVersion"] = existing["metadata"]["resourceVersion"]
        if kind == "Service":
            _keep_allocations(obj, existing)
        updated = self._call("PUT", self._path(kind, namespace, meta["name"]), body=obj)
        if "status" in obj and obj["status"] != updated.get("status"):
            # As on a real server, a PUT of the object keeps the stored status: status has its own path.
            status = {**updated, "status": obj["status"]}
            updated = self._call("PUT", self._path(kind, namespace, meta["name"]) + "/status", body=status)
        return updated

    def delete(self, kind: str, name: str, namespace: str | None = "default") -> bool:
        try:
            self._call("DELETE", self._path(kind, namespace if RESOURCES[kind][1] else None, name))
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise


def _keep_allocations(new: dict, old: dict) -> None:
    spec, old_spec = new.setdefault("spec", {}), old.get("spec") or {}
    for key in ("clusterIP", "clusterIPs", "healthCheckNodePort"):
        if key not in spec and key in old_spec:
            if key == "healthCheckNodePort" and spec.get("externalTrafficPolicy") != "Local":
                continue
            spec[key] = old_spec[key]
    if spec.get("type", "ClusterIP") in ("NodePort", "LoadBalancer"):
        old_ports = {(p.get("port"), p.get("protocol", "TCP")): p for p in old_spec.get("ports") or []}
        for port in spec.get("ports") or []:
            prev = old_ports.get((port.get("port"), port.get("protocol", "TCP")))
            if "nodePort" not in port and prev and prev.get("nodePort"):
                port["nodePort"] = prev["nodePort"]
