"""Routing strategies, registered by name so new ones plug in without touching the server.

A strategy sees only `Candidate`s (what a gateway observes: its in-flight counts, engine metrics,
learned capacity) and a seeded `random.Random`; it returns one of the candidates.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from plugin.core.types import Candidate, RequestInfo
from plugin.errors import RoutingFailed

__all__ = [
    "LoadBalance",
    "Strategy",
    "StrategyParams",
    "build_strategies",
    "kv_free",
    "load_balance_scores",
    "register_strategy",
    "strategy_names",
    "with_room",
]


@dataclass(frozen=True, slots=True)
class StrategyParams:
    """Knobs of the load-balance score (AIBrix's variables, same defaults)."""

    queued_weight: float = 0.0  # lambda
    kv_pressure_alpha: float = 2.0  # alpha
    kv_critical_free: float = 0.10
    # Pass over replicas whose engine batch is full (in flight >= the running count at which
    # the engine was seen queueing) while another has room. False is the reference algorithm.
    avoid_full_batches: bool = True


class Strategy(Protocol):
    @property
    def name(self) -> str: ...

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate: ...


StrategyFactory = Callable[[StrategyParams], Strategy]
_REGISTRY: dict[str, StrategyFactory] = {}


def register_strategy(name: str) -> Callable[[StrategyFactory], StrategyFactory]:
    def deco(factory: StrategyFactory) -> StrategyFactory:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def strategy_names() -> frozenset[str]:
    return frozenset(_REGISTRY)


def build_strategies(params: StrategyParams) -> dict[str, Strategy]:
    return {name: factory(params) for name, factory in _REGISTRY.items()}


def _require(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise RoutingFailed("no candidate pods")


def _random_min(
    candidates: Sequence[Candidate], keys: Sequence[tuple[float, ...]], rng: random.Random
) -> Candidate:
    best = min(keys)
    tied = [c for c, k in zip(candidates, keys, strict=True) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@register_strategy("random")
@dataclass(frozen=True, slots=True)
class RandomPick:
    params: StrategyParams
    name: str = "random"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        _require(candidates)
        return rng.choice(candidates)


@register_strategy("least-request")
@dataclass(frozen=True, slots=True)
class LeastRequest:
    """Fewest requests in flight (as the gateway counts them); ties at random."""

    params: StrategyParams
    name: str = "least-request"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        _require(candidates)
        return _random_min(candidates, [(float(c.running),) for c in candidates], rng)


@register_strategy("round-robin")
class RoundRobin:
    """Candidates in turn, blind to load (Envoy's default policy): a baseline to compare with."""

    __slots__ = ("_next", "params")
    name = "round-robin"

    def __init__(self, params: StrategyParams) -> None:
        self.params = params
        self._next: dict[str, int] = {}  # per model: models must not share one turn

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        _require(candidates)
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        return candidates[turn % len(candidates)]


@register_strategy("power-of-two")
@dataclass(frozen=True, slots=True)
class PowerOfTwo:
    """Two candidates at random, the one with fewer in flight (Envoy's LEAST_REQUEST default)."""

    params: StrategyParams
    name: str = "power-of-two"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        _require(candidates)
        if len(candidates) <= 2:
            pair: Sequence[Candidate] = candidates
        else:
            pair = rng.sample(candidates, 2)
        return _random_min(pair, [(float(c.running),) for c in pair], rng)


def kv_free(kv_usage: float | None) -> float:
    """1 - KV usage clamped to [0, 1]; a missing or NaN metric counts as fully free."""
    if kv_usage is None or math.isnan(kv_usage):
        return 1.0
    return 1.0 - min(1.0, max(0.0, kv_usage))


def _valid_capacity(capacity: float | None) -> bool:
    return capacity is not None and capacity > 0 and math.isfinite(capacity)


def load_balance_scores(candidates: Sequence[Candidate], params: StrategyParams) -> list[float]:
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


@register_strategy("load-balance")
@dataclass(frozen=True, slots=True)
class LoadBalance:
    """Capacity-aware: lowest score wins; ties by least KV usage, then at random.

    When every replica is below the KV guardrail the request still routes, to the one with the
    most KV headroom.
    """

    params: StrategyParams
    name: str = "load-balance"

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        _require(candidates)
        if self.params.avoid_full_batches:
            candidates = with_room(candidates, self.params.kv_critical_free)
        scores = load_balance_scores(candidates, self.params)
        frees = [kv_free(c.kv_usage) for c in candidates]
        if all(math.isinf(s) for s in scores):
            return _random_min(candidates, [(-f,) for f in frees], rng)
        return _random_min(candidates, [(s, -f) for s, f in zip(scores, frees, strict=True)], rng)
