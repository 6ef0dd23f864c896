"""OpenAI-compatible HTTP front of the mock engine, driven in real time by one step loop.

The numbers it produces (token timing, /metrics) come from :class:`BatchScheduler`, so what a
benchmark measures through the gateway is the cost model and nothing else. One asyncio task runs
engine steps back to back against absolute deadlines: when the event loop lags, the next steps
start at the deadline that was due, so the long-run token rate still matches the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from bisect import bisect_left
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from plugin_tools.mock_engine.model import (
    BatchScheduler,
    EngineParams,
    StepResult,
    saturated_output_tokens_per_s,
)

__all__ = ["MockEngine", "MockEngineHandle", "build_app", "start_mock_engine"]

_log = logging.getLogger(__name__)
# vLLM serves the classic text format; prometheus_client's CONTENT_TYPE_LATEST moved to 1.0.0.
_METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
# Bucket bounds as vLLM uses them, so dashboards built for vLLM read the mock unchanged.
_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TPOT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's request-latency buckets (queue, prefill, decode, e2e times).
_REQUEST_TIME_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Lag beyond which the step loop stops catching up (a stalled process should not then burst).
_MAX_CATCH_UP_S: Final = 0.5
_SHUTDOWN_TIMEOUT_S: Final = 2.0
_TOKEN_TEXT: Final = "tok "


class _Histogram:
    """Cumulative-bucket histogram with weighted observations.

    A step delivers one token to every running sequence after the same interval; observing that
    interval once with weight ``batch`` keeps the per-step cost O(log buckets), not O(batch).
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += weight
        self.count += weight
        self.sum += value * weight

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            acc += n
            out.append((repr(float(bound)), float(acc)))
        out.append(("+Inf", float(self.count)))
        return out


class _Request:
    """What the step loop publishes to one waiting handler."""

    __slots__ = ("arrival", "finished", "max_tokens", "prompt_tokens", "queued_s", "ready",
                 "seq_id", "wake", "wake_every")  # fmt: skip

    def __init__(self, seq_id: int, prompt_tokens: int, max_tokens: int, wake_every: int) -> None:
        self.seq_id = seq_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.wake_every = wake_every
        self.arrival = time.monotonic()
        self.queued_s = 0.0  # from arrival to the step that admitted it
        self.ready = 0
        self.finished = False
        self.wake = asyncio.Event()


class _EngineClosing(Exception):
    """The engine is shutting down; the request cannot complete."""


