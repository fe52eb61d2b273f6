"""Scratch network namespaces for tests that need a topology of their own (not a whole lab).

Made and removed with the lab's own code (unshare + bind mount, no `ip netns add`), and entered
with `nsenter --net`: iproute2's `ip netns exec` / `ip -n` also remount / and /sys, which fails
where / is not a mount point (a chroot, as on the fresh-machine check) and is not needed here.
"""

from __future__ import annotations

import subprocess

from ebpf_proxy.lab.netns import create_netns, delete_netns


def nsenter(name: str) -> list[str]:
    """Command prefix that runs the rest inside netns NAME."""
    return ["nsenter", f"--net=/run/netns/{name}"]


def add_netns(name: str) -> None:
    """A new netns with loopback up."""
    create_netns(name)
    subprocess.run(nsenter(name) + ["ip", "link", "set", "lo", "up"], check=True, capture_output=True)


def del_netns(name: str) -> None:
    """Remove netns NAME if it exists (its interfaces go with it)."""
    try:
        delete_netns(name)
    except FileNotFoundError:
        pass
