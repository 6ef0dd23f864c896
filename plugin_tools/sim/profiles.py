"""GPU profiles of the simulated GPU types, measured as `profile sweep` measures a real deployment
and built by the same code (`rows_for`, `build_profile`), so SLO routing in the simulator reads
what it would read in production.

For one GPU type and each (input, output, rate) point of a doubling grid: one engine alone,
`prompts` requests of exactly that size arriving as a Poisson process at the rate (the first at
once, as the sweep sends it). Each request gives a `Sample`: served or not, E2E, TTFT and the
gaps between its tokens (a simulated stream sends one token per chunk). `rows_for` turns a
point's samples into AIBrix's five rows and `build_profile` the rows into the profile for an SLO.

Two departures from the live sweep, both to keep a run short: a point costs simulated time, not
wall time; and a cell's rates stop rising after one at which the engine served less than half
the offered rate (every higher rate falls further behind, so none of them could be kept up
with). A sequence that was preempted is given a gap per engine step from its first token to its
last, so its gaps can outnumber its tokens; their sum is still its decode time.

Rows and profiles are cached per GPU type and grid (and SLO and percentile) for the process:
every run of a study with an SLO strategy reuses them.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from plugin.core.profile import GpuProfile as SloProfile
from plugin.core.profile import ProfileBook, profile_key
from plugin.core.types import SloTarget
from plugin_tools.profile.build import BenchmarkRow, build_profile
from plugin_tools.profile.steady import (
    Cell,
    GridSearch,
    Outcome,
    Probe,
    ProbePlan,
    bounding_axes,
    build_steady_profile,
    sweep_grid,
)
from plugin_tools.profile.sweep import Sample, SweepPlan, doubling, rows_for
from plugin_tools.sim.engine import GpuProfile, SimEngine, SimSeq
from plugin_tools.sim.workload import LengthSource

__all__ = [
    "OVERLOADED",
    "SweepGrid",
    "grid_for",
    "measure_point",
    "profile_book",
    "simulated_profile",
    "sweep_rows",
]

OVERLOADED = 0.5  # a rate served below this share of the offered rate ends the cell's sweep
DEFAULT_RATES = (0.25, 1024.0)  # req/s, each doubling (a cell stops once overloaded)
DEFAULT_PROMPTS = 100
STEADY_FLOOR = 0.01  # req/s: a cell that sustains less is unservable (simulated time is cheap)
# The sizes a workload makes are found from this many draws of a fixed-seed stream.
_GRID_DRAWS = 4000


@dataclass(frozen=True, slots=True)
class SweepGrid:
    """The points of a simulated sweep: input x output tokens x offered rates (req/s)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    rates: tuple[float, ...]
    prompts: int = DEFAULT_PROMPTS  # requests per point (AIBrix's rule only)
    seed: int = 0
    # "steady": `profile sweep`'s steady-state search (rates[0] its floor, rates[-1] its limit);
    # "aibrix": AIBrix's sweep (every doubling rate, `prompts` each) and build rule.
    rule: str = "steady"
    cuts: bool = True  # the steady search's ceilings and predictions (`GridSearch.cuts`)
    floor: float = STEADY_FLOOR  # the steady search's: below it a cell is unservable

    def plan(self, gpu: str, model: str) -> SweepPlan:
        """The live sweep's plan for these points (its rows carry the plan's seed and model)."""
        return SweepPlan(
            f"sim://{gpu}",
            model,
            self.inputs,
            self.outputs,
            self.rates,
            prompts=self.prompts,
            seed=self.seed,
        )


