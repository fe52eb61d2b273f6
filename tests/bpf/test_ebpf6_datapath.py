"""EbpfDatapath for IPv6 end to end in a throw-away dual-stack node (netlab.py's, with IPv6 added):
the IPv6 datapath writes the epx_*6 maps with ids of its own and switches the programs' IPv6 path
on after its first sync; an IPv4 and an IPv6 datapath of one process share one load, one set of
attachments and one conntrack GC; close (SIGTERM) keeps IPv6 served, a restart adopts the IPv6 maps
without writing (ids and connections kept); the drift audit sees both families; an IPv6-only node
loads, attaches and serves alone; a process without an IPv6 datapath switches IPv6 off and removes
what an earlier one left; cleanup removes everything once.

Not here: a node's own IPv6 connections to a Service (the socket LB's IPv6 programs)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ebpf_proxy.datapath.ebpf import EbpfDatapath, pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Maps6, ip6_str
from ebpf_proxy.explain import audit_ebpf
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.model import ChangeSet, Endpoint, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName
from tests.bpf import netlab
from tests.bpf.conftest import PROGRAM_CACHE, SMALL_MAPS
from tests.bpf.netlab import NODE_BACKEND_SIDE, NODE_OUTSIDE_SIDE, NODE_POD_SIDE
from tests.bpf.test_audit import _audit
from tests.bpf.test_datapath import _attached, _cgroup_programs, node  # noqa: F401 (fixture)
from tests.bpf.test_datapath import _state as dp4_state
from tests.netns_util import nsenter

pytestmark = [pytest.mark.bpf, pytest.mark.root]

# the IPv6 side of netlab's node: one /64 per link, the node ::1, the peer as in the IPv4 lab
LINKS6 = {"pod": ("vpod", "fd00:244::1", "fd00:244::7"),
          "backend": ("vbe", "fd00:244:1::1", "fd00:244:1::31"),
          "outside": ("vout", "fd00:203::1", "fd00:203::9")}
POD6, BACKEND6, OUTSIDE6 = LINKS6["pod"][2], LINKS6["backend"][2], LINKS6["outside"][2]
NODE6_OUTSIDE = LINKS6["outside"][1]
VIP4, VIP6, NODE_PORT = "10.96.0.10", "fd00:96::a", 30080
NODE4 = NodeConfig("node", node_ips=(NODE_OUTSIDE_SIDE, NODE_POD_SIDE, NODE_BACKEND_SIDE),
                   cluster_cidrs=("10.244.0.0/16",))
NODE6 = NodeConfig("node", family=6, node_ips=tuple(node for _dev, node, _peer in LINKS6.values()),
                   cluster_cidrs=("fd00:244::/56",))

BACKEND6_PORT = 8086  # beside netlab's IPv4 server on BACKEND_PORT (a "::" socket takes IPv4 too)
# netlab's server and client scripts, on AF_INET6 sockets
SERVER6 = netlab.TCP_SERVER.replace("socket.socket()", "socket.socket(socket.AF_INET6)") \
    .replace("socket.AF_INET,", "socket.AF_INET6,").replace('"0.0.0.0"', '"::"').replace("{peer[0]}:", "[{peer[0]}]:")
CLIENT6 = netlab.CLIENT.replace("socket.socket()", "socket.socket(socket.AF_INET6)") \
    .replace("socket.AF_INET,", "socket.AF_INET6,").replace("c.getpeername()", "c.getpeername()[:2]") \
    .replace("% peer)", "% peer[:2])")


def add_ipv6(lab: netlab.NetLab) -> None:
    """IPv6 on every link of netlab's node as well (LINKS6): forwarding on, no DAD (an address is
    usable at once), each peer's default IPv6 route through the node."""
    node = lab.ns["node"]
    netlab.sh("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1", ns=node)
    for role, (dev, node_addr, peer_addr) in LINKS6.items():
        netlab.sh("ip", "-6", "addr", "add", f"{node_addr}/64", "dev", dev, "nodad", ns=node)
        netlab.sh("ip", "-6", "addr", "add", f"{peer_addr}/64", "dev", "eth0", "nodad", ns=lab.ns[role])
        netlab.sh("ip", "-6", "route", "add", "default", "via", node_addr, ns=lab.ns[role])


def client6(lab: netlab.NetLab, role: str, proto: str, host: str, port: int, timeout: float = 3) -> list[str]:
    """netlab's client over IPv6: ["ok", what the backend saw as [addr]:port, peer] or ["error", name]."""
    return netlab.sh(sys.executable, "-c", CLIENT6, proto, host, str(port), str(timeout), ns=lab.ns[role]).stdout.split()


