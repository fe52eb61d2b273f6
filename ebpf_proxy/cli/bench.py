"""`ebpf-proxy bench`: the data path and control plane of each mode, measured side by side."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

# The bench's modules are imported inside the command: every `ebpf-proxy` invocation (the agent's
# `run` included) imports this module to register the command, and must neither pay for nor
# break on the bench's dependencies (the lab, matplotlib).

EPILOG = """\b
Examples:
  ebpf-proxy bench --quick                                # 1 and 1,000 services, ~3 min
  ebpf-proxy bench --modes direct,iptables,ebpf --services 1,1000,10000 --duration 5s --out docs/benchmarks/run
  ebpf-proxy bench --compare old/results.json new/results.json
  ebpf-proxy bench --report-from run/results.json         # redraw report.md and the plots
"""

# (full profile, --quick); an option given explicitly wins over both.
PROFILES = {
    "services": ("1,1000,10000", "1,1000"),
    "duration": ("5s", "1s"),
    "warmup": ("1s", "0.5s"),
    "repeats": (3, 3),
    "update_changes": (20, 10),
    "burst_changes": (1000, 1000),
    "xdp_duration": ("2s", "0s"),  # the CI profile has no xdp_pps rows: 4 agent restarts per size
}


def _pick(name: str, given, quick: bool):
    return given if given is not None else PROFILES[name][1 if quick else 0]


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected numbers separated by commas, e.g. 1,1000,10000",
                                 param_hint=what) from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: expected positive numbers", param_hint=what)
    return sorted(set(values))


def _seconds(text: str, what: str, allow_zero: bool = False) -> float:
    from ebpf_proxy.agent.config import ConfigError, parse_duration

    try:
        value = parse_duration(text, what)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=what) from None
    if value < 0 or (value == 0 and not allow_zero):
        raise click.BadParameter(f"{text!r}: must be longer than 0", param_hint=what)
    return value


def _modes_as_root(modes: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """--modes as a list, each one of `allowed`; and root, which building a lab needs (checked
    after the options, so a typo is reported as such even without root)."""
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in mode_list if m not in allowed]
    if bad or not mode_list:
        raise click.BadParameter(f"{modes!r}: modes are {', '.join(allowed)}", param_hint="--modes")
    if os.geteuid() != 0:
        raise click.ClickException(f"the {what} builds a lab (network namespaces, iptables): run it as root")
    return mode_list


def _print_compare(old_path: str, new_path: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from ebpf_proxy.bench.compare import compare
    from ebpf_proxy.bench.results import load

    rows = compare(load(old_path), load(new_path))
    table = Table("metric", "path", "mode", "services", "old", "new", "unit", "new/old", "verdict",
                  title=f"{new_path} vs {old_path}")
    colour = {"better": "green", "worse": "red"}
    for r in rows:
        fmt = (lambda x: "–" if x is None else f"{x:,.4g}")
        ratio = "–" if r.ratio is None else f"{r.ratio:.3f}"
        verdict = f"[{colour[r.verdict]}]{r.verdict}[/]" if r.verdict in colour else r.verdict
        table.add_row(r.metric, r.path or "–", r.mode, f"{r.services:,}", fmt(r.old), fmt(r.new), r.unit, ratio,
                      verdict)
    console = Console()
    if not console.is_terminal:  # a pipe or a log: no reason to squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)


@click.command(epilog=EPILOG)
@click.option("--modes", default="direct,iptables,ebpf", show_default=True,
              help="Comma-separated, from: direct (pod IPs, no proxy), iptables, ebpf.")
@click.option("--services",
              help="Sizes: total Services installed, comma-separated. [default: 1,1000,10000; --quick: 1,1000]")
@click.option("--endpoints-per-service", type=click.IntRange(1, 100), default=2, show_default=True)
@click.option("--duration", help="Measured time of each load run. [default: 5s; --quick: 1s]")
@click.option("--warmup", help="Load before a point's first measured run. [default: 1s; --quick: 0.5s]")
@click.option("--repeats", type=click.IntRange(1, 100),
              help="Runs of each point (3 or more for a spread). [default: 3]")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Connections (or UDP requests) in flight per load generator.")
@click.option("--client-threads", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Load generator threads sharing --concurrency; 0: one per CPU, so the client is not the limit.")
@click.option("--update-changes", type=click.IntRange(1, 10000),
              help="Single endpoint changes per repeat of the update-latency measurement. [default: 20; --quick: 10]")
@click.option("--burst-changes", type=click.IntRange(1, 100000), help="Changes in one burst. [default: 1000]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where results.json, report.md and the plots go. [default: bench-results/<time>]")
@click.option("--xdp-duration", help="Each xdp_pps run's SYN flood; 0 measures no xdp_pps. [default: 2s; --quick: 0s]")
@click.option("--bpf-host-routing", type=click.Choice(["auto", "on", "off"]), default=None,
              help="The ebpf agents' --bpf-host-routing: measure the host-routing fast path on and off in two "
                   "runs. [default: the agent's, auto]")
@click.option("--quick", is_flag=True, help="The CI profile: 1 and 1,000 services, 1 s runs.")
@click.option("--lab", "lab_name", help="Reuse this lab (built from the bench topology) instead of building one.")
@click.option("--topology", "topology_path", type=click.Path(exists=True, dir_okay=False),
              help="Another topology with the bench's pods, clients and ports (see ebpf_proxy/bench/topology.yaml).")
@click.option("--compare", "compare_paths", nargs=2, type=click.Path(exists=True, dir_okay=False),
              metavar="OLD NEW", help="Print NEW/OLD ratios of two results.json files, and run nothing.")
@click.option("--report-from", type=click.Path(exists=True, dir_okay=False),
              help="Rebuild report.md and the plots from a results.json (into --out, default its directory).")
def bench(modes, services, endpoints_per_service, duration, warmup, repeats, concurrency, client_threads, update_changes,
          burst_changes, xdp_duration, bpf_host_routing, out_dir, quick, lab_name, topology_path, compare_paths,
          report_from) -> None:
    """Measure each mode's data path and control plane in one run, side by side.

    Data path: new TCP connections/s and latency through a ClusterIP (from a pod), a NodePort with
    externalTrafficPolicy Cluster and Local (from outside), and straight to the pod IPs; UDP
    request rate through a ClusterIP. XDP: packets/s an eTP=Local NodePort's node drops under a SYN
    flood, per drop point (XDP native, generic, TC, netfilter). Control plane: full sync, single endpoint change to kernel,
    a 1,000-change burst, agent CPU and RSS. Kernel state size per number of Services. Writes
    results.json, report.md and PNG plots.
    """
    if compare_paths:
        _print_compare(*compare_paths)
        return
    from ebpf_proxy.bench import ports
    from ebpf_proxy.bench.report import write_report
    from ebpf_proxy.bench.results import check, load
    from ebpf_proxy.bench.runner import BenchConfig, default_out_dir, run_bench

    if report_from:
        doc = load(report_from)
        target = out_dir or Path(report_from).parent
        click.echo(f"wrote {write_report(doc, target)}")
        return
    mode_list = _modes_as_root(modes, ports.MODES, "bench")
    config = BenchConfig(
        modes=mode_list,
        services=_int_list(_pick("services", services, quick), "--services"),
        out_dir=out_dir or default_out_dir(),
        endpoints_per_service=endpoints_per_service,
        duration=_seconds(_pick("duration", duration, quick), "--duration"),
        warmup=_seconds(_pick("warmup", warmup, quick), "--warmup", allow_zero=True),
        repeats=_pick("repeats", repeats, quick),
        concurrency=concurrency,
        client_threads=client_threads,
        update_changes=_pick("update_changes", update_changes, quick),
        burst_changes=_pick("burst_changes", burst_changes, quick),
        xdp_seconds=_seconds(_pick("xdp_duration", xdp_duration, quick), "--xdp-duration", allow_zero=True),
        lab_name=lab_name,
        topology_path=topology_path,
        quick=quick,
        bpf_host_routing=bpf_host_routing,
    )
    doc, report_path = run_bench(config, sys.argv[1:])
    click.echo(f"results: {config.out_dir / 'results.json'}\nreport:  {report_path}")
    if doc.get("failures"):
        raise click.ClickException(f"{len(doc['failures'])} measurement(s) failed: see the report's Failed section")
    problems = check(doc)
    if problems:
        raise click.ClickException("the results failed their sanity check:\n  " + "\n  ".join(problems))


SOAK_EPILOG = """\b
Examples:
  ebpf-proxy soak --minutes 30                           # what `make soak` runs
  ebpf-proxy soak --minutes 10 --modes ebpf --json soak.json
