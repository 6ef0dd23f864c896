"""The load-imbalance gate: a hotspot safeguard ahead of a strategy, measured per unit of capacity.

AIBrix's rule (pkg/plugins/gateway/algorithms/load_balance.go: `ApplyLoadImbalanceGate`,
`getTargetPodListOnLoadImbalance`, `getRequestCounts`; applied once in
pkg/plugins/gateway/gateway.go `selectTargetPod`, ahead of whichever strategy routes the request,
except the exclusive ones, pd and slo*, which manage their own pod subsets):

- the load of a pod is its running-request count (the live count across gateways); with fewer
  than two ready pods there is no gate;
- imbalanced when `max - min >= AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP` (default 8) and, with
  three pods or more, `max > AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR * (meanOfOthers + 1)`
  (default 2.0), `meanOfOthers` being the mean count of every pod but the busiest; two pods skip
  the factor check (with factor 2 it could never hold);
- when imbalanced the ready pods are narrowed to those at the minimum count, the strategy picks
  among them, and `aibrix_load_imbalance_total{model}` counts it.

A fast replica rightly carries more requests than a slow one: load-balance sends it more because
it drains them faster. Raw counts read that as a hotspot and fence the fast replica off, sending
its traffic to the slow ones. AIBrix's own TODO on `getTargetPodListOnLoadImbalance` names the fix
this module makes: compare load per unit of capacity.

Ours (`ImbalanceSettings.capacity_aware`, the default): a pod's load is `running / capacity`
(the learned output tokens/s), times the pool's mean capacity, so it stays a number of requests
(those the pod would hold at the mean capacity) and `min_gap` keeps its unit. A pod without an
estimate counts at the mean capacity, as load-balance scores it; with no estimate anywhere every
pod counts at 1, which is AIBrix's rule. The others' level is their requests over their
capacity: `(running total - busiest's running) / (n - busiest's capacity / mean capacity)`,
AIBrix's `meanOfOthers` when capacities are equal. When imbalanced the request goes to the least
loaded pod by that measure, ties at random (the draw `random_min` makes), where AIBrix lets the
strategy choose among the tied pods.

It sends a request only to a pod whose engine batch has room (`Candidate.saturation`, the rule
load-balance applies): the gap is measured from the least loaded pod with room, and with none the
strategy decides. A fast replica at its batch cap still looks lightly loaded per unit of capacity
(its estimate lags, and the requests over its cap only queue), and without this the gate filled
its queue under overload: in the simulator (a100 + 3 x v100, 30 req/s, 0.91 of the fleet's
token ceiling) SLO attainment fell to 0.07, against 0.46 with no gate and 0.44 with this rule.
`capacity_aware=False` is AIBrix's raw-count rule exactly, batch caps ignored.

Cost on a `CandidateView`: the least loaded pod with room and the busiest pod are ends of one
grouped index (with room, at the cap; O(log n) per lease to keep, O(1) to read). The running
total and the capacity sum are the view's own, kept current as it changes (O(1) to read). A
plain list, or a view mixing pods with and without an estimate, takes the plain pass, the rule
the indexed path reproduces (`tests/unit/test_gate.py` holds them to the same answers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from plugin.core.strategies.base import Admission, Route, Strategy
from plugin.core.strategies.load_balance import has_room
from plugin.core.strategies.simple import random_min
from plugin.core.types import Candidate, RequestInfo
from plugin.core.view import CandidateView, choose_tied, tied_run, usable_capacity

__all__ = ["ImbalanceGate", "ImbalanceSettings", "Wrapped"]

# Capacity-aware loads are ratios of floats: with equal capacities they may land an ulp off the
# integer counts AIBrix compares. A load this close (relative) to a whole number of requests is
# taken as that number, so equal capacities reproduce AIBrix's arithmetic exactly, ties included
# (a slack on the comparisons instead broke ties that AIBrix's own float sums settle).
_SNAP = 1e-9


def _snap(value: float) -> float:
    """`value`, or the whole number it is within `_SNAP` of."""
    whole = float(round(value))
    return whole if abs(value - whole) <= _SNAP * max(1.0, abs(value)) else value


@dataclass(frozen=True, slots=True)
class ImbalanceSettings:
    """AIBrix's AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP and _FACTOR, same defaults; `capacity_aware`
    False is AIBrix's raw-count rule (to compare with)."""

    min_gap: float = 8
    factor: float = 2.0
    capacity_aware: bool = True

    def __post_init__(self) -> None:
        if not (self.min_gap >= 0 and math.isfinite(self.min_gap)):
            raise ValueError(f"min_gap must be a finite number >= 0, not {self.min_gap}")
        if not (self.factor >= 0 and math.isfinite(self.factor)):
            raise ValueError(f"factor must be a finite number >= 0, not {self.factor}")


