"""`profile sweep`: measure one deployment over input lengths x output lengths x request rates.

Per cell and rate, `--prompts` streaming text completions of exactly that size (the prompt is
"hi " repeated, as AIBrix's benchmark sends it; `max_tokens` the output length) arrive as a
Poisson process at the rate, and the cell gets AIBrix's five rows:

- `TPUT`: requests served / wall time of the run (from the first send to the last response);
- `TT`: requested output tokens of the served requests / the same wall time;
- `E2E`: request latency, from sending to the response's end;
- `TTFT`: from sending to the first network chunk of the body;
- `TPOT`: the gaps between successive network chunks of every served request, pooled (a
  chunk can hold several tokens: this is AIBrix's definition, kept so profiles interchange).

E2E, TTFT and TPOT give mean, P50, P90 and P99, the percentiles interpolated as NumPy does
(AIBrix's), where this project's other reports use nearest-rank ones (`plugin_tools.stats`).
Unlike AIBrix's benchmark, a failed request (no 200) is not counted as served: it is counted
apart and reported, and a rate at which some fail is visibly not kept up with in TPUT.

Rows are appended to the output file as each rate finishes, so an interrupted sweep keeps what
it measured.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson

from plugin_tools.profile.build import BenchmarkRow
from plugin_tools.stats import interpolated_percentile

__all__ = ["Sample", "SweepPlan", "doubling", "rows_for", "run_sweep"]


def doubling(start: float, limit: float) -> list[float]:
    """start, 2 x start, ... up to and including limit."""
    if start <= 0 or limit < start:
        raise ValueError(f"need 0 < start <= limit, got {start}..{limit}")
    values = []
    v = start
    while v <= limit * (1 + 1e-9):
        values.append(v)
        v *= 2
    return values


@dataclass(frozen=True, slots=True)
class SweepPlan:
    base_url: str
    model: str
    inputs: Sequence[int]
    outputs: Sequence[int]
    rates: Sequence[float]
    prompts: int = 100
    seed: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def points(self) -> list[tuple[int, int, float]]:
        """(input, output, rate) in the order they run: AIBrix's order, outputs inside inputs."""
        return [(i, o, r) for i in self.inputs for o in self.outputs for r in self.rates]

    @property
    def requests(self) -> int:
        return len(self.points) * self.prompts

    def expected_seconds(self) -> float:
        """A lower bound on the wall time: the arrival spans alone."""
        return sum((self.prompts - 1) / rate for _, _, rate in self.points)


@dataclass(slots=True)
class Sample:
    """One request's measurements (times in seconds)."""

    ok: bool
    e2e: float
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)


async def _one(
    session: aiohttp.ClientSession, plan: SweepPlan, input_tokens: int, output_tokens: int
) -> Sample:
    body = {
        "model": plan.model,
        "prompt": "hi " * input_tokens,
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    url = plan.base_url.rstrip("/") + "/v1/completions"
    start = time.perf_counter()
    ttft: float | None = None
    gaps: list[float] = []
    try:
        async with session.post(url, json=body, headers=dict(plan.headers)) as resp:
            previous = start
            async for _chunk, _ in resp.content.iter_chunks():
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - previous)
                previous = now
            ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    return Sample(ok, time.perf_counter() - start, ttft, gaps)


async def run_point(
    session: aiohttp.ClientSession,
    plan: SweepPlan,
    input_tokens: int,
    output_tokens: int,
    rate: float,
    rng: random.Random,
) -> tuple[list[Sample], float]:
    """The prompts of one (cell, rate) as a Poisson process; (samples, wall seconds)."""
    tasks = []
    start = time.perf_counter()
    for i in range(plan.prompts):
        tasks.append(asyncio.create_task(_one(session, plan, input_tokens, output_tokens)))
        if i < plan.prompts - 1:
            await asyncio.sleep(rng.expovariate(rate))
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - start


def rows_for(
    plan: SweepPlan,
    input_tokens: int,
    output_tokens: int,
    rate: float,
    samples: Sequence[Sample],
    wall_s: float,
) -> list[BenchmarkRow]:
    """AIBrix's five rows for one (cell, rate) from its samples."""
    served = [s for s in samples if s.ok]

    def row(metric: str, mean: float, values: Sequence[float] | None = None) -> BenchmarkRow:
        p50 = p90 = p99 = math.nan
        if values:
            p50, p90, p99 = (interpolated_percentile(values, p) for p in (50, 90, 99))
        return BenchmarkRow(
            input_tokens,
            output_tokens,
            rate,
            metric,
            mean,
            p50,
            p90,
            p99,
            seed=plan.seed,
            model=plan.model,
            samples=len(samples),
        )

    e2e = [s.e2e for s in served] or [math.nan]
    ttft = [s.ttft for s in served if s.ttft is not None] or [math.nan]
    gaps = [g for s in served for g in s.gaps] or [0.0]
    return [
        row("TPUT", len(served) / wall_s),
        row("TT", len(served) * output_tokens / wall_s),
        row("E2E", sum(e2e) / len(e2e), e2e),
        row("TTFT", sum(ttft) / len(ttft), ttft),
        row("TPOT", sum(gaps) / len(gaps), gaps),
    ]


async def run_sweep(plan: SweepPlan, out: IO[bytes], *, progress: bool = True) -> tuple[int, int]:
    """Run every point of the plan, appending rows to `out`; (requests sent, failed)."""
    rng = random.Random(plan.seed)
    bar = _progress(plan.requests) if progress else None
    sent = failed = 0
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for input_tokens, output_tokens, rate in plan.points:
            samples, wall_s = await run_point(session, plan, input_tokens, output_tokens, rate, rng)
            sent += len(samples)
            failed += sum(not s.ok for s in samples)
            for r in rows_for(plan, input_tokens, output_tokens, rate, samples, wall_s):
                out.write(orjson.dumps(r.to_json()) + b"\n")
            out.flush()
            if bar is not None:
                bar.update(len(samples))
                bar.set_postfix(cell=f"{input_tokens}:{output_tokens}", rate=rate, failed=failed)
    if bar is not None:
        bar.close()
    return sent, failed


def _progress(total: int) -> Any:
    from plugin_tools.extras import require_demo_extra

    require_demo_extra("profile sweep", ("tqdm",))
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr)


def describe(plan: SweepPlan) -> str:
    """What `--dry-run` prints: the grid, the request count and a lower bound on the time."""
    return (
        f"inputs {list(plan.inputs)}\noutputs {list(plan.outputs)}\nrates {list(plan.rates)}\n"
        f"{len(plan.points)} points x {plan.prompts} prompts = {plan.requests} requests to "
        f"{plan.base_url}/v1/completions (model {plan.model}); at least "
        f"{plan.expected_seconds():.0f} s of arrivals"
    )


def open_output(path: Path | None) -> IO[bytes]:
    return sys.stdout.buffer if path is None else path.open("ab")
