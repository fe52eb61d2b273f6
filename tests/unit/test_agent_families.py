"""The agent on dual-stack and IPv6-only nodes: one tracker, NodeConfig and datapath per IP family,
as kube-proxy's metaproxier runs one proxier per family (pkg/proxy/metaproxier/meta_proxier.go:
every Service event goes to both proxiers, each EndpointSlice to the one of its addressType)."""

from __future__ import annotations

import pytest

from tests.unit.kobjects import endpoint, endpoint_slice, node, port, service
from tests.unit.test_agent import NODE, WEB, RecordingDatapath, agent_parts, listed  # noqa: F401 (fixture)

__all__ = ["agent_parts"]

V4_IP, V6_IP = "192.168.1.10", "fd00:20::10"


def dual_node(**meta) -> dict:
    obj = node(NODE, internal=V4_IP, **meta)
    obj["status"]["addresses"].append({"type": "InternalIP", "address": V6_IP})
    return obj


def dual_service(name="web", **spec) -> dict:
    obj = service(name, ports=[port("http", 80, "TCP")], svc_type="NodePort", **spec)
    obj["spec"]["ports"][0]["nodePort"] = 30080
    obj["spec"]["clusterIPs"] = ["10.96.0.10", "fd00:10:96::a"]
    return obj


def slices() -> list[dict]:
    ports = [{"name": "http", "port": 8080, "protocol": "TCP"}]
    return [endpoint_slice("web-v4", endpoints=[endpoint("10.244.1.5", NODE)], ports=ports),
            endpoint_slice("web-v6", address_type="IPv6", endpoints=[endpoint("fd00:10:244:1::5", NODE)],
                           ports=ports)]


def local_dual():
    return ["127.0.0.1", "::1", V4_IP, V6_IP, "fe80::1"]


def by_family():
    return {dp.node.family: dp for dp in RecordingDatapath.created}


def test_a_dual_stack_node_programs_each_family_with_its_own_addresses(agent_parts):
    make, _, _ = agent_parts
    agent = make(local_addresses=local_dual)
    agent.resolve_mode()
    listed(agent, nodes=[dual_node()], services=[dual_service()], slices=slices())
    agent.prepare_datapath()
    assert agent.families == (4, 6)
    agent.sync(full=True)
    v4, v6 = by_family()[4], by_family()[6]
    assert v4.node.node_ips == (V4_IP,) and v6.node.node_ips == (V6_IP,)  # no loopback, no link-local
    assert not v6.node.localhost_nodeports  # never on IPv6 (kube-proxy)
    assert v4.last_state.services[WEB].cluster_ip == "10.96.0.10"
    assert v6.last_state.services[WEB].cluster_ip == "fd00:10:96::a"
    assert [ep.ip for ep in v4.last_state.endpoints_of(WEB)] == ["10.244.1.5"]
    assert [ep.ip for ep in v6.last_state.endpoints_of(WEB)] == ["fd00:10:244:1::5"]
    assert agent.datapath is v4  # the primary family: the first of the Node's addresses


def test_an_ipv6_primary_node_lists_ipv6_first_and_ipv4_only_nodes_get_no_ipv6_proxier(agent_parts):
    make, _, _ = agent_parts
    agent = make(local_addresses=local_dual)
    agent.resolve_mode()
    v6_first = node(NODE, internal=V6_IP)
    v6_first["status"]["addresses"].append({"type": "InternalIP", "address": V4_IP})
    listed(agent, nodes=[v6_first])
    agent.prepare_datapath()
    assert agent.families == (6, 4)
    assert agent.datapath.node.family == 6

    RecordingDatapath.created = []
    v4_only = make(local_addresses=lambda: ["127.0.0.1", V4_IP])
    v4_only.resolve_mode()
    listed(v4_only, nodes=[node(NODE, internal=V4_IP)], services=[dual_service()], slices=slices())
    v4_only.prepare_datapath()
    assert v4_only.families == (4,)
    assert [dp.node.family for dp in RecordingDatapath.created] == [4]


