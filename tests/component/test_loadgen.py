"""Load generator: deterministic schedules, and a real run against a loopback SSE server."""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from plugin_tools.demo.loadgen import (
    LengthDist,
    Workload,
    _has_content,
    _usage_tokens,
    arrival_times,
    run_open_loop,
)
from tests.helpers import ServeApp, free_port

pytestmark = pytest.mark.component

# ---------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize(
    "dist",
    [
        LengthDist(median=100, sigma=0.8, low=10, high=400),
        LengthDist(median=5, sigma=2.0, low=1, high=8),
        LengthDist(median=50, sigma=0.0, low=1, high=1000),
    ],
    ids=["typical", "heavy-clipped", "degenerate"],
)
def test_length_dist_deterministic_and_bounded(dist: LengthDist) -> None:
    first = [dist.sample(random.Random(7)) for _ in range(3)]
    rng_a, rng_b = random.Random(42), random.Random(42)
    a = [dist.sample(rng_a) for _ in range(2000)]
    b = [dist.sample(rng_b) for _ in range(2000)]
    assert a == b
    assert len(set(first)) == 1
    assert all(dist.low <= x <= dist.high for x in a)
    assert all(isinstance(x, int) for x in a)
    # mean() is the distribution's (clipped) mean: the sample's mean agrees with it.
    assert statistics.fmean(a) == pytest.approx(dist.mean(), rel=0.1)
    assert dist.low <= dist.mean() <= dist.high


def test_length_dist_mean_reflects_clipping() -> None:
    unclipped = LengthDist(median=100, sigma=1.0, low=1, high=10**9).mean()
    clipped = LengthDist(median=100, sigma=1.0, low=1, high=150).mean()
    assert clipped < unclipped
    assert LengthDist(median=50, sigma=0.0, low=1, high=1000).mean() == 50


@pytest.mark.parametrize(
    "kwargs",
    [
        {"median": 0, "sigma": 1, "low": 1, "high": 2},
        {"median": 10, "sigma": -1, "low": 1, "high": 2},
        {"median": 10, "sigma": 1, "low": 0, "high": 2},
        {"median": 10, "sigma": 1, "low": 5, "high": 2},
    ],
    ids=["median", "sigma", "low", "order"],
)
def test_length_dist_rejects_bad_parameters(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LengthDist(**kwargs)


def test_arrival_times_deterministic_sorted_in_range() -> None:
    a = arrival_times(50.0, 10.0, random.Random(3))
    assert a == arrival_times(50.0, 10.0, random.Random(3))
    assert a == sorted(a)
    assert all(0 <= t < 10.0 for t in a)
    assert 400 < len(a) < 600  # Poisson(500): far outside would mean a wrong rate
    assert arrival_times(0.0, 10.0, random.Random(3)) == []


def test_workload_bounded() -> None:
    d = LengthDist(10, 0.5, 1, 100)
    with pytest.raises(ValueError):
        Workload(rate_per_s=1e6, duration_s=1e3, prompt_words=d, output_tokens=d)
    with pytest.raises(ValueError):
        Workload(rate_per_s=10, duration_s=0, prompt_words=d, output_tokens=d)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"choices":[{"delta":{"role":"assistant","content":""}}]}', False),
        (b'{"choices":[{"delta":{"content":"hi"}}]}', True),
        (b'{"choices":[{"delta":{"content": "hi"}}]}', True),
        (b'{"choices":[{"delta":{"content":null}}]}', False),
        (b'{"choices":[],"usage":{"completion_tokens":3}}', False),
    ],
    ids=["empty", "text", "spaced", "null", "usage-only"],
)
def test_has_content(payload: bytes, expected: bool) -> None:
    assert _has_content(payload) is expected


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"choices":[{"delta":{"content":"x"}}],"usage":null}', None),
        (b'{"choices":[{"delta":{"content":"x"}}],"usage": null}', None),
        (b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":9}}', 9),
        (b'{"choices":[],"usage":{"input_tokens":4,"output_tokens":5}}', 5),
        (b'{"choices":[],"usage":{"completion_tokens":', None),
        (b'{"choices":[{"delta":{"content":"x"}}]}', None),
    ],
    ids=["null", "null-spaced", "chat", "responses-names", "truncated", "absent"],
)
def test_usage_tokens(payload: bytes, expected: int | None) -> None:
    assert _usage_tokens(payload) == expected


# ---------------------------------------------------------------------------------------------
# Component: a real aiohttp server on loopback speaking OpenAI-style SSE


@dataclass
class _Seen:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    strategies: list[str | None] = field(default_factory=list)


def _chunk(delta: dict[str, Any]) -> bytes:
    doc: dict[str, Any] = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta}],
        "usage": None,
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