def _ticks(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from the one at or below half of `low` (a margin for sizes the draws
    missed) to the one at or above `high`."""
    first = 2 ** math.floor(math.log2(max(low // 2, 1)))
    last = 2 ** math.ceil(math.log2(max(high, 1)))
    return tuple(int(v) for v in doubling(first, last))


@functools.lru_cache(maxsize=16)
def grid_for(
    lengths: LengthSource,
    rates: tuple[float, float] = DEFAULT_RATES,
    prompts: int = DEFAULT_PROMPTS,
    rule: str = "steady",
) -> SweepGrid:
    """A doubling grid whose input and output ticks span every size `lengths` makes, so every
    request falls inside the profile (a size outside it would leave SLO routing no cell)."""
    rng = random.Random(0)
    sizes = [lengths.sample(rng) for _ in range(_GRID_DRAWS)]
    prompts_seen = [p for p, _ in sizes]
    outputs_seen = [o for _, o in sizes]
    return SweepGrid(
        _ticks(min(prompts_seen), max(prompts_seen)),
        _ticks(min(outputs_seen), max(max(outputs_seen), lengths.max_output)),
        tuple(doubling(*rates)),
        prompts,
        rule=rule,
    )


def _serve(
    gpu: GpuProfile, arrivals: Sequence[float], input_tokens: int, output_tokens: int
) -> tuple[list[SimSeq], list[float], float]:
    """One engine alone serving requests of one size arriving at `arrivals` (sorted): the
    sequences, the end of every engine step in order, and the time the last one ended."""
    engine = SimEngine(gpu.name, gpu)
    seqs: list[SimSeq] = []
    ends: list[float] = []
    plan = None
    step_end = math.inf
    now = 0.0
    k = 0
    while True:
        if k < len(arrivals) and arrivals[k] < step_end:
            now = arrivals[k]
            seq = SimSeq(k, now, input_tokens, output_tokens)
            seqs.append(seq)
            k += 1
            if engine.fits(seq):
                engine.submit(seq)
                if plan is None:
                    plan = engine.plan_step()
                    step_end = now + plan[0] if plan else math.inf
            continue
        if plan is None:
            break
        now = step_end
        engine.finish_step(now, *plan)
        ends.append(now)
        plan = engine.plan_step()
        step_end = now + plan[0] if plan else math.inf
    return seqs, ends, now


def _gaps(seq: SimSeq, ends: list[float], steps: list[float]) -> list[float]:
    """The step durations between a sequence's first token and its last (one token a chunk)."""
    first = bisect.bisect_left(ends, seq.first_token_at)
    last = bisect.bisect_left(ends, seq.finish_at)
    return steps[first:last]


def measure_point(
    gpu: GpuProfile,
    input_tokens: int,
    output_tokens: int,
    rate: float,
    prompts: int,
    rng: random.Random,
) -> tuple[list[Sample], float]:
    """One engine alone serving `prompts` requests of one size at `rate`: (samples, seconds
    from the first arrival to the last response)."""
    arrivals = [0.0]
    for _ in range(prompts - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    seqs, ends, now = _serve(gpu, arrivals, input_tokens, output_tokens)
    steps = [b - a for a, b in itertools.pairwise(ends)]  # steps[j]: from end j to end j + 1
    samples = []
    for seq in seqs:
        if seq.finish_at < 0:  # too large for the KV cache: never served
            samples.append(Sample(False, 0.0))
            continue
        ttft = seq.first_token_at - seq.arrival
        samples.append(Sample(True, seq.finish_at - seq.arrival, ttft, _gaps(seq, ends, steps)))
    return samples, max(now, arrivals[-1])


def run_probe(gpu: GpuProfile, cell: Cell, probe: Probe, plan: ProbePlan) -> list[Outcome]:
    """A steady-state probe on one simulated engine alone (`plugin_tools.profile.steady`); the
    idle probe's requests are one at a time, which on a simulated engine all take the same."""
    input_tokens, output_tokens = cell
    if plan.sequential:
        seqs, ends, _ = _serve(gpu, [0.0], input_tokens, output_tokens)
        one = _outcome(seqs[0], ends, [b - a for a, b in itertools.pairwise(ends)], 0.0)
        e2e = one.e2e_s if one.ok else 0.0
        return [replace(one, sent_s=k * e2e) for k in range(plan.requests)]
    rng = random.Random(f"steady-{probe.seed}-{input_tokens}-{output_tokens}-{probe.rate!r}")
    arrivals = [0.0]
    for _ in range(plan.requests - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(probe.rate))
    seqs, ends, _ = _serve(gpu, arrivals, input_tokens, output_tokens)
    steps = [b - a for a, b in itertools.pairwise(ends)]
    return [_outcome(seq, ends, steps, seq.arrival) for seq in seqs]


def _outcome(seq: SimSeq, ends: list[float], steps: list[float], sent_s: float) -> Outcome:
    if seq.finish_at < 0:  # too large for the KV cache: never served
        return Outcome(sent_s, False, prompt_tokens=seq.prompt_tokens)
    return Outcome(
        sent_s,
        True,
        seq.first_token_at - seq.arrival,
        seq.finish_at - seq.arrival,
        seq.output_tokens,
        seq.prompt_tokens,
        tuple(_gaps(seq, ends, steps)),
    )


@functools.lru_cache(maxsize=16)
def sweep_rows(gpu: GpuProfile, grid: SweepGrid, model: str) -> tuple[BenchmarkRow, ...]:
    """AIBrix's benchmark rows of `gpu` over `grid`, in the live sweep's order."""
    plan = grid.plan(gpu.name, model)
    rows: list[BenchmarkRow] = []
    for input_tokens in grid.inputs:
        for output_tokens in grid.outputs:
            for rate in grid.rates:
                rng = random.Random(f"sweep-{grid.seed}-{input_tokens}-{output_tokens}-{rate}")
                samples, wall_s = measure_point(
                    gpu, input_tokens, output_tokens, rate, grid.prompts, rng
                )
                point = rows_for(plan, input_tokens, output_tokens, rate, samples, wall_s)
                rows.extend(point)
                served_rate = point[0].mean  # TPUT
                if served_rate < OVERLOADED * rate:
                    break
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class SteadySweep:
    """A simulated steady sweep of one GPU type: its rows and what it cost."""

    rows: tuple[BenchmarkRow, ...]
    cell_seconds: Mapping[Cell, float]  # per cell, its probes' spans (first send to last answer)
    probes: int
    requests: int

    @property
    def gpu_seconds(self) -> float:
        """What the sweep costs on one replica."""
        return sum(self.cell_seconds.values())


@functools.lru_cache(maxsize=32)
def steady_sweep(
    gpu: GpuProfile, grid: SweepGrid, slo: SloTarget, model: str, percentile: int = 99
) -> SteadySweep:
    """`profile sweep`'s steady-state search of `gpu` over `grid`'s cells for `slo`, each probe
    run on one simulated engine alone."""
    search = GridSearch(
        grid.inputs,
        grid.outputs,
        rate_start=grid.rates[0],
        rate_limit=grid.rates[-1],
        floor=grid.floor,
        cuts=grid.cuts,
        monotone_in=bounding_axes(slo)[0],
        monotone_out=bounding_axes(slo)[1],
    )
    rows: list[BenchmarkRow] = []
    seconds: dict[Cell, float] = {}
    counts = [0, 0]

    def run(cell: Cell, probe: Probe, plan: ProbePlan) -> list[Outcome]:
        outcomes = run_probe(gpu, cell, probe, plan)
        span = max((o.done_s for o in outcomes if o.ok), default=0.0)
        seconds[cell] = seconds.get(cell, 0.0) + span
        counts[0] += 1
        counts[1] += len(outcomes)
        return outcomes

    sweep_grid(search, slo, percentile, model, run, rows.extend)
    return SteadySweep(tuple(rows), seconds, counts[0], counts[1])


@functools.lru_cache(maxsize=32)
def simulated_profile(
    gpu: GpuProfile, grid: SweepGrid, slo: SloTarget, model: str, percentile: int = 99
) -> SloProfile:
    """The profile `profile build` would make of `gpu`'s simulated sweep for `slo` (the
    steady rule, or AIBrix's, as `grid.rule` says)."""
    if not slo.slos():
        raise ValueError("an SLO profile needs at least one latency target")
    if grid.rule == "steady":
        rows = steady_sweep(gpu, grid, slo, model, percentile).rows
        return build_steady_profile(rows, gpu.name, cost=1.0, created=0.0).profile
    return build_profile(
        sweep_rows(gpu, grid, model),
        gpu.name,
        slos=slo.slos(),
        percentile=percentile,
        cost=1.0,
        created=0.0,
    )


def profile_book(
    gpus: Sequence[GpuProfile], grid: SweepGrid, slo: SloTarget, model: str, percentile: int = 99
) -> ProfileBook:
    """Each GPU type's profile under AIBrix's key for `model` (deployment = the GPU type)."""
    book = ProfileBook()
    book.replace(
        {
            profile_key(model, gpu.name): simulated_profile(gpu, grid, slo, model, percentile)
            for gpu in dict.fromkeys(gpus)
        }
    )
    return book
