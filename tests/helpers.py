"""Plain helpers the test modules share: polling, request bodies, Envoy-shaped ext_proc messages,
pods files, metric readers. Fixtures (servers, processes, data) are in `tests/conftest.py`.

Every wait is bounded and polls a condition; nothing here sleeps for a fixed time to let
something happen.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from hetero_gateway_protos.envoy.config.core.v3 import base_pb2
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from plugin.adapters.discovery import PodSource
from plugin.adapters.kubernetes import MODEL_KEY
from plugin.adapters.serve import Gateway
from plugin.config import Settings, load_settings
from plugin.core.strategies import Strategy
from plugin.core.types import Pod
from plugin_tools.demo.fleet import LocalFleet, free_port
from plugin_tools.demo.redis_server import RedisServer

__all__ = [
    "REPO",
    "WAIT_S",
    "ObserveServe",
    "ServeApp",
    "StartGateway",
    "bootstrap_hcm",
    "chat_body",
    "debug_pods",
    "eventually",
    "extproc_exchange",
    "free_port",
    "gateway_settings",
    "header_map",
    "metric_sum",
    "metric_value",
    "poll",
    "redis_env",
    "require_tool",
    "run_cli",
    "wait_idle",
    "write_pods_file",
]

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 5.0  # default bound of every wait; a passing run waits milliseconds

# --- tools outside pip ----------------------------------------------------------------------------

# How to get each program a test runs that pip does not install (`.ci/run` installs them all).
INSTALL = {
    "redis-server": "apt-get install redis-server",
    "prometheus": "apt-get install prometheus",
    "promtool": "apt-get install prometheus",
    "tmux": "apt-get install tmux",
    "kustomize": "go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0 (or install kubectl)",
}


def require_tool(name: str) -> str:
    """The path of program `name`. Missing, the test skips naming the install line, except in CI
    (`CI=true`), where it fails: there a test must never silently stop running."""
    found = shutil.which(name)
    if found is not None:
        return found
    message = f"{name} not found on PATH: {INSTALL[name]}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


# --- waiting --------------------------------------------------------------------------------------


async def eventually(
    check: Callable[[], bool], what: str, *, limit_s: float = WAIT_S, interval_s: float = 0.01
) -> float:
    """Poll `check()` until it holds; returns the seconds it took; fails the test after `limit_s`
    naming `what` it waited for."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


async def poll(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    what: str,
    *,
    limit_s: float = WAIT_S,
    interval_s: float = 0.05,
) -> T:
    """Await `probe()` until `done` holds for what it returned, and return that; fails the test
    after `limit_s` with the last value. For conditions that need I/O to read (an HTTP page)."""
    deadline = time.monotonic() + limit_s
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}: last {value!r}")
        await asyncio.sleep(interval_s)


# --- requests -------------------------------------------------------------------------------------


