"""What a large fleet costs the plugin outside the request path, by pool size.

Three loops run whatever the traffic, and each grows with the pool:

- scraping: one `MetricsScraper` tick over N pods, each answering a page shaped like vLLM's
  /metrics (histograms per model, about 440 lines and 38 KB) from a server in another
  process on loopback (not the mock engine's page: at 72 lines and 5 KB it would understate
  what a real engine costs to scrape);
- discovery: the Kubernetes source's handling of N ADDED events (start-up) and then N MODIFIED
  events (a rolling restart: each pod not ready, then ready again at a new IP), each event
  parsed, the pod list published and `PodPool.set_pods` applied, as the watch thread and the
  event loop do it (the client library's JSON decoding of the watch stream is not included);
- shared state: one `RedisState.sync_once` round trip per gateway, 4 gateways sharing a real
  `redis-server` on loopback, every pod with requests in flight and tokens to publish.

CPU is this process's user + system time (`time.process_time`), so the metrics server and
redis-server are not counted. The share of a core is the CPU per tick times the ticks per
second at the default intervals (scrape 1 s, Redis sync 100 ms).

    python benchmarks/fleet_overhead.py            # about a minute

Writes its table into docs/plugin-cost.md between the fleet-overhead markers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiohttp import web
from kubernetes import client
from redis.asyncio import Redis

from plugin.adapters.gc_tuning import collect_young_garbage_less_often
from plugin.adapters.kubernetes import MODEL_KEY, KubernetesSource, _Worker
from plugin.adapters.redis_state import GATEWAYS_KEY, RedisState, scrapes_key
from plugin.adapters.scraper import MetricsScraper, encode_scrape
from plugin.config import RedisSettings
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.scrape_share import ScrapeShares
from plugin.core.types import EngineMetrics, Pod
from plugin_tools.demo.fleet import free_port
from plugin_tools.docsection import write_section

MODEL = "llama-3-8b"
DOC = Path(__file__).resolve().parent.parent / "docs" / "plugin-cost.md"
SIZES = (16, 256, 1000)
SCRAPE_TICKS = 5
SYNC_ROUNDS = 30
GATEWAYS = 4
REPLICAS = 5  # gateways sharing the scrapes
GENERATED = f'vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}}'
GENERATED_SAMPLE = GENERATED + " 12345.0"
TOKENS_PER_S = 2000  # what each engine's counter gains a second
T = TypeVar("T")


def vllm_page(seed: int) -> str:
    """A /metrics page with vLLM's shape: a few gauges, many counters and histograms."""
    rng = random.Random(seed)
    labels = f'engine="0",model_name="{MODEL}"'
    lines = []
    for name, value in (
        ("vllm:num_requests_running", rng.randint(0, 64)),
        ("vllm:num_requests_waiting", rng.randint(0, 4)),
        ("vllm:kv_cache_usage_perc", rng.random()),
    ):
        lines += [f"# HELP {name} gauge", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    for name in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions"):
        lines += [f"# TYPE vllm:{name}_total counter", f"vllm:{name}_total{{{labels}}} 12345.0"]
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "iteration_tokens_total",
        "request_params_max_tokens",
        "request_params_n",
    ):
        lines.append(f"# TYPE vllm:{name} histogram")
        total = 0
        for le in (*(2**i / 1000 for i in range(28)), "+Inf"):
            total += rng.randint(0, 50)
            lines.append(f'vllm:{name}_bucket{{{labels},le="{le}"}} {total}.0')
        lines += [
            f"vllm:{name}_sum{{{labels}}} {total * 0.3}",
            f"vllm:{name}_count{{{labels}}} {total}.0",
        ]
    for i in range(40):  # the Python process and GC families every client exports
        lines.append(f'python_gc_objects_collected_total{{generation="{i % 3}"}} {i * 1000}.0')
    return "\n".join(lines) + "\n"


def narrowed(page: str, names: frozenset[str]) -> str:
    """The page as prometheus_client renders it for a request naming samples (`name[]`): the
    named samples, each after its family's HELP and TYPE lines."""
    out: list[str] = []
    block: list[str] = []  # the comment lines of the family being read
    shown = after_comment = False
    for line in page.splitlines():
        if line.startswith("#"):
            if not after_comment:
                block, shown = [], False
            block.append(line)
            after_comment = True
            continue
        after_comment = False
        if line.split("{", 1)[0].split(" ", 1)[0] in names:
            if not shown:
                out += block
                shown = True
            out.append(line)
    return "\n".join(out) + "\n"


