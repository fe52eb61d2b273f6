"""services.py: model objects to map entries, and endpoint changes as small deltas."""

from __future__ import annotations

import ctypes
import os
import pickle
import random
from dataclasses import replace

import pytest

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import DETECT_CIDR, DETECT_IFACE, DETECT_NONE, Backend, Frontend
from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf.adopt import adopt, entries_of, made_ahead, read
from ebpf_proxy.datapath.ebpf.maps import Maps
from ebpf_proxy.datapath.ebpf.readback import SEND, ReadAhead, make_until_asked
from ebpf_proxy.datapath.ebpf.services import (
    ServicePrograms,
    detector_cidrs,
    detector_is_noop,
    node_addresses,
    node_settings,
    program_node,
    stable_slots,
)
from ebpf_proxy.model import LocalDetector, LocalMode, NodeConfig, ProxyState
from ebpf_proxy.model.types import Endpoint, Protocol, ServicePort, ServicePortName
from tests.bpf import world as w
from tests.bpf.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, counted, endpoints, run, tcp, udp

NAME = ServicePortName("default", "web", "http", Protocol.TCP)
WEB = ServicePort(
    name=NAME, cluster_ip=w.VIP, port=80, protocol=Protocol.TCP, node_port=w.NODE_PORT,
    external_ips=(w.EXTERNAL_IP,), load_balancer_ips=(w.LB_IP,), load_balancer_source_ranges=("203.0.113.0/24",),
)
LOCAL = Endpoint(w.LOCAL_EP[0], 8080, node_name="me", is_local=True)
REMOTE = Endpoint(w.REMOTE_EP[0], 8080, node_name="other")
REMOTE2 = Endpoint(w.REMOTE_EP2[0], 8080, node_name="other2")
TERMINATING = Endpoint("10.244.3.3", 8080, node_name="other", ready=False, serving=True, terminating=True)
NODE = NodeConfig("me", node_ips=(w.NODE_IP, w.NODE_IP2), cluster_cidrs=(w.POD_CIDR,))


# ---- pure ----


@pytest.mark.parametrize("seed", range(20))
def test_stable_slots_moves_little(seed):
    rng = random.Random(seed)
    before = tuple(rng.sample(range(1, 40), rng.randint(0, 12)))
    wanted = set(rng.sample(range(1, 40), rng.randint(0, 12)))
    after = stable_slots(before, wanted)
    assert sorted(after) == sorted(wanted)
    moved = sum(1 for i, b in enumerate(after) if i < len(before) and before[i] != b)
    removed = len(set(before) - wanted)
    assert moved <= removed, "only the slots of leaving backends change hands"


def test_entries_follow_categorize_and_frontend_kinds():
    e = ServicePrograms(maps=None).entries(WEB, (LOCAL, REMOTE, TERMINATING))
    assert {b.addr for b in e.backends.values()} == {LOCAL.ip, REMOTE.ip}  # terminating: not with ready ones
    assert len(e.cluster_slots) == 2 and e.local_slots == ()  # eTP=Cluster: no local set
    has, ext = s.LB4_F_HAS_ENDPOINTS, s.LB4_F_EXTERNAL
    assert e.frontends == {
        Frontend(w.VIP, 80): has,
        Frontend(None, w.NODE_PORT): has | ext,
        Frontend(w.EXTERNAL_IP, 80): has | ext,
        Frontend(w.LB_IP, 80): has | ext | s.LB4_F_SOURCE_RANGES,
    }
    assert e.source_ranges == {"203.0.113.0/24"}


def test_entries_for_local_policies():
    etp = ServicePrograms(maps=None).entries(replace(WEB, external_policy_local=True), (LOCAL, REMOTE))
    assert len(etp.cluster_slots) == 2 and len(etp.local_slots) == 1
    assert etp.backends[etp.local_slots[0]] == Backend(LOCAL.ip, 8080, in_cluster=True, in_local=True)
    itp = ServicePrograms(maps=None).entries(
        replace(WEB, node_port=0, external_ips=(), load_balancer_ips=(), internal_policy_local=True), (REMOTE,)
    )
    assert itp.cluster_slots == () and itp.local_slots == ()
    assert itp.frontends == {Frontend(w.VIP, 80): s.LB4_F_HAS_ENDPOINTS | s.LB4_F_ITP_LOCAL}


