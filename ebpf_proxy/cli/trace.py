"""`ebpf-proxy trace`: why would a new connection go there? Asked of this node's datapath.

One question, two datapaths, one answer shape (explain/result.py): in iptables mode the node's
live rules are walked hook by hook (explain/iptables_walk.py); in eBPF mode the pinned maps are
read by the eBPF tracer (explain/ebpf_trace.py, `trace_ebpf(flow, bpffs)`), imported only when
asked for, so this command works on nodes (and in builds) without it. `--mode auto` follows what
the node runs: eBPF when the datapath's maps are pinned, else iptables.

An IPv6 flow is asked of whatever serves the node's IPv6 Services: in eBPF mode the programs'
IPv6 path when the agent switched it on (CFG6_F_ON in epx_config6, ebpf_trace.ipv6_served), else
its ip6tables rules (the answer then says so); in iptables mode its ip6tables rules.

Exit status: 0 with an answer; 1 when the question or the node's state cannot be read (the
message names the option, command or rule at fault); 2 when eBPF tracing is asked for and this
build has no eBPF tracer.
"""

from __future__ import annotations

import sys

import click

from ebpf_proxy.datapath.iptables.backend import BACKENDS
from ebpf_proxy.explain.packet import FlowError, FlowSpec, ip_of, parse_endpoint

EPILOG = """\b
Examples:
  ebpf-proxy trace --from 203.0.113.5 --to 172.20.20.16:30294
  ebpf-proxy trace --from 10.244.5.9 --from-pod --to 10.96.0.10:53/udp --json
  ebpf-proxy trace --from 172.20.20.16 --to 172.20.20.16:30294      # the node itself (a local source)
  ebpf-proxy trace --from fd00:20::99 --to [fd00:20::16]:30294       # IPv6: as the node serves IPv6
  ebpf-proxy trace --mode iptables --rules-file node.save --node-ip 172.20.20.16 --from 203.0.113.5 --to 172.20.20.16:30294
  ebpf-proxy lab trace --from outside --to 172.20.20.16:30294      # in the lab: picks the node for you

\b
Exit status: 0 with an answer, 1 on an error naming its cause, 2 when eBPF tracing is not available.
"""

EBPF_UNAVAILABLE = "ebpf tracing not available in this build (no ebpf_proxy.explain.ebpf_trace): use --mode iptables"
IPV6_BY_IP6TABLES = ("this node's eBPF datapath does not serve IPv6 (CFG6_F_ON unset in epx_config6): its "
                     "ip6tables rules do, and were walked")


def flow_family(dst: str) -> int:
    """4 or 6: the IP family of --to (which proxier's rules answer)."""
    return ip_of("--to", parse_endpoint(dst, "--to")[0]).version


def build_flow(src: str, dst: str, in_iface: str | None, from_pod: bool, from_host: bool,
               is_local=None, route_device=None) -> FlowSpec:
    """The FlowSpec the options describe. Without --from-pod/--from-host the origin is the node itself
    when the source is one of its addresses, else external; without --in-iface a packet that is not
    the node's own enters through the device the reverse route to its source uses."""
    if from_pod and from_host:
        raise FlowError("--from-pod and --from-host: give one (where does the packet start?)")
    if from_host and in_iface:
        raise FlowError("--in-iface: a packet the node sends itself enters through no device (drop --from-host or it)")
    if "/" in src:
        raise FlowError(f"--from: {src!r}: the protocol goes on --to (IP:PORT/udp)")
    s_ip, s_port, _ = parse_endpoint(src, "--from", 40000)
    d_ip, d_port, proto = parse_endpoint(dst, "--to")
    if d_port is None:
        raise FlowError(f"--to: {dst!r} has no port (IP:PORT[/tcp|udp|sctp], [IPv6]:PORT)")
    checked = FlowSpec(s_ip, d_ip, d_port, proto)  # both addresses valid and of one family, canonical
    s_ip, d_ip = checked.src, checked.dst
    if from_host or (not from_pod and is_local is not None and is_local(s_ip)):
        origin = "host"
    else:
        origin = "pod" if from_pod else "external"
    if origin != "host" and in_iface is None and route_device is not None:
        in_iface = route_device(s_ip)
    return FlowSpec(s_ip, d_ip, d_port, proto, s_port or 40000, origin, in_iface if origin != "host" else None)


def ebpf_pinned(bpffs: str | None) -> str | None:
    """The bpffs mount whose pin directory holds this node's eBPF datapath maps, else None."""
    try:
        from ebpf_proxy.datapath.ebpf import inspect as epx_inspect

        pin_dir = epx_inspect.locate(bpffs)
    except Exception:  # noqa: BLE001 - no libbpf, no bpffs: then nothing is pinned here
        return None
    return str(pin_dir.parent) if pin_dir.is_dir() and any(pin_dir.glob("epx_*")) else None


def trace_iptables(flow_args: dict, backend: str, rules_file: str | None, node_ips: tuple[str, ...],
                   masquerade_ip: str | None):
    from ebpf_proxy.explain import iptables_live as live
    from ebpf_proxy.explain.iptables_rules import parse_save
    from ebpf_proxy.explain.iptables_walk import walk

    family = flow_family(flow_args["dst"])
    facts = live.node_facts(node_ips or None, masquerade_ip, family)
    flow = build_flow(**flow_args, is_local=facts.is_local,
                      route_device=None if node_ips else live.route_device)
    if rules_file:
        with open(rules_file) as fh:
            text, source = fh.read(), rules_file
    else:
        text, source = live.read_rules(backend, family)
    return walk(parse_save(text, source), flow, facts)


