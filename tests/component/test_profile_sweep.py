"""`profile sweep` against a real mock engine on loopback: AIBrix's rows, AIBrix's statistics."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import pytest_asyncio
import redis

from plugin.core.profile import parse_profile
from plugin.core.types import SloTarget
from plugin.errors import ConfigError
from plugin_tools.demo.redis_server import RedisServer
from plugin_tools.mock_engine.model import PRESETS
from plugin_tools.mock_engine.server import MockEngineHandle, start_mock_engine
from plugin_tools.profile.build import build_profile, load_benchmark, parse_row
from plugin_tools.profile.store import write_profile
from plugin_tools.profile.sweep import (
    Sample,
    SteadySweepPlan,
    SweepPlan,
    doubling,
    rows_for,
    run_steady_sweep,
    run_sweep,
)
from plugin_tools.stats import interpolated_percentile
from tests.helpers import run_cli

pytestmark = pytest.mark.component

MODEL = "llama-3-8b"
ROW_KEYS = [
    "input_tokens",
    "output_tokens",
    "request_rate",
    "seed",
    "model",
    "samples",
    "metric",
    "mean",
]


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[MockEngineHandle]:
    params = dataclasses.replace(PRESETS["a100"], time_scale=0.05)
    handle = await start_mock_engine(params, model=MODEL, name="a100-0")
    yield handle
    await handle.close()


def test_doubling_grid() -> None:
    assert doubling(128, 2048) == [128, 256, 512, 1024, 2048]
    assert doubling(1, 6) == [1, 2, 4]
    with pytest.raises(ValueError):
        doubling(4, 2)


def test_interpolated_percentile_is_numpy_s() -> None:
    rng = random.Random(3)
    for n in (1, 2, 5, 100, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (50, 90, 99):
            assert interpolated_percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_rows_follow_aibrix_definitions() -> None:
    plan = SweepPlan("http://x", MODEL, [16], [4], [2.0], prompts=3, seed=7)
    samples = [
        Sample(True, 1.0, 0.1, [0.2, 0.3]),
        Sample(True, 2.0, 0.2, [0.4]),
        Sample(False, 0.5),  # failed: not served, not in the latency statistics
    ]
    rows = {r.metric: r for r in rows_for(plan, 16, 4, 2.0, samples, wall_s=4.0)}
    assert list(rows) == ["TPUT", "TT", "E2E", "TTFT", "TPOT"]
    assert rows["TPUT"].mean == 0.5 and rows["TT"].mean == 2.0  # 2 served, 4 tokens each, 4 s
    assert rows["E2E"].mean == 1.5 and rows["E2E"].p50 == pytest.approx(1.5)
    # TPOT per request, (E2E - TTFT) / (tokens - 1): (1.0 - 0.1) / 3 and (2.0 - 0.2) / 3.
    assert rows["TPOT"].mean == pytest.approx(0.45)
    assert rows["TPOT"].p90 == pytest.approx(np.percentile([0.3, 0.6], 90))
    # AIBrix's TPOT, every gap between chunks pooled, under a key of its own.
    pooled = rows["TPOT"].extra["pooled_gaps"]
    assert pooled["mean"] == pytest.approx(0.3)
    assert pooled["P90"] == pytest.approx(np.percentile([0.2, 0.3, 0.4], 90))
    assert rows["TPOT"].to_json()["pooled_gaps"] == pooled  # written after AIBrix's keys
    assert list(rows["TPOT"].to_json())[-1] == "pooled_gaps"
    assert all(r.samples == 3 and r.seed == 7 for r in rows.values())
    assert list(rows["TPUT"].to_json()) == ROW_KEYS  # no percentiles for throughput
    assert list(rows["E2E"].to_json()) == [*ROW_KEYS, "P50", "P90", "P99"]


async def test_sweep_against_an_engine_builds_a_profile(engine: MockEngineHandle) -> None:
    plan = SweepPlan(engine.url, MODEL, [16, 32], [4, 8], [8.0, 16.0], prompts=6, seed=1)
    out = io.BytesIO()
    sent, failed = await run_sweep(plan, out, progress=False)
    assert (sent, failed) == (48, 0)
    docs = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert len(docs) == 8 * 5
    rows = [parse_row(d, "sweep") for d in docs]
    for r in rows:
        assert r.samples == 6 and r.model == MODEL
    by = {(r.input_tokens, r.output_tokens, r.request_rate, r.metric): r for r in rows}
    for inp, out_tokens, rate in plan.points:
        e2e, ttft = by[(inp, out_tokens, rate, "E2E")], by[(inp, out_tokens, rate, "TTFT")]
        assert 0 < ttft.mean < e2e.mean and e2e.p50 <= e2e.p99
        assert by[(inp, out_tokens, rate, "TPUT")].mean > 0  # 6 served / the run's wall time
        tt = by[(inp, out_tokens, rate, "TT")].mean
        assert tt == pytest.approx(by[(inp, out_tokens, rate, "TPUT")].mean * out_tokens)
    profile = build_profile(rows, "a100", slos={"e2e": 30.0}, percentile=99)
    assert profile.in_ticks == (16, 32) and profile.out_ticks == (4, 8)
    assert all(v > 0 for row in profile.tputs for v in row)  # an easy SLO: every cell passes


async def test_a_dead_endpoint_counts_failures_not_service(reserved_port: int) -> None:
    plan = SweepPlan(f"http://127.0.0.1:{reserved_port}", MODEL, [16], [4], [50.0], prompts=3)
    out = io.BytesIO()
    sent, failed = await run_sweep(plan, out, progress=False)
    assert (sent, failed) == (3, 3)
    rows = {d["metric"]: d for d in map(orjson.loads, out.getvalue().splitlines())}
    assert rows["TPUT"]["mean"] == 0.0
    assert rows["E2E"]["mean"] is None  # NaN: no served request; a profile never passes it


def test_dry_run_prints_the_plan_and_sends_nothing(reserved_port: int) -> None:
    result = run_cli(
        "profile",
        "sweep",
        "--base-url",
        f"http://127.0.0.1:{reserved_port}",
        "--model",
        MODEL,
        "--input-start",
        "128",
        "--input-limit",
        "512",
        "--output-start",
        "4",
        "--output-limit",
        "8",
        "--rate-start",
        "1",
        "--rate-limit",
        "4",
        "--prompts",
        "10",
        "--rule",
        "aibrix",
        "--dry-run",
        timeout_s=60,
    )
    assert result.returncode == 0, result.stderr
    assert "inputs [128, 256, 512]" in result.stderr
    assert "18 points x 10 prompts = 180 requests" in result.stderr


def test_the_steady_sweep_needs_an_slo_and_dry_runs(reserved_port: int) -> None:
    base = ["profile", "sweep", "--base-url", f"http://127.0.0.1:{reserved_port}"]
    base += ["--model", MODEL, "--input-limit", "256", "--output-limit", "8", "--dry-run"]
    missing = subprocess.run(
        [sys.executable, "-m", "plugin", *base], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "needs an SLO to judge" in missing.stderr
    planned = run_cli(*base, "--ttft", "1", "--tpot", "0.06", timeout_s=60)
    assert "4 cells, SLO {'ttft': 1.0, 'tpot': 0.06} at p99" in planned.stderr


async def test_a_steady_sweep_on_two_replicas_resumes_and_builds(
    engine: MockEngineHandle, tmp_path: Path
) -> None:
    """Two replicas of one deployment share the cells; an interrupted file is resumed from its
    last probe, and `profile build` (rule auto: steady) turns it into a profile AIBrix's readers
    take (its keys, in its order, then e2e_idle)."""
    second = await start_mock_engine(
        dataclasses.replace(PRESETS["a100"], time_scale=0.05), model=MODEL, name="a100-1"
    )
    try:
        plan = SteadySweepPlan(
            (engine.url, second.url),
            MODEL,
            [16, 32],
            [4, 8],
            SloTarget(ttft_s=2.0),
            percentile=50,
            rate_limit=16.0,
        )
        out = io.BytesIO()
        tally = await run_steady_sweep(plan, out, progress=False)
    finally:
        await second.close()
    lines = out.getvalue().splitlines()
    rows = [parse_row(orjson.loads(line), "sweep") for line in lines]
    assert tally.cells == 4 and tally.failed == 0 and tally.gpu_seconds > 0
    assert {(r.input_tokens, r.output_tokens) for r in rows} == {(16, 4), (16, 8), (32, 4), (32, 8)}
    # Cut the file after the first probe of the last cell (five rows a probe), then resume.
    cells = [(r.input_tokens, r.output_tokens) for r in rows if r.metric == "TPUT"]
    cut = 5 * (cells.index(cells[-1]) + 1)
    path = tmp_path / "a100.jsonl"
    path.write_bytes(b"\n".join(lines[:cut]) + b"\n")
    args = ["profile", "sweep", "--base-url", engine.url, "--model", MODEL, "--ttft", "2"]
    args += ["--input-start", "16", "--input-limit", "32", "--output-start", "4"]
    args += ["--output-limit", "8", "--percentile", "50", "--rate-limit", "16"]
    args += ["--no-progress", "-o", str(path)]
    result = await asyncio.to_thread(run_cli, *args, timeout_s=300)
    assert "1 cells swept (3 from an earlier run)" in result.stderr
    resumed = path.read_bytes().splitlines()
    assert len(resumed) > cut and resumed[:cut] == lines[:cut]  # nothing measured twice
    again = await asyncio.to_thread(run_cli, *args, timeout_s=60)
    assert "0 cells swept (4 from an earlier run)" in again.stderr
    assert path.read_bytes().splitlines() == resumed
    built = await asyncio.to_thread(
        run_cli, "profile", "build", "a100", "--benchmark", str(path), timeout_s=60
    )
    doc = orjson.loads(built.stdout)
    keys = ["gpu", "cost", "tputs", "indexes", "created", "e2e", "ttft", "slos", "e2e_idle"]
    assert list(doc) == keys  # AIBrix's, in its order (ttft: a TTFT SLO), then ours
    assert doc["indexes"] == [[4, 8], [16, 32]]
    assert doc["slos"] == {"percentile": 50, "ttft": 2.0}
    profile = parse_profile(doc)
    assert all(0 < v <= 16.0 for row in profile.tputs for v in row)


async def test_build_stores_the_profile_under_aibrix_s_key(
    redis_server: RedisServer, profile_dir: Path
) -> None:
    rows = load_benchmark(profile_dir / "simulator-llama2-7b-a100.jsonl")
    profile = build_profile(rows, "simulator-llama2-7b-a100", slos={"e2e": 5.0}, percentile=99)
    target = f"redis://127.0.0.1:{redis_server.port}/2?model=llama2-7b"
    message = await asyncio.to_thread(write_profile, profile, target)
    assert "aibrix:profile_llama2-7b_simulator-llama2-7b-a100" in message
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=2)
    try:
        stored = client.get("aibrix:profile_llama2-7b_simulator-llama2-7b-a100")
    finally:
        client.close()
    assert stored is not None and parse_profile(orjson.loads(stored)) == profile
    with pytest.raises(ConfigError, match="needs \\?model=MODEL"):
        write_profile(profile, f"redis://127.0.0.1:{redis_server.port}/0")
