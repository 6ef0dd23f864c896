"""Registers `hetero-gateway serve` (heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from plugin.config import flag_vars

COMMAND = "serve"


def register_cli(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(COMMAND, help="run the ext_proc plugin (gRPC) with /metrics over HTTP")
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    # --pods, --discovery, --grpc-port, --http-port: declared with their variables.
    for var in flag_vars(COMMAND):
        var.add_flag(p)
    # Set by `--workers N`'s supervisor on the processes it starts (plugin.adapters.workers).
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from plugin.adapters.gc_tuning import collect_young_garbage_less_often
    from plugin.adapters.native_memory import return_large_buffers_to_the_os
    from plugin.adapters.serve import Gateway, build_source, run_until_signal
    from plugin.config import flag_overrides, load_settings

    # A flag is its variable's value: the same validation and the same error for both.
    env = {**os.environ, **flag_overrides(COMMAND, args)}
    settings = load_settings(env)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.workers > 1 and args.worker_index is None:
        from plugin.adapters.workers import supervise

        return supervise(settings, env, args.host)
    return_large_buffers_to_the_os()
    collect_young_garbage_less_often()
    source = build_source(settings)
    main = run_until_signal(Gateway(settings, source, args.host))
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
    return 0
