"""What `hetero-gateway top` shows, from a plugin's `/debug/pods` and `/metrics`: pure functions
over what those pages said, no I/O.

Per pod: its GPU type, state, share of the requests routed in the window against its share of
the learned capacity, in flight (this gateway and the others), learned tokens/s, and TTFT and
TPOT p50/p99 over the window, from the latency histograms' bucket counts at the window's two
ends (Prometheus's `histogram_quantile` over their difference, linear within a bucket). Then
the requests held per model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Buckets", "PodRow", "Snapshot", "View", "parse_snapshot", "quantile", "view"]

TTFT = "hetero_gateway_time_to_first_token_seconds"
TPOT = "hetero_gateway_time_per_output_token_seconds"
WAITING = "hetero_gateway_waiting_requests"

# Per pod: (upper bound, cumulative count) in order, +Inf last.
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One reading of a plugin: when, its pods (from /debug/pods) and its histograms."""

    at: float
    pods: Mapping[str, Mapping[str, Any]]
    ttft: Mapping[str, Buckets] = field(default_factory=dict)  # by pod key
    tpot: Mapping[str, Buckets] = field(default_factory=dict)
    waiting: Mapping[str, float] = field(default_factory=dict)  # by model


def parse_snapshot(at: float, debug_pods: Mapping[str, Any], metrics_text: str) -> Snapshot:
    """A snapshot from the two pages' contents."""
    hist: dict[str, dict[str, list[tuple[float, float]]]] = {TTFT: {}, TPOT: {}}
    waiting: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name in hist:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
                    hist[family.name].setdefault(s.labels["pod"], []).append((le, s.value))
        elif family.name == WAITING:
            for s in family.samples:
                waiting[s.labels["model"]] = s.value

    def ordered(by_pod: dict[str, list[tuple[float, float]]]) -> dict[str, Buckets]:
        return {pod: tuple(sorted(b)) for pod, b in by_pod.items()}

    pods = dict(debug_pods.get("pods", {}))
    return Snapshot(at, pods, ordered(hist[TTFT]), ordered(hist[TPOT]), waiting)


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's `histogram_quantile` over cumulative `buckets`: the bucket the rank falls
    in, linear between its bounds (the first from 0); the last finite bound if it falls in
    +Inf; None without observations."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return le if inside <= 0 else lower + (le - lower) * (rank - below) / inside
        lower, below = le, count
    return lower


def _delta(new: Buckets | None, old: Buckets | None) -> Buckets:
    if not new:
        return ()
    if not old or len(old) != len(new) or old[-1][1] > new[-1][1]:  # new pod, or a restart
        return new
    return tuple((le, c - o) for (le, c), (_, o) in zip(new, old, strict=True))


@dataclass(frozen=True, slots=True)
class PodRow:
    key: str
    gpu: str
    state: str  # up | not ready | unreachable | unusable | ejected
    request_share: float | None  # of the requests routed in the window (None: none routed)
    capacity_share: float | None  # of the learned capacity (None: nothing learned yet)
    inflight: int  # this gateway's
    inflight_remote: int  # the other gateways'
    tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None


@dataclass(frozen=True, slots=True)
class View:
    window_s: float  # the span the shares and quantiles cover
    pods: Sequence[PodRow]
    waiting: Mapping[str, float]


def _state(pod: Mapping[str, Any]) -> str:
    if pod.get("unreachable"):
        return "unreachable"
    if pod.get("metrics_unusable"):
        return "unusable"
    if pod.get("ejected"):
        return "ejected"
    return "up" if pod.get("ready", True) else "not ready"


def view(new: Snapshot, old: Snapshot | None) -> View:
    """The rows for `new`, with shares and quantiles over the window since `old` (since the
    plugin started when `old` is None)."""
    routed = {}
    for key, pod in new.pods.items():
        before = old.pods.get(key, {}).get("routed_total", 0) if old is not None else 0
        now = pod.get("routed_total", 0)
        routed[key] = now - before if now >= before else now
    total_routed = sum(routed.values())
    capacity = {k: p.get("capacity_tokens_per_s") for k, p in new.pods.items()}
    total_capacity = sum(c for c in capacity.values() if c)
    rows = []
    for key, pod in sorted(new.pods.items()):
        ttft = _delta(new.ttft.get(key), old.ttft.get(key) if old else None)
        tpot = _delta(new.tpot.get(key), old.tpot.get(key) if old else None)
        cap = capacity[key]
        rows.append(
            PodRow(
                key=key,
                gpu=str(pod.get("gpu") or pod.get("deployment") or ""),
                state=_state(pod),
                request_share=routed[key] / total_routed if total_routed else None,
                capacity_share=cap / total_capacity if cap and total_capacity else None,
                inflight=int(pod.get("inflight", 0)),
                inflight_remote=int(pod.get("inflight_remote", 0)),
                tokens_per_s=cap,
                ttft_p50=quantile(0.5, ttft),
                ttft_p99=quantile(0.99, ttft),
                tpot_p50=quantile(0.5, tpot),
                tpot_p99=quantile(0.99, tpot),
            )
        )
    window = new.at - old.at if old is not None else math.nan
    return View(window, rows, dict(new.waiting))
