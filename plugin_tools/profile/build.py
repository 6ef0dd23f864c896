"""`profile build`: a benchmark JSONL (AIBrix's rows) into a GPU profile for an SLO.

Per cell (output x input tokens), AIBrix's rule, which this reproduces exactly:

1. Keep the request rates at which every metric passes its SLO: time metrics (E2E, TTFT, TPAT,
   TPOT) at the chosen statistic (`mean`, or `P50`/`P90`/`P99` with `--percentile`) strictly
   below the target, throughput metrics (TPUT requests/s, TT tokens/s) with a mean at or above
   it. An SLO not given still applies with its neutral target (below infinity, at or above 0),
   so a cell whose rows lack a metric, or hold NaN for it, never passes. TPAT (time per all
   tokens) is derived: E2E / (input + output tokens).
2. Of those, the highest rate whose measured TPUT is at least 0.9 x the offered rate (a rate the
   deployment keeps up with); if none keeps up, the lowest passing rate.
3. `tputs` is that rate's measured TPUT, `e2e` its mean E2E (and `ttft` its mean TTFT when a TTFT
   SLO was given). A cell with no passing rate gets `tputs` 0 and the E2E (TTFT) mean of its
   first row: it is in the profile, and it says this GPU type never meets the SLO there.

Where several rows share a cell, rate and metric (several seeds), the first in file order counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from plugin.core.profile import SLO_NAMES, GpuProfile
from plugin.errors import ConfigError

__all__ = ["BenchmarkRow", "build_profile", "load_benchmark"]

TPUT_TOLERANCE = 0.9  # a rate is kept up with when measured TPUT >= 0.9 x offered
STATISTICS = {0: "mean", 50: "P50", 90: "P90", 99: "P99"}
# Per SLO name: the metric it reads and whether it is a time (lower is better).
_SLO_METRIC = {
    "tput": ("TPUT", False),
    "tt": ("TT", False),
    "e2e": ("E2E", True),
    "ttft": ("TTFT", True),
    "tpat": ("TPAT", True),
    "tpot": ("TPOT", True),
}


@dataclass(frozen=True, slots=True)
class BenchmarkRow:
    """One line of AIBrix's benchmark JSONL: one metric of one cell at one offered rate."""

    input_tokens: int
    output_tokens: int
    request_rate: float
    metric: str  # TPUT, TT, E2E, TTFT, TPOT (TPAT is derived)
    mean: float
    p50: float = math.nan  # NaN: not reported (TPUT and TT have only a mean)
    p90: float = math.nan
    p99: float = math.nan
    seed: int = 0
    model: str = ""
    samples: int = 0
    # Keys beyond AIBrix's (its builder reads a fixed list of columns and ignores the rest):
    # the steady-state sweep's verdicts and the pooled chunk gaps (`plugin_tools.profile.steady`).
    extra: Mapping[str, Any] = field(default_factory=dict)

    def statistic(self, name: str) -> float:
        return {"mean": self.mean, "P50": self.p50, "P90": self.p90, "P99": self.p99}[name]

    def to_json(self) -> dict[str, Any]:
        """The row as AIBrix writes it (same keys, same order; no percentiles for TPUT, TT)."""
        doc: dict[str, Any] = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "request_rate": self.request_rate,
            "seed": self.seed,
            "model": self.model,
            "samples": self.samples,
            "metric": self.metric,
            "mean": self.mean,
        }
        if not math.isnan(self.p50):
            doc.update(P50=self.p50, P90=self.p90, P99=self.p99)
        doc.update(self.extra)
        return doc


_AIBRIX_KEYS = frozenset(
    [
        "input_tokens",
        "output_tokens",
        "request_rate",
        "seed",
        "model",
        "samples",
        "metric",
        "mean",
        "P50",
        "P90",
        "P99",
    ]
)


