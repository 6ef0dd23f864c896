"""Mock engine: the pure scheduler against its cost model, then the real server on loopback.

Server tests run fast engines (small time_scale) and never assert timings beyond sanity: what they
check is protocol shape and that /metrics tells the truth about the scheduler's state.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from plugin_tools.mock_engine import cli
from plugin_tools.mock_engine.model import (
    PRESETS,
    BatchScheduler,
    EngineParams,
    saturated_output_tokens_per_s,
    step_duration_s,
)
from plugin_tools.mock_engine.server import MockEngineHandle, start_mock_engine
from tests.helpers import poll

pytestmark = pytest.mark.component

MODEL = "mock-llama"

# ---------------------------------------------------------------------------------------------
# Pure model


def _params(**kw: Any) -> EngineParams:
    base: dict[str, Any] = {
        "a_ms": 10.0,
        "b_ms": 0.5,
        "prefill_ms_per_token": 0.1,
        "kv_tokens": 10_000,
        "max_num_seqs": 256,
    }
    return EngineParams(**(base | kw))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"a_ms": 0.0}, "a_ms"),
        ({"a_ms": -1.0}, "a_ms"),
        ({"b_ms": -0.1}, "b_ms"),
        ({"prefill_ms_per_token": float("nan")}, "prefill_ms_per_token"),
        ({"time_scale": 0.0}, "time_scale"),
        ({"kv_tokens": 0}, "kv_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"tokens_per_chunk": 0}, "tokens_per_chunk"),
        ({"default_max_tokens": -5}, "default_max_tokens"),
        ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ],
    ids=[
        "a-zero",
        "a-negative",
        "b-negative",
        "prefill-nan",
        "time-scale-zero",
        "kv-zero",
        "seqs-zero",
        "chunk-zero",
        "default-max-negative",
        "seqs-float",
    ],
)
def test_params_validation(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _params(**kw)


@pytest.mark.parametrize(
    ("preset", "a", "b", "p", "kv", "saturated"),
    [
        ("a100", 9.0, 0.12, 0.09, 440_000, 256 / ((9 + 0.12 * 256) / 1000)),
        ("l20", 20.0, 0.30, 0.25, 210_000, 256 / ((20 + 0.30 * 256) / 1000)),
        ("v100", 22.0, 0.35, 0.35, 100_000, 256 / ((22 + 0.35 * 256) / 1000)),
    ],
    ids=["a100", "l20", "v100"],
)
def test_presets(preset: str, a: float, b: float, p: float, kv: int, saturated: float) -> None:
    params = PRESETS[preset]
    assert (params.a_ms, params.b_ms, params.prefill_ms_per_token) == (a, b, p)
    assert (params.kv_tokens, params.max_num_seqs) == (kv, 256)
    assert saturated_output_tokens_per_s(params) == pytest.approx(saturated)
    slow = dataclasses.replace(params, time_scale=2.0)
    assert saturated_output_tokens_per_s(slow) == pytest.approx(saturated / 2)


@pytest.mark.parametrize(
    ("n", "prompt", "time_scale"),
    [(1, 1, 1.0), (1, 500, 1.0), (8, 100, 1.0), (256, 10, 1.0), (32, 50, 0.01), (32, 50, 3.0)],
    ids=["one", "one-long-prompt", "eight", "full-batch", "fast-engine", "slow-engine"],
)
def test_step_duration_follows_cost_model(n: int, prompt: int, time_scale: float) -> None:
    params = _params(time_scale=time_scale)
    sched = BatchScheduler(params)
    for i in range(n):
        sched.submit(i, prompt, 3)
    first = sched.step(0.0)
    scale = time_scale / 1000
    assert first.duration_s == pytest.approx((10.0 + 0.5 * n + 0.1 * n * prompt) * scale)
    assert first.prefill_tokens == n * prompt
    assert first.admitted == tuple(range(n))
    second = sched.step(first.end)
    assert second.start == first.end
    assert second.duration_s == pytest.approx((10.0 + 0.5 * n) * scale)
    assert second.admitted == ()
    assert step_duration_s(params, n) == pytest.approx(second.duration_s)


def test_tokens_and_finish() -> None:
    sched = BatchScheduler(_params())
    sched.submit("a", 5, 1)
    sched.submit("b", 5, 3)
    r1 = sched.step(0.0)
    assert r1.emitted == (("a", 1), ("b", 1))
    assert r1.finished == ("a",)
    assert (sched.num_running, sched.kv_reserved_tokens) == (1, 8)
    r2 = sched.step(r1.end)
    assert (r2.emitted, r2.finished) == ((("b", 2),), ())
    r3 = sched.step(r2.end)
    assert (r3.emitted, r3.finished) == ((("b", 3),), ("b",))
    assert not sched.has_work
    assert sched.step(r3.end).duration_s == 0.0
    assert (sched.generation_tokens_total, sched.prompt_tokens_total) == (4, 10)
    assert (sched.finished_total, sched.kv_usage) == (2, 0.0)


@pytest.mark.parametrize(
    ("max_num_seqs", "kv_tokens", "sizes", "expected_waves"),
    [
        (2, 10_000, [(1, 1)] * 5, [(0, 1), (2, 3), (4,)]),
        (256, 100, [(10, 50), (10, 50), (10, 10)], [(0,), (1, 2)]),
        # strict FCFS: the big head waits for KV, the small one behind it must not overtake
        (256, 100, [(10, 40), (40, 40), (1, 1)], [(0,), (1, 2)]),
        (1, 10_000, [(3, 1), (3, 1), (3, 1)], [(0,), (1,), (2,)]),
    ],
    ids=["batch-cap", "kv-cap", "kv-head-of-line", "one-at-a-time"],
)
def test_admission_fcfs_under_caps(
    max_num_seqs: int,
    kv_tokens: int,
    sizes: list[tuple[int, int]],
    expected_waves: list[tuple[int, ...]],
) -> None:
    sched = BatchScheduler(_params(max_num_seqs=max_num_seqs, kv_tokens=kv_tokens))
    for i, (prompt, max_tokens) in enumerate(sizes):
        sched.submit(i, prompt, max_tokens)
    waves: list[tuple[int, ...]] = []
    now = 0.0
    while sched.has_work:
        result = sched.step(now)
        assert sched.num_running <= max_num_seqs
        assert 0.0 <= sched.kv_usage <= 1.0
        if result.admitted:
            waves.append(tuple(int(str(s)) for s in result.admitted))
        now = result.end
    assert waves == expected_waves


def test_waiting_counts_and_kv_usage() -> None:
    sched = BatchScheduler(_params(max_num_seqs=2, kv_tokens=1000))
    for i in range(3):
        sched.submit(i, 10, 90)
    assert (sched.num_running, sched.num_waiting) == (0, 3)
    sched.step(0.0)
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert sched.kv_usage == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [(60, 41, "KV cache"), (0, 5, ">= 1"), (5, 0, ">= 1")],
    ids=["never-fits", "empty-prompt", "zero-output"],
)
def test_submit_rejects(prompt: int, max_tokens: int, match: str) -> None:
    sched = BatchScheduler(_params(kv_tokens=100))
    with pytest.raises(ValueError, match=match):
        sched.submit(1, prompt, max_tokens)
    assert not sched.has_work


def test_submit_rejects_duplicate_id() -> None:
    sched = BatchScheduler(_params())
    sched.submit(1, 1, 1)
    with pytest.raises(ValueError, match="already"):
        sched.submit(1, 1, 1)


def test_abort_frees_slot_and_kv() -> None:
    sched = BatchScheduler(_params(max_num_seqs=1, kv_tokens=1000))
    sched.submit("run", 10, 100)
    sched.submit("wait1", 10, 100)
    sched.submit("wait2", 10, 100)
    sched.step(0.0)
    assert (sched.num_running, sched.num_waiting, sched.kv_reserved_tokens) == (1, 2, 110)
    assert sched.abort("wait1") is True
    assert sched.num_waiting == 1
    assert sched.abort("run") is True
    assert (sched.num_running, sched.kv_usage) == (0, 0.0)
    assert sched.abort("run") is False
    assert sched.abort("nobody") is False
    result = sched.step(1.0)
    assert result.admitted == ("wait2",)
    assert result.emitted == (("wait2", 1),)


def _simulate(sched: BatchScheduler) -> float:
    """Drive the scheduler with simulated time until idle; returns the elapsed seconds."""
    now = 0.0
    while sched.has_work:
        now = sched.step(now).end
    return now


@pytest.mark.parametrize("preset", ["a100", "l20", "v100"], ids=["a100", "l20", "v100"])
@pytest.mark.parametrize("time_scale", [1.0, 0.25], ids=["real", "fast"])
def test_single_sequence_throughput(preset: str, time_scale: float) -> None:
    params = dataclasses.replace(PRESETS[preset], time_scale=time_scale)
    sched = BatchScheduler(params)
    sched.submit(0, 20, 1000)
    elapsed = _simulate(sched)
    analytic = 1000.0 / ((params.a_ms + params.b_ms) * time_scale)
    assert 1000 / elapsed == pytest.approx(analytic, rel=0.05)


@pytest.mark.parametrize("preset", ["a100", "l20", "v100"], ids=["a100", "l20", "v100"])
def test_saturated_throughput(preset: str) -> None:
    params = PRESETS[preset]
    sched = BatchScheduler(params)
    n, max_tokens = 2 * params.max_num_seqs, 200
    for i in range(n):
        sched.submit(i, 4, max_tokens)
    elapsed = _simulate(sched)
    assert sched.generation_tokens_total == n * max_tokens
    assert n * max_tokens / elapsed == pytest.approx(
        saturated_output_tokens_per_s(params), rel=0.05
    )


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["submit", "abort", "step"]), st.integers(0, 15)),
        max_size=80,
    ),
    max_num_seqs=st.integers(1, 4),
)
def test_scheduler_invariants(ops: list[tuple[str, int]], max_num_seqs: int) -> None:
    sched = BatchScheduler(_params(max_num_seqs=max_num_seqs, kv_tokens=60))
    live: dict[int, int] = {}  # seq -> reserved tokens, for submitted sequences
    now = 0.0
    for op, arg in ops:
        if op == "submit" and arg not in live:
            sched.submit(arg, 1 + arg, 1 + arg % 5)
            live[arg] = 2 + arg + arg % 5
        elif op == "abort":
            assert sched.abort(arg) == (arg in live)
            live.pop(arg, None)
        elif op == "step":
            result = sched.step(now)
            now = result.end
            for seq_id in result.finished:
                del live[int(str(seq_id))]
        assert sched.num_running <= max_num_seqs
        assert sched.num_running + sched.num_waiting == len(live)
        assert 0.0 <= sched.kv_usage <= 1.0
        assert sched.kv_reserved_tokens <= sum(live.values())
    _simulate(sched)
    assert (sched.num_running, sched.num_waiting, sched.kv_reserved_tokens) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------
# Real server on loopback

EngineFactory = Callable[..., Awaitable[MockEngineHandle]]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    handles: list[MockEngineHandle] = []

    async def make(preset: str = "a100", name: str = "gpu-a", **kw: Any) -> MockEngineHandle:
        params = dataclasses.replace(PRESETS[preset], **({"time_scale": 0.02} | kw))
        handle = await start_mock_engine(params, host="127.0.0.1", port=0, model=MODEL, name=name)
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        await handle.close()


def _request(chat: bool, words: int = 3, **kw: Any) -> dict[str, Any]:
    text = " ".join(["word"] * words)
    body: dict[str, Any] = {"model": MODEL}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body | kw


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events)
    return [e[len(b"data: ") :] for e in events]


async def _metrics(http: aiohttp.ClientSession, handle: MockEngineHandle) -> dict[str, float]:
    async with http.get(handle.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL
            if "le" not in sample.labels:
                out[sample.name] = sample.value
    return out


async def _wait_for(
    http: aiohttp.ClientSession,
    handle: MockEngineHandle,
    pred: Callable[[dict[str, float]], bool],
    within_s: float = 8.0,
) -> dict[str, float]:
    return await poll(
        lambda: _metrics(http, handle), pred, "the metrics", limit_s=within_s, interval_s=0.01
    )


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
@pytest.mark.parametrize(("k", "max_tokens"), [(1, 5), (3, 7), (4, 8)], ids=["k1", "k3", "k4"])
async def test_stream_format(
    make_engine: EngineFactory,
    http: aiohttp.ClientSession,
    chat: bool,
    include_usage: bool,
    k: int,
    max_tokens: int,
) -> None:
    handle = await make_engine(tokens_per_chunk=k)
    body = _request(chat, words=4, stream=True, max_tokens=max_tokens)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with http.post(handle.url + _path(chat), json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-mock-engine"] == "gpu-a"
        raw = await resp.read()
    events = _sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    usage_chunks = [c for c in chunks if "usage" in c]
    content = [c for c in chunks if "usage" not in c]
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1
    # The first token streams alone, then groups of k.
    rest = max_tokens - 1
    assert len(content) == 1 + math.ceil(rest / k)
    texts = [
        c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in content
    ]
    counts = [len(t.split()) for t in texts]
    assert counts == [1] + [k] * (rest // k) + ([rest % k] if rest % k else [])
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons == [None] * (len(content) - 1) + ["length"]
    if include_usage:
        assert usage_chunks == [chunks[-1]]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": max_tokens,
            "total_tokens": 4 + max_tokens,
        }
    else:
        assert usage_chunks == []


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("extra", "completion_tokens"),
    [({}, 9), ({"max_tokens": 5}, 5), ({"max_tokens": 5, "max_completion_tokens": 7}, 7)],
    ids=["default", "max-tokens", "max-completion-tokens-wins"],
)
async def test_non_stream_usage(
    make_engine: EngineFactory,
    http: aiohttp.ClientSession,
    chat: bool,
    extra: dict[str, Any],
    completion_tokens: int,
) -> None:
    handle = await make_engine(preset="l20", name="gpu-l20", default_max_tokens=9)
    async with http.post(handle.url + _path(chat), json=_request(chat, words=6, **extra)) as resp:
        assert resp.status == 200
        assert resp.headers["x-mock-engine"] == "gpu-l20"
        data = await resp.json()
    assert data["object"] == ("chat.completion" if chat else "text_completion")
    assert data["model"] == MODEL
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert len(text.split()) == completion_tokens
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": completion_tokens,
        "total_tokens": 6 + completion_tokens,
    }


@pytest.mark.parametrize("k", [1, 4], ids=["k1", "k4"])
async def test_responses_api_streams_typed_events_and_always_reports_usage(
    make_engine: EngineFactory, http: aiohttp.ClientSession, k: int
) -> None:
    handle = await make_engine(tokens_per_chunk=k)
    body = {
        "model": MODEL,
        "instructions": "be brief",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "one two three"}]}],
        "max_output_tokens": 7,
        "stream": True,
    }
    async with http.post(handle.url + "/v1/responses", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    events = []
    for block in raw[:-2].split(b"\n\n"):
        kind, data = block.split(b"\n")
        assert kind.startswith(b"event: ") and data.startswith(b"data: ")
        event = orjson.loads(data[len(b"data: ") :])
        assert event["type"] == kind[len(b"event: ") :].decode()
        events.append(event)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert len(deltas) == 1 + math.ceil(6 / k)  # the first token alone, then groups of k
    assert sum(len(d.split()) for d in deltas) == 7
    done = events[-1]["response"]
    assert done["usage"] == {"input_tokens": 5, "output_tokens": 7, "total_tokens": 12}
    assert done["output"][0]["content"][0]["text"] == "".join(deltas)
    async with http.post(handle.url + "/v1/responses", json=body | {"stream": False}) as resp:
        assert resp.status == 200
        whole = await resp.json()
    assert whole["object"] == "response" and whole["status"] == "completed"
    assert whole["usage"] == done["usage"]


@pytest.mark.parametrize(
    ("path", "payload", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", orjson.dumps({"model": MODEL}), 400, None),
        ("/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": []}), 400, None),
        ("/v1/completions", orjson.dumps({"model": MODEL}), 400, None),
        ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": ["a", "b"]}), 400, None),
        ("/v1/completions", orjson.dumps(_request(False, max_tokens=0)), 400, None),
        ("/v1/completions", orjson.dumps(_request(False, max_tokens=10**6)), 400, None),
        (
            "/v1/chat/completions",
            orjson.dumps(_request(True) | {"model": "x"}),
            404,
            "model_not_found",
        ),
        ("/v1/completions", orjson.dumps({"prompt": "hi"}), 404, "model_not_found"),
    ],
    ids=[
        "bad-json",
        "not-object",
        "no-messages",
        "empty-messages",
        "no-prompt",
        "batched-prompts",
        "zero-max-tokens",
        "exceeds-kv",
        "wrong-model",
        "no-model",
    ],
)
async def test_errors(
    make_engine: EngineFactory,
    http: aiohttp.ClientSession,
    path: str,
    payload: bytes,
    status: int,
    code: str | None,
) -> None:
    handle = await make_engine(kv_tokens=1000)
    async with http.post(handle.url + path, data=payload) as resp:
        assert resp.status == status
        assert resp.headers["x-mock-engine"] == "gpu-a"
        body = await resp.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, None)
    assert isinstance(error["message"], str) and error["message"]
    m = await _metrics(http, handle)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (0, 0)


async def test_models_health_and_header(
    make_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    handle = await make_engine(preset="v100", name="v100-0")
    async with http.get(handle.url + "/v1/models") as resp:
        assert resp.headers["x-mock-engine"] == "v100-0"
        data = await resp.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [MODEL]
    async with http.get(handle.url + "/health") as resp:
        assert resp.status == 200
        assert resp.headers["x-mock-engine"] == "v100-0"
    async with http.get(handle.url + "/nope") as resp:
        assert resp.status == 404
        assert resp.headers["x-mock-engine"] == "v100-0"
    m = await _metrics(http, handle)
    assert m["mock_engine_saturated_output_tokens_per_second"] == pytest.approx(
        saturated_output_tokens_per_s(dataclasses.replace(PRESETS["v100"], time_scale=0.02))
    )


async def test_metrics_track_in_flight_state(
    make_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    # ~40 ms steps: three 20-token streams, two at a time, last ~1.6 s in all.
    handle = await make_engine(time_scale=4.0, max_num_seqs=2, kv_tokens=1000)
    max_tokens, words = 20, 5

    async def stream() -> int:
        body = _request(True, words=words, stream=True, max_tokens=max_tokens)
        async with http.post(handle.url + _path(True), json=body) as resp:
            events = _sse_events(await resp.read())
        return sum(
            len(orjson.loads(e)["choices"][0]["delta"]["content"].split()) for e in events[:-1]
        )

    tasks = [asyncio.create_task(stream()) for _ in range(3)]
    m = await _wait_for(http, handle, lambda m: m["vllm:num_requests_waiting"] == 1)
    assert m["vllm:num_requests_running"] == 2
    assert m["vllm:kv_cache_usage_perc"] == pytest.approx(2 * (words + max_tokens) / 1000)
    generated = await asyncio.gather(*tasks)
    assert generated == [max_tokens] * 3
    m = await _metrics(http, handle)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:generation_tokens_total"] == sum(generated)
    assert m["vllm:prompt_tokens_total"] == 3 * words
    assert m["vllm:request_success_total"] == 3
    assert m["vllm:time_to_first_token_seconds_count"] == 3
    assert m["vllm:time_per_output_token_seconds_count"] == 3 * (max_tokens - 1)
    # Sanity only: a token every ~40 ms, far from both 0 and seconds.
    mean_tpot = (
        m["vllm:time_per_output_token_seconds_sum"] / m["vllm:time_per_output_token_seconds_count"]
    )
    assert 0.01 < mean_tpot < 1.0
    # Two were admitted at once; the third waited for a slot, about 20 steps.
    assert m["vllm:request_queue_time_seconds_count"] == 3
    assert 10 * mean_tpot < m["vllm:request_queue_time_seconds_sum"] < 30 * mean_tpot


@pytest.mark.parametrize(
    ("stream", "queued"),
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["stream-running", "wait-running", "stream-queued", "wait-queued"],
)
async def test_disconnect_frees_slot_and_kv(
    make_engine: EngineFactory, http: aiohttp.ClientSession, stream: bool, queued: bool
) -> None:
    handle = await make_engine(time_scale=1.0, max_num_seqs=1)
    url = handle.url + _path(True)
    blocker: asyncio.Task[bytes] | None = None
    if queued:  # occupy the only slot so the victim waits in the queue

        async def block() -> bytes:
            async with http.post(url, json=_request(True, max_tokens=60)) as resp:
                return await resp.read()

        blocker = asyncio.create_task(block())
        await _wait_for(http, handle, lambda m: m["vllm:num_requests_running"] == 1)

    async def victim() -> None:
        body = _request(True, stream=stream, max_tokens=100_000)
        async with http.post(url, json=body) as resp:
            await resp.content.readany()  # first chunk (stream) or blocks until finished
            await asyncio.sleep(30)

    task = asyncio.create_task(victim())
    key = "vllm:num_requests_waiting" if queued else "vllm:num_requests_running"
    await _wait_for(http, handle, lambda m: m[key] == 1 and m["vllm:kv_cache_usage_perc"] > 0)
    if stream and not queued:
        await asyncio.sleep(0.05)  # let a few chunks flow first
    task.cancel()  # drops the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    if blocker is not None:
        await blocker
    m = await _wait_for(
        http,
        handle,
        lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0,
    )
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total"] == (1 if queued else 0)


async def test_close_releases_in_flight_requests(http: aiohttp.ClientSession) -> None:
    params = dataclasses.replace(PRESETS["a100"], time_scale=1.0)
    handle = await start_mock_engine(params, host="127.0.0.1", port=0, model=MODEL, name="x")
    try:
        request = asyncio.create_task(
            http.post(handle.url + _path(False), json=_request(False, max_tokens=100_000))
        )
        await _wait_for(http, handle, lambda m: m["vllm:num_requests_running"] == 1)
    finally:
        # Not aiohttp's 60 s shutdown_timeout: in-flight requests are answered and closed.
        async with asyncio.timeout(5):
            await handle.close()
    async with await request as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "overloaded_error"


async def test_engines_share_one_loop(
    make_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    fast = await make_engine(preset="a100", name="a")
    slow = await make_engine(preset="v100", name="b")
    assert fast.port != slow.port
    for handle, name in ((fast, "a"), (slow, "b")):
        async with http.post(handle.url + _path(False), json=_request(False, max_tokens=3)) as r:
            assert r.headers["x-mock-engine"] == name
            assert (await r.json())["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.register_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_flags_override_preset() -> None:
    args = _parser().parse_args(
        [
            *("mock-engine", "--preset", "l20", "--port", "0", "--model", "m", "--a-ms", "5"),
            *("--max-num-seqs", "32", "--time-scale", "0.5", "--tokens-per-chunk", "4"),
        ]
    )
    params = cli.params_from_args(args)
    assert params == dataclasses.replace(
        PRESETS["l20"], a_ms=5.0, max_num_seqs=32, time_scale=0.5, tokens_per_chunk=4
    )
    assert args.func is cli.run
    assert (args.host, args.name) == ("127.0.0.1", None)


def test_cli_rejects_bad_params(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(
        ["mock-engine", "--preset", "a100", "--port", "0", "--model", "m", "--b-ms", "-1"]
    )
    assert cli.run(args) == 2
    assert "b_ms" in capsys.readouterr().err


_CLI_SCRIPT = """
import argparse, sys
from plugin_tools.mock_engine import cli
parser = argparse.ArgumentParser()
cli.register_cli(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_cli_serves_until_sigterm(http: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CLI_SCRIPT,
        *("mock-engine", "--preset", "v100", "--port", "0", "--model", MODEL),
        *("--name", "cli-engine", "--time-scale", "0.01"),
        stdout=asyncio.subprocess.PIPE,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        url = next(word for word in line.split() if word.startswith("http://"))
        async with http.post(url + "/v1/completions", json=_request(False, max_tokens=4)) as r:
            assert r.headers["x-mock-engine"] == "cli-engine"
            assert (await r.json())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_step_costs_change_at_run_time_and_metrics_follow(
    make_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    """A benchmark slows an engine mid-run (another tenant on its GPU): its scheduler takes the
    new step costs, and /metrics' saturated throughput says so."""
    handle = await make_engine(time_scale=1.0, max_num_seqs=4)
    url = handle.url + "/mock/step-costs"
    async with http.get(url) as resp:
        costs = await resp.json()
    assert set(costs) == {"a_ms", "b_ms", "prefill_ms_per_token", "time_scale"}
    before = (await _metrics(http, handle))["mock_engine_saturated_output_tokens_per_second"]

    async with http.put(url, json={"a_ms": costs["a_ms"] * 4, "b_ms": costs["b_ms"] * 4}) as resp:
        assert resp.status == 200
        changed = await resp.json()
    assert changed["a_ms"] == pytest.approx(costs["a_ms"] * 4)
    # the step loop's scheduler costs its next steps with them
    assert handle.engine.scheduler.params.a_ms == pytest.approx(costs["a_ms"] * 4)
    body = _request(True, words=3, stream=False, max_tokens=5)
    async with http.post(handle.url + _path(True), json=body) as resp:
        assert resp.status == 200
    after = (await _metrics(http, handle))["mock_engine_saturated_output_tokens_per_second"]
    assert after < before / 2.5
    for bad in ({"a_ms": -1}, {"kv_tokens": 5}, {"a_ms": "fast"}, [1]):
        async with http.put(url, json=bad) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with http.get(url) as resp:
        assert (await resp.json()) == changed  # nothing changed by the bad ones


async def test_a_page_asked_for_by_name_holds_those_samples_and_scrapes_are_counted(
    make_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    """As vLLM's prometheus_client exposition: `name[]` narrows the page to the named samples
    (what the gateway's scraper asks for); every page served is counted, this one included."""
    handle = await make_engine(time_scale=1.0)
    wanted = ["vllm:num_requests_running", "vllm:request_queue_time_seconds_sum"]
    query = [("name[]", n) for n in wanted]
    async with http.get(handle.url + "/metrics", params=query) as resp:
        assert resp.status == 200
        page = await resp.text()
    samples = [line.split("{")[0] for line in page.splitlines() if not line.startswith("#")]
    assert samples == wanted
    full = await _metrics(http, handle)
    assert full["mock_engine_metrics_requests_total"] == 2
    assert "vllm:kv_cache_usage_perc" in full