def test_events_after_start_reach_only_the_served_families(agent_parts):
    make, _, _ = agent_parts
    agent = make(local_addresses=lambda: ["127.0.0.1", V4_IP])
    agent.resolve_mode()
    listed(agent, nodes=[node(NODE, internal=V4_IP)], services=[dual_service()], slices=slices())
    agent.prepare_datapath()
    agent.sync(full=True)
    handlers = agent.handlers()
    handlers["EndpointSlice"].on_add(endpoint_slice("web-v6b", address_type="IPv6",
                                                    endpoints=[endpoint("fd00:10:244:1::9", NODE)]))
    assert not agent.pending  # the IPv6 slice has no proxier here
    handlers["Service"].on_delete(dual_service())
    assert agent.pending


class _Ip6tablesLeftover(RecordingDatapath):
    """An iptables-mode IPv6 datapath whose rules an earlier agent left on the node."""

    cleaned: list["_Ip6tablesLeftover"] = []

    def installed(self) -> bool:
        return self.opts["mode"] == "iptables" and self.node.family == 6

    def cleanup(self) -> None:
        _Ip6tablesLeftover.cleaned.append(self)


def _ebpf_dual_stack_agent(make, monkeypatch):
    """An ebpf-mode agent on a dual-stack node where an earlier agent left ip6tables rules (one
    ip6tables backend installed: the cleanup tries each installed one)."""
    monkeypatch.setattr("ebpf_proxy.agent.cleanup.shutil.which",
                        lambda cmd: f"/usr/sbin/{cmd}" if cmd.startswith("ip6tables-nft") else None)
    _Ip6tablesLeftover.cleaned = []
    agent = make({"mode": "ebpf"}, local_addresses=local_dual,
                 datapath_factory=lambda mode, node, **opts: _Ip6tablesLeftover(node, mode=mode, **opts))
    agent.resolve_mode()
    listed(agent, nodes=[dual_node()], services=[dual_service()], slices=slices())
    agent.prepare_datapath()
    return agent


def test_ebpf_mode_serves_ipv6_with_the_ebpf_datapath_and_removes_ip6tables_leftovers(agent_parts, monkeypatch):
    agent = _ebpf_dual_stack_agent(agent_parts[0], monkeypatch)
    assert {f: p.mode for f, p in agent.proxiers.items()} == {4: "ebpf", 6: "ebpf"}
    assert not _Ip6tablesLeftover.cleaned, "the ip6tables rules serve IPv6 until the programs do"
    agent.sync(full=True)
    assert [(dp.opts["mode"], dp.node.family) for dp in _Ip6tablesLeftover.cleaned] == [("iptables", 6)]
    assert agent.proxiers[6].datapath.last_state.services[WEB].cluster_ip == "fd00:10:96::a"
    agent.sync(full=True)
    assert len(_Ip6tablesLeftover.cleaned) == 1, "looked for once, after the IPv6 family's first sync"


def test_ipv6_leftovers_wait_for_the_ipv6_family_to_sync(agent_parts, monkeypatch):
    agent = _ebpf_dual_stack_agent(agent_parts[0], monkeypatch)
    agent.proxiers[6].datapath.fail_next(1)
    with pytest.raises(RuntimeError, match="injected sync failure"):
        agent.sync(full=True)
    assert not _Ip6tablesLeftover.cleaned, "the IPv6 family failed its sync: the ip6tables rules still serve it"
    agent.sync(full=True)
    assert len(_Ip6tablesLeftover.cleaned) == 1


def test_the_ebpf_datapath_takes_both_families():
    pytest.importorskip("bcc", reason="the eBPF datapath module needs bcc (python3-bpfcc)")
    from ebpf_proxy.datapath.ebpf import EbpfDatapath
    from ebpf_proxy.model import NodeConfig

    for family in (4, 6):
        datapath = EbpfDatapath(NodeConfig(node_name="n1", family=family), bpffs="/nonexistent")
        assert datapath.family == family
        datapath.close()
