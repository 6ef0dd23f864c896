"""Load-blind and count-based strategies: the baselines `load-balance` is measured against.

None takes settings and none holds a request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from plugin.core.strategies.base import Picker, register_strategy, require_candidates
from plugin.core.types import Candidate, RequestInfo
from plugin.core.view import CandidateView

__all__ = ["LeastRequest", "PowerOfTwo", "RandomPick", "RoundRobin", "random_min"]


def random_min(
    candidates: Sequence[Candidate], keys: Sequence[tuple[float, ...]], rng: random.Random
) -> Candidate:
    """The candidate with the smallest key; ties at random."""
    best = min(keys)
    tied = [c for c, k in zip(candidates, keys, strict=True) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@register_strategy("random")
@dataclass(frozen=True, slots=True)
class RandomPick(Picker):
    name: str = "random"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        return rng.choice(candidates)


@dataclass(frozen=True, slots=True, eq=False)
class _ByRunning:
    """Index key for `least-request`: requests in flight."""

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        return (float(candidate.running),)

    def member(self, candidate: Candidate) -> bool:
        return True


_BY_RUNNING = _ByRunning()


@register_strategy("least-request")
@dataclass(frozen=True, slots=True)
class LeastRequest(Picker):
    """Fewest requests in flight (as the gateway counts them); ties at random."""

    name: str = "least-request"
    higher_is_better = False  # as a blend member: fewer in flight is better

    def scores(self, candidates: Sequence[Candidate], request: RequestInfo) -> list[float]:
        return [float(c.running) for c in candidates]

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        if isinstance(candidates, CandidateView):
            return candidates.sorted_by(_BY_RUNNING).pick_min(rng)  # O(log n), same pick
        return random_min(candidates, [(float(c.running),) for c in candidates], rng)


@register_strategy("round-robin")
class RoundRobin(Picker):
    """Candidates in turn, blind to load (Envoy's default policy): a baseline to compare with."""

    __slots__ = ("_next",)
    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # per model: models must not share one turn

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        return candidates[turn % len(candidates)]


@register_strategy("power-of-two")
@dataclass(frozen=True, slots=True)
class PowerOfTwo(Picker):
    """Two candidates at random, the one with fewer in flight (Envoy's LEAST_REQUEST default)."""

    name: str = "power-of-two"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        if len(candidates) <= 2:
            pair: Sequence[Candidate] = candidates
        else:
            pair = rng.sample(candidates, 2)
        return random_min(pair, [(float(c.running),) for c in pair], rng)
