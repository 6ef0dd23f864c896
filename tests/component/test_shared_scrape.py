"""Engine scrapes shared among gateway replicas through a real `redis-server`.

Three gateways in this process, each a `PodPool`, a `MetricsScraper` and a `RedisState` with
their real loops, scrape twelve real HTTP engines on loopback that count the pages they serve.
Shared, each engine is scraped about once a period for the whole fleet and every gateway still
sees every engine's metrics; a gateway that stops has its engines scraped by the others; with
Redis gone every gateway scrapes every engine again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from aiohttp import web
from redis.asyncio import Redis

from plugin.adapters.redis_state import RedisState, scrapes_key
from plugin.adapters.scraper import MetricsScraper
from plugin.config import RedisSettings
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.scrape_share import ScrapeShares
from plugin.core.types import Pod
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import ServeApp, eventually, make_pod

pytestmark = pytest.mark.component

PERIOD_S = 0.3
ENGINES = 12


@dataclasses.dataclass
class Engine:
    """A vLLM-shaped /metrics page whose running count is the engine's number."""

    number: int
    hits: int = 0
    pod: Pod | None = None
    generated: float | None = None  # its generated-token counter, once it exports one

    def page(self) -> str:
        counter = ""
        if self.generated is not None:
            counter = f'vllm:generation_tokens_total{{model_name="m"}} {self.generated}\n'
        return (
            f'vllm:num_requests_running{{model_name="m"}} {self.number}\n'
            'vllm:num_requests_waiting{model_name="m"} 0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n' + counter
        )


@dataclasses.dataclass
class Replica:
    name: str
    pool: PodPool
    scraper: MetricsScraper
    state: RedisState
    tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    @property
    def shares(self) -> ScrapeShares:
        assert self.state.shares is not None
        return self.state.shares

    def start(self) -> None:
        self.tasks = [
            asyncio.ensure_future(self.state.run()),
            asyncio.ensure_future(self.scraper.run()),
        ]

    async def crash(self) -> None:
        """Stop scraping and syncing without a goodbye, as a killed process would."""
        tasks, self.tasks = self.tasks, []
        for task in tasks:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5.0)
            if not done:
                task.print_stack()
                pytest.fail(f"{task.get_name()} of {self.name} did not stop when cancelled")
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def running(self) -> dict[str, float | None]:
        """Each pod's running count as this replica's pool has it from the engines."""
        pods = self.pool.snapshot(time.monotonic())["pods"]
        return {k: (v["engine"] or {}).get("running") for k, v in pods.items()}


