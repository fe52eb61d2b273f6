"""The IPv6 iptables datapath against the real ip6tables-restore, ip6tables-save and conntrack (root).

As tests/lab/test_iptables_apply.py (same fixtures, same namespace naming and finalizer): every
command runs inside network namespaces these tests create and delete, with both backends
(legacy and nft) where installed. Each test also checks the other family is left alone: an
IPv6 datapath never touches iptables (IPv4) and an IPv4 one never touches ip6tables, with either
backend. Real IPv6 traffic (DNAT, masquerade, REJECT, stale UDP conntrack) is the IPv6 run of
test_iptables_apply.py's traffic tests (its `topology` fixture, one per family).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest

from ebpf_proxy.datapath.iptables import IptablesDatapath, render
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.ruleset import parse_save
from ebpf_proxy.model import ChangeSet, NodeConfig, ProxyState
from tests.lab.test_iptables_apply import (  # noqa: F401 - netns is a fixture
    DNS,
    EMPTY,
    FLAVOURS,
    FLAVOURS6,
    LB,
    LOCAL,
    V6,
    WEB,
    ep,
    in_ns,
    kube_only,
    netns,
    rich_state,
    svc,
)
from tests.lab.test_iptables_apply import NODE as NODE4

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(shutil.which("ip6tables-restore") is None, reason="ip6tables not installed"),
]

NODE6 = V6.node
POD_IP = V6.pod


def datapath6(ns: str, flavour: str = "nft", node: NodeConfig = NODE6) -> IptablesDatapath:
    return IptablesDatapath(node, netns=ns, **FLAVOURS6[flavour])


def datapath4(ns: str, flavour: str = "nft", node: NodeConfig = NODE4) -> IptablesDatapath:
    return IptablesDatapath(node, netns=ns, **FLAVOURS[flavour])


def saved6(ns: str, flavour: str = "nft") -> dict[str, dict[str, list[str]]]:
    save = FLAVOURS6[flavour]["iptables_save"][0]
    return {t: parse_save(in_ns(ns, save, "-t", t)).get(t, {}) for t in ("nat", "filter")}


def dump(ns: str, command: str) -> str:
    """Every table `command` (a save command) shows, without its timestamped comment lines."""
    return "\n".join(line for line in in_ns(ns, command).splitlines() if not line.startswith("#"))


def other_family(ns: str, family: int) -> dict[str, str]:
    """The whole of the other family's tables, per backend: what a datapath must never touch."""
    prefix = "iptables" if family == 6 else "ip6tables"
    return {b: dump(ns, f"{prefix}-{b}-save") for b in ("legacy", "nft") if shutil.which(f"{prefix}-{b}-save")}


def rich_state6() -> ProxyState:
    """As rich_state(), in IPv6 (with IPv4 addresses mixed in, which must not reach ip6tables)."""
    services = {
        WEB: svc(WEB, "fd00:96::10", 80, node_port=30080, affinity_timeout_seconds=600),
        EMPTY: svc(EMPTY, "fd00:96::11", 80, node_port=30081, external_ips=("2001:db8:113::9", "203.0.113.9")),
        DNS: svc(DNS, "fd00:96::53", 53),
        LOCAL: svc(LOCAL, "fd00:96::12", 80, node_port=30082, external_policy_local=True, health_check_node_port=32000),
        LB: svc(LB, "fd00:96::13", 80, load_balancer_ips=("2001:db8:100::7", "198.51.100.7"),
                load_balancer_source_ranges=("2001:db8:113::/64", "203.0.113.0/24")),
    }
    endpoints = {
        WEB: (ep(POD_IP, 8080), ep("fd00:10:2::2", 8080, local=False), ep("10.244.1.2", 8080)),
        DNS: (ep(POD_IP, 5353),),
        LOCAL: (ep("fd00:10:2::3", 8080, local=False),),
        LB: (ep(POD_IP, 8080),),
    }
    return ProxyState(services=services, endpoints=endpoints)


flavours6 = pytest.mark.parametrize("flavour", sorted(FLAVOURS6))


# ---- apply mechanics, both backends ---------------------------------------------------------


