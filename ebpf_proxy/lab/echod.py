"""The lab's native echo server, echod.c: echo.py's wire format, in C, one thread per CPU.

A pod with `server: native` in the topology runs it instead of the Python server: the bench's
backends do, so that a connection rate measures the path to the server rather than the server
(the Python server is one interpreter thread). The source ships with the package and is compiled
once with the system cc (cbuild.py). It serves TCP and UDP only: SCTP listens are the Python
server's (the bench measures TCP and UDP), and asking echod.c for one is an error, not a port
silently left closed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from ebpf_proxy.lab import cbuild

SOURCE_NAME = "echod.c"


def build(cc: str | None = None, directory: Path | None = None) -> Path:
    """The compiled server's path (compiled on first use; cbuild.BuildError if it cannot be)."""
    return cbuild.build("ebpf_proxy.lab", SOURCE_NAME, libs=("-lpthread",), cc=cc, directory=directory)


def server_argv(server: str, pod: str, listens: Sequence[str], ready_file: str | Path | None = None,
                ipv6: bool = False, threads: int | None = None) -> list[str]:
    """The command line of a pod's echo server: `server` "native" (this one, compiled on first
    use; cbuild.BuildError if it cannot be) or "python" (lab/echo.py, one thread: no `threads`).
    ValueError for a combination neither serves (native with a PORT/sctp listen)."""
    if server == "native":
        sctp = [entry for entry in listens if entry.lower().endswith("/sctp")]
        if sctp:
            raise ValueError(f"server native (echod.c) serves tcp and udp only, not {', '.join(sctp)}: "
                             "use server python")
        return argv(build(), pod, listens, ready_file, ipv6=ipv6, threads=threads)
    if server != "python" or threads is not None:
        raise ValueError(f"server {server!r} with threads {threads!r}: python (one thread) or native")
    out = [sys.executable, "-m", "ebpf_proxy.lab.echo", "--pod", pod]
    for entry in listens:
        out += ["--listen", entry]
    if ready_file is not None:
        out += ["--ready-file", str(ready_file)]
    return out + (["--ipv6"] if ipv6 else [])


def argv(binary: str | Path, pod: str, listens: Sequence[str], ready_file: str | Path | None = None,
         ipv6: bool = False, threads: int | None = None) -> list[str]:
    """The command line serving `listens` ("PORT/tcp", "PORT/udp") as pod `pod`."""
    out = [str(binary), "--pod", pod]
    for entry in listens:
        out += ["--listen", entry]
    if ready_file is not None:
        out += ["--ready-file", str(ready_file)]
    if ipv6:
        out.append("--ipv6")
    if threads is not None:
        out += ["--threads", str(threads)]
    return out
