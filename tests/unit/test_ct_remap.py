"""Port-remapped connections (CT4_S_REMAP) on the Python side: a client using one source port for two
connections through two frontends that pick one backend; the second leaves with another port, as
netfilter's NAT remaps a clashing tuple (bpf/lib/ct4.h). Its reply half is keyed by that wire port
and keeps the client's own port. Here, without root or BPF: the conntrack GC's liveness test
(maps._owner_tuple/_half_is_live and ctscan's identities, which must agree), and the mode switch's
moves (ebpf/handover.py) with a dict for epx_ct4. The programs' side is tests/bpf's."""

from __future__ import annotations

import socket
from dataclasses import replace
from types import SimpleNamespace

import pytest

from ebpf_proxy.datapath.ebpf import ctscan, handover
from ebpf_proxy.datapath.ebpf import maps as mp
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.datapath import EbpfDatapath
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, NodeSettings, be16, be32, ct_key
from ebpf_proxy.datapath.kernel_nat import NatConnection
from ebpf_proxy.model import NodeConfig

NOW = 10**12
TCP = socket.IPPROTO_TCP
CLIENT, VIP_A, VIP_B, BACKEND, MASQ_ADDR = "10.244.1.5", "10.96.0.10", "10.96.0.11", "10.244.2.7", "192.168.1.10"
PORT, WIRE, OTHER_WIRE = 40000, 61005, 61006


# ---- the GC's liveness test ----


def _table_addr(table, addr: str):
    if table is mp._CT4:
        return be32(addr)
    return s.In6.from_buffer_copy(bytes(12) + socket.inet_aton(addr))  # ::a.b.c.d: any IPv6 address will do


def _owner(table, frontend: str, remap_to: int | None, backend: str = BACKEND):
    """The CT4_SVC entry of CLIENT:PORT -> frontend:80 -> backend:8080, remapped to `remap_to`."""
    a = lambda addr: _table_addr(table, addr)  # noqa: E731
    k = table.key(saddr=a(CLIENT), daddr=a(frontend), sport=be16(PORT), dport=be16(80), proto=TCP, kind=s.CT4_SVC)
    v = table.entry(expires=NOW + 1, nat_addr=a(backend), nat_port=be16(8080), svc_addr=a(frontend),
                    svc_port=be16(80), backend_id=1)
    if remap_to is not None:
        v.state, v.snat_addr, v.snat_port = s.CT4_S_REMAP, a(CLIENT), be16(remap_to)
    return k, v


def _rev_dnat(table, frontend: str, wire: int, remapped: bool):
    """A CT4_REV_DNAT half backend:8080 -> CLIENT:wire answering through `frontend`."""
    a = lambda addr: _table_addr(table, addr)  # noqa: E731
    k = table.key(saddr=a(BACKEND), daddr=a(CLIENT), sport=be16(8080), dport=be16(wire), proto=TCP,
                  kind=s.CT4_REV_DNAT)
    v = table.entry(nat_addr=a(frontend), nat_port=be16(80), svc_addr=a(frontend), svc_port=be16(80))
    if remapped:
        v.state, v.snat_port = s.CT4_S_REMAP, be16(PORT)
    return k, v


def _judge(table, owners, half) -> bool:
    """Whether `half` is live for the decoded check, asserting ctscan's raw check agrees."""
    flat = table.flat
    by_key = {}
    for k, v in owners:
        fk = flat(k)
        by_key[(fk.saddr, fk.daddr, fk.sport, fk.dport, fk.proto)] = v
    hk, hv = half
    owner = by_key.get(mp._owner_tuple(flat(hk), flat(hv)))
    decoded = mp._half_is_live(flat(hk), flat(hv), flat(owner) if owner is not None else None, NOW)
    layout = ctscan.Layout(table.key, table.entry)
    live = ctscan.Hashes()
    for k, v in owners:
        for identity in layout.owner_identities(bytes(k), bytes(v)):
            live.add(identity)
    live.seal()
    assert (layout.half_identity(bytes(hk), bytes(hv)) in live) == decoded, "ctscan and maps disagree"
    return decoded


