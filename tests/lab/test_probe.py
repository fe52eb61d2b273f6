"""The probe and the echo server against real network namespaces.

Topology (made here, torn down in a finalizer even when tests fail; nothing touches the root
netns): "client" 10.99.0.1/24 + 10.99.0.11/24 --veth-- "pod" 10.99.0.2/24, running the echo
server as pod "web-1" on 80/tcp, 53/udp and 8080/tcp. In the pod netns, iptables drops port 9
(the real "dropped" case); in the client netns, local OUTPUT rules and a blackhole route provoke
the kernel's local drop/reject errors.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.lab.echo_util import start, stop
from tests.netns_util import add_netns, del_netns, nsenter

from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.lab.probe import Outcome, ProbeError, ProbeWaitTimeout, probe, wait_until_ok

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

PREFIX = f"epxt-probe-{os.getpid()}-"
CLIENT = PREFIX + "client"
POD = PREFIX + "pod"
POD_IP = "10.99.0.2"
CLIENT_IP = "10.99.0.1"
CLIENT_IP2 = "10.99.0.11"
HAVE_IPTABLES = shutil.which("iptables") is not None


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    made: list[str] = []
    procs: list[subprocess.Popen] = []
    try:
        for ns in (CLIENT, POD):
            add_netns(ns)
            made.append(ns)
            sh(*nsenter(ns), "ip", "link", "set", "lo", "up")
        # Created inside the client netns, with the peer created directly in the pod netns.
        sh(*nsenter(CLIENT), "ip", "link", "add", "c0", "type", "veth", "peer", "name", "p0", "netns", POD)
        sh(*nsenter(CLIENT), "ip", "addr", "add", f"{CLIENT_IP}/24", "dev", "c0")
        sh(*nsenter(CLIENT), "ip", "addr", "add", f"{CLIENT_IP2}/24", "dev", "c0")
        sh(*nsenter(CLIENT), "ip", "link", "set", "c0", "up")
        sh(*nsenter(CLIENT), "ip", "route", "add", "blackhole", "10.98.0.0/24")
        sh(*nsenter(POD), "ip", "addr", "add", f"{POD_IP}/24", "dev", "p0")
        sh(*nsenter(POD), "ip", "link", "set", "p0", "up")
        if HAVE_IPTABLES:
            for proto in ("tcp", "udp"):
                sh(*nsenter(POD), "iptables", "-A", "INPUT", "-p", proto, "--dport", "9", "-j", "DROP")
            sh(*nsenter(CLIENT), "iptables", "-A", "OUTPUT", "-p", "udp", "--dport", "10", "-j", "DROP")
            sh(*nsenter(CLIENT), "iptables", "-A", "OUTPUT", "-p", "udp", "--dport", "11", "-j", "REJECT")
        ready = tmp_path_factory.mktemp("echo") / "ready"
        procs.append(start("python", POD, "web-1", ready, "80/tcp", "53/udp", "8080/tcp"))
        wait_until_ok(CLIENT, f"{POD_IP}:80", timeout=10)  # the veth needs a moment to come up
        yield
    finally:
        for proc in procs:
            stop(proc)
        for ns in made:
            del_netns(ns)


# --- ok ----------------------------------------------------------------------------------------


def test_tcp_ok_names_pod_backend_and_source(lab):
    report = probe(CLIENT, f"{POD_IP}:80", count=3, label="client")
    assert report.outcomes == {Outcome.OK}
    assert report.pods == {"web-1"}
    assert report.backends == {f"{POD_IP}:80"}
    assert report.source_ips == {CLIENT_IP}
    assert len(report.sources) == 3, "every attempt must be a fresh connection (new source port)"


def test_udp_ok(lab):
    report = probe(CLIENT, f"{POD_IP}:53/udp", count=3)
    assert report.outcomes == {Outcome.OK}
    assert report.by_pod == {"web-1": 3}
    assert report.backends == {f"{POD_IP}:53"}
    assert report.source_ips == {CLIENT_IP}
    assert len(report.sources) == 3


@pytest.mark.parametrize("target", [f"{POD_IP}:8080", f"{POD_IP}:53/udp"])
def test_source_ip_is_bound_before_connecting(lab, target):
    report = probe(CLIENT, target, count=2, source_ip=CLIENT_IP2)
    assert report.all_ok
    assert report.source_ips == {CLIENT_IP2}


def test_source_ip_that_is_not_configured_is_an_error_not_an_outcome(lab):
    with pytest.raises(ProbeError, match="source IP 10.99.0.99"):
        probe(CLIENT, f"{POD_IP}:80", source_ip="10.99.0.99")


def test_json_shape_of_a_real_probe(lab):
    doc = probe(CLIENT, f"{POD_IP}:80", count=2, label="client-1").to_json()
    assert list(doc) == ["from", "to", "results", "summary"]
    assert doc["from"] == "client-1"
    assert doc["to"] == f"{POD_IP}:80/tcp"
    for r in doc["results"]:
        assert list(r) == ["outcome", "pod", "backend", "source"]
        assert r["outcome"] == "ok" and r["pod"] == "web-1" and r["backend"] == f"{POD_IP}:80"
        assert r["source"].startswith(f"{CLIENT_IP}:")
    assert doc["summary"] == {"ok": 2, "refused": 0, "timeout": 0, "by_pod": {"web-1": 2}}


def test_netns_none_probes_from_the_current_namespace(lab):
    report = run_in_netns(CLIENT, probe, None, f"{POD_IP}:80")
    assert report.label == "local"
    assert report.pods == {"web-1"}


# --- refused -----------------------------------------------------------------------------------


def test_tcp_port_without_listener_is_refused(lab):
    t0 = time.monotonic()
    report = probe(CLIENT, f"{POD_IP}:81", count=3, timeout=2)
    assert [r.outcome for r in report.results] == [Outcome.REFUSED] * 3
    assert report.pods == set() and report.summary["refused"] == 3
    assert time.monotonic() - t0 < 1, "an RST must not wait for the timeout"


def test_udp_port_without_listener_is_refused_by_icmp(lab):
    # Three stays within the kernel's ICMP rate-limit burst (about 6 per destination per second).
    t0 = time.monotonic()
    report = probe(CLIENT, f"{POD_IP}:54/udp", count=3, timeout=2)
    assert [r.outcome for r in report.results] == [Outcome.REFUSED] * 3
    assert time.monotonic() - t0 < 1


@pytest.mark.skipif(not HAVE_IPTABLES, reason="needs iptables")
def test_local_reject_of_udp_is_refused(lab):
    assert probe(CLIENT, f"{POD_IP}:11/udp", timeout=1).outcomes == {Outcome.REFUSED}


# --- timeout -----------------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_IPTABLES, reason="needs iptables")
@pytest.mark.parametrize("target", [f"{POD_IP}:9/tcp", f"{POD_IP}:9/udp", f"{POD_IP}:10/udp"])
def test_dropped_packets_time_out(lab, target):
    t0 = time.monotonic()
    report = probe(CLIENT, target, count=2, timeout=0.3)
    elapsed = time.monotonic() - t0
    assert [r.outcome for r in report.results] == [Outcome.TIMEOUT] * 2
    assert 0.6 <= elapsed < 3, elapsed


def test_neighbour_that_never_answers_times_out(lab):
    report = probe(CLIENT, "10.99.0.77:80", timeout=0.3)
    assert report.outcomes == {Outcome.TIMEOUT}


@pytest.mark.parametrize("target", ["10.98.0.5:80/tcp", "10.98.0.5:53/udp"])
def test_blackhole_route_counts_as_dropped(lab, target):
    assert probe(CLIENT, target, timeout=0.3).outcomes == {Outcome.TIMEOUT}


def _pod_listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((POD_IP, port))
    sock.listen(8)
    return sock


def test_tcp_connection_that_never_sends_a_line_times_out(lab):
    silent = run_in_netns(POD, _pod_listener, 7000)  # the kernel accepts; nobody ever writes
    try:
        t0 = time.monotonic()
        report = probe(CLIENT, f"{POD_IP}:7000", timeout=0.3)
        assert report.outcomes == {Outcome.TIMEOUT}
        assert time.monotonic() - t0 >= 0.3
    finally:
        silent.close()


def test_answer_that_is_not_ours_is_ok_without_a_pod(lab):
    listener = run_in_netns(POD, _pod_listener, 7001)

    def serve_garbage():
        conn, _ = listener.accept()
        conn.sendall(b"SSH-2.0-OpenSSH\r\n")
        conn.close()

    server = threading.Thread(target=serve_garbage, daemon=True)
    server.start()
    try:
        report = probe(CLIENT, f"{POD_IP}:7001", timeout=2)
        assert [(r.outcome, r.pod, r.backend, r.source) for r in report.results] == [(Outcome.OK, None, None, None)]
    finally:
        server.join(2)
        listener.close()


# --- speed, waiting, errors --------------------------------------------------------------------


def test_200_tcp_probes_are_fast(lab):
    t0 = time.monotonic()
    report = probe(CLIENT, f"{POD_IP}:80", count=200)
    elapsed = time.monotonic() - t0
    print(f"\n200 TCP probes in {elapsed * 1000:.0f} ms")
    assert report.summary["ok"] == 200
    assert len(report.sources) == 200
    assert elapsed < 10


def test_200_udp_probes_are_fast(lab):
    t0 = time.monotonic()
    report = probe(CLIENT, f"{POD_IP}:53/udp", count=200)
    elapsed = time.monotonic() - t0
    print(f"\n200 UDP probes in {elapsed * 1000:.0f} ms")
    assert report.summary["ok"] == 200
    assert elapsed < 10


def test_wait_until_ok_returns_at_once_when_ok_and_gives_up_otherwise(lab):
    assert wait_until_ok(CLIENT, f"{POD_IP}:80", timeout=5, count=2).by_pod == {"web-1": 2}
    t0 = time.monotonic()
    with pytest.raises(ProbeWaitTimeout) as info:
        wait_until_ok(CLIENT, f"{POD_IP}:81", timeout=0.5)
    assert 0.4 <= time.monotonic() - t0 < 3
    assert info.value.last.outcomes == {Outcome.REFUSED}
    report = wait_until_ok(CLIENT, f"{POD_IP}:81", timeout=5, until=lambda r: r.summary["refused"] == 1)
    assert report.outcomes == {Outcome.REFUSED}


def test_missing_netns_is_an_error(lab):
    with pytest.raises(ProbeError, match="no network namespace"):
        probe(PREFIX + "nonexistent", f"{POD_IP}:80")


def test_command_line_prints_the_report(lab):
    run = subprocess.run(
        [sys.executable, "-m", "ebpf_proxy.lab.probe", "--netns", CLIENT, "--from", "c", "-c", "2", f"{POD_IP}:80"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["summary"] == {"ok": 2, "refused": 0, "timeout": 0, "by_pod": {"web-1": 2}}
    run = subprocess.run(
        [sys.executable, "-m", "ebpf_proxy.lab.probe", "--netns", CLIENT, f"{POD_IP}:81"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert json.loads(run.stdout)["results"][0]["outcome"] == "refused"


@pytest.fixture
def cgroup():
    """A cgroup v2 directory of our own (removed afterwards), like the lab's per-node cgroups."""
    root = "/sys/fs/cgroup/unified"
    if not os.path.isfile(os.path.join(root, "cgroup.controllers")):
        root = "/sys/fs/cgroup"
    if not os.path.isfile(os.path.join(root, "cgroup.controllers")):
        pytest.skip("no cgroup v2 hierarchy")
    path = os.path.join(root, PREFIX + "cg")
    os.mkdir(path)
    try:
        yield path
    finally:
        for _ in range(50):  # a member that just exited may take a moment to leave
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


