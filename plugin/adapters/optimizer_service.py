"""The GPU optimizer service: traced traffic + GPU profiles -> replicas per deployment, over HTTP.

Every 10 s, 2 s after a trace window closes (the gateways flush just after the boundary), it
lists each model's deployments, reads the last `lookback` seconds of trace windows from Redis,
builds the model's problem (`plugin.core.workload`), solves it off the event loop
(`plugin.core.optimizer`, SciPy's HiGHS) and passes each deployment's count through the
scale-down gate. AIBrix's PodAutoscaler reads the result from `GET /metrics/<ns>/<deployment>`
as `vllm:deployment_replicas{model_name="<m>"} <replicas x 100>` (1/100-GPU units, paired with
`targetValue: "100"`).

What it answers for a monitored deployment: an operator's override (`PUT /scale`) wins over the
plan; a deployment without a profile, or before the first plan, gets what it runs now
(the autoscaler holds it steady). Failures degrade, never flap: deployments that cannot be
listed keep the last list; traces that cannot be read keep the last plan (an outage of Redis must
not look like an idle fleet and scale everything to its minimum).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from redis.exceptions import RedisError

from plugin.adapters.discovery import load_pods_file
from plugin.adapters.profiles import DirectoryProfiles, ProfileLoader, RedisProfiles
from plugin.adapters.redis_state import connect
from plugin.config import OptimizerSettings, RedisSettings, Settings
from plugin.core.optimizer import Plan, ScaleDownGate, solve
from plugin.core.profile import GpuProfile, ProfileBook
from plugin.core.trace import TRACE_INTERVAL_S, TraceWindow, trace_key, window_start
from plugin.core.workload import Deployment, ModelProblem, build_problem, traffic
from plugin.errors import ConfigError, GatewayError, OptimizerInputError, TraceFormatError

log = logging.getLogger(__name__)

__all__ = [
    "MIN_REPLICAS_LABEL",
    "MODEL_LABEL",
    "DeploymentSource",
    "KubernetesDeployments",
    "Optimizer",
    "PodsFileDeployments",
    "RedisTraces",
    "UnknownDeployment",
    "build_app",
    "replicas_text",
]

MODEL_LABEL = "model.aibrix.ai/name"
MIN_REPLICAS_LABEL = "model.aibrix.ai/min_replicas"
READ_DELAY_S = 2.0  # after a window closes: the gateways flush it just after the boundary
TRACE_READ_TIMEOUT_S = 5.0
REPLICA_UNITS = 100  # AIBrix's PodAutoscaler: targetValue "100" = one replica


class UnknownDeployment(GatewayError, LookupError):
    """The request names a deployment the optimizer does not know (or no longer monitors)."""


# --- where deployments come from -----------------------------------------------------------------


class DeploymentSource(Protocol):
    where: str

    async def fetch(self) -> list[Deployment]: ...


def _min_replicas(labels: Mapping[str, str], where: str) -> int:
    raw = labels.get(MIN_REPLICAS_LABEL)
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        log.warning("%s: label %s=%r is not a count; using 0", where, MIN_REPLICAS_LABEL, raw)
        return 0
    return value


class KubernetesDeployments:
    """Deployments labelled `model.aibrix.ai/name`, listed through the official client (in a
    thread: the client is synchronous) once per optimization round."""

    def __init__(self, namespaces: Sequence[str] = (), configuration: Any = None) -> None:
        """`configuration`: a `kubernetes.client.Configuration`; None loads the in-cluster one,
        else the kubeconfig (ConfigError when neither loads)."""
        from kubernetes import client

        from plugin.adapters.kubernetes import load_client_configuration

        cfg = configuration if configuration is not None else load_client_configuration()
        self._api = client.AppsV1Api(client.ApiClient(cfg))
        self._namespaces = tuple(namespaces)
        self.where = "the Kubernetes API"

    async def fetch(self) -> list[Deployment]:
        return await asyncio.to_thread(self._list)

    def _list(self) -> list[Deployment]:
        if self._namespaces:
            items = [
                d
                for ns in self._namespaces
                for d in self._api.list_namespaced_deployment(
                    ns, label_selector=MODEL_LABEL, _request_timeout=10
                ).items
            ]
        else:
            items = self._api.list_deployment_for_all_namespaces(
                label_selector=MODEL_LABEL, _request_timeout=10
            ).items
        found = []
        for d in items:
            meta, spec = d.metadata, d.spec
            if meta is None or not meta.name or not meta.namespace:
                continue
            labels = dict(meta.labels or {})
            if not labels.get(MODEL_LABEL):
                continue
            replicas = spec.replicas if spec is not None else None
            found.append(
                Deployment(
                    namespace=meta.namespace,
                    name=meta.name,
                    model=labels[MODEL_LABEL],
                    # Kubernetes' default when the field is unset.
                    replicas=int(replicas) if replicas is not None else 1,
                    min_replicas=_min_replicas(labels, f"deployment {meta.namespace}/{meta.name}"),
                )
            )
        return found


class PodsFileDeployments:
    """The deployments the pods file names: each distinct (namespace, deployment label, model)
    is one, running as many replicas as it has pods; `model.aibrix.ai/min_replicas` may be set
    on its pods' labels. Pods without the deployment label belong to no deployment."""

    def __init__(self, path: str, deployment_label: str) -> None:
        self.path = path
        self.deployment_label = deployment_label
        self.where = path

    async def fetch(self) -> list[Deployment]:
        pods = await asyncio.to_thread(load_pods_file, self.path, self.deployment_label)
        groups: dict[tuple[str, str, str], list[Mapping[str, str]]] = {}
        for pod in pods:
            if pod.deployment is not None:
                groups.setdefault((pod.namespace, pod.deployment, pod.model), []).append(pod.labels)
        return [
            Deployment(
                namespace=ns,
                name=name,
                model=model,
                replicas=len(labels),
                min_replicas=max(_min_replicas(lb, f"{self.path}: {ns}/{name}") for lb in labels),
            )
            for (ns, name, model), labels in sorted(groups.items())
        ]


