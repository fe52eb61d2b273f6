"""Topology hints on EndpointSlice endpoints, as kube-controller-manager's EndpointSlice controller
writes them; the lab's controller (slicecontroller.py) calls `add_hints` on each Service's
endpoints before writing its slices.

Which hints a Service gets (the real reconciler's order):
1. annotation `service.kubernetes.io/topology-mode` (or the deprecated
   `service.kubernetes.io/topology-aware-hints`) `Auto`/`auto`: the proportional allocation of
   `pkg/controller/endpointslice/topologycache` (below);
2. else `spec.trafficDistribution` PreferClose/PreferSameZone: each ready endpoint hinted for its
   own zone; PreferSameNode: also for its own node (staging/.../endpointslice/trafficdist);
3. else no hints.
Only ready endpoints get hints; an endpoint without a zone gets no zone hint.

The Auto allocation, a faithful subset of topologycache.AddHints: zones are weighed by the
allocatable CPU of their ready nodes (control-plane nodes excluded); no hints at all when a node
lacks a zone or CPU, when fewer than 2 zones exist, when there are fewer ready endpoints than
zones, when a zone's minimum share (its CPU share divided by 1.2, the overload threshold) cannot
be met, or when a ready endpoint has no zone. Otherwise each endpoint is hinted for its own zone,
then endpoints of zones above their desired share are re-hinted, one by one, for zones below it.
Endpoints are visited in order and receiving zones in name order (upstream iterates Go maps, so
its choice among equals is arbitrary; ours is stable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

TOPOLOGY_MODE_ANNOTATION = "service.kubernetes.io/topology-mode"
DEPRECATED_HINTS_ANNOTATION = "service.kubernetes.io/topology-aware-hints"
ZONE_LABEL = "topology.kubernetes.io/zone"
CLOSE_DISTRIBUTIONS = ("PreferClose", "PreferSameZone", "PreferSameNode")
OVERLOAD_THRESHOLD = 0.2
_EXCLUDED_NODE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


@dataclass(frozen=True)
class NodeInfo:
    """What hints need from a Node object."""

    zone: str  # "" without the zone label
    cpu_milli: int  # allocatable CPU; 0 when missing or unparsable
    ready: bool
    excluded: bool  # a control-plane node: not counted for capacity


def node_info(node: Mapping[str, Any]) -> NodeInfo:
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    labels = meta.get("labels") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return NodeInfo(zone=labels.get(ZONE_LABEL) or "", cpu_milli=_cpu_milli((status.get("allocatable") or {}).get("cpu")),
                    ready=ready, excluded=any(k in labels for k in _EXCLUDED_NODE_LABELS))


def _cpu_milli(value: Any) -> int:
    """A CPU quantity ("2", "1500m", 2) in millicores; 0 if it is not one."""
    try:
        if isinstance(value, str) and value.endswith("m"):
            return int(value[:-1])
        return int(float(value) * 1000)
    except (TypeError, ValueError):
        return 0


def auto_enabled(svc: Mapping[str, Any]) -> bool:
    """The real reconciler's hintsEnabled: the deprecated annotation, if present, wins."""
    annotations = (svc.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(DEPRECATED_HINTS_ANNOTATION, annotations.get(TOPOLOGY_MODE_ANNOTATION))
    return value in ("Auto", "auto")


def add_hints(svc: Mapping[str, Any], endpoints: list[dict[str, Any]], nodes: Mapping[str, NodeInfo]) -> None:
    """Set (or leave out) `hints` on every endpoint of `svc`, across all its slices, in place."""
    for ep in endpoints:
        ep.pop("hints", None)
    ready = [ep for ep in endpoints if (ep.get("conditions") or {}).get("ready")]
    if auto_enabled(svc):
        _auto(ready, nodes.values())
        return
    distribution = (svc.get("spec") or {}).get("trafficDistribution")
    if distribution not in CLOSE_DISTRIBUTIONS:
        return
    for ep in ready:
        hints: dict[str, list[dict[str, str]]] = {}
        if ep.get("zone"):
            hints["forZones"] = [{"name": ep["zone"]}]
        if distribution == "PreferSameNode" and ep.get("nodeName"):
            hints["forNodes"] = [{"name": ep["nodeName"]}]
        if hints:
            ep["hints"] = hints


def cpu_ratios(nodes: Iterable[NodeInfo]) -> dict[str, float] | None:
    """Each zone's share of the ready nodes' CPU (topologycache.SetNodes); None if insufficient."""
    by_zone: dict[str, int] = {}
    for node in nodes:
        if node.excluded or not node.ready:
            continue
        if not node.zone or not node.cpu_milli:
            return None  # upstream bails out entirely on one node without zone or CPU
        by_zone[node.zone] = by_zone.get(node.zone, 0) + node.cpu_milli
    total = sum(by_zone.values())
    if not total or len(by_zone) < 2:
        return None
    return {zone: cpu / total for zone, cpu in by_zone.items()}


def allocations(ratios: Mapping[str, float], endpoints: int) -> dict[str, float] | None:
    """Each zone's desired endpoint count (topologycache.getAllocations); None if not possible."""
    if len(ratios) > endpoints:
        return None
    desired: dict[str, float] = {}
    minimum_total = 0
    for zone, ratio in ratios.items():
        want = ratio * endpoints
        minimum = math.ceil(want * (1 / (1 + OVERLOAD_THRESHOLD)))
        minimum_total += minimum
        if minimum_total > endpoints:
            return None
        desired[zone] = max(want, float(minimum))
    return desired


def _auto(ready: list[dict[str, Any]], nodes: Iterable[NodeInfo]) -> None:
    ratios = cpu_ratios(nodes)
    desired = allocations(ratios, len(ready)) if ratios else None
    if desired is None or any(not ep.get("zone") for ep in ready):
        return
    allocated: dict[str, int] = {}
    for ep in ready:  # step 1: every endpoint for its own zone
        allocated[ep["zone"]] = allocated.get(ep["zone"], 0) + 1
        ep["hints"] = {"forZones": [{"name": ep["zone"]}]}
    giving, receiving = _giving_and_receiving(desired, allocated)
    for ep in ready:  # step 3: move surplus endpoints' hints to zones short of their share
        if not giving or not receiving:
            break
        zone = ep["zone"]
        if giving.get(zone, 0) <= 0:
            continue
        to = next(z for z in sorted(receiving) if receiving[z] > 0)
        ep["hints"] = {"forZones": [{"name": to}]}
        for counts, key in ((giving, zone), (receiving, to)):
            counts[key] -= 1
            if not counts[key]:
                del counts[key]


def _giving_and_receiving(desired: Mapping[str, float], allocated: Mapping[str, int]) -> tuple[dict, dict]:
    """Whole endpoints each zone gives or receives (topologycache getGivingAndReceivingZones)."""
    give = {z: allocated.get(z, 0) - d for z, d in desired.items() if allocated.get(z, 0) > d}
    take = {z: d - allocated.get(z, 0) for z, d in desired.items() if allocated.get(z, 0) < d}
    giving: dict[str, int] = {}
    receiving: dict[str, int] = {}
    while give and take:
        g = max(sorted(give), key=lambda z: give[z])
        r = max(sorted(take), key=lambda z: take[z])
        if (give[g] < 1 and take[r] < 1) or give[g] < 0.5 or take[r] < 0.5:
            break
        giving[g] = giving.get(g, 0) + 1
        receiving[r] = receiving.get(r, 0) + 1
        give[g] -= 1
        take[r] -= 1
    return giving, receiving
