"""Runs one scenario of tests/e2e/scenarios.yaml against a lab, whatever datapath its agents run.

Kept apart from the pytest file so the same table can be replayed by hand
(`python -m tests.e2e.scenario_runner --lab NAME SCENARIO`) when a case needs debugging.
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
# the topology-aware routing table runs on its own three-zone lab
ZONES_TOPOLOGY = HERE / "topology_zones.yaml"
ZONES_SCENARIOS = HERE / "scenarios_zones.yaml"


def load_scenarios(path: Path = SCENARIOS) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["scenarios"]


def addresses(lab) -> dict[str, str]:
    t = lab.topology
    out = {n.name: n.ip for n in t.nodes}
    out.update({p.name: p.ip for p in t.pods})
    out.update({c.name: c.ip for c in t.clients})
    return out


def substitute(text: str, lab) -> str:
    addr = addresses(lab)

    def repl(m: re.Match) -> str:
        if m.group(1) not in addr:
            raise KeyError(f"${{{m.group(1)}}}: no node, pod or client of that name")
        return addr[m.group(1)]

    return re.sub(r"\$\{([a-z0-9-]+)\}", repl, text)


class ScenarioFailure(AssertionError):
    pass


def check_probe(report, expect: dict[str, Any], lab, where: str) -> list[str]:
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
        want = substitute(expect["source"], lab)
        seen = {r["source"].rsplit(":", 1)[0] for r in ok if r["source"]}
        if seen != {want}:
            problems.append(f"backend saw source {sorted(seen)}, expected {want}")
    return problems


def run_step(lab, step: dict[str, Any]) -> list[str]:
    if "probe" in step:
        p = step["probe"]
        target = substitute(p["to"], lab)
        report = lab.probe(p["from"], target, count=p.get("count", 1), source_ip=p.get("source_ip"),
                           timeout=p.get("timeout", 1.0))
        problems = check_probe(report, step.get("expect", {}), lab, p["from"])
        return [f"probe {p['from']} → {target}: {x}" for x in problems]
    if "http" in step:
        from ebpf_proxy.lab.nshttp import http_get

        h = step["http"]
        url = substitute(h["url"], lab)
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
        raise ScenarioFailure(f"scenario {scenario['name']} (rule {scenario.get('rule')}) in mode {lab.mode}:\n  "
                              + "\n  ".join(problems))
