"""Host routing (bpf/lib/fib4.h, CFG_F_HOST_ROUTING): tc_ingress forwards what it translated itself.

Two tiers on netlab's node (strict rp_filter, forwarding on, TX offload off on the node's veths):
  - BPF_PROG_TEST_RUN inside the node's netns, so bpf_fib_lookup sees its routes and neighbours:
    each way out of the fast path, decided packet by packet (redirect, TTL, MACs, the counters);
  - the programs attached to the node's veths and real TCP/UDP through them: the same
    observations as on the slow path (test_attach.py), with the fast path counted.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import threading
from dataclasses import replace

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.layers.sctp import SCTP

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf import loader, testrun
from ebpf_proxy.datapath.ebpf.datapath import resolve_host_routing
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Service
from tests.bpf.netlab import BACKEND_IP, NODE_OUTSIDE_SIDE, OUTSIDE_IP, POD_IP, sh
from tests.bpf.packets import TC_ACT_OK, TC_ACT_REDIRECT, assert_checksums_valid, sctp, sctp_crc_valid
from tests.bpf.test_attach import BACKEND_PORT, NODE_PORT, PORT, SETTINGS, VIP, lab  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ROUTED = replace(SETTINGS, handover=s.CFG_F_HOST_ROUTING)  # the datapath sets the bit this way (datapath.py)
HOST_EVENTS = (R.EV_HOST_ROUTED_PEER, R.EV_HOST_ROUTED_NEIGH, R.EV_HOST_STACK_FIB, R.EV_HOST_STACK_MTU,
               R.EV_HOST_STACK_SKIP)
BACKEND_MAC = "02:00:00:00:01:31"
SCTP_P = socket.IPPROTO_SCTP
_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def counts(maps) -> dict[s.Reason, int]:
    return {r: p for r, (p, _) in maps.stats().items() if p}


def host_events(maps) -> dict[s.Reason, int]:
    return {r: n for r, n in counts(maps).items() if r in HOST_EVENTS}


def _mac(lab, dev: str) -> str:
    return json.loads(sh("ip", "-j", "link", "show", "dev", dev, ns=lab.ns["node"]).stdout)[0]["address"]


def run_in_node(lab, datapath, frame: bytes, ifindex: int) -> testrun.RunResult:
    """tc_ingress on `frame` as if it arrived on `ifindex`, run from a thread inside the node's
    netns: the helpers look up that namespace's FIB (the test process's own is never touched)."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{lab.ns['node']}", os.O_RDONLY)
            try:
                if _LIBC.setns(fd, _CLONE_NEWNET) != 0:  # this thread only (Python 3.11 has no os.setns)
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            out["result"] = testrun.run(datapath.prog_fds["tc_ingress"], frame, ctx=testrun.SkBuffCtx(ifindex=ifindex))
        except Exception as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.fixture
def node(lab, maps):
    """The node with a permanent neighbour entry for the backend (the lookup's SUCCESS needs one)."""
    sh("ip", "neigh", "replace", BACKEND_IP, "lladdr", BACKEND_MAC, "dev", "vbe", "nud", "permanent", ns=lab.ns["node"])
    maps.set_settings(ROUTED)
    maps.reset_stats()
    return lab


def syn_from_pod(lab, ttl: int = 64, size: int = 0, dev: str = "vpod") -> bytes:
    pkt = Ether(src="02:00:00:00:00:07", dst=_mac(lab, dev)) / IP(src=POD_IP, dst=VIP, ttl=ttl, flags="DF") / TCP(
        sport=40000, dport=PORT, flags="S")
    return bytes(pkt / (b"x" * size)) if size else bytes(pkt)


def test_into_a_local_pod_redirects_to_the_peer_as_ip_forward_would(node, datapath, maps):
    maps.set_ifaces({node.ifindex("vbe"): s.EPX_IF_POD | s.EPX_IF_PEER})
    result = run_in_node(node, datapath, syn_from_pod(node), node.ifindex("vpod"))
    assert result.retval == TC_ACT_REDIRECT
    out = Ether(result.packet)
    assert (out[IP].dst, out[TCP].dport) == (BACKEND_IP, BACKEND_PORT)
    assert out[IP].ttl == 63, "forwarding decrements the TTL"
    assert_checksums_valid(out)
    # the frame is the pod's to take: its MAC, from the node's side of its veth
    assert (out.dst, out.src) == (BACKEND_MAC, _mac(node, "vbe"))
    assert host_events(maps) == {R.EV_HOST_ROUTED_PEER: 1}
    # the egress hook of vbe will not run: its verdict is counted here (nothing to masquerade)
    assert counts(maps)[R.FWD_NEW] == 1 and counts(maps)[R.PASS_NO_SERVICE] == 1


