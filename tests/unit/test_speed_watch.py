"""Seeing a replica's speed change in a few scrapes: `SpeedWatch` on per-scrape token counts, the
estimator's rescale, and the pool wiring them for pods fed by their engine's token counter."""

from __future__ import annotations

import random

import pytest

from plugin.core.capacity import (
    SHIFT_RATIO,
    SHIFT_SCRAPES,
    SHIFT_TAU_S,
    CapacityEstimator,
    SpeedWatch,
)
from plugin.core.pool import PodPool
from plugin.core.types import EngineMetrics, Pod

pytestmark = pytest.mark.unit


def _step_ms(batch: float, a: float, b: float) -> float:
    return a + b * batch


def _scrape(batch: float, a: float, b: float, rng: random.Random, noise: float = 0.1) -> float:
    """Tokens one second of a replica gives at `batch` running (step a + b x batch ms), with
    `noise` of jitter (prefill, arrivals)."""
    per_request = 1000.0 / _step_ms(batch, a, b)
    return batch * per_request * rng.uniform(1 - noise, 1 + noise)


def _warm(watch: SpeedWatch, batch: float, a: float, b: float, rng: random.Random) -> None:
    for _ in range(int(3 * SHIFT_TAU_S)):
        assert watch.observe(_scrape(batch, a, b, rng), batch, batch, 1.0) is None


@pytest.mark.parametrize(
    ("before", "after"), [((9.0, 0.12), (22.0, 0.35)), ((22.0, 0.35), (9.0, 0.12))]
)
def test_a_change_of_speed_is_seen_in_a_few_scrapes_and_measured(
    before: tuple[float, float], after: tuple[float, float]
) -> None:
    rng = random.Random(1)
    watch = SpeedWatch()
    _warm(watch, 40.0, *before, rng)
    factors = [watch.observe(_scrape(40.0, *after, rng), 40.0, 40.0, 1.0) for _ in range(6)]
    seen = [i for i, f in enumerate(factors) if f is not None]
    assert seen == [SHIFT_SCRAPES - 1]  # once, as soon as it held
    truth = _step_ms(40.0, *before) / _step_ms(40.0, *after)
    assert factors[seen[0]] == pytest.approx(truth, rel=0.15)


def test_noise_and_a_growing_batch_are_no_change() -> None:
    """Poisson-like jitter of 20%, and the batch drifting up by a quarter (each request slower,
    a bit), never read as a change."""
    rng = random.Random(2)
    watch = SpeedWatch()
    _warm(watch, 40.0, 9.0, 0.12, rng)
    for k in range(600):
        batch = 40.0 + 10.0 * (k % 60) / 60
        assert watch.observe(_scrape(batch, 9.0, 0.12, rng, 0.2), batch, batch, 1.0) is None


def test_what_a_batch_change_explains_is_not_taken_for_a_change() -> None:
    """A batch four times larger slows each request by more than the ratio, and a batch a
    quarter of the usual speeds each up: neither is the replica's own speed. A replica that got
    faster while its batch grew did change."""
    rng = random.Random(3)
    a, b = 2.0, 0.5  # a step cost mostly per sequence: the batch explains nearly all
    for batch in (160.0, 10.0):
        watch = SpeedWatch()
        _warm(watch, 40.0, a, b, rng)
        assert all(
            watch.observe(_scrape(batch, a, b, rng), batch, batch, 1.0) is None for _ in range(10)
        )
    watch = SpeedWatch()
    _warm(watch, 40.0, a, b, rng)
    factors = [watch.observe(_scrape(60.0, a / 4, b / 4, rng), 60.0, 60.0, 1.0) for _ in range(6)]
    assert any(f is not None and f > SHIFT_RATIO for f in factors)


def test_a_stall_of_a_scrape_or_two_is_no_change_and_the_streak_takes_the_median() -> None:
    rng = random.Random(4)
    watch = SpeedWatch()
    _warm(watch, 40.0, 9.0, 0.12, rng)
    usual = _scrape(40.0, 9.0, 0.12, rng, 0.0)
    # stalls behind a long prefill, one or two seconds, with normal seconds between
    for stall in ([0.05], [0.05, 0.3], [0.05], [0.3, 0.05]):
        for share in [*stall, 1.0]:
            assert watch.observe(usual * share, 40.0, 40.0, 1.0) is None
    # a change that holds, with one wild second in it: its median sets the factor
    shares = [0.4, 0.05, 0.4, 0.42]
    factors = [watch.observe(usual * s, 40.0, 40.0, 1.0) for s in shares]
    assert factors[:-1] == [None] * (SHIFT_SCRAPES - 1)
    assert factors[-1] == pytest.approx(0.4, rel=0.1)


