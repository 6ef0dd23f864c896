"""HTTP side of the plugin: Prometheus /metrics, /healthz, /readyz and /debug/pods.

Metrics are read from the pool and the router at scrape time by a custom collector, so the
request path pays nothing for them but the histograms' increments (`plugin.core.latency`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from plugin.adapters.extproc import ErrorCounts
from plugin.adapters.profiles import ProfileLoader
from plugin.adapters.scraper import UNREACHABLE, UNUSABLE, MetricsScraper
from plugin.core.admission import Admission
from plugin.core.drift import BeyondGrid, ProfileDrift, cell_label
from plugin.core.latency import ClientLatency, Histogram, SloOutcomes
from plugin.core.pool import PodPool
from plugin.core.router import PredictionStats, WaitStats


class SharedStateView(Protocol):
    """What the HTTP side reads of the shared-state sync (`RedisState`), when there is one."""

    @property
    def up(self) -> bool: ...

    @property
    def sync_errors_total(self) -> int: ...

    @property
    def other_gateways(self) -> int: ...

    def status(self) -> dict[str, Any]: ...


class TracingView(Protocol):
    """What the HTTP side reads of request tracing (`TraceFlusher`), when it is on."""

    @property
    def flush_errors_total(self) -> int: ...

    @property
    def windows_dropped_total(self) -> int: ...

    def status(self) -> dict[str, Any]: ...


def _add(family: HistogramMetricFamily, labels: list[str], data: Histogram) -> None:
    bounds = [floatToGoString(b) for b in data.bounds]  # type: ignore[no-untyped-call]
    buckets = [(b, c) for b, c in zip(bounds, data.cumulative(), strict=True)]
    buckets.append(("+Inf", data.count))
    family.add_metric(labels, buckets, data.total)


def queue_families(
    waits: WaitStats, predictions: PredictionStats | None = None
) -> Iterator[Metric]:
    """The gateway queue's wait-time histogram (rejections are request errors, by class) and how
    SLO-routed requests' latency compared with their profiles' predictions."""
    wait = HistogramMetricFamily(
        "hetero_gateway_wait_seconds",
        "How long requests held at the gateway waited, by outcome (routed or rejected).",
        labels=["outcome"],
    )
    for routed, outcome in ((True, "routed"), (False, "rejected")):
        _add(wait, [outcome], waits.by_outcome[routed])
    yield wait
    if predictions is None:
        return
    ratio = HistogramMetricFamily(
        "hetero_gateway_slo_e2e_ratio",
        "Actual / predicted end-to-end latency of SLO-routed requests (routing decision to "
        "response end, over the GPU profile's E2E for the request's size), by deployment.",
        labels=["deployment"],
    )
    for deployment, data in sorted(predictions.ratios.items()):
        _add(ratio, [deployment], data)
    yield ratio


_LATENCY_FAMILIES = (
    (
        "ttft",
        "hetero_gateway_time_to_first_token_seconds",
        "Time from the request's arrival at the gateway to its first streamed token, per pod"
        " (responses with SSE events, status 200).",
    ),
    (
        "tpot",
        "hetero_gateway_time_per_output_token_seconds",
        "Per request, the mean gap between output tokens after the first: (last event - first"
        " event) / (output tokens - 1), per pod.",
    ),
    (
        "e2e",
        "hetero_gateway_e2e_request_latency_seconds",
        "Time from the request's arrival at the gateway to the end of its response, per pod"
        " (status 200).",
    ),
    (
        "tokens",
        "hetero_gateway_request_output_tokens",
        "Output tokens per response (the engine's usage, else the SSE events), per pod.",
    ),
)


class LatencyView(NamedTuple):
    """What the HTTP side reads of the router's latency records (`plugin.core.latency`)."""

    clients: ClientLatency
    decision_time: Histogram
    slo_outcomes: SloOutcomes


def latency_families(view: LatencyView) -> Iterator[Metric]:
    """Latency as clients feel it, per pod (`plugin.core.latency`; sum by deployment for a GPU
    type's), the gateway's own time to decide, and requests with an SLO by outcome."""
    outcomes = CounterMetricFamily(
        "hetero_gateway_slo_requests",
        "Requests with an SLO (their own x-slo-* headers, or routed by an SLO strategy by a GPU"
        " profile's), by outcome: met, late (served, a target missed; as the client felt it)"
        " or rejected (deployment empty).",
        labels=["model", "deployment", "outcome"],
    )
    for (model, deployment, outcome), count in sorted(view.slo_outcomes.counts.items()):
        outcomes.add_metric([model, deployment, outcome], count)
    yield outcomes
    latency, decision_time = view.clients, view.decision_time
    decisions = HistogramMetricFamily(
        "hetero_gateway_routing_decision_seconds",
        "The routing stream's time from a request's whole body to its decision (parse, strategy,"
        " pick; a held request: until it was held, its wait is hetero_gateway_wait_seconds).",
        labels=[],
    )
    _add(decisions, [], decision_time)
    yield decisions
    labels = ["pod", "model", "deployment"]
    for attr, name, what in _LATENCY_FAMILIES:
        family = HistogramMetricFamily(name, what, labels=labels)
        for key, pod in sorted(latency.pods.items()):
            pod_label = key if latency.per_pod else ""
            _add(family, [pod_label, pod.model, pod.deployment], getattr(pod, attr))
        yield family


