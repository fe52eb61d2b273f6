"""`ebpf-proxy lab …`: the mini-cluster of network namespaces that shows service traffic for real."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ebpf_proxy.lab import agent_fault, state
from ebpf_proxy.lab.cluster import MODES, Lab, LabError, destroy, destroy_all

LAB_EPILOG = """\b
Examples:
  ebpf-proxy lab up                              # default topology: worker1-3, my-nginx on worker1+3
  ebpf-proxy lab up --mode iptables --topology my-topology.yaml --name t1
  ebpf-proxy lab apply service.yaml
  ebpf-proxy lab probe --from outside --to 172.20.20.17:30294 --count 20
  ebpf-proxy lab exec worker2 -- ip route
  ebpf-proxy lab scale my-nginx --replicas 3
  ebpf-proxy lab apiserver freeze                 # then thaw; or stop, start, restart
  ebpf-proxy lab down --all
"""

name_option = click.option("--name", default=state.DEFAULT_LAB, show_default=True, envvar="EBPF_PROXY_LAB",
                           help="Which lab (several can run side by side, each under its own prefix).")


def _load(name: str) -> Lab:
    try:
        return Lab.load(name)
    except state.LabNotFound as exc:
        raise click.ClickException(str(exc)) from None


def _load_with_nodes(name: str, nodes: tuple[str, ...]) -> Lab:
    """The lab, after checking that each of `nodes` is one of its nodes (the error names the first that is not)."""
    lab_ = _load(name)
    for node in nodes:
        try:
            lab_.topology.node(node)
        except KeyError as exc:
            raise _fail(LabError(str(exc.args[0]))) from None
    return lab_


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@click.group(epilog=LAB_EPILOG)
def lab() -> None:
    """Build and drive a lab cluster: nodes, pods and clients as network namespaces."""


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab up\n  ebpf-proxy lab up --mode iptables --name t1 --topology topo.yaml")
@name_option
@click.option("--topology", "topology_path", type=click.Path(exists=True, dir_okay=False),
              help="Topology YAML (see README); default: the seed-000 cluster.")
@click.option("--mode", type=click.Choice(MODES), default="auto", show_default=True,
              help="Datapath the per-node agents run (none: no agent).")
def up(name: str, topology_path: str | None, mode: str) -> None:
    """Create the lab: underlay, nodes, pods with echo servers, clients, API server, agents."""
    from ebpf_proxy.lab.topology import TopologyError

    try:
        lab_ = Lab.up(name, topology_path, mode)
    except (LabError, TopologyError, ValueError) as exc:
        raise _fail(exc) from None
    t = lab_.topology
    click.echo(f"lab {name} up: {len(t.nodes)} nodes, {len(t.pods)} pods, {len(t.clients)} clients, mode {lab_.mode}")
    click.echo(f"kubeconfig: {lab_.kubeconfig}")


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab down\n  ebpf-proxy lab down --all")
@name_option
@click.option("--all", "all_", is_flag=True, help="Remove every lab and every leftover of one (even after a crash).")
@click.option("--quiet", is_flag=True, help="Print nothing.")
def down(name: str, all_: bool, quiet: bool) -> None:
    """Remove the lab: namespaces, processes, cgroups, pins, state."""
    names = destroy_all() if all_ else (destroy(name) or [name])
    if not quiet:
        click.echo(f"removed: {', '.join(names) if names else 'nothing to remove'}")


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab status\n  ebpf-proxy lab status --json")
@name_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(name: str, as_json: bool) -> None:
    """Show the lab's nodes, pods, clients, API server and agents."""
    info = _load(name).status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    api = info["apiserver"]
    api_state = "FROZEN" if api.get("frozen") else "up" if api["alive"] else "DOWN"
    console.print(f"lab [bold]{name}[/] mode [bold]{info['mode']}[/]  api {api.get('url')} "
                  f"({api_state})  kubeconfig {info['kubeconfig']}")
    table = Table("kind", "name", "address", "where", "process")
    for n in info["nodes"]:
        agent = n["agent"]
        proc = f"agent {agent.get('mode')} pid {agent.get('pid')}" if agent.get("pid") else "no agent"
        if agent.get("pid") and not agent["alive"]:
            proc += " (DEAD)"
        where = n["podCIDR"] + (f" zone {n['zone']}" if n.get("zone") else "")
        table.add_row("node", n["name"], ", ".join([n["ip"], *n["extraIPs"]]), where, proc)
    for p in info["pods"]:
        server = (f"echo {' '.join(p['listen'])}" + ("" if p["alive"] else " (DEAD)")) if p["listen"] else "serves nothing"
        table.add_row("pod", p["name"], p["ip"], p["node"], server)
    for c in info["clients"]:
        table.add_row("client", c["name"], c["ip"], "outside", "")
    console.print(table)


