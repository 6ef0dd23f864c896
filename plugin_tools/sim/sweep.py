"""SLO capacity per replica, the oracle goodput bound G*, load sweeps and max sustainable rates.

Every run of a scenario at a given rate replays the same seeded request stream, so strategies are
compared on identical traffic (common random numbers) and a result is reproducible from its seed.

A strategy that reads GPU profiles (SLO routing) runs with the profiles of the fleet's GPU types
measured on simulated engines over a grid covering the workload's sizes and built for the
scenario's SLO (`plugin_tools.sim.profiles`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plugin.core.profile import ProfileBook
from plugin.core.strategies import Picker, Strategy, build_strategies, strategy_names
from plugin.core.types import Candidate, RequestInfo, SloTarget
from plugin.errors import RoutingFailed
from plugin_tools.sim.engine import GpuProfile
from plugin_tools.sim.fleet import MODEL, GatewayModel, RunResult, replica_names, simulate
from plugin_tools.sim.metrics import DEFAULT_SLO, attainment, summarize
from plugin_tools.sim.profiles import SweepGrid, grid_for, profile_book
from plugin_tools.sim.workload import Arrivals, LengthSource, SimRequest, generate

__all__ = [
    "ORACLE",
    "REFERENCE",
    "CapacityWeighted",
    "Scenario",
    "bisect_rate",
    "known_strategies",
    "make_strategy",
    "reads_profiles",
    "run_at",
    "slo_capacities",
    "study",
]

ORACLE = "capacity-weighted"
# load-balance with the reference algorithm exactly (no full-batch rule), to compare in one run.
REFERENCE = "load-balance-reference"


@dataclass(frozen=True, slots=True)
class CapacityWeighted(Picker):
    """Oracle baseline: random, weighted by each replica's true capacity (given, not learned)."""

    weights: Mapping[str, float]  # pod name -> capacity
    name: str = ORACLE

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        if not candidates:
            raise RoutingFailed("no candidate pods")
        weights = [max(0.0, self.weights.get(c.pod.name, 0.0)) for c in candidates]
        if sum(weights) <= 0:
            return rng.choice(candidates)
        return rng.choices(candidates, weights)[0]


def known_strategies() -> list[str]:
    return sorted(strategy_names() | {ORACLE, REFERENCE})


@dataclass(frozen=True, slots=True)
class Scenario:
    profiles: tuple[GpuProfile, ...]
    lengths: LengthSource
    arrivals: Arrivals = field(default_factory=Arrivals)
    slo: SloTarget = DEFAULT_SLO
    gateway: GatewayModel = field(default_factory=GatewayModel)
    measured_requests: int = 2000
    warmup_s: float = 120.0
    seed: int = 1
    target: float = 0.99  # attainment a rate must reach to count as sustained
    # SLO routing's profiles: the simulated sweep's grid (None: one covering the workload) and
    # the percentile the SLO is checked at when they are built.
    sweep: SweepGrid | None = None
    profile_percentile: int = 99

    def requests(self, rate: float) -> list[SimRequest]:
        n = math.ceil(rate * self.warmup_s) + self.measured_requests
        return generate(self.lengths, self.arrivals, rate, n, random.Random(self.seed))

    def sweep_grid(self) -> SweepGrid:
        return self.sweep or grid_for(self.lengths)

    def profile_book(self) -> ProfileBook:
        """The fleet's GPU profiles for this scenario's SLO, from simulated sweeps (cached)."""
        return profile_book(
            self.profiles, self.sweep_grid(), self.slo, MODEL, self.profile_percentile
        )


def make_strategy(
    name: str, scenario: Scenario, capacities: Mapping[str, float] | None = None
) -> Strategy:
    """A fresh strategy (round-robin keeps state) with the scenario's score parameters."""
    if name == ORACLE:
        if capacities is None:
            names = replica_names(scenario.profiles)
            capacities = {
                n: p.saturated_tokens_per_s() for n, p in zip(names, scenario.profiles, strict=True)
            }
        return CapacityWeighted(dict(capacities))
    params = scenario.gateway.params
    if name == REFERENCE:
        return build_strategies(replace(params, avoid_full_batches=False))["load-balance"]
    strategies = build_strategies(params)
    if name not in strategies:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(known_strategies())}")
    return strategies[name]


def reads_profiles(name: str) -> bool:
    """The named strategy routes by GPU profiles (SLO routing); False for an unknown name."""
    strategy = build_strategies().get(name)
    return bool(getattr(strategy, "needs_profiles", False))


def run_at(
    scenario: Scenario,
    strategy: str,
    rate: float,
    capacities: Mapping[str, float] | None = None,
) -> RunResult:
    chosen = make_strategy(strategy, scenario, capacities)
    slo_routing = getattr(chosen, "needs_profiles", False)
    return simulate(
        scenario.profiles,
        chosen,
        scenario.requests(rate),
        warmup_s=scenario.warmup_s,
        gateway=scenario.gateway,
        seed=scenario.seed,
        book=scenario.profile_book() if slo_routing else None,
        max_tokens=scenario.lengths.max_output,
    )


