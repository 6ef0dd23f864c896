"""The one percentile every report of the tools uses (demo, simulator, bench, benchmarks).

Nearest-rank: the p-th percentile of n sorted samples is the sample at rank ceil(p/100 * n)
(1-based), so every reported value is one that some request really had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile"]


def percentile(samples: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None when there is no sample."""
    if not 0.0 < p <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]
