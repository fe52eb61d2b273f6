"""The eBPF datapath writes the same bytes, in the same order, whether a service port's endpoints come
packed from the tracker (model.categorize.reachable's fast path, issue 12) or as plain Endpoint
tuples (categorize itself): over a full sync and partial ones (endpoints added, removed, replaced,
bank swaps, deletions, a zone change). The kernel is a dict per map here: every write is recorded
as the bytes libbpf would hand it."""

from __future__ import annotations

import ctypes
import random

import pytest

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps, Maps6
from ebpf_proxy.datapath.ebpf.services import ServicePrograms
from ebpf_proxy.model import ProxyState, Protocol, ServicePort, ServicePortName
from ebpf_proxy.model.endpoints import MergedEndpoints, PortlessEndpoints
from ebpf_proxy.model.tracker import ChangeTracker, NodeState


class DictKernel:
    """libbpf's map calls over dicts (map fd -> {key bytes: value bytes}), recording each write."""

    def __init__(self, monkeypatch) -> None:
        self.maps: dict[int, dict[bytes, bytes]] = {}
        self.log: list[tuple] = []
        monkeypatch.setattr(libbpf, "map_update", self.update)
        monkeypatch.setattr(libbpf, "map_update_batch", self.update_batch)
        monkeypatch.setattr(libbpf, "map_delete", self.delete)
        monkeypatch.setattr(libbpf, "map_lookup", self.lookup)

    def update(self, fd, key, value, flags=0):
        self.log.append(("update", fd, bytes(key), bytes(value)))
        self.maps.setdefault(fd, {})[bytes(key)] = bytes(value)

    def update_batch(self, fd, keys, values, count):
        self.log.append(("batch", fd, bytes(keys), bytes(values), count))
        k, v = len(keys) // count, len(values) // count
        for i in range(count):
            self.maps.setdefault(fd, {})[bytes(keys[i * k:(i + 1) * k])] = bytes(values[i * v:(i + 1) * v])

    def delete(self, fd, key):
        self.log.append(("delete", fd, bytes(key)))
        return self.maps.get(fd, {}).pop(bytes(key), None) is not None

    def lookup(self, fd, key, value):
        held = self.maps.get(fd, {}).get(bytes(key))
        if held is None:
            return False
        ctypes.memmove(ctypes.addressof(value), held, len(held))
        return True


PROTOCOLS = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)


def address(family: int, i: int) -> str:
    return f"fd00:64::{i >> 16:x}:{i & 0xffff:x}" if family == 6 else f"100.{64 + (i >> 16) % 64}.{(i >> 8) & 255}.{i & 255}"


def service(family: int, i: int, gen: int) -> ServicePort:
    r = random.Random(i * 7919 + gen * (i % 3 == 0))
    kind = r.randrange(7)
    kw: dict = {}
    if kind == 1:
        kw["node_port"] = 30000 + i
    elif kind == 2:
        kw.update(node_port=30000 + i, external_policy_local=True)
    elif kind == 3:
        kw["internal_policy_local"] = True
    elif kind == 4:
        kw.update(external_ips=("203.0.113.7", "fd00::7"), external_policy_local=r.random() < .5)
    elif kind == 5:
        kw.update(load_balancer_ips=("198.51.100.9" if family == 4 else "2001:db8::9",),
                  load_balancer_source_ranges=("10.0.0.0/8",) if family == 4 else ("fd00::/8",))
    elif kind == 6:
        kw["affinity_timeout_seconds"] = 10800
    protocol = PROTOCOLS[r.randrange(3)]
    cluster_ip = f"10.96.0.{i}" if family == 4 else f"fd00:96::{i:x}"
    return ServicePort(ServicePortName("default", f"svc-{i}", "", protocol), cluster_ip, 80, protocol, **kw)


def rows(family: int, i: int, gen: int) -> list[tuple]:
    """Mostly ready and unhinted (the fast path), sometimes terminating, not ready or hinted."""
    r = random.Random(i * 31 + gen * 1000003 * (i % 4 == 0))
    out = []
    for j in range(r.randrange(0, 9)):
        c = r.random()
        ready, serving, terminating = (True, True, False) if c < .8 else \
            ((False, True, True) if c < .9 else (False, False, False))
        zones = ("zone-a",) if r.random() < .1 else ()
        node = ("node-a", "node-b", "node-c")[r.randrange(3)]
        out.append((address(family, i * 16 + j + (gen if r.random() < .3 else 0)), node, ready, serving,
                    terminating, node == "node-a", zones, ()))
    return out


def syncs(family: int, services: int = 120):
    """The states of four syncs (full, partial, partial, full) as the tracker hands them out,
    with the names each sync programs."""
    tracker = ChangeTracker(node_name="node-a")
    synced: set = set()
    for gen in range(4):
        for i in range(services):
            if gen and (i * 13 + gen) % 5:
                continue
            svc = service(family, i, gen)
            tracker.update_service("default", f"svc-{i}", [] if gen == 2 and i % 11 == 0 else [svc])
            tracker.update_slice("default", f"svc-{i}-a", f"svc-{i}",
                                 {svc.name: PortlessEndpoints(rows(family, i, gen)).with_port(8080 + (gen == 3) * (i % 2))})
        if gen == 1:
            tracker.update_node(NodeState("node-a", zone="zone-a"))
        state, changes = tracker.take(full=gen == 3)
        names = set(state.services) | synced if changes.full else set(changes.services)
        yield ProxyState(dict(state.services), dict(state.endpoints), state.topology), names
        synced = set(state.services)
        tracker.commit()


def writes(monkeypatch, family: int, packed: bool) -> list[tuple]:
    kernel = DictKernel(monkeypatch)
    maps: Maps = Maps({name: fd for fd, name in enumerate(s.MAPS, start=100)})
    programs = ServicePrograms(Maps6(maps) if family == 6 else maps, ("172.20.20.15", "fd00:20::15"), family=family)
    for state, names in syncs(family):
        if not packed:  # the same endpoints as Endpoint tuples: categorize decides, Endpoint by Endpoint
            state = ProxyState(state.services, {k: tuple(v) for k, v in state.endpoints.items()}, state.topology)
        else:
            assert any(type(v) is MergedEndpoints for v in state.endpoints.values())
        kernel.log.append(("sync", programs.sync_names(state, names)))
        programs.sync_done()
    return kernel.log


@pytest.mark.parametrize("family", [4, 6])
def test_packed_endpoints_are_written_as_their_endpoint_tuples_are(monkeypatch, family):
    fast = writes(monkeypatch, family, packed=True)
    slow = writes(monkeypatch, family, packed=False)
    assert len(fast) > 200 and any(entry[0] == "delete" for entry in fast)
    assert fast == slow