def test_not_programmed():
    programs = ServicePrograms(maps=None)
    assert programs.entries(replace(WEB, cluster_ip=None), (REMOTE,)) is None  # headless
    assert programs.entries(replace(WEB, cluster_ip="fd00:10:96::a"), (REMOTE,)) is None  # IPv6: ip6tables


def test_sctp_is_programmed_like_tcp():
    """Issue 10: SCTP frontends (protocol 132), the same entries as TCP's otherwise."""
    programs = ServicePrograms(maps=None)
    tcp_entries = programs.entries(WEB, (REMOTE,))
    sctp_entries = ServicePrograms(maps=None).entries(replace(WEB, protocol=Protocol.SCTP), (REMOTE,))
    assert sctp_entries.frontends == {replace(fe, proto=132): flags for fe, flags in tcp_entries.frontends.items()}
    assert (sctp_entries.backends, sctp_entries.cluster_slots) == (tcp_entries.backends, tcp_entries.cluster_slots)


def test_sctp_over_ipv6_is_programmed_like_tcp():
    """Issue 10: the IPv6 programs serve SCTP too (sctp.h's CRC update is family-free)."""
    web6 = replace(WEB, cluster_ip="fd00:10:96::a", external_ips=(), load_balancer_ips=())
    tcp_entries = ServicePrograms(maps=None, family=6).entries(web6, ())
    sctp_entries = ServicePrograms(maps=None, family=6).entries(replace(web6, protocol=Protocol.SCTP), ())
    assert sctp_entries is not None
    assert sctp_entries.frontends == {replace(fe, proto=132): flags for fe, flags in tcp_entries.frontends.items()}


class _NullMaps:
    """Maps that accept every write and hold nothing: ServicePrograms' own memory, measured alone."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_endpoint_and_service_churn_leave_no_state_behind():
    """Every change moves an endpoint to a never-seen address, and services come and go: the
    agent's memory must stay what the current services need (it once kept every address ever
    seen, and every deleted service's frontends)."""
    import gc
    import tracemalloc

    programs = ServicePrograms(_NullMaps())
    names = [replace(NAME, name=f"svc-{i}") for i in range(50)]

    def churn(rounds: int, start: int) -> None:
        for k in range(start, start + rounds):
            name = names[k % len(names)]
            udp = replace(name, protocol=Protocol.UDP)
            ep = Endpoint(f"100.96.{k // 250 % 250}.{k % 250 + 1}", 8080, node_name="other")
            programs.apply(name, programs.entries(replace(WEB, name=name), (ep, REMOTE)))
            programs.apply(udp, programs.entries(replace(WEB, name=udp, protocol=Protocol.UDP), (ep,)))
            programs.apply(udp, None)
            programs.sync_done()

    tracemalloc.start()
    try:
        churn(500, 0)  # warm up: every service exists, caches are built
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        churn(3000, 500)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"{grown} bytes kept after 3000 changes"
    assert set(programs.current) == set(names)


def test_ids_are_never_reused():
    programs = ServicePrograms(_NullMaps())
    first = programs.entries(WEB, (LOCAL, REMOTE))
    programs.apply(NAME, first)
    again = programs.entries(WEB, (LOCAL, REMOTE, REMOTE2))
    assert again.svc_id == first.svc_id, "a service port keeps its id"
    assert {b.addr: i for i, b in again.backends.items() if b.addr != REMOTE2.ip} == \
        {b.addr: i for i, b in first.backends.items()}, "and its endpoints theirs"
    programs.apply(NAME, programs.entries(WEB, (LOCAL,)))
    back = programs.entries(WEB, (LOCAL, REMOTE))
    assert not set(back.backends) - {i for i, b in back.backends.items() if b.addr == REMOTE.ip} - set(first.backends)
    assert [i for i, b in back.backends.items() if b.addr == REMOTE.ip][0] > max(again.backends), \
        "a returning endpoint gets a fresh id"
    programs.apply(NAME, None)
    assert programs.entries(WEB, (LOCAL,)).svc_id > first.svc_id


