"""Which endpoints each kind of traffic may use: kube-proxy's `CategorizeEndpoints`, shared by every datapath.

Both datapaths must pick backends from exactly the same sets, so the choice lives here, once
(kube-proxy keeps it in pkg/proxy/topology.go for the same reason):
- cluster endpoints: ready ones anywhere, narrowed by topology (below); if none is ready, the
  serving+terminating ones, topology ignored;
- local endpoints (used by eTP=Local for external traffic and by iTP=Local): ready local ones, else
  serving+terminating local ones; topology hints never apply to them;
- all_reachable: cluster ∪ local, merged when topology or the terminating fallback makes them differ;
- has_any: whether a usable endpoint exists anywhere (decides REJECT vs. the eTP=Local DROP).

Topology (kube-proxy's topologyModeFromHints and availableForTopology), decided per service
port from the hints of its *ready* endpoints:
- PreferSameNode when every ready endpoint has a node hint and at least one names this node:
  cluster endpoints are those hinted for this node;
- else PreferSameZone when every ready endpoint has a zone hint and at least one names this
  node's zone: cluster endpoints are those hinted for this zone;
- else no topology: every ready endpoint.
The fallback is in choosing the mode, never in applying it, so a chosen mode always yields at
least one ready endpoint. The hints are whatever the EndpointSlice controller wrote
(trafficDistribution or the topology-mode annotation); the proxy never looks at the Service's
own fields for this, exactly as kube-proxy does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ebpf_proxy.model.endpoints import MergedEndpoints, columns, v4_texts
from ebpf_proxy.model.types import Endpoint, NodeTopology, ServicePort

NO_TOPOLOGY = ""
PREFER_SAME_NODE = "PreferSameNode"
PREFER_SAME_ZONE = "PreferSameZone"

_UNKNOWN_NODE = NodeTopology()


@dataclass(frozen=True)
class EndpointSets:
    cluster: tuple[Endpoint, ...]
    local: tuple[Endpoint, ...]
    all_reachable: tuple[Endpoint, ...]
    has_any: bool


def topology_mode(endpoints: tuple[Endpoint, ...], node: NodeTopology) -> str:
    """kube-proxy's topologyModeFromHints: which hints (if any) narrow the cluster endpoints."""
    ready = [ep for ep in endpoints if ep.ready]
    if not ready:
        return NO_TOPOLOGY
    if all(ep.node_hints for ep in ready) and any(node.node_name in ep.node_hints for ep in ready):
        return PREFER_SAME_NODE
    # a node without the zone label has zone "", which matches only a (legal, odd) hint named "",
    # exactly as in kube-proxy's ZoneHints().Has(zone)
    if all(ep.zone_hints for ep in ready) and any(node.zone in ep.zone_hints for ep in ready):
        return PREFER_SAME_ZONE
    return NO_TOPOLOGY


def available_for_topology(ep: Endpoint, mode: str, node: NodeTopology) -> bool:
    """kube-proxy's availableForTopology: no fallback here, it happened when choosing the mode."""
    if mode == PREFER_SAME_NODE:
        return node.node_name in ep.node_hints
    if mode == PREFER_SAME_ZONE:
        return node.zone in ep.zone_hints
    return True


def _usable_local(endpoints: tuple[Endpoint, ...]) -> tuple[tuple[Endpoint, ...], bool]:
    """Local endpoints for Local policies, and whether they are the terminating fallback."""
    local = tuple(ep for ep in endpoints if ep.is_local)
    ready = tuple(ep for ep in local if ep.ready)
    if ready:
        return ready, False
    return tuple(ep for ep in local if ep.serving and ep.terminating), True


