"""Which endpoints each kind of traffic may use: kube-proxy's `CategorizeEndpoints`, shared by every datapath.

Both datapaths must pick backends from exactly the same sets, so the choice lives here, once:
- cluster endpoints: ready ones anywhere; if none is ready, the serving+terminating ones;
- local endpoints (used by eTP=Local for external traffic and by iTP=Local): ready local ones, else
  serving+terminating local ones;
- has_any: whether a usable endpoint exists anywhere (decides REJECT vs. the eTP=Local DROP).
"""

from __future__ import annotations

from dataclasses import dataclass

from ebpf_proxy.model.types import Endpoint, ServicePort


@dataclass(frozen=True)
class EndpointSets:
    cluster: tuple[Endpoint, ...]
    local: tuple[Endpoint, ...]
    all_reachable: tuple[Endpoint, ...]
    has_any: bool


def _usable(endpoints: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    ready = tuple(ep for ep in endpoints if ep.ready)
    if ready:
        return ready
    return tuple(ep for ep in endpoints if ep.serving and ep.terminating)


def categorize(svc: ServicePort, endpoints: tuple[Endpoint, ...]) -> EndpointSets:
    endpoints = tuple(sorted(set(endpoints)))
    cluster: tuple[Endpoint, ...] = ()
    has_any = False
    if svc.uses_cluster_endpoints:
        cluster = _usable(endpoints)
        has_any = bool(cluster)
    if not svc.uses_local_endpoints:
        return EndpointSets(cluster=cluster, local=(), all_reachable=cluster, has_any=has_any)

    has_any = has_any or any(ep.ready or (ep.serving and ep.terminating) for ep in endpoints)
    local = _usable(tuple(ep for ep in endpoints if ep.is_local))
    if not svc.uses_cluster_endpoints:
        return EndpointSets(cluster=(), local=local, all_reachable=local, has_any=has_any)
    reachable = tuple(sorted(set(cluster) | set(local))) if local else cluster
    return EndpointSets(cluster=cluster, local=local, all_reachable=reachable, has_any=has_any)
