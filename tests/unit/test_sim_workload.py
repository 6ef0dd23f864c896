"""Workloads: length distributions, arrival processes, the Azure traces and the CLI's parsing.

The Azure traces come from the shared data (the `trace_dir` fixture, tests/conftest.py).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from plugin.errors import ConfigError
from plugin_tools.sim.traces import load_trace, parse_workload
from plugin_tools.sim.workload import (
    CHAT,
    LONG,
    Arrivals,
    MixedLengths,
    TraceLengths,
    generate,
)

pytestmark = pytest.mark.unit


def test_chat_lengths_have_the_specified_medians_and_clips() -> None:
    rng = random.Random(1)
    samples = [CHAT.sample(rng) for _ in range(20_000)]
    prompts, outputs = zip(*samples, strict=True)
    assert statistics.median(prompts) == pytest.approx(40, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(280, rel=0.1)
    assert max(prompts) == 4096 and max(outputs) == 1024 and min(prompts) >= 1


def test_the_long_mix_has_long_prompts_with_short_answers(tmp_path: Path) -> None:
    lengths, traces = parse_workload("chat:0.8,long:0.2", tmp_path)  # synthetic: no trace read
    assert isinstance(lengths, MixedLengths) and not traces
    rng = random.Random(3)
    samples = [lengths.sample(rng) for _ in range(5000)]
    long = [(p, o) for p, o in samples if p > 4096]
    assert 0.17 < len(long) / len(samples) < 0.23  # chat prompts are clipped at 4096
    assert all(o <= LONG.max_output == 128 for _, o in long)
    assert statistics.median(p for p, _ in long) == pytest.approx(6000, rel=0.1)
    # What a client asks for at most: the longest answer of any part.
    assert lengths.max_output == CHAT.max_output == 1024


@pytest.mark.parametrize(("kind", "cv"), [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_arrivals_have_the_rate_and_burstiness_asked_for(kind: str, cv: float) -> None:
    times = Arrivals(kind, cv).times(5.0, 20_000, random.Random(2))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = statistics.fmean(gaps)
    assert 1 / mean == pytest.approx(5.0, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.1)


def test_trace_arrivals_keep_the_trace_gaps_rescaled() -> None:
    arrivals = Arrivals("trace", trace_times=(0.0, 1.0, 1.5, 4.0))
    times = arrivals.times(2.0, 6, random.Random(0))
    assert len(times) / times[-1] == pytest.approx(2.0, rel=0.35)
    gaps = sorted(round(b - a, 6) for a, b in zip([0.0, *times], times, strict=False))
    # mean trace gap 4/3 s; at 2 req/s each gap is scaled by 1 / (2 * 4/3)
    assert set(gaps) == {round(g / (2 * 4 / 3), 6) for g in (1.0, 0.5, 2.5)}


@pytest.mark.parametrize(
    ("name", "rows"), [("azure-conv", 19_000), ("azure-code", 8_000)], ids=["conv", "code"]
)
def test_azure_traces_load_from_shared_data(name: str, rows: int, trace_dir: Path) -> None:
    lengths, traces = parse_workload(name, trace_dir)
    assert isinstance(lengths, TraceLengths) and len(lengths.rows) > rows
    trace = traces[name]
    assert len(trace.times) == len(lengths.rows)
    assert all(p >= 1 and o >= 1 for p, o in lengths.rows)


def test_a_mix_draws_from_each_part_by_weight(trace_dir: Path) -> None:
    lengths, _ = parse_workload("chat:3,azure-code:1", trace_dir)
    assert isinstance(lengths, MixedLengths)
    rng = random.Random(5)
    code_like = sum(1 for _ in range(4000) if lengths.sample(rng)[0] > 1000)
    # Code prompts are long (median in the thousands); chat prompts rarely pass 1000 tokens.
    assert 0.15 < code_like / 4000 < 0.35


@pytest.mark.parametrize(
    "spec", ["sharegpt", "chat:-1", "chat:x"], ids=["unknown", "negative", "not-a-number"]
)
def test_bad_workloads_are_config_errors(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        parse_workload(spec, tmp_path)  # no trace is read: the spec is wrong first


def test_a_missing_or_malformed_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "nope.csv", "x")
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ConfigError, match="expected columns"):
        load_trace(bad, "x")


def test_a_request_keeps_its_lengths_and_shape_of_arrival_at_every_rate() -> None:
    # Bisection over rates must compare like with like: the k-th request is the same request.
    low = generate(CHAT, Arrivals("gamma", 2.0), 4.0, 500, random.Random(9))
    high = generate(CHAT, Arrivals("gamma", 2.0), 8.0, 900, random.Random(9))
    assert [(r.prompt_tokens, r.output_tokens) for r in low] == [
        (r.prompt_tokens, r.output_tokens) for r in high[:500]
    ]
    assert all(h.arrival * 2 == pytest.approx(lo.arrival) for lo, h in zip(low, high, strict=False))
