"""tc_lo (bpf/lib/lo6.h): [::1]:<nodePort> on the node's lo, dropped exactly where kube-proxy's
INPUT rule KUBE-EXTERNAL-SERVICES "has no local endpoints" drops it (an eTP=Local NodePort whose
endpoints are all on other nodes), and left to the kernel everywhere else (refused there, as in
the iptables mode). Real program, BPF_PROG_TEST_RUN, frames as lo carries them."""

from __future__ import annotations

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps6
from tests.bpf import world6 as w6
from tests.bpf.packets import TC_ACT_OK, TC_ACT_SHOT, counted, run
from tests.bpf.world6 import LOCAL_EP6, NODE6, NODE_PORT, REMOTE_EP6, REMOTE_EP6_2, tcp6, udp6

pytestmark = [pytest.mark.bpf, pytest.mark.root]

R = s.Reason
ETP, HAS = s.LB4_F_ETP_LOCAL, s.LB4_F_HAS_ENDPOINTS
REMOTE = (REMOTE_EP6, REMOTE_EP6_2)
NO_LOCAL = w6.web6(flags=HAS | ETP, cluster=REMOTE, local=())  # the scenario's eTP=Local port on worker2


@pytest.fixture
def maps6(maps):
    w6.install_node6(maps)
    return maps


def _verdict(datapath, maps, pkt) -> tuple[int, dict]:
    maps.reset_stats()
    out = run(datapath, "tc_lo", pkt)
    if out.verdict == TC_ACT_OK:
        assert out.raw == bytes(pkt), "tc_lo never rewrites a packet"
    return out.verdict, counted(maps)


@pytest.mark.parametrize("pkt", [tcp6("::1", 40000, "::1", NODE_PORT),
                                 udp6("::1", 40000, "::1", NODE_PORT)], ids=["tcp-syn", "udp"])
def test_localhost_to_an_etp_local_nodeport_without_local_endpoint_is_dropped(datapath, maps6, pkt):
    svc = NO_LOCAL if pkt.haslayer(TCP) else w6.web6(flags=HAS | ETP, cluster=REMOTE, local=(), proto=w6.UDP_P)
    w6.install6(maps6, svc)
    assert _verdict(datapath, maps6, pkt) == (TC_ACT_SHOT, {R.DROP_LOCALHOST6_NO_LOCAL: 1})
    assert R.DROP_LOCALHOST6_NO_LOCAL.is_drop


CASES = {
    # kube-proxy has no DROP rule for these: the kernel refuses them, in both modes
    "etp-local-with-a-local-endpoint": (w6.web6(flags=HAS | ETP), tcp6("::1", 40000, "::1", NODE_PORT)),
    "etp-cluster": (w6.web6(cluster=REMOTE, local=()), tcp6("::1", 40000, "::1", NODE_PORT)),
    "no-endpoint-at-all (REJECT, refused)": (w6.web6(flags=ETP, cluster=(), local=()), tcp6("::1", 40000, "::1", NODE_PORT)),
    "not-a-nodeport": (NO_LOCAL, tcp6("::1", 40000, "::1", 8080)),
    "other-protocol": (NO_LOCAL, udp6("::1", 40000, "::1", NODE_PORT)),
    # ctstate NEW only: a segment of an established connection is not the rule's
    "tcp-ack": (NO_LOCAL, tcp6("::1", 40000, "::1", NODE_PORT, flags="A")),
    # a node address on lo: the socket LB decided that call already (connect6)
    "node-address": (NO_LOCAL, tcp6(NODE6, 40000, NODE6, NODE_PORT)),
    # IPv4 localhost NodePorts are the socket LB's (route_localnet): lo's IPv4 leaves at once
    "ipv4-localhost": (NO_LOCAL, Ether(bytes(Ether() / IP(src="127.0.0.1", dst="127.0.0.1") / TCP(sport=40000, dport=NODE_PORT, flags="S")))),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_everything_else_on_lo_passes_uncounted(datapath, maps6, case):
    svc, pkt = CASES[case]
    w6.install6(maps6, svc)
    assert _verdict(datapath, maps6, pkt) == (TC_ACT_OK, {})


def test_ipv6_not_served_passes(datapath, maps6):
    """CFG6_F_ON unset: ip6tables serves IPv6, its own rule drops the packet."""
    w6.install6(maps6, NO_LOCAL)
    Maps6(maps6).set_config6(NODE6, on=False)
    assert _verdict(datapath, maps6, tcp6("::1", 40000, "::1", NODE_PORT)) == (TC_ACT_OK, {})


def test_local_endpoint_arriving_lifts_the_drop(datapath, maps6):
    w6.install6(maps6, NO_LOCAL)
    syn = tcp6("::1", 40000, "::1", NODE_PORT)
    assert _verdict(datapath, maps6, syn)[0] == TC_ACT_SHOT
    w6.install6(maps6, w6.web6(flags=HAS | ETP, cluster=(LOCAL_EP6, *REMOTE), local=(LOCAL_EP6,)))
    assert _verdict(datapath, maps6, syn) == (TC_ACT_OK, {})
