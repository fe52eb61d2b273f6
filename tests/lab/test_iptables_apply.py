"""The iptables datapath against the real iptables-restore, iptables-save and conntrack (root).

Every command runs inside network namespaces these tests create (named `epxt-ipt-<pid>-...`) and
delete in a finalizer, even when a test fails; nothing touches the namespace pytest runs in.
The apply tests run with both iptables backends (nft, the default, and legacy), each in its own
namespace. The traffic tests build client <-> node <-> pod:

    client 192.168.50.2 --- 192.168.50.1 node 10.244.1.1 --- 10.244.1.2 pod (echo: 8080/tcp, 5353/udp)
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from tests.netns_util import add_netns, del_netns, nsenter

from ebpf_proxy.datapath.iptables import IptablesDatapath, RestoreError, render
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.apply import IptablesCommands, run_command
from ebpf_proxy.datapath.iptables.backend import family_commands
from ebpf_proxy.datapath.iptables.ruleset import parse_save
from ebpf_proxy.model import ChangeSet, Endpoint, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(shutil.which("iptables-restore") is None, reason="iptables not installed"),
]

PREFIX = f"epxt-ipt-{os.getpid()}-"
_serial = itertools.count()

FLAVOURS = {
    "nft": {"iptables": ("iptables-nft",), "iptables_save": ("iptables-nft-save",),
            "iptables_restore": ("iptables-nft-restore",)},
    "legacy": {"iptables": ("iptables-legacy",), "iptables_save": ("iptables-legacy-save",),
               "iptables_restore": ("iptables-legacy-restore",)},
}

CIDR = "10.244.0.0/16"
CLIENT_IP, NODE_CLIENT_SIDE, NODE_POD_SIDE, POD_IP = "192.168.50.2", "192.168.50.1", "10.244.1.1", "10.244.1.2"
NODE = NodeConfig("node-a", node_ips=(NODE_CLIENT_SIDE, NODE_POD_SIDE), cluster_cidrs=(CIDR,))

WEB = ServicePortName("ns1", "web", "http", Protocol.TCP)
EMPTY = ServicePortName("ns1", "empty", "", Protocol.TCP)
DNS = ServicePortName("ns1", "dns", "dns", Protocol.UDP)
LOCAL = ServicePortName("ns1", "local", "", Protocol.TCP)
LB = ServicePortName("ns1", "lb", "", Protocol.TCP)


def sh(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def in_ns(ns: str, *args: str) -> str:
    return sh(*nsenter(ns), *args)


@pytest.fixture
def netns():
    """Factory of fresh namespaces (loopback up); all deleted at teardown, pass or fail."""
    created: list[str] = []

    def make(tag: str) -> str:
        name = f"{PREFIX}{tag}{next(_serial)}"
        add_netns(name)
        created.append(name)
        sh(*nsenter(name), "ip", "link", "set", "lo", "up")
        return name

    yield make
    for name in reversed(created):
        del_netns(name)


def datapath(ns: str, flavour: str = "nft", node: NodeConfig = NODE) -> IptablesDatapath:
    return IptablesDatapath(node, netns=ns, **FLAVOURS[flavour])


def saved(ns: str, flavour: str = "nft") -> dict[str, dict[str, list[str]]]:
    save = FLAVOURS[flavour]["iptables_save"][0]
    return {t: parse_save(in_ns(ns, save, "-t", t)).get(t, {}) for t in ("nat", "filter")}


def kube_only(tables: dict[str, dict[str, list[str]]]) -> dict[str, dict[str, list[str]]]:
    """Our chains and every rule that mentions them (the jumps in built-in chains included)."""
    return {
        t: {c: [r for r in rules if c.startswith("KUBE-") or "KUBE-" in r]
            for c, rules in chains.items() if c.startswith("KUBE-") or any("KUBE-" in r for r in rules)}
        for t, chains in tables.items()
    }


def svc(name, ip, port, **kw) -> ServicePort:
    return ServicePort(name=name, cluster_ip=ip, port=port, protocol=name.protocol, **kw)


def ep(ip: str, port: int, local: bool = True) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name="node-a" if local else "node-b", is_local=local)


def rich_state() -> ProxyState:
    """One of each kind of rule: affinity, no endpoints, UDP, eTP=Local with none local, source ranges."""
    services = {
        WEB: svc(WEB, "10.96.0.10", 80, node_port=30080, affinity_timeout_seconds=600),
        EMPTY: svc(EMPTY, "10.96.0.11", 80, node_port=30081, external_ips=("203.0.113.9",)),
        DNS: svc(DNS, "10.96.0.53", 53),
        LOCAL: svc(LOCAL, "10.96.0.12", 80, node_port=30082, external_policy_local=True, health_check_node_port=32000),
        LB: svc(LB, "10.96.0.13", 80, load_balancer_ips=("198.51.100.7",), load_balancer_source_ranges=("203.0.113.0/24",)),
    }
    endpoints = {
        WEB: (ep(POD_IP, 8080), ep("10.244.2.2", 8080, local=False)),
        DNS: (ep(POD_IP, 5353),),
        LOCAL: (ep("10.244.2.3", 8080, local=False),),
        LB: (ep(POD_IP, 8080),),
    }
    return ProxyState(services=services, endpoints=endpoints)


# ---- apply mechanics, both backends ---------------------------------------------------------


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_apply_and_read_back(netns, flavour):
    ns = netns("node")
    state = rich_state()
    dp = datapath(ns, flavour)
    result = dp.sync(state, ChangeSet())
    rs = render(NODE, state)
    kernel = saved(ns, flavour)
    for table in ("nat", "filter"):
        ours = {c for c in kernel[table] if c.startswith("KUBE-")}
        assert ours == set(rs.chains(table)), table
        for chain, rules in rs.chains(table).items():
            assert len(kernel[table][chain]) == len(rules), f"{table} {chain}"
    assert result.counts["iptables_rules_nat"] == rs.rule_count("nat")
    assert dp.stats() == {"iptables_rules_nat": rs.rule_count("nat"), "iptables_rules_filter": rs.rule_count("filter")}
    for jump in ch.JUMP_RULES:
        hits = [r for r in kernel[jump.table][jump.chain] if r.endswith(f"-j {jump.target}")]
        assert len(hits) == 1, f"{jump.table} {jump.chain} -> {jump.target}: {hits}"
    svc_rules = kernel["nat"][ch.svc_chain(WEB)]
    assert any("--probability 0.5" in r and "-m recent" not in r for r in svc_rules)
    assert sum("--rcheck --seconds 600 --reap" in r for r in svc_rules) == 2
    sep = kernel["nat"][ch.sep_chain(WEB, POD_IP, 8080)]
    assert "--to-destination 10.244.1.2:8080" in sep[-1] and "--set" in sep[-1]
    assert any("10.96.0.11/32" in r and "icmp-port-unreachable" in r for r in kernel["filter"]["KUBE-SERVICES"])
    assert any("--dport 30082" in r and r.endswith("-j DROP") for r in kernel["filter"]["KUBE-EXTERNAL-SERVICES"])
    assert any("198.51.100.7/32" in r and r.endswith("-j DROP") for r in kernel["filter"]["KUBE-PROXY-FIREWALL"])
    assert any("--dport 32000" in r and r.endswith("-j ACCEPT") for r in kernel["filter"]["KUBE-NODEPORTS"])
    assert in_ns(ns, "sysctl", "-n", "net.ipv4.conf.all.route_localnet").strip() == "1"


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_resync_is_idempotent(netns, flavour):
    ns = netns("node")
    dp = datapath(ns, flavour)
    dp.sync(rich_state(), ChangeSet())
    first = saved(ns, flavour)
    dp.sync(rich_state(), ChangeSet())
    assert saved(ns, flavour) == first
    # A fresh agent (no memory) against the same kernel: still no duplicate jump or chain.
    datapath(ns, flavour).sync(rich_state(), ChangeSet())
    assert saved(ns, flavour) == first
    result = dp.sync(rich_state(), ChangeSet(full=False, services=frozenset({WEB, DNS})))
    assert result.counts["chains_written"] == 0 and result.counts["chains_deleted"] == 0
    assert saved(ns, flavour) == first


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_restarted_full_sync_reads_the_jumps_from_its_save(netns, flavour):
    """A restarted agent's full sync finds its jumps in the iptables-save it takes anyway, with no
    `iptables -C` (each reads the whole table from the kernel: ~0.12 s for the nat table at
    10,000 Services); a jump someone deleted is not in the save, so -C is asked and it goes back."""
    ns = netns("node")
    datapath(ns, flavour).sync(rich_state(), ChangeSet())
    first = saved(ns, flavour)
    calls: list[tuple[str, ...]] = []

    def recording(cmd, stdin=None):
        calls.append(tuple(cmd))
        return run_command(cmd, stdin)

    def restarted() -> IptablesDatapath:
        return IptablesDatapath(NODE, netns=ns, runner=recording, **FLAVOURS[flavour])

    restarted().sync(rich_state(), ChangeSet())
    assert [c for c in calls if "-C" in c] == []
    assert saved(ns, flavour) == first
    jump = next(j for j in ch.JUMP_RULES if j.table == "nat" and j.chain == "PREROUTING")
    in_ns(ns, FLAVOURS[flavour]["iptables"][0], "-t", "nat", "-D", jump.chain, *jump.rule_args)
    calls.clear()
    restarted().sync(rich_state(), ChangeSet())
    asked = [c for c in calls if "-C" in c]
    assert len(asked) == 1 and asked[0][asked[0].index("-C") + 1] == "PREROUTING", asked
    assert saved(ns, flavour) == first


@pytest.mark.parametrize("max_age", [60.0, 0.0])
def test_the_first_full_sync_takes_the_save_read_ahead_while_fresh(netns, monkeypatch, max_age):
    """prefetch() reads the chains while the agent lists; the first full sync then saves nothing
    itself, unless that read is older than SAVE_AHEAD_MAX_AGE_SECONDS (then it reads again)."""
    from ebpf_proxy.datapath.iptables import datapath as iptables_datapath

    monkeypatch.setattr(iptables_datapath, "SAVE_AHEAD_MAX_AGE_SECONDS", max_age)
    ns = netns("node")
    datapath(ns, "legacy").sync(rich_state(), ChangeSet())
    first = saved(ns, "legacy")
    saves: list[str] = []  # the thread of each iptables-save run

    def recording(cmd, stdin=None):
        if any(word.endswith("-save") for word in cmd):
            saves.append(threading.current_thread().name)
        return run_command(cmd, stdin)

    dp = IptablesDatapath(NODE, netns=ns, runner=recording, **FLAVOURS["legacy"])
    dp.prefetch()
    dp.sync(rich_state(), ChangeSet())  # waits for the read ahead: filter and nat, then none or both again
    ahead = ["iptables-save-ahead"] * 2
    assert saves == (ahead if max_age else [*ahead, "MainThread", "MainThread"]), saves
    assert saved(ns, "legacy") == first
    dp.prefetch()  # after a sync: nothing to read ahead
    dp.sync(rich_state(), ChangeSet())
    assert len(saves) == (4 if max_age else 6) and saves[-1] == "MainThread"



@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_an_auto_detected_backend_gives_the_first_full_sync_its_save(netns, flavour):
    """With backend auto, a thread saves every table of each backend to choose one (as
    iptables-wrapper does), and the first full sync reads the existing chains from the chosen
    one's save: no save of its own (~0.2 s at 10,000 Services), a stale chain of an earlier run
    still found and deleted, and the jumps still found without `iptables -C`."""
    ns = netns("node")
    datapath(ns, flavour).sync(rich_state(), ChangeSet())
    first = saved(ns, flavour)
    stale = ch.svc_chain(ServicePortName("gone", "old", "http", Protocol.TCP))
    in_ns(ns, FLAVOURS[flavour]["iptables"][0], "-t", "nat", "-N", stale)
    calls: list[tuple[str, tuple[str, ...]]] = []  # (thread, command) of each command run

    def recording(cmd, stdin=None):
        calls.append((threading.current_thread().name, tuple(cmd)))
        return run_command(cmd, stdin)

    dp = IptablesDatapath(NODE, netns=ns, backend="auto", runner=recording)
    dp.sync(rich_state(), ChangeSet())
    saves = [(thread, cmd[-1]) for thread, cmd in calls if any(w.endswith("-save") for w in cmd)]
    assert saves == [("iptables-backend", "iptables-legacy-save"), ("iptables-backend", "iptables-nft-save")], saves
    assert dp._cmd._restore[-1] == FLAVOURS[flavour]["iptables_restore"][0]
    assert [cmd for _, cmd in calls if "-C" in cmd] == []
    assert saved(ns, flavour) == first  # the stale chain deleted, nothing else changed


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_partial_sync_reaches_what_a_full_sync_does(netns, flavour):
    partial_ns, full_ns = netns("part"), netns("full")
    before = rich_state()
    after = ProxyState(
        services={n: s for n, s in before.services.items() if n != LB},  # LB deleted
        endpoints={**{n: e for n, e in before.endpoints.items() if n != LB},
                   WEB: (ep(POD_IP, 8080), ep("10.244.2.9", 8080, local=False), ep("10.244.2.10", 8080, local=False)),
                   EMPTY: (ep(POD_IP, 8080),)},
    )
    dp = datapath(partial_ns, flavour)
    dp.sync(before, ChangeSet())
    result = dp.sync(after, ChangeSet(full=False, services=frozenset({WEB, EMPTY, LB})))
    assert result.counts["full_sync"] == 0 and result.counts["chains_deleted"] >= 4
    datapath(full_ns, flavour).sync(after, ChangeSet())
    assert kube_only(saved(partial_ns, flavour)) == kube_only(saved(full_ns, flavour))
    assert ch.fw_chain(LB) not in saved(partial_ns, flavour)["nat"]
    assert ch.sep_chain(WEB, "10.244.2.2", 8080) not in saved(partial_ns, flavour)["nat"]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_cleanup_removes_every_kube_chain_and_jump_only(netns, flavour):
    ns = netns("node")
    ipt = FLAVOURS[flavour]["iptables"][0]
    in_ns(ns, ipt, "-A", "INPUT", "-s", "192.0.2.1", "-j", "ACCEPT")
    in_ns(ns, ipt, "-t", "nat", "-N", "OTHER-CHAIN")
    in_ns(ns, ipt, "-t", "nat", "-A", "POSTROUTING", "-j", "OTHER-CHAIN")
    dp = datapath(ns, flavour)
    dp.sync(rich_state(), ChangeSet())
    dp.cleanup()
    kernel = saved(ns, flavour)
    assert kube_only(kernel) == {"nat": {}, "filter": {}}
    assert kernel["filter"]["INPUT"] == ["-A INPUT -s 192.0.2.1/32 -j ACCEPT"]
    assert kernel["nat"]["POSTROUTING"] == ["-A POSTROUTING -j OTHER-CHAIN"]
    dp.cleanup()  # idempotent
    datapath(ns, flavour).cleanup()  # and from a fresh agent with nothing installed
    assert kube_only(saved(ns, flavour)) == {"nat": {}, "filter": {}}


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_restore_error_carries_stderr_and_the_offending_line(netns, flavour):
    ns = netns("node")
    cmds = IptablesCommands(prefix=tuple(nsenter(ns)), **FLAVOURS[flavour])
    bad = "*nat\n:KUBE-TEST - [0:0]\n-A KUBE-TEST -j KUBE-DOES-NOT-EXIST\nCOMMIT\n"
    with pytest.raises(RestoreError) as info:
        cmds.restore(bad)
    assert info.value.stderr
    assert info.value.line == "-A KUBE-TEST -j KUBE-DOES-NOT-EXIST" and info.value.line_no == 3
    assert "KUBE-DOES-NOT-EXIST" in str(info.value)
    assert "KUBE-TEST" not in saved(ns, flavour)["nat"]  # atomic: nothing of the failed input applied


# ---- real traffic ---------------------------------------------------------------------------

# Both scripts take the IP family first ("4" or "6"): tests/lab/test_ip6tables_apply.py runs them too.
ECHO = r"""
import select, socket, sys
family, any_addr = (socket.AF_INET6, "::") if sys.argv[1] == "6" else (socket.AF_INET, "0.0.0.0")
tcp = socket.socket(family); tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind((any_addr, 8080)); tcp.listen(16)
udp = socket.socket(family, socket.SOCK_DGRAM); udp.bind((any_addr, 5353))
print("ready", flush=True)
while True:
    for s in select.select([tcp, udp], [], [])[0]:
        if s is tcp:
            conn, peer = tcp.accept(); conn.sendall(peer[0].encode()); conn.close()
        else:
            data, peer = udp.recvfrom(2048); udp.sendto(peer[0].encode(), peer)
