"""`trace` of IPv6 flows against the real loaded programs (ebpf_trace.trace_ebpf) on a throw-away node
with IPv6 (netlab's, given IPv6 by test_sock6_lb.add_ipv6), its IPv6 maps filled: the answer is
what real IPv6 traffic through the same programs does, and tracing writes nothing. With the node's
IPv6 path off (CFG6_F_ON unset), the eBPF tracer refuses and says why: ip6tables answers then.
"""

from __future__ import annotations

import pytest
from pyroute2 import IPRoute

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps6
from ebpf_proxy.explain.ebpf_trace import TraceError, ipv6_served, trace_ebpf
from ebpf_proxy.explain.packet import FlowSpec, host_port
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.model import Protocol
from tests.bpf import netlab, world6
from tests.bpf.packets import counted
from tests.bpf.test_sock6_lb import BACKEND6, BACKEND_PORT, LINKS6, PORT, add_ipv6, call, dual_stack_server

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
VIP6, DEAD_VIP6, LB_IP6 = world6.VIP6, "fd00:96::99", world6.LB_IP6
NODE_PORT = world6.NODE_PORT
POD6, OUTSIDE6 = LINKS6["pod"][2], LINKS6["outside"][2]
NODE_OUT6 = LINKS6["outside"][1]  # the node's outside address: its NodePort address and IPv6 masquerade source
BACKEND = host_port(BACKEND6, BACKEND_PORT)
# what the lab's own veths say on their own (neighbour discovery: PASS_IPV6_NOT_L4; anything else)
NOISE = (R.PASS_NOT_IPV4, R.PASS_IPV6_NOT_L4, R.PASS_IPV6_OFF)


@pytest.fixture
def lab6(datapath, maps):
    """The IPv6 node: its addresses and masquerade source in epx_config6 (IPv6 path on), the pod
    CIDR, a clusterIP + NodePort + LB IP (admitting 2001:db8:113::/48 only) and a clusterIP without
    endpoints, for TCP and UDP; the TC programs on the node's veths, the server on the backend."""
    with netlab.NetLab() as lab, dual_stack_server(lab):
        add_ipv6(lab)
        Maps6(maps).set_config6(NODE_OUT6, on=True)
        maps.set_node_addrs6([addr for _, addr, _ in LINKS6.values()])
        maps.set_pod_cidrs6([world6.POD_CIDR6])
        ext, ranged = world6.EXT, world6.EXT | s.LB4_F_SOURCE_RANGES
        for svc_id, proto in ((1, world6.TCP_P), (2, world6.UDP_P)):
            world6.install6(maps, world6.Svc6(
                id=svc_id, proto=proto, cluster=((BACKEND6, BACKEND_PORT),), ranges=("2001:db8:113::/48",),
                frontends=((VIP6, PORT, 0), (None, NODE_PORT, ext), (LB_IP6, PORT, ranged))))
        for svc_id, proto in ((3, world6.TCP_P), (4, world6.UDP_P)):
            world6.install6(maps, world6.Svc6(id=svc_id, proto=proto, frontends=((DEAD_VIP6, PORT, 0),), flags=0))
        with IPRoute(netns=lab.ns["node"]) as ipr:
            for dev, *_ in netlab.LINKS.values():
                loader.attach_tc(ipr, lab.ifindex(dev), datapath.prog_fds["tc_ingress"], datapath.prog_fds["tc_egress"])
        yield lab


def quiet_state(maps) -> tuple:
    """What a trace must leave as it was: the IPv6 connections and affinity entries, the counters
    (but the veths' own chatter)."""
    return (sorted(map(repr, maps.connections6())), maps.count("epx_affinity6"),
            {r: n for r, n in counted(maps).items() if r not in NOISE})


def node_trace(lab, pin_dir, flow: FlowSpec, **kw):
    return run_in_netns(lab.ns["node"], trace_ebpf, flow, pin_dir, **kw)


