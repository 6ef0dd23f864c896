"""GPU profiles against served traffic (`plugin.core.drift`): the prediction at the pod's load,
each cell's drift ratio, its warning (once, re-armed), the requests that count, and what
/metrics and /debug/pods show of it. A hand-driven clock, no sockets."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from plugin.adapters.http import debug_pods, profile_families
from plugin.core.capacity import CapacityEstimator
from plugin.core.drift import (
    DRIFT_MIN_REQUESTS,
    DRIFT_REQUESTS,
    BeyondGrid,
    ProfileDrift,
    cell_label,
)
from plugin.core.pool import PodPool
from plugin.core.profile import GpuProfile, ProfileBook, ProfiledRoute, parse_profile, profile_key
from plugin.core.router import Decision, Router
from plugin.core.strategies import SloSettings, build_strategies
from plugin.core.types import Pod, RequestInfo

pytestmark = pytest.mark.unit

MODEL = "m"
DEPLOYMENT = "a100"


def profile(idle: float | None = 0.5, created: float = 0.0) -> GpuProfile:
    """Outputs 4 and 64, input 128: E2E 1 s loaded (and `idle` s idle) in the small cell, 8 s
    in the large one; 10 req/s, so a request takes 0.1 of a pod; E2E SLO 20 s."""
    return GpuProfile(
        DEPLOYMENT,
        1.0,
        (4, 64),
        (128,),
        ((10.0,), (1.0,)),
        created,
        ((1.0,), (8.0,)),
        slos={"e2e": 20.0},
        e2e_idle=None if idle is None else ((idle,), (0.0,)),  # 0: not measured
    )


def route(p: GpuProfile, load: float, cell: tuple[int, int] = (0, 0)) -> ProfiledRoute:
    return ProfiledRoute(p, cell, 4, load, p.e2e_at(cell, load))


def feed(drift: ProfileDrift, r: ProfiledRoute, ratio: float, n: int) -> list[str]:
    """`n` served requests that each took `ratio` x their prediction; the warnings returned."""
    assert r.e2e_s is not None
    seen = [drift.observe(MODEL, DEPLOYMENT, r, r.e2e_s * ratio) for _ in range(n)]
    return [w for w in seen if w is not None]


@pytest.mark.parametrize(
    ("idle", "load", "expected"),
    [
        (0.5, 0.0, 0.5),
        (0.5, 0.5, 0.75),
        (0.5, 1.0, 1.0),
        (0.5, 3.0, 1.0),  # an idle pod takes a request worth more than itself: still loaded
        (0.5, -1.0, 0.5),
        (None, 0.0, 1.0),  # AIBrix's profiles: the loaded E2E at any load
        (None, 0.9, 1.0),
    ],
    ids=["idle", "half", "full", "over-full", "negative", "no-idle-low", "no-idle-high"],
)
def test_the_prediction_is_interpolated_at_the_pod_s_load(
    idle: float | None, load: float, expected: float
) -> None:
    assert profile(idle).e2e_at((0, 0), load) == pytest.approx(expected)


def test_a_cell_without_an_idle_or_loaded_e2e() -> None:
    p = profile()
    assert p.idle_e2e((1, 0)) is None and p.e2e_at((1, 0), 0.0) == 8.0  # idle 0: not measured
    assert dataclasses.replace(p, e2e=None).e2e_at((0, 0), 0.5) is None


def test_e2e_idle_round_trips_after_aibrix_s_keys() -> None:
    p = profile()
    doc = p.to_json()
    assert list(doc) == ["gpu", "cost", "tputs", "indexes", "created", "e2e", "slos", "e2e_idle"]
    assert parse_profile(doc) == p
    assert "e2e_idle" not in profile(None).to_json()
    assert parse_profile(profile(None).to_json()).e2e_idle is None


def test_the_ratio_is_of_means_plain_then_exponentially_weighted() -> None:
    drift = ProfileDrift()
    r = route(profile(), 0.0)  # predicted 0.5 s
    for actual in (0.5, 1.5):
        drift.observe(MODEL, DEPLOYMENT, r, actual)
    (cell,) = drift.cells.values()
    assert cell.requests == 2 and cell.ratio == pytest.approx(2.0)  # (0.5 + 1.5) / 2 / 0.5
    drift = ProfileDrift()
    for _ in range(DRIFT_REQUESTS):
        drift.observe(MODEL, DEPLOYMENT, r, 0.5)
    drift.observe(MODEL, DEPLOYMENT, r, 0.5 + DRIFT_REQUESTS * 0.5)  # weighs 1/50 from now on
    (cell,) = drift.cells.values()
    assert cell.ratio == pytest.approx(2.0)


def test_the_warning_waits_for_the_minimum_fires_once_and_re_arms() -> None:
    drift = ProfileDrift()
    r = route(profile(), 0.0)
    assert feed(drift, r, 3.0, DRIFT_MIN_REQUESTS - 1) == []  # too few to judge
    (warning,) = feed(drift, r, 3.0, 1)
    assert f"{MODEL} on deployment {DEPLOYMENT} is off at 4 output x 128 input tokens" in warning
    assert "took 3x the E2E it predicts" in warning
    assert feed(drift, r, 3.0, 100) == []  # once, however long it stays off
    (cell,) = drift.cells.values()
    assert cell.off
    assert feed(drift, r, 1.0, 200) == [] and not cell.off  # back within range: re-armed
    (again,) = feed(drift, r, 0.2, 200)  # off the other way: faster than predicted
    assert "took 0.4" in again and cell.off  # just crossed below 0.5


def test_without_an_idle_e2e_only_requests_at_half_load_or_more_count() -> None:
    """An AIBrix profile's E2E is a loaded replica's: a lightly loaded one is faster, and must
    not be called off for it."""
    drift = ProfileDrift()
    aibrix = profile(idle=None)
    assert feed(drift, route(aibrix, 0.3), 0.1, 100) == [] and drift.cells == {}
    assert len(feed(drift, route(aibrix, 0.5), 0.1, DRIFT_MIN_REQUESTS)) == 1
    # With an idle E2E every load counts, against the prediction at that load.
    drift = ProfileDrift()
    assert len(feed(drift, route(profile(), 0.1), 0.1, DRIFT_MIN_REQUESTS)) == 1


def test_a_replaced_profile_starts_its_cells_over() -> None:
    drift = ProfileDrift()
    feed(drift, route(profile(created=1.0), 0.0), 3.0, DRIFT_MIN_REQUESTS)
    feed(drift, route(profile(created=2.0), 0.0), 1.0, 1)
    (cell,) = drift.cells.values()
    assert cell.requests == 1 and cell.ratio == pytest.approx(1.0) and not cell.off


def test_a_failed_or_unpredicted_request_is_not_counted() -> None:
    drift = ProfileDrift()
    p = profile()
    assert drift.observe(MODEL, DEPLOYMENT, ProfiledRoute(p, (0, 0), 4, 1.0, None), 1.0) is None
    assert drift.observe(MODEL, DEPLOYMENT, route(p, 1.0), -1.0) is None
    assert drift.cells == {}


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _router(p: GpuProfile) -> tuple[Router, _Clock]:
    clock = _Clock()
    pool = PodPool(CapacityEstimator())
    book = ProfileBook()
    book.replace({profile_key(MODEL, DEPLOYMENT): p})
    pool.use_profiles(book)
    pool.set_pods([Pod("p", "ns", MODEL, "10.0.0.1", 8000, 8000, deployment=DEPLOYMENT)])
    router = Router(pool, build_strategies(SloSettings()), "least-request", random.Random(0), clock)
    return router, clock


def test_the_router_predicts_at_the_load_with_the_request_and_checks_served_ones() -> None:
    router, clock = _router(profile())
    slo = router.strategy_for("slo")
    first, second = (
        router.admit(RequestInfo(MODEL, prompt_tokens=128, max_tokens=4, arrived_at=clock.t), slo)
        for _ in range(2)
    )
    assert isinstance(first, Decision) and isinstance(second, Decision)
    assert first.profiled is not None and second.profiled is not None
    assert first.profiled.load == pytest.approx(0.1)  # the pod's load with the request
    assert second.profiled.load == pytest.approx(0.2)
    assert first.expected_e2e_s == pytest.approx(0.5 + 0.5 * 0.1)  # idle + (e2e - idle) x load
    assert second.expected_e2e_s == pytest.approx(0.5 + 0.5 * 0.2)
    warnings: list[str] = []
    router.on_warning = warnings.append
    clock.t += 3.0
    router.finished(first, 200)
    router.finished(second, 503)  # failed: not a measure of the profile
    (cell,) = router.drift.cells.values()
    assert cell.requests == 1 and cell.ratio == pytest.approx(3.0 / 0.55)
    for _ in range(DRIFT_MIN_REQUESTS):
        d = router.admit(
            RequestInfo(MODEL, prompt_tokens=128, max_tokens=4, arrived_at=clock.t), slo
        )
        assert isinstance(d, Decision)
        clock.t += 3.0
        router.finished(d, 200)
        d.lease.release()
    assert len(warnings) == 1 and "is off at 4 output x 128 input tokens" in warnings[0]


def _render(collector_families: Iterator[Metric]) -> dict[str, Metric]:
    families = list(collector_families)

    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            return iter(families)

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_and_debug_pods_show_the_drift_and_the_requests_beyond_the_grid() -> None:
    drift, beyond = ProfileDrift(), BeyondGrid()
    p = profile()
    feed(drift, route(p, 0.0), 3.0, DRIFT_MIN_REQUESTS)
    feed(drift, route(p, 1.0, cell=(1, 0)), 1.0, 2)
    above = dataclasses.replace(route(p, 0.0), above=("output", "input"))
    for _ in range(2):
        beyond.observe(MODEL, DEPLOYMENT, above, 1000)
    families = _render(profile_families(beyond, drift))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for name in (
            "hetero_gateway_slo_beyond_profile_requests",
            "hetero_gateway_profile_drift_ratio",
            "hetero_gateway_profile_drift_requests",
        )
        for s in families[name].samples
    }
    small = (("cell", "out=4,in=128"), ("deployment", DEPLOYMENT), ("model", MODEL))
    large = (("cell", "out=64,in=128"), ("deployment", DEPLOYMENT), ("model", MODEL))
    assert samples == {
        (
            "hetero_gateway_slo_beyond_profile_requests_total",
            (("axis", "input"), ("model", MODEL)),
        ): 2,
        (
            "hetero_gateway_slo_beyond_profile_requests_total",
            (("axis", "output"), ("model", MODEL)),
        ): 2,
        ("hetero_gateway_profile_drift_ratio", small): pytest.approx(3.0),
        ("hetero_gateway_profile_drift_ratio", large): pytest.approx(1.0),
        ("hetero_gateway_profile_drift_requests", small): DRIFT_MIN_REQUESTS,
        ("hetero_gateway_profile_drift_requests", large): 2,
    }
    pool = PodPool(CapacityEstimator())
    doc = debug_pods(pool, 0.0, drift=drift)
    assert doc["profile_drift"] == {
        MODEL: {
            DEPLOYMENT: {
                cell_label(4, 128): {"ratio": 3.0, "requests": DRIFT_MIN_REQUESTS, "off": True},
                cell_label(64, 128): {"ratio": 1.0, "requests": 2, "off": False},
            }
        }
    }
    assert debug_pods(pool, 0.0)["profile_drift"] == {}
    assert not math.isnan(doc["profile_drift"][MODEL][DEPLOYMENT]["out=4,in=128"]["ratio"])
