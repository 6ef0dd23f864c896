"""`hetero-gateway mock-engine`: serve one mock engine from a GPU preset.

Only argparse at module level: the top-level CLI imports every command module to build --help, so
aiohttp, prometheus_client and the event loop are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from plugin_tools.sim.engine import PRESETS as GPU_PRESETS

if TYPE_CHECKING:
    from plugin_tools.mock_engine.model import EngineParams

# flag dest -> EngineParams field; a flag left unset keeps the preset's value.
_OVERRIDES = (
    "a_ms",
    "b_ms",
    "prefill_ms_per_token",
    "max_num_seqs",
    "kv_tokens",
    "time_scale",
    "tokens_per_chunk",
    "default_max_tokens",
)


def register_cli(subparsers: Any) -> None:
    """Add the `mock-engine` sub-command to the top-level parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "mock-engine",
        help="serve an OpenAI-compatible mock engine with a GPU cost model",
        description=(
            "Serve an OpenAI-compatible mock inference engine whose decode steps cost "
            "a + b*batch ms (plus prefill per prompt token), with vLLM-style /metrics. "
            "Flags override the preset's values."
        ),
    )
    parser.add_argument(
        "--preset", required=True, choices=sorted(GPU_PRESETS), help="GPU step-cost preset"
    )
    parser.add_argument("--port", required=True, type=int, help="TCP port (0 picks a free one)")
    parser.add_argument("--model", required=True, help="model name to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--name", default=None, help="engine name in the x-mock-engine header (default: preset)"
    )
    parser.add_argument("--a-ms", type=float, help="fixed cost of a decode step, ms")
    parser.add_argument("--b-ms", type=float, help="cost per running sequence of a step, ms")
    parser.add_argument("--prefill-ms-per-token", type=float, help="prefill cost per prompt token")
    parser.add_argument("--max-num-seqs", type=int, help="batch cap (sequences)")
    parser.add_argument("--kv-tokens", type=int, help="KV-cache capacity (tokens)")
    parser.add_argument("--time-scale", type=float, help="multiplies every duration (>1 slower)")
    parser.add_argument("--tokens-per-chunk", type=int, help="tokens per streamed SSE chunk")
    parser.add_argument(
        "--default-max-tokens", type=int, help="output tokens when a request names none"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 2 on bad parameters, 1 if bind fails."""
    import asyncio

    try:
        params = params_from_args(args)
    except ValueError as exc:
        print(f"hetero-gateway mock-engine: invalid parameters: {exc}", file=sys.stderr)
        return 2
    name = args.name or args.preset
    try:
        import uvloop
    except ImportError:
        runner = asyncio.Runner()
    else:
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    with runner:
        return runner.run(
            _serve(params, host=args.host, port=args.port, model=args.model, name=name)
        )


def params_from_args(args: argparse.Namespace) -> EngineParams:
    """The preset named by ``--preset`` with every given flag applied; ValueError if invalid."""
    import dataclasses

    from plugin_tools.mock_engine.model import PRESETS

    overrides = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k, None) is not None}
    return dataclasses.replace(PRESETS[args.preset], **overrides)


async def _serve(params: EngineParams, *, host: str, port: int, model: str, name: str) -> int:
    import asyncio
    import contextlib
    import signal

    from plugin_tools.mock_engine.model import saturated_output_tokens_per_s
    from plugin_tools.mock_engine.server import start_mock_engine

    try:
        handle = await start_mock_engine(params, host=host, port=port, model=model, name=name)
    except OSError as exc:
        print(f"hetero-gateway mock-engine: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # Not on every platform (Windows): there Ctrl-C still stops the runner.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    print(
        f"mock-engine {name}: model {model!r} on {handle.url} "
        f"(saturated {saturated_output_tokens_per_s(params):.0f} output tokens/s)",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await handle.close()
    return 0