def test_ipv6_flows_are_explained_by_the_programs(lab6, datapath, maps, pin_dir):
    lab = lab6
    before = quiet_state(maps)
    names = {(VIP6, PORT, "TCP"): "default/web:http"}

    pod = node_trace(lab, pin_dir, FlowSpec(POD6, VIP6, PORT, origin="pod"), names=names)
    assert (pod.verdict, pod.reason.split(":")[0], pod.service, pod.backends, pod.masquerade, pod.source_after) == \
        ("dnat", "FWD_NEW", "default/web:http", (BACKEND,), False, POD6)
    assert [(st.hook, st.unit) for st in pod.steps] == [("tc-ingress", "tc_ingress@vpod"), ("tc-egress", "tc_egress@vbe")]
    assert pod.details["picked"] == BACKEND

    with IPRoute(netns=lab.ns["node"]) as ipr:  # as --bpf-xdp-mode generic attaches it: the trace runs it first
        loader.attach_xdp(ipr, lab.ifindex("vout"), datapath.prog_fds["xdp_lb"], "generic")
    out = node_trace(lab, pin_dir, FlowSpec(OUTSIDE6, NODE_OUT6, NODE_PORT, origin="external"))
    assert (out.verdict, out.backends, out.masquerade, out.source_after) == ("dnat", (BACKEND,), True, NODE_OUT6)
    assert [st.hook for st in out.steps] == ["xdp", "tc-ingress", "tc-egress"]
    assert "epx_config6" in out.steps[-1].action

    denied = node_trace(lab, pin_dir, FlowSpec(world6.OUTSIDE6_2, LB_IP6, PORT, origin="external",
                                               in_iface="vout"))
    assert (denied.verdict, denied.reason.split(":")[0], [st.hook for st in denied.steps]) == \
        ("drop", "DROP_SOURCE_RANGE", ["xdp"])

    dead = node_trace(lab, pin_dir, FlowSpec(POD6, DEAD_VIP6, PORT, origin="pod"))
    assert (dead.verdict, dead.reason.split(":")[0], dead.backends) == ("reject", "REJECT", ())

    udp = node_trace(lab, pin_dir, FlowSpec(POD6, VIP6, PORT, protocol=Protocol.UDP, origin="pod"))
    assert (udp.verdict, udp.backends) == ("dnat", (BACKEND,))

    assert quiet_state(maps) == before, "tracing wrote nothing"

    # the same flows for real, through the same programs
    assert call(lab, None, "tcp", VIP6, role="pod")[1].rsplit("|", 1)[0] == POD6
    assert call(lab, None, "tcp", NODE_OUT6, NODE_PORT, role="outside")[1].rsplit("|", 1)[0] == NODE_OUT6
    assert call(lab, None, "tcp", DEAD_VIP6, role="pod") == ["error", "ConnectionRefusedError"]


@pytest.mark.parametrize("proto", [Protocol.TCP, Protocol.UDP])
def test_node_traffic_is_asked_of_the_ipv6_socket_lb(lab6, datapath, maps, pin_dir, proto):
    lab = lab6
    cgroup = lab.cgroup()
    loader.attach_cgroup(datapath, cgroup)
    try:
        before = quiet_state(maps)
        host = node_trace(lab, pin_dir, FlowSpec(NODE_OUT6, VIP6, PORT, protocol=proto, origin="host"), cgroup=cgroup)
        dead = node_trace(lab, pin_dir, FlowSpec(NODE_OUT6, DEAD_VIP6, PORT, protocol=proto, origin="host"),
                          cgroup=cgroup)
        assert quiet_state(maps) == before, "the trace socket sent nothing and the program wrote nothing"
        live = call(lab, cgroup, proto.lower, VIP6)
    finally:
        loader.detach_cgroup(datapath, cgroup)
    hook = "cgroup/sendmsg6" if proto == Protocol.UDP else "cgroup/connect6"
    assert [st.hook for st in host.steps] == [hook]
    assert (host.verdict, host.reason.split(":")[0], host.backends) == ("dnat", "SOCK_FWD", (BACKEND,))
    assert live[0] == "ok" and live[1].rsplit("|", 1)[0] == host.source_after == LINKS6["backend"][1]
    assert (dead.verdict, dead.reason.split(":")[0]) == ("reject", "SOCK_REJECT")


def test_with_the_ipv6_path_off_the_ebpf_tracer_refuses(lab6, maps, pin_dir):
    """ip6tables serves IPv6 then (the CLI walks its rules instead, cli/trace.py): the programs
    would only say PASS_IPV6_OFF."""
    assert run_in_netns(lab6.ns["node"], ipv6_served, pin_dir)
    Maps6(maps).set_config6(NODE_OUT6, on=False)
    assert not run_in_netns(lab6.ns["node"], ipv6_served, pin_dir)
    with pytest.raises(TraceError, match="CFG6_F_ON"):
        node_trace(lab6, pin_dir, FlowSpec(POD6, VIP6, PORT, origin="pod"))