# ---- against the maps and the programs ----


@pytest.fixture
def programs(maps):
    program_node(maps, NODE, node_settings(NODE, snat_port_min=w.SNAT_MIN, snat_port_max=w.SNAT_MAX))
    return ServicePrograms(maps)


def sync(programs, svc, eps):
    return programs.apply(svc.name, programs.entries(svc, eps))


@pytest.mark.bpf
@pytest.mark.root
def test_programmed_service_behaves(datapath, maps, programs):
    sync(programs, replace(WEB, external_policy_local=True), (LOCAL, REMOTE))
    out = run(datapath, "tc_ingress", tcp(w.OUTSIDE, 40000, w.NODE_IP, w.NODE_PORT))
    assert out.verdict == TC_ACT_OK and endpoints(out.pkt)[1] == w.LOCAL_EP  # eTP=Local from outside
    out = run(datapath, "tc_ingress", tcp(w.OUTSIDE2, 40000, w.LB_IP, 80))
    assert out.verdict == TC_ACT_SHOT  # source range
    picks = {endpoints(run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 20000 + i, w.VIP, 80)).pkt)[1] for i in range(60)}
    assert picks == {w.LOCAL_EP, w.REMOTE_EP}

    sync(programs, replace(WEB, external_policy_local=True), (REMOTE,))  # the local endpoint left
    maps.reset_stats()
    assert run(datapath, "tc_ingress", tcp(w.OUTSIDE, 40001, w.NODE_IP, w.NODE_PORT)).verdict == TC_ACT_SHOT
    assert counted(maps) == {s.Reason.DROP_NO_LOCAL_EXTERNAL: 1}

    sync(programs, WEB, ())  # no endpoints at all
    assert run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, w.VIP, 80)).verdict == TC_ACT_REDIRECT


@pytest.mark.bpf
@pytest.mark.root
def test_one_endpoint_change_is_a_few_writes(maps, programs):
    eps = (LOCAL, REMOTE, REMOTE2)
    assert sync(programs, WEB, eps) > 0
    assert sync(programs, WEB, eps) == 0, "no change, no write"
    frontends = len(programs.frontends_of(NAME))
    added = Endpoint("10.244.4.4", 8080, node_name="other4")
    # backend + slot + every frontend's count
    assert sync(programs, WEB, (*eps, added)) == 2 + frontends
    # the last slot's backend moves into the hole: slot write + frontends + slot delete + backend delete
    assert sync(programs, WEB, (LOCAL, REMOTE2, added)) == 3 + frontends
    slots = programs.current[NAME].cluster_slots
    assert len(slots) == 3 and len(set(slots)) == 3
    svc_id = programs.current[NAME].svc_id
    assert [maps.slot(svc_id, s.LB4_SCOPE_CLUSTER, i) for i in range(4)] == [*slots, None]


@pytest.mark.bpf
@pytest.mark.root
def test_deleting_a_service_leaves_nothing(maps, programs):
    sync(programs, replace(WEB, external_policy_local=True), (LOCAL, REMOTE, REMOTE2))
    assert programs.apply(NAME, None) > 0
    for name in ("epx_svc", "epx_backend", "epx_slot", "epx_src_range"):
        assert list(maps.keys(name)) == [], name


