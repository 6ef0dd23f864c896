"""A tenant's token limit held across three plugin replicas, through Envoy.

One real Envoy whose ext_proc cluster holds 1 or 3 plugin replicas sharing a real
`redis-server`, in front of mock engines; admission on, tenant `team` (the `x-tenant` header)
limited to `LIMIT` tokens a minute, offering three times that (open loop, Poisson arrivals,
each request a prompt of 20-60 words and `max_tokens` 20-100; the mock engines answer exactly
`max_tokens`). Three runs, each on a fresh fleet:

- 1 replica (the reference);
- 3 replicas sharing the limit through Redis;
- 3 replicas, Redis killed at `KILL_AT_S`: each replica then holds the tenant to its share of
  the limit (the limit over the 3 gateways it last saw), against what it served itself.

Per run: tokens served (the engines' usage, prompt and completion, of every 200) in each 60 s
window of the run, sliding by the second, by when each response ended: the most in any window
and the mean over the windows, against the limit; for the Redis run, the windows wholly after
the kill. And the answers: 200s, 429s (each should carry `retry-after`), other failures, and
whether the 200s carried `x-ratelimit-remaining-tokens`.

    python benchmarks/limits.py          # about 9 minutes on 2 cores

Writes its table into docs/benchmarks.md between the tenant-limits markers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from plugin_tools.demo.redis_server import RedisServer
from plugin_tools.docsection import write_section

MODEL = "llama-3-8b"
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
PRESETS = ("a100", "a100")
LIMIT = 18_000  # tokens a minute for the tenant
OFFERED = 3.0  # times the limit
DURATION_S = 150.0
KILL_AT_S = 50.0
WINDOW_S = 60


@dataclass
class Result:
    label: str
    duration_s: float
    served: list[tuple[float, int]] = field(default_factory=list)  # (ended at, tokens)
    refused: int = 0
    refused_with_retry: int = 0
    failed: int = 0
    with_headers: int = 0
    measured_from: float = 0.0  # windows starting here or later count

    def windows(self) -> list[int]:
        last = int(self.duration_s) - WINDOW_S
        return [
            sum(n for t, n in self.served if start <= t < start + WINDOW_S)
            for start in range(int(self.measured_from), last + 1)
        ]


def _body(rng: random.Random, n: int) -> dict[str, object]:
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(20, 60)))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{n}: {words}"}],
        "max_tokens": rng.randint(20, 100),
    }


async def _ask(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], t0: float, result: Result
) -> None:
    headers = {"x-tenant": "team"}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            data = await r.json(content_type=None)
            if r.status == 200:
                usage = data["usage"]
                result.served.append((time.monotonic() - t0, int(usage["total_tokens"])))
                result.with_headers += "x-ratelimit-remaining-tokens" in r.headers
            elif r.status == 429:
                result.refused += 1
                result.refused_with_retry += "retry-after" in r.headers
            else:
                result.failed += 1
    except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError):
        result.failed += 1


async def run(tmp: Path, replicas: int, kill_redis: bool, seed: int, duration_s: float) -> Result:
    kill_at = min(KILL_AT_S, duration_s / 3)
    label = f"{replicas} replica{'s' if replicas > 1 else ''}" + (
        f", Redis killed at {kill_at:g} s" if kill_redis else ""
    )
    result = Result(label, duration_s)
    rng = random.Random(seed)
    mean_tokens = 40 * 1.0 + 60  # prompt words (about one token each, and the index) + answer
    rate = OFFERED * LIMIT / 60 / mean_tokens  # requests a second
    async with RedisServer() as redis:
        env = {
            "REDIS_HOST": redis.host,
            "REDIS_PORT": str(redis.port),
            "HETERO_GATEWAY_ADMISSION": "on",
            "HETERO_GATEWAY_TENANT_HEADER": "x-tenant",
            "HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE": f"team:{LIMIT}",
        }
        spec = FleetSpec(
            model=MODEL,
            listen_port=free_port(),
            presets=PRESETS,
            time_scale=4.0,
            plugin_env={**env, "POD_NAME": "replica-0"},
        )
        logs = tmp / f"{replicas}-{'kill' if kill_redis else 'shared'}"
        logs.mkdir()
        async with LocalFleet(spec, str(logs)) as fleet:
            url, _ = await fleet.start_replicas(replicas, env)
            await asyncio.sleep(1.0)  # the replicas' first syncs: each sees the others
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                t0, tasks, n, at = time.monotonic(), [], 0, 0.0
                killed = not kill_redis
                while True:
                    at += rng.expovariate(rate)
                    if at >= duration_s:
                        break
                    if not killed and at >= kill_at:
                        await asyncio.sleep(max(0.0, t0 + kill_at - time.monotonic()))
                        await redis.kill()
                        killed = True
                        result.measured_from = kill_at + 1
                    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                    ask = _ask(session, url, _body(rng, n), t0, result)
                    tasks.append(asyncio.create_task(ask))
                    n += 1
                await asyncio.gather(*tasks)
    return result


def table(results: list[Result]) -> str:
    lines = [
        "| plugin replicas | most tokens in any 60 s window / limit | mean / limit | windows "
        "| 200 | 429 (with retry-after) | other failures | 200s with x-ratelimit-* |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        windows = r.windows()
        most = max(windows) / LIMIT if windows else 0.0
        mean = sum(windows) / len(windows) / LIMIT if windows else 0.0
        ok = len(r.served)
        lines.append(
            f"| {r.label} | {most:.3f} | {mean:.3f} | {len(windows)} | {ok} "
            f"| {r.refused} ({r.refused_with_retry}) | {r.failed} | {r.with_headers}/{ok} |"
        )
    return "\n".join(lines)


async def main_async(seed: int, duration_s: float) -> list[Result]:
    with tempfile.TemporaryDirectory() as tmp:
        return [
            await run(Path(tmp), replicas, kill, seed, duration_s)
            for replicas, kill in ((1, False), (3, False), (3, True))
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=DURATION_S, help="seconds a run")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(main_async(args.seed, args.duration))
    text = table(results)
    print(text)
    if args.no_write:
        return
    doc = (
        "## A tenant's token limit across three plugin replicas\n\n"
        "Generated by `python benchmarks/limits.py`: one Envoy whose ext_proc cluster holds 1 or "
        "3 plugin replicas sharing a redis-server, mock engines "
        f"{', '.join(PRESETS)}; admission on, tenant `team` limited to {LIMIT:,} tokens a "
        f"minute (`HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE`) and offering {OFFERED:g}x that for "
        f"{DURATION_S:g} s (Poisson arrivals, prompts of 20-60 words, `max_tokens` 20-100, "
        "answered in full). Tokens served: the engines' usage (prompt and completion) of each "
        "200, by when it ended, in every 60 s window sliding by the second (for the Redis run, "
        "the windows wholly after the kill: each replica then holds the tenant to a third of "
        "the limit, against what it served itself). Each run on a fresh fleet.\n\n"
        f"{text}\n"
    )
    print(f"wrote {write_section(DOC, 'tenant-limits', doc).name}", file=sys.stderr)


if __name__ == "__main__":
    main()
