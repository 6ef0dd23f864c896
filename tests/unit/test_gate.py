"""The load-imbalance gate: AIBrix's raw-count rule exactly, ours per unit of capacity, and the
view's indexed path answering what the plain pass answers (same pod, same random draws)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import Lease, PodPool
from plugin.core.router import Decision, Router
from plugin.core.strategies import LoadBalanceSettings, Route, build_strategies
from plugin.core.strategies.base import Admission, Scorer, Strategy
from plugin.core.strategies.gate import ImbalanceGate, ImbalanceSettings, Wrapped
from plugin.core.types import Candidate, EngineMetrics, Pod, RequestInfo
from plugin.core.view import CandidateView

pytestmark = pytest.mark.unit

MODEL = "m"
RAW = ImbalanceSettings(capacity_aware=False)
AWARE = ImbalanceSettings()


def pods(n: int, model: str = MODEL) -> list[Pod]:
    return [Pod(f"p{i}", "ns", model, "10.0.0.1", 8000 + i, 8000) for i in range(n)]


def fleet(
    running: Sequence[int], capacities: Sequence[float | None] | None = None
) -> list[Candidate]:
    caps = capacities if capacities is not None else [None] * len(running)
    return [
        Candidate(p, r, None, None, c)
        for p, r, c in zip(pods(len(running)), running, caps, strict=True)
    ]


def gated_to(
    settings: ImbalanceSettings, candidates: Sequence[Candidate], seed: int = 0
) -> int | None:
    """Index of the candidate the gate routes to, None when it does not fire."""
    chosen = ImbalanceGate(settings).check(candidates, MODEL, random.Random(seed))
    return None if chosen is None else list(candidates).index(chosen)


# AIBrix's rule (capacity_aware=False) --------------------------------------------------------
@pytest.mark.parametrize(
    ("running", "settings", "targets"),
    [
        # AIBrix's own cases (load_balance_test.go): three light pods and a busy one.
        pytest.param([2, 2, 2, 20], RAW, {0, 1, 2}, id="busy-pod-fenced"),
        pytest.param([2, 2, 2, 20], ImbalanceSettings(2, 20.0, False), None, id="high-factor"),
        pytest.param([2, 2, 2, 20], ImbalanceSettings(100, 2.0, False), None, id="wide-gap"),
        pytest.param([2, 20], RAW, {0}, id="two-pods-skip-the-factor"),
        pytest.param([0, 7], RAW, None, id="gap-below-min"),
        pytest.param([0, 8], RAW, {0}, id="gap-at-min-fires"),
        # meanOfOthers excludes the busiest: (0 + 8) / 2 = 4, and 8 <= 2 * (4 + 1)
        pytest.param([0, 8, 8], RAW, None, id="within-factor-of-the-others"),
        pytest.param([0, 0, 9], RAW, {0, 1}, id="ties-at-the-least"),
        pytest.param([5], RAW, None, id="one-pod"),
        pytest.param([], RAW, None, id="no-pod"),
    ],
)
def test_aibrix_raw_count_rule(
    running: list[int], settings: ImbalanceSettings, targets: set[int] | None
) -> None:
    for seed in range(8):
        chosen = gated_to(settings, fleet(running), seed)
        if targets is None:
            assert chosen is None
        else:
            assert chosen in targets


def test_ties_at_the_least_are_drawn_as_random_min_draws() -> None:
    cands = fleet([0, 9, 0, 0, 30])
    for seed in range(20):
        expected = random.Random(seed).choice([cands[0], cands[2], cands[3]])
        assert ImbalanceGate(RAW).check(cands, MODEL, random.Random(seed)) is expected


# Ours: load per unit of capacity -------------------------------------------------------------
def test_a_fast_replica_carrying_its_share_is_no_hotspot() -> None:
    """AIBrix's busy pod, now ten times faster: 20 in flight is its share, not a hotspot."""
    running = [2, 2, 2, 20]
    assert gated_to(RAW, fleet(running, [100.0, 100.0, 100.0, 1000.0])) in {0, 1, 2}
    assert gated_to(AWARE, fleet(running, [100.0, 100.0, 100.0, 1000.0])) is None