TABLES = pytest.mark.parametrize("table", [mp._CT4, mp._CT6], ids=["epx_ct4", "epx_ct6"])


@TABLES
def test_a_remapped_connections_reply_half_is_live_at_its_wire_port(table):
    owners = [_owner(table, VIP_A, None), _owner(table, VIP_B, WIRE)]
    assert _judge(table, owners, _rev_dnat(table, VIP_B, WIRE, remapped=True))
    assert _judge(table, owners, _rev_dnat(table, VIP_A, PORT, remapped=False)), "the first connection keeps its half"


@TABLES
def test_a_half_at_the_client_port_is_stale_once_its_connection_is_remapped(table):
    """The connection through VIP_B was re-created remapped: its old half at the client's own
    port is no longer its own (it would take the replies of the one through VIP_A)."""
    owners = [_owner(table, VIP_B, WIRE)]
    assert not _judge(table, owners, _rev_dnat(table, VIP_B, PORT, remapped=False))


@TABLES
def test_a_remapped_half_is_stale_once_its_connection_is_not_remapped(table):
    owners = [_owner(table, VIP_B, None)]
    assert not _judge(table, owners, _rev_dnat(table, VIP_B, WIRE, remapped=True))
    assert _judge(table, owners, _rev_dnat(table, VIP_B, PORT, remapped=False))


@TABLES
def test_a_remapped_half_is_stale_once_its_connection_left_with_another_port_or_backend(table):
    half = _rev_dnat(table, VIP_B, WIRE, remapped=True)
    assert not _judge(table, [_owner(table, VIP_B, OTHER_WIRE)], half)
    assert not _judge(table, [_owner(table, VIP_B, WIRE, backend="10.244.2.8")], half)
    assert not _judge(table, [_owner(table, VIP_A, WIRE)], half), "another frontend's connection does not own it"


@TABLES
def test_a_remapped_half_of_an_expired_connection_is_stale(table):
    k, v = _owner(table, VIP_B, WIRE)
    v.expires = NOW
    flat = table.flat
    hk, hv = _rev_dnat(table, VIP_B, WIRE, remapped=True)
    assert not mp._half_is_live(flat(hk), flat(hv), flat(v), NOW)


# ---- the mode switch ----


class FakeMaps:
    """epx_ct4 as a dict, with the few Maps methods ebpf/handover.py calls."""

    def __init__(self, frontends=((VIP_A, 80), (VIP_B, 80))) -> None:
        self.ct: dict[bytes, tuple[s.CT4Key, s.CT4Entry]] = {}
        self.frontends = {Frontend(addr, port, TCP) for addr, port in frontends}

    def put_connection_entry(self, key, entry) -> None:
        self.ct[bytes(key)] = (s.CT4Key.from_buffer_copy(key), s.CT4Entry.from_buffer_copy(entry))

    def connection_entry(self, key):
        found = self.ct.get(bytes(key))
        return s.CT4Entry.from_buffer_copy(found[1]) if found else None

    def delete_connection_entry(self, key) -> bool:
        return self.ct.pop(bytes(key), None) is not None

    def connections(self, kind=None):
        return [mp._connection(k, v) for k, v in self.ct.values() if kind is None or k.kind == kind]

    def service(self, fe):
        return object() if fe in self.frontends else None

    def backends(self):
        return {1: Backend(BACKEND, 8080)}

    def entry(self, saddr, daddr, sport, dport, kind):
        return self.connection_entry(ct_key(saddr, daddr, sport, dport, TCP, kind))

    def kinds(self) -> list[int]:
        return sorted(k.kind for k, _ in self.ct.values())


PLAIN = NatConnection(TCP, CLIENT, PORT, VIP_A, 80, BACKEND, 8080, CLIENT, PORT, 300)
REMAPPED = replace(PLAIN, frontend=VIP_B, source_port=WIRE)  # netfilter gave the second one another port
MASQUERADED = replace(PLAIN, client="203.0.113.5", source=MASQ_ADDR, source_port=61001)


