"""`hetero-gateway up`: the whole stack on one machine, no cluster and no Docker.

Without `--demo` it serves until interrupted. With `--demo SECONDS` it offers the same open-loop
load twice (least-request, then load-balance), prints the before/after table, optionally writes
JSON, stops every process and exits 0.
"""

from __future__ import annotations

import argparse
from typing import Any

DEMO_STRATEGIES = ("least-request", "load-balance")


def register_cli(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "up",
        help="run Envoy + the plugin + a three-replica mock fleet (a100, l20, v100) locally",
    )
    p.add_argument(
        "--demo",
        type=float,
        metavar="SECONDS",
        help="measure SECONDS per strategy (after --warmup), print the comparison, then exit",
    )
    p.add_argument("--json", metavar="PATH", help="with --demo: write the figures as JSON")
    p.add_argument("--port", type=int, default=8888, help="Envoy listener port (default 8888)")
    p.add_argument("--model", default="llama-3-8b", help="model name the fleet serves")
    p.add_argument("--fleet", default="a100,l20,v100", help="comma-separated presets")
    p.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="offered output tokens/s as a fraction of the fleet's saturated rate",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="slow every engine by this factor (keeps GPU ratios; default 4)",
    )
    p.add_argument(
        "--tokens-per-chunk",
        type=int,
        default=8,
        help="tokens per SSE chunk from the mock engines (default 8)",
    )
    p.add_argument("--max-num-seqs", type=int, help="override every engine's batch cap")
    p.add_argument(
        "--strategies",
        default=",".join(DEMO_STRATEGIES),
        help="with --demo: strategies to compare, in order",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --demo: load offered before each measured window, left out of the figures "
        "(default 60: capacity is learned over a one-minute window)",
    )
    p.add_argument("--seed", type=int, default=1, help="the load's arrivals and sizes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from plugin_tools.extras import require_demo_extra

    require_demo_extra("up", (), envoy=True)
    from plugin_tools.demo.up import UpOptions, up

    opts = UpOptions(
        demo_s=args.demo,
        json_path=args.json,
        port=args.port,
        model=args.model,
        presets=tuple(x.strip() for x in args.fleet.split(",") if x.strip()),
        load=args.load,
        time_scale=args.time_scale,
        tokens_per_chunk=args.tokens_per_chunk,
        max_num_seqs=args.max_num_seqs,
        strategies=tuple(x.strip() for x in args.strategies.split(",") if x.strip()),
        warmup=args.warmup,
        seed=args.seed,
    )
    try:
        import uvloop
    except ImportError:
        return asyncio.run(up(opts))
    return uvloop.run(up(opts))