async def _stream(request: web.Request, seen: _Seen, *, hang_s: float = 0.0) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    seen.bodies.append(body)
    seen.strategies.append(request.headers.get("routing-strategy"))
    pod = f"pod-{len(seen.bodies) % 2}"
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "target-pod": pod})
    await resp.prepare(request)
    await resp.write(_chunk({"role": "assistant", "content": ""}))
    if hang_s:
        await asyncio.sleep(hang_s)
    n = int(body["max_tokens"])
    for _ in range(n):
        await resp.write(_chunk({"content": "tok "}))
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
    await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def engine(serve_app: ServeApp) -> tuple[str, _Seen]:
    seen = _Seen()

    async def ok(request: web.Request) -> web.StreamResponse:
        return await _stream(request, seen)

    async def slow(request: web.Request) -> web.StreamResponse:
        return await _stream(request, seen, hang_s=5.0)

    async def pace(request: web.Request) -> web.StreamResponse:
        return await _stream(request, seen, hang_s=0.1)

    async def bad(request: web.Request) -> web.Response:
        await request.read()
        err = {"error": {"message": "model x does not exist", "type": "invalid_request_error"}}
        return web.json_response(err, status=400, headers={"x-error-no-model-backends": "x"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", ok)
    app.router.add_post("/slow/v1/chat/completions", slow)
    app.router.add_post("/bad/v1/chat/completions", bad)
    app.router.add_post("/pace/v1/chat/completions", pace)
    return f"http://127.0.0.1:{await serve_app(app)}", seen


_WORKLOAD = Workload(
    rate_per_s=30.0,
    duration_s=1.0,
    prompt_words=LengthDist(median=20, sigma=0.5, low=1, high=60),
    output_tokens=LengthDist(median=8, sigma=0.5, low=2, high=20),
    seed=11,
)


async def test_streams_parsed_against_real_server(engine: tuple[str, _Seen]) -> None:
    url, seen = engine
    progress: list[tuple[int, int]] = []
    results = await run_open_loop(
        url,
        "demo-model",
        _WORKLOAD,
        strategy="load-balance",
        request_timeout_s=10.0,
        on_progress=lambda done, total: progress.append((done, total)),
    )
    expected = arrival_times(_WORKLOAD.rate_per_s, _WORKLOAD.duration_s, random.Random(11))
    assert len(results) == len(expected) > 0
    assert [r.started_at for r in results] == expected
    assert progress[-1] == (len(expected), len(expected))

    assert all(r.status == 200 and r.error is None for r in results), results
    assert {r.replica for r in results} == {"pod-0", "pod-1"}
    assert all(s == "load-balance" for s in seen.strategies)
    assert len(seen.bodies) == len(results)
    for body in seen.bodies:
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["model"] == "demo-model"
        assert body["messages"][0]["role"] == "user"
        assert 1 <= len(body["messages"][0]["content"].split()) <= 60
    for r in results:
        assert r.ttft_s is not None and r.latency_s is not None
        assert 0 <= r.ttft_s <= r.latency_s
        assert r.tpot_s is not None
    sent = sorted(int(b["max_tokens"]) for b in seen.bodies)
    assert sorted(r.output_tokens for r in results) == sent


_SHORT = Workload(
    rate_per_s=20.0,
    duration_s=0.2,
    prompt_words=_WORKLOAD.prompt_words,
    output_tokens=_WORKLOAD.output_tokens,
    seed=5,
)


async def test_http_error_recorded(engine: tuple[str, _Seen]) -> None:
    url, _ = engine
    results = await run_open_loop(url + "/bad", "x", _SHORT, strategy=None)
    assert len(results) == len(
        arrival_times(_SHORT.rate_per_s, _SHORT.duration_s, random.Random(_SHORT.seed))
    )
    assert all(r.status == 400 for r in results)
    assert all(r.error is not None and "does not exist" in r.error for r in results)
    assert all(r.output_tokens == 0 and r.ttft_s is None for r in results)


async def test_timeout_and_transport_error_are_status_zero(engine: tuple[str, _Seen]) -> None:
    url, _ = engine
    n = len(arrival_times(_SHORT.rate_per_s, _SHORT.duration_s, random.Random(_SHORT.seed)))
    assert n > 0
    slow = await run_open_loop(url + "/slow", "m", _SHORT, strategy=None, request_timeout_s=0.3)
    assert len(slow) == n
    assert all(r.status == 0 and r.error and "Timeout" in r.error for r in slow), slow
    assert all(r.replica in {"pod-0", "pod-1"} for r in slow)  # headers arrived before the hang
    refused = await run_open_loop(f"http://127.0.0.1:{free_port()}", "m", _SHORT, strategy=None)
    assert len(refused) == n
    assert all(r.status == 0 and r.error for r in refused)


async def test_in_flight_cap_sends_late_not_never(engine: tuple[str, _Seen]) -> None:
    url, _ = engine
    burst = Workload(
        rate_per_s=100.0,
        duration_s=0.05,
        prompt_words=_WORKLOAD.prompt_words,
        output_tokens=LengthDist(median=2, sigma=0.0, low=2, high=2),
        seed=1,
    )
    n = len(arrival_times(burst.rate_per_s, burst.duration_s, random.Random(burst.seed)))
    assert n >= 3
    # One slot, 0.1 s per request: request k leaves about k * 0.1 s after the first.
    results = await run_open_loop(url + "/pace", "m", burst, strategy=None, max_in_flight=1)
    assert len(results) == n
    assert all(r.status == 200 and r.output_tokens == 2 for r in results)
    assert results[-1].send_lag_s > 0.1
    assert results[-1].latency_s is not None and results[-1].latency_s > results[-1].send_lag_s


async def test_run_ends_at_deadline(engine: tuple[str, _Seen]) -> None:
    url, _ = engine
    # One slot, requests that hang past their 0.3 s timeout: the queue cannot drain by
    # duration + timeout = 0.5 s, so what is left is cancelled and recorded, not awaited (the
    # last result says so below; the timeout only guards against a hang).
    async with asyncio.timeout(5):
        results = await run_open_loop(
            url + "/slow", "m", _SHORT, strategy=None, max_in_flight=1, request_timeout_s=0.3
        )
    assert len(results) == len(
        arrival_times(_SHORT.rate_per_s, _SHORT.duration_s, random.Random(_SHORT.seed))
    )
    assert results[0].status == 0 and results[0].error and "Timeout" in results[0].error
    assert results[-1].status == 0 and results[-1].error == "cancelled at the run deadline"
