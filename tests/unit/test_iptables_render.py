"""The iptables datapath without root: rendering against kube-proxy's rules, restore plans, and the
sync logic (full vs. partial, failure, cleanup) against an in-memory model of iptables that
enforces what the kernel enforces (chains must exist, referenced chains cannot be deleted)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from ebpf_proxy.datapath.iptables import IptablesDatapath, RestoreError, render
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.conntrack import StaleFilter, stale_filters
from ebpf_proxy.datapath.iptables.render import RenderContext, probability
from ebpf_proxy.datapath.iptables.ruleset import Ruleset, full_plan, parse_save, partial_plan
from ebpf_proxy.model import (
    ChangeSet,
    Endpoint,
    NodeConfig,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)

CIDR = "10.244.0.0/16"
NODE = NodeConfig("node-a", node_ips=("192.168.1.10",), cluster_cidrs=(CIDR,))
WEB = ServicePortName("ns1", "web", "http", Protocol.TCP)
DNS = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)


def svc(name: ServicePortName = WEB, ip: str | None = "10.96.0.10", port: int = 80, **kw) -> ServicePort:
    return ServicePort(name=name, cluster_ip=ip, port=port, protocol=name.protocol, **kw)


def ep(ip: str, port: int = 8080, *, local: bool = False, **kw) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name="node-a" if local else "node-b", is_local=local, **kw)


def state(*pairs: tuple[ServicePort, tuple[Endpoint, ...]]) -> ProxyState:
    return ProxyState(services={s.name: s for s, _ in pairs}, endpoints={s.name: eps for s, eps in pairs})


def chain(rs: Ruleset, table: str, name: str) -> list[str]:
    return list(rs.chains(table)[name])


def grep(rs: Ruleset, table: str, name: str, needle: str) -> list[str]:
    return [line for line in chain(rs, table, name) if needle in line]


SVC = ch.svc_chain(WEB)
SVL = ch.svl_chain(WEB)
EXT = ch.ext_chain(WEB)
FW = ch.fw_chain(WEB)


# ---- chain names ---------------------------------------------------------------------------


def test_chain_names_equal_kube_proxys():
    # Values from kube-proxy's own proxier tests: same hash input, same names.
    name = ServicePortName("ns1", "svc1", "p80", Protocol.TCP)
    assert ch.svc_chain(name) == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert ch.sep_chain(name, "10.180.0.1", 80) == "KUBE-SEP-SXIVWICOYRO3J4NJ"
    assert ch.ext_chain(name) == "KUBE-EXT-XPGD46QRK7WJZT7O"
    assert ch.svl_chain(name) == "KUBE-SVL-XPGD46QRK7WJZT7O"
    assert ch.fw_chain(name) == "KUBE-FW-XPGD46QRK7WJZT7O"
    assert ch.service_chains(name) == (ch.svc_chain(name), ch.svl_chain(name), ch.ext_chain(name), ch.fw_chain(name))


def test_chain_names_depend_on_protocol_and_port_name_and_fit_iptables():
    tcp = ServicePortName("ns", "s", "p", Protocol.TCP)
    udp = ServicePortName("ns", "s", "p", Protocol.UDP)
    other = ServicePortName("ns", "s", "q", Protocol.TCP)
    assert len({ch.svc_chain(tcp), ch.svc_chain(udp), ch.svc_chain(other)}) == 3
    assert ch.sep_chain(tcp, "10.0.0.1", 80) != ch.sep_chain(tcp, "10.0.0.1", 81)
    assert all(len(c) <= 28 for c in (ch.svc_chain(tcp), ch.sep_chain(tcp, "10.0.0.1", 80), ch.fw_chain(tcp)))


def test_chain_names_stable_across_renders_and_states():
    a = render(NODE, state((svc(), (ep("10.244.1.2"),))))
    b = render(NODE, state((svc(), (ep("10.244.1.2"), ep("10.244.2.2"))), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))))
    assert SVC in a.chains("nat") and SVC in b.chains("nat")
    assert ch.sep_chain(WEB, "10.244.1.2", 8080) in a.chains("nat")
    assert ch.sep_chain(WEB, "10.244.1.2", 8080) in b.chains("nat")
    assert chain(a, "nat", ch.sep_chain(WEB, "10.244.1.2", 8080)) == chain(b, "nat", ch.sep_chain(WEB, "10.244.1.2", 8080))


def test_ipv6_endpoint_string_is_bracketed():
    assert ch.join_host_port("fd00::1", 80) == "[fd00::1]:80"


# ---- rule 1-3: ClusterIP -------------------------------------------------------------------


def test_cluster_ip_rules_exact():
    rs = render(NODE, state((svc(), (ep("10.244.1.2"),))))
    sep = ch.sep_chain(WEB, "10.244.1.2", 8080)
    assert grep(rs, "nat", "KUBE-SERVICES", "10.96.0.10") == [
        f'-A KUBE-SERVICES -m comment --comment "ns1/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j {SVC}'
    ]
    assert chain(rs, "nat", SVC) == [
        f'-A {SVC} -m comment --comment "ns1/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 '
        f"! -s {CIDR} -j KUBE-MARK-MASQ",
        f'-A {SVC} -m comment --comment "ns1/web:http -> 10.244.1.2:8080" -j {sep}',
    ]
    # Hairpin (rule 3) first, then the DNAT.
    assert chain(rs, "nat", sep) == [
        f"-A {sep} -m comment --comment ns1/web:http -s 10.244.1.2 -j KUBE-MARK-MASQ",
        f"-A {sep} -m comment --comment ns1/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080",
    ]
    assert not grep(rs, "filter", "KUBE-SERVICES", "10.96.0.10")
    assert EXT not in rs.chains("nat")  # not externally accessible


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, [None]),
        (2, ["0.5000000000", None]),
        (3, ["0.3333333333", "0.5000000000", None]),
        (4, ["0.2500000000", "0.3333333333", "0.5000000000", None]),
    ],
)
def test_probability_chain_exact(n, expected):
    eps = tuple(ep(f"10.244.{i}.2") for i in range(1, n + 1))
    rs = render(NODE, state((svc(), eps)))
    lines = [line for line in chain(rs, "nat", SVC) if "KUBE-SEP-" in line]
    assert len(lines) == n
    for line, e, prob in zip(lines, eps, expected):
        sep = ch.sep_chain(WEB, e.ip, 8080)
        comment = f'-m comment --comment "ns1/web:http -> {e.ip}:8080"'
        stat = f" -m statistic --mode random --probability {prob}" if prob else ""
        assert line == f"-A {SVC} {comment}{stat} -j {sep}"


def test_probability_format_matches_kube_proxy():
    assert [probability(n) for n in (1, 2, 3, 7)] == ["1.0000000000", "0.5000000000", "0.3333333333", "0.1428571429"]


def test_masquerade_all_marks_every_cluster_ip_flow():
    node = NodeConfig("node-a", cluster_cidrs=(CIDR,), masquerade_all=True)
    rs = render(node, state((svc(), (ep("10.244.1.2"),))))
    assert chain(rs, "nat", SVC)[0].endswith("--dport 80 -j KUBE-MARK-MASQ")
    assert "! -s" not in chain(rs, "nat", SVC)[0]


def test_without_cluster_cidr_there_is_no_off_cluster_masquerade():
    node = NodeConfig("node-a")
    rs = render(node, state((svc(), (ep("10.244.1.2"),))))
    assert not grep(rs, "nat", SVC, "KUBE-MARK-MASQ")


def test_more_than_one_ipv4_cluster_cidr_is_refused_naming_the_node():
    node = NodeConfig("node-x", cluster_cidrs=("10.244.0.0/16", "10.245.0.0/16"))
    with pytest.raises(ValueError, match="node-x"):
        render(node, ProxyState())
    with pytest.raises(ValueError, match="node-x"):
        IptablesDatapath(node, runner=FakeIptables())


def test_terminating_endpoints_serve_when_none_is_ready():
    eps = (ep("10.244.1.2", ready=False, serving=True, terminating=True), ep("10.244.1.3", ready=False, serving=False))
    rs = render(NODE, state((svc(), eps)))
    assert grep(rs, "nat", SVC, "KUBE-SEP-") == [
        f'-A {SVC} -m comment --comment "ns1/web:http -> 10.244.1.2:8080" -j {ch.sep_chain(WEB, "10.244.1.2", 8080)}'
    ]


def test_headless_and_ipv6_services_are_not_programmed():
    rs = render(NODE, state((svc(ip=None), (ep("10.244.1.2"),)), (svc(DNS, "fd00::10", 53), (ep("fd00::2", 53),))))
    assert not [c for c in rs.chains("nat") if ch.is_service_chain(c)]
    assert chain(rs, "nat", "KUBE-SERVICES") == [chain(rs, "nat", "KUBE-SERVICES")[-1]]  # only the nodeports jump


def test_sctp_uses_the_sctp_match():
    name = ServicePortName("ns1", "sig", "", Protocol.SCTP)
    rs = render(NODE, state((svc(name, "10.96.0.40", 3868), (ep("10.244.1.2", 3868),))))
    sep = ch.sep_chain(name, "10.244.1.2", 3868)
    assert "-m sctp -p sctp -d 10.96.0.40 --dport 3868" in grep(rs, "nat", "KUBE-SERVICES", "10.96.0.40")[0]
    assert chain(rs, "nat", sep)[1].endswith("-m sctp -p sctp -j DNAT --to-destination 10.244.1.2:3868")


# ---- rule 4-8, 11: external traffic ---------------------------------------------------------


def test_nodeport_cluster_policy_masquerades_then_any_endpoint():
    rs = render(NODE, state((svc(node_port=30080), (ep("10.244.1.2"),))))
    assert chain(rs, "nat", "KUBE-NODEPORTS") == [
        f"-A KUBE-NODEPORTS -m comment --comment ns1/web:http -m tcp -p tcp --dport 30080 -j {EXT}"
    ]
    assert chain(rs, "nat", EXT) == [
        f'-A {EXT} -m comment --comment "masquerade traffic for ns1/web:http external destinations" -j KUBE-MARK-MASQ',
        f"-A {EXT} -j {SVC}",
    ]


def test_nodeport_local_policy_short_circuits_pods_and_node_then_local_endpoints():
    eps = (ep("10.244.1.2", local=True), ep("10.244.2.2"))
    rs = render(NODE, state((svc(node_port=30080, external_policy_local=True), eps)))
    assert chain(rs, "nat", EXT) == [
        f'-A {EXT} -m comment --comment "pod traffic for ns1/web:http external destinations" -s {CIDR} -j {SVC}',
        f'-A {EXT} -m comment --comment "masquerade LOCAL traffic for ns1/web:http external destinations" '
        "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
        f'-A {EXT} -m comment --comment "route LOCAL traffic for ns1/web:http external destinations" '
        f"-m addrtype --src-type LOCAL -j {SVC}",
        f"-A {EXT} -j {SVL}",
    ]
    assert grep(rs, "nat", SVL, "KUBE-SEP-") == [
        f'-A {SVL} -m comment --comment "ns1/web:http -> 10.244.1.2:8080" -j {ch.sep_chain(WEB, "10.244.1.2", 8080)}'
    ]
    assert len(grep(rs, "nat", SVC, "KUBE-SEP-")) == 2  # cluster chain for pods and the node
    assert {ch.sep_chain(WEB, e.ip, 8080) for e in eps} <= set(rs.chains("nat"))
    assert not rs.chains("filter")["KUBE-EXTERNAL-SERVICES"]


def test_local_policy_without_local_endpoints_drops_external_but_keeps_short_circuits():
    s = svc(node_port=30080, external_ips=("203.0.113.5",), load_balancer_ips=("198.51.100.7",),
            external_policy_local=True)
    rs = render(NODE, state((s, (ep("10.244.2.2"),))))
    comment = '-m comment --comment "ns1/web:http has no local endpoints"'
    assert chain(rs, "filter", "KUBE-EXTERNAL-SERVICES") == [
        f"-A KUBE-EXTERNAL-SERVICES {comment} -m tcp -p tcp -d 203.0.113.5 --dport 80 -j DROP",
        f"-A KUBE-EXTERNAL-SERVICES {comment} -m tcp -p tcp -d 198.51.100.7 --dport 80 -j DROP",
        f"-A KUBE-EXTERNAL-SERVICES {comment} -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j DROP",
    ]
    # EXT still exists for pods and the node, with no fall-through to a local chain.
    assert len(chain(rs, "nat", EXT)) == 3 and all(SVL not in line for line in chain(rs, "nat", EXT))
    assert SVL not in rs.chains("nat")
    # The clusterIP still works (rule 1) and external IPs / LB IPs / nodeport still enter EXT.
    assert grep(rs, "nat", "KUBE-SERVICES", "cluster IP")
    assert grep(rs, "nat", "KUBE-SERVICES", "203.0.113.5")[0].endswith(f"-j {EXT}")
    assert grep(rs, "nat", "KUBE-SERVICES", "198.51.100.7")[0].endswith(f"-j {EXT}")
    assert chain(rs, "nat", "KUBE-NODEPORTS")[0].endswith(f"-j {EXT}")


def test_external_ips_and_lb_ips_enter_the_ext_chain_in_kube_proxy_order():
    s = svc(external_ips=("203.0.113.5",), load_balancer_ips=("198.51.100.7",))
    rs = render(NODE, state((s, (ep("10.244.1.2"),))))
    assert chain(rs, "nat", "KUBE-SERVICES")[:3] == [
        f'-A KUBE-SERVICES -m comment --comment "ns1/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j {SVC}',
        f'-A KUBE-SERVICES -m comment --comment "ns1/web:http external IP" -m tcp -p tcp -d 203.0.113.5 --dport 80 -j {EXT}',
        f'-A KUBE-SERVICES -m comment --comment "ns1/web:http loadbalancer IP" -m tcp -p tcp -d 198.51.100.7 --dport 80 -j {EXT}',
    ]


def test_nodeports_jump_is_the_last_rule_of_kube_services():
    rs = render(NODE, state((svc(node_port=30080), (ep("10.244.1.2"),)), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))))
    assert chain(rs, "nat", "KUBE-SERVICES")[-1] == (
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule '
        'in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS'
    )
    assert sum("KUBE-NODEPORTS" in line for line in chain(rs, "nat", "KUBE-SERVICES")) == 1


def test_localhost_nodeports_disabled_excludes_loopback_and_drops_the_firewall_rule():
    on = render(NODE, ProxyState())
    assert "127.0.0.0/8" not in chain(on, "nat", "KUBE-SERVICES")[-1]
    assert chain(on, "filter", "KUBE-FIREWALL") == [
        '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 '
        "! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
    ]
    off = render(NodeConfig("node-a", localhost_nodeports=False), ProxyState())
    assert chain(off, "nat", "KUBE-SERVICES")[-1].endswith(
        "-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS"
    )
    assert chain(off, "filter", "KUBE-FIREWALL") == []


def test_nodeport_addresses_restrict_the_jump_to_matching_node_ips():
    node = NodeConfig("node-a", node_ips=("192.168.1.10", "10.0.0.5", "fd00::5"), nodeport_addresses=("192.168.1.0/24",))
    rs = render(node, ProxyState())
    jumps = grep(rs, "nat", "KUBE-SERVICES", "KUBE-NODEPORTS")
    assert jumps == [
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule '
        'in this chain" -d 192.168.1.10 -j KUBE-NODEPORTS'
    ]
    assert RenderContext.for_node(node).localhost_nodeports is False  # 127.0.0.1 not in the CIDRs
    assert chain(rs, "filter", "KUBE-FIREWALL") == []


def test_nodeport_addresses_with_loopback_keep_localhost_nodeports():
    node = NodeConfig("node-a", node_ips=("192.168.1.10",), nodeport_addresses=("192.168.1.0/24", "127.0.0.0/8"))
    rs = render(node, ProxyState())
    dests = [line.split(" -d ")[1].split()[0] for line in grep(rs, "nat", "KUBE-SERVICES", "KUBE-NODEPORTS")]
    assert dests == ["192.168.1.10", "127.0.0.1"]
    off = render(NodeConfig("node-a", node_ips=("192.168.1.10",), nodeport_addresses=("127.0.0.0/8", "192.168.1.0/24"),
                            localhost_nodeports=False), ProxyState())
    assert [line for line in chain(off, "nat", "KUBE-SERVICES") if "127.0.0.1" in line] == []


def test_nodeport_addresses_zero_cidr_means_every_local_address():
    node = NodeConfig("node-a", node_ips=("192.168.1.10",), nodeport_addresses=("0.0.0.0/0",))
    assert "--dst-type LOCAL" in chain(render(node, ProxyState()), "nat", "KUBE-SERVICES")[-1]


def test_health_check_node_port_is_accepted():
    s = svc(node_port=30080, external_policy_local=True, health_check_node_port=32100)
    rs = render(NODE, state((s, ())))
    assert chain(rs, "filter", "KUBE-NODEPORTS") == [
        '-A KUBE-NODEPORTS -m comment --comment "ns1/web:http health check node port" -m tcp -p tcp --dport 32100 -j ACCEPT'
    ]


# ---- rule 9: no endpoints -------------------------------------------------------------------


def test_no_endpoints_rejects_every_frontend_and_programs_no_nat():
    s = svc(node_port=30080, external_ips=("203.0.113.5",), load_balancer_ips=("198.51.100.7",))
    rs = render(NODE, state((s, (ep("10.244.1.2", ready=False, serving=False),))))
    reject = "-j REJECT --reject-with icmp-port-unreachable"
    comment = '-m comment --comment "ns1/web:http has no endpoints"'
    assert chain(rs, "filter", "KUBE-SERVICES") == [
        f"-A KUBE-SERVICES {comment} -m tcp -p tcp -d 10.96.0.10 --dport 80 {reject}"
    ]
    assert chain(rs, "filter", "KUBE-EXTERNAL-SERVICES") == [
        f"-A KUBE-EXTERNAL-SERVICES {comment} -m tcp -p tcp -d 203.0.113.5 --dport 80 {reject}",
        f"-A KUBE-EXTERNAL-SERVICES {comment} -m tcp -p tcp -d 198.51.100.7 --dport 80 {reject}",
        f"-A KUBE-EXTERNAL-SERVICES {comment} -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 {reject}",
    ]
    assert not [c for c in rs.chains("nat") if ch.is_service_chain(c)]
    assert len(chain(rs, "nat", "KUBE-SERVICES")) == 1 and not chain(rs, "nat", "KUBE-NODEPORTS")


def test_local_policy_with_no_endpoints_anywhere_rejects_rather_than_drops():
    rs = render(NODE, state((svc(node_port=30080, external_policy_local=True), ())))
    assert chain(rs, "filter", "KUBE-EXTERNAL-SERVICES")[0].endswith("-j REJECT --reject-with icmp-port-unreachable")


# ---- rule 12: internalTrafficPolicy=Local ---------------------------------------------------


def test_internal_local_without_local_endpoints_drops_cluster_ip_traffic():
    rs = render(NODE, state((svc(internal_policy_local=True), (ep("10.244.2.2"),))))
    assert chain(rs, "filter", "KUBE-SERVICES") == [
        '-A KUBE-SERVICES -m comment --comment "ns1/web:http has no local endpoints" '
        "-m tcp -p tcp -d 10.96.0.10 --dport 80 -j DROP"
    ]
    assert not [c for c in rs.chains("nat") if ch.is_service_chain(c)]


def test_internal_local_with_local_endpoint_uses_the_local_chain():
    eps = (ep("10.244.1.2", local=True), ep("10.244.2.2"))
    rs = render(NODE, state((svc(internal_policy_local=True), eps)))
    assert grep(rs, "nat", "KUBE-SERVICES", "cluster IP")[0].endswith(f"-j {SVL}")
    assert chain(rs, "nat", SVL)[0].endswith(f"! -s {CIDR} -j KUBE-MARK-MASQ")
    assert len(grep(rs, "nat", SVL, "KUBE-SEP-")) == 1
    assert SVC not in rs.chains("nat")
    assert ch.sep_chain(WEB, "10.244.2.2", 8080) not in rs.chains("nat")


def test_internal_local_external_cluster_keeps_nodeport_on_all_endpoints():
    s = svc(node_port=30080, internal_policy_local=True)
    rs = render(NODE, state((s, (ep("10.244.2.2"),))))
    assert chain(rs, "filter", "KUBE-SERVICES")[0].endswith("-j DROP")
    assert chain(rs, "nat", EXT)[-1] == f"-A {EXT} -j {SVC}"
    assert len(grep(rs, "nat", SVC, "KUBE-SEP-")) == 1


# ---- rule 11: loadBalancerSourceRanges ------------------------------------------------------


def test_source_ranges_filter_lb_traffic():
    s = svc(load_balancer_ips=("198.51.100.7",), load_balancer_source_ranges=("203.0.113.0/24", "10.1.2.3/32"))
    rs = render(NODE, state((s, (ep("10.244.1.2"),))))
    assert grep(rs, "nat", "KUBE-SERVICES", "198.51.100.7")[0].endswith(f"-j {FW}")
    assert chain(rs, "nat", FW) == [
        f'-A {FW} -m comment --comment "ns1/web:http loadbalancer IP" -s 203.0.113.0/24 -j {EXT}',
        f'-A {FW} -m comment --comment "ns1/web:http loadbalancer IP" -s 10.1.2.3/32 -j {EXT}',
        f'-A {FW} -m comment --comment "other traffic to ns1/web:http will be dropped by KUBE-PROXY-FIREWALL"',
    ]
    assert chain(rs, "filter", "KUBE-PROXY-FIREWALL") == [
        f'-A KUBE-PROXY-FIREWALL -m comment --comment "ns1/web:http traffic not accepted by {FW}" '
        "-m tcp -p tcp -d 198.51.100.7 --dport 80 -j DROP"
    ]


def test_source_range_containing_the_node_admits_the_vip_as_source():
    s = svc(load_balancer_ips=("198.51.100.7",), load_balancer_source_ranges=("192.168.0.0/16",))
    rs = render(NODE, state((s, (ep("10.244.1.2"),))))
    assert f'-A {FW} -m comment --comment "ns1/web:http loadbalancer IP" -s 198.51.100.7 -j {EXT}' in chain(rs, "nat", FW)


def test_source_ranges_without_lb_ips_or_endpoints_create_no_firewall():
    s = svc(external_ips=("203.0.113.5",), load_balancer_source_ranges=("203.0.113.0/24",))
    rs = render(NODE, state((s, (ep("10.244.1.2"),))))
    assert FW not in rs.chains("nat") and not chain(rs, "filter", "KUBE-PROXY-FIREWALL")


# ---- rule 13: session affinity --------------------------------------------------------------


def test_session_affinity_checks_recent_before_the_random_spread():
    eps = (ep("10.244.1.2"), ep("10.244.2.2"))
    rs = render(NODE, state((svc(affinity_timeout_seconds=600), eps)))
    seps = [ch.sep_chain(WEB, e.ip, 8080) for e in eps]
    lines = chain(rs, "nat", SVC)[1:]
    assert lines[:2] == [
        f'-A {SVC} -m comment --comment "ns1/web:http -> {e.ip}:8080" -m recent --name {sep} --rcheck '
        f"--seconds 600 --reap -j {sep}"
        for e, sep in zip(eps, seps)
    ]
    assert "--probability 0.5000000000" in lines[2] and lines[3].endswith(f"-j {seps[1]}")
    assert chain(rs, "nat", seps[0])[1] == (
        f"-A {seps[0]} -m comment --comment ns1/web:http -m recent --name {seps[0]} --set "
        "-m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080"
    )


# ---- fixed chains, large clusters -----------------------------------------------------------


def test_masquerade_plumbing_uses_the_configured_bit():
    rs = render(NodeConfig("node-a", masquerade_bit=15), ProxyState())
    assert chain(rs, "nat", "KUBE-MARK-MASQ") == ["-A KUBE-MARK-MASQ -j MARK --or-mark 0x008000"]
    assert chain(rs, "nat", "KUBE-POSTROUTING") == [
        "-A KUBE-POSTROUTING -m mark ! --mark 0x008000/0x008000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x008000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully',
    ]
    assert chain(render(NODE, ProxyState()), "nat", "KUBE-MARK-MASQ") == ["-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000"]


def test_forward_chain_and_invalid_drop_switch():
    rs = render(NODE, ProxyState())
    assert chain(rs, "filter", "KUBE-FORWARD")[0] == "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"
    assert len(chain(rs, "filter", "KUBE-FORWARD")) == 3
    liberal = render(NODE, ProxyState(), drop_invalid=False)
    assert all("INVALID" not in line for line in chain(liberal, "filter", "KUBE-FORWARD"))


def test_every_top_level_chain_is_declared_even_when_empty():
    rs = render(NODE, ProxyState())
    assert list(rs.chains("filter")) == list(ch.TOP_LEVEL_CHAINS["filter"])
    assert list(rs.chains("nat")) == list(ch.TOP_LEVEL_CHAINS["nat"])


def test_large_clusters_drop_per_endpoint_comments():
    eps = tuple(ep(f"10.244.{i // 250}.{i % 250 + 1}") for i in range(1001))
    rs = render(NODE, state((svc(), eps)))
    sep = ch.sep_chain(WEB, eps[0].ip, 8080)
    assert "comment" not in chain(rs, "nat", sep)[0]
    assert all("comment" not in line for line in grep(rs, "nat", SVC, "KUBE-SEP-"))
    assert "comment" in chain(rs, "nat", SVC)[0]  # the masquerade rule keeps its comment, as kube-proxy


def test_ruleset_is_independent_of_insertion_order():
    a = state((svc(), (ep("10.244.1.2"), ep("10.244.2.2"))), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    b = ProxyState(services=dict(reversed(list(a.services.items()))),
                   endpoints={k: tuple(reversed(v)) for k, v in a.endpoints.items()})
    assert render(NODE, a) == render(NODE, b)


# ---- restore plans --------------------------------------------------------------------------


def test_full_plan_writes_everything_and_collects_only_our_stale_chains():
    rs = render(NODE, state((svc(), (ep("10.244.1.2"),))))
    existing = {"nat": {"KUBE-SVC-OLDOLDOLDOLDOLD0", "KUBE-SEP-OLDOLDOLDOLDOLD0", "CNI-CHAIN", "KUBE-SERVICES", SVC}}
    plan = full_plan(rs, existing)
    assert plan.write["nat"] == tuple(rs.chains("nat")) and plan.write["filter"] == tuple(rs.chains("filter"))
    assert plan.delete["nat"] == ("KUBE-SEP-OLDOLDOLDOLDOLD0", "KUBE-SVC-OLDOLDOLDOLDOLD0")
    text = plan.text(rs).splitlines()
    assert text[0] == "*filter" and text.count("COMMIT") == 2
    nat = text[text.index("*nat"):]
    assert nat[-3:] == ["-X KUBE-SEP-OLDOLDOLDOLDOLD0", "-X KUBE-SVC-OLDOLDOLDOLDOLD0", "COMMIT"]
    assert ":KUBE-SVC-OLDOLDOLDOLDOLD0 - [0:0]" in nat  # flushed before it is deleted
    assert "CNI-CHAIN" not in plan.text(rs)


def test_partial_plan_sends_only_changed_chains():
    old = render(NODE, state((svc(), (ep("10.244.1.2"), ep("10.244.2.2"))), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))))
    new = render(NODE, state((svc(), (ep("10.244.1.2"),)), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))))
    plan = partial_plan(old, new)
    assert plan.write == {"filter": (), "nat": (SVC,)}
    assert plan.delete == {"filter": (), "nat": (ch.sep_chain(WEB, "10.244.2.2", 8080),)}
    assert partial_plan(new, new).empty and partial_plan(new, new).text(new) == ""


def test_partial_plan_deletes_a_removed_services_chains_and_rewrites_kube_services():
    old = render(NODE, state((svc(node_port=30080), (ep("10.244.1.2"),)), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))))
    new = render(NODE, state((svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))))
    plan = partial_plan(old, new)
    assert set(plan.write["nat"]) == {"KUBE-SERVICES", "KUBE-NODEPORTS"}
    assert set(plan.delete["nat"]) == {SVC, EXT, ch.sep_chain(WEB, "10.244.1.2", 8080)}


def test_parse_save_reads_chains_and_rules():
    text = "# comment\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-X - [0:0]\n-A PREROUTING -j KUBE-X\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"
    assert parse_save(text) == {"nat": {"PREROUTING": ["-A PREROUTING -j KUBE-X"], "KUBE-X": []}, "filter": {"INPUT": []}}


# ---- conntrack selectors --------------------------------------------------------------------


def test_stale_endpoint_filters_cover_every_service_ip_and_the_nodeport():
    s = svc(DNS, "10.96.0.53", 53, node_port=30053, external_ips=("203.0.113.5",), load_balancer_ips=("198.51.100.7",))
    st = state((s, (ep("10.244.3.3", 53),)))
    changes = ChangeSet(full=False, stale_udp_endpoints=frozenset({(DNS, "10.244.3.4")}))
    assert stale_filters(changes, st) == [
        StaleFilter("10.96.0.53", 53, "10.244.3.4"),
        StaleFilter("203.0.113.5", 53, "10.244.3.4"),
        StaleFilter("198.51.100.7", 53, "10.244.3.4"),
        StaleFilter(None, 30053, "10.244.3.4"),
    ]
    f = StaleFilter(None, 30053, "10.244.3.4")
    assert f.matches("192.168.1.10", 30053, "10.244.3.4") and not f.matches("192.168.1.10", 30053, "10.244.3.5")


def test_stale_endpoint_of_a_deleted_service_uses_the_previous_state():
    previous = state((svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    changes = ChangeSet(full=False, services=frozenset({DNS}), stale_udp_endpoints=frozenset({(DNS, "10.244.3.3")}))
    assert stale_filters(changes, ProxyState(), previous) == [StaleFilter("10.96.0.53", 53, "10.244.3.3")]
    assert stale_filters(changes, ProxyState()) == []


def test_stale_service_filters_match_any_reply_and_ignore_tcp():
    st = state((svc(DNS, "10.96.0.53", 53, node_port=30053), (ep("10.244.3.3", 53),)), (svc(), (ep("10.244.1.2"),)))
    changes = ChangeSet(full=False, stale_udp_services=frozenset({DNS, WEB}))
    assert stale_filters(changes, st) == [StaleFilter("10.96.0.53", 53, None), StaleFilter(None, 30053, None)]
    assert StaleFilter("10.96.0.53", 53, None).matches("10.96.0.53", 53, "10.96.0.53")


# ---- the datapath against a model of iptables ----------------------------------------------

BUILTIN = {"nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"), "filter": ("INPUT", "FORWARD", "OUTPUT")}
TARGETS = {"ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "SNAT", "MASQUERADE", "MARK"}


def _target(rule: str) -> str | None:
    tokens = shlex.split(rule)
    return tokens[tokens.index("-j") + 1] if "-j" in tokens else None


class FakeIptables:
    """Just enough of iptables for the datapath: chains, rules, -C/-I/-D/-N, save, and a
    restore that is atomic and refuses what the kernel refuses (unknown chain or target,
    deleting a chain still referenced)."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[str]]] = {t: {c: [] for c in cs} for t, cs in BUILTIN.items()}
        self.restores: list[str] = []
        self.commands: list[tuple[str, ...]] = []
        self.sysctls = {"/proc/sys/net/ipv4/conf/all/route_localnet": "0",
                        "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal": "0"}
        self.fail_restores = 0

    def __call__(self, cmd, stdin=None) -> subprocess.CompletedProcess:
        cmd = tuple(cmd)
        self.commands.append(cmd)
        if cmd[0] == "cat":
            return self._ok(self.sysctls[cmd[1]] + "\n") if cmd[1] in self.sysctls else self._err("No such file")
        if cmd[0] == "sh":  # sh -c 'printf %s "$1" > "$2"' sysctl-set VALUE PATH
            assert cmd[-1] in self.sysctls
            self.sysctls[cmd[-1]] = cmd[-2]
            return self._ok()
        if cmd[0] == "iptables-save":
            return self._ok(self.save(cmd[2]))
        if cmd[0] == "iptables-restore":
            assert "--noflush" in cmd
            return self._restore(stdin)
        assert cmd[:2] == ("iptables", "-w")
        table, op, chain, args = cmd[3], cmd[4], cmd[5], cmd[6:]
        rules = self.tables[table]
        line = " ".join(("-A", chain, *(shlex.quote(a) for a in args)))
        if op == "-N":
            if chain in rules:
                return self._err("Chain already exists.")
            rules[chain] = []
        elif op == "-C":
            return self._ok() if line in rules.get(chain, []) else self._err("Bad rule")
        elif op == "-I":
            if _target(line) not in TARGETS and _target(line) not in rules:
                return self._err("Couldn't load target")
            rules[chain].insert(0, line)
        elif op == "-D":
            if line not in rules.get(chain, []):
                return self._err("Bad rule")
            rules[chain].remove(line)
        return self._ok()

    def save(self, table: str) -> str:
        out = [f"*{table}"] + [f":{c} - [0:0]" for c in self.tables[table]]
        out += [r for rules in self.tables[table].values() for r in rules]
        return "\n".join([*out, "COMMIT", ""])

    def _restore(self, text: str) -> subprocess.CompletedProcess:
        self.restores.append(text)
        if self.fail_restores:
            self.fail_restores -= 1
            return self._err("iptables-restore: line 2 failed", rc=1)
        tables = {t: {c: list(r) for c, r in cs.items()} for t, cs in self.tables.items()}
        table = None
        for n, line in enumerate(text.splitlines(), 1):
            fail = self._err(f"iptables-restore: line {n} failed", rc=1)
            if line.startswith("*"):
                table = tables[line[1:]]
            elif line == "COMMIT":
                table = None
            elif line.startswith(":"):
                table[line[1:].split()[0]] = []
            elif line.startswith("-A "):
                name = line.split()[1]
                target = _target(line)
                if name not in table or (target and target not in TARGETS and target not in table):
                    return fail
                table[name].append(line)
            elif line.startswith("-X "):
                name = line.split()[1]
                if name not in table or any(_target(r) == name for rules in table.values() for r in rules):
                    return fail
                del table[name]
            else:
                return fail
        self.tables = tables
        return self._ok()

    def kube_chains(self, table: str) -> dict[str, list[str]]:
        return {c: r for c, r in self.tables[table].items() if c.startswith("KUBE-")}

    @staticmethod
    def _ok(stdout: str = "") -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], 0, stdout, "")

    @staticmethod
    def _err(stderr: str, rc: int = 1) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], rc, "", stderr)


