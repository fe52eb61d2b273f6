"""The compiled programs attached for real: TC on a node's veths, the socket LB on a cgroup,
real TCP and UDP through them (see netlab.py for the topology and why it is built that way)."""

from __future__ import annotations

import pytest
from dataclasses import replace

from pyroute2 import IPRoute

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, NodeSettings, Service
from tests.bpf import netlab
from tests.bpf.netlab import BACKEND_IP, NODE_OUTSIDE_SIDE, POD_IP

pytestmark = [pytest.mark.bpf, pytest.mark.root]

VIP, PORT, BACKEND_PORT, NODE_PORT = "10.96.0.10", 80, 8080, 30080
LB_IP = "192.0.2.80"  # a load-balancer IP admitting 198.51.100.0/24 only
SETTINGS = NodeSettings(snat_addr=NODE_OUTSIDE_SIDE, snat_port_min=61000, snat_port_max=65535)
DEAD_VIP = "10.96.0.99"  # a service without endpoints
DEAD_EXTERNAL_IP = "192.0.2.99"  # that service's externalIP


@pytest.fixture
def lab(datapath, maps):
    with netlab.NetLab() as lab:
        maps.set_settings(SETTINGS)
        maps.set_node_addrs([NODE_OUTSIDE_SIDE, netlab.NODE_POD_SIDE, netlab.NODE_BACKEND_SIDE])
        maps.set_pod_cidrs(["10.244.0.0/16"])
        for proto in (6, 17):
            svc_id = 10 + proto
            maps.set_backend(svc_id, Backend(BACKEND_IP, BACKEND_PORT))
            maps.set_slots(svc_id, s.LB4_SCOPE_CLUSTER, [svc_id])
            has = s.LB4_F_HAS_ENDPOINTS
            maps.set_service(Frontend(VIP, PORT, proto), Service(svc_id, 1, 0, 0, has))
            maps.set_service(Frontend(None, NODE_PORT, proto), Service(svc_id, 1, 0, 0, has | s.LB4_F_EXTERNAL))
            maps.set_service(Frontend(DEAD_VIP, PORT, proto), Service(svc_id + 100, 0, 0, 0, 0))
            maps.set_service(Frontend(DEAD_EXTERNAL_IP, PORT, proto), Service(svc_id + 100, 0, 0, 0, s.LB4_F_EXTERNAL))
            ranged = has | s.LB4_F_EXTERNAL | s.LB4_F_SOURCE_RANGES
            maps.set_service(Frontend(LB_IP, PORT, proto), Service(svc_id, 1, 0, 0, ranged))
            maps.add_source_range(svc_id, "198.51.100.0/24")
        lab.start_server(BACKEND_PORT)
        with IPRoute(netns=lab.ns["node"]) as ipr:
            for dev, *_ in netlab.LINKS.values():
                loader.attach_tc(ipr, lab.ifindex(dev), datapath.prog_fds["tc_ingress"], datapath.prog_fds["tc_egress"])
        yield lab


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_pod_to_clusterip_keeps_the_pod_address(lab, maps, proto):
    assert lab.client("pod", proto, VIP, PORT) == ["ok", f"{POD_IP}:" + lab_port_of(lab, maps), f"{VIP}:{PORT}"]


def lab_port_of(lab, maps) -> str:
    """The client port the backend saw (the pod's own, unmasqueraded)."""
    svc = [c for c in maps.connections() if c.kind == s.CT4_SVC and c.saddr == POD_IP]
    return str(svc[-1].sport)


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_outside_to_nodeport_is_masqueraded(lab, maps, proto):
    result = lab.client("outside", proto, NODE_OUTSIDE_SIDE, NODE_PORT)
    assert result[0] == "ok", result
    seen_addr, seen_port = result[1].split(":")
    assert seen_addr == NODE_OUTSIDE_SIDE and 61000 <= int(seen_port) <= 65535
    assert result[2] == f"{NODE_OUTSIDE_SIDE}:{NODE_PORT}"
    counts = {r: p for r, (p, _) in maps.stats().items() if p}
    assert counts[s.Reason.SNAT] and counts[s.Reason.REV_SNAT] and counts[s.Reason.REV_DNAT]


def test_service_without_endpoints_refuses(lab, maps):
    assert lab.client("pod", "tcp", DEAD_VIP, PORT) == ["error", "ConnectionRefusedError"]
    assert maps.stats()[s.Reason.REJECT][0] >= 1


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_node_process_through_socket_lb(lab, datapath, maps, proto):
    cgroup = lab.cgroup()
    loader.attach_cgroup(datapath, cgroup)
    try:
        result = lab.client("node", proto, VIP, PORT, cgroup=cgroup)
        refused = lab.client("node", "tcp", DEAD_VIP, PORT, cgroup=cgroup)
    finally:
        loader.detach_cgroup(datapath, cgroup)
    assert result[0] == "ok" and result[1].split(":")[0] == netlab.NODE_BACKEND_SIDE, result
    if proto == "udp":
        assert result[2] == f"{VIP}:{PORT}", "recvmsg shows the frontend, not the backend"
    assert refused == ["error", "ConnectionRefusedError"]
    assert maps.stats()[s.Reason.SOCK_FWD][0] >= 1


