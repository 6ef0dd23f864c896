"""Command-line entry point: one sub-command per job, each registered by the module that owns it.

The runtime's own commands (`serve`, `optimizer`, `envoy-config`) are listed here. The tools
(`mock-engine`, `up`, `simulate`, `bench`, `profile`) live in `plugin_tools`, which the runtime
never imports: they announce themselves as entry points of the group `hetero_gateway.commands`
(`pyproject.toml`), so an installation without them (the plugin image) simply has fewer commands.

Registration modules import nothing heavy at module level, so `hetero-gateway mock-engine` does not
pay for gRPC and `hetero-gateway --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version

# Each `register_cli(subparsers)` adds a sub-command whose parser has
# `set_defaults(func=callable(args) -> int)`.
_RUNTIME_COMMANDS = (
    "plugin.adapters.serve_cli",
    "plugin.adapters.optimizer.cli",
    "plugin.adapters.envoy_config",
)
COMMAND_GROUP = "hetero_gateway.commands"

log = logging.getLogger(__name__)


def _version() -> str:
    """The installed distribution's version (a source tree that was never installed has none)."""
    try:
        return version("hetero-gateway")
    except PackageNotFoundError:
        return "(not installed)"


class _DefaultsShown(argparse.HelpFormatter):
    """Each option's default after its help, unless the help already says it (the options
    declared in `plugin/config` say where theirs comes from)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.default not in (None, False, "", [], argparse.SUPPRESS)
        if not action.option_strings or not shown or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)"


def command_parsers(
    parser: argparse.ArgumentParser, path: str = "hetero-gateway"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and every command's parser below it, each with its command line."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from command_parsers(child, f"{path} {name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-gateway",
        description="Capacity-aware LLM routing for Envoy on mixed GPU fleets.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _RUNTIME_COMMANDS:
        importlib.import_module(name).register_cli(sub)
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:  # declared by the metadata but not shipped (the plugin image)
            log.debug("command %s unavailable: %s", ep.name, exc)
            continue
        register(sub)
    for _, each in command_parsers(parser):
        if each.formatter_class is argparse.HelpFormatter:  # a command's own formatter stays
            each.formatter_class = _DefaultsShown
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
