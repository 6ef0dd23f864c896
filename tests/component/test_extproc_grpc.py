"""The running plugin over its real wire protocols: ext_proc gRPC, gRPC health, and HTTP.

A real `Gateway` is started in-process on loopback (ports chosen by the OS) and driven by a
grpc.aio client that sends `ProcessingRequest`s the way Envoy does, one phase at a time. The pods
point at loopback ports that are reserved but not listening: no request is forwarded anywhere
(that is Envoy's job), and their failing scrapes only leave engine metrics missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetero_gateway_protos.envoy.config.core.v3 import base_pb2
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from plugin.adapters.discovery import PodsCallback, StaticFileSource, load_pods_file
from plugin.adapters.extproc import DEFAULT_MAX_HEADERS
from plugin.adapters.serve import Gateway
from plugin.adapters.steering import LEASE_HEADER, PROMPT_TOKENS_HEADER
from plugin.core.pool import Lease, PodPool
from plugin.core.strategies import Admission, Route, Strategy, Wait, build_strategies
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import ConfigError
from tests.helpers import (
    StartGateway,
    eventually,
    gateway_settings,
    header_map,
    redis_env,
    write_pods_file,
)

pytestmark = pytest.mark.component

MODEL = "m"
WAIT_S = 5.0  # bound of every "until" wait; a passing run waits a few milliseconds
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

CHAT = "/v1/chat/completions"
COMPLETION_TOKENS = 17


# --- Envoy-shaped messages ----------------------------------------------------------------------


# A request-headers reply continues and strips client-sent steering headers.
HEADERS_CONTINUE = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(
                remove_headers=[
                    "target-pod",
                    "x-gateway-destination-endpoint",
                    "x-hetero-gateway-prompt-tokens",
                    "x-aibrix-config-profile",
                    "x-hetero-gateway-lease",
                    "x-hetero-gateway-reservation",
                ]
            )
        )
    )
)


def request_headers(
    path: str = CHAT,
    method: str = "POST",
    *,
    request_id: str | None = "req-1",
    strategy: str | None = None,
    end_of_stream: bool = False,
    extra: dict[str, str] | None = None,
) -> pb.ProcessingRequest:
    headers = {
        ":authority": "localhost:8888",
        ":path": path,
        ":method": method,
        ":scheme": "http",
        "content-type": "application/json",
        "user-agent": "test",
    }
    if request_id is not None:
        headers["x-request-id"] = request_id
    if strategy is not None:
        headers["routing-strategy"] = strategy
    headers.update(extra or {})
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )


def request_body(body: bytes | dict[str, Any]) -> pb.ProcessingRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def response_headers(status: int = 200, end_of_stream: bool = False) -> pb.ProcessingRequest:
    headers = {":status": str(status), "content-type": "text/event-stream"}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )


def response_body(chunk: bytes, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


CHAT_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_chunks(completion_tokens: int = COMPLETION_TOKENS) -> list[bytes]:
    """A streamed chat response cut where a network would cut it (mid-line included)."""
    events = b"".join(
        _sse({"id": "c1", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}], "usage": None})
        for i in range(3)
    )
    usage = _sse(
        {
            "id": "c1",
            "choices": [],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": completion_tokens,
                "total_tokens": 5 + completion_tokens,
            },
        }
    )
    whole = events + usage + b"data: [DONE]\n\n"
    cut1, cut2 = len(events) // 2, len(events) + len(usage) // 2
    return [whole[:cut1], whole[cut1:cut2], whole[cut2:]]


def set_headers(mutation: pb.HeaderMutation) -> dict[str, bytes]:
    return {h.header.key: h.header.raw_value for h in mutation.set_headers}


def set_header_values(mutation: pb.HeaderMutation) -> dict[str, str]:
    """The `value` fields, which must stay empty: Envoy rejects overrides set through them."""
    return {h.header.key: h.header.value for h in mutation.set_headers}


# --- fixtures -----------------------------------------------------------------------------------


# Scrapes of the (refusing) pods stay out of the way: one every 30 s.
SETTINGS_ENV = {"AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "30000"}


@pytest.fixture
def pods_file(tmp_path: Path, reserve_port: Callable[[], int]) -> Path:
    """Two pods on loopback ports that refuse connections: nothing is forwarded to them."""
    pods = [Pod(n, "default", MODEL, "127.0.0.1", reserve_port(), 0) for n in ("a", "b")]
    return write_pods_file(tmp_path / "pods.yaml", pods)


@dataclass
class Running:
    gateway: Gateway
    channel: grpc.aio.Channel
    stub: pb_grpc.ExternalProcessorStub
    pods: dict[str, Pod]  # by endpoint

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def key_of(self, endpoint: bytes | str) -> str:
        text = endpoint.decode() if isinstance(endpoint, bytes) else endpoint
        return self.pods[text].key


async def _connected(gateway: Gateway, pods_file: Path) -> AsyncIterator[Running]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        pods = {p.endpoint: p for p in load_pods_file(str(pods_file))}
        yield Running(gateway, channel, pb_grpc.ExternalProcessorStub(channel), pods)


@pytest_asyncio.fixture
async def running(pods_file: Path, start_gateway: StartGateway) -> AsyncIterator[Running]:
    gateway = await start_gateway(pods_file, SETTINGS_ENV)
    assert gateway.grpc_port > 0 and gateway.http_port > 0
    async for r in _connected(gateway, pods_file):
        yield r


class Stream:
    """One ext_proc stream, driven phase by phase like Envoy: write a message, read its reply."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        await self.call.write(req)
        async with asyncio.timeout(WAIT_S):
            reply = await self.call.read()
        assert reply is not grpc.aio.EOF
        assert isinstance(reply, pb.ProcessingResponse)
        return reply

    async def finish(self) -> None:
        await self.call.done_writing()
        async with asyncio.timeout(WAIT_S):
            assert await self.call.read() is grpc.aio.EOF
            assert await self.call.code() == grpc.StatusCode.OK


async def _route(r: Running, strategy: str | None = None) -> tuple[Stream, str]:
    """Open a stream and take it through request headers and body; returns (stream, pod key)."""
    stream = Stream(r.stub)
    reply = await stream.send(request_headers(strategy=strategy))
    assert reply == HEADERS_CONTINUE
    reply = await stream.send(request_body(CHAT_BODY))
    assert reply.WhichOneof("response") == "request_body"
    target = set_headers(reply.request_body.response.header_mutation)["target-pod"]
    return stream, r.key_of(target)


# --- the routed request -------------------------------------------------------------------------


