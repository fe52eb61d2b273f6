"""results.json: every raw sample, the machine and parameters, and the `summary` scripts rely on.

The document (schema 1)::

    schema, tool, command, started_at, finished_at
    parameters    what was asked (modes, sizes, durations, repeats, ...)
    machine       kernel, CPU, cores, memory;  versions: python, package, iptables, cc, git commit
    modes         {mode: {"status": "ok"|"unavailable", "reason": ...}}
    points        raw measurements, one per (metric, path, mode, services): per-repeat `values`
                  and everything the tools printed (`runs`); `failed` ones (runs with errors)
                  are kept here for diagnosis but have no summary row
    installs      [{services, created, deleted, seconds}]: installing the Services at each size
    kernel_state  [{mode, services, node, counts}]
    resources     [{mode, services, phase, node, cpu_seconds, peak_rss_mib, rss_mib}]
    unavailable   [{mode, metric, reason}]: what cannot be measured here (not built yet), and why
    failures      [{mode, metric, services, path, error}]: measurements that broke (exit status 1)
    notes         free text the report repeats (e.g. a point whose runs saw errors)
    summary       one row per measured point, built from `points` by `summarize` (below)

A summary row: {"metric", "path", "mode", "services", "value", "unit", "p50", "p99", "repeats",
"spread"}, where `value` is the median over the repeats (for update_latency: the p50 over every
change; for rss: the highest peak RSS of any agent in any phase, the phases being its "repeats"),
`spread` is (max - min) / median of the per-repeat values, and p50/p99 are request
latency in ms (the median over repeats of each run's percentile) for conn_rate/udp_rate, the
percentiles over every change for update_latency, for bpf_ns_per_packet the program's own run
time in ns (median over repeats of each repeat's median and p99; bench/bpfcost.py; its
`load_tc_ingress` / `load_tc_egress` rows are the mean run time of each program on the node a
ClusterIP load entered, from the kernel's BPF statistics, bench/livecost.py: no percentiles), and
null for the rest. conn_rate rows of path `podip` (the proxy modes) are `direct`'s traffic, the
client pod straight to the backend pod IPs, with that mode's agents on (bench/traffic.py:
podip_point). cpu_per_conn / cpu_per_req (one per conn_rate / udp_rate point) are the machine's
kernel CPU time (system + irq + softirq of every CPU; the lab's nodes share one kernel) over each
run's measured window divided by the operations it completed, in µs. xdp_pps rows (bench/xdppps.py)
are the packets per second an eTP=Local NodePort's node dropped for lack of a local endpoint under
a SYN flood, by where it dropped them (path xdp-native, xdp-generic, tc-only: ebpf; netfilter:
iptables), and carry `sent_pps`, what the generator sent. Rate rows also carry
`p90` and `latency_unit`; rss rows carry `by_phase` (MiB) and `cpu_seconds_by_phase`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable

from ebpf_proxy import __version__
from ebpf_proxy.bench.stats import is_figure, median, percentile, spread

SCHEMA = 1
SUMMARY_KEYS = ("metric", "path", "mode", "services", "value", "unit", "p50", "p99", "repeats", "spread")
METRICS = ("conn_rate", "udp_rate", "cpu_per_conn", "cpu_per_req", "bpf_ns_per_packet", "xdp_pps", "update_latency",
           "full_sync", "burst_converge", "rss")
XDP_PATHS = ("xdp-native", "xdp-generic", "tc-only", "netfilter")  # where the node drops (bench/xdppps.py)
BPF_COST_PATHS = ("clusterip_syn", "established", "nodeport")  # the packets bench/bpfcost.py times
PATHS = ("clusterip", "nodeport-cluster", "nodeport-local", "clusterip6", "direct", "direct6", "podip",
         *BPF_COST_PATHS, "load_tc_ingress", "load_tc_egress", *XDP_PATHS, None)
MODES = ("direct", "iptables", "ebpf")
RATE_METRICS = ("conn_rate", "udp_rate")
HIGHER_IS_BETTER = frozenset((*RATE_METRICS, "xdp_pps"))


def summary_index(summary: Iterable[dict]) -> dict[tuple, dict]:
    """Summary rows by (metric, path, mode, services): one row per point, as summarize makes them."""
    return {(r["metric"], r["path"], r["mode"], r["services"]): r for r in summary}


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}") if x and math.isfinite(x) else x


def summarize_point(point: dict[str, Any]) -> dict[str, Any]:
    """The summary row of one raw point (see the module docstring)."""
    metric, values = point["metric"], list(point["values"])
    if not values:
        raise ValueError(f"point {metric}/{point.get('path')}/{point['mode']}/{point['services']}: no values")
    row: dict[str, Any] = {
        "metric": metric, "path": point.get("path"), "mode": point["mode"], "services": point["services"],
        "value": _round(median(values)), "unit": point["unit"], "p50": None, "p99": None,
        "repeats": len(values), "spread": _round(spread(values), 3),
    }
    if metric in RATE_METRICS:
        lat = point["latency_ms"]
        row["p50"] = _round(median(lat["p50"]))
        row["p99"] = _round(median(lat["p99"]))
        row["p90"] = _round(median(lat["p90"]))
        row["latency_unit"] = "ms"
    elif metric == "update_latency":
        pooled = [s for repeat in point["samples"] for s in repeat]
        row["value"] = row["p50"] = _round(percentile(pooled, 50))
        row["p99"] = _round(percentile(pooled, 99))
        row["changes"] = len(pooled)
    elif metric == "bpf_ns_per_packet" and all("p99" in r for r in point["runs"]):  # crafted packets
        row["p50"] = row["value"]
        row["p99"] = _round(median([r["p99"] for r in point["runs"]]))
    elif metric == "xdp_pps":
        row["sent_pps"] = _round(median([r["sent_pps"] for r in point["runs"]]))
    elif metric == "full_sync" and point.get("runs") and all("healthy_s" in r for r in point["runs"]):
        row["healthy_s"] = _round(median([r["healthy_s"] for r in point["runs"]]))  # when /healthz said so
    elif metric == "rss":
        row["value"] = _round(max(values))  # the peak: the most memory the agent needed
        row["by_phase"] = point.get("by_phase", {})
        row["cpu_seconds_by_phase"] = point.get("cpu_seconds_by_phase", {})
    return row


def summarize(points: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of every point that did not fail (a failed point's figure is no figure)."""
    order = {m: i for i, m in enumerate(METRICS)}
    rows = [summarize_point(p) for p in points if not p.get("failed")]
    return sorted(rows, key=lambda r: (order.get(r["metric"], 99), r["services"], str(r["path"]),
                                       MODES.index(r["mode"]) if r["mode"] in MODES else 9))


