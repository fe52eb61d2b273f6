"""The conntrack GC over a full epx_ct4 (262,144 entries, the default size): right answers, and
no Python object per entry (issue 12: decoding every entry cost ~100 MiB at the peak of a pass,
every 10 s; holding the batches' bytes until the halves were judged, ~17; judging each batch as
it is read, with only hashes kept between the pass's two reads, ctscan.py, ~0.1).

Only the connection table matters here, so the test creates it alone (a kernel hash of the real
key and entry sizes and flags, not pinned, closed at the end) rather than loading the programs
with another table size (a build of its own). Every other map's fd is -1: the GC touching one
fails loudly.
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.loader import MAX_ENTRIES
from ebpf_proxy.datapath.ebpf.maps import Maps, be16, be32

pytestmark = [pytest.mark.bpf, pytest.mark.root]

BPF_MAP_TYPE_HASH, BPF_F_NO_PREALLOC = 1, 1  # bpf/maps.c: epx_ct4 is a plain hash, not preallocated
CAPACITY = MAX_ENTRIES["epx_ct4"]
VIP, MASQ = be32("10.96.0.10"), be32("172.20.20.15")
# how far a pass may raise the process's peak RSS: ~0.1 MiB here; the halves' bytes held took
# ~17, an object per entry ~107
PEAK_LIMIT_MIB = 4


def _rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, in MiB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _fill(fd: int, now_ns: int) -> tuple[int, int, int]:
    """CAPACITY entries: connections of 2 entries, every 4th masqueraded (4 entries), every 8th
    expired. Returns (connections, expired ones, entries)."""
    keys, values = bytearray(), bytearray()
    connections = expired = entries = i = 0
    while True:
        masq = i % 4 == 0
        if entries + (4 if masq else 2) > CAPACITY:
            break
        # distinct (client, port) per connection, and masquerade ports per masqueraded one
        client, cport = be32(f"10.244.{i >> 14 & 0xff}.{i >> 6 & 0xff}"), be16(1024 + (i & 0x3f))
        backend, bport, snat_port = be32(f"10.245.0.{i % 200 + 1}"), be16(8080), be16(1024 + (i >> 2))
        gone = i % 8 == 1
        rows = [(s.CT4Key(saddr=client, daddr=VIP, sport=cport, dport=be16(80), proto=6, kind=s.CT4_SVC),
                 s.CT4Entry(expires=1 if gone else now_ns + 3600 * 10**9, nat_addr=backend, nat_port=bport,
                            svc_addr=VIP, svc_port=be16(80), backend_id=1, snat_addr=MASQ if masq else 0,
                            snat_port=snat_port if masq else 0, flags=s.CT4_F_MASQ if masq else 0)),
                (s.CT4Key(saddr=backend, daddr=client, sport=bport, dport=cport, proto=6, kind=s.CT4_REV_DNAT),
                 s.CT4Entry(svc_addr=VIP, svc_port=be16(80)))]
        if masq:
            rows += [(s.CT4Key(saddr=client, daddr=backend, sport=cport, dport=bport, proto=6, kind=s.CT4_SNAT),
                      s.CT4Entry(svc_addr=VIP, svc_port=be16(80), nat_port=snat_port)),
                     (s.CT4Key(saddr=backend, daddr=MASQ, sport=bport, dport=snat_port, proto=6, kind=s.CT4_REV_SNAT),
                      s.CT4Entry(nat_addr=client, nat_port=cport, svc_addr=VIP, svc_port=be16(80)))]
        for k, v in rows:
            keys += bytes(k)
            values += bytes(v)
        connections, expired, entries, i = connections + 1, expired + gone, entries + len(rows), i + 1
    libbpf.map_update_batch(fd, bytes(keys), bytes(values), entries)
    return connections, expired, entries


@pytest.fixture
def full_table():
    fd = libbpf.map_create(BPF_MAP_TYPE_HASH, "epx_ct4", ctypes.sizeof(s.CT4Key), ctypes.sizeof(s.CT4Entry),
                           CAPACITY, BPF_F_NO_PREALLOC)
    try:
        yield Maps({**{name: -1 for name in s.MAPS}, "epx_ct4": fd}), fd
    finally:
        os.close(fd)


def test_a_pass_over_a_full_table_collects_what_expired_and_keeps_no_object_per_entry(full_table):
    maps, fd = full_table
    connections, expired, entries = _fill(fd, time.monotonic_ns())
    assert entries > 0.95 * CAPACITY, "the table is full enough to be pressed"
    expired_halves = sum(3 if i % 4 == 0 else 1 for i in range(connections) if i % 8 == 1)

    _reset_peak_rss()
    before, _ = _rss_mib()
    first = maps.collect_connections(time.monotonic_ns())
    _, peak = _rss_mib()
    print(f"\nGC pass over {entries} entries: peak RSS {before:.1f} -> {peak:.1f} MiB")
    assert (first.collected, first.entries, first.connections) == (expired, entries - expired, connections - expired)
    assert peak - before < PEAK_LIMIT_MIB, f"a pass raised the peak RSS by {peak - before:.1f} MiB"

    # the expired connections' halves were orphaned by the first pass: the second collects them
    _reset_peak_rss()
    before, _ = _rss_mib()
    second = maps.collect_connections(time.monotonic_ns())
    _, peak = _rss_mib()
    print(f"GC pass collecting {second.collected} orphaned halves: peak RSS {before:.1f} -> {peak:.1f} MiB")
    assert peak - before < PEAK_LIMIT_MIB, f"the second pass raised the peak RSS by {peak - before:.1f} MiB"
    assert (second.collected, second.entries, second.connections) == \
        (expired_halves, entries - expired - expired_halves, connections - expired)
    third = maps.collect_connections(time.monotonic_ns())
    assert (third.collected, third.entries) == (0, second.entries), "every live connection kept its halves"
    assert maps.count("epx_ct4") == third.entries
