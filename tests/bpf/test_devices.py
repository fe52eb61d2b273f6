"""devices.py: which devices get programs (pure), and attaching/following them in a real netns."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from pyroute2 import IPRoute

from ebpf_proxy.datapath.ebpf import devices, libbpf, loader
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.devices import EXTERNAL, POD, Device, Link, Route, classify, iface_flags
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.model import LocalDetector, LocalMode
from tests.bpf import netlab
from tests.netns_util import nsenter

CIDRS = ("10.244.0.0/16",)


def test_lab_node_devices():
    """The lab's node: eth0 (peer on the underlay, /24 routes via other nodes), one pod veth."""
    links = [Link(1, "lo", loopback=True), Link(2, "eth0", "veth", True), Link(3, "lxcba92dbab", "veth", True)]
    routes = [Route("10.244.4.0/24", 2, "172.20.20.17"), Route("172.20.20.17/32", 2), Route("10.244.5.4/32", 3)]
    assert classify(links, routes, CIDRS) == {2: Device(2, "eth0", EXTERNAL), 3: Device(3, "lxcba92dbab", POD)}


@pytest.mark.parametrize("link, route, role", [
    (Link(5, "pod-a", "veth", True), Route("10.244.9.9/32", 5), POD),  # a routed CNI's veth, any name
    (Link(5, "pod-a", "veth", False), Route("10.244.9.9/32", 5), EXTERNAL),  # its peer is here: not a pod's
    (Link(5, "pod-a", "veth", True), Route("10.245.9.9/32", 5), EXTERNAL),  # host route outside the cluster CIDR
    (Link(5, "pod-a", "veth", True), Route("10.244.9.0/24", 5, "10.0.0.1"), EXTERNAL),  # a gateway route
    (Link(5, "pod-a", "vxlan", False), Route("10.244.9.9/32", 5), EXTERNAL),  # not a veth
    (Link(5, "cali12345", "veth", True), None, POD),  # a CNI prefix, before its route exists
    (Link(5, "ens3", None, False), Route("0.0.0.0/0", 5, "10.0.0.1"), EXTERNAL),
], ids=["routed-veth", "local-peer", "outside-cidr", "gateway", "not-veth", "pattern", "nic"])
def test_role(link, route, role):
    got = classify([link], [route] if route else [], CIDRS)
    assert got == {5: Device(5, link.name, role)}


def test_patterns_are_configurable_and_cidrs_may_be_empty():
    links = [Link(5, "lxc1", "veth", True), Link(6, "pod-b", "veth", True)]
    routes = [Route("10.244.1.1/32", 6)]
    assert {d.role for d in classify(links, routes, CIDRS, pod_patterns=()).values()} == {EXTERNAL, POD}
    assert {d.role for d in classify(links, routes, (), pod_patterns=()).values()} == {EXTERNAL}


# ---- in a namespace ----


def _filters(ns: str, dev: str) -> list[str]:
    """Our TC programs on `dev`, "hook:name" (through tcx on this kernel; cls_bpf filters where not)."""
    names = run_in_netns(ns, loader.tc_attached_by_device)[dev]
    return [f"{hook}:{name}" for hook, name in (("ingress", "epx_ingress"), ("egress", "epx_egress"))
            for _ in range(names.count(name))]


def _xdp(ns: str, dev: str) -> bool:
    return "xdp" in subprocess.run([*nsenter(ns), "ip", "link", "show", dev], capture_output=True, text=True).stdout


def _wait(condition, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.05)


