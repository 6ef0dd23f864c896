"""The one percentile every report of the tools uses (demo, simulator, bench, benchmarks).

Nearest-rank: the p-th percentile of n sorted samples is the sample at rank ceil(p/100 * n)
(1-based), so every reported value is one that some request really had.

The exception is `interpolated_percentile`, for the rows `profile sweep` writes: AIBrix's
benchmark computes them with NumPy's default (linear interpolation between the two nearest
ranks), and profiles built from our rows must mean what profiles built from AIBrix's do.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["interpolated_percentile", "percentile"]


def percentile(samples: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None when there is no sample."""
    if not 0.0 < p <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def interpolated_percentile(samples: Sequence[float], p: int) -> float:
    """NumPy's default percentile (linear between ranks, `statistics.quantiles` 'inclusive'),
    for integer p in 1..99; the one sample when there is one."""
    if not 1 <= p <= 99:
        raise ValueError(f"percentile must be in 1..99, got {p}")
    if not samples:
        raise ValueError("no samples")
    if len(samples) == 1:
        return float(samples[0])
    return statistics.quantiles(samples, n=100, method="inclusive")[p - 1]
