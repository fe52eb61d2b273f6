"""`ebpf-proxy run`: the agent, with kube-proxy's flags (and its --config file) plus ours."""

from __future__ import annotations

import sys

import click

from ebpf_proxy.agent.config import DETECT_LOCAL_MODES, LOG_FORMATS, LOG_LEVELS, MODES, ConfigError, load_config
from ebpf_proxy.agent.logs import setup_logging
from ebpf_proxy.bareimport import slim_imports
from ebpf_proxy.k8s import kubeconfig

EPILOG = """\b
Examples:
  # the way a kube-proxy DaemonSet runs it (in-cluster credentials, its ConfigMap):
  ebpf-proxy run --config /var/lib/kube-proxy/config.conf --hostname-override $(NODE_NAME)
  # force the iptables datapath, outside a cluster:
  ebpf-proxy run --mode iptables --kubeconfig ~/.kube/config --cluster-cidr 10.244.0.0/16
  # eBPF with socket load-balancing for one cgroup, JSON logs:
  ebpf-proxy run --mode ebpf --cgroup-path /sys/fs/cgroup --log-format json

\b
Flags override the --config file. Durations as in Kubernetes: 500ms, 1s, 1m30s.
SIGTERM stops the agent and leaves the datapath in place; `ebpf-proxy cleanup` removes it.
"""

BOOL = "[=BOOL]"

def _bool_flag(*names: str, help: str):  # noqa: A002 (click's name)
    """A Go-style bool flag: `--flag` or `--flag=false`, so kube-proxy command lines work unchanged."""
    return click.option(*names, is_flag=False, flag_value="true", default=None, metavar=BOOL, help=help)


@click.command(epilog=EPILOG)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="A KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1), e.g. kube-proxy's ConfigMap.")
@click.option("--hostname-override", default=None, help="This node's name, if not the hostname.")
@click.option("--cluster-cidr", "cluster_cidrs", default=None,
              help="The pod network, comma-separated CIDRs; traffic from outside it to a ClusterIP is masqueraded.")
@click.option("--nodeport-addresses", default=None,
              help="Comma-separated CIDRs of node addresses that accept NodePorts, or 'primary'; default: all.")
@click.option("--detect-local-mode", default=None, metavar="|".join(DETECT_LOCAL_MODES),
              help="How traffic from this node's pods is told apart (default ClusterCIDR).")
@click.option("--pod-bridge-interface", default=None, metavar="NAME",
              help="--detect-local-mode BridgeInterface: the bridge pods are attached to.")
@click.option("--pod-interface-name-prefix", default=None, metavar="PREFIX",
              help="--detect-local-mode InterfaceNamePrefix: the name prefix of pod interfaces.")
@_bool_flag("--masquerade-all", help="SNAT all traffic to ClusterIPs and to eTP=Cluster external destinations.")
@click.option("--iptables-masquerade-bit", "masquerade_bit", default=None, metavar="INT",
              help="The fwmark bit for traffic to masquerade, 0..31 (default 14).")
@_bool_flag("--iptables-localhost-nodeports", "localhost_nodeports",
            help="Accept NodePorts on 127.0.0.1 (default true).")
@click.option("--min-sync-period", "--iptables-min-sync-period", "min_sync_period", default=None, metavar="DURATION",
              help="Minimum time between syncs (default 1s).")
@click.option("--sync-period", "--iptables-sync-period", "sync_period", default=None, metavar="DURATION",
              help="Maximum time between full resyncs (default 30s).")
@click.option("--metrics-bind-address", default=None, metavar="IP:PORT",
              help="Where to serve /metrics (default 127.0.0.1:10249; empty disables).")
@click.option("--healthz-bind-address", default=None, metavar="IP:PORT",
              help="Where to serve /healthz and /livez (default 0.0.0.0:10256; empty disables).")
@click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False), help="Kubeconfig file for the API server.")
@click.option("--master", default=None, help="API server URL (overrides the kubeconfig's).")
@click.option("--mode", "--proxy-mode", "mode", default=None, metavar="|".join(MODES),
              help="Datapath: ebpf, iptables, or auto (ebpf if this machine can, default).")
@click.option("--cgroup-path", default=None, type=click.Path(file_okay=False),
              help="cgroup v2 directory whose sockets get eBPF socket load-balancing (ebpf mode).")
@click.option("--bpffs", default=None, type=click.Path(file_okay=False),
              help="bpffs mount for pinned maps (default /sys/fs/bpf).")
@click.option("--bpf-cache-dir", default=None, type=click.Path(file_okay=False),
              help="The node's cache of compiled eBPF programs, by build: a start that finds no pinned "
                   "programs loads them from here instead of compiling (default /var/cache/ebpf-proxy/bpf; "
                   "empty disables). Root-owned, mode 0700.")
