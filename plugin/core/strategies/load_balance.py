"""`load-balance`: the capacity-aware score (AIBrix's algorithm, plus the full-batch rule).

score = (running + lambda * queued) / capacity * (1 + alpha * (1 - kvFree)^2), lowest wins; the
exact rules are in the `docs/routing.md` and `docs/architecture.md`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from plugin.core.config_profile import ConfigProfile, overridden
from plugin.core.strategies.base import Picker, register_strategy, require_candidates
from plugin.core.strategies.simple import random_min
from plugin.core.types import Candidate, RequestInfo
from plugin.core.view import CandidateView, usable_capacity

__all__ = [
    "LoadBalance",
    "LoadBalanceSettings",
    "has_room",
    "kv_free",
    "load_balance_scores",
    "score",
    "with_room",
]


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


def tie_usage(candidate: Candidate) -> float:
    """The tie-break among equal scores, lower first: GPU + CPU KV usage (AIBrix's rule; the
    CPU part only where the engine exports it). A missing or NaN value counts as unused."""
    cpu = candidate.cpu_kv_usage
    cpu_used = 0.0 if cpu is None or math.isnan(cpu) else min(1.0, max(0.0, cpu))
    return 1.0 - kv_free(candidate.kv_usage) + cpu_used


def score(candidate: Candidate, params: LoadBalanceSettings, default_capacity: float) -> float:
    """One candidate's score; `default_capacity` stands in for a missing estimate."""
    free = kv_free(candidate.kv_usage)
    if free < params.kv_critical_free:
        return math.inf
    if candidate.running == 0:
        return 0.0
    load = float(candidate.running)
    waiting = candidate.waiting
    if params.queued_weight > 0 and waiting is not None and not math.isnan(waiting):
        load += params.queued_weight * max(0.0, waiting)
    capacity = candidate.capacity
    if capacity is None or not usable_capacity(capacity):
        capacity = default_capacity
    pressure = 1.0 - free
    return load / capacity * (1.0 + params.kv_pressure_alpha * pressure * pressure)


def load_balance_scores(
    candidates: Sequence[Candidate], params: LoadBalanceSettings
) -> list[float]:
    """score = (running + lambda * queued) / capacity * (1 + alpha * (1 - kvFree)^2).

    +Inf below the KV guardrail; 0 when idle. The pool gives a replica that has not learned its
    capacity where it starts (`plugin.core.fair_start`); a candidate still without one (built
    elsewhere) gets the mean of the estimates that exist, and with none at all every replica
    gets the same capacity.
    """
    known = [
        c.capacity for c in candidates if c.capacity is not None and usable_capacity(c.capacity)
    ]
    default_capacity = sum(known) / len(known) if known else 1.0
    return [score(c, params, default_capacity) for c in candidates]


def has_room(candidate: Candidate) -> bool:
    """Below the in-flight count at which its engine's batch is full (`Candidate.saturation`;
    unknown: room)."""
    cap = candidate.saturation
    return cap is None or candidate.running < cap


def with_room(
    candidates: Sequence[Candidate], kv_critical_free: float = 0.0
) -> Sequence[Candidate]:
    """Candidates whose engine batch has room for one more, or all of them if none has (or if
    every one with room is below the KV guardrail: the guardrail decides first).

    A request sent to a replica at its batch cap waits in the engine queue, however fast the
    replica is: the time per token the score balances hides that wait, which lands on TTFT.
    """
    room = [c for c in candidates if has_room(c)]
    if not room or all(kv_free(c.kv_usage) < kv_critical_free for c in room):
        return candidates
    return room


@dataclass(frozen=True, slots=True, eq=False)
class _ByScore:
    """Index key for `load-balance`: (below the KV guardrail, score, GPU + CPU KV usage),
    lowest first.

    Its smallest keys are exactly the candidates the pass over all of them picks among: the
    guardrail flag only sorts the +Inf scores of replicas below the guardrail after the +Inf
    of overflowing ones, which the pass ranks the same way by KV usage.
    """

    params: LoadBalanceSettings
    room_only: bool  # only replicas whose batch has room (the full-batch rule)

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        free = kv_free(candidate.kv_usage)
        guard = 1.0 if free < self.params.kv_critical_free else 0.0
        return (guard, score(candidate, self.params, 1.0), tie_usage(candidate))

    def member(self, candidate: Candidate) -> bool:
        return not self.room_only or has_room(candidate)


@register_strategy("load-balance", LoadBalanceSettings)
@dataclass(frozen=True, slots=True)
class LoadBalance(Picker):
    """Capacity-aware: lowest score wins; ties by least KV usage, then at random.

    When every replica is below the KV guardrail the request still routes, to the one with the
    most KV headroom. On a `CandidateView` the pick comes from sorted indexes the view keeps
    current (O(log n)); the pass over a plain list is the rule they reproduce, and the path
    used while the pool mixes replicas with and without a capacity estimate (the stand-in
    capacity is then the mean over whichever subset is scored).
    """

    params: LoadBalanceSettings
    name: str = "load-balance"
    _room: _ByScore = field(init=False, repr=False, compare=False)
    _all: _ByScore = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_room", _ByScore(self.params, room_only=True))
        object.__setattr__(self, "_all", _ByScore(self.params, room_only=False))

    higher_is_better = False  # as a blend member: the lowest score is the best

    def for_profile(self, profile: ConfigProfile) -> LoadBalance:
        """A model config profile's `routingConfig.loadBalance` fields over this gateway's."""
        if not profile.load_balance:
            return self
        return LoadBalance(overridden(self.params, profile.load_balance))

    def scores(self, candidates: Sequence[Candidate], request: RequestInfo) -> list[float]:
        """The score of each candidate; with the full-batch rule on, a replica at its batch cap
        scores +Inf while another has room (in a blend: the strongest penalty)."""
        scores = load_balance_scores(candidates, self.params)
        if self.params.avoid_full_batches:
            room = with_room(candidates, self.params.kv_critical_free)
            if len(room) < len(candidates):
                keep = {id(c) for c in room}
                scores = [
                    s if id(c) in keep else math.inf
                    for c, s in zip(candidates, scores, strict=True)
                ]
        return scores

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        if isinstance(candidates, CandidateView) and candidates.known_capacities in (
            0,
            len(candidates),
        ):
            return self._pick_indexed(candidates, rng)
        if self.params.avoid_full_batches:
            candidates = with_room(candidates, self.params.kv_critical_free)
        scores = load_balance_scores(candidates, self.params)
        usage = [tie_usage(c) for c in candidates]
        if all(math.isinf(s) for s in scores):
            return random_min(candidates, [(u,) for u in usage], rng)
        return random_min(candidates, [(s, u) for s, u in zip(scores, usage, strict=True)], rng)

    def _pick_indexed(self, view: CandidateView, rng: random.Random) -> Candidate:
        if self.params.avoid_full_batches:
            room = view.sorted_by(self._room)
            best = room.min_key()
            if best is not None and best[0] == 0.0:  # some replica with room is above the guardrail
                return room.pick_min(rng)
        return view.sorted_by(self._all).pick_min(rng)
