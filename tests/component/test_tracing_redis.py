"""Request traces against a real `redis-server` (the conftest's fixture, a free loopback port).

What only a real Redis shows: the Lua merge runs in Redis's own Lua (cjson and all), several
gateways writing one window at once lose nothing, the key's expiry, and what a Redis outage does
to the counts. Windows are closed on hand-driven clocks, so no test waits for a 10 s boundary;
one runs the real loop on 1 s windows, and one a whole `Gateway` with the flag set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from plugin.adapters.tracing import MERGE_SCRIPT, TraceFlusher, TraceRecorder, writes_key
from plugin.config import RedisSettings
from plugin.core.trace import TRACE_TTL_S, TraceWindow, trace_key
from plugin.core.types import Pod
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import StartGateway, debug_pods, eventually, metric_value, write_pods_file

pytestmark = pytest.mark.component

MODEL = "llama-3-8b"
START = 1700000000  # the window the tests write
KEY = trace_key(MODEL, START)


@dataclass
class Clock:
    t: float

    def __call__(self) -> float:
        return self.t


@dataclass
class Gw:
    """One gateway's tracing: its recorder and flusher on hand-driven clocks."""

    flusher: TraceFlusher
    wall: Clock
    mono: Clock
    queue: dict[str, int] = field(default_factory=dict)

    @property
    def recorder(self) -> TraceRecorder:
        return self.flusher.recorder

    def advance(self, seconds: float) -> None:
        self.wall.t += seconds
        self.mono.t += seconds

    def close(self) -> int:
        """Close the window START: move to just after its end and close it."""
        self.wall.t = self.mono.t = START + 10.05
        return self.flusher.close_windows()


MakeGw = Callable[..., Gw]


@pytest_asyncio.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    async with Redis(host=redis_server.host, port=redis_server.port, decode_responses=True) as r:
        yield r


@pytest_asyncio.fixture
async def gateways(redis_server: RedisServer) -> AsyncIterator[MakeGw]:
    made: list[TraceFlusher] = []

    def make(port: int | None = None, **kw: Any) -> Gw:
        wall, mono = Clock(START + 1.0), Clock(START + 1.0)
        settings = RedisSettings(host=redis_server.host, port=port or redis_server.port)
        gw = Gw(
            TraceFlusher(TraceRecorder(), settings, clock=mono, wall_clock=wall, **kw), wall, mono
        )
        gw.flusher._queueing = lambda: gw.queue
        made.append(gw.flusher)
        return gw

    yield make
    for f in made:
        await f._drop_client()


async def read(client: Redis, key: str = KEY) -> dict[str, Any] | None:
    raw = await client.get(key)
    return None if raw is None else dict(orjson.loads(raw))


def traffic(gw: Gw, arrivals: int, sizes: list[tuple[int, int]]) -> None:
    for _ in range(arrivals):
        gw.recorder.arrived(MODEL)
    for input_tokens, output_tokens in sizes:
        gw.recorder.completed(MODEL, input_tokens, output_tokens)


async def test_a_window_is_written_in_aibrix_format_with_a_600_s_expiry(
    gateways: MakeGw, client: Redis
) -> None:
    gw = gateways()
    traffic(gw, 3, [(1000, 100), (1000, 100), (0, 7)])
    gw.recorder.started(MODEL, START - 5.0)  # in flight since the window before: pending
    gw.queue[MODEL] = 2
    assert gw.close() == 1
    assert await gw.flusher.flush()
    doc = await read(client)
    assert doc == {
        "100:66": 2,
        "0:28": 1,
        "meta_v": 4,
        "meta_interval_sec": 10,
        "meta_precision": 10,
        "meta_total_reqs": 3,
        "meta_pending_reqs": 1,
        "meta_queueing_reqs": 2,
    }
    assert TraceWindow.parse(MODEL, START, doc).total_reqs == 3
    assert 590 <= await client.ttl(KEY) <= TRACE_TTL_S
    assert 590 <= await client.ttl(writes_key(KEY)) <= TRACE_TTL_S
    assert gw.flusher.pending == [] and gw.flusher.windows_written_total == 1


