"""categorize() with topology hints: kube-proxy's TestCategorizeEndpoints (pkg/proxy/topology_test.go).

Each upstream case is ported as one table row, named as upstream names it (the hint-gate rows of
older releases are gone upstream and here: topology is decided by hints alone). The node-hint
rows (PreferSameNode) and the terminating-fallback rows with hints follow the current
topologyModeFromHints; upstream's table has no row for them, so they are ours and say so.

Expected sets use `None` for "the service does not use this kind of endpoint", as upstream
distinguishes nil from an empty set; all_reachable defaults to whichever of cluster/local is set.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.model import Endpoint, NodeTopology, Protocol, ServicePort, ServicePortName, categorize
from ebpf_proxy.model.categorize import (
    NO_TOPOLOGY,
    PREFER_SAME_NODE,
    PREFER_SAME_ZONE,
    topology_mode,
)

NAME = ServicePortName("default", "web", "", Protocol.TCP)
NODE = "node-a1"


def svc(*, etp_local=False, itp_local=False, node_port=0) -> ServicePort:
    return ServicePort(name=NAME, cluster_ip="10.96.0.10", port=80, protocol=Protocol.TCP, node_port=node_port,
                       external_policy_local=etp_local and bool(node_port), internal_policy_local=itp_local)


def ep(addr: str, *, zones=(), nodes=(), ready=True, serving=None, terminating=False, local=False) -> Endpoint:
    ip, port = addr.split(":")
    return Endpoint(ip=ip, port=int(port), node_name=NODE if local else "elsewhere", ready=ready,
                    serving=ready if serving is None else serving, terminating=terminating, is_local=local,
                    zone_hints=tuple(sorted(zones)), node_hints=tuple(sorted(nodes)))


def addrs(endpoints) -> set[str]:
    return {e.addr for e in endpoints}


# (name, zone label of this node, service, endpoints, cluster, local, all_reachable, only_remote)
CASES = [
    ("should use topology since all endpoints have hints, node has a zone label and and there are "
     "endpoints for the node's zone", "zone-a", svc(),
     [ep("10.1.2.3:80", zones={"zone-a"}), ep("10.1.2.4:80", zones={"zone-b"}),
      ep("10.1.2.5:80", zones={"zone-c"}), ep("10.1.2.6:80", zones={"zone-a"})],
     {"10.1.2.3:80", "10.1.2.6:80"}, None, None, False),
    ("externalTrafficPolicy: Local, topology ignored for Local endpoints", "zone-a",
     svc(etp_local=True, node_port=8080),
     [ep("10.1.2.3:80", zones={"zone-a"}, local=True), ep("10.1.2.4:80", zones={"zone-b"}, local=True),
      ep("10.1.2.5:80", zones={"zone-c"}), ep("10.1.2.6:80", zones={"zone-a"})],
     {"10.1.2.3:80", "10.1.2.6:80"}, {"10.1.2.3:80", "10.1.2.4:80"},
     {"10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"}, False),
    ("internalTrafficPolicy: Local, topology ignored for Local endpoints", "zone-a",
     svc(itp_local=True, node_port=8080),
     [ep("10.1.2.3:80", zones={"zone-a"}, local=True), ep("10.1.2.4:80", zones={"zone-b"}, local=True),
      ep("10.1.2.5:80", zones={"zone-c"}), ep("10.1.2.6:80", zones={"zone-a"})],
     {"10.1.2.3:80", "10.1.2.6:80"}, {"10.1.2.3:80", "10.1.2.4:80"},
     {"10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"}, False),
    ("empty node labels", None, svc(), [ep("10.1.2.3:80", zones={"zone-a"})],
     {"10.1.2.3:80"}, None, None, False),
    ("empty zone label", "", svc(), [ep("10.1.2.3:80", zones={"zone-a"})],
     {"10.1.2.3:80"}, None, None, False),
    ("node in different zone, no endpoint filtering", "zone-b", svc(), [ep("10.1.2.3:80", zones={"zone-a"})],
     {"10.1.2.3:80"}, None, None, False),
    ("unready endpoint", "zone-a", svc(),
     [ep("10.1.2.3:80", zones={"zone-a"}), ep("10.1.2.4:80", zones={"zone-b"}),
      ep("10.1.2.5:80", zones={"zone-c"}), ep("10.1.2.6:80", zones={"zone-a"}, ready=False)],
     {"10.1.2.3:80"}, None, None, False),
    ("only unready endpoints in same zone (should not filter)", "zone-a", svc(),
     [ep("10.1.2.3:80", zones={"zone-a"}, ready=False), ep("10.1.2.4:80", zones={"zone-b"}),
      ep("10.1.2.5:80", zones={"zone-c"}), ep("10.1.2.6:80", zones={"zone-a"}, ready=False)],
     {"10.1.2.4:80", "10.1.2.5:80"}, None, None, False),
    ("missing hints, no filtering applied", "zone-a", svc(),
     [ep("10.1.2.3:80", zones={"zone-a"}), ep("10.1.2.4:80", zones={"zone-b"}),
      ep("10.1.2.5:80"), ep("10.1.2.6:80", zones={"zone-a"})],
     {"10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"}, None, None, False),
    ("multiple hints per endpoint, filtering includes any endpoint with zone included", "zone-c", svc(),
     [ep("10.1.2.3:80", zones={"zone-a", "zone-b", "zone-c"}), ep("10.1.2.4:80", zones={"zone-b", "zone-c"}),
      ep("10.1.2.5:80", zones={"zone-b", "zone-d"}), ep("10.1.2.6:80", zones={"zone-c"})],
     {"10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"}, None, None, False),
    ("conflicting topology and localness require merging allEndpoints", "zone-a",
     svc(etp_local=True, node_port=8080),
     [ep("10.0.0.0:80", zones={"zone-a"}, local=True), ep("10.0.0.1:80", zones={"zone-b"}, local=True),
      ep("10.0.0.2:80", zones={"zone-a"}), ep("10.0.0.3:80", zones={"zone-b"})],
     {"10.0.0.0:80", "10.0.0.2:80"}, {"10.0.0.0:80", "10.0.0.1:80"},
     {"10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"}, False),
    ("internalTrafficPolicy: Local, with empty endpoints", None, svc(itp_local=True), [],
     None, set(), None, False),
    ("internalTrafficPolicy: Local, but all endpoints are remote", None, svc(itp_local=True),
     [ep("10.0.0.0:80"), ep("10.0.0.1:80")], None, set(), None, True),
    ("internalTrafficPolicy: Local, all endpoints are local", None, svc(itp_local=True),
     [ep("10.0.0.0:80", local=True), ep("10.0.0.1:80", local=True)],
     None, {"10.0.0.0:80", "10.0.0.1:80"}, None, False),
    ("internalTrafficPolicy: Local, some endpoints are local", None, svc(itp_local=True),
     [ep("10.0.0.0:80", local=True), ep("10.0.0.1:80")], None, {"10.0.0.0:80"}, None, False),
    ("Cluster traffic policy, endpoints not Ready", None, svc(),
     [ep("10.0.0.0:80", ready=False), ep("10.0.0.1:80", ready=False)], set(), None, None, False),
    ("Cluster traffic policy, some endpoints are Ready", None, svc(),
     [ep("10.0.0.0:80", ready=False), ep("10.0.0.1:80")], {"10.0.0.1:80"}, None, None, False),
    ("Cluster traffic policy, all endpoints are terminating", None, svc(),
     [ep("10.0.0.0:80", ready=False, serving=True, terminating=True, local=True),
      ep("10.0.0.1:80", ready=False, serving=True, terminating=True)],
     {"10.0.0.0:80", "10.0.0.1:80"}, None, None, False),
    ("iTP: Local, eTP: Cluster, some endpoints local", None, svc(itp_local=True, node_port=8080),
     [ep("10.0.0.0:80", local=True), ep("10.0.0.1:80")],
     {"10.0.0.0:80", "10.0.0.1:80"}, {"10.0.0.0:80"}, {"10.0.0.0:80", "10.0.0.1:80"}, False),
    ("iTP: Cluster, eTP: Local, some endpoints local", None, svc(etp_local=True, node_port=8080),
     [ep("10.0.0.0:80", local=True), ep("10.0.0.1:80")],
     {"10.0.0.0:80", "10.0.0.1:80"}, {"10.0.0.0:80"}, {"10.0.0.0:80", "10.0.0.1:80"}, False),
    ("iTP: Local, eTP: Local, some endpoints local", None, svc(itp_local=True, etp_local=True, node_port=8080),
     [ep("10.0.0.0:80", local=True), ep("10.0.0.1:80")],
     {"10.0.0.0:80", "10.0.0.1:80"}, {"10.0.0.0:80"}, {"10.0.0.0:80", "10.0.0.1:80"}, False),
    ("iTP: Local, eTP: Local, all endpoints remote", None, svc(itp_local=True, etp_local=True, node_port=8080),
     [ep("10.0.0.0:80"), ep("10.0.0.1:80")],
     {"10.0.0.0:80", "10.0.0.1:80"}, set(), {"10.0.0.0:80", "10.0.0.1:80"}, False),
    ("iTP: Local, eTP: Local, all endpoints remote and terminating", None,
     svc(itp_local=True, etp_local=True, node_port=8080),
     [ep("10.0.0.0:80", ready=False, serving=True, terminating=True),
      ep("10.0.0.1:80", ready=False, serving=True, terminating=True)],
     {"10.0.0.0:80", "10.0.0.1:80"}, set(), {"10.0.0.0:80", "10.0.0.1:80"}, True),
    ("iTP: Cluster, eTP: Local, with terminating endpoints", None, svc(etp_local=True, node_port=8080),
     [ep("10.0.0.0:80"), ep("10.0.0.1:80", ready=False, serving=False, local=True),
      ep("10.0.0.2:80", ready=False, serving=True, terminating=True, local=True),
      ep("10.0.0.3:80", ready=False, serving=True, terminating=True)],
     {"10.0.0.0:80"}, {"10.0.0.2:80"}, {"10.0.0.0:80", "10.0.0.2:80"}, False),
    ("externalTrafficPolicy ignored if not externally accessible", None, svc(etp_local=True),
     [ep("10.0.0.0:80"), ep("10.0.0.1:80", local=True)],
     {"10.0.0.0:80", "10.0.0.1:80"}, None, {"10.0.0.0:80", "10.0.0.1:80"}, False),
    ("no cluster endpoints for iTP:Local internal-only service", None, svc(itp_local=True),
     [ep("10.0.0.0:80"), ep("10.0.0.1:80", local=True)], None, {"10.0.0.1:80"}, {"10.0.0.1:80"}, False),

    # ---- ours: node hints (PreferSameNode) and hints with fallbacks, per topologyModeFromHints ----
    ("ours: node hints for this node win over zone hints", "zone-a", svc(),
     [ep("10.0.1.1:80", nodes={NODE}, zones={"zone-a"}), ep("10.0.1.2:80", nodes={"node-a2"}, zones={"zone-a"}),
      ep("10.0.1.3:80", nodes={"node-b1"}, zones={"zone-b"})],
     {"10.0.1.1:80"}, None, None, False),
    ("ours: no node hint for this node falls back to zone hints", "zone-a", svc(),
     [ep("10.0.1.2:80", nodes={"node-a2"}, zones={"zone-a"}), ep("10.0.1.3:80", nodes={"node-b1"}, zones={"zone-b"})],
     {"10.0.1.2:80"}, None, None, False),
    ("ours: a ready endpoint without a node hint turns node topology off (zone still applies)", "zone-a", svc(),
     [ep("10.0.1.1:80", nodes={NODE}, zones={"zone-a"}), ep("10.0.1.2:80", zones={"zone-a"}),
      ep("10.0.1.3:80", nodes={"node-b1"}, zones={"zone-b"})],
     {"10.0.1.1:80", "10.0.1.2:80"}, None, None, False),
    ("ours: node hints only, none for this node and no zone hints: no topology", "zone-a", svc(),
     [ep("10.0.1.2:80", nodes={"node-a2"}), ep("10.0.1.3:80", nodes={"node-b1"})],
     {"10.0.1.2:80", "10.0.1.3:80"}, None, None, False),
    ("ours: unready endpoint without hints does not turn topology off", "zone-a", svc(),
     [ep("10.0.1.1:80", zones={"zone-a"}), ep("10.0.1.2:80", zones={"zone-b"}), ep("10.0.1.3:80", ready=False)],
     {"10.0.1.1:80"}, None, None, False),
    ("ours: only terminating endpoints: fallback ignores zone hints", "zone-a", svc(),
     [ep("10.0.1.1:80", zones={"zone-a"}, ready=False, serving=True, terminating=True),
      ep("10.0.1.2:80", zones={"zone-b"}, ready=False, serving=True, terminating=True)],
     {"10.0.1.1:80", "10.0.1.2:80"}, None, None, False),
    ("ours: zone's ready endpoints gone (terminating there): other zones' ready ones, not the terminating",
     "zone-a", svc(),
     [ep("10.0.1.1:80", zones={"zone-a"}, ready=False, serving=True, terminating=True),
      ep("10.0.1.2:80", zones={"zone-b"}), ep("10.0.1.3:80", zones={"zone-c"})],
     {"10.0.1.2:80", "10.0.1.3:80"}, None, None, False),
    ("ours: iTP=Local with zone hints: local endpoints of another zone still used", "zone-a",
     svc(itp_local=True),
     [ep("10.0.1.1:80", zones={"zone-b"}, local=True), ep("10.0.1.2:80", zones={"zone-a"})],
     None, {"10.0.1.1:80"}, None, False),
    ("ours: iTP=Local, eTP=Cluster NodePort with node hints: cluster narrowed, local not", "zone-a",
     svc(itp_local=True, node_port=30080),
     [ep("10.0.1.1:80", nodes={NODE}, zones={"zone-a"}, local=True),
      ep("10.0.1.4:80", nodes={NODE}, zones={"zone-a"}, local=True, ready=False, serving=False),
      ep("10.0.1.2:80", nodes={"node-b1"}, zones={"zone-b"})],
     {"10.0.1.1:80"}, {"10.0.1.1:80"}, {"10.0.1.1:80"}, False),
    ("ours: eTP=Local with a terminating local endpoint and zone topology: merged", "zone-a",
     svc(etp_local=True, node_port=30080),
     [ep("10.0.1.1:80", zones={"zone-b"}, local=True, ready=False, serving=True, terminating=True),
      ep("10.0.1.2:80", zones={"zone-a"}), ep("10.0.1.3:80", zones={"zone-b"})],
     {"10.0.1.2:80"}, {"10.0.1.1:80"}, {"10.0.1.1:80", "10.0.1.2:80"}, False),
]


@pytest.mark.parametrize("name,zone,service,endpoints,cluster,local,reachable,only_remote", CASES,
                         ids=[c[0] for c in CASES])
def test_categorize_endpoints(name, zone, service, endpoints, cluster, local, reachable, only_remote):
    """Upstream: TestCategorizeEndpoints in kubernetes/kubernetes pkg/proxy/topology_test.go."""
    sets = categorize(service, tuple(endpoints), NodeTopology(node_name=NODE, zone=zone or ""))
    if cluster is None:
        assert sets.cluster == ()
        assert not service.uses_cluster_endpoints
    else:
        assert addrs(sets.cluster) == cluster
    if local is None:
        assert sets.local == ()
        assert not service.uses_local_endpoints
    else:
        assert addrs(sets.local) == local
    if reachable is None:
        reachable = cluster if local is None else local
    assert addrs(sets.all_reachable) == reachable
    assert sets.has_any == (bool(reachable) or only_remote)


@pytest.mark.parametrize("endpoints,zone,mode", [
    ((ep("1.1.1.1:80", nodes={NODE}, zones={"z"}),), "z", PREFER_SAME_NODE),
    ((ep("1.1.1.1:80", nodes={"other"}, zones={"z"}),), "z", PREFER_SAME_ZONE),
    ((ep("1.1.1.1:80", nodes={"other"}, zones={"y"}),), "z", NO_TOPOLOGY),
    ((ep("1.1.1.1:80", nodes={NODE}, ready=False),), "z", NO_TOPOLOGY),  # no ready endpoint: no hints to use
    ((), "z", NO_TOPOLOGY),
])
def test_topology_mode_from_hints(endpoints, zone, mode):
    """Upstream: topologyModeFromHints in pkg/proxy/topology.go (PreferSameNode first, then zone)."""
    assert topology_mode(endpoints, NodeTopology(node_name=NODE, zone=zone)) == mode


def test_without_a_topology_hints_are_ignored():
    """A caller that does not know its node (NodeTopology()) gets every ready endpoint."""
    eps = (ep("10.0.0.1:80", zones={"zone-a"}, nodes={NODE}), ep("10.0.0.2:80", zones={"zone-b"}, nodes={"x"}))
    assert addrs(categorize(svc(), eps).cluster) == {"10.0.0.1:80", "10.0.0.2:80"}
