"""Weighted blends and auto-blend: parsing, normalisation, what a list resolves to, the pick,
and the router's echo and `routed` hook."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.router import Decision, Router
from plugin.core.strategies import Route, Strategy, build_strategies
from plugin.core.strategies.blend import AutoBlend, Blend, normalise, parse_blend, resolve
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import UnknownStrategy

pytestmark = pytest.mark.unit

MODEL = "m"


@dataclass
class Table(Strategy):
    """A scoring strategy whose scores are given per pod name; records what was routed."""

    name: str
    higher_is_better: bool
    table: dict[str, float] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    def scores(self, candidates: Sequence[Candidate], request: RequestInfo) -> list[float]:
        return [self.table.get(c.pod.name, math.nan) for c in candidates]

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Route:
        return Route(candidates[0])

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:
        self.seen.append(candidate.pod.name)


@dataclass
class Exclusive(Strategy):
    name: str = "slo"
    needs_profiles: bool = True

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Route:
        return Route(candidates[0])


def registry() -> dict[str, Strategy]:
    built = build_strategies()
    return {
        "load-balance": Table("load-balance", False),
        "least-request": Table("least-request", False),
        "prefix-cache": Table("prefix-cache", True),
        "kv": Table("kv", False),
        "random": built["random"],
        "round-robin": built["round-robin"],
        "slo": Exclusive(),
    }


def members(strategy: Strategy) -> list[tuple[str, int]]:
    assert isinstance(strategy, Blend)
    return [(scorer.name, weight) for scorer, weight in strategy.members]


# parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("load-balance", [("load-balance", 1)]),
        (" prefix-cache:5 , load-balance:4 ", [("prefix-cache", 5), ("load-balance", 4)]),
        ("a:2,b,c:0", [("a", 2), ("b", 1), ("c", 0)]),
        ("a:1000000", [("a", 1_000_000)]),
    ],
)
def test_a_list_parses_into_names_and_weights(text: str, parsed: list[tuple[str, int]]) -> None:
    assert parse_blend(text) == parsed


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a:-1", "must be an integer from 0 to 1000000"),
        ("a:1.5", "must be an integer"),
        ("a:1000001", "must be an integer"),
        ("a:", "must be an integer"),
        ("a,,b", "empty strategy name"),
        (",a", "empty strategy name"),
        ("a,a:2", "a is named twice"),
        (",".join(f"s{i}" for i in range(9)), "at most 8 strategies"),
        ("x" * 300, "longer than 256"),
    ],
)
def test_a_malformed_list_is_a_400_saying_why(text: str, why: str) -> None:
    with pytest.raises(UnknownStrategy) as info:
        parse_blend(text)
    assert info.value.status == 400
    assert why in str(info.value)
    assert len(str(info.value)) < 400  # a long header is not echoed whole


# normalisation --------------------------------------------------------------------------------


def test_scores_normalise_min_max_with_the_best_at_one() -> None:
    assert normalise([1.0, 3.0, 2.0], higher_is_better=True) == [0.0, 1.0, 0.5]
    assert normalise([1.0, 3.0, 2.0], higher_is_better=False) == [1.0, 0.0, 0.5]


def test_equal_scores_are_all_one_and_non_finite_ones_zero() -> None:
    assert normalise([2.0, 2.0, math.inf], higher_is_better=False) == [1.0, 1.0, 0.0]
    assert normalise([math.nan, math.inf], higher_is_better=True) == [0.0, 0.0]
    assert normalise([], higher_is_better=True) == []


# what a list resolves to ----------------------------------------------------------------------


def test_an_exclusive_member_routes_alone_and_so_does_one_that_cannot_score() -> None:
    table = registry()
    assert resolve("load-balance,slo", table, AutoBlend()) is table["slo"]
    assert resolve("least-request:3,random", table, AutoBlend()) is table["random"]
    assert resolve("random,round-robin", table, AutoBlend()) is table["random"]


def test_weight_zero_drops_a_member_and_all_zero_is_refused() -> None:
    table = registry()
    assert resolve("kv:2,slo:0", table, None) is table["kv"]
    with pytest.raises(UnknownStrategy, match="weight 0"):
        resolve("kv:0,least-request:0", table, None)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(UnknownStrategy, match="fastest"):
        resolve("kv,fastest", registry(), None)


def test_auto_blend_rules() -> None:
    table, auto = registry(), AutoBlend()
    assert members(resolve("prefix-cache", table, auto)) == [
        ("prefix-cache", 5),
        ("load-balance", 4),
    ]
    assert members(resolve("least-request", table, auto)) == [
        ("least-request", 1),
        ("load-balance", 1),
    ]
    assert members(resolve("kv:3,prefix-cache", table, auto)) == [
        ("kv", 3),
        ("prefix-cache", 1),
        ("load-balance", 1),
    ]
    # Nothing is added to a list that names load-balance, whatever its weight.
    assert members(resolve("prefix-cache:2,load-balance:7", table, auto)) == [
        ("prefix-cache", 2),
        ("load-balance", 7),
    ]
    assert resolve("load-balance", table, auto) is table["load-balance"]
    # The variables' weights are used.
    tuned = AutoBlend(load_balance_weight=3, least_request_weight=2, prefix_cache_weight=9)
    assert members(resolve("least-request", table, tuned)) == [
        ("least-request", 2),
        ("load-balance", 1),
    ]
    assert members(resolve("kv", table, tuned)) == [("kv", 1), ("load-balance", 3)]
    assert members(resolve("prefix-cache", table, tuned))[0] == ("prefix-cache", 9)


def test_auto_blend_off_leaves_what_the_client_named() -> None:
    table = registry()
    assert (
        resolve("least-request", table, AutoBlend(load_balance_weight=0)) is table["least-request"]
    )
    assert resolve("prefix-cache", table, None) is table["prefix-cache"]
    assert members(resolve("kv,least-request:2", table, AutoBlend(load_balance_weight=-1))) == [
        ("kv", 1),
        ("least-request", 2),
    ]


# the pick -------------------------------------------------------------------------------------


def candidates(*names: str) -> list[Candidate]:
    return [
        Candidate(Pod(n, "ns", MODEL, "10.0.0.1", 8000 + i, 8000), 0, None, None, None)
        for i, n in enumerate(names)
    ]


def test_the_weighted_sum_of_normalised_scores_decides() -> None:
    cands = candidates("a", "b", "c")
    hit = Table("prefix-cache", True, {"a": 1.0, "b": 0.0, "c": 0.5})  # a holds the prefix
    load = Table("load-balance", False, {"a": 9.0, "b": 1.0, "c": 2.0})  # a is the busiest
    request = RequestInfo(MODEL)
    # prefix 5 : load 4 -> a 5, b 4, c 2.5+3.5 = 6: c balances both.
    pick = Blend("x", [(hit, 5), (load, 4)]).admit(cands, request, random.Random(0), 0.0)
    assert isinstance(pick, Route) and pick.candidate.pod.name == "c"
    pick = Blend("x", [(hit, 50), (load, 4)]).admit(cands, request, random.Random(0), 0.0)
    assert isinstance(pick, Route) and pick.candidate.pod.name == "a"


def test_the_kv_guardrail_is_a_penalty_in_a_blend_not_an_exclusion() -> None:
    cands = candidates("a", "b")
    hit = Table("prefix-cache", True, {"a": 1.0, "b": 0.0})
    load = Table("load-balance", False, {"a": math.inf, "b": 1.0})  # a below the guardrail
    request = RequestInfo(MODEL)
    strong = Blend("x", [(hit, 5), (load, 4)]).admit(cands, request, random.Random(0), 0.0)
    weak = Blend("x", [(hit, 1), (load, 4)]).admit(cands, request, random.Random(0), 0.0)
    assert isinstance(strong, Route) and strong.candidate.pod.name == "a"
    assert isinstance(weak, Route) and weak.candidate.pod.name == "b"


def test_ties_go_at_random() -> None:
    cands = candidates("a", "b", "c")
    flat = Table("kv", False, {"a": 1.0, "b": 1.0, "c": 1.0})
    blend = Blend("x", [(flat, 1), (Table("least-request", False), 1)])
    picked = set()
    for seed in range(40):
        answer = blend.admit(cands, RequestInfo(MODEL), random.Random(seed), 0.0)
        assert isinstance(answer, Route)
        picked.add(answer.candidate.pod.name)
    assert picked == {"a", "b", "c"}


def test_real_load_balance_and_least_request_blend_on_a_pool() -> None:
    """The registered strategies score as blend members: a pod at its batch cap scores +Inf
    under the full-batch rule, so the blend leaves it while another has room."""
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=10.0)
    pods = [Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000) for i in range(3)]
    pool.set_pods(pods)
    leases = [pool.acquire(pods[0]) for _ in range(3)] + [pool.acquire(pods[1])]
    built = build_strategies()
    blend = resolve("least-request:1,load-balance:1", built, None)
    answer = blend.admit(pool.candidates(MODEL, 1.0), RequestInfo(MODEL), random.Random(0), 1.0)
    assert isinstance(answer, Route) and answer.candidate.pod is pods[2]
    for lease in leases:
        lease.release()


# the router -----------------------------------------------------------------------------------


AUTO = AutoBlend()


def router(default: str = "kv") -> tuple[Router, dict[str, Strategy]]:
    pool = PodPool(CapacityEstimator())
    pool.set_pods([Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000) for i in range(3)])
    table = registry()
    return Router(pool, table, default, random.Random(0), lambda: 1.0, auto_blend=AUTO), table


def route(r: Router, text: str | None) -> Decision:
    decision = r.admit(RequestInfo(MODEL), r.strategy_for(text))
    assert isinstance(decision, Decision)
    decision.lease.release()
    return decision


def test_the_client_sees_the_string_it_sent() -> None:
    r, _ = router()
    for text in ("least-request:3", "prefix-cache", " kv:2,prefix-cache ", "load-balance"):
        assert route(r, text).strategy == text.strip()
    assert r.strategy_for("least-request:3") is r.strategy_for("least-request:3")  # cached


def test_a_named_exclusive_strategy_keeps_what_the_router_asks_of_it() -> None:
    r, _ = router()
    chosen = r.strategy_for("slo:2")
    assert chosen.name == "slo:2"
    assert getattr(chosen, "needs_profiles", False) is True


def test_the_default_may_be_a_list_and_is_auto_blended() -> None:
    r, _ = router(default="prefix-cache")
    assert r.strategy_for(None).name == "prefix-cache"
    assert members(r.strategy_for(None)) == [
        ("prefix-cache", 5),
        ("load-balance", 4),
    ]
    with pytest.raises(ValueError, match="unknown default strategy"):
        router(default="kv,fastest")


def test_strategies_that_learn_hear_where_each_request_went() -> None:
    r, table = router()
    hit = table["prefix-cache"]
    assert isinstance(hit, Table)
    hit.table.update({"p0": 0.0, "p1": 1.0, "p2": 0.0})
    for _ in range(3):
        route(r, "prefix-cache")
    route(r, "kv")  # kv alone: prefix-cache is not asked and learns nothing
    assert hit.seen == ["p1", "p1", "p1"]