@pytest.mark.bpf
@pytest.mark.root
def test_stale_udp_endpoint_connections_are_flushed(datapath, maps, programs):
    dns = replace(WEB, name=replace(NAME, protocol=Protocol.UDP), protocol=Protocol.UDP, load_balancer_ips=())
    sync(programs, dns, (REMOTE,))
    run(datapath, "tc_ingress", udp(w.POD_CLIENT, 5000, w.VIP, 80))
    run(datapath, "tc_ingress", udp(w.OUTSIDE, 5000, w.NODE_IP, w.NODE_PORT))
    sync(programs, WEB, (REMOTE,))  # a TCP connection to the same endpoint must survive
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 5000, w.VIP, 80))
    assert programs.flush_udp_connections(dns.name, endpoint_ip="10.9.9.9") == 0
    assert programs.flush_udp_connections(dns.name, endpoint_ip=REMOTE.ip) == 2
    left = [c for c in maps.connections() if c.kind == s.CT4_SVC]
    assert [c.proto for c in left] == [6]
    # the replies of the flushed connections are no longer translated
    maps.reset_stats()
    run(datapath, "tc_egress", udp(REMOTE.ip, 8080, w.POD_CLIENT, 5000))
    assert counted(maps) == {s.Reason.PASS_NO_SERVICE: 1}


@pytest.mark.bpf
@pytest.mark.root
def test_stale_udp_flush_reads_the_connection_table_once(datapath, maps, programs, monkeypatch):
    dns = replace(WEB, name=replace(NAME, protocol=Protocol.UDP), protocol=Protocol.UDP, load_balancer_ips=())
    other = replace(dns, name=replace(dns.name, name="other-dns"), cluster_ip="10.96.0.99", node_port=0,
                    external_ips=())
    sync(programs, dns, (REMOTE, REMOTE2))
    sync(programs, other, (REMOTE,))
    # flows until both backends hold some (the choice is random: six flows all went to REMOTE
    # once in 64 runs, leaving nothing that must survive the flush)
    for port in range(5000, 5200):
        run(datapath, "tc_ingress", udp(w.POD_CLIENT, port, w.VIP, 80))
        if port >= 5005 and {c.nat_addr for c in maps.connections(kind=s.CT4_SVC)} == {REMOTE.ip, REMOTE2.ip}:
            break
    run(datapath, "tc_ingress", udp(w.POD_CLIENT, 6000, "10.96.0.99", 80))
    to_remote = sum(1 for c in maps.connections(kind=s.CT4_SVC) if c.daddr == w.VIP and c.nat_addr == REMOTE.ip)
    reads = []
    real = maps.connections
    monkeypatch.setattr(maps, "connections", lambda **kw: reads.append(kw) or real(**kw))
    removed = programs.flush_udp([(dns.name, REMOTE.ip), (other.name, REMOTE.ip)], [])
    assert removed == to_remote + 1 and len(reads) == 1
    left = real(kind=s.CT4_SVC)
    assert left and all(c.nat_addr == REMOTE2.ip and c.daddr == w.VIP for c in left)
    assert programs.flush_udp([], []) == 0 and len(reads) == 1, "nothing stale: the table is not read"


@pytest.mark.bpf
@pytest.mark.root
def test_connections_of_a_deleted_udp_service_are_flushed_in_its_sync(datapath, maps, programs):
    dns = replace(WEB, name=replace(NAME, protocol=Protocol.UDP), protocol=Protocol.UDP, load_balancer_ips=())
    sync(programs, dns, (REMOTE,))
    run(datapath, "tc_ingress", udp(w.POD_CLIENT, 5000, w.VIP, 80))
    programs.apply(dns.name, None)  # the service and its endpoint go in one sync
    assert programs.flush_udp_connections(dns.name, endpoint_ip=REMOTE.ip) == 1
    programs.sync_done()
    run(datapath, "tc_ingress", udp(w.POD_CLIENT, 5001, w.VIP, 80))  # nothing serves it now: untouched
    assert programs.flush_udp_connections(dns.name) == 0, "forgotten once its sync is done"


# ---- node facts ----


def test_node_settings_and_addresses():
    assert node_settings(NODE, snat_addr="192.0.2.7").snat_addr == "192.0.2.7"
    assert node_settings(NODE).snat_addr == w.NODE_IP, "without a device answer: the first node IP"
    assert node_settings(NODE).local_detect == DETECT_CIDR
    assert node_settings(replace(NODE, cluster_cidrs=())).local_detect == DETECT_NONE
    bridge = LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")
    assert node_settings(replace(NODE, local_detector=bridge)).local_detect == DETECT_IFACE
    node_cidr = LocalDetector(LocalMode.NODE_CIDR, ("10.244.3.0/24",))
    assert detector_cidrs(replace(NODE, local_detector=node_cidr)) == ["10.244.3.0/24"]
    assert detector_cidrs(replace(NODE, local_detector=bridge)) == []
    assert node_addresses(NODE) == [w.NODE_IP, w.NODE_IP2, "127.0.0.1"]
    assert node_addresses(replace(NODE, localhost_nodeports=False)) == [w.NODE_IP, w.NODE_IP2]


