"""Seeing a replica's speed change within a fraction of a second: `GapWatch` on the gaps between
response chunks, the pool wiring it (prefills kept out, routing told at once, the scrape watch
told too) and the adapter that times a response's events."""

from __future__ import annotations

import random

import pytest

from plugin.adapters.extproc import ChunkGaps, ResponseTokens
from plugin.core.capacity import (
    GAP_BIG_RATIO,
    GAP_BIG_ROUNDS,
    GAP_ROUNDS,
    GAP_SPAN_S,
    GAP_SPEEDUP_RATIO,
    PREFILL_SHARE,
    SHIFT_RATIO,
    SHIFT_TAU_S,
    CapacityEstimator,
    GapWatch,
    SpeedWatch,
)
from plugin.core.pod_speed import PodSpeed
from plugin.core.pool import PodPool
from plugin.core.types import EngineMetrics, Pod

pytestmark = pytest.mark.unit

POD = Pod(name="a", namespace="ns", model="m", address="10.0.0.1", port=8000, metrics_port=8000)


def _steps(
    watch: GapWatch,
    seconds: float,
    gap: float,
    batch: int,
    rng: random.Random,
    noise: float = 0.1,
    prefill_every: int = 0,
) -> list[float]:
    """`seconds` of engine steps of about `gap` s at `batch` streams, each step one call with
    the whole batch (as the simulator feeds it); every `prefill_every`-th step a prefill of
    three times the batch in prompt tokens (told as waiting) stalls it 4x. The factors the
    watch returned."""
    fired, elapsed, k = [], 0.0, 0
    while elapsed < seconds:
        k += 1
        prefill = prefill_every > 0 and k % prefill_every == 0
        step = gap * rng.uniform(1 - noise, 1 + noise) * (4.0 if prefill else 1.0)
        elapsed += step
        factor = watch.add(step, batch, batch, 3 * batch if prefill else 0)
        if factor is not None:
            fired.append(factor)
    return fired


def _rounds_to_fire(watch: GapWatch, gap: float, rng: random.Random) -> tuple[int, float, float]:
    """Steps of about `gap` s at 40 streams until the watch fires: (rounds, seconds, factor)."""
    fired, elapsed, k = None, 0.0, 0
    while fired is None:
        k += 1
        step = gap * rng.uniform(0.97, 1.03)
        elapsed += step
        fired = watch.add(step, 40, 40)
        assert k <= 10 * GAP_ROUNDS
    return k, elapsed, fired


def test_a_slowdown_is_seen_within_a_fraction_of_a_second_and_measured() -> None:
    rng = random.Random(1)
    watch = GapWatch()
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, rng) == []
    k, elapsed, fired = _rounds_to_fire(watch, 0.03 * (SHIFT_RATIO + GAP_BIG_RATIO) / 2, rng)
    assert k == GAP_ROUNDS and elapsed >= GAP_SPAN_S and elapsed < 1.0
    assert fired == pytest.approx(2 / (SHIFT_RATIO + GAP_BIG_RATIO), rel=0.05)
    assert _steps(watch, 5.0, 0.05, 40, rng) == []  # the new speed is the usual one now


def test_a_large_slowdown_needs_fewer_rounds_but_the_same_span() -> None:
    rng = random.Random(6)
    for slower, rounds in (
        (GAP_BIG_RATIO * 1.1, GAP_BIG_ROUNDS),
        (GAP_BIG_RATIO * 0.9, GAP_ROUNDS),
    ):
        watch = GapWatch()
        assert _steps(watch, 3 * SHIFT_TAU_S, 0.2, 40, rng, noise=0.03) == []
        k, elapsed, fired = _rounds_to_fire(watch, 0.2 * slower, rng)
        assert k == rounds and elapsed >= GAP_SPAN_S
        assert fired == pytest.approx(1 / slower, rel=0.05)
    # Short steps: the span, not the count of rounds, holds it back.
    watch = GapWatch()
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.02, 40, rng, noise=0.03) == []
    k, elapsed, _ = _rounds_to_fire(watch, 0.02 * GAP_BIG_RATIO * 1.1, rng)
    assert k > GAP_BIG_ROUNDS and elapsed >= GAP_SPAN_S > elapsed - 0.02 * GAP_BIG_RATIO * 1.2
    # Large rounds must be the last ones in a row: alternating with smaller ones, the full
    # count; after a smaller one, the large ones alone.
    large, smaller = 0.2 * GAP_BIG_RATIO * 1.1, 0.2 * (SHIFT_RATIO + GAP_BIG_RATIO) / 2
    for steps, at in (
        ([large, smaller] * GAP_ROUNDS, GAP_ROUNDS - 1),
        ([smaller] + [large] * GAP_ROUNDS, GAP_BIG_ROUNDS),
    ):
        watch = GapWatch()
        assert _steps(watch, 3 * SHIFT_TAU_S, 0.2, 40, rng, noise=0.0) == []
        assert [i for i, g in enumerate(steps) if watch.add(g, 40, 40) is not None] == [at]


