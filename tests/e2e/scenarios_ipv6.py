"""The IPv6-only twin of the e2e scenario table and its lab, derived from the IPv4 ones, never
written by hand: one address translation (`translate`) turns topology.yaml into
topology_ipv6.yaml (checked in for `lab up` by hand; test_scenarios_ipv6.py verifies it is the
translation) and every scenario of scenarios.yaml into its IPv6 form (scenario_runner's
load_ipv6_scenarios), so the two tables can never drift apart.

The translation maps each IPv4 range the e2e files use onto an IPv6 range of at least as many
addresses, keeping an address's offset in its range, so every address stays inside every CIDR that
held it (pod in its node's podCIDR, client in a loadBalancerSourceRange, cluster IP in the
serviceCIDR) and outside every CIDR that did not:

    10.96.c.d        → fd00:10:96::<hex(c*256+d)>        (10.96.100.10 → fd00:10:96::640a)
    10.244.c.d       → fd00:10:244:<hex c>::<hex d>      (each pod /24 a /64 of the /56)
    172.20.20.d      → fd00:20::<hex d>                  nodes (172.20.20.15 → fd00:20::f)
    192.168.99.d     → fd00:192:168:99::<hex d>          nodes' extra IPs
    203.0.113.d      → 2001:db8:203:113::<hex d>         clients outside
    198.51.100.d     → 2001:db8:198:51:100::<hex d>      external and load-balancer IPs
    192.0.2.d        → 2001:db8:192:0:2::<hex d>         (a source range nobody is in)
    127.0.0.1        → ::1

A CIDR maps to the CIDR of the translated addresses (203.0.113.0/24 → 2001:db8:203:113::/120,
10.244.5.0/24 → fd00:10:244:5::/64, 10.244.0.0/16 → fd00:10:244::/56); the IPv4 serviceCIDR
10.96.0.0/12 becomes fd00:10:96::/112 (the tables use only its first /16). An IPv4 address or
CIDR outside every range is an error: a new address in the IPv4 files needs a rule here first.

In free text (probe targets, URLs, placeholders) `IP:PORT` becomes `[IPv6]:PORT` and
`${name}:PORT` becomes `[${name}]:PORT` (the placeholder resolves to the IPv6 address of that
node, pod or client in the IPv6 lab). Manifests are translated as YAML: every string in them,
plus `addressType: IPv4` (and any `IPv4` in ipFamilies) → `IPv6`. Services need no
`ipFamilies`: an IPv6-only cluster's API server defaults them to IPv6 (and a given clusterIP
implies its family anyway).

`python -m tests.e2e.scenarios_ipv6` prints the translated topology (to regenerate
topology_ipv6.yaml when topology.yaml changes; the comments there are kept by hand).
"""

from __future__ import annotations

import copy
import ipaddress
import re
import sys
from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class Rule:
    """IPv4 range → IPv6 range, the offset kept. With `subnet`, each IPv4 /subnet of the range
    becomes a /64 (the subnet number in the /64's last bits, the host in the interface ID)."""

    v4: ipaddress.IPv4Network
    v6: ipaddress.IPv6Network
    subnet: int | None = None

    def __post_init__(self) -> None:
        if self.subnet is None:
            assert 128 - self.v6.prefixlen >= 32 - self.v4.prefixlen, self
        else:
            assert self.subnet - self.v4.prefixlen == 64 - self.v6.prefixlen, self

    def ip(self, a: ipaddress.IPv4Address) -> ipaddress.IPv6Address:
        off = int(a) - int(self.v4.network_address)
        if self.subnet is not None:
            host_bits = 32 - self.subnet
            off = ((off >> host_bits) << 64) | (off & ((1 << host_bits) - 1))
        return ipaddress.IPv6Address(int(self.v6.network_address) + off)

    def prefixlen(self, p: int) -> int:
        if self.subnet is not None and p <= self.subnet:
            return self.v6.prefixlen + (p - self.v4.prefixlen)
        return 128 - (32 - p)


def _rule(v4: str, v6: str, subnet: int | None = None) -> Rule:
    return Rule(ipaddress.IPv4Network(v4), ipaddress.IPv6Network(v6), subnet)