def _read_file(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text()


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab apply my-service.yaml\n  cat svc.yaml | ebpf-proxy lab apply -")
@name_option
@click.argument("file")
def apply(name: str, file: str) -> None:
    """Create or update Namespaces, Services, EndpointSlices and Pods from standard Kubernetes YAML."""
    try:
        for line in _load(name).apply_manifests(_read_file(file), file):
            click.echo(f"{line} applied")
    except (LabError, ValueError, OSError) as exc:
        raise _fail(exc) from None


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab delete my-service.yaml")
@name_option
@click.argument("file")
def delete(name: str, file: str) -> None:
    """Delete the objects a YAML file names."""
    try:
        for line in _load(name).delete_manifests(_read_file(file), file):
            click.echo(f"{line} deleted")
    except (LabError, ValueError, OSError) as exc:
        raise _fail(exc) from None


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab scale my-nginx --replicas 3")
@name_option
@click.argument("app")
@click.option("--replicas", type=int, required=True, help="How many pods labelled app=APP should run.")
def scale(name: str, app: str, replicas: int) -> None:
    """Add or remove pods labelled app=APP (endpoint slices follow, like a Deployment)."""
    try:
        pods = _load(name).scale(app, replicas)
    except LabError as exc:
        raise _fail(exc) from None
    click.echo(f"{app}: {len(pods)} replicas: {', '.join(pods)}")


@lab.command("exec", context_settings={"ignore_unknown_options": True},
             epilog="\b\nExamples:\n  ebpf-proxy lab exec worker1 -- iptables-save -t nat\n  ebpf-proxy lab exec outside -- ping -c1 172.20.20.15")
@name_option
@click.argument("where")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(name: str, where: str, command: tuple[str, ...]) -> None:
    """Run COMMAND inside WHERE (a node, pod or client)."""
    try:
        result = _load(name).exec(where, list(command), check=False, capture_output=False)
    except LabError as exc:
        raise _fail(exc) from None
    sys.exit(result.returncode)


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab probe --from my-nginx-1 --to 10.96.0.10:80 --count 10\n"
             "  ebpf-proxy lab probe --from worker2 --source-ip 127.0.0.1 --to 127.0.0.1:30294 --json\n"
             "  ebpf-proxy lab probe --from outside --to 172.20.20.16:30294/udp")
@name_option
@click.option("--from", "where", required=True, help="Node, pod or client to send from.")
@click.option("--to", "target", required=True,
              help="IP:PORT[/tcp|udp|sctp] (default tcp), IPv6 [IP]:PORT[/...]; sctp needs kernel SCTP sockets "
                   "(modprobe sctp), else the probe fails saying so.")
@click.option("--source-ip", help="Which of WHERE's addresses to send from (e.g. a node's extra IP, 127.0.0.1).")
@click.option("--count", type=click.IntRange(1, 100000), default=1, show_default=True, help="Fresh connections to open.")
@click.option("--timeout", type=float, default=1.0, show_default=True, help="Seconds before an attempt counts as dropped.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object (stable interface).")
def probe(name: str, where: str, target: str, source_ip: str | None, count: int, timeout: float, as_json: bool) -> None:
    """Open COUNT fresh connections and report who answered, on which address, seeing which source."""
    from ebpf_proxy.lab.probe import ProbeError

    try:
        report = _load(name).probe(where, target, count=count, source_ip=source_ip, timeout=timeout)
    except (LabError, ValueError, ProbeError) as exc:
        raise _fail(exc) from None
    if as_json:
        click.echo(json.dumps(report.to_json()))
        return
    data = report.to_json()
    for r in data["results"]:
        if r["outcome"] == "ok":
            click.echo(f"ok       pod={r['pod']} backend={r['backend']} source={r['source']}")
        else:
            click.echo(r["outcome"])
    s = data["summary"]
    click.echo(f"summary: ok={s['ok']} refused={s['refused']} timeout={s['timeout']} by_pod={s['by_pod']}")


