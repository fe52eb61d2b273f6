"""A lab whose topology needs what kube-apiserver allows: low node ports, a pod serving nothing,
Namespaces applied by the lab and created by kubectl, and objects written with legacy IP forms,
which the agent must serve as kube-proxy does (upstream TestBadIPs, with real packets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebpf_proxy.lab import state
from ebpf_proxy.lab.cluster import Lab, destroy

pytestmark = pytest.mark.root

CLI = [sys.executable, "-m", "ebpf_proxy"]
TOPOLOGY = """\
serviceNodePortRange: 3000-3100
nodes:
  - {name: worker1, ip: 172.20.30.15}
pods:
  - {name: web-1, node: worker1, ip: 10.244.1.5, labels: {app: web}}
  - {name: client-1, node: worker1, listen: []}
"""
MANIFEST = """\
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: team-a}
spec:
  type: NodePort
  ports: [{port: 80, nodePort: 3001}]
"""


def cli(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(CLI + list(args), capture_output=True, text=True, input=input, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"ebpf-proxy {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result


@pytest.fixture(scope="module")
def lab_name(tmp_path_factory):
    name = f"as{os.getpid() % 100000}"
    topology = tmp_path_factory.mktemp("topo") / "topology.yaml"
    topology.write_text(TOPOLOGY)
    destroy(name)
    cli("lab", "up", "--name", name, "--mode", "iptables", "--topology", str(topology))
    try:
        yield name
    finally:
        destroy(name)


def kubectl(name: str, *args: str) -> subprocess.CompletedProcess:
    kubeconfig = state.lab_dir(name) / "kubeconfig"
    return subprocess.run([str(Path(sys.executable).parent / "kubectl"), "--kubeconfig", str(kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)


def test_a_pod_with_listen_empty_runs_no_server(lab_name):
    info = json.loads(cli("lab", "status", "--name", lab_name, "--json").stdout)
    pods = {p["name"]: p for p in info["pods"]}
    assert pods["client-1"]["listen"] == [] and not pods["client-1"]["alive"]
    assert pods["web-1"]["alive"]
    assert "serves nothing" in cli("lab", "status", "--name", lab_name).stdout
    assert cli("lab", "exec", "client-1", "--name", lab_name, "--", "true").returncode == 0


def test_node_port_range_reaches_the_api_server(lab_name):
    applied = cli("lab", "apply", "--name", lab_name, "-", input=MANIFEST).stdout.splitlines()
    assert applied == ["namespace/team-a applied", "service/web applied"]
    out = kubectl(lab_name, "get", "svc", "web", "-n", "team-a", "-o", "jsonpath={.spec.ports[0].nodePort}")
    assert out.returncode == 0 and out.stdout == "3001", out.stderr
    bad = MANIFEST.replace("name: web,", "name: web2,").replace("3001", "30080")
    failed = cli("lab", "apply", "--name", lab_name, "-", input=bad, check=False)
    assert failed.returncode != 0
    assert "The range of valid ports is 3000-3100" in failed.stderr + failed.stdout


def test_kubectl_creates_and_deletes_a_namespace(lab_name):
    assert kubectl(lab_name, "create", "namespace", "team-b").stdout == "namespace/team-b created\n"
    assert kubectl(lab_name, "delete", "namespace", "team-b").returncode == 0


BAD_IPS = """\
apiVersion: v1
kind: Service
metadata: {name: bad-ips}
spec:
  type: NodePort
  clusterIP: 10.96.00.041
  ports: [{name: p80, port: 80, nodePort: 3002}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: bad-ips-1
  labels: {kubernetes.io/service-name: bad-ips}
addressType: IPv4
endpoints: [{addresses: [10.244.001.005], nodeName: worker1}]
ports: [{name: p80, port: 80, protocol: TCP}]
"""


def test_bad_ips_are_served_at_their_normalised_addresses(lab_name):
    """TestBadIPs with packets: clusterIP 10.96.00.041 is 10.96.0.41, endpoint 10.244.001.005 is web-1."""
    lab = Lab.load(lab_name)
    lab.apply_manifests(BAD_IPS, "bad-ips")
    lab.wait_converged()
    assert "-d 10.96.0.41/32" in lab.iptables_save("worker1", "nat")
    for target in ("10.96.0.41:80", "172.20.30.15:3002"):
        report = lab.probe("client-1", target, count=3)
        assert report.summary["ok"] == 3 and report.by_pod == {"web-1": 3}, (target, report.summary)
