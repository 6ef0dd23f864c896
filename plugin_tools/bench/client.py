"""Closed-loop load for the overhead and streaming parts: N workers, each one request at a time.

Closed loop (unlike the demo's open loop) because these parts ask "how fast can the path go" and
"what does one request or chunk pay", not "what happens at a given offered load". Every SSE event's
arrival is timed from the moment the request left, so per-chunk delays can be compared between
bootstraps. Bounded twice: a run stops at its request count or at `max_seconds`, whichever first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson

__all__ = ["Batch", "Timing", "chat_body", "run_batch", "run_interleaved"]

_VOCAB = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog")
_ERROR_BYTES = 512


def chat_body(model: str, prompt_words: int, max_tokens: int) -> bytes:
    """A streamed chat completion asking for usage, as the gateway's clients should send it."""
    prompt = " ".join(_VOCAB[i % len(_VOCAB)] for i in range(prompt_words))
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


@dataclass(frozen=True, slots=True)
class Timing:
    """One request: seconds from send to the end of the stream, and to each SSE data event.

    `chunks` excludes `[DONE]` and is empty unless the batch records chunks.
    """

    status: int
    latency_s: float | None
    chunks: tuple[float, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(frozen=True, slots=True)
class Batch:
    """What one closed-loop run did; `elapsed_s` runs from the start to the last completion."""

    timings: list[Timing]
    elapsed_s: float

    @property
    def ok(self) -> int:
        return sum(1 for t in self.timings if t.ok)

    @property
    def errors(self) -> int:
        return len(self.timings) - self.ok


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, record_chunks: bool, timeout_s: float
) -> Timing:
    clock = time.perf_counter
    sent = clock()
    chunks: list[float] = []
    try:
        async with session.post(
            url,
            data=body,
            headers={"content-type": "application/json", "accept": "text/event-stream"},
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                text = (await resp.content.read(_ERROR_BYTES)).decode("utf-8", "replace")
                return Timing(resp.status, None, error=f"HTTP {resp.status}: {text.strip()}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if line[5:].strip() == b"[DONE]":
                    break
                if record_chunks:
                    chunks.append(clock() - sent)
            return Timing(200, clock() - sent, tuple(chunks))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return Timing(0, None, error=f"{type(exc).__name__}: {exc}")


async def run_batch(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    max_requests: int,
    max_seconds: float,
    record_chunks: bool = False,
    timeout_s: float = 60.0,
    on_done: Callable[[int], None] | None = None,
) -> Batch:
    """`concurrency` workers send `body` to `url` back to back until either bound is reached.

    A request started before the deadline runs to its end (or `timeout_s`); none starts after.
    `on_done(completed)` is called after each request and must not raise.
    """
    if concurrency < 1 or max_requests < 1 or not max_seconds > 0:
        raise ValueError("concurrency, max_requests and max_seconds must be positive")
    timings: list[Timing] = []
    started = 0
    last_done = 0.0
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        deadline = start + max_seconds

        async def worker() -> None:
            nonlocal started, last_done
            while started < max_requests and time.perf_counter() < deadline:
                started += 1
                timings.append(await _one(session, url, body, record_chunks, timeout_s))
                last_done = time.perf_counter()
                if on_done is not None:
                    on_done(len(timings))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, max_requests))))
    return Batch(timings, max(last_done - start, 1e-9))


async def run_interleaved(
    urls: Mapping[str, str],
    body: bytes,
    *,
    requests_per_url: int,
    max_seconds: float,
    record_chunks: bool = False,
    timeout_s: float = 60.0,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, list[Timing]]:
    """One request at a time, to each url in turn, `requests_per_url` times round.

    For concurrency-1 comparisons: consecutive requests go to different variants, so drift on a
    shared machine (another job starting, CPU frequency) lands on every variant alike instead of
    on whichever batch ran then. Each step starts at a different url, so none always follows the
    same neighbour. Every url keeps its own keep-alive connection. Stops after `max_seconds`;
    `on_step(steps_done)` is called after each round and must not raise.
    """
    if requests_per_url < 1 or not max_seconds > 0 or not urls:
        raise ValueError("requests_per_url, max_seconds and urls must be positive / non-empty")
    names = list(urls)
    timings: dict[str, list[Timing]] = {name: [] for name in names}
    sessions = {
        name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for name in names
    }
    try:
        deadline = time.perf_counter() + max_seconds
        for step in range(requests_per_url):
            if time.perf_counter() >= deadline:
                break
            k = step % len(names)
            for name in [*names[k:], *names[:k]]:
                timings[name].append(
                    await _one(sessions[name], urls[name], body, record_chunks, timeout_s)
                )
            if on_step is not None:
                on_step(step + 1)
    finally:
        for session in sessions.values():
            await session.close()
    return timings