def serve_metrics(port: int, by_name: bool) -> None:
    """The other process: one server on every loopback address, a page per pod. `by_name`: it
    honours `name[]` as vLLM's prometheus_client exposition does; else it sends the whole page
    whatever is asked (an engine that ignores the parameters)."""
    pages = [vllm_page(i) for i in range(64)]
    # Each page split around its generated-token counter, which grows with the clock as a busy
    # engine's does: a static counter would leave every pod without a learned capacity, and
    # the gateway would pay the fair start of a newcomer for each of them every tick.
    cache: dict[tuple[int, frozenset[str]], tuple[bytes, bytes | None]] = {}
    started = time.monotonic()

    async def metrics(request: web.Request) -> web.Response:
        host = request.host.rsplit(":", 1)[0]
        which = hash(host) % len(pages)
        names = frozenset(request.query.getall("name[]", [])) if by_name else frozenset()
        parts = cache.get((which, names))
        if parts is None:
            page = pages[which]
            text = narrowed(page, names) if names else page
            head, found, tail = text.partition(GENERATED_SAMPLE)
            parts = cache[(which, names)] = (head.encode(), tail.encode() if found else None)
        head_bytes, tail_bytes = parts
        if tail_bytes is None:
            body = head_bytes
        else:
            tokens = 12345 + round(TOKENS_PER_S * (time.monotonic() - started))
            body = b"%s%s %d.0%s" % (head_bytes, GENERATED.encode(), tokens, tail_bytes)
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="0.0.0.0", port=port, print=None, access_log=None)


def make_pods(n: int, metrics_port: int = 8000) -> list[Pod]:
    return [
        Pod(f"p{i}", "bench", MODEL, f"127.1.{i // 250}.{i % 250 + 1}", 8000, metrics_port)
        for i in range(n)
    ]


async def scrape_cost(n: int, port: int) -> tuple[float, float]:
    """(CPU ms per scrape tick, wall ms per tick) over N pods."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods(make_pods(n, port))
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=5.0)
    await scraper.tick()  # connections open, pages cached by the server
    if scraper.errors_total:
        raise RuntimeError(f"{len(scraper.errors_total)} scrapes failed")
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(SCRAPE_TICKS):
        await scraper.tick()
    cpu1, t1 = time.process_time(), time.perf_counter()
    scraper.close()
    return (cpu1 - cpu0) * 1000 / SCRAPE_TICKS, (t1 - t0) * 1000 / SCRAPE_TICKS


async def shared_scrape_cost(n: int, port: int, redis_port: int) -> float:
    """CPU ms per scrape tick of one of REPLICAS gateways sharing N pods through Redis: its
    share scraped over HTTP, its scrapes published, the others' read and applied. The other
    replicas' scrapes are written to Redis between ticks as they would publish them (their
    writing is not counted: it is their CPU)."""
    pods = make_pods(n, port)
    pool = PodPool(CapacityEstimator())
    pool.set_pods(pods)
    me, peers = "bench-0", [f"bench-{i}" for i in range(1, REPLICAS)]
    settings = RedisSettings("127.0.0.1", redis_port, gateway_id=me)
    state = RedisState(pool, settings, shares=ScrapeShares(me), scrape_expiry_s=60.0)
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=5.0, exchange=state)
    redis = Redis(port=redis_port)
    rng = random.Random(n)

    async def publish_peers(seq: int) -> None:
        """Each peer's records for the pods it owns, as its scraper writes them."""
        pipe = redis.pipeline(transaction=False)
        pipe.zadd(GATEWAYS_KEY, {g: time.time() for g in peers})
        for peer in peers:
            view = ScrapeShares(peer)
            view.set_scrapers([me, *peers])
            records = {}
            for pod in pods:
                if view.mine(pod.key):
                    metrics = EngineMetrics(
                        running=float(rng.randint(0, 64)),
                        waiting=float(rng.randint(0, 4)),
                        kv_usage=rng.random(),
                        generation_tokens=1000.0 * seq + rng.randint(0, 999),
                        generation_tokens_stepwise=True,
                        queue_time_sum=0.3 * seq,
                        queue_time_count=float(seq),
                        token_latency_sum=0.02 * seq,
                        token_latency_count=float(seq),
                    )
                    # What the peer learned of the pod, as its scraper publishes it.
                    learned = (rng.uniform(1000.0, 3000.0), True, 64, "learned")
                    records[pod.key] = [0.0, *encode_scrape(metrics, learned)]  # just scraped
            blob = orjson.dumps({"seq": seq, "pods": records})
            pipe.set(scrapes_key(peer), blob, px=60_000)
        await pipe.execute()

    try:
        await publish_peers(0)
        for _ in range(2):  # the first lists the gateways, the second checks their scrapes
            if not await state.sync_once():
                raise RuntimeError(f"sync failed: {state.last_error}")
        await scraper.tick()  # connections open
        if scraper.errors_total or state.shares is None:
            raise RuntimeError(f"{len(scraper.errors_total)} scrapes failed")
        cpu = 0.0
        for tick in range(1, SCRAPE_TICKS + 1):
            await publish_peers(tick)
            cpu0 = time.process_time()
            await scraper.tick()
            cpu += time.process_time() - cpu0
        shares = state.shares
        if shares.scraped + shares.from_peers != n or shares.from_peers == 0:
            raise RuntimeError(f"scraped {shares.scraped}, read {shares.from_peers} of {n}")
        learned = sum(1 for p in pods if shares.mine(p.key) and pool.capacity(p.key) is not None)
        if learned < shares.scraped:  # a busy fleet: every engine's counter moves
            raise RuntimeError(f"{shares.scraped - learned} scraped pods learned no capacity")
        adopted = sum(1 for p in pods if not shares.mine(p.key) and pool.saturation(p.key) == 64)
        if adopted < shares.from_peers:
            raise RuntimeError(f"{shares.from_peers - adopted} pods read from peers not adopted")
    finally:
        scraper.close()
        await state.close()
        await redis.delete(GATEWAYS_KEY, *(scrapes_key(p) for p in peers))
        await redis.aclose()
    return cpu * 1000 / SCRAPE_TICKS


