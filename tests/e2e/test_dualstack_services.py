"""Services over IPv6 and IPv4 with the agents running, on the scenario table's dual-stack and
IPv6-only labs (conftest.py's `shaped_lab`: topology_dualstack.yaml and topology_ipv6.yaml, shared
with test_scenarios.py, so no lab is built twice), in every mode: `lab audit` finds and repairs
drift of the IPv6 datapath, and `lab trace` / `lab verify` explain the IPv6 proxier. In ebpf mode
the eBPF programs serve both families (ip6tables holds no rules there).

The labs: web-1 on worker1, web-2 on worker3, client-1 on worker2, `outside` routed through
worker1. Seed 000's three NodePort externalTrafficPolicy=Local cases, a ClusterIP from a pod
(hairpin included) and REJECT for a Service without endpoints are rows of the scenario table,
which runs on these labs in every shape and mode (EBPF_PROXY_E2E_DUALSTACK_MODES /
EBPF_PROXY_E2E_IPV6_MODES), so they are not probed again here.

The module applies its Services to a lab (RequireDualStack on the dual-stack lab) and deletes
them again after its tests there, leaving the shared lab as the scenario table expects it.
"""

from __future__ import annotations

import json
import os

import pytest

from ebpf_proxy.lab.cluster import Lab
from tests.e2e.conftest import E2E_MODES

pytestmark = [pytest.mark.root, pytest.mark.e2e]

NODE_PORT = 30190  # none of the scenario table's (30080-30087): its Services are gone by now, but still
PODS = {"web-1", "web-2"}


def _shaped(shape_modes: list[tuple[str, str]]):
    """Parametrize a test over conftest's shaped_lab (session-scoped, indirect, as test_scenarios.py
    does), so pytest runs it on the very lab the scenario table of that shape and mode uses."""
    return pytest.mark.parametrize("shaped_lab", shape_modes, ids=[f"{s}-{m}" for s, m in shape_modes],
                                   indirect=True, scope="session")


# The audit and trace/verify checks, this module's own (see the module docstring).
CHECKED = [(shape, m) for shape in ("dual", "ipv6") for m in E2E_MODES]


@pytest.fixture(scope="module")
def lab(shaped_lab):
    """(shape, the shared lab) with this module's Services, deleted again after the module's tests
    on that lab (pytest runs them one after the other, next to the scenario table's)."""
    lab = shaped_lab
    shape = "dual" if len(lab.topology.families) == 2 else "ipv6"
    policy = {"ipFamilyPolicy": "RequireDualStack"} if shape == "dual" else {}
    services = [_service("np-local", type="NodePort", externalTrafficPolicy="Local",
                         ports=[{"port": 80, "nodePort": NODE_PORT}], **policy),
                _service("cip", ports=[{"port": 80}], **policy),
                _service("empty", selector={"app": "nobody"}, ports=[{"port": 80}], **policy)]
    api = lab.api()
    try:
        for svc in services:
            api.apply(svc)
    finally:
        api.close()
    lab.wait_converged()
    try:
        yield shape, lab
    finally:
        api = lab.api()
        try:
            for svc in services:
                api.delete("Service", svc["metadata"]["name"])
        finally:
            api.close()
        lab.wait_converged()