def categorize(svc: ServicePort, endpoints: tuple[Endpoint, ...],
               node: NodeTopology = _UNKNOWN_NODE) -> EndpointSets:
    """The endpoint sets of one service port as seen from `node` (its name and zone)."""
    if type(endpoints) is MergedEndpoints:  # the tracker's: already sorted and without duplicates
        merged = endpoints
        endpoints = tuple(merged)
        if svc.uses_cluster_endpoints and not svc.uses_local_endpoints and merged.all_ready_without_hints():
            # every endpoint ready and unhinted: no topology mode, all of them in the cluster set
            # (what the loops below find, without them: most service ports, at every full sync)
            return EndpointSets(cluster=endpoints, local=(), all_reachable=endpoints, has_any=bool(endpoints))
    else:
        endpoints = tuple(sorted(set(endpoints)))
    cluster: tuple[Endpoint, ...] = ()
    has_any = False
    mode = NO_TOPOLOGY
    if svc.uses_cluster_endpoints:
        mode = topology_mode(endpoints, node)
        cluster = tuple(ep for ep in endpoints if ep.ready and available_for_topology(ep, mode, node))
        if not cluster:  # nothing ready anywhere (a mode always leaves one): terminating, topology ignored
            cluster = tuple(ep for ep in endpoints if ep.serving and ep.terminating)
        has_any = bool(cluster)
    if not svc.uses_local_endpoints:
        return EndpointSets(cluster=cluster, local=(), all_reachable=cluster, has_any=has_any)

    has_any = has_any or any(ep.ready or (ep.serving and ep.terminating) for ep in endpoints)
    local, terminating_fallback = _usable_local(endpoints)
    if not svc.uses_cluster_endpoints:
        return EndpointSets(cluster=(), local=local, all_reachable=local, has_any=has_any)
    if mode == NO_TOPOLOGY and not terminating_fallback:
        # cluster then holds every ready endpoint, local ones included: nothing to merge
        return EndpointSets(cluster=cluster, local=local, all_reachable=cluster, has_any=has_any)
    reachable = tuple(sorted(set(cluster) | set(local)))
    return EndpointSets(cluster=cluster, local=local, all_reachable=reachable, has_any=has_any)


class Reachable:
    """categorize's answer for one service port as columns over its all_reachable endpoints, in
    that order: each one's port, whether it is in the cluster set, whether in the local set (so
    the sets are all_reachable's endpoints flagged so, in the same order), and has_any. The
    addresses: `ips()`, and `v4`, their 4 bytes each (socket.inet_aton's) when known without
    parsing, else None. What the eBPF datapath writes (a backend per reachable endpoint, flagged
    in-cluster/in-local); build with `reachable`."""

    __slots__ = ("ports", "in_cluster", "in_local", "has_any", "v4", "_ips")

    def __init__(self, ports: Sequence[int], in_cluster: Sequence[bool], in_local: Sequence[bool], has_any: bool,
                 v4: bytes | None = None, ips: list[str] | None = None) -> None:
        """Either `v4` or `ips` (or both) gives the addresses."""
        self.ports, self.in_cluster, self.in_local, self.has_any = ports, in_cluster, in_local, has_any
        self.v4, self._ips = v4, ips

    def ips(self) -> list[str]:
        if self._ips is None:  # made on demand: a first sync needs only the bytes
            self._ips = v4_texts(self.v4)  # type: ignore[arg-type]
        return self._ips


def reachable(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeTopology = _UNKNOWN_NODE) -> Reachable:
    """categorize(svc, endpoints, node) as a Reachable: exactly its sets, in its order
    (tests/unit/test_categorize_reachable.py compares both over varied inputs).

    The common case is read from the packed rows, without an Endpoint value each (a million
    at every full sync of 100,000 Services): the tracker's MergedEndpoints (sorted, without
    duplicates) whose endpoints are all ready and unhinted. There, whatever the node, no
    topology mode applies and no terminating fallback: the cluster set is every endpoint, the
    local set the local ones (Local policies; none without), all_reachable the cluster set, or
    the local set when the cluster one is not used (iTP=Local alone), and has_any is true.
    Everything else is categorize's answer, converted."""
    if type(endpoints) is MergedEndpoints:
        cols = columns(endpoints)
        if cols.ports and all(ready and not zones and not nodes for _, ready, _, _, _, zones, nodes in cols.kinds()):
            n = len(cols.ports)
            if svc.uses_cluster_endpoints:
                local = [extra[4] for extra in cols.extras()] if svc.uses_local_endpoints else [False] * n
                return Reachable(cols.ports, [True] * n, local, True, cols.v4, cols.ips() if cols.v4 is None else None)
            picked = [i for i, extra in enumerate(cols.extras()) if extra[4]]  # [4]: is_local
            v4 = cols.v4
            return Reachable([cols.ports[i] for i in picked], [False] * len(picked), [True] * len(picked), True,
                             None if v4 is None else b"".join([v4[4 * i:4 * i + 4] for i in picked]),
                             None if v4 is not None else [cols.ips()[i] for i in picked])
    sets = categorize(svc, endpoints, node)  # type: ignore[arg-type]  # any Sequence, as the datapaths pass
    # by identity: the sets hold the very objects of all_reachable (one per distinct endpoint)
    cluster, local = {id(ep) for ep in sets.cluster}, {id(ep) for ep in sets.local}
    eps = sets.all_reachable
    return Reachable([ep.port for ep in eps], [id(ep) in cluster for ep in eps], [id(ep) in local for ep in eps],
                     sets.has_any, ips=[ep.ip for ep in eps])
