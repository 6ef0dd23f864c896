"""The `up` command's body: start the local stack, optionally run the demo, stop everything."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from plugin.core.strategies import strategy_names
from plugin.errors import ConfigError
from plugin_tools.demo.fleet import FleetSpec, LocalFleet, process_cpu_seconds
from plugin_tools.demo.loadgen import LengthDist, Workload, run_open_loop
from plugin_tools.demo.report import demo_json, format_table, summarize
from plugin_tools.mock_engine.model import PRESETS

# Demo lengths. Short prompts: the engines' saturated rate counts decode only, so long prompts
# would add unmodelled prefill load (with 44-token prompts and 57-token answers prefill took 45%
# of an a100's time and "80%" became overload). Answers long enough that per-request costs on
# 2 cores stay small, short enough that a 60 s phase completes a few thousand requests.
DEMO_PROMPT_WORDS = LengthDist(median=8, sigma=0.5, low=2, high=64)
DEMO_OUTPUT_TOKENS = LengthDist(median=64, sigma=0.6, low=8, high=256)


@dataclass(frozen=True, slots=True)
class UpOptions:
    demo_s: float | None = None
    json_path: str | None = None
    port: int = 8888
    model: str = "llama-3-8b"
    presets: tuple[str, ...] = ("a100", "l20", "v100")
    load: float = 0.8
    time_scale: float = 4.0
    tokens_per_chunk: int = 8
    max_num_seqs: int | None = None
    strategies: tuple[str, ...] = ("least-request", "load-balance")
    warmup: float = 60.0  # seconds of load before each measured window
    seed: int = 1

    def check(self) -> None:
        unknown = [p for p in self.presets if p not in PRESETS]
        if unknown or not self.presets:
            raise ConfigError(f"--fleet: unknown presets {unknown} (known: {sorted(PRESETS)})")
        if self.demo_s is not None and self.demo_s <= 0:
            raise ConfigError("--demo SECONDS must be positive")
        if not 0 < self.load <= 2:
            raise ConfigError("--load must be in (0, 2]")
        if self.warmup < 0:
            raise ConfigError("--warmup SECONDS must be >= 0")
        if self.json_path and self.demo_s is None:
            raise ConfigError("--json needs --demo")
        known = strategy_names()
        bad = [s for s in self.strategies if s not in known]
        if bad or not self.strategies:
            raise ConfigError(f"--strategies: unknown {bad} (known: {sorted(known)})")
        if self.json_path:
            # Found out now, not after minutes of load.
            try:
                Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--json {self.json_path}: {exc.strerror}") from None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _plugin_routed(session: aiohttp.ClientSession, fleet: LocalFleet) -> int:
    async with session.get(f"{fleet.plugin_url}/debug/pods") as resp:
        doc = orjson.loads(await resp.read())
    return sum(int(p["routed_total"]) for p in doc["pods"].values())


async def _progress(label: str, total_s: float, state: dict[str, int]) -> None:
    start = time.monotonic()
    while True:
        await asyncio.sleep(5)
        elapsed = time.monotonic() - start
        _say(
            f"  [{label}] {elapsed:5.0f}/{total_s:.0f} s  requests done {state['done']}"
            f"/{state['total']}"
        )


async def run_demo(
    fleet: LocalFleet,
    opts: UpOptions,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Offer the demo load once per strategy; summaries by strategy.

    `on_progress(strategy, done, total)` replaces the periodic progress lines (`bench` draws a
    progress bar with it); it must not raise.
    """
    assert opts.demo_s is not None
    saturated = {e.name: e.saturated_tokens_per_s for e in fleet.engines}
    mean_out = DEMO_OUTPUT_TOKENS.mean()
    rate = opts.load * sum(saturated.values()) / mean_out
    _say(
        f"demo: {opts.warmup:.0f} s warm-up + {opts.demo_s:.0f} s measured per strategy "
        f"at {rate:.1f} req/s "
        f"(~{opts.load:.0%} of the fleet's {sum(saturated.values()):.0f} output tokens/s; "
        f"mean {mean_out:.0f} output tokens per request)"
    )
    summaries: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as session:
        for i, strategy in enumerate(opts.strategies):
            workload = Workload(
                rate_per_s=rate,
                duration_s=opts.warmup + opts.demo_s,
                prompt_words=DEMO_PROMPT_WORDS,
                output_tokens=DEMO_OUTPUT_TOKENS,
                seed=opts.seed + i,
            )
            state = {"done": 0, "total": 0}

            def progress(
                done: int, total: int, state: dict[str, int] = state, strategy: str = strategy
            ) -> None:
                state["done"], state["total"] = done, total
                if on_progress is not None:
                    on_progress(strategy, done, total)

            assert fleet.plugin is not None
            cpu0 = process_cpu_seconds(fleet.plugin.pid)
            routed0 = await _plugin_routed(session, fleet)
            ticker = None
            if on_progress is None:
                ticker = asyncio.ensure_future(
                    _progress(strategy, opts.warmup + opts.demo_s, state)
                )
            try:
                results = await run_open_loop(
                    fleet.envoy_url,
                    opts.model,
                    workload,
                    strategy=strategy,
                    on_progress=progress,
                )
            finally:
                if ticker is not None:
                    ticker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await ticker
            cpu1 = process_cpu_seconds(fleet.plugin.pid)
            routed = await _plugin_routed(session, fleet) - routed0
            summary = summarize(
                results,
                saturated_tokens_per_s=saturated,
                window=(opts.warmup, opts.warmup + opts.demo_s),
            )
            if cpu0 is not None and cpu1 is not None and routed > 0:
                summary["fleet"]["plugin_cpu_ms_per_request"] = (cpu1 - cpu0) * 1000 / routed
            summary["fleet"]["offered_rate_per_s"] = rate
            summaries[strategy] = summary
            _say(
                f"  [{strategy}] done: {len(results)} requests, "
                f"{summary['fleet']['errors']} errors in the window"
            )
    return summaries