def test_a_port_remap_is_neither_a_masquerade_nor_untranslated():
    assert REMAPPED.port_remapped and not REMAPPED.masqueraded and REMAPPED.source_translated
    assert MASQUERADED.masqueraded and not MASQUERADED.port_remapped and MASQUERADED.source_translated
    assert not (PLAIN.masqueraded or PLAIN.port_remapped or PLAIN.source_translated)
    assert REMAPPED.describe().endswith(f"as {CLIENT}:{WIRE}")


def test_a_connection_netfilter_port_remapped_is_adopted_as_remapped_not_masqueraded():
    maps = FakeMaps()
    backends = handover.backend_ids(maps)
    assert handover.adopt(maps, PLAIN, backends, set(), NOW) is None
    assert handover.adopt(maps, REMAPPED, backends, set(), NOW) is None
    svc = maps.entry(CLIENT, VIP_B, PORT, 80, s.CT4_SVC)
    assert svc.state & s.CT4_S_REMAP and not svc.flags & s.CT4_F_MASQ
    assert (svc.snat_addr, svc.snat_port) == (be32(CLIENT), be16(WIRE))
    half = maps.entry(BACKEND, CLIENT, 8080, WIRE, s.CT4_REV_DNAT)
    assert half is not None and half.state == s.CT4_S_REMAP and half.snat_port == be16(PORT)
    assert (half.nat_addr, half.nat_port, half.svc_addr, half.svc_port) == (be32(VIP_B), be16(80), be32(VIP_B), be16(80))
    first = maps.entry(BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT)
    assert first is not None and first.nat_addr == be32(VIP_A) and not first.state, "the first one's half is untouched"
    assert maps.kinds() == [s.CT4_SVC, s.CT4_SVC, s.CT4_REV_DNAT, s.CT4_REV_DNAT], "no SNAT halves"
    # what was written is what the GC keeps
    svc_key = ct_key(CLIENT, VIP_B, PORT, 80, TCP, s.CT4_SVC)
    half_key = ct_key(BACKEND, CLIENT, 8080, WIRE, TCP, s.CT4_REV_DNAT)
    assert mp._owner_tuple(half_key, half) == (svc_key.saddr, svc_key.daddr, svc_key.sport, svc_key.dport, TCP)
    assert mp._half_is_live(half_key, half, svc, NOW)


def test_a_masquerade_is_still_adopted_with_its_snat_halves():
    maps = FakeMaps()
    assert handover.adopt(maps, MASQUERADED, handover.backend_ids(maps), set(), NOW) is None
    svc = maps.entry(MASQUERADED.client, VIP_A, PORT, 80, s.CT4_SVC)
    assert svc.flags & s.CT4_F_MASQ and not svc.state & s.CT4_S_REMAP
    assert maps.kinds() == [s.CT4_SVC, s.CT4_REV_DNAT, s.CT4_SNAT, s.CT4_REV_SNAT]
    assert maps.entry(BACKEND, MASQUERADED.client, 8080, PORT, s.CT4_REV_DNAT) is not None


def test_a_remapped_connection_goes_to_the_kernel_with_the_source_the_backend_sees():
    maps = FakeMaps()
    for conn in (PLAIN, REMAPPED):
        handover.adopt(maps, conn, handover.backend_ids(maps), set(), NOW - 10**9)
    out = sorted(handover.outgoing(maps, NOW), key=lambda c: c.frontend)
    assert [(c.frontend, c.source, c.source_port) for c in out] == [(VIP_A, CLIENT, PORT), (VIP_B, CLIENT, WIRE)], \
        "two tuples at the backend: both are handed over"
    assert out[1].port_remapped and not out[1].masqueraded
    assert replace(out[1], timeout=REMAPPED.timeout) == REMAPPED


