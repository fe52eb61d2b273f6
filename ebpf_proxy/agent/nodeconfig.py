"""Which addresses are "this node": the NodeConfig every datapath gets.

kube-proxy's iptables mode matches NodePorts with `-m addrtype --dst-type LOCAL`, i.e. *every*
address of the node, whatever its Node object lists. So the node IPs come from the node's own
interfaces (pyroute2), not from the API. One NodeConfig per IP family the node serves
(`served_families`), as kube-proxy runs a proxier per family; each holds that family's addresses:
- `node_ips`: every local address of the family except loopback, kept only if inside --nodeport-addresses
  when that flag is set. Loopback is left out on purpose: NodePorts on 127.0.0.0/8 are their own
  rule (SEMANTICS rule 8) and are expressed by `localhost_nodeports`.
- `localhost_nodeports`: kube-proxy's --iptables-localhost-nodeports, and only when
  --nodeport-addresses is unset or includes 127.0.0.1 (as kube-proxy decides); never for IPv6,
  where localhost NodePorts do not exist.
- `--nodeport-addresses primary`: the node's primary IP from its Node object (first InternalIP),
  of the family, as /32 or /128; if the Node object has none, every local address, with a warning.
- If the interfaces cannot be read (no netlink), the Node object's InternalIP/ExternalIP are the
  fallback, with a warning.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Sequence

from ebpf_proxy.agent.config import PRIMARY, AgentConfig
from ebpf_proxy.agent.conntrack import conntrack_limits
from ebpf_proxy.model import LocalDetector, LocalMode, NodeConfig, NodeState, networks_of_family, of_family

log = logging.getLogger(__name__)

_LOCALHOST = ipaddress.ip_address("127.0.0.1")


def local_ipv4_addresses() -> list[str]:
    """Every IPv4 address on this network namespace's interfaces (raises OSError without netlink)."""
    return list(of_family(local_addresses(), 4))