def test_jitter_prefills_and_a_batch_that_explains_it_are_no_change() -> None:
    """Steps jittering by 30%, prefills stalling every fifth step (their prompts told), a
    growing batch whose steps are slower: none is the replica's own speed."""
    rng = random.Random(2)
    watch = GapWatch()
    assert _steps(watch, 60.0, 0.03, 40, rng, noise=0.3, prefill_every=5) == []
    assert watch.gap == pytest.approx(0.03, rel=0.1)  # the stalled steps did not move it
    assert _steps(watch, 10.0, 0.06, 60, rng) == []  # half again the batch, each step 2x
    # A burst of long prefills stalling more steps in a row than a change needs, 4x: with its
    # prompts told (three times the batch, as waiting through each round or as just started),
    # it is no change; untold, it would be read as a slowdown.
    waiting, started, untold = GapWatch(), GapWatch(), GapWatch()
    for watch in (waiting, started, untold):
        assert _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, random.Random(5)) == []
    burst = [0.12] * (2 * GAP_ROUNDS)
    assert [f for f in (waiting.add(g, 40, 40, 3 * 40) for g in burst) if f] == []
    assert waiting.gap == pytest.approx(0.03, rel=0.1)
    for g in burst:
        started.started(3 * 40)  # started in the steps just run, not waiting when timed
        assert started.add(g, 40, 40) is None
    assert [f for f in (untold.add(g, 40, 40) for g in burst) if f]
    # Prompts that came and went within a round (the least waiting at any of its gaps is 0)
    # and did not start: not prefilled in it.
    came_and_went = GapWatch()
    assert _steps(came_and_went, 3 * SHIFT_TAU_S, 0.03, 40, random.Random(5)) == []
    fired = []
    for g in burst:
        for waiting_tokens in (3 * 40, 0):
            fired.append(came_and_went.add(g, 20, 40, waiting_tokens))
    assert [f for f in fired if f]


def test_prefills_in_every_round_hide_no_slowdown_and_leave_the_usual_pair() -> None:
    """At a high request rate some request nearly always waits for its first chunk or has just
    got it. Prompts up to `PREFILL_SHARE` of the batch: the round is read as it is. More: it
    still shows a slowdown larger than its prefills can make (through Envoy at the demo's rate,
    leaving such rounds out left the watch nothing to read), and otherwise moves nothing."""
    rng = random.Random(7)
    light = PREFILL_SHARE * 40  # prompt tokens in each round, half waiting, half started
    for heavy_after in (0.0, 40.0):
        watch = GapWatch()
        usual = 0.03 * (1 + light / 40 / 4)  # a quarter of the most the prefills could add
        for _ in range(int(3 * SHIFT_TAU_S / usual)):
            watch.started(light / 2)
            assert watch.add(usual * rng.uniform(0.97, 1.03), 40, 40, light / 2) is None
        assert watch.gap == pytest.approx(usual, rel=0.02)
        prompts = heavy_after or light  # after the change: as many prompts, or the batch's
        fired = []
        for _ in range(GAP_ROUNDS):
            watch.started(prompts / 2)
            fired.append(watch.add(0.12, 40, 40, prompts / 2))
        # Read as it is, or without the most its prefills add (half of it here).
        seen = 0.12 if not heavy_after else 0.12 / (1 + prompts / 40)
        assert [f for f in fired if f] == [pytest.approx(usual / seen, rel=0.02)]
    # Rounds left out move neither the usual gap nor the usual batch: a batch followed without
    # its gap would read a step of the old batch as the new one's (in the simulator at 8
    # tokens an event it made a replica at full load read 1.8x slower where nothing changed).
    # A slowdown after such a stretch, at twice the batch, is still seen beyond what the batch
    # explains, and the factor is the output rate's (the streams' speed times the batch's).
    watch = GapWatch()
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, rng, noise=0.03) == []
    for _ in range(int(2 * SHIFT_TAU_S / 0.03)):
        watch.started(80.0)
        assert watch.add(0.03 * 1.2, 80, 80) is None  # twice the batch, prefills in each
    assert watch.batch == pytest.approx(40, rel=0.05)
    assert watch.gap == pytest.approx(0.03, rel=0.05)
    fired = [f for f in (watch.add(0.03 * 4, 80, 80) for _ in range(GAP_ROUNDS)) if f]
    assert fired == [pytest.approx(2 / 4, rel=0.05)]


