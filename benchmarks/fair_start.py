"""A new replica joins a mixed fleet under load: how much traffic it takes before it has learned
its own capacity, starting from its GPU type's peers (`plugin.core.fair_start`) against the
previous rule, the mean learned capacity of the whole pool (AIBrix's), in the same run.

Simulated fleet (`plugin_tools.sim`): A100s and a V100 serving the chat mix with load-balance at
a fixed share of G* (the sum of what each replica sustains alone within the SLO); a second V100
is listed but not ready until `--join-at`, then joins. Reported for the requests that arrived in
the `--window` seconds after it joined: the share it was sent against its share of G*, the p99
E2E of the requests it served, and the whole fleet's SLO attainment over that window.

    python benchmarks/fair_start.py            # writes docs/benchmarks.md, "A new replica joins"
    python benchmarks/fair_start.py --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

from plugin.core.pool import PodPool
from plugin_tools.docsection import write_section
from plugin_tools.sim.engine import parse_fleet
from plugin_tools.sim.fleet import RunResult, replica_names, simulate
from plugin_tools.sim.metrics import met
from plugin_tools.sim.sweep import Scenario, make_strategy, slo_capacities
from plugin_tools.sim.workload import CHAT, Arrivals, generate

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "fair-start"
FLEET = "3xa100,2xv100"  # the last replica is the one that joins
FIRST_TICK_S = 1.5


def run(rule: str, seed: int, load: float, join_at: float, window: float) -> dict[str, float]:
    profiles = parse_fleet(FLEET)
    names = replica_names(profiles)
    joining = len(profiles) - 1
    scenario = Scenario(tuple(profiles), CHAT, warmup_s=join_at, seed=seed)
    join_at += FIRST_TICK_S
    capacities = slo_capacities(scenario)
    g_star = sum(capacities.values())
    rate = load * g_star
    total_s = join_at + window
    drawn = generate(CHAT, Arrivals(), rate, math.ceil(rate * total_s), random.Random(seed))
    # Nothing arrives before the first scrape tick (1 s), which takes the joining replica out:
    # it must have learned nothing when it joins.
    requests = [dataclasses.replace(r, arrival=r.arrival + FIRST_TICK_S) for r in drawn]
    state = {"hidden": False, "joined": False}

    def on_scrape(now: float, pool: PodPool) -> None:
        # Not ready from the first tick until `join_at`: it has learned nothing when it joins.
        pods = pool.pods()
        key = next(p.key for p in pods if p.name == names[joining])
        if not state["hidden"]:
            state["hidden"] = True
            pool.set_pods([dataclasses.replace(p, ready=p.key != key) for p in pods])
        elif not state["joined"] and now >= join_at:
            state["joined"] = True
            pool.set_pods([dataclasses.replace(p, ready=True) for p in pods])

    gateway = dataclasses.replace(scenario.gateway, fair_start=rule != "pool mean")
    strategy = make_strategy("load-balance", scenario)
    result = simulate(
        profiles,
        strategy,
        requests,
        warmup_s=join_at,
        gateway=gateway,
        seed=seed,
        on_scrape=on_scrape,
    )
    return summarize(result, scenario, joining, capacities[names[joining]] / g_star)


def summarize(
    result: RunResult, scenario: Scenario, joining: int, fair_share: float
) -> dict[str, float]:
    window = [r for r in result.records if r.measured]
    on_it = [r for r in window if r.replica == joining]
    e2e = sorted(r.e2e for r in on_it)
    p99 = e2e[min(len(e2e) - 1, math.ceil(0.99 * len(e2e)) - 1)] if e2e else math.nan
    return {
        "share": len(on_it) / len(window) if window else math.nan,
        "fair_share": fair_share,
        "p99_e2e_s": p99,
        "attainment": sum(met(scenario.slo, r) for r in window) / len(window),
        "attainment_on_it": sum(met(scenario.slo, r) for r in on_it) / len(on_it)
        if on_it
        else math.nan,
    }


RULES = ("pool mean", "its deployment's peers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=float, default=0.7, help="share of G* (default 0.7)")
    parser.add_argument("--join-at", type=float, default=120.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {rule: [] for rule in RULES}
    for seed in range(1, args.seeds + 1):
        for rule in RULES:
            rows[rule].append(run(rule, seed, args.load, args.join_at, args.window))
            r = rows[rule][-1]
            print(
                f"seed {seed} {rule}: share {r['share']:.3f} (fair {r['fair_share']:.3f}),"
                f" p99 E2E on it {r['p99_e2e_s']:.2f} s, attainment {r['attainment']:.3f}"
                f" (on it {r['attainment_on_it']:.3f})",
                file=sys.stderr,
            )
    text = render(rows, args)
    print(text)
    if not args.no_write:
        write_section(DOC, SECTION, text)
    return 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def render(rows: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    fair = _mean([r["fair_share"] for r in rows[RULES[0]]])
    lines = [
        "## A new replica joins a mixed fleet: where its capacity starts",
        "",
        f"`python benchmarks/fair_start.py` (simulator; fleet {FLEET}, the chat mix, load-balance"
        f" at {args.load:g} G*, {args.seeds} seeds): the second V100 is listed but not ready"
        f" until {args.join_at:g} s, then joins with nothing learned. The requests that arrived"
        f" in the {args.window:g} s after it joined, mean over seeds; its fair share (its G* over"
        f" the fleet's) is {fair:.3f}.",
        "",
        "| a replica without an estimate starts from | its share of requests | its share / fair"
        " | p99 E2E of those it served (s) | SLO attainment, its requests | SLO attainment,"
        " fleet |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rule in RULES:
        rs = rows[rule]
        share = _mean([r["share"] for r in rs])
        p99 = _mean([r["p99_e2e_s"] for r in rs])
        lines.append(
            f"| {rule} | {share:.3f} | {share / fair:.2f}x | {p99:.2f}"
            f" | {_mean([r['attainment_on_it'] for r in rs]):.3f}"
            f" | {_mean([r['attainment'] for r in rs]):.3f} |"
        )
    peers, mean = (_mean([r["share"] for r in rows[rule]]) / fair for rule in RULES[::-1])
    lines += [
        "",
        f"Starting from the pool's mean, the newcomer is scored as the A100s around it and takes"
        f" {mean:.1f}x its fair share until its own estimate catches up. Starting from its"
        f" deployment's peers it takes {peers:.2f}x: no more than a V100 can serve, and for"
        " those seconds somewhat less (it earns the rest as it learns; the fleet's other replicas"
        " absorb the difference within the SLO here).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
