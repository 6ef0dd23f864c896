"""The capacity estimator: step response, idle hold, windowing, first estimate."""

from __future__ import annotations

import itertools
import math

import pytest

from plugin.core.capacity import CapacityEstimator

pytestmark = pytest.mark.unit


def drive(est: CapacityEstimator, key: str, rate: float, start: float, end: float) -> float:
    """Complete `rate` tokens/s from start to end with 1 s refreshes; return the end time."""
    t = start
    while t < end - 1e-9:
        t += 1.0
        est.add_tokens(key, int(rate))
        est.refresh(t)
    return t


def test_first_estimate_is_the_measured_rate() -> None:
    est = CapacityEstimator(window_s=60, tau_s=10)
    est.ensure("ns/a")
    est.refresh(0.0)
    est.add_tokens("ns/a", 500)
    est.refresh(1.0)
    assert est.estimate("ns/a") == pytest.approx(500.0)


def test_constant_rate_converges_to_it() -> None:
    est = CapacityEstimator(window_s=60, tau_s=10)
    est.ensure("ns/a")
    est.refresh(0.0)
    drive(est, "ns/a", 300, 0.0, 120.0)
    assert est.estimate("ns/a") == pytest.approx(300.0, rel=1e-6)


def test_step_response_follows_window_and_ewma() -> None:
    """After a step 100 -> 400 tok/s the estimate rises monotonically, below the new rate."""
    est = CapacityEstimator(window_s=60, tau_s=10)
    est.ensure("ns/a")
    est.refresh(0.0)
    t = drive(est, "ns/a", 100, 0.0, 120.0)
    before = est.estimate("ns/a")
    assert before == pytest.approx(100.0)
    seen: list[float] = []
    for _ in range(10):
        t = drive(est, "ns/a", 400, t, t + 1)
        estimate = est.estimate("ns/a")
        assert estimate is not None
        seen.append(estimate)
    assert all(b > a for a, b in itertools.pairwise(seen))
    assert all(100 < v < 400 for v in seen)
    # 10 s after the step the window rate is 100 + 300 * 10/60 = 150: estimate is below that.
    assert seen[-1] < 150
    t = drive(est, "ns/a", 400, t, t + 200)
    assert est.estimate("ns/a") == pytest.approx(400.0, rel=1e-3)


def test_ewma_alpha_uses_the_time_constant() -> None:
    est = CapacityEstimator(window_s=1, tau_s=10)  # window of one tick: rate = last second
    est.ensure("k")
    est.refresh(0.0)
    est.add_tokens("k", 100)
    est.refresh(1.0)
    est.add_tokens("k", 200)
    est.refresh(2.0)
    alpha = 1 - math.exp(-1 / 10)
    assert est.estimate("k") == pytest.approx(100 + alpha * (200 - 100))


def test_idle_window_keeps_the_estimate() -> None:
    est = CapacityEstimator(window_s=60, tau_s=10)
    est.ensure("ns/a")
    est.refresh(0.0)
    t = drive(est, "ns/a", 250, 0.0, 100.0)
    held = est.estimate("ns/a")
    # Idle for five minutes: during the first minute the window still holds tokens and the rate
    # falls; once the window is empty the estimate stays where it was, it does not decay to 0.
    for _ in range(60):
        t += 1
        est.refresh(t)
    after_first_minute = est.estimate("ns/a")
    for _ in range(240):
        t += 1
        est.refresh(t)
    assert held is not None and after_first_minute is not None
    assert est.estimate("ns/a") == after_first_minute
    assert after_first_minute > 0


def test_no_estimate_before_tokens_and_keys_are_separate() -> None:
    est = CapacityEstimator()
    est.ensure("a/x")
    est.ensure("b/x")
    est.refresh(0.0)
    est.add_tokens("a/x", 10)
    est.refresh(1.0)
    assert est.estimate("b/x") is None
    assert est.estimates() == {"a/x": pytest.approx(10.0)}
    assert est.total("a/x") == 10


def test_forget_drops_state() -> None:
    est = CapacityEstimator()
    est.add_tokens("a/x", 10)
    est.forget("a/x")
    assert est.total("a/x") == 0


def _crossing(fast: bool) -> float:
    """Two replicas at 600 and 400 tok/s exchange rates at t = 120: seconds until the estimates
    rank them the other way."""
    est = CapacityEstimator()
    for key in ("a", "b"):
        est.set_fast(key, fast)
    est.refresh(0.0)
    t = 0.0
    while t < 120.0:
        t += 1.0
        est.add_tokens("a", 600)
        est.add_tokens("b", 400)
        est.refresh(t)
    while True:
        t += 1.0
        est.add_tokens("a", 400)
        est.add_tokens("b", 600)
        est.refresh(t)
        a, b = est.estimate("a"), est.estimate("b")
        assert a is not None and b is not None
        if b > a:
            return t - 120.0


def test_a_replica_fed_by_its_engines_counter_re_ranks_within_seconds() -> None:
    """The engine's counter credits tokens as they are generated, so the short window can be
    used: the estimates cross 12 s after the change, against 40 s with the minute-long window."""
    assert _crossing(fast=True) <= 15.0
    assert _crossing(fast=False) >= 30.0


def test_switching_windows_keeps_the_estimate_and_reports_the_track() -> None:
    est = CapacityEstimator()
    est.refresh(0.0)
    drive(est, "a", 300, 0.0, 60.0)
    before = est.estimate("a")
    est.set_fast("a", True)
    assert est.is_fast("a") and not est.is_fast("b")
    drive(est, "a", 300, 60.0, 61.0)
    assert est.estimate("a") == pytest.approx(before)
