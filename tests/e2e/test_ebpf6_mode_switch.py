"""A mode switch on a dual-stack lab leaves one IPv6 datapath, in both directions (agent/handover.py).

iptables -> ebpf: once the agents' IPv6 family synced, the eBPF programs serve IPv6 (CFG6_F_ON)
and no node keeps an ip6tables KUBE-* chain (kube-proxy's rules would act on what the programs
pass up); ebpf -> iptables: the programs and pins are gone and ip6tables serves IPv6 again. After
each switch a dual-stack NodePort and ClusterIP answer over both families with kube-proxy's
source addresses: a second translation (the old datapath's left beside the new one) would change
them or break the connection. The IPv6 connections themselves are not moved (README "Switching
modes"); test_mode_switch.py covers moving IPv4 ones under load.
"""

from __future__ import annotations

import os

import pytest

from ebpf_proxy.datapath.ebpf import pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps6
from tests.e2e.conftest import _lab
from tests.e2e.scenario_runner import TOPOLOGY_DUALSTACK

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.bpf]

VIPS = {4: "10.96.102.30", 6: "fd00:10:96::661e"}
NODE_PORT = 31190
WORKER1 = {4: "172.20.20.15", 6: "fd00:20::f"}  # where `outside` enters
OUTSIDE = {4: "203.0.113.5", 6: "2001:db8:203:113::5"}
MANIFESTS = f"""
apiVersion: v1
kind: Service
metadata: {{name: switch6}}
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIPs: [{VIPS[4]}, "{VIPS[6]}"]
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
"""
NODES = ("worker1", "worker2", "worker3")


@pytest.fixture(scope="module")
def lab():
    yield from _lab(f"msw6{os.getpid() % 10000}", TOPOLOGY_DUALSTACK, "iptables")


def _target(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _ip6tables_save(lab, node: str) -> str:
    out = []
    for save in ("ip6tables-legacy-save", "ip6tables-nft-save"):
        done = lab.exec(node, [save], check=False)
        if done.returncode == 0:
            out.append(done.stdout)
    return "".join(out)


def _ipv6_served_by_ebpf(lab, node: str) -> bool:
    maps = pins.open_maps(lab.dir / "bpffs" / node)
    try:
        return bool(Maps6(maps).config().flags & s.CFG6_F_ON)
    finally:
        maps.close()


def _serves_both_families(lab) -> None:
    pod_ips = {ip for pod in ("web-1", "web-2") for ip in lab.topology.pod(pod).ips}
    client_ips = set(lab.topology.pod("client-1").ips)
    for family in (4, 6):
        report = lab.probe("client-1", _target(VIPS[family], 80), count=12)
        assert report.all_ok and report.pods == {"web-1", "web-2"}, (family, report.to_json())
        assert report.source_ips <= client_ips, ("a pod's clusterIP connection is not masqueraded", family,
                                                 report.to_json())
        report = lab.probe("outside", _target(WORKER1[family], NODE_PORT), count=12)
        assert report.all_ok and report.pods == {"web-1", "web-2"}, (family, report.to_json())
        # eTP=Cluster: masqueraded to one of worker1's addresses, once
        assert report.source_ips <= set(lab.topology.node("worker1").all_ips), (family, report.to_json())
        assert not report.source_ips & (pod_ips | {OUTSIDE[family]}), (family, report.to_json())


def test_switching_modes_leaves_one_ipv6_datapath_in_both_directions(lab):
    lab.apply_manifests(MANIFESTS, "switch6")
    lab.wait_converged()
    _serves_both_families(lab)
    assert all("KUBE-SERVICES" in _ip6tables_save(lab, node) for node in NODES)

    lab.set_mode("ebpf")
    lab.wait_converged()
    for node in NODES:
        assert _ipv6_served_by_ebpf(lab, node), f"{node}: the programs' IPv6 path is off in ebpf mode"
        assert "KUBE-" not in _ip6tables_save(lab, node), f"{node}: ip6tables chains left in ebpf mode"
        assert "KUBE-" not in lab.iptables_save(node), f"{node}: iptables chains left in ebpf mode"
    _serves_both_families(lab)

    lab.set_mode("iptables")
    lab.wait_converged()
    for node in NODES:
        assert not (lab.dir / "bpffs" / node / pins.PIN_SUBDIR).exists(), f"{node}: pins left in iptables mode"
        assert "KUBE-SERVICES" in _ip6tables_save(lab, node), f"{node}: no ip6tables rules in iptables mode"
    _serves_both_families(lab)
