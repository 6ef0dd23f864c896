"""Shared state against a real `redis-server`, started by the fixture on a free loopback port.

Each test gets its own server (no persistence), so it can kill it, pause it and start it again on
the same port. Gateways are `PodPool` + `RedisState` pairs in this process; the traffic test runs
a whole `Gateway` and drives it over its real ext_proc gRPC protocol while Redis dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from redis.asyncio import Redis

from plugin.adapters.redis_state import (
    GATEWAYS_KEY,
    RedisState,
    state_key,
    tokens_key,
    usage_key,
)
from plugin.config import RedisSettings
from plugin.core.capacity import CapacityEstimator
from plugin.core.limits import Limit, LimitTable, RateLimits
from plugin.core.pool import Lease, PodPool
from plugin.core.prefix import PrefixIndex
from plugin.core.types import Pod
from plugin.errors import RateLimited
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import (
    StartGateway,
    debug_pods,
    eventually,
    extproc_exchange,
    free_port,
    make_pod,
    metric_value,
    write_pods_file,
)

pytestmark = pytest.mark.component

WAIT_S = 5.0  # bound of every "until" wait
SYNC_S = 0.05
TTL_S = 0.5


def pod(name: str, port: int = 8000) -> Pod:
    return make_pod(name, address="127.0.0.1", port=port)


X, Y = pod("x", 8001), pod("y", 8002)


@dataclasses.dataclass
class Member:
    """One gateway's state: its pool, its estimator and its sync loop."""

    pool: PodPool
    estimator: CapacityEstimator
    state: RedisState
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.state.run())

    async def crash(self) -> None:
        """Stop syncing without a goodbye, as a killed process would."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=WAIT_S)
            if not done:
                task.print_stack()
                pytest.fail("the sync loop did not stop when cancelled")
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest_asyncio.fixture
async def members(redis_server: RedisServer) -> AsyncIterator[Callable[..., Member]]:
    made: list[Member] = []

    def make(
        gateway_id: str,
        ttl_s: float = TTL_S,
        sync_s: float = SYNC_S,
        claims: Any = None,
        limits: RateLimits | None = None,
    ) -> Member:
        estimator = CapacityEstimator()
        pool = PodPool(estimator)
        pool.set_pods([X, Y])
        settings = RedisSettings(
            host=redis_server.host,
            port=redis_server.port,
            gateway_id=gateway_id,
            sync_interval_s=sync_s,
            ttl_s=ttl_s,
        )
        state = RedisState(pool, settings, max_backoff_s=0.2, claims=claims, limits=limits)
        member = Member(pool, estimator, state)
        made.append(member)
        return member

    yield make
    for m in made:
        await m.crash()
        await m.state.close()


def hold(pool: PodPool, p: Pod, n: int) -> list[Lease]:
    return [pool.acquire(p) for _ in range(n)]


def running(pool: PodPool) -> dict[str, int]:
    return {c.pod.name: c.running for c in pool.candidates("m", 0.0)}


# --- in-flight counts ---------------------------------------------------------------------------


async def test_inflight_counts_sum_across_two_gateways(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    a, b = members("gw-a"), members("gw-b")
    hold(a.pool, X, 2)
    hold(b.pool, X, 3)
    hold(b.pool, Y, 1)
    # Round 1 lists both gateways; each reads the others it knew from the round before.
    for _ in range(3):
        for m in (a, b):
            assert await m.state.sync_once()
    assert running(a.pool) == {"x": 5, "y": 1}
    assert running(b.pool) == {"x": 5, "y": 1}
    assert (a.pool.inflight(X.key), a.pool.remote_inflight(X.key)) == (2, 3)
    assert (b.pool.inflight(X.key), b.pool.remote_inflight(X.key)) == (3, 2)
    assert a.state.other_gateways == b.state.other_gateways == 1

    # The layout the README documents.
    async with Redis(port=redis_server.port, decode_responses=True) as r:
        assert set(await r.zrange(GATEWAYS_KEY, 0, -1)) == {"gw-a", "gw-b"}
        entry = orjson.loads(await r.get(state_key("gw-b")) or "null")
        assert entry["inflight"] == {X.key: 3, Y.key: 1}
        assert 0 < await r.pttl(state_key("gw-b")) <= TTL_S * 1000


async def test_slo_loads_sum_across_gateways_so_no_pod_is_over_committed(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    """SLO routing's accounting (each request's share of its pod's profile) is shared like the
    counts: a gateway sees the load the others' requests take, candidates carry the sum, and it
    leaves their view when released (or when that gateway's entry expires)."""
    a, b = members("gw-a"), members("gw-b")
    mine = a.pool.acquire(X, 0.5)
    theirs = [b.pool.acquire(X, 0.25), b.pool.acquire(Y, 0.75)]
    for _ in range(3):
        for m in (a, b):
            assert await m.state.sync_once()
    loads = {c.pod.name: c.load for c in a.pool.candidates("m", 0.0)}
    assert loads == {"x": pytest.approx(0.75), "y": pytest.approx(0.75)}
    assert a.pool.load(X.key) == 0.5
    assert a.pool.remote_load(X.key) == pytest.approx(0.25)
    assert b.pool.remote_load(X.key) == pytest.approx(0.5)
    async with Redis(port=redis_server.port, decode_responses=True) as r:
        entry = orjson.loads(await r.get(state_key("gw-b")) or "null")
        assert entry["load"][Y.key] == 0.75
    for lease in theirs:
        lease.release()
    for m in (b, a):
        assert await m.state.sync_once()
    loads = {c.pod.name: c.load for c in a.pool.candidates("m", 0.0)}
    assert loads == {"x": 0.5, "y": 0.0}
    mine.release()


async def test_released_requests_leave_the_other_gateways_view(
    members: Callable[..., Member],
) -> None:
    a, b = members("gw-a"), members("gw-b")
    leases = hold(b.pool, X, 4)
    for _ in range(3):
        for m in (a, b):
            await m.state.sync_once()
    assert a.pool.remote_inflight(X.key) == 4
    for lease in leases[:3]:
        lease.release(0, 200, 0.0)
    await b.state.sync_once()
    await a.state.sync_once()
    assert a.pool.remote_inflight(X.key) == 1


async def test_gateway_that_stops_publishing_drops_out_within_the_expiry(
    members: Callable[..., Member],
) -> None:
    a, b = members("gw-a"), members("gw-b")
    hold(b.pool, X, 3)
    a.start()
    b.start()
    await eventually(lambda: a.pool.remote_inflight(X.key) == 3, "gw-b's counts")
    await b.crash()
    # Without the expiry gw-b's counts would stay for good; the bound leaves room for a slow
    # machine, not for "never".
    await eventually(
        lambda: a.pool.remote_inflight(X.key) == 0, "gw-b to expire", limit_s=TTL_S * 6
    )
    assert a.state.other_gateways == 0
    assert a.state.up


async def test_gateway_that_stops_cleanly_leaves_at_once(members: Callable[..., Member]) -> None:
    a, b = members("gw-a", ttl_s=30.0), members("gw-b", ttl_s=30.0)
    hold(b.pool, X, 2)
    a.start()
    b.start()
    await eventually(lambda: a.pool.remote_inflight(X.key) == 2, "gw-b's counts")
    await b.crash()
    await b.state.close()
    # Far sooner than the 30 s expiry: close() removed the entry.
    await eventually(lambda: a.pool.remote_inflight(X.key) == 0, "gw-b to leave", limit_s=2.0)


async def test_two_processes_with_one_name_are_reported(
    members: Callable[..., Member], caplog: pytest.LogCaptureFixture
) -> None:
    a1, a2 = members("gw-a"), members("gw-a")
    with caplog.at_level(logging.WARNING, logger="plugin.adapters.redis_state"):
        for _ in range(2):
            for m in (a1, a2):
                await m.state.sync_once()
    assert "give each gateway replica its own POD_NAME" in caplog.text


# --- token counters -----------------------------------------------------------------------------


async def test_token_counters_are_shared(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    a, b = members("gw-a"), members("gw-b")
    for m in (a, b):  # enter shared mode (baselines)
        await m.state.sync_once()
        assert m.pool.shared_tokens
    a.pool.acquire(X).release(100, 200, 0.0)
    b.pool.acquire(X).release(40, 200, 0.0)
    b.pool.credit_tokens(Y.key, 7)
    for _ in range(2):
        for m in (a, b):
            assert await m.state.sync_once()
    # Each estimator saw the whole fleet's output; each gateway's own count stays its own.
    for m in (a, b):
        assert (m.estimator.total(X.key), m.estimator.total(Y.key)) == (140, 7)
    assert (a.pool.output_tokens_total(X.key), b.pool.output_tokens_total(X.key)) == (100, 40)
    async with Redis(port=redis_server.port, decode_responses=True) as r:
        assert await r.get(tokens_key(X.key)) == "140"
    # Same tokens, same windows: the two gateways' capacity estimates agree.
    for m in (a, b):
        m.pool.refresh_capacity(0.0)
    a.pool.acquire(X).release(60, 200, 0.0)
    for _ in range(2):
        for m in (a, b):
            await m.state.sync_once()
    for m in (a, b):
        m.pool.refresh_capacity(10.0)
    assert a.pool.capacity(X.key) == b.pool.capacity(X.key) == pytest.approx(6.0)


async def test_redis_restart_is_a_reset_and_no_token_is_counted_twice(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    a = members("gw-a")
    await a.state.sync_once()
    a.pool.credit_tokens(X.key, 30)
    await a.state.sync_once()
    assert a.estimator.total(X.key) == 30

    await redis_server.kill()
    a.pool.credit_tokens(X.key, 5)  # taken by the failing round trip: credited locally
    assert not await a.state.sync_once()
    assert not a.state.up and not a.pool.shared_tokens
    a.pool.credit_tokens(X.key, 4)  # local mode: straight to the estimator
    assert a.estimator.total(X.key) == 39

    await redis_server.start()  # empty: the counters start from 0 again
    assert await a.state.sync_once()
    assert a.state.up and a.pool.shared_tokens
    a.pool.credit_tokens(X.key, 11)
    await a.state.sync_once()
    assert a.estimator.total(X.key) == 50
    assert a.pool.output_tokens_total(X.key) == 50


# --- failures -----------------------------------------------------------------------------------


async def test_paused_redis_is_local_only_then_shared_again(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    """A Redis that stops answering (SIGSTOP: connections hang) times out the round trip."""
    a, b = members("gw-a"), members("gw-b")
    hold(b.pool, X, 2)
    a.start()
    b.start()
    await eventually(lambda: a.state.up and a.pool.remote_inflight(X.key) == 2, "shared view")
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await eventually(lambda: not a.state.up, "local-only mode")
        assert not a.pool.shared_tokens
        # Other gateways' counts are dropped once older than their entries would live.
        await eventually(lambda: a.pool.remote_inflight(X.key) == 0, "remote counts dropped")
        assert a.state.sync_errors_total >= 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await eventually(lambda: a.state.up and a.pool.remote_inflight(X.key) == 2, "shared again")


class ClaimBook:
    """One gateway's side of the handover (what `LeaseHandoff` keeps): claims it owes others,
    and the claims others sent it."""

    def __init__(self) -> None:
        self.owed: dict[str, list[tuple[str, str]]] = {}
        self.received: list[tuple[str, str]] = []
        self.adopted = self.released_elsewhere = 0

    def take_claims(self) -> dict[str, list[tuple[str, str]]]:
        owed, self.owed = self.owed, {}
        return owed

    def return_claims(self, claims: dict[str, list[tuple[str, str]]]) -> None:
        for origin, keys in claims.items():
            self.owed.setdefault(origin, [])[:0] = keys

    def claimed_elsewhere(self, keys: Iterable[tuple[str, str]]) -> int:
        got = list(keys)
        self.received += got
        return len(got)


async def test_claims_reach_their_gateway_and_survive_a_paused_redis(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    """A claim (a request whose count another gateway took over) reaches the gateway that
    routed it, request ids with spaces intact, once; one owed while Redis does not answer is
    kept and delivered when it answers again."""
    book_a, book_b = ClaimBook(), ClaimBook()
    a, b = members("gw-a", claims=book_a), members("gw-b", claims=book_b)
    a.start()
    b.start()
    await eventually(lambda: a.state.up and b.state.up, "both gateways shared")
    book_b.owed["gw-a"] = [("req 1", "127.0.0.1:8001"), ("req-2", "127.0.0.1:8002")]
    await eventually(lambda: len(book_a.received) == 2, "the claims at gw-a")
    assert book_a.received == [("req 1", "127.0.0.1:8001"), ("req-2", "127.0.0.1:8002")]
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await eventually(lambda: not b.state.up, "gw-b local-only")
        book_b.owed["gw-a"] = [("req-3", "127.0.0.1:8001")]
        failed = b.state.sync_errors_total + 2  # each failed round trip gives the claim back

        def given_back() -> bool:
            kept = book_b.owed == {"gw-a": [("req-3", "127.0.0.1:8001")]}
            return b.state.sync_errors_total >= failed and kept

        await eventually(given_back, "the claim kept through two failed round trips")
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await eventually(lambda: len(book_a.received) == 3, "the kept claim at gw-a")
    assert book_a.received[-1] == ("req-3", "127.0.0.1:8001") and not book_b.owed
    assert b.state.status()["counts_taken_over"] == 0  # the book's own counter, passed through


async def test_unreachable_redis_at_start_is_local_only(members: Callable[..., Member]) -> None:
    a = members("gw-a")
    a.state.settings = dataclasses.replace(a.state.settings, port=free_port())
    assert not await a.state.sync_once()
    assert not a.state.up
    a.pool.acquire(X).release(9, 200, 0.0)
    assert a.estimator.total(X.key) == 9
    assert a.state.status()["mode"] == "local-only"


async def test_sync_costs_no_redis_call_per_request(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    """Requests only touch the pool; Redis sees one round trip per sync, however many ran."""
    a = members("gw-a", sync_s=0.5, ttl_s=2.0)
    await a.state.sync_once()
    async with Redis(port=redis_server.port, decode_responses=True) as r:
        before = (await r.info("stats"))["total_commands_processed"]
        for _ in range(500):
            a.pool.acquire(X).release(3, 200, 0.0)
        await a.state.sync_once()
        after = (await r.info("stats"))["total_commands_processed"]
    # One pipeline (MULTI, 7 fixed commands, INCRBY + EXPIRE per pod, MGET, EXEC) and the INFO.
    assert after - before <= 15, after - before
    assert a.estimator.total(X.key) == 1500


# --- a whole gateway under traffic while Redis dies ---------------------------------------------


async def _one_request(stub: pb_grpc.ExternalProcessorStub, tokens: int) -> bool:
    """One request through every ext_proc phase; True when it was routed and completed."""
    call = stub.Process()
    routed = False
    async with asyncio.timeout(WAIT_S):
        for message in extproc_exchange("m", tokens):
            await call.write(message)
            reply = await call.read()
            if not isinstance(reply, pb.ProcessingResponse):
                return False
            if reply.WhichOneof("response") == "immediate_response":
                return False
            if reply.WhichOneof("response") == "request_body":
                mutation = reply.request_body.response.header_mutation
                routed = any(h.header.key == "target-pod" for h in mutation.set_headers)
        await call.done_writing()
        await call.read()
    return routed and await call.code() == grpc.StatusCode.OK


async def test_kill_redis_during_traffic_fails_no_request_and_recovers(
    tmp_path: Path,
    redis_server: RedisServer,
    members: Callable[..., Member],
    start_gateway: StartGateway,
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {
        "REDIS_HOST": redis_server.host,
        "REDIS_PORT": str(redis_server.port),
        "POD_NAME": "gw-under-test",
        "HETERO_GATEWAY_REDIS_SYNC_MS": str(int(SYNC_S * 1000)),
        "HETERO_GATEWAY_REDIS_TTL_MS": str(int(TTL_S * 1000)),
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "30000",  # the pods do not exist: no scraping
    }
    other = members("gw-other")  # a second gateway holding load on x
    hold(other.pool, X, 2)
    other.start()
    outcomes: list[bool] = []
    failures: list[str] = []
    stop = asyncio.Event()

    async def traffic(stub: pb_grpc.ExternalProcessorStub) -> None:
        while not stop.is_set():
            try:
                outcomes.append(await _one_request(stub, 5))
            except Exception as exc:
                failures.append(repr(exc))
                outcomes.append(False)

    caplog.set_level(logging.INFO, logger="plugin.adapters.redis_state")
    gateway = await start_gateway(write_pods_file(tmp_path / "pods.yaml", [X, Y]), env)
    url = f"http://127.0.0.1:{gateway.http_port}"
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel,
            aiohttp.ClientSession() as http,
        ):
            stub = pb_grpc.ExternalProcessorStub(channel)
            shared = gateway.shared
            assert shared is not None
            await eventually(
                lambda: shared.up and gateway.pool.remote_inflight(X.key) == 2, "shared view"
            )
            assert await metric_value(http, url, "hetero_gateway_shared_state_up") == 1.0
            workers = [asyncio.ensure_future(traffic(stub)) for _ in range(4)]
            try:
                await asyncio.sleep(0.5)
                before = len(outcomes)
                await redis_server.kill()
                await eventually(lambda: not shared.up, "local-only mode")
                assert await metric_value(http, url, "hetero_gateway_shared_state_up") == 0.0
                debug = await debug_pods(http, url)
                assert debug["shared_state"]["mode"] == "local-only"
                assert debug["shared_state"]["gateway"] == "gw-under-test"
                # Traffic on local state only: 20 more requests complete while Redis is gone.
                await eventually(lambda: len(outcomes) - before >= 20, "requests during")
                during = len(outcomes) - before
                assert not shared.up  # still local-only: those 20 really ran without Redis
                await redis_server.start()
                await eventually(
                    lambda: shared.up and gateway.pool.remote_inflight(X.key) == 2,
                    "shared view back",  # within WAIT_S: "a few seconds"
                )
                await asyncio.sleep(0.3)
            finally:
                stop.set()
                await asyncio.gather(*workers)
            assert await metric_value(http, url, "hetero_gateway_shared_state_up") == 1.0
            errors = await metric_value(http, url, "hetero_gateway_shared_state_sync_errors_total")
            assert errors is not None and errors >= 1
    finally:
        await gateway.stop()
    assert during >= 20, during  # requests kept flowing while Redis was gone
    assert len(outcomes) > during and all(outcomes), failures[:3] or outcomes.count(False)
    # No leaked in-flight count, and every token counted.
    assert gateway.pool.inflight(X.key) == gateway.pool.inflight(Y.key) == 0
    counted = gateway.pool.output_tokens_total(X.key) + gateway.pool.output_tokens_total(Y.key)
    assert counted == 5 * len(outcomes)
    assert "routing on this gateway's local state only" in caplog.text
    assert "in-flight counts and token counters shared" in caplog.text


# --- the prefix-cache index ----------------------------------------------------------------------


async def test_a_prefix_one_gateway_routed_matches_at_the_other_and_survives_an_outage(
    redis_server: RedisServer,
) -> None:
    """Each sync publishes the prompts a gateway routed and adds the others' to its index; while
    Redis is away they wait, and are published when it is back."""
    states: list[RedisState] = []
    indexes: list[PrefixIndex] = []
    for name in ("gw-a", "gw-b"):
        pool = PodPool(CapacityEstimator())
        pool.set_pods([X, Y])
        index = PrefixIndex(block_chars=16)
        index.share()
        settings = RedisSettings(
            host=redis_server.host, port=redis_server.port, gateway_id=name, ttl_s=TTL_S
        )
        states.append(RedisState(pool, settings, prefixes=index))
        indexes.append(index)
    a, b = states
    try:
        for state in (a, b, a, b):  # each has read where the stream ends
            assert await state.sync_once()
        prompt = ("a system prompt every request of this app starts with",)
        indexes[0].record("m", X.key, prompt)
        assert await a.sync_once() and await b.sync_once()
        blocks = len(indexes[0].hashes("m", prompt))
        assert indexes[1].match("m", prompt) == {X.key: blocks}
        assert (a.prefixes_added, b.prefixes_added) == (0, 1)  # its own are not added again

        await redis_server.kill()
        other = ("another prompt, routed while Redis is away",)
        indexes[0].record("m", Y.key, other)
        assert not await a.sync_once()
        await redis_server.start()
        assert await a.sync_once() and await b.sync_once()
        assert indexes[1].match("m", other) == {Y.key: len(indexes[0].hashes("m", other))}
    finally:
        for state in states:
            await state.close()


# --- tenants' rate limits -----------------------------------------------------------------------


def remaining_tokens(limits: RateLimits) -> int:
    return int(dict(limits.headers("team", time.time()))["x-ratelimit-remaining-tokens"])


async def test_tenant_limits_hold_across_gateways_and_fall_back_to_a_share(
    members: Callable[..., Member], redis_server: RedisServer
) -> None:
    table = LimitTable({"team": Limit(tokens=900)})
    la, lb = RateLimits(table), RateLimits(table)
    a, b = members("gw-a", limits=la), members("gw-b", limits=lb)
    a.start()
    b.start()
    await eventually(lambda: la.sharing == lb.sharing == 2, "limits shared by two")
    la.reserve("team", 600, time.time())
    await eventually(lambda: remaining_tokens(lb) == 300, "a's usage seen at b")
    with pytest.raises(RateLimited):
        lb.reserve("team", 400, time.time())
    lb.reserve("team", 300, time.time())
    async with Redis(host=redis_server.host, port=redis_server.port) as client:
        published = await client.get(usage_key("gw-a"))
        assert published is not None
        assert orjson.loads(published) == {"team": [1.0, 600.0, 0.0]}
        assert await client.pttl(usage_key("gw-a")) > 60_000  # outlives the gateway's state
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await eventually(lambda: not la.shared and not lb.shared, "local-only limits")
        # Each gateway holds the tenant to half the limit, against its own usage.
        assert remaining_tokens(la) == 0 and remaining_tokens(lb) == 150
        with pytest.raises(RateLimited, match="share: 1/2"):
            lb.reserve("team", 151, time.time())
        lb.reserve("team", 150, time.time())
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await eventually(lambda: la.shared and lb.shared, "shared again")
    # What b admitted while alone is published too: the tenant is over for everyone.
    await eventually(lambda: remaining_tokens(la) == 0, "the outage's usage seen at a")
    await a.crash()  # its state expires; what it served still counts for the window
    await eventually(lambda: b.state.other_gateways == 0 and lb.sharing == 1, "a gone")
    assert lb.shared and remaining_tokens(lb) == 0
    with pytest.raises(RateLimited):
        lb.reserve("team", 1, time.time())
    # A new process under a's name (a restarted container) starts from what a published.
    la2 = RateLimits(table)
    members("gw-a", limits=la2).start()
    await eventually(lambda: la2.shared and la2.sharing == 2, "the new a shares the limits")
    assert la2.totals(time.time())["team"][1] == 600.0
    assert remaining_tokens(la2) == 0
