"""The pure parts of the eBPF trace (no root): the frame it hands the kernel, and the words it uses."""

from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.layers.sctp import SCTP, SCTPChunkInit

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.explain import ebpf_trace
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.model import Protocol


def _valid_checksums(raw: bytes, layer) -> None:
    pkt = Ether(raw)
    fresh = Ether(raw)
    del fresh[IP].chksum
    del fresh[layer].chksum
    fresh = Ether(bytes(fresh))
    assert (fresh[IP].chksum, fresh[layer].chksum) == (pkt[IP].chksum, pkt[layer].chksum)


def test_tcp_frame_is_a_syn_with_valid_checksums():
    raw = ebpf_trace.build_frame(FlowSpec("203.0.113.5", "172.20.20.16", 30294, sport=41000))
    pkt = Ether(raw)
    assert (pkt[IP].src, pkt[IP].dst, pkt[TCP].sport, pkt[TCP].dport, str(pkt[TCP].flags)) == \
        ("203.0.113.5", "172.20.20.16", 41000, 30294, "S")
    _valid_checksums(raw, TCP)
    assert ebpf_trace._frame_dst(raw) == ("172.20.20.16", 30294)


def test_udp_frame_has_valid_checksums():
    raw = ebpf_trace.build_frame(FlowSpec("10.244.5.4", "10.96.0.10", 53, protocol=Protocol.UDP))
    assert Ether(raw)[UDP].dport == 53
    _valid_checksums(raw, UDP)


def test_sctp_frame_is_an_init_with_a_valid_crc32c():
    raw = ebpf_trace.build_frame(FlowSpec("10.244.5.4", "10.96.0.10", 80, sport=41000, protocol=Protocol.SCTP))
    pkt = Ether(raw)
    assert (pkt[SCTP].sport, pkt[SCTP].dport, pkt[SCTP].tag, pkt[SCTPChunkInit].type) == (41000, 80, 0, 1)
    fresh = Ether(raw)
    del fresh[IP].chksum
    del fresh[SCTP].chksum
    fresh = Ether(bytes(fresh))  # scapy computes both, the CRC32c as the kernel stores it
    assert (fresh[IP].chksum, fresh[SCTP].chksum) == (pkt[IP].chksum, pkt[SCTP].chksum)
    assert ebpf_trace._frame_dst(raw) == ("10.96.0.10", 80)


def test_crc32c_is_castagnolis():
    assert ebpf_trace._crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C


def test_reason_is_the_name_and_what_it_means():
    assert ebpf_trace.reason_text(s.Reason.DROP_NO_LOCAL_EXTERNAL) == \
        "DROP_NO_LOCAL_EXTERNAL: externalTrafficPolicy=Local, from outside, no local endpoint"


def _rec(**kw) -> s.EpxTraceRec:
    return s.EpxTraceRec(**kw)


def test_hairpin_masquerades_only_when_every_backend_is_the_client():
    flow = FlowSpec("10.244.5.4", "10.96.0.10", 80, origin="pod")
    rec = _rec(flags=s.TRACE_F_POLICY | s.TRACE_F_BACKEND, masq=s.TRACE_MASQ_HAIRPIN)
    assert ebpf_trace._masquerades(rec, ["10.244.5.4:80"], flow)
    assert not ebpf_trace._masquerades(rec, ["10.244.5.4:80", "10.244.4.3:80"], flow)
    assert ebpf_trace._masquerades(_rec(flags=s.TRACE_F_POLICY, masq=s.TRACE_MASQ_POLICY), ["10.244.4.3:80"], flow)


def test_the_etp_local_drop_story_names_the_policy():
    flow = FlowSpec("203.0.113.5", "172.20.20.16", 30294)
    rec = _rec(flags=s.TRACE_F_SERVICE | s.TRACE_F_POLICY, origin=s.ORIGIN_EXTERNAL, scope=s.LB4_SCOPE_LOCAL,
               svc_flags=s.LB4_F_EXTERNAL | s.LB4_F_ETP_LOCAL)
    story = ebpf_trace._story("drop", s.Reason.DROP_NO_LOCAL_EXTERNAL, rec, "default/my-nginx:http", flow, [], None,
                              "xdp_lb")
    assert story.startswith("drop default/my-nginx:http: externalTrafficPolicy=Local")
    assert "no local endpoint" in story


def test_service_names_are_looked_up_whatever_the_protocol_spelling():
    flow = FlowSpec("10.96.0.10", "10.96.0.10", 80)
    assert ebpf_trace._service_name({("10.96.0.10", 80, "TCP"): "default/web:http"}, flow) == "default/web:http"
    assert ebpf_trace._service_name({("10.96.0.10", 80, Protocol.TCP): "default/web:http"}, flow) == "default/web:http"
    assert ebpf_trace._service_name({("10.96.0.10", 80, "tcp"): "default/web:http"}, flow) == "default/web:http"
    assert ebpf_trace._service_name(None, flow) is None


def test_sctp_frame_over_ipv6_is_an_init_with_a_valid_crc32c():
    raw = ebpf_trace.build_frame(FlowSpec("fd10:244::7", "fd00:96::10", 80, sport=41000, protocol=Protocol.SCTP))
    pkt = Ether(raw)
    assert (pkt[IPv6].nh, pkt[IPv6].plen, pkt[SCTP].sport, pkt[SCTP].dport, pkt[SCTPChunkInit].type) == \
        (132, 32, 41000, 80, 1)
    fresh = Ether(raw)
    del fresh[SCTP].chksum
    assert Ether(bytes(fresh))[SCTP].chksum == pkt[SCTP].chksum  # no pseudo-header: the same CRC32c as IPv4's
    assert ebpf_trace._frame_dst(raw) == ("fd00:96::10", 80)
