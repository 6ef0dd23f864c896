"""What each counting wiring costs per streamed output token, and whether the cheap source agrees.

One mock engine, the plugin, and one Envoy per wiring in front of them:
- `envoy alone`: no ext_proc filter, a STATIC cluster to the engine (the baseline);
- `observe` (the default): the counting filter receives every response chunk;
- `observe, usage added`: the same, for clients that do not ask for usage: the plugin asks the
  engine for it and the Lua filter takes the usage chunk out again;
- `streamed`: the routing filter itself receives and answers every chunk;
- `engine`: no chunk reaches the plugin; capacity comes from the engine's token counter.

Each wiring serves streams of 32 and of 256 output tokens, one token per SSE event; plugin and
Envoy CPU (user + system, from /proc) per request is measured for each, and the difference
between the two lengths, per 224 tokens, is the per-token cost: the part that grows with the
fleet's output token rate. Wirings run one after another, in rotated order per round, and each
figure is the median of the rounds. Ratios are to Envoy alone's per-token CPU in the same run.

Second, on the three-engine demo fleet (default wiring), the capacity estimate each pod would
get from the gateway's counted tokens and from the engine's own counter, each read once a second
into its own `CapacityEstimator`, compared at the end of a steady run.

    python benchmarks/token_cost.py          # about 6 minutes on 2 cores

Writes its section of docs/plugin-cost.md.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from plugin.core.capacity import CapacityEstimator
from plugin_tools.demo.envoy_layout import BenchLayout
from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port, process_cpu_seconds
from plugin_tools.demo.loadgen import LengthDist, Workload, run_open_loop
from plugin_tools.docsection import write_section

MODEL = "llama-3-8b"
SHORT, LONG = 32, 256
RATE = 8.0  # requests/s: well inside one engine's capacity at either length
SECONDS = 8.0
ROUNDS = 3
WIRINGS = ("envoy alone", "observe", "observe, usage added", "streamed", "engine")


def fixed(n: int) -> LengthDist:
    return LengthDist(median=n, sigma=0.0, low=n, high=n)


async def _cpu_per_request(
    url: str, pids: dict[str, int], output_tokens: int, ask_usage: bool
) -> dict[str, float]:
    before = {k: process_cpu_seconds(p) or 0.0 for k, p in pids.items()}
    workload = Workload(RATE, SECONDS, fixed(8), fixed(output_tokens), seed=7)
    results = await run_open_loop(url, MODEL, workload, strategy=None, ask_usage=ask_usage)
    after = {k: process_cpu_seconds(p) or 0.0 for k, p in pids.items()}
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{url}: {len(bad)} of {len(results)} requests failed: {bad[0].error}")
    return {k: (after[k] - before[k]) * 1000 / len(results) for k in pids}


async def measure_cost() -> list[dict[str, Any]]:
    spec = FleetSpec(
        model=MODEL,
        presets=("a100",),
        time_scale=0.25,
        tokens_per_chunk=1,
        listen_port=free_port(),
    )
    samples: dict[str, dict[str, list[float]]] = {w: {} for w in WIRINGS}
    async with LocalFleet(spec) as fleet:
        assert fleet.plugin is not None and fleet.envoy is not None
        engine = fleet.engines[0]
        urls = {"observe": fleet.envoy_url, "observe, usage added": fleet.envoy_url}
        envoys = {"observe": fleet.envoy.pid, "observe, usage added": fleet.envoy.pid}
        extra = {
            "envoy alone": (
                "observe",
                BenchLayout(plugin=False, upstream=("127.0.0.1", engine.port)),
            ),
            "streamed": ("streamed", None),
            "engine": ("engine", None),
        }
        for name, (count_mode, layout) in extra.items():
            port = free_port()
            opts = replace(fleet.envoy_options(port, free_port()), count_mode=count_mode)
            proc = await fleet.start_extra_envoy(f"envoy-{name.replace(' ', '-')}", opts, layout)
            urls[name], envoys[name] = f"http://127.0.0.1:{port}", proc.pid
        for round_ in range(ROUNDS):
            order = WIRINGS[round_ % len(WIRINGS) :] + WIRINGS[: round_ % len(WIRINGS)]
            for name in order:
                pids = {"plugin": fleet.plugin.pid, "envoy": envoys[name]}
                ask = name != "observe, usage added"
                for n in (SHORT, LONG):
                    cpu = await _cpu_per_request(urls[name], pids, n, ask)
                    for part, ms in cpu.items():
                        samples[name].setdefault(f"{part}_{n}", []).append(ms)
                print(f"  round {round_ + 1}: {name} done", file=sys.stderr, flush=True)
    rows = []
    for name in WIRINGS:
        m = {k: statistics.median(v) for k, v in samples[name].items()}
        per_k = 1000 / (LONG - SHORT)
        plugin = (
            0.0 if name == "envoy alone" else (m[f"plugin_{LONG}"] - m[f"plugin_{SHORT}"]) * per_k
        )
        envoy = (m[f"envoy_{LONG}"] - m[f"envoy_{SHORT}"]) * per_k
        rows.append(
            {
                "wiring": name,
                "plugin_ms_per_1k": plugin,
                "envoy_ms_per_1k": envoy,
                "plugin_ms_per_request": 0.0 if name == "envoy alone" else m[f"plugin_{SHORT}"],
                "envoy_ms_per_request": m[f"envoy_{SHORT}"],
            }
        )
    return rows


async def _sample(session: aiohttp.ClientSession, fleet: LocalFleet) -> dict[str, tuple[int, int]]:
    """Per pod: (tokens the gateway counted, the engine's generated-token counter)."""
    async with session.get(f"{fleet.plugin_url}/debug/pods") as resp:
        pods = (await resp.json())["pods"]
    out = {}
    for engine in fleet.engines:
        async with session.get(f"{engine.url}/metrics") as resp:
            text = await resp.text()
        generated = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:generation_tokens_total")
        )
        key = next(k for k, p in pods.items() if p["name"] == engine.name)
        out[key] = (int(pods[key]["output_tokens_total"]), int(generated))
    return out


