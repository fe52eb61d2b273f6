"""`python -m ebpf_proxy.lab.apiserver_main`: the lab's API server as a process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.netns_util import add_netns, del_netns, nsenter


def start(tmp_path, *args):
    ready = tmp_path / "ready.json"
    log = tmp_path / "apiserver.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ebpf_proxy.lab.apiserver_main", "--ready-file", str(ready), "--log-file", str(log), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"apiserver exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("apiserver did not write its ready file within 30s")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text()), ready


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("apiserver did not exit within 15s of SIGTERM")


def request(port, path, body=None, method=None, host="127.0.0.1"):
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(body).encode() if body else None,
                                 method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def test_ready_file_serving_slices_and_clean_sigterm(tmp_path):
    proc, ready, ready_path = start(tmp_path, "--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0",
                                    "--service-cidr", "10.100.0.0/16")
    try:
        assert ready["pid"] == proc.pid
        assert list(ready["ports"]) == ["127.0.0.1:0"]  # both listeners were asked as "127.0.0.1:0"...
        first, second = ready["listeners"]  # ...so only the ordered list tells them apart
        assert first["listen"] == second["listen"] == "127.0.0.1:0" and first["port"] != second["port"]
        port = second["port"]
        assert request(first["port"], "/version")["major"] == "1"
        svc = request(port, "/api/v1/namespaces/default/services",
                      {"metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}})
        assert svc["spec"]["clusterIP"].startswith("10.100.")
        request(port, "/api/v1/namespaces/default/pods",
                {"metadata": {"name": "web-1", "labels": {"app": "web"}}, "spec": {"containers": [{"name": "c"}]},
                 "status": {"podIP": "10.1.0.1"}})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            items = request(port, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")["items"]
            if items and items[0]["endpoints"]:
                break
            time.sleep(0.05)
        assert [ep["addresses"] for ep in items[0]["endpoints"]] == [["10.1.0.1"]]
    finally:
        code = stop(proc)
    assert code == 0
    assert not ready_path.exists()
    assert "lab API server stopping" in (tmp_path / "apiserver.log").read_text()


def test_ready_file_maps_each_listen_argument(tmp_path):
    proc, ready, _ = start(tmp_path, "--listen", "127.0.0.1:0", "--listen", "localhost:0")
    try:
        assert set(ready["ports"]) == {"127.0.0.1:0", "localhost:0"}
        for value, port in ready["ports"].items():
            assert request(port, "/version")["major"] == "1"
    finally:
        assert stop(proc) == 0


def test_bad_arguments_fail_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ebpf_proxy.lab.apiserver_main", "--listen", "nonsense"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--listen" in proc.stderr and "nonsense" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ebpf_proxy.lab.apiserver_main", "--listen", "127.0.0.1:0",
                           "--service-cidr", "10.96.0.1/12"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--service-cidr" in proc.stderr


@pytest.mark.root
def test_listen_inside_a_network_namespace(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace")
    netns = f"epxt-apisrv-{os.getpid()}"
    add_netns(netns)
    try:
        subprocess.run([*nsenter(netns), "ip", "link", "set", "lo", "up"], check=True)
        proc, ready, _ = start(tmp_path, "--listen", "127.0.0.1:0", "--listen-netns", f"{netns}=127.0.0.1:0")
        try:
            root_port = ready["ports"]["127.0.0.1:0"]
            ns_port = ready["ports"][f"{netns}=127.0.0.1:0"]
            request(root_port, "/api/v1/nodes", {"metadata": {"name": "n1"}})
            # Inside the namespace, the same store answers.
            out = subprocess.run(
                [*nsenter(netns), sys.executable, "-c",
                 f"import json,urllib.request;print(json.load(urllib.request.urlopen('http://127.0.0.1:{ns_port}/api/v1/nodes'))"
                 "['items'][0]['metadata']['name'])"],
                capture_output=True, text=True, timeout=30, check=True)
            assert out.stdout.strip() == "n1"
            # And the socket really is in the namespace, not in ours.
            listening = subprocess.run(["ss", "-Hltn", f"sport = :{ns_port}"], capture_output=True, text=True).stdout
            assert f":{ns_port}" not in listening
        finally:
            assert stop(proc) == 0
    finally:
        del_netns(netns)
    assert not Path(f"/run/netns/{netns}").exists()
