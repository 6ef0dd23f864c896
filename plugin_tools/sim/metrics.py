"""Figures of one simulated run: SLO attainment, goodput, latency percentiles, per-replica shares.

Utilisation of a replica is its output tokens/s over the measured window divided by its
saturated decode rate (`max_num_seqs` sequences in every step, no prefill): the fraction of the
GPU's token ceiling it delivered. `busy` is the fraction of the window it spent running steps,
which reaches 1 long before the ceiling in a continuous-batching engine.

The SLO is the core's `SloTarget`: a request meets it when it completed and its TTFT, TPOT, E2E
and TPAT (E2E over prompt + output tokens) are within every target set, times counted from its
arrival at the gateway (a wait there counts). A request the strategy rejected is a miss, and is
counted apart from those dropped (never finished, or too large for a KV cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from plugin.core.types import SloTarget
from plugin_tools.sim.fleet import RequestRecord, RunResult
from plugin_tools.stats import percentile as nearest_rank

__all__ = ["DEFAULT_SLO", "attainment", "met", "percentile", "summarize"]

DEFAULT_SLO = SloTarget(ttft_s=1.0, tpot_s=0.06)


def met(slo: SloTarget, r: RequestRecord) -> bool:
    """The request completed within every target of `slo`."""
    return r.completed and slo.met(r.ttft, r.tpot, r.e2e, r.prompt_tokens + r.output_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """The demo's nearest-rank percentile (q in 0..100), NaN instead of None for no values."""
    value = nearest_rank(values, q)
    return math.nan if value is None else value


def attainment(result: RunResult, slo: SloTarget) -> float:
    measured = [r for r in result.records if r.measured]
    if not measured:
        return math.nan
    return sum(1 for r in measured if met(slo, r)) / len(measured)


def _spread(values: Sequence[float]) -> float:
    """max / min of the finite values; inf when one is 0 (an unused replica); NaN for < 2."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return math.nan
    low = min(finite)
    return max(finite) / low if low > 0 else math.inf


def summarize(result: RunResult, slo: SloTarget) -> dict[str, Any]:
    """JSON-ready figures of the measured window (times in seconds)."""
    measured = [r for r in result.records if r.measured]
    window = result.window_s
    done = [r for r in measured if r.completed]
    good = sum(1 for r in measured if met(slo, r))
    rejected = sum(1 for r in measured if r.rejected)
    waits = [r.wait for r in measured if r.decided >= 0 and not r.rejected]
    ttfts = [r.ttft for r in done]
    tpots = [r.tpot for r in done if r.output_tokens > 1]
    replicas: dict[str, Any] = {}
    ceiling = 0.0
    delivered = 0.0
    for i, (name, profile) in enumerate(zip(result.replicas, result.profiles, strict=True)):
        mine = [r for r in done if r.replica == i]
        sat = profile.saturated_tokens_per_s()
        tokens_per_s = result.windows[i].output_tokens / window if window > 0 else math.nan
        ceiling += sat
        delivered += tokens_per_s if math.isfinite(tokens_per_s) else 0.0
        replicas[name] = {
            "gpu": profile.name,
            "share": sum(1 for r in measured if r.replica == i) / len(measured)
            if measured
            else math.nan,
            "capacity_share": math.nan,  # filled below
            "tpot_p50": percentile([r.tpot for r in mine if r.output_tokens > 1], 50),
            "tpot_p99": percentile([r.tpot for r in mine if r.output_tokens > 1], 99),
            "ttft_p99": percentile([r.ttft for r in mine], 99),
            "e2e_per_token_p99": percentile([r.e2e_per_token for r in mine], 99),
            "utilization": tokens_per_s / sat,
            "busy": result.windows[i].busy_s / window if window > 0 else math.nan,
            "output_tokens_per_s": tokens_per_s,
            "saturated_tokens_per_s": sat,
            "preemptions": result.windows[i].preemptions,
        }
    for entry in replicas.values():
        entry["capacity_share"] = entry["saturated_tokens_per_s"] / ceiling
    return {
        "requests": len(measured),
        "completed": len(done),
        "dropped": len(measured) - len(done) - rejected,
        "rejected": rejected,
        "offered_rate": len(measured) / window if window > 0 else math.nan,
        "attainment": good / len(measured) if measured else math.nan,
        "goodput": good / window if window > 0 else math.nan,
        "wait_p50": percentile(waits, 50),
        "wait_p99": percentile(waits, 99),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "e2e_per_token_p99": percentile([r.e2e_per_token for r in done], 99),
        "output_tokens_per_s": delivered,
        "token_ceiling_per_s": ceiling,
        # Over the replicas that served requests; `unused_replicas` counts the others.
        "tpot_p50_ratio": _spread([v["tpot_p50"] for v in replicas.values()]),
        "unused_replicas": sum(1 for v in replicas.values() if v["share"] == 0),
        "utilization_spread": _spread([v["utilization"] for v in replicas.values()]),
        "replicas": replicas,
    }
