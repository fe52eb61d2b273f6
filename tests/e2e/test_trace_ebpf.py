"""trace_ebpf on seed 000's cluster in ebpf mode: each explanation matches what `lab probe` sees.

The default topology (my-nginx pods on worker1 and worker3, none on worker2, a client outside),
an externalTrafficPolicy=Local NodePort over my-nginx and a Service without endpoints. Each trace
runs inside the node's network namespace, against that node's pinned programs, and the same flow
is then probed for real.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from ebpf_proxy.explain.ebpf_trace import trace_ebpf
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.lab import naming
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.lab.cluster import Lab, destroy

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.bpf]

NODE_PORT = 30294  # the article's
DEAD_VIP = "10.96.77.7"
MANIFESTS = f"""
apiVersion: v1
kind: Service
metadata: {{name: my-nginx}}
spec:
  type: NodePort
  selector: {{app: my-nginx}}
  externalTrafficPolicy: Local
  ports: [{{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: nobody}}
spec:
  clusterIP: {DEAD_VIP}
  selector: {{app: nobody}}
  ports: [{{name: http, port: 80, targetPort: 80}}]
"""
W1, W2, W3 = "172.20.20.15", "172.20.20.16", "172.20.20.17"
POD1, POD2 = "10.244.5.4", "10.244.4.3"
OUTSIDE = "203.0.113.5"
BOTH = (f"{POD2}:80", f"{POD1}:80")  # sorted as Trace sorts


@contextmanager
def ebpf_lab(prefix: str, topology: str | None, manifests: str, source: str, proxy_config: dict | None = None):
    """A lab in ebpf mode (a name of this process's, any leftover of it removed first) with
    `manifests` applied and every agent converged; destroyed on the way out, whatever happens."""
    name = f"{prefix}{os.getpid() % 10000}"
    destroy(name)
    lab = Lab.up(name, topology, mode="ebpf")
    try:
        if proxy_config:
            lab.set_proxy_config(proxy_config)
        lab.apply_manifests(manifests, source)
        lab.wait_converged()
        yield lab
    finally:
        destroy(name)


@pytest.fixture(scope="module")
def lab():
    with ebpf_lab("trc", None, MANIFESTS, "trace-ebpf") as lab:
        yield lab


def hosts(sources: set[str]) -> set[str]:
    return {src.rsplit(":", 1)[0] for src in sources}


def trace_on(lab, node: str, flow: FlowSpec, **kw):
    names = {(ip, NODE_PORT, "TCP"): "default/my-nginx:http" for ip in (W1, W2, W3)}
    return run_in_netns(naming.node_netns(lab.name, node), trace_ebpf, flow, lab.dir / "bpffs" / node,
                        names=names, **kw)


def test_outside_to_worker2_nodeport_is_dropped_for_externaltrafficpolicy(lab):
    t = trace_on(lab, "worker2", FlowSpec(OUTSIDE, W2, NODE_PORT, origin="external"))
    assert (t.verdict, t.reason.split(":")[0], t.backends, t.source_after) == \
        ("drop", "DROP_NO_LOCAL_EXTERNAL", (), None)
    assert t.service == "default/my-nginx:http"
    assert "externalTrafficPolicy=Local" in t.sentence()
    assert [st.hook for st in t.steps] == ["tc-ingress"], "no XDP by default (--bpf-xdp-mode off): TC drops it"
    report = lab.probe("outside", f"{W2}:{NODE_PORT}", timeout=1.0)
    assert report.summary["timeout"] == 1


def test_with_xdp_generic_the_drop_is_xdps_and_back_off_it_is_detached(lab):
    """An operator's --bpf-xdp-mode generic: worker2's restarted agent attaches xdp_lb to eth0, the
    trace names XDP as the hook that drops, and the packet is dropped for real; restarted with
    the default (off) again, the agent detaches it (an agent of an older default leaves none) and
    TC drops the same packet."""
    flow = FlowSpec(OUTSIDE, W2, NODE_PORT, origin="external")
    try:
        lab.stop_agent("worker2")
        lab.start_agent("worker2", extra_args=["--bpf-xdp-mode", "generic"])
        assert _xdp_on_eth0(lab, "worker2") == "xdpgeneric"
        t = trace_on(lab, "worker2", flow)
        assert (t.verdict, t.reason.split(":")[0], [st.hook for st in t.steps]) == \
            ("drop", "DROP_NO_LOCAL_EXTERNAL", ["xdp"])
        assert lab.probe("outside", f"{W2}:{NODE_PORT}", timeout=1.0).summary["timeout"] == 1
    finally:
        lab.stop_agent("worker2")
        lab.start_agent("worker2")
    assert _xdp_on_eth0(lab, "worker2") is None
    assert [st.hook for st in trace_on(lab, "worker2", flow).steps] == ["tc-ingress"]
    assert lab.probe("outside", f"{W2}:{NODE_PORT}", timeout=1.0).summary["timeout"] == 1


def _xdp_on_eth0(lab, node: str) -> str | None:
    """How an XDP program is attached to the node's eth0 (xdpgeneric, xdpdrv), or None."""
    from pyroute2 import IPRoute

    with IPRoute(netns=naming.node_netns(lab.name, node)) as ipr:
        link = ipr.get_links(ipr.link_lookup(ifname="eth0")[0])[0]
    return (link.get("xdp") or {}).get("IFLA_XDP_ATTACHED")


@pytest.mark.parametrize("client,node,flow,backends,masquerade,seen_as,programs,count,pods", [
    pytest.param("outside", "worker3", FlowSpec(OUTSIDE, W3, NODE_PORT, origin="external"), (f"{POD2}:80",),
                 False, OUTSIDE, [("tc-ingress", "tc_ingress"), ("tc-egress", "tc_egress")],
                 5, {"my-nginx-2"}, id="outside to worker3: its own pod, unmasqueraded"),
    pytest.param("worker2", "worker2", FlowSpec(W2, W2, NODE_PORT, origin="host"), BOTH,
                 True, W2, [("cgroup/connect4", "sock_connect4")],
                 20, {"my-nginx-1", "my-nginx-2"}, id="worker2 to itself: any pod, masqueraded"),
])
def test_nodeport_trace_is_what_the_probe_sees(lab, client, node, flow, backends, masquerade, seen_as,
                                               programs, count, pods):
    """The eTP=Local NodePort from outside (rule 5) and from the node itself (rule 7): the backends
    the trace names are the ones real connections reach, seen from the source it says."""
    t = trace_on(lab, node, flow)
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == ("dnat", backends, masquerade, seen_as)
    assert [(st.hook, st.unit.split("@")[0]) for st in t.steps] == programs
    report = lab.probe(client, f"{flow.dst}:{flow.dport}", count=count)
    assert report.pods == pods and hosts(report.sources) == {seen_as}
    assert {r.backend for r in report.results} == set(t.backends)


def test_pod_to_a_service_without_endpoints_is_rejected(lab):
    t = trace_on(lab, "worker1", FlowSpec(POD1, DEAD_VIP, 80, origin="pod"))
    assert (t.verdict, t.reason.split(":")[0], t.service, t.backends) == ("reject", "REJECT", None, ())
    assert t.steps[0].unit.startswith("tc_ingress@")
    report = lab.probe("my-nginx-1", f"{DEAD_VIP}:80")
    assert report.summary["refused"] == 1


def test_tracing_leaves_the_datapath_as_it_was(lab):
    from ebpf_proxy.datapath.ebpf import pins

    maps = pins.open_maps(lab.dir / "bpffs" / "worker3")
    try:
        conns = maps.count("epx_ct4")
        trace_on(lab, "worker3", FlowSpec(OUTSIDE, W3, NODE_PORT, sport=45678, origin="external"))
        assert maps.count("epx_ct4") == conns
        assert not [c for c in maps.connections() if c.sport == 45678]
    finally:
        maps.close()


# ---- the interface local-traffic detector needs the device the packet really enters through ----

BRIDGED_TOPOLOGY = os.path.join(os.path.dirname(__file__), "local_traffic_topology.yaml")
WEB_VIP = "10.96.110.77"
WEB = f"""
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  clusterIP: {WEB_VIP}
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 80}}]
"""


@pytest.fixture(scope="module")
def bridged_lab():
    """worker1's pods on a bridge, the others' on routed veths; detectLocalMode BridgeInterface."""
    config = {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
              "detectLocalMode": "BridgeInterface", "detectLocal": {"bridgeInterface": "cbr0"}}
    with ebpf_lab("trcb", BRIDGED_TOPOLOGY, WEB, "trace-ebpf-bridged", config) as lab:
        yield lab


@pytest.mark.parametrize("pod,node,masquerade", [("client-a", "worker1", False), ("client-c", "worker3", True)],
                         ids=["bridged pod: local", "routed pod: not local for BridgeInterface"])
def test_interface_detector_sees_the_pods_own_device(bridged_lab, pod, node, masquerade):
    src = bridged_lab.topology.pod(pod).ip
    t = trace_on(bridged_lab, node, FlowSpec(src, WEB_VIP, 80, origin="pod"))
    assert (t.verdict, t.masquerade) == ("dnat", masquerade)
    ingress = t.steps[0].unit.split("@", 1)[1]
    assert ingress != "cbr0", "tc_ingress runs on the pod's port of the bridge, not on the bridge"
    report = bridged_lab.probe(pod, f"{WEB_VIP}:80", count=6)
    expected_source = bridged_lab.topology.node(node).ip if masquerade else src
    assert report.summary["ok"] == 6 and hosts(report.sources) == {expected_source} == {t.source_after}
