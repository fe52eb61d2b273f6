"""kill -9 of the agent in the middle of a full sync (issue 13, part 3), at every possible point.

A full sync moves a set of services from one state to another: some unchanged, some with an
endpoint added, removed, replaced, all replaced, a traffic policy switched, a nodePort added,
some deleted, some new. The writer is stopped after N map writes, for every N from 0 to the
sync's total, by an injected failure in the map-write calls themselves (not by timing): the
maps then hold exactly what a kill -9 after N writes leaves. For each N:

1. every frontend in epx_svc leads to a complete chain: its record's bank and counts name slots
   that all exist, and every slot's backend exists; the backend set each frontend shows is
   exactly its service's old set or its new one (never a mixture, never a partial one); the
   frontends of a service that exists before and after are all present;
2. a restarted agent (a fresh ServicePrograms: adopt, then the full sync; 1. holds after the
   adoption too, before the sync) converges to the new
   state exactly, with nothing left over, keeps every surviving service's id, and neither the
   dying sync nor the restart writes or deletes a single entry of a service the change did not
   touch (no flush).
"""

from __future__ import annotations

import ctypes
from collections import Counter

import pytest

from ebpf_proxy.datapath.ebpf import libbpf, services
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.adopt import adopt
from ebpf_proxy.datapath.ebpf.maps import Frontend, Maps, ip_str, port_int, slot_bank
from ebpf_proxy.datapath.ebpf.services import ServiceEntries, ServicePrograms, node_settings, program_node
from ebpf_proxy.model import NodeConfig, ProxyState
from ebpf_proxy.model.types import Endpoint, Protocol, ServicePort, ServicePortName
from tests.bpf import world as w

pytestmark = [pytest.mark.bpf, pytest.mark.root]

NODE = NodeConfig("me", node_ips=(w.NODE_IP, w.NODE_IP2), cluster_cidrs=(w.POD_CIDR,))


class Killed(BaseException):
    """The agent died here (a BaseException: no `except Exception` runs on its way out, as none
    would run after a kill -9)."""


def ep(i: int, local: bool = False) -> Endpoint:
    return Endpoint(f"10.244.{0 if local else 1}.{i}", 8080, node_name="me" if local else f"n{i}", is_local=local)


def svc(name: str, n: int, **kw) -> ServicePort:
    return ServicePort(name=ServicePortName("default", name, "http", kw.pop("protocol", Protocol.TCP)),
                       cluster_ip=f"10.96.1.{n}", port=80, protocol=Protocol.TCP, **kw)


# (name, before, after): a service port and its endpoints, None where it does not exist
CHANGES = [
    ("keep-a", (svc("keep-a", 1), (ep(1), ep(2))), (svc("keep-a", 1), (ep(1), ep(2)))),
    ("keep-b", (svc("keep-b", 2, node_port=30002, external_policy_local=True), (ep(3), ep(4, True))),
     (svc("keep-b", 2, node_port=30002, external_policy_local=True), (ep(3), ep(4, True)))),
    ("append", (svc("append", 3, node_port=30003), (ep(5),)), (svc("append", 3, node_port=30003), (ep(5), ep(6), ep(7)))),
    ("drop-middle", (svc("drop-middle", 4, node_port=30004), (ep(8), ep(9), ep(10), ep(11))),
     (svc("drop-middle", 4, node_port=30004), (ep(8), ep(10), ep(11)))),
    ("replace-one", (svc("replace-one", 5), (ep(12), ep(13), ep(14))), (svc("replace-one", 5), (ep(12), ep(15), ep(14)))),
    ("replace-all", (svc("replace-all", 6, node_port=30006, external_ips=("192.0.2.6",)), (ep(16), ep(17), ep(18))),
     (svc("replace-all", 6, node_port=30006, external_ips=("192.0.2.6",)), (ep(19), ep(20), ep(21)))),
    ("replace-and-grow", (svc("replace-and-grow", 7, node_port=30007), (ep(22), ep(23))),
     (svc("replace-and-grow", 7, node_port=30007), (ep(24), ep(23), ep(25), ep(26)))),
    ("to-none", (svc("to-none", 8), (ep(27), ep(28))), (svc("to-none", 8), ())),
    ("from-none", (svc("from-none", 9, node_port=30009), ()), (svc("from-none", 9, node_port=30009), (ep(29), ep(30)))),
    ("etp-local", (svc("etp-local", 10, node_port=30010), (ep(31), ep(32, True))),
     (svc("etp-local", 10, node_port=30010, external_policy_local=True), (ep(33, True), ep(31), ep(32, True)))),
    ("gains-nodeport", (svc("gains-nodeport", 11), (ep(34),)), (svc("gains-nodeport", 11, node_port=30011), (ep(35),))),
    ("deleted", (svc("deleted", 12, node_port=30012), (ep(36), ep(37))), None),
    ("new", None, (svc("new", 13, node_port=30013, external_ips=("192.0.2.13",)), (ep(38), ep(39)))),
]
# already on bank 1 before the change (it went through a swap once): the change swaps it back
BANK1 = ("bank-one", svc("bank-one", 14, node_port=30014), ((ep(40), ep(41)), (ep(42), ep(43))), (ep(44), ep(45)))
UNTOUCHED = {"keep-a", "keep-b"}


