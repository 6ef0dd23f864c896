"""The simulator's capacity-shift scenario: two replicas exchange speeds at a known time."""

from __future__ import annotations

import math

import pytest

from plugin_tools.sim.engine import parse_fleet
from plugin_tools.sim.fleet import SpeedSwap, simulate
from plugin_tools.sim.shift import format_markdown, shift_study
from plugin_tools.sim.sweep import Scenario, make_strategy
from plugin_tools.sim.workload import CHAT

pytestmark = pytest.mark.unit


def test_a_swap_exchanges_step_costs_and_nothing_else() -> None:
    profiles = tuple(parse_fleet("a100,v100"))
    scenario = Scenario(profiles, CHAT, warmup_s=10.0, measured_requests=50)
    seen: list[tuple[float, ...]] = []
    result = simulate(
        profiles,
        make_strategy("round-robin", scenario),
        scenario.requests(2.0),
        warmup_s=10.0,
        swap=SpeedSwap(20.0, 0, 1),
        on_scrape=lambda now, pool: seen.append((now, len(pool.pods()))),
    )
    assert result.records and seen and seen[0] == (1.0, 2)
    # The fast type's requests after the swap run at the slow type's pace, and back.
    early = [r.tpot for r in result.records if r.replica == 0 and r.finish < 20 and r.completed]
    late = [r.tpot for r in result.records if r.replica == 0 and r.arrival > 25 and r.completed]
    assert early and late and min(late) > max(early)


def test_the_engine_counter_re_ranks_sooner_and_nothing_flaps_before_the_swap() -> None:
    study = shift_study(load=0.7, seed=1)
    rows = {row.variant: row for row in study.rows}
    lr = rows["least-request"]
    counted = rows["load-balance, gateway counts"]
    engine = rows["load-balance, engine counter"]
    assert lr.rerank_s is None and lr.flips_before is None
    assert counted.rerank_s is not None and engine.rerank_s is not None
    assert math.isfinite(engine.rerank_s) and engine.rerank_s < counted.rerank_s / 2
    assert counted.flips_before == engine.flips_before == 0
    assert all(math.isfinite(v) for row in study.rows for v in row.tpot_p99)
    table = format_markdown(study)
    assert table.count("\n| ") == 2 + len(study.rows)
