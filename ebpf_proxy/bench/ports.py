"""Which backend port each (mode, path) uses, and what the bench's measured Services are called.

Every (mode, path) pair gets its own backend port. One backend ip:port reached both directly and
through a VIP within TIME_WAIT's lifetime trips PAWS (the kernel randomises the TCP timestamp
offset per address pair, so the backend sees timestamps jump backwards) and the rate collapses
(shared/PLATFORM.md, pitfall 3); giving each pair its own port keeps the points independent. The
bench topology's pods listen on exactly these ports; a unit test checks the two agree.
"""

from __future__ import annotations

MODES = ("direct", "iptables", "ebpf")
PROXY_MODES = ("iptables", "ebpf")  # modes that run an agent
PODIP = "podip"  # the pod IPs with the mode's agents on: what the mode costs traffic no Service translates
TCP_PATHS = ("clusterip", "nodeport-cluster", "nodeport-local", "clusterip6", PODIP)
DIRECT = "direct"
DIRECT6 = "direct6"  # the pod IPs over IPv6: the physical limit beside clusterip6
DIRECT_OF = {"clusterip6": DIRECT6}  # the direct path a TCP path compares with (default: DIRECT)
IPV6_PATHS = frozenset(("clusterip6", DIRECT6))  # measured over IPv6 (a dual-stack bench topology)

# (mode, path) -> backend TCP port; (mode, "udp-" + path) -> backend UDP port.
_MODE_BASE = {"direct": 8100, "iptables": 8210, "ebpf": 8310}
_UDP_BASE = {"direct": 9100, "iptables": 9210, "ebpf": 9310}

SERVICE_PORT = 80  # every measured ClusterIP listens on this port
UDP_SERVICE_PORT = 53
FILLER_PORT = 7000  # backend port of the filler and churn endpoints: nothing listens, nothing connects

# The measured Services. They count towards --services (with fewer than this many, all are still
# installed). `churn` is the Service whose endpoints change when there are no fillers to change.
SVC_CLUSTERIP = "bench-clusterip"
SVC_NODEPORT_CLUSTER = "bench-np-cluster"
SVC_NODEPORT_LOCAL = "bench-np-local"
SVC_UDP = "bench-udp"
SVC_CHURN = "bench-churn"
SVC_CLUSTERIP6 = "bench-clusterip6"  # IPv6 single-stack
MEASURED_SERVICES = (SVC_CLUSTERIP, SVC_NODEPORT_CLUSTER, SVC_NODEPORT_LOCAL, SVC_UDP, SVC_CHURN, SVC_CLUSTERIP6)
PATH_SERVICE = {"clusterip": SVC_CLUSTERIP, "nodeport-cluster": SVC_NODEPORT_CLUSTER,
                "nodeport-local": SVC_NODEPORT_LOCAL, "clusterip6": SVC_CLUSTERIP6}


def tcp_port(mode: str, path: str) -> int:
    """Backend TCP port for `path` measured in `mode` (mode "direct" has the paths "direct" and
    "direct6")."""
    if mode == "direct":
        if path not in (DIRECT, DIRECT6):
            raise ValueError(f"mode direct has only the paths {DIRECT!r} and {DIRECT6!r}, not {path!r}")
        return _MODE_BASE["direct"] + (path == DIRECT6)
    if mode not in _MODE_BASE or path not in TCP_PATHS:
        raise ValueError(f"no backend port for mode {mode!r}, path {path!r}")
    return _MODE_BASE[mode] + TCP_PATHS.index(path)


def udp_port(mode: str) -> int:
    """Backend UDP port for mode's UDP point (ClusterIP for proxy modes, the pod IP for direct)."""
    if mode not in _UDP_BASE:
        raise ValueError(f"no UDP backend port for mode {mode!r}")
    return _UDP_BASE[mode]


def all_ports() -> dict[str, set[int]]:
    """{'tcp': {...}, 'udp': {...}}: what every backend pod must listen on."""
    tcp = {tcp_port("direct", DIRECT), tcp_port("direct", DIRECT6)} | {tcp_port(m, p) for m in PROXY_MODES
                                                                         for p in TCP_PATHS}
    return {"tcp": tcp, "udp": {udp_port(m) for m in MODES}}
