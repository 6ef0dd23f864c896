"""Table-driven tests of the strategies, the load-balance score's every edge case included."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugin.core.strategies import (
    LoadBalanceSettings,
    Picker,
    build_strategies,
    load_balance_scores,
    strategy_names,
)
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import RoutingFailed

pytestmark = pytest.mark.unit

REQ = RequestInfo(model="m")


def cand(
    name: str,
    running: int = 0,
    capacity: float | None = None,
    kv_usage: float | None = None,
    waiting: float | None = None,
    saturation: int | None = None,
) -> Candidate:
    pod = Pod(
        name=name, namespace="ns", model="m", address="10.0.0.1", port=8000, metrics_port=8000
    )
    return Candidate(pod, running, waiting, kv_usage, capacity, saturation)


def pickers(*settings: object) -> dict[str, Picker]:
    """The strategies that route at once (all but the SLO family, tested in test_slo.py):
    their `pick` is what is tested here."""
    built = build_strategies(*settings)
    assert {n for n, s in built.items() if not isinstance(s, Picker)} == SLO_FAMILY
    return {name: s for name, s in built.items() if isinstance(s, Picker)}


SLO_FAMILY = {"slo", "slo-least-load", "slo-least-load-pulling", "slo-pack-load"}


def lb(**kw: Any) -> Picker:
    return pickers(LoadBalanceSettings(**kw))["load-balance"]


def test_registry_has_the_strategies() -> None:
    assert {
        "random",
        "least-request",
        "load-balance",
        "round-robin",
        "power-of-two",
    } <= strategy_names()


def test_worked_example() -> None:
    cands = [
        cand("a100", running=20, capacity=4000, kv_usage=0.70),
        cand("l20", running=25, capacity=3000, kv_usage=0.40),
        cand("b100", running=30, capacity=6000, kv_usage=0.50),
    ]
    scores = load_balance_scores(cands, LoadBalanceSettings(kv_pressure_alpha=2.0))
    assert [round(s, 4) for s in scores] == [0.0099, 0.0110, 0.0075]
    picked = pickers()["load-balance"].pick(cands, REQ, random.Random(1))
    assert picked.pod.name == "b100"


@pytest.mark.parametrize(
    ("cands", "params", "expected"),
    [
        pytest.param(
            [cand("a", 10, capacity=100), cand("b", 10, capacity=None)],
            LoadBalanceSettings(kv_pressure_alpha=0),
            [0.1, 0.1],
            id="missing-estimate-gets-mean",
        ),
        pytest.param(
            [cand("a", 10, capacity=100), cand("b", 10, capacity=300), cand("c", 10)],
            LoadBalanceSettings(kv_pressure_alpha=0),
            [0.1, 10 / 300, 0.05],
            id="mean-of-existing-estimates",
        ),
        pytest.param(
            [cand("a", 4, kv_usage=0.5), cand("b", 2, kv_usage=0.0)],
            LoadBalanceSettings(kv_pressure_alpha=2),
            [4 * 1.5, 2.0],
            id="no-estimates-load-times-penalty",
        ),
        pytest.param(
            [
                cand("a", 5, capacity=10, kv_usage=None),
                cand("b", 5, capacity=10, kv_usage=math.nan),
            ],
            LoadBalanceSettings(kv_pressure_alpha=2),
            [0.5, 0.5],
            id="missing-or-nan-kv-is-free",
        ),
        pytest.param(
            [cand("a", 5, capacity=10, kv_usage=0.95), cand("b", 5, capacity=10, kv_usage=0.5)],
            LoadBalanceSettings(kv_critical_free=0.10),
            [math.inf, 0.5 * 1.5],
            id="below-critical-is-inf",
        ),
        pytest.param(
            [cand("a", 0, capacity=1, kv_usage=0.8), cand("b", 0, capacity=None)],
            LoadBalanceSettings(),
            [0.0, 0.0],
            id="idle-scores-zero",
        ),
        pytest.param(
            [cand("a", 2, capacity=10, waiting=8), cand("b", 2, capacity=10, waiting=None)],
            LoadBalanceSettings(queued_weight=0.5, kv_pressure_alpha=0),
            [0.6, 0.2],
            id="queued-weight",
        ),
        pytest.param(
            [cand("a", 2, capacity=10, waiting=8)],
            LoadBalanceSettings(queued_weight=0.0, kv_pressure_alpha=0),
            [0.2],
            id="queued-ignored-when-lambda-zero",
        ),
        pytest.param(
            [cand("a", 2, capacity=10, kv_usage=1.7), cand("b", 2, capacity=10, kv_usage=-1)],
            LoadBalanceSettings(kv_critical_free=0.0, kv_pressure_alpha=1),
            [0.4, 0.2],
            id="kv-clamped-to-0-1",
        ),
    ],
)
def test_load_balance_scores(
    cands: list[Candidate], params: LoadBalanceSettings, expected: list[float]
) -> None:
    assert load_balance_scores(cands, params) == pytest.approx(expected)


def test_all_below_critical_routes_to_most_headroom() -> None:
    cands = [cand("a", 1, kv_usage=0.97), cand("b", 9, kv_usage=0.92), cand("c", 0, kv_usage=0.99)]
    for seed in range(20):
        assert lb().pick(cands, REQ, random.Random(seed)).pod.name == "b"


def test_ties_prefer_least_kv_then_random() -> None:
    cands = [cand("a", 0, kv_usage=0.5), cand("b", 0, kv_usage=0.2), cand("c", 0, kv_usage=0.2)]
    picks = Counter(lb().pick(cands, REQ, random.Random(seed)).pod.name for seed in range(200))
    assert set(picks) == {"b", "c"}
    assert min(picks.values()) > 50


def test_ties_count_cpu_kv_usage_where_the_engine_exports_it() -> None:
    """AIBrix's tie-break is GPU + CPU KV usage: b has less on the GPU but more offloaded."""
    a, b = cand("a", 0, kv_usage=0.3), cand("b", 0, kv_usage=0.2)
    b.cpu_kv_usage = 0.5
    for seed in range(20):
        assert lb().pick([a, b], REQ, random.Random(seed)).pod.name == "a"
    b.cpu_kv_usage = float("nan")  # an unusable value counts as unused
    assert lb().pick([a, b], REQ, random.Random(0)).pod.name == "b"


