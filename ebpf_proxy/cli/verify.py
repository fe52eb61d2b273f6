"""`ebpf-proxy verify`: on a node, every flow that matters, explained three ways, compared.

The node's desired state comes from the API (listed as the agent lists it), its configuration
from the agent's own flags or --config (so the same command line as the agent's works), and the
flows from every frontend × each sender class. Each flow goes to the model (explain/expect), to
the iptables rules iptables mode would write for this state (rendered here, never installed,
walked by the same walker `trace` uses), and to what runs in this node's kernel: the eBPF
programs in trace mode when their maps are pinned, else the live iptables rules. Any
disagreement is printed with every opinion, and the exit status is 1.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys

import click

SENDER_HELP = ("A sender, repeatable: LABEL=IP/ORIGIN[@IFACE], ORIGIN pod|external|host "
               "(default: the node itself, a client outside through the default-route device, and "
               "the pods of this node's routed veths)")


def parse_sender(text: str):
    from ebpf_proxy.explain.packet import ORIGINS
    from ebpf_proxy.explain.verify import Origin

    label, sep, rest = text.partition("=")
    addr, _, iface = rest.partition("@")
    ip, _, origin = addr.partition("/")
    try:
        ip = str(ipaddress.ip_address(ip))
    except ValueError:
        raise click.BadParameter(f"{text!r}: {ip!r} is not an IPv4 or IPv6 address", param_hint="--sender") from None
    if not sep or not label or origin not in ORIGINS:
        raise click.BadParameter(f"{text!r} is not LABEL=IP/ORIGIN[@IFACE] with ORIGIN one of {', '.join(ORIGINS)}",
                                 param_hint="--sender")
    return Origin(label, ip, origin, iface or None)


OUTSIDE = {4: "203.0.113.77", 6: "2001:db8:7::77"}  # documentation addresses: a client outside


def default_senders(node_ips: tuple[str, ...], cluster_cidrs: tuple[str, ...], family: int = 4):
    """The node itself, an outside client (a documentation address) through the default-route
    device, and each pod of this node that has a routed veth (a /32 or /128 route into the cluster
    CIDR): the senders of IP `family`."""
    from pyroute2 import IPRoute

    from ebpf_proxy.explain.iptables_live import route_device
    from ebpf_proxy.explain.verify import Origin
    from ebpf_proxy.model import networks_of_family, of_family

    senders = []
    own = of_family(node_ips, family)
    if own:
        senders.append(Origin("the node itself", own[0], "host"))
    senders.append(Origin("a client outside", OUTSIDE[family], "external", route_device(OUTSIDE[family])))
    nets = networks_of_family(cluster_cidrs, family)
    host_len = 32 if family == 4 else 128
    with IPRoute() as ipr:
        names = {link["index"]: link.get("IFLA_IFNAME") for link in ipr.get_links()}
        for route in ipr.get_routes(family=socket.AF_INET if family == 4 else socket.AF_INET6):
            dst, oif = route.get("RTA_DST"), route.get("RTA_OIF")
            if route["dst_len"] == host_len and dst and oif and any(ipaddress.ip_address(dst) in n for n in nets):
                senders.append(Origin(f"pod {dst} (this node)", dst, "pod", names.get(oif)))
    return senders


def _ipv6_served(bpffs: str | None) -> bool:
    from ebpf_proxy.explain.ebpf_trace import ipv6_served

    return ipv6_served(bpffs or "/sys/fs/bpf")


def run_verify(config, node_ips: tuple[str, ...], senders, bpffs: str | None, kernel: str,
               families: tuple[int, ...] = (4,)):
    """The Report of every family (flows of each family put to that family's tracers), and a
    description of the tracers used. In ebpf mode an IPv6 flow is traced through the programs
    where the agent switched their IPv6 path on (CFG6_F_ON, ebpf_trace.ipv6_served), else through
    the live ip6tables rules that then serve IPv6."""
    from ebpf_proxy.agent.nodeconfig import build_node_config
    from ebpf_proxy.datapath.iptables.render import render
    from ebpf_proxy.explain import iptables_live as live
    from ebpf_proxy.explain.iptables_rules import from_ruleset, parse_save
    from ebpf_proxy.explain.iptables_walk import walk
    from ebpf_proxy.explain.state import frontend_names, listed_state
    from ebpf_proxy.explain.verify import Report, flows_for, verify
    from ebpf_proxy.k8s.client import make_api_client

    states = listed_state(make_api_client(config.kubeconfig, config.master), config.node_name, families)
    report, used = Report(), set()
    for family, (state, node_state) in states.items():
        node = build_node_config(config, list(node_ips), node_state, family)
        facts = live.node_facts(node_ips or None, family=family)
        rendered = from_ruleset(render(node, state))
        command = "ip6tables" if family == 6 else "iptables"
        tracers = {f"{command} (rendered)": lambda f, t=rendered, n=facts: walk(t, f, n)}
        if kernel == "ebpf" and (family == 4 or _ipv6_served(bpffs)):
            from ebpf_proxy.explain.ebpf_trace import trace_ebpf

            names = frontend_names(state, node.node_ips)
            tracers["ebpf"] = lambda f: trace_ebpf(f, bpffs or "/sys/fs/bpf", names)
        else:
            text, source = live.read_rules(config.iptables_backend, family)
            live_rules = parse_save(text, source)
            tracers[f"{command} (live)"] = lambda f, t=live_rules, n=facts: walk(t, f, n)
        family_senders = senders or default_senders(node.node_ips, node.cluster_cidrs, family)
        part = verify(flows_for(state, node, family_senders), state, node, tracers)
        report.flows += part.flows
        report.mismatches += part.mismatches
        report.errors += part.errors
        used.update(tracers)
    return report, sorted(used)


@click.command(epilog="\b\nExamples:\n  ebpf-proxy verify --config /var/lib/kube-proxy/config.conf --hostname-override $(NODE_NAME)\n"
                      "  ebpf-proxy verify --kubeconfig kc --hostname-override worker1 --cluster-cidr 10.244.0.0/16 --json")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="The agent's KubeProxyConfiguration file.")
@click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False), help="Kubeconfig for the API server.")
@click.option("--master", default=None, help="API server URL.")
@click.option("--hostname-override", default=None, help="This node's name, as the agent has it.")
@click.option("--cluster-cidr", "cluster_cidrs", default=None, help="As the agent's flag.")
@click.option("--detect-local-mode", default=None, help="As the agent's flag.")
@click.option("--pod-bridge-interface", default=None, help="As the agent's flag.")
@click.option("--pod-interface-name-prefix", default=None, help="As the agent's flag.")
@click.option("--masquerade-all", default=None, help="As the agent's flag (true/false).")
@click.option("--bpffs", default=None, help="bpffs mount of the eBPF datapath (default: found by netns).")
@click.option("--sender", "senders", multiple=True, help=SENDER_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def verify(config_file, senders, bpffs, as_json, **flags) -> None:
    """Compare, flow by flow, the model, the iptables rules and this node's datapath."""
    from ebpf_proxy.agent.config import ConfigError, load_config
    from ebpf_proxy.agent.nodeconfig import local_addresses, served_families
    from ebpf_proxy.cli.trace import ebpf_pinned

    try:
        config = load_config({k: v for k, v in flags.items() if v is not None}, config_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    pinned = ebpf_pinned(bpffs)
    kernel = "ebpf" if pinned else "iptables"
    parsed = [parse_sender(s) for s in senders]
    local = local_addresses()
    node_ips = tuple(ip for ip in local if not ipaddress.ip_address(ip).is_loopback)
    report, tracers = run_verify(config, node_ips, parsed, pinned, kernel, served_families(None, node_ips))
    if as_json:
        click.echo(json.dumps({
            "node": config.node_name, "tracers": tracers, "flows": report.flows,
            "mismatches": [{"service": m.flow.service, "frontend": m.flow.frontend, "sender": m.flow.sender.label,
                            "flow": m.flow.spec.label, "problems": m.problems,
                            "model": {"verdict": m.expectation.verdict, "backends": sorted(m.expectation.backends),
                                      "masquerade": m.expectation.masquerade},
                            "traces": {k: t.to_json() for k, t in m.traces.items()}} for m in report.mismatches],
            "errors": report.errors}))
    else:
        for m in report.mismatches:
            click.echo(m.render())
        for e in report.errors:
            click.echo(f"ERROR {e}")
        verdict = "ok" if report.ok else f"{len(report.mismatches)} mismatches, {len(report.errors)} errors"
        click.echo(f"{config.node_name}: {report.flows} flows, model vs {', '.join(tracers)}: {verdict}")
    sys.exit(0 if report.ok else 1)


COMMANDS = [verify]
