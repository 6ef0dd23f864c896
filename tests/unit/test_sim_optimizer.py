"""The GPU optimizer in a closed loop in the fleet simulator (issue 13, "closed loop in the
simulator"): at rates from low to high, the fleet the optimizer plans from traced traffic meets
the SLO for >= 99% of requests under load-balance; least-request and round-robin run on the same
fleet beside it and are reported, not asserted (round-robin gives a slow replica as many requests
as a fast one, which a mixed plan does not provide for). The trace windows the loop plans from
are the ones the gateway's own recorder makes of the same requests, and the cheapest fleet of
one GPU type never costs less than the mixed plan.

The GPU profiles come from simulated sweeps on a grid stepping by 4, built once per process (about
50 s for the three types); the runs are short (400 measured requests after 60 s of warm-up), so
the module takes about a minute. The benchmark (`benchmarks/optimizer_plan.py`) runs the same loop
at full size.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import replace

import pytest

from plugin.adapters.tracing import TraceRecorder
from plugin.core.trace import TRACE_INTERVAL_S, TraceWindow, bucket, window_start
from plugin_tools.sim.closed_loop import (
    NAMESPACE,
    PRICES,
    STRATEGIES,
    TRACE_S,
    TRACE_START,
    ClosedLoop,
    RatePoint,
    build_fleet,
    cheapest_fleet,
    default_gpus,
    trace_windows,
)
from plugin_tools.sim.fleet import MODEL
from plugin_tools.sim.profiles import grid_for
from plugin_tools.sim.sweep import Scenario
from plugin_tools.sim.workload import CHAT, SimRequest

pytestmark = [
    pytest.mark.unit,
    pytest.mark.slow(reason="the module's first test builds three simulated sweeps (about 50 s)"),
]

RATES = (1.0, 8.0, 32.0)  # req/s: one replica, a mixed handful, a dozen or more
TARGET = 0.99


# The sweep's grid steps by 4 (not 2), as tests/unit/test_sim_slo.py's does: it still covers
# every size chat makes, and the three simulated sweeps take a third of the time (the
# benchmark sweeps the full grid).
COARSE = replace(
    grid_for(CHAT), inputs=tuple(4**k for k in range(7)), outputs=(1, 4, 16, 64, 256, 1024)
)


@pytest.fixture(scope="module")
def loop() -> ClosedLoop:
    return ClosedLoop(
        Scenario(default_gpus(), CHAT, measured_requests=400, warmup_s=60.0, sweep=COARSE)
    )


@pytest.fixture(scope="module")
def points(loop: ClosedLoop) -> dict[float, RatePoint]:
    return {rate: loop.at(rate) for rate in RATES}


# the plan meets the SLO -------------------------------------------------------------------------
@pytest.mark.parametrize("rate", RATES, ids=[f"{r:g}/s" for r in RATES])
def test_the_planned_fleet_meets_the_slo_under_load_balance(
    points: dict[float, RatePoint], rate: float
) -> None:
    p = points[rate]
    assert p.plan.status == "optimal"
    assert sum(p.mixed.replicas.values()) >= 1
    assert p.mixed.attainment["load-balance"] >= TARGET, p.to_json()
    # Reported beside it, not asserted: computed on the same fleet and requests.
    assert set(p.mixed.attainment) == set(STRATEGIES)
    for name in ("least-request", "round-robin"):
        assert 0.0 <= p.mixed.attainment[name] <= 1.0


def test_the_fleet_run_is_the_plan_at_the_prices(points: dict[float, RatePoint]) -> None:
    gpus = {g.name: g for g in default_gpus()}
    for p in points.values():
        assert {c.name: c.cost for c in p.inputs.problem.candidates} == {
            f"{NAMESPACE}/{g}": price for g, price in PRICES.items()
        }
        assert p.mixed.replicas == {g: p.plan.replicas[f"{NAMESPACE}/{g}"] for g in gpus}
        fleet = Counter(g.name for g in build_fleet(p.mixed.replicas, gpus))
        assert fleet == Counter({g: n for g, n in p.mixed.replicas.items() if n})
        cost = math.fsum(PRICES[g] * n for g, n in p.mixed.replicas.items())
        assert p.mixed.cost == pytest.approx(cost)
    assert points[RATES[-1]].mixed.cost > points[RATES[0]].mixed.cost


def test_the_plan_is_for_the_rate_traced(points: dict[float, RatePoint]) -> None:
    for rate, p in points.items():
        assert p.inputs.traffic.rate == pytest.approx(rate, rel=0.25)
        assert p.inputs.traffic.windows == len(p.windows)
        assert p.inputs.traffic.span_s == TRACE_S  # the service's look-back, every window found
        assert sum(w.total_reqs for w in p.windows) == p.inputs.traffic.arrivals


def test_the_cheapest_single_type_costs_at_least_the_mixed_plan(
    points: dict[float, RatePoint],
) -> None:
    compared = 0
    for p in points.values():
        feasible = {g: c for g, c in p.single_costs.items() if c is not None}
        for cost in feasible.values():
            assert cost >= p.mixed.cost - 1e-9
        if not feasible:
            assert p.single is None and p.single_gpu is None
            continue
        compared += 1
        assert p.single is not None and p.single_gpu is not None
        assert p.single.cost == min(feasible.values()) == feasible[p.single_gpu]
        assert set(p.single.replicas) == {p.single_gpu}
        assert p.saving is not None and p.saving >= -1e-9
        assert 0.0 <= p.single.attainment["load-balance"] <= 1.0
    assert compared >= 2


def test_a_rate_point_is_deterministic(loop: ClosedLoop, points: dict[float, RatePoint]) -> None:
    assert loop.at(RATES[0]).to_json() == points[RATES[0]].to_json()


@pytest.mark.parametrize("rate", [1.0, 32.0], ids=["1/s", "32/s"])
def test_a_plan_for_99_percent_costs_no_more_and_its_fleet_holds_99_percent(
    loop: ClosedLoop, points: dict[float, RatePoint], rate: float
) -> None:
    """Under an attainment target the plan may leave the costliest 1% of requests out of what it
    buys for; they are still served (late), and the fleet still holds the target."""
    held = replace(loop, attainment=TARGET).at(rate)
    every = points[rate]
    assert held.every is not None and every.every is None
    assert held.every.replicas == every.plan.replicas  # the same plan as without a target
    assert held.plan.cost <= every.plan.cost + 1e-9
    if rate == 1.0:  # the a10 alone, its 4k prompts late, instead of an a100
        assert held.plan.cost < every.plan.cost
    assert held.plan.status == "optimal"
    assert sum(held.plan.exempt) <= (1 - TARGET) * sum(held.inputs.problem.rates) * (1 + 1e-6)
    assert held.mixed.attainment["load-balance"] >= TARGET, held.to_json()


# the trace windows are the gateway's -----------------------------------------------------------
def test_the_windows_are_what_the_gateways_recorder_writes(loop: ClosedLoop) -> None:
    history, future = loop.requests(8.0)
    assert history and all(0 <= r.arrival < TRACE_S for r in history)
    assert future and future[0].arrival >= 0  # what the plan serves follows the stretch
    windows = trace_windows(history)
    # The gateway's recorder fed the same requests (each completed as it arrived), closing each
    # window at its boundary as the flusher does.
    recorder = TraceRecorder()
    expected: list[TraceWindow] = []
    current = TRACE_START
    for r in history:
        while window_start(TRACE_START + r.arrival) > current:
            expected += recorder.close(current, float(current), {})
            current += TRACE_INTERVAL_S
        recorder.arrived(MODEL)
        recorder.completed(MODEL, r.prompt_tokens, r.output_tokens)
    expected += recorder.close(current, float(current), {})
    assert [(w.start, w.to_json()) for w in windows] == [(w.start, w.to_json()) for w in expected]
    # 10 s windows over the whole stretch, counts keyed by bucket, totals the arrivals.
    assert [w.start for w in windows] == [
        TRACE_START + k * TRACE_INTERVAL_S for k in range(TRACE_S // TRACE_INTERVAL_S)
    ]
    assert sum(w.total_reqs for w in windows) == len(history)
    for w in windows:
        mine = [r for r in history if window_start(TRACE_START + r.arrival) == w.start]
        assert w.counts == Counter(bucket(r.prompt_tokens, r.output_tokens) for r in mine)
        assert w.total_reqs == len(mine) == sum(w.counts.values())
        doc = w.to_json()
        assert all(re.fullmatch(r"\d+:\d+", k) for k in doc if not k.startswith("meta_"))
        assert (doc["meta_v"], doc["meta_interval_sec"], doc["meta_precision"]) == (4, 10, 10)
        assert (doc["meta_total_reqs"], doc["meta_pending_reqs"], doc["meta_queueing_reqs"]) == (
            len(mine),
            0,
            0,
        )
        assert TraceWindow.parse(MODEL, w.start, doc) == w


def test_trace_windows_by_hand() -> None:
    requests = [
        SimRequest(0.0, 100, 10),  # log2(100) x 10 = 66.4, log2(10) x 10 = 33.2
        SimRequest(9.99, 100, 10),
        SimRequest(10.0, 1, 1),  # the next window; log2(1) = 0
        SimRequest(35.0, 1024, 0),  # zero tokens -> 0; nothing in the window at +20
    ]
    got = {w.start - TRACE_START: (w.counts, w.total_reqs) for w in trace_windows(requests)}
    assert got == {0: ({"66:33": 2}, 2), 10: ({"0:0": 1}, 1), 30: ({"100:0": 1}, 1)}
    with pytest.raises(ValueError, match="multiple of 10"):
        trace_windows(requests, start_unix=TRACE_START + 5)


def test_the_cheapest_fleet_search_holds_the_target_and_nothing_cheaper_it_tried_does(
    loop: ClosedLoop,
) -> None:
    found = cheapest_fleet(loop, 8.0)
    assert found.run is not None and found.tried >= 1
    assert found.run.attainment["load-balance"] >= TARGET
    # One replica fewer of any type it uses no longer holds it.
    _, future = loop.requests(8.0)
    for name, count in found.run.replicas.items():
        if count:
            fewer = found.run.replicas | {name: count - 1}
            if sum(fewer.values()):
                run = loop.run_fleet(fewer, 0.0, ("load-balance",), future)
                assert run.attainment["load-balance"] < TARGET, fewer