def state(which: int) -> ProxyState:
    pairs = [c[which] for c in CHANGES if c[which] is not None]
    pairs.append((BANK1[1], BANK1[2][1] if which == 1 else BANK1[3]))
    return ProxyState(services={p.name: p for p, _ in pairs}, endpoints={p.name: eps for p, eps in pairs})


def full_sync(programs: ServicePrograms, desired: ProxyState) -> int:
    """What EbpfDatapath.sync does for a full sync: every service port, in name order."""
    writes = 0
    for name in sorted(set(desired.services) | set(programs.current)):
        port = desired.services.get(name)
        writes += programs.apply(name, programs.entries(port, desired.endpoints_of(name)) if port else None)
    return writes


def program_before(maps: Maps) -> ServicePrograms:
    maps.reset()
    w.install_node(maps)
    program_node(maps, NODE, node_settings(NODE))
    programs = ServicePrograms(maps)
    bank1 = BANK1[1]
    full_sync(programs, ProxyState(services={bank1.name: bank1}, endpoints={bank1.name: BANK1[2][0]}))
    full_sync(programs, state(1))
    assert programs.current[bank1.name].bank == 1, "the scenario needs a service on bank 1 already"
    return programs


View = tuple[int, int, frozenset, frozenset]  # flags without the bank, affinity, cluster and local (ip, port)


def views_of(programs: ServicePrograms) -> dict[Frontend, View]:
    """What each frontend should show, from the entries a ServicePrograms holds."""
    out = {}
    for entries in programs.current.values():
        for fe, flags in entries.frontends.items():
            out[fe] = _view(entries, flags)
    return out


def _view(e: ServiceEntries, flags: int) -> View:
    addr = lambda bids: frozenset((e.backends[b].addr, e.backends[b].port) for b in bids)  # noqa: E731
    return flags, e.affinity_timeout, addr(e.cluster_slots), addr(e.local_slots)


def held_views(maps: Maps) -> dict[Frontend, View]:
    """What each frontend in the maps shows, walking frontend -> record -> slots -> backends as the
    programs do; a missing slot or backend on that walk fails the test."""
    out = {}
    for fe, rec in maps.services():
        bank = slot_bank(rec.flags)
        sets = []
        for scope, count in ((s.LB4_SCOPE_CLUSTER, rec.count), (s.LB4_SCOPE_LOCAL, rec.local_count)):
            found = set()
            for slot in range(count):
                bid = maps.slot(rec.id, scope, slot, bank=bank)
                assert bid is not None, f"{fe}: slot {slot} of scope {scope} bank {bank} (id {rec.id}) is missing"
                be = maps.backend(bid)
                assert be is not None, f"{fe}: backend {bid} of slot {slot} (id {rec.id}) is missing"
                found.add((be.addr, be.port))
            sets.append(frozenset(found))
        out[fe] = (rec.flags & ~s.LB4_F_SLOT_BANK, rec.affinity_timeout, sets[0], sets[1])
    return out


