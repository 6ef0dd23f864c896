"""Admission under overload, in the simulator: priority classes, and fairness in GPU time against
fairness by request count and by tokens, all in one run (`plugin.core.admission`).

1. **Overload.** A mixed fleet (`--fleet`, default one A100 and two V100s) serving the chat mix
   at `--load` times G* (the sum of what each replica sustains alone within the SLO: 1 s TTFT,
   60 ms TPOT). 20% of the requests come from an interactive tenant, the rest from a batch
   tenant. Without admission (today: every request routed at once, engines queue in arrival
   order) against admission on (classes `interactive,batch`): per tenant, the share of its
   requests served within the SLO (a shed request counts as missed), and the share shed.
2. **Fairness.** One A100 and one V100; two tenants of equal weight, one sending ten times the
   other's rate, both backlogged (`--fair-load` times G*). The heavy tenant chats; the light one
   sends long documents with short answers (`LONG`: prompts of about 6k tokens). Fair by
   GPU-seconds (the default), by tokens (AIBrix's VTC counts prompt and output tokens), by
   requests (the endpoint picker's flow control): the GPU time each tenant's requests took on
   the engines (`SimSeq.gpu_s`: each step's time split by marginal cost) over the requests the
   gateway dispatched inside the measured window, and the ratio light / heavy (1.0 is fair).

The strategy is `load-balance` throughout; the GPU profiles (from simulated sweeps) are loaded so
that prompts are priced at each GPU type's prefill speed.

    python benchmarks/admission.py             # writes docs/benchmarks.md, section admission
    python benchmarks/admission.py --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from plugin.core.admission import AdmissionSettings, ClassTable
from plugin.core.profile import ProfileBook
from plugin_tools.docsection import write_section
from plugin_tools.sim.engine import parse_fleet
from plugin_tools.sim.fleet import RequestRecord, RunResult, simulate
from plugin_tools.sim.metrics import DEFAULT_SLO, met
from plugin_tools.sim.sweep import Scenario, make_strategy, slo_capacities
from plugin_tools.sim.workload import CHAT, LONG, Arrivals, SimRequest, generate

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "admission"
CLASSES = ClassTable(("interactive", "batch"), {"chat": "interactive"}, default="batch")


def tenants_mixed(
    requests: Sequence[SimRequest], share: float, tenant: str, other: str, seed: int
) -> list[SimRequest]:
    """Each request is `tenant`'s with probability `share`, else `other`'s."""
    rng = random.Random(f"tenants-{seed}")
    return [
        dataclasses.replace(r, tenant=tenant if rng.random() < share else other) for r in requests
    ]


def merged(*streams: Sequence[SimRequest]) -> list[SimRequest]:
    return sorted((r for s in streams for r in s), key=lambda r: r.arrival)


def window(result: RunResult) -> list[RequestRecord]:
    return [r for r in result.records if r.measured]


def overload(
    fleet: str, load: float, seed: int, warmup_s: float, measured_s: float, book: ProfileBook
) -> dict[str, dict[str, float]]:
    profiles = tuple(parse_fleet(fleet))
    scenario = Scenario(profiles, CHAT, warmup_s=warmup_s, seed=seed)
    g_star = sum(slo_capacities(scenario).values())
    rate = load * g_star
    n = math.ceil(rate * (warmup_s + measured_s))
    drawn = generate(CHAT, Arrivals(), rate, n, random.Random(seed))
    requests = tenants_mixed(drawn, 0.2, "chat", "bulk", seed)
    rows: dict[str, dict[str, float]] = {}
    for label, settings in (
        ("without admission", None),
        ("admission", AdmissionSettings(classes=CLASSES)),
        (
            "admission, batch waits 2 s at most",
            AdmissionSettings(classes=CLASSES, class_max_wait_s={"batch": 2.0}),
        ),
    ):
        started = time.perf_counter()
        result = simulate(
            profiles,
            make_strategy("load-balance", scenario),
            requests,
            warmup_s=warmup_s,
            seed=seed,
            book=book,
            admission=settings,
            drain_limit_s=120.0,
        )
        records = window(result)
        row: dict[str, float] = {"g_star": g_star, "rate": rate}
        for tenant in ("chat", "bulk"):
            mine = [r for r in records if r.tenant == tenant]
            row[f"{tenant}_n"] = len(mine)
            row[f"{tenant}_met"] = sum(met(DEFAULT_SLO, r) for r in mine) / max(1, len(mine))
            row[f"{tenant}_shed"] = sum(r.rejected for r in mine) / max(1, len(mine))
            served = [r for r in mine if r.completed]
            row[f"{tenant}_ttft_p99"] = _p99([r.ttft for r in served])
        goodput = sum(met(DEFAULT_SLO, r) for r in records) / max(result.window_s, 1e-9)
        row["goodput"] = goodput
        rows[label] = row
        print(f"overload {label}: {row} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return rows


def fairness(
    fleet: str,
    load: float,
    seed: int,
    warmup_s: float,
    measured_s: float,
    book: ProfileBook,
) -> dict[str, dict[str, float]]:
    profiles = tuple(parse_fleet(fleet))
    scenario = Scenario(profiles, CHAT, warmup_s=warmup_s, seed=seed)
    g_star = sum(slo_capacities(scenario).values())
    rate = load * g_star
    total_s = warmup_s + measured_s
    heavy_rate, light_rate = rate * 10 / 11, rate / 11
    heavy = generate(
        CHAT, Arrivals(), heavy_rate, math.ceil(heavy_rate * total_s), random.Random(seed)
    )
    light = generate(
        LONG, Arrivals(), light_rate, math.ceil(light_rate * total_s), random.Random(seed + 1000)
    )
    requests = merged(
        [dataclasses.replace(r, tenant="heavy") for r in heavy],
        [dataclasses.replace(r, tenant="light") for r in light],
    )
    rows: dict[str, dict[str, float]] = {}
    for measure in ("gpu-seconds", "tokens", "requests"):
        started = time.perf_counter()
        result = simulate(
            profiles,
            make_strategy("load-balance", scenario),
            requests,
            warmup_s=warmup_s,
            seed=seed,
            book=book,
            admission=AdmissionSettings(measure=measure, max_wait_s=30.0),
            drain_limit_s=60.0,
        )
        t0 = min(r.arrival for r in window(result))
        t1 = t0 + result.window_s
        dispatched = [
            r for r in result.records if t0 <= r.decided <= t1 and not r.rejected and r.replica >= 0
        ]
        row: dict[str, float] = {}
        for tenant in ("heavy", "light"):
            mine = [r for r in dispatched if r.tenant == tenant]
            row[f"{tenant}_gpu_s"] = sum(r.gpu_s for r in mine)
            row[f"{tenant}_requests"] = len(mine)
            row[f"{tenant}_tokens"] = sum(r.prompt_tokens + r.output_tokens for r in mine)
        row["ratio"] = row["light_gpu_s"] / max(row["heavy_gpu_s"], 1e-9)
        rows[measure] = row
        print(f"fairness {measure}: {row} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return rows


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", default="a100,2xv100")
    parser.add_argument("--load", type=float, default=1.5, help="overload: share of G*")
    parser.add_argument("--fair-fleet", default="a100,v100")
    parser.add_argument("--fair-load", type=float, default=6.0, help="fairness: share of G*")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--measured", type=float, default=180.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    over_scenario = Scenario(tuple(parse_fleet(args.fleet)), CHAT, seed=args.seed)
    over = overload(
        args.fleet, args.load, args.seed, args.warmup, args.measured, over_scenario.profile_book()
    )
    fair_profiles = tuple(parse_fleet(args.fair_fleet))
    fair = fairness(
        args.fair_fleet,
        args.fair_load,
        args.seed,
        args.warmup,
        args.measured,
        Scenario(fair_profiles, CHAT, seed=args.seed).profile_book(),
    )
    text = render(over, fair, args)
    print(text)
    if not args.no_write:
        write_section(DOC, SECTION, text)
    return 0


def render(
    over: dict[str, dict[str, float]], fair: dict[str, dict[str, float]], args: argparse.Namespace
) -> str:
    first = next(iter(over.values()))
    lines = [
        "## Admission: priority under overload, fairness in GPU time",
        "",
        "`python benchmarks/admission.py` (simulator; `load-balance`; the module docstring has the",
        "set-up). Overload: fleet "
        f"`{args.fleet}` at {args.load:g} x G* ({first['rate']:.1f} req/s against G* ="
        f" {first['g_star']:.1f}), 20% of requests from an interactive tenant (`chat`), 80% from"
        " a batch tenant (`bulk`); SLO 1 s TTFT and 60 ms TPOT; a shed request counts as missed.",
        "",
        "| | chat within SLO | chat shed | chat p99 TTFT | bulk within SLO | bulk shed |"
        " bulk p99 TTFT | goodput (req/s within SLO) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, row in over.items():
        lines.append(
            f"| {label} | {row['chat_met']:.3f} | {row['chat_shed']:.3f} |"
            f" {row['chat_ttft_p99']:.2f} s | {row['bulk_met']:.3f} | {row['bulk_shed']:.3f} |"
            f" {row['bulk_ttft_p99']:.2f} s | {row['goodput']:.2f} |"
        )
    lines += [
        "",
        f"Fairness: fleet `{args.fair_fleet}` at {args.fair_load:g} x G*; tenant `heavy` sends"
        " ten times the rate of `light`, equal weights, both backlogged; `heavy` chats, `light`"
        " sends long documents with short answers. GPU time their requests took on the engines,"
        " over the requests dispatched in the measured window:",
        "",
        "| fair by | heavy GPU-s | light GPU-s | light / heavy | heavy requests | light requests"
        " | heavy tokens | light tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for measure, row in fair.items():
        lines.append(
            f"| {measure} | {row['heavy_gpu_s']:.0f} | {row['light_gpu_s']:.0f} |"
            f" {row['ratio']:.2f} | {row['heavy_requests']:.0f} | {row['light_requests']:.0f} |"
            f" {row['heavy_tokens']:.0f} | {row['light_tokens']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
