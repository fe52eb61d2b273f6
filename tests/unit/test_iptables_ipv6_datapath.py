"""The IPv6 iptables datapath without root: ip6tables commands per backend, the sync against a
model of ip6tables, the per-family conntrack cleanup, and `ebpf-proxy cleanup` per family."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest

from ebpf_proxy.agent import cleanup as agent_cleanup
from ebpf_proxy.datapath.iptables import IptablesDatapath, backend, render
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.conntrack import ConntrackCleaner, StaleFilter, stale_filters
from ebpf_proxy.model import ChangeSet, Endpoint, NodeConfig, Protocol, ProxyState, ServicePort, ServicePortName
from tests.unit.test_iptables_render import FakeConntrack, FakeIptables

NODE6 = NodeConfig("test-node", family=6, node_ips=("2001:db8::1",), cluster_cidrs=("fd00:10::/64",))
WEB = ServicePortName("ns1", "web", "http", Protocol.TCP)
DNS = ServicePortName("ns1", "dns", "dns", Protocol.UDP)
ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"


def svc(name=WEB, ip="fd00:172:30::41", port=80, **kw) -> ServicePort:
    return ServicePort(name=name, cluster_ip=ip, port=port, protocol=name.protocol, **kw)


def ep(ip: str, port: int = 8080) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name="other", is_local=False)


def state(*pairs) -> ProxyState:
    return ProxyState(services={s.name: s for s, _ in pairs}, endpoints={s.name: eps for s, eps in pairs})


# ---- backend commands per family ---------------------------------------------------------------


def test_each_backend_has_its_ip6tables_commands():
    run = lambda cmd: (0, "")  # noqa: E731
    assert backend.commands("legacy", run, family=6) == {
        "iptables": ("ip6tables-legacy",), "iptables_save": ("ip6tables-legacy-save",),
        "iptables_restore": ("ip6tables-legacy-restore",)}
    assert backend.commands("nft", run, family=6)["iptables_restore"] == ("ip6tables-nft-restore",)
    assert backend.commands("default", run, family=6) == {
        "iptables": ("ip6tables",), "iptables_save": ("ip6tables-save",), "iptables_restore": ("ip6tables-restore",)}
    assert backend.commands("legacy", run) == backend.COMMANDS["legacy"]  # IPv4 as before
    with pytest.raises(ValueError, match="family"):
        backend.commands("legacy", run, family=5)


def test_auto_detection_of_ipv6_reads_the_ip6tables_save_commands(monkeypatch, caplog):
    monkeypatch.setattr(backend.shutil, "which", lambda name: f"/usr/sbin/{name}")
    seen = []

    def run(cmd):
        seen.append(tuple(cmd))
        # ip6tables-nft holds kube rules; iptables-legacy holds some (ignored for IPv6)
        if cmd[-1] == "ip6tables-nft-save":
            return 0, "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n"
        if cmd[-1] == "iptables-legacy-save":
            return 0, "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j RETURN\n-A X -j Y\nCOMMIT\n"
        return 0, ""

    with caplog.at_level(logging.INFO, logger=backend.__name__):
        assert backend.detect(run, ("nsenter", "--net=/run/netns/x"), family=6) == "nft"
        assert backend.detect(run, family=4) == "legacy"
    assert seen == [("nsenter", "--net=/run/netns/x", "ip6tables-legacy-save"),
                    ("nsenter", "--net=/run/netns/x", "ip6tables-nft-save"),
                    ("iptables-legacy-save",), ("iptables-nft-save",)]
    assert [r.getMessage() for r in caplog.records] == [
        "ip6tables backend: nft (it already holds rules (2 Kubernetes, 1 in all))",
        "iptables backend: legacy (it already holds rules (2 Kubernetes, 2 in all))",
    ]


def test_the_datapath_auto_detects_among_the_ip6tables_commands(monkeypatch):
    monkeypatch.setattr(backend.shutil, "which", lambda name: f"/usr/sbin/{name}" if "legacy" in name else None)
    seen = []

    def runner(cmd, stdin=None):
        seen.append(tuple(cmd))
        return FakeIptables._ok("")

    dp = IptablesDatapath(NODE6, backend="auto", runner=runner, conntrack=FakeConntrack())
    assert dp._cmd._restore == ("ip6tables-legacy-restore",)  # waits for the detection's thread
    assert seen == [("ip6tables-legacy-save",)]


def test_a_failed_detection_falls_back_to_the_default_commands_and_says_so(monkeypatch, caplog):
    """The detection runs in a thread (IptablesDatapath._detect_and_read): were it to raise, the
    commands must still be set (a sync waits for them) and the fallback logged."""
    from ebpf_proxy.datapath.iptables import datapath as iptables_datapath

    def broken(*_args, **_kw):
        raise RuntimeError("detection broke")

    monkeypatch.setattr(iptables_datapath, "detect_reading", broken)
    with caplog.at_level(logging.WARNING, logger=iptables_datapath.__name__):
        dp = IptablesDatapath(NODE6, backend="auto", runner=lambda cmd, stdin=None: FakeIptables._ok(""),
                              conntrack=FakeConntrack())
        assert dp._cmd._restore == ("ip6tables-restore",)
        dp._save_ahead.take(60)  # the thread is done
    assert any("backend detection failed" in r.getMessage() and r.exc_info for r in caplog.records)


# ---- sync, cleanup against a model of ip6tables ----------------------------------------------


class FakeIp6tables(FakeIptables):
    """FakeIptables answering the ip6tables commands only (an iptables command is a test failure)."""

    def __call__(self, cmd, stdin=None):
        cmd = tuple(cmd)
        if cmd[0].startswith("iptables"):
            raise AssertionError(f"an IPv6 datapath ran {cmd}")
        if cmd[0].startswith("ip6tables"):
            self.ip6_commands.append(cmd)
            cmd = ("iptables" + cmd[0][len("ip6tables"):], *cmd[1:])
        return super().__call__(cmd, stdin)

    def __init__(self) -> None:
        super().__init__()
        self.ip6_commands: list[tuple[str, ...]] = []


def test_ipv6_sync_drives_ip6tables_and_leaves_route_localnet_alone():
    fake = FakeIp6tables()
    dp = IptablesDatapath(NODE6, runner=fake, conntrack=FakeConntrack())
    st = state((svc(node_port=30080), (ep("fd00:10::5"),)))
    result = dp.sync(st, ChangeSet())
    assert result.counts["full_sync"] == 1
    rs = render(NODE6, st)
    for table in ("nat", "filter"):
        assert fake.kube_chains(table) == {c: list(r) for c, r in rs.chains(table).items()}
    assert {c[0] for c in fake.ip6_commands} == {"ip6tables", "ip6tables-save", "ip6tables-restore"}
    assert fake.sysctls[ROUTE_LOCALNET] == "0"
    assert not [c for c in fake.commands if ROUTE_LOCALNET in c]  # not even read
    for jump in ch.JUMP_RULES:
        assert sum(r.endswith(f"-j {jump.target}") for r in fake.tables[jump.table][jump.chain]) == 1
    # idempotent, then partial
    dp.sync(st, ChangeSet())
    assert fake.restores[-1] == fake.restores[0]
    st2 = state((svc(node_port=30080), (ep("fd00:10::5"), ep("fd00:10::6"))))
    result = dp.sync(st2, ChangeSet(full=False, services=frozenset({WEB})))
    assert result.counts["full_sync"] == 0 and result.counts["chains_written"] == 2  # SVC + the new SEP
    dp.cleanup()
    assert fake.kube_chains("nat") == {} and fake.kube_chains("filter") == {}
    assert not dp.installed()


def test_ipv4_sync_still_sets_route_localnet():
    fake = FakeIptables()
    IptablesDatapath(NodeConfig("n"), runner=fake, conntrack=FakeConntrack()).sync(ProxyState(), ChangeSet())
    assert fake.sysctls[ROUTE_LOCALNET] == "1"


# ---- conntrack per family ----------------------------------------------------------------------


def test_stale_filters_keep_the_datapaths_family_in_canonical_form():
    v6 = svc(DNS, "FD00:172:30:0::10", 53, node_port=30053, external_ips=("2001:db8:99::11", "192.168.99.11"))
    v4 = svc(ServicePortName("ns1", "dns4", "", Protocol.UDP), "172.30.0.10", 53, node_port=30054)
    st = state((v6, (ep("fd00:10::5", 53),)), (v4, (ep("10.0.0.5", 53),)))
    changes = ChangeSet(full=False, stale_udp_endpoints=frozenset({(DNS, "fd00:10:0::6"), (DNS, "10.0.0.6"),
                                                                   (v4.name, "10.0.0.6")}),
                        stale_udp_services=frozenset({DNS, v4.name}))
    assert stale_filters(changes, st, family=6) == [
        StaleFilter("fd00:172:30::10", 53, "fd00:10::6"),
        StaleFilter("2001:db8:99::11", 53, "fd00:10::6"),
        StaleFilter(None, 30053, "fd00:10::6"),
        StaleFilter("fd00:172:30::10", 53, None),
        StaleFilter("2001:db8:99::11", 53, None),
        StaleFilter(None, 30053, None),
    ]
    assert stale_filters(changes, st) == [  # IPv4: only the IPv4 service
        StaleFilter("172.30.0.10", 53, "10.0.0.6"),
        StaleFilter(None, 30054, "10.0.0.6"),
        StaleFilter("172.30.0.10", 53, None),
        StaleFilter(None, 30054, None),
    ]
    assert StaleFilter("FD00::A", 53, None).orig_dst == "fd00::a"


class _FakeCt:
    """pyroute2's Conntrack, as far as ConntrackCleaner uses it."""

    instances: list[_FakeCt] = []

    def __init__(self, nfgen_family=socket.AF_INET, **kwargs):
        self.nfgen_family, self.kwargs, self.deleted, self.dumped_with = nfgen_family, kwargs, [], None
        _FakeCt.instances.append(self)

    def dump_entries(self, tuple_orig=None):
        self.dumped_with = tuple_orig
        tuple_ = lambda s, d, dport: SimpleNamespace(saddr=s, daddr=d, dport=dport)  # noqa: E731
        return [
            SimpleNamespace(tuple_orig=tuple_("2001:db8::99", "fd00:172:30::10", 53),
                            tuple_reply=tuple_("fd00:10::6", "2001:db8::99", 40000)),
            SimpleNamespace(tuple_orig=tuple_("2001:db8::99", "fd00:172:30::10", 53),
                            tuple_reply=tuple_("fd00:10::5", "2001:db8::99", 40001)),
        ]

    def delete(self, entry):
        self.deleted.append(entry)

    def close(self):
        pass