class WriteLog:
    """Counts the map writes (updates and deletes) and records which entries they touched; raises
    Killed on the write after `limit`."""

    def __init__(self, monkeypatch, maps: Maps, limit: int | None = None) -> None:
        self.limit, self.done, self.touched = limit, 0, []
        self._names = {fd: name for name, fd in maps._fds.items()}
        update, delete = libbpf.map_update, libbpf.map_delete

        def guarded(real):
            def call(fd, key, *rest):
                if self.limit is not None and self.done >= self.limit:
                    raise Killed(f"killed after {self.done} writes")
                self.done += 1
                self.touched.append((self._names.get(fd), type(key).from_buffer_copy(key)))
                return real(fd, key, *rest)
            return call

        monkeypatch.setattr(libbpf, "map_update", guarded(update))
        monkeypatch.setattr(libbpf, "map_delete", guarded(delete))
        batch = libbpf.map_update_batch

        def guarded_batch(fd, keys, values, count):
            """A batch is written entry by entry, in order, and programs read the map meanwhile:
            each entry counts as a write, and a kill may land between any two of them."""
            name = self._names.get(fd)
            spec = s.MAPS[name]
            ks, vs = ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf)
            allowed = count if self.limit is None else max(0, min(count, self.limit - self.done))
            self.touched += [(name, spec.key.from_buffer_copy(keys, i * ks)) for i in range(allowed)]
            if allowed:
                batch(fd, keys[:allowed * ks], values[:allowed * vs], allowed)
            self.done += allowed
            if allowed < count:
                raise Killed(f"killed after {self.done} writes")

        monkeypatch.setattr(libbpf, "map_update_batch", guarded_batch)

    def touches(self, untouched: dict[int, set[int]], frontends: set[Frontend]) -> list[str]:
        """The writes that touched an entry of an untouched service (svc id -> its backend ids)."""
        bad = []
        backends = {b for bids in untouched.values() for b in bids}
        for name, key in self.touched:
            if name == "epx_svc":
                fe = Frontend(None if not key.addr else _ip(key.addr), _port(key.port), key.proto)
                if fe in frontends:
                    bad.append(f"epx_svc {fe}")
            elif name == "epx_slot" and key.svc_id in untouched:
                bad.append(f"epx_slot {key}")
            elif name == "epx_backend" and key.value in backends:
                bad.append(f"epx_backend {key.value}")
            elif name == "epx_src_range" and key.svc_id in untouched:
                bad.append(f"epx_src_range {key}")
        return bad


def _ip(raw) -> str:
    return ip_str(getattr(raw, "value", raw))  # be32 fields are structs with a value


def _port(raw) -> int:
    return port_int(getattr(raw, "value", raw))


