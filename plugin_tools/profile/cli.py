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
        help="run the benchmark grid against one base URL, write benchmark JSONL",
        description="Streaming text completions over input lengths x output lengths x request "
        "rates (each doubling from start to limit), --prompts per point, rows in AIBrix's "
        "benchmark JSONL. Point it at one replica, or at the gateway with a header that narrows "
        "the candidates to one deployment.",
    )
    sweep.add_argument("--base-url", required=True, help="e.g. http://10.0.0.5:8000")
    sweep.add_argument("--model", required=True)
    sweep.add_argument("--input-start", type=_positive_int, default=128)
    sweep.add_argument("--input-limit", type=_positive_int, default=2048)
    sweep.add_argument("--output-start", type=_positive_int, default=4)
    sweep.add_argument("--output-limit", type=_positive_int, default=512)
    sweep.add_argument("--rate-start", type=_positive_float, default=1.0)
    sweep.add_argument("--rate-limit", type=_positive_float, default=64.0)
    sweep.add_argument("--prompts", type=_positive_int, default=100, help="requests per point")
    sweep.add_argument("--seed", type=int, default=0)
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
    sweep.add_argument("-o", "--output", type=Path, help="JSONL file to append to (default stdout)")
    sweep.add_argument("--dry-run", action="store_true", help="print the plan, send nothing")
    sweep.add_argument("--no-progress", action="store_true")
    sweep.set_defaults(func=_sweep)

    build = commands.add_parser(
        "build",
        help="turn benchmark JSONL into a profile for an SLO",
        description="Per cell, the highest rate that meets every SLO given and is kept up "
        "with (measured TPUT >= 0.9 x offered), else the lowest passing rate, else 0.",
    )
    build.add_argument("deployment", help="the deployment (GPU type) the profile describes")
    build.add_argument("--benchmark", type=Path, required=True, help="benchmark JSONL")
    for name in SLO_NAMES:
        build.add_argument(f"--{name}", type=float, help=_SLO_HELP[name])
    build.add_argument(
        "--percentile",
        type=int,
        default=0,
        choices=(0, 50, 90, 99),
        help="statistic the time SLOs are checked at (0: the mean)",
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

    for what in ("input", "output", "rate"):
        start, limit = getattr(args, f"{what}_start"), getattr(args, f"{what}_limit")
        if limit < start:
            print(f"profile sweep: --{what}-limit is below --{what}-start", file=sys.stderr)
            return 2
    plan = SweepPlan(
        base_url=args.base_url,
        model=args.model,
        inputs=[int(v) for v in doubling(args.input_start, args.input_limit)],
        outputs=[int(v) for v in doubling(args.output_start, args.output_limit)],
        rates=doubling(args.rate_start, args.rate_limit),
        prompts=args.prompts,
        seed=args.seed,
        headers=dict(args.header)
        | ({"external-filter": args.external_filter} if args.external_filter else {}),
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


def _build(args: argparse.Namespace) -> int:
    import orjson

    from plugin_tools.profile.build import build_profile, load_benchmark
    from plugin_tools.profile.store import write_profile

    slos = {name: getattr(args, name) for name in SLO_NAMES if getattr(args, name) is not None}
    profile = build_profile(
        load_benchmark(args.benchmark),
        args.deployment,
        slos=slos,
        percentile=args.percentile,
        cost=args.cost,
    )
    if args.output is None:
        sys.stdout.write(orjson.dumps(profile.to_json()).decode() + "\n")
        return 0
    print(write_profile(profile, args.output), file=sys.stderr)
    return 0
