"""The agent's configuration: kube-proxy's flags and KubeProxyConfiguration file, plus ours.

Drop-in means an existing kube-proxy DaemonSet's arguments and ConfigMap keep working: the same
flag names and meanings (`--hostname-override`, `--cluster-cidr`, `--nodeport-addresses`, ...), the
same `--config` file (kubeproxy.config.k8s.io/v1alpha1), the same duration syntax ("1s", "500ms",
"1m30s"). Precedence: built-in defaults < the `--config` file < flags given on the command line.

Every error names what the user wrote: the flag (`--min-sync-period`) or the file's field
(`iptables.minSyncPeriod`), never an internal attribute name. Nothing here parses argv (the CLI
does); `load_config` gets the flags the user actually gave, as raw values.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping

import yaml

log = logging.getLogger(__name__)

CONFIG_API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
CONFIG_KIND = "KubeProxyConfiguration"
MODES = ("auto", "ebpf", "iptables")
# kube-proxy's --detect-local-mode values (LocalMode in the model)
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
LOG_FORMATS = ("text", "json")
XDP_MODES = ("generic", "native", "off")  # EbpfDatapath's xdp_mode
HOST_ROUTING_MODES = ("auto", "on", "off")  # EbpfDatapath's host_routing (datapath/ebpf/datapath.py)
LOG_LEVELS = ("debug", "info", "warning", "error")
PRIMARY = "primary"  # --nodeport-addresses primary: the node's primary IP (from its Node object)


class ConfigError(ValueError):
    """A flag or config-file field with an unusable value; the message starts with its name."""


@dataclass(frozen=True)
class AgentConfig:
    hostname_override: str = ""
    cluster_cidrs: tuple[str, ...] = ()
    nodeport_addresses: tuple[str, ...] = ()  # CIDRs, or ("primary",); empty: every local address
    masquerade_all: bool = False
    masquerade_bit: int = 14
    detect_local_mode: str = "ClusterCIDR"
    pod_bridge_interface: str = ""
    pod_interface_name_prefix: str = ""
    localhost_nodeports: bool = True
    min_sync_period: float = 1.0
    sync_period: float = 30.0
    metrics_bind_address: str = "127.0.0.1:10249"  # "" disables the metrics server
    healthz_bind_address: str = "0.0.0.0:10256"  # "" disables the healthz server
    kubeconfig: str = ""
    master: str = ""
    mode: str = "auto"
    cgroup_path: str = ""
    bpffs: str = "/sys/fs/bpf"
    bpf_cache_dir: str = "/var/cache/ebpf-proxy/bpf"  # compiled programs by build id; "" disables
    iptables_backend: str = "auto"
    # where the drift audit's proofs that the kernel holds the ruleset are kept, so that a restart
    # restores no table it still holds (datapath/iptables/proof.py); "" keeps none
    iptables_proof_dir: str = "/var/cache/ebpf-proxy/iptables"
    log_format: str = "text"
    log_level: str = "info"
    audit_period: float = 60.0  # how often the drift audit compares the kernel with the last sync; 0: never
    audit_repair: bool = True  # write back what the audit finds drifted
    # a watch silent this long (no event, no BOOKMARK) is hung: reconnect (k8s/client.py says why 90s)
    watch_idle_timeout: float = 90.0
    # the longest wait between attempts to reach the API server (client-go's Reflector: 30s)
    watch_backoff_max: float = 30.0
    # kube-proxy's conntrack settings (KubeProxyConntrackConfiguration, its defaults): they size and
    # time the eBPF connection table (agent/conntrack.py). 0 means what kube-proxy's 0 means: leave
    # the kernel's value, here nf_conntrack's default.
    conntrack_max_per_core: int = 32768
    conntrack_min: int = 131072
    conntrack_tcp_established_timeout: float = 86400.0  # 24h
    conntrack_tcp_close_wait_timeout: float = 3600.0  # 1h
    conntrack_udp_timeout: float = 0.0
    conntrack_udp_stream_timeout: float = 0.0
    # capacities of the eBPF datapath's maps other than the connection table (sized above), for
    # clusters beyond the defaults (65,536 frontends and backends): ((map name, entries), ...)
    bpf_map_sizes: tuple[tuple[str, int], ...] = ()
    # how the early-drop XDP program attaches to the node's outside-facing devices: off (TC alone
    # decides every packet, and makes the same drops), native (in the driver, before the skb is
    # built: the fast one, where the driver supports it), generic (any driver, after the skb is
    # built). Off by default, as Cilium's XDP acceleration: generic XDP drops no faster than TC
    # and costs every packet through the device (~1.6 µs of kernel CPU per connection crossing
    # a node, docs/benchmarks/2026-11-28-podip-profile), and native XDP on a NIC reconfigures
    # its queues as it attaches: an operator asks for it
    bpf_xdp_mode: str = "off"
    # the host-routing fast path (bpf/lib/fib4.h): tc_ingress forwards what it translated itself
    # (bpf_fib_lookup, bpf_redirect_peer/_neigh), skipping the node's routing and netfilter stack;
    # auto: on where the kernel has the helpers
    bpf_host_routing: str = "auto"
    # seconds between two passes of the eBPF connection table's garbage collector (a thread: the
    # table does not evict, expired connections stay until a pass removes them); the kernel's own
    # nf_conntrack GC has no such knob, so kube-proxy has none either. The datapath's CT_GC_PERIOD.
    bpf_conntrack_gc_period: float = 10.0
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)  # attr → flag/field name

    @property
    def node_name(self) -> str:
        """kube-proxy's rule: the override if given, else the hostname; trimmed and lower-cased."""
        return (self.hostname_override or socket.gethostname()).strip().lower()

    def source_of(self, attr: str) -> str:
        """Where a value came from, for error messages ("--sync-period", "iptables.syncPeriod")."""
        return self.sources.get(attr, _FIELDS[attr].flag)