def test_the_no_op_detector_is_decided_per_family():
    """--cluster-cidr naming IPv4 only: IPv4's detector is the CIDR one, IPv6's kube-proxy's
    no-op one (getLocalDetectors), and the interface detectors serve both families."""
    node6 = replace(NODE, node_ips=("fd00:20::5",), family=6)
    assert not detector_is_noop(NODE) and detector_is_noop(node6)
    assert not detector_is_noop(replace(node6, cluster_cidrs=(w.POD_CIDR, "fd00:10:244::/56")))
    assert detector_is_noop(replace(NODE, cluster_cidrs=("fd00:10:244::/56",)))
    bridge = LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")
    assert not detector_is_noop(replace(node6, local_detector=bridge))


def test_source_ranges_are_normalized():
    e = ServicePrograms(maps=None).entries(replace(WEB, load_balancer_source_ranges=("203.0.113.5/24",)), (REMOTE,))
    assert e.source_ranges == {"203.0.113.0/24"}


def test_lb_ips_join_the_source_ranges_when_a_node_address_is_admitted():
    """As kube-proxy's KUBE-FW "-s <LB IP>" rule: the node's own traffic from a VIP it holds."""
    svc = replace(WEB, load_balancer_source_ranges=(f"{w.NODE_IP}/32",))
    lb_ips = set(svc.load_balancer_ips)
    assert lb_ips, "WEB has an LB IP"
    admitted = ServicePrograms(maps=None, node_ips=(w.NODE_IP,)).entries(svc, (REMOTE,)).source_ranges
    assert admitted == {f"{w.NODE_IP}/32", *(f"{ip}/32" for ip in lb_ips)}
    elsewhere = ServicePrograms(maps=None, node_ips=("10.9.9.9",)).entries(svc, (REMOTE,)).source_ranges
    assert elsewhere == {f"{w.NODE_IP}/32"}


@pytest.mark.bpf
@pytest.mark.root
def test_program_node_writes_only_differences(maps):
    settings = node_settings(NODE, snat_port_min=w.SNAT_MIN, snat_port_max=w.SNAT_MAX)
    assert program_node(maps, NODE, settings) > 0  # 127.0.0.1 is new, settings differ from the world's
    assert program_node(maps, NODE, settings) == 0
    assert program_node(maps, replace(NODE, node_ips=(w.NODE_IP,)), settings) == 1


@pytest.mark.bpf
@pytest.mark.root
def test_a_node_port_moving_to_another_service_stays(maps, programs):
    other = replace(WEB, name=replace(NAME, name="other"), cluster_ip="10.96.0.20", node_port=0, external_ips=(),
                    load_balancer_ips=())
    sync(programs, WEB, (REMOTE,))
    sync(programs, replace(other, node_port=w.NODE_PORT), (REMOTE2,))  # takes the nodePort over
    sync(programs, replace(WEB, node_port=0), (REMOTE,))  # ...before its old owner lets it go
    held = maps.service(Frontend(None, w.NODE_PORT))
    assert held is not None and held.id == programs.current[other.name].svc_id


# ---- agent restart: adopt what the maps hold ----


def _raw(maps) -> dict[str, dict[bytes, bytes]]:
    out = {}
    for name in ("epx_svc", "epx_backend", "epx_slot", "epx_src_range", "epx_node_addr", "epx_pod_cidr"):
        out[name] = {bytes(k): bytes(v) for k, v in maps._items(name)}
    return out


def _state(*pairs) -> ProxyState:
    return ProxyState(services={svc.name: svc for svc, _ in pairs}, endpoints={svc.name: eps for svc, eps in pairs})


