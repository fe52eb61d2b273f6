"""agent/config.py and `ebpf-proxy run`'s flags: kube-proxy's names, file < flags, errors name the input."""

from __future__ import annotations

import logging
import re
import textwrap

import pytest
from click.testing import CliRunner

from ebpf_proxy.agent.config import AgentConfig, ConfigError, load_config, parse_duration
from ebpf_proxy.cli import main

KUBEADM_CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: true
  masqueradeBit: null
  minSyncPeriod: 2s
  syncPeriod: 1m0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "config.conf"
    path.write_text(textwrap.dedent(text))
    return str(path)


def header(body: str = "") -> str:
    return "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n" + textwrap.dedent(body)


# ---- durations ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,seconds", [
    ("1s", 1.0), ("500ms", 0.5), ("1m30s", 90.0), ("1h", 3600.0), ("2h45m", 9900.0), ("1.5s", 1.5),
    ("0", 0.0), ("0s", 0.0), ("300us", 0.0003), ("-1s", -1.0), ("1m0s", 60.0), (0, 0.0),
])
def test_durations_as_kubernetes_writes_them(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1", "s", "1x", "", "1s2", "one second", "1 s", 5, None, True])
def test_bad_durations_name_the_setting(text):
    with pytest.raises(ConfigError, match="^--sync-period: "):
        parse_duration(text, "--sync-period")


# ---- flags ----------------------------------------------------------------------------------------


def test_defaults_are_kube_proxys():
    c = load_config({})
    assert (c.min_sync_period, c.sync_period) == (1.0, 30.0)
    assert c.metrics_bind_address == "127.0.0.1:10249" and c.healthz_bind_address == "0.0.0.0:10256"
    assert c.mode == "auto" and c.bpffs == "/sys/fs/bpf" and c.masquerade_bit == 14
    assert c.localhost_nodeports and not c.masquerade_all
    assert c.cluster_cidrs == () and c.nodeport_addresses == ()
    # ours: a real kube-apiserver bookmarks about once a minute; client-go's backoff cap
    assert (c.watch_idle_timeout, c.watch_backoff_max) == (90.0, 30.0)


def test_flags_are_parsed():
    c = load_config({
        "hostname_override": " Worker1 ", "cluster_cidrs": "10.244.0.0/16, 10.245.0.0/16",
        "nodeport_addresses": "192.168.0.0/16", "masquerade_all": "true", "min_sync_period": "500ms",
        "sync_period": "1m", "metrics_bind_address": "0.0.0.0:9999", "healthz_bind_address": "",
        "mode": "iptables", "masquerade_bit": "15", "localhost_nodeports": "false", "log_level": "WARN",
        "watch_idle_timeout": "5s", "watch_backoff_max": "1500ms",
    })
    assert (c.watch_idle_timeout, c.watch_backoff_max) == (5.0, 1.5)
    assert c.node_name == "worker1"
    assert c.cluster_cidrs == ("10.244.0.0/16", "10.245.0.0/16")
    assert c.nodeport_addresses == ("192.168.0.0/16",)
    assert c.masquerade_all and not c.localhost_nodeports and c.masquerade_bit == 15
    assert (c.min_sync_period, c.sync_period) == (0.5, 60.0)
    assert c.metrics_bind_address == "0.0.0.0:9999" and c.healthz_bind_address == ""
    assert c.mode == "iptables" and c.log_level == "warning"


def test_node_name_defaults_to_the_hostname(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "Node-7.Example")
    assert load_config({}).node_name == "node-7.example"


@pytest.mark.parametrize("flags,named", [
    ({"min_sync_period": "fast"}, "--min-sync-period"),
    ({"sync_period": "0s"}, "--sync-period"),
    ({"min_sync_period": "-1s"}, "--min-sync-period"),
    ({"min_sync_period": "1m", "sync_period": "30s"}, "--sync-period"),
    ({"cluster_cidrs": "10.244.0.0/33"}, "--cluster-cidr"),
    ({"nodeport_addresses": "primary,10.0.0.0/8"}, "--nodeport-addresses"),
    ({"nodeport_addresses": "eth0"}, "--nodeport-addresses"),
    ({"masquerade_all": "yes"}, "--masquerade-all"),
    ({"masquerade_bit": "32"}, "--iptables-masquerade-bit"),
    ({"healthz_bind_address": "10256"}, "--healthz-bind-address"),
    ({"metrics_bind_address": "localhost:10249"}, "--metrics-bind-address"),
    ({"mode": "ipvs"}, "--mode"),
    ({"log_format": "xml"}, "--log-format"),
    ({"log_level": "loud"}, "--log-level"),
    ({"watch_idle_timeout": "0s"}, "--watch-idle-timeout"),
    ({"watch_backoff_max": "-1s"}, "--watch-backoff-max"),
    ({"watch_backoff_max": "soon"}, "--watch-backoff-max"),
])
def test_flag_errors_name_the_flag(flags, named):
    with pytest.raises(ConfigError) as err:
        load_config(flags)
    assert str(err.value).startswith(named + ":"), str(err.value)


def test_min_sync_period_error_mentions_both_settings():
    with pytest.raises(ConfigError, match=r"--sync-period: .*--min-sync-period"):
        load_config({"min_sync_period": "1m", "sync_period": "30s"})


# ---- the config file ------------------------------------------------------------------------------


def test_kubeadm_config_file_loads(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        c = load_config({}, write(tmp_path, KUBEADM_CONFIG))
    assert not caplog.records, caplog.text  # every field of kubeadm's ConfigMap is known
    assert c.cluster_cidrs == ("10.244.0.0/16", "fd00:10:244::/56")
    assert c.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert c.masquerade_all and (c.min_sync_period, c.sync_period) == (2.0, 60.0)
    assert c.mode == "auto"  # kube-proxy's "" is our default
    # null/empty values keep the defaults, as kube-proxy's defaulting does
    assert c.masquerade_bit == 14 and c.localhost_nodeports
    assert c.metrics_bind_address == "" and c.healthz_bind_address == ""  # empty: disabled


def test_file_fields(tmp_path):
    c = load_config({}, write(tmp_path, header("""
        hostnameOverride: from-file
        mode: iptables
        nodePortAddresses: [primary]
        metricsBindAddress: 0.0.0.0:10249
        iptables:
          masqueradeBit: 13
          localhostNodePorts: false
        """)))
    assert c.node_name == "from-file" and c.mode == "iptables"
    assert c.nodeport_addresses == ("primary",)
    assert c.masquerade_bit == 13 and not c.localhost_nodeports
    assert c.source_of("masquerade_bit") == "iptables.masqueradeBit"


def test_top_level_sync_periods_of_newer_kube_proxy_versions(tmp_path):
    c = load_config({}, write(tmp_path, header("syncPeriod: 45s\nminSyncPeriod: 3s\n")))
    assert (c.min_sync_period, c.sync_period) == (3.0, 45.0)
    c = load_config({}, write(tmp_path, header("syncPeriod: 45s\niptables:\n  syncPeriod: 20s\n")))
    assert c.sync_period == 20.0  # v1alpha1's iptables.syncPeriod wins, as in kube-proxy's conversion


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, header("""
        hostnameOverride: from-file
        clusterCIDR: 10.0.0.0/8
        iptables:
          syncPeriod: 10s
          masqueradeAll: true
        """))
    c = load_config({"hostname_override": "from-flag", "sync_period": "20s", "masquerade_all": "false"}, path)
    assert c.node_name == "from-flag" and c.sync_period == 20.0 and not c.masquerade_all
    assert c.cluster_cidrs == ("10.0.0.0/8",)  # not overridden: the file's value stays
    assert c.source_of("sync_period") == "--sync-period" and c.source_of("cluster_cidrs") == "clusterCIDR"


def test_a_flag_overrides_a_file_value_we_cannot_use(tmp_path):
    c = load_config({"mode": "iptables"}, write(tmp_path, header("mode: ipvs\n")))
    assert c.mode == "iptables"


def test_ignored_and_unknown_fields(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="ebpf_proxy.agent.config"):
        load_config({}, write(tmp_path, header("""
            conntrack: {maxPerCore: 32768, tcpBeLiberal: true}
            ipvs: {scheduler: rr}
            clientConnection: {qps: 5, timeout: 3s}
            frobnicate: true
            detectLocal: {clusterCIDRs: [10.0.0.0/8]}
            """)))
    by_level = {(r.levelname, r.field) for r in caplog.records}
    assert ("DEBUG", "ipvs") in by_level and ("DEBUG", "clientConnection.qps") in by_level
    assert ("DEBUG", "conntrack.tcpBeLiberal") in by_level, "conntrack's other fields are used (test_conntrack_*)"
    assert ("WARNING", "clientConnection.timeout") in by_level and ("WARNING", "frobnicate") in by_level
    assert ("DEBUG", "detectLocal.clusterCIDRs") in by_level


def test_detect_local_settings_from_the_file_and_flags(tmp_path):
    """kube-proxy's detectLocalMode / detectLocal.* (and --detect-local-mode, --pod-bridge-interface,
    --pod-interface-name-prefix); empty means ClusterCIDR, as in getDetectLocalMode."""
    assert load_config({}).detect_local_mode == "ClusterCIDR"
    c = load_config({}, write(tmp_path, header("""
        detectLocalMode: BridgeInterface
        detectLocal: {bridgeInterface: cbr0, interfaceNamePrefix: veth}
        """)))
    assert (c.detect_local_mode, c.pod_bridge_interface, c.pod_interface_name_prefix) == ("BridgeInterface", "cbr0", "veth")
    c = load_config({"detect_local_mode": "InterfaceNamePrefix", "pod_interface_name_prefix": "cali"})
    assert (c.detect_local_mode, c.pod_interface_name_prefix) == ("InterfaceNamePrefix", "cali")
    assert load_config({}, write(tmp_path, header("detectLocalMode: ''\n"))).detect_local_mode == "ClusterCIDR"


@pytest.mark.parametrize("flags,body,message", [
    ({"detect_local_mode": "Magic"}, None, "--detect-local-mode: unknown detect-local-mode 'Magic'"),
    ({"detect_local_mode": "BridgeInterface"}, None,
     "--pod-bridge-interface: must not be empty when --detect-local-mode is BridgeInterface"),
    ({}, "detectLocalMode: InterfaceNamePrefix\n",
     "--pod-interface-name-prefix: must not be empty when detectLocalMode is InterfaceNamePrefix"),
    ({}, "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: ''}\n",
     "detectLocal.bridgeInterface: must not be empty when detectLocalMode is BridgeInterface"),
])
def test_detect_local_errors_name_the_setting(tmp_path, flags, body, message):
    with pytest.raises(ConfigError) as err:
        load_config(flags, write(tmp_path, header(body)) if body else None)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("body,named", [
    ("mode: ipvs\n", "mode"),
    ("mode: nftables\n", "mode"),
    ("iptables:\n  minSyncPeriod: soon\n", "iptables.minSyncPeriod"),
    ("iptables:\n  syncPeriod: 30\n", "iptables.syncPeriod"),
    ("iptables:\n  masqueradeBit: 40\n", "iptables.masqueradeBit"),
    ("iptables:\n  masqueradeAll: maybe\n", "iptables.masqueradeAll"),
    ("iptables: true\n", "iptables"),
    ("iptables:\n  minSyncPeriod: 1m\n  syncPeriod: 30s\n", "iptables.syncPeriod"),
    ("clusterCIDR: 10.244.0.0/99\n", "clusterCIDR"),
    ("nodePortAddresses: [10.0.0.0/8, bogus]\n", "nodePortAddresses"),
    ("healthzBindAddress: everywhere\n", "healthzBindAddress"),
    ("hostnameOverride: [a, b]\n", "hostnameOverride"),
    ("clientConnection:\n  kubeconfig: 5\n", "clientConnection.kubeconfig"),
])
def test_file_errors_name_the_field(tmp_path, body, named):
    with pytest.raises(ConfigError) as err:
        load_config({}, write(tmp_path, header(body)))
    assert str(err.value).startswith(named + ":"), str(err.value)


@pytest.mark.parametrize("text,named", [
    ("apiVersion: v1\nkind: KubeProxyConfiguration\n", "apiVersion"),
    ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n", "kind"),
    ("just a string\n", "--config"),
    ("a: [unclosed\n", "--config"),
])
def test_file_shape_errors(tmp_path, text, named):
    with pytest.raises(ConfigError) as err:
        load_config({}, write(tmp_path, text))
    assert str(err.value).startswith(named), str(err.value)


def test_missing_file_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="^--config .*missing.conf: cannot read"):
        load_config({}, str(tmp_path / "missing.conf"))