async def test_two_gateways_merge_into_one_window(gateways: MakeGw, client: Redis) -> None:
    a, b = gateways(), gateways()
    traffic(a, 4, [(1000, 100)] * 3)
    traffic(b, 2, [(1000, 100), (16, 16)])
    a.queue[MODEL], b.queue[MODEL] = 1, 2
    b.recorder.started(MODEL, START - 3.0)
    a.close(), b.close()
    assert await a.flusher.flush() and await b.flusher.flush()
    doc = await read(client)
    assert doc is not None
    w = TraceWindow.parse(MODEL, START, doc)
    assert w.counts == {"100:66": 4, "40:40": 1}
    assert (w.total_reqs, w.pending_reqs, w.queueing_reqs) == (6, 1, 3)


async def test_many_concurrent_flushes_into_one_window_lose_nothing(
    gateways: MakeGw, client: Redis
) -> None:
    """20 gateways, each with 5 writes for the same key, all at once: a read-modify-write that
    were not atomic would lose some."""
    fleet = [gateways() for _ in range(20)]
    for i, gw in enumerate(fleet):
        gw.wall.t = gw.mono.t = START + 2.0
        for _ in range(5):
            traffic(gw, i + 1, [(2**i, 8)])
            assert gw.flusher.close_windows(final=True) == 1
    assert await asyncio.gather(*(gw.flusher.flush() for gw in fleet)) == [True] * 20
    doc = await read(client)
    assert doc is not None
    w = TraceWindow.parse(MODEL, START, doc)
    assert w.total_reqs == 5 * sum(range(1, 21))
    assert sum(w.counts.values()) == 100
    assert w.counts == {f"{10 * i}:30": 5 for i in range(20)}


async def test_a_write_keeps_the_key_600_s_from_its_last_write(
    gateways: MakeGw, client: Redis
) -> None:
    gw = gateways()
    traffic(gw, 1, [])
    await client.set(KEY, orjson.dumps({"meta_v": 4, "meta_precision": 10, "meta_total_reqs": 5}))
    await client.expire(KEY, 30)
    gw.close()
    assert await gw.flusher.flush()
    assert 590 <= await client.ttl(KEY) <= TRACE_TTL_S
    doc = await read(client)
    assert doc is not None and doc["meta_total_reqs"] == 6


async def test_an_empty_window_writes_nothing(gateways: MakeGw, client: Redis) -> None:
    gw = gateways()
    gw.recorder.started(MODEL, START - 30.0)  # in flight and queued, but nothing new
    gw.queue[MODEL] = 3
    assert gw.close() == 0
    assert await gw.flusher.flush()
    gw.advance(10.0)
    assert gw.flusher.close_windows() == 0
    assert await client.keys("*") == []


async def test_merging_with_aibrix_documents(gateways: MakeGw, client: Redis) -> None:
    """An AIBrix v3 document (same precision) is merged; a v2 one too, its total being the sum
    of its counts; a v1 one (precision 1) cannot be and is replaced."""
    v3 = {"100:66": 1, "meta_v": 3, "meta_interval_sec": 10, "meta_precision": 10}
    v3 |= {"meta_total_reqs": 9, "meta_pending_reqs": 1}
    v2 = {"100:66": 2, "40:40": 1, "meta_v": 2, "meta_interval_sec": 10, "meta_precision": 10}
    for old, total, replaced in ((v3, 9 + 2, 0), (v2, 3 + 2, 0), ({"10:7": 3}, 2, 1)):
        await client.flushall()
        await client.set(KEY, orjson.dumps(old))
        gw = gateways()
        traffic(gw, 2, [(1000, 100)])
        gw.close()
        assert await gw.flusher.flush()
        doc = await read(client)
        assert doc is not None
        assert TraceWindow.parse(MODEL, START, doc).total_reqs == total, old
        assert gw.flusher.windows_replaced_total == replaced


async def test_a_retried_write_is_not_counted_twice(client: Redis) -> None:
    merge = client.register_script(MERGE_SCRIPT)
    window = orjson.dumps(TraceWindow(MODEL, START, {"100:66": 1}, 1, 0, 0).to_json())
    keys = [KEY, writes_key(KEY)]
    assert await merge(keys=keys, args=["gw-a:1", window, TRACE_TTL_S]) == 1
    # The reply was lost and the write retried: not added again.
    assert await merge(keys=keys, args=["gw-a:1", window, TRACE_TTL_S]) == 0
    assert await merge(keys=keys, args=["gw-b:1", window, TRACE_TTL_S]) == 2
    doc = await read(client)
    assert doc is not None and doc["meta_total_reqs"] == 2 and doc["100:66"] == 2