def test_a_grown_batch_explains_a_slowdown_in_proportion_at_most() -> None:
    """A step costs a fixed part plus a part per stream: a batch q times the usual one makes it
    at most q times longer. A third more streams and 1.8x the gap is the replica's own 1.35x
    (no change); twice the streams and 4x the gap is its own 2x (a change, the big one's count
    of rounds), where a rule that took any batch outside a band as the cause saw nothing."""
    rng = random.Random(11)
    watch = GapWatch()
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.05, 60, rng, noise=0.02) == []
    assert _steps(watch, 5.0, 0.05 * 1.8, 80, rng, noise=0.02) == []
    watch = GapWatch()
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.05, 60, rng, noise=0.0) == []
    fired = [i for i in range(GAP_ROUNDS) if watch.add(0.05 * 4.4, 120, 120) is not None]
    assert fired == [GAP_BIG_ROUNDS - 1]


def _chunks(
    watch: GapWatch,
    seconds: float,
    step: float,
    batch: int,
    per_event: int,
    phase: list[float],
) -> tuple[float | None, float]:
    """`seconds` of engine steps of `step` s at `batch` streams that each send a chunk every
    `per_event` steps (their phases spread), one gap each, as the plugin times them; `phase`
    carries the steps' clock between calls. (seconds after the start to the first factor, that
    factor) or (None, 0)."""
    start = phase[0]
    sent: list[float] = phase[1:] or [start] * batch
    k = 0
    while phase[0] - start < seconds:
        phase[0] += step
        k += 1
        for stream in range(batch):
            if (k + stream) % per_event == 0:
                factor = watch.add(phase[0] - sent[stream], 1, batch)
                sent[stream] = phase[0]
                if factor is not None:
                    phase[1:] = sent
                    return phase[0] - start, factor
    phase[1:] = sent
    return None, 0.0


def test_several_tokens_a_chunk_are_learned_and_a_round_stays_a_step() -> None:
    """An engine that sends k tokens an event (SGLang's stream interval, TensorRT-LLM,
    speculative decoding) spaces a stream's chunks k steps apart. Learned from the streams that
    ended, a round closes after the batch over k chunks (one step), so a slowdown is seen within
    about k steps plus the rounds it needs, where rounds of a whole batch took k times longer."""
    watch = GapWatch()
    watch.ended(200, 27)  # 25 chunks of 8 tokens, a role chunk and a usage chunk
    assert watch.per_event == pytest.approx(200 / 27)
    watch.ended(0, 3)  # no tokens, or too few chunks to say: nothing learned
    watch.ended(5, 1)
    assert watch.per_event == pytest.approx(200 / 27)
    one = GapWatch()
    one.ended(100, 103)  # a token an event, with the role, finish and usage chunks
    assert one.per_event == 1.0
    seen = {}
    for learned in (True, False):
        watch = GapWatch()
        if learned:
            for _ in range(20):
                watch.ended(200, 27)
        phase = [0.0]
        assert _chunks(watch, 3 * SHIFT_TAU_S, 0.03, 64, 8, phase) == (None, 0.0)
        at, factor = _chunks(watch, 5.0, 0.09, 64, 8, phase)
        assert at is not None
        seen[learned] = (at, factor)
    # Learned: once about half of a gap's 8 steps ran slower its gaps read 2x, and a run of
    # the big count plus the 7 rounds one stall could lengthen follows, a step each: within
    # 8 + 3 + 7 steps (1.62 s), measuring the whole 3x. Not learned: a round is 8 steps, and
    # three of them come at least 24 steps (2.16 s) after the change.
    (at, factor), (unlearned_at, _) = seen[True], seen[False]
    assert at <= (8 + GAP_BIG_ROUNDS + 7) * 0.09 < 3 * 0.72 <= unlearned_at
    assert factor == pytest.approx(1 / 3, rel=0.1)


