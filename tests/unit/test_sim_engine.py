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


def test_a_cached_prefix_skips_its_prefill_and_is_counted_as_vllm_counts_hits() -> None:
    profile = GpuProfile("t", 10.0, 0.1, 1.0, 100_000, max_batched_tokens=4096)
    engine = SimEngine("e", profile)
    first = SimSeq(0, 0.0, 1100, 10, prefix_group=7, shared_tokens=1000)
    drive(engine, [first])
    assert (engine.prefix_query_tokens, engine.prefix_hit_tokens) == (1100, 0)
    # the first request's prefill cost 1,100 prompt tokens; the second, same group, only 100
    assert first.first_token_at == pytest.approx(profile.step_ms(0, 1100) / 1000)
    second = SimSeq(1, 0.0, 1100, 10, prefix_group=7, shared_tokens=1000)
    start = drive(engine, [])
    end = drive(engine, [second])
    assert end - start == pytest.approx(
        profile.step_ms(0, 100) / 1000 + 9 * profile.step_ms(1) / 1000
    )
    assert (engine.prefix_query_tokens, engine.prefix_hit_tokens) == (2200, 1000)
    # another group's prefix, and a request of no group, find nothing
    other = SimSeq(2, 0.0, 1100, 10, prefix_group=8, shared_tokens=1000)
    alone = SimSeq(3, 0.0, 1100, 10)
    drive(engine, [other, alone])
    assert engine.prefix_hit_tokens == 1000
    assert engine.generated_tokens == 40


def test_the_prefix_cache_keeps_a_share_of_the_kv_cache_least_recently_used_out() -> None:
    # 25% of 10,000 KV tokens: two prefixes of 1,000 fit, a third pushes out the oldest
    profile = GpuProfile("t", 10.0, 0.1, 0.1, 10_000, prefix_cache_share=0.25)
    engine = SimEngine("e", profile)
    rid = 0

    def ask(group: int) -> int:
        nonlocal rid
        before = engine.prefix_hit_tokens
        rid += 1
        drive(engine, [SimSeq(rid, 0.0, 1050, 2, prefix_group=group, shared_tokens=1000)])
        return engine.prefix_hit_tokens - before

    assert [ask(1), ask(2), ask(1)] == [0, 0, 1000]  # 1 is now the most recent
    assert ask(3) == 0  # 2, the least recent, goes
    assert [ask(1), ask(3), ask(2)] == [1000, 1000, 0]
    # a prefix larger than the whole share is never cached
    big = GpuProfile("t", 10.0, 0.1, 0.1, 1_000, prefix_cache_share=0.25)
    engine = SimEngine("e", big)
    for k in range(2):
        drive(engine, [SimSeq(k, 0.0, 400, 2, prefix_group=1, shared_tokens=300)])
    assert engine.prefix_hit_tokens == 0
    with pytest.raises(ValueError, match="prefix_cache_share"):
        GpuProfile("t", 10.0, 0.1, 0.1, 1_000, prefix_cache_share=1.5)


def test_a_preempted_request_with_a_cached_prefix_releases_all_the_kv_it_held() -> None:
    # A KV cache so small that the second long decode preempts: the accounting must return to 0.
    profile = GpuProfile("t", 10.0, 0.1, 0.1, 3_000, prefix_cache_share=0.5)
    engine = SimEngine("e", profile)
    drive(engine, [SimSeq(0, 0.0, 1100, 2, prefix_group=1, shared_tokens=1000)])
    seqs = [SimSeq(k, 0.0, 1100, 600, prefix_group=1, shared_tokens=1000) for k in (1, 2)]
    drive(engine, seqs)
    assert engine.preemptions > 0
    assert all(s.finish_at > 0 for s in seqs)
    assert engine.kv_used() == 0 and engine.idle()
    assert engine.prefix_hit_tokens >= 2000


@pytest.mark.parametrize("kv_tokens", [100_000, 300], ids=["roomy", "preempting"])
def test_every_busy_second_is_charged_to_exactly_one_request(kv_tokens: int) -> None:
    """`SimSeq.gpu_s` splits each step by marginal cost: the requests' GPU time adds up to the
    engine's busy time, preemptions' recomputation included."""
    engine = SimEngine("e", GpuProfile("t", 5, 0.1, 0.01, kv_tokens, max_batched_tokens=512))
    seqs = [SimSeq(i, 0.0, 40 + 30 * i, 20 + 25 * i) for i in range(6)]
    drive(engine, seqs)
    assert sum(s.gpu_s for s in seqs) == pytest.approx(engine.busy_s)
    assert all(s.gpu_s > 0 for s in seqs)


def test_a_longer_answer_beside_a_shorter_one_takes_more_gpu_time() -> None:
    engine = SimEngine("e", GpuProfile("t", 10, 0.1, 0.01, 100_000))
    short, long = SimSeq(0, 0.0, 10, 10), SimSeq(1, 0.0, 10, 40)
    drive(engine, [short, long])
    # Together for 10 steps (halves), then the long one alone for 30 (whole steps).
    assert long.gpu_s > 3 * short.gpu_s
