"""The iptables drift audit against the real kernel, with both backends, IPv4 and IPv6 (ip6tables).

Clean after a sync (so the canonical form really absorbs every spelling the kernel prints back
for every kind of rule we render), then each kind of tampering an operator or another tool can do
is found, named, and repaired by rewriting only what drifted.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from ebpf_proxy.explain.audit import EXTRA, MISSING, STALE, audit
from ebpf_proxy.datapath.iptables.render import probability
from ebpf_proxy.explain.audit_iptables import canonical
from ebpf_proxy.model import ChangeSet, LocalDetector, LocalMode, NodeConfig
from tests.lab.test_ip6tables_apply import FLAVOURS6, NODE6, datapath6, rich_state6
from tests.lab.test_iptables_apply import (  # noqa: F401 - netns is a fixture
    FLAVOURS,
    NODE,
    datapath,
    in_ns,
    netns,
    rich_state,
)

pytestmark = [pytest.mark.root]


def _found(report) -> set[tuple[str, str, str]]:
    return {(d.kind, d.what, d.key) for d in report.drifts}


# each family's datapath and rich state: (datapath factory, state)
FAMILIES = {4: (datapath, rich_state), 6: (datapath6, rich_state6)}


@pytest.mark.parametrize("family, flavour", [(4, f) for f in sorted(FLAVOURS)] + [(6, f) for f in sorted(FLAVOURS6)],
                         ids=lambda v: f"ipv{v}" if isinstance(v, int) else v)
def test_a_synced_node_has_no_drift(netns, family, flavour):
    """IPv6 too: ip6tables-save prints addresses with /128, the recent match's IPv6 mask, REJECT's
    icmp6-port-unreachable, all absorbed by the canonical form."""
    make, state = FAMILIES[family]
    ns = netns("aud")
    dp = make(ns, flavour)
    dp.sync(state(), ChangeSet())
    report = audit(dp)
    assert report.clean, "\n".join(report.lines())
    assert report.checked["rules"] > 40 and report.checked["jumps"] > 10


NODES = {
    "masquerade-all": dataclasses.replace(NODE, masquerade_all=True),
    "no-detector": dataclasses.replace(NODE, cluster_cidrs=()),
    "node-cidr": dataclasses.replace(NODE, local_detector=LocalDetector(LocalMode.NODE_CIDR, ("10.244.1.0/24",))),
    "bridge": dataclasses.replace(NODE, local_detector=LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")),
    "prefix": dataclasses.replace(NODE, local_detector=LocalDetector(LocalMode.INTERFACE_NAME_PREFIX,
                                                                     interface="veth")),
    "nodeport-addresses": dataclasses.replace(NODE, nodeport_addresses=("192.0.2.0/24",), localhost_nodeports=False),
}


@pytest.mark.parametrize("config", sorted(NODES))
def test_every_node_configuration_audits_clean(netns, config):
    """Each configuration renders other rule forms (-i, ! -i prefix+, --src-type LOCAL, ...)."""
    ns = netns("aud")
    dp = datapath(ns, "nft", node=NODES[config])
    dp.sync(rich_state(), ChangeSet())
    report = audit(dp)
    assert report.clean, "\n".join(report.lines())


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_tampering_is_found_named_and_repaired(netns, flavour):
    ns = netns("aud")
    ipt = FLAVOURS[flavour]["iptables"][0]
    dp = datapath(ns, flavour)
    dp.sync(rich_state(), ChangeSet())
    applied = dp.believed()
    memo: dict = {}  # as the agent keeps it: chains proven clean are not compared again...
    assert audit(dp, memo=memo).clean and memo["proven"]
    svc_chain = next(c for c in applied.chains("nat") if c.startswith("KUBE-SVC-") and len(applied.chains("nat")[c]) >= 2)
    sep_chain = next(c for c in applied.chains("nat") if c.startswith("KUBE-SEP-"))

    in_ns(ns, ipt, "-t", "nat", "-D", svc_chain, "1")  # an operator deletes a rule
    in_ns(ns, ipt, "-t", "nat", "-R", "KUBE-SERVICES", "1", "-d", "10.96.0.99/32", "-p", "tcp", "-m", "tcp",
          "--dport", "81", "-j", "RETURN")  # ... rewrites one
    in_ns(ns, ipt, "-t", "nat", "-A", sep_chain, "-j", "ACCEPT")  # ... adds one to our chain
    in_ns(ns, ipt, "-t", "nat", "-N", "KUBE-SEP-STRAYSTRAYSTRAY1")  # a chain nobody wrote
    in_ns(ns, ipt, "-t", "nat", "-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals",
          "-j", "KUBE-SERVICES")  # the way in
    in_ns(ns, ipt, "-t", "filter", "-F", "KUBE-FIREWALL")  # a whole chain emptied

    report = audit(dp, memo=memo)  # ... unless their text changed
    found = _found(report)
    assert (MISSING, "iptables rule", f"nat {svc_chain} rule 1") in found
    assert (STALE, "iptables rule", "nat KUBE-SERVICES rule 1") in found
    assert any(k == EXTRA and w == "iptables rule" and key.startswith(f"nat {sep_chain} ") for k, w, key in found)
    assert (EXTRA, "iptables chain", "nat KUBE-SEP-STRAYSTRAYSTRAY1") in found
    assert (MISSING, "iptables jump", "nat PREROUTING -> KUBE-SERVICES") in found
    assert (MISSING, "iptables rule", "filter KUBE-FIREWALL rule 1") in found
    changed = next(d for d in report.drifts if d.kind == STALE)
    assert "--dport 81" in changed.detail and "should be" in changed.detail
    assert not report.repaired

    repaired = audit(dp, repair=True, memo=memo)
    assert repaired.repaired and repaired.drifts == report.drifts
    # only what drifted: 3 nat chains and 1 filter chain rewritten, 1 chain deleted, 1 jump
    assert repaired.writes == 6
    after = audit(dp, memo=memo)
    assert after.clean, "\n".join(after.lines())
    assert "KUBE-SEP-STRAYSTRAYSTRAY1" not in in_ns(ns, FLAVOURS[flavour]["iptables_save"][0], "-t", "nat")


def test_probabilities_compare_as_the_fixed_point_value_the_kernel_holds():
    """kube-proxy's ten decimals of 1/n against what the kernel prints back: libxt_statistic
    holds lround(p * 2^31) and prints it over 2^31 with eleven decimals (0.1000000000 comes back
    0.10000000009). Equal for every endpoint count; a probability one step of the u32 away is not."""
    for n in range(1, 1001):
        ours = probability(n)
        held = math.floor(float(ours) * 0x80000000 + 0.5)
        kernel = f"{held / 0x80000000:.11f}"
        rule = "-m statistic --mode random --probability {} -j X"
        assert canonical(rule.format(ours).split()) == canonical(rule.format(kernel).split()), (n, ours, kernel)
        if held > 1:
            other = f"{(held - 1) / 0x80000000:.11f}"
            assert canonical(rule.format(ours).split()) != canonical(rule.format(other).split()), (n, ours, other)


def test_a_service_with_many_endpoints_audits_clean(netns):
    """Against the real kernel (the nft backend): 1/n for every n up to 12 endpoints is the
    probability the kernel prints back, absorbed (with 3 or more, every audit found drift)."""
    ns = netns("aud")
    dp = datapath(ns, "nft")
    state = rich_state()
    web = next(name for name in state.endpoints if len(state.endpoints[name]) == 2)
    many = tuple(dataclasses.replace(state.endpoints[web][0], ip=f"10.244.1.{10 + i}") for i in range(12))
    state = dataclasses.replace(state, endpoints={**state.endpoints, web: many})
    dp.sync(state, ChangeSet())
    report = audit(dp)
    assert report.clean, "\n".join(report.lines())
    assert report.checked["rules"] > 50


def test_canonical_form_equates_the_kernels_spellings_only():
    ours = "-m comment --comment x -m tcp -p tcp -d 10.96.0.1 --dport 80 -j MARK --or-mark 0x004000"
    kernel = "-d 10.96.0.1/32 -p tcp -m comment --comment x -m tcp --dport 80 -j MARK --set-xmark 0x4000/0x4000"
    assert canonical(ours.split()) == canonical(kernel.split())
    assert canonical("-j MARK --xor-mark 0x4000".split()) == canonical("-j MARK --set-xmark 0x4000/0x0".split())
    assert canonical("-m statistic --mode random --probability 0.5000000000 -j X".split()) == \
        canonical("-m statistic --mode random --probability 0.50000000000 -j X".split())
    assert canonical("-m recent --name A --rcheck --seconds 600 --reap -j A".split()) == canonical(
        "-m recent --rcheck --seconds 600 --reap --name A --mask 255.255.255.255 --rsource -j A".split())
    # what differs in meaning stays different
    assert canonical("-d 10.96.0.1 -j X".split()) != canonical("-d 10.96.0.2/32 -j X".split())
    assert canonical("! -s 10.0.0.0/8 -j X".split()) != canonical("-s 10.0.0.0/8 -j X".split())
    assert canonical("-m recent --name A --rcheck --seconds 600 -j A".split()) != canonical(
        "-m recent --name A --rcheck --seconds 10800 -j A".split())
    assert canonical("-m recent --name A --rcheck --mask 255.255.0.0 -j A".split()) != canonical(
        "-m recent --name A --rcheck -j A".split())
    assert canonical("-j X".split()) != canonical("-g X".split())
    assert canonical("-j MARK --or-mark 0x4000".split()) != canonical("-j MARK --xor-mark 0x4000".split())


# ---- IPv6: the audit against ip6tables-save -------------------------------------------------

flavours6 = pytest.mark.parametrize("flavour", sorted(FLAVOURS6))
needs_ip6tables = pytest.mark.skipif(not FLAVOURS6, reason="ip6tables not installed")


NODES6 = {
    "masquerade-all": dataclasses.replace(NODE6, masquerade_all=True),
    "no-detector": dataclasses.replace(NODE6, cluster_cidrs=("10.244.0.0/16",)),
    "node-cidr": dataclasses.replace(NODE6, local_detector=LocalDetector(LocalMode.NODE_CIDR,
                                                                         ("10.244.1.0/24", "fd00:10:1::/64"))),
    "nodeport-addresses": dataclasses.replace(NODE6, nodeport_addresses=("192.0.2.0/24", "2001:db8:50::/64", "::1/128")),
    "localhost-nodeports-off": dataclasses.replace(NODE6, localhost_nodeports=False),
}


@needs_ip6tables
@pytest.mark.parametrize("config", sorted(NODES6))
def test_every_ipv6_node_configuration_audits_clean(netns, config):
    ns = netns("aud6")
    dp = datapath6(ns, sorted(FLAVOURS6)[-1], node=NODES6[config])
    dp.sync(rich_state6(), ChangeSet())
    report = audit(dp)
    assert report.clean, "\n".join(report.lines())


@flavours6
def test_ipv6_tampering_is_found_and_repaired(netns, flavour):
    ns = netns("aud6")
    ip6t = FLAVOURS6[flavour]["iptables"][0]
    dp = datapath6(ns, flavour)
    dp.sync(rich_state6(), ChangeSet())
    sep_chain = next(c for c in dp.believed().chains("nat") if c.startswith("KUBE-SEP-"))
    in_ns(ns, ip6t, "-t", "nat", "-R", "KUBE-SERVICES", "1", "-d", "fd00:96::99/128", "-p", "tcp", "-m", "tcp",
          "--dport", "81", "-j", "RETURN")
    in_ns(ns, ip6t, "-t", "nat", "-A", sep_chain, "-j", "ACCEPT")
    report = audit(dp)
    found = _found(report)
    assert (STALE, "iptables rule", "nat KUBE-SERVICES rule 1") in found
    assert any(k == EXTRA and key.startswith(f"nat {sep_chain} ") for k, _, key in found)
    assert audit(dp, repair=True).repaired
    after = audit(dp)
    assert after.clean, "\n".join(after.lines())
