"""Profiles in AIBrix's format: parsing both versions, and `profile build` reproducing AIBrix's
own output from the same benchmark rows."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from plugin.core.profile import GpuProfile, parse_profile, profile_key
from plugin.errors import ConfigError
from plugin_tools.profile.build import BenchmarkRow, build_profile, load_benchmark
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

A100 = "simulator-llama2-7b-a100"
A40 = "simulator-llama2-7b-a40"


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        len(ra) == len(rb) and all(abs(x - y) <= 1e-6 for x, y in zip(ra, rb, strict=True))
        for ra, rb in zip(a, b, strict=True)
    )


def test_build_reproduces_aibrix_profile(profile_dir: Path) -> None:
    """AIBrix built the A100 profile from these rows with --e2e 5 --percentile 99 --cost 1."""
    reference = json.loads((profile_dir / f"{A100}.json").read_text())
    rows = load_benchmark(profile_dir / f"{A100}.jsonl")
    built = build_profile(rows, A100, slos={"e2e": 5.0}, percentile=99, cost=1.0).to_json()
    assert built["indexes"] == reference["indexes"]
    assert _close(built["tputs"], reference["tputs"])
    assert _close(built["e2e"], reference["e2e"])
    assert built["slos"] == reference["slos"]
    assert (built["gpu"], built["cost"]) == (reference["gpu"], reference["cost"])
    assert list(built) == list(reference)  # same keys, same order
    # The grid is not trivial: some cells never meet the SLO, the rest at different rates.
    flat = [v for row in built["tputs"] for v in row]
    assert 0.0 in flat and len(set(flat)) > 20


@pytest.mark.parametrize("rule", ["aibrix", "auto"])  # auto: AIBrix's rows carry no verdicts
def test_cli_build_writes_the_same_profile(profile_dir: Path, tmp_path: Path, rule: str) -> None:
    out = tmp_path / "a100.json"
    result = run_cli(
        "profile",
        "build",
        A100,
        "--benchmark",
        str(profile_dir / f"{A100}.jsonl"),
        "--e2e",
        "5",
        "--percentile",
        "99",
        "--cost",
        "1.0",
        "--rule",
        rule,
        "-o",
        str(out),
        timeout_s=60,
    )
    assert result.returncode == 0, result.stderr
    written = json.loads(out.read_text())
    reference = json.loads((profile_dir / f"{A100}.json").read_text())
    assert _close(written["tputs"], reference["tputs"]) and written["created"] > 1.7e9
    assert _close(written["e2e"], reference["e2e"]) and "e2e_idle" not in written


@pytest.mark.parametrize("name", [A100, A40])
def test_both_formats_load(profile_dir: Path, name: str) -> None:
    doc = json.loads((profile_dir / f"{name}.json").read_text())
    profile = parse_profile(doc)
    assert profile.gpu == name
    assert profile.out_ticks == tuple(doc["indexes"][0])
    assert profile.in_ticks == tuple(doc["indexes"][1])
    assert len(profile.tputs) == len(profile.out_ticks)
    if name == A40:  # the older format: no e2e, no slos
        assert profile.e2e is None and profile.slos == {} and profile.percentile == 0
        assert profile.cost == 0.3
    else:
        assert profile.e2e is not None and profile.slos == {"e2e": 5.0}
    assert parse_profile(profile.to_json()) == profile  # round trip


def _cell(rate: float, tput: float, e2e_p99: float, ttft: float = 0.01) -> list[BenchmarkRow]:
    return [
        BenchmarkRow(128, 8, rate, "TPUT", tput),
        BenchmarkRow(128, 8, rate, "TT", tput * 8),
        BenchmarkRow(128, 8, rate, "E2E", e2e_p99 / 2, e2e_p99 / 3, e2e_p99 / 2, e2e_p99),
        BenchmarkRow(128, 8, rate, "TTFT", ttft, ttft, ttft, ttft),
        BenchmarkRow(128, 8, rate, "TPOT", 0.01, 0.01, 0.01, 0.01),
    ]


@pytest.mark.parametrize(
    ("cells", "expected_tput"),
    [
        # 1, 2, 4 pass the 1 s p99; 4 is not kept up with (3.0 < 0.9 x 4): 2 wins.
        ([(1.0, 1.0, 0.2), (2.0, 1.95, 0.5), (4.0, 3.0, 0.9), (8.0, 3.1, 4.0)], 1.95),
        # Every passing rate falls behind: the lowest passing rate.
        ([(1.0, 0.5, 0.2), (2.0, 0.9, 0.5), (4.0, 1.0, 2.0)], 0.5),
        # Nothing passes: 0, and e2e of the first row of the cell.
        ([(1.0, 1.0, 3.0), (2.0, 2.0, 4.0)], 0.0),
    ],
    ids=["highest-kept-up", "lowest-passing", "none"],
)
def test_rate_choice(cells: list[tuple[float, float, float]], expected_tput: float) -> None:
    rows = [r for rate, tput, p99 in cells for r in _cell(rate, tput, p99)]
    profile = build_profile(rows, "gpu", slos={"e2e": 1.0}, percentile=99)
    assert profile.tputs == ((expected_tput,),)
    assert profile.e2e is not None
    if expected_tput == 0.0:
        assert profile.e2e == ((cells[0][2] / 2,),)


def test_every_slo_applies_and_tpat_is_derived() -> None:
    rows = _cell(1.0, 1.0, 0.2, ttft=0.5) + _cell(2.0, 2.0, 0.4, ttft=0.05)
    # TTFT below 0.1 s: only rate 2 passes; its mean TTFT is recorded.
    profile = build_profile(rows, "gpu", slos={"ttft": 0.1}, percentile=90)
    assert profile.tputs == ((2.0,),) and profile.ttft == ((0.05,),)
    # TPAT = E2E / (128 + 8): mean E2E 0.1 s at rate 1 -> 0.000735 s a token, 0.2 s at rate 2
    # -> 0.00147: only rate 1 passes 0.0008.
    assert build_profile(rows, "gpu", slos={"tpat": 0.0008}).tputs == ((1.0,),)
    assert build_profile(rows, "gpu", slos={"tpat": 0.0005}).tputs == ((0.0,),)
    # A throughput SLO compares the mean, at or above.
    assert build_profile(rows, "gpu", slos={"tput": 1.5}).tputs == ((2.0,),)


def test_a_metric_missing_from_a_cell_fails_it() -> None:
    rows = [r for r in _cell(1.0, 1.0, 0.2) if r.metric != "TPOT"]
    assert build_profile(rows, "gpu").tputs == ((0.0,),)
    nan_row = [*(r for r in rows), BenchmarkRow(128, 8, 1.0, "TPOT", math.nan)]
    assert build_profile(nan_row, "gpu").tputs == ((0.0,),)


def test_bad_inputs_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"input_tokens": 1, "output_tokens": 1, "request_rate": 1, "metric": "E2E"}\nnot json\n'
    )
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not JSON"):
        load_benchmark(bad)
    with pytest.raises(ConfigError, match="unknown SLO latency"):
        build_profile(_cell(1.0, 1.0, 0.1), "gpu", slos={"latency": 1.0})
    with pytest.raises(ConfigError, match="tputs must be a 1 x 2"):
        parse_profile({"gpu": "g", "indexes": [[4], [8, 16]], "tputs": [[1.0]]})
    with pytest.raises(ConfigError, match="strictly increasing"):
        parse_profile({"gpu": "g", "indexes": [[8, 4], [8]], "tputs": [[1.0], [1.0]]})


def test_cell_lookup_by_log2_signature() -> None:
    profile = GpuProfile("g", 1.0, (4, 8, 16), (128, 256), ((0.0, 0.0),) * 3, 0.0)
    assert profile.cell(128, 4) == (0, 0)
    assert profile.cell(180, 11) == (1, 0)  # log2 11 = 3.46: nearer 8; 180: nearer 128
    assert profile.cell(182, 12) == (2, 1)  # log2 12 = 3.58: nearer 16; 182: nearer 256
    assert profile.cell(128, 22) == (2, 0)  # 22 is within half a doubling above 16
    assert profile.above_grid(128, 22) == ()
    # Beyond it: the border cell, said to be a guess for that axis.
    assert profile.cell(128, 23) == (2, 0) and profile.above_grid(128, 23) == ("output",)
    # 256 x sqrt(2) = 362.04: 362 is within half a doubling above the last input tick, 363 not.
    assert profile.above_grid(362, 4) == () and profile.above_grid(363, 4) == ("input",)
    assert profile.cell(100_000, 1_000) == (2, 1)
    assert profile.above_grid(100_000, 1_000) == ("output", "input")
    # Below the grid: the smallest tick (no request is harder than the smallest cell), not a
    # guess: 128 / sqrt(2) = 90.5, and 3 prompt tokens or none at all land on 128 too.
    for prompt, output in ((91, 4), (90, 4), (3, 1), (0, 0)):
        assert profile.cell(prompt, output) == (0, 0)
        assert profile.above_grid(prompt, output) == ()


def test_profile_key_is_aibrix_s() -> None:
    assert profile_key("llama2-7b", A100) == f"aibrix:profile_llama2-7b_{A100}"


def test_a_long_prompt_counts_in_a_mix_as_at_most_its_share_of_shorter_ones() -> None:
    # Inputs 128..1024 doubling, outputs 4 and 64. Output 4: the 512 and 1024 cells sustain
    # little alone (collisions), so inside a mix they count as two 256s and two 512s; the 256
    # cell is bound by its own work (11 >= 20 / 2) and keeps its rate. Output 64: a cell at 0
    # stays 0 and passes no bound on.
    tputs = ((20.0, 11.0, 2.0, 0.5), (8.0, 0.0, 1.0, 0.25))
    profile = GpuProfile("g", 1.0, (4, 64), (128, 256, 512, 1024), tputs, 0.0)
    assert profile.mix_tputs == ((20.0, 11.0, 5.5, 2.75), (8.0, 0.0, 1.0, 0.5))
    # Derived, never written: AIBrix's document is unchanged, and a copy derives its own.
    doc = profile.to_json()
    assert "mix_tputs" not in doc
    assert parse_profile(json.loads(json.dumps(doc))).mix_tputs == profile.mix_tputs
    cheaper = dataclasses.replace(profile, tputs=((20.0, 11.0, 2.0, 0.5), (8.0, 4.0, 1.0, 0.25)))
    assert cheaper.mix_tputs[1] == (8.0, 4.0, 2.0, 1.0)


def test_a_size_never_served_in_time_costs_late_what_its_prompt_scales_to() -> None:
    # Output 4: the 512 and 1024 prompts never meet the SLO (0); served late they cost what
    # the 256 cell does in a mix, times the prompts' ratio. Output 64: the 256 cell is not
    # served (late: half the 128's rate), the 512 is (its own), the 1024 not (half the 512's).
    # A row with nothing served in time below a size has no estimate (0).
    tputs = ((20.0, 11.0, 0.0, 0.0), (8.0, 0.0, 1.0, 0.0), (0.0, 0.0, 3.0, 1.0))
    profile = GpuProfile("g", 1.0, (4, 64, 512), (128, 256, 512, 1024), tputs, 0.0)
    assert profile.late_tputs == (
        (20.0, 11.0, 5.5, 2.75),
        (8.0, 4.0, 1.0, 0.5),
        (0.0, 0.0, 3.0, 1.5),
    )
    # Where the type serves the size in time, late costs what it costs in a mix.
    for late_row, mix_row in zip(profile.late_tputs, profile.mix_tputs, strict=True):
        assert all(late == mix for late, mix in zip(late_row, mix_row, strict=True) if mix > 0)
    assert "late_tputs" not in profile.to_json()
