"""The IPv6 mirror of common.h and its byte-order conversions, without root (tests/bpf/test_structs.py
checks every layout against bcc's reflection of the compiled C)."""

from __future__ import annotations

import ctypes
import socket

import pytest

from ebpf_proxy.datapath.ebpf import maps as m
from ebpf_proxy.datapath.ebpf import structs as s


@pytest.mark.parametrize("addr", ["fd00::1", "2001:db8:113::9", "::", "::ffff:10.0.0.1", "fe80::1:2:3:4"])
def test_addresses_are_the_packet_bytes(addr):
    raw = m.in6(addr)
    assert bytes(raw) == socket.inet_pton(socket.AF_INET6, addr)
    assert m.ip6_str(raw) == socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, addr))


def test_none_is_the_nodeport_key():
    assert bytes(m.in6(None)) == bytes(16)


def test_lpm_prefix_is_the_network():
    plen, addr = m._lpm6("fd10:244::7/56")
    assert plen == 56 and m.ip6_str(addr) == "fd10:244::"


# sizes the C side has, packed as common.h lays them out (the bcc comparison is the authority;
# these catch a mirror edit before the root tier runs)
SIZES = {s.In6: 16, s.LB6Key: 20, s.LB6Backend: 20, s.LB6AffinityKey: 20, s.LPM6Key: 20, s.LB6RangeKey: 24,
         s.CT6Key: 40, s.CT6Entry: 72, s.LB6Config: 20, s.Sock6RevKey: 32, s.Sock6Rev: 20, s.Scratch6: 3 * 40 + 2 * 72 + 304 + 280}


@pytest.mark.parametrize("struct", SIZES, ids=lambda t: t.__name__)
def test_ipv6_struct_sizes(struct):
    assert ctypes.sizeof(struct) == SIZES[struct]


def test_scratch_sizes_match_common_h():
    from ebpf_proxy.datapath.ebpf import loader  # noqa: PLC0415

    text = (loader.BPF_SRC_DIR / "lib" / "common.h").read_text()
    assert "#define EPX_IPV6_MAX_EXTLEN 256 " in text and "#define EPX_ICMP6_PARTIAL_PAD 24 " in text
    assert (s.IPV6_MAX_EXTLEN, s.ICMP6_PARTIAL_PAD) == (256, 24)


def test_every_ipv6_map_has_a_capacity_or_is_fixed():
    from ebpf_proxy.datapath.ebpf import loader  # noqa: PLC0415

    six = {name for name in s.MAPS if name.endswith("6")}
    assert six == {"epx_svc6", "epx_backend6", "epx_slot6", "epx_affinity6", "epx_src_range6", "epx_node_addr6",
                   "epx_pod_cidr6", "epx_ct6", "epx_config6", "epx_scratch6", "epx_sock_rev6"}
    assert all(name in loader.MAX_ENTRIES or name in loader.FIXED_ENTRIES for name in six)
