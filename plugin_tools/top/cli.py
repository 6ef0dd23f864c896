"""`hetero-gateway top`: registration only; rich is imported when the command runs."""

from __future__ import annotations

import argparse
from typing import Any

from plugin_tools.extras import require_demo_extra


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def register_cli(sub: Any) -> None:
    p = sub.add_parser(
        "top",
        help="a live view of one plugin: per pod its GPU type, share of requests against share"
        " of capacity, in flight, tokens/s, TTFT and TPOT; the queue",
        description="Reads the plugin's /debug/pods and /metrics every --interval seconds. On a"
        " terminal it redraws in place and quits on q; piped, it prints plain lines.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the plugin's HTTP address")
    p.add_argument("--interval", type=_positive, default=2.0, help="seconds between readings")
    p.add_argument(
        "--window", type=_positive, default=60.0, help="seconds the shares and latency cover"
    )
    p.add_argument("--once", action="store_true", help="print one reading (since start) and exit")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    require_demo_extra("top", ("rich",))
    from plugin_tools.top.screen import run

    return run(args.url, args.interval, args.window, args.once)