class FakeConntrack:
    def __init__(self) -> None:
        self.calls: list[list[StaleFilter]] = []

    def delete(self, filters) -> int:
        self.calls.append(list(filters))
        return len(self.calls[-1])


@pytest.fixture
def fake():
    return FakeIptables()


@pytest.fixture
def dp(fake):
    return IptablesDatapath(NODE, runner=fake, conntrack=FakeConntrack())


def _kernel_matches(fake: FakeIptables, rs: Ruleset) -> None:
    for table in ("nat", "filter"):
        assert fake.kube_chains(table) == {c: list(r) for c, r in rs.chains(table).items()}


def test_first_sync_is_full_creates_chains_jumps_and_route_localnet(fake, dp):
    st = state((svc(node_port=30080), (ep("10.244.1.2"),)))
    result = dp.sync(st, ChangeSet(full=False))  # no previous sync: full regardless
    assert result.counts["full_sync"] == 1
    _kernel_matches(fake, render(NODE, st))
    for jump in ch.JUMP_RULES:
        line = " ".join(("-A", jump.chain, *(shlex.quote(a) for a in jump.rule_args)))
        assert fake.tables[jump.table][jump.chain].count(line) == 1
    # Prepend semantics: the last jump ensured is first in its built-in chain, as on a kube-proxy node.
    assert fake.tables["filter"]["INPUT"][0].endswith("-j KUBE-FIREWALL")
    assert fake.tables["nat"]["PREROUTING"] == ["-A PREROUTING -m comment --comment 'kubernetes service portals' -j KUBE-SERVICES"]
    assert fake.sysctls["/proc/sys/net/ipv4/conf/all/route_localnet"] == "1"
    assert dp.stats() == {"iptables_rules_nat": render(NODE, st).rule_count("nat"),
                          "iptables_rules_filter": render(NODE, st).rule_count("filter")}


