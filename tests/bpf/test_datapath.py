"""EbpfDatapath end to end in a throw-away node (netlab.py): first sync, traffic, close (SIGTERM)
keeps everything in place, a restart adopts the pinned maps without writing, and a cleanup from a
fresh instance that was told nothing removes every program and pin."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ebpf_proxy.datapath.ebpf import EbpfDatapath, libbpf, loader, pins
from ebpf_proxy.datapath.ebpf.datapath import ServicesDidNotFit
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.model import ChangeSet, ConntrackLimits, Endpoint, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName
from tests.bpf import netlab
from tests.bpf.conftest import PROGRAM_CACHE, SMALL_MAPS, TEST_ROOT
from tests.bpf.netlab import BACKEND_IP, NODE_BACKEND_SIDE, NODE_OUTSIDE_SIDE, NODE_POD_SIDE
from tests.netns_util import nsenter

pytestmark = [pytest.mark.bpf, pytest.mark.root]

VIP, NODE_PORT, BACKEND_PORT = "10.96.0.10", 30080, 8080
NODE = NodeConfig("node", node_ips=(NODE_OUTSIDE_SIDE, NODE_POD_SIDE, NODE_BACKEND_SIDE), cluster_cidrs=("10.244.0.0/16",))


def _state() -> ProxyState:
    services, endpoints = {}, {}
    for proto in (Protocol.TCP, Protocol.UDP):
        name = ServicePortName("default", "web", proto.lower, proto)
        services[name] = ServicePort(name, VIP, 80, proto, node_port=NODE_PORT)
        endpoints[name] = (Endpoint(BACKEND_IP, BACKEND_PORT, node_name="other"),)
    return ProxyState(services=services, endpoints=endpoints)


@pytest.fixture
def node():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    TEST_ROOT.mkdir(parents=True, exist_ok=True)
    bpffs = Path(tempfile.mkdtemp(prefix=f"dp-{os.getpid()}-", dir=TEST_ROOT))
    try:
        with netlab.NetLab() as lab:
            lab.start_server(BACKEND_PORT)
            lab.bpffs = bpffs
            yield lab
    finally:
        loader.unmount_bpffs(bpffs)
        bpffs.rmdir()
        with contextlib.suppress(OSError):
            TEST_ROOT.rmdir()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _datapath(lab, cgroup: Path, clock=None, **kw) -> EbpfDatapath:
    return EbpfDatapath(NODE, cgroup_path=str(cgroup), bpffs=str(lab.bpffs), pod_device_patterns=("vpod", "vbe"),
                        bpf_cache_dir=str(PROGRAM_CACHE),
                        max_entries=SMALL_MAPS, **({"clock": clock} if clock else {}), **kw)


def _sync(lab, dp: EbpfDatapath, state: ProxyState):
    return run_in_netns(lab.ns["node"], dp.sync, state, ChangeSet(full=True)).counts


def _attached(lab) -> dict[str, str]:
    """device -> what of ours is on it (tc: tcx programs or cls_bpf filters; xdp), as the kernel shows them."""
    out = {}
    tc = run_in_netns(lab.ns["node"], loader.tc_attached_by_device)
    for dev in ("lo", "vpod", "vbe", "vout"):  # lo: tc_lo on ingress (bpf/lib/lo6.h)
        link = subprocess.run([*nsenter(lab.ns["node"]), "ip", "link", "show", dev], capture_output=True, text=True).stdout
        out[dev] = ",".join(x for x, present in (("tc", bool(tc[dev])), ("xdp", "xdp_lb" in link)) if present)
    return out


def _cgroup_programs(cgroup: Path) -> list[int]:
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return [i for t in pins.CGROUP_PROGRAMS.values() for i in libbpf.prog_query(fd, t)]
    finally:
        os.close(fd)


def _traffic_ok(lab, cgroup: Path) -> None:
    assert lab.client("pod", "tcp", VIP, 80)[:1] == ["ok"], "pod -> clusterIP"
    seen = lab.client("outside", "tcp", NODE_OUTSIDE_SIDE, NODE_PORT)
    assert seen[0] == "ok" and seen[1].startswith(NODE_OUTSIDE_SIDE + ":"), f"outside -> NodePort, masqueraded: {seen}"
    assert lab.client("node", "udp", VIP, 80, cgroup=cgroup)[0] == "ok", "node process -> clusterIP (socket LB)"


def test_life_cycle(node, caplog):
    lab, state = node, _state()
    cgroup = lab.cgroup()
    clock = _Clock()
    dp = _datapath(lab, cgroup, clock, xdp_mode="generic")  # an operator's opt-in: XDP kept across restarts too
    with caplog.at_level(logging.INFO, logger="ebpf_proxy.datapath.ebpf.shared"):
        counts = _sync(lab, dp, state)
    loaded = [r for r in caplog.records if r.getMessage() == "ebpf programs loaded"]
    assert [r.tc_attach for r in loaded] == ["tcx"], "this kernel (6.6+) has tcx, and the load log says so"
    assert counts["full_sync"] == 1 and counts["map_writes"] > 0
    assert counts["programs_compiled"] + counts["programs_from_cache"] == 1, "loaded here: compiled, or from the cache"
    assert counts["bpf_services"] == 4 and counts["bpf_backends"] == 2 and counts["bpf_devices"] == 4
    assert _attached(lab) == {"lo": "tc", "vpod": "tc", "vbe": "tc", "vout": "tc,xdp"}
    assert len(_cgroup_programs(cgroup)) == len(pins.CGROUP_PROGRAMS)  # connect, sendmsg, recvmsg: 4 and 6
    _traffic_ok(lab, cgroup)
    assert counts["bpf_ct_entries"] == 0 and dp.stats()["bpf_ct_entries"] == 0, \
        "the connection table is not read again on every call (a full one takes ~65 ms)"
    assert counts["bpf_ct_capacity"] == SMALL_MAPS["epx_ct4"]
    clock.now += 10
    assert dp.stats()["bpf_ct_entries"] > 0, "but at most ct_gc_period seconds old"
    assert dp.counters()[s.Reason.FWD_NEW][0] >= 2

    maps = pins.open_maps(lab.bpffs)
    try:
        before_services = dict(maps.services())
        connections = len(maps.connections())
    finally:
        maps.close()

    dp.close()  # SIGTERM: everything stays, traffic keeps flowing
    assert _attached(lab) == {"lo": "tc", "vpod": "tc", "vbe": "tc", "vout": "tc,xdp"}
    _traffic_ok(lab, cgroup)

    restarted = _datapath(lab, cgroup, xdp_mode="generic")
    run_in_netns(lab.ns["node"], restarted.prefetch)  # as the agent does while it lists
    counts = _sync(lab, restarted, state)
    assert counts["maps_read_ahead"] == 1, "the pins' read-back came from the helper process"
    assert counts["map_writes"] == 0, "a restart writes nothing when nothing changed"
    assert counts["programs_compiled"] == 0, "the same build's pinned programs are re-opened"
    maps = pins.open_maps(lab.bpffs)
    try:
        assert dict(maps.services()) == before_services, "same ids"
        assert len(maps.connections()) >= connections, "connections survive"
    finally:
        maps.close()
    assert len(_cgroup_programs(cgroup)) == len(pins.CGROUP_PROGRAMS), \
        "the cgroup links got the new programs, not a second set"
    _traffic_ok(lab, cgroup)
    restarted.close()

    fresh = EbpfDatapath(NodeConfig("node"), bpffs=str(lab.bpffs / "elsewhere"))  # told nothing useful
    run_in_netns(lab.ns["node"], fresh.cleanup)
    assert _attached(lab) == {"lo": "", "vpod": "", "vbe": "", "vout": ""}
    assert _cgroup_programs(cgroup) == []
    assert not pins.pin_dir(lab.bpffs).exists()
    assert lab.client("pod", "tcp", VIP, 80)[0] == "error", "no service any more"
    run_in_netns(lab.ns["node"], fresh.cleanup)  # idempotent


def test_conntrack_settings_size_the_table_and_the_gc_thread_collects(node):
    """kube-proxy's conntrack settings (NodeConfig.conntrack) reach the kernel: the table's
    capacity (2 entries per connection) and its lifetimes; the GC thread removes connections
    that expired, whole, with no sync needed."""
    lab, cgroup = node, node.cgroup()
    limits = ConntrackLimits(max_connections=1500, tcp_established=7200, tcp_close_wait=30, udp=15, udp_stream=90)
    sizes = {k: v for k, v in SMALL_MAPS.items() if k != "epx_ct4"}  # epx_ct4: from the settings
    dp = EbpfDatapath(replace(NODE, conntrack=limits), cgroup_path=str(cgroup), bpffs=str(lab.bpffs),
                      pod_device_patterns=("vpod", "vbe"),
                      bpf_cache_dir=str(PROGRAM_CACHE), max_entries=sizes, ct_gc_period=0.2)
    try:
        counts = _sync(lab, dp, _state())
        assert counts["bpf_ct_capacity"] == 3000
        maps = pins.open_maps(lab.bpffs)
        try:
            cfg = maps.config()
            assert (cfg.tcp_est_timeout, cfg.tcp_close_wait_timeout, cfg.udp_timeout, cfg.udp_stream_timeout) == \
                (7200, 30, 15, 90)
            _traffic_ok(lab, cgroup)
            made = maps.connections(kind=s.CT4_SVC)
            assert made
            for c in made:
                maps.set_connection_expiry(c, 1)
            deadline = time.monotonic() + 5
            while maps.connections() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert maps.connections() == [], "expired connections and their halves collected"
        finally:
            maps.close()
        deadline = time.monotonic() + 5
        while dp.stats()["bpf_ct_entries"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dp.stats()["bpf_ct_entries"] == 0
    finally:
        run_in_netns(lab.ns["node"], dp.cleanup)
        dp.close()


def test_a_full_service_map_programs_what_fits_attaches_and_names_the_rest(node):
    """epx_svc holds 2 frontends; the TCP service port takes both (clusterIP, NodePort), so the
    UDP one does not fit: the first sync still attaches and the TCP port serves, and the sync
    fails naming the UDP port, the map and the flag, again on every retry, until it fits (here:
    the UDP port is gone)."""
    lab, cgroup = node, node.cgroup()
    dp = EbpfDatapath(NODE, cgroup_path=str(cgroup), bpffs=str(lab.bpffs), pod_device_patterns=("vpod", "vbe"),
                      bpf_cache_dir=str(PROGRAM_CACHE),
                      max_entries={**SMALL_MAPS, "epx_svc": 2})
    try:
        with pytest.raises(ServicesDidNotFit) as caught:
            _sync(lab, dp, _state())
        assert str(caught.value).endswith(
            "1 service port(s) not programmed (default/web:udp): BPF map epx_svc is full (2 entries): "
            "raise its capacity with --bpf-map-sizes epx_svc=N (N > 2)")
        assert _attached(lab) == {"lo": "tc", "vpod": "tc", "vbe": "tc", "vout": "tc"}  # no XDP: off by default
        assert lab.client("pod", "tcp", VIP, 80)[:1] == ["ok"], "the port that fit serves"
        assert lab.client("pod", "udp", VIP, 80)[0] == "error", "the one that did not is not there"
        with pytest.raises(ServicesDidNotFit):  # retried: still no room
            run_in_netns(lab.ns["node"], dp.sync, _state(), ChangeSet(full=True))
        both = _state()
        tcp_only = ProxyState(services={n: v for n, v in both.services.items() if n.protocol is Protocol.TCP},
                              endpoints={n: v for n, v in both.endpoints.items() if n.protocol is Protocol.TCP})
        run_in_netns(lab.ns["node"], dp.sync, tcp_only, ChangeSet(full=True))  # nothing left out: no error
        assert lab.client("pod", "tcp", VIP, 80)[:1] == ["ok"]
    finally:
        run_in_netns(lab.ns["node"], dp.cleanup)
        dp.close()
