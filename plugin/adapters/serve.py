"""`hetero-gateway serve`: wires config, discovery, scraper, gRPC and HTTP together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from plugin.adapters.discovery import PodsCallback, PodSource, StaticFileSource
from plugin.adapters.extproc import ExtProcServicer
from plugin.adapters.extproc.locks import HeaderLock
from plugin.adapters.http import LatencyView, build_app
from plugin.adapters.native_memory import MemoryTrimmer
from plugin.adapters.profiles import DirectoryProfiles, ProfileLoader, RedisProfiles
from plugin.adapters.scraper import MetricsScraper
from plugin.config import GRPC_PORT, HTTP_PORT, Settings, Var
from plugin.core.admission import Admission
from plugin.core.auth import BearerToken
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.prefix import PrefixIndex
from plugin.core.profile import ProfileBook
from plugin.core.router import Router
from plugin.core.scrape_share import ScrapeShares
from plugin.core.strategies import Strategy, build_strategies
from plugin.core.strategies.gate import ImbalanceGate
from plugin.core.strategies.prefix_cache import PrefixCache, prefix_stats
from plugin.core.types import Pod
from plugin.errors import ConfigError, ShuttingDown

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from plugin.adapters.otel import RequestSpans
    from plugin.adapters.redis_state import RedisState
    from plugin.adapters.tracing import TraceFlusher

log = logging.getLogger("hetero_gateway")


def _log_warning(message: str) -> None:
    log.warning("%s", message)


class MergedSource:
    """Several pod sources as one (Kubernetes discovery of several namespaces).

    Delivers the union of their latest lists once every source has delivered (so the first
    delivery, which marks readiness, has every namespace), then on every change. `dedupe` keeps
    one pod per IP:PORT across the sources.
    """

    def __init__(
        self,
        sources: Sequence[PodSource],
        dedupe: Callable[[list[Pod]], list[Pod]] | None = None,
    ) -> None:
        self.sources = list(sources)
        self._dedupe = dedupe

    async def run(self, on_update: PodsCallback) -> None:
        latest: dict[int, list[Pod]] = {}

        def receiver(index: int) -> PodsCallback:
            def receive(pods: list[Pod]) -> None:
                latest[index] = pods
                if len(latest) == len(self.sources):
                    merged = [p for i in sorted(latest) for p in latest[i]]
                    on_update(self._dedupe(merged) if self._dedupe else merged)

            return receive

        async with asyncio.TaskGroup() as group:
            for i, source in enumerate(self.sources):
                group.create_task(source.run(receiver(i)))


def build_source(settings: Settings) -> PodSource:
    """The pod source the settings choose; ConfigError when it cannot start."""
    if settings.discovery == "kubernetes":
        # Imported only when chosen: the client is heavy and file discovery does not need it.
        from plugin.adapters.kubernetes import (
            KubernetesSource,
            load_client_configuration,
            unique_endpoints,
        )

        configuration = load_client_configuration()
        namespaces: Sequence[str | None] = settings.k8s_namespaces or (None,)
        sources = [
            KubernetesSource(
                ns,
                settings.k8s_label_selector,
                configuration,
                deployment_label=settings.deployment_label,
            )
            for ns in namespaces
        ]
        return sources[0] if len(sources) == 1 else MergedSource(sources, unique_endpoints)
    if not settings.pods_file:
        raise ConfigError(
            "no pod source: pass --pods FILE or set HETERO_GATEWAY_PODS_FILE"
            " (or use --discovery kubernetes)"
        )
    return StaticFileSource(settings.pods_file, deployment_label=settings.deployment_label)


class Gateway:
    """A running plugin: gRPC ext_proc + health, HTTP endpoints, discovery and scraping."""

    def __init__(
        self,
        settings: Settings,
        source: PodSource,
        host: str = "0.0.0.0",
        strategies: Mapping[str, Strategy] | None = None,
    ) -> None:
        """`strategies` replaces the registered ones (built from `settings`) when given: an
        embedding program, or a test, can route with strategies of its own."""
        self.settings = settings
        self.source = source
        self.host = host
        self.pool = PodPool(
            CapacityEstimator(settings.capacity_window_s, settings.capacity_tau_s),
            settings.metrics_max_age_s,
            settings.ejection,
            slow_start_s=settings.slow_start_s,
            slow_start_min=settings.slow_start_min,
        )
        # GPU profiles (SLO routing): from the directory when one is set, else from Redis.
        self.profiles = ProfileBook()
        self.pool.use_profiles(self.profiles)
        if strategies is None:
            strategies = build_strategies(*settings.strategy_settings())
        self._prefix_cache = strategies.get("prefix-cache")  # its hit counts are metrics
        self.router = Router(
            self.pool,
            strategies,
            settings.default_strategy,
            random.Random(),
            time.monotonic,
            max_waiting=settings.max_waiting,
            auto_blend=settings.auto_blend,
            gate=None if settings.imbalance is None else ImbalanceGate(settings.imbalance),
            admission=None if settings.admission is None else Admission(settings.admission),
            wall_clock=time.time,  # rate-limit windows line up across gateway replicas
        )
        # What the core says an operator should hear (a request beyond a GPU profile's grid, a
        # profile cell off from served traffic), logged here: the core does no I/O.
        self.router.on_warning = _log_warning
        self.router.latency.per_pod = settings.pod_latency
        # Request traces for the GPU optimizer: counted on the request path, written to Redis
        # every 10 s by a background task (the flag without Redis stops start-up in config).
        self.tracer: TraceFlusher | None = None
        if settings.tracing and settings.redis is not None:
            from plugin.adapters.tracing import TraceFlusher, TraceRecorder

            self.tracer = TraceFlusher(
                TraceRecorder(),
                settings.redis,
                queueing=self.router.waiting_by_model,
                clock=self.router.now,  # what a request's `arrived_at` is measured on
            )
        # A held request's reply may take up to the longest hold; 1 s more covers the answer.
        longest_hold = settings.slo.max_wait_s
        if settings.admission is not None:
            waits = settings.admission.class_max_wait_s.values()
            longest_hold = max(longest_hold, settings.admission.max_wait_s, *waits)
        self.servicer = ExtProcServicer(
            self.router,
            longest_hold + 1.0,
            settings.max_request_headers,
            tracer=None if self.tracer is None else self.tracer.recorder,
            auth=None
            if not settings.auth_bearer_token
            else BearerToken(settings.auth_bearer_token),
            lock=HeaderLock(settings.client_headers, settings.denied_header_action),
            # Without Redis replicas cannot hand counts over: no name, no lease header to take.
            gateway_id="" if settings.redis is None else settings.redis.gateway_id,
            otel=self._otel_spans(settings.otel),
        )
        self.scraper = MetricsScraper(
            self.pool,
            interval_s=settings.metric_refresh_interval_s,
            timeout_s=settings.scrape_timeout_s,
        )
        self.pool.on_failure = self.scraper.probe
        self.shared: RedisState | None = None
        if settings.redis is not None:
            from plugin.adapters.redis_state import RedisState

            shares = (
                ScrapeShares(settings.redis.gateway_id) if settings.redis.shared_scrape else None
            )
            interval, timeout = settings.metric_refresh_interval_s, settings.scrape_timeout_s
            self.shared = RedisState(
                self.pool,
                settings.redis,
                claims=self.servicer.handoff,
                shares=shares,
                # A replica's scrapes outlive one missed tick by half a period (or a scrape's
                # timeout): its pods move to the others within two periods of its last tick.
                scrape_expiry_s=interval + max(interval / 2, timeout),
                on_scrapers_changed=self.scraper.wake,
                prefixes=self._shared_prefix_index(settings.redis.shared_prefix_index),
                limits=None if self.router.admission is None else self.router.admission.limits,
            )
            if shares is not None:
                self.scraper.exchange = self.shared
        self.profile_loader: ProfileLoader | None = None
        if settings.profile_dir is not None:
            self.profile_loader = DirectoryProfiles(
                self.profiles, settings.profile_dir, on_change=self.pool.profiles_changed
            )
        elif settings.redis is not None:
            self.profile_loader = RedisProfiles(
                self.profiles, settings.redis, on_change=self.pool.profiles_changed
            )
        self.health = HealthServicer()
        self.grpc_port = 0
        self.http_port = 0
        self._server: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.draining = False
        self._discovered = asyncio.Event()  # discovery delivered its first list
        # Free native memory back to the OS after bursts of large bodies (glibc only).
        self.trimmer = MemoryTrimmer.for_this_process()

    def _shared_prefix_index(self, wanted: bool) -> PrefixIndex | None:
        """The prefix-cache index, made shared, when the gateway has one and sharing is on."""
        strategy = self._prefix_cache
        if not wanted or not isinstance(strategy, PrefixCache):
            return None
        strategy.index.share()
        return strategy.index

    def _on_pods(self, pods: list[Pod]) -> None:
        first = not self.pool.loaded
        before = {p.key for p in self.pool.pods()}
        self.pool.set_pods(pods)
        self.router.pods_removed(sorted(before - {p.key for p in pods}))
        if first:
            log.info("pod discovery loaded: %d pods, models %s", len(pods), self.pool.models())
            self._discovered.set()
            self._tasks.append(asyncio.ensure_future(self._set_serving()))

    async def _scrape_from_discovery(self) -> None:
        """Scrape from the moment discovery delivers, so the first round (and readiness) does
        not wait a tick for it."""
        await self._discovered.wait()
        await self.scraper.run()

    async def _set_serving(self) -> None:
        # Ready once the engines have been seen: a restarted gateway that took traffic before its
        # first scrape would route blind (to a dead engine among others) for up to a tick.
        await self.scraper.first_round.wait()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(
            "envoy.service.ext_proc.v3.ExternalProcessor",
            health_pb2.HealthCheckResponse.SERVING,
        )

    async def start(self) -> None:
        limit = self.settings.max_message_bytes
        server = grpc.aio.server(
            options=[
                # Room for the ProcessingRequest envelope around a body of exactly `limit` bytes.
                ("grpc.max_receive_message_length", min(limit + 64 * 1024, 2**31 - 1)),
                ("grpc.max_send_message_length", limit),
                # A second gateway on a busy port must fail, not silently share the streams;
                # `serve --workers N` shares it on purpose (plugin.adapters.workers).
                ("grpc.so_reuseport", int(self.settings.workers > 1)),
                ("grpc.max_concurrent_streams", 100000),
                # gRPC grows a connection's read buffer to the largest message it read (up to
                # 4 MiB) and keeps it; a 4 MB body then pins 4 MB per connection for good.
                ("grpc.experimental.tcp_max_read_chunk_size", 256 * 1024),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            self.grpc_port = server.add_insecure_port(f"{self.host}:{self.settings.grpc_port}")
        except RuntimeError as exc:  # grpc raises RuntimeError for a busy port
            raise _unbound("gRPC", self.settings.grpc_port, GRPC_PORT, str(exc)) from None
        if self.grpc_port == 0:
            raise _unbound("gRPC", self.settings.grpc_port, GRPC_PORT, "in use")
        await server.start()
        self._server = server

        app = build_app(
            self.pool,
            self.servicer.errors,
            self.scraper,
            shared=self.shared,
            draining=lambda: self.draining,
            waiting=self.router.waiting_by_model,
            imbalance=self.router.imbalance_fired,
            prefix_cache=lambda: prefix_stats(self._prefix_cache),
            profiles=self.profile_loader,
            waits=self.router.waits,
            predictions=self.router.predictions,
            tracing=self.tracer,
            beyond=self.router.beyond,
            drift=self.router.drift,
            latency=LatencyView(
                self.router.latency, self.router.decision_time, self.router.slo_outcomes
            ),
            admission=self.router.admission,
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.settings.http_port)
        try:
            await site.start()
        except OSError as exc:  # in use, or not ours to bind
            await runner.cleanup()
            raise _unbound("HTTP", self.settings.http_port, HTTP_PORT, exc.strerror) from None
        self._runner = runner
        addresses = runner.addresses
        self.http_port = int(addresses[0][1]) if addresses else self.settings.http_port

        self._background(self.source.run(self._on_pods), "pod discovery")
        self._background(self._scrape_from_discovery(), "metrics scraping")
        if self.trimmer is not None:
            self._background(self.trimmer.run(), "native memory trimming")
        if self.shared is not None:
            self._background(self.shared.run(), "shared state")
        if self.profile_loader is not None:
            self._background(self.profile_loader.run(), "GPU profile loading")
        if self.tracer is not None:
            self._background(self.tracer.run(), "request tracing")
        log.info(
            "ext_proc gRPC on %s:%d, HTTP on %s:%d",
            self.host,
            self.grpc_port,
            self.host,
            self.http_port,
        )

    def _otel_spans(self, on: bool) -> RequestSpans | None:
        """OpenTelemetry's request spans, exported over OTLP, when HETERO_GATEWAY_OTEL is on
        (the `otel` extra; config checked it is installed)."""
        self._otel_provider: TracerProvider | None = None
        if not on:
            return None
        from plugin.adapters.otel import RequestSpans, otlp_provider

        self._otel_provider = otlp_provider()
        return RequestSpans(self._otel_provider)

    def _background(self, work: Coroutine[Any, Any, None], what: str) -> None:
        """Run a loop that should live as long as the gateway; if it dies, say so loudly."""

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled() or self.draining:
                return
            exc = task.exception()
            if exc is None:
                log.error("%s ended; the gateway runs on without it", what)
            else:
                log.error("%s failed: %r; the gateway runs on without it", what, exc)

        task = asyncio.ensure_future(work)
        task.add_done_callback(done)
        self._tasks.append(task)

    async def stop(self) -> None:
        """Drain, then close: refuse new streams and report not ready at once, let in-flight
        requests finish (up to `drain_s`; their leases release and their tokens are counted,
        and shared state keeps publishing meanwhile), then stop the background tasks."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        # Requests held at the gateway get their answer now (503, retry elsewhere), not Envoy's
        # message timeout later; requests already routed drain below.
        held = self.router.reject_waiting(ShuttingDown("the gateway is shutting down; retry"))
        if held:
            log.info("answered %d held requests with 503: shutting down", held)
        if self._server is not None:
            if self.pool.loaded and any(self.pool.inflight(p.key) for p in self.pool.pods()):
                log.info("draining in-flight requests for up to %.0f s", self.settings.drain_s)
            await self._server.stop(grace=self.settings.drain_s)
            self._server = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.shared is not None:
            await self.shared.close()
        if self.tracer is not None:  # after the drain: the last responses are in its window
            await self.tracer.close()
        if self._otel_provider is not None:  # the last spans, exported before the exit
            await asyncio.to_thread(self._otel_provider.shutdown)
        if self.profile_loader is not None:
            await self.profile_loader.close()
        if self._runner is not None:
            await self._runner.cleanup()


def _unbound(what: str, port: int, var: Var[int], reason: str | None) -> ConfigError:
    """A port that cannot be bound, in one line naming what sets it (not a traceback)."""
    flag = f" or {var.flag.command} {var.flag.option}" if var.flag is not None else ""
    return ConfigError(f"cannot bind the {what} port {port} ({var.name}{flag}): {reason}")


async def run_until_signal(gateway: Gateway) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await gateway.start()  # inside try: a failed HTTP bind still stops the gRPC server
        await stop.wait()
    finally:
        log.info("shutting down")
        await gateway.stop()
