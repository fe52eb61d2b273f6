"""Read-only queries of a running datapath's pins (the bench's hooks): no compile, no agent."""

from __future__ import annotations

import os
import socket

import pytest

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import (
    Backend,
    PinnedMapError,
    be16,
    entry_counts,
    frontend_backends,
    programmed_backends,
)
from ebpf_proxy.datapath.ebpf.services import ServicePrograms
from ebpf_proxy.model import Endpoint, Protocol, ServicePort, ServicePortName
from tests.bpf import world as w

pytestmark = [pytest.mark.bpf, pytest.mark.root]


def test_programmed_backends_follow_the_backend_map(pin_dir, maps):
    assert programmed_backends(pin_dir) == set()
    w.install(maps, w.web())
    assert programmed_backends(pin_dir) == {w.LOCAL_EP, w.REMOTE_EP, w.REMOTE_EP2}
    maps.set_backend(999, Backend("100.96.0.7", 7000))
    assert ("100.96.0.7", 7000) in programmed_backends(pin_dir)
    maps.delete_backend(999)
    assert ("100.96.0.7", 7000) not in programmed_backends(pin_dir)


def test_programmed_backends_of_a_sync(pin_dir, maps):
    """What the agent's sync writes is what the query returns, endpoint change included."""
    programs = ServicePrograms(maps)
    name = ServicePortName("default", "web", "", Protocol.TCP)
    svc = ServicePort(name=name, cluster_ip="10.96.5.5", port=80, protocol=Protocol.TCP)
    eps = (Endpoint("10.244.1.5", 8080, node_name="n1", ready=True),
           Endpoint("10.244.2.6", 8080, node_name="n2", ready=True))
    programs.apply(name, programs.entries(svc, eps))
    assert programmed_backends(pin_dir) == {("10.244.1.5", 8080), ("10.244.2.6", 8080)}
    moved = (eps[0], Endpoint("100.96.0.9", 8080, node_name="n2", ready=True))
    programs.apply(name, programs.entries(svc, moved))
    assert programmed_backends(pin_dir) == {("10.244.1.5", 8080), ("100.96.0.9", 8080)}


def test_frontend_backends_reads_one_service(pin_dir, maps):
    """The bench's per-change check: the frontend's cluster slots and nothing else, before and
    after an endpoint moves; another service's backends never show; an unknown frontend is None."""
    programs = ServicePrograms(maps)
    web = ServicePortName("default", "web", "", Protocol.TCP)
    dns = ServicePortName("default", "dns", "", Protocol.UDP)
    web_svc = ServicePort(name=web, cluster_ip="10.96.5.5", port=80, protocol=Protocol.TCP)
    dns_svc = ServicePort(name=dns, cluster_ip="10.96.5.5", port=80, protocol=Protocol.UDP)
    eps = (Endpoint("10.244.1.5", 8080, node_name="n1", ready=True),
           Endpoint("10.244.2.6", 8080, node_name="n2", ready=True))
    programs.apply(web, programs.entries(web_svc, eps))
    programs.apply(dns, programs.entries(dns_svc, (Endpoint("10.244.3.7", 53, node_name="n1", ready=True),)))
    assert frontend_backends(pin_dir, "10.96.5.5", 80) == {("10.244.1.5", 8080), ("10.244.2.6", 8080)}
    assert frontend_backends(pin_dir, "10.96.5.5", 80, socket.IPPROTO_UDP) == {("10.244.3.7", 53)}
    moved = (eps[0], Endpoint("100.96.0.9", 8080, node_name="n2", ready=True))
    programs.apply(web, programs.entries(web_svc, moved))
    assert frontend_backends(pin_dir, "10.96.5.5", 80) == {("10.244.1.5", 8080), ("100.96.0.9", 8080)}
    assert frontend_backends(pin_dir, "10.96.5.6", 80) is None
    programs.apply(web, None)
    assert frontend_backends(pin_dir, "10.96.5.5", 80) is None


def test_batched_read_spans_many_batches(maps):
    for i in range(1, 301):
        maps.set_backend(i, Backend(f"100.64.{i // 250}.{i % 250 + 1}", 7000 + i))
    items = list(libbpf.map_items_batched(maps._fd("epx_backend"), s.u32, s.LB4Backend, chunk=7))
    assert sorted(k.value for k, _ in items) == list(range(1, 301)), "every key once"
    assert {k.value: v.port for k, v in items} == {i: be16(7000 + i) for i in range(1, 301)}, \
        "keys and values copied, not aliased to the reused batch buffers"


def test_entry_counts(pin_dir, maps):
    w.install(maps, w.web())
    counts = entry_counts(pin_dir)
    arrays = {"epx_config", "epx_stats", "epx_trace", "epx_ct4_ring", "epx_config6", "epx_scratch6"}
    assert set(counts) == set(s.MAPS) - arrays, "arrays have no fill level"
    assert counts["epx_backend"] == 3 and counts["epx_svc"] == 4
    assert counts["epx_slot"] == 4 and counts["epx_node_addr"] == 2 and counts["epx_pod_cidr"] == 1
    assert counts["epx_ct4"] == 0


def test_queries_open_the_maps_read_only(pin_dir, maps):
    """The bench polls a live node: the query must not be able to change the datapath."""
    fd = libbpf.obj_get_readonly(str(pin_dir / "epx_backend"))
    try:
        with pytest.raises(OSError):
            libbpf.map_update(fd, s.u32(1), s.LB4Backend())
    finally:
        os.close(fd)


def test_queries_name_what_is_missing(tmp_path):
    with pytest.raises(PinnedMapError, match="epx_backend"):
        programmed_backends(tmp_path)
    with pytest.raises(PinnedMapError, match="epx_svc"):
        entry_counts(tmp_path)
    with pytest.raises(PinnedMapError, match="epx_svc"):
        frontend_backends(tmp_path, "10.96.0.1", 80)