def test_to_another_device_redirects_to_the_next_hop(node, datapath, maps):
    result = run_in_node(node, datapath, syn_from_pod(node), node.ifindex("vpod"))  # vbe not a pod's veth
    assert result.retval == TC_ACT_REDIRECT
    out = Ether(result.packet)
    assert out[IP].ttl == 63 and out[IP].dst == BACKEND_IP
    assert_checksums_valid(out)
    assert host_events(maps) == {R.EV_HOST_ROUTED_NEIGH: 1}
    assert R.PASS_NO_SERVICE not in counts(maps), "the egress hook still runs there: nothing done for it"


def test_sctp_redirected_by_the_fast_path_gets_its_crc32c_for_every_port_changed(node, datapath, maps):
    """SCTP's CRC32c is updated once tc_ingress is done (tc_lb.c: tc_sctp_done), a redirect
    included: here a NodePort's DNAT (30080 -> 8080) and the masquerade (a new source port) that
    fib4_egress_work does for the backend pod's veth, in one run, then bpf_redirect_peer."""
    sid = 10 + SCTP_P
    maps.set_backend(sid, Backend(BACKEND_IP, BACKEND_PORT))
    maps.set_slots(sid, s.LB4_SCOPE_CLUSTER, [sid])
    maps.set_service(Frontend(None, NODE_PORT, SCTP_P), Service(sid, 1, 0, 0, s.LB4_F_HAS_ENDPOINTS | s.LB4_F_EXTERNAL))
    maps.set_ifaces({node.ifindex("vbe"): s.EPX_IF_POD | s.EPX_IF_PEER})
    frame = sctp(OUTSIDE_IP, 40000, NODE_OUTSIDE_SIDE, NODE_PORT, flags="DF")
    frame[Ether].dst = _mac(node, "vout")
    assert sctp_crc_valid(frame)
    result = run_in_node(node, datapath, bytes(frame), node.ifindex("vout"))
    assert result.retval == TC_ACT_REDIRECT
    out = Ether(result.packet)
    assert (out[IP].src, out[IP].dst, out[SCTP].dport) == (NODE_OUTSIDE_SIDE, BACKEND_IP, BACKEND_PORT)
    assert 61000 <= out[SCTP].sport <= 65535 and out[IP].ttl == 63
    assert_checksums_valid(out)  # the CRC32c computed from scratch
    assert host_events(maps) == {R.EV_HOST_ROUTED_PEER: 1}
    assert counts(maps)[R.FWD_NEW] == 1 and counts(maps)[R.SNAT] == 1


@pytest.mark.parametrize("case", ["ttl 1", "larger than the route MTU", "larger than an unlocked route MTU",
                                  "no neighbour", "reverse path", "switched off"])
