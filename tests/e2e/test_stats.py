"""`ebpf-proxy stats` and the live /metrics counters against real drops, in a small ebpf lab.

externalTrafficPolicy=Local NodePort, probed from outside on the node without a local endpoint:
every SYN is dropped under DROP_NO_LOCAL_EXTERNAL. The stats command run inside that node (with
and without --bpffs: the netns-cookie lookup must find the lab's bpffs) and the agent's /metrics
must both show the drops, the latter with no sync in between: nothing changes in the API while we
probe, and a window that a periodic resync (every 30 s) happens to hit is measured again.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ebpf_proxy.datapath.ebpf import inspect as epx_inspect
from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.lab.cluster import AGENT_METRICS_PORT, Lab, destroy
from ebpf_proxy.lab.nshttp import http_get

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.e2e]

TOPOLOGY = {
    "nodes": [
        {"name": "worker1", "ip": "172.20.20.15", "podCIDR": "10.244.5.0/24"},
        {"name": "worker2", "ip": "172.20.20.16", "podCIDR": "10.244.3.0/24"},
    ],
    "pods": [{"name": "web-1", "node": "worker1", "ip": "10.244.5.4", "labels": {"app": "web"}}],
    "clients": [{"name": "outside", "ip": "203.0.113.5", "gateway": "worker1"}],
}
NODE_PORT = 31090
MANIFEST = f"""
apiVersion: v1
kind: Service
metadata: {{name: local-only}}
spec:
  type: NodePort
  clusterIP: 10.96.120.10
  selector: {{app: web}}
  externalTrafficPolicy: Local
  ports: [{{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
"""
DROPPED = 3
REASON = "DROP_NO_LOCAL_EXTERNAL"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    name = f"stats{os.getpid() % 10000}"
    topology = tmp_path_factory.mktemp("stats") / "topology.yaml"
    topology.write_text(yaml.safe_dump(TOPOLOGY))
    destroy(name)
    lab = Lab.up(name, str(topology), mode="ebpf")
    try:
        lab.apply_manifests(MANIFEST, "test-stats")
        lab.wait_converged()
        yield lab
    finally:
        destroy(name)


def stats_json(lab: Lab, node: str, *args: str) -> dict:
    result = lab.exec(node, [sys.executable, "-m", "ebpf_proxy", "stats", "--json", *args])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def scrape(lab: Lab, node: str) -> dict[tuple[str, tuple], float]:
    ip = lab.topology.node(node).ip
    status, body = http_get(lab.netns_of(node), f"http://{ip}:{AGENT_METRICS_PORT}/metrics")
    assert status == 200, body
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body) for sample in family.samples}


def live_drops(samples: dict) -> float:
    value = samples.get(("ebpf_proxy_datapath_packets_total", (("reason", REASON), ("verdict", "drop"))))
    assert value is not None, f"/metrics has no ebpf_proxy_datapath_packets_total for {REASON}"
    return value


def last_sync(samples: dict) -> float:
    return samples[("kubeproxy_sync_proxy_rules_last_timestamp_seconds", ())]


def test_a_drop_shows_in_stats_and_on_metrics_at_once(lab):
    pins_of_worker2 = lab.dir / "bpffs" / "worker2"
    for _attempt in range(2):  # periodic resyncs are 30 s apart: two windows of ~2 s cannot both hit one
        before = stats_json(lab, "worker2", "--bpffs", str(pins_of_worker2))
        before_metrics = scrape(lab, "worker2")
        report = lab.probe("outside", f"{lab.topology.node('worker2').ip}:{NODE_PORT}", count=DROPPED, timeout=0.5)
        assert {r.outcome.value for r in report.results} == {"timeout"}, "eTP=Local without a local endpoint drops"
        after = stats_json(lab, "worker2")  # no --bpffs: found through this netns' cookie
        after_metrics = scrape(lab, "worker2")
        if last_sync(after_metrics) == last_sync(before_metrics):
            break
    else:
        pytest.fail("the agent synced during every measurement: cannot tell live counters from synced ones")

    assert after["pin_dir"] == str(pins_of_worker2 / "ebpf-proxy")
    counted = after["reasons"][REASON]
    assert counted["drop"] is True and counted["verdict"] == "drop"
    assert counted["packets"] - before["reasons"][REASON]["packets"] >= DROPPED
    assert counted["bytes"] >= counted["packets"] * 40  # at least an IP and a TCP header each
    assert after["maps"]["epx_svc"]["entries"] >= 2  # the clusterIP and the nodePort frontend

    assert live_drops(after_metrics) - live_drops(before_metrics) >= DROPPED
    assert live_drops(after_metrics) >= counted["packets"]  # the same kernel counter, read later


def test_the_node_with_the_endpoint_forwards_instead(lab):
    report = lab.probe("outside", f"{lab.topology.node('worker1').ip}:{NODE_PORT}", count=2)
    assert report.all_ok
    data = stats_json(lab, "worker1")
    assert data["reasons"]["FWD_NEW"]["packets"] >= 2 and data["reasons"][REASON]["packets"] == 0


def test_stats_opens_the_maps_read_only(lab):
    fd = epx_inspect._open_readonly(lab.dir / "bpffs" / "worker2" / "ebpf-proxy" / "epx_node_addr")
    try:
        with pytest.raises(PermissionError):
            libbpf.map_update(fd, s.be32(0x01020304), s.u32(1))
    finally:
        os.close(fd)


def test_a_bpffs_without_our_maps_is_a_clear_error(lab, tmp_path):
    result = lab.exec("worker2", [sys.executable, "-m", "ebpf_proxy", "stats", "--bpffs", str(tmp_path)])
    assert result.returncode == 1
    assert f"no ebpf-proxy maps pinned under {tmp_path}/ebpf-proxy" in result.stderr
