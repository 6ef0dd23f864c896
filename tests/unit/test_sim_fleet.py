"""The fleet simulator end to end: determinism, accounting, analytic checks, what strategies see."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

import pytest

from plugin.core.strategies import Picker, build_strategies
from plugin.core.types import Candidate, Pod, RequestInfo, SloTarget
from plugin_tools.sim.engine import GpuProfile, parse_fleet
from plugin_tools.sim.fleet import GatewayModel, simulate
from plugin_tools.sim.metrics import DEFAULT_SLO, attainment, summarize
from plugin_tools.sim.sweep import Scenario, bisect_rate, run_at, slo_capacities, study
from plugin_tools.sim.workload import (
    CHAT,
    Arrivals,
    LogNormalLengths,
    SyntheticLengths,
    generate,
)

pytestmark = pytest.mark.unit

FIXED = SyntheticLengths(LogNormalLengths(50, 0, 50, 50), LogNormalLengths(100, 0, 100, 100))
TINY = dict(measured_requests=300, warmup_s=20.0)


def fleet_scenario(spec: str = "a100,l20,v100", **kw: object) -> Scenario:
    base = Scenario(tuple(parse_fleet(spec)), CHAT, **TINY)  # type: ignore[arg-type]
    return replace(base, **kw)  # type: ignore[arg-type]


def test_same_seed_same_result() -> None:
    scn = fleet_scenario()
    a = summarize(run_at(scn, "load-balance", 8.0), scn.slo)
    b = summarize(run_at(scn, "load-balance", 8.0), scn.slo)
    c = summarize(run_at(replace(scn, seed=2), "load-balance", 8.0), scn.slo)
    assert a == b
    assert a != c


def test_every_request_completes_or_is_counted_as_dropped() -> None:
    # Overload a small cache so that some requests cannot fit and others are cut at the drain
    # limit: nothing may vanish from the books.
    profile = GpuProfile("tiny", 20, 0.3, 0.25, kv_tokens=600, max_num_seqs=8)
    lengths = SyntheticLengths(
        LogNormalLengths(200, 1.0, 1, 1000), LogNormalLengths(100, 1, 1, 500)
    )
    requests = generate(lengths, Arrivals(), 40.0, 600, random.Random(4))
    strategy = build_strategies()["least-request"]
    result = simulate([profile, profile], strategy, requests, warmup_s=0.0, drain_limit_s=5.0)
    assert len(result.records) == len(requests)
    summary = summarize(result, DEFAULT_SLO)
    assert summary["completed"] + summary["dropped"] == summary["requests"] == len(requests)
    too_big = [r for r in result.records if r.prompt_tokens + r.output_tokens > 600]
    assert too_big and all(not r.completed and r.replica == -1 for r in too_big)
    assert summary["dropped"] > len(too_big)  # the drain limit cut others
    assert all(r.completed == (r.finish >= r.first_token >= r.arrival) for r in result.records)


def test_single_replica_throughput_at_saturation_matches_the_step_model() -> None:
    profile = GpuProfile("sat", 9, 0.12, 0.0, 10_000_000, max_num_seqs=64)
    lengths = SyntheticLengths(LogNormalLengths(1, 0, 1, 1), LogNormalLengths(200, 0, 200, 200))
    requests = generate(lengths, Arrivals(), 100.0, 4000, random.Random(1))  # far above capacity
    strategy = build_strategies()["round-robin"]
    result = simulate([profile], strategy, requests, warmup_s=5.0)
    measured = result.windows[0].output_tokens / result.window_s
    analytic = 1000 * 64 / (9 + 0.12 * 64)
    assert measured == pytest.approx(analytic, rel=0.05)


def test_random_routing_ceiling_is_about_n_times_the_slowest() -> None:
    # a100 + v100 with fixed lengths: random gives each half the traffic, so the v100 saturates
    # first and the fleet sustains about twice what the v100 sustains alone.
    scn = Scenario(tuple(parse_fleet("a100,v100")), FIXED, slo=SloTarget(2.0, 0.2), **TINY)  # type: ignore[arg-type]
    caps = slo_capacities(scn)
    slowest = min(caps.values())
    assert caps["a100-0"] > 2 * slowest

    def passes(rate: float) -> bool:
        return attainment(run_at(scn, "random", rate), scn.slo) >= scn.target

    ceiling = bisect_rate(passes, slowest, iterations=7)
    assert ceiling == pytest.approx(2 * slowest, rel=0.2)


class Spy(Picker):
    """Records exactly what the simulator hands a strategy, as it is at the pick: candidates
    are live (the pool updates them in place), so it keeps copies."""

    name = "spy"

    def __init__(self) -> None:
        self.seen: list[tuple[Sequence[Candidate], RequestInfo, random.Random]] = []

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        self.seen.append(([copy.copy(c) for c in candidates], request, rng))
        return min(candidates, key=lambda c: c.running)


def _plain(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def test_a_strategy_sees_only_what_a_gateway_sees() -> None:
    spy = Spy()
    requests = generate(CHAT, Arrivals(), 10.0, 300, random.Random(2))
    simulate(parse_fleet("a100,l20"), spy, requests, warmup_s=0.0)
    assert len(spy.seen) == 300
    allowed = {f.name for f in dataclasses.fields(Candidate)}
    for candidates, request, rng in spy.seen:
        assert type(request) is RequestInfo and type(rng) is random.Random
        for c in candidates:
            assert type(c) is Candidate and type(c.pod) is Pod
            assert {f.name for f in dataclasses.fields(c)} == allowed
            values = [getattr(c, f) for f in allowed - {"pod"}]
            values += [getattr(c.pod, f.name) for f in dataclasses.fields(Pod)]
            assert all(_plain(v) or isinstance(v, Mapping | MappingProxyType) for v in values)
            assert all(_plain(v) for v in c.pod.labels.values())
    # Engine metrics reach the gateway only through scrapes: the first requests see none.
    first, _, _ = spy.seen[0]
    assert all(c.waiting is None and c.kv_usage is None and c.capacity is None for c in first)
    assert any(c.kv_usage is not None for cands, _, _ in spy.seen[-10:] for c in cands)


def test_scrape_staleness_is_a_parameter() -> None:
    seen_ages: dict[float, list[float | None]] = {}
    for delay in (0.0, 2.5):
        spy = Spy()
        requests = generate(CHAT, Arrivals(), 10.0, 200, random.Random(3))
        gw = GatewayModel(scrape_interval_s=1.0, metrics_delay_s=delay)
        simulate(parse_fleet("a100"), spy, requests, warmup_s=0.0, gateway=gw)
        seen_ages[delay] = [cands[0].waiting for cands, _, _ in spy.seen]
    # With a 2.5 s delay the first scrape lands at 3.5 s: more requests route without metrics.
    assert seen_ages[2.5].count(None) > seen_ages[0.0].count(None)


def test_study_writes_the_interface_keys() -> None:
    scn = fleet_scenario("a100,v100")
    doc = study(scn, ["least-request", "load-balance"], [0.5, 0.8])
    assert doc["g_star"] == pytest.approx(sum(doc["slo_capacity"].values()))
    for name in ("least-request", "load-balance"):
        s = doc["strategies"][name]
        assert s["max_rate"] > 0
        assert s["max_rate_over_g_star"] == pytest.approx(s["max_rate"] / doc["g_star"])
        assert set(s["tpot_p50_ratio"]) == {"0.5", "0.8"}
        assert all(v >= 1 or math.isnan(v) for v in s["tpot_p50_ratio"].values())
        assert set(s["utilization"]["0.8"]) == {"a100-0", "v100-0"}
        assert sum(s["share"]["0.8"].values()) == pytest.approx(1.0)


def test_study_rejects_an_unknown_strategy_before_working() -> None:
    with pytest.raises(ValueError, match="unknown strategy"):
        study(fleet_scenario(), ["least-request", "magic"], [0.5])


def test_load_balance_avoids_a_full_fast_replica_where_the_reference_queues() -> None:
    # The fast replica's batch cap binds: the reference keeps feeding its engine queue; the
    # full-batch rule sends the overflow to replicas with room. Same traffic for both.
    scn = Scenario(
        tuple(parse_fleet("a100,l20,v100", **{"a100.max_num_seqs": 32})),
        CHAT,
        measured_requests=800,
        warmup_s=60.0,
    )
    fixed = summarize(run_at(scn, "load-balance", 7.0), scn.slo)
    reference = summarize(run_at(scn, "load-balance-reference", 7.0), scn.slo)
    assert fixed["ttft_p99"] < reference["ttft_p99"]
    assert fixed["attainment"] > reference["attainment"]
    assert fixed["replicas"]["a100-0"]["share"] < reference["replicas"]["a100-0"]["share"]


def test_an_unused_replica_makes_the_utilisation_spread_infinite() -> None:
    scn = fleet_scenario("a100,v100")
    oracle = run_at(scn, "capacity-weighted", 5.0, {"a100-0": 1.0, "v100-0": 0.0})
    summary = summarize(oracle, scn.slo)
    assert summary["replicas"]["v100-0"]["share"] == 0
    assert summary["unused_replicas"] == 1
    assert summary["utilization_spread"] == math.inf