def test_slow_replicas_piling_up_while_the_fast_one_idles_is_a_hotspot() -> None:
    """Raw counts see 10 against 10 and 0 and let it be; per unit of capacity the slow ones hold
    32.5 requests each at the mean capacity, so the request goes to the fast one."""
    running = [10, 10, 10, 0]
    caps: list[float | None] = [100.0, 100.0, 100.0, 1000.0]
    assert gated_to(RAW, fleet(running, caps)) is None
    assert gated_to(AWARE, fleet(running, caps)) == 3


def test_a_pod_without_an_estimate_counts_at_the_mean() -> None:
    # Only the busy pod has an estimate: the mean is its own, every pod counts alike, and the
    # rule is AIBrix's.
    assert gated_to(AWARE, fleet([2, 2, 2, 20], [None, None, None, 1000.0])) in {0, 1, 2}
    # No estimate anywhere: AIBrix's rule.
    assert gated_to(AWARE, fleet([2, 2, 2, 20])) in {0, 1, 2}
    assert gated_to(AWARE, fleet([0, 7])) is None


def test_min_gap_keeps_its_unit_of_requests() -> None:
    """Loads are scaled to the pool's mean capacity: a gap of 8 requests is 8 at any scale."""
    for unit in (1e-3, 1.0, 4000.0):
        assert gated_to(AWARE, fleet([0, 8], [unit, unit])) == 0
        assert gated_to(AWARE, fleet([0, 7], [unit, unit])) is None


def test_ours_sends_nothing_to_a_replica_at_its_batch_cap() -> None:
    """The fast replica is the least loaded per unit of capacity, but its batch is full: the
    request goes to the least loaded with room; with none anywhere, the strategy decides.
    AIBrix's rule knows no batch cap."""
    running = [30, 12, 12, 40]
    caps: list[float | None] = [100.0, 100.0, 100.0, 1000.0]
    cands = fleet(running, caps)  # at the mean capacity: 97.5, 39, 39 and 13 requests
    assert gated_to(AWARE, cands) == 3
    cands[3].saturation = 40
    assert gated_to(AWARE, cands) in {1, 2}
    for c in cands:
        c.saturation = c.running
    assert gated_to(AWARE, cands) is None
    assert gated_to(RAW, fleet([2, 2, 2, 20])) in {0, 1, 2}
    full = fleet([2, 2, 2, 20])
    for c in full[:3]:
        c.saturation = 2
    assert gated_to(RAW, full) in {0, 1, 2}
    assert gated_to(AWARE, full) is None  # the only pod with room is the busiest


@settings(max_examples=300, deadline=None)
@given(
    running=st.lists(st.integers(0, 40), min_size=0, max_size=12),
    capacity=st.floats(1e-3, 1e5),
    min_gap=st.integers(0, 10),
    factor=st.sampled_from((0.5, 1.0, 1.5, 2.0, 3.0)),
    seed=st.integers(0, 1000),
)
# An exact tie with the factor that AIBrix's float arithmetic settles as imbalanced
# (1.5 * (47 / 3 + 1) rounds just below 25): a slack on the comparisons once decided it the
# other way.
@example(running=[0, 22, 25, 25], capacity=1.0, min_gap=0, factor=1.5, seed=0)
def test_equal_capacities_give_aibrix_rule(
    running: list[int], capacity: float, min_gap: int, factor: float, seed: int
) -> None:
    cands = fleet(running, [capacity] * len(running))
    raw = ImbalanceGate(ImbalanceSettings(min_gap, factor, capacity_aware=False))
    aware = ImbalanceGate(ImbalanceSettings(min_gap, factor))
    assert aware.check(cands, MODEL, random.Random(seed)) is raw.check(
        cands, MODEL, random.Random(seed)
    )


def test_settings_are_checked() -> None:
    for bad in ({"min_gap": -1}, {"factor": -0.5}, {"min_gap": float("nan")}):
        with pytest.raises(ValueError):
            ImbalanceSettings(**bad)


# The view's indexes answer what the plain pass answers -------------------------------------
GATES = (
    RAW,
    AWARE,
    ImbalanceSettings(min_gap=2, factor=1.2),
    ImbalanceSettings(min_gap=0, factor=0.0),
    ImbalanceSettings(min_gap=3, factor=1.5, capacity_aware=False),
)


