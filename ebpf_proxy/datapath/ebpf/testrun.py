"""Run a loaded program on one packet with BPF_PROG_TEST_RUN: the BPF unit tests' only way in.

The kernel builds a real skb (or xdp_buff) from `packet`, runs the program once (or `repeat`
times, for timing) and hands back the verdict and the packet as the program left it, without any
device or namespace involved. bcc has no wrapper for this; `libbpf.py` binds the C call and this
module is the one Python-level wrapper around it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ebpf_proxy.datapath.ebpf import libbpf

# Room for the program to grow the packet (the ICMP reject adds an IP and an ICMP header).
_HEADROOM = 512


class SkBuffCtx(ctypes.Structure):
    """The head of struct __sk_buff (include/uapi/linux/bpf.h) up to cb[]: what a TC test run may
    set (the kernel rejects non-zero fields it does not take: len, pkt_type, ...; a shorter ctx
    reads as zeros). `ifindex` names a device of the caller's netns; it becomes skb->dev."""

    _fields_ = [
        ("len", ctypes.c_uint32),
        ("pkt_type", ctypes.c_uint32),
        ("mark", ctypes.c_uint32),
        ("queue_mapping", ctypes.c_uint32),
        ("protocol", ctypes.c_uint32),
        ("vlan_present", ctypes.c_uint32),
        ("vlan_tci", ctypes.c_uint32),
        ("vlan_proto", ctypes.c_uint32),
        ("priority", ctypes.c_uint32),
        ("ingress_ifindex", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("tc_index", ctypes.c_uint32),
        ("cb", ctypes.c_uint32 * 5),
    ]


class XdpMd(ctypes.Structure):
    """struct xdp_md for an XDP test run: data is the length of the metadata in front of the frame
    (data_meta must be 0), data_end the length of the whole input."""

    _fields_ = [
        ("data", ctypes.c_uint32),
        ("data_end", ctypes.c_uint32),
        ("data_meta", ctypes.c_uint32),
        ("ingress_ifindex", ctypes.c_uint32),
        ("rx_queue_index", ctypes.c_uint32),
        ("egress_ifindex", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class RunResult:
    retval: int  # the program's return value: TC_ACT_* or XDP_*
    packet: bytes  # the packet after the program ran
    duration_ns: int  # kernel-measured average per run


def run(prog_fd: int, packet: bytes, repeat: int = 1, ctx: ctypes.Structure | None = None) -> RunResult:
    """Run program `prog_fd` on `packet` (an Ethernet frame; for XDP with metadata, the metadata
    and then the frame), with `ctx` as the program's context when given (SkBuffCtx, XdpMd).
    Raises OSError from the kernel."""
    data_in = ctypes.create_string_buffer(packet, len(packet))
    out_size = len(packet) + _HEADROOM
    data_out = ctypes.create_string_buffer(out_size)
    opts = libbpf.TestRunOpts(
        data_in=ctypes.cast(data_in, ctypes.c_void_p),
        data_size_in=len(packet),
        data_out=ctypes.cast(data_out, ctypes.c_void_p),
        data_size_out=out_size,
        repeat=repeat,
    )
    if ctx is not None:
        opts.ctx_in = ctypes.addressof(ctx)
        opts.ctx_size_in = ctypes.sizeof(ctx)
    libbpf.prog_test_run(prog_fd, opts)
    return RunResult(retval=opts.retval, packet=data_out.raw[: opts.data_size_out], duration_ns=opts.duration)