def test_forgetting_a_remapped_connection_deletes_its_half_at_the_wire_port_only():
    maps = FakeMaps()
    for conn in (PLAIN, REMAPPED):
        handover.adopt(maps, conn, handover.backend_ids(maps), set(), NOW)
    handover.forget(maps, REMAPPED)
    assert maps.kinds() == [s.CT4_SVC, s.CT4_REV_DNAT]
    assert maps.entry(CLIENT, VIP_A, PORT, 80, s.CT4_SVC) is not None
    assert maps.entry(BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT) is not None, "the other connection's half stays"
    handover.forget(maps, PLAIN)
    assert maps.ct == {}


def test_a_port_remapped_kernel_connection_is_adopted_not_left_as_another_masquerade(monkeypatch):
    """datapath.adopt_connections leaves a masquerade to another address to the kernel; a
    remap keeps the client's address, so it is not one."""
    maps = FakeMaps()
    node = NodeConfig(node_name="n1", node_ips=("192.168.1.10",))
    dp = object.__new__(EbpfDatapath)
    dp.family, dp.node, dp._maps = 4, node, maps
    dp._shared = SimpleNamespace(settings=NodeSettings(snat_addr="192.168.1.10"),
                                 update_settings=lambda **kw: pytest.fail(f"settings changed: {kw}"))
    monkeypatch.setattr(handover, "hold", lambda maps, conn, held=True: True)
    adopted = []
    counts = dp.adopt_connections([REMAPPED], adopted.append)
    assert counts["adopted"] == 1 and counts["other_masquerade_address"] == 0 and adopted == [REMAPPED]


def _put_masqueraded_remap(maps: FakeMaps, masq_port: int) -> None:
    """A connection of CLIENT:PORT through VIP_B, masqueraded, whose client port clashed toward
    BACKEND: its entries as ct4_create writes them, every client-side half keyed by the
    masquerade port it leaves with (bpf/lib/ct4.h, CT4_S_REMAP)."""
    def entry(**kw) -> s.CT4Entry:
        e = s.CT4Entry(svc_addr=be32(VIP_B), svc_port=be16(80), state=s.CT4_S_REMAP)
        for name, value in kw.items():
            setattr(e, name, value)
        return e

    maps.put_connection_entry(ct_key(BACKEND, MASQ_ADDR, 8080, masq_port, TCP, s.CT4_REV_SNAT),
                              entry(nat_addr=be32(CLIENT), nat_port=be16(PORT)))
    maps.put_connection_entry(ct_key(CLIENT, BACKEND, masq_port, 8080, TCP, s.CT4_SNAT),
                              entry(nat_addr=be32(MASQ_ADDR), nat_port=be16(masq_port), snat_port=be16(PORT)))
    maps.put_connection_entry(ct_key(BACKEND, CLIENT, 8080, masq_port, TCP, s.CT4_REV_DNAT),
                              entry(nat_addr=be32(VIP_B), nat_port=be16(80), snat_port=be16(PORT)))
    maps.put_connection_entry(ct_key(CLIENT, VIP_B, PORT, 80, TCP, s.CT4_SVC),
                              entry(expires=NOW * 2, nat_addr=be32(BACKEND), nat_port=be16(8080), backend_id=1,
                                    snat_addr=be32(MASQ_ADDR), snat_port=be16(masq_port), flags=s.CT4_F_MASQ))


