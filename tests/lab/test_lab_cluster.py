"""The lab as users drive it: the CLI, the API server behind it, scale, and a clean teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ebpf_proxy.lab import naming, state
from ebpf_proxy.lab.cluster import Lab, LabError, destroy

pytestmark = pytest.mark.root

CLI = [sys.executable, "-m", "ebpf_proxy"]
SERVICE = """apiVersion: v1
kind: Service
metadata: {name: my-nginx}
spec:
  selector: {app: my-nginx}
  clusterIP: 10.96.200.10
  ports: [{name: http, port: 80, targetPort: 80}]
"""


def cli(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(CLI + list(args), capture_output=True, text=True, input=input, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"ebpf-proxy {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result


def leftovers(name: str) -> list[str]:
    """Anything of lab NAME still on the machine: namespaces, cgroups, processes, state."""
    found = [f"netns {n}" for n in naming.lab_netns_names(name)]
    if Path(naming.lab_cgroup(name)).exists():
        found.append(f"cgroup {naming.lab_cgroup(name)}")
    if state.lab_dir(name).exists():
        found.append(f"state {state.lab_dir(name)}")
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"/run/ebpf-proxy/labs/{name}/" in cmdline or f"epx-{name}-" in cmdline:
                found.append(f"process {pid}: {cmdline[:80]}")
    return found


@pytest.fixture(scope="module")
def lab_name():
    name = f"tl{os.getpid() % 100000}"
    destroy(name)
    started = time.monotonic()
    cli("lab", "up", "--name", name, "--mode", "none")
    print(f"\nlab up (default topology, no agents): {time.monotonic() - started:.2f} s")
    try:
        yield name
    finally:
        destroy(name)


def test_up_reports_the_default_topology(lab_name):
    info = json.loads(cli("lab", "status", "--name", lab_name, "--json").stdout)
    assert [n["name"] for n in info["nodes"]] == ["worker1", "worker2", "worker3"]
    assert {p["name"]: p["node"] for p in info["pods"]} == {"my-nginx-1": "worker1", "my-nginx-2": "worker3"}
    assert info["apiserver"]["alive"] and all(p["alive"] for p in info["pods"])


def test_kubectl_sees_the_lab_nodes_and_pods(lab_name):
    kubectl = Path(sys.executable).parent / "kubectl"
    kubeconfig = state.lab_dir(lab_name) / "kubeconfig"
    out = subprocess.run([str(kubectl), "--kubeconfig", str(kubeconfig), "get", "nodes,pods", "-o", "name"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) >= {"node/worker1", "node/worker2", "node/worker3",
                                       "pod/my-nginx-1", "pod/my-nginx-2"}


def test_probe_json_shape_and_direct_pod_traffic(lab_name):
    started = time.monotonic()
    out = cli("lab", "probe", "--name", lab_name, "--from", "worker2", "--to", "10.244.4.3:80",
              "--count", "200", "--json")
    print(f"\nlab probe --count 200 (node to pod, incl. CLI start-up): {time.monotonic() - started:.2f} s")
    data = json.loads(out.stdout)
    assert set(data) == {"from", "to", "results", "summary"}
    assert data["from"] == "worker2" and data["to"] == "10.244.4.3:80/tcp"
    assert data["summary"] == {"ok": 200, "refused": 0, "timeout": 0, "by_pod": {"my-nginx-2": 200}}
    first = data["results"][0]
    assert set(first) == {"outcome", "pod", "backend", "source"}
    assert first["backend"] == "10.244.4.3:80" and first["source"].startswith("172.20.20.16:")


def test_probe_outcomes_refused_and_timeout_for_real(lab_name):
    refused = json.loads(cli("lab", "probe", "--name", lab_name, "--from", "outside", "--to",
                             "10.244.5.4:81", "--json").stdout)
    assert refused["results"][0]["outcome"] == "refused"  # no listener: RST
    # 10.244.5.99 is routed to worker1, which has no such pod: nothing answers the ARP, nothing replies
    dropped = json.loads(cli("lab", "probe", "--name", lab_name, "--from", "my-nginx-2", "--to",
                             "10.244.5.99:80", "--timeout", "0.5", "--json", check=False).stdout)
    assert dropped["results"][0]["outcome"] in ("timeout",), dropped


def test_exec_runs_inside_the_node(lab_name):
    out = cli("lab", "exec", "--name", lab_name, "worker2", "--", "ip", "-4", "-o", "addr", "show", "dev", "eth0")
    assert "172.20.20.16" in out.stdout
    assert cli("lab", "exec", "--name", lab_name, "worker2", "--", "false", check=False).returncode == 1


def test_apply_scale_and_delete_keep_endpoint_slices_current(lab_name):
    path = state.lab_dir(lab_name) / "svc.yaml"
    path.write_text(SERVICE)
    cli("lab", "apply", "--name", lab_name, str(path))
    lab = Lab.load(lab_name)

    def slice_ips() -> set[str]:
        api = lab.api()
        try:
            slices = api.list("EndpointSlice", "default", "kubernetes.io/service-name=my-nginx")
        finally:
            api.close()
        return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}

    assert slice_ips() == {"10.244.5.4", "10.244.4.3"}
    out = cli("lab", "scale", "--name", lab_name, "my-nginx", "--replicas", "3").stdout
    assert "3 replicas" in out
    lab = Lab.load(lab_name)
    new = [p for p in lab.topology.pods if p.name not in ("my-nginx-1", "my-nginx-2")]
    assert len(new) == 1 and new[0].node == "worker2"  # the node with none
    deadline = time.monotonic() + 5
    while slice_ips() != {"10.244.5.4", "10.244.4.3", new[0].ip} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slice_ips() == {"10.244.5.4", "10.244.4.3", new[0].ip}
    report = lab.probe("outside", f"{new[0].ip}:80", count=2)
    assert report.to_json()["summary"]["by_pod"] == {new[0].name: 2}

    cli("lab", "scale", "--name", lab_name, "my-nginx", "--replicas", "2")
    lab = Lab.load(lab_name)
    assert [p.name for p in lab.topology.pods] == ["my-nginx-1", "my-nginx-2"]
    assert not Path(f"/run/netns/{naming.pod_netns(lab_name, new[0].name)}").exists()
    cli("lab", "delete", "--name", lab_name, str(path))
    assert slice_ips() == set()


def test_errors_name_the_bad_input(lab_name, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {name: w1, ip: 172.20.20.300}\n")
    out = cli("lab", "up", "--name", "tbad", "--topology", str(bad), check=False)
    assert out.returncode != 0 and "nodes[0].ip" in out.stderr
    assert "not a node, pod or client" in cli("lab", "exec", "--name", lab_name, "nowhere", "--", "true",
                                              check=False).stderr
    assert "is not up" in cli("lab", "status", "--name", "tnotthere", check=False).stderr
    with pytest.raises(LabError, match="--replicas"):
        Lab.load(lab_name).scale("my-nginx", -1)


def test_down_leaves_nothing_behind_even_without_state():
    name = f"td{os.getpid() % 100000}"
    lab = Lab.up(name, None, mode="iptables")
    try:
        assert lab.data["agents"] and all(a["pid"] for a in lab.data["agents"].values())
        state.remove(name)  # a crash that lost the state file
        assert name in naming.leftover_labs()  # what `lab down --all` removes
        # (not --all here: it would take down labs that other tests or a demo are using)
        assert cli("lab", "down", "--name", name, "--quiet").returncode == 0
    finally:
        destroy(name)
    assert leftovers(name) == []


@pytest.mark.bpf
def test_demo_tells_the_seed_000_story_in_both_modes_alike():
    name = f"tdemo{os.getpid() % 10000}"
    try:
        # through `make demo` itself, as the README tells users (its set-up step is a no-op by now)
        result = subprocess.run(["make", "-s", "-C", str(Path(__file__).parents[2]), "demo",
                                 f"DEMO_ARGS=--name {name} --modes iptables,ebpf --no-keep"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
    finally:
        destroy(name)
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.count("│") > 4]
    # a table row may wrap over several lines: join each case's cells back together
    cases: list[list[str]] = []
    for cells in rows:
        if cells[0] and (not cases or cells[1]):
            cases.append(cells)
        else:
            cases[-1] = [f"{a} {b}".strip() for a, b in zip(cases[-1], cells)]
    by_case = {(c[0], c[1]): c for c in cases}
    assert len(by_case) == 6, out
    for (case, policy), (_, _, _, iptables, ebpf) in by_case.items():
        assert iptables == ebpf, f"{case} ({policy}): iptables {iptables!r} but ebpf {ebpf!r}"
    assert by_case[("NodePort outside→worker2", "Local")][3] == "timeout (dropped)"
    assert by_case[("NodePort outside→worker3", "Local")][3] == "my-nginx-2 ← 203.0.113.5"
    assert "172.20.20.16" in by_case[("worker2 → its own NodePort", "Local")][3]
    assert leftovers(name) == []


def test_topology_kube_proxy_configuration_reaches_every_agent(tmp_path):
    topology = tmp_path / "one-node.yaml"
    topology.write_text("""
