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


@dataclass(frozen=True)
class RunResult:
    retval: int  # the program's return value: TC_ACT_* or XDP_*
    packet: bytes  # the packet after the program ran
    duration_ns: int  # kernel-measured average per run


def run(prog_fd: int, packet: bytes, repeat: int = 1) -> RunResult:
    """Run program `prog_fd` on `packet` (an Ethernet frame). Raises OSError from the kernel."""
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
    libbpf.prog_test_run(prog_fd, opts)
    return RunResult(retval=opts.retval, packet=data_out.raw[: opts.data_size_out], duration_ns=opts.duration)
