"""New service ports' writes gathered over many ports (services.NewPorts, issue 12) put in each
map the same entries, in the same order, as apply() one port at a time: the same bytes (the
packing is checked against the structs.py mirrors in test_map_packing.py), the same final maps,
the same counts and `current`; and the interleaving they do change keeps every port's backends
before its slots before its frontends, so wherever a writer stops every frontend in the maps
leads to slots and backends that exist. Both families, groups small enough that a sync makes
several, new ports among changed and deleted ones. The kernel is a dict per map
(test_sync_fast_path_writes.DictKernel); tests/bpf/test_kill_mid_sync.py stops the real thing."""

from __future__ import annotations

import errno

import pytest

from ebpf_proxy.datapath.ebpf import libbpf, services
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps, Maps6
from ebpf_proxy.datapath.ebpf.services import ServicePrograms
from ebpf_proxy.model import ProxyState
from ebpf_proxy.model.types import Endpoint
from tests.unit.test_sync_fast_path_writes import DictKernel, address, service

NODE_IPS = ("172.20.20.15", "fd00:20::15")


def endpoints(family: int, i: int, gen: int) -> tuple[Endpoint, ...]:
    n = (i * 7 + gen * (i % 3 == 0)) % 6  # some without any
    return tuple(Endpoint(address(family, i * 16 + j + gen * (i % 5 == 0)), 8080, node_name="me" if j % 3 else "other",
                          is_local=bool(j % 3)) for j in range(n))


def state(family: int, gen: int) -> ProxyState:
    """gen 0: 40 ports; gen 1: some changed, some deleted, new ones among them (names interleave)."""
    indices = range(1, 41) if gen == 0 else [i for i in range(1, 61) if i % 9 and (i <= 40 or i % 2)]
    ports = [service(family, i, gen) for i in indices]  # some with source ranges: apply() writes them
    return ProxyState(services={p.name: p for p in ports},
                      endpoints={p.name: endpoints(family, i, gen) for p, i in zip(ports, indices)})


def run(monkeypatch, family: int, grouped: bool, gens: tuple[int, ...] = (0, 1)):
    """The syncs' writes entry by entry [(map fd, op, key, value)], the maps, `current`, counts, writes."""
    kernel = DictKernel(monkeypatch)
    maps = Maps({name: fd for fd, name in enumerate(s.MAPS, start=100)})
    programs = ServicePrograms(Maps6(maps) if family == 6 else maps, NODE_IPS, family=family)
    returned = []
    for gen in gens:
        desired = state(family, gen)
        names = set(desired.services) | set(programs.current)
        if grouped:
            writes, did_not_fit = programs.sync_names(desired, names)
            assert not did_not_fit
        else:  # one port at a time, in the same order
            writes = sum(programs.apply(name, programs.entries(desired.services[name], desired.endpoints_of(name))
                                        if name in desired.services else None)
                         for name in services.sorted_names(names))
        returned.append(writes)
    entries = []
    for op, fd, *rest in kernel.log:
        if op == "batch":
            keys, values, count = rest
            k, v = len(keys) // count, len(values) // count
            entries += [(fd, "update", keys[i * k:(i + 1) * k], values[i * v:(i + 1) * v]) for i in range(count)]
        else:
            entries.append((fd, op, *rest))
    return entries, kernel, programs, returned


def per_map(entries: list) -> dict:
    out: dict = {}
    for fd, *rest in entries:
        out.setdefault(fd, []).append(tuple(rest))
    return out


@pytest.mark.parametrize("family", [4, 6])
def test_grouped_new_ports_write_each_map_as_one_port_at_a_time_does(monkeypatch, family):
    monkeypatch.setattr(services, "GROUP", 7)
    grouped, kernel, programs, writes = run(monkeypatch, family, grouped=True)
    batches = sum(1 for entry in kernel.log if entry[0] == "batch")
    single, single_kernel, reference, single_writes = run(monkeypatch, family, grouped=False)
    assert per_map(grouped) == per_map(single)
    assert batches < sum(1 for entry in single_kernel.log if entry[0] == "batch")
    assert grouped != single, "the groups interleave the maps differently (else nothing was grouped)"
    assert kernel.maps == single_kernel.maps
    assert writes == single_writes
    assert programs.current == reference.current
    assert (programs.frontend_count, programs.backend_count) == (reference.frontend_count, reference.backend_count)
    assert len(programs.current) > 30 and any(e.local_slots for e in programs.current.values())


