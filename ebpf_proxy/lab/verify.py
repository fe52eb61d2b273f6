"""`lab verify`: `ebpf-proxy verify` on every node of a lab, with the lab's real senders.

Each node is verified where its agent runs (its netns and cgroup), with the agent's own settings
(`Lab.proxy_config_args`), and with senders the lab knows to exist: the node itself, each pod of
the node (entering through its veth, or the node's pod bridge), the pods of other nodes and each
outside client (both entering through eth0, as their packets do). Each sender is given with each
of its addresses, so a dual-stack lab's nodes verify both of their proxiers (IPv4 and IPv6).
"""

from __future__ import annotations

import json
import subprocess
import sys

from ebpf_proxy.lab import naming

UPLINK = "eth0"


def senders(lab, node_name: str) -> list[str]:
    """--sender values for `node_name` (LABEL=IP/ORIGIN[@IFACE]), one per address of each sender."""
    topo = lab.topology
    node = topo.node(node_name)
    out = [f"node {node.name}={ip}/host" for ip in node.ips]
    for pod in topo.pods_on(node.name):
        dev = node.pod_bridge or naming.pod_host_ifname(pod.name)
        out += [f"pod {pod.name}={ip}/pod@{dev}" for ip in pod.ips]
    # every pod elsewhere: verify leaves out a service's own backends as senders (hairpins), so
    # one remote pod alone might be a backend of every service
    out += [f"pod {p.name} (on {p.node})={ip}/external@{UPLINK}" for p in topo.pods if p.node != node.name
            for ip in p.ips]
    out += [f"client {c.name}={ip}/external@{UPLINK}" for c in topo.clients for ip in c.ips]
    return out


def run(lab, nodes: list[str] | None = None, timeout: float = 300.0) -> dict[str, dict]:
    """node -> `verify --json`'s object (plus "exit": its status), for `nodes` (default: all)."""
    results = {}
    for name in nodes or [n.name for n in lab.topology.nodes]:
        argv = [sys.executable, "-m", "ebpf_proxy", "verify", "--json",
                "--kubeconfig", str(lab.dir / "kubeconfig-node"), "--hostname-override", name,
                "--bpffs", str(lab.dir / "bpffs" / name), *lab.proxy_config_args()]
        for s in senders(lab, name):
            argv += ["--sender", s]
        done: subprocess.CompletedProcess = lab.exec(name, argv, check=False, timeout=timeout,
                                                     capture_output=True, text=True)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            report = {"errors": [f"verify on {name} failed (exit {done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()[-2000:]}"], "mismatches": [], "flows": 0}
        report["exit"] = done.returncode
        results[name] = report
    return results
