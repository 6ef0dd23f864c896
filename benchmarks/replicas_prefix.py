"""Prefix-cache routing through one Envoy with one plugin replica, and with three.

Requests that share long system prompts, routed by `prefix-cache`, through a real Envoy whose
ext_proc cluster holds 1 or 3 plugin replicas sharing a real `redis-server`, in front of mock
engines: Envoy spreads the requests over the replicas. Three runs, each on a fresh fleet:

- 1 replica;
- 3 replicas sharing the prefix index (the default with Redis);
- 3 replicas each with its own index (`HETERO_GATEWAY_SHARED_PREFIX_INDEX=false`).

Per run: the index hit rate (matched over prompt blocks, summed over the replicas' own
`hetero_gateway_prefix_cache_*` counters); from the client's side (the `target-pod` response
header) the mean number of engines each system prompt was served by, and the share of requests
served by an engine that had served the same system prompt before (what an engine's prefix
cache can reuse; the mock engines keep none, so this is the routing's part of a hit).

    python benchmarks/replicas_prefix.py          # about 2 minutes on 2 cores

Writes its table into docs/benchmarks.md between the replicas-prefix markers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from plugin_tools.demo.redis_server import RedisServer
from plugin_tools.docsection import write_section

MODEL = "llama-3-8b"
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
PRESETS = ("a100", "a100", "l20", "l20")
PROMPTS = 24  # distinct system prompts
PROMPT_WORDS = 300  # each about 1,800 characters
RATE = 8.0  # requests per second
DURATION_S = 25.0


@dataclass
class Result:
    label: str
    requests: int
    failed: int
    hit_rate: float  # the replicas' index: matched / prompt blocks
    engines_per_prompt: float  # mean distinct engines a system prompt was served by
    sticky: float  # requests served where their system prompt had been served before


def system_prompts(seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(5000)}" for _ in range(PROMPTS * PROMPT_WORDS)]
    return [
        f"You are assistant {i}. " + " ".join(words[i * PROMPT_WORDS : (i + 1) * PROMPT_WORDS])
        for i in range(PROMPTS)
    ]


async def _ask(
    session: aiohttp.ClientSession, url: str, system: str, question: str
) -> tuple[int, str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 8,
    }
    headers = {"routing-strategy": "prefix-cache"}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status, r.headers.get("target-pod", "")
    except (aiohttp.ClientError, TimeoutError):
        return 0, ""


async def _counter(session: aiohttp.ClientSession, plugin: str, name: str) -> float:
    """A prefix-cache counter of one replica, summed over models."""
    async with session.get(f"{plugin}/metrics") as resp:
        text = await resp.text()
    wanted = f"hetero_gateway_prefix_cache_{name}_total"
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == wanted
    )


async def run(tmp: Path, replicas: int, shared: bool, seed: int) -> Result:
    label = f"{replicas} replica{'s' if replicas > 1 else ''}" + (
        "" if replicas == 1 else (", index shared" if shared else ", index each its own")
    )
    prompts = system_prompts()
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 0.8 for i in range(PROMPTS)]  # a few prompts are most of the load
    async with RedisServer() as redis:
        env = {
            "REDIS_HOST": redis.host,
            "REDIS_PORT": str(redis.port),
            "HETERO_GATEWAY_SHARED_PREFIX_INDEX": "true" if shared else "false",
        }
        spec = FleetSpec(
            model=MODEL,
            listen_port=free_port(),
            presets=PRESETS,
            time_scale=4.0,
            plugin_env={**env, "POD_NAME": "replica-0"},
        )
        logs = tmp / f"{replicas}-{'shared' if shared else 'own'}"
        logs.mkdir()
        async with LocalFleet(spec, str(logs)) as fleet:
            url, extra = await fleet.start_replicas(replicas, env)
            plugins = [fleet.plugin_url, *(r.plugin_url for r in extra)]
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                t0, tasks, n = time.monotonic(), [], 0
                while (at := n / RATE) < DURATION_S:
                    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                    which = rng.choices(range(PROMPTS), weights)[0]
                    ask = _ask(session, url, prompts[which], f"question {n}?")
                    tasks.append((which, asyncio.create_task(ask)))
                    n += 1
                outcomes = [(which, await task) for which, task in tasks]
                matched = prompt = 0.0
                for plugin in plugins:
                    matched += await _counter(session, plugin, "matched_blocks")
                    prompt += await _counter(session, plugin, "prompt_blocks")
    served: dict[int, set[str]] = defaultdict(set)
    sticky = failed = 0
    for which, (status, pod) in outcomes:
        if status != 200 or not pod:
            failed += 1
            continue
        sticky += pod in served[which]
        served[which].add(pod)
    ok = len(outcomes) - failed
    return Result(
        label,
        len(outcomes),
        failed,
        matched / prompt if prompt else 0.0,
        sum(len(p) for p in served.values()) / max(1, len(served)),
        sticky / ok if ok else 0.0,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| plugin replicas | requests | failed | index hit rate | engines per system prompt "
        "| served where its prompt was served before |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.requests} | {r.failed} | {r.hit_rate:.1%} "
            f"| {r.engines_per_prompt:.2f} | {r.sticky:.1%} |"
        )
    return "\n".join(lines)


async def main_async(seed: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as tmp:
        return [
            await run(Path(tmp), replicas, shared, seed)
            for replicas, shared in ((1, True), (3, True), (3, False))
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(main_async(args.seed))
    text = table(results)
    print(text)
    if args.no_write:
        return
    doc = (
        "## Prefix-cache routing through Envoy with three plugin replicas\n\n"
        "Generated by `python benchmarks/replicas_prefix.py`: one Envoy whose ext_proc cluster "
        "holds 1 or 3 plugin replicas sharing a redis-server, mock engines "
        f"{', '.join(PRESETS)}; {PROMPTS} system prompts of about "
        f"{PROMPT_WORDS * 6:,} characters (popularity falling as 1/rank^0.8), each request one "
        f"of them and a question of its own, `routing-strategy: prefix-cache`, {RATE:g} req/s "
        f"for {DURATION_S:g} s, each run on a fresh fleet. Index hit rate: matched over prompt "
        "blocks, summed over the replicas' `hetero_gateway_prefix_cache_*` counters; engines "
        "per system prompt and the last column from the `target-pod` each client got (the "
        "mock engines keep no prefix cache: this is the routing's part of a cache hit).\n\n"
        f"{text}\n"
    )
    print(f"wrote {write_section(DOC, 'replicas-prefix', doc).name}", file=sys.stderr)


if __name__ == "__main__":
    main()
