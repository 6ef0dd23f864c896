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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from plugin.adapters.serve import Gateway, build_source, run_until_signal
    from plugin.config import flag_overrides, load_settings

    # A flag is its variable's value: the same validation and the same error for both.
    settings = load_settings({**os.environ, **flag_overrides(COMMAND, args)})
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return_large_buffers_to_the_os()
    source = build_source(settings)
    main = run_until_signal(Gateway(settings, source, args.host))
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
    return 0


# glibc's mallopt parameter: blocks this large or larger are mmap'd, and unmapped when freed.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 256 * 1024


def return_large_buffers_to_the_os() -> None:
    """Have glibc give large freed buffers (request bodies, gRPC messages) back to the OS.

    By default glibc raises its mmap threshold each time a large mmap'd block is freed (up to
    32 MiB), after which such blocks come from the heap and stay resident: 1,000 requests with
    4 MB bodies left the plugin at 2.4x its baseline RSS, 1.4-1.5x with this (the rest does not
    grow with more requests, and neither gc nor malloc_trim returns it). Fixing the threshold
    (which turns the adjustment off) keeps them mmap'd. Other C libraries: nothing to do.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