# ---- value parsers: (raw value, name for errors) -> value ------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: Any, where: str = "duration") -> float:
    """A Go/Kubernetes duration ("1s", "500ms", "1m30s", "-2h", "0") in seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text == 0:
        return 0.0  # YAML `minSyncPeriod: 0`
    if not isinstance(text, str):
        raise ConfigError(f"{where}: expected a duration such as \"1s\" or \"1m30s\", got {text!r}")
    raw = text.strip()
    sign, body = (-1.0, raw[1:]) if raw.startswith("-") else (1.0, raw.lstrip("+"))
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(body):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not body or pos != len(body):
        raise ConfigError(f"{where}: {text!r} is not a duration (examples: \"1s\", \"500ms\", \"1m30s\")")
    return sign * total


def _string(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value.strip()


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        # Go's strconv.ParseBool, which kube-proxy's `--flag=value` accepts.
        if value in ("1", "t", "T", "true", "TRUE", "True"):
            return True
        if value in ("0", "f", "F", "false", "FALSE", "False"):
            return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _cidr(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a CIDR such as 10.244.0.0/16, got {value!r}")
    try:
        return str(ipaddress.ip_network(value.strip(), strict=False))
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not a CIDR (example: 10.244.0.0/16)") from None


def _comma_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list):
        return value
    raise ConfigError(f"{where}: expected a list or a comma-separated string, got {value!r}")


def _cidrs(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_cidr(v, where) for v in _comma_list(value, where))


def _nodeport_addresses(value: Any, where: str) -> tuple[str, ...]:
    items = _comma_list(value, where)
    if PRIMARY in items:
        if len(items) != 1:
            raise ConfigError(f"{where}: {PRIMARY!r} cannot be combined with CIDRs")
        return (PRIMARY,)
    return tuple(_cidr(v, where) for v in items)


def _masquerade_bit(value: Any, where: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 31:
        raise ConfigError(f"{where}: must be an integer within [0, 31], got {value!r}")
    return value


def _bind_address(value: Any, where: str) -> str:
    text = _string(value, where)
    if not text:
        return ""  # disabled, as with kube-proxy
    host, sep, port = text.rpartition(":")
    try:
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not IP:port (example: 0.0.0.0:10256)") from None
    return text


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, where: str) -> str:
        text = _string(value, where).lower()
        if text == "warn":
            text = "warning"
        if text not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
        return text
    return parse


def _mode(value: Any, where: str) -> str:
    text = _string(value, where)
    if text == "":
        return "auto"  # kube-proxy's "" means its default; ours is auto
    if text not in MODES:
        raise ConfigError(f"{where}: {text!r} is not supported (use one of {', '.join(MODES)}, or leave it empty)")
    return text


def _detect_local_mode(value: Any, where: str) -> str:
    """kube-proxy's getDetectLocalMode: empty means ClusterCIDR, anything unknown is an error."""
    text = _string(value, where)
    if text == "":
        return "ClusterCIDR"
    if text not in DETECT_LOCAL_MODES:
        raise ConfigError(f"{where}: unknown detect-local-mode {text!r} (use one of {', '.join(DETECT_LOCAL_MODES)})")
    return text


