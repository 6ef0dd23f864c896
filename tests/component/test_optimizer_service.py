"""The GPU optimizer service against real things on loopback: a redis-server holding trace windows
written in AIBrix's documented shape, AIBrix's profile files, a pods file, its HTTP API served by
a real aiohttp server, and a small HTTP server speaking the Kubernetes deployments list API."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aredis
from aiohttp import web

from plugin.adapters.optimizer import (
    KubernetesDeployments,
    Optimizer,
    OptimizerService,
    PodsFileDeployments,
    RedisTraces,
    build_app,
)
from plugin.adapters.profiles import DirectoryProfiles
from plugin.config import OptimizerSettings, RedisSettings, load_settings
from plugin.core.profile import ProfileBook, profile_key
from plugin.errors import ConfigError
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import ServeApp

pytestmark = pytest.mark.component

MODEL = "llama2-7b"
A100, A40 = "simulator-llama2-7b-a100", "simulator-llama2-7b-a40"
NOW = 1_700_000_005.0  # 5 s into a window: the newest closed window ended at NOW - 5
# 512 input tokens, 64 output tokens: AIBrix's bucket key is round(log2(n) * precision).
BUCKET = f"{round(math.log2(512) * 10)}:{round(math.log2(64) * 10)}"


def window_doc(count: int, total: int | None = None) -> bytes:
    """A trace window exactly as AIBrix documents it (meta_v 4, precision 10)."""
    doc = {
        BUCKET: count,
        "meta_v": 4,
        "meta_interval_sec": 10,
        "meta_precision": 10,
        "meta_total_reqs": count if total is None else total,
        "meta_pending_reqs": 0,
        "meta_queueing_reqs": 0,
    }
    return json.dumps(doc).encode()


def pods_doc(pods: list[tuple[str, str, str]]) -> dict[str, Any]:
    """(name, deployment, min_replicas label or '') -> a pods file of one model."""
    entries = []
    for i, (name, deployment, minimum) in enumerate(pods):
        labels = {"app.kubernetes.io/name": deployment}
        if minimum:
            labels["model.aibrix.ai/min_replicas"] = minimum
        entries.append({"name": name, "address": f"10.0.0.{i + 1}", "port": 8000, "labels": labels})
    return {"models": {MODEL: {"pods": entries}}}


@pytest.fixture
def profiles(profile_dir: Path, tmp_path: Path) -> Path:
    """AIBrix's two profiles under `<dir>/<model>/<deployment>.json`; the A100 is made the
    pricier one per request so the cheap type wins unless capped."""
    root = tmp_path / "profiles"
    (root / MODEL).mkdir(parents=True)
    for gpu, cost in ((A100, 1.0), (A40, 0.3)):
        doc = json.loads((profile_dir / f"{gpu}.json").read_text())
        doc["cost"] = cost
        (root / MODEL / f"{gpu}.json").write_text(json.dumps(doc))
    return root


def tput(profile_root: Path, gpu: str) -> float:
    """The profile's rate for the 512-in / 64-out cell (read straight from the JSON)."""
    doc = json.loads((profile_root / MODEL / f"{gpu}.json").read_text())
    out_ticks, in_ticks = doc["indexes"]
    return float(doc["tputs"][out_ticks.index(64)][in_ticks.index(512)])


class Harness:
    def __init__(self, optimizer: Optimizer, url: str, redis: aredis.Redis, pods: Path) -> None:
        self.optimizer = optimizer
        self.url = url
        self.redis = redis
        self.pods = pods

    async def write_windows(self, per_window: int, windows: int = 24) -> None:
        # Keys are labelled with the window's end: the newest closed window ends at the last
        # boundary.
        newest = int(NOW) - int(NOW) % 10
        for k in range(windows):
            key = f"aibrix:{MODEL}_request_trace_{newest - 10 * k}"
            await self.redis.set(key, window_doc(per_window), ex=600)


MakeHarness = Callable[[list[tuple[str, str, str]], OptimizerSettings], Awaitable[Harness]]


