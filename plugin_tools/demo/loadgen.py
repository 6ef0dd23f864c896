"""Open-loop load generator for the demo: streamed OpenAI chat requests at Poisson arrivals.

Open loop means requests leave on a schedule fixed before the run (seeded, absolute times), not
when earlier ones finish: a slow gateway then meets the load it was offered instead of a politely
reduced one, which is what makes strategies comparable. Latencies are measured from each
request's scheduled time, so client-side waiting is not hidden (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from plugin_tools.demo.report import RequestResult

__all__ = [
    "MAX_REQUESTS",
    "LengthDist",
    "Workload",
    "arrival_times",
    "prompt_text",
    "run_open_loop",
]

# Hard cap on the requests of one run, so a typo in rate or duration cannot flood the machine.
MAX_REQUESTS = 200_000
# How much of an error response body is kept in `RequestResult.error`.
_ERROR_BODY_BYTES = 2048
_ERROR_TEXT_CHARS = 500
# Words the prompts are made of; the content does not matter to a mock engine, the length does.
_VOCAB = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Lognormal length (median, sigma of the log), rounded and clipped to [low, high].

    Lognormal because real prompt and completion lengths are right-skewed; the clip keeps a
    heavy tail from producing a request the engine would reject.
    """

    median: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median > 0):
            raise ValueError(f"median must be finite and > 0, got {self.median}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be finite and >= 0, got {self.sigma}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low} high={self.high}")

    def sample(self, rng: random.Random) -> int:
        """One length; draws exactly one variate from `rng` so schedules stay reproducible."""
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return min(self.high, max(self.low, round(value)))

    def mean(self, samples: int = 20000, seed: int = 0) -> float:
        """Monte-Carlo mean of the clipped distribution (deterministic for a seed).

        The clip makes the closed-form lognormal mean wrong; the orchestrator needs the real
        one to turn a target token rate into a request rate.
        """
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        rng = random.Random(seed)
        return sum(self.sample(rng) for _ in range(samples)) / samples


@dataclass(frozen=True, slots=True)
class Workload:
    """What one run offers: Poisson arrivals at `rate_per_s` for `duration_s` seconds."""

    rate_per_s: float
    duration_s: float
    prompt_words: LengthDist
    output_tokens: LengthDist
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ValueError(f"rate_per_s must be finite and > 0, got {self.rate_per_s}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be finite and > 0, got {self.duration_s}")
        if self.rate_per_s * self.duration_s > MAX_REQUESTS:
            raise ValueError(
                f"rate_per_s * duration_s = {self.rate_per_s * self.duration_s:.0f} exceeds "
                f"the {MAX_REQUESTS} requests one run may send"
            )