def frontend_names_from(kubeconfig: str | None, node_ips) -> dict | None:
    """Service names for the eBPF maps' frontends, from the API (None without --kubeconfig, or
    when the API does not answer: the trace then names no service, and says why on stderr)."""
    if not kubeconfig:
        return None
    from ebpf_proxy.explain.state import frontend_names, listed_state
    from ebpf_proxy.k8s.client import make_api_client

    try:
        state, _node = listed_state(make_api_client(kubeconfig), "")[4]
    except Exception as exc:  # noqa: BLE001 - naming is a courtesy; the verdict comes from the kernel
        click.echo(f"--kubeconfig {kubeconfig}: cannot list services ({exc}); the trace names no service", err=True)
        return None
    return frontend_names(state, node_ips)


def trace_ebpf_mode(flow_args: dict, bpffs: str | None, kubeconfig: str | None = None, backend: str = "auto"):
    bpffs = bpffs or "/sys/fs/bpf"
    family = flow_family(flow_args["dst"])
    try:
        from ebpf_proxy.explain.ebpf_trace import ipv6_served, trace_ebpf
    except ModuleNotFoundError as exc:
        if exc.name != "ebpf_proxy.explain.ebpf_trace":
            raise
        if family == 4:
            click.echo(EBPF_UNAVAILABLE, err=True)
            sys.exit(2)
        ipv6_served = None  # without the tracer, IPv6 is answered by ip6tables, as when it serves IPv6
    if family == 6 and not (ipv6_served and ipv6_served(bpffs)):
        from dataclasses import replace

        t = trace_iptables(flow_args, backend, None, (), None)
        return replace(t, story=f"{t.sentence()} [{IPV6_BY_IP6TABLES}]",
                       details={**t.details, "notes": [*t.details.get("notes", ()), IPV6_BY_IP6TABLES]})
    from ebpf_proxy.explain import iptables_live as live

    facts = live.node_facts(family=family)
    flow = build_flow(**flow_args, is_local=facts.is_local, route_device=live.route_device)
    return trace_ebpf(flow, bpffs, frontend_names_from(kubeconfig, sorted(facts.local_ips)))


@click.command(epilog=EPILOG)
@click.option("--from", "src", required=True, help="Source IP[:PORT] (port default 40000).")
@click.option("--to", "dst", required=True, help="Destination IP:PORT[/tcp|udp|sctp] (default tcp); IPv6: [IP]:PORT.")
@click.option("--in-iface", help="Device the packet enters this node through (default: the route back to --from).")
@click.option("--from-pod", is_flag=True, help="The source is a pod of this node (enters through its veth).")
@click.option("--from-host", is_flag=True, help="The node itself sends it (default when --from is a local address).")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object (stable interface).")
@click.option("--mode", type=click.Choice(["auto", "iptables", "ebpf"]), default="auto", show_default=True,
              help="Which datapath to ask; auto: ebpf when its maps are pinned, else iptables.")
@click.option("--bpffs", default=None, help="bpffs mount of the eBPF datapath (default: found by netns, else /sys/fs/bpf).")
@click.option("--iptables-backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="Which iptables holds the rules; auto: the one that holds Kubernetes chains.")
@click.option("--rules-file", type=click.Path(exists=True, dir_okay=False),
              help="Walk this iptables-save dump instead of the live rules (implies --mode iptables).")
@click.option("--node-ip", "node_ips", multiple=True,
              help="The node's addresses (repeatable; with --rules-file from another node): LOCAL for addrtype "
                   "matches, the first is the masquerade address.")
@click.option("--masquerade-ip", help="Address MASQUERADE picks (default: primary address of the default-route device).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
              help="eBPF mode: name the Service of a frontend from this API server (the maps hold ids only).")
def trace(src: str, dst: str, in_iface: str | None, from_pod: bool, from_host: bool, as_json: bool, mode: str,
          bpffs: str | None, iptables_backend: str, rules_file: str | None, node_ips: tuple[str, ...],
          masquerade_ip: str | None, kubeconfig: str | None) -> None:
    """Explain what this node's datapath does with a new connection: DNAT (to which backends), drop,
    reject or pass, whether it is masqueraded, and every chain or program on the way."""
    from ebpf_proxy.explain.iptables_live import LiveError
    from ebpf_proxy.explain.iptables_rules import RulesError
    from ebpf_proxy.explain.iptables_walk import WalkError

    flow_args = dict(src=src, dst=dst, in_iface=in_iface, from_pod=from_pod, from_host=from_host)
    if rules_file:
        if mode == "ebpf":
            raise click.UsageError("--rules-file is an iptables dump: it cannot be traced with --mode ebpf")
        mode = "iptables"
    if mode == "auto":
        found = ebpf_pinned(bpffs)
        mode, bpffs = ("ebpf", found) if found else ("iptables", bpffs)
    try:
        if mode == "ebpf":
            result = trace_ebpf_mode(flow_args, bpffs, kubeconfig, iptables_backend)
        else:
            result = trace_iptables(flow_args, iptables_backend, rules_file, node_ips, masquerade_ip)
    except (FlowError, RulesError, WalkError, LiveError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(result.dumps() if as_json else result.render())


COMMANDS = [trace]
