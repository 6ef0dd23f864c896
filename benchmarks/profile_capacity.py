"""What a GPU profile says a replica sustains, against what the replica really sustains.

For the simulated a100 and the chat mix at TTFT 1 s + TPOT 60 ms (p99 per request):

- **Steady-state figure**: the highest Poisson rate of the chat mix at which the replica alone
  keeps 99% of 2,000 measured requests within the SLO (`plugin_tools.sim.sweep.slo_capacities`,
  bisection).
- **A profile's implied capacity**: the rate at which the mix fills the replica by the profile,
  1 / sum over requests' cells of (share / rate), the cells the gateway maps each size to (the
  nearest tick in log2; sizes a profile gives 0 are left out and counted); the rate is what the
  gateway and the optimizer charge, `mix_tputs` (a long prompt costs at most as many shorter
  ones as it is longer), and beside it `tputs` alone (each size as if it came alone).
- **Profiles**: the steady-state sweep (`profile sweep`'s default), AIBrix's sweep and build
  rule with 100 and 400 prompts per point, and the per-cell oracle: each cell alone bisected to
  1% on 2,400 Poisson requests at 99% attainment, the best any per-size profile can say.
- **Cost** of sweeping AIBrix's 8 x 5 grid (inputs 128..2048, outputs 4..512) on the a100 with
  the live sweep's defaults (rates 0.1..512 req/s): AIBrix's sweep (rates 1..64 doubling, 100
  prompts each) against the steady sweep with and without its cuts (ceilings from smaller
  cells and predicted starts), in GPU-minutes and in wall minutes on 1, 2 and 4 replicas.

Prints the tables and writes the `profile-capacity` section of docs/benchmarks.md.

    python benchmarks/profile_capacity.py        # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from plugin.core.profile import GpuProfile as SloProfile
from plugin_tools.docsection import write_section
from plugin_tools.profile.steady import Probe, ProbePlan, slo_e2e_bound, sweep_wall_seconds
from plugin_tools.profile.sweep import doubling
from plugin_tools.sim.engine import PRESETS, GpuProfile
from plugin_tools.sim.fleet import MODEL
from plugin_tools.sim.metrics import DEFAULT_SLO
from plugin_tools.sim.profiles import (
    SweepGrid,
    grid_for,
    measure_point,
    run_probe,
    simulated_profile,
    steady_sweep,
)
from plugin_tools.sim.sweep import Scenario, slo_capacities
from plugin_tools.sim.workload import CHAT

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "profile-capacity"
GPU = "a100"
DRAWS = 20_000  # chat requests drawn to weigh the cells
ISSUE_CELLS = ((32, 256), (128, 256), (1024, 256), (4096, 64))  # (input, output)
ORACLE_REQUESTS = 2400
AIBRIX_RULES = {"AIBrix's rule, 100 prompts": 100, "AIBrix's rule, 400 prompts": 400}
AIBRIX_GRID = SweepGrid(
    tuple(int(v) for v in doubling(128, 2048)),
    tuple(int(v) for v in doubling(4, 512)),
    tuple(doubling(1, 64)),
)


def implied(
    profile: SloProfile, sizes: list[tuple[int, int]], mixed: bool = True
) -> tuple[float, float]:
    """(requests/s the profile says the mix fills a replica at, share of requests it gives 0),
    charging each request by `mix_tputs` (`mixed`, as the gateway does) or by `tputs`."""
    grid = profile.mix_tputs if mixed else profile.tputs
    load = 0.0
    zero = 0
    for prompt, output in sizes:
        i, j = profile.cell(prompt, output)
        tput = grid[i][j]
        if tput > 0:
            load += 1.0 / tput
        else:
            zero += 1
    served = len(sizes) - zero
    return (served / load if load > 0 else 0.0), zero / len(sizes)


def _attains(gpu: GpuProfile, cell: tuple[int, int], rate: float) -> bool:
    inp, out = cell
    warm = math.ceil(rate * 2 * slo_e2e_bound(DEFAULT_SLO, inp, out))
    plan = ProbePlan(rate, warm, warm + ORACLE_REQUESTS)
    outcomes = run_probe(gpu, cell, Probe(rate, 1, "search"), plan)[warm:]
    return sum(o.meets(DEFAULT_SLO) for o in outcomes) >= 0.99 * len(outcomes)


def oracle_rate(gpu: GpuProfile, cell: tuple[int, int], guess: float) -> float:
    """The cell alone, bisected to 1%: the highest rate keeping 99% of 2,400 within the SLO."""
    lo, hi = 0.0, max(guess * 1.5, 0.05)
    while _attains(gpu, cell, hi) and hi < 4096:
        lo, hi = hi, hi * 2
    while hi - lo > 0.01 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _attains(gpu, cell, mid) else (lo, mid)
    return lo


def aibrix_sweep_seconds(gpu: GpuProfile) -> float:
    """AIBrix's benchmark on its grid: every doubling rate, 100 prompts each, first send to last
    answer (what a replica is busy for)."""
    total = 0.0
    for inp in AIBRIX_GRID.inputs:
        for out in AIBRIX_GRID.outputs:
            for rate in AIBRIX_GRID.rates:
                rng = random.Random(f"aibrix-{inp}-{out}-{rate}")
                total += measure_point(gpu, inp, out, rate, AIBRIX_GRID.prompts, rng)[1]
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-doc", action="store_true", help="print only")
    args = parser.parse_args()
    started = time.perf_counter()
    gpu = PRESETS[GPU]
    rng = random.Random(0)
    sizes = [CHAT.sample(rng) for _ in range(DRAWS)]

    steady_state = slo_capacities(Scenario((gpu,), CHAT))[f"{GPU}-0"]
    grid = grid_for(CHAT)
    profiles = {
        "steady-state sweep (default)": simulated_profile(gpu, grid, DEFAULT_SLO, MODEL),
        **{
            name: simulated_profile(
                gpu, replace(grid, rule="aibrix", prompts=prompts), DEFAULT_SLO, MODEL
            )
            for name, prompts in AIBRIX_RULES.items()
        },
    }
    steady = profiles["steady-state sweep (default)"]
    cells = Counter(steady.cell(p, o) for p, o in sizes)
    oracle_tputs = [list(row) for row in steady.tputs]
    for (i, j), _ in cells.most_common():
        cell = (steady.in_ticks[j], steady.out_ticks[i])
        oracle_tputs[i][j] = oracle_rate(gpu, cell, steady.tputs[i][j])
    oracle = replace(steady, tputs=tuple(tuple(row) for row in oracle_tputs))
    profiles["per-cell oracle (best a per-size profile can say)"] = oracle
    figures = {
        name: (implied(p, sizes), implied(p, sizes, mixed=False)) for name, p in profiles.items()
    }

    lines = [
        "## What a GPU profile says a replica sustains",
        "",
        f"Generated by `python benchmarks/profile_capacity.py` ({{elapsed}} s here, 2-core "
        "machine; deterministic). The simulated a100 alone, the chat mix (prompts median 40 "
        "tokens up to 4k, answers median 280 up to 1k), SLO TTFT <= 1 s and TPOT <= 60 ms per "
        "request at p99. **Steady-state figure**: the highest Poisson rate of the mix at which "
        "the replica keeps 99% of 2,000 measured requests within the SLO (bisection, "
        f"`slo_capacities`): **{steady_state:.2f} req/s**. **Implied capacity** of a profile: 1 / "
        f"sum of share / rate over {DRAWS:,} drawn requests, each in the cell the gateway maps "
        "it to (nearest tick in log2; a cell at 0 is left out and its share given), the rate "
        "being what the gateway and the optimizer charge a request, `mix_tputs` (a long prompt "
        "counts as at most as many shorter ones as it is longer, `plugin.core.profile`), and "
        "beside it `tputs` alone (every size charged as if it came alone). The **oracle** bisects "
        "each cell the mix uses alone to 1% at 99% of 2,400 Poisson requests: the best any "
        "per-size profile can say of this mix.",
        "",
        "| profile | implied req/s (mix_tputs) | over the steady-state figure | implied req/s "
        "(tputs alone) | over the steady-state figure | requests at tputs 0 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, ((rate, zero), (alone, _)) in figures.items():
        lines.append(
            f"| {name} | {rate:.2f} | {rate / steady_state:.2f} | {alone:.2f} | "
            f"{alone / steady_state:.2f} | {zero:.2%} |"
        )
    lines += [
        "",
        "Per cell (req/s; the cells the issue named):",
        "",
        "| cell (in:out) | steady-state sweep | its mix_tputs | AIBrix 100 prompts | "
        "AIBrix 400 prompts | oracle |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for inp, out in ISSUE_CELLS:
        i, j = steady.out_ticks.index(out), steady.in_ticks.index(inp)
        row = [profiles[name].tputs[i][j] for name in AIBRIX_RULES]
        o = oracle.tputs[i][j] if (i, j) in cells else oracle_rate(gpu, (inp, out), row[0])
        values = [steady.tputs[i][j], steady.mix_tputs[i][j], *row, o]
        lines.append(f"| {inp}:{out} | " + " | ".join(f"{v:.2f}" for v in values) + " |")

    # Where the implied figure goes: the 2k and 4k prompts' share of it, each way of charging.
    def heavy_share(grid: tuple[tuple[float, ...], ...]) -> float:
        weights = {(i, j): n / grid[i][j] for (i, j), n in cells.items() if grid[i][j] > 0}
        return sum(w for (_, j), w in weights.items() if steady.in_ticks[j] >= 2048) / sum(
            weights.values()
        )

    lines += [
        "",
        "Where it goes: prompts of 2k and 4k tokens are "
        f"{sum(n for (i, j), n in cells.items() if steady.in_ticks[j] >= 2048) / DRAWS:.1%} of "
        f"the requests and {heavy_share(steady.tputs):.0%} of the load `tputs` alone imply "
        f"({heavy_share(steady.mix_tputs):.0%} of what `mix_tputs` implies). A stream of nothing "
        "but 4k-token prompts misses its TTFT as soon as two arrive together, so alone such a "
        "cell sustains well under 1 req/s, while inside the mix the same prompts cost little "
        "more than their prefill: charging them by `tputs` buys capacity for collisions the mix "
        "rarely has. `mix_tputs` charges a 4k prompt at most twice a 2k one, which the profile "
        "measured where it is bound by its own throughput; what is left between the per-cell "
        "oracle and the steady-state figure is answers rounded to the nearest tick in log2 and "
        "the 10% to which the sweep bisects.",
    ]

    # Cost on AIBrix's grid with the live sweep's defaults.
    live = replace(AIBRIX_GRID, rates=(0.1, 512.0), floor=0.1)
    with_cuts = steady_sweep(gpu, live, DEFAULT_SLO, MODEL)
    without = steady_sweep(gpu, replace(live, rates=(1.0, 512.0), cuts=False), DEFAULT_SLO, MODEL)
    aibrix_s = aibrix_sweep_seconds(gpu)

    def walls(cell_seconds: dict[tuple[int, int], float] | None, total: float) -> str:
        out = []
        for n in (1, 2, 4):
            if cell_seconds is None:
                out.append(f"{total / n / 60:.0f}")
            else:
                wall = sweep_wall_seconds(cell_seconds, live.inputs, live.outputs, n)
                out.append(f"{wall / 60:.0f}")
        return " / ".join(out)

    lines += [
        "",
        "### What a sweep of AIBrix's 8 x 5 grid costs",
        "",
        f"The a100, inputs {live.inputs[0]}..{live.inputs[-1]} x outputs {live.outputs[0]}.."
        f"{live.outputs[-1]} (40 cells), the SLO above. GPU-minutes: each probe's span, first "
        "send to last answer, summed (one replica busy). Wall minutes on 1 / 2 / 4 replicas of "
        "one deployment: the steady sweep runs a cell once the cells one tick smaller on each "
        "axis are done; AIBrix's points are independent (its time divides).",
        "",
        "| sweep | probes | requests | GPU-minutes | wall minutes on 1 / 2 / 4 replicas |",
        "| --- | --- | --- | --- | --- |",
        f"| AIBrix's (rates 1..64 doubling, 100 prompts) | {40 * 7} | {40 * 7 * 100:,} "
        f"| {aibrix_s / 60:.0f} | {walls(None, aibrix_s)} |",
        f"| steady, no cuts (every cell doubles up from 1 req/s) | {without.probes} "
        f"| {without.requests:,} | {without.gpu_seconds / 60:.0f} "
        f"| {walls(dict(without.cell_seconds), without.gpu_seconds)} |",
        f"| steady (default: ceilings and predicted starts) | {with_cuts.probes} "
        f"| {with_cuts.requests:,} | {with_cuts.gpu_seconds / 60:.0f} "
        f"| {walls(dict(with_cuts.cell_seconds), with_cuts.gpu_seconds)} |",
        "",
        "A steady probe runs until the replica's batch has filled (twice the longest E2E the SLO "
        "allows) and then judges at least 299 requests (p99 at 95% confidence), four times as "
        "many to confirm; a probe too close to call doubles up to 2,392. That is the price of a "
        "profile that says what the GPU sustains rather than what 100 requests showed. The "
        "costliest cells are the ones the SLO barely allows, probed at low rates.",
    ]
    elapsed = time.perf_counter() - started
    text = "\n".join(lines).replace("{elapsed}", f"{elapsed:.0f}")
    print(text)
    if not args.no_doc:
        print(f"\nwrote {write_section(DOC, SECTION, text)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