def test_at_several_tokens_a_chunk_one_stall_is_no_change() -> None:
    """One stall (a long prefill the gateway did not route, a pause of its own event loop)
    lengthens every gap that spans it: at eight tokens a chunk, the gaps of eight rounds, each
    2.1x the usual for a stall ten steps long. A run must outlast them: no change. (With runs
    of the big count alone and the first gap's whole span, it rescaled the replica by 0.42.)"""
    watch = GapWatch()
    for _ in range(20):
        watch.ended(200, 25)
    phase = [0.0]
    assert _chunks(watch, 3 * SHIFT_TAU_S, 0.03, 64, 8, phase) == (None, 0.0)
    assert _chunks(watch, 0.3 - 1e-9, 0.3, 64, 8, phase) == (None, 0.0)  # one step, 10x
    assert _chunks(watch, 5.0, 0.03, 64, 8, phase) == (None, 0.0)


def test_a_speedup_needs_the_larger_ratio_and_a_round_is_about_a_step() -> None:
    rng = random.Random(3)
    watch = GapWatch()
    _steps(watch, 3 * SHIFT_TAU_S, 0.06, 20, rng)
    assert _steps(watch, 5.0, 0.06 / (0.9 * GAP_SPEEDUP_RATIO), 20, rng, noise=0.0) == []
    watch = GapWatch()
    _steps(watch, 3 * SHIFT_TAU_S, 0.06, 20, rng)
    assert _steps(watch, 5.0, 0.02, 20, rng, noise=0.0) == [pytest.approx(3.0, rel=0.05)]
    # One gap per stream, as the plugin sees them: a round closes after a batch's worth.
    per_stream = GapWatch()
    assert [per_stream.add(0.05, 1, 4) for _ in range(3)] == [None] * 3
    assert per_stream.gap is None  # three of four streams: the round is still open
    assert per_stream.add(0.05, 1, 4) is None and per_stream.gap == pytest.approx(0.05)


def test_rebase_takes_another_watchs_change_as_the_usual() -> None:
    rng = random.Random(4)
    watch = GapWatch()
    _steps(watch, 3 * SHIFT_TAU_S, 0.03, 40, rng)
    watch.rebase(1 / 3)  # the scrape watch saw it three times slower
    assert watch.gap == pytest.approx(0.09, rel=0.05)
    assert _steps(watch, 3 * SHIFT_TAU_S, 0.09, 40, rng) == []
    speed = SpeedWatch()
    for _ in range(30):
        speed.observe(1000.0, 40.0, 40.0, 1.0)
    speed.rebase(0.5)
    assert speed.speed == pytest.approx(12.5) and speed.seen_s == 0.0


PROMPT = 50  # prompt tokens of each request in the pool tests


def _pool_with_streams(n: int) -> PodPool:
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    for _ in range(n):
        pool.acquire(POD, prompt_tokens=PROMPT)
    return pool


def _speed(pool: PodPool) -> PodSpeed:
    speed = pool.speed(POD.key)
    assert speed is not None
    return speed


def _gaps(pool: PodPool) -> GapWatch:
    gaps = _speed(pool).gaps
    assert gaps is not None
    return gaps


def _slow_to_a_third(pool: PodPool) -> None:
    """The 20 streams start, then their chunks come 0.03 s apart for three time constants,
    then 0.09 s apart: a slowdown the chunk-gap watch acts on."""
    for _ in range(20):
        pool.stream_started(POD.key, PROMPT)
    for _ in range(int(3 * SHIFT_TAU_S / 0.03) * 20):
        pool.observe_chunk_gap(POD.key, 0.03)
    for _ in range(GAP_ROUNDS * 20):
        pool.observe_chunk_gap(POD.key, 0.09)