def spy_streaming(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every `Lease.streaming` call: (the lease's pod key, whether it was released by then)."""
    calls: list[tuple[str, bool]] = []
    real = Lease.streaming

    def spy(self: Lease) -> None:
        calls.append((self.key, self.released))
        real(self)

    monkeypatch.setattr(Lease, "streaming", spy)
    return calls


async def test_routed_streaming_request_full_cycle(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = running
    pool = r.gateway.pool
    stream = Stream(r.stub)
    streaming = spy_streaming(monkeypatch)

    reply = await stream.send(request_headers(request_id="req-1"))
    assert reply == HEADERS_CONTINUE

    reply = await stream.send(request_body(CHAT_BODY))
    assert reply.WhichOneof("response") == "request_body"
    mutation = reply.request_body.response.header_mutation
    headers = set_headers(mutation)
    endpoint = headers["target-pod"].decode()
    assert endpoint in r.pods
    assert headers["routing-strategy"] == b"load-balance"
    assert headers["x-request-id"] == b"req-1"
    assert set(set_header_values(mutation).values()) == {""}  # raw_value only, never value
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    # The pick, then the other pod as the fallback override_host retries a refused connection
    # on; header and metadata carry the same list (the Inference Extension's protocol).
    (other,) = set(r.pods) - {endpoint}
    assert lb.fields["x-gateway-destination-endpoint"].string_value == f"{endpoint},{other}"
    assert headers["x-gateway-destination-endpoint"] == f"{endpoint},{other}".encode()

    key = r.key_of(endpoint)
    other = next(p.key for p in r.pods.values() if p.key != key)
    assert (pool.inflight(key), pool.routed_total(key)) == (1, 1)
    assert (pool.inflight(other), pool.routed_total(other)) == (0, 0)

    reply = await stream.send(response_headers(200))
    assert reply.WhichOneof("response") == "response_headers"
    mutation = reply.response_headers.response.header_mutation
    assert set_headers(mutation) == {
        "request-id": b"req-1",
        "routing-strategy": b"load-balance",
        "target-pod": r.pods[endpoint].name.encode(),
        "target-pod-ip": endpoint.encode(),
    }
    assert set(set_header_values(mutation).values()) == {""}

    *middle, last = sse_chunks(COMPLETION_TOKENS)
    for chunk in middle:
        assert await stream.send(response_body(chunk)) == pb.ProcessingResponse(
            response_body=pb.BodyResponse()
        )
        assert pool.inflight(key) == 1  # still streaming
    assert streaming == [(key, False)]  # the first chunk: the lease's share may shrink
    assert await stream.send(response_body(last, end_of_stream=True)) == pb.ProcessingResponse(
        response_body=pb.BodyResponse()
    )
    # Released at the body's end, before the stream itself closes.
    assert pool.inflight(key) == 0
    assert pool.output_tokens_total(key) == COMPLETION_TOKENS
    assert pool.output_tokens_total(other) == 0

    await stream.finish()
    assert pool.inflight(key) == 0  # the stream's end does not release a second time
    assert pool.output_tokens_total(key) == COMPLETION_TOKENS


@pytest.mark.parametrize(
    ("strategy", "echoed"),
    [(None, "load-balance"), ("least-request", "least-request"), ("random", "random")],
    ids=["default", "least-request", "random"],
)
async def test_strategy_header_is_used_and_echoed(
    running: Running, strategy: str | None, echoed: str
) -> None:
    stream = Stream(running.stub)
    await stream.send(request_headers(strategy=strategy))
    reply = await stream.send(request_body(CHAT_BODY))
    assert set_headers(reply.request_body.response.header_mutation)["routing-strategy"] == (
        echoed.encode()
    )
    reply = await stream.send(response_headers(200))
    assert set_headers(reply.response_headers.response.header_mutation)["routing-strategy"] == (
        echoed.encode()
    )
    await stream.send(response_body(b"", end_of_stream=True))
    await stream.finish()


async def test_missing_request_id_gets_a_generated_one(running: Running) -> None:
    stream = Stream(running.stub)
    await stream.send(request_headers(request_id=None))
    reply = await stream.send(request_body(CHAT_BODY))
    generated = set_headers(reply.request_body.response.header_mutation)["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    reply = await stream.send(response_headers(200))
    assert set_headers(reply.response_headers.response.header_mutation)["request-id"] == generated
    await stream.send(response_body(b"", end_of_stream=True))
    await stream.finish()


async def test_in_flight_requests_steer_least_request(running: Running) -> None:
    pool = running.gateway.pool
    first, key1 = await _route(running, "least-request")
    second, key2 = await _route(running, "least-request")
    assert key1 != key2  # the first one's in-flight slot made its pod the busier one
    assert (pool.inflight(key1), pool.inflight(key2)) == (1, 1)
    for stream, key in ((first, key1), (second, key2)):
        await stream.send(response_headers(200))
        await stream.send(response_body(b"".join(sse_chunks(3)), end_of_stream=True))
        await stream.finish()
        assert pool.inflight(key) == 0
        assert pool.output_tokens_total(key) == 3


async def test_upstream_error_releases_without_crediting_tokens(running: Running) -> None:
    pool = running.gateway.pool
    stream, key = await _route(running)
    await stream.send(response_headers(500))
    await stream.send(response_body(b"".join(sse_chunks()), end_of_stream=True))
    await stream.finish()
    assert pool.inflight(key) == 0
    assert pool.output_tokens_total(key) == 0


async def test_header_only_response_releases(running: Running) -> None:
    pool = running.gateway.pool
    stream, key = await _route(running)
    reply = await stream.send(response_headers(200, end_of_stream=True))
    assert set_headers(reply.response_headers.response.header_mutation)["target-pod-ip"]
    assert pool.inflight(key) == 0
    await stream.finish()
    assert pool.inflight(key) == 0


@pytest.mark.parametrize(
    "phase",
    ["after-body-reply", "after-response-headers", "mid-response-body"],
    ids=["after-body-reply", "after-response-headers", "mid-response-body"],
)
async def test_cancelled_stream_releases_in_flight(running: Running, phase: str) -> None:
    pool = running.gateway.pool
    stream, key = await _route(running)
    if phase != "after-body-reply":
        await stream.send(response_headers(200))
    if phase == "mid-response-body":
        await stream.send(response_body(sse_chunks()[0]))
    assert pool.inflight(key) == 1

    stream.call.cancel()

    await eventually(lambda: pool.inflight(key) == 0, f"{key} released after cancel")
    assert pool.routed_total(key) == 1


async def test_stream_ended_by_envoy_before_response_releases_in_flight(
    running: Running,
) -> None:
    # E.g. the upstream connection failed: Envoy closes the ext_proc stream without response
    # phases. The stream's normal end releases the slot, with no tokens credited.
    pool = running.gateway.pool
    stream, key = await _route(running)
    assert pool.inflight(key) == 1
    await stream.finish()
    assert pool.inflight(key) == 0
    assert pool.output_tokens_total(key) == 0


async def test_second_gateway_cannot_take_a_busy_grpc_port(
    running: Running, pods_file: Path
) -> None:
    settings = dataclasses.replace(
        gateway_settings(SETTINGS_ENV), grpc_port=running.gateway.grpc_port
    )
    second = Gateway(settings, StaticFileSource(str(pods_file), poll_s=30.0), "127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="HETERO_GATEWAY_GRPC_PORT or serve --grpc-port"):
            await second.start()
    finally:
        await second.stop()


async def test_a_second_body_after_routing_does_not_route_again(running: Running) -> None:
    pool = running.gateway.pool
    stream, _ = await _route(running)
    reply = await stream.send(request_body(CHAT_BODY))
    assert reply == pb.ProcessingResponse(request_body=pb.BodyResponse())
    assert sum(pool.routed_total(p.key) for p in running.pods.values()) == 1
    await stream.finish()
    assert all(pool.inflight(p.key) == 0 for p in running.pods.values())


async def test_upstream_5xx_ejects_the_pod(running: Running) -> None:
    pool = running.gateway.pool
    now = running.gateway.router.now
    failing: str | None = None
    for _ in range(12):  # enough that one pod collects the consecutive failures
        stream, key = await _route(running, strategy="random")
        await stream.send(response_headers(503, end_of_stream=True))
        await stream.finish()
        if pool.ejected(key, now()):
            failing = key
            break
    assert failing is not None
    others = {p.key for p in running.pods.values()} - {failing}
    for _ in range(6):
        stream, key = await _route(running, strategy="random")
        await stream.finish()
        assert key in others


def _observed(req: pb.ProcessingRequest) -> pb.ProcessingRequest:
    req.observability_mode = True
    return req


@pytest.mark.parametrize("ending", ["end-of-stream", "stream-closed"])
async def test_counting_filter_credits_tokens_without_replying(
    running: Running, ending: str
) -> None:
    """The observability-mode filter: no replies, tokens credited to the target-pod's pod."""
    pool = running.gateway.pool
    endpoint, pod = next(iter(running.pods.items()))
    headers = request_headers()
    headers.request_headers.headers.headers.append(
        base_pb2.HeaderValue(key="target-pod", raw_value=endpoint.encode())
    )
    chunks = sse_chunks(23)
    messages = [_observed(headers), _observed(response_headers(200))]
    messages += [_observed(response_body(c)) for c in chunks]
    if ending == "end-of-stream":
        messages.append(_observed(response_body(b"", end_of_stream=True)))
    call = running.stub.Process(iter(messages))
    async with asyncio.timeout(WAIT_S):
        replies = [r async for r in call]
    assert replies == []  # Envoy ignores replies in observability mode: none are sent
    await eventually(lambda: pool.output_tokens_total(pod.key) == 23, "tokens credited")
    assert pool.inflight(pod.key) == 0  # counting never holds an in-flight slot
    assert pool.routed_total(pod.key) == 0


async def test_counting_filter_ignores_failed_responses_and_unknown_pods(
    running: Running,
) -> None:
    pool = running.gateway.pool
    endpoint, pod = next(iter(running.pods.items()))
    for target, status in ((endpoint, 503), ("10.9.9.9:1", 200)):
        headers = request_headers()
        headers.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key="target-pod", raw_value=target.encode())
        )
        messages = [_observed(headers), _observed(response_headers(status))]
        messages += [_observed(response_body(c)) for c in sse_chunks(23)]
        messages.append(_observed(response_body(b"", end_of_stream=True)))
        async with asyncio.timeout(WAIT_S):
            assert [r async for r in running.stub.Process(iter(messages))] == []
    # A barrier: a good stream sent after them is credited, so theirs would have been by now.
    good_endpoint, good_pod = list(running.pods.items())[1]
    headers = request_headers()
    headers.request_headers.headers.headers.append(
        base_pb2.HeaderValue(key="target-pod", raw_value=good_endpoint.encode())
    )
    messages = [_observed(headers), _observed(response_headers(200))]
    messages += [_observed(response_body(c)) for c in sse_chunks(5)]
    messages.append(_observed(response_body(b"", end_of_stream=True)))
    async with asyncio.timeout(WAIT_S):
        assert [r async for r in running.stub.Process(iter(messages))] == []
    await eventually(lambda: pool.output_tokens_total(good_pod.key) == 5, "the good stream")
    assert pool.output_tokens_total(pod.key) == 0  # the 503 and the unknown pod: nothing


# --- passthrough --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "method", "body"),
    [
        ("/healthz", "POST", b'{"model": "m"}'),
        ("/v1/embeddings", "POST", b'{"model": "m", "input": "x"}'),
    ],
    ids=["post-healthz", "post-embeddings"],
)
async def test_other_paths_pass_through_untouched(
    running: Running, path: str, method: str, body: bytes | None
) -> None:
    pool = running.gateway.pool
    stream = Stream(running.stub)
    reply = await stream.send(request_headers(path, method, end_of_stream=body is None))
    assert reply == HEADERS_CONTINUE
    if body is not None:
        reply = await stream.send(request_body(body))
        assert reply == pb.ProcessingResponse(request_body=pb.BodyResponse())
    reply = await stream.send(response_headers(200))
    assert reply == pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    reply = await stream.send(response_body(b'{"data": []}', end_of_stream=True))
    assert reply == pb.ProcessingResponse(response_body=pb.BodyResponse())
    await stream.finish()
    for pod in running.pods.values():
        assert (pool.routed_total(pod.key), pool.inflight(pod.key)) == (0, 0)


async def test_get_models_is_answered_by_the_gateway(running: Running) -> None:
    stream = Stream(running.stub)
    reply = await stream.send(request_headers("/v1/models?x=1", "GET", end_of_stream=True))
    await stream.finish()
    immediate = reply.immediate_response
    assert immediate.status.code == 200
    doc = orjson.loads(immediate.body)
    assert doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == ["m"]
    headers = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert headers["content-type"] == b"application/json"


# --- errors the plugin answers itself -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "strategy", "status", "header", "error"),
    [
        (
            b"{not json",
            None,
            400,
            ("x-error-request-body-processing", "true"),
            {"type": "invalid_request_error", "code": None},
        ),
        (
            b"[1, 2]",
            None,
            400,
            ("x-error-request-body-processing", "true"),
            {"type": "invalid_request_error"},
        ),
        (
            b'{"messages": []}',
            None,
            400,
            ("x-error-no-model-backends", "true"),
            {"type": "invalid_request_error", "code": "model_not_found"},
        ),
        (
            b'{"model": "nope"}',
            None,
            400,
            ("x-error-no-model-backends", "nope"),
            {"message": "model nope does not exist", "code": "model_not_found"},
        ),
        (
            orjson.dumps(CHAT_BODY),
            "fastest",
            400,
            ("x-error-routing", "true"),
            {"message": "incorrect routing strategy fastest", "type": "invalid_request_error"},
        ),
    ],
    ids=["bad-json", "json-not-object", "no-model", "unknown-model", "unknown-strategy"],
)
async def test_request_errors_are_immediate_responses(
    running: Running,
    body: bytes,
    strategy: str | None,
    status: int,
    header: tuple[str, str],
    error: dict[str, Any],
) -> None:
    stream = Stream(running.stub)
    await stream.send(request_headers(strategy=strategy))
    reply = await stream.send(request_body(body))

    assert reply.WhichOneof("response") == "immediate_response"
    immediate = reply.immediate_response
    assert immediate.status.code == status
    headers = set_headers(immediate.headers)
    assert headers[header[0]] == header[1].encode()
    assert headers["content-type"] == b"application/json"
    doc = orjson.loads(immediate.body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert error.items() <= doc["error"].items()
    await stream.finish()

    pool = running.gateway.pool
    for pod in running.pods.values():
        assert (pool.routed_total(pod.key), pool.inflight(pod.key)) == (0, 0)


async def test_llm_request_without_body_is_400(running: Running) -> None:
    stream = Stream(running.stub)
    reply = await stream.send(request_headers(end_of_stream=True))
    assert reply.immediate_response.status.code == 400
    assert set_headers(reply.immediate_response.headers)["x-error-request-body-processing"] == (
        b"true"
    )
    await stream.finish()


# --- health and HTTP ----------------------------------------------------------------------------


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
    return int(reply.status)


async def test_grpc_health_serving_once_discovery_loaded(running: Running) -> None:
    statuses: dict[str, int] = {}

    async def poll() -> None:
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            statuses[service] = await _health(running.channel, service)

    for _ in range(int(WAIT_S / 0.01)):
        await poll()
        if set(statuses.values()) == {SERVING}:
            break
        await asyncio.sleep(0.01)
    assert statuses == {"": SERVING, "envoy.service.ext_proc.v3.ExternalProcessor": SERVING}


class GatedSource:
    """A pod source that delivers its list only when the test opens the gate."""

    def __init__(self, pods: Sequence[Pod]) -> None:
        self.pods = list(pods)
        self.gate = asyncio.Event()

    async def run(self, on_update: PodsCallback) -> None:
        await self.gate.wait()
        on_update(self.pods)
        await asyncio.Event().wait()


async def _until_serving(channel: grpc.aio.Channel) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if await _health(channel) == SERVING:
            return
        await asyncio.sleep(0.01)
    assert await _health(channel) == SERVING


@contextlib.asynccontextmanager
async def _probing(gateway: Gateway) -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    """Start `gateway`; yield a channel to its gRPC port and its /readyz URL; stop it after."""
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            yield channel, f"http://127.0.0.1:{gateway.http_port}/readyz"
    finally:
        await gateway.stop()


async def test_not_serving_and_not_ready_until_discovery_delivers(pods_file: Path) -> None:
    source = GatedSource(load_pods_file(str(pods_file)))
    gateway = Gateway(gateway_settings(SETTINGS_ENV), source, "127.0.0.1")
    async with _probing(gateway) as (channel, url), aiohttp.ClientSession() as http:
        assert await _health(channel) == NOT_SERVING
        async with http.get(url) as resp:
            assert resp.status == 503

        # An LLM request before discovery: the model is unknown, answered by the plugin.
        stream = Stream(pb_grpc.ExternalProcessorStub(channel))
        await stream.send(request_headers())
        reply = await stream.send(request_body(CHAT_BODY))
        assert reply.immediate_response.status.code == 400
        await stream.finish()

        source.gate.set()
        await _until_serving(channel)
        async with http.get(url) as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ready", "pods": 2}


async def test_ready_only_once_the_engines_have_been_scraped(
    tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    """A restarted gateway must not take traffic blind: ready (gRPC health and /readyz) only after
    its first scrape round, answered or not. A dead engine is then already out of rotation."""
    gate = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        await gate.wait()
        return web.Response(text="vllm:num_requests_running 7\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    live = Pod("live", "default", MODEL, "127.0.0.1", int(runner.addresses[0][1]), 0)
    dead = Pod("dead", "default", MODEL, "127.0.0.1", reserve_port(), 0)
    source = StaticFileSource(str(write_pods_file(tmp_path / "pods.yaml", [live, dead])), 30.0)
    # The scrape timeout is far above this test's waits: the round ends when the gate opens.
    env = {**SETTINGS_ENV, "HETERO_GATEWAY_SCRAPE_TIMEOUT_MS": "20000"}
    gateway = Gateway(gateway_settings(env), source, "127.0.0.1")
    try:
        async with _probing(gateway) as (channel, url), aiohttp.ClientSession() as http:
            await eventually(lambda: gateway.pool.loaded, "pod discovery")
            await eventually(lambda: gateway.pool.unreachable(dead.key), "the dead pod's scrape")
            await asyncio.sleep(0.2)  # a gateway that did not wait would report ready by now
            assert await _health(channel) == NOT_SERVING
            async with http.get(url) as resp:
                assert resp.status == 503
                assert await resp.json() == {"status": "waiting for the first metrics scrape"}

            gate.set()
            await _until_serving(channel)
            async with http.get(url) as resp:
                assert resp.status == 200
            # What the gateway routes on once ready: the live engine's load, the dead one out.
            scraped = gateway.pool.scraped(live.key)
            assert scraped is not None and scraped[0].running == 7
            assert gateway.pool.unreachable(dead.key)
    finally:
        gate.set()
        await runner.cleanup()


async def test_an_engine_whose_metrics_page_is_of_no_use_stays_in_rotation(
    tmp_path: Path, serve_app: Callable[..., Any], reserve_port: Callable[[], int]
) -> None:
    """Three engines: one with a vLLM page, one answering 404 (a wrong metrics path), one
    refusing. The 404 one is alive: it stays a candidate, flagged in /debug/pods and in
    `hetero_gateway_engine_health`; only the refusing one is out."""

    async def page(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")

    live_app, wrong_app = web.Application(), web.Application()  # the second serves no /metrics
    live_app.router.add_get("/metrics", page)
    live = Pod("live", "default", MODEL, "127.0.0.1", await serve_app(live_app), 0)
    wrong = Pod("wrong", "default", MODEL, "127.0.0.1", await serve_app(wrong_app), 0)
    dead = Pod("dead", "default", MODEL, "127.0.0.1", reserve_port(), 0)
    pods = [live, wrong, dead]
    source = StaticFileSource(str(write_pods_file(tmp_path / "pods.yaml", pods)), 30.0)
    gateway = Gateway(gateway_settings(SETTINGS_ENV), source, "127.0.0.1")
    async with _probing(gateway) as (channel, url), aiohttp.ClientSession() as http:
        await _until_serving(channel)
        base = url.removesuffix("/readyz")
        async with http.get(f"{base}/debug/pods") as resp:
            described = (await resp.json())["pods"]
        assert {k: (v["unreachable"], v["metrics_unusable"]) for k, v in described.items()} == {
            live.key: (False, None),
            wrong.key: (False, "HTTP 404 Not Found"),
            dead.key: (True, None),
        }
        now = gateway.router.now()
        assert {c.pod.key for c in gateway.pool.candidates(MODEL, now)} == {live.key, wrong.key}
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
    health = _samples(text, "hetero_gateway_engine_health")
    up = {dict(k)["pod"]: dict(k)["state"] for k, v in health.items() if v == 1.0}
    assert up == {live.key: "up", wrong.key: "unusable", dead.key: "unreachable"}
    assert len(health) == 9  # every state of every pod, 0 where it is not
    errors = _samples(text, "hetero_gateway_engine_scrape_errors_total")
    failed = {(dict(k)["pod"], dict(k)["cause"]) for k, v in errors.items() if v > 0}
    assert failed == {(wrong.key, "unusable"), (dead.key, "unreachable")}


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_http_metrics_and_readiness(running: Running) -> None:
    stream, key = await _route(running)
    await stream.send(response_headers(200))
    await stream.send(response_body(b"".join(sse_chunks()), end_of_stream=True))
    await stream.finish()
    bad = Stream(running.stub)
    await bad.send(request_headers())
    await bad.send(request_body(b"{not json"))
    await bad.finish()

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{running.http}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        async with http.get(f"{running.http}/readyz") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ready", "pods": 2}
        async with http.get(f"{running.http}/healthz") as resp:
            assert resp.status == 200
        async with http.get(f"{running.http}/debug/pods") as resp:
            debug = await resp.json()

    other = next(p.key for p in running.pods.values() if p.key != key)
    routed = _samples(text, "hetero_gateway_routed_requests_total")
    assert routed == {
        (("model", MODEL), ("pod", key)): 1.0,
        (("model", MODEL), ("pod", other)): 0.0,
    }
    tokens = _samples(text, "hetero_gateway_output_tokens_total")
    assert tokens[(("model", MODEL), ("pod", key), ("source", "reported"))] == COMPLETION_TOKENS
    assert tokens[(("model", MODEL), ("pod", key), ("source", "estimated"))] == 0.0
    assert set(_samples(text, "hetero_gateway_inflight_requests").values()) == {0.0}
    assert _samples(text, "hetero_gateway_request_errors_total") == {
        (("reason", "BadRequestBody"), ("status", "400")): 1.0
    }
    assert debug["pods"][key]["routed_total"] == 1
    assert debug["pods"][key]["output_tokens_total"] == COMPLETION_TOKENS


# --- a strategy that holds requests ---------------------------------------------------------------


@dataclass(frozen=True)
class OnePerPod(Strategy):
    """Routes to a pod with nothing in flight; holds the request while every pod is busy."""

    wait_s: float
    name: str = "one-per-pod"

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: Any, now: float
    ) -> Admission:
        free = [c for c in candidates if c.running == 0]
        return Route(free[0]) if free else Wait(deadline=request.arrived_at + self.wait_s)


@pytest_asyncio.fixture(params=[30.0])
async def holding(
    pods_file: Path, start_gateway: StartGateway, request: pytest.FixtureRequest
) -> AsyncIterator[Running]:
    """A gateway whose default strategy is `OnePerPod` (two pods: the third request waits)."""
    held = OnePerPod(request.param)
    strategies: dict[str, Strategy] = {**build_strategies(), held.name: held}
    gateway = await start_gateway(
        pods_file, SETTINGS_ENV, strategies=strategies, default_strategy=held.name
    )
    async for r in _connected(gateway, pods_file):
        yield r


async def _held(r: Running) -> tuple[Stream, asyncio.Task[pb.ProcessingResponse]]:
    """A third request that the strategy holds: Envoy is told to wait longer than its message
    timeout for it (the longest hold, 30 s by default, plus 1 s); its body reply is pending."""
    stream = Stream(r.stub)
    assert await stream.send(request_headers()) == HEADERS_CONTINUE
    notice = await stream.send(request_body(CHAT_BODY))
    assert notice == pb.ProcessingResponse(override_message_timeout=Duration(seconds=31))
    reply = asyncio.ensure_future(stream.call.read())
    await eventually(lambda: r.gateway.router.waiting(MODEL) == 1, "the request to be held")
    assert not reply.done()
    return stream, reply


def _inflight(r: Running) -> dict[str, int]:
    return {p.key: r.gateway.pool.inflight(p.key) for p in r.pods.values()}


async def test_a_held_request_cancelled_by_the_client_leaves_nothing(holding: Running) -> None:
    first, key1 = await _route(holding)
    second, key2 = await _route(holding)
    assert {key1, key2} == {p.key for p in holding.pods.values()}
    stream, reply = await _held(holding)

    stream.call.cancel()

    await eventually(lambda: holding.gateway.router.waiting() == 0, "the queue to empty")
    assert _inflight(holding) == {key1: 1, key2: 1}
    # The slots the held request waited for free up: nobody takes them any more.
    for s in (first, second):
        await s.send(response_headers(200, end_of_stream=True))
        await s.finish()
    assert _inflight(holding) == {key1: 0, key2: 0}
    assert holding.gateway.pool.routed_total(key1) + holding.gateway.pool.routed_total(key2) == 2
    reply.cancel()


async def test_a_released_lease_wakes_a_held_request(holding: Running) -> None:
    first, key1 = await _route(holding)
    second, _ = await _route(holding)
    stream, reply = await _held(holding)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{holding.http}/metrics") as resp:
            held = _samples(await resp.text(), "hetero_gateway_waiting_requests")
        async with http.get(f"{holding.http}/debug/pods") as resp:
            debug = await resp.json()
    assert held == {(("model", MODEL),): 1.0}
    assert debug["waiting"] == {MODEL: 1}

    await first.send(response_headers(200, end_of_stream=True))  # releases key1's slot

    async with asyncio.timeout(WAIT_S):
        routed = await reply
    assert routed.WhichOneof("response") == "request_body"
    target = set_headers(routed.request_body.response.header_mutation)["target-pod"]
    assert holding.key_of(target) == key1
    assert holding.gateway.router.waiting() == 0
    assert holding.gateway.pool.inflight(key1) == 1
    for s in (stream, second):
        await s.send(response_headers(200, end_of_stream=True))
        await s.finish()
    await first.finish()
    assert set(_inflight(holding).values()) == {0}


@pytest.mark.parametrize("holding", [0.2], indirect=True)
async def test_a_held_request_past_its_deadline_gets_503(holding: Running) -> None:
    first, _ = await _route(holding)
    second, _ = await _route(holding)
    stream, reply = await _held(holding)

    async with asyncio.timeout(WAIT_S):
        rejected = await reply
    assert rejected.immediate_response.status.code == 503
    assert set_headers(rejected.immediate_response.headers)["x-error-routing"] == b"true"
    assert holding.gateway.router.waiting() == 0
    await stream.finish()
    for s in (first, second):
        await s.send(response_headers(200, end_of_stream=True))
        await s.finish()
    assert set(_inflight(holding).values()) == {0}


@pytest.mark.parametrize(
    ("headers", "param"),
    [({"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"), ({"x-slo-tpot-ms": "-5"}, "x-slo-tpot-ms")],
    ids=["ttft-not-a-number", "tpot-negative"],
)
async def test_a_malformed_slo_header_is_400(
    running: Running, headers: dict[str, str], param: str
) -> None:
    stream = Stream(running.stub)
    await stream.send(request_headers(extra=headers))
    reply = await stream.send(request_body(CHAT_BODY))
    immediate = reply.immediate_response
    assert immediate.status.code == 400
    assert set_headers(immediate.headers)["x-error-request-header-processing"] == b"true"
    error = orjson.loads(immediate.body)["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    await stream.finish()
    assert set(_inflight(running).values()) == {0}


async def test_shutdown_answers_held_requests_at_once_and_counts_them(holding: Running) -> None:
    first, _ = await _route(holding)
    second, _ = await _route(holding)
    stream, reply = await _held(holding)
    stopping = asyncio.ensure_future(holding.gateway.stop())
    async with asyncio.timeout(5.0):  # far below the 30 s the strategy would hold it
        rejected = await reply
    assert rejected.immediate_response.status.code == 503
    assert b"shutting down" in rejected.immediate_response.body
    await stream.finish()
    for s in (first, second):  # routed requests still drain normally
        await s.send(response_headers(200, end_of_stream=True))
        await s.finish()
    await stopping
    waits = holding.gateway.router.waits.by_outcome  # the wait histogram
    assert (waits[True].count, waits[False].count) == (0, 1)
    assert holding.gateway.servicer.errors.counts == {(503, "ShuttingDown"): 1}
    assert set(_inflight(holding).values()) == {0}


async def test_a_huge_unknown_model_name_gets_a_small_400(running: Running) -> None:
    """A name of almost the whole gRPC message limit used to make a reply larger than the
    plugin's own send limit: 503 with an empty body and a traceback per request."""
    name = "m" * (4 * 1024 * 1024 - 1024)
    stream = Stream(running.stub)
    await stream.send(request_headers())
    reply = await stream.send(request_body(orjson.dumps({"model": name, "messages": []})))
    immediate = reply.immediate_response
    assert immediate.status.code == 400
    assert len(immediate.body) < 2048
    message = orjson.loads(immediate.body)["error"]["message"]
    assert message.endswith(f"... ({len(name)} characters) does not exist")
    assert len(set_headers(immediate.headers)["x-error-no-model-backends"]) <= 128
    await stream.finish()


# --- operator-locked routing headers ---------------------------------------------------------


async def _locked_gateway(
    tmp_path: Path,
    reserve_port: Callable[[], int],
    start_gateway: StartGateway,
    env: dict[str, str],
    config: dict[str, Any] | None = None,
) -> AsyncIterator[Running]:
    """Two pods of MODEL (`config`: the model's config document) and a gateway with
    SETTINGS_ENV and `env`."""
    entries = [
        {
            "name": n,
            "namespace": "default",
            "address": "127.0.0.1",
            "port": reserve_port(),
            "labels": {"gpu": "a100"},
        }
        for n in ("a", "b")
    ]
    spec: dict[str, Any] = {"pods": entries}
    if config is not None:
        spec["config"] = config
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump({"models": {MODEL: spec}}), encoding="utf-8")
    gateway = await start_gateway(path, {**SETTINGS_ENV, **env})
    async for r in _connected(gateway, path):
        yield r


async def _ask(r: Running, headers: dict[str, str]) -> pb.ProcessingResponse:
    """A request with these routing headers through headers and body: the body's reply."""
    stream = Stream(r.stub)
    assert await stream.send(request_headers(extra=headers)) == HEADERS_CONTINUE
    reply = await stream.send(request_body(CHAT_BODY))
    stream.call.cancel()  # routed or refused: nothing more of this request matters here
    return reply


def _refusal(reply: pb.ProcessingResponse) -> dict[str, Any]:
    immediate = reply.immediate_response
    assert immediate.status.code == 403
    assert set_headers(immediate.headers)["x-error-request-header-processing"] == b"true"
    error: dict[str, Any] = orjson.loads(immediate.body)["error"]
    assert (error["type"], error["code"]) == ("permission_error", "header_not_allowed")
    return error


def _routed_by(reply: pb.ProcessingResponse) -> str:
    assert reply.WhichOneof("response") == "request_body", reply
    return set_headers(reply.request_body.response.header_mutation)["routing-strategy"].decode()


LOCK = "routing-strategy=random|least-request; external-filter=deny"


async def test_a_locked_routing_header_gets_a_403_naming_it(
    tmp_path: Path, reserve_port: Callable[[], int], start_gateway: StartGateway
) -> None:
    async for r in _locked_gateway(
        tmp_path, reserve_port, start_gateway, {"HETERO_GATEWAY_CLIENT_HEADERS": LOCK}
    ):
        assert _routed_by(await _ask(r, {"routing-strategy": "least-request"})) == "least-request"
        blend = await _ask(r, {"routing-strategy": "random:1,least-request:2"})
        assert _routed_by(blend) == "random:1,least-request:2"
        assert _routed_by(await _ask(r, {})) == "load-balance"  # no header: the default
        error = _refusal(await _ask(r, {"routing-strategy": "round-robin"}))
        assert error["param"] == "routing-strategy"
        assert "least-request|random" in error["message"]
        error = _refusal(await _ask(r, {"routing-strategy": "random:1,round-robin:1"}))
        assert error["param"] == "routing-strategy"
        error = _refusal(await _ask(r, {"external-filter": "gpu=a100"}))
        assert error["param"] == "external-filter" and "may not be sent" in error["message"]
        assert _routed_by(await _ask(r, {"x-slo-ttft-ms": "500"})) == "load-balance"  # unlocked
        assert r.gateway.servicer.errors.counts[(403, "HeaderNotAllowed")] == 3


async def test_an_ignored_locked_header_routes_as_if_it_was_not_sent(
    tmp_path: Path,
    reserve_port: Callable[[], int],
    start_gateway: StartGateway,
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"HETERO_GATEWAY_CLIENT_HEADERS": LOCK, "HETERO_GATEWAY_DENIED_HEADER_ACTION": "ignore"}
    async for r in _locked_gateway(tmp_path, reserve_port, start_gateway, env):
        for _ in range(2):
            assert _routed_by(await _ask(r, {"routing-strategy": "round-robin"})) == "load-balance"
        # A selector that matches no pod would fail the request: ignored, it routes.
        assert _routed_by(await _ask(r, {"external-filter": "gpu=none"})) == "load-balance"
    ignored = [m for m in caplog.messages if m.startswith("ignoring the")]
    assert len(ignored) == 2  # once per header
    assert "routing-strategy" in ignored[0] and "external-filter" in ignored[1]


async def test_a_model_s_config_locks_or_lifts_headers_for_its_requests(
    tmp_path: Path, reserve_port: Callable[[], int], start_gateway: StartGateway
) -> None:
    """`clientHeaders` in the model's config document: its rule replaces the gateway-wide one
    for that header; the others stand."""
    config = {"clientHeaders": {"external-filter": "allow", "x-slo-ttft-ms": "deny"}}
    async for r in _locked_gateway(
        tmp_path,
        reserve_port,
        start_gateway,
        {"HETERO_GATEWAY_CLIENT_HEADERS": LOCK},
        config,
    ):
        assert r.gateway.pool.model_config(MODEL) is not None
        assert _routed_by(await _ask(r, {"external-filter": "gpu=a100"})) == "load-balance"
        assert _refusal(await _ask(r, {"x-slo-ttft-ms": "500"}))["param"] == "x-slo-ttft-ms"
        assert _refusal(await _ask(r, {"routing-strategy": "round-robin"}))
        assert _routed_by(await _ask(r, {"routing-strategy": "random"})) == "random"


@pytest.mark.parametrize(
    ("path", "method", "allowed"),
    [
        ("/v1/chat/completions", "GET", b"POST"),
        ("/v1/chat/completions", "PUT", b"POST"),
        ("/v1/models", "POST", b"GET"),
        ("/v1/models", "DELETE", b"GET"),
    ],
)
async def test_a_path_the_gateway_serves_asked_with_another_method_is_405(
    running: Running, path: str, method: str, allowed: bytes
) -> None:
    """Not passed on to an engine (which would answer 503 "no replica" through Envoy): the
    gateway serves these paths itself."""
    stream = Stream(running.stub)
    reply = await stream.send(request_headers(path=path, method=method))
    immediate = reply.immediate_response
    assert immediate.status.code == 405
    assert set_headers(immediate.headers)["allow"] == allowed
    error = orjson.loads(immediate.body)["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    await stream.finish()


async def test_external_filter_header_narrows_the_pods_and_a_bad_one_is_400(
    tmp_path: Path, reserve_port: Callable[[], int], start_gateway: StartGateway
) -> None:
    """AIBrix's `external-filter`: a label selector over the model's pods (its profile sweep
    measures one GPU type through the gateway with it)."""
    pods = [
        Pod(n, "default", MODEL, "127.0.0.1", reserve_port(), 0, labels={"gpu": gpu})
        for n, gpu in (("a", "a100"), ("b", "l20"))
    ]
    pods_file = write_pods_file(tmp_path / "pods.yaml", pods)
    gateway = await start_gateway(pods_file, SETTINGS_ENV)
    async for r in _connected(gateway, pods_file):
        streams = []
        for _ in range(4):  # least-request would alternate; the filter keeps every one on b
            stream = Stream(r.stub)
            await stream.send(
                request_headers(strategy="least-request", extra={"external-filter": "gpu=l20"})
            )
            reply = await stream.send(request_body(CHAT_BODY))
            target = set_headers(reply.request_body.response.header_mutation)["target-pod"]
            assert r.key_of(target) == "default/b"
            streams.append(stream)
        for stream in streams:
            await stream.send(response_headers(200))
            await stream.send(response_body(b"".join(sse_chunks(3)), end_of_stream=True))
            await stream.finish()

        for selector, status, header in (
            ("gpu in (a100", 400, "x-error-request-header-processing"),
            ("gpu=h100", 503, "x-error-routing"),
        ):
            stream = Stream(r.stub)
            await stream.send(request_headers(extra={"external-filter": selector}))
            immediate = (await stream.send(request_body(CHAT_BODY))).immediate_response
            assert immediate.status.code == status
            assert set_headers(immediate.headers)[header] == b"true"
            assert "external-filter" in orjson.loads(immediate.body)["error"]["message"]
            await stream.finish()
        assert set(_inflight(r).values()) == {0}


@dataclass(frozen=True)
class Predicting(Strategy):
    """Routes to the first pod and predicts the request takes `expected_s` end to end."""

    expected_s: float
    name: str = "predicting"

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: Any, now: float
    ) -> Admission:
        return Route(candidates[0], expected_e2e_s=self.expected_s)


async def test_predicted_and_actual_latency_reach_metrics(
    pods_file: Path, start_gateway: StartGateway
) -> None:
    """A served request a strategy predicted is in `hetero_gateway_slo_e2e_ratio` (actual over
    predicted); a failed one is not."""
    strategy = Predicting(expected_s=60.0)  # far slower than this test: ratio below 0.25
    gateway = await start_gateway(
        pods_file,
        SETTINGS_ENV,
        strategies={**build_strategies(), strategy.name: strategy},
        default_strategy=strategy.name,
    )
    async for r in _connected(gateway, pods_file):
        for status in (200, 500):
            stream, _ = await _route(r)
            await stream.send(response_headers(status))
            await stream.send(response_body(b"".join(sse_chunks(3)), end_of_stream=True))
            await stream.finish()
        async with aiohttp.ClientSession() as session, session.get(f"{r.http}/metrics") as resp:
            text = await resp.text()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "hetero_gateway_slo_e2e_ratio"
        for s in f.samples
    }
    assert samples[("hetero_gateway_slo_e2e_ratio_count", None)] == 1
    assert samples[("hetero_gateway_slo_e2e_ratio_bucket", "0.25")] == 1


# The most extra headers a request may carry: 7 base + extra + 4 added within Envoy's limit as
# `envoy-config` renders it (Envoy's default 100 plus room for routing's own headers).
MOST_EXTRA = DEFAULT_MAX_HEADERS - 11


@pytest.mark.parametrize(
    ("extra", "steering", "status"),
    [(MOST_EXTRA, 0, None), (MOST_EXTRA + 1, 0, 431), (MOST_EXTRA + 1, 3, None)],
    ids=["at-the-limit", "one-over", "client-steering-headers-are-replaced-not-added"],
)
async def test_headers_the_gateway_would_take_over_envoy_s_limit_get_431(
    running: Running, extra: int, steering: int, status: int | None
) -> None:
    """Routing adds target-pod, x-gateway-destination-endpoint, the prompt-tokens header (and
    routing-strategy when absent): 7 base + `extra` + 4 added must stay within the limit."""
    headers = {f"x-extra-{i}": "v" for i in range(extra - steering)}
    for name in ("target-pod", "x-gateway-destination-endpoint", "x-hetero-gateway-prompt-tokens")[
        :steering
    ]:
        headers[name] = "10.0.0.9:8000"
    stream = Stream(running.stub)
    reply = await stream.send(request_headers(extra=headers))
    if status is None:
        assert reply == HEADERS_CONTINUE
    else:
        immediate = reply.immediate_response
        assert immediate.status.code == status
        assert set_headers(immediate.headers)["x-error-request-header-processing"] == b"true"
        assert "too many request headers" in orjson.loads(immediate.body)["error"]["message"]
    await stream.finish()


PICK_ONLY = (("x-hetero-gateway-routing", "pick-only"),)


async def _pick(r: Running, request_id: str) -> str:
    """A pick-only routing stream: the plugin answers the body and ends the stream itself."""
    return (await _pick_headers(r, request_id))["target-pod"].decode()


async def _pick_headers(r: Running, request_id: str) -> dict[str, bytes]:
    """`_pick`, returning the headers the pick set on the request."""
    call = r.stub.Process(metadata=PICK_ONLY)
    await call.write(request_headers(request_id=request_id))
    async with asyncio.timeout(WAIT_S):
        assert await call.read() == HEADERS_CONTINUE
        await call.write(request_body(CHAT_BODY))
        reply = await call.read()
        headers = set_headers(reply.request_body.response.header_mutation)
        pod_name = reply.dynamic_metadata.fields["hetero_gateway"].struct_value.fields["pod"]
        target = headers["target-pod"].decode()
        assert pod_name.string_value == r.pods[target].name  # for the route's header
        assert await call.read() is grpc.aio.EOF  # ended by the plugin, not by Envoy
        assert await call.code() == grpc.StatusCode.OK
    return headers


def _counting(
    endpoint: str,
    request_id: str,
    status: int,
    tokens: int,
    forwarded: dict[str, bytes] | None = None,
) -> list[pb.ProcessingRequest]:
    """The counting stream of a request; `forwarded`: the headers the pick set on it (Envoy
    sends the counting filter the request as the routing filter left it)."""
    headers = request_headers(request_id=request_id)
    for key, value in (forwarded or {"target-pod": endpoint.encode()}).items():
        headers.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key=key, raw_value=value)
        )
    return [
        _observed(headers),
        _observed(response_headers(status)),
        *(_observed(response_body(c)) for c in sse_chunks(tokens)),
        _observed(response_body(b"", end_of_stream=True)),
    ]


async def test_pick_only_routing_hands_its_lease_to_the_counting_stream(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the pick-only wiring the routing stream ends at the pick (a plugin crash can no
    longer cut the response) and the counting stream of the same request holds the lease:
    in flight until the response ends, told when the response streams (the first chunk),
    released with its tokens and status."""
    pool = running.gateway.pool
    streaming = spy_streaming(monkeypatch)
    endpoint = await _pick(running, "req-a")
    key = running.key_of(endpoint)
    assert pool.inflight(key) == 1 and len(running.gateway.servicer.handoff) == 1
    call = running.stub.Process(iter(_counting(endpoint, "req-a", 200, 9)))
    async with asyncio.timeout(WAIT_S):
        assert [r async for r in call] == []
    await eventually(lambda: pool.inflight(key) == 0, "the counting stream to release it")
    assert pool.output_tokens_total(key) == 9 and pool.routed_total(key) == 1
    assert len(running.gateway.servicer.handoff) == 0
    assert streaming == [(key, False)]


async def test_the_counting_stream_tells_the_pool_when_the_prompt_was_prefilled(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk-gap watch weighs the prompts a replica's steps may prefill: the lease carries
    the routed prompt's tokens, the counting stream learns them from the header the pick set
    and marks them started at the first event; nothing is left counted at the end, and the
    end tells the pod's watch the response's tokens and events (its tokens per chunk)."""
    pool = running.gateway.pool
    headers = await _pick_headers(running, "req-p")
    endpoint = headers["target-pod"].decode()
    key = running.key_of(endpoint)
    prompt = int(headers[PROMPT_TOKENS_HEADER])
    assert prompt > 0 and pool.prompt_tokens(key) == (prompt, 0)  # routed, not started
    calls: list[tuple[Any, ...]] = []
    for name in ("stream_started", "stream_ended"):
        real = getattr(PodPool, name)

        def spy(self: PodPool, k: str, *rest: int, name: str = name, real: Any = real) -> None:
            calls.append((name, k, *rest))
            real(self, k, *rest)

        monkeypatch.setattr(PodPool, name, spy)
    call = running.stub.Process(iter(_counting(endpoint, "req-p", 200, 5, headers)))
    async with asyncio.timeout(WAIT_S):
        assert [r async for r in call] == []
    await eventually(lambda: pool.inflight(key) == 0, "the counting stream to release it")
    # Five tokens in four data events (three deltas and the usage): 1.25 tokens a chunk.
    assert calls == [("stream_started", key, prompt), ("stream_ended", key, prompt, 5, 4)]
    assert pool.snapshot(running.gateway.router.now())["pods"][key]["tokens_per_chunk"] == 1.25
    assert pool.prompt_tokens(key) == (0, 0)


async def test_a_cut_stream_is_credited_at_the_pod_s_learned_tokens_per_chunk(
    running: Running,
) -> None:
    """A stream its client cut carries no usage: its chunks are credited at what the pod's
    streams showed a chunk carries (here 40 tokens in 4 events: 10), not one token a chunk."""
    pool = running.gateway.pool
    headers = await _pick_headers(running, "req-cut")  # its lease waits for its counting stream
    endpoint = headers["target-pod"].decode()
    key = running.key_of(endpoint)
    # Another request's response on the same pod, whole, with the engine's count.
    call = running.stub.Process(iter(_counting(endpoint, "req-other", 200, 40)))
    async with asyncio.timeout(WAIT_S):
        assert [r async for r in call] == []
    await eventually(lambda: pool.tokens_per_chunk(key) == 10.0, "the pod's tokens per chunk")
    assert pool.output_tokens_total(key) == 40 and pool.inflight(key) == 1

    cut = _counting(endpoint, "req-cut", 200, 40, headers)[:-2]  # ends inside the second piece
    call = running.stub.Process(iter(cut))
    async with asyncio.timeout(WAIT_S):
        assert [r async for r in call] == []
    await eventually(lambda: pool.inflight(key) == 0, "the cut stream to release its lease")
    # Before the cut: the first piece (one whole delta event) and the second (two more, and
    # half of the usage event): 3 events, 10 tokens each, estimated.
    assert pool.output_tokens_total(key) == 40 + 30
    assert pool.estimated_tokens_total(key) == 30


async def test_a_lease_no_counting_stream_claims_is_given_back(running: Running) -> None:
    running.gateway.servicer.handoff._timeout_s = 0.2  # the default is 10 s
    pool = running.gateway.pool
    key = running.key_of(await _pick(running, "req-b"))
    assert pool.inflight(key) == 1
    await eventually(lambda: pool.inflight(key) == 0, "the parked lease to expire")
    assert running.gateway.servicer.handoff.expired == 1


async def test_without_shared_state_a_lease_header_is_never_taken_over(running: Running) -> None:
    """A gateway without Redis names no replica in its lease headers, and takes over no count a
    header names: the counting stream of a request whose parked lease is gone (here: one a
    client made up) credits tokens and holds nothing."""
    pool = running.gateway.pool
    headers = await _pick_headers(running, "req-own")
    assert headers[LEASE_HEADER].decode().startswith(";")  # no gateway name
    endpoint = headers["target-pod"].decode()
    key = running.key_of(endpoint)
    made_up = {"target-pod": endpoint.encode(), LEASE_HEADER: b"gw-elsewhere;1;1"}
    call = running.stub.Process(iter(_counting(endpoint, "req-other", 200, 4, made_up)))
    async with asyncio.timeout(WAIT_S):
        assert [r async for r in call] == []
    await eventually(lambda: pool.output_tokens_total(key) == 4, "the tokens")
    assert pool.inflight(key) == 1  # the parked lease of req-own, nothing more
    assert running.gateway.servicer.handoff.adopted == 0


async def test_a_count_moves_to_the_replica_whose_counting_stream_has_the_request(
    tmp_path: Path, reserve_port: Callable[[], int], redis_server: Any, start_gateway: StartGateway
) -> None:
    """Two plugin replicas sharing Redis: the routing stream on one, the counting stream on the
    other. The second takes the count over (in flight on its pod with the share the lease header
    named, ended with the response's tokens); the first gives its parked lease back when the
    claim arrives through Redis, not at the handoff's 10 s expiry; every view ends at 0."""
    pods = [Pod(n, "default", MODEL, "127.0.0.1", reserve_port(), 0) for n in ("a", "b")]
    pods_file = write_pods_file(tmp_path / "pods.yaml", pods)
    shared = {**SETTINGS_ENV, "HETERO_GATEWAY_REDIS_SYNC_MS": "50"}
    first = await start_gateway(pods_file, {**shared, **redis_env(redis_server, "gw-1")})
    second = await start_gateway(pods_file, {**shared, **redis_env(redis_server, "gw-2")})
    async for one in _connected(first, pods_file):
        async for two in _connected(second, pods_file):
            await _hand_over(one, two)


async def _hand_over(one: Running, two: Running) -> None:
    """The routing stream on `one`, the counting stream on `two` (both sharing Redis)."""
    first, second = one.gateway, two.gateway
    headers = await _pick_headers(one, "req-x")
    assert headers[LEASE_HEADER].decode().startswith("gw-1;")
    endpoint = headers["target-pod"].decode()
    key = one.key_of(endpoint)
    counting = _counting(endpoint, "req-x", 200, 9, headers)
    call = two.stub.Process()
    for message in counting[:-1]:  # the response is still streaming
        await call.write(message)
    await eventually(lambda: second.servicer.handoff.adopted == 1, "gw-2 to take over")
    assert second.pool.inflight(key) == 1
    await eventually(lambda: first.pool.inflight(key) == 0, "the claim to reach gw-1")
    assert first.servicer.handoff.released_elsewhere == 1
    assert first.servicer.handoff.expired == 0
    await eventually(lambda: first.pool.remote_inflight(key) == 1, "gw-2's count in gw-1")
    await call.write(counting[-1])
    await call.done_writing()
    async with asyncio.timeout(WAIT_S):
        assert await call.read() is grpc.aio.EOF  # no reply: observability mode
    await eventually(lambda: second.pool.inflight(key) == 0, "the adopted count to end")
    await eventually(lambda: first.pool.remote_inflight(key) == 0, "gw-1's view at 0")
    assert second.pool.output_tokens_total(key) == 9


async def test_a_5xx_seen_by_the_counting_stream_counts_toward_ejection(running: Running) -> None:
    pool = running.gateway.pool
    now = running.gateway.router.now
    for i in range(12):
        endpoint = await _pick(running, f"req-{i}")
        call = running.stub.Process(iter(_counting(endpoint, f"req-{i}", 503, 0)))
        async with asyncio.timeout(WAIT_S):
            assert [r async for r in call] == []
        key = running.key_of(endpoint)

        def released(key: str = key) -> bool:
            return pool.inflight(key) == 0

        await eventually(released, "the release")
        if pool.ejected(key, now()):
            return
    raise AssertionError("no pod was ejected after 12 upstream 503s")


STRIPS_USAGE = (("x-hetero-gateway-usage", "strip"), *PICK_ONLY)


@pytest.mark.parametrize(
    ("wiring", "options", "content_length", "asked"),
    [
        pytest.param(STRIPS_USAGE, None, True, True, id="asked-for-content-length-updated"),
        pytest.param(STRIPS_USAGE, None, False, True, id="asked-for-chunked-no-length-added"),
        pytest.param(STRIPS_USAGE, {"include_usage": True}, True, False, id="client-asked"),
        pytest.param(PICK_ONLY, None, True, False, id="envoy-does-not-strip-usage"),
    ],
)
async def test_a_stream_is_made_to_report_usage_only_where_envoy_takes_it_out_again(
    running: Running,
    wiring: tuple[tuple[str, str], ...],
    options: dict[str, bool] | None,
    content_length: bool,
    asked: bool,
) -> None:
    body = {k: v for k, v in CHAT_BODY.items() if k != "stream_options"}
    if options is not None:
        body["stream_options"] = options
    raw = orjson.dumps(body)
    extra = {"content-length": str(len(raw))} if content_length else {}
    call = running.stub.Process(metadata=wiring)
    await call.write(request_headers(request_id="req-u", extra=extra))
    async with asyncio.timeout(WAIT_S):
        await call.read()
        await call.write(request_body(raw))
        reply = await call.read()
    common = reply.request_body.response
    marks = reply.dynamic_metadata.fields["hetero_gateway"].struct_value.fields
    headers = set_headers(common.header_mutation)
    if asked:
        sent = orjson.loads(common.body_mutation.body)
        assert sent == {**body, "stream_options": {"include_usage": True}}
        assert marks["strip_usage"].bool_value is True
        expected = str(len(common.body_mutation.body)).encode() if content_length else None
        assert headers.get("content-length") == expected
    else:
        assert not common.HasField("body_mutation")
        assert "strip_usage" not in marks and "content-length" not in headers
    call.cancel()


# --- admission ------------------------------------------------------------------------------------

ADMISSION_ENV = {
    **SETTINGS_ENV,
    "HETERO_GATEWAY_ADMISSION": "on",
    "HETERO_GATEWAY_TENANT_HEADER": "x-tenant",
    "HETERO_GATEWAY_PRIORITY_CLASSES": "interactive,batch",
    "HETERO_GATEWAY_TENANT_CLASSES": "chat:interactive",
    "HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS": "1500",
    "ROUTING_ALGORITHM": "least-request",
}


@pytest_asyncio.fixture
async def admitting(
    tmp_path: Path, reserve_port: Callable[[], int], start_gateway: StartGateway
) -> AsyncIterator[Running]:
    """Admission on, two pods whose engine batches hold one request each (`maxNumSeqs`)."""
    pods = [Pod(n, "default", MODEL, "127.0.0.1", reserve_port(), 0) for n in ("a", "b")]
    path = write_pods_file(tmp_path / "pods.yaml", pods)
    document = yaml.safe_load(path.read_text())
    document["models"][MODEL]["maxNumSeqs"] = 1
    path.write_text(yaml.safe_dump(document))
    gateway = await start_gateway(path, ADMISSION_ENV)
    async for r in _connected(gateway, path):
        yield r


async def _queued(r: Running, tenant: str) -> tuple[Stream, asyncio.Future[Any]]:
    stream = Stream(r.stub)
    assert await stream.send(request_headers(extra={"x-tenant": tenant})) == HEADERS_CONTINUE
    before = r.gateway.router.waiting(MODEL)
    notice = await stream.send(request_body(CHAT_BODY))
    assert notice == pb.ProcessingResponse(override_message_timeout=Duration(seconds=31))
    reply = asyncio.ensure_future(stream.call.read())
    await eventually(lambda: r.gateway.router.waiting(MODEL) == before + 1, "it to queue")
    return stream, reply


async def test_admission_serves_the_higher_class_first_and_sheds_with_retry_after(
    admitting: Running,
) -> None:
    r = admitting
    first, key1 = await _route(r)
    second, _ = await _route(r)
    bulk_stream, bulk = await _queued(r, "bulk")  # batch class, queued first
    chat_stream, chat = await _queued(r, "chat")  # interactive, queued after it

    await first.send(response_headers(200, end_of_stream=True))  # one batch slot frees

    async with asyncio.timeout(WAIT_S):
        routed = await chat
    assert routed.WhichOneof("response") == "request_body"
    assert r.key_of(set_headers(routed.request_body.response.header_mutation)["target-pod"]) == key1
    assert not bulk.done()
    async with asyncio.timeout(WAIT_S):  # the batch request's wait runs out: shed
        shed = await bulk
    immediate = shed.immediate_response
    assert immediate.status.code == 503
    headers = set_headers(immediate.headers)
    assert int(headers["retry-after"]) >= 1 and headers["x-error-routing"] == b"true"
    assert orjson.loads(immediate.body)["error"]["type"] == "overloaded_error"
    assert r.gateway.router.waiting() == 0
    async with aiohttp.ClientSession() as http, http.get(f"{r.http}/metrics") as resp:
        page = await resp.text()
    shed = _samples(page, "hetero_gateway_admission_shed_requests_total")
    assert shed == {(("class", "batch"), ("model", MODEL), ("reason", "timeout")): 1.0}
    assert _samples(page, "hetero_gateway_admission_waiting_requests") == {
        (("class", "interactive"), ("model", MODEL)): 0.0,
        (("class", "batch"), ("model", MODEL)): 0.0,
    }
    await bulk_stream.finish()
    for s in (chat_stream, second):
        await s.send(response_headers(200, end_of_stream=True))
        await s.finish()
    await first.finish()
    assert set(_inflight(r).values()) == {0}


@pytest_asyncio.fixture
async def limited(
    tmp_path: Path, reserve_port: Callable[[], int], start_gateway: StartGateway
) -> AsyncIterator[Running]:
    """Admission on, tenants `team` and `bob` limited to 2 requests a minute each."""
    pods = [Pod(n, "default", MODEL, "127.0.0.1", reserve_port(), 0) for n in ("a", "b")]
    path = write_pods_file(tmp_path / "pods.yaml", pods)
    env = {**ADMISSION_ENV, "HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE": "team:2,bob:2"}
    gateway = await start_gateway(path, env)
    async for r in _connected(gateway, path):
        yield r


async def test_a_tenant_over_its_limit_gets_429_and_the_others_see_what_remains(
    limited: Running,
) -> None:
    r = limited
    streams = []
    for remaining in ("1", "0"):
        stream = Stream(r.stub)
        assert await stream.send(request_headers(extra={"x-tenant": "team"})) == HEADERS_CONTINUE
        reply = await stream.send(request_body(CHAT_BODY))
        assert reply.WhichOneof("response") == "request_body"
        answer = await stream.send(response_headers(200))
        headers = set_headers(answer.response_headers.response.header_mutation)
        assert headers["x-ratelimit-limit-requests"] == b"2"
        assert headers["x-ratelimit-remaining-requests"] == remaining.encode()
        assert headers["x-ratelimit-reset-requests"].endswith(b"s")
        streams.append(stream)
    stream = Stream(r.stub)
    assert await stream.send(request_headers(extra={"x-tenant": "team"})) == HEADERS_CONTINUE
    refused = (await stream.send(request_body(CHAT_BODY))).immediate_response
    assert refused.status.code == 429
    headers = set_headers(refused.headers)
    assert headers["x-error-rpm-exceeded"] == b"true" and int(headers["retry-after"]) >= 59
    assert headers["x-ratelimit-remaining-requests"] == b"0"
    error = orjson.loads(refused.body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    await stream.finish()
    # Picking only, the plugin hands them to Envoy's route in metadata instead (as `pod`).
    call = r.stub.Process(metadata=PICK_ONLY)
    await call.write(request_headers(request_id="req-bob", extra={"x-tenant": "bob"}))
    async with asyncio.timeout(WAIT_S):
        assert await call.read() == HEADERS_CONTINUE
        await call.write(request_body(CHAT_BODY))
        pick = await call.read()
    picked = pick.dynamic_metadata.fields["hetero_gateway"].struct_value
    assert picked.fields["x-ratelimit-limit-requests"].string_value == "2"
    assert picked.fields["x-ratelimit-remaining-requests"].string_value == "1"
    forwarded = set_headers(pick.request_body.response.header_mutation)
    endpoint = forwarded["target-pod"].decode()
    # What it reserved, for a counting stream on another replica to settle (a client's copy is
    # removed from every request, as HEADERS_CONTINUE says: it is the plugin's to set).
    assert forwarded["x-hetero-gateway-reservation"].endswith(b";bob")
    assert (
        "x-hetero-gateway-reservation"
        in HEADERS_CONTINUE.request_headers.response.header_mutation.remove_headers
    )
    counting = r.stub.Process(iter(_counting(endpoint, "req-bob", 200, 9)))
    async with asyncio.timeout(WAIT_S):
        assert [m async for m in counting] == []
    other, _ = await _route(r)  # a tenant without limits is not held to team's
    async with aiohttp.ClientSession() as http, http.get(f"{r.http}/metrics") as resp:
        page = await resp.text()
    assert _samples(page, "hetero_gateway_rate_limited_requests_total") == {
        (("limit", "requests"), ("tenant", "team")): 1.0
    }
    for s in (*streams, other):
        await s.send(response_body(b"", end_of_stream=True))
        await s.finish()
    await eventually(lambda: set(_inflight(r).values()) == {0}, "every lease released")
