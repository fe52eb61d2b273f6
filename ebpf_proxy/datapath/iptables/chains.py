"""Chain names and the fixed jump rules, exactly as kube-proxy's iptables proxier names them.

Names must be stable across syncs and across agent restarts (a partial sync rewrites only the
chains that changed, and a restarted agent must recognise the chains a previous run left), and
they must equal kube-proxy's so that rules read the same as on a kube-proxy node: sha256 of the
service port name + lower-case protocol (+ endpoint "ip:port" for KUBE-SEP), base32, first 16
characters. iptables limits chain names to 28 characters, hence the truncation.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from ebpf_proxy.model import ServicePortName

NAT = "nat"
FILTER = "filter"

KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
# kube-proxy shares this one with kubelet (it holds only the anti-martian rule for localhost NodePorts).
KUBE_FIREWALL = "KUBE-FIREWALL"

SVC_PREFIX = "KUBE-SVC-"
SVL_PREFIX = "KUBE-SVL-"
EXT_PREFIX = "KUBE-EXT-"
FW_PREFIX = "KUBE-FW-"
SEP_PREFIX = "KUBE-SEP-"
SERVICE_CHAIN_PREFIXES = (SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX)

# The top-level chains every sync declares (and so rewrites), in kube-proxy's order.
TOP_LEVEL_CHAINS: dict[str, tuple[str, ...]] = {
    FILTER: (
        KUBE_SERVICES,
        KUBE_EXTERNAL_SERVICES,
        KUBE_FORWARD,
        KUBE_NODEPORTS,
        KUBE_PROXY_FIREWALL,
        KUBE_FIREWALL,
    ),
    NAT: (KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ),
}


def _hash16(text: str) -> str:
    """kube-proxy's base32(sha256(text))[:16]. Base32 encodes each 5 bytes into 8 characters on
    their own, so the first 16 characters are those of the first 10 bytes: only they are encoded
    (base64's base32 is Python; the whole digest took a third of rendering 10,000 Services)."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()[:10]).decode()


def port_proto_hash(name: ServicePortName) -> str:
    """kube-proxy's portProtoHash: the 16-character suffix shared by a service port's chains."""
    return _hash16(str(name) + name.protocol.lower)


def svc_chain(name: ServicePortName) -> str:
    """Dispatch to the cluster-wide endpoints (externalTrafficPolicy/internalTrafficPolicy Cluster)."""
    return SVC_PREFIX + port_proto_hash(name)


def svl_chain(name: ServicePortName) -> str:
    """Dispatch to this node's endpoints only (a traffic policy of Local)."""
    return SVL_PREFIX + port_proto_hash(name)


def ext_chain(name: ServicePortName) -> str:
    """Entry for external destinations (NodePort, externalIPs, LB IPs): masquerade and short-circuits."""
    return EXT_PREFIX + port_proto_hash(name)


def fw_chain(name: ServicePortName) -> str:
    """loadBalancerSourceRanges filter in front of the EXT chain."""
    return FW_PREFIX + port_proto_hash(name)


def service_chains(name: ServicePortName) -> tuple[str, str, str, str]:
    """(SVC, SVL, EXT, FW) chains of `name`, from one hash: they share its suffix."""
    suffix = port_proto_hash(name)
    return SVC_PREFIX + suffix, SVL_PREFIX + suffix, EXT_PREFIX + suffix, FW_PREFIX + suffix


def join_host_port(ip: str, port: int) -> str:
    """Go's net.JoinHostPort: kube-proxy's endpoint string, which is part of the SEP hash. As Go
    does, a host with a colon (an IPv6 address) is bracketed; no parse."""
    if ":" in ip:
        return f"[{ip}]:{port}"
    return f"{ip}:{port}"


def sep_chain(name: ServicePortName, ip: str, port: int) -> str:
    """One endpoint of one service port: hairpin masquerade and the DNAT."""
    return SEP_PREFIX + _hash16(str(name) + name.protocol.lower + join_host_port(ip, port))


def is_service_chain(chain: str) -> bool:
    """True for the per-service chains this datapath creates and garbage-collects."""
    return chain.startswith(SERVICE_CHAIN_PREFIXES)


@dataclass(frozen=True)
class JumpRule:
    """A rule in a built-in chain that sends packets into one of ours.

    These live in chains we do not own (PREROUTING, INPUT, ...), so they cannot be part of the
    `iptables-restore --noflush` input without flushing other software's rules: they are ensured
    one by one with `iptables -C`/`-I`, as kube-proxy does.
    """

    table: str
    chain: str  # the built-in chain holding the jump
    target: str
    args: tuple[str, ...]  # matches, comment included, without "-j target"

    @property
    def rule_args(self) -> tuple[str, ...]:
        return (*self.args, "-j", self.target)

    @property
    def saved_line(self) -> str:
        """The rule as iptables-save prints it (both backends: our options in this order, a value
        with spaces in double quotes). Finding this line in a save proves the jump is there; not
        finding it proves nothing (another iptables may spell it otherwise): `iptables -C` decides."""
        return " ".join(("-A", self.chain, *(f'"{w}"' if " " in w else w for w in self.rule_args)))


def _jump(table: str, chain: str, target: str, comment: str | None, *extra: str) -> JumpRule:
    args = (*extra, "-m", "comment", "--comment", comment) if comment else tuple(extra)
    return JumpRule(table, chain, target, args)


_NEW = ("-m", "conntrack", "--ctstate", "NEW")

# kube-proxy's iptablesJumpChains followed by the two kubelet duplicates it also ensures. Each is
# inserted at position 1 when missing, so the last one ensured ends up first in its chain.
JUMP_RULES: tuple[JumpRule, ...] = (
    _jump(FILTER, "INPUT", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", *_NEW),
    _jump(FILTER, "FORWARD", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", *_NEW),
    _jump(FILTER, "INPUT", KUBE_NODEPORTS, "kubernetes health check service ports"),
    _jump(FILTER, "FORWARD", KUBE_SERVICES, "kubernetes service portals", *_NEW),
    _jump(FILTER, "OUTPUT", KUBE_SERVICES, "kubernetes service portals", *_NEW),
    _jump(FILTER, "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules"),
    _jump(FILTER, "INPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", *_NEW),
    _jump(FILTER, "OUTPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", *_NEW),
    _jump(FILTER, "FORWARD", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", *_NEW),
    _jump(NAT, "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
    _jump(NAT, "PREROUTING", KUBE_SERVICES, "kubernetes service portals"),
    _jump(NAT, "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules"),
    _jump(FILTER, "INPUT", KUBE_FIREWALL, None),
    _jump(FILTER, "OUTPUT", KUBE_FIREWALL, None),
)

# per table, the built-in chains our jumps go in: the only chains not ours whose rules a full sync
# and the drift audit read
JUMP_CHAINS: dict[str, frozenset[str]] = {
    table: frozenset(j.chain for j in JUMP_RULES if j.table == table) for table in (FILTER, NAT)
}
