"""Learning an engine's batch cap from its metrics without mistaking a queue that lasts one step
for a cap: the mock engine's scheduler (`BatchScheduler`, cap 256) runs in simulated time under
bursty arrivals at 50%, 80% and 95% of the rate it can serve at its cap, and the pool reads its
running and waiting counts every scrape interval, as the scraper would."""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.types import EngineMetrics, Pod
from plugin_tools.mock_engine.model import PRESETS, BatchScheduler, step_duration_s

pytestmark = pytest.mark.unit

CAP = 256
POD = Pod(name="a", namespace="ns", model="m", address="10.0.0.1", port=8000, metrics_port=8000)


def _learned_caps(
    load: float,
    seed: int,
    *,
    kv_tokens: int = 10**9,
    duration_s: float = 900.0,
    scrape_s: float = 1.0,
    time_scale: float = 1.0,
    burst: int = 6,
    histograms: bool = True,
) -> list[int]:
    """Every cap the pool held after a scrape, over `duration_s` simulated seconds.

    `burst`: mean requests per burst of arrivals (1: Poisson); `histograms`: the engine's
    queue-time and inter-token-latency histograms reach the pool, as vLLM's do."""
    params = dataclasses.replace(
        PRESETS["a100"], max_num_seqs=CAP, kv_tokens=kv_tokens, time_scale=time_scale
    )
    engine = BatchScheduler(params)
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    rng = random.Random(seed)
    output, prompt = (50, 350), 200  # tokens
    at_cap_rps = CAP / (sum(output) / 2 * step_duration_s(params, CAP))
    bursts_per_s = load * at_cap_rps / burst
    arrivals: list[float] = []
    t = 0.0
    while t < duration_s:
        t += rng.expovariate(bursts_per_s)
        # A burst: its requests arrive within a few ms, so some wait for the next step.
        arrivals.extend(t + rng.uniform(0, 0.005) for _ in range(1 + rng.randrange(2 * burst - 1)))
    heapq.heapify(arrivals)
    caps: list[int] = []
    now, next_scrape, seq = 0.0, scrape_s, 0
    arrived: dict[object, float] = {}
    queued: dict[object, float] = {}  # admitted: how long each waited
    wanted: dict[object, int] = {}  # output tokens per request
    queue_sum = queue_count = latency_sum = latency_count = 0.0
    while now < duration_s:
        result = engine.step(now)
        for admitted in result.admitted:
            queued[admitted] = now - arrived.pop(admitted)
        for done, generated in result.emitted:
            if generated >= wanted[done]:  # vLLM observes the queue time as a request finishes
                queue_sum += queued.pop(done)
                queue_count += 1
        latency_sum += result.duration_s * len(result.emitted)
        latency_count += len(result.emitted)
        if result.duration_s > 0:
            end = now + result.duration_s
        else:  # idle until the next arrival (scrapes on the way still read it)
            end = (arrivals[0] if arrivals else duration_s) + 1e-9
        # Arrivals and scrapes during the step, in time order: an arrival waits for the next step.
        while True:
            first_arrival = arrivals[0] if arrivals else float("inf")
            if min(first_arrival, next_scrape) >= end:
                break
            if first_arrival <= next_scrape:
                arrived[seq := seq + 1] = heapq.heappop(arrivals)
                wanted[seq] = rng.randint(*output)
                engine.submit(seq, prompt, wanted[seq])
            else:
                metrics = EngineMetrics(
                    running=engine.num_running, waiting=engine.num_waiting, kv_usage=engine.kv_usage
                )
                if histograms:
                    metrics = metrics._replace(
                        queue_time_sum=queue_sum,
                        queue_time_count=queue_count,
                        token_latency_sum=latency_sum,
                        token_latency_count=latency_count,
                    )
                pool.update_metrics(POD.key, metrics, next_scrape)
                cap = pool.saturation(POD.key)
                if cap is not None:
                    caps.append(cap)
                next_scrape += scrape_s
        now = end
    return caps


