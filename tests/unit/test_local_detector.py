"""kube-proxy's local-traffic detectors: which one the agent builds, and the rules each renders.

Matches upstream `pkg/proxy/util/localdetector_test.go` (TestNoOpLocalDetector,
TestDetectLocalByCIDR, TestDetectLocalByBridgeInterface, TestDetectLocalByInterfaceNamePrefix)
for the matches, and cmd/kube-proxy's getLocalDetector for the choice of detector.
"""

from __future__ import annotations

import logging

import pytest

from ebpf_proxy.agent.config import load_config
from ebpf_proxy.agent.nodeconfig import build_node_config, local_detector
from ebpf_proxy.datapath.iptables.render import detector_matches, render
from ebpf_proxy.model import (
    Endpoint,
    LocalDetector,
    LocalMode,
    NodeConfig,
    NodeState,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)

NODE = NodeState(name="n1", addresses=("192.168.1.10",), primary_ip="192.168.1.10", pod_cidrs=("10.244.3.0/24",))


def test_cluster_cidr_is_the_default_and_a_no_op_without_a_cidr(caplog):
    assert local_detector(load_config({"cluster_cidrs": "10.244.0.0/16"}), NODE) == LocalDetector(
        LocalMode.CLUSTER_CIDR, ("10.244.0.0/16",))
    with caplog.at_level(logging.INFO):
        assert local_detector(load_config({}), NODE) == LocalDetector()
    assert "no cluster CIDR defined" in caplog.text


def test_node_cidr_uses_the_nodes_pod_cidrs_and_is_a_no_op_without_them(caplog):
    config = load_config({"detect_local_mode": "NodeCIDR", "cluster_cidrs": "10.244.0.0/16"})
    assert local_detector(config, NODE) == LocalDetector(LocalMode.NODE_CIDR, ("10.244.3.0/24",))
    with caplog.at_level(logging.INFO):
        assert local_detector(config, NodeState(name="n1")) == LocalDetector()
        assert local_detector(config, None) == LocalDetector()
    assert "no PodCIDR defined at node" in caplog.text


def test_node_cidr_takes_the_first_pod_cidr_per_family_as_kube_proxy(caplog):
    """getLocalDetectors: MapCIDRsByIPFamily(spec.podCIDRs), then cidrs[0] of each family. A Node
    with two IPv4 podCIDRs (the API server refuses it, the agent does not rely on that) once made
    every sync raise in the iptables renderer; found by tests/unit/test_fuzz_k8s.py."""
    config = load_config({"detect_local_mode": "NodeCIDR", "cluster_cidrs": "10.244.0.0/16"})
    node = NodeState(name="n1", pod_cidrs=("10.244.3.0/24", "fd00:3::/64", "10.244.9.0/24", "fd00:9::/64"))
    with caplog.at_level(logging.WARNING):
        detector = local_detector(config, node)
    assert detector == LocalDetector(LocalMode.NODE_CIDR, ("10.244.3.0/24", "fd00:3::/64"))
    assert "first of each" in caplog.text
    assert detector_matches("n1", detector) == (("-s", "10.244.3.0/24"), ("!", "-s", "10.244.3.0/24"))
    node_config = build_node_config(config, ["192.168.1.10"], node)
    render(node_config, ProxyState())  # raised ValueError before


def test_interface_detectors_take_their_names():
    bridge = load_config({"detect_local_mode": "BridgeInterface", "pod_bridge_interface": "cbr0"})
    assert local_detector(bridge, NODE) == LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")
    prefix = load_config({"detect_local_mode": "InterfaceNamePrefix", "pod_interface_name_prefix": "veth"})
    node_config = build_node_config(prefix, ["192.168.1.10"], NODE)
    assert node_config.detector == LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="veth")


@pytest.mark.parametrize("detector,if_local,if_not_local", [
    (LocalDetector(), None, None),
    (LocalDetector(LocalMode.CLUSTER_CIDR, ("10.0.0.0/14",)), ("-s", "10.0.0.0/14"), ("!", "-s", "10.0.0.0/14")),
    (LocalDetector(LocalMode.NODE_CIDR, ("10.244.3.0/24", "fd00:10:244:3::/64")),
     ("-s", "10.244.3.0/24"), ("!", "-s", "10.244.3.0/24")),
    (LocalDetector(LocalMode.CLUSTER_CIDR, ("fd00::/48",)), None, None),  # iptables: IPv4 only
    (LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="eth0"), ("-i", "eth0"), ("!", "-i", "eth0")),
    (LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="veth"), ("-i", "veth+"), ("!", "-i", "veth+")),
])
def test_detector_matches(detector, if_local, if_not_local):
    assert detector_matches("n1", detector) == (if_local, if_not_local)


