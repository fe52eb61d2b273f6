"""`ebpf-proxy lab apiserver`: the CLI that takes the lab's API server away and brings it back.

Frozen means alive and silent (the kernel still accepts the connection, no answer comes); a
restart keeps the objects and issues newer resourceVersions; a frozen server cannot be started
and a stopped one cannot be frozen (the error says what to do); teardown works with the server
frozen. Agents are not involved (mode none): tests/e2e/test_apiserver_faults.py has them.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.lab.test_lab_cluster import SERVICE, cli, leftovers

pytestmark = pytest.mark.root


def get(url: str, path: str, timeout: float = 2.0) -> dict | None:
    """GET over a raw socket: the JSON body, or None when nothing answers within `timeout`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except socket.timeout:
            return None
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return json.loads(body)


def test_freeze_thaw_stop_start_keep_the_objects():
    name = f"fal{os.getpid() % 10000}"
    destroy(name)
    try:
        cli("lab", "up", "--name", name, "--mode", "none")
        cli("lab", "apply", "--name", name, "-", input=SERVICE)
        url = Lab.load(name).data["apiserver"]["url"]
        before = get(url, "/api/v1/namespaces/default/services/my-nginx")
        assert before["spec"]["clusterIP"] == "10.96.200.10"

        assert cli("lab", "apiserver", "freeze", "--name", name).stdout.strip() == f"lab {name}: API server frozen"
        assert get(url, "/api/v1/namespaces/default/services/my-nginx", timeout=1.0) is None, "frozen must not answer"
        assert json.loads(cli("lab", "status", "--name", name, "--json").stdout)["apiserver"]["frozen"] is True
        refused = cli("lab", "apiserver", "start", "--name", name, check=False)
        assert refused.returncode != 0 and f"lab apiserver thaw --name {name}" in refused.stderr
        assert cli("lab", "apiserver", "thaw", "--name", name).stdout.strip() == f"lab {name}: API server running"
        assert get(url, "/api/v1/namespaces/default/services/my-nginx") == before

        cli("lab", "apiserver", "stop", "--name", name)
        assert json.loads(cli("lab", "status", "--name", name, "--json").stdout)["apiserver"]["alive"] is False
        refused = cli("lab", "apiserver", "freeze", "--name", name, check=False)
        assert refused.returncode != 0 and "the API server is stopped, not running" in refused.stderr
        cli("lab", "apiserver", "start", "--name", name)
        after = get(url, "/api/v1/namespaces/default/services/my-nginx")
        assert after == before, "same object, same uid, clusterIP and resourceVersion after a restart"
        listed = get(url, "/api/v1/services")
        assert int(listed["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])

        cli("lab", "apiserver", "restart", "--name", name)
        assert get(url, "/api/v1/namespaces/default/services/my-nginx") == before
        cli("lab", "apiserver", "freeze", "--name", name)
    finally:
        cli("lab", "down", "--name", name)  # with the server frozen: it must still go away
    assert leftovers(name) == []