nodes: [{name: solo, ip: 172.20.21.10}]
pods: [{name: web-1, node: solo, labels: {app: web}}]
kubeProxyConfiguration:
  apiVersion: kubeproxy.config.k8s.io/v1alpha1
  kind: KubeProxyConfiguration
  iptables: {minSyncPeriod: 3s, masqueradeAll: true}
""")
    name = f"tk{os.getpid() % 10000}"
    try:
        lab = Lab.up(name, str(topology), mode="iptables")
        config = json.loads((state.lab_dir(name) / "kube-proxy-config.yaml").read_text())
        assert config["iptables"] == {"minSyncPeriod": "3s", "masqueradeAll": True}
        # masqueradeAll reached the agent: its rules masquerade even pod-sourced ClusterIP traffic
        nat = lab.iptables_save("solo", "nat")
        assert "-A KUBE-SERVICES" in nat
        lab.apply_manifests(SERVICE.replace("my-nginx", "web"), "test")
        lab.wait_converged()
        nat = lab.iptables_save("solo", "nat")
        svc_rule = next(line for line in nat.splitlines() if "10.96.200.10/32" in line and "KUBE-MARK-MASQ" in line)
        assert "! -s" not in svc_rule, f"masqueradeAll: every source is masqueraded, got {svc_rule}"
    finally:
        destroy(name)
    assert leftovers(name) == []
