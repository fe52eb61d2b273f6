"""make_api_client without --kubeconfig or --master: the pod's service account, through the
official in-cluster loader, imported as a submodule (the agent leaves kubernetes.config's __init__,
and with it the kubeconfig loader, out of its process: bareimport.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from kubernetes.config import incluster_config

from ebpf_proxy.k8s.client import ClientConfigError, make_api_client


@pytest.fixture
def service_account(tmp_path, monkeypatch):
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\nTUlJQ0EK\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return token, ca


def test_the_service_account_is_used_with_its_token_refreshed(service_account):
    token, ca = service_account
    api = make_api_client()
    configuration = api.configuration
    assert configuration.host == "https://10.96.0.1:443" and configuration.ssl_ca_cert == str(ca)
    assert configuration.auth_settings()["BearerToken"]["value"].lower() == "bearer sa-token"
    assert configuration.refresh_api_key_hook is not None, "bound tokens rotate: the loader re-reads the file"


def test_outside_a_pod_the_error_names_the_missing_flags(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClientConfigError, match="neither --kubeconfig nor --master .* in-cluster config is unusable"):
        make_api_client()


def test_the_in_cluster_path_leaves_the_kubeconfig_loader_out():
    code = textwrap.dedent("""
        import sys
        from ebpf_proxy.bareimport import slim_imports
        slim_imports()
        from ebpf_proxy.k8s.client import ClientConfigError, make_api_client
        try:
            make_api_client()
        except ClientConfigError:
            pass
        print("kubernetes.config.incluster_config" in sys.modules, "kubernetes.config.kube_config" in sys.modules)
    """)
    env_free = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env_free)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "False"]
