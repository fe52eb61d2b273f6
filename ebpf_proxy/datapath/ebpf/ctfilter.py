"""The connection table's presence filter, the agent's half of it (bpf/lib/common.h explains it).

The programs ask a bitmap before each epx_ct4 lookup where most lookups miss (bpf/lib/ct4.h:
ct4_may_hold), and set a key's bit in both banks' `made` words before they write the key. The
agent renews one bank per garbage-collection pass (Maps.collect_connections): `begin` picks the
bank the programs do not read and zeroes its `made` words, the pass's read of the table `add`s
every key it finds, and `commit` writes those bits into that bank's `seen` words and makes it the
one the programs read. The map is mmapped (BPF_F_MMAPABLE): a bank is 32,768 slots of two 64-bit
words, and the agent stores its `seen` words one by one, never a whole slot, so a `made` bit a
program sets meanwhile in the same slot is not overwritten.

`off` makes every lookup go to the table again: before the agent writes entries itself (a mode
switch's adopted connections, which no program noted), and when the maps are reset. A pass whose
read may have missed such an entry (an `off` came after its `begin`) leaves the filter off rather
than commit a bank without it: the agent is the only process that writes the table or renews the
filter, so a lock and a count of `off`s in this process order the two.
"""

from __future__ import annotations

import mmap
import struct
import threading
from array import array

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s

_MASK32 = 0xFFFFFFFF
_KEY_WORDS = struct.Struct("=4I")  # struct ct4_key as the four 32-bit words ct4_filter_hash reads
_WORDS_PER_SLOT = 2  # seen, made
_BANK_WORDS = s.CT4_FILTER_SLOTS * _WORDS_PER_SLOT
OFF = 0  # epx_ct4_filter_bank: no bank read, every lookup is made

_lock = threading.Lock()  # orders `off` against a pass's commit
_offs = 0  # `off`s in this process so far


def key_hash(w0: int, w1: int, w2: int, w3: int) -> int:
    """bpf/lib/ct4.h's ct4_filter_hash over a key's four native-order 32-bit words."""
    h = ((w0 * 0x9E3779B1) ^ (w1 * 0x85EBCA77) ^ (w2 * 0xC2B2AE3D) ^ (w3 * 0x27D4EB2F)) & _MASK32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & _MASK32
    return h ^ (h >> 12)


def slot_and_bit(key: bytes) -> tuple[int, int]:
    """Where a packed struct ct4_key's bit lies in a bank: (slot, bit of its 64)."""
    h = key_hash(*_KEY_WORDS.unpack(key))
    return (h >> 6) & (s.CT4_FILTER_SLOTS - 1), h & 63


class Renewal:
    """One bank being renewed: the bits of every key the pass's read found."""

    def __init__(self, bank: int, offs: int = 0) -> None:
        self.bank = bank  # 1 or 2, as epx_ct4_filter_bank names it
        self.offs = offs  # the process's `off` count when the pass began
        self.seen = array("Q", bytes(8 * s.CT4_FILTER_SLOTS))

    def add(self, keys: bytes, n: int, key_size: int) -> None:
        """The first `n` packed keys of `keys` (struct ct4_key, `key_size` bytes each)."""
        if key_size != _KEY_WORDS.size:
            raise ValueError(f"struct ct4_key is {key_size} bytes, the filter hashes {_KEY_WORDS.size}")
        seen, slots = self.seen, s.CT4_FILTER_SLOTS - 1
        for w0, w1, w2, w3 in _KEY_WORDS.iter_unpack(memoryview(keys)[: n * key_size]):
            h = ((w0 * 0x9E3779B1) ^ (w1 * 0x85EBCA77) ^ (w2 * 0xC2B2AE3D) ^ (w3 * 0x27D4EB2F)) & _MASK32
            h ^= h >> 15
            h = (h * 0x2C1B3C6D) & _MASK32
            h ^= h >> 12
            seen[(h >> 6) & slots] |= 1 << (h & 63)


class CtFilter:
    """epx_ct4_filter (mmapped) and epx_ct4_filter_bank, by fd."""

    def __init__(self, filter_fd: int, bank_fd: int) -> None:
        self._bank_fd = bank_fd
        self._map = mmap.mmap(filter_fd, s.CT4_FILTER_BANKS * _BANK_WORDS * 8, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = memoryview(self._map).cast("Q")

    def close(self) -> None:
        self._words.release()
        self._map.close()

    def bank(self) -> int:
        """The bank the programs read: 1 or 2, or OFF."""
        value = s.u32(OFF)
        libbpf.map_lookup(self._bank_fd, s.u32(0), value)
        return value.value

    def _set_bank(self, bank: int) -> None:
        libbpf.map_update(self._bank_fd, s.u32(0), s.u32(bank))

    def off(self) -> None:
        """No bank read: every lookup goes to the table until a pass that began after this commits."""
        global _offs
        with _lock:
            _offs += 1
            self._set_bank(OFF)

    def begin(self) -> Renewal:
        """Start renewing the bank the programs do not read: its `made` words zeroed. Every key
        the table holds from here on is in the read that follows, or sets its own `made` bit."""
        with _lock:
            offs = _offs
        bank = 2 if self.bank() == 1 else 1
        start = (bank - 1) * _BANK_WORDS
        self._words[start + 1:start + _BANK_WORDS:_WORDS_PER_SLOT] = array("Q", bytes(8 * s.CT4_FILTER_SLOTS))
        return Renewal(bank, offs)

    def commit(self, renewal: Renewal) -> bool:
        """Write the read's bits into the bank's `seen` words and make the programs read it,
        unless an `off` came since the pass began (its entries may not be in the read: the filter
        stays off until the next pass). Returns whether the bank is read now."""
        start = (renewal.bank - 1) * _BANK_WORDS
        self._words[start:start + _BANK_WORDS:_WORDS_PER_SLOT] = renewal.seen
        with _lock:
            if _offs != renewal.offs:
                return False
            self._set_bank(renewal.bank)
        return True

    def may_hold(self, key: bytes) -> bool:
        """What the programs' ct4_may_hold answers for a packed key now (tests, `inspect`)."""
        bank = self.bank()
        if bank == OFF:
            return True
        slot, bit = slot_and_bit(key)
        at = (bank - 1) * _BANK_WORDS + slot * _WORDS_PER_SLOT
        return bool(((self._words[at] | self._words[at + 1]) >> bit) & 1)
