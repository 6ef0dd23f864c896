"""HTTP side of the plugin: Prometheus /metrics, /healthz, /readyz and /debug/pods.

Metrics are read from the pool at scrape time by a custom collector, so the request path pays
nothing for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from plugin.adapters.extproc import ErrorCounts
from plugin.adapters.scraper import MetricsScraper
from plugin.core.pool import PodPool


class GatewayCollector(Collector):
    def __init__(self, pool: PodPool, errors: ErrorCounts, scraper: MetricsScraper) -> None:
        self._pool = pool
        self._errors = errors
        self._scraper = scraper

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["pod", "model"]
        routed = CounterMetricFamily(
            "hetero_gateway_routed_requests", "Requests routed to each pod.", labels=labels
        )
        tokens = CounterMetricFamily(
            "hetero_gateway_output_tokens",
            "Output tokens counted in responses from each pod.",
            labels=labels,
        )
        inflight = GaugeMetricFamily(
            "hetero_gateway_inflight_requests", "Requests in flight per pod.", labels=labels
        )
        capacity = GaugeMetricFamily(
            "hetero_gateway_pod_capacity_tokens_per_second",
            "Learned output tokens/s per pod (absent before the first estimate).",
            labels=labels,
        )
        scrape_errors = CounterMetricFamily(
            "hetero_gateway_engine_scrape_errors", "Failed engine /metrics scrapes.", labels=labels
        )
        for pod in self._pool.pods():
            values = [pod.key, pod.model]
            routed.add_metric(values, self._pool.routed_total(pod.key))
            tokens.add_metric(values, self._pool.output_tokens_total(pod.key))
            inflight.add_metric(values, self._pool.inflight(pod.key))
            estimate = self._pool.capacity(pod.key)
            if estimate is not None:
                capacity.add_metric(values, estimate)
            scrape_errors.add_metric(values, self._scraper.errors_total.get(pod.key, 0))
        errors = CounterMetricFamily(
            "hetero_gateway_request_errors",
            "Requests the plugin answered with an error itself.",
            labels=["status", "reason"],
        )
        for (status, reason), count in sorted(self._errors.counts.items()):
            errors.add_metric([str(status), reason], count)
        yield from (routed, tokens, inflight, capacity, scrape_errors, errors)


def build_app(
    pool: PodPool,
    errors: ErrorCounts,
    scraper: MetricsScraper,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    registry = CollectorRegistry()
    registry.register(GatewayCollector(pool, errors, scraper))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        if pool.loaded:
            return web.json_response({"status": "ready", "pods": len(pool.pods())})
        return web.json_response({"status": "waiting for pod discovery"}, status=503)

    async def debug_pods(_: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(pool.snapshot(clock())), content_type="application/json"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/pods", debug_pods)
    return app
