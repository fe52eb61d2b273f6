"""Batched map writes (BPF_MAP_UPDATE_BATCH, maps.Maps.set_backends/set_slot_entries/set_services)
leave exactly what single writes leave, sync after sync, and a full map still says which one.

The maps are private to the test (created unpinned by bench.cpscale.private_maps, freed when
closed): no compile, nothing attached, nothing pinned."""

from __future__ import annotations

import errno
import os

import pytest

from ebpf_proxy.bench.cpscale import private_maps
from ebpf_proxy.datapath.ebpf import libbpf, services
from ebpf_proxy.datapath.ebpf.maps import Backend, MapFull, Maps
from ebpf_proxy.datapath.ebpf.services import ServicePrograms
from ebpf_proxy.model import ProxyState
from ebpf_proxy.model.types import Endpoint, NodeTopology, Protocol, ServicePort, ServicePortName

pytestmark = [pytest.mark.bpf, pytest.mark.root]


@pytest.fixture
def two_maps():
    if os.geteuid() != 0:
        pytest.skip("BPF maps need root")
    batched, single = private_maps(64, 8), private_maps(64, 8)
    single._batch_ok = False  # every write one update, as before batching
    yield batched, single
    batched.close()
    single.close()


def port(i: int, **kw) -> ServicePort:
    proto = Protocol.UDP if i % 5 == 0 else Protocol.TCP
    return ServicePort(name=ServicePortName("default", f"svc-{i}", "", proto), cluster_ip=f"10.96.0.{i + 10}",
                       port=80, protocol=proto, **kw)


def endpoints(i: int, n: int, shift: int = 0) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(f"100.64.{i}.{j + shift + 1}", 8080, node_name="me" if j % 3 == 0 else "other",
                          is_local=j % 3 == 0) for j in range(n))


def state_one() -> dict:
    return {port(i, node_port=30000 + i if i % 2 else 0, external_policy_local=i % 4 == 1,
                 external_ips=("192.0.2.1",) if i % 7 == 0 else ()): endpoints(i, i % 6)
            for i in range(40)}


def state_two() -> dict:
    """Appends, truncations, replacements (a bank swap), a policy switch, deletions, additions."""
    out = {}
    for i in range(5, 48):
        n = (i % 6) + (2 if i % 3 == 0 else -1 if i % 3 == 1 else 0)
        out[port(i, node_port=30000 + i if i % 2 else 0, external_policy_local=i % 4 == 2)] = \
            endpoints(i, max(n, 0), shift=1 if i % 8 == 0 else 0)
    return out


def program(programs: ServicePrograms, desired: dict) -> None:
    wanted = {svc.name: (svc, eps) for svc, eps in desired.items()}
    for name in sorted(set(wanted) | set(programs.current)):
        svc, eps = wanted.get(name, (None, ()))
        programs.apply(name, programs.entries(svc, eps, NodeTopology("me")) if svc else None)


def dump(maps: Maps) -> tuple:
    return (sorted(maps.services(), key=repr), sorted(maps.backends().items()), sorted(maps.slots()))


def test_batched_writes_leave_what_single_writes_leave_sync_after_sync(two_maps):
    batched, single = two_maps
    a, b = ServicePrograms(batched), ServicePrograms(single)
    for desired in (state_one(), state_two(), state_one(), {}):
        program(a, desired)
        program(b, desired)
        assert dump(batched) == dump(single)
        assert a.current == b.current
    assert dump(batched) == ([], [], [])


def test_a_batch_into_a_full_map_names_it_and_keeps_what_went_in():
    if os.geteuid() != 0:
        pytest.skip("BPF maps need root")
    maps = private_maps(64, 8, sizes={"epx_backend": 16})
    try:
        with pytest.raises(MapFull) as caught:
            maps.set_backends([(bid, Backend(f"100.64.0.{bid}", 8080)) for bid in range(1, 21)])
        assert caught.value.errno == errno.E2BIG and caught.value.name == "epx_backend"
        assert sorted(maps.backends()) == list(range(1, 17)), "the entries before the full one are in, in order"
    finally:
        maps.close()


def test_a_batch_error_says_how_many_entries_went_in():
    if os.geteuid() != 0:
        pytest.skip("BPF maps need root")
    maps = private_maps(64, 8, sizes={"epx_backend": 4})
    try:
        keys = b"".join(i.to_bytes(4, "little") for i in range(1, 7))
        with pytest.raises(libbpf.BatchError) as caught:
            libbpf.map_update_batch(maps._fd("epx_backend"), keys, bytes(8 * 6), 6)
        assert caught.value.errno == errno.E2BIG and caught.value.done == 4
    finally:
        maps.close()


@pytest.mark.parametrize("full", [{"epx_backend": 40}, {"epx_slot": 40}, {"epx_svc": 30}])
def test_a_full_map_refuses_the_same_ports_whether_new_ports_are_written_in_groups_or_one_by_one(full, monkeypatch):
    """services.NewPorts writes many new ports' entries in one batch per map; when a map fills
    up, the ports it refuses (and what is left in the maps) are those apply() one port at a
    time refuses and leaves."""
    if os.geteuid() != 0:
        pytest.skip("BPF maps need root")
    monkeypatch.setattr(services, "GROUP", 6)
    grouped, single = private_maps(64, 8, sizes=full), private_maps(64, 8, sizes=full)
    try:
        desired = state_one()
        wanted = {svc.name: (svc, eps) for svc, eps in desired.items()}
        a, b = ServicePrograms(grouped), ServicePrograms(single)
        state = ProxyState(services={n: svc for n, (svc, _) in wanted.items()},
                           endpoints={n: eps for n, (_, eps) in wanted.items()})
        _writes, refused = a.sync_names(state, set(wanted))
        refused_single = {}
        for name in services.sorted_names(wanted):
            try:
                b.apply(name, b.entries(*wanted[name]))
            except MapFull as exc:
                refused_single[name] = exc
        assert refused and set(refused) == set(refused_single)
        assert {exc.name for exc in refused.values()} == set(full)
        assert dump(grouped) == dump(single) and a.current == b.current
    finally:
        grouped.close()
        single.close()
