"""API objects as the API server sends them (plain dicts), for control-plane tests."""

from __future__ import annotations

from typing import Any


def port(name: str = "http", number: int = 80, protocol: str | None = "TCP", node_port: int | None = None) -> dict:
    p: dict[str, Any] = {"name": name, "port": number}
    if protocol is not None:
        p["protocol"] = protocol
    if node_port is not None:
        p["nodePort"] = node_port
    return p


def service(name: str = "web", namespace: str = "default", *, svc_type: str = "ClusterIP",
            cluster_ip: str = "10.96.0.10", ports: list | None = None, rv: str = "1",
            status: dict | None = None, **spec: Any) -> dict:
    obj = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": rv},
        "spec": {"type": svc_type, "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "ports": ports if ports is not None else [port()], **spec},
    }
    if status is not None:
        obj["status"] = status
    return obj


def endpoint(ip: str, node: str | None = None, ready: bool | None = None, serving: bool | None = None,
             terminating: bool | None = None, hints: dict | None = None) -> dict:
    ep: dict[str, Any] = {"addresses": [ip]}
    if hints is not None:
        ep["hints"] = hints
    conditions = {k: v for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
                  if v is not None}
    if conditions:
        ep["conditions"] = conditions
    if node is not None:
        ep["nodeName"] = node
    return ep


def endpoint_slice(name: str = "web-abc", namespace: str = "default", service_name: str = "web", *,
                   endpoints: list | None = None, ports: list | None = None, rv: str = "1",
                   address_type: str = "IPv4", trigger: str | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "resourceVersion": rv,
                            "labels": {"kubernetes.io/service-name": service_name}}
    if trigger is not None:
        meta["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": trigger}
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": meta,
        "addressType": address_type,
        "endpoints": endpoints if endpoints is not None else [endpoint("10.244.1.5", "n1")],
        "ports": ports if ports is not None else [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def node(name: str = "n1", internal: str | None = "192.168.1.10", external: str | None = None, rv: str = "1",
         **meta: Any) -> dict:
    addresses = [{"type": "Hostname", "address": name}]
    if internal:
        addresses.append({"type": "InternalIP", "address": internal})
    if external:
        addresses.append({"type": "ExternalIP", "address": external})
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "resourceVersion": rv, **meta},
            "status": {"addresses": addresses}}
