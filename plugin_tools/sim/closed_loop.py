"""The GPU optimizer in a closed loop: trace -> plan -> fleet -> simulated traffic -> attainment.

What the optimizer service does in production, replayed in simulated time for one request rate:

1. The gateway traces traffic. A 240 s stretch of the workload's requests becomes the trace
   windows the gateway would write (`plugin.core.trace.TraceWindow`, 10 s windows aligned to the
   wall clock, counts keyed `bucket(prompt tokens, output tokens)`, `meta_total_reqs` the
   arrivals). The stretch is history: the simulator does not serve it, so each request is
   counted as completed in the window it arrived in (a gateway counts it in the window it
   completes in, seconds later; over 240 s that moves counts between neighbouring windows, not
   the mix or the level the optimizer reads). Nothing is pending or queued at a window's end.
2. The optimizer plans. The windows, read back from their JSON documents, go through
   `plugin.core.workload.traffic` (the look-back ending at the stretch's end, where the service
   would plan) and `build_problem` with each GPU type's profile, as the service's `_plan_model`
   does, and `plugin.core.optimizer.solve` returns replicas per GPU type. The profiles are the
   simulator's (`plugin_tools.sim.profiles`: a simulated `profile sweep` per GPU type, built
   for the scenario's SLO at its percentile) with each type's `cost` set to its price.
3. The autoscaler applies the plan: a fleet of that many engines of each type, which then
   serves the requests that follow the stretch (the same seeded stream, so the plan never sees
   the requests it is judged on) under each routing strategy; the figure is SLO attainment.

Beside it, the best single GPU type: the same problem solved with one candidate at a time; the
cheapest that serves every cell the plan serves (a type whose profile has `tputs` 0 for such a
cell cannot; a cell no type serves is left out of both), or under an attainment target all but
what the target lets it leave out, run under load-balance. Its cost
against the plan's is what a mixed fleet saves.

The plan is as good as the profiles: a profile built from a finite simulated sweep understates
what a GPU sustains, so plans err on the safe side (docs/benchmarks.md measures by how much).

Prices (`PRICES`, US$ per replica-hour, each a one-GPU on-demand instance) are illustrative:
Lambda's public on-demand price list (lambda.ai/pricing) as public price trackers recorded it
on 2026-09-20 and 2026-09-25: 1x H100 PCIe $3.29, 1x A100 SXM 40 GB $1.99, 1x A10 $1.29. The
simulator's engines are models of these GPU types, not measurements of them; prices change, and
any others can be passed in (`ClosedLoop.costs`).

Pure and deterministic for a seed: no clock, no I/O; SciPy (the `optimizer` extra) for `solve`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plugin.core.optimizer import Plan, Problem, solve
from plugin.core.profile import GpuProfile as SloProfile
from plugin.core.trace import TRACE_INTERVAL_S, TraceWindow, bucket, window_start
from plugin.core.workload import Deployment, ModelProblem, build_problem, traffic
from plugin_tools.sim.engine import PRESETS, GpuProfile
from plugin_tools.sim.fleet import MODEL, simulate
from plugin_tools.sim.metrics import summarize
from plugin_tools.sim.profiles import profile_book, simulated_profile
from plugin_tools.sim.sweep import Scenario, make_strategy, slo_capacities
from plugin_tools.sim.workload import SimRequest, generate

__all__ = [
    "NAMESPACE",
    "PRICES",
    "PRICE_SOURCE",
    "SINGLE_STRATEGY",
    "STRATEGIES",
    "TRACE_S",
    "TRACE_START",
    "Cheapest",
    "ClosedLoop",
    "FleetRun",
    "RatePoint",
    "build_fleet",
    "cheapest_fleet",
    "default_gpus",
    "run_closed_loop",
    "trace_windows",
    "type_capacities",
]

# US$ per hour of a one-GPU on-demand instance (illustrative; see the module docstring).
PRICES: dict[str, float] = {"h100": 3.29, "a100": 1.99, "a10": 1.29}
PRICE_SOURCE = (
    "Lambda's public on-demand price list (lambda.ai/pricing), one-GPU instances, as recorded "
    "by public price trackers on 2026-09-20 and 2026-09-25: 1x H100 PCIe $3.29/h, 1x A100 SXM "
    "40 GB $1.99/h, 1x A10 $1.29/h"
)
STRATEGIES = ("load-balance", "least-request", "round-robin")
SINGLE_STRATEGY = "load-balance"  # the best single type's fleet runs under this one
NAMESPACE = "sim"
# The unix time the traced stretch starts at (2026-01-01 00:00:00 UTC, a window boundary).
TRACE_START = 1_767_225_600
TRACE_S = 240  # the optimizer service's default look-back (seconds)


def trace_windows(
    requests: Sequence[SimRequest],
    model: str = MODEL,
    start_unix: int = TRACE_START,
    interval_s: int = TRACE_INTERVAL_S,
) -> list[TraceWindow]:
    """The windows a gateway would write for `requests` (arrivals in seconds after
    `start_unix`): per window, the arrivals and the size bucket of each request, in the window it
    arrived in. Windows without requests are left out, as the gateway writes nothing for them.
    `start_unix` must be a window boundary: the stretch is then whole windows."""
    if start_unix % interval_s:
        raise ValueError(f"start_unix {start_unix} is not a multiple of {interval_s}")
    windows: dict[int, TraceWindow] = {}
    for r in requests:
        start = window_start(start_unix + r.arrival, interval_s)
        w = windows.get(start)
        if w is None:
            w = windows[start] = TraceWindow(model, start, {}, 0, 0, 0, interval_s)
        key = bucket(r.prompt_tokens, r.output_tokens, w.precision)
        w.counts[key] = w.counts.get(key, 0) + 1
        w.total_reqs += 1
    return [windows[s] for s in sorted(windows)]


def build_fleet(replicas: Mapping[str, int], gpus: Mapping[str, GpuProfile]) -> list[GpuProfile]:
    """The engines a plan asks for (replicas per GPU type name), as `parse_fleet` lists them:
    each type's replicas together, types in the order of `gpus`."""
    fleet: list[GpuProfile] = []
    for name, gpu in gpus.items():
        fleet.extend([gpu] * replicas.get(name, 0))
    return fleet