def bisect_rate(passes: Callable[[float], bool], guess: float, iterations: int = 9) -> float:
    """Largest rate that passes, assuming pass/fail is monotone in the rate.

    Grows the upper bound from `guess` until a rate fails, then bisects.
    """
    if guess <= 0:
        raise ValueError("guess must be positive")
    lo, hi = 0.0, guess
    while passes(hi):
        lo, hi = hi, hi * 2
        if hi > guess * 64:
            return lo
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def slo_capacities(scenario: Scenario) -> dict[str, float]:
    """Per replica: the largest rate it serves alone with attainment >= target (req/s).

    Replicas of the same type share one bisection. The warm-up is short: one replica has no
    routing to learn, only its queue to fill.
    """
    names = replica_names(scenario.profiles)
    mean_out = scenario.lengths.mean_output
    by_profile: dict[GpuProfile, float] = {}
    for profile in scenario.profiles:
        if profile in by_profile:
            continue
        alone = replace(scenario, profiles=(profile,), warmup_s=min(scenario.warmup_s, 30.0))

        def passes(rate: float, alone: Scenario = alone) -> bool:
            return attainment(run_at(alone, "round-robin", rate), alone.slo) >= alone.target

        by_profile[profile] = bisect_rate(passes, profile.saturated_tokens_per_s() / mean_out)
    return {n: by_profile[p] for n, p in zip(names, scenario.profiles, strict=True)}


def _key(fraction: float) -> str:
    return f"{fraction:g}"


def study(
    scenario: Scenario,
    strategies: Sequence[str],
    loads: Sequence[float],
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """G*, then per strategy a load sweep in fractions of G* and the max sustainable rate.

    JSON-ready; `progress` is called once per finished unit of work with a short label.
    """
    for name in strategies:
        make_strategy(name, scenario)  # unknown names fail before any work
    capacities = slo_capacities(scenario)
    progress("slo capacity")
    g_star = sum(capacities.values())
    out: dict[str, Any] = {
        "replicas": replica_names(scenario.profiles),
        "slo_capacity": capacities,
        "g_star": g_star,
        "loads": [float(f) for f in loads],
        "strategies": {},
    }
    if any(reads_profiles(name) for name in strategies):
        grid = scenario.sweep_grid()
        book = scenario.profile_book()
        out["sweep"] = {
            "inputs": list(grid.inputs),
            "outputs": list(grid.outputs),
            "rates": list(grid.rates),
            "prompts": grid.prompts,
            "percentile": scenario.profile_percentile,
            "rule": grid.rule,
            "floor": grid.floor,
        }
        out["profiles"] = {
            gpu.name: profile.to_json()
            for gpu in dict.fromkeys(scenario.profiles)
            if (profile := book.lookup(MODEL, gpu.name)) is not None
        }
        progress("gpu profiles")
    for name in strategies:
        runs = {
            _key(f): summarize(run_at(scenario, name, f * g_star, capacities), scenario.slo)
            for f in loads
        }

        def passes(rate: float, name: str = name) -> bool:
            result = run_at(scenario, name, rate, capacities)
            return attainment(result, scenario.slo) >= scenario.target

        max_rate = bisect_rate(passes, g_star, iterations=7)
        per_replica = {
            "share": "share",
            "utilization": "utilization",
            "busy": "busy",
            "tpot_p50_per_replica": "tpot_p50",
            "e2e_per_token_p99_per_replica": "e2e_per_token_p99",
            "preemptions_per_replica": "preemptions",
        }
        entry: dict[str, Any] = {
            "max_rate": max_rate,
            "max_rate_over_g_star": max_rate / g_star if g_star > 0 else math.nan,
            "tpot_p50_ratio": {k: r["tpot_p50_ratio"] for k, r in runs.items()},
        }
        for out_name, field_name in per_replica.items():
            entry[out_name] = {
                k: {rep: v[field_name] for rep, v in r["replicas"].items()} for k, r in runs.items()
            }
        for field_name in (
            "attainment",
            "goodput",
            "ttft_p50",
            "ttft_p99",
            "tpot_p50",
            "tpot_p99",
            "e2e_per_token_p99",
            "output_tokens_per_s",
            "utilization_spread",
            "unused_replicas",
            "dropped",
            "rejected",
            "wait_p50",
            "wait_p99",
            "requests",
        ):
            entry[field_name] = {k: r[field_name] for k, r in runs.items()}
        entry["token_ceiling_per_s"] = sum(p.saturated_tokens_per_s() for p in scenario.profiles)
        out["strategies"][name] = entry
        progress(name)
    return out