def test_node_call_to_an_external_ip_without_endpoints_is_not_rejected(lab, datapath, maps):
    """kube-proxy rejects a Service's externalIPs/LB IPs without endpoints in KUBE-EXTERNAL-SERVICES,
    which INPUT and FORWARD reach but not the node's own OUTPUT: its call leaves untouched."""
    cgroup = lab.cgroup()
    loader.attach_cgroup(datapath, cgroup)
    try:
        result = lab.client("node", "tcp", DEAD_EXTERNAL_IP, PORT, cgroup=cgroup)
    finally:
        loader.detach_cgroup(datapath, cgroup)
    assert result != ["error", "ConnectionRefusedError"], result
    assert maps.stats()[s.Reason.PASS_SOCK_EXTERNAL][0] >= 1
    assert not maps.stats()[s.Reason.SOCK_REJECT][0]


def test_socket_lb_acts_only_in_the_host_namespace(lab, datapath, maps):
    """Pods' own namespaces take the packet path: the socket LB leaves other netns alone."""
    cgroup = lab.cgroup()
    loader.attach_cgroup(datapath, cgroup)
    try:
        maps.set_settings(replace(SETTINGS, host_netns_cookie=lab.netns_cookie("node")))
        assert lab.client("node", "tcp", VIP, PORT, cgroup=cgroup)[0] == "ok"
        maps.reset_stats()
        maps.set_settings(replace(SETTINGS, host_netns_cookie=lab.netns_cookie("pod")))
        # not translated: the node has no route to the clusterIP
        assert lab.client("node", "tcp", VIP, PORT, cgroup=cgroup) == ["error", "OSError"]
        assert s.Reason.SOCK_FWD not in {r for r, (p, _) in maps.stats().items() if p}
    finally:
        loader.detach_cgroup(datapath, cgroup)


def test_xdp_drops_before_tc_and_detaches(lab, datapath, maps):
    with IPRoute(netns=lab.ns["node"]) as ipr:
        index = lab.ifindex("vout")
        loader.detach_tc(ipr, index)  # only XDP left on the outside device: any drop is its own
        loader.attach_xdp(ipr, index, datapath.prog_fds["xdp_lb"])
        assert ipr.get_links(index)[0].get("xdp").get("IFLA_XDP_ATTACHED") == "xdpgeneric"
        maps.reset_stats()
        assert lab.client("outside", "tcp", LB_IP, PORT, timeout=1.5) == ["error", "TimeoutError"]
        dropped = maps.stats()[s.Reason.DROP_SOURCE_RANGE][0]
        assert dropped >= 1  # the SYN and its retransmissions
        loader.detach_xdp(ipr, index)
        assert ipr.get_links(index)[0].get("xdp").get("IFLA_XDP_ATTACHED") is None


LOCAL_NODE_PORT = 30081  # externalTrafficPolicy=Local, no endpoint on this node


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_localhost_nodeport_from_a_loopback_bound_socket(lab, datapath, maps, proto):
    """Rule 8: a node process bound to 127.0.0.1 reaches 127.0.0.1:<nodePort> of an eTP=Local
    service without a local endpoint: any endpoint (127.0.0.1 is a LOCAL source, so kube-proxy's
    KUBE-EXT routes it to the cluster chain), masqueraded to the node's address on the way out
    (the socket keeps its loopback source: tc_egress does what POSTROUTING MASQUERADE does), and
    the reply is delivered back to the loopback socket."""
    num = 6 if proto == "tcp" else 17
    flags = s.LB4_F_HAS_ENDPOINTS | s.LB4_F_EXTERNAL | s.LB4_F_ETP_LOCAL
    maps.set_service(Frontend(None, LOCAL_NODE_PORT, num), Service(10 + num, 1, 0, 0, flags))
    maps.set_node_addrs([NODE_OUTSIDE_SIDE, netlab.NODE_POD_SIDE, netlab.NODE_BACKEND_SIDE, "127.0.0.1"])
    cgroup = lab.cgroup()
    loader.attach_cgroup(datapath, cgroup)
    maps.reset_stats()
    try:
        result = lab.client("node", proto, "127.0.0.1", LOCAL_NODE_PORT, cgroup=cgroup, source="127.0.0.1")
    finally:
        loader.detach_cgroup(datapath, cgroup)
    assert result[0] == "ok", result
    seen_addr, seen_port = result[1].split(":")
    assert seen_addr == NODE_OUTSIDE_SIDE and 61000 <= int(seen_port) <= 65535, "masqueraded to the node"
    if proto == "udp":
        assert result[2] == f"127.0.0.1:{LOCAL_NODE_PORT}", "recvmsg shows the frontend"
    counts = {r: p for r, (p, _) in maps.stats().items() if p}
    assert counts[s.Reason.SOCK_FWD] and counts[s.Reason.SNAT] and counts[s.Reason.REV_SNAT]
    masqueraded = [c for c in maps.connections() if c.kind == s.CT4_SVC]
    assert masqueraded and all(c.flags & s.CT4_F_SOCK_MASQ and c.saddr == "127.0.0.1" for c in masqueraded)


def test_loopback_source_not_from_the_socket_lb_is_left_alone(lab, datapath, maps):
    """Only sockets the socket LB sent to a backend are masqueraded on egress: a loopback-bound
    socket talking to the backend directly leaves untouched (and so gets no answer)."""
    maps.reset_stats()
    result = lab.client("node", "tcp", BACKEND_IP, BACKEND_PORT, source="127.0.0.1", timeout=1)
    assert result[0] == "error", result
    assert not maps.stats().get(s.Reason.SNAT, (0, 0))[0]
    assert not [c for c in maps.connections() if c.kind == s.CT4_SVC]
