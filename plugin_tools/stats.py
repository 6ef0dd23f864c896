"""The one percentile every report of the tools uses (demo, simulator, bench, benchmarks).

Nearest-rank: the p-th percentile of n sorted samples is the sample at rank ceil(p/100 * n)
(1-based), so every reported value is one that some request really had.

The exception is `interpolated_percentile`, for the rows `profile sweep` writes: AIBrix's
benchmark computes them with NumPy's default (linear interpolation between the two nearest
ranks), and profiles built from our rows must mean what profiles built from AIBrix's do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["interpolated_percentile", "interpolated_percentiles", "percentile"]


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
    return interpolated_percentiles(samples, (p,))[0]


def interpolated_percentiles(samples: Sequence[float], ps: Sequence[int]) -> tuple[float, ...]:
    """`interpolated_percentile` at each of `ps`, from one sort.

    `statistics.quantiles` sorts its input on every call and computes all 99 cut points; a
    sweep's rows ask for three percentiles of the same samples, and the simulated sweep spent
    two fifths of its time in those sorts (cProfile of `simulated_profile`). The arithmetic is
    the one `statistics.quantiles(..., n=100, method="inclusive")` does, so the values are the
    same to the bit (tests/unit/test_report.py holds them equal)."""
    for p in ps:
        if not 1 <= p <= 99:
            raise ValueError(f"percentile must be in 1..99, got {p}")
    if not samples:
        raise ValueError("no samples")
    if len(samples) == 1:
        return tuple(float(samples[0]) for _ in ps)
    data = sorted(samples)
    m = len(data) - 1
    out = []
    for p in ps:
        j, delta = divmod(p * m, 100)
        out.append((data[j] * (100 - delta) + data[j + 1] * delta) / 100)
    return tuple(out)