def _state(family: int) -> ProxyState:
    if family == 4:
        return dp4_state()
    services, endpoints = {}, {}
    for proto in (Protocol.TCP, Protocol.UDP):
        name = ServicePortName("default", "web", proto.lower, proto)
        services[name] = ServicePort(name, VIP6, 80, proto, node_port=NODE_PORT)
        endpoints[name] = (Endpoint(BACKEND6, BACKEND6_PORT, node_name="other"),)
    return ProxyState(services=services, endpoints=endpoints)


@pytest.fixture
def lab(node):
    """test_datapath's node, with IPv6 and an IPv6 server on the backend."""
    add_ipv6(node)
    server = subprocess.Popen([*nsenter(node.ns["backend"]), sys.executable, "-c", SERVER6, str(BACKEND6_PORT)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield node
    finally:
        server.kill()
        server.wait()


def _datapath(lab, node: NodeConfig, cgroup: Path, **kw) -> EbpfDatapath:
    return EbpfDatapath(node, cgroup_path=str(cgroup), bpffs=str(lab.bpffs), pod_device_patterns=("vpod", "vbe"),
                        bpf_cache_dir=str(PROGRAM_CACHE),
                        max_entries=SMALL_MAPS, **kw)


def _sync(lab, dp: EbpfDatapath, state: ProxyState) -> dict[str, int]:
    return run_in_netns(lab.ns["node"], dp.sync, state, ChangeSet(full=True)).counts


def _maps6(lab) -> tuple:
    maps = pins.open_maps(lab.bpffs)
    return maps, Maps6(maps)


def _served6(lab) -> bool:
    maps, maps6 = _maps6(lab)
    try:
        return bool(maps6.config().flags & s.CFG6_F_ON)
    finally:
        maps.close()


def _traffic6_ok(lab) -> None:
    for proto in ("tcp", "udp"):
        seen = client6(lab, "pod", proto, VIP6, 80)
        assert seen[:1] == ["ok"] and seen[1].startswith(f"[{POD6}]:"), f"pod -> [clusterIP]:80/{proto}, not masqueraded: {seen}"
    seen = client6(lab, "outside", "tcp", NODE6_OUTSIDE, NODE_PORT)
    assert seen[:1] == ["ok"] and seen[1].startswith(f"[{NODE6_OUTSIDE}]:"), f"outside -> NodePort, masqueraded: {seen}"


def _traffic4_ok(lab) -> None:
    assert lab.client("pod", "tcp", VIP4, 80)[:1] == ["ok"], "pod -> IPv4 clusterIP"
    seen = lab.client("outside", "tcp", NODE_OUTSIDE_SIDE, NODE_PORT)
    assert seen[0] == "ok" and seen[1].startswith(NODE_OUTSIDE_SIDE + ":"), f"outside -> IPv4 NodePort: {seen}"


def _audit_clean(lab, dp: EbpfDatapath) -> dict[str, int]:
    report = _audit(lab, dp)
    assert report.drifts == [], [str(d) for d in report.drifts]
    return report.checked


def test_dual_stack_one_load_both_families_restart_and_cleanup(lab):
    cgroup = lab.cgroup()
    dp4, dp6 = _datapath(lab, NODE4, cgroup), _datapath(lab, NODE6, cgroup)
    assert client6(lab, "pod", "tcp", VIP6, 80)[0] == "error", "nothing serves the IPv6 clusterIP yet"

    counts4 = _sync(lab, dp4, _state(4))
    assert counts4["programs_compiled"] + counts4["programs_from_cache"] == 1 and counts4["map_writes"] > 0
    assert not _served6(lab), "attached with the IPv4 maps written; IPv6 stays off until its own sync"
    counts6 = _sync(lab, dp6, _state(6))
    assert counts6["programs_compiled"] == 0 and counts6["programs_from_cache"] == 0, "one load for both"
    assert counts6["bpf_services"] == 4 and counts6["bpf_backends"] == 2 and counts6["bpf_devices"] == 4
    assert counts6["bpf_ct_capacity"] == SMALL_MAPS["epx_ct6"]
    assert _served6(lab)
    assert _attached(lab) == {"lo": "tc", "vpod": "tc", "vbe": "tc", "vout": "tc"}, "attached once"
    assert len(_cgroup_programs(cgroup)) == len(pins.CGROUP_PROGRAMS)
    _traffic6_ok(lab)
    _traffic4_ok(lab)

    maps, maps6 = _maps6(lab)
    try:
        services6 = dict(maps6.services())
        assert {svc.id for svc in services6.values()} == {1, 2}, "the IPv6 writer's own ids (IPv4 has 1, 2 too)"
        assert {fe.addr for fe in services6} == {VIP6, None}
        assert {svc.id for svc in dict(maps.services()).values()} == {1, 2}
        connections6 = maps6.connections(kind=s.CT4_SVC)
        assert {c.daddr for c in connections6} >= {VIP6, NODE6_OUTSIDE}
        assert maps6.node_addrs() == set(NODE6.node_ips)
        assert maps6.pod_cidrs() == {"fd00:244::/56"}
        assert ip6_str(maps6.config().snat_addr) == NODE6_OUTSIDE, "the external device's IPv6 address"
    finally:
        maps.close()
    assert dp4.counters()[s.Reason.FWD_NEW][0] >= 5, "one set of counters, both families' packets"
    assert _audit_clean(lab, dp4)["devices"] == 4
    assert _audit_clean(lab, dp6) == {"service ports": 2, "frontends": 4, "backends": 2, "devices": 0}

    dp4.close()
    dp6.close()  # SIGTERM: everything stays, IPv6 included
    assert _attached(lab) == {"lo": "tc", "vpod": "tc", "vbe": "tc", "vout": "tc"}
    assert _served6(lab)
    _traffic6_ok(lab)

    re4, re6 = _datapath(lab, NODE4, cgroup), _datapath(lab, NODE6, cgroup)
    run_in_netns(lab.ns["node"], re6.prefetch)  # the IPv6 maps' read-back by a helper, as the agent has it
    counts6 = _sync(lab, re6, _state(6))
    assert counts6["map_writes"] == 0, "an IPv6 restart writes nothing when nothing changed"
    assert counts6["maps_read_ahead"] == 1, "from the helper's read-back of the IPv6 maps"
    counts4 = _sync(lab, re4, _state(4))
    assert counts4["map_writes"] == 0 and counts4["maps_read_ahead"] == 0, "IPv4 read its maps itself"
    maps, maps6 = _maps6(lab)
    try:
        assert dict(maps6.services()) == services6, "same IPv6 ids"
        kept = {(c.saddr, c.sport, c.daddr, c.dport) for c in maps6.connections(kind=s.CT4_SVC)}
        assert {(c.saddr, c.sport, c.daddr, c.dport) for c in connections6} <= kept, "IPv6 connections survive"
    finally:
        maps.close()
    _traffic6_ok(lab)
    _audit_clean(lab, re6)

    run_in_netns(lab.ns["node"], re6.cleanup)  # once, for both families
    assert _attached(lab) == {"lo": "", "vpod": "", "vbe": "", "vout": ""}
    assert _cgroup_programs(cgroup) == []
    assert not pins.pin_dir(lab.bpffs).exists()
    assert client6(lab, "pod", "tcp", VIP6, 80)[0] == "error", "no IPv6 service any more"
    re4.close()
    re6.close()


def test_an_ipv6_only_node_loads_attaches_serves_and_collects_its_connections(lab):
    cgroup = lab.cgroup()
    dp = _datapath(lab, NODE6, cgroup, ct_gc_period=0.2)
    try:
        counts = _sync(lab, dp, _state(6))
        assert counts["programs_compiled"] + counts["programs_from_cache"] == 1, "the IPv6 datapath loads alone"
        assert _attached(lab) == {"lo": "tc", "vpod": "tc", "vbe": "tc", "vout": "tc"}
        assert _served6(lab)
        _traffic6_ok(lab)
        assert lab.client("pod", "tcp", VIP4, 80)[0] == "error", "no IPv4 service on an IPv6-only node"
        maps, maps6 = _maps6(lab)
        try:
            assert maps.config().host_netns_cookie == lab.netns_cookie("node"), "epx_config written by IPv6"
            assert maps.config().tcp_est_timeout == NODE6.conntrack.tcp_established
            made = maps6.connections(kind=s.CT4_SVC)
            assert made and any(c.flags & s.CT4_F_MASQ for c in made), "the NodePort one is masqueraded"
            for c in made:
                maps6.set_connection_expiry(c, 1)
            deadline = time.monotonic() + 5
            while maps6.connections() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert maps6.connections() == [], "the GC thread collects epx_ct6: connections and their halves"
        finally:
            maps.close()
        assert _audit_clean(lab, dp)["devices"] == 4, "the only family audits the devices"
        _traffic6_ok(lab)
    finally:
        run_in_netns(lab.ns["node"], dp.cleanup)
        dp.close()
    assert _attached(lab) == {"lo": "", "vpod": "", "vbe": "", "vout": ""}


def test_an_ipv4_only_agent_switches_ipv6_off_and_removes_what_an_earlier_one_left(lab):
    cgroup = lab.cgroup()
    dp4, dp6 = _datapath(lab, NODE4, cgroup), _datapath(lab, NODE6, cgroup)
    _sync(lab, dp4, _state(4))
    _sync(lab, dp6, _state(6))
    _traffic6_ok(lab)
    dp4.close()
    dp6.close()
    alone = _datapath(lab, NODE4, cgroup)
    try:
        _sync(lab, alone, _state(4))
        assert not _served6(lab)
        maps, maps6 = _maps6(lab)
        try:
            assert dict(maps6.services()) == {} and maps6.backends() == {} and list(maps6.slots()) == []
            assert maps6.node_addrs() == set()
        finally:
            maps.close()
        assert client6(lab, "pod", "tcp", VIP6, 80)[0] == "error", "IPv6 passes untouched: nothing serves it"
        _traffic4_ok(lab)
        assert _audit_clean(lab, alone)["service ports"] == 2
    finally:
        run_in_netns(lab.ns["node"], alone.cleanup)
        alone.close()


def test_the_ipv6_datapath_drift_audit_reports_and_repairs_its_maps(lab, monkeypatch):
    cgroup = lab.cgroup()
    dp = _datapath(lab, NODE6, cgroup)
    try:
        _sync(lab, dp, _state(6))
        reads = []
        real_read = audit_ebpf.adopt.read
        monkeypatch.setattr(audit_ebpf.adopt, "read", lambda maps: reads.append(maps) or real_read(maps))
        _audit_clean(lab, dp)
        assert reads == [], "clean: the IPv6 maps summed (digest.py), nothing read back"
        maps, maps6 = _maps6(lab)
        try:
            svc_id = next(svc.id for fe, svc in maps6.services() if fe.addr == VIP6)
            bid = next(b for s_id, _bank, _scope, _slot, b in maps6.slots() if s_id == svc_id)
            maps6.set_backend(bid, Backend("fd00:99::5", 8080, in_cluster=True))
        finally:
            maps.close()
        report = _audit(lab, dp, repair=True)
        assert [(d.kind, d.what, d.key) for d in report.drifts] == [("stale", "backend", str(bid))], report.lines()
        assert len(reads) == 1
        _audit_clean(lab, dp)
        maps, maps6 = _maps6(lab)
        try:
            fe = next(fe for fe, _svc in maps6.services() if fe.addr == VIP6)
            maps6.delete_service(fe)
            maps6.set_node_addrs([*NODE6.node_ips, "fd00:99::1"])
            maps6.set_config6(NODE6_OUTSIDE, on=False)
        finally:
            maps.close()
        report = _audit(lab, dp, repair=True)
        found = {(d.kind, d.what, d.key) for d in report.drifts}
        assert ("missing", "service frontend", f"[{VIP6}]:80/{'tcp' if fe.proto == 6 else 'udp'}") in found, found
        assert ("extra", "node address", "fd00:99::1") in found
        assert any(d.what == "node setting" and d.key == "epx_config6" for d in report.drifts), found
        assert report.repaired
        _audit_clean(lab, dp)
        _traffic6_ok(lab)
    finally:
        run_in_netns(lab.ns["node"], dp.cleanup)
        dp.close()


def test_an_ipv6_service_without_endpoints_rejects_and_gets_them_later(lab):
    """A service port with no endpoints holds an empty (packed) backend set: written, rejected
    (an ICMPv6 port unreachable: refused), then served once an endpoint comes."""
    cgroup = lab.cgroup()
    dp = _datapath(lab, NODE6, cgroup)
    try:
        state = _state(6)
        empty = ProxyState(services=state.services, endpoints={})
        _sync(lab, dp, empty)
        assert client6(lab, "pod", "tcp", VIP6, 80)[:2] == ["error", "ConnectionRefusedError"]
        _sync(lab, dp, state)
        _traffic6_ok(lab)
    finally:
        run_in_netns(lab.ns["node"], dp.cleanup)
        dp.close()
