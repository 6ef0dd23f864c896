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
import dataclasses
import math
import random
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson

from plugin.core.types import SloTarget
from plugin.errors import ConfigError
from plugin_tools.profile.build import BenchmarkRow
from plugin_tools.profile.steady import (
    Cell,
    CellHistory,
    GridSearch,
    Outcome,
    Probe,
    ProbePlan,
    bounding_axes,
    cell_probes,
    history_from_rows,
    pooled_gaps,
    swept_slo,
)
from plugin_tools.stats import interpolated_percentiles

__all__ = [
    "Sample",
    "SteadySweepPlan",
    "SteadyTally",
    "SweepPlan",
    "doubling",
    "rows_for",
    "run_probe_live",
    "run_steady_sweep",
    "run_sweep",
]


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
    output_tokens: int | None = None  # the engine's usage; None: not reported
    sent: float = 0.0  # perf_counter at the send


_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


async def _one(
    session: aiohttp.ClientSession,
    plan: SweepPlan,
    input_tokens: int,
    output_tokens: int,
    base_url: str | None = None,
) -> Sample:
    base_url = base_url or plan.base_url
    body = {
        "model": plan.model,
        "prompt": "hi " * input_tokens,
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "stream": True,
        # The last event then carries the tokens really generated (an engine may stop early).
        "stream_options": {"include_usage": True},
    }
    url = base_url.rstrip("/") + "/v1/completions"
    start = time.perf_counter()
    ttft: float | None = None
    gaps: list[float] = []
    tokens: int | None = None
    try:
        async with session.post(url, json=body, headers=dict(plan.headers)) as resp:
            previous = start
            async for chunk, _ in resp.content.iter_chunks():
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - previous)
                previous = now
                if b"completion_tokens" in chunk and (found := _USAGE.search(chunk)):
                    tokens = int(found.group(1))
            ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    return Sample(ok, time.perf_counter() - start, ttft, gaps, tokens, start)


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
            p50, p90, p99 = interpolated_percentiles(values, (50, 90, 99))
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
    tpot = [
        (s.e2e - s.ttft) / (n - 1)
        for s in served
        if s.ttft is not None and (n := s.output_tokens or output_tokens) > 1
    ] or [0.0]
    tpot_row = row("TPOT", sum(tpot) / len(tpot), tpot)
    return [
        row("TPUT", len(served) / wall_s),
        row("TT", len(served) * output_tokens / wall_s),
        row("E2E", sum(e2e) / len(e2e), e2e),
        row("TTFT", sum(ttft) / len(ttft), ttft),
        dataclasses.replace(
            tpot_row, extra={"pooled_gaps": pooled_gaps([g for s in served for g in s.gaps])}
        ),
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


def _progress(total: int, unit: str = "req") -> Any:
    from plugin_tools.extras import require_demo_extra

    require_demo_extra("profile sweep", ("tqdm",))
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, file=sys.stderr)


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


# The steady-state sweep (the default): `plugin_tools.profile.steady` decides, this runs probes.


@dataclass(frozen=True, slots=True)
class SteadySweepPlan:
    """What `profile sweep` measures by default: per cell, the largest rate one replica sustains
    within `slo` at `percentile`. Several base URLs are replicas of one deployment: cells that
    do not bound each other run on them at once."""

    base_urls: tuple[str, ...]
    model: str
    inputs: Sequence[int]
    outputs: Sequence[int]
    slo: SloTarget
    percentile: int = 99
    rate_floor: float = 0.1  # req/s: a cell that sustains less is reported unservable (0)
    rate_limit: float = 512.0  # req/s: a cell that sustains more is reported at it
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def cells(self) -> int:
        return len(self.inputs) * len(self.outputs)

    def grid(self) -> GridSearch:
        monotone_in, monotone_out = bounding_axes(self.slo)
        return GridSearch(
            tuple(self.inputs),
            tuple(self.outputs),
            rate_limit=self.rate_limit,
            floor=self.rate_floor,
            monotone_in=monotone_in,
            monotone_out=monotone_out,
        )

    def client_plan(self) -> SweepPlan:
        """What `_one` reads (model, headers)."""
        return SweepPlan(
            self.base_urls[0],
            self.model,
            self.inputs,
            self.outputs,
            (),
            headers=self.headers,
            timeout_s=self.timeout_s,
        )


@dataclass(slots=True)
class SteadyTally:
    """What a steady sweep did: for the user, and to price it in GPU time."""

    cells: int = 0  # finished in this run
    resumed: int = 0  # finished by an earlier run
    probes: int = 0
    requests: int = 0
    failed: int = 0
    gpu_seconds: float = 0.0  # the probes' spans, first send to last answer, summed


