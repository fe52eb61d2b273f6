"""k8s/kubeconfig.py: the official loader, run in a child, sets the agent's client configuration
exactly as it would in the agent's own process; an expiring credential is loaded in-process, so
that the loader's refresh hook lives where the requests are made."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
from kubernetes.client.configuration import Configuration
from kubernetes.config.kube_config import load_kube_config

from ebpf_proxy.k8s import kubeconfig
from ebpf_proxy.k8s.client import ClientConfigError, make_api_client

CA_PEM = "-----BEGIN CERTIFICATE-----\nTUlJQ0EK\n-----END CERTIFICATE-----\n"
CERT_PEM = "-----BEGIN CERTIFICATE-----\nY2xpZW50Cg==\n-----END CERTIFICATE-----\n"
KEY_PEM = "-----BEGIN PRIVATE KEY-----\na2V5Cg==\n-----END PRIVATE KEY-----\n"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _write(tmp_path: Path, user: dict, cluster: dict | None = None) -> str:
    cluster = cluster or {"server": "https://192.0.2.1:6443", "certificate-authority-data": _b64(CA_PEM),
                          "tls-server-name": "kubernetes"}
    path = tmp_path / "kubeconfig.conf"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return str(path)


def _official(path: str) -> Configuration:
    configuration = Configuration()
    load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)
    return configuration


def _same_settings(ours: Configuration, theirs: Configuration) -> None:
    """Every setting the loader writes: equal values, and files of equal content (each side wrote
    its own copy of inline data)."""
    for name in kubeconfig.SETTINGS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if name in ("ssl_ca_cert", "cert_file", "key_file") and a and b and a != b:
            assert Path(a).read_bytes() == Path(b).read_bytes(), name
        else:
            assert a == b, name


def test_a_token_kubeconfig_gives_the_settings_the_official_loader_gives(tmp_path):
    path = _write(tmp_path, {"token": "s3cr3t"})
    ours = Configuration()
    kubeconfig.load(path, ours)
    _same_settings(ours, _official(path))
    assert ours.api_key == {"BearerToken": "Bearer s3cr3t"} and ours.host == "https://192.0.2.1:6443"
    ca = Path(ours.ssl_ca_cert)
    assert ca.read_text() == CA_PEM, "the CA file the child wrote outlived the child"
    assert stat.S_IMODE(ca.parent.stat().st_mode) == 0o700


def test_client_certificates_and_a_token_file_as_a_kubeadm_kubeconfig(tmp_path):
    """kube-proxy's kubeconfig.conf names a token file and a CA file; a node's own uses inline
    client certificates."""
    (tmp_path / "token").write_text("from-a-file")
    (tmp_path / "ca.crt").write_text(CA_PEM)
    path = _write(tmp_path, {"tokenFile": str(tmp_path / "token"), "client-certificate-data": _b64(CERT_PEM),
                             "client-key-data": _b64(KEY_PEM)},
                  {"server": "https://192.0.2.1:6443", "certificate-authority": str(tmp_path / "ca.crt")})
    ours = Configuration()
    kubeconfig.load(path, ours)
    _same_settings(ours, _official(path))
    assert ours.api_key == {"BearerToken": "Bearer from-a-file"}
    assert ours.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert Path(ours.cert_file).read_text() == CERT_PEM and Path(ours.key_file).read_text() == KEY_PEM


def test_an_expiring_credential_is_loaded_here_with_its_refresh_hook(tmp_path):
    """An exec plugin's token that expires: the loader's hook must re-run the plugin in the
    process that sends the requests."""
    plugin = tmp_path / "plugin.sh"
    plugin.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
               "status": {"token": "short-lived", "expirationTimestamp": "2099-01-01T00:00:00Z"}}'
        """))
    plugin.chmod(0o755)
    path = _write(tmp_path, {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
                                      "interactiveMode": "Never"}})
    ours = Configuration()
    kubeconfig.load(path, ours)
    assert ours.api_key == {"BearerToken": "Bearer short-lived"}
    assert ours.refresh_api_key_hook is not None


def test_a_token_that_does_not_expire_needs_no_hook(tmp_path):
    """The loader's hook for a static token only writes the same settings again."""
    ours = Configuration()
    kubeconfig.load(_write(tmp_path, {"token": "s3cr3t"}), ours)
    assert ours.refresh_api_key_hook is None


def test_a_bad_kubeconfig_names_the_flag_the_file_and_the_loaders_reason(tmp_path):
    path = tmp_path / "broken.conf"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
                                "contexts": [], "clusters": [], "users": []}))
    with pytest.raises(ClientConfigError, match=rf"--kubeconfig {path}: .*nowhere"):
        make_api_client(str(path))
    missing = tmp_path / "missing.conf"
    with pytest.raises(ClientConfigError, match=rf"--kubeconfig {missing}: .*"):
        make_api_client(str(missing))


def test_master_overrides_the_kubeconfigs_server(tmp_path):
    api = make_api_client(_write(tmp_path, {"token": "s3cr3t"}), master="https://198.51.100.7:6443")
    assert api.configuration.host == "https://198.51.100.7:6443"
    assert api.configuration.api_key == {"BearerToken": "Bearer s3cr3t"}
    assert os.path.exists(api.configuration.ssl_ca_cert)


def test_no_directory_is_left_when_nothing_inline_was_written(tmp_path):
    (tmp_path / "ca.crt").write_text(CA_PEM)
    before = {e.name for e in os.scandir(tempfile.gettempdir())}
    ours = Configuration()
    kubeconfig.load(_write(tmp_path, {"token": "s3cr3t"}, {"server": "https://192.0.2.1:6443",
                                                          "certificate-authority": str(tmp_path / "ca.crt")}), ours)
    after = {e.name for e in os.scandir(tempfile.gettempdir())}
    assert not [n for n in after - before if n.startswith(kubeconfig.DIR_PREFIX)]


def test_a_killed_agents_certificates_are_removed_by_the_next_start(tmp_path):
    """kill -9 skips the exit hook: the directory names its owner's pid, and a start sweeps those
    whose owner is gone (not a live process's, not another tool's)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"{kubeconfig.DIR_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{kubeconfig.DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "ebpf-proxy-kubeconfig-notapid"
    for d in (dead, live, other):
        d.mkdir()
        (d / "key").write_text(KEY_PEM)
    assert kubeconfig.sweep_dead(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()
