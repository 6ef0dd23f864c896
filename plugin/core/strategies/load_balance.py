"""`load-balance`: the capacity-aware score (AIBrix's algorithm, plus the full-batch rule).

score = (running + lambda * queued) / capacity * (1 + alpha * (1 - kvFree)^2), lowest wins; the
exact rules are in the README's Routing section and `docs/architecture.md`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from plugin.core.strategies.base import Picker, register_strategy, require_candidates
from plugin.core.strategies.simple import random_min
from plugin.core.types import Candidate, RequestInfo

__all__ = ["LoadBalance", "LoadBalanceSettings", "kv_free", "load_balance_scores", "with_room"]


@dataclass(frozen=True, slots=True)
class LoadBalanceSettings:
    """Knobs of the load-balance score (AIBrix's variables, same defaults)."""

    queued_weight: float = 0.0  # lambda
    kv_pressure_alpha: float = 2.0  # alpha
    kv_critical_free: float = 0.10
    # Pass over replicas whose engine batch is full (in flight >= the running count at which
    # the engine was seen queueing) while another has room. False is the reference algorithm.
    avoid_full_batches: bool = True


def kv_free(kv_usage: float | None) -> float:
    """1 - KV usage clamped to [0, 1]; a missing or NaN metric counts as fully free."""
    if kv_usage is None or math.isnan(kv_usage):
        return 1.0
    return 1.0 - min(1.0, max(0.0, kv_usage))


def _valid_capacity(capacity: float | None) -> bool:
    return capacity is not None and capacity > 0 and math.isfinite(capacity)


def load_balance_scores(
    candidates: Sequence[Candidate], params: LoadBalanceSettings
) -> list[float]:
    """score = (running + lambda * queued) / capacity * (1 + alpha * (1 - kvFree)^2).

    +Inf below the KV guardrail; 0 when idle; a replica without an estimate gets the mean of the
    estimates that exist, and with none at all every replica gets the same capacity.
    """
    known = [
        c.capacity for c in candidates if c.capacity is not None and _valid_capacity(c.capacity)
    ]
    default_capacity = sum(known) / len(known) if known else 1.0
    lam = params.queued_weight
    alpha = params.kv_pressure_alpha
    scores: list[float] = []
    for c in candidates:
        free = kv_free(c.kv_usage)
        if free < params.kv_critical_free:
            scores.append(math.inf)
            continue
        if c.running == 0:
            scores.append(0.0)
            continue
        load = float(c.running)
        if lam > 0 and c.waiting is not None and not math.isnan(c.waiting):
            load += lam * max(0.0, c.waiting)
        capacity = (
            c.capacity
            if c.capacity is not None and _valid_capacity(c.capacity)
            else (default_capacity)
        )
        pressure = 1.0 - free
        scores.append(load / capacity * (1.0 + alpha * pressure * pressure))
    return scores


def with_room(
    candidates: Sequence[Candidate], kv_critical_free: float = 0.0
) -> Sequence[Candidate]:
    """Candidates whose engine batch has room for one more, or all of them if none has (or if
    every one with room is below the KV guardrail: the guardrail decides first).

    A request sent to a replica at its batch cap waits in the engine queue, however fast the
    replica is: the time per token the score balances hides that wait, which lands on TTFT.
    """
    room = [c for c in candidates if c.saturation is None or c.running < c.saturation]
    if not room or all(kv_free(c.kv_usage) < kv_critical_free for c in room):
        return candidates
    return room


@register_strategy("load-balance", LoadBalanceSettings)
@dataclass(frozen=True, slots=True)
class LoadBalance(Picker):
    """Capacity-aware: lowest score wins; ties by least KV usage, then at random.

    When every replica is below the KV guardrail the request still routes, to the one with the
    most KV headroom.
    """

    params: LoadBalanceSettings
    name: str = "load-balance"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        if self.params.avoid_full_batches:
            candidates = with_room(candidates, self.params.kv_critical_free)
        scores = load_balance_scores(candidates, self.params)
        frees = [kv_free(c.kv_usage) for c in candidates]
        if all(math.isinf(s) for s in scores):
            return random_min(candidates, [(-f,) for f in frees], rng)
        return random_min(candidates, [(s, -f) for s, f in zip(scores, frees, strict=True)], rng)
