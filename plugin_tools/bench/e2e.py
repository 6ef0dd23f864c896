"""The benchmark's runs: the stacks it starts, the variants it compares, the parts it measures.

Overhead and streaming each start one mock engine and the plugin, with one Envoy per variant in
front of them (all running at once), and interleave the variants in rounds so drift on a shared
machine falls on every variant alike. Routing reuses the `up` demo on the three-replica fleet.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

from tqdm import tqdm

from plugin_tools.bench.client import Timing, chat_body, run_batch, run_interleaved
from plugin_tools.bench.options import PARTS, BenchOptions
from plugin_tools.bench.stats import CpuTotals, overhead_summary, routing_summary, streaming_summary
from plugin_tools.demo.envoy_layout import BenchLayout
from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port, process_cpu_seconds
from plugin_tools.demo.up import UpOptions, fleet_spec, run_demo

__all__ = ["VARIANTS", "StackShape", "run_bench"]

MODEL = "llama-3-8b"

# What each variant's Envoy does; the order is the order of every table.
VARIANTS: dict[str, str] = {
    "direct": "Envoy alone: no ext_proc filter, a STATIC cluster to the engine.",
    "headers": "Routing filter with request headers only (request body NONE), no counting. The "
    "plugin gets the request and response headers but routes from the body's model, so it picks "
    "nothing and Envoy uses the same STATIC cluster as direct: the cost of the ext_proc stream "
    "and its header round trips, without a pick.",
    "buffered": "Routing filter with the BUFFERED request body: the plugin parses it, picks the "
    "pod and steers the ORIGINAL_DST cluster; no token counting (response body NONE).",
    "observe": "The default wiring: buffered routing plus a second, observability-mode filter "
    "that streams every response chunk to the plugin for token counting (Envoy does not wait).",
    "streamed": "`--count-mode streamed`: buffered routing, and the routing filter itself takes "
    "every response chunk (STREAMED); Envoy waits for the plugin's reply to each.",
}

# No batch runs longer than this, whatever the request count asks (the time bound).
BATCH_CAP_S = 60.0
# No throughput batch sends more than this (the count bound of a time-bound batch).
THROUGHPUT_MAX_REQUESTS = 50_000
_WARMUP_REQUESTS = 20
ROUTING_STRATEGIES = ("least-request", "load-balance")


@dataclass(frozen=True, slots=True)
class StackShape:
    """The engine behind the variants and the one request every run sends."""

    preset: str
    time_scale: float  # the engine's step is (a + b * batch) ms times this
    max_tokens: int
    tokens_per_chunk: int = 1  # one token per SSE event, as vLLM streams
    prompt_words: int = 8


# Overhead: a fast engine (about 1 ms per token on an a100 preset) so the gateway's share shows.
OVERHEAD_SHAPE = StackShape(preset="a100", time_scale=0.1, max_tokens=8)
# Streaming: tokens paced about 2.3 ms apart, longer than one plugin round trip, so every token
# travels as its own chunk instead of being coalesced with the next.
STREAMING_SHAPE = StackShape(preset="a100", time_scale=0.25, max_tokens=32)


def routing_options(opts: BenchOptions) -> UpOptions:
    """The `up` demo's options for the routing part."""
    up_opts = UpOptions(
        demo_s=opts.routing_seconds,
        port=free_port(),
        model=MODEL,
        load=opts.routing_load,
        time_scale=opts.routing_time_scale,
        strategies=ROUTING_STRATEGIES,
        warmup=opts.routing_warmup,
        seed=opts.seed,
    )
    up_opts.check()
    return up_opts


