"""A node's desired state from API objects, the way its agent builds it, for one-off questions.

`verify` and `trace` ask "what should this node do?" without a running agent's memory: they list
Services, EndpointSlices and Nodes once and feed them through the same conversion (k8s/convert)
and change tracker the agent uses, so the answer is the agent's answer by construction.
Malformed objects are skipped exactly as the agent skips them.
"""

from __future__ import annotations

from collections.abc import Iterable

from ebpf_proxy.k8s import convert
from ebpf_proxy.model import ChangeTracker, NodeState, ProxyState


def desired_state(services: Iterable[dict], slices: Iterable[dict], nodes: Iterable[dict],
                  node_name: str, family: int = 4) -> tuple[ProxyState, NodeState | None]:
    """The ProxyState node `node_name`'s agent programs for these objects in its IP `family`
    proxier (IPv6: the Services' IPv6 addresses, the IPv6 EndpointSlices), and its NodeState."""
    tracker = ChangeTracker(node_name=node_name)
    for obj in nodes:
        node = convert.node_info(obj)
        if node is not None and node.name == node_name:
            tracker.update_node(node)
    for obj in services:
        ref = convert.object_ref(obj)
        if ref is not None:
            tracker.update_service(ref.namespace, ref.name, convert.service_ports(obj, family=family))
    for obj in slices:
        sl = convert.endpoint_slice(obj, node_name, families=(family,))
        if sl is not None:
            tracker.update_slice(sl.namespace, sl.name, sl.service, sl.endpoints, sl.trigger_time)
    state, _changes = tracker.take(full=True)
    return state, tracker.node


def listed_state(api, node_name: str, families: tuple[int, ...] = (4,)) -> dict[int, tuple[ProxyState, NodeState | None]]:
    """desired_state() of each of `families` from the API server, listed once as the agent lists
    (same selectors)."""
    from ebpf_proxy.k8s.client import agent_collections

    collections = agent_collections(api, node_name)
    items = {kind: list(collections[kind].list()[0]) for kind in ("Service", "EndpointSlice", "Node")}
    return {family: desired_state(items["Service"], items["EndpointSlice"], items["Node"], node_name, family)
            for family in families}


def frontend_names(state: ProxyState, node_ips: Iterable[str] = ()) -> dict[tuple[str, int, str], str]:
    """(ip, port, protocol) -> "ns/name:port" for every frontend: the names a trace of the eBPF
    datapath prints (its maps hold ids, not names)."""
    names = {}
    for name, svc in state.services.items():
        proto, label = svc.protocol.value, str(name)
        for ip in (svc.cluster_ip, *svc.external_ips, *svc.load_balancer_ips):
            if ip:
                names[(ip, svc.port, proto)] = label
        if svc.node_port:
            for ip in (*node_ips, "127.0.0.1"):
                names[(ip, svc.node_port, proto)] = label
    return names