# The groups of `_ByLoad`: candidates whose engine batch has room, and those at their batch cap
# (only when capacity-aware; AIBrix's rule has every candidate in the first).
_ROOM, _FULL = 0, 1


@dataclass(frozen=True, slots=True, eq=False)
class _ByLoad:
    """Candidates by running per unit of capacity (of 1 without an estimate or when not
    capacity-aware), in two groups when capacity-aware: with room and at their batch cap. Used
    while every candidate has an estimate or none has, so the key needs no mean."""

    capacity_aware: bool

    def group(self, candidate: Candidate) -> Hashable | None:
        return _FULL if self.capacity_aware and not has_room(candidate) else _ROOM

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        return (candidate.running / _unit(candidate, self.capacity_aware, 1.0),)


# Made once and shared by every gate: a view keeps one index per spec object.
_BY_LOAD = {aware: _ByLoad(aware) for aware in (False, True)}


def _unit(candidate: Candidate, capacity_aware: bool, default: float) -> float:
    """The capacity a candidate's load is measured in; `default` without a usable estimate."""
    capacity = candidate.capacity
    if capacity_aware and capacity is not None and usable_capacity(capacity):
        return capacity
    return default


class ImbalanceGate:
    """Decides, per request, whether a model's pool is imbalanced and where the request goes then.

    One gate can stand ahead of several strategies; `fired` counts per model the requests it
    routed (AIBrix's `aibrix_load_imbalance_total`), a plain dict for the caller to export.
    """

    __slots__ = ("_by_load", "fired", "settings")

    def __init__(self, settings: ImbalanceSettings | None = None) -> None:
        self.settings = settings or ImbalanceSettings()
        self.fired: dict[str, int] = {}
        self._by_load = _BY_LOAD[self.settings.capacity_aware]

    def check(
        self, candidates: Sequence[Candidate], model: str, rng: random.Random
    ) -> Candidate | None:
        """The candidate to route to when the pool is imbalanced (counted in `fired`); None when
        it is not, without drawing from `rng`."""
        if isinstance(candidates, CandidateView) and (
            not self.settings.capacity_aware or candidates.known_capacities in (0, len(candidates))
        ):
            chosen = self._indexed(candidates, rng)
        else:
            chosen = self._plain(candidates, rng)
        if chosen is not None:
            self.fired[model] = self.fired.get(model, 0) + 1
        return chosen

    def _fires(
        self,
        n: int,
        scale: float,
        keys: tuple[float, float, float],
        busiest: Candidate,
        busiest_unit: float,
        running_total: Callable[[], int],
    ) -> bool:
        """AIBrix's test on loads in requests at the mean capacity (`scale`). `keys` are running
        per unit of capacity: of the least loaded candidate with room (where the request would
        go), of the least loaded of all, of the busiest. The running total is asked for only
        when the test needs it."""
        settings = self.settings
        if settings.capacity_aware:
            target, least, most = (_snap(k * scale) for k in keys)
            others = n - _snap(busiest_unit / scale)  # the others' capacity, in mean capacities
        else:
            target, least, most = keys
            others = n - 1.0
        if most - target < settings.min_gap:
            return False
        if n <= 2:
            return True
        # The others' level is a capacity-weighted mean of their loads, so at least `least`:
        # when even that keeps the busiest within the factor, no sum is needed.
        if most <= settings.factor * (least + 1.0):
            return False
        if others <= 0:
            return False
        rest = (running_total() - busiest.running) / others
        return most > settings.factor * (rest + 1.0)

    def _plain(self, candidates: Sequence[Candidate], rng: random.Random) -> Candidate | None:
        """The rule, over every candidate."""
        n = len(candidates)
        if n < 2:
            return None
        aware = self.settings.capacity_aware
        scale = 1.0
        if aware:
            known = [_unit(c, True, 0.0) for c in candidates]
            known = [u for u in known if u > 0.0]
            if known:
                scale = sum(known) / len(known)
        units = [_unit(c, aware, scale) for c in candidates]
        keys = [c.running / u for c, u in zip(candidates, units, strict=True)]
        room = [i for i, c in enumerate(candidates) if not aware or has_room(c)]
        if not room:
            return None
        top = 0
        for i, k in enumerate(keys):  # the busiest; ties: the last in order, as the index
            if k >= keys[top]:
                top = i
        if not self._fires(
            n,
            scale,
            (min(keys[i] for i in room), min(keys), keys[top]),
            candidates[top],
            units[top],
            lambda: sum(c.running for c in candidates),
        ):
            return None
        return random_min([candidates[i] for i in room], [(keys[i],) for i in room], rng)

    def _indexed(self, view: CandidateView, rng: random.Random) -> Candidate | None:
        """The rule from the view's index: the least loaded and the busiest are group ends."""
        n = len(view)
        if n < 2:
            return None
        index = view.grouped_by(self._by_load)
        room = index.groups.get(_ROOM)
        if room is None:
            return None
        full = index.groups.get(_FULL)
        ends = (room,) if full is None else (room, full)
        target: tuple[float, ...] = room[0][0]
        least: tuple[float, ...] = min(entries[0][0] for entries in ends)
        most_key, top_order = max(entries[-1] for entries in ends)  # ties: the last in order
        busiest: Candidate = view.slots[top_order]
        scale = (
            view.capacity_total / view.known_capacities
            if self.settings.capacity_aware and view.known_capacities
            else 1.0
        )

        if not self._fires(
            n,
            scale,
            (target[0], least[0], most_key[0]),
            busiest,
            _unit(busiest, self.settings.capacity_aware, 1.0),
            lambda: view.running_total,
        ):
            return None
        return choose_tied([tied_run(room, target)], view.slots, rng)


