"""tc_ingress on the first packet of a connection: kube-proxy's decision, rule by rule.

Each case: the service as the maps hold it, one packet, and what must come out: the verdict,
the one reason counted, the set of backends the DNAT may pick, and whether the connection is
masqueraded. Rule numbers refer to the shared SEMANTICS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from scapy.layers.inet import ICMP, IP, TCP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Packet

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import DETECT_IFACE, DETECT_NONE, NodeSettings
from tests.bpf import world as w
from tests.bpf.packets import (
    MAC_NODE,
    MAC_PEER,
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    assert_checksums_valid,
    counted,
    endpoints,
    run,
    tcp,
    udp,
)

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ALL = (w.LOCAL_EP, w.REMOTE_EP, w.REMOTE_EP2)
LOCAL = (w.LOCAL_EP,)
ETP = s.LB4_F_ETP_LOCAL
ITP = s.LB4_F_ITP_LOCAL
HAS = s.LB4_F_HAS_ENDPOINTS


@dataclass(frozen=True)
class Case:
    desc: str
    svc: w.Svc | None
    pkt: Packet
    reason: s.Reason
    backends: tuple[tuple[str, int], ...] = ()  # DNAT targets allowed (new connections)
    masq: bool = False
    settings: NodeSettings = w.SETTINGS
    ifaces: dict[int, int] | None = None  # epx_iface contents

    @property
    def verdict(self) -> int:
        if self.reason == R.REJECT:
            return TC_ACT_REDIRECT
        return TC_ACT_SHOT if self.reason.is_drop else TC_ACT_OK


def etp_local(**kw) -> w.Svc:
    return w.web(flags=HAS | ETP, **kw)


def no_endpoints(**kw) -> w.Svc:
    return w.web(**{"flags": 0, "cluster": (), "local": (), **kw})


CASES = [
    # rule 1, 2, 3: clusterIP
    Case("clusterIP from a pod: any endpoint, no masquerade", w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW, ALL),
    Case("clusterIP from outside the cluster CIDR: masquerade", w.web(), tcp(w.OUTSIDE, 40000, w.VIP, 80), R.FWD_NEW, ALL, masq=True),
    Case("clusterIP from a node address: masquerade", w.web(), tcp(w.NODE_IP2, 40000, w.VIP, 80), R.FWD_NEW, ALL, masq=True),
    Case("hairpin: a pod landing on itself is masqueraded", w.web(cluster=LOCAL), tcp(w.LOCAL_EP[0], 40000, w.VIP, 80), R.FWD_NEW, LOCAL, masq=True),
    Case("masquerade-all: pod traffic masqueraded too", w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW, ALL, masq=True,
         settings=replace(w.SETTINGS, masquerade_all=True)),
    Case("UDP clusterIP from a pod", w.web(proto=w.UDP), udp(w.POD_CLIENT, 5353, w.VIP, 80), R.FWD_NEW, ALL),
    Case("UDP without checksum stays without", w.web(proto=w.UDP), udp(w.POD_CLIENT, 5353, w.VIP, 80, chksum=0), R.FWD_NEW, ALL),
    Case("TCP with IP options", w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 80, options=b"\x01\x01\x01\x00"), R.FWD_NEW, ALL),
    # rule 4: NodePort, eTP=Cluster
    Case("NodePort on the node's first address: any endpoint, masquerade", w.web(), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL, masq=True),
    Case("NodePort on the node's second address", w.web(), tcp(w.OUTSIDE, 40000, w.NODE_IP2, w.NODE_PORT), R.FWD_NEW, ALL, masq=True),
    Case("NodePort from a pod: still masqueraded", w.web(), tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL, masq=True),
    Case("nodePort on an address that is not the node's: not a service", w.web(), tcp(w.OUTSIDE, 40000, "192.168.50.99", w.NODE_PORT), R.PASS_NO_SERVICE),
    # rules 5, 6, 7: eTP=Local
    Case("eTP=Local from outside: local endpoints only, client IP kept", etp_local(), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, LOCAL),
    Case("eTP=Local from outside, no local endpoint: dropped", etp_local(local=()), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.DROP_NO_LOCAL_EXTERNAL),
    Case("eTP=Local from a pod: any endpoint, no masquerade", etp_local(), tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL),
    Case("eTP=Local from a pod, no local endpoint: still served", etp_local(local=()), tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL),
    Case("eTP=Local from a node address: any endpoint, masquerade", etp_local(local=()), tcp(w.NODE_IP2, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL, masq=True),
    Case("eTP=Local clusterIP from outside: cluster policy applies", etp_local(local=()), tcp(w.OUTSIDE, 40000, w.VIP, 80), R.FWD_NEW, ALL, masq=True),
    # rule 11: externalIPs, LB IPs, source ranges
    Case("externalIP eTP=Local from outside: local only", etp_local(), tcp(w.OUTSIDE, 40000, w.EXTERNAL_IP, 80), R.FWD_NEW, LOCAL),
    Case("LB IP eTP=Cluster from outside: masquerade", w.web(), tcp(w.OUTSIDE, 40000, w.LB_IP, 80), R.FWD_NEW, ALL, masq=True),
    Case("LB IP from a pod, eTP=Local: short-circuited, no masquerade", etp_local(local=()), tcp(w.POD_CLIENT, 40000, w.LB_IP, 80), R.FWD_NEW, ALL),
    Case("LB source range admits the client",
         w.web(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES),), ranges=("203.0.113.0/24",)),
         tcp(w.OUTSIDE, 40000, w.LB_IP, 80), R.FWD_NEW, ALL, masq=True),
    Case("LB source range denies the client",
         w.web(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES),), ranges=("203.0.113.0/24",)),
         tcp(w.OUTSIDE2, 40000, w.LB_IP, 80), R.DROP_SOURCE_RANGE),
    Case("source ranges of another service do not admit",
         w.web(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES),), ranges=()),
         tcp(w.OUTSIDE, 40000, w.LB_IP, 80), R.DROP_SOURCE_RANGE),
    Case("source ranges do not apply to the nodePort",
         w.web(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES), (None, w.NODE_PORT, w.EXT)), ranges=("203.0.113.0/24",)),
         tcp(w.OUTSIDE2, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL, masq=True),
    # rule 9: no endpoints
    Case("no endpoints, clusterIP TCP: rejected", no_endpoints(), tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.REJECT),
    Case("no endpoints, nodePort UDP: rejected", no_endpoints(proto=w.UDP), udp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.REJECT),
    Case("no endpoints anywhere, eTP=Local from outside: rejected, not dropped", no_endpoints(flags=ETP),
         tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.REJECT),
    Case("no endpoints, rejected before source ranges", no_endpoints(frontends=((w.LB_IP, 80, w.EXT | s.LB4_F_SOURCE_RANGES),)),
         tcp(w.OUTSIDE2, 40000, w.LB_IP, 80), R.REJECT),
    # rule 12: iTP=Local
    Case("iTP=Local from a pod: local endpoints only", w.web(flags=HAS | ITP, cluster=()), tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW, LOCAL),
    Case("iTP=Local, no local endpoint: dropped", w.web(flags=HAS | ITP, cluster=(), local=()), tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.DROP_NO_LOCAL_INTERNAL),
    Case("iTP=Local from outside: local only, masquerade", w.web(flags=HAS | ITP, cluster=()), tcp(w.OUTSIDE, 40000, w.VIP, 80), R.FWD_NEW, LOCAL, masq=True),
    # no local-traffic detector (e.g. no --cluster-cidr): kube-proxy has no rule telling pods
    # apart, masquerades no clusterIP traffic and short-circuits no pod traffic (upstream
    # TestInternalExternalMasquerade, "no LocalTrafficDetector")
    Case("no cluster CIDR: clusterIP from outside is not masqueraded", w.web(), tcp(w.OUTSIDE, 40000, w.VIP, 80),
         R.FWD_NEW, ALL, settings=replace(w.SETTINGS, local_detect=DETECT_NONE)),
    Case("no cluster CIDR: hairpin is still masqueraded", w.web(cluster=LOCAL), tcp(w.LOCAL_EP[0], 40000, w.VIP, 80),
         R.FWD_NEW, LOCAL, masq=True, settings=replace(w.SETTINGS, local_detect=DETECT_NONE)),
    Case("no cluster CIDR: NodePort is still masqueraded", w.web(), tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT),
         R.FWD_NEW, ALL, masq=True, settings=replace(w.SETTINGS, local_detect=DETECT_NONE)),
    Case("no cluster CIDR, masquerade-all: masqueraded", w.web(), tcp(w.OUTSIDE, 40000, w.VIP, 80), R.FWD_NEW, ALL,
         masq=True, settings=replace(w.SETTINGS, local_detect=DETECT_NONE, masquerade_all=True)),
    Case("no detector: a pod to an eTP=Local NodePort gets local endpoints only, source kept", etp_local(),
         tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, LOCAL,
         settings=replace(w.SETTINGS, local_detect=DETECT_NONE)),
    Case("no detector: a pod to an eTP=Local NodePort without local endpoint: dropped", etp_local(local=()),
         tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.DROP_NO_LOCAL_EXTERNAL,
         settings=replace(w.SETTINGS, local_detect=DETECT_NONE)),
    # --masquerade-all: clusterIP and eTP=Cluster external traffic, but not a pod's short-circuited
    # eTP=Local traffic (upstream TestInternalExternalMasquerade, "masqueradeAll")
    Case("masquerade-all: a pod to a clusterIP is masqueraded", w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 80),
         R.FWD_NEW, ALL, masq=True, settings=replace(w.SETTINGS, masquerade_all=True)),
    Case("masquerade-all: a pod to an eTP=Local NodePort keeps its source", etp_local(),
         tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL, settings=replace(w.SETTINGS, masquerade_all=True)),
    # interface detectors: local iff the device the packet came in on is marked EPX_IF_LOCAL (the
    # test runs come in on ifindex 1)
    Case("interface detector, local device: a pod to a clusterIP keeps its source", w.web(),
         tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW, ALL, settings=replace(w.SETTINGS, local_detect=DETECT_IFACE),
         ifaces={1: s.EPX_IF_POD | s.EPX_IF_LOCAL}),
    Case("interface detector, other device: a pod address to a clusterIP is masqueraded", w.web(),
         tcp(w.POD_CLIENT, 40000, w.VIP, 80), R.FWD_NEW, ALL, masq=True,
         settings=replace(w.SETTINGS, local_detect=DETECT_IFACE), ifaces={1: s.EPX_IF_POD}),
    Case("interface detector, local device: short-circuit to every endpoint", etp_local(),
         tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, ALL,
         settings=replace(w.SETTINGS, local_detect=DETECT_IFACE), ifaces={1: s.EPX_IF_LOCAL}),
    Case("interface detector, other device: eTP=Local gets local endpoints", etp_local(),
         tcp(w.POD_CLIENT, 40000, w.NODE_IP, w.NODE_PORT), R.FWD_NEW, LOCAL,
         settings=replace(w.SETTINGS, local_detect=DETECT_IFACE)),
    # not ours
    Case("a port the service does not have", w.web(), tcp(w.POD_CLIENT, 40000, w.VIP, 81), R.PASS_NO_SERVICE),
    Case("UDP to a TCP service port", w.web(), udp(w.POD_CLIENT, 40000, w.VIP, 80), R.PASS_NO_SERVICE),
    # 0.0.0.0 is the key NodePorts are stored under, never a node address: addrtype says BROADCAST
    # and the kernel drops it as martian (regression: it was DNATed; found by test_fuzz_packets.py)
    Case("0.0.0.0 on a NodePort: not a node address", w.web(), tcp(w.OUTSIDE, 40000, "0.0.0.0", w.NODE_PORT),
         R.PASS_NO_SERVICE),
    Case("ICMP to a clusterIP", w.web(), Ether(src=MAC_PEER, dst=MAC_NODE) / IP(src=w.POD_CLIENT, dst=w.VIP) / ICMP(), R.PASS_NOT_L4),
    Case("ARP", w.web(), Ether(src=MAC_PEER, dst="ff:ff:ff:ff:ff:ff") / ARP(pdst=w.VIP), R.PASS_NOT_IPV4),
    # IPv6 has its own path and maps (test_tc_ipv6.py), off until the agent serves IPv6 with it
    Case("IPv6 while the eBPF datapath does not serve IPv6", w.web(),
         Ether(src=MAC_PEER, dst=MAC_NODE) / IPv6(dst="fd00::1") / TCP(dport=80), R.PASS_IPV6_OFF),
    # failures with a reason
    Case("masquerade needed, no masquerade address configured: dropped", w.web(), tcp(w.OUTSIDE, 40000, w.VIP, 80), R.DROP_SNAT_NO_ADDR,
         settings=replace(w.SETTINGS, snat_addr=None)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.desc for c in CASES])
def test_first_packet(datapath, maps, case: Case):
    maps.set_settings(case.settings)
    if case.ifaces:
        maps.set_ifaces(case.ifaces)
    if case.svc:
        w.install(maps, case.svc)
    out = run(datapath, "tc_ingress", case.pkt)

    assert out.verdict == case.verdict
    assert counted(maps) == {case.reason: 1}
    conns = {c.kind: c for c in maps.connections()}
    if case.reason != R.FWD_NEW:
        assert not conns, "no connection may be recorded"
        if case.verdict == TC_ACT_OK:
            assert out.raw == bytes(case.pkt), "a packet that is not ours passes unchanged"
        return

    (src, dst) = endpoints(out.pkt)
    (orig_src, _) = endpoints(case.pkt)
    assert dst in case.backends
    assert src == orig_src, "ingress never rewrites the source (masquerade happens on egress)"
    assert_checksums_valid(out.pkt)
    if case.pkt.haslayer("UDP") and case.pkt["UDP"].chksum == 0:
        assert out.pkt["UDP"].chksum == 0
    assert bytes(out.pkt[IP].payload.payload) == bytes(case.pkt[IP].payload.payload), "payload untouched"

    svc = conns[s.CT4_SVC]
    assert (svc.nat_addr, svc.nat_port) == dst
    assert bool(svc.flags & s.CT4_F_MASQ) == case.masq
    assert (s.CT4_SNAT in conns) == case.masq and (s.CT4_REV_SNAT in conns) == case.masq
    assert s.CT4_REV_DNAT in conns
    if case.masq:
        assert svc.snat_addr == w.NODE_IP
        assert w.SNAT_MIN <= svc.snat_port <= w.SNAT_MAX


def test_missing_slot_is_dropped_with_its_reason(datapath, maps):
    svc = w.web()
    w.install(maps, svc)
    maps.set_slots(svc.id, s.LB4_SCOPE_CLUSTER, [], previous=len(svc.cluster))  # count still says 3
    out = run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80))
    assert out.verdict == TC_ACT_SHOT
    assert counted(maps) == {R.DROP_NO_BACKEND: 1}


def test_new_connections_spread_uniformly(datapath, maps):
    """Rule 1/10: uniformly random over the usable endpoints (iptables' 1/n, 1/(n-1), ... chain)."""
    w.install(maps, w.web())
    n = 600
    picks: dict[tuple[str, int], int] = {}
    for i in range(n):
        out = run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 20000 + i, w.VIP, 80))
        dst = endpoints(out.pkt)[1]
        picks[dst] = picks.get(dst, 0) + 1
    assert set(picks) == set(ALL)
    # each expected 200, sd ~11.5: outside [140, 260] is > 5 sd
    assert all(140 <= c <= 260 for c in picks.values()), picks
    assert counted(maps) == {R.FWD_NEW: n}