def check(doc: dict[str, Any]) -> list[str]:
    """Everything wrong with a results document's shape or figures (empty: it is sane).

    A zero, negative, NaN or infinite figure is a broken measurement, never a result."""
    problems = []
    for key in ("schema", "parameters", "machine", "versions", "modes", "points", "summary"):
        if key not in doc:
            problems.append(f"missing top-level key {key!r}")
    summary = doc.get("summary")
    if not isinstance(summary, list) or not summary:
        return problems + ["summary: empty or not a list"]
    for i, row in enumerate(summary):
        where = f"summary[{i}] ({row.get('metric')}/{row.get('path')}/{row.get('mode')}/{row.get('services')})"
        missing = [k for k in SUMMARY_KEYS if k not in row]
        if missing:
            problems.append(f"{where}: missing {', '.join(missing)}")
            continue
        if row["metric"] not in METRICS:
            problems.append(f"{where}: metric {row['metric']!r} is not one of {METRICS}")
        if row["path"] not in PATHS:
            problems.append(f"{where}: path {row['path']!r} is not one of {PATHS}")
        if row["mode"] not in MODES:
            problems.append(f"{where}: mode {row['mode']!r} is not one of {MODES}")
        if not isinstance(row["services"], int) or isinstance(row["services"], bool) or row["services"] < 1:
            problems.append(f"{where}: services {row['services']!r} is not a positive integer")
        if not is_figure(row["value"]):
            problems.append(f"{where}: value {row['value']!r} is not a positive finite number")
        if not isinstance(row["unit"], str) or not row["unit"]:
            problems.append(f"{where}: unit {row['unit']!r}")
        for key in ("p50", "p99"):
            if row[key] is not None and not is_figure(row[key]):
                problems.append(f"{where}: {key} {row[key]!r} is not a positive finite number")
        if row["metric"] in RATE_METRICS + ("update_latency",) and (row["p50"] is None or row["p99"] is None):
            problems.append(f"{where}: a {row['metric']} row needs p50 and p99")
        if is_figure(row["p50"]) and is_figure(row["p99"]) and row["p50"] > row["p99"]:
            problems.append(f"{where}: p50 {row['p50']} > p99 {row['p99']}")
        if not isinstance(row["repeats"], int) or row["repeats"] < 1:
            problems.append(f"{where}: repeats {row['repeats']!r}")
        if not isinstance(row["spread"], (int, float)) or not math.isfinite(row["spread"]) or row["spread"] < 0:
            problems.append(f"{where}: spread {row['spread']!r} is not a finite number >= 0")
    return problems