@lab.command("trace", epilog="\b\nExamples:\n  ebpf-proxy lab trace --from outside --to 172.20.20.16:30294\n"
             "  ebpf-proxy lab trace --from my-nginx-1 --to 10.104.89.245:80 --json\n"
             "  ebpf-proxy lab trace --from worker2 --to 127.0.0.1:30294\n"
             "\b\nExit status: that of `ebpf-proxy trace` on the node (2: eBPF tracing not available).")
@name_option
@click.option("--from", "where", required=True, help="Node, pod or client the connection starts from.")
@click.option("--to", "target", required=True, help="IP:PORT[/tcp|udp|sctp]")
@click.option("--mode", type=click.Choice(["auto", "iptables", "ebpf"]), default="auto", show_default=True,
              help="Which datapath to ask; auto: the one the node runs.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object (stable interface).")
def trace_(name: str, where: str, target: str, mode: str, as_json: bool) -> None:
    """Explain what the datapath does with a new connection from WHERE: runs `ebpf-proxy trace` on the
    node the packet first reaches (a pod's node, the node itself, or a client's entry node)."""
    from ebpf_proxy.explain.packet import FlowError
    from ebpf_proxy.lab import trace as lab_trace

    try:
        runs = lab_trace.run(_load(name), where, target, mode, as_json)
    except (LabError, FlowError) as exc:
        raise _fail(exc) from None
    for i, (p, result) in enumerate(runs):
        last = i == len(runs) - 1
        if not as_json and result.returncode == 0:
            click.echo(f"on {p.node}: {p.why}")
        if last or not as_json:  # --json: exactly one object, the deciding node's
            sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    sys.exit(runs[-1][1].returncode)


@lab.command("verify", epilog="\b\nExamples:\n  ebpf-proxy lab verify\n  ebpf-proxy lab verify worker2 --json\n"
             "\b\nExit status: 0 when every node agrees with the model, else 1.")
@name_option
@click.argument("nodes", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: node -> verify's report.")
def verify_(name: str, nodes: tuple[str, ...], as_json: bool) -> None:
    """Run `ebpf-proxy verify` on every node (or NODES): each frontend × the lab's real senders, the
    model against the rendered iptables rules and the node's running datapath."""
    from ebpf_proxy.lab import verify as lab_verify

    lab_ = _load_with_nodes(name, nodes)
    results = lab_verify.run(lab_, list(nodes) or None)
    if as_json:
        click.echo(json.dumps(results))
    else:
        for node, report in results.items():
            for m in report.get("mismatches", []):
                click.echo(f"MISMATCH on {node}: {m['service']} {m['frontend']} from {m['sender']}: "
                           + "; ".join(m["problems"]))
            for e in report.get("errors", []):
                click.echo(f"ERROR on {node}: {e}")
            click.echo(f"{node}: {report.get('flows', 0)} flows, {len(report.get('mismatches', []))} mismatches, "
                       f"{len(report.get('errors', []))} errors")
    sys.exit(0 if all(r["exit"] == 0 for r in results.values()) else 1)


@lab.command("audit", epilog="\b\nExamples:\n  ebpf-proxy lab audit\n  ebpf-proxy lab audit worker2 --repair\n"
             "\b\nExit status: 0 when no node drifted, 1 when one did, 2 when an agent could not be asked.")
@name_option
@click.argument("nodes", nargs=-1)
@click.option("--repair", is_flag=True, help="Have each agent write back what drifted.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: node -> the agent's audit report.")
def audit_(name: str, nodes: tuple[str, ...], repair: bool, as_json: bool) -> None:
    """Ask every node's agent (or NODES') whether its kernel still holds what it last synced."""
    from ebpf_proxy.explain.audit import AuditReport
    from ebpf_proxy.lab import audit as lab_audit

    lab_ = _load_with_nodes(name, nodes)
    results = lab_audit.run(lab_, list(nodes) or None, repair=repair)
    if as_json:
        click.echo(json.dumps(results))
    else:
        for node, doc in results.items():
            if "error" in doc:
                click.echo(f"{node}: error: {doc['error']}")
                continue
            for line in AuditReport.from_json(doc).lines():
                click.echo(f"{node}: {line}")
    sys.exit(max((r["exit"] for r in results.values()), default=0))


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab mode iptables\n  ebpf-proxy lab mode none")
@name_option
@click.argument("mode", type=click.Choice(MODES))
def mode(name: str, mode: str) -> None:
    """Switch every node's agent to MODE in place (none stops them)."""
    try:
        _load(name).set_mode(mode)
    except LabError as exc:
        raise _fail(exc) from None
    click.echo(f"lab {name}: mode {mode}")


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab agent worker1 restart\n"
                    "  ebpf-proxy lab agent worker1 kill --during full-sync --at 0.5   # SIGKILL halfway\n"
                    "  ebpf-proxy lab agent worker1 start")