def test_nothing_is_read_before_the_usual_speed_is_known_or_with_too_few_running() -> None:
    watch = SpeedWatch()
    assert watch.observe(1000.0, 10.0, 10.0, 1.0) is None  # a first reading
    for _ in range(SHIFT_SCRAPES + 2):  # young: not yet a tau of usual speed behind it
        assert watch.observe(100.0, 10.0, 10.0, 1.0) is None
    idle = SpeedWatch()
    for _ in range(100):
        assert idle.observe(5.0, 1.0, 0.0, 1.0) is None
    assert idle.speed is None
    assert watch.observe(10.0, 10.0, 10.0, 0.0) is None  # no time passed


def test_rescale_scales_the_estimate_and_restarts_its_window() -> None:
    est = CapacityEstimator()
    est.set_fast("a", True)
    for t in range(1, 31):
        est.add_tokens("a", 1000)
        est.refresh(float(t))
    assert est.estimate("a") == pytest.approx(1000.0, rel=0.01)
    est.rescale("a", 0.4)
    assert est.estimate("a") == pytest.approx(400.0, rel=0.01)
    est.add_tokens("a", 400)
    est.refresh(31.0)  # the new window holds only what came after: 400 a second
    assert est.estimate("a") == pytest.approx(400.0, rel=0.01)
    est.rescale("a", float("nan"))
    est.rescale("unknown", 2.0)
    assert est.estimate("a") == pytest.approx(400.0, rel=0.01)


POD = Pod(name="a", namespace="ns", model="m", address="10.0.0.1", port=8000, metrics_port=8000)


def test_the_pool_rescales_a_replica_whose_engine_counter_shows_it_slowed() -> None:
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    total, rng = 0.0, random.Random(5)

    def scrape(t: int, a: float, b: float, kv: float = 0.3, step: bool = True) -> float | None:
        nonlocal total
        total += _scrape(40.0, a, b, rng, 0.05)
        pool.update_metrics(
            POD.key,
            EngineMetrics(40.0, 0.0, kv, generation_tokens=total, generation_tokens_stepwise=step),
            t,
        )
        pool.refresh_capacity(float(t))
        return pool.capacity(POD.key)

    for t in range(60):
        before = scrape(t, 9.0, 0.12)
    assert before is not None
    after = [scrape(t, 22.0, 0.35) for t in range(60, 66)]
    seen = after[SHIFT_SCRAPES - 1]
    assert seen is not None and seen < 0.5 * before
    seen = pool.snapshot(66.0)["pods"][POD.key]  # /debug/pods says so, and which watch
    assert seen["speed_changes"] == 1 and seen["speed_changes_from_chunk_gaps"] == 0
    # A nearly full KV cache preempts: the speed then says nothing, and is not acted on.
    pool2 = PodPool(CapacityEstimator())
    pool2.set_pods([POD])
    total = 0.0
    pool = pool2
    for t in range(60):
        warm = scrape(t, 9.0, 0.12)
    late = [scrape(t, 22.0, 0.35, kv=0.95) for t in range(60, 65)]
    assert warm is not None and late[-1] is not None and late[-1] > 0.6 * warm


def test_a_counter_that_grows_as_requests_finish_is_not_watched() -> None:
    """SGLang's counter: the same slowdown, counted in lumps, leaves the estimate to its window."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    total, rng = 0.0, random.Random(6)
    for t in range(66):
        a, b = (9.0, 0.12) if t < 60 else (22.0, 0.35)
        total += _scrape(40.0, a, b, rng, 0.05)
        metrics = EngineMetrics(40.0, 0.0, 0.3, generation_tokens=total)  # not stepwise
        pool.update_metrics(POD.key, metrics, float(t))
        pool.refresh_capacity(float(t))
        if t == 59:
            before = pool.capacity(POD.key)
    after = pool.capacity(POD.key)
    assert before is not None and after is not None and after > 0.5 * before
    assert pool.snapshot(66.0)["pods"][POD.key]["speed_changes"] == 0


def test_after_a_change_another_needs_a_tau_of_the_new_speed() -> None:
    rng = random.Random(7)
    watch = SpeedWatch()
    _warm(watch, 40.0, 9.0, 0.12, rng)
    fired = [watch.observe(_scrape(40.0, 22.0, 0.35, rng), 40.0, 40.0, 1.0) for _ in range(4)]
    assert fired[-1] is not None
    # straight back: no rescale before the new speed has been followed for a tau (the usual
    # speed follows it back meanwhile, and the estimate's window does the rest)
    back = [watch.observe(_scrape(40.0, 9.0, 0.12, rng), 40.0, 40.0, 1.0) for _ in range(30)]
    assert all(f is None for f in back[: int(SHIFT_TAU_S)])