def test_the_slow_path_when_the_kernel_must_decide(node, datapath, maps, case):
    frame, ingress = syn_from_pod(node), node.ifindex("vpod")
    expected = {}
    if case == "ttl 1":  # the kernel answers time exceeded
        frame, expected = syn_from_pod(node, ttl=1), {R.EV_HOST_STACK_SKIP: 1}
    elif case == "larger than the route MTU":  # the kernel answers fragmentation needed (DF)
        sh("ip", "route", "add", f"{BACKEND_IP}/32", "dev", "vbe", "mtu", "lock", "1000", ns=node.ns["node"])
        frame, expected = syn_from_pod(node, size=1000), {R.EV_HOST_STACK_MTU: 1}
    elif case == "larger than an unlocked route MTU":  # forwarding honours it, the lookup does not:
        # the agent writes it into epx_iface (devices.route_mtus), here by hand
        maps.set_ifaces({node.ifindex("vbe"): 1000 << s.EPX_IF_MTU_SHIFT})
        frame, expected = syn_from_pod(node, size=1000), {R.EV_HOST_STACK_MTU: 1}
    elif case == "no neighbour":  # the kernel resolves it (later packets go fast)
        sh("ip", "neigh", "del", BACKEND_IP, "dev", "vbe", ns=node.ns["node"])
        expected = {R.EV_HOST_STACK_FIB: 1}
    elif case == "reverse path":  # the pod's address arriving from outside: rp_filter's to judge
        frame, ingress, expected = syn_from_pod(node, dev="vout"), node.ifindex("vout"), {R.EV_HOST_STACK_FIB: 1}
    else:
        maps.set_settings(SETTINGS)
    result = run_in_node(node, datapath, frame, ingress)
    assert result.retval == TC_ACT_OK
    out = Ether(result.packet)
    assert out[IP].dst == BACKEND_IP, "translated as on the slow path"
    assert out[IP].ttl == Ether(frame)[IP].ttl, "the stack decrements it"
    assert host_events(maps) == expected


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_pod_to_clusterip_through_the_fast_path_both_ways(lab, maps, proto):
    """Both veths are pods' (EPX_IF_PEER): the request and the reply are delivered with
    bpf_redirect_peer, the reply's frontend restored at ingress; what the pod sees is the slow path's."""
    maps.set_settings(ROUTED)
    maps.set_ifaces({lab.ifindex("vpod"): s.EPX_IF_POD | s.EPX_IF_PEER, lab.ifindex("vbe"): s.EPX_IF_POD | s.EPX_IF_PEER})
    assert lab.client("pod", proto, VIP, PORT)[0] == "ok"  # neighbours resolved by the first packets
    maps.reset_stats()
    result = lab.client("pod", proto, VIP, PORT)
    assert result[0] == "ok" and result[1].startswith(f"{POD_IP}:") and result[2] == f"{VIP}:{PORT}", result
    events = host_events(maps)
    assert events.get(R.EV_HOST_ROUTED_PEER, 0) >= 2, events  # at least a request and a reply
    assert not {R.EV_HOST_STACK_SKIP, R.EV_HOST_STACK_MTU} & set(events), events
    assert counts(maps)[R.REV_DNAT] >= 1


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_outside_to_nodeport_masqueraded_through_the_fast_path(lab, maps, proto):
    """Into the backend's veth with its masquerade done at ingress (bpf_redirect_peer skips that
    veth's egress hook); the reply to the outside device with bpf_redirect_neigh, whose egress hook
    still runs and restores the frontend. The client sees what test_attach.py's slow path shows."""
    maps.set_settings(ROUTED)
    maps.set_ifaces({lab.ifindex("vbe"): s.EPX_IF_POD | s.EPX_IF_PEER})
    assert lab.client("outside", proto, NODE_OUTSIDE_SIDE, NODE_PORT)[0] == "ok"
    maps.reset_stats()
    result = lab.client("outside", proto, NODE_OUTSIDE_SIDE, NODE_PORT)
    assert result[0] == "ok", result
    seen_addr, seen_port = result[1].split(":")
    assert seen_addr == NODE_OUTSIDE_SIDE and 61000 <= int(seen_port) <= 65535
    assert result[2] == f"{NODE_OUTSIDE_SIDE}:{NODE_PORT}"
    events = host_events(maps)
    assert events.get(R.EV_HOST_ROUTED_PEER, 0) >= 1 and events.get(R.EV_HOST_ROUTED_NEIGH, 0) >= 1, events
    done = counts(maps)
    assert done[R.SNAT] and done[R.REV_SNAT] and done[R.REV_DNAT]


def test_auto_is_on_where_the_kernel_has_the_helpers(monkeypatch):
    assert loader.host_routing_unsupported() is None, "this kernel (6.x) loads a program calling each helper"
    assert "older than 5.11" in loader.host_routing_unsupported("5.10.0-28-amd64")
    assert resolve_host_routing("auto") and resolve_host_routing("on") and not resolve_host_routing("off")
    monkeypatch.setattr(loader, "host_routing_unsupported", lambda: "the kernel refuses bpf_redirect_peer")
    assert not resolve_host_routing("auto")
    with pytest.raises(loader.LoadError, match="bpf_redirect_peer"):
        resolve_host_routing("on")  # asked for, not silently off