def _service(name: str, **spec) -> dict:
    spec.setdefault("selector", {"app": "web"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": spec}


def _families(shape: str) -> list[int]:
    return [6, 4] if shape == "dual" else [6]


def _node_ip(lab: Lab, node: str, family: int) -> str:
    return next(ip for ip in lab.topology.node(node).ips if (":" in ip) == (family == 6))


def _client_ip(lab: Lab, family: int) -> str:
    return next(ip for ip in lab.topology.client("outside").ips if (":" in ip) == (family == 6))


def _cluster_ip(lab: Lab, service: str, family: int) -> str:
    api = lab.api()
    try:
        ips = api.get("Service", service)["spec"]["clusterIPs"]
    finally:
        api.close()
    return next(ip for ip in ips if (":" in ip) == (family == 6))


def _target(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _break_ipv6_nodeport(lab: Lab) -> str:
    """worker1 loses its IPv6 NodePort: the ip6tables KUBE-NODEPORTS chain flushed (iptables
    mode), the nodePort's frontend deleted from epx_svc6 (ebpf mode). Returns the object the
    audit names for it."""
    if lab.mode == "ebpf":
        from ebpf_proxy.datapath.ebpf import libbpf
        from ebpf_proxy.datapath.ebpf import structs as s
        from ebpf_proxy.datapath.ebpf.maps import be16

        fd = libbpf.obj_get(str(lab.dir / "bpffs" / "worker1" / "ebpf-proxy" / "epx_svc6"))
        try:
            assert libbpf.map_delete(fd, s.LB6Key(port=be16(NODE_PORT), proto=6))
        finally:
            os.close(fd)
        return "service frontend"
    backend = next(b for b in ("legacy", "nft")
                   if "KUBE-NODEPORTS -" in lab.exec("worker1", [f"ip6tables-{b}-save", "-t", "nat"],
                                                      capture_output=True, text=True).stdout)
    lab.exec("worker1", [f"ip6tables-{backend}", "-t", "nat", "-F", "KUBE-NODEPORTS"], check=True)
    return "iptables rule"


@_shaped(CHECKED)
def test_the_audit_finds_and_repairs_drift_of_the_ipv6_datapath(lab):
    """A lost IPv6 NodePort (a flushed ip6tables chain; in ebpf mode, a frontend gone from
    epx_svc6) is drift of the IPv6 proxier: `lab audit` names it (as IPv6 on a dual-stack node,
    whose primary family is IPv4), repairs it, and the NodePort answers again."""
    from ebpf_proxy.lab import audit as lab_audit

    shape, lab = lab
    what = _break_ipv6_nodeport(lab)
    repaired = False
    try:
        target = _target(_node_ip(lab, "worker1", 6), NODE_PORT)
        assert lab.probe("outside", target).outcomes == {"refused"}  # to the node itself: nothing listens

        report = lab_audit.run(lab, nodes=["worker1"], repair=True)["worker1"]
        repaired = report["repaired"]
        drifted = {(d["kind"], d["what"]) for d in report["drifts"]}
        prefix = "IPv6 " if shape == "dual" else ""
        assert drifted == {("missing", f"{prefix}{what}")}, report
        assert report["repaired"] and report["exit"] == 1, report
        assert lab_audit.run(lab, nodes=["worker1"])["worker1"]["exit"] == 0
        assert lab.probe("outside", target).all_ok
    finally:
        if not repaired:  # the lab is shared: never leave it broken (the agents do not repair it)
            lab_audit.run(lab, nodes=["worker1"], repair=True)


@_shaped(CHECKED)
def test_trace_and_verify_explain_the_ipv6_proxier(lab):
    """`lab trace` of seed 000's first two cases over IPv6 answers from the node's IPv6 proxier
    (its ip6tables rules; in ebpf mode the programs' IPv6 path), and `lab verify` agrees three
    ways on every flow of every family the nodes serve."""
    from ebpf_proxy.lab import trace as lab_trace
    from ebpf_proxy.lab import verify as lab_verify

    shape, lab = lab
    for node, want in (("worker2", ("drop", [])), ("worker1", ("dnat", ["[fd00:10:244:5::4]:80"]))):
        runs = lab_trace.run(lab, "outside", _target(_node_ip(lab, node, 6), NODE_PORT), as_json=True)
        plan_, done = runs[-1]
        assert plan_.node == node and done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert (got["verdict"], got["backends"]) == want, got
        if want[0] == "dnat":
            assert (got["masquerade"], got["sourceAfter"]) == (False, _client_ip(lab, 6)), got
    results = lab_verify.run(lab, nodes=["worker1", "worker2"])
    for node, report in results.items():
        assert report["exit"] == 0 and not report["mismatches"] and not report["errors"], (node, report)
        # IPv6: 4 frontends (2 cluster IPs, np-local's cluster IP and NodePort) x 5 senders (the node,
        # web-1, web-2, client-1, outside), less each frontend's own backends as senders (2 each for
        # the 3 with endpoints): 14; IPv4: the same and the node's own connection to 127.0.0.1:<nodePort>
        assert report["flows"] == {"dual": 14 + 15, "ipv6": 14}[shape], (node, report)
        kernel = "ebpf" if lab.mode == "ebpf" else "ip6tables (live)"
        assert {"ip6tables (rendered)", kernel} <= set(report["tracers"]), report["tracers"]
