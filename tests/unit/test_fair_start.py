"""A replica without a learned capacity starts from its deployment's peers, else from the lowest
learned one (`plugin.core.fair_start`), and the pool scores it so until it has learned."""

from __future__ import annotations

import math

import pytest

from plugin.core.capacity import CapacityEstimator
from plugin.core.fair_start import (
    DEPLOYMENT,
    LOWEST,
    PROFILE,
    SLOW_START_MIN,
    relative_speed,
    slow_start_share,
    starting_capacities,
)
from plugin.core.pool import PodPool
from plugin.core.profile import GpuProfile, ProfileBook, profile_key
from plugin.core.strategies import LoadBalanceSettings, load_balance_scores
from plugin.core.types import Pod
from tests.helpers import make_pod

pytestmark = pytest.mark.unit


def pod(name: str, deployment: str | None, port: int) -> Pod:
    return make_pod(name, deployment=deployment, port=port)


A1, A2, A3 = (pod(f"a100-{i}", "a100", 8000 + i) for i in range(3))
V1, V2 = (pod(f"v100-{i}", "v100", 8100 + i) for i in range(2))
L1 = pod("l20-0", "l20", 8200)
BARE = pod("bare", None, 8300)


def test_a_new_pod_starts_from_its_deployment_s_mean() -> None:
    learned = {A1.key: 1000.0, A2.key: 1400.0, V1.key: 200.0}
    starts = starting_capacities([A1, A2, A3, V1, V2], learned.get)
    assert starts == {A3.key: (1200.0, DEPLOYMENT), V2.key: (200.0, DEPLOYMENT)}


def test_without_learned_peers_a_pod_starts_from_the_lowest_learned() -> None:
    learned = {A1.key: 1000.0, V1.key: 200.0}
    starts = starting_capacities([A1, V1, L1, BARE], learned.get)
    assert starts == {L1.key: (200.0, LOWEST), BARE.key: (200.0, LOWEST)}


@pytest.mark.parametrize("unusable", [0.0, -1.0, math.inf, math.nan])
def test_an_unusable_estimate_is_no_estimate(unusable: float) -> None:
    learned = {A1.key: 1000.0, A2.key: unusable}
    assert starting_capacities([A1, A2], learned.get) == {A2.key: (1000.0, DEPLOYMENT)}


def test_with_nothing_learned_nothing_starts() -> None:
    assert starting_capacities([A1, V1], lambda key: None) == {}


def profile(gpu: str, scale: float, ticks: tuple[int, ...] = (64, 1024)) -> GpuProfile:
    """A profile whose rates are `scale` times a reference grid's (one cell never sustained)."""
    base = ((20.0, 8.0), (6.0, 0.0))
    tputs = tuple(tuple(scale * v for v in row) for row in base)
    return GpuProfile(gpu, 1.0, (32, 256), ticks, tputs, 0.0)


def test_relative_speed_is_the_ratio_of_the_profiles_rates() -> None:
    assert relative_speed(profile("v100", 0.25), profile("a100", 1.0)) == pytest.approx(0.25)
    assert relative_speed(profile("a100", 1.0), profile("v100", 0.25)) == pytest.approx(4.0)
    # Another grid: each cell is looked up by its token sizes.
    other = profile("l20", 0.5, ticks=(100, 2000))
    assert relative_speed(other, profile("a100", 1.0)) == pytest.approx(0.5)
    assert relative_speed(profile("x", 0.0), profile("a100", 1.0)) is None  # never sustained


def test_the_first_of_its_type_starts_from_the_profiles_ratio() -> None:
    """No V100 has learned yet: the A100s' capacity scaled by the profiles (a V100 a quarter of
    an A100), not the lowest learned (an A100's); without a profile of its own, the lowest."""
    profiles = {"a100": profile("a100", 1.0), "v100": profile("v100", 0.25)}
    learned = {A1.key: 1000.0, A2.key: 1400.0}

    def profile_of(p: Pod) -> GpuProfile | None:
        return None if p.deployment is None else profiles.get(p.deployment)

    starts = starting_capacities([A1, A2, V1, L1], learned.get, profile_of)
    assert starts[V1.key][1] == PROFILE
    assert starts[V1.key][0] == pytest.approx(0.25 * 1200.0)
    assert starts[L1.key] == (1000.0, LOWEST)
    assert starting_capacities([A1, A2, V1], learned.get)[V1.key] == (1000.0, LOWEST)


