"""Services over IPv6 and IPv4 with the agents running, on a dual-stack and an IPv6-only lab, in
every mode: seed 000's three NodePort externalTrafficPolicy=Local cases, a ClusterIP from a pod,
and REJECT for a Service without endpoints, all with real packets.

The labs are examples/dualstack.yaml (both families everywhere, IPv4 primary) and
examples/ipv6only.yaml (the same cluster, IPv6 only; in the modes the IPv6-only run of the
scenario table, test_scenarios.py, does not cover): my-nginx-1 on worker1, my-nginx-2 on
worker3, nothing on worker2, `outside` routed through worker3. Both families are checked in
both modes: in ebpf mode the eBPF programs serve both (ip6tables holds no rules there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.e2e.conftest import E2E_IPV6_MODES, E2E_MODES

pytestmark = [pytest.mark.root, pytest.mark.e2e]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPES = {"dual": EXAMPLES / "dualstack.yaml", "v6only": EXAMPLES / "ipv6only.yaml"}
NODE_PORT = 30080
PODS = {"my-nginx-1", "my-nginx-2"}


# The IPv6-only shape in the modes the IPv6 scenario table (test_scenarios.py) does not run.
SHAPE_MODES = [("dual", m) for m in E2E_MODES] + [("v6only", m) for m in E2E_MODES if m not in E2E_IPV6_MODES]


@pytest.fixture(scope="module", params=SHAPE_MODES, ids=lambda p: f"{p[0]}-{p[1]}")
def lab(request):
    shape, mode = request.param
    name = f"ds{shape[:2]}{mode[:2]}{os.getpid() % 10000}"
    destroy(name)
    lab = Lab.up(name, str(SHAPES[shape]), mode=mode)
    try:
        api = lab.api()
        try:
            policy = {"ipFamilyPolicy": "RequireDualStack"} if shape == "dual" else {}
            api.apply(_service("np-local", type="NodePort", externalTrafficPolicy="Local",
                               ports=[{"port": 80, "nodePort": NODE_PORT}], **policy))
            api.apply(_service("cip", ports=[{"port": 80}], **policy))
            api.apply(_service("empty", selector={"app": "nobody"}, ports=[{"port": 80}], **policy))
        finally:
            api.close()
        lab.wait_converged()
        yield shape, lab
    finally:
        destroy(name)


def _service(name: str, **spec) -> dict:
    spec.setdefault("selector", {"app": "my-nginx"})
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


def test_nodeport_local_to_a_node_without_a_pod_is_dropped(lab):
    shape, lab = lab
    for family in _families(shape):
        report = lab.probe("outside", _target(_node_ip(lab, "worker2", family), NODE_PORT), count=3)
        assert report.outcomes == {"timeout"}, (family, report.to_json())


def test_nodeport_local_to_a_node_with_a_pod_reaches_it_and_keeps_the_client_ip(lab):
    shape, lab = lab
    for family in _families(shape):
        report = lab.probe("outside", _target(_node_ip(lab, "worker1", family), NODE_PORT), count=10)
        assert report.all_ok and report.pods == {"my-nginx-1"}, (family, report.to_json())
        assert report.source_ips == {_client_ip(lab, family)}, (family, report.to_json())


def test_a_node_to_its_own_nodeport_reaches_any_pod_masqueraded(lab):
    shape, lab = lab
    for family in _families(shape):
        node_ip = _node_ip(lab, "worker1", family)
        report = lab.probe("worker1", _target(node_ip, NODE_PORT), count=30)
        assert report.all_ok and report.pods == PODS, (family, report.to_json())
        # masqueraded: the pods see an address of worker1, never a client address
        assert report.source_ips <= set(lab.topology.node("worker1").all_ips), (family, report.to_json())


def test_cluster_ip_from_a_pod_spreads_over_the_pods_keeping_the_pod_ip_but_in_hairpin(lab):
    """Rules 1 and 3: the other pod sees the client pod's own address; the client pod reaching
    itself through the Service is masqueraded (KUBE-SEP's `-s <endpoint> -j KUBE-MARK-MASQ`)."""
    shape, lab = lab
    for family in _families(shape):
        pod_ip = next(ip for ip in lab.topology.pod("my-nginx-1").ips if (":" in ip) == (family == 6))
        report = lab.probe("my-nginx-1", _target(_cluster_ip(lab, "cip", family), 80), count=30)
        assert report.all_ok and report.pods == PODS, (family, report.to_json())
        for result in report.results:
            source = result.source.rsplit(":", 1)[0].strip("[]")
            if result.pod == "my-nginx-2":
                assert source == pod_ip, (family, report.to_json())
            else:
                assert source in lab.topology.node("worker1").all_ips, (family, report.to_json())


def test_a_service_without_endpoints_is_rejected(lab):
    """REJECT answers with ICMP(v6) port unreachable. Over IPv6 the kernel's TCP drops the error
    to the first SYN when it arrives while connect() still holds the socket (the whole path runs in
    that call's softirq: TcpExtLockDroppedIcmps), so the refusal comes with the SYN's retransmission
    after ~1 s, as under kube-proxy: hence the 3 s probe timeout."""
    shape, lab = lab
    for family in _families(shape):
        for source in ("worker2", "my-nginx-1"):
            report = lab.probe(source, _target(_cluster_ip(lab, "empty", family), 80), count=2, timeout=3.0)
            assert report.outcomes == {"refused"}, (family, source, report.to_json())


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


def test_the_audit_finds_and_repairs_drift_of_the_ipv6_datapath(lab):
    """A lost IPv6 NodePort (a flushed ip6tables chain; in ebpf mode, a frontend gone from
    epx_svc6) is drift of the IPv6 proxier: `lab audit` names it (as IPv6 on a dual-stack node,
    whose primary family is IPv4), repairs it, and the NodePort answers again."""
    from ebpf_proxy.lab import audit as lab_audit

    shape, lab = lab
    what = _break_ipv6_nodeport(lab)
    target = _target(_node_ip(lab, "worker1", 6), NODE_PORT)
    assert lab.probe("outside", target).outcomes == {"refused"}  # to the node itself: nothing listens

    report = lab_audit.run(lab, nodes=["worker1"], repair=True)["worker1"]
    drifted = {(d["kind"], d["what"]) for d in report["drifts"]}
    prefix = "IPv6 " if shape == "dual" else ""
    assert drifted == {("missing", f"{prefix}{what}")}, report
    assert report["repaired"] and report["exit"] == 1, report
    assert lab_audit.run(lab, nodes=["worker1"])["worker1"]["exit"] == 0
    assert lab.probe("outside", target).all_ok


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
        # IPv6: 4 frontends (2 cluster IPs, np-local's cluster IP and NodePort) x the senders that are
        # not their backends; IPv4: the same and worker1's own connection to 127.0.0.1:<nodePort>
        assert report["flows"] == {"dual": 21, "v6only": 10}[shape], (node, report)
        kernel = "ebpf" if lab.mode == "ebpf" else "ip6tables (live)"
        assert {"ip6tables (rendered)", kernel} <= set(report["tracers"]), report["tracers"]