@pytest.mark.parametrize("family", [4, 6])
def test_wherever_grouped_writes_stop_every_frontend_leads_to_its_slots_and_backends(monkeypatch, family):
    """Replays the first (all new) sync's writes entry by entry: after each, every frontend's
    record names slots that exist in its bank, and every one names a backend that exists."""
    monkeypatch.setattr(services, "GROUP", 5)
    v6 = family == 6
    entries, _kernel, _programs, _writes = run(monkeypatch, family, grouped=True, gens=(0,))
    fds = {name: fd for fd, name in enumerate(s.MAPS, start=100)}
    svc_fd, slot_fd, backend_fd = (fds[n + ("6" if v6 else "")] for n in ("epx_svc", "epx_slot", "epx_backend"))
    held: dict[int, dict[bytes, bytes]] = {svc_fd: {}, slot_fd: {}, backend_fd: {}}
    checked = 0
    for fd, op, key, *value in entries:
        assert op == "update"
        if fd not in held:
            continue
        held[fd][key] = value[0]
        for record in held[svc_fd].values():
            rec = s.LB4Service.from_buffer_copy(record)
            bank = 1 if rec.flags & s.LB4_F_SLOT_BANK else 0
            for scope, count in ((s.LB4_SCOPE_CLUSTER, rec.count), (s.LB4_SCOPE_LOCAL, rec.local_count)):
                for slot in range(count):
                    slot_key = bytes(s.LB4SlotKey(svc_id=rec.id, slot=slot, scope=scope, bank=bank))
                    assert slot_key in held[slot_fd], f"service {rec.id}: slot {slot} missing after {checked} writes"
                    assert held[slot_fd][slot_key] in held[backend_fd], \
                        f"service {rec.id}: the backend of slot {slot} missing after {checked} writes"
        checked += 1
    assert checked > 150 and len(held[svc_fd]) > 40


def test_a_group_whose_batch_fails_is_written_again_port_by_port_and_all_of_it_remembered(monkeypatch):
    """A kernel error other than a full map in a group's batch (here once, after half the
    entries): the group is written again one port at a time, which goes through; nothing is
    left unclaimed in the maps and every port is in `current`, as a sync without the error."""
    monkeypatch.setattr(services, "GROUP", 8)
    _entries, reference_kernel, reference, _writes = run(monkeypatch, 4, grouped=True, gens=(0,))
    kernel = DictKernel(monkeypatch)
    failed = []

    def flaky(fd, keys, values, count):
        if not failed and count > 4 and fd == 100 + list(s.MAPS).index("epx_slot"):
            failed.append(count)
            half = count // 2
            kernel.update_batch(fd, keys[:half * 8], values[:half * 4], half)
            raise libbpf.BatchError(errno.ENOMEM, half)
        kernel.update_batch(fd, keys, values, count)

    monkeypatch.setattr(libbpf, "map_update_batch", flaky)
    programs = ServicePrograms(Maps({name: fd for fd, name in enumerate(s.MAPS, start=100)}), NODE_IPS)
    desired = state(4, 0)
    _writes, did_not_fit = programs.sync_names(desired, set(desired.services))
    assert failed and not did_not_fit
    assert kernel.maps == reference_kernel.maps and programs.current == reference.current


def test_a_name_given_twice_is_synced_once(monkeypatch):
    """sync_names takes any iterable of names; one given twice must not put its new port into a
    group twice (two writes of every entry, and frontend/backend counts doubled)."""
    monkeypatch.setattr(services, "GROUP", 7)
    once_kernel = DictKernel(monkeypatch)
    once = ServicePrograms(Maps({name: fd for fd, name in enumerate(s.MAPS, start=100)}), NODE_IPS)
    desired = state(4, 0)
    names = sorted(desired.services)
    once_writes, _ = once.sync_names(desired, names)
    once_log = list(once_kernel.log)
    twice_kernel = DictKernel(monkeypatch)
    twice = ServicePrograms(Maps({name: fd for fd, name in enumerate(s.MAPS, start=100)}), NODE_IPS)
    twice_writes, _ = twice.sync_names(desired, names + names[::3])
    assert twice_writes == once_writes
    assert twice_kernel.log == once_log and twice_kernel.maps == once_kernel.maps
    assert (twice.frontend_count, twice.backend_count) == (once.frontend_count, once.backend_count)
