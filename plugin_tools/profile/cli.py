"""`hetero-gateway profile sweep | build`: AIBrix-compatible GPU profiles (a command group of its
own, apart from `bench`). Heavy imports wait until a command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from plugin.core.profile import SLO_NAMES

_SLO_HELP = {
    "tput": "throughput target, requests/s (mean at or above)",
    "tt": "token throughput target, output tokens/s (mean at or above)",
    "e2e": "end-to-end latency target, seconds (below)",
    "ttft": "time-to-first-token target, seconds (below)",
    "tpat": "time per token of prompt and output, seconds (below)",
    "tpot": "time per output chunk, seconds (below)",
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def _ticks(text: str) -> list[int]:
    try:
        ticks = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,N,... got {text!r}") from None
    if not ticks or min(ticks) < 1 or ticks != sorted(set(ticks)):
        raise argparse.ArgumentTypeError(f"ticks must be increasing positive integers: {text!r}")
    return ticks


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def register_cli(sub: Any) -> None:
    parser = sub.add_parser(
        "profile",
        help="measure a GPU type and build its profile (AIBrix's formats)",
        description="Measure a deployment (sweep) and turn the measurements into a profile "
        "for an SLO (build). Both read and write AIBrix's formats.",
    )
    commands = parser.add_subparsers(dest="profile_command", required=True, metavar="STEP")

    sweep = commands.add_parser(
        "sweep",
        help="measure one deployment over a grid of request sizes, write benchmark JSONL",
        description="Default (--rule steady): per cell (input x output tokens), the largest "
        "Poisson rate at which one replica is stable and meets every SLO given at --percentile "
        "per request, with 95% confidence; doubling then bisecting to 10%, confirmed with a "
        "second seed, each cell bounded by the smaller cells already swept. Several --base-url "
        "(replicas of one deployment) sweep cells in parallel. Rows in AIBrix's benchmark JSONL, "
        "appended per probe: run the same command again to resume. --rule aibrix: AIBrix's "
        "sweep, --prompts requests at each doubling rate.",
    )
    sweep.add_argument(
        "--base-url",
        required=True,
        action="append",
        help="e.g. http://10.0.0.5:8000; repeat for several replicas of one deployment",
    )
    sweep.add_argument("--model", required=True, help="the body's model, as the engine serves it")
    sweep.add_argument(
        "--rule",
        choices=("steady", "aibrix"),
        default="steady",
        help="steady: the steady-state search; aibrix: AIBrix's doubling sweep",
    )
    sweep.add_argument(
        "--input-start", type=_positive_int, default=128, help="smallest input tick, tokens"
    )
    sweep.add_argument(
        "--input-limit", type=_positive_int, default=2048, help="largest input tick, tokens"
    )
    sweep.add_argument(
        "--output-start", type=_positive_int, default=4, help="smallest output tick, tokens"
    )
    sweep.add_argument(
        "--output-limit", type=_positive_int, default=512, help="largest output tick, tokens"
    )
    sweep.add_argument(
        "--inputs", type=_ticks, metavar="N,N,...", help="input ticks (instead of start..limit)"
    )
    sweep.add_argument(
        "--outputs", type=_ticks, metavar="N,N,...", help="output ticks (instead of start..limit)"
    )
    for name in ("ttft", "tpot", "e2e", "tpat"):
        sweep.add_argument(f"--{name}", type=_positive_float, help=_SLO_HELP[name] + "; steady")
    sweep.add_argument(
        "--percentile",
        type=int,
        default=99,
        choices=(0, 50, 90, 99),
        help="steady: the share of requests that must meet the SLO (0: the means)",
    )
    sweep.add_argument(
        "--rate-floor",
        type=_positive_float,
        default=0.1,
        help="steady: req/s below which a cell is reported unservable",
    )
    sweep.add_argument("--rate-start", type=_positive_float, default=1.0, help="aibrix only")
    sweep.add_argument(
        "--rate-limit",
        type=_positive_float,
        help="highest rate offered, req/s (default: 512 steady, 64 aibrix)",
    )
    sweep.add_argument(
        "--prompts", type=_positive_int, default=100, help="aibrix: requests per point"
    )
    sweep.add_argument("--seed", type=int, default=0, help="aibrix only")
    sweep.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra request header (repeatable), e.g. routing-strategy:least-request",
    )
    sweep.add_argument(
        "--external-filter",
        metavar="SELECTOR",
        help="through a gateway: measure only the pods this label selector matches, e.g. "
        "app.kubernetes.io/name=llama-a100 (sent as AIBrix's external-filter header)",
    )
    sweep.add_argument("--timeout", type=_positive_float, default=600.0, help="per request, s")
    sweep.add_argument(
        "-o",
        "--output",
        type=Path,
        help="JSONL file to append to (default stdout); steady: an existing file is resumed",
    )
    sweep.add_argument("--dry-run", action="store_true", help="print the plan, send nothing")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    sweep.set_defaults(func=_sweep)

    build = commands.add_parser(
        "build",
        help="turn benchmark JSONL into a profile for an SLO",
        description="--rule steady: per cell, the rate the steady sweep settled on (replayed "
        "from its verdicts), for the SLO it judged. --rule aibrix: AIBrix's rule, the highest "
        "rate that meets every SLO given and is kept up with (measured TPUT >= 0.9 x offered), "
        "else the lowest passing rate, else 0. --rule auto (default): steady when the rows "
        "carry a steady sweep's verdicts, else aibrix.",
    )
    build.add_argument("deployment", help="the deployment (GPU type) the profile describes")
    build.add_argument("--benchmark", type=Path, required=True, help="benchmark JSONL")
    build.add_argument(
        "--rule",
        choices=("auto", "steady", "aibrix"),
        default="auto",
        help="how a cell's rate is chosen (the description says each)",
    )
    for name in SLO_NAMES:
        build.add_argument(f"--{name}", type=float, help=_SLO_HELP[name])
    build.add_argument(
        "--percentile",
        type=int,
        choices=(0, 50, 90, 99),
        help="statistic the time SLOs are checked at (aibrix default 0: the mean; steady: the "
        "sweep's)",
    )
    build.add_argument("--cost", type=float, default=1.0, help="cost of one replica")
    build.add_argument(
        "-o",
        "--output",
        help="file, or redis://[user:password@]host:port[/db]?model=MODEL (default stdout)",
    )
    build.set_defaults(func=_build)


def _sweep(args: argparse.Namespace) -> int:
    import asyncio

    from plugin_tools.profile.sweep import SweepPlan, describe, doubling, open_output, run_sweep

    for what in ("input", "output"):
        start, limit = getattr(args, f"{what}_start"), getattr(args, f"{what}_limit")
        if limit < start:
            print(f"profile sweep: --{what}-limit is below --{what}-start", file=sys.stderr)
            return 2
    headers = dict(args.header) | (
        {"external-filter": args.external_filter} if args.external_filter else {}
    )
    inputs = args.inputs or [int(v) for v in doubling(args.input_start, args.input_limit)]
    outputs = args.outputs or [int(v) for v in doubling(args.output_start, args.output_limit)]
    if args.rule == "steady":
        return _sweep_steady(args, inputs, outputs, headers)
    if len(args.base_url) != 1:
        print("profile sweep: --rule aibrix measures one --base-url", file=sys.stderr)
        return 2
    rate_limit = args.rate_limit or 64.0
    if rate_limit < args.rate_start:
        print("profile sweep: --rate-limit is below --rate-start", file=sys.stderr)
        return 2
    plan = SweepPlan(
        base_url=args.base_url[0],
        model=args.model,
        inputs=inputs,
        outputs=outputs,
        rates=doubling(args.rate_start, rate_limit),
        prompts=args.prompts,
        seed=args.seed,
        headers=headers,
        timeout_s=args.timeout,
    )
    print(describe(plan), file=sys.stderr)
    if args.dry_run:
        return 0
    out = open_output(args.output)
    try:
        sent, failed = asyncio.run(run_sweep(plan, out, progress=not args.no_progress))
    finally:
        if args.output is not None:
            out.close()
    print(f"{sent} requests, {failed} failed", file=sys.stderr)
    return 0 if sent > failed else 1


def _sweep_steady(
    args: argparse.Namespace, inputs: list[int], outputs: list[int], headers: dict[str, str]
) -> int:
    import asyncio

    from plugin.core.types import SloTarget
    from plugin_tools.profile.build import load_benchmark
    from plugin_tools.profile.sweep import SteadySweepPlan, open_output, run_steady_sweep

    slo = SloTarget(ttft_s=args.ttft, tpot_s=args.tpot, e2e_s=args.e2e, tpat_s=args.tpat)
    if not slo.slos():
        print(
            "profile sweep: the steady rule needs an SLO to judge (--ttft, --tpot, --e2e or "
            "--tpat)",
            file=sys.stderr,
        )
        return 2
    plan = SteadySweepPlan(
        tuple(args.base_url),
        args.model,
        inputs,
        outputs,
        slo,
        percentile=args.percentile,
        rate_floor=args.rate_floor,
        rate_limit=args.rate_limit or 512.0,
        headers=headers,
        timeout_s=args.timeout,
    )
    earlier = []
    if args.output is not None and args.output.exists() and args.output.stat().st_size > 0:
        earlier = load_benchmark(args.output)  # a bad file: a configuration error naming it
    print(
        f"inputs {inputs}\noutputs {outputs}\n{plan.cells} cells, SLO {slo.slos()} at "
        f"p{args.percentile}, rates {plan.rate_floor:g}..{plan.rate_limit:g} req/s, "
        f"{len(plan.base_urls)} replica(s)"
        + (f"; resuming from {len(earlier)} rows" if earlier else ""),
        file=sys.stderr,
    )
    if args.dry_run:
        return 0
    out = open_output(args.output)
    try:
        tally = asyncio.run(
            run_steady_sweep(plan, out, earlier=earlier, progress=not args.no_progress)
        )
    finally:
        if args.output is not None:
            out.close()
    print(
        f"{tally.cells} cells swept ({tally.resumed} from an earlier run), {tally.probes} "
        f"probes, {tally.requests} requests, {tally.failed} failed, "
        f"{tally.gpu_seconds / 60:.1f} GPU-minutes",
        file=sys.stderr,
    )
    return 0 if tally.requests > tally.failed or tally.cells == 0 else 1


def _build(args: argparse.Namespace) -> int:
    import time

    import orjson

    from plugin_tools.profile.build import build_profile, load_benchmark
    from plugin_tools.profile.steady import build_steady_profile, history_from_rows
    from plugin_tools.profile.store import write_profile

    slos = {name: getattr(args, name) for name in SLO_NAMES if getattr(args, name) is not None}
    rows = load_benchmark(args.benchmark)
    rule = args.rule
    if rule == "auto":
        rule = "steady" if history_from_rows(rows) else "aibrix"
    if rule == "steady":
        built = build_steady_profile(
            rows,
            args.deployment,
            slos=slos,
            percentile=args.percentile,
            cost=args.cost,
            created=time.time(),
        )
        for note in built.notes:
            print(f"profile build: {note}", file=sys.stderr)
        profile = built.profile
    else:
        profile = build_profile(
            rows, args.deployment, slos=slos, percentile=args.percentile or 0, cost=args.cost
        )
    if args.output is None:
        sys.stdout.write(orjson.dumps(profile.to_json()).decode() + "\n")
        return 0
    print(write_profile(profile, args.output), file=sys.stderr)
    return 0
