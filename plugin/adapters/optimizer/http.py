"""The optimizer's HTTP API: what AIBrix's PodAutoscaler reads, overrides, `/debug/plan`,
`/metrics`."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)

from plugin.adapters.optimizer.sources import (
    REPLICA_UNITS,
    UnknownDeployment,
)
from plugin.adapters.optimizer.state import Optimizer

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