def test_the_pool_rescales_at_once_and_keeps_prefills_and_the_scrape_watch_out() -> None:
    pool = _pool_with_streams(20)
    est = pool._capacity  # the estimate the candidates carry
    est.set_fast(POD.key, True)
    for t in range(1, 11):
        est.add_tokens(POD.key, 2000)
        est.refresh(float(t))
    pool.refresh_capacity(10.0)
    before = pool.candidates("m", 10.0)[0].capacity
    assert before is not None
    # No stream has its first chunk yet: every gap may hold a prefill of 20 prompts, none is
    # read.
    for _ in range(2000):
        pool.observe_chunk_gap(POD.key, 0.1)
    assert _gaps(pool).gap is None  # no round was read
    _slow_to_a_third(pool)
    after = pool.candidates("m", 10.0)[0].capacity  # no scrape tick in between
    assert after == pytest.approx(before / 3, rel=0.05)
    seen = pool.snapshot(10.0)["pods"][POD.key]
    assert seen["speed_changes"] == seen["speed_changes_from_chunk_gaps"] == 1
    pool.stream_ended(POD.key, PROMPT)
    assert pool.prompt_tokens(POD.key)[1] == 19 * PROMPT


def test_a_slowdown_seen_here_leaves_an_estimate_adopted_from_the_scraping_replica() -> None:
    """Where another gateway replica scrapes the pod, it rescales the estimate for every
    replica; a change this one's chunk gaps show neither moves the adopted estimate nor counts
    as acted on."""
    pool = _pool_with_streams(20)
    scrape = EngineMetrics(running=20.0, waiting=0.0, generation_tokens=1000.0)
    pool.update_metrics(POD.key, scrape, 10.0, (6000.0, True, None, None))
    pool.refresh_capacity(10.0)
    _slow_to_a_third(pool)
    assert pool.candidates("m", 10.0)[0].capacity == 6000.0
    assert pool.snapshot(10.0)["pods"][POD.key]["speed_changes"] == 0


def test_prompt_tokens_waiting_come_off_when_a_request_starts_or_ends_without_starting() -> None:
    pool = _pool_with_streams(3)
    leases = [pool.acquire(POD, prompt_tokens=7) for _ in range(2)]
    assert pool.prompt_tokens(POD.key)[0] == 3 * PROMPT + 14
    pool.stream_started(POD.key, 7)
    leases[1].release(0, 502, 1.0)  # failed before its first chunk: never started
    inflight, streaming = pool.prompt_tokens(POD.key)
    assert inflight - streaming == 3 * PROMPT
    pool.stream_ended(POD.key, 7)
    leases[0].release(5, 200, 1.0)
    assert pool.prompt_tokens(POD.key) == (3 * PROMPT, 0)


def test_a_change_the_gaps_saw_is_not_acted_on_again_by_the_scrape_watch() -> None:
    pool = _pool_with_streams(40)
    for _ in range(40):
        pool.stream_started(POD.key, PROMPT)
    total = 0.0

    def scrape(t: int, per_request: float) -> None:
        nonlocal total
        total += 40 * per_request
        metrics = EngineMetrics(
            40.0, 0.0, 0.3, generation_tokens=total, generation_tokens_stepwise=True
        )
        pool.update_metrics(POD.key, metrics, float(t))
        pool.refresh_capacity(float(t))

    for t in range(40):
        scrape(t, 30.0)
        for _ in range(int(1 / 0.033) * 40):
            pool.observe_chunk_gap(POD.key, 0.033)
    for _ in range(GAP_ROUNDS * 40):
        pool.observe_chunk_gap(POD.key, 0.1)
    assert pool.snapshot(40.0)["pods"][POD.key]["speed_changes"] == 1
    for t in range(40, 50):
        scrape(t, 10.0)
    assert pool.snapshot(50.0)["pods"][POD.key]["speed_changes"] == 1