def _duration(value: Any, where: str) -> float:
    return parse_duration(value, where)


def _count(value: Any, where: str) -> int:
    """A non-negative integer (kube-proxy's int32 conntrack sizes), from YAML or a flag's text."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**31 - 1:
        raise ConfigError(f"{where}: must be an integer within [0, 2147483647], got {value!r}")
    return value


def _map_sizes(value: Any, where: str) -> tuple[tuple[str, int], ...]:
    """"epx_svc=262144,epx_backend=1048576": capacities of the eBPF maps named (every one the
    loader sizes but epx_ct4, which follows the conntrack settings)."""
    from ebpf_proxy.datapath.ebpf.loader import MAX_ENTRIES  # here: config imports nothing heavy

    text = _string(value, where)
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, number = item.partition("=")
        name = name.strip()
        if not sep or not number.strip().isdigit():
            raise ConfigError(f"{where}: {item!r} is not MAP=ENTRIES (e.g. epx_svc=262144)")
        if name == "epx_ct4":
            raise ConfigError(f"{where}: epx_ct4 is sized by --conntrack-max-per-core and --conntrack-min")
        if name not in MAX_ENTRIES:
            raise ConfigError(f"{where}: {name!r} is not a map whose size can be set "
                              f"({', '.join(n for n in MAX_ENTRIES if n != 'epx_ct4')})")
        entries = int(number)
        if not 1 <= entries <= 2**31 - 1:
            raise ConfigError(f"{where}: {name} must have 1 to 2147483647 entries, got {entries}")
        sizes[name] = entries
    return tuple(sorted(sizes.items()))


def _period(value: Any, where: str) -> float:
    """A period of something repeated: a duration greater than 0."""
    seconds = parse_duration(value, where)
    if seconds <= 0:
        raise ConfigError(f"{where}: must be greater than 0, got {value!r}")
    return seconds


def _timeout(value: Any, where: str) -> float:
    """A conntrack timeout: a duration of at least 0 (0: the kernel's default)."""
    seconds = parse_duration(value, where)
    if seconds < 0:
        raise ConfigError(f"{where}: must be greater than or equal to 0, got {value!r}")
    return seconds


@dataclass(frozen=True)
class _Field:
    flag: str
    file_paths: tuple[tuple[str, ...], ...]  # where the file may set it, first match wins
    parse: Callable[[Any, str], Any]


_FIELDS: dict[str, _Field] = {
    "hostname_override": _Field("--hostname-override", (("hostnameOverride",),), _string),
    "cluster_cidrs": _Field("--cluster-cidr", (("clusterCIDR",),), _cidrs),
    "nodeport_addresses": _Field("--nodeport-addresses", (("nodePortAddresses",),), _nodeport_addresses),
    "masquerade_all": _Field("--masquerade-all", (("iptables", "masqueradeAll"),), _bool),
    "masquerade_bit": _Field("--iptables-masquerade-bit", (("iptables", "masqueradeBit"),), _masquerade_bit),
    "detect_local_mode": _Field("--detect-local-mode", (("detectLocalMode",),), _detect_local_mode),
    "pod_bridge_interface": _Field("--pod-bridge-interface", (("detectLocal", "bridgeInterface"),), _string),
    "pod_interface_name_prefix": _Field("--pod-interface-name-prefix", (("detectLocal", "interfaceNamePrefix"),),
                                        _string),
    "localhost_nodeports": _Field("--iptables-localhost-nodeports", (("iptables", "localhostNodePorts"),), _bool),
    # v1alpha1 keeps the periods under `iptables:`; newer kube-proxy versions also have them top-level.
    "min_sync_period": _Field("--min-sync-period", (("iptables", "minSyncPeriod"), ("minSyncPeriod",)), _duration),
    "sync_period": _Field("--sync-period", (("iptables", "syncPeriod"), ("syncPeriod",)), _duration),
    "metrics_bind_address": _Field("--metrics-bind-address", (("metricsBindAddress",),), _bind_address),
    "healthz_bind_address": _Field("--healthz-bind-address", (("healthzBindAddress",),), _bind_address),
    "kubeconfig": _Field("--kubeconfig", (("clientConnection", "kubeconfig"),), _string),
    "master": _Field("--master", (), _string),
    "mode": _Field("--mode", (("mode",),), _mode),
    "cgroup_path": _Field("--cgroup-path", (), _string),
    "bpffs": _Field("--bpffs", (), _string),
    "bpf_cache_dir": _Field("--bpf-cache-dir", (), _string),
    "iptables_backend": _Field("--iptables-backend", (), _choice(("auto", "legacy", "nft"))),
    "iptables_proof_dir": _Field("--iptables-proof-dir", (), _string),
    "log_format": _Field("--log-format", (), _choice(LOG_FORMATS)),
    "log_level": _Field("--log-level", (), _choice(LOG_LEVELS)),
    "audit_period": _Field("--audit-period", (), _duration),
    "audit_repair": _Field("--audit-repair", (), _bool),
    "watch_idle_timeout": _Field("--watch-idle-timeout", (), _duration),
    "watch_backoff_max": _Field("--watch-backoff-max", (), _duration),
    "conntrack_max_per_core": _Field("--conntrack-max-per-core", (("conntrack", "maxPerCore"),), _count),
    "conntrack_min": _Field("--conntrack-min", (("conntrack", "min"),), _count),
    "conntrack_tcp_established_timeout": _Field("--conntrack-tcp-timeout-established",
                                                (("conntrack", "tcpEstablishedTimeout"),), _timeout),
    "conntrack_tcp_close_wait_timeout": _Field("--conntrack-tcp-timeout-close-wait",
                                               (("conntrack", "tcpCloseWaitTimeout"),), _timeout),
    "conntrack_udp_timeout": _Field("--conntrack-udp-timeout", (("conntrack", "udpTimeout"),), _timeout),
    "conntrack_udp_stream_timeout": _Field("--conntrack-udp-timeout-stream", (("conntrack", "udpStreamTimeout"),),
                                           _timeout),
    "bpf_map_sizes": _Field("--bpf-map-sizes", (), _map_sizes),
    "bpf_xdp_mode": _Field("--bpf-xdp-mode", (), _choice(XDP_MODES)),
    "bpf_host_routing": _Field("--bpf-host-routing", (), _choice(HOST_ROUTING_MODES)),
    "bpf_conntrack_gc_period": _Field("--bpf-conntrack-gc-period", (), _period),
}
_KNOWN_PATHS = {path for f in _FIELDS.values() for path in f.file_paths}

# KubeProxyConfiguration fields that exist but mean nothing here (other modes, client tuning):
# accepted so that an existing ConfigMap loads, logged at debug.
_IGNORED_TOP = {
    "featureGates", "bindAddress", "bindAddressHardFail", "enableProfiling", "showHiddenMetricsForVersion",
    "ipvs", "nftables", "winkernel", "oomScoreAdj", "configSyncPeriod",
    "portRange", "logging", "windowsRunAsService", "udpIdleTimeout",
}
_NESTED = {"clientConnection": {"acceptContentTypes", "contentType", "qps", "burst"}, "iptables": set(),
           "detectLocal": {"clusterCIDRs"}, "conntrack": {"tcpBeLiberal"}}


def _file_values(path: str) -> dict[str, tuple[Any, str]]:
    """attr → (raw value, field name) for every field the file sets."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a {CONFIG_KIND} object, got {type(doc).__name__}")
    if doc.get("apiVersion") != CONFIG_API_VERSION:
        raise ConfigError(f"apiVersion: expected {CONFIG_API_VERSION!r} in {path}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != CONFIG_KIND:
        raise ConfigError(f"kind: expected {CONFIG_KIND!r} in {path}, got {doc.get('kind')!r}")

    found: dict[tuple[str, ...], Any] = {}
    for key, value in doc.items():
        if key in ("apiVersion", "kind"):
            continue
        if (key,) in _KNOWN_PATHS:
            found[(key,)] = value
        elif key in _NESTED:
            if not isinstance(value, (dict, type(None))):
                raise ConfigError(f"{key}: expected an object in {path}, got {value!r}")
            for sub, subvalue in (value or {}).items():
                if (key, sub) in _KNOWN_PATHS:
                    found[(key, sub)] = subvalue
                elif sub in _NESTED[key]:
                    log.debug("config: ignoring %s.%s (not used by ebpf-proxy)", key, sub, extra={"field": f"{key}.{sub}"})
                else:
                    log.warning("config: unknown field %s.%s ignored", key, sub, extra={"field": f"{key}.{sub}"})
        elif key in _IGNORED_TOP:
            log.debug("config: ignoring %s (not used by ebpf-proxy)", key, extra={"field": key})
        else:
            log.warning("config: unknown field %s ignored", key, extra={"field": key})

    values: dict[str, tuple[Any, str]] = {}
    for attr, spec in _FIELDS.items():
        for file_path in spec.file_paths:
            if found.get(file_path) is not None:  # null means "not set", as in kube's defaulting
                values[attr] = (found[file_path], ".".join(file_path))
                break
    return values


def load_config(flags: Mapping[str, Any], config_file: str | None = None) -> AgentConfig:
    """Defaults, then the `--config` file, then the flags the user gave (attr → raw value)."""
    unknown = set(flags) - set(_FIELDS)
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    raw: dict[str, tuple[Any, str]] = _file_values(config_file) if config_file else {}
    raw.update({attr: (value, _FIELDS[attr].flag) for attr, value in flags.items()})

    values = {attr: _FIELDS[attr].parse(value, where) for attr, (value, where) in raw.items()}
    config = replace(AgentConfig(), **values, sources={attr: where for attr, (_, where) in raw.items()})
    _validate(config)
    return config


def _validate(config: AgentConfig) -> None:
    if config.sync_period <= 0:
        raise ConfigError(f"{config.source_of('sync_period')}: must be greater than 0")
    if config.min_sync_period < 0:
        raise ConfigError(f"{config.source_of('min_sync_period')}: must be greater than or equal to 0")
    if config.min_sync_period > config.sync_period:
        raise ConfigError(f"{config.source_of('sync_period')}: must be greater than or equal to "
                          f"{config.source_of('min_sync_period')} ({config.min_sync_period:g}s)")
    if config.audit_period < 0:
        raise ConfigError(f"{config.source_of('audit_period')}: must be greater than or equal to 0 (0 disables)")
    for attr in ("watch_idle_timeout", "watch_backoff_max"):
        if getattr(config, attr) <= 0:
            raise ConfigError(f"{config.source_of(attr)}: must be greater than 0")
    if not config.node_name:
        raise ConfigError(f"{config.source_of('hostname_override')}: the node name is empty")
    # kube-proxy's validateKubeProxyDetectLocalConfiguration: the interface modes need their name
    needs = {"BridgeInterface": "pod_bridge_interface", "InterfaceNamePrefix": "pod_interface_name_prefix"}
    attr = needs.get(config.detect_local_mode)
    if attr and not getattr(config, attr):
        raise ConfigError(f"{config.source_of(attr)}: must not be empty when "
                          f"{config.source_of('detect_local_mode')} is {config.detect_local_mode}")


def config_fields() -> list[str]:
    """Every setting's attribute name (the keys load_config accepts)."""
    return [f.name for f in fields(AgentConfig) if f.name != "sources"]