def fleet_spec(opts: UpOptions) -> FleetSpec:
    """The stack `up` starts for these options (`bench` starts the same one)."""
    return FleetSpec(
        model=opts.model,
        presets=opts.presets,
        time_scale=opts.time_scale,
        tokens_per_chunk=opts.tokens_per_chunk,
        max_num_seqs=opts.max_num_seqs,
        listen_port=opts.port,
    )


async def up(opts: UpOptions) -> int:
    opts.check()
    fleet = LocalFleet(fleet_spec(opts))
    _say("starting mock engines, the plugin and Envoy ...")
    async with fleet:
        for e in fleet.engines:
            _say(
                f"  engine {e.name:8s} {e.url}  saturated {e.saturated_tokens_per_s:7.0f} "
                "output tokens/s"
            )
        _say(f"  plugin   gRPC 127.0.0.1:{fleet.grpc_port}, metrics {fleet.plugin_url}/metrics")
        _say(f"  watch it: hetero-gateway top --url {fleet.plugin_url}  (q quits)")
        _say(
            "  dashboard and alerts for Grafana and Prometheus: deploy/components/monitoring"
            " (docs/operations.md)"
        )
        _say(f"endpoint: http://localhost:{opts.port}  (model {opts.model})")
        if opts.demo_s is None:
            _say(
                f"try: curl -s http://localhost:{opts.port}/v1/chat/completions "
                f'-H \'content-type: application/json\' -d \'{{"model": "{opts.model}", '
                '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}\' -i'
            )
            _say("serving until Ctrl-C")
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            return 0
        summaries = await run_demo(fleet, opts)
    print(format_table(summaries))
    for name, s in summaries.items():
        cpu = s["fleet"].get("plugin_cpu_ms_per_request")
        if cpu is not None:
            print(
                f"plugin CPU per routed request ({name}): {cpu:.2f} ms "
                "(user+system time of the plugin process / requests it routed)"
            )
    if opts.json_path:
        doc = demo_json(summaries)
        doc["config"] = {
            "fleet": list(opts.presets),
            "load": opts.load,
            "time_scale": opts.time_scale,
            "tokens_per_chunk": opts.tokens_per_chunk,
            "seconds_per_strategy": opts.demo_s,
            "warmup_s": opts.warmup,
            "seed": opts.seed,
        }
        Path(opts.json_path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        _say(f"wrote {opts.json_path}")
    return 0