class MockEngine:
    """One engine: a scheduler, its real-time step loop, and its Prometheus registry."""

    def __init__(self, params: EngineParams, *, model: str, name: str) -> None:
        self.params = params
        self.model = model
        self.name = name
        self.scheduler = BatchScheduler(params)
        self.request_success_total = 0
        self.metrics_requests_total = 0  # /metrics pages served, this one included
        self.ttft = _Histogram(_TTFT_BUCKETS)
        self.tpot = _Histogram(_TPOT_BUCKETS)
        # From arrival to the start of the step that admitted it (vLLM: WAITING phase),
        # observed when the request finishes, as vLLM observes it.
        self.queue_time = _Histogram(_REQUEST_TIME_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(self))  # reads the fields above
        self._requests: dict[Hashable, _Request] = {}
        self._ids = itertools.count()
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._last_delivery: float | None = None

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._step_loop(), name=f"mock-engine-{self.name}"
            )

    async def stop(self) -> None:
        """Stop stepping and release every waiting handler (they answer 503 or cut the stream)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in self._requests.values():
            req.wake.set()

    def submit(self, prompt_tokens: int, max_tokens: int, *, wake_every: int) -> _Request:
        """Queue a sequence; raises ValueError if it can never fit, _EngineClosing if closing."""
        if self._closing:
            raise _EngineClosing
        req = _Request(next(self._ids), prompt_tokens, max_tokens, wake_every)
        self.scheduler.submit(req.seq_id, prompt_tokens, max_tokens)
        self._requests[req.seq_id] = req
        self._work.set()
        return req

    def set_step_costs(self, changes: Mapping[str, Any]) -> EngineParams:
        """Change the step cost model at run time (another tenant on the GPU, a restart with
        other engine args): from the next step on, and in what /metrics reports. Raises
        ValueError for an unknown field or a bad value, changing nothing."""
        unknown = set(changes) - set(STEP_COST_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown step-cost fields {sorted(unknown)}; known: {STEP_COST_FIELDS}"
            )
        params = dataclasses.replace(self.params, **changes)  # validates
        self.params = self.scheduler.params = params
        return params

    def release(self, req: _Request) -> None:
        """Forget a request; if it has not finished, abort it so its slot and KV are freed."""
        self._requests.pop(req.seq_id, None)
        if not req.finished:
            self.scheduler.abort(req.seq_id)

    async def wait_progress(self, req: _Request) -> None:
        """Wait until the step loop has published tokens for ``req`` (or it finished)."""
        await req.wake.wait()
        req.wake.clear()
        if self._closing and not req.finished:
            raise _EngineClosing

    async def _step_loop(self) -> None:
        try:
            await self._steps()
        except Exception:
            # A dead loop would hang every client silently: fail them loudly instead.
            _log.exception("mock engine %s: step loop crashed", self.name)
            self._closing = True
            for req in self._requests.values():
                req.wake.set()

    async def _steps(self) -> None:
        sched = self.scheduler
        deadline = time.monotonic()
        while True:
            if not sched.has_work:
                self._work.clear()
                await self._work.wait()
                deadline = time.monotonic()  # an idle engine starts its next step now
                continue
            now = time.monotonic()
            start = deadline if now - deadline <= _MAX_CATCH_UP_S else now
            result = sched.step(start)
            for seq_id in result.admitted:
                req = self._requests.get(seq_id)
                if req is not None:
                    req.queued_s = max(0.0, start - req.arrival)
            deadline = result.end
            # Always yield, even when late, so handlers run between back-to-back steps.
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            self._deliver(result, time.monotonic())

    def _deliver(self, result: StepResult, now: float) -> None:
        requests = self._requests
        continuing = 0
        for seq_id, generated in result.emitted:
            req = requests.get(seq_id)
            if req is None:
                continue  # aborted while its step ran
            req.ready = generated
            if generated == 1:
                self.ttft.observe(now - req.arrival)
            else:
                continuing += 1
            if generated >= req.max_tokens:
                req.finished = True
                self.request_success_total += 1
                self.queue_time.observe(req.queued_s)  # as vLLM: when the request finishes
                req.wake.set()
            elif generated == 1 or (generated - 1) % req.wake_every == 0:
                req.wake.set()  # the first token goes out at once, then groups of k
        if continuing and self._last_delivery is not None:
            self.tpot.observe(now - self._last_delivery, continuing)
        self._last_delivery = now


_ENGINE_KEY: Final = web.AppKey("mock_engine", MockEngine)
# What `/mock/step-costs` reads and changes.
STEP_COST_FIELDS: Final = ("a_ms", "b_ms", "prefill_ms_per_token", "time_scale")


class _EngineCollector:
    """Reads the scheduler at scrape time, so every gauge is exact, never a stale copy."""

    def __init__(self, engine: MockEngine) -> None:
        self._engine = engine

    def describe(self) -> Iterable[Metric]:
        """The families by name, as vLLM's default registry knows its metrics: a page asked
        for by name (`name[]`) then holds those samples only."""
        return list(self.collect())

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        sched = engine.scheduler
        labels = [engine.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def histogram(name: str, doc: str, hist: _Histogram) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, hist.buckets(), sum_value=hist.sum)
            return family

        yield gauge(
            "vllm:num_requests_running", "Number of requests in the batch.", sched.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to run.", sched.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 0..1 (reserved prompt + max_tokens of running requests).",
            sched.kv_usage,
        )
        yield counter(
            "vllm:generation_tokens", "Generation tokens decoded.", sched.generation_tokens_total
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled.", sched.prompt_tokens_total)
        yield counter(
            "vllm:request_success", "Requests that completed.", engine.request_success_total
        )
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from arrival to the first token.",
            engine.ttft,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Seconds from arrival to the step that admitted the request.",
            engine.queue_time,
        )
        yield histogram(
            "vllm:time_per_output_token_seconds",
            "Seconds between consecutive output tokens of a request.",
            engine.tpot,
        )
        yield counter(
            "mock_engine_metrics_requests",
            "Metrics pages served (scrapes of this engine), this one included.",
            engine.metrics_requests_total,
        )
        yield gauge(
            "mock_engine_saturated_output_tokens_per_second",
            "Model decode throughput with a full batch (prefill excluded).",
            saturated_output_tokens_per_s(engine.params),
        )


# ---------------------------------------------------------------------------------------------
# HTTP


_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    503: "overloaded_error",
}


def _error(status: int, message: str, *, code: str | None = None) -> web.Response:
    """OpenAI-shaped error body, typed by status as the gateway types its own (`plugin.errors`)."""
    kind = _ERROR_TYPES.get(status, "api_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class _BadRequest(Exception):
    """The request body is JSON but not a request this engine can serve."""


def _words(text: str) -> int:
    return len(text.split())


def _chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list")
    words = 0
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRequest("each message must be an object")
        content = message.get("content")
        if isinstance(content, str):
            words += _words(content)
        elif isinstance(content, list):  # content parts: count the text ones
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    words += _words(part["text"])
    return max(words, 1)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _completion_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_ids(prompt):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return max(_words(prompt), 1)
    if _is_token_ids(prompt) and prompt:
        return len(prompt)
    if prompt is None:
        raise _BadRequest("'prompt' is required")
    raise _BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")


def _responses_prompt_tokens(body: dict[str, Any]) -> int:
    """The Responses API's `instructions` and `input` (a string, or items like chat messages)."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"content": items}]
    if not isinstance(items, list) or not items:
        raise _BadRequest("'input' must be a string or a non-empty list of items")
    instructions = body.get("instructions")
    extra = _words(instructions) if isinstance(instructions, str) else 0
    messages = [item for item in items if isinstance(item, dict)]
    return _chat_prompt_tokens({"messages": messages}) + extra if messages else max(extra, 1)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _BadRequest(f"'{key}' must be a positive integer")
        return value
    return default


