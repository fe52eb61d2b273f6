"""The XDP NodePort row: how many packets per second a node turns away at its uplink.

The case is the one XDP exists for: an externalTrafficPolicy=Local NodePort reached from outside
at a node with no endpoint of it (seed 000's "dropped" case), under a flood of new connections.
kube-proxy drops those in filter KUBE-EXTERNAL-SERVICES, after the packet was an skb, went
through conntrack and the nat table; the eBPF datapath drops them in XDP before an skb exists
(native: in the veth driver; generic: after the skb is built), or in TC when XDP is off.

`pktgen.c` sends SYN frames from the outside client straight to the node's MAC, as fast as one
thread can; every frame is a new connection (new source port), so each one takes the whole
NodePort decision. What is reported, per variant:
- `pps`: the packets the node counted as dropped for this reason (the eBPF datapath's
  DROP_NO_LOCAL_EXTERNAL counter; iptables: the packet counter of kube-proxy's DROP rule for
  that NodePort), per second of sending;
- `sent_pps`: what the generator sent. On a veth the receiving node's work runs on the sender's
  CPU (the same softirq), so a cheaper drop lets the generator send more: the two rates rise
  together, and their ratio to another variant's is the comparison.
A variant is an agent flag set: ebpf with `--bpf-xdp-mode native`, `generic` and `off` (TC only),
iptables as it is. Each restarts the node agents with its flags.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.bench import ports
from ebpf_proxy.bench.rest import Rest
from ebpf_proxy.bench.services import ROLE_LABEL, slice_name, slice_object
from ebpf_proxy.lab import cbuild, nsexec
from ebpf_proxy.lab.cluster import Lab

SOURCE_NAME = "pktgen.c"
SERVICE = "bench-np-drop"
DROP_REASON = "DROP_NO_LOCAL_EXTERNAL"
TARGET_NODE = "worker2"  # has no endpoint of SERVICE: its only endpoint is backend-1, on worker1
ENDPOINT_POD = "backend-1"
SENDER = "outside"


@dataclass(frozen=True)
class Variant:
    name: str  # the row's path: what was measured
    mode: str  # the agents' mode
    agent_args: tuple[str, ...] = ()


VARIANTS: dict[str, tuple[Variant, ...]] = {
    "ebpf": (Variant("xdp-native", "ebpf", ("--bpf-xdp-mode", "native")),
             Variant("xdp-generic", "ebpf", ("--bpf-xdp-mode", "generic")),
             Variant("tc-only", "ebpf", ("--bpf-xdp-mode", "off"))),
    "iptables": (Variant("netfilter", "iptables"),),
}


class XdpPpsError(RuntimeError):
    pass


def build(cc: str | None = None, directory: Path | None = None) -> Path:
    try:
        return cbuild.build("ebpf_proxy.bench", SOURCE_NAME, cc=cc, directory=directory)
    except cbuild.BuildError as exc:
        raise XdpPpsError(str(exc)) from exc


def install(rest: Rest, lab: Lab) -> int:
    """The measured Service (NodePort, eTP=Local, its one endpoint on worker1); its nodePort."""
    pod = lab.topology.pod(ENDPOINT_POD)
    port = ports.tcp_port("iptables", "nodeport-local")  # nothing connects: any port a backend has
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": SERVICE, "namespace": "default", "labels": {ROLE_LABEL: "measured"}},
           "spec": {"type": "NodePort", "externalTrafficPolicy": "Local",
                    "ports": [{"port": ports.SERVICE_PORT, "protocol": "TCP", "targetPort": port}]}}
    existing = rest.get("Service", SERVICE)
    created = existing or rest.create(svc)
    if rest.get("EndpointSlice", slice_name(SERVICE)) is None:
        rest.create(slice_object(SERVICE, "measured", [(pod.ip, pod.node)], port))
    return int(created["spec"]["ports"][0]["nodePort"])


def remove(rest: Rest) -> None:
    rest.delete("EndpointSlice", slice_name(SERVICE))
    rest.delete("Service", SERVICE)


def dropped(lab: Lab, node: str, mode: str, node_port: int) -> int:
    """Packets `node` dropped so far for SERVICE's NodePort: the reason counter (ebpf) or the DROP
    rule's packet counter (iptables, `iptables-save -c`)."""
    if mode == "ebpf":
        done = subprocess.run([sys.executable, "-m", "ebpf_proxy", "stats", "--json",
                               "--bpffs", str(lab.dir / "bpffs" / node)],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise XdpPpsError(f"ebpf-proxy stats on {node} failed: {done.stderr.strip()[:300]}")
        return int(json.loads(done.stdout)["reasons"][DROP_REASON]["packets"])
    texts = []
    for save in ("iptables-legacy-save", "iptables-nft-save"):  # whichever backend the agent chose
        saved = nsexec.run(lab.netns_of(node), [save, "-c", "-t", "filter"], timeout=60)
        if saved.returncode == 0 and f"--dport {node_port} " in saved.stdout:
            return drop_rule_packets(saved.stdout, node_port)
        texts.append(saved.stdout)
    return drop_rule_packets("\n".join(texts), node_port)


_COUNTED_RULE = re.compile(r"^\[(\d+):(\d+)\] -A KUBE-EXTERNAL-SERVICES .*--dport (\d+) .*-j DROP$")


def drop_rule_packets(save_text: str, node_port: int) -> int:
    """The packet counter of kube-proxy's "has no local endpoints" DROP rule for `node_port`."""
    for line in save_text.splitlines():
        m = _COUNTED_RULE.match(line.strip())
        if m and int(m.group(3)) == node_port:
            return int(m.group(1))
    raise XdpPpsError(f"no KUBE-EXTERNAL-SERVICES DROP rule for nodePort {node_port} in iptables-save -c")


def send(lab: Lab, binary: Path, node: str, node_port: int, seconds: float) -> dict:
    """Run the generator from the outside client to `node`'s NodePort; its JSON report."""
    client = lab.topology.client(SENDER)
    target = lab.topology.node(node)
    # netlink, not /sys/class/net: a setns'd process still sees the sysfs of the netns it came from
    # (flooded frames to a wrong MAC reach the node anyway, and only a BPF hook would count them)
    link = nsexec.run(lab.netns_of(node), ["ip", "-j", "link", "show", "eth0"], timeout=10)
    if link.returncode != 0:
        raise XdpPpsError(f"cannot read {node}'s eth0 address: {link.stderr.strip()[:300]}")
    mac = json.loads(link.stdout)[0]["address"]
    argv = [str(binary), "--ifname", "eth0", "--dst-mac", mac, "--src-ip", client.ip, "--dst-ip", target.ip,
            "--dport", str(node_port), "--seconds", str(seconds)]
    done = nsexec.run(lab.netns_of(SENDER), argv, timeout=seconds + 30)
    if done.returncode != 0:
        raise XdpPpsError(f"pktgen in {SENDER} exited {done.returncode}: {done.stderr.strip()[:300]}")
    return json.loads(done.stdout)


def measure(lab: Lab, binary: Path, variant: Variant, node_port: int, seconds: float) -> dict:
    """One run: the drop counter's growth while the generator sends, as rates."""
    before = dropped(lab, TARGET_NODE, variant.mode, node_port)
    started = time.monotonic()
    report = send(lab, binary, TARGET_NODE, node_port, seconds)
    time.sleep(0.2)  # the last frames' softirq work: the counters settle
    after = dropped(lab, TARGET_NODE, variant.mode, node_port)
    elapsed = float(report["seconds"]) or (time.monotonic() - started)
    return {"sent": int(report["sent"]), "dropped": after - before, "seconds": round(elapsed, 6),
            "sent_pps": round(report["sent"] / elapsed, 1), "pps": round((after - before) / elapsed, 1)}
