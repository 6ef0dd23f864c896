"""The GPU optimizer in a closed loop in the fleet simulator: what its plan costs against the best
single GPU type, and whether the fleet it plans meets the SLO.

For each offered rate (`plugin_tools.sim.closed_loop`): 240 s of chat traffic become the trace
windows the gateway writes; the optimizer service's own path (`plugin.core.workload.traffic`,
`build_problem`, `plugin.core.optimizer.solve`) plans replicas of h100, a100 and a10 from them
and the simulated GPU profiles, priced per hour; the planned fleet then serves the traffic that
follows under load-balance, least-request and round-robin. Beside it, the cheapest fleet of one
GPU type alone that serves every cell, under load-balance, and the cheapest fleet of any mix
that holds 99% of requests within the SLO, found by search (`cheapest_fleet`). It runs with GPU
profiles from the steady-state sweep (`profile sweep`'s default) and, to compare, from AIBrix's
sweep and rule (100 prompts per point). Prints the tables and writes the `optimizer-plan`
section of docs/benchmarks.md.

    python benchmarks/optimizer_plan.py          # about 30 minutes on 2 cores

Deterministic for the seed (`--seed`); prices are illustrative and overridable (`--price`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from plugin_tools.docsection import write_section
from plugin_tools.sim.closed_loop import (
    PRICE_SOURCE,
    PRICES,
    SINGLE_STRATEGY,
    STRATEGIES,
    Cheapest,
    ClosedLoop,
    RatePoint,
    cheapest_fleet,
    run_closed_loop,
    type_capacities,
)
from plugin_tools.sim.engine import PRESETS
from plugin_tools.sim.metrics import DEFAULT_SLO
from plugin_tools.sim.profiles import DEFAULT_RATES, grid_for
from plugin_tools.sim.sweep import Scenario
from plugin_tools.sim.traces import parse_workload
from plugin_tools.sim.workload import Arrivals

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
TRACE_DIR = ROOT.parent / "shared" / "data" / "traces"
SECTION = "optimizer-plan"
RATES = (0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0)
PROFILES = ("steady", "aibrix")  # the simulated sweep's rule (AIBrix's: 100 prompts a point)
UTILISATION_FROM = 16.0  # req/s: from here whole replicas weigh little against the fleet
TARGET = 0.99
LB = "load-balance"


@dataclass(frozen=True, slots=True)
class Run:
    rule: str  # the profiles' sweep: "steady" or "aibrix"
    points: list[RatePoint]
    profile_s: float  # wall seconds to build the profiles
    loop_s: float  # wall seconds for the rates
    cheapest: dict[float, Cheapest]  # per rate, the searched cheapest fleet (steady run only)
    capacity: dict[str, float]  # per GPU type: req/s one replica sustains of the workload

    @property
    def title(self) -> str:
        if self.rule == "steady":
            return "the steady-state sweep (the default)"
        return "AIBrix's sweep and rule, 100 prompts per point"


def _money(v: float | None) -> str:
    return "-" if v is None else f"${v:.2f}"


def _att(v: float) -> str:
    return f"{v:.3f}"


def _replicas(replicas: dict[str, int], gpus: Sequence[str]) -> str:
    return " / ".join(str(replicas.get(g, 0)) for g in gpus)


def table(run: Run, gpus: Sequence[str]) -> list[str]:
    search = bool(run.cheapest)
    head = (
        f"| req/s | plan: {' / '.join(gpus)} | plan $/h | best single type | its $/h | saving "
        f"| attainment: {' / '.join(STRATEGIES)} | best single type, {SINGLE_STRATEGY} "
        "| fleet utilisation | rate / fleet's steady capacity |"
    )
    cols = 10
    every = any(p.every is not None for p in run.points)
    if every:
        head += " plan $/h, every request in the SLO |"
        cols += 1
    if search:
        head += " cheapest fleet holding 99% (search) | its $/h | plan / cheapest |"
        cols += 3
    lines = [head, "|" + " --- |" * cols]
    for p in run.points:
        single = p.single
        saving = p.saving
        mark = "*" if p.plan.infeasible_cells else ""
        line = (
            f"| {p.rate:g} | {_replicas(p.mixed.replicas, gpus)}{mark} | {_money(p.mixed.cost)} "
            f"| {'-' if single is None else f'{sum(single.replicas.values())} x {p.single_gpu}'} "
            f"| {_money(None if single is None else single.cost)} "
            f"| {'-' if saving is None else f'{saving:.0%}'} "
            f"| {' / '.join(_att(p.mixed.attainment[s]) for s in STRATEGIES)} "
            f"| {'-' if single is None else _att(single.attainment[SINGLE_STRATEGY])} "
            f"| {p.mixed.utilization[SINGLE_STRATEGY]:.0%} "
            f"| {_loaded(p.rate, p.mixed.replicas, run.capacity)} |"
        )
        if every:
            line += f" {_money(None if p.every is None else p.every.cost)} |"
        if search:
            found = run.cheapest[p.rate].run
            if found is None:
                line += " none found | - | - |"
            else:
                ratio = p.mixed.cost / found.cost if found.cost > 0 else math.nan
                line += f" {_replicas(found.replicas, gpus)} | {_money(found.cost)} | {ratio:.2f} |"
        lines.append(line)
    return lines


def _loaded(rate: float, replicas: dict[str, int], capacity: dict[str, float]) -> str:
    ceiling = math.fsum(capacity[g] * n for g, n in replicas.items())
    return "-" if ceiling <= 0 else f"{rate / ceiling:.0%}"


def _span(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)} to {format(hi, fmt)}"


def render(runs: Sequence[Run], loop: ClosedLoop, elapsed_s: float, workload: str) -> str:
    s = loop.scenario
    gpus = list(loop.gpus)
    grid = s.sweep_grid()
    prices = ", ".join(f"{g} ${loop.costs[g]:.2f}" for g in gpus)
    slo = " and ".join(f"{k.upper()} <= {v:g} s" for k, v in s.slo.slos().items())
    lines = [
        "## GPU optimizer in a closed loop: plan cost and SLO attainment in the simulator"
        + ("" if s.arrivals.kind != "trace" else f", {workload} trace"),
        "",
        f"Generated by `python benchmarks/optimizer_plan.py` ({elapsed_s:.0f} s here, 2-core "
        "machine; deterministic for the seed). For each offered rate, the loop the optimizer "
        f"service runs, in simulated time: {loop.trace_s} s of traffic become the trace windows "
        "the gateway writes (10 s windows, counts keyed by the log2 size bucket of each request, "
        "`meta_total_reqs` the arrivals; read back from their JSON), the service's own path "
        "(`plugin.core.workload.traffic` over the same look-back, `build_problem`, "
        "`plugin.core.optimizer.solve`) plans replicas per GPU type from them and the GPU "
        "profiles, and a fleet of that many simulated engines serves the requests that follow "
        "(the same seeded stream, so the plan never sees the requests it is judged on) under "
        f"each strategy. Beside it, the best single type: `solve` with one candidate at a time, "
        f"the cheapest that serves every cell (all but what the attainment target lets the plan "
        f"leave out), its fleet run under {SINGLE_STRATEGY}; and the "
        "cheapest fleet of any mix of the types that keeps 99% of the same requests within the "
        "SLO under load-balance, found by search (`plugin_tools.sim.closed_loop.cheapest_fleet`: "
        "fleets in order of price, each simulated, skipping those whose replicas' steady-state "
        "capacities add up to under 0.85 x the rate or that a failed fleet dominates).",
        "",
        f"- **GPU types and prices** (US$ per replica-hour; illustrative): {prices}. "
        f"Source: {PRICE_SOURCE}. The simulator's engines are models of these GPUs, not "
        "measurements.",
        f"- **Workload** `{workload}` ({_describe(s)}), seed {s.seed}; each run "
        f"{s.warmup_s:.0f} s of warm-up, then {s.measured_requests} measured requests.",
        f"- **SLO** {slo} per request (TPOT: the mean gap after the first token); the profiles "
        f"check it at p{s.profile_percentile}. Headroom {loop.headroom:g}. Attainment target "
        f"{loop.attainment:g} (`HETERO_GATEWAY_OPTIMIZER_ATTAINMENT`): the plan buys for at "
        f"least that share of the requests within the SLO (the search holds {TARGET:g})"
        + (
            "; the cost of the plan that buys for every request is shown beside it."
            if loop.attainment < 1
            else "."
        ),
        "- **GPU profiles** from a simulated `profile sweep` per type (one engine alone, Poisson "
        f"requests of one size per probe) over inputs {grid.inputs[0]}..{grid.inputs[-1]} and "
        f"outputs {grid.outputs[0]}..{grid.outputs[-1]} tokens, each doubling, built by "
        "`profile build`, `cost` set to the price: the steady-state search (rates "
        f"{grid.floor:g}..{grid.rates[-1]:g} req/s), and AIBrix's sweep (rates "
        f"{grid.rates[0]:g}..{grid.rates[-1]:g} doubling, 100 prompts each) with its rule.",
        "- **Columns**: plan = replicas per type; saving = 1 - plan cost / best single type's; "
        "attainment = share of measured requests within the SLO; fleet utilisation = output "
        "tokens/s the plan's fleet delivered under load-balance over its saturated decode "
        "ceiling (every engine decoding a full batch); rate / fleet's steady capacity = the "
        "offered rate over the sum of the plan's replicas' steady-state rates for this workload "
        "within the SLO (each type alone, by bisection: "
        + ", ".join(f"{g} {c:.2f}" for g, c in runs[0].capacity.items())
        + " req/s), how full the plan runs its fleet.",
        "",
    ]
    for run in runs:
        lines += [f"### Profiles from {run.title}", "", *table(run, gpus), ""]
        short = [p for p in run.points if p.plan.infeasible_cells]
        if short:
            lines += [
                "\\* "
                + "; ".join(
                    f"{p.rate:g} req/s: {_cells(len(p.plan.infeasible_cells))} no type's profile "
                    f"serves ({sum(p.plan.unserved):.3f} req/s)"
                    for p in short
                )
                + ". The plan reports such cells and leaves them out; the gateway still routes "
                "their requests and the run counts them.",
                "",
            ]
    lines += findings(runs, loop)
    return "\n".join(lines)


def _describe(s: Scenario) -> str:
    if s.arrivals.kind == "trace":
        return (
            "sizes drawn from the trace's rows, arrivals its own gaps rescaled to the rate, "
            "from a random start"
        )
    return f"prompts median 40 tokens up to 4k, answers median 280 up to 1k; {s.arrivals.kind}"


def _cells(n: int) -> str:
    return "one cell" if n == 1 else f"{n} cells"


def findings(runs: Sequence[Run], loop: ClosedLoop) -> list[str]:
    steady = next(r for r in runs if r.rule == "steady")
    others = [r for r in runs if r.rule != "steady"]
    lb = [p.mixed.attainment[LB] for p in steady.points]
    below = [p.rate for p in steady.points if p.mixed.attainment[LB] < TARGET]
    ratios = [
        (p.rate, p.mixed.cost / c.run.cost)
        for p in steady.points
        if (c := steady.cheapest.get(p.rate)) is not None and c.run is not None and c.run.cost > 0
    ]
    over = [(rate, r) for rate, r in ratios if r > 1.2]
    util = [p.mixed.utilization[LB] for p in steady.points if p.rate >= UTILISATION_FROM]
    full = [
        p.rate / fits
        for p in steady.points
        if p.rate >= UTILISATION_FROM
        and (fits := math.fsum(steady.capacity[g] * n for g, n in p.mixed.replicas.items())) > 0
    ]
    savings = [p.saving for p in steady.points if p.saving is not None]
    out = [
        "How to read it.",
        "",
        f"- **SLO.** With steady-state profiles the planned fleet kept {_span(lb, '.1%')} of "
        "the measured requests within the SLO under load-balance"
        + (
            f"; below {TARGET:.0%} at " + ", ".join(f"{r:g} req/s" for r in below)
            if below
            else f", at or above {TARGET:.0%} at every rate"
        )
        + ".",
        f"- **Against the cheapest fleet that holds 99%.** The plan costs "
        f"{_span([r for _, r in ratios], '.2f')} x the cheapest fleet the search found"
        + (
            "; more than 1.2 x at " + ", ".join(f"{rate:g} req/s ({r:.2f})" for rate, r in over)
            if over
            else ", within 1.2 x at every rate"
        )
        + ".",
        f"- **Utilisation.** From {UTILISATION_FROM:g} req/s up the plan's fleet delivered "
        f"{_span(util, '.0%')} of its decode ceiling under load-balance. A replica cannot reach "
        "100% within this SLO: alone at its steady-state rate for this workload it delivers "
        + ", ".join(f"{g} {r:.0%}" for g, r in _reach(steady, loop).items())
        + " of its decode ceiling (prefill steps and the SLO's bounds), so that is the ceiling a "
        "perfect plan would show. Against what the fleet sustains within the SLO (its replicas' "
        f"steady-state rates for this workload) it ran at {_span(full, '.0%')}.",
        f"- **Mixed against one type.** The plan saves {_span(savings, '.0%')} against the "
        "best single type.",
    ]
    for other in others:
        util_o = [p.mixed.utilization[LB] for p in other.points if p.rate >= UTILISATION_FROM]
        cost = [
            q.mixed.cost / p.mixed.cost
            for p, q in zip(steady.points, other.points, strict=True)
            if p.mixed.cost > 0
        ]
        out.append(
            f"- **With {other.title}** the plans cost {_span(cost, '.1f')} x the "
            f"steady-state plans at the same rates and delivered {_span(util_o, '.0%')} of "
            f"their ceiling from {UTILISATION_FROM:g} req/s up: such profiles state a fraction "
            "of what a GPU sustains (`profile_capacity.py` above), and the plan buys for that "
            "fraction."
        )
    return out


def _reach(run: Run, loop: ClosedLoop) -> dict[str, float]:
    """Per GPU type: its steady-state rate's output tokens/s over its saturated decode ceiling,
    the most a replica alone can deliver of it within the SLO on this workload."""
    mean_out = loop.scenario.lengths.mean_output
    return {
        g: run.capacity[g] * mean_out / gpu.saturated_tokens_per_s()
        for g, gpu in loop.gpus.items()
        if g in run.capacity
    }


def _prices(items: Sequence[str]) -> dict[str, float]:
    prices = dict(PRICES)
    for item in items:
        gpu, sep, raw = item.partition("=")
        if not sep or gpu not in PRESETS:
            raise SystemExit(f"--price {item!r}: expected GPU=USD, GPU one of {', '.join(PRESETS)}")
        prices[gpu] = float(raw)
    return prices


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    parser.add_argument("--profiles", default=",".join(PROFILES), help="steady and/or aibrix")
    parser.add_argument("--gpus", default=",".join(PRICES), help="GPU types the plan may use")
    parser.add_argument("--price", action="append", default=[], metavar="GPU=USD")
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per run")
    parser.add_argument("--warmup", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--headroom", type=float, default=1.0)
    parser.add_argument(
        "--attainment",
        type=float,
        default=TARGET,
        help="the plan's attainment target (Problem.attainment); the search holds 0.99",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workload",
        default="chat",
        help="chat, or an Azure 2023 trace: azure-conv, azure-code (sizes and arrival gaps)",
    )
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument("--json", type=Path, help="also write every figure as JSON here")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    prices = _prices(args.price)
    gpus = tuple(PRESETS[g.strip()] for g in args.gpus.split(","))
    rules = [r.strip() for r in args.profiles.split(",")]
    if "steady" not in rules or not set(rules) <= set(PROFILES):
        raise SystemExit(f"--profiles: steady and optionally aibrix, got {args.profiles!r}")
    started = time.perf_counter()
    runs: list[Run] = []
    capacity: dict[str, float] = {}
    loop: ClosedLoop | None = None
    lengths, traces = parse_workload(args.workload, args.trace_dir)
    arrivals = Arrivals()
    if traces:
        arrivals = Arrivals("trace", trace_times=next(iter(traces.values())).times)
    for rule in rules:
        scenario = Scenario(
            gpus,
            lengths,
            arrivals,
            slo=DEFAULT_SLO,
            measured_requests=args.requests,
            warmup_s=args.warmup,
            seed=args.seed,
            sweep=grid_for(lengths, DEFAULT_RATES, rule=rule),
        )
        here = ClosedLoop(
            scenario, costs=prices, headroom=args.headroom, attainment=args.attainment
        )
        loop = here if rule == "steady" else loop or here
        t0 = time.perf_counter()
        here.profiles()
        t1 = time.perf_counter()
        print(f"{rule} profiles in {t1 - t0:.0f} s", file=sys.stderr)

        def progress(p: RatePoint) -> None:
            print(
                f"  {p.rate:g} req/s: plan {p.mixed.replicas} ${p.mixed.cost:.2f}/h, "
                f"attainment {p.mixed.attainment}",
                file=sys.stderr,
                flush=True,
            )

        points = run_closed_loop(here, rates, progress)
        cheapest: dict[float, Cheapest] = {}
        capacity = capacity or type_capacities(here)  # the workload's, whatever the profiles
        if rule == "steady":
            for rate in rates:
                cheapest[rate] = found = cheapest_fleet(here, rate, capacity=capacity)
                print(
                    f"  {rate:g} req/s: cheapest holding 99% "
                    f"{None if found.run is None else found.run.replicas} ({found.tried} tried)",
                    file=sys.stderr,
                    flush=True,
                )
        runs.append(Run(rule, points, t1 - t0, time.perf_counter() - t1, cheapest, capacity))
    assert loop is not None
    text = render(runs, loop, time.perf_counter() - started, args.workload)
    print(text)
    if args.json:
        doc = {r.rule: [p.to_json() for p in r.points] for r in runs}
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if not args.no_write:
        section = SECTION if args.workload == "chat" else f"{SECTION}-{args.workload}"
        print(f"wrote {write_section(DOC, section, text).name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