def profile_families(beyond: BeyondGrid, drift: ProfileDrift) -> Iterator[Metric]:
    """GPU profiles against served traffic (`plugin.core.drift`): requests beyond a profile's
    grid, and each cell's drift ratio with the requests it rests on."""
    above = CounterMetricFamily(
        "hetero_gateway_slo_beyond_profile_requests",
        "SLO-routed requests whose size lies more than half a doubling above the GPU profile's"
        " grid, routed at its border cell, by model and axis (input or output; a request above"
        " both counts on each).",
        labels=["model", "axis"],
    )
    for (model, axis), count in sorted(beyond.counts.items()):
        above.add_metric([model, axis], count)
    yield above
    labels = ["model", "deployment", "cell"]
    ratio = GaugeMetricFamily(
        "hetero_gateway_profile_drift_ratio",
        "Mean actual over mean predicted E2E of the served requests an SLO strategy routed by"
        " this GPU profile cell (out=<output tick>,in=<input tick>), over about its last 50;"
        " predicted at the pod's load when routed. Above 2 or below 0.5: sweep again.",
        labels=labels,
    )
    requests = GaugeMetricFamily(
        "hetero_gateway_profile_drift_requests",
        "Requests the drift ratio of this GPU profile cell counted since the profile was loaded.",
        labels=labels,
    )
    for (model, deployment, out_tick, in_tick), cell in sorted(drift.cells.items()):
        values = [model, deployment, cell_label(out_tick, in_tick)]
        ratio.add_metric(values, cell.ratio)
        requests.add_metric(values, cell.requests)
    yield ratio
    yield requests


