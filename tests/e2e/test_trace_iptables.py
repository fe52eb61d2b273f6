"""`lab trace` (iptables mode) on seed 000's cluster, checked against real packets from `lab probe`.

For each flow the trace's verdict must be what the packets show: dnat ↔ a pod answered (and only
pods among the trace's backends, seeing the source the trace says), drop ↔ timeout, reject ↔
refused. The flows are the issue's: outside → worker2's NodePort (eTP=Local, no pod there), outside
→ worker3's NodePort (its own pod only, client address kept), worker2 → its own NodePort (every
pod, masqueraded), a pod → a Service without endpoints; plus a ClusterIP from a pod on another node.

Both commands run through the CLI, as a user runs them: `lab trace` itself runs `ebpf-proxy trace`
inside the entry node's network namespace, which reads the node's live rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from ebpf_proxy.lab.demo import CLUSTER_IP, NODE_PORT, service_manifest

pytestmark = [pytest.mark.root, pytest.mark.e2e]

EMPTY_IP = "10.96.7.7"
EMPTY = f"""apiVersion: v1
kind: Service
metadata: {{name: nobody, namespace: default}}
spec:
  clusterIP: {EMPTY_IP}
  selector: {{app: nobody}}
  ports: [{{name: http, port: 80, targetPort: 80}}]