def test_the_pool_scales_a_newcomer_by_the_profiles_it_routes_with() -> None:
    estimator = CapacityEstimator()
    pool = PodPool(estimator, 3.0, slow_start_s=0.0)
    book = ProfileBook()
    book.replace(
        {
            profile_key("m", "a100"): profile("a100", 1.0),
            profile_key("m", "v100"): profile("v100", 0.25),
        }
    )
    pool.use_profiles(book)
    pool.set_pods([A1, A2])
    learn(pool, [(A1, 1000), (A2, 1000)])
    a100 = estimator.estimate(A1.key)
    assert a100 is not None
    pool.set_pods([A1, A2, V1])
    capacity = {c.pod.name: c.capacity for c in pool.candidates("m", 10.0)}["v100-0"]
    assert capacity == pytest.approx(0.25 * a100)
    start = pool.snapshot(10.0)["pods"][V1.key]["capacity_start"]
    assert start["from"] == PROFILE


def learn(pool: PodPool, tokens: list[tuple[Pod, int]]) -> None:
    pool.refresh_capacity(0.0)
    for p, n in tokens:
        pool.acquire(p).release(n, 200, 1.0)
    for t in (2.0, 5.0, 10.0):
        pool.refresh_capacity(t)


def test_a_new_v100_among_a100s_is_scored_as_a_v100_until_it_learns() -> None:
    """The mean of the model's estimates would score the new V100 at about an A100's capacity
    (three A100s, one V100): it would take an A100's share of the load."""
    estimator = CapacityEstimator()
    pool = PodPool(estimator, 3.0, slow_start_s=0.0)  # the start itself (the ramp: below)
    pool.set_pods([A1, A2, V1])
    learn(pool, [(A1, 1000), (A2, 1000), (V1, 200)])
    a100, v100 = estimator.estimate(A1.key), estimator.estimate(V1.key)
    assert a100 is not None and v100 is not None and a100 > 4 * v100
    pool.set_pods([A1, A2, V1, V2, L1])
    capacities = {c.pod.name: c.capacity for c in pool.candidates("m", 10.0)}
    assert capacities == {
        "a100-0": a100,
        "a100-1": a100,
        "v100-0": v100,
        "v100-1": v100,
        "l20-0": v100,
    }
    pods = pool.snapshot(10.0)["pods"]
    assert pods[V2.key]["capacity_tokens_per_s"] is None
    assert pods[V2.key]["capacity_start"] == {
        "tokens_per_s": round(v100, 3),
        "from": DEPLOYMENT,
        "slow_start_share": 1.0,
    }
    assert pods[L1.key]["capacity_start"]["from"] == LOWEST
    assert pods[A1.key]["capacity_start"] is None
    # One request each: the new V100 scores as the V100 it is, not as the fleet's mean.
    candidates = pool.candidates("m", 10.0)
    for c in candidates:
        c.running = 1
    scores = dict(
        zip(
            [c.pod.name for c in candidates],
            load_balance_scores(candidates, LoadBalanceSettings()),
            strict=True,
        )
    )
    assert scores["v100-1"] == pytest.approx(scores["v100-0"])
    assert scores["v100-1"] > 4 * scores["a100-0"]
    # Once it has learned its own, that counts.
    pool.refresh_capacity(11.0)  # its first window begins
    pool.acquire(V2).release(400, 200, 11.5)
    for t in (12.0, 15.0, 20.0):
        pool.refresh_capacity(t)
    mine = estimator.estimate(V2.key)
    assert mine is not None
    assert {c.pod.name: c.capacity for c in pool.candidates("m", 20.0)}["v100-1"] == mine
    assert pool.snapshot(20.0)["pods"][V2.key]["capacity_start"] is None


