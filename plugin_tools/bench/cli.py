"""`hetero-gateway bench`: the end-to-end benchmark (real Envoy on loopback), bounded in count and
time, writing JSON, Markdown and PNG plots. Heavy imports wait until the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from plugin_tools.bench.options import PARTS, BenchOptions

# `--quick`: a tiny configuration that checks the command end to end in well under a minute.
QUICK: dict[str, Any] = {
    "requests": 10,
    "seconds": 1.0,
    "rounds": 1,
    "concurrency": 8,
    "stream_concurrency": (1,),
    "routing_seconds": 4.0,
    "routing_warmup": 2.0,
    "routing_load": 0.1,
    "routing_time_scale": 0.5,
}
DEFAULT_OUT_DIR = "docs/bench"

# dest -> flag, for the flags that change figures (the command line recorded in the outputs).
_FLAGS = {
    "parts": "--parts",
    "requests": "--requests",
    "seconds": "--seconds",
    "rounds": "--rounds",
    "concurrency": "--concurrency",
    "stream_concurrency": "--stream-concurrency",
    "routing_seconds": "--routing-seconds",
    "routing_warmup": "--routing-warmup",
    "routing_load": "--routing-load",
    "routing_time_scale": "--routing-time-scale",
    "seed": "--seed",
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register_cli(sub: argparse._SubParsersAction[Any]) -> None:
    d = BenchOptions()
    p = sub.add_parser(
        "bench",
        help="end-to-end benchmark through a real Envoy: overhead, streaming, routing quality",
        description="Start mock engines, the plugin and real Envoys on loopback; measure what the "
        "plugin adds against Envoy alone (overhead, per-chunk streaming delay) and how the "
        "strategies share a mixed fleet (routing); write bench.json, bench.md and PNG plots. "
        "The default run takes about 7 minutes on 2 cores.",
    )
    p.add_argument(
        "--parts",
        type=_names,
        help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all)",
    )
    p.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="requests per variant for latency (concurrency 1) and for each streaming "
        f"concurrency (default {d.requests})",
    )
    p.add_argument(
        "--seconds",
        type=float,
        metavar="S",
        help=f"throughput window per variant, split over the rounds (default {d.seconds:g})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        metavar="R",
        help=f"interleaved rounds over the variants (default {d.rounds})",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        metavar="C",
        help=f"closed-loop workers of the throughput runs (default {d.concurrency})",
    )
    p.add_argument(
        "--stream-concurrency",
        type=_ints,
        metavar="C[,C...]",
        help="concurrencies of the streaming part "
        f"(default {','.join(map(str, d.stream_concurrency))})",
    )
    p.add_argument(
        "--routing-seconds",
        type=float,
        metavar="S",
        help=f"measured seconds per strategy in the routing part (default {d.routing_seconds:g})",
    )
    p.add_argument(
        "--routing-warmup",
        type=float,
        metavar="S",
        help="warm-up seconds per strategy, left out of the figures "
        f"(default {d.routing_warmup:g})",
    )
    p.add_argument(
        "--routing-load",
        type=float,
        metavar="FRACTION",
        help="offered output tokens/s as a fraction of the fleet's saturated rate "
        f"(default {d.routing_load:g})",
    )
    p.add_argument(
        "--routing-time-scale",
        type=float,
        metavar="FACTOR",
        help=f"slow every routing engine by this factor (default {d.routing_time_scale:g}, "
        "as `up`)",
    )
    p.add_argument("--seed", type=int, help=f"seed of the routing load (default {d.seed})")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny run (well under a minute) that checks the command and its outputs; flags "
        "given explicitly still win",
    )
    p.add_argument(
        "--out-dir",
        default=DEFAULT_OUT_DIR,
        metavar="DIR",
        help=f"where bench.json, bench.md and the plots go (default {DEFAULT_OUT_DIR})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions: explicit flags, else the --quick values, else the defaults."""
    given = {dest: getattr(args, dest) for dest in _FLAGS if getattr(args, dest) is not None}
    values = {**(QUICK if args.quick else {}), **given}
    return BenchOptions(**values, progress=not args.no_progress)


def command_line(args: argparse.Namespace) -> str:
    """The command as recorded in the outputs; an absolute --out-dir is left out on purpose."""
    parts = ["hetero-gateway bench"]
    if args.quick:
        parts.append("--quick")
    for dest, flag in _FLAGS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        parts.append(f"{flag} {text}")
    if args.out_dir != DEFAULT_OUT_DIR and not Path(args.out_dir).is_absolute():
        parts.append(f"--out-dir {args.out_dir}")
    return " ".join(parts)


def _envoy_version() -> str | None:
    import re
    import subprocess

    from plugin.adapters.envoy_config import envoy_binary

    try:
        proc = subprocess.run(
            [envoy_binary(), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"/(\d+\.\d+\.\d+)/", proc.stdout)
    return found.group(1) if found else None


def run(args: argparse.Namespace) -> int:
    import asyncio
    import platform
    import sys

    from plugin_tools.extras import require_demo_extra

    require_demo_extra("bench", ("matplotlib", "tqdm"), envoy=True)
    from plugin_tools.bench.e2e import run_bench
    from plugin_tools.bench.render import markdown, write_outputs

    opts = options_from_args(args)
    opts.check()
    command = command_line(args)
    try:
        import uvloop
    except ImportError:
        doc = asyncio.run(run_bench(opts))
    else:
        doc = uvloop.run(run_bench(opts))
    doc["machine"]["envoy"] = _envoy_version()
    doc["machine"]["python"] = platform.python_version()
    paths = write_outputs(doc, Path(args.out_dir), command)
    print(markdown(doc, command))
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    for part, error in doc.get("failed", {}).items():
        print(f"hetero-gateway bench: the {part} part failed: {error}", file=sys.stderr)
    return 1 if doc.get("failed") else 0