def _say(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


def _split(total: int, parts: int, index: int) -> int:
    """The index-th of `parts` near-equal integer shares of `total`."""
    return total * (index + 1) // parts - total * index // parts


def _rotated(names: Sequence[str], shift: int) -> list[str]:
    """Round r starts with a different variant, so no variant always runs first after a pause."""
    k = shift % len(names)
    return [*names[k:], *names[:k]]


class VariantStack:
    """One engine, the plugin, and one Envoy per variant, all in front of that engine."""

    def __init__(self, shape: StackShape) -> None:
        self.shape = shape
        self.body = chat_body(MODEL, shape.prompt_words, shape.max_tokens)
        self.fleet = LocalFleet(
            FleetSpec(
                model=MODEL,
                presets=(shape.preset,),
                time_scale=shape.time_scale,
                tokens_per_chunk=shape.tokens_per_chunk,
                listen_port=free_port(),
                count_mode="observe",
            )
        )
        self.urls: dict[str, str] = {}
        self.envoy_pids: dict[str, int] = {}

    @property
    def plugin_pid(self) -> int:
        assert self.fleet.plugin is not None
        return self.fleet.plugin.pid

    async def __aenter__(self) -> VariantStack:
        fleet = self.fleet
        await fleet.start()
        try:
            engine = fleet.engines[0]
            upstream = ("127.0.0.1", engine.port)
            layouts: dict[str, tuple[str, BenchLayout | None]] = {
                "direct": ("observe", BenchLayout(plugin=False, upstream=upstream)),
                "headers": (
                    "observe",
                    BenchLayout(request_body=False, count=False, upstream=upstream),
                ),
                "buffered": ("observe", BenchLayout(count=False)),
                "streamed": ("streamed", None),
            }
            for name in VARIANTS:
                if name == "observe":  # the fleet's own Envoy is the default wiring
                    assert fleet.envoy is not None
                    self.urls[name] = fleet.envoy_url
                    self.envoy_pids[name] = fleet.envoy.pid
                    continue
                count_mode, layout = layouts[name]
                port = free_port()
                opts = replace(fleet.envoy_options(port, free_port()), count_mode=count_mode)
                proc = await fleet.start_extra_envoy(f"envoy-{name}", opts, layout)
                self.urls[name] = f"http://127.0.0.1:{port}"
                self.envoy_pids[name] = proc.pid
            await self._warm_up()
        except BaseException:
            await fleet.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.fleet.stop()

    def url(self, variant: str) -> str:
        return f"{self.urls[variant]}/v1/chat/completions"

    async def _warm_up(self) -> None:
        """Open every connection (client, upstream, ext_proc) and fail loudly on a broken path."""
        for name in VARIANTS:
            batch = await run_batch(
                self.url(name),
                self.body,
                concurrency=4,
                max_requests=_WARMUP_REQUESTS,
                max_seconds=BATCH_CAP_S,
            )
            if batch.errors:
                first = next(t.error for t in batch.timings if not t.ok)
                raise RuntimeError(
                    f"variant {name}: {batch.errors}/{len(batch.timings)} warm-up requests "
                    f"failed, first: {first}\n{self.fleet.log_tail('plugin')}"
                )


@contextmanager
def _bar(opts: BenchOptions, total: int, desc: str) -> Iterator[tqdm[Any]]:
    bar: tqdm[Any] = tqdm(
        total=total,
        desc=desc,
        unit="step",
        disable=not opts.progress,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    try:
        yield bar
    finally:
        bar.close()


async def _latency_interleaved(
    stack: VariantStack, opts: BenchOptions, bar: tqdm[Any], record_chunks: bool
) -> dict[str, list[Timing]]:
    """Concurrency 1, the variants taking turns request by request (`run_interleaved`)."""
    bar.set_postfix_str("concurrency 1, variants in turn")

    def step(_: int) -> None:
        bar.update(1)

    return await run_interleaved(
        {name: stack.url(name) for name in VARIANTS},
        stack.body,
        requests_per_url=opts.requests,
        max_seconds=BATCH_CAP_S * len(VARIANTS),
        record_chunks=record_chunks,
        on_step=step,
    )


async def measure_overhead(opts: BenchOptions) -> dict[str, Any]:
    """(a): latency at concurrency 1, then requests/s and CPU at `concurrency`, per variant."""
    started = time.monotonic()
    names = list(VARIANTS)
    totals = {n: CpuTotals() for n in names}
    _say(f"overhead: starting one {OVERHEAD_SHAPE.preset} engine, the plugin, {len(names)} Envoys")
    async with VariantStack(OVERHEAD_SHAPE) as stack:
        total = opts.requests + opts.rounds * len(names)
        with _bar(opts, total, "overhead") as bar:
            latency = await _latency_interleaved(stack, opts, bar, record_chunks=False)
            for r in range(opts.rounds):
                for name in _rotated(names, r):
                    bar.set_postfix_str(f"{name}: concurrency {opts.concurrency}")
                    pids = (stack.plugin_pid, stack.envoy_pids[name])
                    before = [process_cpu_seconds(p) for p in pids]
                    batch = await run_batch(
                        stack.url(name),
                        stack.body,
                        concurrency=opts.concurrency,
                        max_requests=THROUGHPUT_MAX_REQUESTS,
                        max_seconds=min(BATCH_CAP_S, opts.seconds / opts.rounds),
                    )
                    after = [process_cpu_seconds(p) for p in pids]
                    spent = [
                        None if a is None or b is None else a - b
                        for a, b in zip(after, before, strict=True)
                    ]
                    totals[name].add(batch, spent[0], spent[1])
                    bar.update(1)
    return {
        "stack": asdict(OVERHEAD_SHAPE),
        "latency_concurrency": 1,
        "latency_requests_per_variant": opts.requests,
        "throughput_concurrency": opts.concurrency,
        "throughput_seconds_per_variant": opts.seconds,
        "rounds": opts.rounds,
        "variants": overhead_summary(latency, totals),
        "duration_s": time.monotonic() - started,
    }


async def measure_streaming(opts: BenchOptions) -> dict[str, Any]:
    """(b): when each SSE chunk reaches the client, per variant and concurrency, vs direct.

    At concurrency 1 the variants take turns request by request; above it each variant carries
    the whole load alone (the contention is the point), in interleaved rounds.
    """
    started = time.monotonic()
    names = list(VARIANTS)
    by_concurrency: dict[str, Any] = {}
    _say(
        f"streaming: starting one {STREAMING_SHAPE.preset} engine, the plugin, {len(names)} Envoys"
    )
    async with VariantStack(STREAMING_SHAPE) as stack:
        total = sum(
            opts.requests if c == 1 else opts.rounds * len(names) for c in opts.stream_concurrency
        )
        with _bar(opts, total, "streaming") as bar:
            for concurrency in opts.stream_concurrency:
                if concurrency == 1:
                    timings = await _latency_interleaved(stack, opts, bar, record_chunks=True)
                    by_concurrency["1"] = {"variants": streaming_summary(timings)}
                    continue
                timings = {n: [] for n in names}
                for r in range(opts.rounds):
                    for name in _rotated(names, r):
                        bar.set_postfix_str(f"{name}: concurrency {concurrency}")
                        n = _split(opts.requests, opts.rounds, r)
                        if n:
                            batch = await run_batch(
                                stack.url(name),
                                stack.body,
                                concurrency=concurrency,
                                max_requests=n,
                                max_seconds=BATCH_CAP_S,
                                record_chunks=True,
                            )
                            timings[name] += batch.timings
                        bar.update(1)
                by_concurrency[str(concurrency)] = {"variants": streaming_summary(timings)}
    return {
        "stack": asdict(STREAMING_SHAPE),
        "requests_per_variant": opts.requests,
        "rounds": opts.rounds,
        "by_concurrency": by_concurrency,
        "duration_s": time.monotonic() - started,
    }


async def measure_routing(opts: BenchOptions) -> dict[str, Any]:
    """(c): the `up` demo's comparison (least-request, then load-balance) on the mixed fleet."""
    started = time.monotonic()
    up_opts = routing_options(opts)
    bars: dict[str, tqdm[Any]] = {}

    def progress(strategy: str, done: int, total: int) -> None:
        bar = bars.get(strategy)
        if bar is None:
            bar = bars[strategy] = tqdm(
                total=total,
                desc=f"routing {strategy}",
                unit="req",
                disable=not opts.progress,
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    _say("routing: starting the a100, l20 and v100 engines, the plugin and Envoy")
    try:
        async with LocalFleet(fleet_spec(up_opts)) as fleet:
            saturated = {e.name: e.saturated_tokens_per_s for e in fleet.engines}
            summaries = await run_demo(fleet, up_opts, on_progress=progress)
    finally:
        for bar in bars.values():
            bar.close()
    return {
        "config": {
            "fleet": list(up_opts.presets),
            "saturated_output_tokens_per_s": saturated,
            "load": up_opts.load,
            "time_scale": up_opts.time_scale,
            "tokens_per_chunk": up_opts.tokens_per_chunk,
            "warmup_s": up_opts.warmup,
            "seconds_per_strategy": up_opts.demo_s,
            "seed": up_opts.seed,
        },
        "strategies": routing_summary(summaries),
        "duration_s": time.monotonic() - started,
    }


_MEASURES: dict[str, Callable[[BenchOptions], Awaitable[dict[str, Any]]]] = {
    "overhead": measure_overhead,
    "streaming": measure_streaming,
    "routing": measure_routing,
}


async def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Every selected part in order; the document `render` writes out.

    A part that fails is recorded under `failed` (with the traceback on stderr) and the next
    one still runs: minutes of figures are not thrown away for one broken stack.
    """
    opts.check()
    doc: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
        "variants": dict(VARIANTS),
    }
    failed: dict[str, str] = {}
    for part in PARTS:
        if part not in opts.parts:
            continue
        try:
            doc[part] = await _MEASURES[part](opts)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            failed[part] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if failed:
        doc["failed"] = failed
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    return doc
