"""The iptables walker (`ebpf-proxy trace`'s iptables half) over rules our renderer produces.

Seed 000's three cases, the whole truth table of docs/local-traffic.md (read from the page, as
the e2e test reads it, so page, renderer and walker cannot drift apart), session affinity, the
seed article's own (older kube-proxy) rules as iptables-save text, and the errors: malformed
text and rules the walk cannot evaluate name the rule at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ebpf_proxy.datapath.iptables.render import render
from ebpf_proxy.explain.iptables_rules import RulesError, from_ruleset, parse_save
from ebpf_proxy.explain.iptables_answer import service_of
from ebpf_proxy.explain.iptables_walk import NodeFacts, WalkError, walk
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import Endpoint, LocalDetector, LocalMode, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName

DOC = Path(__file__).parents[2] / "docs" / "local-traffic.md"
CLUSTER_CIDR = "10.244.0.0/16"
NODES = {"worker1": ("172.20.20.15", "10.244.5.0/24"), "worker2": ("172.20.20.16", "10.244.3.0/24"),
         "worker3": ("172.20.20.17", "10.244.4.0/24")}
POD_W1, POD_W3 = "10.244.5.4", "10.244.4.3"  # seed 000's my-nginx pods
NGINX = ServicePortName("default", "my-nginx", "", Protocol.TCP)


def endpoints(name: ServicePortName, node: str, port: int = 80) -> tuple[Endpoint, ...]:
    return (Endpoint(POD_W1, port, "worker1", is_local=node == "worker1"),
            Endpoint(POD_W3, port, "worker3", is_local=node == "worker3"))


def node_config(node: str, detector: LocalDetector | None = None, masquerade_all: bool = False) -> NodeConfig:
    ip, _ = NODES[node]
    return NodeConfig(node, node_ips=(ip,), cluster_cidrs=(CLUSTER_CIDR,), masquerade_all=masquerade_all,
                      local_detector=detector)


def tables_for(node: str, services: list[tuple[ServicePort, tuple[Endpoint, ...]]], **kw):
    state = ProxyState({s.name: s for s, _ in services}, {s.name: eps for s, eps in services})
    return from_ruleset(render(node_config(node, **kw), state))


def facts(node: str) -> NodeFacts:
    ip, _ = NODES[node]
    return NodeFacts(frozenset({ip}), masquerade_ip=ip)


def nginx(local: bool = True) -> ServicePort:
    return ServicePort(NGINX, "10.104.89.245", 80, Protocol.TCP, node_port=30294, external_policy_local=local)


# ---- seed 000 ----------------------------------------------------------------------------------------

def seed_trace(node: str, flow: FlowSpec, local: bool = True):
    return walk(tables_for(node, [(nginx(local), endpoints(NGINX, node))]), flow, facts(node))


def test_seed_case1_outside_to_worker2_nodeport_is_dropped_for_want_of_a_local_endpoint():
    t = seed_trace("worker2", FlowSpec("203.0.113.5", "172.20.20.16", 30294, in_iface="eth0"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == ("drop", (), False, None)
    assert t.reason == "default/my-nginx has no local endpoints"
    assert t.service == "default/my-nginx"
    assert "externalTrafficPolicy: Local" in t.sentence()
    assert t.steps[-1].to_json() == {"hook": "INPUT", "chain": "KUBE-EXTERNAL-SERVICES",
                                     "action": 'DROP "default/my-nginx has no local endpoints"'}


def test_seed_case2_outside_to_worker3_nodeport_reaches_its_own_pod_unmasqueraded():
    t = seed_trace("worker3", FlowSpec("203.0.113.5", "172.20.20.17", 30294, in_iface="eth0"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == ("dnat", (f"{POD_W3}:80",), False, "203.0.113.5")
    chains = [s.unit for s in t.steps]
    assert chains.index("KUBE-NODEPORTS") < chains.index("KUBE-EXT-L65ENXXZWWSAPRCR") < chains.index(
        "KUBE-SVL-L65ENXXZWWSAPRCR")
    assert "KUBE-SVC-L65ENXXZWWSAPRCR" not in chains  # the local chain, not the balancing one


@pytest.mark.parametrize("src", ["172.20.20.16", "127.0.0.1"])
def test_seed_case3_worker2_to_its_own_nodeport_goes_anywhere_masqueraded(src):
    dst = "172.20.20.16" if src != "127.0.0.1" else "127.0.0.1"
    t = seed_trace("worker2", FlowSpec(src, dst, 30294, origin="host"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == (
        "dnat", (f"{POD_W3}:80", f"{POD_W1}:80"), True, "172.20.20.16")
    actions = [s.action for s in t.steps if s.unit == "KUBE-SVC-L65ENXXZWWSAPRCR"]
    assert [a.split(" \"")[0] for a in actions] == ["jump KUBE-SEP-HL43S2RPGOP5RW4C (1 of 2)",
                                                    "jump KUBE-SEP-CUCTBSPZ5432UVNG (2 of 2)"]
    assert t.steps[0].hook == "OUTPUT" and any(s.hook == "POSTROUTING" and "MASQUERADE" in s.action for s in t.steps)


def test_seed_cluster_ip_from_a_pod_and_json_is_one_object():
    t = seed_trace("worker1", FlowSpec("10.244.5.9", "10.104.89.245", 80, origin="pod", in_iface="lxc0001"))
    assert (t.verdict, t.backends, t.masquerade, t.source_after) == (
        "dnat", (f"{POD_W3}:80", f"{POD_W1}:80"), False, "10.244.5.9")
    assert t.reason == "default/my-nginx cluster IP"
    assert json.loads(t.dumps())["steps"][0] == {"hook": "PREROUTING", "chain": "PREROUTING",
                                                  "action": "jump KUBE-SERVICES"}


def test_a_pod_reaching_itself_is_masqueraded_only_through_its_own_backend():
    t = seed_trace("worker1", FlowSpec(POD_W1, "10.104.89.245", 80, origin="pod", in_iface="lxc0001"))
    assert t.verdict == "dnat" and t.masquerade and t.details["masqueradedVia"] == [f"{POD_W1}:80"]
    assert "hairpin" in t.sentence()


def test_service_without_endpoints_rejects_and_other_addresses_pass():
    empty = ServicePort(ServicePortName("default", "web", "http", Protocol.TCP), "10.96.0.20", 80, Protocol.TCP)
    tables = tables_for("worker2", [(empty, ())])
    t = walk(tables, FlowSpec("10.244.3.5", "10.96.0.20", 80, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert (t.verdict, t.reason, t.service) == ("reject", "default/web:http has no endpoints", "default/web:http")
    assert t.steps[-1].unit == "KUBE-SERVICES" and t.steps[-1].hook == "FORWARD"
    t = walk(tables, FlowSpec("10.244.3.5", "10.96.0.21", 80, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert (t.verdict, t.service, t.source_after) == ("pass", None, "10.244.3.5")
    # the wrong port of a service is not the service either
    t = walk(tables, FlowSpec("10.244.3.5", "10.96.0.20", 81, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert t.verdict == "pass"


def test_health_check_node_port_is_accepted():
    svc = ServicePort(NGINX, "10.104.89.245", 80, Protocol.TCP, node_port=30294, external_policy_local=True,
                      load_balancer_ips=("198.51.100.7",), health_check_node_port=32000)
    t = walk(tables_for("worker2", [(svc, endpoints(NGINX, "worker2"))]),
             FlowSpec("203.0.113.5", "172.20.20.16", 32000, in_iface="eth0"), facts("worker2"))
    assert (t.verdict, t.reason) == ("accept", "default/my-nginx health check node port")


def test_session_affinity_is_a_fork_and_still_one_of_the_backends():
    svc = ServicePort(NGINX, "10.104.89.245", 80, Protocol.TCP, affinity_timeout_seconds=10800)
    t = walk(tables_for("worker2", [(svc, endpoints(NGINX, "worker2"))]),
             FlowSpec("10.244.3.5", "10.104.89.245", 80, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert t.verdict == "dnat" and t.backends == (f"{POD_W3}:80", f"{POD_W1}:80")
    assert any("(session affinity)" in s.action for s in t.steps)


def test_udp_and_sctp_services_match_their_own_protocol_only():
    dns = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)
    svc = ServicePort(dns, "10.96.0.10", 53, Protocol.UDP)
    tables = tables_for("worker2", [(svc, endpoints(dns, "worker2", 53))])
    udp = walk(tables, FlowSpec("10.244.3.5", "10.96.0.10", 53, Protocol.UDP, origin="pod", in_iface="lxc1"),
               facts("worker2"))
    tcp = walk(tables, FlowSpec("10.244.3.5", "10.96.0.10", 53, Protocol.TCP, origin="pod", in_iface="lxc1"),
               facts("worker2"))
    assert (udp.verdict, udp.service, tcp.verdict) == ("dnat", "kube-system/dns:dns", "pass")


def test_load_balancer_source_ranges_drop_other_sources_in_filter():
    svc = ServicePort(NGINX, "10.104.89.245", 80, Protocol.TCP, node_port=30294,
                      load_balancer_ips=("198.51.100.7",), load_balancer_source_ranges=("203.0.113.0/25",))
    tables = tables_for("worker2", [(svc, endpoints(NGINX, "worker2"))])
    ok = walk(tables, FlowSpec("203.0.113.5", "198.51.100.7", 80, in_iface="eth0"), facts("worker2"))
    no = walk(tables, FlowSpec("203.0.113.200", "198.51.100.7", 80, in_iface="eth0"), facts("worker2"))
    assert (ok.verdict, ok.masquerade) == ("dnat", True)
    assert no.verdict == "drop" and "traffic not accepted by KUBE-FW-" in no.reason


# ---- docs/local-traffic.md, every cell ----------------------------------------------------------------

def _doc_table(marker: str) -> list[list[str]]:
    lines = DOC.read_text().splitlines()
    rows = []
    for line in lines[lines.index(f"<!-- truth-table:{marker} -->") + 1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not all(set(c) <= {"-", " "} for c in cells):
            rows.append(cells)
    return rows


ORIGIN_HEADER, *ORIGIN_ROWS = _doc_table("origin")
ORIGINS = {(row[0], mode): cell for row in ORIGIN_ROWS for mode, cell in zip(ORIGIN_HEADER[1:], row[1:])}
OUTCOMES = {(d, p, o, m): cell for d, p, o, off, on in _doc_table("outcome")[1:] for m, cell in ((False, off), (True, on))}
BRIDGE, PREFIX = "cbr0", "lxc"
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
CIP, NODEPORT, EIP, LBIP = "10.96.110.20", 30320, "198.51.100.120", "198.51.100.121"


def detector(mode: str, node: str) -> LocalDetector:
    if mode == "none":
        return LocalDetector()
    if mode == "ClusterCIDR":
        return LocalDetector(LocalMode.CLUSTER_CIDR, (CLUSTER_CIDR,))
    if mode == "NodeCIDR":
        return LocalDetector(LocalMode.NODE_CIDR, (NODES[node][1],))
    if mode == "BridgeInterface":
        return LocalDetector(LocalMode.BRIDGE_INTERFACE, interface=BRIDGE)
    return LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, interface=PREFIX)


def origin_flows(row: str, node: str) -> list[tuple[str, str | None, str]]:
    """(source, in_iface, origin) of an origin-table row, as seen by `node`."""
    own_pods = NODES[node][1].rsplit(".", 1)[0]  # "10.244.3"
    return {
        "pod on this node, routed veth": [(f"{own_pods}.7", "lxc1a2b3c4d", "pod")],
        "pod on this node, on the bridge": [(f"{own_pods}.8", BRIDGE, "pod")],
        "pod on another node": [("10.244.9.9", "eth0", "external")],
        "this node": [(NODES[node][0], None, "host"), ("127.0.0.1", None, "host")],
        "another node": [("172.20.20.99", "eth0", "external")],
        "client outside the cluster": [("203.0.113.5", "eth0", "external")],
    }[row]


def origin_class(row: str, mode: str) -> str:
    cell = ORIGINS[(row, mode)]
    if cell.startswith("local if the veth"):  # our routed pods' veths are lxc*: the prefix
        return "local"
    if cell.startswith("local if the bridge"):  # cbr0 does not have the prefix lxc
        return "other"
    return cell


def expected(dest: str, policy: str, klass: str, mode: str, masq_all: bool, node: str, src: str):
    """(verdict, backends, the source the backend sees) of a cell."""
    key = "other, no detector" if (dest, klass, mode) == ("clusterIP", "other", "none") else klass
    cell = OUTCOMES[(dest, policy, key, masq_all)]
    who, seen = (c.strip() for c in cell.split(","))
    backends = {"worker2": (), "worker3": (f"{POD_W3}:80",)}[node] if who == "this node's endpoints" else (
        f"{POD_W3}:80", f"{POD_W1}:80")
    if not backends:
        return "drop", (), None
    return "dnat", backends, NODES[node][0] if seen == "node" else src


CELLS = [(mode, masq_all, node, policy) for mode in ORIGIN_HEADER[1:] for masq_all in (False, True)
         for node in ("worker2", "worker3") for policy in ("Cluster", "Local")]


@pytest.mark.parametrize("mode, masq_all, node, policy", CELLS,
                         ids=[f"{m}-{'masqAll' if a else 'noMasqAll'}-{n}-eTP{p}" for m, a, n, p in CELLS])
def test_local_traffic_truth_table(mode, masq_all, node, policy):
    svc = ServicePort(WEB, CIP, 80, Protocol.TCP, node_port=NODEPORT, external_ips=(EIP,),
                      load_balancer_ips=(LBIP,), external_policy_local=policy == "Local")
    tables = tables_for(node, [(svc, endpoints(WEB, node))], detector=detector(mode, node), masquerade_all=masq_all)
    checked = 0
    for row, *_ in ORIGIN_ROWS:
        klass = origin_class(row, mode)
        for src, iface, origin in origin_flows(row, node):
            dests = [("clusterIP", CIP, 80), ("external", NODES[node][0], NODEPORT), ("external", EIP, 80),
                     ("external", LBIP, 80)]
            if src == "127.0.0.1":
                dests = [("external", "127.0.0.1", NODEPORT)]
            for dest, ip, port in dests:
                want = expected(dest, "Cluster" if dest == "clusterIP" else policy, klass, mode, masq_all, node, src)
                t = walk(tables, FlowSpec(src, ip, port, origin=origin, in_iface=iface), facts(node))
                # "node" in the page is the address the backend sees: the node's own connections show it
                # without masquerade too (no detector: kube-proxy writes no masquerade rule for them)
                assert (t.verdict, t.backends, t.source_after) == want, (
                    f"{row} ({src} via {iface}) → {dest} {ip}:{port}: got {t.verdict} {t.backends} "
                    f"seen as {t.source_after}\n{t.render()}")
                assert t.masquerade == (t.source_after not in (None, src)) or origin == "host"
                checked += 1
    assert checked == 25


# ---- real iptables-save text --------------------------------------------------------------------------

# The seed article's worker2 (kube-proxy v1.21: KUBE-XLB, KUBE-MARK-DROP, the mark-based drop in
# KUBE-FIREWALL), as iptables-legacy-save prints it: /32 masks, --set-xmark, counters (-c).
SEED_WORKER2 = """\
# Generated by iptables-save v1.8.9 (legacy)
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SEP-CUCTBSPZ5432UVNG - [0:0]
:KUBE-SEP-HL43S2RPGOP5RW4C - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-L65ENXXZWWSAPRCR - [0:0]
:KUBE-XLB-L65ENXXZWWSAPRCR - [0:0]
[12:720] -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
[3:180] -A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
[9:540] -A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
[0:0] -A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
[0:0] -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
[0:0] -A KUBE-NODEPORTS -s 127.0.0.0/8 -p tcp -m comment --comment "default/my-nginx" -m tcp --dport 30294 -j KUBE-MARK-MASQ
[0:0] -A KUBE-NODEPORTS -p tcp -m comment --comment "default/my-nginx" -m tcp --dport 30294 -j KUBE-XLB-L65ENXXZWWSAPRCR
[0:0] -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
[0:0] -A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
[0:0] -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
[0:0] -A KUBE-SEP-CUCTBSPZ5432UVNG -s 10.244.5.4/32 -m comment --comment "default/my-nginx" -j KUBE-MARK-MASQ
[0:0] -A KUBE-SEP-CUCTBSPZ5432UVNG -p tcp -m comment --comment "default/my-nginx" -m tcp -j DNAT --to-destination 10.244.5.4:80
[0:0] -A KUBE-SEP-HL43S2RPGOP5RW4C -s 10.244.4.3/32 -m comment --comment "default/my-nginx" -j KUBE-MARK-MASQ
[0:0] -A KUBE-SEP-HL43S2RPGOP5RW4C -p tcp -m comment --comment "default/my-nginx" -m tcp -j DNAT --to-destination 10.244.4.3:80
[0:0] -A KUBE-SERVICES ! -s 10.244.0.0/16 -d 10.104.89.245/32 -p tcp -m comment --comment "default/my-nginx cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
[0:0] -A KUBE-SERVICES -d 10.104.89.245/32 -p tcp -m comment --comment "default/my-nginx cluster IP" -m tcp --dport 80 -j KUBE-SVC-L65ENXXZWWSAPRCR
[0:0] -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
[0:0] -A KUBE-SVC-L65ENXXZWWSAPRCR -m comment --comment "default/my-nginx" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-HL43S2RPGOP5RW4C
[0:0] -A KUBE-SVC-L65ENXXZWWSAPRCR -m comment --comment "default/my-nginx" -j KUBE-SEP-CUCTBSPZ5432UVNG
[0:0] -A KUBE-XLB-L65ENXXZWWSAPRCR -s 10.244.0.0/16 -m comment --comment "Redirect pods trying to reach external loadbalancer VIP to clusterIP" -j KUBE-SVC-L65ENXXZWWSAPRCR
[0:0] -A KUBE-XLB-L65ENXXZWWSAPRCR -m comment --comment "masquerade LOCAL traffic for default/my-nginx LB IP" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
[0:0] -A KUBE-XLB-L65ENXXZWWSAPRCR -m comment --comment "route LOCAL traffic for default/my-nginx LB IP to service chain" -m addrtype --src-type LOCAL -j KUBE-SVC-L65ENXXZWWSAPRCR
[0:0] -A KUBE-XLB-L65ENXXZWWSAPRCR -m comment --comment "default/my-nginx has no local endpoints" -j KUBE-MARK-DROP
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL -m comment --comment "kubernetes firewall for dropping marked packets" -m mark --mark 0x8000/0x8000 -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -s 10.244.0.0/16 -m comment --comment "kubernetes forwarding conntrack pod source rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
"""


def test_the_seed_articles_own_rules_tell_its_three_cases():
    tables = parse_save(SEED_WORKER2)
    case1 = walk(tables, FlowSpec("203.0.113.5", "172.20.20.16", 30294, in_iface="eth0"), facts("worker2"))
    assert (case1.verdict, case1.reason) == ("drop", "kubernetes firewall for dropping marked packets "
                                              "(marked by: default/my-nginx has no local endpoints)")
    assert "externalTrafficPolicy: Local" in case1.sentence()
    assert any(s.unit == "KUBE-MARK-DROP" and "0x8000" in s.action for s in case1.steps)
    case3 = walk(tables, FlowSpec("172.20.20.16", "172.20.20.16", 30294, origin="host"), facts("worker2"))
    assert (case3.verdict, case3.backends, case3.masquerade) == ("dnat", (f"{POD_W3}:80", f"{POD_W1}:80"), True)
    # FORWARD's policy is DROP here: only the masquerade-marked (or established) traffic is let through
    pod = walk(tables, FlowSpec("10.244.3.5", "10.104.89.245", 80, origin="pod", in_iface="veth1"), facts("worker2"))
    assert (pod.verdict, pod.reason) == ("drop", "filter FORWARD policy DROP")
    out = walk(tables, FlowSpec("203.0.113.5", "10.104.89.245", 80, in_iface="eth0"), facts("worker2"))
    assert (out.verdict, out.masquerade) == ("dnat", True)


def test_both_sources_read_the_same_rules_the_same_way():
    """Our Ruleset (plus the JUMP_RULES) and the same rules as save text walk alike."""
    node = "worker3"
    rs = render(node_config(node), ProxyState({NGINX: nginx()}, {NGINX: endpoints(NGINX, node)}))
    ours = from_ruleset(rs)
    text = ""
    for table in ("filter", "nat"):
        chains = ours.tables[table]
        text += f"*{table}\n" + "".join(f":{c.name} {c.policy or '-'} [0:0]\n" for c in chains.values())
        text += "".join(r.text + "\n" for c in chains.values() for r in c.rules) + "COMMIT\n"
    saved = parse_save(text)
    for flow in (FlowSpec("203.0.113.5", "172.20.20.17", 30294, in_iface="eth0"),
                 FlowSpec("172.20.20.17", "172.20.20.17", 30294, origin="host"),
                 FlowSpec("10.244.4.9", "10.104.89.245", 80, origin="pod", in_iface="lxc1")):
        a, b = walk(ours, flow, facts(node)), walk(saved, flow, facts(node))
        assert a.to_json() == b.to_json()


# ---- errors name what is at fault ------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("-A KUBE-SERVICES -j ACCEPT\n", "line 1: '-A KUBE-SERVICES -j ACCEPT' is outside a table"),
    ("*nat\n-A KUBE-SERVICES -d\n", "nat KUBE-SERVICES rule 1, line 2: -d needs a value"),
    ('*nat\n-A X -m comment --comment "open\n', "line 2: No closing quotation"),
    ("*nat\n-A X --dport 80 -j ACCEPT\n", "option --dport belongs to no match loaded before it"),
    ("*nat\n-A X -s 1.2.3.4 ! ! -d 1.1.1.1\n", "two '!' in a row"),
    ("*nat\nbogus\n", "line 2: not an iptables-save line: 'bogus'"),
])
def test_malformed_text_is_refused_with_the_line(text, message):
    with pytest.raises(RulesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_save(text)


def _filter_only(*rules: str) -> str:
    return "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:X - [0:0]\n" + \
        "".join(f"{r}\n" for r in rules) + "COMMIT\n"


FLOW = FlowSpec("203.0.113.5", "10.0.0.9", 80, in_iface="eth0")


def test_an_unknown_match_fails_only_when_a_packet_reaches_it_and_names_the_rule():
    reached = parse_save(_filter_only("-A FORWARD -j X", "-A X -m physdev --physdev-is-in -j DROP"))
    with pytest.raises(WalkError, match=r"filter X rule 1, line 7: -A X -m physdev --physdev-is-in -j DROP: "
                                        r"cannot evaluate -m physdev"):
        walk(reached, FLOW, NodeFacts())
    unreached = parse_save(_filter_only("-A FORWARD -d 10.9.9.9 -j X", "-A X -m physdev --physdev-is-in -j DROP"))
    assert walk(unreached, FLOW, NodeFacts()).verdict == "pass"


@pytest.mark.parametrize("rule, message", [
    ("-A FORWARD -j NOSUCH", "target NOSUCH is neither a chain of the filter table"),
    ("-A FORWARD -i veth+ -j DROP", r"matches the input device \(-i veth\+\).*give --in-iface"),
    ("-A FORWARD -o eth0 -j DROP", r"matches the output device \(-o eth0\), but the route to 10.0.0.9"),
    ("-A FORWARD -m addrtype --dst-type UNICAST -j DROP", "addrtype UNICAST: only LOCAL"),
    ("-A FORWARD -j X", None),
])
def test_rules_the_walk_cannot_decide_are_errors(rule, message):
    flow = FlowSpec("203.0.113.5", "10.0.0.9", 80)  # in_iface unknown
    tables = parse_save(_filter_only(rule, "-A X -j X" if message is None else "-A X -j RETURN"))
    with pytest.raises(WalkError, match=message or "nested more than 64 deep"):
        walk(tables, flow, NodeFacts())


def test_interfaces_marks_and_negations_evaluate():
    tables = parse_save(_filter_only(
        "-A FORWARD -i lxc+ -j MARK --set-xmark 0x10/0x10",
        "-A FORWARD ! -i lxc+ -j MARK --or-mark 0x20",
        "-A FORWARD -m mark --mark 0x10/0x10 -p udp -j REJECT",
        '-A FORWARD -m mark --mark 0x10/0x10 -m multiport --dports 70:90,443 -m comment --comment "pods to web" -j DROP',
    ))
    from_pod = walk(tables, FlowSpec("10.244.3.5", "10.0.0.9", 80, origin="pod", in_iface="lxcabc"), NodeFacts())
    from_out = walk(tables, FlowSpec("203.0.113.5", "10.0.0.9", 80, in_iface="eth0"), NodeFacts())
    assert (from_pod.verdict, from_pod.reason) == ("drop", "pods to web")
    assert from_out.verdict == "pass"


def test_service_names_are_read_from_comments_not_cidrs():
    assert service_of("default/web:http cluster IP") == "default/web:http"
    assert service_of("other traffic to ns1/svc1:p80 will be dropped by KUBE-PROXY-FIREWALL") == "ns1/svc1:p80"
    assert service_of("block incoming localnet connections 127.0.0.0/8") is None
    assert service_of(None) is None


def test_what_was_not_checked_is_said_and_quoted_comments_are_read_whole():
    nat_only = SEED_WORKER2.split("*filter")[0].replace(
        '"default/my-nginx cluster IP"', '"default/my-nginx \\"cluster\\" IP"')
    t = walk(parse_save(nat_only), FlowSpec("10.244.3.5", "10.104.89.245", 80, origin="pod", in_iface="veth1"),
             facts("worker2"))
    assert t.verdict == "dnat" and t.reason == 'default/my-nginx "cluster" IP'
    assert "[the rules hold no filter table: filter FORWARD was not checked]" in t.sentence()


def test_a_new_connection_is_new_and_dnat_once_translated():
    """KUBE-FIREWALL's localnet rule: `! --ctstate RELATED,ESTABLISHED,DNAT` matches a NEW connection
    that was not DNATed (dropped) and not one that was (a localhost NodePort)."""
    tables = tables_for("worker2", [(nginx(False), endpoints(NGINX, "worker2"))])
    ssh = walk(tables, FlowSpec("10.244.3.5", "127.0.0.1", 22, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert (ssh.verdict, ssh.reason) == ("drop", "block incoming localnet connections")
    local_dnat = parse_save("""*nat
:PREROUTING ACCEPT [0:0]
-A PREROUTING -p tcp --dport 22 -j DNAT --to-destination 127.0.0.1:2222
COMMIT
*filter
:INPUT ACCEPT [0:0]
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j DROP
-A INPUT -d 127.0.0.0/8 -m conntrack ! --ctstate DNAT -j DROP
-A INPUT -m state --state NEW -m conntrack --ctstate NEW,DNAT -p tcp --dport 2222 -j ACCEPT
COMMIT
""")
    t = walk(local_dnat, FlowSpec("10.244.3.5", "127.0.0.1", 22, origin="pod", in_iface="lxc1"), facts("worker2"))
    assert (t.verdict, t.backends, t.masquerade) == ("dnat", ("127.0.0.1:2222",), False)
    assert t.steps[-1].action == "ACCEPT"
