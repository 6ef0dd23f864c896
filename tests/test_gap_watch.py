"""Seeing a replica's speed change within a fraction of a second: `GapWatch` on the gaps between
response chunks, the pool wiring it (prefills kept out, routing told at once, the scrape watch
told too) and the adapter that times a response's events."""

from __future__ import annotations

import random

import pytest

from plugin.adapters.extproc import ChunkGaps, ResponseTokens
from plugin.core.capacity import (
    GAP_ROUNDS,
    GAP_SPAN_S,
    GAP_SPEEDUP_RATIO,
    SHIFT_TAU_S,
    CapacityEstimator,
    GapWatch,
    SpeedWatch,
)
from plugin.core.pool import PodPool
from plugin.core.types import EngineMetrics, Pod

pytestmark = pytest.mark.unit

POD = Pod(name="a", namespace="ns", model="m", address="10.0.0.1", port=8000, metrics_port=8000)


def _steps(
    watch: GapWatch,
    seconds: float,
    gap: float,
    batch: int,
    rng: random.Random,
    noise: float = 0.1,
    prefill_every: int = 0,
) -> list[float]:
    """`seconds` of engine steps of about `gap` s at `batch` streams, each step one call with
    the whole batch (as the simulator feeds it); every `prefill_every`-th step a prefill
    stalls it 4x and is flagged. The factors the watch returned."""
    fired, elapsed, k = [], 0.0, 0
    while elapsed < seconds:
        k += 1
        prefill = prefill_every > 0 and k % prefill_every == 0
        step = gap * rng.uniform(1 - noise, 1 + noise) * (4.0 if prefill else 1.0)
        elapsed += step
        factor = watch.add(step, batch, batch, prefill)
        if factor is not None:
            fired.append(factor)
    return fired


def test_a_slowdown_is_seen_within_a_fraction_of_a_second_and_measured() -> None:
    rng = random.Random(1)
    watch = GapWatch()
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, rng) == []
    fired, elapsed, k = None, 0.0, 0
    while fired is None:
        k += 1
        step = 0.09 * rng.uniform(0.9, 1.1)
        elapsed += step
        fired = watch.add(step, 40, 40)
    assert k == GAP_ROUNDS and elapsed >= GAP_SPAN_S and elapsed < 1.0
    assert fired == pytest.approx(1 / 3, rel=0.1)
    assert _steps(watch, 5.0, 0.09, 40, rng) == []  # the new speed is the usual one now


def test_jitter_prefills_and_a_batch_that_explains_it_are_no_change() -> None:
    """Steps jittering by 30%, prefills stalling every fifth step (flagged), a growing batch
    whose steps are slower: none is the replica's own speed."""
    rng = random.Random(2)
    watch = GapWatch()
    assert _steps(watch, 60.0, 0.03, 40, rng, noise=0.3, prefill_every=5) == []
    assert _steps(watch, 10.0, 0.06, 60, rng) == []  # half again the batch, each step 2x
    # A burst of long prefills stalling more steps in a row than a change needs: flagged, it is
    # left out; the same steps unflagged would be read as a slowdown.
    flagged, unflagged = GapWatch(), GapWatch()
    for watch in (flagged, unflagged):
        assert _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, random.Random(5)) == []
    burst = [0.12] * (2 * GAP_ROUNDS)
    assert [f for f in (flagged.add(g, 40, 40, True) for g in burst) if f] == []
    assert flagged.gap == pytest.approx(0.03, rel=0.1)
    assert [f for f in (unflagged.add(g, 40, 40) for g in burst) if f]


def test_a_speedup_needs_the_larger_ratio_and_a_round_is_about_a_step() -> None:
    rng = random.Random(3)
    watch = GapWatch()
    _steps(watch, 3 * SHIFT_TAU_S, 0.06, 20, rng)
    assert _steps(watch, 5.0, 0.06 / (0.9 * GAP_SPEEDUP_RATIO), 20, rng, noise=0.0) == []
    watch = GapWatch()
    _steps(watch, 3 * SHIFT_TAU_S, 0.06, 20, rng)
    assert _steps(watch, 5.0, 0.02, 20, rng, noise=0.0) == [pytest.approx(3.0, rel=0.05)]
    # One gap per stream, as the plugin sees them: a round closes after a batch's worth.
    per_stream = GapWatch()
    assert [per_stream.add(0.05, 1, 4) for _ in range(3)] == [None] * 3
    assert per_stream.gap is None  # three of four streams: the round is still open
    assert per_stream.add(0.05, 1, 4) is None and per_stream.gap == pytest.approx(0.05)


