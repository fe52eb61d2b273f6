"""The dual-stack shape of the e2e scenario table and its lab, derived from the IPv4 table and its
IPv6 translation (scenarios_ipv6.py), never written by hand.

The lab (topology_dualstack.yaml, checked in for `lab up` by hand; test_scenarios_dualstack.py
verifies it is the derivation) is topology.yaml with every address and CIDR given in both
families, IPv4 first (the primary family): `ip: "172.20.20.15,fd00:20::f"`, `podCIDR:
"10.244.5.0/24,fd00:10:244:5::/64"`, serviceCIDR and clusterCIDR likewise; a list of addresses
(extraIPs) holds both families' addresses.

A scenario runs once with both families of RequireDualStack Services:
- every Service of its manifests gets `ipFamilyPolicy: RequireDualStack`, `ipFamilies: [IPv4,
  IPv6]` and, where the IPv4 table fixes its clusterIP, `clusterIPs` with the IPv6 translation
  second; its externalIPs, loadBalancerSourceRanges and load-balancer ingress hold both
  families' (the IPv4 values, then the IPv6 ones). A hand-written EndpointSlice gets its IPv6
  twin (`<name>-v6`, addressType IPv6), as the EndpointSlice controller writes one per family;
- every probe and http step runs over IPv4 (the IPv4 table's step) and then over IPv6 (the IPv6
  table's step, with its IPV6_DIFFERENCES); `${name}` in each resolves to the address of that
  family (the step's `family`). apply, scale and delete steps run once, in the dual form.

So each row proves both families of one dual-stack Service at once, on a node whose agent runs
both proxiers: in ebpf mode, the eBPF IPv4 datapath beside the IPv6 one. Its agents run with
`--bpf-host-routing=off`: the IPv4-only table runs with the host-routing fast path on (the
default), this one keeps the eBPF datapath's slow path (the host's routing and netfilter after
translation) under the whole table too.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from tests.e2e.scenarios_ipv6 import translate_manifests, translate_topology


class DualStackError(ValueError):
    pass


def dual_topology(data: dict[str, Any]) -> dict[str, Any]:
    """topology.yaml's data with every address and CIDR in both families, IPv4 first, and the
    agents' host-routing fast path off (see the module docstring)."""
    out = _merge_topology(data, translate_topology(data), "")
    out["agentArgs"] = [*out.get("agentArgs", []), "--bpf-host-routing=off"]
    return out


def _merge_topology(v4: Any, v6: Any, where: str) -> Any:
    if isinstance(v4, dict):
        return {k: _merge_topology(v, v6[k], f"{where}.{k}".lstrip(".")) for k, v in v4.items()}
    if isinstance(v4, list):
        if all(isinstance(x, str) for x in v4):  # extraIPs, listen, agentArgs
            return v4 if v4 == v6 else [*v4, *v6]
        return [_merge_topology(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(v4, v6))]
    if v4 != v6:
        if not isinstance(v4, str):
            raise DualStackError(f"{where}: {v4!r} has no dual-stack form")
        return f"{v4},{v6}"
    return v4


def dual_manifests(text: str) -> str:
    """YAML manifests of the IPv4 table → the same objects as dual-stack ones (see the module)."""
    if "${" in text:  # substituted once, with the primary family's addresses: wrong in the IPv6 twin
        raise DualStackError("manifests with ${name} placeholders have no dual-stack form: write the addresses")
    v4_docs = [d for d in yaml.safe_load_all(text) if d is not None]
    v6_docs = [d for d in yaml.safe_load_all(translate_manifests(text)) if d is not None]
    out: list[dict[str, Any]] = []
    for v4, v6 in zip(v4_docs, v6_docs):
        kind = v4.get("kind")
        if kind == "Service":
            out.append(_dual_service(v4, v6))
        elif kind == "EndpointSlice":
            twin = copy.deepcopy(v6)
            twin["metadata"]["name"] = f"{v4['metadata']['name']}-v6"
            out += [v4, twin]
        else:
            raise DualStackError(f"{kind} {v4.get('metadata', {}).get('name')}: no dual-stack form (Service and "
                                 "EndpointSlice only)")
    return yaml.safe_dump_all(out, sort_keys=False)


def _dual_service(v4: dict[str, Any], v6: dict[str, Any]) -> dict[str, Any]:
    svc = _merge_object(v4, v6, "")
    spec = svc.setdefault("spec", {})
    if spec.get("type") != "ExternalName":
        spec["ipFamilyPolicy"] = "RequireDualStack"
        spec["ipFamilies"] = ["IPv4", "IPv6"]
    return svc


def _merge_object(v4: Any, v6: Any, where: str) -> Any:
    if isinstance(v4, dict):
        out = {k: _merge_object(v, v6[k], f"{where}.{k}".lstrip(".")) for k, v in v4.items()}
        if "clusterIP" in v4 and v4["clusterIP"] != v6["clusterIP"]:
            out["clusterIPs"] = [v4["clusterIP"], v6["clusterIP"]]
        return out
    if isinstance(v4, list):  # addresses, ranges, ingress points: both families'; ports: the same
        return v4 if v4 == v6 else [*v4, *v6]
    if v4 != v6 and where.rsplit(".", 1)[-1] != "clusterIP":
        raise DualStackError(f"{where}: {v4!r} differs in IPv6 ({v6!r}) and has no dual-stack form")
    return v4


def dual_scenario(scenario: dict[str, Any], ipv6: dict[str, Any]) -> dict[str, Any]:
    """`scenario` of the IPv4 table with `ipv6`, its IPv6 form (load_ipv6_scenarios), as one
    dual-stack scenario."""
    if scenario["name"] != ipv6["name"] or len(scenario["steps"]) != len(ipv6["steps"]):
        raise DualStackError(f"{scenario['name']}: the IPv6 form {ipv6['name']} does not match it step by step")
    out = {k: v for k, v in scenario.items() if k not in ("manifests", "steps")}
    if scenario.get("manifests"):
        out["manifests"] = dual_manifests(scenario["manifests"])
    if ipv6.get("ipv6_difference"):
        out["ipv6_difference"] = ipv6["ipv6_difference"]
    steps = []
    for step4, step6 in zip(scenario["steps"], ipv6["steps"]):
        if "probe" in step4 or "http" in step4:
            steps += [{**step4, "family": 4}, {**step6, "family": 6}]
        elif "apply" in step4:
            steps.append({**step4, "apply": dual_manifests(step4["apply"])})
        else:
            steps.append(dict(step4))
    out["steps"] = steps
    return out


if __name__ == "__main__":
    from tests.e2e.scenario_runner import TOPOLOGY

    sys.stdout.write(yaml.safe_dump(dual_topology(yaml.safe_load(TOPOLOGY.read_text())),
                                    sort_keys=False, default_flow_style=None))