@pytest.mark.bpf
@pytest.mark.root
def test_iface_flags_mark_pod_devices_and_what_the_interface_detectors_match():
    """kube-proxy's `-i` sees the device a packet enters the IP layer through: for a pod on a
    bridge, the bridge, so a bridge port is local exactly when its bridge is."""
    links = [Link(1, "lo", loopback=True), Link(2, "eth0"), Link(3, "cbr0", "bridge"),
             Link(4, "veth1", "veth", peer_elsewhere=True, master=3), Link(5, "cali9", "veth", peer_elsewhere=True)]
    devs = classify(links, [], [], ("veth*", "cali*"))
    bridge = LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")
    # cali9 is a routed pod veth: host routing may deliver through it (EPX_IF_PEER); veth1 is a
    # bridge port, which no route names
    cali = s.EPX_IF_POD | s.EPX_IF_PEER
    assert iface_flags(links, devs, bridge) == {3: s.EPX_IF_LOCAL, 4: s.EPX_IF_POD | s.EPX_IF_LOCAL, 5: cali}
    prefix = LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="cali")
    assert iface_flags(links, devs, prefix) == {4: s.EPX_IF_POD, 5: cali | s.EPX_IF_LOCAL}
    prefix_veth = LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface="veth")
    assert iface_flags(links, devs, prefix_veth)[4] == s.EPX_IF_POD  # enters through cbr0, not veth1
    assert iface_flags(links, devs, LocalDetector()) == {4: s.EPX_IF_POD, 5: cali}
    # the devices that send no ICMP redirects (the sysctl, read by the caller), loopback never
    quiet = iface_flags(links, devs, LocalDetector(), lambda name: name in ("lo", "eth0"))
    assert quiet == {2: s.EPX_IF_NO_REDIRECTS, 4: s.EPX_IF_POD, 5: cali}
    # the smallest route MTU out of each device in the high bits (host routing's MTU check);
    # a multipath route's (no oif) counts for every device
    mtus = iface_flags(links, devs, LocalDetector(), mtus={2: 1400, 5: 1200, None: 1300})
    assert mtus == {2: 1300 << s.EPX_IF_MTU_SHIFT, 3: 1300 << s.EPX_IF_MTU_SHIFT,
                    4: s.EPX_IF_POD | 1300 << s.EPX_IF_MTU_SHIFT, 5: cali | 1200 << s.EPX_IF_MTU_SHIFT}


def test_attach_follow_and_detach(datapath):
    with netlab.NetLab() as lab:
        node = lab.ns["node"]
        devs = devices.Devices(
            devices.Programs(datapath.prog_fds["tc_ingress"], datapath.prog_fds["tc_egress"], datapath.prog_fds["xdp_lb"]),
            cluster_cidrs=CIDRS, pod_patterns=("vpod", "lxc*"),
        )
        assert run_in_netns(node, devs.reconcile, True) == 3
        assert run_in_netns(node, devs.reconcile) == 0, "nothing changed, nothing re-attached"
        for dev in ("vpod", "vbe", "vout"):
            assert _filters(node, dev) == ["ingress:epx_ingress", "egress:epx_egress"], dev
        assert not _xdp(node, "vpod") and _xdp(node, "vbe") and _xdp(node, "vout"), "XDP on external devices only"

        watcher = devices.LinkWatcher(devs.reconcile)
        run_in_netns(node, watcher.start)
        try:
            netlab.sh(*nsenter(node), "ip", "link", "add", "lxcw1", "type", "veth", "peer", "name", "eth1",
                      "netns", lab.ns["pod"])
            _wait(lambda: any(d.name == "lxcw1" for d in devs.attached.values()), "attaching to a new pod veth")
            assert _filters(node, "lxcw1") == ["ingress:epx_ingress", "egress:epx_egress"]
            assert not _xdp(node, "lxcw1")
            netlab.sh(*nsenter(node), "ip", "link", "del", "lxcw1")
            _wait(lambda: all(d.name != "lxcw1" for d in devs.attached.values()), "forgetting a deleted veth")
        finally:
            watcher.stop()

        foreign = libbpf.prog_load(libbpf.PROG_TYPE_SCHED_CLS, libbpf.return_constant_program(0), name="someone")
        try:  # someone else's filter on the same hook must survive our cleanup
            with IPRoute(netns=node) as ipr:
                ipr.tc("add", "clsact", index=lab.ifindex("vout"))  # ours are on tcx: clsact is the other tool's
                ipr.tc("add-filter", "bpf", index=lab.ifindex("vout"), handle=1, prio=7, protocol=3, fd=foreign,
                       name="someone-else", parent="ffff:fff2", classid=1, direct_action=True)
        finally:
            os.close(foreign)
        counts = run_in_netns(node, devices.detach_all)
        assert counts == {"tc": 6, "xdp": 2}
        for dev in ("vpod", "vbe", "vout"):
            assert _filters(node, dev) == [] and not _xdp(node, dev), dev
        assert "someone-else" in subprocess.run([*nsenter(node), "tc", "filter", "show", "dev", "vout", "ingress"],
                                                capture_output=True, text=True).stdout
        assert run_in_netns(node, devices.detach_all) == {"tc": 0, "xdp": 0}, "idempotent"