# ---- the machine ----------------------------------------------------------------------------------

def _first_line(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0] if text else None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_mib() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"MemTotal:\s+(\d+) kB", f.read())
        return int(m.group(1)) // 1024 if m else None
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    uname = platform.uname()
    return {"hostname": uname.node, "kernel": uname.release, "kernel_version": uname.version,
            "arch": uname.machine, "cpu_model": _cpu_model(), "cpus": os.cpu_count(),
            "memory_mib": _mem_total_mib(), "os": _os_release()}


def _os_release() -> str | None:
    try:
        with open("/etc/os-release") as f:
            m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', f.read(), re.M)
        return m.group(1) if m else None
    except OSError:
        return None


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    if not (repo / ".git").exists():
        return None
    out = _first_line(["git", "-C", str(repo), "rev-parse", "HEAD"])
    return out if out and re.fullmatch(r"[0-9a-f]{40}", out) else None


def versions() -> dict[str, Any]:
    return {"ebpf_proxy": __version__, "python": platform.python_version(), "git_commit": _git_commit(),
            "iptables": _first_line(["iptables", "--version"]), "cc": _first_line(["cc", "--version"]),
            "bpftool": _first_line(["bpftool", "version"]), "conntrack": _first_line(["conntrack", "--version"])}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- the document -------------------------------------------------------------------------------

class Results:
    """Accumulates a run and writes results.json after every point (a crash keeps what was done)."""

    def __init__(self, parameters: dict[str, Any], command: str) -> None:
        self.doc: dict[str, Any] = {
            "schema": SCHEMA, "tool": "ebpf-proxy bench", "command": command,
            "started_at": now_iso(), "finished_at": None,
            "parameters": parameters, "machine": machine_info(), "versions": versions(),
            "modes": {}, "points": [], "kernel_state": [], "resources": [], "installs": [],
            "unavailable": [], "failures": [], "notes": [], "summary": [],
        }

    def set_mode_status(self, mode: str, status: str, reason: str | None = None) -> None:
        self.doc["modes"][mode] = {"status": status, **({"reason": reason} if reason else {})}

    def add_point(self, point: dict[str, Any]) -> dict[str, Any] | None:
        """Keep a raw point; returns its summary row (None for a failed point: it has none)."""
        self.doc["points"].append(point)
        self.doc["summary"] = summarize(self.doc["points"])
        return None if point.get("failed") else summarize_point(point)

    def add_unavailable(self, mode: str, metric: str, reason: str) -> None:
        entry = {"mode": mode, "metric": metric, "reason": reason}
        if entry not in self.doc["unavailable"]:
            self.doc["unavailable"].append(entry)

    def add_failure(self, mode: str, metric: str, services: int, path: str | None, error: str) -> None:
        self.doc["failures"].append({"mode": mode, "metric": metric, "services": services, "path": path,
                                     "error": error})

    def add_note(self, text: str) -> None:
        self.doc["notes"].append(text)

    def finish(self) -> None:
        self.doc["finished_at"] = now_iso()
        self.doc["summary"] = summarize(self.doc["points"])

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "results.json"
        tmp = out_dir / "results.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, path)
        return path


def load(path: str | Path) -> dict[str, Any]:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("summary"), list):
        raise ValueError(f"{path}: not a bench results.json (schema {SCHEMA})")
    return doc
