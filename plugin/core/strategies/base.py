"""The strategy seam: what a strategy sees, what it may answer, and the registry that builds it.

A strategy sees the `Candidate`s of the request's model (what this gateway observes of each
routable pod), the `RequestInfo`, a seeded `random.Random` and the clock's `now`, and answers
with an `Admission`:

- `Route(candidate)`: send the request there now (the router takes the in-flight lease);
- `Reject(error)`: answer the client with that error;
- `Wait(deadline)`: hold the request. The router asks again whenever a lease is released or the
  pool changes, and once more at `deadline`; a `Wait` whose deadline has passed rejects with
  `on_timeout`. The ext_proc stream awaits the answer without blocking anything else.

Strategies register by name with the type of their own settings; `build_strategies` hands each
the instance of that type it was given (`plugin.config` builds them from the environment), or the
type's defaults. `docs/architecture.md` says how to add one.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from plugin.core.config_profile import ConfigProfile
from plugin.core.profile import ProfiledRoute
from plugin.core.types import Candidate, RequestInfo
from plugin.errors import RequestError, RoutingFailed

__all__ = [
    "FALLBACK",
    "Admission",
    "Picker",
    "Reject",
    "Route",
    "Scorer",
    "Strategy",
    "Wait",
    "build_strategies",
    "register_strategy",
    "require_candidates",
    "settings_type",
    "strategy_names",
]


@dataclass(frozen=True, slots=True)
class Route:
    """Admit now, to this candidate. `load` is the share of the pod the request takes, for
    strategies that account for it (`Candidate.load` sums it over the pod's requests)."""

    candidate: Candidate
    load: float = 0.0
    # The share it takes once its response streams (the engine is done with its prompt); None:
    # `load` to the end.
    streaming_load: float | None = None
    # The request's end-to-end latency on this pod as its GPU profile predicts it (seconds), for
    # strategies that predict one; the gateway compares it with what the request then took.
    expected_e2e_s: float | None = None
    # Where the request sits in the pod's GPU profile (strategies that route by one): the
    # gateway checks the profile's cell against served traffic and counts sizes beyond its grid.
    profiled: ProfiledRoute | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Do not route: the client gets this error."""

    error: RequestError


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the request until woken (a lease released, the pool changed) or until `deadline`.

    `deadline` is clock time (the `now` the strategy was given). At the deadline the strategy
    is asked once more; if it answers `Wait` again with a deadline that has passed, the request
    is rejected with `on_timeout`, and with a later one it keeps waiting. So derive deadlines
    from `request.arrived_at` (or a budget the request carries), not from `now`, or the wait
    only ends when Envoy's ext_proc message timeout gives up on the stream.
    """

    deadline: float
    on_timeout: RequestError | None = None
    # Waiting requests of a model are asked again highest priority first (ties: oldest first).
    priority: float = 0.0

    def timeout_error(self) -> RequestError:
        return self.on_timeout or RoutingFailed("no replica could take the request in time")


Admission = Route | Reject | Wait


class Strategy(ABC):
    """A routing strategy: `admit` decides; the hooks below have defaults, so a strategy
    defines only the ones it uses, and the router calls them on every strategy."""

    __slots__ = ()
    name: str
    # Reads GPU profiles (`Candidate.profile`): the router predicts the request's output length
    # for it, routes a model none of whose pods has a profile with `FALLBACK`, and keeps the
    # strategy out of the imbalance gate (it keeps its own pod choice, as AIBrix's slo* do).
    needs_profiles: bool = False

    @abstractmethod
    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission: ...

    def profiled(self, candidates: Sequence[Candidate]) -> bool:
        """Whether some candidate has a GPU profile (asked of strategies that need one)."""
        return any(c.profile is not None for c in candidates)

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:  # noqa: B027
        """Told after every request routed with this strategy, alone or in a blend."""

    def forget(self, *keys: str) -> None:  # noqa: B027
        """These pods left discovery: a strategy that remembers pods forgets them, so one that
        comes back under the same name is not credited with what it lost."""

    def for_profile(self, profile: ConfigProfile) -> Strategy:
        """The strategy with a model config profile's overrides (itself if none apply)."""
        return self


# The strategy a model none of whose pods has a GPU profile routes by when the chosen one (and
# the default) needs profiles.
FALLBACK = "least-request"


@runtime_checkable
class Scorer(Protocol):
    """A strategy that can also score each candidate, so it can take part in a blend
    (`plugin.core.strategies.blend`): scores are normalised per request over the finite ones."""

    name: str
    higher_is_better: bool

    def scores(self, candidates: Sequence[Candidate], request: RequestInfo) -> list[float]:
        """One raw score per candidate, in order; a non-finite one is unscored (a blend gives it
        the worst normalised score, 0)."""
        ...

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:
        """As `Strategy.routed`: a blend tells its members where a request went."""
        ...


class Picker(Strategy):
    """A strategy that never holds a request: it only picks among the candidates."""

    __slots__ = ()

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        return Route(self.pick(candidates, request, rng))

    @abstractmethod
    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate: ...


F = TypeVar("F", bound=Callable[..., Strategy])


@dataclass(frozen=True, slots=True)
class _Entry:
    factory: Callable[..., Strategy]
    settings: type[Any] | None


_REGISTRY: dict[str, _Entry] = {}


def register_strategy(name: str, settings: type[Any] | None = None) -> Callable[[F], F]:
    """Register a factory under `name`; it is called with an instance of `settings` (if any)."""

    def deco(factory: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name} registered twice")
        _REGISTRY[name] = _Entry(factory, settings)
        return factory

    return deco


def strategy_names() -> frozenset[str]:
    return frozenset(_REGISTRY)


def settings_type(name: str) -> type[Any] | None:
    """The settings type a strategy takes (None: it has no settings)."""
    return _REGISTRY[name].settings


def build_strategies(*settings: object) -> dict[str, Strategy]:
    """Every registered strategy, each with its own settings from `settings` (else defaults).

    A settings object that no strategy takes is a programming error (ValueError).
    """
    given = {type(s): s for s in settings}
    wanted = {e.settings for e in _REGISTRY.values()}
    unused = [t.__name__ for t in given if t not in wanted]
    if unused:
        raise ValueError(f"no strategy takes settings of type {', '.join(unused)}")
    built: dict[str, Strategy] = {}
    for name, entry in _REGISTRY.items():
        if entry.settings is None:
            built[name] = entry.factory()
        else:
            built[name] = entry.factory(given.get(entry.settings) or entry.settings())
    return built


def require_candidates(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise RoutingFailed("no candidate pods")