def test_the_slow_start_share_grows_linearly_from_its_least() -> None:
    assert slow_start_share(0.0, 60.0) == SLOW_START_MIN
    assert slow_start_share(0.5, 60.0) == SLOW_START_MIN  # 0.5 / 60 is below it
    assert slow_start_share(30.0, 60.0) == pytest.approx(0.5)
    assert slow_start_share(45.0, 60.0, 0.1) == pytest.approx(0.75)
    assert slow_start_share(60.0, 60.0) == 1.0
    assert slow_start_share(600.0, 60.0) == 1.0
    assert slow_start_share(0.0, 0.0) == 1.0  # no window: no ramp


def test_a_start_is_ramped_in_from_when_the_pod_turns_ready() -> None:
    """A new V100 beside a learned one is scored at a small share of its peer's capacity when
    it turns ready, more each tick, all of it after the window; not-ready time does not count,
    and its own estimate replaces the ramped start outright."""
    estimator = CapacityEstimator()
    pool = PodPool(estimator, 3.0, slow_start_s=60.0, slow_start_min=0.05)
    pool.set_pods([A1, V1])
    learn(pool, [(A1, 1000), (V1, 200)])

    def scored(now: float) -> float | None:
        return {c.pod.name: c.capacity for c in pool.candidates("m", now)}["v100-1"]

    def peer() -> float:  # its peer's estimate, as the last tick left it
        v100 = estimator.estimate(V1.key)
        assert v100 is not None
        return v100

    waiting = make_pod("v100-1", deployment="v100", port=8101, ready=False)
    pool.set_pods([A1, V1, waiting])
    for t in (20.0, 50.0, 80.0):  # listed, not ready: its age does not run
        pool.refresh_capacity(t)
    pool.set_pods([A1, V1, V2])  # ready now: its age counts from the last tick, 80
    assert scored(80.5) == pytest.approx(0.05 * peer())
    pool.refresh_capacity(81.0)
    assert scored(81.0) == pytest.approx(0.05 * peer())  # 1 / 60 is below the least share
    pool.refresh_capacity(110.0)
    assert scored(110.0) == pytest.approx(0.5 * peer())
    start = pool.snapshot(110.0)["pods"][V2.key]["capacity_start"]
    assert start["from"] == DEPLOYMENT and start["slow_start_share"] == pytest.approx(0.5)
    pool.refresh_capacity(141.0)
    assert scored(141.0) == pytest.approx(peer())
    # Its own estimate counts as soon as it has one, above or below the ramp.
    pool.acquire(V2).release(50, 200, 141.5)
    pool.refresh_capacity(142.0)
    mine = estimator.estimate(V2.key)
    assert mine is not None and mine != pytest.approx(peer())
    assert scored(142.0) == mine
    assert pool.snapshot(142.0)["pods"][V2.key]["capacity_start"] is None


def test_a_pod_that_leaves_and_comes_back_ramps_in_again() -> None:
    estimator = CapacityEstimator()
    pool = PodPool(estimator, 3.0, slow_start_s=10.0, slow_start_min=0.1)
    pool.set_pods([A1])
    learn(pool, [(A1, 1000)])

    def share(now: float) -> float:  # the newcomer's capacity over its peer's estimate
        a100 = estimator.estimate(A1.key)
        newcomer = {c.pod.name: c.capacity for c in pool.candidates("m", now)}["a100-1"]
        assert a100 is not None and newcomer is not None
        return newcomer / a100

    pool.set_pods([A1, A2])
    pool.refresh_capacity(15.0)
    assert share(15.0) == pytest.approx(0.5)
    pool.refresh_capacity(30.0)
    assert share(30.0) == pytest.approx(1.0)
    pool.set_pods([A1])
    pool.refresh_capacity(31.0)
    pool.set_pods([A1, A2])
    pool.refresh_capacity(32.0)
    assert share(32.0) == pytest.approx(0.1)
