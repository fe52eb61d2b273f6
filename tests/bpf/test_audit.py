"""The eBPF drift audit on a real node (netlab.py): clean after a sync; every kind of tampering
another tool can do to the maps and devices is found and named; repair writes it back, traffic
flows again, and the ids (so the connections) stay."""

from __future__ import annotations

import os
import socket
import time

import pytest

from ebpf_proxy.datapath.ebpf import EbpfDatapath, libbpf, pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, NodeSettings, Service
from ebpf_proxy.explain import audit_ebpf
from ebpf_proxy.explain.audit import EXTRA, MISSING, STALE, audit
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.model import ProxyState
from tests.bpf.conftest import PROGRAM_CACHE, SMALL_MAPS
from tests.bpf.test_datapath import NODE, NODE_PORT, VIP, _datapath, _state, _sync, _traffic_ok, node  # noqa: F401

pytestmark = [pytest.mark.bpf, pytest.mark.root]


def _audit(lab, dp, repair=False):
    return run_in_netns(lab.ns["node"], audit, dp, repair)


def _detach_tc_ingress(dev: str) -> None:
    """Somebody removes the program on `dev`'s TC ingress (tcx on this kernel, which `tc filter
    del` does not see), in the calling thread's netns."""
    index = socket.if_nametoindex(dev)
    for prog_id in libbpf.prog_query(index, libbpf.ATTACH_TCX_INGRESS):
        fd = libbpf.prog_fd_by_id(prog_id)
        try:
            libbpf.prog_detach(fd, index, libbpf.ATTACH_TCX_INGRESS)
        finally:
            os.close(fd)


def test_tampering_is_found_named_and_repaired(node):
    lab = node
    cgroup = lab.cgroup()
    dp = _datapath(lab, cgroup)
    _sync(lab, dp, _state())
    clean = _audit(lab, dp)
    assert clean.clean, "\n".join(clean.lines())
    assert clean.checked == {"service ports": 2, "frontends": 4, "backends": 2, "devices": 4}  # the three links and lo (tc_lo)

    maps = pins.open_maps(lab.bpffs)  # another tool, with its own handles
    try:
        services = dict(maps.services())
        tcp = services[Frontend(VIP, 80, 6)]
        udp_node_port = Frontend(None, NODE_PORT, 17)
        udp_id = services[udp_node_port].id
        backend_id = maps.slot(tcp.id, s.LB4_SCOPE_CLUSTER, 0)
        maps.delete_slot(tcp.id, s.LB4_SCOPE_CLUSTER, 0)
        maps.set_backend(backend_id + 1000, Backend("10.99.0.1", 1))  # nobody's
        maps.delete_service(udp_node_port)
        maps.set_service(Frontend("10.96.9.9", 80, 6), Service(9999, 0))  # nobody's
        udp_backend = maps.slot(udp_id, s.LB4_SCOPE_CLUSTER, 0)
        maps.set_backend(udp_backend, Backend("10.99.0.2", 9, in_cluster=True))
        maps.set_settings(NodeSettings(snat_addr="192.0.2.99"))
        maps.set_node_addrs([*maps.node_addrs(), "192.0.2.98"])
    finally:
        maps.close()
    run_in_netns(lab.ns["node"], _detach_tc_ingress, "vpod")
    assert lab.client("pod", "tcp", VIP, 80)[0] == "error", "the tampering breaks the service"

    report = _audit(lab, dp)
    found = {(d.kind, d.what) : d for d in report.drifts}
    keys = {(d.kind, d.what, d.key) for d in report.drifts}
    assert (MISSING, "slot") in found and "cluster slot 0" in found[(MISSING, "slot")].key
    assert (EXTRA, "backend", str(backend_id + 1000)) in keys
    assert (MISSING, "service frontend", f"<node>:{NODE_PORT}/udp") in keys
    assert (EXTRA, "service frontend", "10.96.9.9:80/tcp") in keys
    assert (STALE, "backend", str(udp_backend)) in keys and "10.99.0.2:9" in found[(STALE, "backend")].detail
    assert (STALE, "node setting", "epx_config") in keys and "snat_addr" in found[(STALE, "node setting")].detail
    assert (EXTRA, "node address", "192.0.2.98") in keys
    assert (MISSING, "device program", "vpod epx_ingress") in keys
    assert len(report.drifts) == 8, "\n".join(report.lines())
    assert report.counts() == {MISSING: 3, EXTRA: 3, STALE: 2}

    repaired = _audit(lab, dp, repair=True)
    assert repaired.repaired and repaired.writes > 0
    after = _audit(lab, dp)
    assert after.clean, "\n".join(after.lines())
    maps = pins.open_maps(lab.bpffs)
    try:
        now = dict(maps.services())
    finally:
        maps.close()
    assert now[Frontend(VIP, 80, 6)] == tcp and now[udp_node_port].id == udp_id, "ids kept"
    _traffic_ok(lab, cgroup)
    dp.close()