LOAD_BALANCE = build_strategies(LoadBalanceSettings())["load-balance"]


def answers(admission: Admission) -> str:
    assert isinstance(admission, Route)
    return admission.candidate.pod.key


def check_same(view: CandidateView, seed: int) -> None:
    plain = list(view)  # the same candidates, in the same order, as a plain list
    request = RequestInfo(MODEL)
    for gate_settings in GATES:
        indexed_gate, plain_gate = ImbalanceGate(gate_settings), ImbalanceGate(gate_settings)
        a = indexed_gate.check(view, MODEL, random.Random(seed))
        b = plain_gate.check(plain, MODEL, random.Random(seed))
        assert (a and a.pod.key) == (b and b.pod.key), gate_settings
        assert indexed_gate.fired == plain_gate.fired
        # and through the wrapper, the gate's draw and then load-balance's
        lb = LOAD_BALANCE
        on_view = Wrapped(lb, gate=ImbalanceGate(gate_settings)).admit(
            view, request, random.Random(seed), 0
        )
        on_list = Wrapped(lb, gate=ImbalanceGate(gate_settings)).admit(
            plain, request, random.Random(seed), 0
        )
        assert answers(on_view) == answers(on_list)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 14), learn=st.booleans())
def test_indexed_path_matches_the_plain_pass(seed: int, n: int, learn: bool) -> None:
    rng = random.Random(seed)
    pool = PodPool(CapacityEstimator(window_s=10.0, tau_s=2.0), metrics_max_age_s=2.0)
    model_pods = pods(n)
    pool.set_pods(model_pods)
    leases: list[Lease] = []
    now = 0.0
    for _ in range(80):
        roll = rng.random()
        target = rng.choice(model_pods)
        if roll < 0.35:  # a burst on one pod: loads spread far enough for the gate to fire
            leases += [pool.acquire(target) for _ in range(rng.choice((1, 1, 3, 10)))]
        elif roll < 0.6 and leases:
            for _ in range(rng.randint(1, min(4, len(leases)))):
                leases.pop(rng.randrange(len(leases))).release(rng.choice((0, 50, 400)), 200, now)
        elif roll < 0.7 and learn:
            pool.credit_tokens(target.key, rng.choice((100, 100, 700, 3000)))
            pool.refresh_capacity(now)
        elif roll < 0.75:
            counts = {p.key: rng.randint(0, 12) for p in rng.sample(model_pods, min(3, n))}
            pool.set_remote_inflight(counts)
        elif roll < 0.8:  # a queue at a steady running count: the engine's batch cap
            cap = float(rng.randint(1, 8))
            for _ in range(2):
                pool.update_metrics(target.key, EngineMetrics(cap, 1.0, None), now)
        else:
            now += rng.choice((0.1, 0.5, 1.0))
        if rng.random() < 0.5:
            check_same(pool.candidates(MODEL, now), rng.randrange(1 << 30))
    check_same(pool.candidates(MODEL, now), 7)
    for lease in leases:
        lease.release()


def learned_pool(capacities: Sequence[int]) -> tuple[PodPool, list[Pod]]:
    """A pool whose pods have learned capacities proportional to `capacities`."""
    pool = PodPool(CapacityEstimator(window_s=10.0, tau_s=2.0), metrics_max_age_s=5.0)
    model_pods = pods(len(capacities))
    pool.set_pods(model_pods)
    pool.refresh_capacity(0.0)
    for pod, tokens in zip(model_pods, capacities, strict=True):
        pool.credit_tokens(pod.key, tokens)
    pool.refresh_capacity(1.0)
    return pool, model_pods


