"""The seed-000 story, told with real packets in the default lab, for each datapath side by side.

The article (shared/seeds/000_…) traces kube-proxy's chains by hand for a NodePort service
`my-nginx` (pods on worker1 and worker3, none on worker2): a ClusterIP call from a pod, NodePort
calls from outside to worker3 and to worker2 with externalTrafficPolicy Cluster then Local, and
worker2 calling its own NodePort (which works even with Local: the puzzle the article solves).
Each line shows who answered and the source address the pod saw.
"""

from __future__ import annotations

from dataclasses import dataclass

from ebpf_proxy.lab import state
from ebpf_proxy.lab.cluster import Lab, LabError

SERVICE_NAME = "my-nginx"
CLUSTER_IP = "10.104.89.245"  # the article's values
NODE_PORT = 30294


def service_manifest(policy: str) -> str:
    return f"""apiVersion: v1
kind: Service
metadata: {{name: {SERVICE_NAME}, namespace: default}}
spec:
  type: NodePort
  clusterIP: {CLUSTER_IP}
  selector: {{app: my-nginx}}
  externalTrafficPolicy: {policy}
  ports:
    - {{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}, protocol: TCP}}
"""


@dataclass(frozen=True)
class Case:
    title: str
    policy: str  # externalTrafficPolicy in force
    where: str
    target: str
    source_ip: str | None
    expected: str  # what the article (and kube-proxy) says happens
    count: int = 20  # enough that every allowed pod shows up (a miss has odds 2 * 2**-20)


def seed000_cases(lab: Lab) -> list[Case]:
    t = lab.topology
    ips = {n.name: n.ip for n in t.nodes}
    pod_w1 = next(p.name for p in t.pods if p.node == "worker1" and p.labels.get("app") == "my-nginx")
    client = t.clients[0].name
    np_w2, np_w3 = f"{ips['worker2']}:{NODE_PORT}", f"{ips['worker3']}:{NODE_PORT}"
    return [
        Case("ClusterIP from a pod", "Cluster", pod_w1, f"{CLUSTER_IP}:80", None,
             "any pod; source = the client pod's IP (no SNAT), except a pod landing on itself "
             "(hairpin: masqueraded to its node)"),
        Case("NodePort outside→worker3", "Cluster", client, np_w3, None,
             "any pod; source = worker3 (masqueraded)"),
        Case("NodePort outside→worker2", "Cluster", client, np_w2, None,
             "any pod; source = worker2 (masqueraded)"),
        Case("NodePort outside→worker3", "Local", client, np_w3, None,
             "worker3's pod only; client IP preserved"),
        Case("NodePort outside→worker2", "Local", client, np_w2, None,
             "dropped: worker2 has no local endpoint (case 1)", count=2),
        Case("worker2 → its own NodePort", "Local", "worker2", np_w2, None,
             "any pod; source = worker2 (case 3: masquerade + any endpoint)"),
    ]


def describe(report) -> str:
    """'pod ← source it saw' per answering pod, e.g. 'my-nginx-1 ← 172.20.20.15; my-nginx-2 ← 10.244.5.4'."""
    data = report.to_json()
    s = data["summary"]
    if s["ok"] == 0:
        return "refused" if s["refused"] else "timeout (dropped)"
    seen: dict[str, set[str]] = {}
    for r in data["results"]:
        if r["outcome"] == "ok":
            seen.setdefault(r["pod"] or "?", set()).add((r["source"] or "?").rsplit(":", 1)[0])
    text = "; ".join(f"{pod} ← {','.join(sorted(srcs))}" for pod, srcs in sorted(seen.items()))
    if s["ok"] != len(data["results"]):
        text += f" (+{s['refused']} refused, {s['timeout']} timeout)"
    return text


def direct_case(lab: Lab):
    """Without a datapath: pod to pod across nodes, no NAT (the Kubernetes network model)."""
    pods = [p for p in lab.topology.pods if p.labels.get("app") == "my-nginx"]
    src, dst = pods[0], pods[-1]
    return f"direct {src.name}→{dst.name} ({dst.ip}:80)", lab.probe(src.name, f"{dst.ip}:80", count=4)


def available_modes() -> list[str]:
    modes = []
    try:
        from ebpf_proxy.datapath import iptables  # noqa: F401

        modes.append("iptables")
    except ImportError:
        pass
    try:
        from ebpf_proxy.datapath.ebpf import EbpfDatapath  # noqa: F401
        from ebpf_proxy.datapath.ebpf.toolchain import probe

        if probe().ok:
            modes.append("ebpf")
    except ImportError:
        pass
    return modes or ["none"]


def run_story(lab: Lab) -> list[tuple[Case, str]]:
    rows = []
    applied = None
    for case in seed000_cases(lab):
        if case.policy != applied:
            lab.apply_manifests(service_manifest(case.policy), "demo")
            applied = case.policy
            lab.wait_converged()
        report = lab.probe(case.where, case.target, count=case.count, source_ip=case.source_ip, timeout=0.5)
        rows.append((case, describe(report)))
    return rows


def run_demo(name: str = state.DEFAULT_LAB, modes: str = "auto", keep: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    wanted = available_modes() if modes == "auto" else [m.strip() for m in modes.split(",") if m.strip()]
    lab = Lab.load(name) if state.exists(name) else None
    if lab is None:
        console.print(f"[bold]bringing up lab {name}[/] (default topology: worker1–3, my-nginx on worker1 and worker3)")
        lab = Lab.up(name)
    try:
        title, report = direct_case(lab)
        console.print(f"{title}: {describe(report)}")
        results: dict[str, list[tuple[Case, str]]] = {}
        for mode in wanted:
            if mode == "none":
                continue
            console.print(f"[bold]mode {mode}[/]: starting agents on every node …")
            lab.set_mode(mode)
            results[mode] = run_story(lab)
        if not results:
            console.print("no datapath selected: only direct pod-to-pod traffic shown")
            return
        table = Table(title=f"seed 000: service {SERVICE_NAME} ({CLUSTER_IP}:80, nodePort {NODE_PORT})")
        table.add_column("case")
        table.add_column("eTP")
        table.add_column("article says")
        for mode in results:
            table.add_column(f"{mode}: who answered ← source seen")
        cases = next(iter(results.values()))
        for i, (case, _) in enumerate(cases):
            table.add_row(case.title, case.policy, case.expected, *(results[m][i][1] for m in results))
        console.print(table)
    except LabError:
        raise
    finally:
        if not keep:
            lab.down()
