"""A service map that is full: the error names the map, its capacity and the setting that raises
it (--bpf-map-sizes), and what was written before stays (issue 12: capacities for 100k Services)."""

from __future__ import annotations

import errno

import pytest

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf.maps import Frontend, MapFull, Maps, Service
from tests.bpf import world as w
from tests.bpf.conftest import SMALL_MAPS

pytestmark = [pytest.mark.bpf, pytest.mark.root]

FRONTENDS = 8


@pytest.fixture(scope="module")
def small(tmp_bpffs_factory):
    loaded = loader.load(tmp_bpffs_factory("map-full"), ("tc_ingress",),
                         max_entries={**SMALL_MAPS, "epx_svc": FRONTENDS})
    yield loaded
    loaded.close()


def test_a_full_service_map_names_itself_and_the_flag(small):
    maps = Maps.from_loaded(small)
    maps.reset()
    for i in range(FRONTENDS):
        maps.set_service(Frontend(f"10.96.1.{i + 1}", 80, w.TCP), Service(i + 1, 0, 0, 0, 0))
    with pytest.raises(MapFull) as caught:
        maps.set_service(Frontend("10.96.1.200", 80, w.TCP), Service(200, 0, 0, 0, 0))
    assert caught.value.errno == errno.E2BIG and isinstance(caught.value, OSError)
    assert str(caught.value) == (f"[Errno 7] BPF map epx_svc is full ({FRONTENDS} entries): raise its capacity "
                                 f"with --bpf-map-sizes epx_svc=N (N > {FRONTENDS})")
    assert len(list(maps.keys("epx_svc"))) == FRONTENDS
    # an existing frontend can still be rewritten in place
    maps.set_service(Frontend("10.96.1.1", 80, w.TCP), Service(1, 0, 0, 0, 0))
