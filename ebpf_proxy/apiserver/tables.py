"""Server-side printing: `meta.k8s.io/v1 Table` responses for `kubectl get`.

kubectl asks for a Table and prints whatever columns the server defines; without one it can
only show NAME and AGE. The columns and cell formats here are those of kube-apiserver's
printers (`pkg/printers/internalversion/printers.go`), so `kubectl get svc` in the lab looks
like it does on a real cluster, including `-o wide` (priority-1 columns).
"""

from __future__ import annotations

import calendar
import time
from typing import Any, Callable

Row = list[Any]
Column = tuple[str, str, int, str]  # name, type, priority, description


def human_duration(seconds: float) -> str:
    """apimachinery's `duration.HumanDuration` (what the AGE column shows)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def _age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    try:
        then = calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return "<unknown>"
    return human_duration(time.time() - then)


def _service(obj: dict[str, Any]) -> Row:
    spec = obj.get("spec") or {}
    kind = spec.get("type", "ClusterIP")
    cluster_ip = spec.get("clusterIP") or "<none>"
    if kind == "ExternalName":
        external = spec.get("externalName") or "<none>"
    elif kind == "LoadBalancer":
        ingress = ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        ips = [i.get("ip") or i.get("hostname") for i in ingress] + list(spec.get("externalIPs") or [])
        external = ",".join(ip for ip in ips if ip) or "<pending>"
    else:
        external = ",".join(spec.get("externalIPs") or []) or "<none>"
    ports = []
    for p in spec.get("ports") or []:
        text = str(p.get("port"))
        if p.get("nodePort"):
            text += f":{p['nodePort']}"
        ports.append(f"{text}/{p.get('protocol', 'TCP')}")
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items())) or "<none>"
    return [kind, cluster_ip, external, ",".join(ports) or "<none>", _age(obj["metadata"].get("creationTimestamp")), selector]


def _endpoint_slice(obj: dict[str, Any]) -> Row:
    ports = [str(p.get("port")) for p in obj.get("ports") or [] if p.get("port") is not None]
    addresses = [a for ep in obj.get("endpoints") or [] for a in ep.get("addresses") or []]
    shown = ",".join(addresses[:3]) if addresses else "<none>"
    if len(addresses) > 3:
        shown += f" + {len(addresses) - 3} more..."
    return [obj.get("addressType", ""), ",".join(ports) or "<unset>", shown, _age(obj["metadata"].get("creationTimestamp"))]


def _node(obj: dict[str, Any]) -> Row:
    status = obj.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Unknown" if ready is None else ("Ready" if ready.get("status") == "True" else "NotReady")
    if (obj.get("spec") or {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = obj["metadata"].get("labels") or {}
    roles = sorted(k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and "/" in k)
    roles += [v for k, v in labels.items() if k == "kubernetes.io/role"]
    info = status.get("nodeInfo") or {}
    addresses = status.get("addresses") or []

    def addr(kind: str) -> str:
        return next((a.get("address") for a in addresses if a.get("type") == kind), None) or "<none>"

    return [
        state,
        ",".join(roles) or "<none>",
        _age(obj["metadata"].get("creationTimestamp")),
        info.get("kubeletVersion", ""),
        addr("InternalIP"),
        addr("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _pod(obj: dict[str, Any]) -> Row:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    statuses = status.get("containerStatuses") or []
    total = len(spec.get("containers") or [])
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
    phase = status.get("reason") or status.get("phase") or "Unknown"
    if obj["metadata"].get("deletionTimestamp"):
        phase = "Terminating"
    return [
        f"{ready}/{total}", phase, restarts, _age(obj["metadata"].get("creationTimestamp")),
        status.get("podIP") or "<none>", spec.get("nodeName") or "<none>", status.get("nominatedNodeName") or "<none>",
    ]


def _namespace(obj: dict[str, Any]) -> Row:
    return [(obj.get("status") or {}).get("phase", ""), _age(obj["metadata"].get("creationTimestamp"))]


def _event(obj: dict[str, Any]) -> Row:
    involved = obj.get("involvedObject") or obj.get("regarding") or {}
    last = obj.get("lastTimestamp") or obj.get("deprecatedLastTimestamp") or obj.get("eventTime") or obj["metadata"].get("creationTimestamp")
    target = f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"
    return [_age(last), obj.get("type", ""), obj.get("reason", ""), target, obj.get("message") or obj.get("note") or ""]


_NAME: Column = ("Name", "string", 0, "Name must be unique within a namespace.")
_AGE: Column = ("Age", "string", 0, "Time since the object was created.")

PRINTERS: dict[str, tuple[list[Column], Callable[[dict[str, Any]], Row]]] = {
    "Service": (
        [_NAME, ("Type", "string", 0, "The type of the service."), ("Cluster-IP", "string", 0, "The cluster IP."),
         ("External-IP", "string", 0, "External addresses."), ("Port(s)", "string", 0, "Ports of the service."), _AGE,
         ("Selector", "string", 1, "The label selector of the service's pods.")],
        _service,
    ),
    "EndpointSlice": (
        [_NAME, ("AddressType", "string", 0, "The address type."), ("Ports", "string", 0, "Ports of the endpoints."),
         ("Endpoints", "string", 0, "Addresses of the endpoints."), _AGE],
        _endpoint_slice,
    ),
    "Node": (
        [_NAME, ("Status", "string", 0, "Ready condition."), ("Roles", "string", 0, "Node roles."), _AGE,
         ("Version", "string", 0, "Kubelet version."), ("Internal-IP", "string", 1, ""), ("External-IP", "string", 1, ""),
         ("OS-Image", "string", 1, ""), ("Kernel-Version", "string", 1, ""), ("Container-Runtime", "string", 1, "")],
        _node,
    ),
    "Pod": (
        [_NAME, ("Ready", "string", 0, "Ready containers."), ("Status", "string", 0, "Pod phase."),
         ("Restarts", "integer", 0, "Container restarts."), _AGE, ("IP", "string", 1, "Pod IP."),
         ("Node", "string", 1, "Node name."), ("Nominated Node", "string", 1, "")],
        _pod,
    ),
    "Namespace": ([_NAME, ("Status", "string", 0, "Namespace phase."), _AGE], _namespace),
    "Event": (
        [("Last Seen", "string", 0, "Time of the last occurrence."), ("Type", "string", 0, "Normal or Warning."),
         ("Reason", "string", 0, ""), ("Object", "string", 0, "The object the event is about."),
         ("Message", "string", 0, "")],
        _event,
    ),
}


def _partial(obj: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata") or {}}


def to_table(kind: str, objects: list[dict[str, Any]], resource_version: str, *, include_object: str = "Metadata",
             continue_token: str = "") -> dict[str, Any]:
    """A Table of `objects` (stored kind `kind`); rows carry metadata so kubectl can add NAMESPACE."""
    columns, printer = PRINTERS[kind]
    name_first = columns[0] is _NAME
    rows = []
    for obj in objects:
        cells = printer(obj)
        if name_first:
            cells = [obj["metadata"].get("name", "")] + cells
        row: dict[str, Any] = {"cells": cells}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = _partial(obj)
        rows.append(row)
    meta: dict[str, Any] = {"resourceVersion": resource_version}
    if continue_token:
        meta["continue"] = continue_token
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": [
            {"name": n, "type": t, "format": "name" if (n, t, p, d) == _NAME else "", "description": d, "priority": p}
            for n, t, p, d in columns
        ],
        "rows": rows,
    }
