"""Runs one scenario of tests/e2e/scenarios.yaml against a lab, whatever datapath its agents run.

Kept apart from the pytest file so the same table can be replayed by hand
(`python -m tests.e2e.scenario_runner --lab NAME SCENARIO`) when a case needs debugging.

The same table also runs on an IPv6-only cluster (topology_ipv6.yaml): load_ipv6_scenarios()
derives it by the address translation of scenarios_ipv6.py, then applies IPV6_DIFFERENCES, the
few expectations where kube-proxy's IPv6 outcome is not the IPv4 one, each with its reason.
And on a dual-stack cluster (topology_dualstack.yaml): load_dualstack_scenarios() pairs each
scenario with its IPv6 form (scenarios_dualstack.py): RequireDualStack Services, every probe
over IPv4 and then over IPv6 (a step's `family` says which address `${name}` stands for).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
TOPOLOGY = HERE / "topology.yaml"
SCENARIOS = HERE / "scenarios.yaml"
# the IPv6-only twin of TOPOLOGY: scenarios_ipv6.translate_topology(topology.yaml), checked in
TOPOLOGY_IPV6 = HERE / "topology_ipv6.yaml"
# the dual-stack twin: scenarios_dualstack.dual_topology(topology.yaml), checked in
TOPOLOGY_DUALSTACK = HERE / "topology_dualstack.yaml"
# the topology-aware routing table runs on its own three-zone lab
ZONES_TOPOLOGY = HERE / "topology_zones.yaml"
ZONES_SCENARIOS = HERE / "scenarios_zones.yaml"


def load_scenarios(path: Path = SCENARIOS) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["scenarios"]


# Where kube-proxy's outcome over IPv6 differs from the IPv4 table, the IPv6 run checks this
# instead, never skips it: by step index, `expect` replaces the translated step's, and the keys
# of `probe` given update it (the target stays the translation's).
IPV6_DIFFERENCES: dict[str, dict[str, Any]] = {
    "nodeport-on-localhost": {
        "reason": "localhost NodePorts exist on IPv4 only: kube-proxy's IPv6 ruleset jumps to "
                  "KUBE-NODEPORTS with `! -d ::1/128` (proxier.go: \"For IPv6 they never work\"), so "
                  "[::1]:<nodePort> is not DNATed and reaches worker2's own stack: refused (nothing "
                  "listens) for the eTP=Cluster port; for the eTP=Local port, which has no local "
                  "endpoint on worker2, the filter rule KUBE-EXTERNAL-SERVICES `has no local endpoints` "
                  "(`-m addrtype --dst-type LOCAL --dport <nodePort> -j DROP`, which ::1 matches) "
                  "drops it first: timeout",
        "steps": {
            0: {"expect": {"outcome": "refused"}},
            1: {"probe": {"count": 2, "timeout": 0.5}, "expect": {"outcome": "timeout"}},
        },
    },
}


def load_ipv6_scenarios(path: Path = SCENARIOS) -> list[dict[str, Any]]:
    """The table of `path` over IPv6: every scenario translated (scenarios_ipv6.py), then its
    IPV6_DIFFERENCES applied; such a scenario carries the reason as `ipv6_difference`."""
    from tests.e2e.scenarios_ipv6 import translate_scenario

    out = []
    for scenario in load_scenarios(path):
        scenario = translate_scenario(scenario)
        diff = IPV6_DIFFERENCES.get(scenario["name"])
        if diff:
            for index, change in diff["steps"].items():
                if index >= len(scenario["steps"]):
                    raise IndexError(f"IPV6_DIFFERENCES[{scenario['name']!r}]: no step {index}")
                step = dict(scenario["steps"][index])
                for key, value in change.items():
                    if key == "expect":  # the IPv6 outcome replaces the IPv4 one whole
                        step[key] = dict(value)
                    elif isinstance(value, dict):
                        step[key] = {**step.get(key, {}), **value}
                    else:
                        step[key] = value
                scenario["steps"][index] = step
            scenario["ipv6_difference"] = diff["reason"]
        out.append(scenario)
    unknown = set(IPV6_DIFFERENCES) - {s["name"] for s in out}
    if unknown:
        raise KeyError(f"IPV6_DIFFERENCES names no scenario of {path.name}: {sorted(unknown)}")
    return out


def load_dualstack_scenarios(path: Path = SCENARIOS) -> list[dict[str, Any]]:
    """The table of `path` on a dual-stack cluster: each scenario with its IPv6 form, as one."""
    from tests.e2e.scenarios_dualstack import dual_scenario

    return [dual_scenario(v4, v6) for v4, v6 in zip(load_scenarios(path), load_ipv6_scenarios(path))]


def addresses(lab, family: int | None = None) -> dict[str, str]:
    """name -> address of every node, pod and client: of IP `family`, else the primary one."""
    def pick(ips, primary):
        return primary if family is None else next(ip for ip in ips if (":" in ip) == (family == 6))

    t = lab.topology
    out = {n.name: pick(n.ips, n.ip) for n in t.nodes}
    out.update({p.name: pick(p.ips, p.ip) for p in t.pods})
    out.update({c.name: pick(c.ips, c.ip) for c in t.clients})
    return out


def substitute(text: str, lab, family: int | None = None) -> str:
    addr = addresses(lab, family)

    def repl(m: re.Match) -> str:
        if m.group(1) not in addr:
            raise KeyError(f"${{{m.group(1)}}}: no node, pod or client of that name")
        return addr[m.group(1)]

    return re.sub(r"\$\{([a-z0-9-]+)\}", repl, text)


IPV6_REFUSED_TIMEOUT = 3.0  # see run_step


class ScenarioFailure(AssertionError):
    pass


def check_probe(report, expect: dict[str, Any], lab, where: str, family: int | None = None) -> list[str]:
    data = report.to_json()
    results = data["results"]
    problems = []
    if "outcome" in expect:
        bad = [r["outcome"] for r in results if r["outcome"] != expect["outcome"]]
        if bad:
            problems.append(f"expected every attempt {expect['outcome']}, got {data['summary']}")
    ok = [r for r in results if r["outcome"] == "ok"]
    answered = {r["pod"] for r in ok}
    if "pods" in expect:
        allowed = set(expect["pods"])
        if not answered <= allowed:
            problems.append(f"answered by {sorted(answered)}, allowed only {sorted(allowed)}")
        if expect.get("spread") and answered != allowed:
            problems.append(f"expected every one of {sorted(allowed)} to answer, got {data['summary']['by_pod']}")
    if expect.get("same_pod") and len(answered) > 1:
        problems.append(f"session affinity broken: answered by {data['summary']['by_pod']}")
    if "source" in expect:
        want = substitute(expect["source"], lab, family)
        seen = {r["source"].rsplit(":", 1)[0].strip("[]") for r in ok if r["source"]}
        if seen != {want}:
            problems.append(f"backend saw source {sorted(seen)}, expected {want}")
    return problems


def run_step(lab, step: dict[str, Any]) -> list[str]:
    family = step.get("family")  # dual-stack table: which family's address ${name} is
    if "probe" in step:
        p = step["probe"]
        target = substitute(p["to"], lab, family)
        timeout = p.get("timeout", 1.0)
        if target.startswith("[") and step.get("expect", {}).get("outcome") == "refused":
            # Over IPv6 the client's kernel loses the ICMPv6 port unreachable a REJECT sends back
            # to the first TCP SYN: it arrives while connect() still holds the socket (the whole
            # path runs in that call's softirq) and TCP drops ICMPv6 errors for a socket owned
            # by the user (TcpExtLockDroppedIcmps). The refusal comes with the SYN's
            # retransmission ~1 s later -- as under kube-proxy -- so give it 3 s.
            timeout = max(timeout, IPV6_REFUSED_TIMEOUT)
        report = lab.probe(p["from"], target, count=p.get("count", 1), source_ip=p.get("source_ip"),
                           timeout=timeout)
        problems = check_probe(report, step.get("expect", {}), lab, p["from"], family)
        return [f"probe {p['from']} → {target}: {x}" for x in problems]
    if "http" in step:
        from ebpf_proxy.lab.nshttp import http_get

        h = step["http"]
        url = substitute(h["url"], lab, family)
        status, body = http_get(lab.netns_of(h["from"]), url, timeout=2.0)
        expect, problems = step.get("expect", {}), []
        if "status" in expect and status != expect["status"]:
            problems.append(f"status {status}, expected {expect['status']} (body {body!r})")
        for key, value in (expect.get("json") or {}).items():
            try:
                got = json.loads(body).get(key)
            except (ValueError, AttributeError):
                got = f"<not JSON: {body!r}>"
            if got != value:
                problems.append(f"json {key}={got!r}, expected {value!r}")
        return [f"http {h['from']} {url}: {x}" for x in problems]
    if "scale" in step:
        lab.scale(step["scale"]["app"], step["scale"]["replicas"])
        lab.wait_converged()
        return []
    if "apply" in step:
        lab.apply_manifests(substitute(step["apply"], lab), "step")
        lab.wait_converged()
        return []
    if "delete" in step:  # a pod of the lab goes away (its endpoint with it)
        lab.remove_pod(step["delete"]["name"])
        lab.wait_converged()
        return []
    raise ValueError(f"unknown step {sorted(step)}")


def run_scenario(lab, scenario: dict[str, Any], topology: Path = TOPOLOGY) -> None:
    manifests = substitute(scenario.get("manifests") or "", lab)
    if manifests:
        lab.apply_manifests(manifests, scenario["name"])
    lab.wait_converged()
    problems: list[str] = []
    try:
        for step in scenario["steps"]:
            problems += run_step(lab, step)
    finally:
        if manifests:
            lab.delete_manifests(manifests, scenario["name"])
        # leave the lab as the topology file describes it
        if any("scale" in s for s in scenario["steps"]):
            app = next(s["scale"]["app"] for s in scenario["steps"] if "scale" in s)
            base = [p for p in yaml.safe_load(topology.read_text())["pods"] if (p.get("labels") or {}).get("app") == app]
            lab.scale(app, len(base))
        lab.wait_converged()
    if problems:
        families = "/".join(lab.topology.families)
        note = f" [IPv6 difference: {scenario['ipv6_difference']}]" if scenario.get("ipv6_difference") else ""
        raise ScenarioFailure(f"scenario {scenario['name']} (rule {scenario.get('rule')}) in mode {lab.mode}, "
                              f"{families}{note}:\n  " + "\n  ".join(problems))
