"""The walker reads what the kernel holds as it reads what we rendered, with both iptables backends.

The datapath syncs one of each kind of rule into a scratch network namespace; `iptables-legacy-save`
and `iptables-nft-save` print them back in their own spelling (`/32` masks, `--set-xmark`, the
`recent` match's `--mask`/`--rsource`, reordered matches), and for every flow the trace of that
text must equal, field for field and step for step, the trace of our Ruleset plus the JUMP_RULES.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.datapath.iptables import render
from ebpf_proxy.explain.iptables_rules import from_ruleset, parse_save
from ebpf_proxy.explain.iptables_walk import NodeFacts, walk
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import ChangeSet, Protocol
from tests.lab.test_iptables_apply import (  # noqa: F401 - netns is a fixture
    CLIENT_IP,
    FLAVOURS,
    NODE,
    NODE_CLIENT_SIDE,
    datapath,
    in_ns,
    netns,
    rich_state,
)

pytestmark = [pytest.mark.root]

FLOWS = [
    FlowSpec(CLIENT_IP, "10.96.0.10", 80, in_iface="eth0"),  # affinity: forks
    FlowSpec(CLIENT_IP, NODE_CLIENT_SIDE, 30080, in_iface="eth0"),
    FlowSpec(CLIENT_IP, NODE_CLIENT_SIDE, 30082, in_iface="eth0"),  # eTP=Local, none local: drop
    FlowSpec(CLIENT_IP, NODE_CLIENT_SIDE, 32000, in_iface="eth0"),  # health check: accept
    FlowSpec(CLIENT_IP, "10.96.0.11", 80, in_iface="eth0"),  # no endpoints: reject
    FlowSpec(CLIENT_IP, "203.0.113.9", 80, in_iface="eth0"),  # externalIP without endpoints: reject
    FlowSpec("203.0.113.5", "198.51.100.7", 80, in_iface="eth0"),  # in the source ranges
    FlowSpec("198.18.0.1", "198.51.100.7", 80, in_iface="eth0"),  # not: dropped by KUBE-PROXY-FIREWALL
    FlowSpec("10.244.1.2", "10.96.0.53", 53, Protocol.UDP, origin="pod", in_iface="veth0"),
    FlowSpec(NODE_CLIENT_SIDE, "10.96.0.10", 80, origin="host"),
    FlowSpec("127.0.0.1", "127.0.0.1", 30080, origin="host"),
]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_kernel_rules_trace_like_rendered_rules(netns, flavour):
    ns = netns("trace")
    state = rich_state()
    datapath(ns, flavour).sync(state, ChangeSet())
    save = FLAVOURS[flavour]["iptables_save"][0]
    text = in_ns(ns, save, "-t", "nat") + in_ns(ns, save, "-t", "filter")
    assert text.count("-A KUBE-") > 30 and "--set-xmark" in text  # the kernel's spelling, not ours
    kernel, ours = parse_save(text, save), from_ruleset(render(NODE, state))
    facts = NodeFacts(frozenset(NODE.node_ips), masquerade_ip=NODE_CLIENT_SIDE)
    verdicts = []
    for flow in FLOWS:
        a, b = walk(ours, flow, facts), walk(kernel, flow, facts)
        assert a.to_json() == b.to_json(), f"{flow.label}\nrendered:\n{a.render()}\n{save}:\n{b.render()}"
        verdicts.append(a.verdict)
    assert verdicts == ["dnat", "dnat", "drop", "accept", "reject", "reject", "dnat", "drop", "dnat", "dnat", "dnat"]