async def measure_agreement(seconds: float = 90.0) -> list[dict[str, Any]]:
    spec = FleetSpec(model=MODEL, time_scale=2.0, tokens_per_chunk=4, listen_port=free_port())
    counted, engine = CapacityEstimator(), CapacityEstimator()
    async with LocalFleet(spec) as fleet, aiohttp.ClientSession() as session:
        workload = Workload(
            rate_per_s=6.0,
            duration_s=seconds,
            prompt_words=LengthDist(median=60, sigma=0.5, low=8, high=400),
            output_tokens=LengthDist(median=120, sigma=0.6, low=8, high=600),
            seed=11,
        )
        run = asyncio.create_task(run_open_loop(fleet.envoy_url, MODEL, workload, strategy=None))
        start = asyncio.get_running_loop().time()
        base: dict[str, tuple[int, int]] | None = None
        while not run.done():
            now = asyncio.get_running_loop().time() - start
            sample = await _sample(session, fleet)
            if base is None:
                base = sample
            for key, (gw, eng) in sample.items():
                counted.ensure(key)
                engine.ensure(key)
                counted.add_tokens(key, gw - counted.total(key) - base[key][0])
                engine.add_tokens(key, eng - engine.total(key) - base[key][1])
            counted.refresh(now)
            engine.refresh(now)
            await asyncio.sleep(1.0)
        await run
    rows = []
    for key in sorted(counted.estimates()):
        a, b = counted.estimate(key), engine.estimate(key)
        assert a is not None and b is not None
        rows.append({"pod": key, "gateway": a, "engine": b, "ratio": b / a})
    return rows


async def main() -> None:
    cost = await measure_cost()
    base = next(r["envoy_ms_per_1k"] for r in cost if r["wiring"] == "envoy alone")
    observe = next(r for r in cost if r["wiring"] == "observe")
    observe_total = observe["plugin_ms_per_1k"] + observe["envoy_ms_per_1k"]
    lines = [
        "| wiring | plugin CPU ms / 1,000 tokens | Envoy CPU ms / 1,000 tokens "
        "| total / Envoy alone | extra over Envoy alone, vs observe "
        "| plugin ms / request | Envoy ms / request |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in cost:
        total = r["plugin_ms_per_1k"] + r["envoy_ms_per_1k"]
        extra = (total - base) / (observe_total - base) if observe_total > base else float("nan")
        lines.append(
            f"| {r['wiring']} | {r['plugin_ms_per_1k']:.1f} | {r['envoy_ms_per_1k']:.1f} "
            f"| {total / base:.2f} | {extra:.3f} | {r['plugin_ms_per_request']:.2f} "
            f"| {r['envoy_ms_per_request']:.2f} |"
        )
    agreement = await measure_agreement()
    agree = [
        "| pod | from gateway counts (tokens/s) | from the engine's counter | engine / gateway |",
        "| --- | --- | --- | --- |",
        *(
            f"| {r['pod']} | {r['gateway']:.1f} | {r['engine']:.1f} | {r['ratio']:.3f} |"
            for r in agreement
        ),
    ]
    worst = max(abs(r["ratio"] - 1) for r in agreement)
    table, agree_table = "\n".join(lines), "\n".join(agree)
    print(table)
    print()
    print(agree_table)
    doc = Path(__file__).resolve().parent.parent / "docs" / "plugin-cost.md"
    write_section(
        doc,
        "token-cost",
        "## CPU per 1,000 streamed output tokens, by counting wiring\n\n"
        "Generated by `python benchmarks/token_cost.py` (one mock a100 engine at 4x speed, the "
        "plugin, and one real Envoy per wiring in front of them; streams of "
        f"{SHORT} and {LONG} output tokens, one token per SSE event, {RATE:.0f} req/s for "
        f"{SECONDS:.0f} s each, median of {ROUNDS} rounds in rotated order). A figure per "
        f"1,000 tokens is the CPU difference between the {LONG}- and {SHORT}-token streams: "
        "the cost that grows with the fleet's output token rate, not its request rate. `total "
        "/ Envoy alone` is plugin + Envoy CPU per token over what Envoy alone spends proxying "
        "the same tokens; `extra over Envoy alone, vs observe` is what a wiring adds to Envoy "
        "alone as a share of what `observe` adds. Per request: the figures of the "
        f"{SHORT}-token streams.\n\n"
        f"{table}\n\n"
        "`engine` (`envoy-config --count-mode engine`) leaves every response chunk to Envoy "
        "alone: the counting filter sees the response's headers and end, nothing in between, "
        "and capacity is learned from the engine's `vllm:generation_tokens_total` (or SGLang's) "
        "read at each scrape. It needs engines that export that counter; the other wirings work "
        "for every engine. `observe, usage added` is the default wiring for a client that did "
        "not ask for usage: the plugin asks the engine for it and the Lua filter reads every "
        "chunk of that stream to take the usage chunk out again.\n\n"
        "Do the two token sources teach the same capacity? On the three-engine demo fleet "
        "(default wiring, about 6 req/s of mixed lengths for 90 s), each pod's tokens counted "
        "by the gateway and its engine's counter were read once a second into two estimators:\n\n"
        f"{agree_table}\n\n"
        f"Largest difference: {100 * worst:.1f}%. The engine counts a token when it is "
        "generated, the gateway when the response ends, so within a run they differ by the "
        "tokens of the requests in flight at the end of the window.\n",
    )
    print(f"wrote {doc.name}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
