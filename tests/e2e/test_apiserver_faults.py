"""Reliability when the control plane goes away (issue 13): the datapath keeps serving existing
Services while the API server is frozen or stopped, the agents notice and reconnect, and after
recovery they catch up, including with an API server restored from an older backup.

What is matched is client-go's Reflector, which kube-proxy's informers run on: a watch error
backs off (800 ms doubling, capped) and re-watches from the last resourceVersion; a 410 Expired
("too old resource version") relists and delivers the difference. A frozen server keeps the TCP
connection open and says nothing: client-go notices through its HTTP/2 health check, the agent
through its watch read timeout (--watch-idle-timeout). The fault lab's agents use 5 s and a 1 s
backoff cap (topology_faults.yaml).

The outage lasts EPX_FAULT_OUTAGE_SECONDS (default 10: twice the fault lab's 5 s watch idle
timeout, so a frozen server is noticed (and the hung watch retried) well within it, and ten
times the 1 s backoff cap, so a stopped one is retried several times; the issue's scenario is 60:
set it to 60 for the full run, ~100 s more per mode). Figures are printed (run with -s): failed connections
during the outage (asserted 0), and the time from the API server being back to a change made at
that moment answering on every node (asserted only against a generous bound: the machine is
shared). The aim is < 2 s.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from ebpf_proxy.apiserver import persist
from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import be16
from ebpf_proxy.lab import apiserver_ctl
from ebpf_proxy.lab.probe import Outcome
from ebpf_proxy.lab.prober import Prober
from tests.e2e.conftest import E2E_MODES, _lab
from tests.e2e.scenario_runner import HERE

pytestmark = [pytest.mark.root, pytest.mark.e2e]

OUTAGE = float(os.environ.get("EPX_FAULT_OUTAGE_SECONDS", "10"))
CONVERGE_BOUND = 15.0  # seconds; generous on purpose, the figure printed is what matters
WEB_NODE_PORT = 31500


def service(name: str, node_port: int, app: str = "web") -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": {"type": "NodePort", "selector": {"app": app},
                     "ports": [{"name": "http", "port": 80, "targetPort": 80, "nodePort": node_port}]}}


@pytest.fixture(scope="module", params=E2E_MODES)
def fault_lab(request):
    for lab in _lab(f"fa{request.param[:3]}{os.getpid() % 10000}", str(HERE / "topology_faults.yaml"),
                    request.param):
        api = lab.api()
        try:
            api.apply(service("web", WEB_NODE_PORT))
        finally:
            api.close()
        lab.wait_converged()
        yield lab


@pytest.fixture
def lab(fault_lab):
    """The fault lab, its API server running again after the test (also when the test failed)."""
    yield fault_lab
    if apiserver_ctl.state(fault_lab) == "frozen":
        apiserver_ctl.thaw(fault_lab)
    apiserver_ctl.start(fault_lab)


def nodes(lab) -> list[str]:
    return [n.name for n in lab.topology.nodes]


def node_port_target(lab, node: str, port: int) -> str:
    return f"{lab.topology.node(node).ip}:{port}"


def web_prober(lab) -> Prober:
    """Probes the existing `web` Service without pause, from outside (NodePort on every node) and
    from a pod (its ClusterIP), and counts what failed."""
    api = lab.api()
    try:
        cluster_ip = api.get("Service", "web")["spec"]["clusterIP"]
    finally:
        api.close()
    targets = [("outside", node_port_target(lab, n, WEB_NODE_PORT)) for n in nodes(lab)]
    targets.append(("client-1", f"{cluster_ip}:80"))
    return Prober(lab, targets)


def log_sizes(lab) -> dict[str, int]:
    return {n: len(lab.logs(n)) for n in nodes(lab)}


def new_log(lab, since: dict[str, int]) -> dict[str, str]:
    return {n: lab.logs(n)[since[n]:] for n in nodes(lab)}


def serves_everywhere(lab, port: int, timeout: float = 30.0) -> float:
    """Seconds until NodePort `port` answers from outside on every node."""
    started = time.monotonic()
    pending = nodes(lab)
    while pending:
        pending = [n for n in pending if not lab.probe("outside", node_port_target(lab, n, port), timeout=0.5).all_ok]
        if pending and time.monotonic() - started > timeout:
            raise AssertionError(f"NodePort {port} does not answer on {pending} {timeout:.0f}s after recovery")
    return time.monotonic() - started


def kernel_has_node_port(lab, node: str, port: int) -> bool:
    """Is NodePort `port` programmed in `node`'s kernel: its eBPF frontend, or its iptables rule."""
    if lab.mode == "ebpf":
        fd = libbpf.obj_get(str(lab.dir / "bpffs" / node / "ebpf-proxy" / "epx_svc"))
        try:
            return libbpf.map_lookup(fd, s.LB4Key(addr=0, port=be16(port), proto=6), s.LB4Service())
        finally:
            os.close(fd)
    return f"--dport {port} " in lab.iptables_save(node, "nat")


