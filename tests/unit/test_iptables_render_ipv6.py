"""The ip6tables rules of an IPv6 iptables datapath, against kube-proxy's IPv6 proxier.

kube-proxy runs one proxier per IP family; the IPv6 one writes the same rules as the IPv4 one
with that family's addresses, except (pkg/proxy/iptables/proxier.go, checked upstream):
- localhost NodePorts never work on IPv6: NewNodePortAddresses(IPv6) never "contains IPv4
  loopback", so localhostNodePorts is false whatever the flag (no route_localnet, no
  "block incoming localnet connections" rule in KUBE-FIREWALL);
- the match-all NodePorts jump is `-m addrtype --dst-type LOCAL ! -d ::1/128`;
- with --nodeport-addresses, a loopback address is skipped ("localhost NodePorts are not
  supported on IPv6");
- a bare `-j REJECT` comes back from ip6tables-save as `--reject-with icmp6-port-unreachable`.
The service and addresses are upstream TestNodePorts' IPv6 ones (proxier_test.go: cluster IP
fd00:172:30::41, endpoints fd00:10:180::1 and fd00:10:180::2:1, node IPs 2001:db8::1 and
2001:db8:1::2, pod CIDR fd00:10::/64), whose cases "ipv6, localhost-nodeports enabled",
"ipv6, localhost-nodeports disabled" and "ipv6, localhost-nodeports disabled, multiple
nodeport-addresses" the tests below mirror (expectFirewall false in all three).
"""

from __future__ import annotations

import dataclasses

import pytest

from ebpf_proxy.datapath.iptables import IptablesDatapath, render
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.render import RenderContext, detector_matches
from ebpf_proxy.datapath.iptables.ruleset import Ruleset, full_plan
from ebpf_proxy.explain.audit_iptables import canonical
from ebpf_proxy.model import (
    Endpoint,
    LocalDetector,
    LocalMode,
    NodeConfig,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)

NODE6 = NodeConfig("test-node", family=6, node_ips=("2001:db8::1", "2001:db8:1::2"),
                   cluster_cidrs=("10.0.0.0/8", "fd00:10::/64"))
SVC1 = ServicePortName("ns1", "svc1", "p80", Protocol.TCP)
DNS = ServicePortName("ns1", "dns", "dns", Protocol.UDP)
SVC_CHAIN = ch.svc_chain(SVC1)
EXT_CHAIN = ch.ext_chain(SVC1)
SVL_CHAIN = ch.svl_chain(SVC1)
NODEPORTS_JUMP = ('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the '
                  'last rule in this chain"')


def svc(name: ServicePortName = SVC1, ip: str | None = "fd00:172:30::41", port: int = 80, **kw) -> ServicePort:
    return ServicePort(name=name, cluster_ip=ip, port=port, protocol=name.protocol, **kw)


def ep(ip: str, port: int = 80, *, local: bool = False) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name="test-node" if local else "other-node", is_local=local)


def state(*pairs: tuple[ServicePort, tuple[Endpoint, ...]]) -> ProxyState:
    return ProxyState(services={s.name: s for s, _ in pairs}, endpoints={s.name: eps for s, eps in pairs})


def chain(rs: Ruleset, table: str, name: str) -> list[str]:
    return list(rs.chains(table)[name])


def restore_text(rs: Ruleset) -> str:
    return full_plan(rs, {}).text(rs)


# ---- a whole ruleset -------------------------------------------------------------------------

EXPECTED_NODEPORT_SERVICE = """\
*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x004000/0x004000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-EXT-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-OGYCNMB4EMRUSJ6N - [0:0]
:KUBE-SEP-APSFVWOCYOGIDJM2 - [0:0]
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d fd00:172:30::41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-POSTROUTING -m mark ! --mark 0x004000/0x004000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x004000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d fd00:172:30::41 --dport 80 ! -s fd00:10::/64 -j KUBE-MARK-MASQ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> [fd00:10:180::1]:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-OGYCNMB4EMRUSJ6N
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> [fd00:10:180::2:1]:80" -j KUBE-SEP-APSFVWOCYOGIDJM2
-A KUBE-EXT-XPGD46QRK7WJZT7O -m comment --comment "masquerade traffic for ns1/svc1:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-XPGD46QRK7WJZT7O -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SEP-OGYCNMB4EMRUSJ6N -m comment --comment ns1/svc1:p80 -s fd00:10:180::1 -j KUBE-MARK-MASQ
-A KUBE-SEP-OGYCNMB4EMRUSJ6N -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination [fd00:10:180::1]:80
-A KUBE-SEP-APSFVWOCYOGIDJM2 -m comment --comment ns1/svc1:p80 -s fd00:10:180::2:1 -j KUBE-MARK-MASQ
-A KUBE-SEP-APSFVWOCYOGIDJM2 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination [fd00:10:180::2:1]:80
COMMIT
"""