def arrival_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets in [0, duration): exponential gaps with mean 1/rate.

    Pure, so a test can regenerate the exact schedule a seed gives and compare counts.
    """
    if not (math.isfinite(rate) and rate > 0) or not (math.isfinite(duration) and duration > 0):
        return []
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration and len(times) < MAX_REQUESTS:
        times.append(t)
        t += rng.expovariate(rate)
    return times


@dataclass(frozen=True, slots=True)
class _Planned:
    at: float  # scheduled offset from the run start, seconds
    prompt_words: int
    max_tokens: int


def _plan(workload: Workload) -> list[_Planned]:
    """The whole schedule, drawn from one seeded RNG: arrivals first, then lengths in order."""
    rng = random.Random(workload.seed)
    times = arrival_times(workload.rate_per_s, workload.duration_s, rng)
    return [
        _Planned(at, workload.prompt_words.sample(rng), workload.output_tokens.sample(rng))
        for at in times
    ]


def prompt_text(words: int) -> str:
    """The prompt of `words` words the load generator sends (its size is what matters)."""
    return " ".join(_VOCAB[i % len(_VOCAB)] for i in range(words))


def _has_content(payload: bytes) -> bool:
    """True when an SSE chunk carries a non-empty `content` string, without decoding JSON.

    Decoding every chunk would make the client, not the gateway, the bottleneck on 2 cores.
    """
    idx = payload.find(b'"content"')
    while idx != -1:
        rest = payload[idx + len(b'"content"') :].lstrip()
        if rest.startswith(b":"):
            value = rest[1:].lstrip()
            if value.startswith(b'"') and not value.startswith(b'""'):
                return True
        idx = payload.find(b'"content"', idx + 1)
    return False


def _usage_tokens(payload: bytes) -> int | None:
    """Completion tokens of a usage chunk; None when the chunk has no (non-null) usage."""
    if b'"usage"' not in payload:
        return None
    tail = payload[payload.find(b'"usage"') + len(b'"usage"') :].lstrip()
    if tail.startswith(b":") and tail[1:].lstrip().startswith(b"null"):
        return None  # OpenAI sends "usage": null on every chunk but the last
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _one_request(
    session: aiohttp.ClientSession,
    endpoint: str,
    model: str,
    planned: _Planned,
    headers: dict[str, str],
    t0: float,
    gate: asyncio.Semaphore,
    request_timeout_s: float,
    ask_usage: bool = True,
) -> RequestResult:
    """Send one request at its scheduled time and read its stream; never raises for I/O."""
    loop = asyncio.get_running_loop()
    scheduled = t0 + planned.at
    doc: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(planned.prompt_words)}],
        "max_tokens": planned.max_tokens,
        "stream": True,
    }
    if ask_usage:
        doc["stream_options"] = {"include_usage": True}
    body = orjson.dumps(doc)
    async with gate:
        send_lag = max(0.0, loop.time() - scheduled)
        replica: str | None = None
        status = 0
        ttft: float | None = None
        latency: float | None = None
        tokens = 0
        try:
            async with session.post(
                endpoint,
                data=body,
                headers=headers,
                allow_redirects=False,  # only ever talk to the url we were given
                timeout=aiohttp.ClientTimeout(total=request_timeout_s),
            ) as resp:
                replica = resp.headers.get("target-pod")
                status = resp.status
                if status != 200:
                    raw = await resp.content.read(_ERROR_BODY_BYTES)
                    text = raw.decode("utf-8", "replace").strip()[:_ERROR_TEXT_CHARS]
                    return RequestResult(
                        replica=replica,
                        status=status,
                        started_at=planned.at,
                        ttft_s=None,
                        latency_s=loop.time() - scheduled,
                        output_tokens=0,
                        error=f"HTTP {status}: {text}" if text else f"HTTP {status}",
                        send_lag_s=send_lag,
                    )
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    if ttft is None and _has_content(payload):
                        ttft = loop.time() - scheduled
                    found = _usage_tokens(payload)
                    if found is not None:
                        tokens = found
                latency = loop.time() - scheduled
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            # ValueError: aiohttp's "Line is too long" and similar malformed-stream errors.
            return RequestResult(
                replica=replica,
                status=0,
                started_at=planned.at,
                ttft_s=ttft,
                latency_s=None,
                output_tokens=tokens,
                error=_describe(exc),
                send_lag_s=send_lag,
            )
    return RequestResult(
        replica=replica,
        status=status,
        started_at=planned.at,
        ttft_s=ttft,
        latency_s=latency,
        output_tokens=tokens,
        send_lag_s=send_lag,
    )


async def run_open_loop(
    url: str,
    model: str,
    workload: Workload,
    *,
    strategy: str | None,
    max_in_flight: int = 2000,
    request_timeout_s: float = 300.0,
    on_progress: Callable[[int, int], None] | None = None,
    ask_usage: bool = True,
) -> list[RequestResult]:
    """Offer `workload` to `{url}/v1/chat/completions`; one result per scheduled request.

    Results come back in schedule order with `started_at` in seconds since the run start, the
    clock `report.summarize`'s window uses. Past `max_in_flight` a request waits in the client
    and is sent late (its `send_lag_s` says how late; its latency includes the wait). The run ends
    by `duration_s + request_timeout_s`: anything still open then is cancelled and recorded as a
    status-0 error. `on_progress(done, total)` is called after each request finishes and must not
    raise. `ask_usage=False` sends no `stream_options` (the result's `output_tokens` is then 0
    unless the stream carries usage anyway).
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
        raise ValueError(f"request_timeout_s must be finite and > 0, got {request_timeout_s}")
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"url must be http(s)://host[:port], got {url!r}")
    endpoint = f"{base}/v1/chat/completions"
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if strategy is not None:
        headers["routing-strategy"] = strategy

    plan = _plan(workload)
    total = len(plan)
    done = 0
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(max_in_flight)

    def _finished(_: asyncio.Task[RequestResult]) -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total)

    connector = aiohttp.TCPConnector(limit=max_in_flight, limit_per_host=0)
    tasks: list[asyncio.Task[RequestResult]] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = loop.time()
        try:
            for planned in plan:
                delay = t0 + planned.at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(
                    _one_request(
                        session,
                        endpoint,
                        model,
                        planned,
                        headers,
                        t0,
                        gate,
                        request_timeout_s,
                        ask_usage,
                    )
                )
                task.add_done_callback(_finished)
                tasks.append(task)
            deadline = t0 + workload.duration_s + request_timeout_s
            pending = {t for t in tasks if not t.done()}
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
        finally:
            # At the deadline, or when the caller cancels the run: leave nothing running.
            pending = {t for t in tasks if not t.done()}
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    results: list[RequestResult] = []
    for planned, task in zip(plan, tasks, strict=True):
        if task.cancelled():
            results.append(
                RequestResult(
                    replica=None,
                    status=0,
                    started_at=planned.at,
                    ttft_s=None,
                    latency_s=None,
                    output_tokens=0,
                    error="cancelled at the run deadline",
                )
            )
        else:
            results.append(task.result())
    return results