"""


@click.command(epilog=SOAK_EPILOG)
@click.option("--minutes", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Minutes of churn per mode.")
@click.option("--modes", default="iptables,ebpf", show_default=True, help="Comma-separated proxy modes, run in turn.")
@click.option("--writers", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Threads writing to the API server.")
@click.option("--max-rate", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Cap on API changes per second over all writers; 0: as fast as the API server takes them.")
@click.option("--services", "live", type=click.IntRange(1, 10000), default=100, show_default=True,
              help="Churned Services existing at most at once (spread over the writers).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write every figure (and the parameters) to this file.")
def soak(minutes, modes, writers, max_rate, live, json_path) -> None:
    """Churn Services and endpoints for MINUTES per mode under steady traffic; check for leaks.

    Creates, scales (EndpointSlice rewrites) and deletes Services as fast as the lab's API server
    takes them, while fresh connections go to a few stable Services without pause. Prints, per
    mode: API changes and rate, stable connections ok / failed, agent RSS and datapath objects
    (iptables rules, or eBPF services, backends, slots and connections) at baseline, peak and
    after the churned objects are deleted. Exits 1 when a connection failed or anything is not
    back to its baseline (RSS: within 30 MiB).
    """
    from ebpf_proxy.bench import ports
    from ebpf_proxy.bench.soak import SoakConfig, problems, run_soak, table, write_json

    mode_list = _modes_as_root(modes, ports.PROXY_MODES, "soak")
    config = SoakConfig(modes=mode_list, duration=minutes * 60, writers=writers, max_rate=max_rate,
                        slots_per_writer=max(1, live // writers))
    results = run_soak(config, say=lambda line: click.echo(line, err=True))
    click.echo(f"ebpf-proxy {' '.join(sys.argv[1:])}\n")
    click.echo(table(results))
    if json_path:
        write_json(results, config, json_path)
    found = problems(results)
    if found:
        raise click.ClickException("the soak's claim does not hold:\n  " + "\n  ".join(found))


COMMANDS = [bench, soak]
