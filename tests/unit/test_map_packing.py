"""The packed entries batched writes send (maps.pack_*) are byte for byte what the ctypes mirrors
of structs.py hold for the same values, so a batch writes exactly what single writes would."""

from __future__ import annotations

import socket

import pytest

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import (
    Backend,
    Frontend,
    Service,
    _frontend_key,
    be16,
    be32,
    pack_backend,
    pack_frontend,
    pack_service,
    pack_slot_key,
    pack_u32,
)


@pytest.mark.parametrize("fe", [Frontend("10.96.0.10", 80), Frontend(None, 30080, socket.IPPROTO_UDP),
                                Frontend("255.255.255.254", 65535, socket.IPPROTO_TCP)])
def test_a_packed_frontend_is_the_lb4_key(fe):
    assert pack_frontend(fe) == bytes(_frontend_key(fe))


def test_a_packed_service_is_the_lb4_service():
    svc = Service(id=123456, count=10, local_count=3, affinity_timeout=10800,
                  flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_SLOT_BANK)
    mirror = s.LB4Service(id=svc.id, count=svc.count, local_count=svc.local_count,
                          affinity_timeout=svc.affinity_timeout, flags=svc.flags)
    assert pack_service(svc) == bytes(mirror)


@pytest.mark.parametrize("in_cluster, in_local", [(True, False), (False, True), (True, True), (False, False)])
def test_a_packed_backend_is_the_lb4_backend(in_cluster, in_local):
    be = Backend("100.64.1.2", 8080, in_cluster=in_cluster, in_local=in_local)
    flags = (s.LB4_BE_IN_CLUSTER if in_cluster else 0) | (s.LB4_BE_IN_LOCAL if in_local else 0)
    assert pack_backend(be) == bytes(s.LB4Backend(addr=be32(be.addr), port=be16(be.port), flags=flags))


def test_a_packed_slot_key_and_u32_are_their_mirrors():
    key = s.LB4SlotKey(svc_id=70000, slot=513, scope=s.LB4_SCOPE_LOCAL, bank=1)
    assert pack_slot_key(70000, s.LB4_SCOPE_LOCAL, 513, bank=1) == bytes(key)
    assert pack_u32(4_000_000_000) == bytes(s.u32(4_000_000_000))


def test_backends_hand_their_bytes_over_as_the_batch_of_epx_backend_entries():
    from ebpf_proxy.datapath.ebpf.maps import Backend, Backends, MapEntries, _U32, pack_backend

    backends = {7: Backend("10.0.0.1", 8080, True, False), 3: Backend("10.0.0.2", 53, False, True)}
    packed = Backends.pack(backends)
    entries = packed.map_entries()
    want = [(_U32.pack(bid), pack_backend(be)) for bid, be in backends.items()]
    assert isinstance(entries, MapEntries) and len(entries) == 2
    assert list(entries) == want and entries == want and entries[1] == want[1] and entries[-1] == want[-1]
    assert entries.keys == b"".join(k for k, _ in want) and entries.values == b"".join(v for _, v in want)
    assert dict(packed.items()) == backends and list(packed) == [7, 3] and 3 in packed and 4 not in packed
    assert Backends.of([(7, "10.0.0.1", 8080, True, False), (3, "10.0.0.2", 53, False, True)]) == packed
    assert type(Backends.of([(1, "10.1", 80, True, False)])) is dict, "not canonical: kept as records"


@pytest.mark.parametrize("n", [0, 1, 10, 64, 65, 300])
def test_a_slot_array_s_keys_are_the_lb4_slot_keys_back_to_back(n):
    from ebpf_proxy.datapath.ebpf.maps import slot_array_keys

    for scope in (s.LB4_SCOPE_CLUSTER, s.LB4_SCOPE_LOCAL):
        for bank in (0, 1):
            for svc_id in (1, 70000, (1 << 32) - 1):
                want = b"".join(bytes(s.LB4SlotKey(svc_id=svc_id, slot=slot, scope=scope, bank=bank))
                                for slot in range(n))
                assert slot_array_keys(svc_id, scope, bank, n) == want
                assert slot_array_keys(svc_id, scope, bank, n) == b"".join(
                    pack_slot_key(svc_id, scope, slot, bank) for slot in range(n))


def test_a_service_packed_from_its_fields_is_the_lb4_service():
    from ebpf_proxy.datapath.ebpf.maps import pack_service_fields

    mirror = s.LB4Service(id=(1 << 32) - 2, count=65535, local_count=3, affinity_timeout=10800,
                          flags=s.LB4_F_HAS_ENDPOINTS | s.LB4_F_SLOT_BANK)
    flags = s.LB4_F_HAS_ENDPOINTS | s.LB4_F_SLOT_BANK
    assert pack_service_fields((1 << 32) - 2, 65535, 3, 10800, flags) == bytes(mirror)


@pytest.mark.parametrize("fe", [Frontend("10.96.0.10", 80), Frontend(None, 30080, socket.IPPROTO_UDP)])
def test_the_family_s_frontend_key_and_backend_entry_are_their_mirrors_ipv4(fe):
    from ebpf_proxy.datapath.ebpf.maps import Maps

    assert Maps.frontend_key(fe) == bytes(_frontend_key(fe))
    be = Backend("100.64.1.2", 8080, in_cluster=False, in_local=True)
    assert Maps.backend_entry(70000, be) == (bytes(s.u32(70000)), bytes(s.LB4Backend(
        addr=be32(be.addr), port=be16(be.port), flags=s.LB4_BE_IN_LOCAL)))


@pytest.mark.parametrize("fe", [Frontend("fd00:96::a", 80), Frontend(None, 30080, socket.IPPROTO_UDP),
                                Frontend("2001:db8::ffff:1", 65535, 132)])
@pytest.mark.parametrize("in_cluster, in_local", [(True, False), (False, True), (True, True)])
def test_the_family_s_frontend_key_and_backend_entry_are_their_mirrors_ipv6(fe, in_cluster, in_local):
    from ebpf_proxy.datapath.ebpf.maps import Maps6, _frontend_key6, in6

    assert Maps6.frontend_key(fe) == bytes(_frontend_key6(fe))
    be = Backend("fd00:64::1:2", 8080, in_cluster=in_cluster, in_local=in_local)
    flags = (s.LB4_BE_IN_CLUSTER if in_cluster else 0) | (s.LB4_BE_IN_LOCAL if in_local else 0)
    assert Maps6.backend_entry(9, be) == (bytes(s.u32(9)), bytes(s.LB6Backend(
        addr=in6(be.addr), port=be16(be.port), flags=flags)))


def test_backends_packed_from_address_bytes_are_the_lb4_backends():
    from ebpf_proxy.datapath.ebpf.maps import Backends

    addrs, ports = ["100.64.1.2", "10.0.0.255", "255.255.255.255"], [8080, 1, 65535]
    for in_cluster, in_local in (([True] * 3, [False] * 3), ([True, False, True], [False, True, True])):
        packed = Backends.of_v4([7, 1 << 31, 3], b"".join(map(socket.inet_aton, addrs)), ports, in_cluster, in_local)
        mirrors = [s.LB4Backend(addr=be32(a), port=be16(p), flags=(s.LB4_BE_IN_CLUSTER if c else 0)
                                | (s.LB4_BE_IN_LOCAL if loc else 0))
                   for a, p, c, loc in zip(addrs, ports, in_cluster, in_local)]
        assert packed._packed == b"".join(bytes(s.u32(i)) for i in (7, 1 << 31, 3)) + b"".join(map(bytes, mirrors))