def test_full_resync_is_idempotent(fake, dp):
    st = state((svc(), (ep("10.244.1.2"),)))
    dp.sync(st, ChangeSet())
    before = {t: fake.save(t) for t in ("nat", "filter")}
    dp.sync(st, ChangeSet())
    assert {t: fake.save(t) for t in ("nat", "filter")} == before


def test_partial_sync_sends_only_the_changed_service_chains(fake, dp):
    a = state((svc(), (ep("10.244.1.2"), ep("10.244.2.2"))), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    dp.sync(a, ChangeSet())
    n = len(fake.commands)
    b = state((svc(), (ep("10.244.1.2"), ep("10.244.2.2"), ep("10.244.4.4"))), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    result = dp.sync(b, ChangeSet(full=False, services=frozenset({WEB})))
    text = fake.restores[-1]
    assert result.counts == {**result.counts, "full_sync": 0, "chains_written": 2, "chains_deleted": 0}
    declared = [line[1:].split()[0] for line in text.splitlines() if line.startswith(":")]
    assert declared == [SVC, ch.sep_chain(WEB, "10.244.4.4", 8080)]
    assert "*filter" not in text and ch.svc_chain(DNS) not in text
    # One command: no iptables-save, jump checks or sysctls on a partial sync.
    assert [c[0] for c in fake.commands[n:]] == ["iptables-restore"]
    _kernel_matches(fake, render(NODE, b))


def test_partial_sync_with_nothing_changed_runs_no_restore(fake, dp):
    st = state((svc(), (ep("10.244.1.2"),)))
    dp.sync(st, ChangeSet())
    n = len(fake.restores)
    assert dp.sync(st, ChangeSet(full=False, services=frozenset({WEB}))).counts["chains_written"] == 0
    assert len(fake.restores) == n


def test_partial_sync_removes_a_deleted_service(fake, dp):
    a = state((svc(node_port=30080, external_policy_local=True), (ep("10.244.1.2", local=True),)),
              (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    dp.sync(a, ChangeSet())
    b = state((svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    result = dp.sync(b, ChangeSet(full=False, services=frozenset({WEB})))
    assert result.counts["chains_deleted"] == 4  # SVC, SVL, EXT, SEP
    _kernel_matches(fake, render(NODE, b))


def test_many_partial_syncs_end_where_a_full_render_would(fake, dp):
    """The invariant partial sync rests on: after any sequence, the kernel equals a fresh full render."""
    steps = [
        state((svc(), (ep("10.244.1.2"),))),
        state((svc(), (ep("10.244.1.2"), ep("10.244.2.2"))), (svc(DNS, "10.96.0.53", 53), ())),
        state((svc(node_port=30080, load_balancer_ips=("198.51.100.7",), load_balancer_source_ranges=("1.0.0.0/8",)),
               (ep("10.244.2.2"),)), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))),
        state((svc(node_port=30080, external_policy_local=True), (ep("10.244.2.2"),)),
              (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),))),
        state((svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53), ep("10.244.3.4", 53)))),
        ProxyState(),
    ]
    dp.sync(steps[0], ChangeSet())
    prev = steps[0]
    for st in steps[1:]:
        changed = frozenset(set(st.services) | set(prev.services))
        dp.sync(st, ChangeSet(full=False, services=changed))
        _kernel_matches(fake, render(NODE, st))
        prev = st


