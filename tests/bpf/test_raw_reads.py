"""Whole-map reads as raw batches (maps.raw_batches, and Maps' readers over it that adopt.read
uses at every restart and drift audit) hold exactly the entries the ctypes reader reads, batch
after batch, for either family, and fall back to a key walk where a map cannot batch.

The maps are private to the test (created unpinned by bench.cpscale.private_maps, freed when
closed): no compile, nothing attached, nothing pinned."""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket

import pytest

from ebpf_proxy.bench.cpscale import private_maps
from ebpf_proxy.datapath.ebpf import adopt, libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Maps, Maps6, Service, raw_batches

pytestmark = [pytest.mark.bpf, pytest.mark.root]

CLUSTER, LOCAL = s.LB4_SCOPE_CLUSTER, s.LB4_SCOPE_LOCAL


@pytest.fixture
def private():
    if os.geteuid() != 0:
        pytest.skip("BPF maps need root")
    maps = private_maps(400, 2)
    yield maps
    maps.close()


def addr(family: int, i: int) -> str:
    """The i-th address of `family`, in the text the readers give back (canonical)."""
    return str(ipaddress.IPv4Address(10 << 24 | i) if family == 4 else ipaddress.IPv6Address(0xFD00 << 112 | i))


def fill(maps: Maps, family: int) -> tuple[dict, list, dict]:
    """Services (nodePorts among them), slots (both banks and scopes, fields at their widest) and
    backends, written through the ordinary writers; returns them as the readers should give them."""
    services = {Frontend(addr(family, 0x60000 + i), 80 + i % 3, (socket.IPPROTO_TCP, socket.IPPROTO_UDP, 132)[i % 3]):
                Service(i + 1, i % 7, i % 3, i * 10, i * 0x01010101 & 0xFFFFFFFF) for i in range(250)}
    services.update({Frontend(None, 30000 + i): Service(i + 1, 1, 0, 0, s.LB4_F_EXTERNAL) for i in range(40)})
    services[Frontend(addr(family, 0xFFFFFF), 65535, 255)] = Service((1 << 32) - 1, 0xFFFF, 0xFFFF,
                                                                     (1 << 32) - 1, (1 << 32) - 1)
    maps.set_services(list(services.items()))
    slots = [(svc_id, svc_id % 2, CLUSTER if slot % 3 else LOCAL, slot, svc_id * 10 + slot)
             for svc_id in range(1, 150) for slot in range(4)]
    slots += [((1 << 32) - 1, 255, 255, 0xFFFF, (1 << 32) - 1), (1 << 31, 128, 1, 0x8001, 1 << 31), (0, 0, 0, 0, 0)]
    maps.set_slot_entries([(svc_id, scope, slot, bid, bank) for svc_id, bank, scope, slot, bid in slots])
    backends = {bid: Backend(addr(family, 0x400000 + bid), bid % 65536, bool(bid % 2), bool(bid % 3 == 0))
                for bid in range(1, 300)}
    backends[(1 << 32) - 1] = Backend(addr(family, 0xFFFFFF), 65535, True, True)
    maps.set_backends(list(backends.items()))
    return services, slots, backends


def family_maps(private: Maps, family: int) -> Maps:
    return private if family == 4 else Maps6(private)


@pytest.mark.parametrize("name", ["epx_svc", "epx_slot", "epx_backend", "epx_svc6", "epx_slot6", "epx_backend6"])
def test_raw_batches_hold_the_entries_the_ctypes_reader_reads(private, name):
    fill(family_maps(private, 6 if name.endswith("6") else 4), 6 if name.endswith("6") else 4)
    spec = s.MAPS[name]
    ksz, vsz = ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf)
    fd = private._fd(name)
    raw, batches = [], 0
    for keys, values, n in raw_batches(fd, name, chunk=7):
        assert 0 < n <= 7 and (len(keys), len(values)) == (n * ksz, n * vsz)
        raw += [(keys[i * ksz:(i + 1) * ksz], values[i * vsz:(i + 1) * vsz]) for i in range(n)]
        batches += 1
    decoded = [(bytes(k), bytes(v)) for k, v in libbpf.map_items_batched(fd, spec.key, spec.leaf)]
    assert batches > 20 and len(raw) == len(set(raw)) == len(decoded) > 150, "every entry once, over many batches"
    assert sorted(raw) == sorted(decoded)


