"""Admission under overload through a real Envoy: an interactive tenant keeps its SLO while a
batch tenant absorbs the shedding; the same run without admission for comparison.

A mixed fleet of mock engines (one A100, two V100s, each batch capped at `MAX_NUM_SEQS` and the
cap declared in the pods file) behind one Envoy and the plugin (`load-balance`). Open-loop
Poisson arrivals at `LOAD` times the fleet's capacity (what its engines complete a second at
their full batch: `saturated_output_tokens_per_s` over the mean answer), 20% of them from tenant
`chat` (class `interactive`), the rest from `bulk` (class `batch`); streamed chat completions,
prompts of 50-150 words, answers of 64-192 tokens. The engines run `TIME_SCALE` times slower
than the GPUs they model, so the SLO is scaled the same: time to first token within
`TTFT_S` x scale, mean time per output token within `TPOT_S` x scale (the simulator's 1 s and
60 ms). Two runs, each on a fresh fleet: admission off (today's default: every request routed at
once, the engines queue the excess in arrival order) and on (`interactive,batch`, the batch
class's longest wait `BATCH_WAIT_MS`). Per tenant, over the requests sent after `WARMUP_S`: the
share served within the SLO (a 503, an error or a timeout counts as missed), the share shed
(503 with `retry-after`), and the p99 TTFT of those served.

    python benchmarks/admission_envoy.py          # about 6 minutes on 2 cores

Writes its table into docs/benchmarks.md between the admission-envoy markers.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import orjson

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from plugin_tools.docsection import write_section
from plugin_tools.mock_engine.model import PRESETS as ENGINE_PRESETS
from plugin_tools.mock_engine.model import saturated_output_tokens_per_s

MODEL = "llama-3-8b"
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
PRESETS = ("a100", "v100", "v100")
MAX_NUM_SEQS = 16
TIME_SCALE = 4.0
LOAD = 1.5
INTERACTIVE_SHARE = 0.2
DURATION_S = 100.0
WARMUP_S = 20.0
TTFT_S = 1.0
TPOT_S = 0.060
BATCH_WAIT_MS = 10_000
MEAN_ANSWER = 128  # tokens: answers of 64-192, uniform
TIMEOUT_S = 90.0


@dataclass
class Outcome:
    tenant: str
    sent_at: float
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self) -> bool:
        return (
            self.status == 200
            and self.ttft_s is not None
            and self.ttft_s <= TTFT_S * TIME_SCALE
            and (self.tpot_s is None or self.tpot_s <= TPOT_S * TIME_SCALE)
        )


@dataclass
class Result:
    label: str
    outcomes: list[Outcome] = field(default_factory=list)


def capacity_rps() -> float:
    """Requests a second the fleet completes with every batch full: each engine's decode
    throughput at its cap over the mean answer (prefill left out: an upper bound)."""
    return sum(
        saturated_output_tokens_per_s(
            replace(ENGINE_PRESETS[p], max_num_seqs=MAX_NUM_SEQS, time_scale=TIME_SCALE)
        )
        / MEAN_ANSWER
        for p in PRESETS
    )


async def _ask(session: aiohttp.ClientSession, url: str, out: Outcome, body: bytes) -> None:
    headers = {"x-tenant": out.tenant, "content-type": "application/json"}
    started = time.monotonic()
    first: float | None = None
    tokens = 0  # the engine's count (its usage chunk): an event may carry several tokens
    try:
        async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                await r.read()
                return
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                data = orjson.loads(line[6:])
                if not data.get("choices"):
                    tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
                    continue
                if first is None:
                    first = time.monotonic()
                    out.ttft_s = first - started
        ended = time.monotonic()
        if first is not None and tokens > 1:
            out.tpot_s = (ended - first) / (tokens - 1)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        out.status = out.status if out.status != 200 else 0


def _body(rng: random.Random) -> bytes:
    words = " ".join(f"w{rng.randrange(5000)}" for _ in range(rng.randint(50, 150)))
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(64, 192),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def run(tmp: Path, admission: bool, seed: int, duration_s: float) -> Result:
    result = Result("admission on" if admission else "admission off (today)")
    rng = random.Random(seed)
    env = {"ROUTING_ALGORITHM": "load-balance"}
    if admission:
        env |= {
            "HETERO_GATEWAY_ADMISSION": "on",
            "HETERO_GATEWAY_TENANT_HEADER": "x-tenant",
            "HETERO_GATEWAY_PRIORITY_CLASSES": "interactive,batch",
            "HETERO_GATEWAY_TENANT_CLASSES": "chat:interactive",
            "HETERO_GATEWAY_CLASS_MAX_WAIT_MS": f"batch:{BATCH_WAIT_MS}",
        }
    spec = FleetSpec(
        model=MODEL,
        listen_port=free_port(),
        presets=PRESETS,
        time_scale=TIME_SCALE,
        max_num_seqs=MAX_NUM_SEQS,
        declare_max_num_seqs=True,
        plugin_env=env,
    )
    logs = tmp / ("on" if admission else "off")
    logs.mkdir()
    rate = LOAD * capacity_rps()
    async with LocalFleet(spec, str(logs)) as fleet:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            t0, tasks, at = time.monotonic(), [], 0.0
            while True:
                at += rng.expovariate(rate)
                if at >= duration_s:
                    break
                tenant = "chat" if rng.random() < INTERACTIVE_SHARE else "bulk"
                out = Outcome(tenant, at)
                result.outcomes.append(out)
                body = _body(rng)
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                tasks.append(asyncio.create_task(_ask(session, fleet.envoy_url, out, body)))
            await asyncio.gather(*tasks)
    return result


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def table(results: list[Result], warmup_s: float) -> str:
    lines = [
        "| run | tenant (class) | requests | within SLO | shed (503) | other failures "
        "| p99 TTFT of those served |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for tenant, cls in (("chat", "interactive"), ("bulk", "batch")):
            mine = [o for o in r.outcomes if o.tenant == tenant and o.sent_at >= warmup_s]
            n = len(mine) or 1
            met = sum(o.met() for o in mine) / n
            shed = sum(o.status == 503 for o in mine) / n
            failed = sum(o.status not in (200, 503) for o in mine) / n
            p99 = _p99([o.ttft_s for o in mine if o.status == 200 and o.ttft_s is not None])
            p99_text = "-" if p99 is None else f"{p99:.2f} s"
            lines.append(
                f"| {r.label} | {tenant} ({cls}) | {len(mine)} | {met:.3f} | {shed:.3f} "
                f"| {failed:.3f} | {p99_text} |"
            )
    return "\n".join(lines)


async def main_async(seed: int, duration_s: float) -> list[Result]:
    with tempfile.TemporaryDirectory() as tmp:
        return [await run(Path(tmp), on, seed, duration_s) for on in (False, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=DURATION_S, help="seconds a run")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    warmup = min(WARMUP_S, args.duration / 5)
    results = asyncio.run(main_async(args.seed, args.duration))
    text = table(results, warmup)
    print(text)
    if args.no_write:
        return
    doc = (
        "## Admission under overload through Envoy\n\n"
        "Generated by `python benchmarks/admission_envoy.py`: one Envoy and the plugin "
        f"(`load-balance`) in front of mock engines {', '.join(PRESETS)}, each batch capped at "
        f"{MAX_NUM_SEQS} (declared in the pods file), running {TIME_SCALE:g}x slower than the "
        f"GPUs they model; open-loop Poisson arrivals at {LOAD:g}x the fleet's capacity "
        f"({LOAD * capacity_rps():.2f} req/s), {INTERACTIVE_SHARE:.0%} from tenant `chat` "
        "(class interactive), the rest from `bulk` (batch); streamed, prompts of 50-150 words, "
        f"answers of 64-192 tokens, {args.duration:g} s a run, the first {warmup:g} s not "
        f"counted. SLO: TTFT within {TTFT_S * TIME_SCALE:g} s and mean TPOT within "
        f"{TPOT_S * TIME_SCALE * 1000:g} ms (1 s and 60 ms, scaled); a 503 or a timeout "
        f"({TIMEOUT_S:g} s) is missed. With admission: classes `interactive,batch`, the batch "
        f"class's longest wait {BATCH_WAIT_MS / 1000:g} s. Each run on a fresh fleet.\n\n"
        f"{text}\n"
    )
    print(f"wrote {write_section(DOC, 'admission-envoy', doc).name}", file=sys.stderr)


if __name__ == "__main__":
    main()