@pytest_asyncio.fixture
async def engines(serve_app: ServeApp) -> list[Engine]:
    made = []
    for number in range(ENGINES):
        engine = Engine(number)

        async def metrics(_: web.Request, engine: Engine = engine) -> web.Response:
            engine.hits += 1
            return web.Response(text=engine.page(), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        port = await serve_app(app)
        engine.pod = make_pod(f"e{number}", address="127.0.0.1", port=port)
        made.append(engine)
    return made


ReplicaFactory = Callable[..., Replica]


@pytest_asyncio.fixture
async def replicas(
    redis_server: RedisServer, engines: list[Engine]
) -> AsyncIterator[ReplicaFactory]:
    made: list[Replica] = []

    def make(name: str, fast_window_s: float = 15.0) -> Replica:
        estimator = CapacityEstimator(fast_window_s=fast_window_s, fast_tau_s=fast_window_s / 3)
        pool = PodPool(estimator, metrics_max_age_s=3 * PERIOD_S)
        pool.set_pods([e.pod for e in engines if e.pod is not None])
        scraper = MetricsScraper(pool, interval_s=PERIOD_S, timeout_s=PERIOD_S / 2)
        settings = RedisSettings(
            host=redis_server.host,
            port=redis_server.port,
            gateway_id=name,
            sync_interval_s=0.05,
            ttl_s=0.5,
        )
        state = RedisState(
            pool,
            settings,
            max_backoff_s=0.2,
            shares=ScrapeShares(name),
            scrape_expiry_s=1.5 * PERIOD_S,
            on_scrapers_changed=scraper.wake,
        )
        scraper.exchange = state
        replica = Replica(name, pool, scraper, state)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        await replica.crash()
        await replica.state.close()


def _truth(engines: list[Engine]) -> dict[str, float | None]:
    return {e.pod.key: float(e.number) for e in engines if e.pod is not None}


async def _hits_over(engines: list[Engine], periods: int) -> list[int]:
    before = [e.hits for e in engines]
    await asyncio.sleep(periods * PERIOD_S)
    return [e.hits - b for e, b in zip(engines, before, strict=True)]


async def _three_sharing(
    replicas: ReplicaFactory, engines: list[Engine]
) -> tuple[Replica, Replica, Replica]:
    a, b, c = replicas("gw-a"), replicas("gw-b"), replicas("gw-c")
    for replica in (a, b, c):
        replica.start()
    await eventually(
        lambda: all(len(r.shares.scrapers) == 3 for r in (a, b, c)), "three scrapers seen by all"
    )
    truth = _truth(engines)
    await eventually(
        lambda: all(r.running() == truth for r in (a, b, c)), "every engine's metrics on all"
    )
    return a, b, c


async def test_each_engine_is_scraped_once_a_period_and_every_replica_sees_all(
    replicas: ReplicaFactory, engines: list[Engine]
) -> None:
    a, b, c = await _three_sharing(replicas, engines)
    periods = 6
    hits = await _hits_over(engines, periods)
    # Three replicas each scraping everything would make it 3 x periods.
    assert all(periods - 2 <= h <= periods + 2 for h in hits), hits
    owners = {r.name: sum(r.shares.mine(e.pod.key) for e in engines if e.pod) for r in (a, b, c)}
    assert sum(owners.values()) == ENGINES and all(n > 0 for n in owners.values()), owners
    # Read from the others, still exact: each replica's pool shows every engine's value.
    truth = _truth(engines)
    assert all(r.running() == truth for r in (a, b, c))
    status = a.state.status()["scrapes"]
    assert status["scrapers"] == ["gw-a", "gw-b", "gw-c"]
    assert status["scraped_here_last_tick"] + status["read_from_peers_last_tick"] >= ENGINES - 1


async def test_a_replica_that_stops_has_its_engines_scraped_by_the_others(
    replicas: ReplicaFactory, engines: list[Engine]
) -> None:
    a, b, c = await _three_sharing(replicas, engines)
    orphans = [e for e in engines if e.pod is not None and c.shares.mine(e.pod.key)]
    assert orphans
    await c.crash()
    await eventually(
        lambda: all(r.shares.scrapers == ("gw-a", "gw-b") for r in (a, b)),
        "the stopped replica to leave the scrapers",
        limit_s=10 * PERIOD_S,
    )
    before = [e.hits for e in orphans]
    await eventually(
        lambda: all(e.hits > h for e, h in zip(orphans, before, strict=True)),
        "its engines scraped by the others",
        limit_s=10 * PERIOD_S,
    )
    hits = await _hits_over(engines, 6)
    assert all(4 <= h <= 8 for h in hits), hits  # once a period, now by two replicas


async def test_with_redis_gone_every_replica_scrapes_every_engine(
    replicas: ReplicaFactory, engines: list[Engine], redis_server: RedisServer
) -> None:
    a, b, c = await _three_sharing(replicas, engines)
    await redis_server.kill()
    await eventually(lambda: not any(r.state.up for r in (a, b, c)), "Redis to be missed")
    await eventually(lambda: all(r.shares.scrapers == (r.name,) for r in (a, b, c)), "each alone")
    hits = await _hits_over(engines, 6)
    assert all(h >= 3 * 6 - 4 for h in hits), hits  # every replica scrapes every engine
    truth = _truth(engines)
    assert all(r.running() == truth for r in (a, b, c))


async def test_a_replica_that_stops_cleanly_hands_its_engines_over_at_once(
    replicas: ReplicaFactory, engines: list[Engine]
) -> None:
    a, b, c = await _three_sharing(replicas, engines)
    await c.crash()
    await c.state.close()  # removes its scrapes: no wait for the expiry
    await eventually(
        lambda: all(r.shares.scrapers == ("gw-a", "gw-b") for r in (a, b)),
        "the others to see it gone",
        limit_s=4 * PERIOD_S,
    )


async def test_every_replica_scores_an_engine_with_what_its_scraper_learned(
    replicas: ReplicaFactory, engines: list[Engine]
) -> None:
    """The replica that scrapes an engine learns its capacity from the engine's counter; the
    others take that estimate as it is, so all three score the engine alike (each learning it
    from the same records would give three slightly different estimates, sampled at their
    own ticks). A short window, so that estimates settle soon after the counters stop."""
    window_s = 1.0
    a, b, c = (replicas(name, fast_window_s=window_s) for name in ("gw-a", "gw-b", "gw-c"))
    for engine in engines:
        engine.generated = 0.0
    for replica in (a, b, c):
        replica.start()
    await eventually(
        lambda: all(len(r.shares.scrapers) == 3 for r in (a, b, c)), "three scrapers seen by all"
    )
    for _ in range(int(2.0 / 0.05)):  # each engine generates (its number + 1) x 500 tokens/s
        await asyncio.sleep(0.05)
        for engine in engines:
            engine.generated = (engine.generated or 0.0) + (engine.number + 1) * 500 * 0.05
    keys = [e.pod.key for e in engines if e.pod is not None]

    def alike() -> bool:
        estimates = [[r.pool.capacity(k) for r in (a, b, c)] for k in keys]
        return all(None not in row and len(set(row)) == 1 for row in estimates)

    await eventually(alike, "the same estimate of every engine on all three", limit_s=8.0)
    # Learned where each is scraped, from its own counter: in proportion to its rate (the
    # short window ran past the counters' stop, so each estimate is below its rate alike).
    first = a.pool.capacity(keys[0])
    assert first is not None and first > 0
    for engine in engines:
        capacity = a.pool.capacity(engine.pod.key) if engine.pod else None
        assert capacity is not None
        assert 0.85 * (engine.number + 1) <= capacity / first <= 1.15 * (engine.number + 1)
    assert all(r.pool.token_source(k) == "engine" for r in (a, b, c) for k in keys)


async def test_each_peers_scrapes_are_decoded_only_when_reached(
    replicas: ReplicaFactory, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica reads the other scrapers' records one peer at a time: the next peer's are
    decoded once the caller is done with the first (so a tick holds one peer's records, not all
    of them). Shown with a garbled second peer, whose warning comes only when it is reached."""
    a, b, c = replicas("gw-a"), replicas("gw-b"), replicas("gw-c")
    for replica in (a, b, c):
        assert await replica.state.sync_once()
    for replica in (b, c):
        list(await replica.state.exchange_scrapes({"ns/p": [0.0, "down"]}))
    async with Redis(host=redis_server.host, port=redis_server.port) as redis:
        await redis.set(scrapes_key("gw-c"), b"{not json", px=5_000)
    for _ in range(2):  # the first lists the gateways, the second checks their scrapes
        assert await a.state.sync_once()
    assert a.shares.scrapers == ("gw-a", "gw-b", "gw-c")
    caplog.set_level(logging.WARNING, logger="plugin.adapters.redis_state")
    peers = await a.state.exchange_scrapes({})
    gateway, _, _, pods = next(peers)
    assert (gateway, pods) == ("gw-b", {"ns/p": [0.0, "down"]})
    assert "unreadable scrapes" not in caplog.text  # gw-c's not decoded yet
    assert list(peers) == []
    assert "unreadable scrapes of gateway gw-c" in caplog.text
