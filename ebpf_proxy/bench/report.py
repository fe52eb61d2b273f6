"""report.md and its plots, from a results.json document alone.

The report is rebuilt from the document (never from the run's memory), so a report can be
regenerated, or made from someone else's results, with `write_report(load(path), dir)`. Every
table puts the modes side by side (the comparison is the point of the bench), every figure
carries its spread over repeats, and what was not measured is said, with the reason, instead
of being left out silently.

Plots need matplotlib (the project's test extra); without it the report says so and the tables
are still written.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Callable

from ebpf_proxy.bench import targets
from ebpf_proxy.bench.results import MODES, summary_index

PLOT_FILES = {"conn_rate": "conn_rate.png", "latency_p99": "latency_p99.png", "update_latency": "update_latency.png"}
TCP_PATHS = ("clusterip", "nodeport-cluster", "nodeport-local")
MODE_COLOURS = {"direct": "tab:gray", "iptables": "tab:orange", "ebpf": "tab:blue"}
PATH_TITLES = {"clusterip": "ClusterIP (from a pod)", "nodeport-cluster": "NodePort, eTP=Cluster (outside)",
               "nodeport-local": "NodePort, eTP=Local (outside)", "direct": "pod IP, no proxy (baseline)",
               "clusterip6": "ClusterIP over IPv6 (from a pod)",
               "podip": "pod IPs, no Service (from a pod)"}
# the direct baseline of each path's row (the pod IPs of the same family)
DIRECT_OF = {"clusterip6": "direct6"}


def _table_paths(idx: dict) -> list[str]:
    """The TCP paths with rows: the IPv6 ClusterIP only in runs that measured it (dual-stack), and
    the pod IPs under the proxy modes' agents (podip) only in runs that measured them (from
    2026-11-28 on: earlier results.json files have no such point)."""
    return [*TCP_PATHS] + [p for p in ("clusterip6", "podip") if any(k[1] == p for k in idx)]


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "–"
    if abs(x) >= 100:
        text = f"{x:,.0f}"
    elif abs(x) >= 10:
        text = f"{x:.1f}"
    else:
        text = f"{x:.3g}"
    return f"{text} {unit}".strip()


def _pm(row: dict) -> str:
    return f"±{row['spread'] * 50:.0f}%" if row.get("spread") else "±0%"


def _modes(doc: dict) -> list[str]:
    asked = doc.get("parameters", {}).get("modes") or list(MODES)
    return [m for m in asked if m in MODES]


def _proxy_modes(doc: dict) -> list[str]:
    return [m for m in _modes(doc) if m != "direct"]


def _sizes(doc: dict) -> list[int]:
    return sorted({r["services"] for r in doc.get("summary", [])} | set(doc.get("parameters", {}).get("services", [])))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


# ---- sections -------------------------------------------------------------------------------------

def _header(doc: dict) -> list[str]:
    p, m, v = doc.get("parameters", {}), doc.get("machine", {}), doc.get("versions", {})
    lines = ["# ebpf-proxy bench", "",
             f"Run {doc.get('started_at')} → {doc.get('finished_at') or 'unfinished'}.", "",
             "```", doc.get("command") or "ebpf-proxy bench", "```", "",
             f"- machine: {m.get('cpu_model')}, {m.get('cpus')} CPUs, {m.get('memory_mib')} MiB; "
             f"kernel {m.get('kernel')}; {m.get('os')}",
             f"- versions: ebpf-proxy {v.get('ebpf_proxy')} (commit {v.get('git_commit') or 'unknown'}), "
             f"Python {v.get('python')}, {v.get('iptables')}",
             f"- parameters: services {p.get('services')} (+ the {p.get('measured_services')} measured ones "
             f"count towards it), {p.get('endpoints_per_service')} endpoints each; {p.get('duration_s')} s per "
             f"run after {p.get('warmup_s')} s warm-up, {p.get('repeats')} repeats; {p.get('concurrency')} "
             f"concurrent connections over {p.get('client_threads', 1)} client threads; {p.get('update_changes')} single changes × {p.get('repeats')}; bursts of "
             f"{p.get('burst_changes')} changes",
             "- figures: median over the repeats, ±half the relative range of the repeats "
             "((max − min) / 2 / median); latencies in ms", ""]
    skipped = [(mode, st.get("reason")) for mode, st in doc.get("modes", {}).items() if st.get("status") != "ok"]
    for mode, reason in skipped:
        lines.append(f"**Mode {mode} was skipped**: {reason}")
        lines.append("")
    return lines


def _targets_section(doc: dict) -> list[str]:
    """Each target (bench/targets.py) with what this run measured: a target not met is shown
    with its figure, one this run did not measure says so."""
    verdicts = targets.evaluate(doc.get("summary", []), doc.get("parameters", {}).get("endpoints_per_service"))
    words = {True: "met", False: "**not met**", None: "not measured"}
    rows = [[v.target, v.figure, words[v.met]] for v in verdicts]
    met = sum(v.met is True for v in verdicts)
    missed = sum(v.met is False for v in verdicts)
    return ["## Targets", "",
            f"The speed and memory targets (README, Benchmarks), read from this run's figures: {met} met, "
            f"{missed} not met, {len(verdicts) - met - missed} not measured in this run.", ""] \
        + _table(["target", "this run", "verdict"], rows)


def _datapath_section(doc: dict, idx: dict) -> list[str]:
    modes, sizes, paths = _modes(doc), _sizes(doc), _table_paths(idx)
    lines = ["## Data path", "",
             "New TCP connections per second (connect, 5-byte request, reply, close; a new connection "
             "each), and the request latency of those connections (p50 / p99, ms). `direct` is the "
             "client pod straight to the backend pod IPs, no proxy in the way: the physical limit."
             + (" `pod IPs, no Service` is that same traffic with each proxy mode's agents on (its "
                "`direct` cell is the baseline): what the mode costs traffic no Service translates."
                if "podip" in paths else ""), ""]
    rows = []
    for path in paths:
        for n in sizes:
            cells = [PATH_TITLES[path], f"{n:,}"]
            for mode in modes:
                r = idx.get(("conn_rate", DIRECT_OF.get(path, "direct") if mode == "direct" else path, mode, n))
                cells.append(f"{_fmt(r['value'])} {_pm(r)} ({_fmt(r['p50'])} / {_fmt(r['p99'])})" if r else "–")
            rows.append(cells)
    lines += _table(["path", "services"] + [f"{m}: conn/s (p50 / p99 ms)" for m in modes], rows)
    lines += ["UDP request/response per second, a new flow (socket) per request, as DNS clients do "
              "(ClusterIP for the proxy modes; the pod IPs for `direct`).", ""]
    rows = []
    for n in sizes:
        cells = [f"{n:,}"]
        for mode in modes:
            r = idx.get(("udp_rate", "direct" if mode == "direct" else "clusterip", mode, n))
            cells.append(f"{_fmt(r['value'])} {_pm(r)} ({_fmt(r['p50'])} / {_fmt(r['p99'])})" if r else "–")
        rows.append(cells)
    lines += _table(["services"] + [f"{m}: req/s (p50 / p99 ms)" for m in modes], rows)
    lines += ["Kernel CPU per operation, µs: the machine's system + irq + softirq time (every CPU) over "
              "each run's measured window, divided by the connections (or UDP requests) it completed. "
              "The lab's nodes share one kernel, so this is the whole path's kernel cost, the servers' "
              "and the load generator's system calls included (the same in every mode): the differences "
              "between modes are the proxy's.", ""]
    rows = []
    for metric, path, title in ([("cpu_per_conn", p, PATH_TITLES[p]) for p in _table_paths(idx)]
                                + [("cpu_per_req", "clusterip", "UDP, ClusterIP (from a pod)")]):
        for n in sizes:
            cells = [title, f"{n:,}"]
            for mode in modes:
                r = idx.get((metric, DIRECT_OF.get(path, "direct") if mode == "direct" else path, mode, n))
                cells.append(f"{_fmt(r['value'])} {_pm(r)}" if r else "–")
            rows.append(cells)
    lines += _table(["path", "services"] + [f"{m}: µs/operation" for m in modes], rows)
    return lines + _limits_lines(doc)


def _limits_lines(doc: dict) -> list[str]:
    """The rate points some of whose runs hit a CPU limit (bench/limits.py): their figure is that
    limit's, not (only) the path's."""
    hits = []
    for p in doc.get("points", []):
        runs = p.get("limits") or []
        counts: dict[str, int] = defaultdict(int)
        for run in runs:
            for limit in run.get("limited_by", []):
                counts[limit.split(" (")[0]] += 1
        if counts:
            what = ", ".join(f"{name} in {n} of {len(runs)} runs" for name, n in sorted(counts.items()))
            hits.append(f"- {p['metric']} {p['path']} {p['mode']} at {p['services']:,} services: {what}")
    if not hits:
        return ["No run hit a CPU limit (the load generator, an echo server, the machine): the rates are "
                "the paths'.", ""]
    return ["Runs that hit a CPU limit (the load generator or an echo server busy ≥ 0.9 of a core per "
            "thread, or the machine under 5 % idle; per-run figures in results.json, `limits`): there the "
            "rate is that limit's, and the modes' difference shows in the CPU per operation instead.", ""] \
        + hits + [""]


BPF_PATH_TITLES = {"clusterip_syn": "ClusterIP, first packet (SYN)", "established": "ClusterIP, established",
                   "nodeport": "NodePort, first packet (SYN, masqueraded)"}
LOAD_PATH_TITLES = {"load_tc_ingress": "tc_ingress", "load_tc_egress": "tc_egress"}


def _bpf_rows(idx: dict, titles: dict[str, str], sizes: list[int], cell: Callable[[dict], str]) -> list[list[str]]:
    """One row per bpf_ns_per_packet path of `titles`, one cell per size (– where not measured)."""
    rows = []
    for path, title in titles.items():
        found = (idx.get(("bpf_ns_per_packet", path, "ebpf", n)) for n in sizes)
        rows.append([title] + [cell(r) if r else "–" for r in found])
    return rows


def _bpf_cost_section(doc: dict, idx: dict) -> list[str]:
    sizes = [n for n in _sizes(doc) if any(idx.get(("bpf_ns_per_packet", p, "ebpf", n)) for p in BPF_PATH_TITLES)]
    if not sizes:
        return []
    lines = ["## eBPF program cost per packet", "",
             "tc_ingress alone, timed by the kernel (BPF_PROG_TEST_RUN, one run per packet, a new "
             "connection each; private maps holding the Services; bench/bpfcost.py): median / p99 ns.", ""]
    lines += _table(["packet"] + [f"{n:,} services: ns" for n in sizes],
                    _bpf_rows(idx, BPF_PATH_TITLES, sizes, lambda r: f"{_fmt(r['value'])} / {_fmt(r['p99'])} {_pm(r)}"))
    if not any(r["metric"] == "bpf_ns_per_packet" and r["path"] in LOAD_PATH_TITLES for r in idx.values()):
        return lines
    lines += ["Under load, as a cross-check: each program's mean time per run on the node a ClusterIP "
              "connection load entered (every packet its devices saw: SYNs, ACKs, data, replies, FINs), "
              "from the kernel's BPF statistics (run_time_ns / run_cnt; bench/livecost.py), ns.", ""]
    return lines + _table(["program"] + [f"{n:,} services: ns/run" for n in sizes],
                          _bpf_rows(idx, LOAD_PATH_TITLES, sizes, lambda r: f"{_fmt(r['value'])} {_pm(r)}"))


XDP_PATH_TITLES = {"xdp-native": "ebpf, XDP native", "xdp-generic": "ebpf, XDP generic",
                   "tc-only": "ebpf, TC only (XDP off)", "netfilter": "iptables (filter KUBE-EXTERNAL-SERVICES)"}


def _xdp_section(doc: dict, idx: dict) -> list[str]:
    rows = [r for r in idx.values() if r["metric"] == "xdp_pps"]
    if not rows:
        return []
    sizes = sorted({r["services"] for r in rows})
    lines = ["## NodePort flood: packets dropped per second", "",
             "A SYN flood (bench/pktgen.c, one thread, raw frames to the node's MAC, a new connection each) "
             "from outside to an externalTrafficPolicy=Local NodePort of a node without its endpoint; "
             "packets/s the node counted as dropped for that reason, by where it dropped them, and "
             "(in brackets) what the generator sent. On veths the receiver's work runs on the sender's "
             "CPU, so a cheaper drop shows as a higher rate (bench/xdppps.py).", ""]
    table = []
    for path, title in XDP_PATH_TITLES.items():
        cells = []
        for n in sizes:
            r = next((r for r in rows if r["path"] == path and r["services"] == n), None)
            cells.append(f"{_fmt(r['value'])} ({_fmt(r.get('sent_pps'))}) {_pm(r)}" if r else "–")
        if any(c != "–" for c in cells):
            table.append([title] + cells)
    return lines + _table(["dropped at"] + [f"{n:,} services: pps (sent)" for n in sizes], table)


def _control_section(doc: dict, idx: dict) -> list[str]:
    modes, sizes = _proxy_modes(doc), _sizes(doc)
    if not modes:
        return []
    lines = ["## Control plane", "",
             "- full sync: restart one node's agent with every Service present; seconds from its "
             "process start to the end of its first sync, the kernel complete (its "
             "kubeproxy_sync_proxy_rules_last_timestamp_seconds; initial list included), then in "
             "brackets until its /healthz answered 200 (the probe's period and the agent's heap "
             "settle later; per run in results.json, with the agent's own sync metric);",
             "- update latency: one endpoint moved at the API server → the node's kernel holds it "
             "(p50 / p99 over every change, ms);",
             f"- burst: {doc.get('parameters', {}).get('burst_changes', 1000):,}-change burst written at once → "
             "the kernel holds every final endpoint (s).", ""]
    rows = []
    for n in sizes:
        cells = [f"{n:,}"]
        for mode in modes:
            fs = idx.get(("full_sync", None, mode, n))
            ul = idx.get(("update_latency", None, mode, n))
            bc = idx.get(("burst_converge", None, mode, n))
            healthy = f" ({_fmt(fs['healthy_s'])})" if fs and fs.get("healthy_s") is not None else ""
            cells += [f"{_fmt(fs['value'])} {_pm(fs)}{healthy}" if fs else "–",
                      f"{_fmt(ul['p50'])} / {_fmt(ul['p99'])}" if ul else "–",
                      f"{_fmt(bc['value'])} {_pm(bc)}" if bc else "–"]
        rows.append(cells)
    header = ["services"]
    for mode in modes:
        header += [f"{mode}: full sync s", f"{mode}: update ms", f"{mode}: burst s"]
    lines += _table(header, rows)
    lines += _resources_section(doc, idx, modes, sizes)
    return lines


def _resources_section(doc: dict, idx: dict, modes: list[str], sizes: list[int]) -> list[str]:
    lines = ["Agent resources: peak RSS (MiB; the highest of any agent in any phase, then per phase) and "
             "CPU seconds per phase (the sum over both nodes' agents; full sync: the restarted agent, "
             "median of the restarts).", ""]
    phases: list[str] = []
    for r in doc.get("summary", []):
        for phase in r.get("cpu_seconds_by_phase", {}):
            if phase not in phases:
                phases.append(phase)
    rows = []
    for n in sizes:
        for mode in modes:
            r = idx.get(("rss", None, mode, n))
            if not r:
                continue
            cpu = r.get("cpu_seconds_by_phase", {})
            peaks = r.get("by_phase", {})
            rows.append([f"{n:,}", mode, _fmt(r["value"])]
                        + [f"{_fmt(cpu.get(ph))} s / {_fmt(peaks.get(ph))} MiB" for ph in phases])
    if rows:
        lines += _table(["services", "mode", "peak RSS MiB"] + [f"{ph}: CPU / peak RSS" for ph in phases], rows)
    return lines


def _kernel_section(doc: dict) -> list[str]:
    entries = doc.get("kernel_state", [])
    if not entries:
        return []
    lines = ["## Kernel state", "",
             "What the proxy holds in each node's kernel: iptables rules (`-A` lines of iptables-save, "
             "all tables) or entries of its hash-like BPF maps.", ""]
    by = defaultdict(dict)
    for e in entries:
        by[(e["services"], e["mode"])][e["node"]] = e["counts"]
    rows = []
    for (n, mode), nodes in sorted(by.items()):
        for node, counts in sorted(nodes.items()):
            detail = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if k != "total")
            rows.append([f"{n:,}", mode, node, f"{counts.get('total', 0):,}", detail])
    return lines + _table(["services", "mode", "node", "total", "detail"], rows)


def _installs_section(doc: dict) -> list[str]:
    installs = doc.get("installs", [])
    if not installs:
        return []
    rows = [[f"{i['services']:,}", str(i["created"]), str(i["deleted"]), _fmt(i["seconds"], "s"),
             _pair(i.get("list_first_s", i.get("list_seconds")), i.get("list_later_s")),
             _pair(i.get("api_cpu_first_s"), i.get("api_cpu_later_s"))] for i in installs]
    return ["Installing the Services at the API server (selector-less, hand-written EndpointSlices), and "
            "what serving an agent's start costs the lab API server: one paged list of every Service and "
            "EndpointSlice, as an agent lists them, taken twice: the first after the installs (the server "
            "encodes each object once and keeps its JSON) and a later one, as each restart of the full sync "
            "above lists. The wall time is a client's, its own JSON decoding included; the CPU is the API "
            "server process's alone (on these same two CPUs; a real API server runs elsewhere):", ""] + \
        _table(["services", "created", "deleted", "took", "list wall s: first / later",
                "API server CPU s: first / later"], rows)


def _pair(first: float | None, later: float | None) -> str:
    """"first / later" seconds, – for a figure a run did not take."""
    return f"{_fmt(first)} / {_fmt(later)}"


def _unavailable_section(doc: dict) -> list[str]:
    lines = []
    failures = doc.get("failures", [])
    if failures:
        lines += ["## Failed", "", "These measurements broke; their figures are missing, not zero.", ""]
        lines += [f"- {f['metric']} {f.get('path') or ''} {f['mode']} at {f['services']:,} services: "
                  f"{f['error'].splitlines()[0] if f['error'] else ''}" for f in failures]
        lines.append("")
    items = doc.get("unavailable", [])
    if items:
        lines += ["## Not measured", ""]
        lines += [f"- {u['mode']} {u['metric']}: {u['reason']}" for u in items]
        lines.append("")
    notes = doc.get("notes", [])
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return lines


# ---- plots --------------------------------------------------------------------------------------

def _series(summary: list[dict], metric: str, path: str | None, mode: str, key: str) -> tuple[list[int], list[float]]:
    rows = sorted((r for r in summary if r["metric"] == metric and r["path"] == path and r["mode"] == mode),
                  key=lambda r: r["services"])
    pts = [(r["services"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _range(points: list[dict], metric: str, path: str | None, mode: str, xs: list[int]) -> list[tuple[float, float]]:
    """(min, max) of the per-repeat values at each x: the error bars."""
    out = []
    for x in xs:
        values = next((p["values"] for p in points if (p["metric"], p.get("path"), p["mode"], p["services"])
                       == (metric, path, mode, x)), [])
        out.append((min(values), max(values)) if values else (math.nan, math.nan))
    return out


def write_plots(doc: dict, out_dir: Path) -> list[str]:
    """The PNGs; returns their file names (none when matplotlib is missing: ImportError)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, modes = doc.get("summary", []), _modes(doc)
    written = []
    for name, key, ylabel in (("conn_rate", "value", "new TCP connections / s"),
                              ("latency_p99", "p99", "request latency p99 (ms)")):
        fig, axes = plt.subplots(1, len(TCP_PATHS), figsize=(5 * len(TCP_PATHS), 4), sharey=True)
        for ax, path in zip(axes, TCP_PATHS):
            for mode in modes:
                mode_path = "direct" if mode == "direct" else path
                xs, ys = _series(summary, "conn_rate", mode_path, mode, key)
                if not xs:
                    continue
                style = dict(marker="o", label=mode, color=MODE_COLOURS.get(mode),
                             linestyle="--" if mode == "direct" else "-")
                if key == "value":  # the rate's repeats as error bars (min to max)
                    lo_hi = _range(doc.get("points", []), "conn_rate", mode_path, mode, xs)
                    # max(0, ...): the plotted median is rounded and may sit a hair outside the range
                    err = [[max(0.0, y - lo) for y, (lo, _) in zip(ys, lo_hi)],
                           [max(0.0, hi - y) for y, (_, hi) in zip(ys, lo_hi)]]
                    ax.errorbar(xs, ys, yerr=err, capsize=3, **style)
                else:
                    ax.plot(xs, ys, **style)
            ax.set_xscale("log")
            ax.set_title(PATH_TITLES[path], fontsize=10)
            ax.set_xlabel("services")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel(ylabel)
        axes[0].set_ylim(bottom=0)
        if axes[-1].get_legend_handles_labels()[0]:
            axes[-1].legend()
        fig.tight_layout()
        fig.savefig(out_dir / PLOT_FILES[name], dpi=100)
        plt.close(fig)
        written.append(PLOT_FILES[name])
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in _proxy_modes(doc):
        for key, style in (("p50", "-"), ("p99", ":")):
            xs, ys = _series(summary, "update_latency", None, mode, key)
            if xs:
                ax.plot(xs, ys, marker="o", linestyle=style, label=f"{mode} {key}", color=MODE_COLOURS.get(mode))
    ax.set_xscale("log")
    ax.set_xlabel("services")
    ax.set_ylabel("endpoint change → kernel (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / PLOT_FILES["update_latency"], dpi=100)
    plt.close(fig)
    written.append(PLOT_FILES["update_latency"])
    return written


def render_markdown(doc: dict, plots: list[str], plot_error: str | None = None) -> str:
    idx = summary_index(doc.get("summary", []))
    lines = _header(doc) + _targets_section(doc) + _datapath_section(doc, idx) + _bpf_cost_section(doc, idx) \
        + _xdp_section(doc, idx) + _control_section(doc, idx) \
        + _kernel_section(doc) \
        + _installs_section(doc) + _unavailable_section(doc)
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    elif plot_error:
        lines += [f"Plots not drawn: {plot_error}", ""]
    return "\n".join(lines)


def write_report(doc: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    error = None
    try:
        plots = write_plots(doc, out_dir)
    except ImportError as exc:
        error = (f"matplotlib is not installed ({exc}); install it and run "
                 "`ebpf-proxy bench --report-from DIR/results.json`")
    except Exception as exc:  # noqa: BLE001 - the tables must not be lost to a plotting problem
        error = f"drawing failed: {type(exc).__name__}: {exc}"
    path = out_dir / "report.md"
    path.write_text(render_markdown(doc, plots, error))
    return path