def test_a_response_times_its_events_for_its_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool_with_streams(1)
    now = [100.0]
    tokens = ResponseTokens()
    tokens.status = 200
    tokens.gaps = ChunkGaps(pool, POD.key, lambda: now[0], PROMPT)
    seen: list[float] = []
    monkeypatch.setattr(
        PodPool, "observe_chunk_gap", lambda self, key, gap, count=1: seen.append(gap)
    )
    event = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    tokens.feed(b": keep-alive\n\n", False)  # no event: nothing timed, not started
    assert pool.prompt_tokens(POD.key)[1] == 0
    tokens.feed(event, False)
    assert pool.prompt_tokens(POD.key)[1] == PROMPT  # the first event: its prefill is over
    now[0] += 0.05
    tokens.feed(event, False)
    now[0] += 0.2
    tokens.feed(event * 4, False)  # four events in one chunk: four steps
    assert seen == [pytest.approx(0.05), pytest.approx(0.05)]
    tokens.feed(b"data: [DONE]\n\n", True)
    tokens.close_gaps()
    tokens.close_gaps()  # once
    assert pool.prompt_tokens(POD.key)[1] == 0


def test_streams_that_outlive_a_pods_absence_still_end() -> None:
    """The pod leaves discovery and comes back while two streams run: new streams start before
    the old ones end, and the prompt tokens of started streams still match those in flight
    (nothing left counted as waiting)."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([POD])
    old = [pool.acquire(POD, prompt_tokens=PROMPT) for _ in range(2)]
    for _ in old:
        pool.stream_started(POD.key, PROMPT)
    pool.set_pods([])
    pool.set_pods([POD])
    new = [pool.acquire(POD, prompt_tokens=PROMPT) for _ in range(3)]
    for _ in new:
        pool.stream_started(POD.key, PROMPT)
    for lease in old:
        pool.stream_ended(POD.key, PROMPT)
        lease.release(10, 200, 1.0)
    assert pool.prompt_tokens(POD.key) == (3 * PROMPT, 3 * PROMPT)
    assert pool.inflight(POD.key) == 3


def test_the_pool_learns_tokens_a_chunk_from_reported_counts_and_forgets_them_on_a_restart() -> (
    None
):
    pool = _pool_with_streams(2)
    now = [100.0]

    def response(events: int, usage: bool) -> None:
        tokens = ResponseTokens()
        tokens.status = 200
        tokens.gaps = ChunkGaps(pool, POD.key, lambda: now[0], PROMPT)
        for _ in range(events):
            now[0] += 0.05
            tokens.feed(b'data: {"choices":[{"delta":{"content":"abcdefgh"}}]}\n\n', False)
        if usage:
            report = b'{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}'
            tail = b'data: {"choices":[],"usage":' + report % (8 * events, 5 + 8 * events)
            tokens.feed(tail + b"}\n\n", False)
        tokens.feed(b"data: [DONE]\n\n", True)
        tokens.close_gaps()

    def per_chunk() -> float | None:
        value: float | None = pool.snapshot(now[0])["pods"][POD.key]["tokens_per_chunk"]
        return value

    response(10, usage=False)  # counted by its events: an estimate says nothing of k
    assert _speed(pool).gaps is not None and per_chunk() is None
    response(10, usage=True)  # 80 tokens in ten events and the usage one
    assert per_chunk() == pytest.approx(80 / 11, abs=0.01)
    # The engine's token counter went back: a restart, perhaps with another stream interval.
    pool.update_metrics(POD.key, EngineMetrics(2.0, 0.0, 0.3, generation_tokens=5000.0), 1.0)
    pool.update_metrics(POD.key, EngineMetrics(2.0, 0.0, 0.3, generation_tokens=10.0), 2.0)
    assert _speed(pool).gaps is None


def test_the_pool_reads_no_gaps_while_the_kv_cache_is_full() -> None:
    """A full KV cache preempts and recomputes, so steps grow beyond what the batch explains:
    the gaps then say nothing of the replica's own speed (the scrape watch stops there too)."""
    pool = _pool_with_streams(40)
    for _ in range(40):
        pool.stream_started(POD.key, PROMPT)
    for kv, changes in ((0.95, 0), (0.5, 1)):
        pool.update_metrics(POD.key, EngineMetrics(40.0, 0.0, kv), 1.0)
        for _ in range(int(3 * SHIFT_TAU_S / 0.03) * 40):
            pool.observe_chunk_gap(POD.key, 0.03)
        for _ in range(2 * GAP_ROUNDS * 40):
            pool.observe_chunk_gap(POD.key, 0.09)
        assert pool.snapshot(1.0)["pods"][POD.key]["speed_changes"] == changes