def local_addresses() -> list[str]:
    """Every IPv4 and IPv6 address on this network namespace's interfaces, IPv6 link-local ones
    left out (no NodePort is reached through them); raises OSError without netlink."""
    from pyroute2.iproute import IPRoute  # imported here: only the real agent needs netlink

    with IPRoute() as ipr:
        addrs = [msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS") for msg in ipr.get_addr()]
    return list(dict.fromkeys(a for a in addrs if a and not ipaddress.ip_address(a).is_link_local))


def served_families(node: NodeState | None, local_ips: Sequence[str]) -> tuple[int, ...]:
    """The IP families this node proxies, primary first: those of its Node object's addresses
    (kubelet's --node-ip, as kube-proxy takes its primary family from the NodeIPs), else of its
    own non-loopback addresses, else IPv4.

    kube-proxy runs a proxier for every family the host's iptables supports, whatever the node's
    addresses; one for a family the node has no address of would program nothing reachable but
    its cluster IPs, and only on a dual-stack cluster, which gives its nodes both families."""
    if node is not None and node.families:
        return node.families
    local = [ipaddress.ip_address(ip) for ip in local_ips]
    families = tuple(dict.fromkeys(ip.version for ip in local if not ip.is_loopback))
    return families or (4,)


def nodeport_cidrs(config: AgentConfig, node: NodeState | None, family: int = 4) -> tuple[str, ...]:
    if config.nodeport_addresses != (PRIMARY,):
        return config.nodeport_addresses
    primary = node.primary_of(family) if node is not None else None
    if primary:
        return (f"{primary}/{32 if family == 4 else 128}",)
    log.warning(f"--nodeport-addresses primary: this node's Node object has no IPv{family} InternalIP/ExternalIP "
                "yet; using every local address", extra={"field": config.source_of("nodeport_addresses")})
    return ()


def local_detector(config: AgentConfig, node: NodeState | None) -> LocalDetector:
    """kube-proxy's getLocalDetector: the detector --detect-local-mode asks for, or the no-op one
    when its mode has nothing to match on (ClusterCIDR without --cluster-cidr, NodeCIDR on a
    Node without spec.podCIDRs), with one log line saying so, as kube-proxy logs it."""
    mode = LocalMode(config.detect_local_mode)
    if mode is LocalMode.CLUSTER_CIDR:
        if not config.cluster_cidrs:
            log.info("detect-local-mode set to ClusterCIDR, but no cluster CIDR defined: defaulting to no-op "
                     "detect-local (ClusterIP traffic from outside is not masqueraded)",
                     extra={"field": config.source_of("cluster_cidrs")})
            return LocalDetector()
        return LocalDetector(mode, config.cluster_cidrs)
    if mode is LocalMode.NODE_CIDR:
        if node is None or not node.pod_cidrs:
            log.info("detect-local-mode set to NodeCIDR, but no PodCIDR defined at node: defaulting to no-op "
                     "detect-local", extra={"node": config.node_name})
            return LocalDetector()
        return LocalDetector(mode, first_per_family(node.pod_cidrs, node.name))
    if mode is LocalMode.BRIDGE_INTERFACE:
        return LocalDetector(mode, interface=config.pod_bridge_interface)
    return LocalDetector(mode, interface=config.pod_interface_name_prefix)


def first_per_family(cidrs: Sequence[str], node_name: str) -> tuple[str, ...]:
    """The first CIDR of each IP family, as kube-proxy's getLocalDetectors reads a Node's podCIDRs
    (MapCIDRsByIPFamily, then cidrs[0] per family). The API server allows one per family, but the
    agent does not trust that: a Node with two IPv4 podCIDRs made every sync raise (found by
    tests/unit/test_fuzz_k8s.py). The ones left out are logged."""
    first: dict[int, str] = {}
    for cidr in cidrs:
        first.setdefault(ipaddress.ip_network(cidr, strict=False).version, cidr)
    if len(first) < len(cidrs):
        log.warning("Node has more than one podCIDR per IP family; the NodeCIDR local-traffic detector uses the "
                    "first of each, as kube-proxy does",
                    extra={"node": node_name, "field": "spec.podCIDRs", "pod_cidrs": ",".join(cidrs),
                           "used": ",".join(first.values())})
    return tuple(first.values())


def build_node_config(config: AgentConfig, local_ips: Sequence[str], node: NodeState | None,
                      family: int = 4) -> NodeConfig:
    """The NodeConfig of the `family` proxier: that family's addresses only."""
    cidrs = nodeport_cidrs(config, node, family)
    # only this family's CIDRs count: with none of them, every address of the family matches
    # (kube-proxy's NewNodePortAddresses filters the flag per family the same way)
    networks = networks_of_family(cidrs, family)
    candidates = list(local_ips)
    if not candidates and node is not None:
        log.warning("no local addresses read from the interfaces; using the Node object's addresses",
                    extra={"node": node.name, "addresses": ",".join(node.addresses)})
        candidates = list(node.addresses)
    node_ips = []
    for text in candidates:
        ip = ipaddress.ip_address(text)
        if ip.version != family or ip.is_loopback or ip.is_link_local and family == 6:
            continue
        if networks and not any(ip in net for net in networks):
            continue
        if text not in node_ips:
            node_ips.append(text)
    localhost = family == 4 and config.localhost_nodeports and (
        not networks or any(_LOCALHOST in net for net in networks))
    return NodeConfig(
        node_name=config.node_name,
        family=family,
        node_ips=tuple(node_ips),
        cluster_cidrs=config.cluster_cidrs,
        nodeport_addresses=cidrs,
        masquerade_all=config.masquerade_all,
        masquerade_bit=config.masquerade_bit,
        localhost_nodeports=localhost,
        local_detector=local_detector(config, node),
        conntrack=conntrack_limits(config),
    )
