"""Weighted blends of scoring strategies (AIBrix's `routing-strategy:
prefix-cache:5,load-balance:4`) and auto-blend (load-balance added behind the others by default).

A blend string lists `name[:weight]` members, comma separated: integer weights 0..1,000,000,
a missing weight is 1, weight 0 drops the member. Per request each member scores every
candidate (`Scorer.scores`); a member's scores are normalised over the finite ones, min-max,
to 1 for its best and 0 for its worst (all equal: 1.0; non-finite or unscored: 0, so
load-balance's +Inf KV guardrail is the strongest penalty a member can give, not an
exclusion); the weighted sum decides, highest wins, ties at random (`random_min`).

What a list resolves to (`resolve`), first rule that applies:

1. a member that is exclusive (an SLO strategy: it holds and rejects requests by its own
   rules) routes alone: the first one listed;
2. a member that cannot score (random, round-robin, power-of-two) routes alone: the first one
   listed;
3. one member: that strategy;
4. otherwise the blend.

Auto-blend (`AutoBlend`, AIBrix's `AIBRIX_ROUTING_AUTO_BLEND_*` variables): unless its
load-balance weight is 0 or less, a bare `prefix-cache` becomes `prefix-cache:5,load-balance:4`,
a bare `least-request` `least-request:1,load-balance:1`, and any other list of scoring
strategies gets `load-balance:1` added; nothing is added to a list that names load-balance
itself, and nothing to exclusive or non-scoring strategies. The client still sees the string it
sent (`Blend.name`).

A blend reads every candidate, so it costs O(pods) per request (the single strategies pick in
O(log pods) from the view's indexes; `docs/architecture.md`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plugin.core.strategies.base import Admission, Route, Scorer, Strategy, require_candidates
from plugin.core.strategies.simple import random_min
from plugin.core.strategy_list import MAX_WEIGHT, parse_blend
from plugin.core.types import Candidate, RequestInfo
from plugin.errors import UnknownStrategy

__all__ = ["MAX_WEIGHT", "AutoBlend", "Blend", "normalise", "parse_blend", "resolve"]

LOAD_BALANCE = "load-balance"


def normalise(scores: Sequence[float], higher_is_better: bool) -> list[float]:
    """Min-max over the finite scores: best 1, worst 0; all equal 1.0; non-finite 0."""
    finite = [s for s in scores if math.isfinite(s)]
    if not finite:
        return [0.0] * len(scores)
    lo, hi = min(finite), max(finite)
    if hi == lo:
        return [1.0 if math.isfinite(s) else 0.0 for s in scores]
    span = hi - lo
    if higher_is_better:
        return [(s - lo) / span if math.isfinite(s) else 0.0 for s in scores]
    return [(hi - s) / span if math.isfinite(s) else 0.0 for s in scores]


class Blend(Strategy):
    """Route to the candidate with the highest weighted sum of normalised member scores."""

    __slots__ = ("members", "name")

    def __init__(self, name: str, members: Sequence[tuple[Scorer, int]]) -> None:
        self.name = name  # what the client asked for, echoed back
        self.members = tuple(members)

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        require_candidates(candidates)
        listed = candidates if isinstance(candidates, list) else list(candidates)
        totals = [0.0] * len(listed)
        for scorer, weight in self.members:
            parts = normalise(scorer.scores(listed, request), scorer.higher_is_better)
            for i, part in enumerate(parts):
                totals[i] += weight * part
        return Route(random_min(listed, [(-t,) for t in totals], rng))

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:
        """Tell members that learn from routed requests (prefix-cache) where this one went."""
        for scorer, _ in self.members:
            scorer.routed(candidate, request)


@dataclass(frozen=True, slots=True)
class AutoBlend:
    """AIBrix's auto-blend weights (`AIBRIX_ROUTING_AUTO_BLEND_*`); a load-balance weight of 0
    or less turns auto-blend off."""

    load_balance_weight: int = 1
    least_request_weight: int = 1
    prefix_cache_weight: int = 5
    prefix_cache_load_balance_weight: int = 4

    def apply(self, members: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The members auto-blend routes with, for scoring, non-exclusive members only."""
        if self.load_balance_weight <= 0 or any(n == LOAD_BALANCE for n, _ in members):
            return members
        if members == [("prefix-cache", 1)]:
            return [
                ("prefix-cache", self.prefix_cache_weight),
                (LOAD_BALANCE, self.prefix_cache_load_balance_weight),
            ]
        if members == [("least-request", 1)]:
            return [("least-request", self.least_request_weight), (LOAD_BALANCE, 1)]
        return [*members, (LOAD_BALANCE, self.load_balance_weight)]


def _exclusive(strategy: Strategy) -> bool:
    return strategy.needs_profiles


def resolve(text: str, strategies: Mapping[str, Strategy], auto: AutoBlend | None) -> Strategy:
    """The strategy a `routing-strategy` value (or `ROUTING_ALGORITHM`) routes with (module
    doc); unknown names and malformed lists raise UnknownStrategy."""
    members = parse_blend(text)
    for name, _ in members:
        if name not in strategies:
            raise UnknownStrategy(name)
    members = [(n, w) for n, w in members if w > 0]
    if not members:
        raise UnknownStrategy(text, "every strategy in the list has weight 0")
    for name, _ in members:
        if _exclusive(strategies[name]):
            return strategies[name]
    for name, _ in members:
        if not isinstance(strategies[name], Scorer):
            return strategies[name]
    if auto is not None:
        members = auto.apply(members)
    if len(members) == 1:
        return strategies[members[0][0]]
    scorers: list[tuple[Scorer, int]] = []
    for name, weight in members:
        scorer = strategies[name]
        assert isinstance(scorer, Scorer)
        scorers.append((scorer, weight))
    return Blend(text.strip(), scorers)