"""
W2, W3 = "172.20.20.16", "172.20.20.17"
POD_W1, POD_W3 = "10.244.5.4:80", "10.244.4.3:80"
PROBE_OUTCOME = {"dnat": "ok", "drop": "timeout", "reject": "refused"}


@pytest.fixture(scope="module")
def lab():
    name = f"iptr{os.getpid() % 10000}"  # "trc…" is another suite's prefix
    destroy(name)
    try:
        lab = Lab.up(name, None, mode="iptables")  # the default topology is seed 000's cluster
        lab.apply_manifests(service_manifest("Local") + "---\n" + EMPTY, "trace-test")
        lab.wait_converged()
        yield lab
    finally:
        destroy(name)


def cli(lab, *args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "ebpf_proxy", "lab", *args, "--name", lab.name],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def trace(lab, where: str, target: str) -> dict:
    code, out, err = cli(lab, "trace", "--from", where, "--to", target, "--json")
    assert code == 0, err
    assert out.count("\n") == 1, f"--json prints exactly one line: {out!r}"
    return json.loads(out)


def probe(lab, where: str, target: str, count: int) -> dict:
    code, out, err = cli(lab, "probe", "--from", where, "--to", target, "--json", "--count", str(count),
                         "--timeout", "0.5")
    assert code == 0, err
    return json.loads(out)


CASES = [
    # id, from, to, verdict, backends, masquerade, the source a backend sees
    ("outside-to-worker2-nodeport", "outside", f"{W2}:{NODE_PORT}", "drop", [], False, None),
    ("outside-to-worker3-nodeport", "outside", f"{W3}:{NODE_PORT}", "dnat", [POD_W3], False, "203.0.113.5"),
    ("worker2-to-own-nodeport", "worker2", f"{W2}:{NODE_PORT}", "dnat", [POD_W3, POD_W1], True, W2),
    # worker1 passes it on unchanged; worker2 decides (lab trace follows it there)
    ("worker1-to-worker2-nodeport", "worker1", f"{W2}:{NODE_PORT}", "drop", [], False, None),
    ("pod-to-service-without-endpoints", "my-nginx-1", f"{EMPTY_IP}:80", "reject", [], False, None),
    ("pod-on-worker3-to-cluster-ip", "my-nginx-2", f"{CLUSTER_IP}:80", "dnat", [POD_W3, POD_W1], True, None),
]


@pytest.mark.parametrize("where, target, verdict, backends, masquerade, seen", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_trace_says_what_the_packets_show(lab, where, target, verdict, backends, masquerade, seen):
    t = trace(lab, where, target)
    assert (t["datapath"], t["verdict"], t["backends"]) == ("iptables", verdict, backends), t
    assert t["service"] in ("default/my-nginx:http", "default/nobody:http")
    if seen is not None:  # (a pod calling its own service is masqueraded only when it lands on itself)
        assert (t["masquerade"], t["sourceAfter"]) == (masquerade, seen), t
    if verdict == "drop":
        assert "no local endpoints" in t["reason"] and t["steps"][-1]["chain"] == "KUBE-EXTERNAL-SERVICES"

    count = 1 if verdict == "drop" else 12
    p = probe(lab, where, target, count)
    outcomes = {r["outcome"] for r in p["results"]}
    assert outcomes == {PROBE_OUTCOME[verdict]}, (t, p)
    if verdict == "dnat":
        reached = {r["backend"] for r in p["results"]}
        assert reached <= set(t["backends"]), (t, p)
        if seen is not None:
            assert {r["source"].rpartition(":")[0] for r in p["results"]} == {seen}


def test_human_output_names_the_entry_node_and_the_deciding_rule(lab):
    code, out, _ = cli(lab, "trace", "--from", "outside", "--to", f"{W2}:{NODE_PORT}")
    assert code == 0
    first, story, *steps = out.splitlines()
    assert first == "on worker2: 172.20.20.16 is worker2's address, entering through eth0 (origin external)"
    assert story.startswith("[iptables] drop default/my-nginx:http: default/my-nginx:http has no local endpoints")
    assert "externalTrafficPolicy: Local" in story
    assert steps[-1].split() == ["INPUT", "KUBE-EXTERNAL-SERVICES", "DROP", '"default/my-nginx:http', "has", "no",
                                 "local", 'endpoints"']


def test_unknown_places_and_bad_targets_are_named(lab):
    code, _, err = cli(lab, "trace", "--from", "nowhere", "--to", f"{W2}:{NODE_PORT}")
    assert code == 1 and "'nowhere' is not a node, pod or client" in err
    code, _, err = cli(lab, "trace", "--from", "outside", "--to", W2)
    assert code == 1 and "has no port" in err


# ---- the device a pod's packets enter by decides, with an interface detector -------------------------

LT_TOPOLOGY = Path(__file__).parent / "local_traffic_topology.yaml"  # worker1's pods on bridge cbr0
LT_LOCAL = """apiVersion: v1
kind: Service
metadata: {name: tt-local}
spec:
  type: NodePort
  clusterIP: 10.96.110.20
  externalTrafficPolicy: Local
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 80, nodePort: 30320}]
"""
WEB_1, WEB_2 = "10.244.5.4:80", "10.244.4.3:80"  # on worker1 (bridged) and worker3


@pytest.fixture(scope="module")
def bridged_lab():
    name = f"iptb{os.getpid() % 10000}"
    destroy(name)
    try:
        lab = Lab.up(name, str(LT_TOPOLOGY), mode="iptables")
        lab.apply_manifests(LT_LOCAL, "trace-test")
        lab.wait_converged()
        yield lab
    finally:
        destroy(name)


@pytest.mark.parametrize("mode, backends", [("BridgeInterface", [WEB_2, WEB_1]), ("InterfaceNamePrefix", [WEB_1])])
def test_a_bridged_pod_enters_through_the_bridge(bridged_lab, mode, backends):
    """client-a hangs off worker1's bridge cbr0: `-i cbr0` (BridgeInterface) sees it as local and
    short-circuits it to every endpoint; `-i lxc+` (InterfaceNamePrefix) does not, so it gets
    worker1's endpoint only. The trace must enter by the bridge, as the kernel does."""
    bridged_lab.set_proxy_config({"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
                                  "detectLocalMode": mode,
                                  "detectLocal": {"bridgeInterface": "cbr0", "interfaceNamePrefix": "lxc"}})
    bridged_lab.wait_converged()
    client_a = next(p.ip for p in bridged_lab.topology.pods if p.name == "client-a")
    t = trace(bridged_lab, "client-a", "172.20.20.15:30320")
    assert (t["verdict"], t["backends"], t["masquerade"], t["sourceAfter"]) == ("dnat", backends, False, client_a), t
    p = probe(bridged_lab, "client-a", "172.20.20.15:30320", 12)
    assert {r["outcome"] for r in p["results"]} == {"ok"}
    assert {r["backend"] for r in p["results"]} <= set(backends)
    assert {r["source"].rpartition(":")[0] for r in p["results"]} == {client_a}
