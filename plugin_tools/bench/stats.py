"""The benchmark's figures from raw timings: pure, so the arithmetic is testable without Envoy.

Everything in the overhead and streaming parts is reported against the `direct` variant (Envoy
alone) of the same command: as a ratio (variant / direct) and, for times, as the added
milliseconds. Percentiles are nearest-rank (`plugin_tools.stats.percentile`), so every reported
time is one some request really had.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plugin_tools.bench.client import Batch, Timing
from plugin_tools.demo.report import REPLICA_KEYS
from plugin_tools.stats import percentile

__all__ = [
    "DIRECT",
    "CpuTotals",
    "overhead_summary",
    "ratio",
    "routing_summary",
    "streaming_summary",
]

DIRECT = "direct"


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None when either is missing or the base is not positive."""
    if value is None or base is None or not base > 0 or not math.isfinite(value):
        return None
    return value / base


def _diff(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value - base


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


@dataclass(slots=True)
class CpuTotals:
    """Throughput runs of one variant, summed over rounds; CPU seconds None if /proc is absent."""

    requests: int = 0
    ok: int = 0
    elapsed_s: float = 0.0
    plugin_cpu_s: float | None = 0.0
    envoy_cpu_s: float | None = 0.0

    def add(self, batch: Batch, plugin_cpu_s: float | None, envoy_cpu_s: float | None) -> None:
        self.requests += len(batch.timings)
        self.ok += batch.ok
        self.elapsed_s += batch.elapsed_s
        self.plugin_cpu_s = _sum(self.plugin_cpu_s, plugin_cpu_s)
        self.envoy_cpu_s = _sum(self.envoy_cpu_s, envoy_cpu_s)

    def per_request_ms(self, cpu_s: float | None) -> float | None:
        return None if cpu_s is None or self.requests == 0 else cpu_s * 1000.0 / self.requests


def _latency_figures(timings: Sequence[Timing]) -> dict[str, Any]:
    latencies = [t.latency_s for t in timings if t.ok and t.latency_s is not None]
    return {
        "latency_requests": len(timings),
        "latency_errors": sum(1 for t in timings if not t.ok),
        "latency_p50_ms": _ms(percentile(latencies, 50)),
        "latency_p99_ms": _ms(percentile(latencies, 99)),
    }


def overhead_summary(
    latency: Mapping[str, Sequence[Timing]], throughput: Mapping[str, CpuTotals]
) -> dict[str, dict[str, Any]]:
    """Per variant: latency at concurrency 1, requests/s and CPU per request at load, vs direct.

    `plugin_cpu_ratio` divides the plugin's CPU per request by what Envoy alone spends per
    request in the direct run: the plugin's cost in units of a plain proxy hop. The direct row's
    plugin CPU is the idle plugin's background work (metric scrapes), shown as measured.
    """
    rows: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys([*latency, *throughput]):  # variants in the order given
        row = _latency_figures(latency.get(name, ()))
        totals = throughput.get(name, CpuTotals())
        plugin = totals.per_request_ms(totals.plugin_cpu_s)
        envoy = totals.per_request_ms(totals.envoy_cpu_s)
        row |= {
            "throughput_requests": totals.requests,
            "throughput_errors": totals.requests - totals.ok,
            "requests_per_s": totals.ok / totals.elapsed_s if totals.elapsed_s > 0 else None,
            "plugin_cpu_ms_per_request": plugin,
            "envoy_cpu_ms_per_request": envoy,
            "gateway_cpu_ms_per_request": None
            if plugin is None or envoy is None
            else plugin + envoy,
        }
        rows[name] = row
    base = rows.get(DIRECT, {})
    for row in rows.values():
        for pct in ("p50", "p99"):
            key = f"latency_{pct}_ms"
            row[f"added_{pct}_ms"] = _diff(row[key], base.get(key))
            row[f"{pct}_ratio"] = ratio(row[key], base.get(key))
        row["rps_ratio"] = ratio(row["requests_per_s"], base.get("requests_per_s"))
        direct_envoy = base.get("envoy_cpu_ms_per_request")
        row["plugin_cpu_ratio"] = ratio(row["plugin_cpu_ms_per_request"], direct_envoy)
        row["envoy_cpu_ratio"] = ratio(row["envoy_cpu_ms_per_request"], direct_envoy)
        row["gateway_cpu_ratio"] = ratio(
            row["gateway_cpu_ms_per_request"], base.get("gateway_cpu_ms_per_request")
        )
    return rows


def _chunk_figures(timings: Sequence[Timing]) -> dict[str, Any]:
    """Median arrival of each chunk index over the responses that have the usual chunk count.

    Every request of a streaming run is identical, so chunk k of one response compares with
    chunk k of another; a response with another count (a cut stream) is left out and counted.
    """
    ok = [t.chunks for t in timings if t.ok and t.chunks]
    figures: dict[str, Any] = {
        "requests": len(timings),
        "errors": sum(1 for t in timings if not t.ok),
        "chunks_per_response": None,
        "irregular_responses": 0,
        "median_arrivals_s": [],
        "gap_p50_ms": None,
        "gap_p99_ms": None,
    }
    if not ok:
        return figures
    count = Counter(len(c) for c in ok).most_common(1)[0][0]
    same = [c for c in ok if len(c) == count]
    medians = [percentile([c[k] for c in same], 50) for k in range(count)]
    gaps = [c[k] - c[k - 1] for c in same for k in range(1, count)]
    figures |= {
        "chunks_per_response": count,
        "irregular_responses": len(ok) - len(same),
        "median_arrivals_s": medians,
        "gap_p50_ms": _ms(percentile(gaps, 50)),
        "gap_p99_ms": _ms(percentile(gaps, 99)),
    }
    return figures


def streaming_summary(
    timings: Mapping[str, Sequence[Timing]],
    *,
    request_path: str = "buffered",
    response_paths: Sequence[str] = ("observe", "streamed"),
) -> dict[str, dict[str, Any]]:
    """Per variant: how much later each SSE chunk reaches the client than through Envoy alone.

    `chunk_delay_ms` is the mean over chunk indices of (median arrival of chunk k) minus the
    direct run's; it includes the request path (the request reaches the engine later, so every
    chunk shifts). `response_path_delay_ms` subtracts the `request_path` variant's chunk delay,
    which routes the same way but does not process the response body: what streaming the response
    through the plugin adds per chunk. `chunk_arrival_ratio` is the mean chunk arrival over the
    direct run's; `gap_*_ratio` compare the intervals between consecutive chunks (jitter).
    """
    rows = {name: _chunk_figures(ts) for name, ts in timings.items()}
    base = rows.get(DIRECT, {})
    base_arrivals: list[float] = base.get("median_arrivals_s") or []
    for row in rows.values():
        arrivals: list[float] = row["median_arrivals_s"]
        comparable = bool(arrivals) and len(arrivals) == len(base_arrivals)
        if comparable:
            deltas = [a - b for a, b in zip(arrivals, base_arrivals, strict=True)]
            row["chunk_delay_ms"] = _ms(sum(deltas) / len(deltas))
            row["first_chunk_delay_ms"] = _ms(deltas[0])
            row["last_chunk_delay_ms"] = _ms(deltas[-1])
            row["chunk_arrival_ratio"] = ratio(
                sum(arrivals) / len(arrivals), sum(base_arrivals) / len(base_arrivals)
            )
        else:
            row["chunk_delay_ms"] = row["first_chunk_delay_ms"] = None
            row["last_chunk_delay_ms"] = row["chunk_arrival_ratio"] = None
        row["gap_p50_ratio"] = ratio(row["gap_p50_ms"], base.get("gap_p50_ms"))
        row["gap_p99_ratio"] = ratio(row["gap_p99_ms"], base.get("gap_p99_ms"))
    request_delay = rows.get(request_path, {}).get("chunk_delay_ms")
    for name, row in rows.items():
        row["response_path_delay_ms"] = (
            _diff(row["chunk_delay_ms"], request_delay) if name in response_paths else None
        )
        row["median_arrivals_ms"] = [a * 1000.0 for a in row.pop("median_arrivals_s")]
    return rows


def routing_summary(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The routing part's figures from `run_demo`'s summaries, one entry per strategy.

    Per replica: the demo's keys plus `token_share` (its share of the output tokens delivered,
    the share that compares with `capacity_share`, a share of output tokens/s). Per strategy:
    `share_distance`, half the sum of |token share - capacity share| (0 = shares follow capacity,
    1 = all on a replica with no capacity), and `tpot_p50_spread`, the slowest replica's p50 time
    per output token over the fastest's (1 = balanced per-token latency).
    """
    out: dict[str, Any] = {}
    for strategy, summary in summaries.items():
        replicas = summary["replicas"]
        total = sum(float(r["output_tokens_per_s"]) for r in replicas.values())
        rows: dict[str, dict[str, Any]] = {}
        for name, rep in replicas.items():
            rows[name] = {key: rep[key] for key in REPLICA_KEYS}
            rows[name]["token_share"] = (
                float(rep["output_tokens_per_s"]) / total if total > 0 else 0.0
            )
        distance = 0.5 * sum(
            abs(r["token_share"] - (r["capacity_share"] or 0.0)) for r in rows.values()
        )
        tpots = [r["tpot_p50_ms"] for r in rows.values() if r["tpot_p50_ms"] is not None]
        out[strategy] = {
            "fleet": dict(summary["fleet"]),
            "replicas": rows,
            "share_distance": distance,
            "tpot_p50_spread": max(tpots) / min(tpots) if tpots and min(tpots) > 0 else None,
        }
    return out