def test_a_masqueraded_remapped_connection_hands_over_and_is_forgotten_by_its_own_halves():
    """Two masqueraded connections of one client port to one backend: the second's halves are
    keyed by its masquerade port (CT4_S_REMAP). The kernel gets it from its masquerade address and
    port, and forgetting it leaves the first connection's halves at the client's own port."""
    maps = FakeMaps()
    first = replace(PLAIN, source=MASQ_ADDR, source_port=61001)
    handover.adopt(maps, first, handover.backend_ids(maps), set(), NOW)
    _put_masqueraded_remap(maps, 61002)
    going = {c.frontend: c for c in handover.outgoing(maps, NOW)}
    assert (going[VIP_B].source, going[VIP_B].source_port) == (MASQ_ADDR, 61002)
    for k, v in maps.ct.values():  # the GC's view: every half of both is live
        owner = maps.connection_entry(mp._svc_key(mp._owner_tuple(k, v))) if k.kind != s.CT4_SVC else None
        assert k.kind == s.CT4_SVC or mp._half_is_live(k, v, owner, NOW), (k.kind, k.sport, k.dport)
    handover.forget(maps, going[VIP_B])
    assert maps.kinds() == [s.CT4_SVC, s.CT4_REV_DNAT, s.CT4_SNAT, s.CT4_REV_SNAT]
    assert maps.entry(CLIENT, BACKEND, PORT, 8080, s.CT4_SNAT) is not None, "the first connection's SNAT half stays"
    assert maps.entry(BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT) is not None
    handover.forget(maps, going[VIP_A])
    assert maps.ct == {}


@pytest.mark.parametrize("order", ["unmasqueraded-first", "masqueraded-first"])
def test_a_kernel_masquerade_sharing_a_client_port_is_adopted_as_remapped_in_either_order(monkeypatch, order):
    """netfilter keeps C:p -> VIP_A -> B unmasqueraded beside C:p -> VIP_B -> B masqueraded (their
    reply tuples differ). adopt_connections takes the unmasqueraded first (the backend knows it by
    the client's own port) and the masqueraded one gives way: keyed by its masquerade port
    (CT4_S_REMAP), every half of both live, none overwritten."""
    maps = FakeMaps()
    node = NodeConfig(node_name="n1", node_ips=(MASQ_ADDR,))
    dp = object.__new__(EbpfDatapath)
    dp.family, dp.node, dp._maps = 4, node, maps
    dp._shared = SimpleNamespace(settings=NodeSettings(snat_addr=MASQ_ADDR),
                                 update_settings=lambda **kw: pytest.fail(f"settings changed: {kw}"))
    monkeypatch.setattr(handover, "hold", lambda maps, conn, held=True: True)
    masq = replace(PLAIN, frontend=VIP_B, source=MASQ_ADDR, source_port=61002)
    conns = [PLAIN, masq] if order == "unmasqueraded-first" else [masq, PLAIN]
    assert dp.adopt_connections(conns, lambda conn: None)["adopted"] == 2
    svc = maps.entry(CLIENT, VIP_B, PORT, 80, s.CT4_SVC)
    assert svc.state & s.CT4_S_REMAP and svc.flags & s.CT4_F_MASQ
    assert maps.entry(CLIENT, BACKEND, 61002, 8080, s.CT4_SNAT) is not None
    assert maps.entry(CLIENT, BACKEND, PORT, 8080, s.CT4_SNAT) is None
    rev = maps.entry(BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT)
    assert (rev.svc_addr, rev.state) == (be32(VIP_A), 0), "the unmasqueraded one keeps the client's port"
    for k, v in maps.ct.values():
        if k.kind != s.CT4_SVC:
            assert mp.half_is_held(maps, k, NOW), (k.kind, k.sport, k.dport)


def test_a_kernel_connection_whose_tuple_another_holds_is_left_to_the_kernel():
    """Adopting never overwrites a live connection's half: one whose client port toward the
    backend is held already, without a masquerade to step aside with, is refused with a reason."""
    maps = FakeMaps()
    handover.adopt(maps, PLAIN, handover.backend_ids(maps), set(), NOW)
    other = replace(PLAIN, frontend=VIP_B)
    why = handover.adopt(maps, other, handover.backend_ids(maps), set(), NOW)
    assert why is not None and f"{BACKEND}:8080" in why and str(PORT) in why
    assert maps.entry(CLIENT, VIP_B, PORT, 80, s.CT4_SVC) is None
    assert maps.entry(BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT).svc_addr == be32(VIP_A)