def test_least_request_picks_fewest_in_flight_and_breaks_ties_randomly() -> None:
    strategy = pickers()["least-request"]
    cands = [cand("a", 3), cand("b", 1), cand("c", 1)]
    picks = Counter(strategy.pick(cands, REQ, random.Random(s)).pod.name for s in range(200))
    assert set(picks) == {"b", "c"}


def test_random_covers_every_candidate() -> None:
    strategy = pickers()["random"]
    cands = [cand("a"), cand("b"), cand("c")]
    rng = random.Random(3)
    picks = Counter(strategy.pick(cands, REQ, rng).pod.name for _ in range(300))
    assert set(picks) == {"a", "b", "c"}


@pytest.mark.parametrize("name", sorted(strategy_names()))
def test_no_candidates_is_routing_failure(name: str) -> None:
    with pytest.raises(RoutingFailed):
        build_strategies()[name].admit([], REQ, random.Random(0), 0.0)


cand_st = st.builds(
    cand,
    name=st.sampled_from(["a", "b", "c", "d"]),
    running=st.integers(0, 1000),
    capacity=st.one_of(st.none(), st.just(math.nan), st.floats(min_value=-10, max_value=1e6)),
    kv_usage=st.one_of(st.none(), st.just(math.nan), st.floats(min_value=-2, max_value=2)),
    waiting=st.one_of(st.none(), st.floats(min_value=0, max_value=1e4)),
)


@given(st.lists(cand_st, min_size=1, max_size=8), st.integers(0, 2**32))
def test_scores_are_finite_or_inf_and_pick_is_a_candidate(
    cands: list[Candidate], seed: int
) -> None:
    params = LoadBalanceSettings(queued_weight=0.3)
    for score in load_balance_scores(cands, params):
        assert score >= 0 and not math.isnan(score)
    for strategy in pickers(params).values():
        assert any(strategy.pick(cands, REQ, random.Random(seed)) is c for c in cands)


def test_round_robin_takes_candidates_in_turn() -> None:
    strategy = pickers()["round-robin"]
    cands = [cand("a", running=9), cand("b"), cand("c")]
    picks = [strategy.pick(cands, REQ, random.Random(0)).pod.name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    strategy = pickers()["power-of-two"]
    cands = [cand("busy", running=50), cand("idle", running=0), cand("mid", running=10)]
    rng = random.Random(1)
    picks = Counter(strategy.pick(cands, REQ, rng).pod.name for _ in range(600))
    # "busy" only wins a pair against nothing: it is never picked; "mid" only beats "busy".
    assert picks["busy"] == 0
    assert picks["idle"] > picks["mid"] > 0
    assert picks["mid"] == pytest.approx(200, rel=0.25)  # the pair {busy, mid}: 1 in 3


@pytest.mark.parametrize(
    ("saturations", "running", "expected"),
    [
        ((32, None), (32, 40), "l20"),  # the a100 is full: the other has room, whatever its score
        ((32, None), (31, 40), "a100"),  # one slot left: the score decides
        ((32, 9), (32, 9), "a100"),  # every batch full: the score decides among all
        ((None, None), (32, 40), "a100"),  # no cap learned yet: the score decides
    ],
    ids=["full", "room", "all-full", "unknown"],
)
def test_load_balance_passes_over_full_batches(
    saturations: tuple[int | None, int | None], running: tuple[int, int], expected: str
) -> None:
    cands = [
        cand("a100", running=running[0], capacity=4000, saturation=saturations[0]),
        cand("l20", running=running[1], capacity=1000, saturation=saturations[1]),
    ]
    assert lb().pick(cands, REQ, random.Random(0)).pod.name == expected


def test_reference_load_balance_ignores_batch_caps() -> None:
    reference = pickers(LoadBalanceSettings(avoid_full_batches=False))["load-balance"]
    cands = [
        cand("a100", running=32, capacity=4000, saturation=32),
        cand("l20", running=40, capacity=1000),
    ]
    assert reference.pick(cands, REQ, random.Random(0)).pod.name == "a100"


def test_full_batch_rule_does_not_override_the_kv_guardrail() -> None:
    # The only replica with room is nearly out of KV cache: the guardrail wins, and the full
    # replica with healthy KV takes the request, as in the reference algorithm.
    cands = [
        cand("full", running=32, capacity=4000, kv_usage=0.30, saturation=32),
        cand("kv-starved", running=3, capacity=1000, kv_usage=0.97),
    ]
    assert lb().pick(cands, REQ, random.Random(0)).pod.name == "full"


def test_round_robin_keeps_a_turn_per_model() -> None:
    strategy = pickers()["round-robin"]
    a = [cand("a0"), cand("a1")]
    b = [cand("b0"), cand("b1")]
    picks = []
    for _ in range(4):
        picks.append(strategy.pick(a, RequestInfo(model="a"), random.Random(0)).pod.name)
        picks.append(strategy.pick(b, RequestInfo(model="b"), random.Random(0)).pod.name)
    assert picks == ["a0", "b0", "a1", "b1", "a0", "b0", "a1", "b1"]