@name_option
@click.argument("node")
@click.argument("action", type=click.Choice(["start", "stop", "restart", "kill"]))
@click.option("--during", type=click.Choice(list(agent_fault.DURING)), default=None,
              help="kill: wait for a sync of this kind (its /metrics progress) instead of killing at once.")
@click.option("--at", "at", type=float, default=0.5, show_default=True,
              help="kill --during: the fraction of the sync written when the kill comes.")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="kill --during: seconds to wait for that moment (the agent is left running if it never comes).")
def agent(name: str, node: str, action: str, during: str | None, at: float, timeout: float) -> None:
    """Start, stop, restart or kill -9 the agent of one node.

    kill sends SIGKILL: no handler runs, the kernel keeps what the agent had written so far;
    `start` runs a new agent over it."""
    try:
        lab_ = _load(name)
        if action == "kill":
            done = agent_fault.kill(lab_, node, during=during, at=at, timeout=timeout)
            where = (f" with its {during} {done.progress.fraction:.0%} written" if done.progress else "")
            click.echo(f"{node}: agent pid {done.pid} killed (SIGKILL){where}")
            return
        lab_.agent_action(node, action)
    except (LabError, KeyError) as exc:
        raise _fail(exc) from None
    click.echo(f"{node}: agent {action} done")


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab apiserver freeze\n  ebpf-proxy lab apiserver thaw\n"
             "  ebpf-proxy lab apiserver restart --name t1")
@name_option
@click.argument("action", type=click.Choice(["stop", "start", "restart", "freeze", "thaw"]))
def apiserver(name: str, action: str) -> None:
    """Take the API server away and bring it back: stop/start (objects kept, old resourceVersions
    410 Expired), restart, freeze/thaw (SIGSTOP/SIGCONT: connections stay open, nothing answered)."""
    from ebpf_proxy.lab import apiserver_ctl

    try:
        now = apiserver_ctl.act(_load(name), action)
    except LabError as exc:
        raise _fail(exc) from None
    click.echo(f"lab {name}: API server {now}")


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab logs worker1 --tail 50")
@name_option
@click.argument("node")
@click.option("--tail", type=int, help="Only the last N lines.")
def logs(name: str, node: str, tail: int | None) -> None:
    """Print the agent log of NODE."""
    try:
        click.echo(_load(name).logs(node, tail=tail))
    except (LabError, KeyError) as exc:
        raise _fail(exc) from None


@lab.command(epilog="\b\nExamples:\n  ebpf-proxy lab demo\n  ebpf-proxy lab demo --modes iptables")
@name_option
@click.option("--modes", default="auto", show_default=True,
              help="Comma-separated datapaths to show side by side (none, iptables, ebpf); auto: every one available.")
@click.option("--keep/--no-keep", default=True, show_default=True, help="Leave the lab up afterwards.")
def demo(name: str, modes: str, keep: bool) -> None:
    """Tell the seed-000 story with real packets: ClusterIP, NodePort eTP Cluster/Local, node-local access."""
    from ebpf_proxy.lab.demo import run_demo

    try:
        run_demo(name, modes, keep)
    except LabError as exc:
        raise _fail(exc) from None


COMMANDS = [lab]
