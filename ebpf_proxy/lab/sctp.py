"""Whether this kernel has SCTP sockets: one answer shared by the lab's probe, its echo server and
the tests, so all three agree on when SCTP is served, probed or skipped, and say the same why.

SCTP sockets come from the kernel's sctp module (CONFIG_IP_SCTP); without it, socket(...,
IPPROTO_SCTP) fails with EPROTONOSUPPORT. SCTP *Services* still work without it (a service proxy
only rewrites packets; tests/e2e/test_sctp.py plays both ends with raw sockets), but neither
the probe nor the echo server can speak SCTP, and they must say so rather than crash or go quiet.
"""

from __future__ import annotations

import socket


def sctp_available() -> str | None:
    """None if this kernel can open a one-to-one SCTP socket, else the reason it cannot.

    Asked afresh each time (one socket() call): the module may be loaded (`modprobe sctp`) while
    a lab runs, and the answer is the kernel's, the same in every network namespace."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP).close()
    except OSError as exc:
        return f"this kernel has no SCTP sockets (socket(IPPROTO_SCTP): {exc.strerror or exc}; modprobe sctp)"
    return None
