"""Data plane: request tracing with two gateway replicas (two plugin processes, each behind its
own real Envoy) writing into one `redis-server`, in front of one fleet of mock engines.

Requests go through both Envoys, in two batches a 10 s boundary apart, and the test reads back
what the gateways wrote, in the real format (10 s windows): keys aligned to 10 s with an expiry of
at most 600 s, documents in AIBrix's shape, and every request of both replicas counted once, its
size in the bucket of the usage the engine reported. AIBrix's gateways overwrite each other's
window; these merge, so the sums come out whole.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest
from redis.asyncio import Redis

from plugin.adapters.tracing import writes_key
from plugin.core.trace import TraceWindow, bucket, window_start
from plugin_tools.demo.fleet import ExtraGateway, FleetSpec, LocalFleet
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import chat_body, poll, redis_env

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"
PER_GATEWAY = 8  # requests per gateway per batch
KEY_RE = re.compile(rf"^aibrix:{re.escape(MODEL)}_request_trace_(\d+)$")
META = {
    "meta_v",
    "meta_interval_sec",
    "meta_precision",
    "meta_total_reqs",
    "meta_pending_reqs",
    "meta_queueing_reqs",
}


@pytest.fixture(scope="module")
def fleet_spec(module_redis: RedisServer) -> FleetSpec:
    """gw-a traces into the module's Redis; the conftest's `second_gateway` (gw-b) too."""
    return FleetSpec(
        model=MODEL,
        time_scale=4.0,
        tokens_per_chunk=4,
        plugin_env={
            **redis_env(module_redis, "gw-a"),
            "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true",
        },
    )


async def send(session: aiohttp.ClientSession, envoy_url: str, i: int) -> tuple[int, int]:
    """One chat request (every other one streamed); the usage the engine reported."""
    stream = i % 2 == 1
    body = chat_body(MODEL, 4 + 5 * i, stream=stream, content="word " * (3 + 7 * i))
    async with session.post(f"{envoy_url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    if not stream:
        usage = orjson.loads(raw)["usage"]
    else:
        lines = [line for line in raw.split(b"\n") if line.startswith(b"data: {")]
        (usage,) = [u for line in lines if (u := orjson.loads(line[6:]).get("usage"))]
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


async def batch(
    session: aiohttp.ClientSession, urls: list[str], first: int
) -> list[tuple[int, int]]:
    """PER_GATEWAY requests through each Envoy at once, of sizes `first`, `first` + 1, ..."""
    sent = [send(session, url, first + i) for url in urls for i in range(PER_GATEWAY)]
    return await asyncio.gather(*sent)


async def until_next_window() -> None:
    """Sleep to 1 s past the next 10 s boundary."""
    await asyncio.sleep(window_start(time.time()) + 11.0 - time.time())


async def traces(redis: Redis) -> dict[str, dict[str, Any]]:
    """Every trace key in Redis and its document."""
    found = {}
    for key in await redis.keys("aibrix:*"):
        raw = await redis.get(key)
        if raw is not None:
            found[str(key)] = dict(orjson.loads(raw))
    return found


@pytest.mark.slow(reason="traffic through two gateways across trace windows, which are 10 s each")
async def test_both_gateways_requests_are_traced_once_in_aligned_windows(
    fleet: LocalFleet, second_gateway: ExtraGateway, module_redis: RedisServer
) -> None:
    urls = [fleet.envoy_url, second_gateway.envoy_url]
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
        Redis(host=module_redis.host, port=module_redis.port, decode_responses=True) as redis,
    ):
        # Each batch well inside a window: the gateways close one just after its end.
        if window_start(time.time()) + 8.0 < time.time():
            await until_next_window()
        first_window = window_start(time.time())
        sizes = await batch(session, urls, 0)
        await until_next_window()
        second_window = window_start(time.time())
        sizes += await batch(session, urls, PER_GATEWAY)
        last_window = window_start(time.time())
        n = len(sizes)

        def complete(docs: dict[str, dict[str, Any]]) -> bool:
            totals: int = sum(d["meta_total_reqs"] for d in docs.values())
            counted: int = sum(v for d in docs.values() for k, v in d.items() if k not in META)
            return totals >= n and counted >= n

        # Written just after the window ends (a few seconds' margin for a loaded machine).
        docs = await poll(
            lambda: traces(redis), complete, "every request traced", limit_s=15, interval_s=0.5
        )
        ttls = {key: await redis.ttl(key) for key in docs}
        # Each write's id is "<gateway process>:<sequence>" (a retried write is not re-added).
        writers = {key: {str(m) for m in await redis.smembers(writes_key(key))} for key in docs}

    starts = {}
    for key, doc in sorted(docs.items()):
        match = KEY_RE.match(key)
        assert match, key
        end = int(match.group(1))  # a key is labelled with its window's end, as AIBrix's
        assert end % 10 == 0, key
        start = end - 10
        assert first_window <= start <= last_window, (key, first_window, last_window)
        starts[key] = start
        assert 0 < ttls[key] <= 600, (key, ttls[key])
        assert doc.keys() >= META, doc
        assert (doc["meta_v"], doc["meta_interval_sec"], doc["meta_precision"]) == (4, 10, 10)
        assert all(re.match(r"^\d+:\d+$", k) for k in doc.keys() - META), doc
        # Nothing is written for an empty window.
        assert doc["meta_total_reqs"] > 0 or len(doc) > len(META), doc

    windows = [TraceWindow.parse(MODEL, starts[key], doc) for key, doc in docs.items()]
    assert sum(w.total_reqs for w in windows) == n
    counted: Counter[str] = Counter()
    for w in windows:
        counted.update(w.counts)
    assert counted == Counter(bucket(p, c) for p, c in sizes)
    # Each batch arrived in its own window, and both gateways wrote into a shared key.
    arrived = {w.start for w in windows if w.total_reqs}
    assert first_window in arrived and second_window in arrived, (arrived, first_window)
    instances = {m.split(":")[0] for members in writers.values() for m in members}
    assert len(instances) == 2, writers
    assert any(len({m.split(":")[0] for m in members}) == 2 for members in writers.values())
