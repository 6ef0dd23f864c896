"""SLO routing in the fleet simulator: the one SLO type, held requests driven in simulated time,
GPU profiles built from simulated sweeps, and SLO routing against least-request on a mix of
short chat and long prompts."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest

from plugin.core.profile import profile_key
from plugin.core.strategies import Admission, Route, Wait
from plugin.core.strategies.base import Strategy
from plugin.core.types import Candidate, RequestInfo, SloTarget
from plugin_tools.profile.sweep import doubling
from plugin_tools.sim.engine import PRESETS, GpuProfile, parse_fleet
from plugin_tools.sim.fleet import MODEL, RunResult, simulate
from plugin_tools.sim.metrics import attainment, summarize
from plugin_tools.sim.profiles import (
    SweepGrid,
    grid_for,
    measure_point,
    profile_book,
    simulated_profile,
    sweep_rows,
)
from plugin_tools.sim.sweep import Scenario, run_at
from plugin_tools.sim.workload import CHAT, LONG, MixedLengths, SimRequest

pytestmark = pytest.mark.unit

# One step costs 10 ms whatever it holds: a 1-token prompt with 10 output tokens takes one
# prefill step (its first token) and nine decode steps, 100 ms alone.
FLAT = GpuProfile("flat", a_ms=10.0, b_ms=0.0, p_ms=0.0, kv_tokens=100_000)
ALONE_S = 0.1
MIX = MixedLengths(((0.8, CHAT), (0.2, LONG)), name="chat:0.8,long:0.2")


# SloTarget ---------------------------------------------------------------------------------
def test_an_slo_is_met_when_every_target_set_holds_and_only_then() -> None:
    assert SloTarget().met(math.inf, math.inf, math.inf, 1)  # nothing set: anything meets it
    ttft = SloTarget(ttft_s=1.0)
    assert ttft.met(1.0, 99.0, 99.0, 10) and not ttft.met(1.01, 0.0, 0.0, 10)  # at most
    tpat = SloTarget(tpat_s=0.01)  # E2E over prompt + output tokens
    assert tpat.met(9.0, 9.0, 1.0, 100) and not tpat.met(0.0, 0.0, 1.0, 99)
    assert not SloTarget(tpot_s=0.1).met(0.0, math.nan, 0.0, 1)  # NaN never meets a target
    every = SloTarget(1.0, 0.05, 10.0, 0.02)
    assert every.met(0.5, 0.05, 5.0, 1000)
    for broken in ((1.5, 0.05, 5.0, 1000), (0.5, 0.06, 5.0, 1000), (0.5, 0.05, 11.0, 1000)):
        assert not every.met(*broken)
    assert not every.met(0.5, 0.05, 5.0, 200)  # 25 ms per token


def test_the_slo_speaks_the_profile_names() -> None:
    slo = SloTarget.from_slos({"percentile": 99, "e2e": 5.0, "tpat": 0.02, "tput": 3.0})
    assert slo == SloTarget(e2e_s=5.0, tpat_s=0.02)
    assert slo.slos() == {"e2e": 5.0, "tpat": 0.02}
    assert SloTarget(0.5, 0.05) == SloTarget(ttft_s=0.5, tpot_s=0.05)  # the headers' order


# held requests in simulated time -------------------------------------------------------------
@dataclass
class Limit(Strategy):
    """Routes while a pod has fewer than `limit` in flight; else holds the request until
    `arrived_at + wait_s` (with `extend`, until `now + wait_s` at every ask)."""

    wait_s: float
    extend: bool = False
    limit: int = 1
    name: str = "limit"
    asked_at: list[float] = field(default_factory=list)

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        self.asked_at.append(now)
        room = [c for c in candidates if c.running < self.limit]
        if room:
            return Route(room[0])
        return Wait((now if self.extend else request.arrived_at) + self.wait_s)


def two_requests(strategy: Limit) -> RunResult:
    requests = [SimRequest(0.0, 1, 10), SimRequest(0.005, 1, 10)]
    return simulate([FLAT], strategy, requests, warmup_s=0.0)


def test_a_held_request_is_routed_when_the_lease_ends() -> None:
    result = two_requests(Limit(wait_s=1.0))
    first, second = result.records
    assert first.finish == pytest.approx(ALONE_S) and first.wait == 0.0
    assert second.decided == first.finish  # the release woke it, at that instant
    assert second.wait == pytest.approx(ALONE_S - 0.005)
    assert not second.rejected and second.replica == 0
    assert second.finish == pytest.approx(2 * ALONE_S)
    summary = summarize(result, SloTarget(ttft_s=1.0))
    assert summary["rejected"] == 0 and summary["wait_p99"] == pytest.approx(second.wait)


def test_a_request_past_its_deadline_is_rejected_at_the_deadline() -> None:
    result = two_requests(Limit(wait_s=0.05))
    first, second = result.records
    assert second.rejected and second.decided == pytest.approx(0.055)
    assert second.decided < first.finish  # not when the pod frees up
    assert not second.completed and second.replica == -1
    slo = SloTarget(e2e_s=10.0)
    summary = summarize(result, slo)
    # A rejection is a miss, counted apart from drops, and never goodput.
    assert (summary["rejected"], summary["dropped"], summary["completed"]) == (1, 0, 1)
    assert attainment(result, slo) == 0.5
    assert summary["goodput"] == pytest.approx(1 / result.window_s)


def test_a_deadline_moved_later_keeps_the_request_waiting() -> None:
    strategy = Limit(wait_s=0.03, extend=True)
    result = two_requests(strategy)
    first, second = result.records
    assert not second.rejected and second.decided == first.finish
    # Asked at arrival, at each deadline (each 30 ms after the last) and at the release.
    deadlines = [t for t in strategy.asked_at if 0.005 < t < first.finish]
    assert deadlines == pytest.approx([0.035, 0.065, 0.095])


@dataclass
class Spy(Strategy):
    """Routes to the first pod; reads profiles like SLO routing, so the router predicts."""

    name: str = "spy"
    needs_profiles: bool = True
    seen: list[RequestInfo] = field(default_factory=list)

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        assert all(c.profile is not None and c.pod.deployment == "flat" for c in candidates)
        self.seen.append(request)
        return Route(candidates[0])


def test_requests_carry_their_sizes_and_completions_teach_the_prediction() -> None:
    grid = SweepGrid((1,), (8,), (1.0,), prompts=5)
    spy = Spy()
    requests = [SimRequest(0.0, 1, 10), SimRequest(1.0, 3, 10)]
    book = profile_book([FLAT], grid, SloTarget(e2e_s=10.0), MODEL)
    simulate([FLAT], spy, requests, warmup_s=0.0, book=book, max_tokens=64)
    first, second = spy.seen
    assert (first.prompt_tokens, first.max_tokens, first.arrived_at) == (1, 64, 0.0)
    assert first.predicted_output_tokens is None  # nothing completed yet
    assert (second.prompt_tokens, second.arrived_at) == (3, 1.0)
    assert second.predicted_output_tokens == 8  # 10 tokens, the nearest power of two


# profiles from simulated sweeps ----------------------------------------------------------
def test_a_point_measures_each_request_as_the_live_sweep_does() -> None:
    samples, wall_s = measure_point(FLAT, 1, 10, 0.001, 3, random.Random(0))
    assert all(s.ok for s in samples)  # far apart: each alone
    for s in samples:
        assert s.ttft == pytest.approx(0.01) and s.e2e == pytest.approx(ALONE_S)
        assert s.gaps == pytest.approx([0.01] * 9)
    assert wall_s > 1000  # from the first arrival to the last response
    too_big = replace(FLAT, kv_tokens=5)
    assert not any(s.ok for s in measure_point(too_big, 1, 10, 1.0, 3, random.Random(0))[0])


def test_a_profile_from_a_simulated_sweep_has_the_grid_and_follows_the_slo() -> None:
    grid = SweepGrid((64, 256), (16, 64), (1.0, 2.0, 4.0), prompts=20)
    a100 = PRESETS["a100"]
    rows = sweep_rows(a100, grid, MODEL)
    assert len(rows) == 5 * 2 * 2 * 3  # AIBrix's five rows per point
    easy = simulated_profile(a100, grid, SloTarget(e2e_s=60.0), MODEL)
    assert (easy.gpu, easy.in_ticks, easy.out_ticks) == ("a100", (64, 256), (16, 64))
    assert easy.slos == {"e2e": 60.0} and easy.percentile == 99
    assert all(v > 0 for row in easy.tputs for v in row)
    assert easy.e2e is not None and all(v > 0 for row in easy.e2e for v in row)
    impossible = simulated_profile(a100, grid, SloTarget(ttft_s=1e-4), MODEL)
    assert all(v == 0 for row in impossible.tputs for v in row)
    assert simulated_profile(a100, grid, SloTarget(e2e_s=60.0), MODEL) is easy  # cached


def test_the_grid_covers_every_size_the_workload_makes() -> None:
    grid = grid_for(MIX)
    rng = random.Random(7)  # not the stream the grid was drawn from
    sizes = [MIX.sample(rng) for _ in range(20_000)]
    for ticks, values in (
        (grid.inputs, [p for p, _ in sizes]),
        (grid.outputs, [o for _, o in sizes]),
    ):
        assert ticks == tuple(int(v) for v in doubling(ticks[0], ticks[-1]))
        assert ticks[0] <= min(values) and ticks[-1] >= max(values)
    assert grid.outputs[-1] >= MIX.max_output  # what the requests ask for at most


def test_the_book_holds_one_profile_per_gpu_type_under_aibrix_keys() -> None:
    grid = SweepGrid((16,), (16,), (1.0,), prompts=5)
    book = profile_book(parse_fleet("2xa100,l20"), grid, SloTarget(e2e_s=5.0), MODEL)
    assert book.keys() == sorted(profile_key(MODEL, gpu) for gpu in ("a100", "l20"))


# SLO routing against least-request on the mix -------------------------------------------------
@pytest.mark.slow(
    reason="simulated steady sweeps of two GPU types, then both strategies on the same mix"
)
def test_slo_routing_beats_least_request_on_chat_with_long_prompts() -> None:
    # A TPAT target of 20 ms: the l20 (20 ms a step at least) cannot serve chat's long answers
    # within it, the a100 can; least-request sends the l20 its share of them anyway. The grid
    # steps by 4 (not 2) to keep the sweep short; it still covers every size.
    coarse = replace(
        grid_for(MIX), inputs=tuple(4**k for k in range(8)), outputs=(1, 4, 16, 64, 256, 1024)
    )
    scenario = Scenario(
        tuple(parse_fleet("a100,l20")),
        MIX,
        slo=SloTarget(tpat_s=0.02),
        measured_requests=500,
        warmup_s=60.0,
        sweep=coarse,
    )
    slo = attainment(run_at(scenario, "slo", 0.6), scenario.slo)
    least = attainment(run_at(scenario, "least-request", 0.6), scenario.slo)
    assert slo > least + 0.03
