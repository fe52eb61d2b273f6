"""kube-proxy's conntrack settings, resolved the way kube-proxy resolves them.

kube-proxy writes them to the kernel (nf_conntrack_max, nf_conntrack_tcp_timeout_established, ...)
for the conntrack its iptables rules rely on. The eBPF datapath keeps its own connection table,
so the same settings size and time that table instead (ConntrackLimits): an existing
`conntrack:` section or `--conntrack-*` flags keep meaning what they meant.

kube-proxy (cmd/kube-proxy/app/conntrack.go, getConntrackMax): the limit is maxPerCore x CPUs,
raised to `min`, and only when maxPerCore > 0; a 0 leaves the kernel's value alone, as does a
0 timeout. Here "the kernel's value" is nf_conntrack's default for the same thing.
"""

from __future__ import annotations

import os

from ebpf_proxy.agent.config import AgentConfig
from ebpf_proxy.model import ConntrackLimits

# nf_conntrack's defaults, what kube-proxy leaves in place for a 0 (nf_conntrack_max depends on
# the node's memory; 131072 is kube-proxy's own `min` default, the size this table had before)
KERNEL_DEFAULTS = ConntrackLimits(max_connections=131072, tcp_established=432000, tcp_close_wait=60, udp=30,
                                  udp_stream=120)


def cpu_count() -> int:
    """CPUs this process may run on, as kube-proxy's detectNumCPU counts them (at least 1)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """kube-proxy's getConntrackMax: max(maxPerCore x CPUs, min) when maxPerCore > 0, else 0."""
    if max_per_core <= 0:
        return 0
    return max(max_per_core * cpus, minimum)


def conntrack_limits(config: AgentConfig, cpus: int | None = None) -> ConntrackLimits:
    """The connection table's size and timeouts from the agent's conntrack settings."""
    def seconds(value: float, default: int) -> int:
        return max(1, round(value)) if value > 0 else default

    limit = conntrack_max(config.conntrack_max_per_core, config.conntrack_min, cpus or cpu_count())
    return ConntrackLimits(
        max_connections=limit or KERNEL_DEFAULTS.max_connections,
        tcp_established=seconds(config.conntrack_tcp_established_timeout, KERNEL_DEFAULTS.tcp_established),
        tcp_close_wait=seconds(config.conntrack_tcp_close_wait_timeout, KERNEL_DEFAULTS.tcp_close_wait),
        udp=seconds(config.conntrack_udp_timeout, KERNEL_DEFAULTS.udp),
        udp_stream=seconds(config.conntrack_udp_stream_timeout, KERNEL_DEFAULTS.udp_stream),
    )
