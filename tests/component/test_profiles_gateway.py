"""GPU profiles in the gateway: which pod has one (its deployment label), where they are read
from (Redis keys `aibrix:profile_*` or a directory), how a newer profile wins, and what the
running plugin shows of them against its traffic (sizes beyond the grid, drift per cell)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import redis
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from plugin.adapters.discovery import parse_pods
from plugin.adapters.kubernetes import MODEL_KEY, pod_from_object
from plugin.adapters.profiles import DirectoryProfiles, RedisProfiles
from plugin.config import RedisSettings
from plugin.core.profile import GpuProfile, ProfileBook, profile_key
from plugin.core.types import Pod
from plugin.errors import ConfigError
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import (
    StartGateway,
    chat_body,
    debug_pods,
    extproc_exchange,
    header_map,
    write_pods_file,
)

pytestmark = pytest.mark.component

MODEL = "llama-3-8b"


def profile(gpu: str, created: float, tput: float = 10.0) -> GpuProfile:
    return GpuProfile(gpu, 1.0, (4, 8), (128,), ((tput,), (tput / 2,)), created, ((0.5,), (1.0,)))


def test_book_keeps_the_newest_and_drops_what_is_gone() -> None:
    book = ProfileBook()
    a, b = profile_key(MODEL, "a100"), profile_key(MODEL, "l20")
    assert sorted(book.replace({a: profile("a100", 10.0), b: profile("l20", 10.0)})) == [a, b]
    assert book.replace({a: profile("a100", 5.0, tput=99.0), b: profile("l20", 10.0)}) == []
    found = book.lookup(MODEL, "a100")
    assert found is not None and found.tputs[0][0] == 10.0  # the older copy did not win
    assert book.replace({a: profile("a100", 11.0, tput=12.0)}) == [b, a]
    assert book.lookup(MODEL, "l20") is None  # deleted upstream
    assert book.lookup(MODEL, None) is None and book.lookup("other", "a100") is None


def test_both_discovery_sources_read_the_deployment_label() -> None:
    doc = {
        "models": {
            MODEL: {
                "pods": [
                    {
                        "name": "p0",
                        "address": "10.0.0.1",
                        "port": 8000,
                        "labels": {"app.kubernetes.io/name": "a100", "gpu": "A100"},
                    },
                    {"name": "p1", "address": "10.0.0.2", "port": 8000},
                ]
            }
        }
    }
    p0, p1 = parse_pods(doc, "pods.yaml")
    assert (p0.deployment, p1.deployment) == ("a100", None)
    (custom, _) = parse_pods(doc, "pods.yaml", deployment_label="gpu")
    assert custom.deployment == "A100"
    obj: dict[str, Any] = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "labels": {MODEL_KEY: MODEL, "app.kubernetes.io/name": "l20"},
        },
        "status": {"podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    pod = pod_from_object(obj)
    assert pod is not None and pod.deployment == "l20"
    other = pod_from_object(obj, deployment_label="missing")
    assert other is not None and other.deployment is None


async def test_redis_profiles_scan_their_own_database(redis_server: RedisServer) -> None:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3)
    key_a, key_l = profile_key(MODEL, "a100"), profile_key(MODEL, "l20")
    try:
        client.set(key_a, json.dumps(profile("a100", 10.0).to_json()))
        client.set(key_l, json.dumps(profile("l20", 10.0).to_json()))
        client.set(profile_key(MODEL, "broken"), b"{not json")
        client.set("aibrix:other", b"x")
        redis.Redis(host="127.0.0.1", port=redis_server.port, db=0).set(
            profile_key(MODEL, "db0"), json.dumps(profile("db0", 1.0).to_json())
        )
        book = ProfileBook()
        loader = RedisProfiles(book, RedisSettings("127.0.0.1", redis_server.port, db=3))
        try:
            assert await loader.load_once()
            assert book.keys() == sorted([key_a, key_l])  # not db 0's, not the broken one
            client.set(key_a, json.dumps(profile("a100", 20.0, tput=30.0).to_json()))
            client.delete(key_l)
            assert await loader.load_once()
            found = book.lookup(MODEL, "a100")
            assert found is not None and found.tputs[0][0] == 30.0
            assert book.lookup(MODEL, "l20") is None
            await redis_server.kill()
            assert not await loader.load_once()  # Redis down: nothing changes
            assert book.keys() == [key_a] and loader.status()["last_error"]
        finally:
            await loader.close()
    finally:
        client.close()


async def test_directory_profiles_and_debug_pods(
    tmp_path: Path, start_gateway: StartGateway
) -> None:
    profiles = tmp_path / "profiles"
    (profiles / MODEL).mkdir(parents=True)
    (profiles / MODEL / "a100.json").write_text(json.dumps(profile("a100", 1.0).to_json()))
    (profiles / MODEL / "bad.json").write_text("[]")
    pods = [
        Pod(
            "a",
            "default",
            MODEL,
            "127.0.0.1",
            18001,
            18001,
            labels={"app.kubernetes.io/name": "a100"},
        ),
        Pod(
            "b",
            "default",
            MODEL,
            "127.0.0.1",
            18002,
            18002,
            labels={"app.kubernetes.io/name": "v100"},
        ),
    ]
    pods_file = write_pods_file(tmp_path / "pods.yaml", pods)
    gateway = await start_gateway(pods_file, {"HETERO_GATEWAY_PROFILE_DIR": str(profiles)})
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            doc = await debug_pods(session, f"http://127.0.0.1:{gateway.http_port}")
            if doc["profiles"]["keys"]:
                break
            await asyncio.sleep(0.05)
    assert doc["profiles"]["source"] == "directory"
    assert doc["profiles"]["keys"] == [profile_key(MODEL, "a100")]
    a, b = doc["pods"]["default/a"], doc["pods"]["default/b"]
    assert (a["deployment"], a["profile"]) == ("a100", True)
    assert (b["deployment"], b["profile"]) == ("v100", False)


def test_a_profile_dir_that_is_not_a_directory_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_PROFILE_DIR"):
        DirectoryProfiles(ProfileBook(), str(tmp_path / "missing"))


SLO_STRATEGIES = ("slo", "slo-least-load-pulling", "slo-least-load", "slo-pack-load")


async def _exchange(stub: pb_grpc.ExternalProcessorStub, strategy: str, content: str) -> bool:
    """One chat request through the plugin as Envoy sends it (4 output tokens in its usage):
    True when it was routed (and then served), False when the plugin answered it itself."""
    messages = extproc_exchange(MODEL, 4)
    headers = {":path": "/v1/chat/completions", ":method": "POST", ":authority": "gateway"}
    messages[0] = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers | {"routing-strategy": strategy}))
    )
    body = orjson.dumps(chat_body(MODEL, content=content))
    messages[1] = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    call = stub.Process()
    try:
        for i, message in enumerate(messages):
            await call.write(message)
            async with asyncio.timeout(5.0):
                reply = await call.read()
            assert isinstance(reply, pb.ProcessingResponse)
            if i == 1 and reply.WhichOneof("response") != "request_body":
                return False
        return True
    finally:
        await call.done_writing()


async def test_aibrix_profile_sizes_outside_the_grid_and_drift_through_the_gateway(
    tmp_path: Path,
    profile_dir: Path,
    start_gateway: StartGateway,
    reserve_port: Callable[[], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """AIBrix's sample A100 profile (inputs from 128 tokens; with an idle E2E added) served from
    a profile directory: a 3-token chat prompt routes under every SLO strategy, a prompt above
    the grid routes and shows in `hetero_gateway_slo_beyond_profile_requests_total` with one
    WARNING for the model, and the served requests' drift per cell shows in /metrics and
    /debug/pods."""
    caplog.set_level(logging.WARNING, logger="hetero_gateway")
    doc = json.loads((profile_dir / "simulator-llama2-7b-a100.json").read_text())
    doc["e2e_idle"] = [[e / 2 for e in row] for row in doc["e2e"]]
    (tmp_path / "profiles" / MODEL).mkdir(parents=True)
    (tmp_path / "profiles" / MODEL / "a100.json").write_text(json.dumps(doc))
    labels = {"app.kubernetes.io/name": "a100"}
    ports = {name: reserve_port() for name in ("a", "b")}  # reserved, never listening
    pods = [
        Pod(name, "default", MODEL, "127.0.0.1", port, port, labels=labels)
        for name, port in ports.items()
    ]
    env = {
        "HETERO_GATEWAY_PROFILE_DIR": str(tmp_path / "profiles"),
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "30000",  # the pods never answer a scrape
    }
    gateway = await start_gateway(write_pods_file(tmp_path / "pods.yaml", pods), env)
    url = f"http://127.0.0.1:{gateway.http_port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            state = await debug_pods(session, url)
            if state["profiles"]["keys"]:
                break
            await asyncio.sleep(0.05)
        assert state["pods"]["default/a"]["profile"] is True
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            for strategy in SLO_STRATEGIES:
                assert await _exchange(stub, strategy, "hello there"), strategy  # 3 tokens
            for _ in range(2):
                assert await _exchange(stub, "slo", "word " * 4000)  # 5000 tokens > 2048
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        state = await debug_pods(session, url)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    beyond = "hetero_gateway_slo_beyond_profile_requests_total"
    assert samples[(beyond, (("axis", "input"), ("model", MODEL)))] == 2
    small = (("cell", "out=4,in=128"), ("deployment", "a100"), ("model", MODEL))
    assert samples[("hetero_gateway_profile_drift_requests", small)] == 4
    assert 0 < samples[("hetero_gateway_profile_drift_ratio", small)] < 1  # loopback is quick
    cells = state["profile_drift"][MODEL]["a100"]
    assert cells["out=4,in=128"]["requests"] == 4 and cells["out=4,in=2048"]["requests"] == 2
    assert set(cells["out=4,in=128"]) == {"ratio", "requests", "off"}
    (warning,) = [r for r in caplog.records if "above the GPU profile" in r.getMessage()]
    assert warning.levelno == logging.WARNING and warning.getMessage().startswith(f"{MODEL}: ")
    assert "largest ticks: 512 output, 2048 input tokens" in warning.getMessage()