@flavours6
def test_ipv6_apply_and_read_back_leaving_iptables_alone(netns, flavour):
    ns = netns("six")
    ipv4_before = other_family(ns, 6)
    state = rich_state6()
    dp = datapath6(ns, flavour)
    result = dp.sync(state, ChangeSet())
    rs = render(NODE6, state)
    kernel = saved6(ns, flavour)
    for table in ("nat", "filter"):
        assert {c for c in kernel[table] if c.startswith("KUBE-")} == set(rs.chains(table)), table
        for chain, rules in rs.chains(table).items():
            assert len(kernel[table][chain]) == len(rules), f"{table} {chain}"
    assert result.counts["iptables_rules_nat"] == rs.rule_count("nat")
    for jump in ch.JUMP_RULES:
        hits = [r for r in kernel[jump.table][jump.chain] if r.endswith(f"-j {jump.target}")]
        assert len(hits) == 1, f"{jump.table} {jump.chain} -> {jump.target}: {hits}"
    sep = kernel["nat"][ch.sep_chain(WEB, POD_IP, 8080)]
    assert sep[0].startswith(f"-A {ch.sep_chain(WEB, POD_IP, 8080)} -s {POD_IP}/128 ")
    assert "--to-destination [fd00:10:1::2]:8080" in sep[-1] and "--set" in sep[-1]
    assert any("fd00:96::11/128" in r and r.endswith("--reject-with icmp6-port-unreachable")
               for r in kernel["filter"]["KUBE-SERVICES"])
    assert any("2001:db8:100::7/128" in r and r.endswith("-j DROP") for r in kernel["filter"]["KUBE-PROXY-FIREWALL"])
    assert kernel["nat"]["KUBE-SERVICES"][-1].startswith("-A KUBE-SERVICES ! -d ::1/128 ")
    assert kernel["filter"]["KUBE-FIREWALL"] == []
    text = "\n".join(r for t in kernel.values() for rules in t.values() for r in rules)
    assert not [w for w in ("10.244.1.2", "203.0.113", "198.51.100.7") if w in text]
    assert in_ns(ns, "cat", "/proc/sys/net/ipv4/conf/all/route_localnet").strip() == "0"  # IPv4's, not touched
    assert other_family(ns, 6) == ipv4_before


@flavours6
def test_ipv6_resync_is_idempotent_and_a_partial_sync_changes_only_what_changed(netns, flavour):
    ns = netns("six")
    dp = datapath6(ns, flavour)
    dp.sync(rich_state6(), ChangeSet())
    first = saved6(ns, flavour)
    dp.sync(rich_state6(), ChangeSet())
    assert saved6(ns, flavour) == first
    datapath6(ns, flavour).sync(rich_state6(), ChangeSet())  # a fresh agent: no duplicate jump or chain
    assert saved6(ns, flavour) == first
    result = dp.sync(rich_state6(), ChangeSet(full=False, services=frozenset({WEB, DNS})))
    assert result.counts["chains_written"] == 0 and result.counts["chains_deleted"] == 0
    assert saved6(ns, flavour) == first

    # one more endpoint for DNS: its SVC chain and the new SEP chain, nothing else
    before = rich_state6()
    after = dataclasses.replace(before, endpoints={**before.endpoints, DNS: (ep(POD_IP, 5353), ep("fd00:10:2::4", 5353))})
    result = dp.sync(after, ChangeSet(full=False, services=frozenset({DNS})))
    assert result.counts["full_sync"] == 0
    assert result.counts["chains_written"] == 2 and result.counts["chains_deleted"] == 0
    now = saved6(ns, flavour)
    changed = {(t, c) for t in now for c in set(now[t]) | set(first[t]) if now[t].get(c) != first[t].get(c)}
    assert changed == {("nat", ch.svc_chain(DNS)), ("nat", ch.sep_chain(DNS, "fd00:10:2::4", 5353))}


@flavours6
def test_ipv6_partial_sync_reaches_what_a_full_sync_does(netns, flavour):
    partial_ns, full_ns = netns("part6"), netns("full6")
    before = rich_state6()
    after = ProxyState(
        services={n: s for n, s in before.services.items() if n != LB},
        endpoints={**{n: e for n, e in before.endpoints.items() if n != LB},
                   WEB: (ep(POD_IP, 8080), ep("fd00:10:2::9", 8080, local=False)),
                   EMPTY: (ep(POD_IP, 8080),)},
    )
    dp = datapath6(partial_ns, flavour)
    dp.sync(before, ChangeSet())
    result = dp.sync(after, ChangeSet(full=False, services=frozenset({WEB, EMPTY, LB})))
    assert result.counts["full_sync"] == 0 and result.counts["chains_deleted"] >= 4
    datapath6(full_ns, flavour).sync(after, ChangeSet())
    assert kube_only(saved6(partial_ns, flavour)) == kube_only(saved6(full_ns, flavour))


