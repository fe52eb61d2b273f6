"""`lab trace`: ask the right lab node's datapath about a connection, as `lab probe` would send it.

A trace is only meaningful on the node where the packet first meets a proxy, and with the right
idea of how it got there; the lab knows both, so the user names a place, not a node:
  a pod      its node; origin pod; it enters through the pod's device: the host side of its
             veth, or the node's pod bridge when pods hang off one (iptables' -i and the eBPF
             interface detector see the bridge then, not the veth)
  a node     itself; origin host (its own connection; 127.0.0.1 as source for a loopback target)
  a client   the node its packets reach first: the node whose address is the destination (the
             lab routes node addresses directly), else the client's gateway; origin external,
             entering through eth0
The source is the place's address of the target's family (its IPv6 address for an IPv6 target). Then `ebpf-proxy trace` runs inside that node's network namespace (and cgroup), exactly as an
operator would run it on a real node, and its output (text or the one JSON object) is passed on.
When that node passes the packet on unchanged to another node's address (a pod or a node calling
another node's NodePort), the other node decides: it is asked next, as the packet arrives there
(origin external, through eth0), and with --json its answer is the one printed.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass

from ebpf_proxy.explain.packet import FlowError, host_port, ip_of, parse_endpoint
from ebpf_proxy.lab import naming


def _address(where: str, ips, family: int) -> str:
    """`where`'s address of the target's family; the error says the place has none."""
    found = next((ip for ip in ips if ipaddress.ip_address(ip).version == family), None)
    if found is None:
        raise FlowError(f"--from: {where} has no IPv{family} address (it has {', '.join(ips)}); "
                        f"give an IPv{6 if family == 4 else 4} --to")
    return found


@dataclass(frozen=True)
class TracePlan:
    node: str  # where `ebpf-proxy trace` runs
    argv: tuple[str, ...]  # its arguments after `trace`
    why: str  # one line: why this node, which origin


def plan(lab, where: str, target: str, mode: str = "auto", as_json: bool = False) -> TracePlan:
    """Which node to ask and with which `trace` options; errors name WHERE or --to."""
    dst, port, proto = parse_endpoint(target, "--to")
    if port is None:
        raise FlowError(f"--to: {target!r} has no port (IP:PORT[/tcp|udp|sctp], [IPv6]:PORT)")
    addr = ip_of("--to", dst)
    dst, family, loopback = str(addr), addr.version, addr.is_loopback
    topo = lab.topology
    nodes = {n.name: n for n in topo.nodes}
    pods = {p.name: p for p in topo.pods}
    clients = {c.name: c for c in topo.clients}
    to = f"{host_port(dst, port)}/{proto.lower}"
    if where in nodes:
        loopback_src = "127.0.0.1" if family == 4 else "::1"  # what a socket to a loopback target binds
        src = loopback_src if loopback else _address(where, nodes[where].ips, family)
        node, args, why = where, ["--from", src, "--from-host"], f"{where} itself sends it (origin host)"
    elif where in pods:
        pod = pods[where]
        bridge = nodes[pod.node].pod_bridge
        dev = bridge or naming.pod_host_ifname(pod.name)
        node, args = pod.node, ["--from", _address(where, pod.ips, family), "--from-pod", "--in-iface", dev]
        why = f"{where} is a pod of {pod.node}, entering through {dev} (origin pod)"
    elif where in clients:
        client = clients[where]
        owner = next((n.name for n in topo.nodes if dst in n.all_ips), None)
        node = owner or client.gateway
        args = ["--from", _address(where, client.ips, family), "--in-iface", "eth0"]
        why = (f"{dst} is {owner}'s address" if owner else f"{client.gateway} is {where}'s gateway") + \
            ", entering through eth0 (origin external)"
    else:
        known = ", ".join([*nodes, *pods, *clients])
        raise FlowError(f"--from: {where!r} is not a node, pod or client of lab {lab.name!r} (known: {known})")
    args += ["--to", to, "--mode", mode, "--bpffs", str(lab.dir / "bpffs" / node),
             "--kubeconfig", str(lab.dir / "kubeconfig-node")]
    if as_json:
        args.append("--json")
    return TracePlan(node, tuple(args), why)


def follow(lab, first: TracePlan, target: str, mode: str, as_json: bool) -> TracePlan | None:
    """When the first node passes the packet on unchanged to another node's address (a pod or node
    calling another node's NodePort), that node decides: the plan for asking it, else None."""
    dst, port, proto = parse_endpoint(target, "--to")
    dst = str(ip_of("--to", dst))
    owner = next((n.name for n in lab.topology.nodes if dst in n.all_ips), None)
    if owner is None or owner == first.node:
        return None
    src = first.argv[first.argv.index("--from") + 1]
    args = ["--from", src, "--in-iface", "eth0", "--to", f"{host_port(dst, port)}/{proto.lower}", "--mode", mode,
            "--bpffs", str(lab.dir / "bpffs" / owner), "--kubeconfig", str(lab.dir / "kubeconfig-node")] + \
        (["--json"] if as_json else [])
    return TracePlan(owner, tuple(args), f"{first.node} passes it on unchanged to {owner}'s address "
                                        "(origin external, entering through eth0)")


def _passed(result: subprocess.CompletedProcess, as_json: bool) -> bool:
    if result.returncode != 0:
        return False
    if as_json:
        try:
            return json.loads(result.stdout).get("verdict") == "pass"
        except ValueError:
            return False
    return result.stdout.split(" ", 2)[1:2] == ["pass:"]  # "[iptables] pass: ..."


def run(lab, where: str, target: str, mode: str = "auto", as_json: bool = False,
        timeout: float = 60.0) -> list[tuple[TracePlan, subprocess.CompletedProcess]]:
    """Run the planned `ebpf-proxy trace` in the node's netns, and on the next node when the first
    passes the packet on to it; every (plan, stdout/stderr/exit status), the deciding one last."""
    out = []
    p: TracePlan | None = plan(lab, where, target, mode, as_json)
    while p is not None:
        argv = [sys.executable, "-m", "ebpf_proxy", "trace", *p.argv]
        result = lab.exec(p.node, argv, check=False, timeout=timeout)
        out.append((p, result))
        p = follow(lab, p, target, mode, as_json) if len(out) == 1 and _passed(result, as_json) else None
    return out