def test_no_audit_before_the_first_sync(node):
    from ebpf_proxy.explain.audit import AuditUnavailable

    dp = _datapath(node, node.cgroup())
    with pytest.raises(AuditUnavailable, match="no sync has completed"):
        audit(dp)


def test_drifts_come_in_service_port_order_whatever_order_the_syncs_keep(node):
    """The audit walks the service ports as the syncs keep them (no sorted copy of 100,000);
    what drifted is still reported by service port name."""
    lab = node
    dp = _datapath(lab, lab.cgroup())
    both = _state()
    tcp, udp = names = sorted(both.services)  # default/web:tcp, default/web:udp
    _sync(lab, dp, ProxyState(services={udp: both.services[udp]}, endpoints={udp: both.endpoints[udp]}))
    _sync(lab, dp, both)  # tcp joins after udp
    assert list(dp.believed().services) == [udp, tcp]
    maps = pins.open_maps(lab.bpffs)
    try:
        services = dict(maps.services())
        for fe in (Frontend(VIP, 80, 6), Frontend(VIP, 80, 17)):
            maps.delete_slot(services[fe].id, s.LB4_SCOPE_CLUSTER, 0)
    finally:
        maps.close()
    report = _audit(lab, dp)
    assert [d.key.split(" (id")[0] for d in report.drifts] == [str(n) for n in names], "\n".join(report.lines())
    dp.close()


def test_the_connection_gc_waits_while_an_audit_reads_whole_maps(node):
    """An audit's read-back and a GC pass each hold whole tables in memory: they take turns
    (whole_map_pass), so their peaks never add up. A pass due meanwhile is skipped, the next one
    collects."""
    lab, cgroup = node, node.cgroup()
    dp = EbpfDatapath(NODE, cgroup_path=str(cgroup), bpffs=str(lab.bpffs), pod_device_patterns=("vpod", "vbe"),
                      bpf_cache_dir=str(PROGRAM_CACHE),
                      max_entries=SMALL_MAPS, ct_gc_period=0.1)
    try:
        _sync(lab, dp, _state())
        _traffic_ok(lab, cgroup)
        maps = pins.open_maps(lab.bpffs)
        try:
            made = maps.connections(kind=s.CT4_SVC)
            assert made
            with dp.whole_map_pass():
                for c in made:
                    maps.set_connection_expiry(c, 1)
                time.sleep(1.0)  # ten GC periods
                assert len(maps.connections(kind=s.CT4_SVC)) == len(made), "no pass while the audit reads"
            deadline = time.monotonic() + 5
            while maps.connections() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert maps.connections() == [], "the next pass collects"
        finally:
            maps.close()
    finally:
        run_in_netns(lab.ns["node"], dp.cleanup)
        dp.close()


def _tamper_record(maps, tcp, udp):
    fe = Frontend(VIP, 80, 6)
    maps.set_service(fe, Service(tcp.id, tcp.count, tcp.local_count, tcp.affinity_timeout + 5, tcp.flags))
    return STALE, "service frontend"


def _tamper_slot(maps, tcp, udp):
    maps.set_slot(tcp.id, s.LB4_SCOPE_CLUSTER, 0, maps.slot(udp.id, s.LB4_SCOPE_CLUSTER, 0))  # udp's backend
    return STALE, "slot"


def _tamper_backend(maps, tcp, udp):
    maps.set_backend(maps.slot(tcp.id, s.LB4_SCOPE_CLUSTER, 0), Backend("10.99.0.3", 8080, in_cluster=True))
    return STALE, "backend"


def _tamper_range(maps, tcp, udp):
    maps.add_source_range(tcp.id, "198.51.100.0/24")
    return EXTRA, "source range"


@pytest.mark.parametrize("tamper", [_tamper_record, _tamper_slot, _tamper_backend, _tamper_range],
                         ids=["record", "slot", "backend", "range"])
def test_one_changed_entry_of_any_service_table_is_found(node, tamper, monkeypatch):
    """The audit first only sums the service maps (digest.py) and reads them back only when the
    sums differ from the last sync's: a clean audit reads nothing back, and one entry changed
    in any of the four tables, with its count unchanged, still makes them differ."""
    lab = node
    dp = _datapath(lab, lab.cgroup())
    _sync(lab, dp, _state())
    reads = []
    real_read = audit_ebpf.adopt.read
    monkeypatch.setattr(audit_ebpf.adopt, "read", lambda maps: reads.append(maps) or real_read(maps))
    assert _audit(lab, dp).clean and reads == [], "clean: summed, nothing read back"
    maps = pins.open_maps(lab.bpffs)
    try:
        services = dict(maps.services())
        expected = tamper(maps, services[Frontend(VIP, 80, 6)], services[Frontend(VIP, 80, 17)])
    finally:
        maps.close()
    report = _audit(lab, dp)
    assert [(d.kind, d.what) for d in report.drifts] == [expected], "\n".join(report.lines())
    assert len(reads) == 1, "read back to name it"
    assert _audit(lab, dp, repair=True).repaired
    after = _audit(lab, dp)
    assert after.clean, "repaired without touching the other port's backend: " + "\n".join(after.lines())
    dp.close()