def test_native_xdp_attaches_in_the_driver_and_cleanup_removes_it(datapath):
    """--bpf-xdp-mode native: the program runs in the veth driver (before an skb exists), and a
    cleanup that does not know the mode (`ebpf-proxy cleanup`, detach_all) still removes it."""
    with netlab.NetLab() as lab:
        node = lab.ns["node"]
        devs = devices.Devices(
            devices.Programs(datapath.prog_fds["tc_ingress"], datapath.prog_fds["tc_egress"], datapath.prog_fds["xdp_lb"]),
            cluster_cidrs=CIDRS, pod_patterns=("vpod", "lxc*"), xdp_mode="native",
        )
        run_in_netns(node, devs.reconcile, True)
        assert devs.errors == {}
        with IPRoute(netns=node) as ipr:
            attached = ipr.get_links(lab.ifindex("vout"))[0].get("xdp").get("IFLA_XDP_ATTACHED")
        assert attached == "xdp", attached  # XDP_ATTACHED_DRV: in the driver, not "xdpgeneric"
        assert run_in_netns(node, devices.detach_all)["xdp"] == 2
        assert not _xdp(node, "vout") and not _xdp(node, "vbe")


def test_an_older_agents_filters_give_way_to_tcx(datapath):
    """An agent of a version that attached cls_bpf filters, restarted as this one: its filters
    are replaced by the same programs through tcx (attached first, so no packet meets neither),
    attached once however often the agent attaches again; tcx is refused for an IPRoute of
    another namespace, whose ifindex it would take in the caller's."""
    with netlab.NetLab() as lab:
        node = lab.ns["node"]
        fds = datapath.prog_fds
        vpod = lab.ifindex("vpod")

        def attach(tcx):
            with IPRoute() as ipr:
                loader.attach_tc(ipr, vpod, fds["tc_ingress"], fds["tc_egress"], tcx=tcx)

        run_in_netns(node, attach, False)
        shown = subprocess.run([*nsenter(node), "tc", "filter", "show", "dev", "vpod", "ingress"],
                               capture_output=True, text=True).stdout
        assert "epx_ingress" in shown
        assert run_in_netns(node, libbpf.prog_query, vpod, libbpf.ATTACH_TCX_INGRESS) == []
        run_in_netns(node, attach, None)  # the default: tcx, on this kernel
        assert run_in_netns(node, libbpf.prog_query, vpod, libbpf.ATTACH_TCX_INGRESS) == \
            [libbpf.object_id(fds["tc_ingress"], "prog")]
        assert subprocess.run([*nsenter(node), "tc", "filter", "show", "dev", "vpod", "ingress"],
                              capture_output=True, text=True).stdout == ""
        assert _filters(node, "vpod") == ["ingress:epx_ingress", "egress:epx_egress"]
        run_in_netns(node, attach, None)
        assert _filters(node, "vpod") == ["ingress:epx_ingress", "egress:epx_egress"], "attached once"
        with IPRoute(netns=node) as ipr, pytest.raises(ValueError, match="tcx would take the ifindex in the wrong"):
            loader.attach_tc(ipr, vpod, fds["tc_ingress"], None, tcx=True)
        assert run_in_netns(node, devices.detach_all)["tc"] == 2


def test_the_loopback_device_gets_tc_lo_on_its_ingress_alone(datapath):
    """With a tc_lo program (bpf/lib/lo6.h) the node namespace's lo gets it on ingress, nothing on
    egress and no XDP; the drift audit expects just that filter there, and cleanup removes it."""
    with netlab.NetLab() as lab:
        node = lab.ns["node"]
        fds = datapath.prog_fds
        devs = devices.Devices(devices.Programs(fds["tc_ingress"], fds["tc_egress"], fds["xdp_lb"], fds["tc_lo"]),
                               cluster_cidrs=CIDRS, pod_patterns=("vpod", "lxc*"))
        assert run_in_netns(node, devs.reconcile, True) == 4
        lo = next(d for d in devs.attached.values() if d.role == devices.LOOPBACK)
        assert lo.name == "lo"
        assert _filters(node, "lo") == ["ingress:epx_ingress"] and not _xdp(node, "lo")
        on_lo = run_in_netns(node, libbpf.prog_query, lo.index, libbpf.ATTACH_TCX_INGRESS)
        assert on_lo == [libbpf.object_id(fds["tc_lo"], "prog")], "tc_lo, through tcx"
        assert run_in_netns(node, libbpf.prog_query, lo.index, libbpf.ATTACH_TCX_EGRESS) == []
        assert run_in_netns(node, devs.lost) == {}, "lo has no egress program to miss"
        run_in_netns(node, libbpf.prog_detach, fds["tc_lo"], lo.index, libbpf.ATTACH_TCX_INGRESS)  # somebody's tampering
        assert run_in_netns(node, devs.lost) == {lo.index: ["epx_ingress"]}
        assert run_in_netns(node, devs.reattach, [lo.index]) == 1
        assert _filters(node, "lo") == ["ingress:epx_ingress"]
        assert run_in_netns(node, devices.detach_all)["tc"] == 7
        assert _filters(node, "lo") == []