@pytest.mark.parametrize("family", [4, 6])
def test_the_readers_and_the_read_back_give_what_was_written(private, family):
    maps = family_maps(private, family)
    services, slots, backends = fill(maps, family)
    assert dict(maps.services()) == services and len(list(maps.services())) == len(services)
    assert sorted(maps.slots()) == sorted(slots)
    assert {bid: maps.BACKEND_VALUES.record(raw) for bid, raw in maps.backend_rows()} == backends
    snap = adopt.read(maps)
    assert dict(snap.records.items()) == services and len(snap.records) == len(services)
    assert dict(snap.slots.items()) == {row[:4]: row[4] for row in slots}
    assert dict(snap.backends.items()) == backends
    assert (snap.max_svc_id, snap.max_backend_id) == ((1 << 32) - 1, (1 << 32) - 1)
    other = family_maps(private, 10 - family)  # the other family's maps are apart
    assert list(other.services()) == [] and list(other.slots()) == [] and list(other.backend_rows()) == []


def test_a_map_that_cannot_batch_is_walked(private, monkeypatch):
    """A map the kernel cannot read in batches (an LPM trie before Linux 6.x had no batched
    lookup): its raw batches are a key walk's entries, one each, the ones a batched read gives."""
    for i in range(20):
        private.add_source_range(i + 1, f"192.168.{i}.0/24")
    fd, name = private._fd("epx_src_range"), "epx_src_range"
    batched = sorted((k, v) for k, v, _ in raw_batches(fd, name, chunk=1))

    def cannot_batch(fd, key_type, value_type, chunk=4096):
        raise OSError(524, "ENOTSUPP")  # the kernel's answer for a map type without batched ops
        yield  # a generator, as libbpf.map_batches: the error comes with the first batch

    monkeypatch.setattr(libbpf, "map_batches", cannot_batch)
    walked = list(raw_batches(fd, name))
    assert [n for _, _, n in walked] == [1] * 20
    assert sorted((k, v) for k, v, _ in walked) == batched
    assert sorted(k for k, _, _ in walked) == sorted(bytes(k) for k in private.keys(name))
    assert {v for _, v, _ in walked} == {bytes(s.u32(1))}


@pytest.mark.parametrize("family", [4, 6])
def test_a_kernel_that_cannot_batch_reads_the_same_by_key_walk(private, family, monkeypatch):
    maps = family_maps(private, family)
    fill(maps, family)
    batched = adopt.read(maps)
    walked_batches = []

    def cannot_batch(fd, key_type, value_type, chunk=4096):
        walked_batches.append(fd)
        raise OSError(errno.EINVAL, "no batched lookup")
        yield  # a generator, as libbpf.map_batches: the error comes with the first batch

    monkeypatch.setattr(libbpf, "map_batches", cannot_batch)
    walked = adopt.read(maps)
    assert len(walked_batches) >= 3, "services, slots and backends each tried a batch first"
    assert list(walked.records.items()) == list(batched.records.items()) and len(walked.records) > 250
    assert list(walked.slots.items()) == list(batched.slots.items())
    assert list(walked.backends.items()) == list(batched.backends.items())


def test_another_error_is_raised_not_walked(private, monkeypatch):
    def denied(fd, key_type, value_type, chunk=4096):
        raise OSError(errno.EPERM, "denied")
        yield

    monkeypatch.setattr(libbpf, "map_batches", denied)
    with pytest.raises(OSError) as caught:
        list(private.raw_entries("epx_slot"))
    assert caught.value.errno == errno.EPERM