async def run_probe_live(
    session: aiohttp.ClientSession,
    client: SweepPlan,
    base_url: str,
    cell: Cell,
    probe: Probe,
    plan: ProbePlan,
) -> list[Outcome]:
    """One probe against one replica: Poisson sends at the probe's rate from the same seeded
    stream the simulator draws (`plugin_tools.sim.profiles.run_probe`), or, for the idle
    probe, one request at a time."""
    input_tokens, output_tokens = cell
    start = time.perf_counter()
    if plan.sequential:
        samples = [
            await _one(session, client, input_tokens, output_tokens, base_url)
            for _ in range(plan.requests)
        ]
    else:
        rng = random.Random(f"steady-{probe.seed}-{input_tokens}-{output_tokens}-{probe.rate!r}")
        tasks = []
        due = 0.0
        for k in range(plan.requests):
            if k:
                due += rng.expovariate(probe.rate)
                await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            one = _one(session, client, input_tokens, output_tokens, base_url)
            tasks.append(asyncio.create_task(one))
        samples = list(await asyncio.gather(*tasks))
    return [
        Outcome(
            s.sent - start,
            s.ok,
            math.nan if s.ttft is None else s.ttft,
            s.e2e,
            s.output_tokens or output_tokens,
            input_tokens,
            tuple(s.gaps),
        )
        for s in samples
    ]


def resume_from(plan: SteadySweepPlan, rows: Sequence[BenchmarkRow]) -> dict[Cell, CellHistory]:
    """The cells an earlier run of the same sweep measured (from its output file); an error if
    that run judged another SLO, or measured other cells."""
    histories = history_from_rows(rows)
    if not histories:
        return histories
    slos, percentile = swept_slo(rows)
    if slos != plan.slo.slos() or percentile != plan.percentile:
        raise ConfigError(
            f"the output file holds a sweep judged for {slos} at p{percentile}, not this one: "
            "write to another file"
        )
    foreign = sorted(set(histories) - {(i, o) for i in plan.inputs for o in plan.outputs})
    if foreign:
        raise ConfigError(f"the output file holds cells outside this grid: {foreign[:3]}")
    return histories


async def run_steady_sweep(
    plan: SteadySweepPlan,
    out: IO[bytes],
    *,
    earlier: Sequence[BenchmarkRow] = (),
    progress: bool = True,
) -> SteadyTally:
    """Every cell of the plan, resuming from `earlier` (the rows a previous run wrote to the same
    file: its finished cells are kept, an unfinished one goes on from its last probe). Rows are
    appended to `out` as each probe is judged."""
    histories = resume_from(plan, earlier)
    grid = plan.grid()
    tally = SteadyTally()
    for cell, history in histories.items():
        search = history.search()
        if search.done:
            grid.started.add(cell)
            grid.idle[cell] = history.idle_e2e_s
            grid.finish(cell, search)
            tally.resumed += 1
    bar = _progress(plan.cells, "cell") if progress else None
    if bar is not None:
        bar.update(tally.resumed)

    def emit(rows: list[BenchmarkRow]) -> None:
        for r in rows:
            out.write(orjson.dumps(r.to_json()) + b"\n")
        out.flush()

    client = plan.client_plan()
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def drive(cell: Cell, base_url: str) -> None:
            steps = cell_probes(
                grid, cell, plan.slo, plan.percentile, plan.model, emit, histories.get(cell)
            )
            try:
                probe, probe_plan = next(steps)
                while True:
                    if bar is not None:
                        bar.set_postfix(cell=f"{cell[0]}:{cell[1]}", rate=f"{probe.rate:.3g}")
                    outcomes = await run_probe_live(
                        session, client, base_url, cell, probe, probe_plan
                    )
                    tally.probes += 1
                    tally.requests += len(outcomes)
                    tally.failed += sum(not o.ok for o in outcomes)
                    tally.gpu_seconds += max((o.done_s for o in outcomes if o.ok), default=0.0)
                    probe, probe_plan = steps.send(outcomes)
            except StopIteration:
                pass

        free = list(plan.base_urls)
        running: dict[asyncio.Task[None], tuple[Cell, str]] = {}
        while not grid.done:
            for cell in grid.ready():
                if not free:
                    break
                grid.started.add(cell)
                base_url = free.pop()
                running[asyncio.create_task(drive(cell, base_url))] = (cell, base_url)
            if not running:
                break
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                _, base_url = running.pop(task)
                free.append(base_url)
                task.result()  # a bug surfaces here, not silently
                tally.cells += 1
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return tally