OTHER = replace(WEB, name=replace(NAME, name="other"), cluster_ip="10.96.0.20", node_port=30090, external_ips=(),
                load_balancer_ips=(), load_balancer_source_ranges=())


@pytest.mark.bpf
@pytest.mark.root
def test_restart_takes_over_without_writing(maps, programs):
    web = replace(WEB, external_policy_local=True)
    state = _state((web, (LOCAL, REMOTE, REMOTE2)), (OTHER, (REMOTE,)))
    for svc, eps in ((web, (LOCAL, REMOTE, REMOTE2)), (OTHER, (REMOTE,))):
        sync(programs, svc, eps)
    before = _raw(maps)

    restarted = ServicePrograms(maps)
    assert adopt(restarted, state) == 0
    for name, svc in state.services.items():
        assert restarted.apply(name, restarted.entries(svc, state.endpoints_of(name))) == 0, name
        assert restarted.current[name] == programs.current[name], "same ids, same slots"
    assert _raw(maps) == before


@pytest.mark.bpf
@pytest.mark.root
def test_restart_takes_over_a_helpers_read_back_without_writing(pin_dir, maps, programs, caplog):
    """readback.py: the read-back a helper process made while the agent listed is adopt.read's
    own, and a restart takes over from it as from its own read."""
    web = replace(WEB, external_policy_local=True)
    state = _state((web, (LOCAL, REMOTE, REMOTE2)), (OTHER, (REMOTE,)))
    for svc, eps in ((web, (LOCAL, REMOTE, REMOTE2)), (OTHER, (REMOTE,))):
        sync(programs, svc, eps)
    maps.add_source_range(4000, "192.0.2.0/24")  # a stray: a range of no service
    before = _raw(maps)

    caplog.set_level("INFO", logger="ebpf_proxy.datapath.ebpf.readback")
    snap = ReadAhead.start(pin_dir, 4).take(maps)
    assert snap is not None, caplog.text
    own = read(maps)
    assert snap == own and snap.max_svc_id == 4000, "the same tables and ids as the agent's own read"
    made = {svc_id: entries for svc_id, entries in enumerate(snap.made) if entries is not None}
    assert made == {svc_id: made_ahead(own, svc_id) for svc_id in made}, "what it made ahead (if any yet) is adopt's"
    assert "read back by a helper process" in caplog.text
    restarted = ServicePrograms(maps)
    assert adopt(restarted, state, snap) == 1, "the stray range, nothing else"
    for name in state.services:
        assert restarted.current[name] == programs.current[name], "same ids, same slots"


PLAIN = replace(OTHER, name=replace(NAME, name="plain"), cluster_ip="10.96.0.30", node_port=0)  # one frontend


@pytest.mark.bpf
@pytest.mark.root
def test_a_restart_takes_entries_made_ahead_as_its_own(maps, programs):
    """readback.py: the entries a helper made ahead (adopt.made_ahead: a service's one frontend
    left for the agent to give) are what adopt would make. A restart given them takes over the
    same entries, writes nothing, and its one-frontend service's frontend is the agent's own
    object, its address the model's own text (no second copy of either kept)."""
    state = _state((WEB, (LOCAL, REMOTE)), (PLAIN, (REMOTE, REMOTE2)))
    for svc, eps in ((WEB, (LOCAL, REMOTE)), (PLAIN, (REMOTE, REMOTE2))):
        sync(programs, svc, eps)
    before = _raw(maps)

    snap = read(maps)
    made = {svc_id: made_ahead(snap, svc_id) for svc_id in snap.frontends}
    plain_id = programs.current[PLAIN.name].svc_id
    assert list(made[plain_id].frontends) == [None], "the one frontend left out"
    assert made[programs.current[NAME].svc_id] == entries_of(snap, programs.current[NAME].svc_id), "several: all given"
    snap.made = [made.get(i) for i in range(snap.max_svc_id + 1)]
    restarted = ServicePrograms(maps)
    assert adopt(restarted, state, snap) == 0
    assert snap.made == [], "what was made ahead is not kept once taken"
    for name in state.services:
        assert restarted.current[name] == programs.current[name], "same ids, same slots"
    (fe,) = restarted.current[PLAIN.name].frontends
    assert fe.addr is PLAIN.cluster_ip, "the frontend made by the agent, on the model's address text"
    for name, svc in state.services.items():
        assert restarted.apply(name, restarted.entries(svc, state.endpoints_of(name))) == 0, name
    assert _raw(maps) == before