@click.option("--bpf-map-sizes", default=None, metavar="MAP=N[,MAP=N...]",
              help="Capacities of eBPF maps, e.g. epx_svc=262144,epx_backend=1048576,epx_slot=2097152 for "
                   "100,000 Services of 10 endpoints (defaults: 65,536 frontends and backends, 262,144 slots; "
                   "the connection table follows --conntrack-*). A changed size recreates that map at start.")
@click.option("--bpf-xdp-mode", default=None, metavar="off|native|generic",
              help="How the eBPF mode's early-drop XDP program attaches to outside-facing devices: off "
                   "(default: the TC program decides every packet, with the same drops), native (in the "
                   "driver, before an skb exists: the fast drops, where the driver supports it; the NIC "
                   "may reset its queues as it attaches) or generic (any driver; drops no faster than TC "
                   "and costs every packet a little).")
@click.option("--bpf-host-routing", default=None, metavar="auto|on|off",
              help="eBPF mode: forward translated packets (and replies of tracked connections) straight to "
                   "their pod or next hop with bpf_fib_lookup and bpf_redirect_peer/_neigh, skipping the "
                   "node's routing, neighbour and netfilter stack (auto, default: on where the kernel has "
                   "the helpers). Netfilter's FORWARD/POSTROUTING rules of other components do not see "
                   "those packets: turn it off where they must.")
@click.option("--bpf-conntrack-gc-period", default=None, metavar="DURATION",
              help="eBPF mode: time between two passes of the connection table's garbage collector, which "
                   "removes expired connections (default 10s; a closed connection's reply half goes one "
                   "pass after it). Shorter frees entries sooner at the cost of more table walks.")
@click.option("--iptables-backend", default=None, metavar="auto|legacy|nft",
              help="iptables mode: which backend (auto: the one already holding rules, else legacy).")
@click.option("--iptables-proof-dir", default=None, type=click.Path(file_okay=False),
              help="iptables mode: where a clean drift audit's proof that the kernel holds the rules is kept, "
                   "so that a restarted agent restores no table the kernel still holds that way (default "
                   "/var/cache/ebpf-proxy/iptables; empty disables).")
@click.option("--audit-period", default=None, metavar="DURATION",
              help="How often to compare the kernel's rules or maps with the last sync (default 1m; 0 disables).")
@click.option("--watch-idle-timeout", default=None, metavar="DURATION",
              help="Reconnect a watch that brings no event or bookmark for this long: a frozen API server "
                   "keeps connections open (default 1m30s).")
@click.option("--watch-backoff-max", default=None, metavar="DURATION",
              help="Longest wait between attempts to reach the API server (default 30s, client-go's; lower "
                   "catches up sooner after an outage, at the cost of more attempts against a struggling server).")
@_bool_flag("--audit-repair", help="Write back what the drift audit finds (default true; false: only report).")
@click.option("--conntrack-max-per-core", default=None, metavar="INT",
              help="eBPF connection table: connections per CPU (default 32768; 0: the built-in 131072).")
@click.option("--conntrack-min", default=None, metavar="INT",
              help="eBPF connection table: at least this many connections (default 131072).")
@click.option("--conntrack-tcp-timeout-established", "conntrack_tcp_established_timeout", default=None,
              metavar="DURATION", help="Idle timeout of an established TCP connection (default 24h; 0: 5 days).")
@click.option("--conntrack-tcp-timeout-close-wait", "conntrack_tcp_close_wait_timeout", default=None,
              metavar="DURATION", help="Idle timeout of a TCP connection closed one way (default 1h; 0: 60s).")
@click.option("--conntrack-udp-timeout", default=None, metavar="DURATION",
              help="Idle timeout of a UDP flow not answered yet (default 0: 30s).")
@click.option("--conntrack-udp-timeout-stream", "conntrack_udp_stream_timeout", default=None, metavar="DURATION",
              help="Idle timeout of an answered UDP flow (default 0: 120s).")
@click.option("--log-format", default=None, metavar="|".join(LOG_FORMATS), help="text (default) or json.")
@click.option("--log-level", default=None, metavar="|".join(LOG_LEVELS), help="debug, info (default), warning, error.")
def run(config_file: str | None, **flags: str | None) -> None:
    """Run the service proxy on this node until SIGTERM."""
    setup_logging(flags.get("log_format") or "text", flags.get("log_level") or "info")
    try:
        config = load_config({k: v for k, v in flags.items() if v is not None}, config_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    setup_logging(config.log_format, config.log_level)
    if config.kubeconfig:  # its child reads it while the agent's modules import (k8s/kubeconfig.py)
        kubeconfig.prefetch(config.kubeconfig)
    slim_imports()
    from ebpf_proxy.agent.agent import Agent  # here: ~70 ms of imports the kubeconfig child overlaps

    agent = Agent(config, settle_heap=True)
    agent.install_signal_handlers()
    sys.exit(agent.run())


COMMANDS = [run]