def test_forgetting_a_connection_whose_entry_is_gone_leaves_its_partners_halves():
    """A masqueraded remapped connection whose CT4_SVC entry expired before the handover forgot it:
    only halves it owns are deleted, not those its partner holds at the client's own port."""
    maps = FakeMaps()
    first = replace(PLAIN, source=MASQ_ADDR, source_port=61001)
    handover.adopt(maps, first, handover.backend_ids(maps), set(), NOW)
    _put_masqueraded_remap(maps, 61002)
    gone = replace(PLAIN, frontend=VIP_B, source=MASQ_ADDR, source_port=61002)
    maps.delete_connection_entry(ct_key(CLIENT, VIP_B, PORT, 80, TCP, s.CT4_SVC))
    handover.forget(maps, gone)
    assert maps.kinds() == [s.CT4_SVC, s.CT4_REV_DNAT, s.CT4_SNAT, s.CT4_REV_SNAT]
    assert all(maps.entry(*t) is not None for t in (
        (CLIENT, BACKEND, PORT, 8080, s.CT4_SNAT), (BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT)))


def test_a_masquerade_adopted_first_steps_aside_for_an_unmasqueraded_connection_of_its_client_port():
    """The mode switch adopts a connection still in its handshake in a later batch: the
    masqueraded one of the same client port may be ours already, at the client's own port. It
    moves to its masquerade port (CT4_S_REMAP, as ct4_create lays it out) so that the
    unmasqueraded one, which the backend knows by the client's port, gets that port's halves."""
    maps = FakeMaps()
    masq = replace(PLAIN, frontend=VIP_B, source=MASQ_ADDR, source_port=61002)
    assert handover.adopt(maps, masq, handover.backend_ids(maps), set(), NOW) is None
    assert maps.entry(CLIENT, BACKEND, PORT, 8080, s.CT4_SNAT) is not None  # plain: nothing clashed yet
    assert handover.adopt(maps, PLAIN, handover.backend_ids(maps), set(), NOW) is None
    svc = maps.entry(CLIENT, VIP_B, PORT, 80, s.CT4_SVC)
    assert svc.state & s.CT4_S_REMAP and svc.flags & s.CT4_F_MASQ
    assert maps.entry(CLIENT, BACKEND, PORT, 8080, s.CT4_SNAT) is None
    assert maps.entry(CLIENT, BACKEND, 61002, 8080, s.CT4_SNAT).snat_port == be16(PORT)
    moved = maps.entry(BACKEND, CLIENT, 8080, 61002, s.CT4_REV_DNAT)
    assert moved.svc_addr == be32(VIP_B) and moved.snat_port == be16(PORT)
    assert maps.entry(BACKEND, CLIENT, 8080, PORT, s.CT4_REV_DNAT).svc_addr == be32(VIP_A)
    assert maps.entry(BACKEND, MASQ_ADDR, 8080, 61002, s.CT4_REV_SNAT).state & s.CT4_S_REMAP
    for k, v in maps.ct.values():
        if k.kind != s.CT4_SVC:
            assert mp.half_is_held(maps, k, NOW), (k.kind, k.sport, k.dport)


def test_a_masquerade_whose_port_another_connection_holds_is_left_to_the_kernel():
    """Adopting never overwrites a live half, the masquerade port's reply half included (a
    connection the programs made during the switch may hold it)."""
    maps = FakeMaps()
    first = replace(PLAIN, source=MASQ_ADDR, source_port=61001)
    assert handover.adopt(maps, first, handover.backend_ids(maps), set(), NOW) is None
    other_client = replace(PLAIN, client="10.244.1.6", frontend=VIP_B, source=MASQ_ADDR, source_port=61001)
    why = handover.adopt(maps, other_client, handover.backend_ids(maps), set(), NOW)
    assert why is not None and "61001" in why
    assert maps.entry(BACKEND, MASQ_ADDR, 8080, 61001, s.CT4_REV_SNAT).nat_addr == be32(CLIENT)