"""

CLIENT = r"""
import json, socket, sys
family, any_addr = (socket.AF_INET6, "::") if sys.argv[1] == "6" else (socket.AF_INET, "0.0.0.0")
host, port, proto = sys.argv[2], int(sys.argv[3]), sys.argv[4]
try:
    if proto == "tcp":
        s = socket.create_connection((host, port), timeout=3)
    else:
        s = socket.socket(family, socket.SOCK_DGRAM); s.settimeout(3)
        s.bind((any_addr, int(sys.argv[5]))); s.sendto(b"hi", (host, port))
    print(json.dumps({"reply": s.recv(100).decode()}))
except OSError as e:
    print(json.dumps({"errno": e.errno, "error": str(e)}))
"""


def talk(ns: str, host: str, port: int, proto: str = "tcp", sport: int = 40000, family: int = 4) -> dict:
    out = in_ns(ns, sys.executable, "-c", CLIENT, str(family), host, str(port), proto, str(sport))
    return json.loads(out)


@dataclass(frozen=True)
class Wiring:
    """One IP family's addresses of the traffic topology (client - node - pod, and an uplink), the
    node's NodeConfig and the backends to drive: the same tests run over IPv4 and IPv6."""

    family: int
    client: str
    node_client: str  # the node's address facing the client
    node_pod: str  # the node's address facing the pod
    pod: str
    prefix: int
    uplink: str
    gateway: str
    web: str  # the cluster IPs of traffic_state's three services
    empty: str
    dns: str
    node: NodeConfig
    flavours: dict[str, dict[str, tuple[str, ...]]]
    flavour: str  # the backend the traffic tests drive

    @property
    def ip(self) -> tuple[str, ...]:
        return ("ip", "-6") if self.family == 6 else ("ip",)

    def datapath(self, ns: str) -> IptablesDatapath:
        return IptablesDatapath(self.node, netns=ns, **self.flavours[self.flavour])