@pytest.mark.parametrize("localhost_nodeports", [True, False], ids=["localhost-nodeports enabled",
                                                                    "localhost-nodeports disabled"])
def test_ipv6_nodeport_service_renders_kube_proxys_ipv6_rules_exactly(localhost_nodeports):
    """TestNodePorts "ipv6, localhost-nodeports enabled/disabled": the same rules either way,
    KUBE-FIREWALL empty, the NodePorts jump excluding ::1/128, endpoints DNATed to [addr]:port."""
    node = dataclasses.replace(NODE6, localhost_nodeports=localhost_nodeports)
    st = state((svc(node_port=3001), (ep("fd00:10:180::1"), ep("fd00:10:180::2:1", local=True))))
    assert restore_text(render(node, st)) == EXPECTED_NODEPORT_SERVICE
    assert RenderContext.for_node(node).localhost_nodeports is False
    assert RenderContext.for_node(node).family == 6


def test_ipv4_addresses_are_skipped_in_an_ipv6_ruleset():
    """IPv4 node IPs, endpoints, external and LB IPs and source ranges render nothing in ip6tables."""
    node = dataclasses.replace(NODE6, node_ips=(*NODE6.node_ips, "192.168.0.2"))
    st = state((svc(node_port=3001), (ep("fd00:10:180::1"), ep("10.180.0.1"), ep("fd00:10:180::2:1", local=True),
                                      ep("10.180.2.1", local=True))))
    assert restore_text(render(node, st)) == EXPECTED_NODEPORT_SERVICE
    assert RenderContext.for_node(node).node_ips == ("2001:db8::1", "2001:db8:1::2")


