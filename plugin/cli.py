"""Command-line entry point: one sub-command per job, each registered by the module that owns it.

Registration modules import nothing heavy at module level, so `hetero-gateway mock-engine` does not
pay for gRPC and `hetero-gateway --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# module path -> it defines `register_cli(subparsers)`, which adds a sub-command whose parser has
# `set_defaults(func=callable(args) -> int)`.
_COMMAND_MODULES = (
    "plugin.adapters.serve_cli",
    "plugin.adapters.envoy_config",
    "plugin.mock_engine.cli",
    "plugin.demo.cli",
    "plugin.sim.cli",
    "plugin.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-gateway",
        description="Capacity-aware LLM routing for Envoy on mixed GPU fleets.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from plugin.errors import ConfigError

        if isinstance(exc, ConfigError):
            print(f"hetero-gateway: configuration error: {exc}", file=sys.stderr)
            return 2
        raise
