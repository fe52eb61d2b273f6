"""Start and stop the lab's echo servers (Python or native) in a test's own network namespace."""

from __future__ import annotations

import signal
import subprocess
import time

from ebpf_proxy.lab import echod, nsexec

SERVERS = ("python", "native")


def start(kind: str, netns: str, pod: str, ready_file, *listens: str, ipv6: bool = False,
          threads: int | None = None) -> subprocess.Popen:
    """The server, once its ready file exists (RuntimeError with its stderr if it exits first)."""
    proc = nsexec.spawn(netns, echod.server_argv(kind, pod, listens, ready_file, ipv6, threads),
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 10
    while not ready_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} echo server exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"{kind} echo server did not become ready in 10 s")
        time.sleep(0.01)
    return proc


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 5 s; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
