"""The host-routing fast path (bpf/lib/fib4.h) in the e2e lab: real connections take it, and what
the pods and clients see is what the scenario table checks on the slow path.

On the ebpf-mode e2e lab (shared with test_scenarios.py: no lab of its own), whose agents run with
the default --bpf-host-routing=auto (on: this kernel has the helpers). One test, four traffic
shapes, each checked by what the backend saw and by the EV_HOST_ROUTED_* counters of the node the
fast path should have served, read from its pinned maps:
  - pod -> ClusterIP -> pod on the same node (internalTrafficPolicy=Local pins it to worker1's
    web-1, from a client pod added on worker1 for the test): both directions bpf_redirect_peer;
  - pod -> ClusterIP -> pod on another node (client-1 on worker2): out with bpf_redirect_neigh,
    the replies into client-1 with bpf_redirect_peer;
  - NodePort from outside, externalTrafficPolicy=Cluster: masqueraded (web-1 local to worker1,
    web-2 through worker1's eth0 again: the lab's nodes send no ICMP redirects);
  - NodePort from outside, externalTrafficPolicy=Local: the client's address preserved.
The slow path (--bpf-host-routing=off) stays covered by the whole scenario table too: its
dual-stack shape runs with the switch off (scenarios_dualstack.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ebpf_proxy.datapath.ebpf import pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps
from ebpf_proxy.lab.topology import PodSpec
from tests.e2e.conftest import E2E_MODES
from tests.e2e.scenario_runner import check_probe, substitute

pytestmark = [pytest.mark.root, pytest.mark.e2e]

COUNT = 10
FAST = (s.Reason.EV_HOST_ROUTED_PEER, s.Reason.EV_HOST_ROUTED_NEIGH)
MANIFESTS = """
apiVersion: v1
kind: Service
metadata: {name: hr-local}
spec:
  clusterIP: 10.96.120.10
  internalTrafficPolicy: Local
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: hr-web}
spec:
  type: NodePort
  clusterIP: 10.96.120.11
  externalTrafficPolicy: Cluster
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 80, nodePort: 30120}]
---
apiVersion: v1
kind: Service
metadata: {name: hr-web-local}
spec:
  type: NodePort
  clusterIP: 10.96.120.12
  externalTrafficPolicy: Local
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 80, nodePort: 30121}]
"""


def fast_counts(lab, node: str) -> dict[s.Reason, int]:
    """The node's EV_HOST_ROUTED_* counters, from the maps its agent pinned."""
    maps = Maps.open_pinned(pins.pin_dir(Path(lab.dir) / "bpffs" / node))
    try:
        stats = maps.stats()
    finally:
        maps.close()
    return {r: stats.get(r, (0, 0))[0] for r in FAST}


def grown(before: dict, after: dict, reason: s.Reason) -> int:
    return after[reason] - before[reason]


@pytest.mark.parametrize("e2e_lab", [m for m in E2E_MODES if m == "ebpf"], indirect=True)  # the eBPF datapath's
def test_connections_take_the_fast_path_with_the_slow_paths_observations(e2e_lab):
    lab = e2e_lab
    lab.add_pod(PodSpec(name="hr-client", node="worker1", labels={"app": "hr-client"}, listen=()))
    lab.apply_manifests(MANIFESTS, "host-routing")
    problems: list[str] = []
    try:
        lab.wait_converged()

        def probe(where: str, to: str, expect: dict, node: str, *groups: tuple[s.Reason, ...]) -> None:
            """Probe, check what the backends saw, and that `node` counted at least one packet per
            connection under each group of reasons (a packet of a flow's first may wait for a
            neighbour on the slow path; the rest of its packets go fast)."""
            before = fast_counts(lab, node)
            report = lab.probe(where, to, count=COUNT)
            problems.extend(f"{where} -> {to}: {p}" for p in check_probe(report, expect, lab, where))
            after = fast_counts(lab, node)
            for group in groups:
                n = sum(grown(before, after, reason) for reason in group)
                if n < COUNT:
                    problems.append(f"{where} -> {to}: {node} counted {n} {'+'.join(r.name for r in group)}, "
                                    f"expected at least {COUNT}")

        peer, neigh = (s.Reason.EV_HOST_ROUTED_PEER,), (s.Reason.EV_HOST_ROUTED_NEIGH,)

        w1 = substitute("${worker1}", lab)
        probe("hr-client", "10.96.120.10:80", {"outcome": "ok", "pods": ["web-1"], "source": "${hr-client}"},
              "worker1", peer)
        probe("client-1", "10.96.120.11:80", {"outcome": "ok", "pods": ["web-1", "web-2"], "source": "${client-1}"},
              "worker2", neigh, peer)
        # web-1 is worker1's (peer), web-2 behind eth0 (neigh): which one answers is random
        probe("outside", f"{w1}:30120", {"outcome": "ok", "pods": ["web-1", "web-2"], "source": "${worker1}"},
              "worker1", FAST)
        probe("outside", f"{w1}:30121", {"outcome": "ok", "pods": ["web-1"], "source": "${outside}"},
              "worker1", peer)
    finally:
        lab.delete_manifests(MANIFESTS, "host-routing")
        lab.remove_pod("hr-client")
        lab.wait_converged()
    assert not problems, "\n".join(problems)