@pytest_asyncio.fixture
async def make_harness(
    redis_server: RedisServer, profiles: Path, tmp_path: Path, serve_app: ServeApp
) -> AsyncIterator[MakeHarness]:
    """An optimizer over a pods file of `pods`, AIBrix's profiles and the test's redis-server,
    its HTTP API served on loopback, its clock at NOW."""
    made: list[tuple[RedisTraces, aredis.Redis]] = []

    async def make(pods: list[tuple[str, str, str]], settings: OptimizerSettings) -> Harness:
        path = tmp_path / f"pods-{len(made)}.yaml"
        path.write_text(json.dumps(pods_doc(pods)))
        book = ProfileBook()
        loader = DirectoryProfiles(book, str(profiles))
        assert await loader.load_once()
        traces = RedisTraces(RedisSettings(host=redis_server.host, port=redis_server.port))
        client = aredis.Redis(host=redis_server.host, port=redis_server.port)
        made.append((traces, client))
        optimizer = Optimizer(
            settings,
            PodsFileDeployments(str(path), "app.kubernetes.io/name"),
            traces,
            book,
            loader,
            clock=lambda: NOW,
        )
        assert await optimizer.refresh_deployments()  # as the service does before it serves
        port = await serve_app(build_app(optimizer))
        return Harness(optimizer, f"http://127.0.0.1:{port}", client, path)

    yield make
    for traces, client in made:
        await client.aclose()
        await traces.close()


@pytest_asyncio.fixture
async def harness(make_harness: MakeHarness) -> Harness:
    pods = [("a100-0", A100, "1"), ("a40-0", A40, ""), ("h100-0", "h100", "")]
    return await make_harness(pods, OptimizerSettings(scale_down_windows=2))


async def replicas_of(http: aiohttp.ClientSession, url: str, deployment: str) -> float:
    async with http.get(f"{url}/metrics/default/{deployment}") as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "text/plain"
        text = await resp.text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert "# TYPE vllm:deployment_replicas gauge" in text
    assert len(lines) == 1 and lines[0].startswith(
        f'vllm:deployment_replicas{{model_name="{MODEL}"}} '
    )
    return float(lines[0].split()[-1])


async def test_plan_follows_traffic_in_hundredths(
    harness: Harness, http: aiohttp.ClientSession, profiles: Path
) -> None:
    # Before any plan: each deployment is held where it runs (one pod each).
    assert await replicas_of(http, harness.url, A40) == 100
    await harness.write_windows(per_window=240)  # 24 req/s over 240 s
    await harness.optimizer.step()
    # The A100 keeps its min_replicas label (1) and, being paid for, serves what it can; the
    # cheap A40 takes the rest.
    expected = math.ceil((24.0 - tput(profiles, A100)) / tput(profiles, A40))
    assert expected > 1
    assert await replicas_of(http, harness.url, A40) == 100 * expected
    assert await replicas_of(http, harness.url, A100) == 100
    # No profile: left alone at what it runs, and reported.
    assert await replicas_of(http, harness.url, "h100") == 100
    async with http.get(f"{harness.url}/debug/plan") as resp:
        plan = (await resp.json())["plans"][MODEL]
    assert plan["unprofiled"] == ["default/h100"]
    assert plan["status"] == "optimal"
    assert plan["traffic"]["rate"] == pytest.approx(24.0)
    assert plan["cells"][0]["input_tokens"] == pytest.approx(512, rel=0.01)
    assert plan["cells"][0]["output_tokens"] == pytest.approx(64, rel=0.01)
    # What each cell costs inside a mix, beside what a replica sustains of it alone.
    cell = plan["cells"][0]
    assert set(cell["mix_tputs"]) == set(cell["tputs"]) == {f"default/{A100}", f"default/{A40}"}
    assert all(cell["mix_tputs"][d] >= cell["tputs"][d] > 0 for d in cell["tputs"])
    # The optimizer's own metrics.
    async with http.get(f"{harness.url}/metrics") as resp:
        own = await resp.text()
    assert f'hetero_optimizer_decisions_total{{model="{MODEL}",status="optimal"}} 1.0' in own
    assert "hetero_optimizer_solve_seconds_count" in own
    assert (
        f'hetero_optimizer_replicas{{deployment="{A40}",model="{MODEL}",namespace="default"}}'
        f" {float(expected)}" in own
    )


