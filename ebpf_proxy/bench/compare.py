"""`ebpf-proxy bench --compare OLD NEW`: the ratio NEW / OLD of every figure both runs measured.

Rows are matched on (metric, path, mode, services). A ratio alone does not say whether it is good
news (a higher rate is, a higher latency is not), so each row also says "better" or "worse" —
but only when the change is larger than the noise the two runs themselves saw (the larger of
their spreads, and at least 5%); otherwise "same". Rows only one side has are listed too, so a
metric that silently disappeared from a run is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ebpf_proxy.bench.results import HIGHER_IS_BETTER, METRICS, MODES

MIN_NOISE = 0.05


@dataclass(frozen=True)
class Ratio:
    metric: str
    path: str | None
    mode: str
    services: int
    unit: str
    old: float | None
    new: float | None
    ratio: float | None
    verdict: str  # "better" | "worse" | "same" | "only old" | "only new"


def _key(row: dict) -> tuple:
    return (row["metric"], row["path"], row["mode"], row["services"])


def verdict(metric: str, old: float, new: float, noise: float) -> str:
    ratio = new / old
    if abs(ratio - 1) <= max(noise, MIN_NOISE):
        return "same"
    up_is_good = metric in HIGHER_IS_BETTER
    return "better" if (ratio > 1) == up_is_good else "worse"


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[Ratio]:
    olds = {_key(r): r for r in old["summary"]}
    news = {_key(r): r for r in new["summary"]}
    out = []

    def order(key: tuple) -> tuple:
        metric, path, mode, services = key
        return (METRICS.index(metric) if metric in METRICS else 99, services, str(path),
                MODES.index(mode) if mode in MODES else 9)

    for key in sorted(set(olds) | set(news), key=order):
        o, n = olds.get(key), news.get(key)
        unit = (o or n)["unit"]
        if o is None or n is None:
            side = "only new" if o is None else "only old"
            out.append(Ratio(*key, unit, o and o["value"], n and n["value"], None, side))
            continue
        noise = max(o.get("spread") or 0, n.get("spread") or 0)
        ratio = n["value"] / o["value"] if o["value"] else None
        out.append(Ratio(*key, unit, o["value"], n["value"], ratio,
                         verdict(key[0], o["value"], n["value"], noise) if ratio is not None else "same"))
    return out
