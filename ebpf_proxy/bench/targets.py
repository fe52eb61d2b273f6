"""The speed and memory targets a bench run is held to, judged from its results alone.

The targets (README, Benchmarks) are ratios between modes measured side by side in one run, and
figures at given sizes. Every report says, for each one, what that run measured and whether it
meets the target, or that the run did not measure it (a size, a mode or an endpoint count it did
not run), so a target that is not met shows with its figure instead of being left out. A verdict
is a reading of the figures, never a timed assertion: the bench reports; it does not fail
because the machine was slow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ebpf_proxy.bench import ports
from ebpf_proxy.bench.results import BPF_COST_PATHS, summary_index

RATIO_SERVICES = 10_000  # the size the connection-rate ratios are asked at
FLAT_SIZES = (1, 10_000, 100_000)  # the sizes the BPF cost per packet must be flat across
FLAT_SPREAD = 0.10  # flat: (max - min) / min over FLAT_SIZES
BIG = 100_000  # the control-plane targets at this size ask for 10 endpoints per Service
BIG_ENDPOINTS = 10


@dataclass(frozen=True)
class Verdict:
    target: str  # what is asked, in words
    figure: str  # what this run measured, or why it measured nothing
    met: bool | None  # None: not measured in this run


def _ratio(idx: dict, num: str, den: str, limit: float) -> Verdict:
    target = f"{num} ÷ {den}, new connections/s through a ClusterIP at {RATIO_SERVICES:,} Services ≥ {limit:.1f}"
    a = idx.get(("conn_rate", "clusterip", num, RATIO_SERVICES))
    # direct has no ClusterIP: its baseline is the pod IPs (bench/traffic.py)
    b = idx.get(("conn_rate", ports.DIRECT if den == "direct" else "clusterip", den, RATIO_SERVICES))
    if not a or not b or not b["value"]:
        return Verdict(target, f"not measured: this run has no {num} and {den} rates at that size", None)
    ratio = a["value"] / b["value"]
    return Verdict(target, f"{ratio:.2f}× ({a['value']:,.0f} against {b['value']:,.0f}/s)", ratio >= limit)


def _endpoints_short(size: int, endpoints: int | None) -> str | None:
    """Why a figure at `size` does not answer its target, if it does not: 100,000 Services are
    asked with 10 endpoints each."""
    if size == BIG and endpoints is not None and endpoints < BIG_ENDPOINTS:
        return f"not measured: this run had {endpoints} endpoints per Service, the target asks {BIG_ENDPOINTS}"
    return None


def _below(idx: dict, metric: str, mode: str, size: int, limit: float, unit: str, what: str,
           endpoints: int | None, key: str = "value") -> Verdict:
    services = f"{size:,} Service{'' if size == 1 else 's'}{f' × {BIG_ENDPOINTS} endpoints' if size == BIG else ''}"
    target = f"{mode} {what} at {services} < {limit:g} {unit}"
    row = idx.get((metric, None, mode, size))
    if row is None or row.get(key) is None:
        return Verdict(target, "not measured: this run has no such row", None)
    short = _endpoints_short(size, endpoints)
    if short:
        return Verdict(target, short, None)
    return Verdict(target, f"{row[key]:,.4g} {unit}", row[key] < limit)


def _flat(idx: dict, path: str) -> Verdict:
    target = (f"ebpf tc_ingress ns per packet ({path}) flat across {', '.join(f'{n:,}' for n in FLAT_SIZES)} "
              f"Services: within {FLAT_SPREAD:.0%}")
    values = {n: idx[("bpf_ns_per_packet", path, "ebpf", n)]["value"] for n in FLAT_SIZES
              if ("bpf_ns_per_packet", path, "ebpf", n) in idx}
    if len(values) < 2:
        return Verdict(target, "not measured: this run has it at fewer than two of those sizes", None)
    low, high = min(values.values()), max(values.values())
    spread = (high - low) / low if low else float("inf")
    figure = ", ".join(f"{v:,.0f} ns at {n:,}" for n, v in values.items()) + f": {spread:.0%} apart"
    if len(values) < len(FLAT_SIZES):
        figure += f" (not at {', '.join(f'{n:,}' for n in FLAT_SIZES if n not in values)})"
    return Verdict(target, figure, spread <= FLAT_SPREAD)


def evaluate(summary: Iterable[dict], endpoints_per_service: int | None = None) -> list[Verdict]:
    """Every target against a run's summary rows (results.json `summary`); `endpoints_per_service`
    from its parameters (the 100,000-Service targets ask for 10)."""
    idx = summary_index(summary)
    out = [_ratio(idx, "ebpf", "direct", 1.0), _ratio(idx, "ebpf", "iptables", 1.3)]
    out += [_flat(idx, path) for path in BPF_COST_PATHS]
    for size, limit in ((RATIO_SERVICES, 2.0), (BIG, 10.0)):
        for mode in ("iptables", "ebpf"):
            out.append(_below(idx, "full_sync", mode, size, limit, "s", "full sync (agent start → kernel complete)",
                              endpoints_per_service))
    for size, limit in ((1, 60.0), (RATIO_SERVICES, 150.0), (BIG, 300.0)):
        for mode in ("iptables", "ebpf"):
            out.append(_below(idx, "rss", mode, size, limit, "MiB", "agent peak RSS", endpoints_per_service))
    out.append(_below(idx, "update_latency", "ebpf", BIG, 20.0, "ms", "one endpoint change → kernel, p99",
                      endpoints_per_service, key="p99"))
    return out