async def test_scale_down_waits_and_redis_outage_keeps_the_plan(
    harness: Harness, http: aiohttp.ClientSession, redis_server: RedisServer, profiles: Path
) -> None:
    await harness.write_windows(per_window=120)
    await harness.optimizer.step()
    high = await replicas_of(http, harness.url, A40)
    await harness.redis.flushdb()  # the traffic stops
    await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == high  # one quiet window: not yet
    await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == 0  # two agree: down to min (0)
    await harness.write_windows(per_window=120)
    await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == high  # up at once
    await redis_server.kill()
    await harness.optimizer.step()  # traces unreadable: the last plan stays
    await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == high
    async with http.get(f"{harness.url}/metrics") as resp:
        assert 'hetero_optimizer_errors_total{stage="traces"} 2.0' in await resp.text()


async def test_caps_move_traffic_to_the_pricier_type(
    make_harness: MakeHarness, profiles: Path, http: aiohttp.ClientSession
) -> None:
    h = await make_harness(
        [("a100-0", A100, ""), ("a40-0", A40, "")], OptimizerSettings(max_replicas={A40: 1})
    )
    await h.write_windows(per_window=120)
    await h.optimizer.step()
    a40, a100 = await replicas_of(http, h.url, A40), await replicas_of(http, h.url, A100)
    assert a40 == 100  # at its cap
    rest = 12.0 - tput(profiles, A40)
    assert a100 == 100 * math.ceil(rest / tput(profiles, A100))


async def test_an_attainment_target_reaches_the_plan_and_reports_what_is_late(
    make_harness: MakeHarness, profiles: Path, http: aiohttp.ClientSession
) -> None:
    env = {"HETERO_GATEWAY_OPTIMIZER_ATTAINMENT": "0.5", "REDIS_HOST": "127.0.0.1"}
    settings = load_settings(env).optimizer
    assert settings.attainment == 0.5
    h = await make_harness([("a100-0", A100, "1"), ("a40-0", A40, "")], settings)
    await h.write_windows(per_window=240)  # 24 req/s
    await h.optimizer.step()
    a100, a40 = tput(profiles, A100), tput(profiles, A40)
    # One size both types serve: a request served late takes the same work as one in time, so
    # the target buys nothing less here (each type's profile charges the cell as it serves it).
    assert await replicas_of(http, h.url, A40) == 100 * math.ceil((24.0 - a100) / a40)
    async with http.get(f"{h.url}/debug/plan") as resp:
        doc = await resp.json()
    plan = doc["plans"][MODEL]
    assert doc["settings"]["attainment"] == plan["attainment"] == 0.5
    assert plan["status"] == "optimal"
    exempt = sum(c["exempt"] for c in plan["cells"])
    assert 0 <= exempt <= 12.0 + 1e-9
    assert sum(c["unserved"] for c in plan["cells"]) == 0
    async with http.get(f"{h.url}/metrics") as resp:
        own = await resp.text()
    line = next(x for x in own.splitlines() if x.startswith("hetero_optimizer_exempt_rate{"))
    assert float(line.split()[-1]) == pytest.approx(exempt, abs=1e-9)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("GET", "/metrics/default/nope", None, 404, "unknown deployment default/nope"),
        ("GET", "/metrics/other/" + A40, None, 404, "unknown deployment other/"),
        ("PUT", "/scale/default/nope", b'{"replicas": 2}', 404, "unknown deployment"),
        ("PUT", "/scale/default/" + A40, b"{not json", 400, "body must be JSON"),
        ("PUT", "/scale/default/" + A40, b'{"replicas": -2}', 400, "integer >= 0, or -1"),
        ("PUT", "/scale/default/" + A40, b'{"replicas": 1.5}', 400, "integer >= 0, or -1"),
        ("PUT", "/scale/default/" + A40, b'{"replicas": true}', 400, "integer >= 0, or -1"),
        ("PUT", "/scale/default/" + A40, b"[2]", 400, "integer >= 0, or -1"),
        ("POST", "/monitor/default/nope", None, 404, "unknown deployment"),
        ("DELETE", "/monitor/default/nope", None, 404, "unknown deployment"),
        ("GET", "/update_profile/nope", None, 404, "model nope is not monitored"),
    ],
    ids=[
        "metrics-unknown",
        "metrics-wrong-namespace",
        "scale-unknown",
        "scale-malformed-json",
        "scale-negative",
        "scale-fraction",
        "scale-bool",
        "scale-not-object",
        "monitor-unknown",
        "unmonitor-unknown",
        "profile-unknown-model",
    ],
)
async def test_bad_requests_get_clear_errors(
    harness: Harness,
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    message: str,
) -> None:
    await harness.optimizer.step()
    async with http.request(method, harness.url + path, data=body) as resp:
        assert resp.status == status
        assert message in (await resp.json())["error"]