def _number(doc: Mapping[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def parse_row(doc: Any, where: str) -> BenchmarkRow:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    for key in ("input_tokens", "output_tokens"):
        if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool):
            raise ConfigError(f"{where}: {key!r} must be an integer")
    metric = doc.get("metric")
    if not isinstance(metric, str):
        raise ConfigError(f"{where}: 'metric' must be a string")
    rate = _number(doc, "request_rate", where)
    if math.isnan(rate):
        raise ConfigError(f"{where}: 'request_rate' is missing")
    return BenchmarkRow(
        input_tokens=doc["input_tokens"],
        output_tokens=doc["output_tokens"],
        request_rate=rate,
        metric=metric,
        mean=_number(doc, "mean", where),
        p50=_number(doc, "P50", where),
        p90=_number(doc, "P90", where),
        p99=_number(doc, "P99", where),
        seed=int(doc.get("seed", 0)),
        model=str(doc.get("model", "")),
        samples=int(doc.get("samples", 0)),
        extra={k: v for k, v in doc.items() if k not in _AIBRIX_KEYS},
    )


def load_benchmark(path: Path) -> list[BenchmarkRow]:
    """Rows of a benchmark JSONL; blank lines are skipped, a bad line names its number."""
    rows = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not JSON ({exc})") from exc
            rows.append(parse_row(doc, f"{path}:{n}"))
    if not rows:
        raise ConfigError(f"{path}: no benchmark rows")
    return rows


def _with_tpat(rows: Sequence[BenchmarkRow]) -> list[BenchmarkRow]:
    """The rows followed by a TPAT row per E2E row: each statistic / (input + output)."""
    derived = []
    for r in rows:
        if r.metric == "E2E":
            n = r.input_tokens + r.output_tokens
            derived.append(
                BenchmarkRow(
                    r.input_tokens,
                    r.output_tokens,
                    r.request_rate,
                    "TPAT",
                    r.mean / n,
                    r.p50 / n,
                    r.p90 / n,
                    r.p99 / n,
                    r.seed,
                    r.model,
                    r.samples,
                )
            )
    return [*rows, *derived]


def _first(rows: Iterable[BenchmarkRow], metric: str, rate: float | None = None) -> float:
    for r in rows:
        if r.metric == metric and (rate is None or r.request_rate == rate):
            return r.mean
    return 0.0


def build_profile(
    rows: Sequence[BenchmarkRow],
    deployment: str,
    *,
    slos: Mapping[str, float] | None = None,
    percentile: int = 0,
    cost: float = 1.0,
    created: float | None = None,
) -> GpuProfile:
    """The profile of `deployment` for `slos` (AIBrix's names: tput, tt, e2e, ttft, tpat, tpot)
    checked at `percentile` (0: the mean)."""
    given = dict(slos or {})
    unknown = sorted(set(given) - set(SLO_NAMES))
    if unknown:
        raise ConfigError(f"unknown SLO {', '.join(unknown)} (known: {', '.join(SLO_NAMES)})")
    if percentile not in STATISTICS:
        raise ConfigError(f"percentile must be one of 0, 50, 90, 99, got {percentile}")
    statistic = STATISTICS[percentile]
    targets = {
        name: given.get(name, math.inf if is_time else 0.0)
        for name, (_, is_time) in _SLO_METRIC.items()
    }
    all_rows = _with_tpat(rows)
    out_ticks = tuple(sorted({r.output_tokens for r in rows}))
    in_ticks = tuple(sorted({r.input_tokens for r in rows}))
    by_cell: dict[tuple[int, int], list[BenchmarkRow]] = {}
    for r in all_rows:
        by_cell.setdefault((r.output_tokens, r.input_tokens), []).append(r)
    with_ttft = "ttft" in given
    tputs, e2es, ttfts = [], [], []
    for out in out_ticks:
        tput_row, e2e_row, ttft_row = [], [], []
        for inp in in_ticks:
            cell = by_cell.get((out, inp), [])
            passing = _passing_rates(cell, targets, statistic)
            if passing:
                rate = _chosen_rate(cell, passing)
                tput_row.append(_first(cell, "TPUT", rate))
                e2e_row.append(_first(cell, "E2E", rate))
                ttft_row.append(_first(cell, "TTFT", rate))
            else:
                tput_row.append(0.0)
                e2e_row.append(_first(cell, "E2E"))
                ttft_row.append(_first(cell, "TTFT"))
        tputs.append(tuple(tput_row))
        e2es.append(tuple(e2e_row))
        ttfts.append(tuple(ttft_row))
    return GpuProfile(
        gpu=deployment,
        cost=cost,
        out_ticks=out_ticks,
        in_ticks=in_ticks,
        tputs=tuple(tputs),
        created=time.time() if created is None else created,
        e2e=tuple(e2es),
        ttft=tuple(ttfts) if with_ttft else None,
        percentile=percentile,
        slos={name: float(given[name]) for name in SLO_NAMES if name in given},
    )


def _passing_rates(
    cell: Sequence[BenchmarkRow], targets: Mapping[str, float], statistic: str
) -> set[float]:
    """Offered rates at which every metric meets its target (the neutral ones included)."""
    rates: set[float] | None = None
    for name, (metric, is_time) in _SLO_METRIC.items():
        target = targets[name]
        ok = {
            r.request_rate
            for r in cell
            if r.metric == metric
            and (r.statistic(statistic) < target if is_time else r.mean >= target)
        }
        rates = ok if rates is None else rates & ok
        if not rates:
            return set()
    return rates or set()


def _chosen_rate(cell: Sequence[BenchmarkRow], passing: set[float]) -> float:
    """The highest passing rate that is kept up with, else the lowest passing rate."""
    kept_up = {
        r.request_rate
        for r in cell
        if r.metric == "TPUT"
        and r.request_rate in passing
        and r.mean >= r.request_rate * TPUT_TOLERANCE
    }
    return max(kept_up) if kept_up else min(passing)