def test_a_kill_at_any_write_of_a_full_sync_leaves_no_partial_service_and_the_restart_converges(maps, monkeypatch):
    reference = program_before(maps)
    before = views_of(reference)
    untouched_ids = {reference.current[n].svc_id: set(reference.current[n].backends)
                     for n in reference.current if n.name in UNTOUCHED}
    untouched_fes = {fe for n, e in reference.current.items() if n.name in UNTOUCHED for fe in e.frontends}
    ids_before = {n: e.svc_id for n, e in reference.current.items()}
    total = full_sync(reference, state(2))
    after = views_of(reference)
    assert held_views(maps) == after
    assert total > 40 and sum(1 for e in reference.current.values() if e.bank == 1) >= 2, "the scenario swaps banks"
    both = set(before) & set(after)
    restart_writes = []

    for kill_at in range(total):
        programs = program_before(maps)
        log = WriteLog(monkeypatch, maps, limit=kill_at)
        with pytest.raises(Killed):
            full_sync(programs, state(2))
        log.limit = None
        # 1. what the kill left: every frontend complete, old or new, none of a surviving service missing
        held = held_views(maps)
        for fe, view in held.items():
            assert view in (before.get(fe), after.get(fe)), \
                f"killed after {kill_at} writes: {fe} shows {view}; before {before.get(fe)}, after {after.get(fe)}"
        assert both <= set(held), f"killed after {kill_at} writes: frontends gone: {both - set(held)}"

        # 2. the restart: adopt, then the first (full) sync
        restarted = ServicePrograms(maps)
        since = log.done
        adopt(restarted, state(2))
        for fe, view in held_views(maps).items():  # adoption deletes only what no frontend reads
            assert view in (before.get(fe), after.get(fe)), f"after adoption (kill at {kill_at}): {fe} shows {view}"
        full_sync(restarted, state(2))
        restart_writes.append(log.done - since)
        assert held_views(maps) == after, f"killed after {kill_at} writes: the restart did not converge"
        assert full_sync(restarted, state(2)) == 0
        for name, svc_id in ids_before.items():
            if name in restarted.current:
                assert restarted.current[name].svc_id == svc_id, f"{name} got a new id after a kill at {kill_at}"
        wanted_slots = sum(len(e.cluster_slots) + len(e.local_slots) for e in restarted.current.values())
        assert maps.count("epx_slot") == wanted_slots, f"stray slots after a kill at {kill_at}"
        assert set(maps.backends()) == {b for e in restarted.current.values() for b in e.backends}
        assert not log.touches(untouched_ids, untouched_fes), f"kill at {kill_at}: untouched services rewritten"
        monkeypatch.undo()

    spread = Counter(restart_writes)
    print(f"\nfull sync of {len(CHANGES) + 1} service ports, {total} map writes: killed after each of 0..{total - 1} "
          f"writes: 0 frontends showed a partial or mixed backend set; every restart converged with "
          f"{min(restart_writes)}-{max(restart_writes)} writes (a clean sync: {total}), 0 writes to the "
          f"{len(UNTOUCHED)} untouched services")
    assert max(spread) <= 2 * total


def fresh(maps: Maps) -> ServicePrograms:
    """Empty service maps on the test's node, and the ServicePrograms of an agent's first start."""
    maps.reset()
    w.install_node(maps)
    program_node(maps, NODE, node_settings(NODE))
    return ServicePrograms(maps)


def test_a_kill_at_any_write_of_a_first_sync_in_groups_leaves_no_partial_service_and_the_restart_converges(
        maps, monkeypatch):
    """An agent's first sync (EbpfDatapath.sync: ServicePrograms.sync_names) writes its new service
    ports in groups (services.NewPorts: every map's entries of several ports in one batch),
    small ones here: killed after each of its writes, every frontend in the maps shows its whole
    new backend set, and a restart (adopt, then sync_names) converges exactly."""
    desired = state(2)
    names = set(desired.services)
    monkeypatch.setattr(services, "GROUP", 4)
    flushed: list[int] = []
    flush = services.NewPorts.flush
    monkeypatch.setattr(services.NewPorts, "flush", lambda group, out: flushed.append(len(group)) or flush(group, out))
    reference = fresh(maps)
    total, did_not_fit = reference.sync_names(desired, names)
    after = views_of(reference)
    assert not did_not_fit and held_views(maps) == after and len(after) > 20
    assert sum(flushed) == len(desired.services) and max(flushed) == 4, "every port new, written in groups of 4"
    monkeypatch.undo()
    for kill_at in range(total):
        monkeypatch.setattr(services, "GROUP", 4)
        programs = fresh(maps)
        log = WriteLog(monkeypatch, maps, limit=kill_at)
        with pytest.raises(Killed):
            programs.sync_names(desired, names)
        log.limit = None
        for fe, view in held_views(maps).items():
            assert view == after.get(fe), f"killed after {kill_at} writes: {fe} shows {view}, wants {after.get(fe)}"

        restarted = ServicePrograms(maps)
        adopt(restarted, desired)
        for fe, view in held_views(maps).items():
            assert view == after.get(fe), f"after adoption (kill at {kill_at}): {fe} shows {view}"
        restarted.sync_names(desired, names | set(restarted.current))
        assert held_views(maps) == after, f"killed after {kill_at} writes: the restart did not converge"
        assert restarted.sync_names(desired, names)[0] == 0
        wanted_slots = sum(len(e.cluster_slots) + len(e.local_slots) for e in restarted.current.values())
        assert maps.count("epx_slot") == wanted_slots, f"stray slots after a kill at {kill_at}"
        assert set(maps.backends()) == {b for e in restarted.current.values() for b in e.backends}
        monkeypatch.undo()