@pytest.mark.bpf
@pytest.mark.root
def test_the_helper_makes_entries_until_the_first_sync_asks(maps, programs):
    """readback.make_until_asked: every service id's entries, a chunk at a time, while nothing
    asks; none more once the first sync's SEND (or EOF) is there to read."""
    for i in range(5):
        sync(programs, replace(PLAIN, name=replace(NAME, name=f"p{i}"), cluster_ip=f"10.96.1.{i}"), (REMOTE,))
    snap = read(maps)
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as ask, os.fdopen(write_end, "wb") as send:
        chunks = [pickle.loads(c) for c in make_until_asked(snap, ask, chunk=2)]
        assert [len(c) for c in chunks] == [2, 2, 1]
        assert [e for c in chunks for e in c] == [made_ahead(snap, i) for i in snap.frontends]
        send.write(SEND)
        send.flush()
        assert make_until_asked(snap, ask, chunk=2) == [], "asked: nothing more made"


@pytest.mark.bpf
@pytest.mark.root
def test_a_read_back_of_other_maps_or_a_failed_helper_is_not_used(pin_dir, tmp_path, maps, caplog):
    """A helper that read other maps than the loaded ones (pins replaced, a map recreated by the
    load) or that failed is refused, naming why: the first sync then reads the maps itself."""
    caplog.set_level("WARNING", logger="ebpf_proxy.datapath.ebpf.readback")
    spec = s.MAPS["epx_svc"]
    other_fd = libbpf.map_create(libbpf.map_info(maps._fd("epx_svc")).type, "epx_svc", ctypes.sizeof(spec.key),
                                 ctypes.sizeof(spec.leaf), 16)
    other = Maps({**maps._fds, "epx_svc": other_fd})
    try:
        assert ReadAhead.start(pin_dir, 4).take(other) is None
    finally:
        os.close(other_fd)
    assert "read other maps than the ones loaded (epx_svc)" in caplog.text

    caplog.clear()
    assert ReadAhead.start(tmp_path, 4).take(maps) is None
    assert f"exited with status 1: {tmp_path}/" in caplog.text and "No such file" in caplog.text

    unwanted = ReadAhead.start(pin_dir, 4)  # the datapath closed before its first sync
    unwanted.stop()
    assert unwanted._proc.returncode is not None and unwanted._proc.stdout.closed, "ended and reaped"


@pytest.mark.bpf
@pytest.mark.root
def test_restart_removes_what_no_service_claims_and_never_reuses_ids(datapath, maps, programs):
    sync(programs, WEB, (LOCAL, REMOTE))
    sync(programs, OTHER, (REMOTE2,))
    run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 40000, "10.96.0.20", 80))  # a connection to OTHER
    old_svc, old_backends = programs.current[OTHER.name].svc_id, set(programs.current[OTHER.name].backends)
    maps.set_slot(programs.current[NAME].svc_id, s.LB4_SCOPE_CLUSTER, 7, 999)  # a stray slot past the count

    restarted = ServicePrograms(maps)
    assert adopt(restarted, _state((WEB, (LOCAL, REMOTE)))) > 0
    assert set(programs.current[NAME].frontends) == {fe for fe, _ in maps.services()}
    assert maps.slot(programs.current[NAME].svc_id, s.LB4_SCOPE_CLUSTER, 7) is None
    assert set(maps.backends()) == set(programs.current[NAME].backends)

    added = restarted.entries(OTHER, (REMOTE2,))  # back again: fresh ids, above every id seen
    assert added.svc_id > old_svc and min(added.backends) > max(old_backends)
    assert [c for c in maps.connections() if c.kind == s.CT4_SVC], "connections are not flushed"