def test_the_ipv6_cleaner_dumps_and_deletes_inet6_entries(monkeypatch):
    import pyroute2.conntrack

    _FakeCt.instances.clear()
    monkeypatch.setattr(pyroute2.conntrack, "Conntrack", _FakeCt)
    cleaner = ConntrackCleaner("epxt-ns", family=6)
    assert cleaner.delete([StaleFilter("FD00:172:30::10", 53, "fd00:10:0:0::6")]) == 1
    ct = _FakeCt.instances[-1]
    assert ct.nfgen_family == socket.AF_INET6 and ct.kwargs == {"netns": "epxt-ns", "flags": 0}
    assert ct.dumped_with.family == socket.AF_INET6 and ct.dumped_with.proto == socket.IPPROTO_UDP
    assert [e.tuple_reply.saddr for e in ct.deleted] == ["fd00:10::6"]
    ConntrackCleaner().delete([StaleFilter("10.0.0.1", 53, None)])
    assert _FakeCt.instances[-1].nfgen_family == socket.AF_INET
    assert _FakeCt.instances[-1].dumped_with.family == socket.AF_INET


# ---- `ebpf-proxy cleanup`: both families --------------------------------------------------------


def test_cleanup_runs_the_iptables_mode_per_backend_and_family(monkeypatch):
    monkeypatch.setattr(agent_cleanup.shutil, "which", lambda name: f"/usr/sbin/{name}")
    made = []

    class Cleans:
        def __init__(self, mode, node, **opts):
            made.append((mode, node.family, opts.get("backend")))

        def cleanup(self):
            pass

        def close(self):
            pass

    results = agent_cleanup.cleanup_all("n1", modes=("ebpf", "iptables"), factory=Cleans)
    assert [r.mode for r in results] == ["ebpf", "iptables (legacy)", "iptables (nft)",
                                         "iptables (legacy, IPv6)", "iptables (nft, IPv6)"]
    assert made == [("ebpf", 4, None), ("iptables", 4, "legacy"), ("iptables", 4, "nft"),
                    ("iptables", 6, "legacy"), ("iptables", 6, "nft")]
    # mode_variants (the handover's installed check) is unchanged: IPv4 only
    assert [label for _, label, _ in agent_cleanup.mode_variants(("iptables",))] == [
        "iptables (legacy)", "iptables (nft)"]


@pytest.mark.parametrize("installed, labels", [
    (set(), ["iptables"]),
    ({"iptables-legacy-restore"}, ["iptables (legacy)"]),
    ({"iptables-legacy-restore", "ip6tables-restore"}, ["iptables (legacy)", "iptables (IPv6)"]),
    ({"iptables-nft-restore", "ip6tables-nft-restore"}, ["iptables (nft)", "iptables (nft, IPv6)"]),
])
def test_ipv6_cleanup_only_where_ip6tables_is_installed(monkeypatch, installed, labels):
    monkeypatch.setattr(agent_cleanup.shutil, "which", lambda name: f"/usr/sbin/{name}" if name in installed else None)
    assert [label for _, label, _, _ in agent_cleanup.family_variants(("iptables",))] == labels
