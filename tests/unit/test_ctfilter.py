"""ctfilter.py's hash: the one the programs compute (bpf/lib/ct4.h: ct4_filter_hash; that the
two agree is tests/bpf/test_ct_filter.py's), and Renewal.add's inlined copy of it."""

from __future__ import annotations

import random
import struct

import pytest

from ebpf_proxy.datapath.ebpf import ctfilter
from ebpf_proxy.datapath.ebpf import structs as s


def _keys(n: int) -> list[bytes]:
    rng = random.Random(12)
    return [bytes(s.CT4Key(saddr=rng.getrandbits(32), daddr=rng.getrandbits(32), sport=rng.getrandbits(16),
                           dport=rng.getrandbits(16), proto=rng.choice((6, 17, 132)), kind=rng.randrange(4)))
            for _ in range(n)]


def test_renewal_sets_exactly_the_bits_slot_and_bit_names():
    keys = _keys(500)
    renewal = ctfilter.Renewal(bank=1)
    renewal.add(b"".join(keys), len(keys), 16)
    expected = [0] * s.CT4_FILTER_SLOTS
    for key in keys:
        slot, bit = ctfilter.slot_and_bit(key)
        expected[slot] |= 1 << bit
    assert list(renewal.seen) == expected


def test_add_reads_only_the_first_n_keys():
    keys = _keys(3)
    renewal, first_two = ctfilter.Renewal(bank=2), ctfilter.Renewal(bank=2)
    renewal.add(b"".join(keys), 2, 16)
    first_two.add(b"".join(keys[:2]), 2, 16)
    assert renewal.seen == first_two.seen and any(renewal.seen)
    renewal.add(keys[2], 1, 16)
    assert renewal.seen != first_two.seen


def test_hash_spreads_keys_of_one_client_over_the_bank():
    """A node's keys differ in a port or two: their bits must not crowd (one bank of 2^21 bits)."""
    keys = [bytes(s.CT4Key(saddr=0x0700F40A, daddr=0x1500F40A, sport=port, dport=0x901F, proto=6, kind=1))
            for port in range(32768, 32768 + 4096)]
    assert len({ctfilter.slot_and_bit(k) for k in keys}) > 4000


def test_the_hash_is_the_c_one_by_value():
    """ct4_filter_hash's multiply-xor on known words, worked out by hand from the C."""
    w = (1, 2, 3, 4)
    h = ((1 * 0x9E3779B1) ^ (2 * 0x85EBCA77) ^ (3 * 0xC2B2AE3D) ^ (4 * 0x27D4EB2F)) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 12
    assert ctfilter.key_hash(*w) == h
    assert ctfilter.slot_and_bit(struct.pack("=4I", *w)) == ((h >> 6) % s.CT4_FILTER_SLOTS, h % 64)


def test_a_key_of_another_size_is_refused():
    with pytest.raises(ValueError, match="struct ct4_key is 40 bytes"):
        ctfilter.Renewal(bank=1).add(bytes(40), 1, 40)