RULES: tuple[Rule, ...] = (
    _rule("10.96.0.0/16", "fd00:10:96::/112"),  # Service cluster IPs
    _rule("10.244.0.0/16", "fd00:10:244::/56", subnet=24),  # pods: every node's /24 a /64
    _rule("172.20.20.0/24", "fd00:20::/120"),  # node InternalIPs
    _rule("192.168.99.0/24", "fd00:192:168:99::/120"),  # nodes' extra IPs
    _rule("203.0.113.0/24", "2001:db8:203:113::/120"),  # clients outside the cluster (TEST-NET-3)
    _rule("198.51.100.0/24", "2001:db8:198:51:100::/120"),  # external and LB IPs (TEST-NET-2)
    _rule("192.0.2.0/24", "2001:db8:192:0:2::/120"),  # TEST-NET-1
    _rule("127.0.0.1/32", "::1/128"),  # loopback
)
# whole ranges with no rule of their own (the IPv4 serviceCIDR is a /12, its IPv6 twin a /112)
EQUIVALENT_CIDRS = {ipaddress.IPv4Network("10.96.0.0/12"): ipaddress.IPv6Network("fd00:10:96::/112")}


class TranslationError(ValueError):
    pass


def _rule_for(net: ipaddress.IPv4Network) -> Rule:
    for rule in RULES:
        if net.subnet_of(rule.v4):
            return rule
    raise TranslationError(f"{net}: no IPv4→IPv6 rule covers it (add one to tests/e2e/scenarios_ipv6.py RULES)")


def translate_ip(ip: str) -> str:
    a = ipaddress.IPv4Address(ip)
    return str(_rule_for(ipaddress.IPv4Network(a)).ip(a))


def translate_cidr(cidr: str) -> str:
    net = ipaddress.IPv4Network(cidr)  # strict: a CIDR with host bits is a mistake in the table
    if net in EQUIVALENT_CIDRS:
        return str(EQUIVALENT_CIDRS[net])
    rule = _rule_for(net)
    return str(ipaddress.IPv6Network((rule.ip(net.network_address), rule.prefixlen(net.prefixlen))))


_IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?:/(\d{1,2}))?(:\d+)?(?![\w.])")
_PLACEHOLDER_PORT = re.compile(r"(\$\{[a-z0-9-]+\}):(\d+)")


def translate_text(text: str) -> str:
    """Every IPv4 address, CIDR and IP:PORT in a free string; `${name}:PORT` → `[${name}]:PORT`."""

    def ipv4(m: re.Match) -> str:
        addr, plen, port = m.groups()
        if plen is not None:
            return translate_cidr(f"{addr}/{plen}")
        v6 = translate_ip(addr)
        return f"[{v6}]{port}" if port else v6

    return _PLACEHOLDER_PORT.sub(r"[\1]:\2", _IPV4.sub(ipv4, text))


def _walk(obj: Any, key: str | None = None) -> Any:
    if isinstance(obj, dict):
        return {k: _walk(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, key) for v in obj]
    if isinstance(obj, str):
        if key in ("addressType", "ipFamilies") and obj == "IPv4":
            return "IPv6"
        return translate_text(obj)
    return obj


def translate(obj: Any) -> Any:
    """A parsed topology, manifest or any structure: every string translated."""
    return _walk(obj)


def translate_manifests(text: str) -> str:
    """YAML manifests (with ${name} placeholders) → the same objects over IPv6, as YAML."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    return yaml.safe_dump_all([translate(d) for d in docs], sort_keys=False)


def translate_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(scenario)
    if out.get("manifests"):
        out["manifests"] = translate_manifests(out["manifests"])
    steps = []
    for step in out["steps"]:
        step = dict(step)
        if "apply" in step:
            step["apply"] = translate_manifests(step["apply"])
        steps.append({k: (v if k == "apply" else translate(v)) for k, v in step.items()})
    out["steps"] = steps
    return out


def translate_topology(data: dict[str, Any]) -> dict[str, Any]:
    return translate(data)


if __name__ == "__main__":
    from tests.e2e.scenario_runner import TOPOLOGY

    sys.stdout.write(yaml.safe_dump(translate_topology(yaml.safe_load(TOPOLOGY.read_text())),
                                    sort_keys=False, default_flow_style=None))