def test_with_a_cgroup_the_probe_runs_in_a_process_inside_it(lab, cgroup):
    report = probe(CLIENT, f"{POD_IP}:80", count=3, cgroup=cgroup, label="node-1")
    assert report.label == "node-1" and report.by_pod == {"web-1": 3} and report.source_ips == {CLIENT_IP}
    assert probe(CLIENT, f"{POD_IP}:53/udp", cgroup=cgroup, source_ip=CLIENT_IP2).source_ips == {CLIENT_IP2}

    # Watch the cgroup while a probe waits on a listener that never answers.
    silent = run_in_netns(POD, _pod_listener, 7002)
    reports = []
    worker = threading.Thread(
        target=lambda: reports.append(probe(CLIENT, f"{POD_IP}:7002", timeout=1.5, cgroup=cgroup))
    )
    members: set[str] = set()
    try:
        worker.start()
        while worker.is_alive():
            with open(os.path.join(cgroup, "cgroup.procs")) as f:
                members.update(f.read().split())
            time.sleep(0.02)
        worker.join()
    finally:
        silent.close()
    assert members and str(os.getpid()) not in members
    assert reports[0].outcomes == {Outcome.TIMEOUT}


def test_cgroup_path_errors_are_reported(lab, cgroup):
    with pytest.raises(ProbeError, match="cannot join cgroup"):
        probe(CLIENT, f"{POD_IP}:80", cgroup=cgroup + "-missing")
    with pytest.raises(ProbeError, match="no network namespace"):
        probe(PREFIX + "nonexistent", f"{POD_IP}:80", cgroup=cgroup)