def test_rebase_takes_another_watchs_change_as_the_usual() -> None:
    rng = random.Random(4)
    watch = GapWatch()
    _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, rng)
    watch.rebase(1 / 3)  # the scrape watch saw it three times slower
    assert watch.gap == pytest.approx(0.09, rel=0.05)
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.09, 40, rng) == []
    speed = SpeedWatch()
    for _ in range(30):
        speed.observe(1000.0, 40.0, 40.0, 1.0)
    speed.rebase(0.5)
    assert speed.speed == pytest.approx(12.5) and speed.seen_s == 0.0


def _pool_with_streams(n: int) -> PodPool:
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    for _ in range(n):
        pool.acquire(POD)
    return pool


def test_the_pool_rescales_at_once_and_keeps_prefills_and_the_scrape_watch_out() -> None:
    pool = _pool_with_streams(20)
    est = pool._capacity  # the estimate the candidates carry
    est.set_fast(POD.key, True)
    for t in range(1, 11):
        est.add_tokens(POD.key, 2000)
        est.refresh(float(t))
    pool.refresh_capacity(10.0)
    before = pool.candidates("m", 10.0)[0].capacity
    assert before is not None
    # No stream has its first chunk yet: every gap may hold a prefill, none is read.
    for _ in range(2000):
        pool.observe_chunk_gap(POD.key, 0.1)
    assert pool._gaps[POD.key].gap is None  # no round was read
    for _ in range(20):
        pool.stream_started(POD.key)
    for _ in range(int(3 * SHIFT_TAU_S / 0.03) * 20):
        pool.observe_chunk_gap(POD.key, 0.03)
    for _ in range(GAP_ROUNDS * 20):
        pool.observe_chunk_gap(POD.key, 0.09)
    after = pool.candidates("m", 10.0)[0].capacity  # no scrape tick in between
    assert after == pytest.approx(before / 3, rel=0.05)
    assert pool.snapshot(10.0)["pods"][POD.key]["speed_changes"] == 1
    pool.stream_ended(POD.key)
    assert pool._streaming[POD.key] == 19


def test_a_change_the_gaps_saw_is_not_acted_on_again_by_the_scrape_watch() -> None:
    pool = _pool_with_streams(40)
    for _ in range(40):
        pool.stream_started(POD.key)
    total = 0.0

    def scrape(t: int, per_request: float) -> None:
        nonlocal total
        total += 40 * per_request
        metrics = EngineMetrics(
            40.0, 0.0, 0.3, generation_tokens=total, generation_tokens_stepwise=True
        )
        pool.update_metrics(POD.key, metrics, float(t))
        pool.refresh_capacity(float(t))

    for t in range(40):
        scrape(t, 30.0)
        for _ in range(int(1 / 0.033) * 40):
            pool.observe_chunk_gap(POD.key, 0.033)
    for _ in range(GAP_ROUNDS * 40):
        pool.observe_chunk_gap(POD.key, 0.1)
    assert pool.snapshot(40.0)["pods"][POD.key]["speed_changes"] == 1
    for t in range(40, 50):
        scrape(t, 10.0)
    assert pool.snapshot(50.0)["pods"][POD.key]["speed_changes"] == 1


def test_a_response_times_its_events_for_its_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool_with_streams(1)
    now = [100.0]
    tokens = ResponseTokens()
    tokens.status = 200
    tokens.gaps = ChunkGaps(pool, POD.key, lambda: now[0])
    seen: list[float] = []
    monkeypatch.setattr(
        PodPool, "observe_chunk_gap", lambda self, key, gap, count=1: seen.append(gap)
    )
    event = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    tokens.feed(b": keep-alive\n\n", False)  # no event: nothing timed, not started
    assert POD.key not in pool._streaming
    tokens.feed(event, False)
    assert pool._streaming[POD.key] == 1  # the first event: its prefill is over
    now[0] += 0.05
    tokens.feed(event, False)
    now[0] += 0.2
    tokens.feed(event * 4, False)  # four events in one chunk: four steps
    assert seen == [pytest.approx(0.05), pytest.approx(0.05)]
    tokens.feed(b"data: [DONE]\n\n", True)
    tokens.close_gaps()
    tokens.close_gaps()  # once
    assert POD.key not in pool._streaming


def test_streams_that_outlive_a_pods_absence_still_end() -> None:
    """The pod leaves discovery and comes back while two streams run: new streams start before
    the old ones end, and the count of started streams still matches what is in flight."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    old = [pool.acquire(POD) for _ in range(2)]
    for _ in old:
        pool.stream_started(POD.key)
    pool.set_pods([])
    pool.set_pods([POD])
    new = [pool.acquire(POD) for _ in range(3)]
    for _ in new:
        pool.stream_started(POD.key)
    for lease in old:
        pool.stream_ended(POD.key)
        lease.release(10, 200, 1.0)
    assert pool._streaming[POD.key] == pool.inflight(POD.key) == 3
