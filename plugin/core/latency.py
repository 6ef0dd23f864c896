"""Latency as clients feel it, per pod: TTFT, TPOT, E2E and output tokens of each response the
gateway streamed, as Prometheus-shaped histograms read by /metrics.

Times come from the streams the plugin already reads (`ChunkGaps` in the ext_proc adapter): a
request starts when its headers reached the gateway (its routing stream's arrival; on a counting
stream whose routing ran on another replica, when the counting stream saw its headers), its
first token is its first SSE data event, and it ends when its body ends. TPOT is per request,
the mean gap after the first token: (last event - first event) / (output tokens - 1), as
`SloTarget` judges it. A response without SSE events (`"stream": false`) has an E2E and a token
count but no TTFT or TPOT.

Per pod, labelled with its model and deployment (GPU type), so a deployment's figures are a
`sum by (deployment)` away and the label set stays bounded: a pod's series go when it leaves
(`forget`). Observing costs a dict lookup and four binary searches per response, nothing per
chunk (the chunk path only keeps the first and last event's times, which it kept already).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import NamedTuple

from plugin.core.types import SloTarget

__all__ = [
    "DECISION_BUCKETS_S",
    "E2E_BUCKETS_S",
    "TOKEN_BUCKETS",
    "TPOT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "ClientLatency",
    "Felt",
    "Histogram",
    "PodLatency",
    "SloOutcomes",
]

# Milliseconds to minutes: a cached short prompt's first token to a long answer's end.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# An H100's few ms per token to an overloaded engine's quarter second and more.
TPOT_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
# The gateway's own time to route a request: tens of microseconds to a slow pass over a big pool.
DECISION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1
)  # fmt: skip
TOKEN_BUCKETS = (16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


class Histogram:
    """The core's one histogram (here and in `plugin.core.router`), read by /metrics: counts per
    bucket (not cumulative: one bisect and one increment an observation), made cumulative when
    read (`cumulative`), as Prometheus's `le` buckets are."""

    __slots__ = ("bounds", "count", "per_bucket", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.per_bucket = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.per_bucket[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def cumulative(self) -> list[int]:
        """Observations at or below each bound, in order (the +Inf bucket is `count`)."""
        out, running = [], 0
        for n in self.per_bucket[:-1]:
            running += n
            out.append(running)
        return out


class PodLatency:
    """One pod's four histograms, with the labels it is exported under."""

    __slots__ = ("deployment", "e2e", "model", "tokens", "tpot", "ttft")

    def __init__(self, model: str, deployment: str) -> None:
        self.model = model
        self.deployment = deployment
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)
        self.tokens = Histogram(TOKEN_BUCKETS)


class Felt(NamedTuple):
    """One response as its client felt it (seconds; None where it had no SSE event to time)."""

    ttft: float | None
    tpot: float | None
    e2e: float
    output_tokens: int

    def met(self, target: SloTarget, prompt_tokens: int) -> bool:
        """Whether it met every target set. A response without events got its first token
        with its end (TTFT = E2E) and has no gaps to judge (TPOT met)."""
        ttft = self.e2e if self.ttft is None else self.ttft
        tpot = 0.0 if self.tpot is None else self.tpot
        return target.met(ttft, tpot, self.e2e, prompt_tokens + self.output_tokens)


class SloOutcomes:
    """Requests with an SLO (their own `x-slo-*` headers, or routed by an SLO strategy by a GPU
    profile's), by model, deployment and outcome: `met`, `late` (served, a target missed) or
    `rejected` (deployment ""). The share of each is what an operator's SLO report needs."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}

    def count(self, model: str, deployment: str, outcome: str) -> None:
        key = (model, deployment, outcome)
        self.counts[key] = self.counts.get(key, 0) + 1


class ClientLatency:
    """Every pod's `PodLatency`, by pod key; a pod's entry is made on its first response.

    `per_pod` False keeps one entry per model and deployment instead (key `model deployment`,
    exported with an empty `pod` label): 4 histograms a GPU type rather than a pod, for fleets
    of thousands of pods. Such entries outlive the pods (`forget` is by pod key)."""

    __slots__ = ("per_pod", "pods")

    def __init__(self, per_pod: bool = True) -> None:
        self.per_pod = per_pod
        self.pods: dict[str, PodLatency] = {}

    def observe(
        self,
        key: str,
        model: str,
        deployment: str,
        started: float,
        first: float | None,
        last: float | None,
        ended: float,
        output_tokens: int,
    ) -> Felt:
        """A response of `output_tokens` ended at `ended`; `first`/`last`: its first and last
        SSE data events (None for a response without any). Times in seconds, one clock."""
        if not self.per_pod:
            key = f"{model} {deployment}"
        pod = self.pods.get(key)
        if pod is None:
            pod = self.pods[key] = PodLatency(model, deployment)
        e2e = max(0.0, ended - started)
        pod.e2e.observe(e2e)
        pod.tokens.observe(output_tokens)
        if first is None:
            return Felt(None, None, e2e, output_tokens)
        ttft = max(0.0, first - started)
        pod.ttft.observe(ttft)
        tpot = None
        if output_tokens > 1 and last is not None:
            tpot = max(0.0, last - first) / (output_tokens - 1)
            pod.tpot.observe(tpot)
        return Felt(ttft, tpot, e2e, output_tokens)

    def forget(self, keys: Iterable[str]) -> None:
        """Pods that left: their series go (a pod back under the same name starts anew)."""
        for key in keys:
            self.pods.pop(key, None)