def recover_and_measure(lab, recover, port: int) -> float:
    """Bring the API server back, create a Service at once, and time it into every node."""
    recover(lab)
    back = time.monotonic()
    api = lab.api()
    try:
        api.apply(service(f"after-{port}", port))
    finally:
        api.close()
    serves_everywhere(lab, port)
    return time.monotonic() - back


def remove(lab, *names: str) -> None:
    api = lab.api()
    try:
        for name in names:
            api.delete("Service", name)
    finally:
        api.close()
    lab.wait_converged()


@pytest.mark.parametrize("fault, outage, recover, port, sign", [
    ("freeze", apiserver_ctl.freeze, apiserver_ctl.thaw, 31501, "the connection is hung"),
    ("stop", apiserver_ctl.stop, apiserver_ctl.start, 31502, "relisting"),
], ids=["frozen", "stopped"])
def test_outage_keeps_traffic_and_the_agent_catches_up(lab, fault, outage, recover, port, sign):
    """No failed connection to an existing Service while the API server is away; then a new Service
    reaches every node's kernel soon after it is back. A frozen server is found by the watch
    read timeout (log: "the connection is hung"); a restarted one has forgotten our versions, so
    the watch's 410 makes the agent relist (log: "relisting")."""
    since = log_sizes(lab)
    with web_prober(lab) as prober:
        outage(lab)
        started = time.monotonic()
        time.sleep(OUTAGE)
        took = recover_and_measure(lab, recover, port)
        down = time.monotonic() - started - took
    try:
        logs = new_log(lab, since)
        print(f"\n[{lab.mode}] API server {fault} {down:.1f}s: {prober.ok} connections ok, "
              f"{len(prober.failed)} failed; a Service created when it was back answered on every node "
              f"after {took:.2f}s")
        assert prober.ok > 0 and not prober.failed, prober.failed[:10]
        assert all(sign in text for text in logs.values()), {n: t[-2000:] for n, t in logs.items()}
        assert took < CONVERGE_BOUND
        assert all(kernel_has_node_port(lab, n, port) for n in nodes(lab))
    finally:
        remove(lab, f"after-{port}")


def wait_saved(lab) -> bytes:
    """The state file once it holds everything the API server has (the saver writes within 0.2s)."""
    api = lab.api()
    try:
        target = api.resource_version()
    finally:
        api.close()
    deadline = time.monotonic() + 10
    while persist.read(lab.apiserver_state_file)[0] < target:
        assert time.monotonic() < deadline, "the API server did not save its state within 10s"
        time.sleep(0.05)
    return lab.apiserver_state_file.read_bytes()


def test_restore_from_an_older_backup_converges_to_it(lab):
    """A restore from backup: the API server comes back with the objects of an earlier moment.
    The agents' resourceVersions are 410 Expired there, so they relist, and the kernel ends up
    with exactly the backup's Services: one deleted after the backup is back, one created after
    it is gone, the ones in both never stopped working."""
    keep, old, new = (31510, 31511, 31512)
    api = lab.api()
    try:
        api.apply(service("restore-keep", keep))
        api.apply(service("restore-old", old))
    finally:
        api.close()
    lab.wait_converged()
    backup = wait_saved(lab)
    assert {"restore-keep", "restore-old"} <= {o["metadata"]["name"] for o in json.loads(backup)["objects"]}
    api = lab.api()
    try:
        api.delete("Service", "restore-old")
        api.apply(service("restore-new", new))
    finally:
        api.close()
    lab.wait_converged()
    for node in nodes(lab):
        assert [kernel_has_node_port(lab, node, p) for p in (keep, old, new)] == [True, False, True], node

    since = log_sizes(lab)
    try:
        with web_prober(lab) as prober:
            apiserver_ctl.stop(lab)
            lab.apiserver_state_file.write_bytes(backup)
            apiserver_ctl.start(lab)
            back = time.monotonic()
            deadline = back + 30
            for node in nodes(lab):
                while [kernel_has_node_port(lab, node, p) for p in (keep, old, new)] != [True, True, False]:
                    assert time.monotonic() < deadline, f"{node} did not converge to the backup in 30s"
                    time.sleep(0.05)
            took = time.monotonic() - back
        print(f"\n[{lab.mode}] restored from backup: every node's kernel matched it {took:.2f}s after the "
              f"API server was back; {prober.ok} connections to an unchanged Service ok, {len(prober.failed)} failed")
        assert not prober.failed, prober.failed[:10]
        assert all("relisting" in text for text in new_log(lab, since).values())
        lab.wait_converged()
        for node in nodes(lab):
            assert lab.probe("outside", node_port_target(lab, node, keep)).all_ok
            assert lab.probe("outside", node_port_target(lab, node, old)).all_ok
            gone = lab.probe("outside", node_port_target(lab, node, new))
            assert gone.outcomes == {Outcome.REFUSED}, gone.summary
    finally:
        remove(lab, "restore-keep", "restore-old", "restore-new")
