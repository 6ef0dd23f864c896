"""Running the optimizer service: its loop, its HTTP server, its inputs from settings."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal

from aiohttp import web

from plugin.adapters.optimizer.http import build_app
from plugin.adapters.optimizer.sources import (
    DeploymentSource,
    KubernetesDeployments,
    PodsFileDeployments,
    RedisTraces,
)
from plugin.adapters.optimizer.state import Optimizer
from plugin.adapters.profiles import DirectoryProfiles, ProfileLoader, RedisProfiles
from plugin.config import Settings
from plugin.core.profile import ProfileBook
from plugin.errors import ConfigError

log = logging.getLogger(__name__)


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