def test_a_large_pool_is_not_walked_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the mean capacity is summed (once per capacity refresh), a request reads the ends of
    the sorted index and the running-count groups, never the candidates one by one."""
    pool, model_pods = learned_pool([100 if i % 4 else 400 for i in range(1000)])
    view = pool.candidates(MODEL, 1.0)
    assert view.known_capacities == 1000
    gate = ImbalanceGate(AWARE)
    assert gate.check(view, MODEL, random.Random(0)) is None  # sums the mean once

    def no_walk(self: CandidateView, *args: Any) -> Iterator[Candidate]:
        raise AssertionError("the view was walked")

    monkeypatch.setattr(CandidateView, "__iter__", no_walk)
    monkeypatch.setattr(CandidateView, "__getitem__", no_walk)
    slow = model_pods[1]  # capacity 100, mean 175
    leases = [pool.acquire(slow) for _ in range(6)]  # 10.5 requests at the mean capacity
    assert gate.check(view, MODEL, random.Random(0)) is not None  # needed the running total
    assert gate.fired == {MODEL: 1}
    chosen = gate.check(view, MODEL, random.Random(5))
    assert chosen is not None and chosen.running == 0 and chosen.pod is not slow
    for lease in leases:
        lease.release()
    assert gate.check(view, MODEL, random.Random(0)) is None
    assert gate.fired == {MODEL: 2}


# The wrapper -------------------------------------------------------------------------------
class Learner(Strategy):
    """A scoring strategy that learns where requests went (as prefix-cache does)."""

    name = "learner"
    higher_is_better = True

    def __init__(self) -> None:
        self.seen: list[str] = []

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        return Route(candidates[-1])

    def scores(self, candidates: Sequence[Candidate], request: RequestInfo) -> list[float]:
        return [float(c.running) for c in candidates]

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:
        self.seen.append(candidate.pod.name)


def test_gated_stands_where_the_strategy_stood() -> None:
    gate = ImbalanceGate()
    learner = Learner()
    gated = Wrapped(learner, gate=gate)
    assert gated.name == "learner"
    assert isinstance(gated, Scorer) and gated.higher_is_better
    assert gated.scores(fleet([1, 2]), RequestInfo(MODEL)) == [1.0, 2.0]
    gated.routed(fleet([0])[0], RequestInfo(MODEL))
    assert learner.seen == ["p0"]
    plain = Wrapped(build_strategies()["random"], gate=gate)  # does not score
    assert plain.name == "random"
    assert not isinstance(plain, Scorer)
    renamed = Wrapped(learner, "learner:2")
    assert renamed.name == "learner:2" and renamed.gate is None


def test_gated_routes_where_the_gate_says_and_counts_per_model() -> None:
    gate = ImbalanceGate(RAW)
    gated = Wrapped(Learner(), gate=gate)
    balanced, skewed = fleet([3, 3, 4]), fleet([0, 1, 30])
    answer = gated.admit(balanced, RequestInfo(MODEL), random.Random(0), 0.0)
    assert isinstance(answer, Route) and answer.candidate is balanced[-1]  # the strategy's
    for model in ("a", "a", "b"):
        answer = gated.admit(skewed, RequestInfo(model), random.Random(0), 0.0)
        assert isinstance(answer, Route) and answer.candidate is skewed[0]  # the gate's
    assert gate.fired == {"a": 2, "b": 1}


def test_the_gate_draws_nothing_when_it_does_not_fire() -> None:
    cands = fleet([1, 0, 0, 2, 0], [10.0, 20.0, 20.0, 10.0, 20.0])
    lb = build_strategies()["load-balance"]
    for seed in range(10):
        alone = lb.admit(cands, RequestInfo(MODEL), random.Random(seed), 0.0)
        gated = Wrapped(lb, gate=ImbalanceGate()).admit(
            cands, RequestInfo(MODEL), random.Random(seed), 0.0
        )
        assert answers(alone) == answers(gated)


def test_through_the_router_the_gate_routed_request_is_learned_and_leased() -> None:
    pool, model_pods = learned_pool([100, 100, 100, 100])
    held = [pool.acquire(model_pods[0]) for _ in range(12)]
    learner = Learner()
    gated = Wrapped(learner, gate=ImbalanceGate())
    router = Router(pool, {"learner": gated}, "learner", random.Random(0), lambda: 1.0)
    decision = router.admit(RequestInfo(MODEL), gated)
    assert isinstance(decision, Decision)
    assert decision.strategy == "learner"
    assert decision.lease.key != model_pods[0].key  # not the hotspot
    assert learner.seen == [decision.lease.pod.name]
    decision.lease.release()
    for lease in held:
        lease.release()