async def test_redis_down_then_up_keeps_the_counts(
    gateways: MakeGw, client: Redis, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gw = gateways(timeout_s=0.5)
    traffic(gw, 2, [(1000, 100)])
    gw.close()
    await redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="plugin.adapters.tracing"):
        assert not await gw.flusher.flush()
        traffic(gw, 3, [(16, 16)])  # the request path goes on counting meanwhile
        gw.advance(10.0)
        assert gw.flusher.close_windows() == 1
        assert not await gw.flusher.flush()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one, then reminders
    assert gw.flusher.flush_errors_total == 2 and len(gw.flusher.pending) == 2
    await redis_server.start()
    assert await gw.flusher.flush()
    first, second = await read(client), await read(client, trace_key(MODEL, START + 10))
    assert first is not None and second is not None
    assert (first["meta_total_reqs"], first["100:66"]) == (2, 1)
    assert (second["meta_total_reqs"], second["40:40"]) == (3, 1)
    assert gw.flusher.pending == [] and gw.flusher.up


async def test_windows_older_than_the_ttl_are_dropped(gateways: MakeGw, reserved_port: int) -> None:
    gw = gateways(port=reserved_port, timeout_s=0.2)  # nothing listens there
    traffic(gw, 1, [])
    gw.close()
    assert not await gw.flusher.flush()
    gw.advance(TRACE_TTL_S - 1.0)
    assert not await gw.flusher.flush() and len(gw.flusher.pending) == 1
    gw.advance(2.0)
    assert await gw.flusher.flush()  # nothing left to write
    assert gw.flusher.pending == [] and gw.flusher.windows_dropped_total == 1


async def only_trace(server: RedisServer) -> tuple[str, dict[str, Any]]:
    """The one trace key in Redis and its document."""
    async with Redis(host=server.host, port=server.port, decode_responses=True) as r:
        (key,) = await r.keys("aibrix:*")
        raw = await r.get(key)
    assert isinstance(key, str) and raw is not None
    return key, dict(orjson.loads(raw))


async def test_the_loop_writes_each_window_just_after_its_end(redis_server: RedisServer) -> None:
    """The real loop on real clocks, 1 s windows: a window's counts land in its key, aligned."""
    settings = RedisSettings(host=redis_server.host, port=redis_server.port)
    recorder = TraceRecorder()
    flusher = TraceFlusher(recorder, settings, interval_s=1)
    task = asyncio.ensure_future(flusher.run())
    try:
        recorder.arrived(MODEL)
        await eventually(lambda: flusher.windows_written_total == 1, "the window's flush")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await flusher.close()
    key, doc = await only_trace(redis_server)
    assert key.startswith(f"aibrix:{MODEL}_request_trace_")
    assert doc["meta_interval_sec"] == 1 and doc["meta_total_reqs"] == 1


async def test_the_gateway_traces_when_the_flag_is_set(
    redis_server: RedisServer, start_gateway: StartGateway, tmp_path: Path, reserved_port: int
) -> None:
    pods = write_pods_file(
        tmp_path / "pods.yaml",
        [Pod("p0", "ns", MODEL, "127.0.0.1", reserved_port, reserved_port)],
    )
    redis = {"REDIS_HOST": redis_server.host, "REDIS_PORT": str(redis_server.port)}
    untraced = await start_gateway(pods, redis)
    assert untraced.tracer is None and untraced.servicer.tracer is None
    gateway = await start_gateway(pods, redis | {"AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true"})
    assert gateway.tracer is not None
    assert gateway.servicer.tracer is gateway.tracer.recorder
    gateway.tracer.recorder.arrived(MODEL)
    url = f"http://127.0.0.1:{gateway.http_port}"
    async with aiohttp.ClientSession() as session:
        assert await metric_value(session, url, "hetero_gateway_trace_flush_errors_total") == 0
        tracing = (await debug_pods(session, url))["tracing"]
        assert tracing["redis"] == f"{redis_server.host}:{redis_server.port}"
        assert tracing["windows_written_total"] == tracing["windows_replaced_total"] == 0
        untraced_url = f"http://127.0.0.1:{untraced.http_port}"
        assert (await debug_pods(session, untraced_url))["tracing"] == {"mode": "off"}
    await gateway.stop()  # the open window is written at shutdown
    _, doc = await only_trace(redis_server)
    assert doc["meta_total_reqs"] == 1