@dataclass(frozen=True, slots=True)
class _Shape:
    """What differs between chat and text completions."""

    chat: bool
    model: str
    ident: str
    created: int
    usage_always = False  # streams report usage only when asked (`stream_options`)
    done = b"data: [DONE]\n\n"

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return self._event({"choices": [choice]}, obj)

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._event({"choices": [], "usage": usage}, obj)

    def _event(self, payload: dict[str, Any], obj: str) -> bytes:
        head = {"id": self.ident, "object": obj, "created": self.created, "model": self.model}
        return b"data: " + orjson.dumps(head | payload) + b"\n\n"

    def full(self, text: str, usage: dict[str, int]) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        head = {"id": self.ident, "object": obj, "created": self.created, "model": self.model}
        return orjson.dumps(head | {"choices": [choice], "usage": usage})


@dataclass(frozen=True, slots=True)
class _ResponsesShape:
    """The Responses API (`/v1/responses`), as vLLM serves it: typed events, usage always in the
    final `response.completed` (input/output token names), no `[DONE]`."""

    model: str
    ident: str
    created: int
    usage_always = True
    done = b""

    def _response(self, status: str, text: str | None, usage: dict[str, int] | None) -> Any:
        output = []
        if text is not None:
            part = {"type": "output_text", "text": text, "annotations": []}
            output.append(
                {"type": "message", "id": "msg_" + self.ident, "status": status,
                 "role": "assistant", "content": [part]}
            )  # fmt: skip
        return {
            "id": self.ident, "object": "response", "created_at": self.created,
            "model": self.model, "status": status, "output": output,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
            },
        }  # fmt: skip

    @staticmethod
    def _event(kind: str, payload: dict[str, Any]) -> bytes:
        data = orjson.dumps({"type": kind, **payload})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> bytes:
        delta = self._event(
            "response.output_text.delta",
            {"item_id": "msg_" + self.ident, "output_index": 0, "content_index": 0, "delta": text},
        )
        if not first:
            return delta
        created = self._event(
            "response.created", {"response": self._response("in_progress", None, None)}
        )
        return created + delta

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        text = _TOKEN_TEXT * usage["completion_tokens"]
        return self._event(
            "response.completed", {"response": self._response("completed", text, usage)}
        )

    def full(self, text: str, usage: dict[str, int]) -> bytes:
        return orjson.dumps(self._response("completed", text, usage))


def _usage(req: _Request) -> dict[str, int]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.max_tokens,
        "total_tokens": req.prompt_tokens + req.max_tokens,
    }


