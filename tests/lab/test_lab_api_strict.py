"""A lab whose topology needs what kube-apiserver allows: low node ports, a pod serving nothing,
Namespaces applied by the lab and created by kubectl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebpf_proxy.lab import state
from ebpf_proxy.lab.cluster import destroy

pytestmark = pytest.mark.root

CLI = [sys.executable, "-m", "ebpf_proxy"]
TOPOLOGY = """\
serviceNodePortRange: 3000-3100
nodes:
  - {name: worker1, ip: 172.20.30.15}
pods:
  - {name: web-1, node: worker1, labels: {app: web}}
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
    cli("lab", "up", "--name", name, "--mode", "none", "--topology", str(topology))
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
