"""Statistics and the before/after table for the demo load runs.

Pure on purpose: no I/O and no clock, so the numbers printed by `hetero-gateway up --demo` can be
checked by table-driven tests on hand-built results.

Percentiles are **nearest-rank**: the p-th percentile of n sorted samples is the sample at rank
ceil(p/100 * n) (1-based). Every reported value is then a latency that some request really had.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plugin_tools.stats import percentile

__all__ = [
    "LATE_SEND_S",
    "REPLICA_KEYS",
    "RequestResult",
    "demo_json",
    "format_table",
    "summarize",
]

# A request dispatched this much after its scheduled arrival counts as "late" in the fleet summary
# (client event-loop lag or the in-flight cap): the offered load was then not quite what was asked.
LATE_SEND_S = 0.050

# The per-replica keys `demo_json` emits, exactly.
REPLICA_KEYS: tuple[str, ...] = (
    "requests",
    "request_share",
    "capacity_share",
    "output_tokens_per_s",
    "utilization",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "p50_ms",
    "p99_ms",
)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one demo request did, as seen by the client.

    `started_at` is the request's *scheduled* arrival (seconds on the run's clock); `ttft_s` and
    `latency_s` are durations measured from it, so time a request spent waiting in the client
    (in-flight cap, event-loop lag) counts against latency, as it would for a real caller.
    `send_lag_s` is how long after its schedule the request actually left the client.
    """

    replica: str | None
    status: int
    started_at: float
    ttft_s: float | None
    latency_s: float | None
    output_tokens: int
    error: str | None = None
    send_lag_s: float = 0.0

    @property
    def ok(self) -> bool:
        """A success is a 200 with no client-side error (a stream cut mid-way is not a success)."""
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; undefined below two tokens."""
        if self.output_tokens < 2 or self.latency_s is None or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def _latency_stats(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """TPOT, latency and TTFT percentiles over the successful requests only."""
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "tpot_p50_ms": _ms(percentile(tpots, 50)),
        "tpot_p99_ms": _ms(percentile(tpots, 99)),
        "latency_p50_ms": _ms(percentile(latencies, 50)),
        "latency_p99_ms": _ms(percentile(latencies, 99)),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
    }


def summarize(
    results: Iterable[RequestResult],
    *,
    saturated_tokens_per_s: Mapping[str, float],
    window: tuple[float, float],
) -> dict[str, Any]:
    """Fleet and per-replica figures for the requests that *started* inside [start, end).

    Filtering on the start time keeps warm-up and drain out of the numbers without cutting a
    request in half. Token rates count the output tokens of successful requests in the window
    divided by the window length. `request_share` is a replica's share of the requests that
    reached a replica (those with a `target-pod`), so the shares compare with `capacity_share`.
    Every replica of `saturated_tokens_per_s` appears (zeros and None when it got nothing); a
    replica seen in the results but missing from it is listed too, with capacity share 0.
    """
    start, end = window
    length = end - start
    if not (math.isfinite(length) and length > 0):
        raise ValueError(f"window must be a non-empty finite interval, got {window}")
    for name, rate in saturated_tokens_per_s.items():
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"saturated rate of {name!r} must be finite and >= 0, got {rate}")

    inside = [r for r in results if start <= r.started_at < end]
    by_replica: dict[str, list[RequestResult]] = {name: [] for name in saturated_tokens_per_s}
    for r in inside:
        if r.replica is not None:
            by_replica.setdefault(r.replica, []).append(r)
    # Stable order: configured replicas first, then unexpected ones alphabetically.
    extra = sorted(set(by_replica) - set(saturated_tokens_per_s))
    names = [*saturated_tokens_per_s, *extra]

    routed = sum(len(v) for v in by_replica.values())
    total_capacity = sum(saturated_tokens_per_s.values())
    replicas: dict[str, dict[str, Any]] = {}
    for name in names:
        rs = by_replica[name]
        saturated = saturated_tokens_per_s.get(name, 0.0)
        tokens_per_s = sum(r.output_tokens for r in rs if r.ok) / length
        stats = _latency_stats(rs)
        replicas[name] = {
            "requests": len(rs),
            "errors": sum(1 for r in rs if not r.ok),
            "request_share": len(rs) / routed if routed else 0.0,
            "capacity_share": saturated / total_capacity if total_capacity > 0 else None,
            "output_tokens_per_s": tokens_per_s,
            "utilization": tokens_per_s / saturated if saturated > 0 else None,
            "tpot_p50_ms": stats["tpot_p50_ms"],
            "tpot_p99_ms": stats["tpot_p99_ms"],
            "p50_ms": stats["latency_p50_ms"],
            "p99_ms": stats["latency_p99_ms"],
        }

    fleet_tokens_per_s = sum(r.output_tokens for r in inside if r.ok) / length
    lags = [r.send_lag_s for r in inside]
    fleet: dict[str, Any] = {
        "requests": len(inside),
        "errors": sum(1 for r in inside if not r.ok),
        **_latency_stats(inside),
        "output_tokens_per_s": fleet_tokens_per_s,
        "utilization": fleet_tokens_per_s / total_capacity if total_capacity > 0 else None,
        "late_requests": sum(1 for lag in lags if lag > LATE_SEND_S),
        "send_lag_p99_ms": _ms(percentile(lags, 99)),
        "window_s": [start, end],
    }
    return {"fleet": fleet, "replicas": replicas}


# ---------------------------------------------------------------------------------------------
# Rendering


def _fmt_int(value: Any) -> str:
    return "-" if value is None else str(int(value))


def _fmt_pct(value: Any) -> str:
    return "-" if value is None else f"{100.0 * float(value):.1f}%"


def _fmt_num(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f}"


# (header, key in a replica/fleet dict, formatter); the first column is the row label.
_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("reqs", "requests", _fmt_int),
    ("err", "errors", _fmt_int),
    ("share", "request_share", _fmt_pct),
    ("cap share", "capacity_share", _fmt_pct),
    ("out tok/s", "output_tokens_per_s", _fmt_num),
    ("util", "utilization", _fmt_pct),
    ("TPOT p50", "tpot_p50_ms", _fmt_num),
    ("TPOT p99", "tpot_p99_ms", _fmt_num),
    ("lat p50", "p50_ms", _fmt_num),
    ("lat p99", "p99_ms", _fmt_num),
)


def _align(rows: list[list[str]]) -> list[str]:
    """Left-align the first column, right-align the numbers."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _fleet_row(fleet: Mapping[str, Any]) -> dict[str, Any]:
    """The fleet line in the replica columns' vocabulary."""
    return {
        "requests": fleet.get("requests"),
        "errors": fleet.get("errors"),
        "request_share": None,
        "capacity_share": None,
        "output_tokens_per_s": fleet.get("output_tokens_per_s"),
        "utilization": fleet.get("utilization"),
        "tpot_p50_ms": fleet.get("tpot_p50_ms"),
        "tpot_p99_ms": fleet.get("tpot_p99_ms"),
        "p50_ms": fleet.get("latency_p50_ms"),
        "p99_ms": fleet.get("latency_p99_ms"),
    }


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Monospace before/after table: one block per strategy, then a fleet comparison.

    Times are milliseconds; "-" marks a figure with no sample. Replica rows are errors-inclusive
    in `reqs`/`err`; rates and percentiles count successful requests only.
    """
    blocks: list[str] = []
    for strategy, summary in summaries.items():
        fleet = summary["fleet"]
        rows = [["replica", *(h for h, _, _ in _COLUMNS)]]
        for name, rep in summary["replicas"].items():
            rows.append([name, *(fmt(rep.get(key)) for _, key, fmt in _COLUMNS)])
        rows.append(["fleet", *(fmt(_fleet_row(fleet).get(key)) for _, key, fmt in _COLUMNS)])
        lines = _align(rows)
        lines.insert(1, "-" * max(len(line) for line in lines))
        title = f"strategy: {strategy}"
        window = fleet.get("window_s")
        if window:
            title += f"  (requests started in [{window[0]:g}, {window[1]:g}) s)"
        lines.insert(0, title)
        late = fleet.get("late_requests")
        if late:
            lag = _fmt_num(fleet.get("send_lag_p99_ms"))
            lines.append(f"note: {late} request(s) left the client late (p99 send lag {lag} ms)")
        blocks.append("\n".join(lines))

    if len(summaries) > 1:
        rows = [
            ["fleet by strategy", "reqs", "err", "out tok/s", "TPOT p50", "TPOT p99", "lat p99"],
        ]
        for strategy, summary in summaries.items():
            fleet = summary["fleet"]
            rows.append(
                [
                    strategy,
                    _fmt_int(fleet.get("requests")),
                    _fmt_int(fleet.get("errors")),
                    _fmt_num(fleet.get("output_tokens_per_s")),
                    _fmt_num(fleet.get("tpot_p50_ms")),
                    _fmt_num(fleet.get("tpot_p99_ms")),
                    _fmt_num(fleet.get("latency_p99_ms")),
                ]
            )
        lines = _align(rows)
        lines.insert(1, "-" * max(len(line) for line in lines))
        blocks.append("\n".join(lines))
    blocks.append("times in ms; percentiles are nearest-rank over successful requests")
    return "\n\n".join(blocks) + "\n"


def demo_json(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The machine-readable demo result: all fleet keys, exactly `REPLICA_KEYS` per replica."""
    return {
        "strategies": {
            strategy: {
                "fleet": dict(summary["fleet"]),
                "replicas": {
                    name: {key: rep[key] for key in REPLICA_KEYS}
                    for name, rep in summary["replicas"].items()
                },
            }
            for strategy, summary in summaries.items()
        }
    }
