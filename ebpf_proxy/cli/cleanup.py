"""`ebpf-proxy cleanup`: remove everything any datapath mode installed on this node."""

from __future__ import annotations

import socket
import sys

import click

from ebpf_proxy.agent.cleanup import cleanup_all
from ebpf_proxy.agent.logs import setup_logging

EPILOG = """\b
Examples:
  ebpf-proxy cleanup                                  # iptables chains, BPF programs and pinned maps
  ebpf-proxy cleanup --bpffs /run/lab/bpffs/worker1   # maps pinned under another bpffs

\b
Exit status: 0 when every mode was cleaned or had nothing importable to clean, 1 if any cleanup failed.
"""


@click.command(epilog=EPILOG)
@click.option("--hostname-override", default=None, help="This node's name, if not the hostname.")
@click.option("--cgroup-path", default=None, type=click.Path(file_okay=False),
              help="cgroup v2 directory the eBPF socket programs were attached to.")
@click.option("--bpffs", default=None, type=click.Path(file_okay=False),
              help="bpffs mount holding the pinned maps (default /sys/fs/bpf).")
@click.option("--log-level", default="warning", show_default=True, help="debug, info, warning, error.")
def cleanup(hostname_override: str | None, cgroup_path: str | None, bpffs: str | None, log_level: str) -> None:
    """Remove the iptables rules and eBPF programs/maps that ebpf-proxy installed."""
    setup_logging("text", log_level)
    node_name = (hostname_override or socket.gethostname()).strip().lower()
    results = cleanup_all(node_name, cgroup_path=cgroup_path, bpffs=bpffs)
    for result in results:
        click.echo(result.line())
    sys.exit(1 if any(r.failed for r in results) else 0)


COMMANDS = [cleanup]
