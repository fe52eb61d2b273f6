"""Maps.count: what stats() reports after every sync, in a few syscalls."""

from __future__ import annotations

import ctypes

import pytest

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import be16, be32

pytestmark = [pytest.mark.bpf, pytest.mark.root]


def _connections(maps, n: int) -> None:
    for i in range(n):
        key = s.CT4Key(saddr=be32("10.244.0.7"), daddr=be32("10.96.0.10"), sport=be16(1000 + i), dport=be16(80),
                       proto=6, kind=s.CT4_SVC)
        maps._put("epx_ct4", key, s.CT4Entry(expires=1 << 62))


@pytest.mark.parametrize("n", [0, 1, 50])
def test_batched_count_matches_the_key_walk(maps, n):
    _connections(maps, n)
    assert maps.count("epx_ct4") == n == len(list(maps.keys("epx_ct4")))
    fd = maps._fd("epx_ct4")
    size = ctypes.sizeof
    assert libbpf.map_count_batched(fd, size(s.CT4Key), size(s.CT4Entry), chunk=7) == n, "across many batches"


def test_maps_that_cannot_batch_are_walked(maps):
    maps.set_pod_cidrs(["10.244.0.0/16", "10.250.0.0/16"])  # an LPM trie
    assert maps.count("epx_pod_cidr") == 2