@flavours6
def test_ipv6_cleanup_removes_everything_of_ours_only(netns, flavour):
    ns = netns("six")
    ip6t = FLAVOURS6[flavour]["iptables"][0]
    in_ns(ns, ip6t, "-A", "INPUT", "-s", "2001:db8::1", "-j", "ACCEPT")
    in_ns(ns, ip6t, "-t", "nat", "-N", "OTHER-CHAIN")
    in_ns(ns, ip6t, "-t", "nat", "-A", "POSTROUTING", "-j", "OTHER-CHAIN")
    ipv4_before = other_family(ns, 6)
    dp = datapath6(ns, flavour)
    dp.sync(rich_state6(), ChangeSet())
    assert dp.installed()
    dp.cleanup()
    kernel = saved6(ns, flavour)
    assert kube_only(kernel) == {"nat": {}, "filter": {}}
    assert kernel["filter"]["INPUT"] == ["-A INPUT -s 2001:db8::1/128 -j ACCEPT"]
    assert kernel["nat"]["POSTROUTING"] == ["-A POSTROUTING -j OTHER-CHAIN"]
    assert not dp.installed()
    dp.cleanup()  # idempotent
    datapath6(ns, flavour).cleanup()  # and from a fresh agent
    assert kube_only(saved6(ns, flavour)) == {"nat": {}, "filter": {}}
    assert other_family(ns, 6) == ipv4_before


@flavours6
def test_an_ipv4_datapath_never_touches_ip6tables(netns, flavour):
    ns = netns("four")
    in_ns(ns, FLAVOURS6[flavour]["iptables"][0], "-A", "INPUT", "-s", "2001:db8::1", "-j", "ACCEPT")
    ipv6_before = other_family(ns, 4)
    dp = datapath4(ns, flavour)
    dp.sync(rich_state(), ChangeSet())
    dp.cleanup()
    assert other_family(ns, 4) == ipv6_before


@flavours6
def test_both_families_in_one_namespace_each_cleans_its_own(netns, flavour):
    ns = netns("dual")
    dp4, dp6 = datapath4(ns, flavour), datapath6(ns, flavour)
    dp4.sync(rich_state(), ChangeSet())
    dp6.sync(rich_state6(), ChangeSet())
    ipv4 = dump(ns, FLAVOURS[flavour]["iptables_save"][0])
    assert "KUBE-SVC-" in ipv4 and "fd00" not in ipv4
    dp6.cleanup()
    assert dump(ns, FLAVOURS[flavour]["iptables_save"][0]) == ipv4
    assert kube_only(saved6(ns, flavour)) == {"nat": {}, "filter": {}}
    assert dp4.installed() and not dp6.installed()
    dp6.sync(rich_state6(), ChangeSet())
    ipv6 = dump(ns, FLAVOURS6[flavour]["iptables_save"][0])
    dp4.cleanup()
    assert dump(ns, FLAVOURS6[flavour]["iptables_save"][0]) == ipv6
    assert dp6.installed() and not dp4.installed()


def test_ebpf_proxy_cleanup_removes_the_iptables_mode_of_both_families(netns):
    """`ebpf-proxy cleanup`'s iptables part (cleanup_all, run inside the namespace as the CLI runs
    on a node): the IPv6 rules in ip6tables go too, whichever backend each family used."""
    if set(FLAVOURS6) != {"legacy", "nft"}:
        pytest.skip("needs both ip6tables backends")
    ns = netns("clean")
    datapath6(ns, "legacy").sync(rich_state6(), ChangeSet())
    datapath4(ns, "nft").sync(rich_state(), ChangeSet())
    code = ("import json; from ebpf_proxy.agent.cleanup import cleanup_all; "
            "print(json.dumps([r.line() for r in cleanup_all('node-a', modes=('iptables',))]))")
    lines = json.loads(in_ns(ns, sys.executable, "-c", code))
    assert lines == ["iptables (legacy): cleaned", "iptables (nft): cleaned",
                     "iptables (legacy, IPv6): cleaned", "iptables (nft, IPv6): cleaned"]
    for save in ("iptables-legacy-save", "iptables-nft-save", "ip6tables-legacy-save", "ip6tables-nft-save"):
        assert "KUBE-" not in dump(ns, save), save


def test_auto_backend_picks_among_the_ip6tables_commands(netns):
    if set(FLAVOURS6) != {"legacy", "nft"}:
        pytest.skip("needs both ip6tables backends")
    ns = netns("auto")
    # the IPv4 side holds rules in nft; IPv6 decides on its own: nothing there, so legacy
    in_ns(ns, "iptables-nft", "-A", "INPUT", "-s", "192.0.2.1", "-j", "ACCEPT")
    dp = IptablesDatapath(NODE6, netns=ns)
    dp.sync(rich_state6(), ChangeSet())
    assert kube_only(saved6(ns, "legacy"))["nat"] and kube_only(saved6(ns, "nft")) == {"nat": {}, "filter": {}}
    # a fresh agent finds its rules again in the backend that holds them
    other = netns("auto")
    in_ns(other, "ip6tables-nft", "-A", "INPUT", "-s", "2001:db8::1", "-j", "ACCEPT")
    IptablesDatapath(NODE6, netns=other).sync(rich_state6(), ChangeSet())
    assert kube_only(saved6(other, "nft"))["nat"] and kube_only(saved6(other, "legacy")) == {"nat": {}, "filter": {}}