def test_interface_detectors_need_a_name():
    with pytest.raises(ValueError, match="BridgeInterface"):
        LocalDetector(LocalMode.BRIDGE_INTERFACE)


def test_a_bridge_detector_matches_only_the_bridge_and_a_prefix_detector_names_starting_with_it():
    bridge = LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")
    assert bridge.matches_l3_device("cbr0") and not bridge.matches_l3_device("cbr01")
    prefix = LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="cali")
    assert prefix.matches_l3_device("cali12ab") and not prefix.matches_l3_device("eth0")
    assert not LocalDetector().matches_l3_device("cbr0")


SPN = ServicePortName("ns", "web", "http", Protocol.TCP)
ETP_LOCAL = ServicePort(SPN, "10.96.0.10", 80, Protocol.TCP, node_port=30080, external_policy_local=True)


def _rules(detector: LocalDetector, masquerade_all: bool = False) -> list[str]:
    node = NodeConfig("n1", node_ips=("192.168.1.10",), local_detector=detector, masquerade_all=masquerade_all)
    state = ProxyState({SPN: ETP_LOCAL}, {SPN: (Endpoint("10.244.3.5", 8080, "n1", is_local=True),
                                                Endpoint("10.244.4.5", 8080, "n2"))})
    return [line for lines in render(node, state).tables["nat"].values() for line in lines]


@pytest.mark.parametrize("detector,local_args", [
    (LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0"), "-i cbr0"),
    (LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="cali"), "-i cali+"),
    (LocalDetector(LocalMode.NODE_CIDR, ("10.244.3.0/24",)), "-s 10.244.3.0/24"),
])
def test_each_detector_renders_kube_proxys_two_rules(detector, local_args):
    lines = _rules(detector)
    assert any(f"--dport 80 ! {local_args} -j KUBE-MARK-MASQ" in line for line in lines)
    assert any('"pod traffic for ns/web:http external destinations"' in line and f" {local_args} -j KUBE-SVC-" in line
               for line in lines)


def test_no_op_detector_renders_neither_rule():
    """Upstream TestInternalExternalMasquerade's "no LocalTrafficDetector" case."""
    lines = _rules(LocalDetector())
    assert not any("pod traffic for" in line for line in lines)
    assert not any("--dport 80" in line and "KUBE-MARK-MASQ" in line for line in lines)


def test_masquerade_all_masquerades_the_cluster_ip_only_not_short_circuited_pod_traffic():
    """Upstream TestInternalExternalMasquerade's "masqueradeAll" case: the masquerade rule matches
    the clusterIP as destination, so a pod's short-circuited eTP=Local traffic keeps its source."""
    lines = _rules(LocalDetector(LocalMode.CLUSTER_CIDR, ("10.244.0.0/16",)), masquerade_all=True)
    masq = [line for line in lines if line.endswith("-j KUBE-MARK-MASQ") and line.startswith("-A KUBE-SVC-")]
    assert len(masq) == 1 and "-d 10.96.0.10/32" not in masq[0] and "-d 10.96.0.10" in masq[0]
    assert "! -s" not in masq[0]


def test_lb_ips_are_admitted_as_sources_when_a_node_address_is():
    """Upstream TestLoadBalancer: "same node to LB1, SNATted to LB1 (implicitly allowed)"."""
    lb = ServicePort(SPN, "10.96.0.10", 80, Protocol.TCP, load_balancer_ips=("1.2.3.4",),
                     load_balancer_source_ranges=(" 192.168.0.0/24 ", "203.0.113.0/25"))
    assert lb.lb_ips_admitted_as_source(("192.168.0.2",))
    assert not lb.lb_ips_admitted_as_source(("10.0.0.2",))
    assert not ServicePort(SPN, "10.96.0.10", 80, Protocol.TCP).lb_ips_admitted_as_source(("192.168.0.2",))