def test_a_service_of_the_other_family_renders_nothing_in_either():
    v4 = svc(DNS, "172.30.0.10", 53, node_port=3053)
    v6 = svc(node_port=3001)
    st = state((v4, (ep("10.180.0.1", 53),)), (v6, (ep("fd00:10:180::1"),)))
    six = render(NODE6, st)
    four = render(NodeConfig("test-node", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",)), st)
    assert {c for c in six.chains("nat") if ch.is_service_chain(c)} == {
        SVC_CHAIN, EXT_CHAIN, ch.sep_chain(SVC1, "fd00:10:180::1", 80)}
    assert {c for c in four.chains("nat") if ch.is_service_chain(c)} == {
        ch.svc_chain(DNS), ch.ext_chain(DNS), ch.sep_chain(DNS, "10.180.0.1", 53)}
    assert "172.30.0.10" not in restore_text(six) and "fd00" not in restore_text(four)


def test_mixed_family_external_and_lb_ips_keep_only_the_ipv6_ones():
    s = svc(external_ips=("192.168.99.11", "2001:db8:99::11"), load_balancer_ips=("1.2.3.4", "2001:db8:1b::4"),
            load_balancer_source_ranges=("203.0.113.0/25", "2001:db8:ff::/48"))
    rs = render(NODE6, state((s, (ep("fd00:10:180::1"),))))
    fw = ch.fw_chain(SVC1)
    assert [line for line in chain(rs, "nat", "KUBE-SERVICES") if "-d " in line and "KUBE-NODEPORTS" not in line] == [
        f'-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d fd00:172:30::41 --dport 80 -j {SVC_CHAIN}',
        f'-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 external IP" -m tcp -p tcp -d 2001:db8:99::11 --dport 80 -j {EXT_CHAIN}',
        f'-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 loadbalancer IP" -m tcp -p tcp -d 2001:db8:1b::4 --dport 80 -j {fw}',
    ]
    assert chain(rs, "nat", fw) == [
        f'-A {fw} -m comment --comment "ns1/svc1:p80 loadbalancer IP" -s 2001:db8:ff::/48 -j {EXT_CHAIN}',
        f'-A {fw} -m comment --comment "other traffic to ns1/svc1:p80 will be dropped by KUBE-PROXY-FIREWALL"',
    ]
    assert chain(rs, "filter", "KUBE-PROXY-FIREWALL") == [
        '-A KUBE-PROXY-FIREWALL -m comment --comment "ns1/svc1:p80 traffic not accepted by '
        f'{fw}" -m tcp -p tcp -d 2001:db8:1b::4 --dport 80 -j DROP'
    ]


def test_lb_source_range_holding_an_ipv6_node_ip_admits_the_vip_as_source():
    s = svc(load_balancer_ips=("2001:db8:1b::4",), load_balancer_source_ranges=("2001:db8::/64",))
    rs = render(NODE6, state((s, (ep("fd00:10:180::1"),))))
    assert f'-A {ch.fw_chain(SVC1)} -m comment --comment "ns1/svc1:p80 loadbalancer IP" -s 2001:db8:1b::4 ' \
           f'-j {EXT_CHAIN}' in chain(rs, "nat", ch.fw_chain(SVC1))


# ---- externalTrafficPolicy=Local, no endpoints, affinity -------------------------------------


def test_external_policy_local_short_circuits_ipv6_pods_and_the_node():
    """TestExternalTrafficPolicyLocal's rules, IPv6: pods (-s the IPv6 pod CIDR) and the node
    itself reach every endpoint, outsiders only the local one."""
    s = svc(node_port=3001, external_policy_local=True, health_check_node_port=30000)
    rs = render(NODE6, state((s, (ep("fd00:10:180::1"), ep("fd00:10:180::2:1", local=True)))))
    assert chain(rs, "nat", EXT_CHAIN) == [
        f'-A {EXT_CHAIN} -m comment --comment "pod traffic for ns1/svc1:p80 external destinations" '
        f"-s fd00:10::/64 -j {SVC_CHAIN}",
        f'-A {EXT_CHAIN} -m comment --comment "masquerade LOCAL traffic for ns1/svc1:p80 external destinations" '
        "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
        f'-A {EXT_CHAIN} -m comment --comment "route LOCAL traffic for ns1/svc1:p80 external destinations" '
        f"-m addrtype --src-type LOCAL -j {SVC_CHAIN}",
        f"-A {EXT_CHAIN} -j {SVL_CHAIN}",
    ]
    local_sep = ch.sep_chain(SVC1, "fd00:10:180::2:1", 80)
    assert chain(rs, "nat", SVL_CHAIN) == [
        f'-A {SVL_CHAIN} -m comment --comment "ns1/svc1:p80 -> [fd00:10:180::2:1]:80" -j {local_sep}']
    assert chain(rs, "filter", "KUBE-NODEPORTS") == [
        '-A KUBE-NODEPORTS -m comment --comment "ns1/svc1:p80 health check node port" -m tcp -p tcp '
        "--dport 30000 -j ACCEPT"]


def test_external_policy_local_without_local_ipv6_endpoints_drops_external_traffic():
    s = svc(node_port=3001, external_policy_local=True, external_ips=("2001:db8:99::11",))
    rs = render(NODE6, state((s, (ep("fd00:10:180::1"), ep("10.180.2.1", local=True)))))  # the local one is IPv4
    assert chain(rs, "filter", "KUBE-EXTERNAL-SERVICES") == [
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no local endpoints" -m tcp -p tcp '
        "-d 2001:db8:99::11 --dport 80 -j DROP",
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no local endpoints" -m addrtype '
        "--dst-type LOCAL -m tcp -p tcp --dport 3001 -j DROP",
    ]


def test_no_ipv6_endpoints_reject_with_icmp6_port_unreachable():
    """What ip6tables-save prints for kube-proxy's bare `-j REJECT` (icmp-port-unreachable is IPv4's)."""
    s = svc(node_port=3001, external_ips=("2001:db8:99::11",))
    rs = render(NODE6, state((s, (ep("10.180.0.1"),))))  # IPv4 endpoints do not count in ip6tables
    assert chain(rs, "filter", "KUBE-SERVICES") == [
        '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m tcp -p tcp -d fd00:172:30::41 '
        "--dport 80 -j REJECT --reject-with icmp6-port-unreachable"]
    assert chain(rs, "filter", "KUBE-EXTERNAL-SERVICES") == [
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m tcp -p tcp '
        "-d 2001:db8:99::11 --dport 80 -j REJECT --reject-with icmp6-port-unreachable",
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m addrtype --dst-type LOCAL '
        "-m tcp -p tcp --dport 3001 -j REJECT --reject-with icmp6-port-unreachable",
    ]
    assert not [c for c in rs.chains("nat") if ch.is_service_chain(c)]
    assert "icmp6" not in restore_text(render(NodeConfig("n"), state((svc(DNS, "172.30.0.10", 53), ()))))


def test_session_affinity_on_ipv6_endpoints():
    s = svc(affinity_timeout_seconds=600)
    rs = render(NODE6, state((s, (ep("fd00:10:180::1"),))))
    sep = ch.sep_chain(SVC1, "fd00:10:180::1", 80)
    assert chain(rs, "nat", SVC_CHAIN)[1:] == [
        f'-A {SVC_CHAIN} -m comment --comment "ns1/svc1:p80 -> [fd00:10:180::1]:80" -m recent --name {sep} '
        f"--rcheck --seconds 600 --reap -j {sep}",
        f'-A {SVC_CHAIN} -m comment --comment "ns1/svc1:p80 -> [fd00:10:180::1]:80" -j {sep}',
    ]
    assert chain(rs, "nat", sep)[-1] == (f"-A {sep} -m comment --comment ns1/svc1:p80 -m recent --name {sep} --set "
                                         "-m tcp -p tcp -j DNAT --to-destination [fd00:10:180::1]:80")


# ---- NodePorts: localhost, --nodeport-addresses ----------------------------------------------


def test_no_localnet_firewall_rule_and_no_localhost_nodeports_on_ipv6():
    for flag in (True, False):
        rs = render(dataclasses.replace(NODE6, localhost_nodeports=flag), ProxyState())
        assert chain(rs, "filter", "KUBE-FIREWALL") == []
        assert chain(rs, "nat", "KUBE-SERVICES") == [
            f"{NODEPORTS_JUMP} -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"]
    # the IPv4 rule stays as it was
    four = render(NodeConfig("test-node"), ProxyState())
    assert chain(four, "nat", "KUBE-SERVICES") == [f"{NODEPORTS_JUMP} -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"]
    assert len(chain(four, "filter", "KUBE-FIREWALL")) == 1


@pytest.mark.parametrize("addresses", [("192.168.0.0/24", "127.0.0.0/8"), ("0.0.0.0/0",), ("::/0",),
                                       ("192.168.0.0/24", "::/0")])
def test_nodeport_addresses_without_an_ipv6_cidr_or_with_a_zero_one_match_every_local_address(addresses):
    """NewNodePortAddresses(IPv6, ...): only the IPv6 CIDRs count; none, or ::/0, means match-all."""
    node = dataclasses.replace(NODE6, nodeport_addresses=addresses)
    ctx = RenderContext.for_node(node)
    assert ctx.nodeport_match_all and not ctx.localhost_nodeports
    assert chain(render(node, ProxyState()), "nat", "KUBE-SERVICES") == [
        f"{NODEPORTS_JUMP} -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"]


def test_nodeport_addresses_restrict_ipv6_nodeports_to_matching_node_ips():
    """TestNodePorts "ipv6, localhost-nodeports disabled, multiple nodeport-addresses": only the
    node IP within 2001:db8::/64 takes NodePorts, the alternate 2001:db8:1::2 does not."""
    node = dataclasses.replace(NODE6, nodeport_addresses=("192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"),
                               localhost_nodeports=False)
    rs = render(node, ProxyState())
    assert chain(rs, "nat", "KUBE-SERVICES") == [f"{NODEPORTS_JUMP} -d 2001:db8::1 -j KUBE-NODEPORTS"]


def test_a_loopback_nodeport_address_is_skipped_on_ipv6():
    """"--nodeport-addresses includes localhost but localhost NodePorts are not supported on IPv6"."""
    node = dataclasses.replace(NODE6, node_ips=("2001:db8::1", "::1"), nodeport_addresses=("::1/128", "2001:db8::/64"))
    rs = render(node, ProxyState())
    assert chain(rs, "nat", "KUBE-SERVICES") == [f"{NODEPORTS_JUMP} -d 2001:db8::1 -j KUBE-NODEPORTS"]
    only_loopback = dataclasses.replace(node, nodeport_addresses=("::1/128",))
    assert [line for line in chain(render(only_loopback, ProxyState()), "nat", "KUBE-SERVICES")
            if "KUBE-NODEPORTS" in line] == []
    assert chain(render(only_loopback, ProxyState()), "filter", "KUBE-FIREWALL") == []


# ---- local-traffic detector --------------------------------------------------------------------


def test_cluster_cidr_detector_takes_the_ipv6_cidr():
    node = dataclasses.replace(NODE6, cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/56"))
    rs = render(node, state((svc(), (ep("fd00:10:244:1::5"),))))
    assert chain(rs, "nat", SVC_CHAIN)[0].endswith("--dport 80 ! -s fd00:10:244::/56 -j KUBE-MARK-MASQ")
    assert detector_matches("n", node.detector, 6) == (("-s", "fd00:10:244::/56"), ("!", "-s", "fd00:10:244::/56"))
    assert detector_matches("n", node.detector, 4) == (("-s", "10.244.0.0/16"), ("!", "-s", "10.244.0.0/16"))


def test_node_cidr_detector_takes_the_ipv6_pod_cidr():
    node = dataclasses.replace(NODE6, local_detector=LocalDetector(LocalMode.NODE_CIDR,
                                                                   ("10.244.1.0/24", "fd00:10:244:1::/64")))
    rs = render(node, state((svc(node_port=3001, external_policy_local=True), (ep("fd00:10:244:1::5", local=True),))))
    assert f"-s fd00:10:244:1::/64 -j {SVC_CHAIN}" in chain(rs, "nat", EXT_CHAIN)[0]


def test_an_ipv4_only_cidr_detector_is_a_no_op_for_ipv6():
    node = dataclasses.replace(NODE6, cluster_cidrs=("10.244.0.0/16",))
    rs = render(node, state((svc(), (ep("fd00:10:244:1::5"),))))
    assert not [line for line in chain(rs, "nat", SVC_CHAIN) if "KUBE-MARK-MASQ" in line]


def test_more_than_one_ipv6_cluster_cidr_is_refused_saying_ipv6():
    node = dataclasses.replace(NODE6, node_name="node-x", cluster_cidrs=("10.244.0.0/16", "fd00:10::/64", "fd00:11::/64"))
    with pytest.raises(ValueError, match="node-x.*holds more than one IPv6 CIDR"):
        render(node, ProxyState())
    with pytest.raises(ValueError, match="more than one IPv6 CIDR"):
        IptablesDatapath(node, runner=lambda cmd, stdin=None: None)
    # the same CIDRs are fine for the IPv4 datapath: it takes its one IPv4 CIDR
    assert RenderContext.for_node(dataclasses.replace(node, family=4)).if_local == ("-s", "10.244.0.0/16")


# ---- the audit's canonical form: our IPv6 rules as ip6tables-save prints them ----------------

# (ours, ip6tables-save's), both backends print the same (checked with iptables 1.8.9)
SPELLINGS = [
    ('-m comment --comment "a b" -m tcp -p tcp -d fd00:172:30::41 --dport 80 ! -s fd00:10::/64 -j KUBE-MARK-MASQ',
     '! -s fd00:10::/64 -d fd00:172:30::41/128 -p tcp -m comment --comment "a b" -m tcp --dport 80 -j KUBE-MARK-MASQ'),
    ("-m comment --comment x -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS",
     "! -d ::1/128 -m comment --comment x -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"),
    ("-m comment --comment ns1/svc1:p80 -s fd00:10:180::1 -j KUBE-MARK-MASQ",
     '-s fd00:10:180::1/128 -m comment --comment "ns1/svc1:p80" -j KUBE-MARK-MASQ'),
    ("-m comment --comment ns1/svc1:p80 -m recent --name KUBE-SEP-X --set -m tcp -p tcp -j DNAT "
     "--to-destination [fd00:10:180::1]:80",
     '-p tcp -m comment --comment "ns1/svc1:p80" -m recent --set --name KUBE-SEP-X '
     "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -m tcp -j DNAT --to-destination [fd00:10:180::1]:80"),
    ('-m comment --comment "a b" -m recent --name KUBE-SEP-X --rcheck --seconds 600 --reap -j KUBE-SEP-X',
     '-m comment --comment "a b" -m recent --rcheck --seconds 600 --reap --name KUBE-SEP-X '
     "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -j KUBE-SEP-X"),
    ('-m comment --comment "x y" -m tcp -p tcp -d fd00:172:30::42 --dport 80 -j REJECT '
     "--reject-with icmp6-port-unreachable",
     '-d fd00:172:30::42/128 -p tcp -m comment --comment "x y" -m tcp --dport 80 -j REJECT '
     "--reject-with icmp6-port-unreachable"),
]


@pytest.mark.parametrize("ours, saved", SPELLINGS)
def test_audit_canonical_form_equates_ip6tables_save_spellings(ours, saved):
    import shlex

    assert canonical(shlex.split(ours)) == canonical(shlex.split(saved))


def test_audit_canonical_form_keeps_ipv6_differences():
    import shlex

    dnat = "-j DNAT --to-destination [{}]:80"
    assert canonical(shlex.split(dnat.format("FD00:10:180:0::1"))) == canonical(shlex.split(dnat.format("fd00:10:180::1")))
    assert canonical(shlex.split(dnat.format("fd00:10:180::1"))) != canonical(shlex.split(dnat.format("fd00:10:180::2")))
    assert canonical(shlex.split("-d fd00::1 -j X")) != canonical(shlex.split("-d fd00::1/64 -j X"))
    # a non-default recent mask is a difference
    assert canonical(shlex.split("-m recent --name A --rcheck --mask ffff:ffff:: -j A")) != canonical(
        shlex.split("-m recent --name A --rcheck -j A"))