@dataclass(frozen=True, slots=True)
class FleetRun:
    """One fleet and what it did with the traffic after the trace."""

    replicas: dict[str, int]  # per GPU type
    cost: float  # per hour
    attainment: dict[str, float]  # per strategy: share of measured requests within the SLO
    # Per strategy: output tokens/s delivered over the fleet's saturated decode ceiling.
    utilization: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "cost": self.cost,
            "attainment": self.attainment,
            "utilization": self.utilization,
        }


@dataclass(frozen=True, slots=True)
class RatePoint:
    """The closed loop at one offered rate."""

    rate: float  # req/s offered
    windows: tuple[TraceWindow, ...]  # what the gateway traced
    inputs: ModelProblem  # what the optimizer built from them
    plan: Plan
    mixed: FleetRun  # the plan's fleet
    single_costs: dict[str, float | None]  # per GPU type alone: its plan's cost, None: cannot
    single_gpu: str | None  # the cheapest single type that serves every cell (or the target)
    single: FleetRun | None  # its fleet (load-balance only)
    every: Plan | None = None  # under an attainment target below 1: the plan serving every cell

    @property
    def saving(self) -> float | None:
        """1 - plan cost / best single type's cost (None without a feasible single type)."""
        if self.single is None or self.single.cost <= 0:
            return None
        return 1.0 - self.mixed.cost / self.single.cost

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "traced_rate": self.inputs.traffic.rate,
            "windows": len(self.windows),
            "cells": len(self.inputs.problem.rates),
            "plan_status": self.plan.status,
            "unserved": sum(self.plan.unserved),
            "plan_load": dict(
                zip(
                    (d.name for d in self.inputs.deployments),
                    self.plan.load,
                    strict=True,
                )
            ),
            "mixed": self.mixed.to_json(),
            "single_costs": self.single_costs,
            "single_gpu": self.single_gpu,
            "single": None if self.single is None else self.single.to_json(),
            "saving": self.saving,
            "exempt": sum(self.plan.exempt),
            "every_cost": None if self.every is None else self.every.cost,
        }


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """A closed-loop scenario. `scenario.profiles` lists the GPU types the optimizer may use
    (one entry each); the workload, arrivals, SLO, gateway model, warm-up, measured requests,
    seed, sweep grid and profile percentile are the scenario's."""

    scenario: Scenario
    costs: Mapping[str, float] = field(default_factory=lambda: dict(PRICES))  # per GPU type
    headroom: float = 1.0  # Problem.headroom: plan capacity for the traced rate x this
    attainment: float = 1.0  # Problem.attainment: the share the plan serves within the SLO
    trace_s: int = TRACE_S  # the stretch traced, and the service's look-back (seconds)
    strategies: tuple[str, ...] = STRATEGIES

    def __post_init__(self) -> None:
        names = [g.name for g in self.scenario.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"list each GPU type once: {', '.join(names)}")
        missing = [n for n in names if n not in self.costs]
        if missing:
            raise ValueError(f"no cost for {', '.join(missing)}")
        if self.trace_s <= 0 or self.trace_s % TRACE_INTERVAL_S:
            raise ValueError(f"trace_s must be a positive multiple of {TRACE_INTERVAL_S}")

    @property
    def gpus(self) -> dict[str, GpuProfile]:
        return {g.name: g for g in self.scenario.profiles}

    def profiles(self) -> dict[str, SloProfile]:
        """Each GPU type's profile from the simulated sweep, with its price as `cost`."""
        s = self.scenario
        grid = s.sweep_grid()
        return {
            name: replace(
                simulated_profile(gpu, grid, s.slo, MODEL, s.profile_percentile),
                cost=float(self.costs[name]),
            )
            for name, gpu in self.gpus.items()
        }

    def requests(self, rate: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """(the traced stretch, what follows it): one seeded stream at `rate`, cut at `trace_s`;
        what follows starts at 0 and holds the scenario's warm-up and measured requests."""
        s = self.scenario
        served = math.ceil(rate * s.warmup_s) + s.measured_requests
        n = math.ceil(rate * self.trace_s * 1.2) + served + 16
        while True:
            stream = generate(s.lengths, s.arrivals, rate, n, random.Random(s.seed))
            cut = next((k for k, r in enumerate(stream) if r.arrival >= self.trace_s), n)
            if n - cut >= served:
                break
            n *= 2  # the k-th request does not depend on n: a longer stream extends this one
        history = stream[:cut]
        future = [
            SimRequest(r.arrival - self.trace_s, r.prompt_tokens, r.output_tokens)
            for r in stream[cut : cut + served]
        ]
        return history, future

    def deployments(self) -> list[Deployment]:
        return [Deployment(NAMESPACE, name, MODEL, replicas=0) for name in self.gpus]

    def plan(self, windows: Sequence[TraceWindow]) -> tuple[ModelProblem, Plan]:
        """The optimizer service's plan for these windows (its `_plan_model`, without I/O): each
        window is read back from the document the gateway writes, as the service reads it."""
        read = [TraceWindow.parse(w.model, w.start, w.to_json()) for w in windows]
        until = TRACE_START + self.trace_s  # the service plans just after this boundary
        inputs = build_problem(
            MODEL,
            self.deployments(),
            self.profiles(),
            traffic(read, self.trace_s, until=until),
            headroom=self.headroom,
            attainment=self.attainment,
        )
        return inputs, solve(inputs.problem)

    def run_fleet(
        self,
        replicas: Mapping[str, int],
        cost: float,
        strategies: Sequence[str],
        future: list[SimRequest],
    ) -> FleetRun:
        """The fleet `replicas` serving `future` under each strategy."""
        s = self.scenario
        fleet = build_fleet(replicas, self.gpus)
        met: dict[str, float] = {}
        used: dict[str, float] = {}
        for name in strategies:
            if not fleet:  # no replicas (no traffic traced): nothing serves
                met[name] = used[name] = math.nan
                continue
            chosen = make_strategy(name, s)
            book = None
            if getattr(chosen, "needs_profiles", False):
                book = profile_book(fleet, s.sweep_grid(), s.slo, MODEL, s.profile_percentile)
            result = simulate(
                fleet,
                chosen,
                future,
                warmup_s=s.warmup_s,
                gateway=s.gateway,
                seed=s.seed,
                book=book,
                max_tokens=s.lengths.max_output,
            )
            figures = summarize(result, s.slo)
            met[name] = figures["attainment"]
            used[name] = figures["output_tokens_per_s"] / figures["token_ceiling_per_s"]
        return FleetRun(dict(replicas), cost, met, used)

    def at(self, rate: float) -> RatePoint:
        """The closed loop at `rate` req/s."""
        if not rate > 0:
            raise ValueError("rate must be positive")
        history, future = self.requests(rate)
        windows = trace_windows(history)
        inputs, plan = self.plan(windows)
        replicas = {d.name: plan.replicas[d.key] for d in inputs.deployments}
        mixed = self.run_fleet(replicas, plan.cost, self.strategies, future)
        single_costs: dict[str, float | None] = {}
        single_plans: dict[str, Plan] = {}
        problem = inputs.problem
        nobody = set(plan.infeasible_cells)  # cells no type serves: unserved by any fleet
        # A type alone may leave out what the target lets the plan leave out, no more.
        allowed = (1 - problem.attainment) * math.fsum(problem.rates) * (1 + 1e-9)
        for d, cand in zip(inputs.deployments, problem.candidates, strict=True):
            alone = solve(Problem(problem.rates, (cand,), problem.headroom, problem.attainment))
            missed = math.fsum(u for k, u in enumerate(alone.unserved) if k not in nobody)
            feasible = missed == 0 or missed <= allowed
            single_costs[d.name] = alone.cost if feasible else None
            if feasible:
                single_plans[d.name] = alone
        single_gpu = min(single_plans, key=lambda n: (single_plans[n].cost, n), default=None)
        single = None
        if single_gpu is not None:
            alone = single_plans[single_gpu]
            fleet = {single_gpu: alone.replicas[f"{NAMESPACE}/{single_gpu}"]}
            single = self.run_fleet(fleet, alone.cost, (SINGLE_STRATEGY,), future)
        every = None
        if problem.attainment < 1:
            every = solve(replace(problem, attainment=1.0))
        return RatePoint(
            rate, tuple(windows), inputs, plan, mixed, single_costs, single_gpu, single, every
        )


def run_closed_loop(
    loop: ClosedLoop,
    rates: Sequence[float],
    progress: Callable[[RatePoint], None] = lambda _: None,
) -> list[RatePoint]:
    """The closed loop at each rate, in order; `progress` sees each point as it is done."""
    points = []
    for rate in rates:
        point = loop.at(rate)
        progress(point)
        points.append(point)
    return points


def default_gpus() -> tuple[GpuProfile, ...]:
    """The GPU types `PRICES` names, as the simulator's presets."""
    return tuple(PRESETS[name] for name in PRICES)


@dataclass(frozen=True, slots=True)
class Cheapest:
    """The cheapest fleet the search found holding the target under load-balance."""

    run: FleetRun | None  # None: none within the search's bounds
    tried: int  # fleets simulated


def type_capacities(loop: ClosedLoop) -> dict[str, float]:
    """Per GPU type: the rate (req/s) one replica sustains alone within the SLO at the
    scenario's target for its workload (`slo_capacities`, a bisection per type)."""
    s = loop.scenario
    return {
        name: slo_capacities(replace(s, profiles=(gpu,)))[f"{name}-0"]
        for name, gpu in loop.gpus.items()
    }


def cheapest_fleet(
    loop: ClosedLoop,
    rate: float,
    target: float = 0.99,
    pooling: float = 0.85,
    capacity: Mapping[str, float] | None = None,
) -> Cheapest:
    """The cheapest fleet of the loop's GPU types whose run of the traffic after the trace keeps
    `target` of requests within the SLO under load-balance, found by search: fleets in order of
    cost, skipping any whose replicas' capacities alone (each type's steady-state rate for the
    workload, `type_capacities`, computed here unless given) add up to less than `pooling` x
    the rate (a pooled fleet does a little better than its replicas alone, so not all the way),
    and any with no more of every type than a fleet that already failed. The first that holds
    is the answer."""
    if capacity is None:
        capacity = type_capacities(loop)
    limits = {n: math.ceil(rate / c / pooling) + 1 for n, c in capacity.items() if c > 0}
    names = list(limits)
    fleets: list[dict[str, int]] = [{}]
    for name in names:
        fleets = [f | {name: k} for f in fleets for k in range(limits[name] + 1)]
    able = [
        f
        for f in fleets
        if sum(f.values()) and sum(capacity[n] * k for n, k in f.items()) >= pooling * rate
    ]
    able.sort(key=lambda f: (math.fsum(loop.costs[n] * k for n, k in f.items()), sum(f.values())))
    _, future = loop.requests(rate)
    failed: list[dict[str, int]] = []
    tried = 0
    for fleet in able:
        if any(all(fleet[n] <= bad[n] for n in names) for bad in failed):
            continue
        cost = math.fsum(loop.costs[n] * k for n, k in fleet.items())
        tried += 1
        run = loop.run_fleet(fleet, cost, (SINGLE_STRATEGY,), future)
        if run.attainment[SINGLE_STRATEGY] >= target:
            return Cheapest(run, tried)
        failed.append(fleet)
    return Cheapest(None, tried)
