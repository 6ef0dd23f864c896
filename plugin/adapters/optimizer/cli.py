"""Registers `hetero-gateway optimizer` (heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from plugin.config import flag_vars

COMMAND = "optimizer"


def register_cli(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        COMMAND,
        help="run the GPU optimizer: traced traffic -> replicas per GPU type, for the autoscaler",
    )
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    for var in flag_vars(COMMAND):
        var.add_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from plugin.adapters.optimizer.run import OptimizerService, run_until_signal
    from plugin.config import flag_overrides, load_settings

    settings = load_settings({**os.environ, **flag_overrides(COMMAND, args)})
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run_until_signal(OptimizerService(settings, host=args.host)))
    return 0
