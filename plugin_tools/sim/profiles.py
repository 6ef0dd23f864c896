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
from collections.abc import Sequence
from dataclasses import dataclass

from plugin.core.profile import GpuProfile as SloProfile
from plugin.core.profile import ProfileBook, profile_key
from plugin.core.types import SloTarget
from plugin_tools.profile.build import BenchmarkRow, build_profile
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
# The sizes a workload makes are found from this many draws of a fixed-seed stream.
_GRID_DRAWS = 4000


@dataclass(frozen=True, slots=True)
class SweepGrid:
    """The points of a simulated sweep: input x output tokens x offered rates (req/s)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    rates: tuple[float, ...]
    prompts: int = DEFAULT_PROMPTS  # requests per point
    seed: int = 0

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
    )


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
    engine = SimEngine(gpu.name, gpu)
    arrivals = [0.0]
    for _ in range(prompts - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    seqs: list[SimSeq] = []
    ends: list[float] = []  # the end of every engine step, in order
    plan = None
    step_end = math.inf
    now = 0.0
    k = 0
    while True:
        if k < prompts and arrivals[k] < step_end:
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
    steps = [b - a for a, b in itertools.pairwise(ends)]  # steps[j]: from end j to end j + 1
    samples = []
    for seq in seqs:
        if seq.finish_at < 0:  # too large for the KV cache: never served
            samples.append(Sample(False, 0.0))
            continue
        first = bisect.bisect_left(ends, seq.first_token_at)
        last = bisect.bisect_left(ends, seq.finish_at)
        ttft = seq.first_token_at - seq.arrival
        samples.append(Sample(True, seq.finish_at - seq.arrival, ttft, steps[first:last]))
    return samples, max(now, arrivals[-1])


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


@functools.lru_cache(maxsize=32)
def simulated_profile(
    gpu: GpuProfile, grid: SweepGrid, slo: SloTarget, model: str, percentile: int = 99
) -> SloProfile:
    """The profile `profile build` would make of `gpu`'s simulated sweep for `slo`."""
    if not slo.slos():
        raise ValueError("an SLO profile needs at least one latency target")
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
