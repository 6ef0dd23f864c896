"""The simulated engine: step costs, chunked prefill, FCFS, KV preemption, token accounting."""

from __future__ import annotations

import pytest

from plugin_tools.sim.engine import PRESETS, GpuProfile, SimEngine, SimSeq, parse_fleet

pytestmark = pytest.mark.unit


def drive(engine: SimEngine, seqs: list[SimSeq], limit_s: float = 10_000.0) -> float:
    """Submit everything at t=0 and run steps until idle; returns the end time."""
    for seq in seqs:
        engine.submit(seq)
    now = 0.0
    while True:
        plan = engine.plan_step()
        if plan is None:
            return now
        duration, chunks = plan
        now += duration
        engine.finish_step(now, duration, chunks)
        assert now < limit_s, "engine did not drain"


def test_presets_match_the_issue_table() -> None:
    table = {
        "h100": (5, 0.06, 0.03, 440_000),
        "a100": (9, 0.12, 0.09, 440_000),
        "l20": (20, 0.30, 0.25, 210_000),
        "a40": (24, 0.35, 0.20, 210_000),
        "v100": (22, 0.35, 0.35, 100_000),
        "a10": (30, 0.45, 0.25, 45_000),
        "l4": (60, 0.8, 0.25, 45_000),
    }
    assert {k: (p.a_ms, p.b_ms, p.p_ms, p.kv_tokens) for k, p in PRESETS.items()} == table


@pytest.mark.parametrize(
    ("spec", "overrides", "expected"),
    [
        ("a100,l20,v100", {}, [("a100", 256), ("l20", 256), ("v100", 256)]),
        ("3xa100", {"max_num_seqs": 32}, [("a100", 32)] * 3),
        ("a100,l20", {"a100.max_num_seqs": 32}, [("a100", 32), ("l20", 256)]),
    ],
    ids=["list", "count-and-override-all", "override-one-type"],
)
def test_parse_fleet(spec: str, overrides: dict[str, int], expected: list[tuple[str, int]]) -> None:
    assert [(p.name, p.max_num_seqs) for p in parse_fleet(spec, **overrides)] == expected


@pytest.mark.parametrize("spec", ["", "b200", "a100,,tpu"], ids=["empty", "unknown", "mixed"])
def test_parse_fleet_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_fleet(spec)


def test_every_token_is_generated_once_and_fcfs_admission() -> None:
    engine = SimEngine("e", GpuProfile("t", 10, 0.1, 0.01, 100_000, max_num_seqs=2))
    seqs = [SimSeq(i, 0.0, 10, 5 + i) for i in range(5)]
    drive(engine, seqs)
    assert engine.generated_tokens == sum(s.output_tokens for s in seqs)
    assert all(s.finish_at > 0 for s in seqs)
    firsts = [s.first_token_at for s in seqs]
    assert firsts == sorted(firsts)  # admitted in arrival order
    assert engine.idle() and engine.kv_used() == 0


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    profile = GpuProfile("t", 10, 0.0, 0.1, 100_000, max_batched_tokens=2048)
    engine = SimEngine("e", profile)
    seq = SimSeq(0, 0.0, 5000, 3)
    drive(engine, [seq])
    # 2048 + 2048 + 904 prompt tokens: three steps, the last one emits the first token.
    expected_ttft = (3 * 10 + 5000 * 0.1) / 1000
    assert seq.first_token_at == pytest.approx(expected_ttft)
    assert engine.steps == 3 + 2


def test_decode_step_cost_follows_a_plus_b_times_batch() -> None:
    profile = GpuProfile("t", 9, 0.12, 0.0, 100_000)
    engine = SimEngine("e", profile)
    seqs = [SimSeq(i, 0.0, 1, 11) for i in range(4)]
    end = drive(engine, seqs)
    # One prefill step (no decoding yet, a ms) emits the first tokens; then 10 decode steps of 4.
    assert end == pytest.approx((9 + 10 * (9 + 0.12 * 4)) / 1000)


def test_kv_exhaustion_preempts_the_newest_and_recomputes() -> None:
    # Room for about 1.5 sequences: the second admitted is preempted, then recomputed.
    profile = GpuProfile("t", 5, 0.1, 0.01, 300, max_batched_tokens=512)
    engine = SimEngine("e", profile)
    a, b = SimSeq(0, 0.0, 100, 100), SimSeq(1, 0.0, 100, 100)
    drive(engine, [a, b])
    assert engine.preemptions >= 1
    assert b.preemptions >= 1 and a.preemptions == 0
    assert engine.generated_tokens == 200  # recompute does not emit tokens twice
    assert a.finish_at < b.finish_at
    assert engine.kv_used() == 0


def test_a_sequence_larger_than_the_cache_does_not_fit() -> None:
    engine = SimEngine("e", GpuProfile("t", 5, 0.1, 0.01, 100))
    assert not engine.fits(SimSeq(0, 0.0, 60, 50))
    assert engine.fits(SimSeq(1, 0.0, 50, 50))


def test_snapshot_reports_running_waiting_and_kv() -> None:
    engine = SimEngine("e", GpuProfile("t", 5, 0.1, 0.01, 1000, max_num_seqs=1))
    for i in range(3):
        engine.submit(SimSeq(i, 0.0, 100, 10))
    plan = engine.plan_step()
    assert plan is not None
    engine.finish_step(plan[0], *plan)
    snap = engine.snapshot()
    assert (snap.running, snap.waiting) == (1, 2)
    assert snap.kv_usage == pytest.approx(101 / 1000)