async def _completions(request: web.Request, *, kind: str) -> web.StreamResponse:
    """One handler for the three APIs; `kind`: "chat", "text" or "responses"."""
    engine = request.app[_ENGINE_KEY]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _error(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    model = body.get("model")
    if model != engine.model:
        what = f"The model `{model}` does not exist." if model else "The request names no model."
        return _error(404, f"{what} This engine serves `{engine.model}`.", code="model_not_found")
    try:
        prompt_tokens = (
            _chat_prompt_tokens(body)
            if kind == "chat"
            else _responses_prompt_tokens(body)
            if kind == "responses"
            else _completion_prompt_tokens(body)
        )
        max_tokens = _max_tokens(body, engine.params.default_max_tokens)
        if body.get("n") not in (None, 1):
            raise _BadRequest("the mock engine generates one choice per request ('n' = 1)")
    except _BadRequest as exc:
        return _error(400, str(exc))
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    k = engine.params.tokens_per_chunk
    try:
        req = engine.submit(prompt_tokens, max_tokens, wake_every=k if stream else max_tokens)
    except ValueError as exc:
        return _error(400, str(exc))
    except _EngineClosing:
        return _error(503, "the engine is shutting down")
    ident, created = uuid.uuid4().hex, int(time.time())
    shape: _Shape | _ResponsesShape
    if kind == "responses":
        shape = _ResponsesShape(engine.model, "resp_" + ident, created)
    else:
        chat = kind == "chat"
        shape = _Shape(chat, engine.model, ("chatcmpl-" if chat else "cmpl-") + ident, created)
    try:
        if stream:
            return await _stream(request, engine, req, shape, include_usage)
        while not req.finished:
            await engine.wait_progress(req)
        return web.Response(
            body=shape.full(_TOKEN_TEXT * req.max_tokens, _usage(req)),
            content_type="application/json",
        )
    except _EngineClosing:
        return _error(503, "the engine is shutting down")
    finally:
        # Runs on completion, on a client disconnect (handler cancelled) and on write errors.
        engine.release(req)


async def _stream(
    request: web.Request,
    engine: MockEngine,
    req: _Request,
    shape: _Shape | _ResponsesShape,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.headers["Cache-Control"] = "no-cache"
    await resp.prepare(request)
    k = engine.params.tokens_per_chunk
    sent = 0
    try:
        while True:
            try:
                await engine.wait_progress(req)
            except _EngineClosing:
                return resp  # cut the stream: no [DONE], the client sees it incomplete
            ready, finished = req.ready, req.finished
            parts: list[bytes] = []
            # The first token streams alone (TTFT is real); then groups of k tokens.
            while ready - sent >= (1 if sent == 0 else k) or (finished and sent < ready):
                n = min(1 if sent == 0 else k, ready - sent)
                last = finished and sent + n == ready
                parts.append(shape.chunk(_TOKEN_TEXT * n, "length" if last else None, sent == 0))
                sent += n
            if parts:
                await resp.write(b"".join(parts))
            if finished:
                break
        tail = shape.usage_chunk(_usage(req)) if include_usage or shape.usage_always else b""
        await resp.write(tail + shape.done)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # client went away; the caller's finally aborts the sequence
    return resp


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, kind="chat")


async def _text_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, kind="text")


async def _responses(request: web.Request) -> web.StreamResponse:
    return await _completions(request, kind="responses")


async def _models(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    card = {"id": engine.model, "object": "model", "created": 0, "owned_by": "mock-engine",
            "root": engine.model, "max_model_len": engine.params.kv_tokens}  # fmt: skip
    return web.Response(
        body=orjson.dumps({"object": "list", "data": [card]}), content_type="application/json"
    )


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    """The page, or only the samples named by `name[]` query parameters, as vLLM's
    prometheus_client exposition serves them."""
    engine = request.app[_ENGINE_KEY]
    engine.metrics_requests_total += 1
    names = request.query.getall("name[]", [])
    registry = engine.registry.restricted_registry(names) if names else engine.registry
    return web.Response(
        body=generate_latest(registry),
        headers={"Content-Type": _METRICS_CONTENT_TYPE},
    )


def _step_costs(params: EngineParams) -> web.Response:
    body = {name: getattr(params, name) for name in STEP_COST_FIELDS}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _get_step_costs(request: web.Request) -> web.Response:
    return _step_costs(request.app[_ENGINE_KEY].params)


async def _put_step_costs(request: web.Request) -> web.Response:
    """Benchmarks change an engine's speed mid-run with this (a JSON object of fields)."""
    try:
        changes = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "the body is not JSON")
    if not isinstance(changes, dict):
        return _error(400, f"expected a JSON object of {', '.join(STEP_COST_FIELDS)}")
    try:
        params = request.app[_ENGINE_KEY].set_step_costs(changes)
    except (TypeError, ValueError) as exc:
        return _error(400, str(exc))
    return _step_costs(params)


def build_app(engine: MockEngine) -> web.Application:
    """The aiohttp application for ``engine``; every response names the engine that served it."""
    app = web.Application()
    app[_ENGINE_KEY] = engine

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-mock-engine"] = engine.name

    app.on_response_prepare.append(tag)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _text_completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/mock/step-costs", _get_step_costs)
    app.router.add_put("/mock/step-costs", _put_step_costs)
    return app


@dataclass(slots=True)
class MockEngineHandle:
    """A running engine: where it listens, and how to stop it."""

    engine: MockEngine
    host: str
    port: int
    _runner: web.AppRunner

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop the step loop, release waiting handlers, close the listener and connections."""
        await self.engine.stop()
        await self._runner.cleanup()


async def start_mock_engine(
    params: EngineParams, *, host: str = "127.0.0.1", port: int = 0, model: str, name: str
) -> MockEngineHandle:
    """Serve one mock engine on ``host:port`` (0 picks a free port) inside the running loop.

    Several engines can share one process and loop (``hetero-gateway up`` does that).
    """
    engine = MockEngine(params, model=model, name=name)
    runner = web.AppRunner(
        build_app(engine),
        handle_signals=False,
        # A disconnect cancels the handler, whose `finally` aborts the sequence (frees KV).
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = int(runner.addresses[0][1])
    engine.start()
    return MockEngineHandle(engine=engine, host=host, port=bound_port, _runner=runner)