def test_partial_sync_renders_services_the_changeset_forgot(fake, dp):
    dp.sync(state((svc(), (ep("10.244.1.2"),))), ChangeSet())
    st = state((svc(), (ep("10.244.1.2"),)), (svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    dp.sync(st, ChangeSet(full=False))
    _kernel_matches(fake, render(NODE, st))


def test_restore_failure_raises_with_stderr_and_line_then_next_sync_is_full(fake, dp):
    st = state((svc(), (ep("10.244.1.2"),)))
    dp.sync(st, ChangeSet())
    fake.fail_restores = 1
    st2 = state((svc(), (ep("10.244.1.3"),)))
    with pytest.raises(RestoreError) as info:
        dp.sync(st2, ChangeSet(full=False, services=frozenset({WEB})))
    err = info.value
    assert err.line_no == 2 and err.line == fake.restores[-1].splitlines()[1]
    assert "line 2 failed" in str(err) and err.line in str(err)
    assert dp.stats() == {"iptables_rules_nat": 0, "iptables_rules_filter": 0}
    result = dp.sync(st2, ChangeSet(full=False, services=frozenset({WEB})))
    assert result.counts["full_sync"] == 1
    _kernel_matches(fake, render(NODE, st2))


def test_full_sync_collects_chains_left_by_an_earlier_run(fake, dp):
    fake.tables["nat"]["KUBE-SEP-LEFTOVERLEFTOVER"] = ["-A KUBE-SEP-LEFTOVERLEFTOVER -j DNAT --to-destination 1.2.3.4:5"]
    fake.tables["nat"]["KUBE-SVC-LEFTOVERLEFTOVER"] = ["-A KUBE-SVC-LEFTOVERLEFTOVER -j KUBE-SEP-LEFTOVERLEFTOVER"]
    fake.tables["nat"]["OTHER-CHAIN"] = []
    dp.sync(ProxyState(), ChangeSet())
    assert "KUBE-SEP-LEFTOVERLEFTOVER" not in fake.tables["nat"] and "KUBE-SVC-LEFTOVERLEFTOVER" not in fake.tables["nat"]
    assert "OTHER-CHAIN" in fake.tables["nat"]


def test_be_liberal_sysctl_drops_the_invalid_rule(fake, dp):
    fake.sysctls["/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal"] = "1"
    dp.sync(ProxyState(), ChangeSet())
    assert all("INVALID" not in r for r in fake.tables["filter"]["KUBE-FORWARD"])


def test_cleanup_removes_everything_ours_and_nothing_else(fake, dp):
    fake.tables["filter"]["INPUT"].append("-A INPUT -j ACCEPT")
    dp.sync(state((svc(node_port=30080), (ep("10.244.1.2"),))), ChangeSet())
    dp.cleanup()
    for table in ("nat", "filter"):
        assert not fake.kube_chains(table)
        assert not [r for rules in fake.tables[table].values() for r in rules if "KUBE-" in r]
    assert fake.tables["filter"]["INPUT"] == ["-A INPUT -j ACCEPT"]
    n = len(fake.restores)
    dp.cleanup()  # idempotent: nothing left, nothing to restore
    assert len(fake.restores) == n
    assert dp.sync(ProxyState(), ChangeSet(full=False)).counts["full_sync"] == 1


def test_cleanup_leaves_a_chain_another_rule_still_uses(fake, dp):
    dp.sync(ProxyState(), ChangeSet())
    fake.tables["nat"]["CNI-MASQ"] = ["-A CNI-MASQ -j KUBE-MARK-MASQ"]
    dp.cleanup()
    assert set(fake.kube_chains("nat")) == {"KUBE-MARK-MASQ"}


def test_stale_udp_endpoints_reach_conntrack_after_the_restore(fake):
    ct = FakeConntrack()
    dp = IptablesDatapath(NODE, runner=fake, conntrack=ct)
    a = state((svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53), ep("10.244.3.4", 53))))
    dp.sync(a, ChangeSet())
    assert ct.calls == []
    b = state((svc(DNS, "10.96.0.53", 53), (ep("10.244.3.3", 53),)))
    result = dp.sync(b, ChangeSet(full=False, services=frozenset({DNS}),
                                  stale_udp_endpoints=frozenset({(DNS, "10.244.3.4")})))
    assert ct.calls == [[StaleFilter("10.96.0.53", 53, "10.244.3.4")]]
    assert result.counts["conntrack_deleted"] == 1


def test_netns_prefixes_every_command():
    seen = []

    def runner(cmd, stdin=None):
        seen.append(tuple(cmd))
        return FakeIptables._ok("0" if "cat" in cmd else "")

    IptablesDatapath(NODE, netns="epxt-test", runner=runner, conntrack=FakeConntrack()).sync(ProxyState(), ChangeSet())
    assert seen and all(c[:2] == ("nsenter", "--net=/run/netns/epxt-test") for c in seen)
    assert any(c[2] == "iptables-restore" for c in seen)
