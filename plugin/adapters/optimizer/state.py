"""The optimizer itself: per model, deployments and traces in, a plan through the scale-down
gate out; its metrics and its `/debug/plan` view."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from redis.exceptions import RedisError

from plugin.adapters.optimizer.sources import (
    READ_DELAY_S,
    DeploymentSource,
    TraceSource,
    UnknownDeployment,
)
from plugin.adapters.profiles import ProfileLoader
from plugin.config import OptimizerSettings
from plugin.core.optimizer import Plan, ScaleDownGate, solve
from plugin.core.profile import GpuProfile, ProfileBook
from plugin.core.trace import TRACE_INTERVAL_S, window_start
from plugin.core.workload import Deployment, ModelProblem, build_problem, traffic
from plugin.errors import OptimizerInputError

log = logging.getLogger(__name__)


# --- the optimizer's state -----------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    deployment: Deployment
    planned: int | None = None  # the last plan's count, after the scale-down gate
    override: int | None = None  # an operator's PUT /scale
    monitored: bool = True


class OptimizerMetrics:
    """The optimizer's own Prometheus metrics, on its `/metrics`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.solve_seconds = Histogram(
            "hetero_optimizer_solve_seconds",
            "Time to solve one model's plan (MILP, HiGHS).",
            ["model"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0),
        )
        self.decisions = Counter(
            "hetero_optimizer_decisions",
            "Plans made, by model and status (optimal, short: caps leave traffic unserved, idle).",
            ["model", "status"],
            registry=r,
        )
        self.cost = Gauge(
            "hetero_optimizer_plan_cost",
            "Cost of the last plan (sum of cost x replicas).",
            ["model"],
            registry=r,
        )
        self.rate = Gauge(
            "hetero_optimizer_request_rate",
            "Mean request rate (req/s) over the look-back that the last plan served.",
            ["model"],
            registry=r,
        )
        self.unserved = Gauge(
            "hetero_optimizer_unserved_rate",
            "Request rate (req/s) the last plan cannot serve: caps, or sizes no profile serves.",
            ["model"],
            registry=r,
        )
        self.exempt = Gauge(
            "hetero_optimizer_exempt_rate",
            "Request rate (req/s) the last plan leaves out of the SLO's capacity under its"
            " attainment target (HETERO_GATEWAY_OPTIMIZER_ATTAINMENT): routed, served late.",
            ["model"],
            registry=r,
        )
        self.replicas = Gauge(
            "hetero_optimizer_replicas",
            "Replicas the optimizer answers for each deployment (override, plan or current).",
            ["namespace", "deployment", "model"],
            registry=r,
        )
        self.errors = Counter(
            "hetero_optimizer_errors",
            "Optimization rounds that degraded, by stage (deployments, traces, solve).",
            ["stage"],
            registry=r,
        )