def test_unknown_setting_is_a_programming_error():
    with pytest.raises(ConfigError, match="unknown settings: colour"):
        load_config({"colour": "blue"})


# ---- the CLI ----------------------------------------------------------------------------------------


@pytest.fixture
def captured(monkeypatch):
    """`ebpf-proxy run` with the agent replaced: we only look at the config it would run with."""
    seen: list[AgentConfig] = []

    class FakeAgent:
        def __init__(self, config, settle_heap=False):
            assert settle_heap, "`ebpf-proxy run` settles the heap after full syncs (agent/heap.py)"
            seen.append(config)

        def install_signal_handlers(self):
            pass

        def run(self):
            return 0

    monkeypatch.setattr("ebpf_proxy.agent.agent.Agent", FakeAgent)  # `run` imports it when it runs
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield seen
    root.handlers[:] = handlers  # the command installed a handler on CliRunner's (now closed) stderr
    root.setLevel(level)


def test_cli_go_style_bool_flags_and_aliases(captured):
    result = CliRunner().invoke(main, ["run", "--masquerade-all", "--iptables-sync-period=45s", "--proxy-mode",
                                       "iptables", "--hostname-override", "n1"])
    assert result.exit_code == 0, result.output
    assert captured[-1].masquerade_all and captured[-1].sync_period == 45.0 and captured[-1].mode == "iptables"
    result = CliRunner().invoke(main, ["run", "--masquerade-all=false", "--iptables-localhost-nodeports=false"])
    assert result.exit_code == 0, result.output
    assert not captured[-1].masquerade_all and not captured[-1].localhost_nodeports


