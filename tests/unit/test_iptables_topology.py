"""The iptables datapath takes topology from model.categorize: the cluster chain jumps only to
endpoints hinted for this node's zone, and a zone change (a full sync with no changed service,
as the tracker sends it) rewrites the chains for the new zone."""

from __future__ import annotations

from dataclasses import replace

from ebpf_proxy.datapath.iptables import IptablesDatapath, render
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.model import ChangeSet, NodeTopology
from tests.unit.test_iptables_render import NODE, SVC, WEB, FakeConntrack, FakeIptables, _kernel_matches, ep, state, svc

IN_A = ep("10.244.1.2", zone_hints=("zone-a",))
IN_B = ep("10.244.2.2", zone_hints=("zone-b",))


def sep_jumps(rs, chain=SVC):
    return sorted(line.split("-j ")[-1] for line in rs.chains("nat")[chain] if "KUBE-SEP-" in line)


def test_cluster_chain_jumps_only_to_this_zones_endpoints():
    st = replace(state((svc(), (IN_A, IN_B))), topology=NodeTopology("node-a", "zone-a"))
    assert sep_jumps(render(NODE, st)) == [ch.sep_chain(WEB, "10.244.1.2", 8080)]


def test_zone_change_full_sync_rewrites_the_service_chains():
    fake = FakeIptables()
    dp = IptablesDatapath(NODE, runner=fake, conntrack=FakeConntrack())
    st = replace(state((svc(), (IN_A, IN_B))), topology=NodeTopology("node-a", "zone-a"))
    dp.sync(st, ChangeSet())
    moved = replace(st, topology=NodeTopology("node-a", "zone-b"))
    dp.sync(moved, ChangeSet(full=True))
    _kernel_matches(fake, render(NODE, moved))
    assert [r for r in fake.kube_chains("nat")[SVC] if "KUBE-SEP-" in r][0].endswith(
        ch.sep_chain(WEB, "10.244.2.2", 8080))