class Wrapped(Strategy):
    """A strategy under another name and/or behind an imbalance gate; everything else (the
    hooks, and `scores` for blends) is the strategy's, so it stands where the strategy stood.

    - `name`: what the client asked for (`least-request:3` routes with least-request, a bare
      `prefix-cache` with its auto-blend): the echo is the client's string.
    - `gate`: when it fires the request goes where it says, else the strategy decides. AIBrix
      exempts its exclusive strategies (pd, slo*) from the gate: they keep their own pod
      subsets, and a request the gate routes bypasses them. In a blend, gate the blend:
      `scores` pass through ungated.
    """

    __slots__ = ("gate", "inner", "name", "needs_profiles")

    def __init__(
        self, inner: Strategy, name: str | None = None, gate: ImbalanceGate | None = None
    ) -> None:
        self.inner = inner
        self.name = inner.name if name is None else name
        self.gate = gate
        self.needs_profiles = inner.needs_profiles  # asked on every request: copied once

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        gate = self.gate
        if gate is not None:
            target = gate.check(candidates, request.model, rng)
            if target is not None:
                return Route(target)
        return self.inner.admit(candidates, request, rng, now)

    def profiled(self, candidates: Sequence[Candidate]) -> bool:
        return self.inner.profiled(candidates)

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:
        self.inner.routed(candidate, request)

    def forget(self, *keys: str) -> None:
        self.inner.forget(*keys)

    def __getattr__(self, attr: str) -> Any:  # scores, higher_is_better, params, ...
        if attr in Wrapped.__slots__:  # not set yet (copying): no recursion through `inner`
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        gate = None if self.gate is None else self.gate.settings
        return f"Wrapped({self.inner!r}, {self.name!r}, {gate!r})"