def test_cli_flags_override_the_config_file(captured, tmp_path):
    path = write(tmp_path, header("iptables:\n  syncPeriod: 10s\nclusterCIDR: 10.0.0.0/8\n"))
    result = CliRunner().invoke(main, ["run", "--config", path, "--sync-period", "20s"])
    assert result.exit_code == 0, result.output
    assert captured[-1].sync_period == 20.0 and captured[-1].cluster_cidrs == ("10.0.0.0/8",)


def test_cli_errors_name_the_flag_and_exit_2(captured):
    result = CliRunner().invoke(main, ["run", "--min-sync-period", "quickly"])
    assert result.exit_code == 2
    assert "--min-sync-period: 'quickly' is not a duration" in result.output
    assert captured == []


def test_run_help_has_examples():
    result = CliRunner().invoke(main, ["run", "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "ebpf-proxy run --config" in result.output
    for flag in ("--hostname-override", "--cluster-cidr", "--nodeport-addresses", "--masquerade-all",
                 "--min-sync-period", "--sync-period", "--metrics-bind-address", "--healthz-bind-address",
                 "--kubeconfig", "--master", "--config", "--mode", "--cgroup-path", "--bpffs", "--log-format",
                 "--log-level"):
        assert flag in result.output


# ---- conntrack (issue 13): kube-proxy's settings size and time the eBPF connection table -------


def test_conntrack_settings_from_flags_and_file(tmp_path):
    from ebpf_proxy.agent.conntrack import conntrack_limits

    c = load_config({})
    assert (c.conntrack_max_per_core, c.conntrack_min) == (32768, 131072)
    assert (c.conntrack_tcp_established_timeout, c.conntrack_tcp_close_wait_timeout) == (86400.0, 3600.0)
    limits = conntrack_limits(c, cpus=8)  # kube-proxy: max(maxPerCore x CPUs, min)
    assert (limits.max_connections, limits.tcp_established, limits.tcp_close_wait) == (262144, 86400, 3600)
    assert (limits.udp, limits.udp_stream) == (30, 120), "0: the kernel's defaults"
    assert conntrack_limits(c, cpus=2).max_connections == 131072, "min is the floor"

    path = write(tmp_path, textwrap.dedent("""\
        apiVersion: kubeproxy.config.k8s.io/v1alpha1
        kind: KubeProxyConfiguration
        conntrack:
          maxPerCore: 1000
          min: 500
          tcpEstablishedTimeout: 2h
          tcpCloseWaitTimeout: 30s
          udpTimeout: 15s
          udpStreamTimeout: 3m
          tcpBeLiberal: true
        """))
    c = load_config({"conntrack_udp_timeout": "20s"}, path)
    limits = conntrack_limits(c, cpus=2)
    assert (limits.max_connections, limits.tcp_established, limits.tcp_close_wait) == (2000, 7200, 30)
    assert (limits.udp, limits.udp_stream) == (20, 180), "the flag overrides the file"
    assert conntrack_limits(load_config({"conntrack_max_per_core": "0"}), cpus=2).max_connections == 131072, \
        "0 leaves the limit alone: the built-in size"


@pytest.mark.parametrize(("flags", "named"), [
    ({"conntrack_max_per_core": "-1"}, "--conntrack-max-per-core"),
    ({"conntrack_min": "lots"}, "--conntrack-min"),
    ({"conntrack_tcp_established_timeout": "-1s"}, "--conntrack-tcp-timeout-established"),
    ({"conntrack_udp_stream_timeout": "soon"}, "--conntrack-udp-timeout-stream"),
])
def test_bad_conntrack_settings_name_the_flag(flags, named):
    with pytest.raises(ConfigError, match="^" + named):
        load_config(flags)


def test_bad_conntrack_field_names_the_field(tmp_path):
    path = write(tmp_path, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                           "conntrack:\n  maxPerCore: many\n")
    with pytest.raises(ConfigError, match="^conntrack.maxPerCore"):
        load_config({}, path)


def test_bpf_xdp_mode_flag():
    assert load_config({}).bpf_xdp_mode == "off"  # as Cilium's XDP acceleration: an operator asks for it
    assert load_config({"bpf_xdp_mode": "native"}).bpf_xdp_mode == "native"
    with pytest.raises(ConfigError, match="^--bpf-xdp-mode: .*'driver'"):
        load_config({"bpf_xdp_mode": "driver"})


def test_bpf_map_sizes_flag():
    """Capacities for clusters beyond the defaults (issue 12: 100,000 Services × 10 endpoints)."""
    c = load_config({"bpf_map_sizes": "epx_svc=262144, epx_backend=1048576,epx_slot=2097152"})
    assert c.bpf_map_sizes == (("epx_backend", 1048576), ("epx_slot", 2097152), ("epx_svc", 262144))
    assert load_config({}).bpf_map_sizes == ()


@pytest.mark.parametrize(("attr", "flag", "text", "message"), [
    ("bpf_map_sizes", "--bpf-map-sizes", "epx_svc", "'epx_svc' is not MAP=ENTRIES"),
    ("bpf_map_sizes", "--bpf-map-sizes", "epx_svc=lots", "'epx_svc=lots' is not MAP=ENTRIES"),
    ("bpf_map_sizes", "--bpf-map-sizes", "epx_nope=10", "'epx_nope' is not a map whose size can be set"),
    ("bpf_map_sizes", "--bpf-map-sizes", "epx_ct4=10", "epx_ct4 is sized by --conntrack-max-per-core"),
    ("bpf_map_sizes", "--bpf-map-sizes", "epx_svc=0", "epx_svc must have 1 to 2147483647 entries, got 0"),
    ("bpf_conntrack_gc_period", "--bpf-conntrack-gc-period", "0", "must be greater than 0, got '0'"),
    ("bpf_conntrack_gc_period", "--bpf-conntrack-gc-period", "0s", "must be greater than 0, got '0s'"),
    ("bpf_conntrack_gc_period", "--bpf-conntrack-gc-period", "-1s", "must be greater than 0, got '-1s'"),
    ("bpf_conntrack_gc_period", "--bpf-conntrack-gc-period", "often", "'often' is not a duration"),
])
def test_bad_bpf_settings_name_the_flag_and_the_value(attr, flag, text, message):
    with pytest.raises(ConfigError, match=f"^{flag}: " + re.escape(message)):
        load_config({attr: text})


def test_bpf_conntrack_gc_period_flag(captured):
    """The eBPF connection table's GC period: ours (nf_conntrack's GC is the kernel's), flag only."""
    from ebpf_proxy.datapath.ebpf.datapath import CT_GC_PERIOD

    assert load_config({}).bpf_conntrack_gc_period == CT_GC_PERIOD == 10.0  # the datapath's default
    assert load_config({"bpf_conntrack_gc_period": "1s"}).bpf_conntrack_gc_period == 1.0
    assert load_config({"bpf_conntrack_gc_period": "250ms"}).bpf_conntrack_gc_period == 0.25
    result = CliRunner().invoke(main, ["run", "--bpf-conntrack-gc-period", "1m30s"])
    assert result.exit_code == 0, result.output
    assert captured[-1].bpf_conntrack_gc_period == 90.0