def pod_object(i: int, ip: str, ready: bool) -> dict[str, Any]:
    """A pod as the API server sends it in a watch event (the fields the source reads)."""
    return {
        "metadata": {
            "name": f"p{i}",
            "namespace": "bench",
            "uid": f"uid-{i}",
            "labels": {"app": "engine", MODEL_KEY: MODEL},
        },
        "spec": {"nodeName": "node-1", "containers": [{"name": "engine", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def discovery_cost(n: int) -> tuple[float, float]:
    """(CPU us per ADDED event at start-up, CPU us per MODIFIED event in a rolling restart)."""
    pool = PodPool(CapacityEstimator())
    # Never connects: only its event handling runs.
    source = KubernetesSource(configuration=client.Configuration(host="http://127.0.0.1:9"))
    worker = _Worker(source, pool.set_pods)
    cpu0 = time.process_time()
    for i in range(n):
        worker._apply("ADDED", pod_object(i, f"10.0.{i // 250}.{i % 250 + 1}", True))
    cpu1 = time.process_time()
    for i in range(n):
        worker._apply("MODIFIED", pod_object(i, f"10.0.{i // 250}.{i % 250 + 1}", False))
        worker._apply("MODIFIED", pod_object(i, f"10.1.{i // 250}.{i % 250 + 1}", True))
    cpu2 = time.process_time()
    if len(pool.pods()) != n:
        raise RuntimeError(f"{len(pool.pods())} of {n} pods discovered")
    return (cpu1 - cpu0) * 1e6 / n, (cpu2 - cpu1) * 1e6 / (2 * n)


async def redis_cost(n: int, port: int) -> float:
    """CPU ms per sync round trip of one gateway, with 4 gateways sharing N busy pods."""
    rng = random.Random(n)
    pods = make_pods(n)
    states: list[tuple[RedisState, PodPool]] = []
    for g in range(GATEWAYS):
        pool = PodPool(CapacityEstimator())
        pool.set_pods(pods)
        for pod in pods:
            for _ in range(rng.randint(0, 8)):
                pool.acquire(pod)
        settings = RedisSettings("127.0.0.1", port, gateway_id=f"bench-{n}-{g}")
        states.append((RedisState(pool, settings), pool))
    try:
        for state, _ in states:  # every gateway knows every other one from here on
            await state.sync_once()
        cpu0 = time.process_time()
        for _ in range(SYNC_ROUNDS):
            for state, pool in states:
                for pod in rng.sample(pods, min(len(pods), 50)):
                    pool.credit_tokens(pod.key, rng.randint(1, 500))
                if not await state.sync_once():
                    raise RuntimeError(f"sync failed: {state.last_error}")
        cpu1 = time.process_time()
        if states[0][0].other_gateways != GATEWAYS - 1:
            raise RuntimeError(f"saw {states[0][0].other_gateways} other gateways")
    finally:
        for state, _ in states:
            await state.close()
    return (cpu1 - cpu0) * 1000 / (SYNC_ROUNDS * GATEWAYS)


Row = tuple[int, float, float, float, float, float, float, float]


async def measure(sizes: list[int], metrics_ports: tuple[int, int], redis_port: int) -> list[Row]:
    await asyncio.sleep(1.5)  # the metrics servers and redis-server start
    rows = []
    for n in sizes:
        # Each measurement from a collected heap: the garbage of the one before (thousands of
        # pools' and connections' objects) is not this one's to collect.
        gc.collect()
        scrape_ms, scrape_wall_ms = await scrape_cost(n, metrics_ports[0])
        gc.collect()
        whole_ms, _ = await scrape_cost(n, metrics_ports[1])
        gc.collect()
        shared_ms = await shared_scrape_cost(n, metrics_ports[0], redis_port)
        gc.collect()
        added_us, modified_us = discovery_cost(n)
        gc.collect()
        sync_ms = await redis_cost(n, redis_port)
        rows.append(
            (n, scrape_ms, scrape_wall_ms, whole_ms, shared_ms, added_us, modified_us, sync_ms)
        )
        print(
            f"  {n:5d} pods: scrape tick {scrape_ms:.1f} ms CPU ({whole_ms:.1f} whole pages, "
            f"{shared_ms:.1f} one of {REPLICAS} sharing), discovery "
            f"{added_us:.0f}/{modified_us:.0f} us per event, Redis sync {sync_ms:.2f} ms",
            file=sys.stderr,
            flush=True,
        )
    return rows


def run_like_serve(main: Coroutine[Any, Any, T]) -> T:
    """On uvloop where `serve` uses it, with its garbage collector settings, so the loops cost
    what they cost in the plugin."""
    collect_young_garbage_less_often()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default=",".join(map(str, SIZES)))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--serve-metrics", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--whole-pages", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_metrics:
        serve_metrics(args.serve_metrics, by_name=not args.whole_pages)
        return
    sizes = [int(x) for x in args.pods.split(",")]
    redis_binary = shutil.which("redis-server")
    if redis_binary is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    metrics_ports = (free_port("0.0.0.0"), free_port("0.0.0.0"))
    redis_port = free_port()
    servers = [
        subprocess.Popen([sys.executable, __file__, "--serve-metrics", str(port), *extra])
        for port, extra in zip(metrics_ports, ([], ["--whole-pages"]), strict=True)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        redis = subprocess.Popen(
            [
                *(redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", tmp),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            rows = run_like_serve(measure(sizes, metrics_ports, redis_port))
        finally:
            for process in (redis, *servers):
                process.terminate()
                process.wait()
    head = (
        "| pods | scrape tick CPU ms | scrape tick wall ms | scraping, share of a core at 1 s "
        f"| whole pages: scrape tick CPU ms | one of {REPLICAS} replicas sharing: scrape tick "
        "CPU ms | its share of a core at 1 s | ADDED event CPU us | MODIFIED event CPU us "
        "| Redis sync CPU ms | Redis sync, share of a core at 100 ms |"
    )
    lines = [head, "| --- " * 11 + "|"]
    for n, scrape_ms, wall_ms, whole_ms, shared_ms, added_us, modified_us, sync_ms in rows:
        lines.append(
            f"| {n} | {scrape_ms:.1f} | {wall_ms:.0f} | {scrape_ms / 1000:.1%} | {whole_ms:.1f} "
            f"| {shared_ms:.1f} | {shared_ms / 1000:.1%} | {added_us:.0f} | {modified_us:.0f} "
            f"| {sync_ms:.2f} | {sync_ms / 100:.1%} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    text = (
        "## Costs outside the request path by pool size\n\n"
        f"Generated by `python benchmarks/fleet_overhead.py --pods {args.pods}`: CPU of the "
        "plugin's own loops in one process (`time.process_time`; the metrics server and "
        "redis-server run in other processes and are not counted; the garbage of each "
        "measurement is collected before the next). Scrape: one "
        "`MetricsScraper` tick over N pods serving a vLLM-shaped page (about 440 lines, "
        "38 KB), mean of "
        f"{SCRAPE_TICKS} ticks. Discovery: the Kubernetes source's handling of N ADDED events, "
        "then 2N MODIFIED events (a rolling restart: not ready, then ready at a new IP), each "
        "including `PodPool.set_pods`; the client library's decoding of the watch stream is "
        f"not included. Redis: one `RedisState.sync_once` of one of {GATEWAYS} gateways sharing "
        "N pods, each pod with 0-8 requests in flight per gateway and 50 pods' tokens to "
        f"publish per round, mean of {SYNC_ROUNDS} rounds per gateway.\n\n{table}\n"
    )
    print(f"wrote {write_section(DOC, 'fleet-overhead', text).name}", file=sys.stderr)


if __name__ == "__main__":
    main()