async def test_operator_override_and_monitoring(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    await harness.write_windows(per_window=120)
    await harness.optimizer.step()
    planned = await replicas_of(http, harness.url, A40)
    async with http.put(f"{harness.url}/scale/default/{A40}", json={"replicas": 7}) as resp:
        assert resp.status == 200
    assert await replicas_of(http, harness.url, A40) == 700
    await harness.optimizer.step()  # a new plan does not undo the operator
    assert await replicas_of(http, harness.url, A40) == 700
    async with http.put(f"{harness.url}/scale/default/{A40}", json={"replicas": -1}) as resp:
        assert resp.status == 200
    assert await replicas_of(http, harness.url, A40) == planned
    async with http.delete(f"{harness.url}/monitor/default/{A40}") as resp:
        assert resp.status == 200
        assert (await resp.json())["message"] == "deployment optimization stopped"
    async with http.get(f"{harness.url}/metrics/default/{A40}") as resp:
        assert resp.status == 404 and "not monitored" in (await resp.json())["error"]
    async with http.post(f"{harness.url}/monitor/default/{A40}") as resp:
        assert (await resp.json())["message"] == "deployment optimization started"
    await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == planned
    async with http.get(f"{harness.url}/update_profile/{MODEL}") as resp:
        assert resp.status == 200


async def test_a_new_deployment_is_found_when_monitored(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    await harness.optimizer.step()
    harness.pods.write_text(
        json.dumps(pods_doc([("a100-0", A100, "1"), ("a40-0", A40, ""), ("l20-0", "l20", "")]))
    )
    async with http.post(f"{harness.url}/monitor/default/l20") as resp:
        assert resp.status == 200, await resp.text()
    assert await replicas_of(http, harness.url, "l20") == 100


# --- Kubernetes deployments -----------------------------------------------------------------------


def deployment_obj(
    name: str, namespace: str, labels: Mapping[str, str], replicas: int | None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": name}}, "template": {}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": spec,
    }


async def test_kubernetes_deployments_are_listed_by_model_label(serve_app: ServeApp) -> None:
    from kubernetes import client

    seen: list[str] = []
    items = [
        deployment_obj(
            "llama-a100",
            "prod",
            {"model.aibrix.ai/name": MODEL, "model.aibrix.ai/min_replicas": "2"},
            3,
        ),
        deployment_obj(
            "llama-l20",
            "prod",
            {"model.aibrix.ai/name": MODEL, "model.aibrix.ai/min_replicas": "x"},
            None,
        ),
    ]

    async def deployments(request: web.Request) -> web.Response:
        seen.append(request.query.get("labelSelector", ""))
        doc = {"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {}, "items": items}
        return web.json_response(doc)

    app = web.Application()
    app.router.add_get("/apis/apps/v1/deployments", deployments)
    app.router.add_get("/apis/apps/v1/namespaces/{ns}/deployments", deployments)
    port = await serve_app(app)
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    found = await KubernetesDeployments(configuration=cfg).fetch()
    assert seen == ["model.aibrix.ai/name"]
    by_name = {d.name: d for d in found}
    assert by_name["llama-a100"].key == "prod/llama-a100"
    assert (by_name["llama-a100"].replicas, by_name["llama-a100"].min_replicas) == (3, 2)
    # No replicas field means Kubernetes' default of 1; a malformed label means 0.
    assert (by_name["llama-l20"].replicas, by_name["llama-l20"].min_replicas) == (1, 0)
    assert {d.model for d in found} == {MODEL}
    await KubernetesDeployments(("prod", "dev"), configuration=cfg).fetch()
    assert len(seen) == 3


# --- configuration and start-up -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HETERO_GATEWAY_OPTIMIZER_LOOKBACK_S": "245"}, "must be a multiple of 10"),
        ({"HETERO_GATEWAY_OPTIMIZER_LOOKBACK_S": "900"}, "HETERO_GATEWAY_OPTIMIZER_LOOKBACK_S"),
        ({"HETERO_GATEWAY_OPTIMIZER_HEADROOM": "0.8"}, "HETERO_GATEWAY_OPTIMIZER_HEADROOM"),
        ({"HETERO_GATEWAY_OPTIMIZER_ATTAINMENT": "0"}, "HETERO_GATEWAY_OPTIMIZER_ATTAINMENT"),
        ({"HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS": "a100"}, "is not deployment=N"),
        ({"HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS": "a100=-1"}, "replica count >= 0"),
        ({"HETERO_GATEWAY_OPTIMIZER_SCALE_DOWN_WINDOWS": "0"}, "SCALE_DOWN_WINDOWS"),
    ],
    ids=["lookback-not-multiple", "lookback-past-ttl", "headroom-below-1", "attainment-0",
         "cap-no-count",
         "cap-negative", "no-hysteresis-windows"],
)  # fmt: skip
def test_bad_optimizer_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(env)


def test_caps_parse_by_name_and_namespace() -> None:
    settings = load_settings({"HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS": "a100=4, prod/h100=0"})
    assert dict(settings.optimizer.max_replicas) == {"a100": 4, "prod/h100": 0}


def test_the_optimizer_needs_redis() -> None:
    with pytest.raises(ConfigError, match="REDIS_HOST"):
        OptimizerService(load_settings({"HETERO_GATEWAY_PODS_FILE": "pods.yaml"}))


def test_the_command_refuses_to_start_without_redis() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
    done = subprocess.run(
        [sys.executable, "-m", "plugin", "optimizer", "--port", "0"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "REDIS_HOST" in done.stderr


async def test_service_serves_on_its_port(
    redis_server: RedisServer, profiles: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text(json.dumps(pods_doc([("a40-0", A40, "")])))
    settings = load_settings(
        {
            "REDIS_HOST": redis_server.host,
            "REDIS_PORT": str(redis_server.port),
            "HETERO_GATEWAY_PODS_FILE": str(pods),
            "HETERO_GATEWAY_PROFILE_DIR": str(profiles),
            "HETERO_GATEWAY_OPTIMIZER_PORT": "0",
        }
    )
    service = OptimizerService(settings, host="127.0.0.1")
    await service.start()
    try:
        await service.optimizer.step()
        url = f"http://127.0.0.1:{service.port}"
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 200
        # No traffic plans min_replicas (0), but the first plan below what runs (one pod) waits
        # for the scale-down windows like any other.
        assert await replicas_of(http, url, A40) == 100
    finally:
        await service.stop()


async def test_a_profile_the_solver_refuses_keeps_the_last_plan(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    await harness.write_windows(per_window=240)
    await harness.optimizer.step()
    before = await replicas_of(http, harness.url, A40)
    held = harness.optimizer.book.lookup(MODEL, A40)
    assert held is not None
    broken = dataclasses.replace(
        held, tputs=tuple(tuple(math.inf for _ in row) for row in held.tputs), created=1e12
    )
    other = harness.optimizer.book.lookup(MODEL, A100)
    assert other is not None
    harness.optimizer.book.replace(
        {profile_key(MODEL, A40): broken, profile_key(MODEL, A100): other}
    )
    await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == before
    async with http.get(f"{harness.url}/metrics") as resp:
        assert 'hetero_optimizer_errors_total{stage="solve"} 1.0' in await resp.text()


async def test_arrivals_without_sizes_keep_the_last_plan(
    harness: Harness, http: aiohttp.ClientSession
) -> None:
    await harness.write_windows(per_window=240)
    await harness.optimizer.step()
    before = await replicas_of(http, harness.url, A40)
    # Streams without include_usage and still running: arrivals, no size. Not an idle fleet.
    await harness.redis.flushdb()
    newest = int(NOW) - int(NOW) % 10
    doc = {"meta_v": 4, "meta_interval_sec": 10, "meta_precision": 10, "meta_total_reqs": 300}
    for k in range(24):
        await harness.redis.set(f"aibrix:{MODEL}_request_trace_{newest - 10 * k}", json.dumps(doc))
    for _ in range(3):  # more rounds than the scale-down windows (2)
        await harness.optimizer.step()
    assert await replicas_of(http, harness.url, A40) == before