class Optimizer:
    """The optimization loop and what it answers; HTTP handlers call its methods."""

    def __init__(
        self,
        settings: OptimizerSettings,
        source: DeploymentSource,
        traces: TraceSource,
        book: ProfileBook,
        profiles: ProfileLoader | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.source = source
        self.traces = traces
        self.book = book
        self.profiles = profiles
        self.clock = clock
        self.gate = ScaleDownGate(settings.scale_down_windows)
        self.metrics = OptimizerMetrics()
        self._held: dict[str, _Held] = {}
        self._last: dict[str, dict[str, Any]] = {}  # model -> the last plan and its inputs
        self._listing = asyncio.Lock()
        self.rounds = 0

    # -- the loop --

    async def run(self) -> None:
        while True:
            now = self.clock()
            wake = window_start(now) + TRACE_INTERVAL_S + READ_DELAY_S
            await asyncio.sleep(max(0.0, wake - now))
            try:
                await self.step(wake)
            except Exception:  # one bad round must not end the loop
                log.exception("optimization round failed")
                self.metrics.errors.labels("solve").inc()

    async def refresh_deployments(self) -> bool:
        async with self._listing:  # one list at a time, however many callers
            return await self._refresh()

    async def _refresh(self) -> bool:
        try:
            found = await self.source.fetch()
        except (
            Exception
        ) as exc:  # the Kubernetes client raises many kinds; a pods file, ConfigError
            log.warning(
                "listing deployments from %s failed: %r; keeping the last", self.source.where, exc
            )
            self.metrics.errors.labels("deployments").inc()
            return False
        seen = set()
        for d in found:
            seen.add(d.key)
            held = self._held.get(d.key)
            if held is None:
                self._held[d.key] = _Held(d)
                # What it runs is the first proposal: a first plan below it waits like any other.
                self.gate.step(d.key, d.replicas)
            else:
                held.deployment = d
        for key in [k for k in self._held if k not in seen]:
            del self._held[key]
            self.gate.forget(key)
        return True

    async def step(self, now: float | None = None) -> None:
        """One round: every model's plan from the traces of the look-back ending before `now`
        (taken before listing deployments, which may take a while)."""
        now = self.clock() if now is None else now
        self.rounds += 1
        await self.refresh_deployments()
        models = sorted({h.deployment.model for h in self._held.values() if h.monitored})
        for model in models:
            try:
                await self._plan_model(model, now)
            except Exception:  # one model's failure must not skip the others
                log.exception("planning %s failed; keeping its last plan", model)
                self.metrics.errors.labels("solve").inc()
        self._export()

    async def _plan_model(self, model: str, now: float) -> None:
        s = self.settings
        try:
            windows = await self.traces.windows(model, now, s.lookback_s)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("reading traces of %s failed: %r; keeping the last plan", model, exc)
            self.metrics.errors.labels("traces").inc()
            return
        load = traffic(windows, s.lookback_s, until=window_start(now))
        if load.arrivals and not load.completions:
            # Requests arrive but none reported its size (streams without include_usage, or
            # all still running): no mix to plan for, and certainly not an idle fleet.
            log.info(
                "%s: %d arrivals, no sizes reported; keeping the last plan", model, load.arrivals
            )
            return
        deployments = [h.deployment for h in self._held.values() if h.monitored]
        profiles = self._profiles(model)
        inputs = build_problem(
            model,
            deployments,
            profiles,
            load,
            headroom=s.headroom,
            caps=s.max_replicas,
            attainment=s.attainment,
        )
        if inputs.beyond_grid:
            log.info(
                "%s: %.3g req/s larger than a profile's grid, planned at its largest cell",
                model,
                inputs.beyond_grid,
            )
        started = time.perf_counter()
        try:
            plan = await asyncio.to_thread(solve, inputs.problem)
        except (OptimizerInputError, ArithmeticError) as exc:  # a profile the solver refuses
            log.warning("planning %s failed: %s; keeping the last plan", model, exc)
            self.metrics.errors.labels("solve").inc()
            return
        took = time.perf_counter() - started
        self.metrics.solve_seconds.labels(model).observe(took)
        self.metrics.decisions.labels(model, plan.status).inc()
        self.metrics.cost.labels(model).set(plan.cost)
        self.metrics.rate.labels(model).set(inputs.traffic.rate)
        self.metrics.unserved.labels(model).set(sum(plan.unserved))
        self.metrics.exempt.labels(model).set(sum(plan.exempt))
        published = {}
        for d in inputs.deployments:
            held = self._held.get(d.key)
            if held is None or not held.monitored:  # removed or unmonitored during the solve
                continue
            count = self.gate.step(d.key, plan.replicas[d.key])
            held.planned = count
            published[d.key] = count
        for d in inputs.unprofiled:
            if (held := self._held.get(d.key)) is not None:
                held.planned = None
        if inputs.unprofiled:
            log.info(
                "%s: no profile for %s; left alone",
                model,
                ", ".join(d.key for d in inputs.unprofiled),
            )
        if plan.infeasible_cells:
            log.warning(
                "%s: %d request sizes no profile serves (%.3g req/s unserved)",
                model,
                len(plan.infeasible_cells),
                sum(plan.unserved[k] for k in plan.infeasible_cells),
            )
        self._last[model] = _debug(inputs, plan, published, now, took)

    def _profiles(self, model: str) -> dict[str, GpuProfile]:
        found = {}
        for held in self._held.values():
            d = held.deployment
            if d.model == model and (p := self.book.lookup(model, d.name)) is not None:
                found[d.name] = p
        return found

    def _export(self) -> None:
        self.metrics.replicas.clear()
        for held in self._held.values():
            if held.monitored:
                d = held.deployment
                self.metrics.replicas.labels(d.namespace, d.name, d.model).set(self._answer(held))

    # -- what the HTTP side asks --

    def _find(self, namespace: str, name: str) -> _Held:
        held = self._held.get(f"{namespace}/{name}")
        if held is None:
            raise UnknownDeployment(f"unknown deployment {namespace}/{name}")
        return held

    @staticmethod
    def _answer(held: _Held) -> int:
        if held.override is not None:
            return held.override
        if held.planned is not None:
            return held.planned
        return held.deployment.replicas

    def replicas(self, namespace: str, name: str) -> tuple[str, int]:
        """(model, replicas) the autoscaler should run for the deployment."""
        held = self._find(namespace, name)
        if not held.monitored:
            raise UnknownDeployment(f"deployment {namespace}/{name} is not monitored")
        return held.deployment.model, self._answer(held)

    def set_override(self, namespace: str, name: str, replicas: int | None) -> None:
        self._find(namespace, name).override = replicas
        self._export()

    def set_monitored(self, namespace: str, name: str, monitored: bool) -> bool:
        """Start or stop planning a deployment; returns whether that changed anything."""
        held = self._find(namespace, name)
        changed = held.monitored != monitored
        held.monitored = monitored
        if not monitored:
            held.planned = None
            self.gate.forget(held.deployment.key)
        self._export()
        return changed

    def knows(self, namespace: str, name: str) -> bool:
        return f"{namespace}/{name}" in self._held

    def knows_model(self, model: str) -> bool:
        return any(h.deployment.model == model for h in self._held.values())

    def debug(self) -> dict[str, Any]:
        return {
            "settings": {
                "lookback_s": self.settings.lookback_s,
                "headroom": self.settings.headroom,
                "attainment": self.settings.attainment,
                "scale_down_windows": self.settings.scale_down_windows,
                "max_replicas": dict(self.settings.max_replicas),
            },
            "rounds": self.rounds,
            "deployments": {
                key: {
                    "model": h.deployment.model,
                    "running": h.deployment.replicas,
                    "min_replicas": h.deployment.min_replicas,
                    "monitored": h.monitored,
                    "planned": h.planned,
                    "override": h.override,
                    "answer": self._answer(h),
                }
                for key, h in sorted(self._held.items())
            },
            "plans": self._last,
        }


def _debug(
    inputs: ModelProblem, plan: Plan, published: Mapping[str, int], now: float, took: float
) -> dict[str, Any]:
    p = inputs.problem
    return {
        "at": now,
        "solve_seconds": took,
        "status": plan.status,
        "cost": plan.cost,
        "planned": dict(plan.replicas),
        "published": dict(published),
        "unprofiled": [d.key for d in inputs.unprofiled],
        "traffic": {
            "windows": inputs.traffic.windows,
            "span_s": inputs.traffic.span_s,
            "beyond_grid_rate": inputs.beyond_grid,
            "arrivals": inputs.traffic.arrivals,
            "completions": inputs.traffic.completions,
            "rate": inputs.traffic.rate,
        },
        "headroom": p.headroom,
        "attainment": p.attainment,
        "cells": [
            {
                "input_tokens": round(i, 1),
                "output_tokens": round(o, 1),
                "rate": p.rates[k],
                "tputs": {c.name: c.tputs[k] for c in p.candidates},
                "mix_tputs": {c.name: c.mix[k] for c in p.candidates},
                "share": {c.name: plan.share[k][j] for j, c in enumerate(p.candidates)},
                "unserved": plan.unserved[k],
                "exempt": plan.exempt[k],
                "servable": k not in plan.infeasible_cells,
            }
            for k, (i, o) in enumerate(inputs.cells)
        ],
        "candidates": [
            {
                "name": c.name,
                "cost": c.cost,
                "min_replicas": c.min_replicas,
                "max_replicas": c.max_replicas,
            }
            for c in p.candidates
        ],
    }