# A scrape between two steps of a full engine reads its cap less the requests that finished in
# the step before: the one way a learned cap reads below the real one, by a request or two, until
# a scrape sees the batch full (it then ends at the cap).
AT_CAP_READING = 2


@pytest.mark.parametrize("kv_tokens", [10**9, 60_000], ids=["batch-bound", "kv-bound"])
@pytest.mark.parametrize("load", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_queue_that_lasts_one_step_is_not_taken_for_a_cap(
    load: float, seed: int, kv_tokens: int
) -> None:
    """Below the cap a burst waits one step, a long prompt the step's budget, and with a small
    KV cache (kv-bound: it fills at about 150 running) requests wait for KV: none is a cap."""
    caps = _learned_caps(load, seed, kv_tokens=kv_tokens)
    assert min(caps, default=CAP) >= CAP - AT_CAP_READING, f"learned {min(caps)}, cap {CAP}"
    assert caps[-1:] in ([], [CAP])


def test_an_engine_held_at_its_cap_is_learned_at_its_cap() -> None:
    """Over capacity, the engine runs its cap with a queue scrape after scrape: that is learned,
    and exactly (the cap is what the full-batch rule needs)."""
    caps = _learned_caps(1.3, 3, duration_s=300.0)
    assert caps and caps[-1] == CAP and min(caps) >= CAP - AT_CAP_READING


def _scrapes(pool: PodPool, waits_in_steps: float, scrapes: int = 8) -> int | None:
    """Scrapes of an engine steady at 231 running with 3 waiting, whose requests admitted
    between scrapes (10 a second) waited `waits_in_steps` steps of 0.16 s each on average."""
    step, admitted, tokens = 0.16, 10, 231 / 0.16
    queue = latency = 0.0
    for k in range(1, scrapes + 1):
        queue += admitted * waits_in_steps * step
        latency += tokens * step
        pool.update_metrics(
            POD.key,
            EngineMetrics(
                running=231.0,
                waiting=3.0,
                kv_usage=0.5,
                queue_time_sum=queue,
                queue_time_count=float(admitted * k),
                token_latency_sum=latency,
                token_latency_count=tokens * k,
            ),
            float(k),
        )
    return pool.saturation(POD.key)


@pytest.mark.parametrize(("waits", "learned"), [(0.5, None), (1.5, None), (3.0, 231), (8.0, 231)])
def test_a_queue_counts_only_where_the_engine_says_it_held_requests_for_steps(
    waits: float, learned: int | None
) -> None:
    """With long steps under heavy load nearly every scrape finds a few requests waiting for the
    next step while the running count holds still (the `up` demo learned 231 of 256 that way).
    vLLM's queue-time histogram says how long the admitted requests waited: half a step is the
    next step, several steps a full batch."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    assert _scrapes(pool, waits) == learned
    # without the histograms, the same scrapes are read as a cap (the rule before them)
    blind = PodPool(CapacityEstimator())
    blind.set_pods([POD])
    for k in range(1, 9):
        blind.update_metrics(POD.key, EngineMetrics(231.0, 3.0, 0.5), float(k))
    assert blind.saturation(POD.key) == 231


def test_scrapes_where_no_queue_time_was_counted_fall_back_to_the_queue_itself() -> None:
    """vLLM counts a request's queue time when it finishes: a scrape interval in which nothing
    finished says nothing about the queue, and the queue counts as it did without histograms."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    for k in range(1, 6):
        metrics = EngineMetrics(
            231.0,
            3.0,
            0.5,
            queue_time_sum=5.0,
            queue_time_count=50.0,
            token_latency_sum=10.0 * k,
            token_latency_count=1000.0 * k,
        )
        pool.update_metrics(POD.key, metrics, float(k))
    assert pool.saturation(POD.key) == 231


def test_a_cap_held_at_long_steps_is_still_learned() -> None:
    caps = _learned_caps(1.3, 1, duration_s=300.0, time_scale=4.0, burst=1)
    assert caps and caps[-1] == CAP and min(caps) >= CAP - AT_CAP_READING
