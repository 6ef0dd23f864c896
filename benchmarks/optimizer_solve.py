"""How long the GPU optimizer's MILP takes: `solve` on random but realistic mixes of GPU types.

Each instance is a profile grid of input x output token cells (AIBrix's grid has 8 output x 5
input ticks: 40 cells) and a few GPU types from a catalogue of eight with hourly-price-like costs.
A type's `tputs` fall as requests grow (prefill plus decode work per request, scaled by the
type's speed, +-15% noise) and are 0 where one request alone would miss a 5 s end-to-end SLO on
it, so slow types cannot serve the long cells. Traffic spreads over the cells with gamma-distributed
weights (about a third of the cells idle) at a total of 2, 20 or 200 req/s, headroom 1.1. The
"capped" rows cap the two types the uncapped plan uses most at half its count of them, so the plan
must fall back to pricier types, or runs short where only those serve a cell.

    python benchmarks/optimizer_solve.py         # about half a minute on 2 cores

Each instance is solved `RUNS` times; the table gives the median over instances of each instance's
median wall time (`time.perf_counter`), the slowest instance's median, and what the plans came to.
It is printed and written into the `optimizer-solve` section of docs/benchmarks.md. Absolute
times depend on the machine; read how they grow with the problem within one run.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import scipy

from plugin.core.optimizer import Candidate, Plan, Problem, solve
from plugin_tools.docsection import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
RUNS = 5
SEEDS = 4  # random instances per (size, rate)
RATES = (2.0, 20.0, 200.0)  # total req/s
HEADROOM = 1.1
E2E_SLO_S = 5.0


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    cost: float  # per replica-hour, roughly cloud list prices
    speed: float  # relative to an A100


CATALOGUE = (
    Gpu("h100", 4.0, 2.2),
    Gpu("a100", 2.5, 1.0),
    Gpu("l40s", 1.8, 0.8),
    Gpu("a40", 1.3, 0.55),
    Gpu("l20", 1.1, 0.5),
    Gpu("a10", 0.75, 0.33),
    Gpu("l4", 0.7, 0.3),
    Gpu("t4", 0.35, 0.12),
)


@dataclass(frozen=True, slots=True)
class Size:
    types: int
    out_ticks: int
    in_ticks: int
    capped: bool = False

    @property
    def cells(self) -> int:
        return self.out_ticks * self.in_ticks

    @property
    def label(self) -> str:
        return f"{self.types} x {self.cells}" + (" capped" if self.capped else "")


SIZES = (
    Size(2, 2, 5),
    Size(4, 8, 5),
    Size(4, 8, 5, capped=True),
    Size(8, 16, 5),
    Size(8, 16, 5, capped=True),
)


def grid(size: Size) -> list[tuple[int, int]]:
    """(input, output) tokens per cell, as AIBrix's ticks: powers of two."""
    outs = [2 ** (2 + i * 8 // size.out_ticks) for i in range(size.out_ticks)]
    ins = [2 ** (7 + i) for i in range(size.in_ticks)]
    return [(i, o) for o in outs for i in ins]


def tput(gpu: Gpu, tokens_in: int, tokens_out: int, rng: random.Random) -> float:
    """Requests/s one replica sustains within the SLO; 0 if one request alone misses it."""
    alone_s = (0.0002 * tokens_in + 0.009 * tokens_out) / math.sqrt(gpu.speed)
    if alone_s > E2E_SLO_S:
        return 0.0
    return gpu.speed * 12000.0 / (tokens_in + 20 * tokens_out) * rng.uniform(0.85, 1.15)


def instance(size: Size, total_rate: float, rng: random.Random) -> Problem:
    cells = grid(size)
    gpus = rng.sample(CATALOGUE, size.types)
    weights = [0.0 if rng.random() < 0.35 else rng.gammavariate(0.6, 1.0) for _ in cells]
    norm = sum(weights) or 1.0
    rates = tuple(total_rate * w / norm for w in weights)
    cands = tuple(
        Candidate(f"default/llama-{g.name}", g.cost, tuple(tput(g, i, o, rng) for i, o in cells))
        for g in gpus
    )
    problem = Problem(rates, cands, HEADROOM)
    if not size.capped:
        return problem
    # Cap the two types the uncapped plan uses most at half their count (rounded down): the plan
    # must move traffic to pricier types, or run short where only the capped ones serve a cell.
    plan = solve(problem)
    most = sorted(cands, key=lambda c: plan.replicas[c.name], reverse=True)[:2]
    capped = tuple(
        Candidate(c.name, c.cost, c.tputs, max_replicas=plan.replicas[c.name] // 2)
        if c in most
        else c
        for c in cands
    )
    return Problem(rates, capped, HEADROOM)


def best_single_type(problem: Problem) -> float | None:
    """The cheapest plan that uses one type only (uncapped), if any type serves every cell."""
    costs = []
    for c in problem.candidates:
        if any(r > 0 and t == 0 for r, t in zip(problem.rates, c.tputs, strict=True)):
            continue
        alone = Candidate(c.name, c.cost, c.tputs)
        costs.append(solve(Problem(problem.rates, (alone,), problem.headroom)).cost)
    return min(costs) if costs else None


@dataclass(slots=True)
class Row:
    size: Size
    variables: list[int]
    times_ms: list[float]
    statuses: Counter[str]
    replicas: list[int]
    saving: dict[float, list[float]]  # per total rate: 1 - mixed cost / best single type's


def measure(size: Size) -> Row:
    row = Row(size, [], [], Counter(), [], {rate: [] for rate in RATES})
    for rate in RATES:
        for seed in range(SEEDS):
            rng = random.Random(f"{size.label}/{rate}/{seed}")
            problem = instance(size, rate, rng)
            runs: list[float] = []
            plan: Plan | None = None
            for _ in range(RUNS):
                t0 = time.perf_counter()
                plan = solve(problem)
                runs.append((time.perf_counter() - t0) * 1000.0)
            assert plan is not None
            row.times_ms.append(statistics.median(runs))
            row.variables.append(
                sum(
                    1
                    for k, r in enumerate(problem.rates)
                    if r > 0
                    for c in problem.candidates
                    if c.tputs[k] > 0
                )
            )
            row.statuses[plan.status] += 1
            row.replicas.append(sum(plan.replicas.values()))
            single = None if size.capped else best_single_type(problem)
            if single:
                row.saving[rate].append(1.0 - plan.cost / single)
    print(
        f"  {size.label:14s} median {statistics.median(row.times_ms):7.1f} ms"
        f"  slowest {max(row.times_ms):7.1f} ms",
        file=sys.stderr,
        flush=True,
    )
    return row


def table(rows: list[Row]) -> str:
    head = (
        "| types x cells | instances | assignment variables | solve ms, median | solve ms, "
        "slowest | plans | replicas, median | saving vs best single type, median at "
        + ", ".join(f"{r:g}" for r in RATES)
        + " req/s |"
    )
    rule = "| --- | --- | --- | --- | --- | --- | --- | --- |"
    lines = [head, rule]
    for r in rows:
        plans = ", ".join(f"{n} {s}" for s, n in sorted(r.statuses.items()))
        saving = " / ".join(f"{statistics.median(v):.0%}" if v else "-" for v in r.saving.values())
        lines.append(
            f"| {r.size.label} | {len(r.times_ms)} | {min(r.variables)}-{max(r.variables)} "
            f"| {statistics.median(r.times_ms):.1f} | {max(r.times_ms):.1f} | {plans} "
            f"| {statistics.median(r.replicas):.0f} | {saving} |"
        )
    return "\n".join(lines)


def main() -> None:
    solve(instance(SIZES[0], 2.0, random.Random(0)))  # import SciPy before timing anything
    rows = [measure(size) for size in SIZES]
    text = (
        "## GPU optimizer: solve time\n\n"
        "Generated by `python benchmarks/optimizer_solve.py`: `plugin.core.optimizer.solve` "
        f"(SciPy {scipy.__version__} `milp`, HiGHS) on random but realistic instances: a profile "
        "grid of input x output token cells (40 cells is AIBrix's 8 x 5 grid), GPU types drawn "
        "from a catalogue of eight (H100 to T4) with hourly-price-like costs, `tputs` falling with "
        "request size and 0 where one request alone would miss a 5 s end-to-end SLO, traffic on "
        f"about two thirds of the cells at {', '.join(f'{r:g}' for r in RATES)} req/s in total "
        f"({SEEDS} instances each), headroom {HEADROOM}. `capped` caps the two types the uncapped "
        "plan uses most at half its count of them, so plans fall back to pricier types or run "
        "short (a short plan solves three programs: the most the capped fleet serves, its "
        "cheapest mix, that fleet's shares once more). Times are wall milliseconds, the median "
        f"of {RUNS} runs per instance; the table gives the median and the slowest instance. The "
        "last column compares each uncapped plan with the cheapest fleet of one type alone that "
        "serves every cell, where one exists.\n\n"
        f"{table(rows)}\n\n"
        "Solve time is not asserted anywhere: the optimizer service solves once per window "
        "(tens of seconds), so even the largest size leaves it idle nearly all the time.\n"
    )
    print(table(rows))
    print(f"wrote {write_section(DOC, 'optimizer-solve', text).name}", file=sys.stderr)


if __name__ == "__main__":
    main()