# --- where traces come from ----------------------------------------------------------------------


class RedisTraces:
    """Reads a model's closed trace windows of the look-back with one MGET, within
    `timeout_s` and without client retries (a dead Redis costs a round one timeout, not a
    minute of retries per model)."""

    def __init__(self, settings: RedisSettings, timeout_s: float = TRACE_READ_TIMEOUT_S) -> None:
        self._client = connect(settings, timeout_s)
        self._timeout_s = timeout_s
        self.where = f"Redis {settings.host}:{settings.port}/{settings.db}"

    async def windows(self, model: str, now: float, lookback_s: float) -> list[TraceWindow]:
        last = window_start(now) - TRACE_INTERVAL_S  # the newest closed window
        starts = [last - k * TRACE_INTERVAL_S for k in range(int(lookback_s // TRACE_INTERVAL_S))]
        async with asyncio.timeout(self._timeout_s):
            raws = await self._client.mget([trace_key(model, s) for s in starts])
        found = []
        for start, raw in zip(starts, raws, strict=True):
            if raw is None:
                continue  # nothing traced then: gateways write nothing for an empty window
            try:
                found.append(TraceWindow.parse(model, start, orjson.loads(raw)))
            except (orjson.JSONDecodeError, TraceFormatError) as exc:
                log.warning("ignoring trace window %s: %s", trace_key(model, start), exc)
        return found

    async def close(self) -> None:
        await self._client.aclose()


class TraceSource(Protocol):
    where: str

    async def windows(self, model: str, now: float, lookback_s: float) -> list[TraceWindow]: ...


# --- the optimizer's state -----------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    deployment: Deployment
    planned: int | None = None  # the last plan's count, after the scale-down gate
    override: int | None = None  # an operator's PUT /scale
    monitored: bool = True


class _Metrics:
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
        self.metrics = _Metrics()
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
            model, deployments, profiles, load, headroom=s.headroom, caps=s.max_replicas
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
        "cells": [
            {
                "input_tokens": round(i, 1),
                "output_tokens": round(o, 1),
                "rate": p.rates[k],
                "tputs": {c.name: c.tputs[k] for c in p.candidates},
                "mix_tputs": {c.name: c.mix[k] for c in p.candidates},
                "share": {c.name: plan.share[k][j] for j, c in enumerate(p.candidates)},
                "unserved": plan.unserved[k],
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


# --- HTTP ----------------------------------------------------------------------------------------


def replicas_text(model: str, replicas: int) -> str:
    """AIBrix's optimizer's answer, in 1/100-GPU units."""
    escaped = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return (
        "# HELP vllm:deployment_replicas Number of suggested replicas.\n"
        "# TYPE vllm:deployment_replicas gauge\n"
        f'vllm:deployment_replicas{{model_name="{escaped}"}} {replicas * REPLICA_UNITS}\n'
    )


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": message}, status=status, dumps=lambda o: orjson.dumps(o).decode()
    )


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS),
        status=status,
        content_type="application/json",
    )


def build_app(optimizer: Optimizer) -> web.Application:
    routes = web.RouteTableDef()

    def where(request: web.Request) -> tuple[str, str]:
        return request.match_info["namespace"], request.match_info["deployment"]

    @routes.get("/healthz")
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    @routes.get("/metrics")
    async def own_metrics(_: web.Request) -> web.Response:
        body = generate_latest(optimizer.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @routes.get("/metrics/{namespace}/{deployment}")
    async def deployment_replicas(request: web.Request) -> web.Response:
        try:
            model, replicas = optimizer.replicas(*where(request))
        except UnknownDeployment as exc:
            return _error(404, str(exc))
        return web.Response(
            text=replicas_text(model, replicas), content_type="text/plain", charset="utf-8"
        )

    @routes.get("/debug/plan")
    async def debug_plan(_: web.Request) -> web.Response:
        return _json(optimizer.debug())

    @routes.put("/scale/{namespace}/{deployment}")
    async def scale(request: web.Request) -> web.Response:
        try:
            doc = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, 'body must be JSON: {"replicas": N} (N >= 0, or -1 to clear)')
        replicas = doc.get("replicas") if isinstance(doc, dict) else None
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < -1:
            return _error(
                400, f'"replicas" must be an integer >= 0, or -1 to clear; got {replicas!r}'
            )
        try:
            optimizer.set_override(*where(request), None if replicas == -1 else replicas)
        except UnknownDeployment as exc:
            return _error(404, str(exc))
        ns, name = where(request)
        if replicas == -1:
            return _json({"message": f"override of {ns}/{name} cleared"})
        return _json({"message": f"{ns}/{name} held at {replicas} replicas"})

    @routes.post("/monitor/{namespace}/{deployment}")
    async def monitor(request: web.Request) -> web.Response:
        return await _monitor(request, True)

    @routes.delete("/monitor/{namespace}/{deployment}")
    async def unmonitor(request: web.Request) -> web.Response:
        return await _monitor(request, False)

    async def _monitor(request: web.Request, on: bool) -> web.Response:
        ns, name = where(request)
        if not optimizer.knows(ns, name):
            # Not listed yet: list again before answering (a deployment created a moment ago).
            await optimizer.refresh_deployments()
        try:
            changed = optimizer.set_monitored(ns, name, on)
        except UnknownDeployment as exc:
            return _error(404, str(exc))
        return _json({"message": _monitor_message(changed, on)})

    @routes.get("/update_profile/{model}")
    async def update_profile(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not optimizer.knows_model(model):
            return _error(404, f"model {model} is not monitored")
        if optimizer.profiles is None or not await optimizer.profiles.load_once():
            return _error(500, f"failed to update the GPU profiles of {model}")
        return _json({"message": f"GPU profiles of {model} updated"})

    app = web.Application()
    app.add_routes(routes)
    return app


def _monitor_message(changed: bool, on: bool) -> str:
    if on:
        return "deployment optimization started" if changed else "deployment already optimized"
    return "deployment optimization stopped" if changed else "deployment was not optimized"


# --- running it ----------------------------------------------------------------------------------


class OptimizerService:
    """The running service: the optimization loop, the profile loader and the HTTP server."""

    def __init__(
        self, settings: Settings, source: DeploymentSource | None = None, host: str = "0.0.0.0"
    ) -> None:
        if settings.redis is None:
            raise ConfigError(
                "the optimizer reads the gateways' request traces from Redis: set REDIS_HOST"
            )
        if importlib.util.find_spec("scipy") is None:
            raise ConfigError(
                "the optimizer solves with SciPy: pip install 'hetero-gateway[optimizer]'"
            )
        self.settings = settings
        self.host = host
        self.book = ProfileBook()
        self.profiles: ProfileLoader = (
            DirectoryProfiles(self.book, settings.profile_dir)
            if settings.profile_dir is not None
            else RedisProfiles(self.book, settings.redis)
        )
        self.traces = RedisTraces(settings.redis)
        self.optimizer = Optimizer(
            settings.optimizer,
            source if source is not None else deployment_source(settings),
            self.traces,
            self.book,
            self.profiles,
        )
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.profiles.load_once()
        await self.optimizer.refresh_deployments()  # so /metrics answers before the first plan
        self._runner = web.AppRunner(build_app(self.optimizer), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.settings.optimizer.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("GPU optimizer listening on %s:%d", self.host, self.port)
        self._tasks = [
            asyncio.create_task(self.profiles.run(), name="profiles"),
            asyncio.create_task(self.optimizer.run(), name="optimizer"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        await self.profiles.close()
        await self.traces.close()


def deployment_source(settings: Settings) -> DeploymentSource:
    """Deployments from the Kubernetes API, or the ones the pods file names."""
    if settings.discovery == "kubernetes":
        return KubernetesDeployments(settings.k8s_namespaces)
    if not settings.pods_file:
        raise ConfigError(
            "no deployments: pass --pods FILE or set HETERO_GATEWAY_PODS_FILE"
            " (or use --discovery kubernetes)"
        )
    return PodsFileDeployments(settings.pods_file, settings.deployment_label)


async def run_until_signal(service: OptimizerService) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        await stop.wait()
    finally:
        await service.stop()
