"""A kubeconfig read by the official client's loader in a short-lived child, not in the agent.

The loader (kubernetes.config.kube_config) imports, at module level, what only some kubeconfigs
need: requests and requests-oauthlib (OIDC), the generated ApiClient and pydantic, dateutil,
google-auth when installed. With the ApiClient, which the agent no longer uses either
(client.KubeApi), that was ~13 MiB of a 1-Service agent's 57 MiB RSS (issue 12), for a file read
once at start. So `load` runs the official loader in a child process (`python -m
ebpf_proxy.k8s.kubeconfig FILE DIR`): it resolves the current context as the client would
(server, CA, client certificate and key, token or tokenFile, TLS server name, proxy), writes
inline certificate data to files in DIR, which the agent keeps for its life, and prints the
resolved settings as JSON. The agent copies them into its own client Configuration.

A credential that expires (an exec plugin's or OIDC token) must be refreshed by the loader's hook,
which only lives in the process that loaded it: for those the child says so and the agent loads
the kubeconfig itself, at the loader's memory cost, as before.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from ebpf_proxy import procs
from ebpf_proxy.bareimport import slim_imports

# The Configuration attributes the official loader sets from a kubeconfig (KubeConfigLoader.
# _set_config): api_key holds the bearer token; the rest are copied as they are.
SETTINGS = ("host", "ssl_ca_cert", "cert_file", "key_file", "verify_ssl", "tls_server_name", "proxy", "api_key")
CHILD_TIMEOUT_SECONDS = 60.0
DIR_PREFIX = "ebpf-proxy-kubeconfig-"  # then the owning agent's pid


class KubeconfigError(Exception):
    """The kubeconfig cannot be used; the message is the official loader's."""


def prefetch(path: str) -> None:
    """Start reading the kubeconfig at `path` now, so that the child runs while the agent imports
    and starts (`ebpf-proxy run` calls this first): `load` then finds it done or nearly."""
    if path not in _started:
        try:
            _started[path] = _Child(path)
        except OSError:  # no temporary directory, no interpreter: `load` tries again, and says why
            pass


def load(path: str, configuration: Any) -> None:
    """Set `configuration` (a kubernetes.client Configuration) from the kubeconfig at `path`, as
    the official `load_kube_config(config_file=path, client_configuration=configuration,
    persist_config=False)` does; the loader runs in a child unless the credential expires."""
    child = _started.pop(path, None) or _Child(path)
    settings = child.settings()
    if settings is None:  # an expiring credential: its refresh hook must live here
        from kubernetes.config.kube_config import load_kube_config
        load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)
        return
    for name, value in settings.items():
        setattr(configuration, name, value)


class _Child:
    """One run of the loader in a child process, and the private directory (0700) where it writes
    inline certificates and keys: removed at once when it wrote none, else when the agent exits,
    or, after a kill -9, by the next agent's start (sweep_dead)."""

    def __init__(self, path: str) -> None:
        sweep_dead()
        self.files_dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, self.files_dir, True)
        self.process = subprocess.Popen([sys.executable, "-m", __name__, path, self.files_dir],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def settings(self) -> dict[str, Any] | None:
        """The settings the child resolved, or None when the credential expires."""
        try:
            out, err = self.process.communicate(timeout=CHILD_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise KubeconfigError(f"reading it took more than {CHILD_TIMEOUT_SECONDS:g}s") from None
        if self.process.returncode != 0:
            lines = err.strip().splitlines()
            raise KubeconfigError(lines[-1] if lines else f"the loader exited with status {self.process.returncode}")
        answer = json.loads(out)
        if answer["expires"] or not os.listdir(self.files_dir):
            shutil.rmtree(self.files_dir, True)
        return None if answer["expires"] else answer["settings"]


def sweep_dead(parent: str | None = None) -> list[str]:
    """Remove the certificate directories of agents that are gone (killed before their exit hook
    ran): their names carry the owner's pid. Returns the directories removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(parent):
        owner = entry.name[len(DIR_PREFIX):].split("-", 1)[0]
        if entry.name.startswith(DIR_PREFIX) and owner.isdigit() and not procs.alive(int(owner)):
            shutil.rmtree(entry.path, True)
            removed.append(entry.path)
    return removed


_started: dict[str, _Child] = {}  # prefetch()ed children, by kubeconfig path


def _child(path: str, files_dir: str) -> None:
    """Load `path` with the official loader, print {"expires", "settings"}, and leave without
    running the loader's exit hook, which deletes the certificate files it wrote."""
    slim_imports()  # the loader's own imports only: not the client's dynamic client, streams, ...
    from kubernetes.client.configuration import Configuration
    from kubernetes.config.kube_config import KubeConfigLoader, KubeConfigMerger

    merged = KubeConfigMerger(path)
    if merged.config is None:
        raise KubeconfigError("Invalid kube-config file. No configuration found.")
    loader = KubeConfigLoader(config_dict=merged.config, config_base_path=None, temp_file_path=files_dir)
    configuration = Configuration()
    loader.load_and_set(configuration)
    expires = getattr(loader, "expiry", None) is not None
    settings = {name: getattr(configuration, name) for name in SETTINGS}
    sys.stdout.write(json.dumps({"expires": expires, "settings": settings}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    try:
        _child(sys.argv[1], sys.argv[2])
    except Exception as exc:  # the loader's message, for the agent's error
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
