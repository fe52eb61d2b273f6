"""The statistics every figure of the bench uses, defined once.

Percentiles are nearest-rank (the smallest sample with at least p% of the samples at or below it),
the same definition the C load generator uses, so a p99 means the same thing wherever it comes
from. Spread is the relative range of the repeats, (max - min) / median: it says at a glance
whether a difference between two modes is larger than the noise between two runs of one.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(samples: Iterable[float], p: float) -> float:
    """Nearest-rank percentile, 0 < p <= 100; ValueError on no samples."""
    data = sorted(samples)
    if not data:
        raise ValueError("percentile of no samples")
    if not 0 < p <= 100:
        raise ValueError(f"percentile: p must be in (0, 100], got {p}")
    rank = math.ceil(p / 100.0 * len(data))
    return data[max(rank, 1) - 1]


def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count); ValueError on none."""
    data = sorted(values)
    if not data:
        raise ValueError("median of no values")
    mid = len(data) // 2
    return data[mid] if len(data) % 2 else (data[mid - 1] + data[mid]) / 2


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of the repeats; 0 for a single value; inf when the median is 0."""
    if not values:
        raise ValueError("spread of no values")
    mid = median(values)
    width = max(values) - min(values)
    if width == 0:
        return 0.0
    return width / mid if mid else math.inf


def is_figure(value: object) -> bool:
    """A usable measured number: finite and > 0 (a zero or NaN figure means a broken measurement)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
