"""A throw-away node for the attach tests: four network namespaces wired with veths.

    pod (10.244.0.7) ──vpod── node ──vbe── backend (10.244.1.31)
                                │
                              vout── outside (203.0.113.9)

The node forwards, runs strict reverse-path filtering (PLATFORM.md pitfall 2 must not bite),
has route_localnet on (as kube-proxy sets it, for 127.0.0.1:<nodePort>) and TX checksum offload
off on its own veths while the pods keep it on, so packets from the pods
arrive CHECKSUM_PARTIAL and leave the node with checksums computed in software from what the
programs wrote (pitfall 1: a wrong checksum flag shows as a dead connection). Everything lives in
namespaces named epxt-bpf-<pid>-*, removed on exit, also when building failed halfway.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from tests.netns_util import add_netns, del_netns, nsenter

PREFIX = f"epxt-bpf-{os.getpid()}-"
CGROUP_ROOT = Path("/sys/fs/cgroup/unified/ebpf-proxy-test")

NODE_POD_SIDE, POD_IP = "10.244.0.1", "10.244.0.7"
NODE_BACKEND_SIDE, BACKEND_IP = "10.244.1.1", "10.244.1.31"
NODE_OUTSIDE_SIDE, OUTSIDE_IP = "203.0.113.1", "203.0.113.9"
LINKS = {  # role: (node's device, node's address, peer address)
    "pod": ("vpod", NODE_POD_SIDE, POD_IP),
    "backend": ("vbe", NODE_BACKEND_SIDE, BACKEND_IP),
    "outside": ("vout", NODE_OUTSIDE_SIDE, OUTSIDE_IP),
}


def sh(*cmd: str, ns: str | None = None, timeout: float = 10, check: bool = True) -> subprocess.CompletedProcess:
    full = (nsenter(ns) if ns else []) + list(cmd)
    return subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=check)


TCP_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", int(sys.argv[1])))
    print("ready", flush=True)
    import selectors
    sel = selectors.DefaultSelector(); sel.register(s, selectors.EVENT_READ); sel.register(u, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is s:
                c, peer = s.accept(); c.sendall(f"{peer[0]}:{peer[1]}".encode()); c.close()
            else:
                data, peer = u.recvfrom(2048); u.sendto(f"{peer[0]}:{peer[1]}".encode(), peer)
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    proto, host, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    source = sys.argv[5] if len(sys.argv) > 5 else ""
    try:
        if proto == "tcp":
            c = socket.socket(); c.settimeout(timeout)
            if source:
                c.bind((source, 0))
            c.connect((host, port))
            print("ok", c.recv(100).decode(), "%s:%d" % c.getpeername())
        else:
            c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(timeout)
            if source:
                c.bind((source, 0))
            c.sendto(b"hi", (host, port)); data, peer = c.recvfrom(100)
            print("ok", data.decode(), "%s:%d" % peer)
    except OSError as e:
        print("error", type(e).__name__)
""")


class NetLab:
    def __init__(self) -> None:
        self.ns = {role: PREFIX + role for role in ("node", "pod", "backend", "outside")}
        self._server: subprocess.Popen | None = None
        self._cgroups: list[Path] = []

    def __enter__(self) -> NetLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self.ns.values():
            add_netns(ns)
        node = self.ns["node"]
        for key in ("all", "default"):
            sh("sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=1", ns=node)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=node)
        sh("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1", ns=node)
        for role, (dev, node_addr, peer_addr) in LINKS.items():
            peer_ns = self.ns[role]
            sh(*nsenter(node), "ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", peer_ns)
            sh(*nsenter(node), "ip", "addr", "add", f"{node_addr}/24", "dev", dev)
            sh(*nsenter(node), "ip", "link", "set", dev, "up")
            sh("ethtool", "-K", dev, "tx", "off", ns=node)
            sh(*nsenter(peer_ns), "ip", "addr", "add", f"{peer_addr}/24", "dev", "eth0")
            sh(*nsenter(peer_ns), "ip", "link", "set", "eth0", "up")
            sh(*nsenter(peer_ns), "ip", "link", "set", "lo", "up")
            sh(*nsenter(peer_ns), "ip", "route", "add", "default", "via", node_addr)
        sh(*nsenter(node), "ip", "link", "set", "lo", "up")

    def ifindex(self, dev: str) -> int:
        # netlink, not /sys/class/net: /sys shows the netns it was mounted in, not ours
        return json.loads(sh("ip", "-j", "link", "show", "dev", dev, ns=self.ns["node"]).stdout)[0]["ifindex"]

    def start_server(self, port: int) -> None:
        """TCP and UDP on the backend: both answer with the peer address they saw."""
        cmd = [*nsenter(self.ns["backend"]), sys.executable, "-c", TCP_SERVER, str(port)]
        self._server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self._server.stdout.readline().strip() == "ready"

    def client(
        self, role: str, proto: str, host: str, port: int, cgroup: Path | None = None, timeout: float = 3,
        source: str = "",
    ) -> list[str]:
        """Connect from `role`'s namespace (from `source` if given); returns ["ok", seen-by-backend,
        peer] or ["error", name]."""
        py = [sys.executable, "-c", CLIENT, proto, host, str(port), str(timeout), source]
        if cgroup is None:
            return sh(*py, ns=self.ns[role]).stdout.split()
        # join the cgroup, then enter the netns (nsenter --net keeps the host's mounts)
        script = f'echo $$ > {cgroup}/cgroup.procs && exec nsenter --net=/run/netns/{self.ns[role]} "$@"'
        return sh("sh", "-c", script, "sh", *py).stdout.split()

    def netns_cookie(self, role: str) -> int:
        """The network namespace cookie of `role` (SO_NETNS_COOKIE), as the socket LB compares it."""
        code = "import socket; print(int.from_bytes(socket.socket().getsockopt(socket.SOL_SOCKET, 71, 8), 'little'))"
        return int(sh(sys.executable, "-c", code, ns=self.ns[role]).stdout)

    def cgroup(self) -> Path:
        path = CGROUP_ROOT / f"{PREFIX}sock"
        path.mkdir(parents=True)
        self._cgroups.append(path)
        return path

    def close(self) -> None:
        if self._server:
            self._server.kill()
            self._server.wait()
            self._server = None
        for path in self._cgroups:
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            CGROUP_ROOT.rmdir()  # only when no other test run uses it
        self._unplug_node()
        for ns in self.ns.values():
            del_netns(ns)

    def _unplug_node(self) -> None:
        """Take the session's programs off the node before its namespaces go.

        The tests attach the session-wide programs (conftest's `datapath`) here, and they count
        into the session-wide maps. A deleted namespace is torn down later, by the kernel's
        workqueue; until then its veths still carry those programs, and a packet the kernel sends
        by itself (an IPv6 router solicitation, an MLD report) is counted in whatever test runs
        next (seen: PASS_IPV6_OFF in an IPv4 test_xdp case). Deleting the veths (both ends go at
        once) and lo's clsact here, synchronously, leaves nothing of ours to count."""
        node = self.ns["node"]
        sh("tc", "qdisc", "del", "dev", "lo", "clsact", ns=node, check=False)
        for dev, *_ in LINKS.values():
            sh("ip", "link", "del", dev, ns=node, check=False)