def chat_body(
    model: str,
    max_tokens: int | None = None,
    *,
    stream: bool = False,
    content: str = "hello there",
    **extra: Any,
) -> dict[str, Any]:
    """An OpenAI chat completion request; a streamed one asks for usage (as clients should)."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body | extra


def header_map(headers: Mapping[str, str]) -> base_pb2.HeaderMap:
    """Headers as Envoy (>= 1.27) sends them to ext_proc: in `raw_value`, `value` left empty."""
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def extproc_exchange(model: str, completion_tokens: int) -> list[pb.ProcessingRequest]:
    """The four messages of one non-streamed chat request, in the order Envoy sends them:
    request headers, request body, response headers (200), response body carrying `usage`."""
    request = {":path": "/v1/chat/completions", ":method": "POST", ":authority": "gateway"}
    usage = {"prompt_tokens": 2, "completion_tokens": completion_tokens}
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(request))),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(
                body=orjson.dumps(chat_body(model, content="hi")), end_of_stream=True
            )
        ),
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=header_map({":status": "200", "content-type": "application/json"})
            )
        ),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(
                body=orjson.dumps({"choices": [], "usage": usage}), end_of_stream=True
            )
        ),
    ]


# --- the plugin -----------------------------------------------------------------------------------


def make_pod(
    name: str,
    *,
    model: str = "m",
    namespace: str = "ns",
    address: str = "10.0.0.1",
    port: int = 8000,
    metrics_port: int | None = None,
    ready: bool = True,
    deployment: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> Pod:
    """A pod for tests: the fields a test does not care about at one default everywhere
    (`metrics_port`: the port)."""
    return Pod(
        name,
        namespace,
        model,
        address,
        port,
        port if metrics_port is None else metrics_port,
        ready=ready,
        labels=dict(labels or {}),
        deployment=deployment,
    )


def pod_obj(
    name: str,
    namespace: str = "default",
    *,
    model: str | None = "m",
    ip: str | None = "10.0.0.1",
    ready: bool | None = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    phase: str = "Running",
) -> dict[str, Any]:
    """A pod as the API server sends it (only the fields the source reads, and a few it ignores)."""
    all_labels = {"app": "engine"} | ({MODEL_KEY: model} if model is not None else {})
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{namespace}-{name}",
        "labels": all_labels | (labels or {}),
    }
    if annotations:
        metadata["annotations"] = annotations
    if deleting:
        metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    if ready is not None:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]
    spec = {"nodeName": "node-1", "containers": [{"name": "engine", "image": "vllm/vllm-openai"}]}
    return {"metadata": metadata, "spec": spec, "status": status}


def write_pods_file(path: Path, pods: Iterable[Pod]) -> Path:
    """A pods file (README's format) listing `pods` under their models; returns `path`."""
    models: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for p in pods:
        entry: dict[str, Any] = {
            "name": p.name,
            "namespace": p.namespace,
            "address": p.address,
            "port": p.port,
        }
        if p.labels:
            entry["labels"] = dict(p.labels)
        models.setdefault(p.model, {"pods": []})["pods"].append(entry)
    path.write_text(yaml.safe_dump({"models": models}), encoding="utf-8")
    return path


class ObserveServe(Protocol):
    """The `observe_serve` fixture: records what `observe` returns of each gateway `serve` runs."""

    def __call__(self, observe: Callable[[Gateway], Awaitable[T]]) -> list[T]: ...


class ServeApp(Protocol):
    """The `serve_app` fixture: an aiohttp application served on loopback; returns its port."""

    async def __call__(self, app: web.Application, host: str = "127.0.0.1") -> int: ...


class StartGateway(Protocol):
    """The `start_gateway` fixture: a started in-process plugin from a pods file or a source."""

    async def __call__(
        self,
        source: PodSource | Path,
        env: Mapping[str, str] | None = None,
        *,
        strategies: Mapping[str, Strategy] | None = None,
        default_strategy: str | None = None,
    ) -> Gateway: ...


def run_cli(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`hetero-gateway ARGS...` in a child process of this interpreter; fails the test with the
    tail of its stderr unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "plugin", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def gateway_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings `env` makes, on ports the OS chooses (read them back from the Gateway)."""
    return dataclasses.replace(load_settings(env or {}), grpc_port=0, http_port=0)


def redis_env(server: RedisServer, gateway: str) -> dict[str, str]:
    """The plugin's environment as gateway replica `gateway`, sharing state through `server`."""
    return {"REDIS_HOST": server.host, "REDIS_PORT": str(server.port), "POD_NAME": gateway}


def bootstrap_hcm(boot: Mapping[str, Any]) -> dict[str, Any]:
    """The HTTP connection manager of a rendered Envoy bootstrap's first listener."""
    listener = boot["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def routing_filter(boot: Mapping[str, Any]) -> dict[str, Any]:
    """The routing ext_proc filter's config in a rendered bootstrap (not always the first)."""
    for f in bootstrap_hcm(boot)["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            config: dict[str, Any] = f["typed_config"]
            return config
    raise AssertionError("no routing filter in the bootstrap")


# --- reading a running stack ----------------------------------------------------------------------


async def debug_pods(session: aiohttp.ClientSession, plugin_url: str) -> dict[str, Any]:
    """The plugin's `/debug/pods` document."""
    async with session.get(f"{plugin_url}/debug/pods") as resp:
        assert resp.status == 200, resp.status
        doc: dict[str, Any] = orjson.loads(await resp.read())
    return doc


async def _metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200, resp.status
        return await resp.text()


async def metric_sum(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum over every sample named `name` on `url`/metrics (0 when there is none)."""
    text = await _metrics_text(session, url)
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


async def metric_value(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """The first sample named `name` on `url`/metrics; None when there is none."""
    text = await _metrics_text(session, url)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


async def wait_idle(session: aiohttp.ClientSession, fleet: LocalFleet, limit_s: float = 30) -> None:
    """Until the plugin counts nothing in flight and no engine runs or queues anything."""

    async def busy() -> tuple[int, float, int]:
        state = await debug_pods(session, fleet.plugin_url)
        inflight = sum(p["inflight"] for p in state["pods"].values())
        engines = 0.0
        for e in fleet.engines:
            engines += await metric_sum(session, e.url, "vllm:num_requests_running")
            engines += await metric_sum(session, e.url, "vllm:num_requests_waiting")
        return inflight, engines, len(state["inflight_removed_pods"])

    await poll(busy, lambda b: b == (0, 0.0, 0), "an idle fleet", limit_s=limit_s, interval_s=0.2)


# --- deploy/ -------------------------------------------------------------------------------------

# libyaml's loader where PyYAML has it: the CRDs are large, and the pure-Python one is slow.
YAML_LOADER = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The rendered objects of `kind` (and `name`, when given)."""
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one rendered object of `kind` (and `name`); fails the test unless exactly one."""
    hits = find(objs, kind, name)
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


class RenderError(Exception):
    """kustomize refused a kustomization; the message carries its own."""


class Kustomize:
    """`kubectl kustomize` (or `kustomize build`: `command` is either, without the directory);
    each overlay of deploy/ is rendered once and copied for each test."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self._overlays: dict[str, tuple[dict[str, Any], ...]] = {}

    def build(self, directory: Path) -> list[dict[str, Any]]:
        """The objects the kustomization in `directory` renders, in kubectl's order."""
        proc = subprocess.run(
            [*self.command, str(directory)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise RenderError(f"{shlex.join(self.command)} {directory} failed:\n{proc.stderr}")
        return [doc for doc in yaml.load_all(proc.stdout, Loader=YAML_LOADER) if doc is not None]

    def __call__(self, overlay: str) -> list[dict[str, Any]]:
        """deploy/overlays/`overlay`'s objects (a fresh copy: tests may mutate them)."""
        if overlay not in self._overlays:
            self._overlays[overlay] = tuple(self.build(REPO / "deploy" / "overlays" / overlay))
        return copy.deepcopy(list(self._overlays[overlay]))


def write_one_at_a_time_profile(directory: Path, model: str) -> None:
    """An a100 GPU profile under which the a100 takes one request at a time (tputs x e2e < 1:
    its SLO batch is one), with a lenient SLO: a second request waits at the gateway until the
    first ends, whether an SLO strategy or admission holds it."""
    profile = {
        "gpu": "a100",
        "cost": 1.0,
        "tputs": [[0.1]],
        "indexes": [[32], [16]],
        "created": time.time(),
        "e2e": [[2.0]],
        "slos": {"percentile": 0, "e2e": 30.0},  # at the mean: no burst room
    }
    (directory / model).mkdir(parents=True)
    (directory / model / "a100.json").write_bytes(orjson.dumps(profile))