FLAVOURS6 = {name: family_commands(6)[name] for name in FLAVOURS if shutil.which(f"ip6tables-{name}-restore")}
V4 = Wiring(4, CLIENT_IP, NODE_CLIENT_SIDE, NODE_POD_SIDE, POD_IP, 24, "172.31.0.1", "172.31.0.254",
            "10.96.0.10", "10.96.0.11", "10.96.0.53", NODE, FLAVOURS, "nft")
_CLIENT6, _NODE_CLIENT6, _NODE_POD6, _POD6 = "2001:db8:50::2", "2001:db8:50::1", "fd00:10:1::1", "fd00:10:1::2"
V6 = Wiring(6, _CLIENT6, _NODE_CLIENT6, _NODE_POD6, _POD6, 64, "2001:db8:31::1", "2001:db8:31::fe",
            "fd00:96::10", "fd00:96::11", "fd00:96::53",
            NodeConfig("node-a", family=6, node_ips=(_NODE_CLIENT6, _NODE_POD6),
                       cluster_cidrs=("10.244.0.0/16", "fd00:10::/48")),
            FLAVOURS6, min(FLAVOURS6, default="legacy"))


@pytest.fixture(params=[V4, V6], ids=["ipv4", "ipv6"])
def topology(request, netns):
    """(wiring, client, node, pod): namespaces wired and routed in one IP family, echo server
    running in the pod."""
    w: Wiring = request.param
    if not w.flavours:
        pytest.skip(f"ip{'6' if w.family == 6 else ''}tables not installed")
    client, node, pod = netns("cli"), netns("node"), netns("pod")
    sh(*nsenter(node), "ip", "link", "add", "to-cli", "type", "veth", "peer", "name", "eth0", "netns", client)
    sh(*nsenter(node), "ip", "link", "add", "to-pod", "type", "veth", "peer", "name", "eth0", "netns", pod)
    # An uplink with a default route, as real nodes have: without one, packets to a service IP
    # fail the routing decision (ICMP net unreachable) before the filter table ever sees them.
    # (A veth whose peer stays in the node: this kernel has no dummy device.)
    sh(*nsenter(node), "ip", "link", "add", "uplink", "type", "veth", "peer", "name", "uplink-peer")
    nodad = ("nodad",) if w.family == 6 else ()  # usable at once, not after duplicate detection
    for ns, dev, addr in ((client, "eth0", w.client), (node, "to-cli", w.node_client),
                          (node, "to-pod", w.node_pod), (pod, "eth0", w.pod), (node, "uplink", w.uplink)):
        sh(*nsenter(ns), *w.ip, "addr", "add", f"{addr}/{w.prefix}", "dev", dev, *nodad)
        sh(*nsenter(ns), "ip", "link", "set", dev, "up")
    sh(*nsenter(node), "ip", "link", "set", "uplink-peer", "up")
    sh(*nsenter(client), *w.ip, "route", "add", "default", "via", w.node_client)
    sh(*nsenter(pod), *w.ip, "route", "add", "default", "via", w.node_pod)
    sh(*nsenter(node), *w.ip, "route", "add", "default", "via", w.gateway, "dev", "uplink")
    in_ns(node, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1" if w.family == 6 else "net.ipv4.ip_forward=1")
    echo = subprocess.Popen([*nsenter(pod), sys.executable, "-c", ECHO, str(w.family)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError(f"echo server failed: {echo.stderr.read()}")
        yield w, client, node, pod
    finally:
        echo.kill()
        echo.wait(timeout=10)


def traffic_state(w: Wiring, dns_endpoints: tuple[Endpoint, ...] | None = None) -> ProxyState:
    services = {
        WEB: svc(WEB, w.web, 80, node_port=30080),
        EMPTY: svc(EMPTY, w.empty, 80, node_port=30081),
        DNS: svc(DNS, w.dns, 53),
    }
    dns = (ep(w.pod, 5353),) if dns_endpoints is None else dns_endpoints
    return ProxyState(services=services, endpoints={WEB: (ep(w.pod, 8080),), DNS: dns})


def test_cluster_ip_and_nodeport_dnat_and_masquerade_and_reject(topology):
    w, client, node, _ = topology
    assert talk(client, w.pod, 8080, family=w.family) == {"reply": w.client}  # routed directly: no NAT
    w.datapath(node).sync(traffic_state(w), ChangeSet())
    # Rule 2: clusterIP from outside the cluster CIDR -> DNAT + masquerade (backend sees the node).
    assert talk(client, w.web, 80, family=w.family) == {"reply": w.node_pod}
    # Rule 4: NodePort, eTP=Cluster -> DNAT + masquerade.
    assert talk(client, w.node_client, 30080, family=w.family) == {"reply": w.node_pod}
    # Rule 9: no endpoints -> REJECT (ICMP or ICMPv6 port unreachable): "connection refused".
    assert talk(client, w.empty, 80, family=w.family)["errno"] == errno.ECONNREFUSED
    assert talk(client, w.node_client, 30081, family=w.family)["errno"] == errno.ECONNREFUSED


def _udp_entries(ns: str, family: int) -> list[tuple[str, int, str]]:
    from pyroute2.conntrack import Conntrack, NFCTAttrTuple

    af = socket.AF_INET6 if family == 6 else socket.AF_INET
    ct = Conntrack(nfgen_family=af, netns=ns, flags=0)
    try:
        return [(e.tuple_orig.daddr, e.tuple_orig.dport, e.tuple_reply.saddr)
                for e in ct.dump_entries(tuple_orig=NFCTAttrTuple(family=af, proto=socket.IPPROTO_UDP))]
    finally:
        ct.close()


def test_conntrack_cleanup_removes_the_stale_udp_entry_only(topology):
    w, client, node, _ = topology
    dp = w.datapath(node)
    dp.sync(traffic_state(w), ChangeSet())
    assert talk(client, w.dns, 53, "udp", 40001, family=w.family) == {"reply": w.node_pod}
    # not via the service: must survive
    assert talk(client, w.pod, 5353, "udp", 40002, family=w.family) == {"reply": w.client}
    entries = _udp_entries(node, w.family)
    assert (w.dns, 53, w.pod) in entries and (w.pod, 5353, w.pod) in entries

    result = dp.sync(
        traffic_state(w, dns_endpoints=()),
        ChangeSet(full=False, services=frozenset({DNS}), stale_udp_endpoints=frozenset({(DNS, w.pod)})),
    )
    assert result.counts["conntrack_deleted"] == 1
    deadline = time.monotonic() + 2
    while (w.dns, 53, w.pod) in _udp_entries(node, w.family) and time.monotonic() < deadline:
        time.sleep(0.05)
    entries = _udp_entries(node, w.family)
    assert (w.dns, 53, w.pod) not in entries
    assert (w.pod, 5353, w.pod) in entries