class AdmissionCollector(Collector):
    """Admission's figures (`plugin.core.admission`), when it is on."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        admission = self._admission
        used = CounterMetricFamily(
            "hetero_gateway_tenant_gpu_seconds",
            "GPU time the tenant's finished requests took, priced at the serving replica's speeds"
            " (its GPU profile's, else its learned throughput); beyond 1,000 tenants a model, the"
            " others as (other).",
            labels=["model", "tenant"],
        )
        for (model, tenant), value in sorted(admission.gpu_seconds.items()):
            used.add_metric([model, tenant], value)
        yield used
        shed = CounterMetricFamily(
            "hetero_gateway_admission_shed_requests",
            "Requests admission refused with 503, by class and why: timeout (waited the limit),"
            " displaced (a higher class took its place in a full queue), full (the queue was"
            " full of its class or higher).",
            labels=["model", "class", "reason"],
        )
        for (model, name, why), count in sorted(admission.shed.items()):
            shed.add_metric([model, name, why], count)
        yield shed
        queued = GaugeMetricFamily(
            "hetero_gateway_admission_waiting_requests",
            "Requests waiting for room in admission's queue, by class.",
            labels=["model", "class"],
        )
        for (model, name), count in sorted(admission.waiting_by_class().items()):
            queued.add_metric([model, name], count)
        yield queued
        limits = admission.limits
        if limits is not None:
            refused = CounterMetricFamily(
                "hetero_gateway_rate_limited_requests",
                "Requests refused with 429 because they would take their tenant past a rate limit"
                " (requests, tokens or gpu-seconds a minute); beyond 3,000 series, the tenants as"
                " (other).",
                labels=["tenant", "limit"],
            )
            for (tenant, kind), count in sorted(limits.refused.items()):
                refused.add_metric([tenant, kind], count)
            yield refused


class GatewayCollector(Collector):
    def __init__(
        self,
        pool: PodPool,
        errors: ErrorCounts,
        scraper: MetricsScraper,
        shared: SharedStateView | None = None,
        waiting: Callable[[], Mapping[str, int]] = dict,
        waits: WaitStats | None = None,
        predictions: PredictionStats | None = None,
        tracing: TracingView | None = None,
        imbalance: Callable[[], Mapping[str, int]] = dict,
        prefix_cache: Callable[[], Mapping[str, tuple[int, int, int]]] = dict,
        beyond: BeyondGrid | None = None,
        drift: ProfileDrift | None = None,
        latency: LatencyView | None = None,
    ) -> None:
        self._pool = pool
        self._latency = latency
        self._beyond = beyond
        self._drift = drift
        self._prefix_cache = prefix_cache
        self._tracing = tracing
        self._imbalance = imbalance
        self._waiting = waiting
        self._waits = waits
        self._predictions = predictions
        self._errors = errors
        self._scraper = scraper
        self._shared = shared

    def collect(self) -> Iterator[Metric]:
        labels = ["pod", "model"]
        routed = CounterMetricFamily(
            "hetero_gateway_routed_requests", "Requests routed to each pod.", labels=labels
        )
        tokens = CounterMetricFamily(
            "hetero_gateway_output_tokens",
            "Output tokens counted in responses from each pod; source: reported (the engine's"
            " usage) or estimated (no usage in the response: SSE events or text length).",
            labels=[*labels, "source"],
        )
        inflight = GaugeMetricFamily(
            "hetero_gateway_inflight_requests",
            "Requests this gateway has in flight per pod.",
            labels=labels,
        )
        remote = GaugeMetricFamily(
            "hetero_gateway_remote_inflight_requests",
            "Requests other gateway replicas have in flight per pod (as last synced).",
            labels=labels,
        )
        info = GaugeMetricFamily(
            "hetero_gateway_pod_info",
            "Always 1; the pod's GPU type (value of the configured GPU label, empty if absent).",
            labels=[*labels, "gpu"],
        )
        capacity = GaugeMetricFamily(
            "hetero_gateway_pod_capacity_tokens_per_second",
            "Learned output tokens/s per pod (absent before the first estimate).",
            labels=labels,
        )
        scrape_errors = CounterMetricFamily(
            "hetero_gateway_engine_scrape_errors",
            "Failed engine /metrics scrapes by cause: unreachable (refused, reset or timed out: "
            "out of rotation) or unusable (answered with no usable page: kept in rotation).",
            labels=[*labels, "cause"],
        )
        health = GaugeMetricFamily(
            "hetero_gateway_engine_health",
            "1 for the pod's state as its last scrape showed it (up, unusable: answered with no "
            "usable metrics page, routed by the gateway's own counts; unreachable: out of "
            "rotation), 0 for the others.",
            labels=[*labels, "state"],
        )
        for pod in self._pool.pods():
            values = [pod.key, pod.model]
            routed.add_metric(values, self._pool.routed_total(pod.key))
            estimated = self._pool.estimated_tokens_total(pod.key)
            tokens.add_metric(
                [*values, "reported"], self._pool.output_tokens_total(pod.key) - estimated
            )
            tokens.add_metric([*values, "estimated"], estimated)
            inflight.add_metric(values, self._pool.inflight(pod.key))
            remote.add_metric(values, self._pool.remote_inflight(pod.key))
            info.add_metric([*values, pod.deployment or ""], 1)
            estimate = self._pool.capacity(pod.key)
            if estimate is not None:
                capacity.add_metric(values, estimate)
            for cause in (UNREACHABLE, UNUSABLE):
                failed = self._scraper.errors_total.get((pod.key, cause), 0)
                scrape_errors.add_metric([*values, cause], failed)
            state = (
                UNREACHABLE
                if self._pool.unreachable(pod.key)
                else UNUSABLE
                if self._pool.metrics_unusable(pod.key) is not None
                else "up"
            )
            for name in ("up", UNUSABLE, UNREACHABLE):
                health.add_metric([*values, name], 1.0 if name == state else 0.0)
        errors = CounterMetricFamily(
            "hetero_gateway_request_errors",
            "Requests the plugin answered with an error itself.",
            labels=["status", "reason"],
        )
        for (status, reason), count in sorted(self._errors.counts.items()):
            errors.add_metric([str(status), reason], count)
        held = GaugeMetricFamily(
            "hetero_gateway_waiting_requests",
            "Requests a strategy holds at the gateway until a replica can take them, per model.",
            labels=["model"],
        )
        counts = self._waiting()
        for model in sorted(set(self._pool.models()) | set(counts)):
            held.add_metric([model], counts.get(model, 0))
        gated = CounterMetricFamily(
            "hetero_gateway_load_imbalance",
            "Requests the load-imbalance gate routed itself, per model (AIBrix's"
            " aibrix_load_imbalance_total).",
            labels=["model"],
        )
        fired = self._imbalance()
        for model in sorted(set(self._pool.models()) | set(fired)):
            gated.add_metric([model], fired.get(model, 0))
        yield from (routed, tokens, inflight, remote, capacity, scrape_errors, health, errors)
        yield from (info, held)
        yield gated
        prefix = self._prefix_cache()
        if prefix:
            for i, (name, what) in enumerate(
                (
                    ("requests", "Requests routed with prefix-cache (alone or blended)."),
                    ("prompt_blocks", "Whole prompt blocks of those requests."),
                    (
                        "matched_blocks",
                        "Of those, blocks the chosen replica was sent before:"
                        " matched / prompt is the prefix-cache hit rate.",
                    ),
                )
            ):
                family = CounterMetricFamily(
                    f"hetero_gateway_prefix_cache_{name}", what, labels=["model"]
                )
                for model, per_model in sorted(prefix.items()):
                    family.add_metric([model], per_model[i])
                yield family
        if self._latency is not None:
            yield from latency_families(self._latency)
        if self._waits is not None:
            yield from queue_families(self._waits, self._predictions)
        if self._beyond is not None and self._drift is not None:
            yield from profile_families(self._beyond, self._drift)
        if self._shared is not None:
            yield GaugeMetricFamily(
                "hetero_gateway_shared_state_up",
                "1 while state is shared through Redis, 0 while this gateway routes on local"
                " state only.",
                value=1 if self._shared.up else 0,
            )
            yield CounterMetricFamily(
                "hetero_gateway_shared_state_sync_errors",
                "Shared-state round trips to Redis that failed or timed out.",
                value=self._shared.sync_errors_total,
            )
            yield GaugeMetricFamily(
                "hetero_gateway_shared_state_other_gateways",
                "Other gateway replicas whose in-flight counts the last sync read.",
                value=self._shared.other_gateways,
            )
        if self._tracing is not None:
            yield CounterMetricFamily(
                "hetero_gateway_trace_flush_errors",
                "Request-trace flushes to Redis that failed (their windows are retried).",
                value=self._tracing.flush_errors_total,
            )
            yield CounterMetricFamily(
                "hetero_gateway_trace_windows_dropped",
                "Request-trace windows dropped unwritten after 600 s of failed flushes.",
                value=self._tracing.windows_dropped_total,
            )


def debug_pods(
    pool: PodPool,
    now: float,
    shared: SharedStateView | None = None,
    waiting: Mapping[str, int] | None = None,
    profiles: ProfileLoader | None = None,
    tracing: TracingView | None = None,
    drift: ProfileDrift | None = None,
) -> dict[str, Any]:
    """The pool's snapshot, each pod's GPU type and whether its deployment has a GPU profile,
    held requests, the shared-state and tracing status, the profiles known and how their
    cells compare with served traffic."""
    doc = pool.snapshot(now)
    for entry in doc["pods"].values():
        entry["gpu"] = entry["deployment"]  # the GPU type: AIBRIX_POD_DEPLOYMENT_LABEL
        entry["profile"] = (
            profiles is not None
            and profiles.book.lookup(entry["model"], entry["deployment"]) is not None
        )
    doc["waiting"] = dict(waiting or {})
    doc["shared_state"] = {"mode": "off"} if shared is None else shared.status()
    doc["profiles"] = {"source": "none"} if profiles is None else profiles.status()
    doc["tracing"] = {"mode": "off"} if tracing is None else tracing.status()
    doc["profile_drift"] = {} if drift is None else drift.snapshot()
    return doc


def build_app(
    pool: PodPool,
    errors: ErrorCounts,
    scraper: MetricsScraper,
    clock: Callable[[], float] = time.monotonic,
    *,
    shared: SharedStateView | None = None,
    draining: Callable[[], bool] = lambda: False,
    waiting: Callable[[], Mapping[str, int]] = dict,
    profiles: ProfileLoader | None = None,
    waits: WaitStats | None = None,
    predictions: PredictionStats | None = None,
    tracing: TracingView | None = None,
    imbalance: Callable[[], Mapping[str, int]] = dict,
    prefix_cache: Callable[[], Mapping[str, tuple[int, int, int]]] = dict,
    beyond: BeyondGrid | None = None,
    drift: ProfileDrift | None = None,
    latency: LatencyView | None = None,
    admission: Admission | None = None,
) -> web.Application:
    registry = CollectorRegistry()
    if admission is not None:
        registry.register(AdmissionCollector(admission))
    registry.register(
        GatewayCollector(
            pool,
            errors,
            scraper,
            shared,
            waiting,
            waits,
            predictions,
            tracing,
            imbalance,
            prefix_cache,
            beyond,
            drift,
            latency,
        )
    )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        if draining():
            return web.json_response({"status": "draining"}, status=503)
        if not pool.loaded:
            return web.json_response({"status": "waiting for pod discovery"}, status=503)
        if not scraper.first_round.is_set():
            return web.json_response({"status": "waiting for the first metrics scrape"}, status=503)
        return web.json_response({"status": "ready", "pods": len(pool.pods())})

    async def pods(_: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(
                debug_pods(pool, clock(), shared, waiting(), profiles, tracing, drift)
            ),
            content_type="application/json",
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/pods", pods)
    return app
