"""The pod pool: leases, passive-health ejection, pod removal while requests are in flight."""

from __future__ import annotations

import dataclasses

import pytest

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import EjectionPolicy, PodPool
from plugin.core.types import EngineMetrics, Pod
from plugin.errors import NoReadyPod, UnknownModel
from tests.helpers import make_pod

pytestmark = pytest.mark.unit


def pod(name: str, model: str = "m", ready: bool = True, ns: str = "default") -> Pod:
    return make_pod(name, model=model, namespace=ns, ready=ready)


def make_pool(*pods: Pod, policy: EjectionPolicy | None = None) -> PodPool:
    pool = PodPool(CapacityEstimator(), 3.0, policy or EjectionPolicy(3, 5.0, 60.0))
    pool.set_pods(pods)
    return pool


def names(pool: PodPool, now: float, model: str = "m") -> set[str]:
    return {c.pod.name for c in pool.candidates(model, now)}


def fail(pool: PodPool, p: Pod, times: int, now: float, status: int = 503) -> None:
    for _ in range(times):
        pool.acquire(p).release(0, status, now)


def test_lease_releases_exactly_once_and_credits_tokens() -> None:
    a = pod("a")
    pool = make_pool(a)
    lease = pool.acquire(a)
    assert pool.inflight(a.key) == 1
    assert lease.release(12, 200, 0.0) is True
    assert lease.release(12, 200, 0.0) is False
    assert (pool.inflight(a.key), pool.output_tokens_total(a.key)) == (0, 12)


def test_unknown_model_and_no_ready_pod() -> None:
    pool = make_pool(pod("a", ready=False))
    with pytest.raises(UnknownModel):
        pool.candidates("other", 0.0)
    with pytest.raises(NoReadyPod):
        pool.candidates("m", 0.0)


def test_consecutive_5xx_eject_then_return() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    fail(pool, a, 2, now=0.0)
    assert names(pool, 0.0) == {"a", "b"}  # two failures: still a candidate
    fail(pool, a, 1, now=0.0)
    assert names(pool, 0.1) == {"b"}
    assert pool.snapshot(0.1)["pods"]["default/a"]["ejected"] is True
    assert names(pool, 5.1) == {"a", "b"}  # base ejection time is over


def test_ejection_backs_off_and_success_resets() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    fail(pool, a, 3, now=0.0)  # ejected for 5 s
    fail(pool, a, 3, now=6.0)  # again: 10 s
    assert names(pool, 15.0) == {"b"}
    assert names(pool, 16.1) == {"a", "b"}
    pool.acquire(a).release(10, 200, 17.0)  # success: history forgotten
    fail(pool, a, 3, now=20.0)
    assert names(pool, 24.0) == {"b"} and names(pool, 25.1) == {"a", "b"}


@pytest.mark.parametrize(
    ("status", "ejected"),
    [
        (500, True),
        (502, True),
        (503, True),
        (504, True),
        (200, False),
        (400, False),
        (429, False),
        (0, False),
    ],
    ids=lambda v: str(v),
)
def test_which_statuses_count_as_failures(status: int, ejected: bool) -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    fail(pool, a, 3, now=0.0, status=status)
    assert ("a" not in names(pool, 0.1)) is ejected


def test_all_ejected_means_all_remain_candidates() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    fail(pool, a, 3, now=0.0)
    fail(pool, b, 3, now=0.0)
    assert names(pool, 1.0) == {"a", "b"}


def test_removed_pod_in_flight_is_released_without_resurrecting_state() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    lease = pool.acquire(a)
    pool.set_pods([b])
    assert pool.snapshot(0.0)["inflight_removed_pods"] == {"default/a": 1}
    lease.release(100, 503, 0.0)
    snap = pool.snapshot(0.0)
    assert snap["inflight_removed_pods"] == {}
    assert pool.output_tokens_total(a.key) == 0
    pool.refresh_capacity(1.0)
    assert pool.capacity(a.key) is None
    # Re-added later, it starts clean (no stale ejection, no stale tokens).
    pool.set_pods([a, b])
    assert names(pool, 0.5) == {"a", "b"}


def test_same_name_in_two_namespaces_is_two_pods() -> None:
    a1, a2 = pod("a", ns="x"), pod("a", ns="y")
    pool = make_pool(a1, a2)
    pool.acquire(a1)
    assert (pool.inflight("x/a"), pool.inflight("y/a")) == (1, 0)
    assert len(pool.candidates("m", 0.0)) == 2


def test_serving_models_lists_only_models_with_a_ready_pod() -> None:
    pool = make_pool(pod("a", model="up"), pod("b", model="down", ready=False))
    assert pool.models() == ["down", "up"]
    assert pool.serving_models() == ["up"]


def test_a_success_from_before_the_ejection_does_not_end_it() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    old = pool.acquire(a)  # routed before the engine broke
    fail(pool, a, 3, now=1.0)
    old.release(10, 200, 2.0)
    assert names(pool, 2.5) == {"b"}


def test_a_pod_dead_for_days_keeps_being_ejected() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    now = 0.0
    for _ in range(2000):  # far past where 2 ** ejections would overflow a float
        fail(pool, a, 3, now=now)
        assert names(pool, now + 1) == {"b"}
        now += 61.0


def _scrape(
    pool: PodPool, p: Pod, running: float, waiting: float, now: float, kv: float = 0.2
) -> None:
    pool.update_metrics(p.key, EngineMetrics(running, waiting, kv), now)


HELD = [(32, 5), (32, 3), (32, 4), (32, 2)]  # a queue held at the same running count


@pytest.mark.parametrize(
    ("scrapes", "expected"),
    [
        (HELD, 32),  # the batch cap
        ([(32, 5)], None),  # one scrape proves nothing: a request may just have arrived
        (HELD[:3], None),  # three in a row: still a step's wait now and then
        ([(32, 5), (32, 3), (33, 2), (32, 1), (32, 1)], None),  # the running count moved
        ([(10, 1), (12, 1), (14, 1), (16, 1)], None),  # running moves: a burst waiting
        ([*HELD, (40, 0)], 40),  # more run without a queue: the cap was higher
        ([*HELD, (20, 0)], 32),  # fewer running says nothing new
        ([(float("nan"), 5)] * 4, None),
        ([(40, 0), *HELD], None),  # held below its peak: a budget wait, not a cap
    ],
    ids=["held", "once", "thrice", "interrupted", "moving", "raised", "lower", "nan", "below-peak"],
)
def test_pool_learns_an_engines_batch_cap_from_its_metrics(
    scrapes: list[tuple[float, float]], expected: int | None
) -> None:
    a = pod("a")
    pool = make_pool(a)
    for t, (running, waiting) in enumerate(scrapes):
        _scrape(pool, a, running, waiting, float(t))
    assert pool.saturation(a.key) == expected
    (candidate,) = pool.candidates("m", float(len(scrapes)))
    # The full-batch rule passes it over a 1/64 slack above a learned cap (at least 1).
    assert candidate.saturation == (None if expected is None else expected + max(1, expected // 64))


def test_a_removed_pod_forgets_its_batch_cap() -> None:
    a = pod("a")
    pool = make_pool(a)
    for t in range(4):
        _scrape(pool, a, 32, 5, float(t))
    assert pool.saturation(a.key) == 32
    pool.set_pods([])
    pool.set_pods([a])
    assert pool.saturation(a.key) is None


def test_an_unconfirmed_batch_cap_is_probed_upwards_and_relearned() -> None:
    a = pod("a")
    pool = PodPool(CapacityEstimator(), 3.0, saturation_probe_s=60.0)
    pool.set_pods([a])
    for t, (running, waiting) in enumerate(HELD):
        _scrape(pool, a, running, waiting, float(t))
    assert pool.saturation(a.key) == 32
    _scrape(pool, a, 32, 2, 40.0)  # queued at the cap again: confirmed
    leases = [pool.acquire(a) for _ in range(32)]  # the gateway holds as many as the cap
    for t in range(41, 101):
        _scrape(pool, a, 32, 0, float(t))  # full, no queue: neither proof nor disproof
    assert pool.saturation(a.key) == 32  # 60 s after the confirmation: not yet
    _scrape(pool, a, 32, 0, 101.0)
    assert pool.saturation(a.key) == 40  # probed: a quarter more may go through
    _scrape(pool, a, 32, 6, 102.0)

    assert pool.saturation(a.key) == 32  # the engine queues at 32 again: back at once
    for lease in leases:
        lease.release()


def test_a_cap_nothing_presses_on_is_not_probed() -> None:
    """Light load never reaches the cap: the probe would only inflate it, scrape after scrape."""
    a = pod("a")
    pool = PodPool(CapacityEstimator(), 3.0, saturation_probe_s=60.0)
    pool.set_pods([a])
    for t, (running, waiting) in enumerate(HELD):
        _scrape(pool, a, running, waiting, float(t))
    for t in range(4, 400):
        _scrape(pool, a, 32 if t % 7 else 12, 0, float(t))  # full now and then, never held
    assert pool.saturation(a.key) == 32


def test_a_queue_behind_a_full_kv_cache_is_not_a_batch_cap() -> None:
    a = pod("a")
    pool = make_pool(a)
    for t in range(5):
        _scrape(pool, a, 150, 8, float(t), kv=0.97)
    assert pool.saturation(a.key) is None


def test_a_declared_batch_cap_wins_over_what_the_metrics_suggest() -> None:
    a = dataclasses.replace(pod("a"), max_num_seqs=256)
    pool = make_pool(a)
    assert pool.saturation(a.key) == 256  # before any scrape
    for t, (running, waiting) in enumerate(HELD):
        _scrape(pool, a, running, waiting, float(t))
    (candidate,) = pool.candidates("m", 5.0)
    assert pool.saturation(a.key) == candidate.saturation == 256


def _exporting(
    pool: PodPool, p: Pod, running: float, waiting: float, now: float, cap: float | None
) -> None:
    pool.update_metrics(p.key, EngineMetrics(running, waiting, 0.2, max_batch=cap), now)


def test_a_batch_cap_the_engine_exports_counts_as_declared() -> None:
    """TensorRT-LLM exports its cap: exact (no slack), nothing learned over it, and the debug
    view says where it came from."""
    a = pod("a")
    pool = make_pool(a)
    cap = 64
    for t, (running, waiting) in enumerate(HELD):  # a queue held at 32 would teach a cap
        _exporting(pool, a, running, waiting, float(t), cap)
    (candidate,) = pool.candidates("m", 5.0)
    assert pool.saturation(a.key) == candidate.saturation == cap
    snapshot = pool.snapshot(5.0)["pods"][a.key]
    assert (snapshot["saturation"], snapshot["saturation_source"]) == (cap, "engine")

    _exporting(pool, a, 32, 0, 6.0, None)  # no longer exported: unknown until learned again
    assert (pool.saturation(a.key), pool.saturation_source(a.key)) == (None, None)
    for t, (running, waiting) in enumerate(HELD, start=7):
        _exporting(pool, a, running, waiting, float(t), None)
    assert (pool.saturation(a.key), pool.saturation_source(a.key)) == (32, "learned")
    _exporting(pool, a, 32, 0, 20.0, cap)  # exported again: it replaces what was learned
    assert (pool.saturation(a.key), pool.saturation_source(a.key)) == (cap, "engine")
    _exporting(pool, a, 32, 0, 21.0, None)
    assert pool.saturation(a.key) is None
    _exporting(pool, a, 32, 0, 22.0, cap)
    pool.set_pods([])
    pool.set_pods([a])
    assert pool.saturation(a.key) is None  # a removed pod forgets it


def test_a_declared_batch_cap_wins_over_the_one_the_engine_exports() -> None:
    declared = 256
    a = dataclasses.replace(pod("a"), max_num_seqs=declared)
    pool = make_pool(a)
    _exporting(pool, a, 10, 0, 1.0, 64)
    (candidate,) = pool.candidates("m", 1.0)
    assert pool.saturation(a.key) == candidate.saturation == declared
    assert pool.snapshot(1.0)["pods"][a.key]["saturation_source"] == "declared"


@pytest.mark.parametrize("bad", [0.0, 0.5, -3.0, float("nan"), float("inf")])
def test_an_exported_cap_that_is_no_count_is_ignored(bad: float) -> None:
    a = pod("a")
    pool = make_pool(a)
    _exporting(pool, a, 10, 0, 1.0, bad)
    assert (pool.saturation(a.key), pool.saturation_source(a.key)) == (None, None)


def test_a_false_cap_learned_early_is_outgrown() -> None:
    # A burst of long prompts held a queue at 126 while that was the engine's peak.
    a = pod("a")
    pool = PodPool(CapacityEstimator(), 3.0, saturation_probe_s=60.0)
    pool.set_pods([a])
    for t in range(4):
        _scrape(pool, a, 126, 4 - t, float(t))
    assert pool.saturation(a.key) == 126
    leases = [pool.acquire(a) for _ in range(126)]
    _scrape(pool, a, 126, 0, 64.0)  # held at the cap since, never confirmed: probed
    assert pool.saturation(a.key) == 158
    _scrape(pool, a, 150, 0, 65.0)  # it runs more than the old cap without a queue
    _scrape(pool, a, 158, 0, 66.0)
    _scrape(pool, a, 170, 0, 67.0)
    del leases
    assert pool.saturation(a.key) == 170  # raised by what it ran


def test_an_infinite_running_count_is_ignored() -> None:
    a = pod("a")
    pool = make_pool(a)
    for t in range(4):
        _scrape(pool, a, float("inf"), 5, float(t))
    assert pool.saturation(a.key) is None


def test_an_engine_that_does_not_answer_its_scrape_leaves_rotation_until_it_answers() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    pool.scrape_failed(a.key)
    assert names(pool, 1.0) == {"b"} and pool.unreachable(a.key)
    pool.scrape_failed(a.key)  # again: nothing changes
    assert names(pool, 1.5) == {"b"}
    pool.update_metrics(a.key, EngineMetrics(0.0, 0.0, 0.1), 2.0)
    assert names(pool, 2.0) == {"a", "b"} and not pool.unreachable(a.key)
    assert pool.snapshot(2.0)["pods"][a.key]["unreachable"] is False


def test_an_answering_engine_ends_its_5xx_ejection_only_after_it_was_unreachable() -> None:
    """A dead engine refuses connections (5xx, ejected with backoff) and its scrapes fail; once
    it answers a scrape again it is back at once. An engine whose /metrics works while its
    requests fail keeps its ejection."""
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    fail(pool, a, 3, 1.0)
    pool.update_metrics(a.key, EngineMetrics(0.0, 0.0, 0.1), 1.5)
    assert names(pool, 1.5) == {"b"}  # it answers metrics, but it failed requests: still out
    pool.scrape_failed(a.key)
    pool.update_metrics(a.key, EngineMetrics(0.0, 0.0, 0.1), 2.0)  # back from the dead
    assert names(pool, 2.0) == {"a", "b"} and not pool.ejected(a.key, 2.0)


def test_an_engine_that_answers_with_an_unusable_page_stays_in_rotation_flagged() -> None:
    """An answer is proof of life: a 404 page keeps the pod a candidate (its old metrics go
    stale as usual), brings an unreachable one back and ends its ejection; a usable page
    clears the flag."""
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    pool.update_metrics(a.key, EngineMetrics(3.0, 1.0, 0.5), 1.0)
    pool.scrape_unusable(a.key, "HTTP 404 Not Found")
    assert names(pool, 1.5) == {"a", "b"} and not pool.unreachable(a.key)
    assert pool.metrics_unusable(a.key) == "HTTP 404 Not Found"
    assert pool.snapshot(1.5)["pods"][a.key]["metrics_unusable"] == "HTTP 404 Not Found"
    (stale,) = [c for c in pool.candidates("m", 100.0) if c.pod.key == a.key]
    assert (stale.waiting, stale.kv_usage) == (None, None)  # routed by the gateway's counts
    fail(pool, a, 3, 2.0)
    pool.scrape_failed(a.key)  # dead: out
    assert names(pool, 2.0) == {"b"}
    pool.scrape_unusable(a.key, "HTTP 503 Service Unavailable")  # it answers again
    assert names(pool, 2.5) == {"a", "b"} and not pool.ejected(a.key, 2.5)
    pool.update_metrics(a.key, EngineMetrics(0.0, 0.0, 0.1), 3.0)
    assert pool.metrics_unusable(a.key) is None
    assert pool.metrics_unusable("ns/unknown") is None


def test_unreachable_pods_come_back_before_failing_ones_when_nothing_else_is_left() -> None:
    a, b = pod("a"), pod("b")
    pool = make_pool(a, b)
    pool.scrape_failed(a.key)
    pool.scrape_failed(b.key)  # say, a metrics port nobody can reach
    assert names(pool, 1.0) == {"a", "b"}  # all out: all stay candidates
    fail(pool, a, 3, 1.0)
    assert names(pool, 1.0) == {"b"}  # the 5xx rule still works


def _counter(pool: PodPool, p: Pod, total: float | None, now: float) -> None:
    pool.update_metrics(p.key, EngineMetrics(running=1, waiting=0, generation_tokens=total), now)


def test_an_engines_generated_token_counter_teaches_capacity_and_gateway_counts_do_not() -> None:
    capacity = CapacityEstimator()
    a = pod("a")
    pool = PodPool(capacity, 3.0)
    pool.set_pods([a])
    pool.acquire(a).release(40, 200, 0.0)  # before the counter is seen: the gateway's count
    assert capacity.total(a.key) == 40
    _counter(pool, a, 1000.0, 1.0)  # a baseline: what the engine did before is not credited
    assert (capacity.total(a.key), pool.token_source(a.key)) == (40, "engine")
    pool.acquire(a).release(30, 200, 1.5)  # counted for metrics, not for capacity
    _counter(pool, a, 1100.0, 2.0)
    assert capacity.total(a.key) == 140
    assert pool.output_tokens_total(a.key) == 70
    _counter(pool, a, 25.0, 3.0)  # went backwards: a restarted engine, all of it is new
    assert capacity.total(a.key) == 165
    _counter(pool, a, None, 4.0)  # no longer exported: back to the gateway's counts
    pool.acquire(a).release(5, 200, 4.5)
    assert (capacity.total(a.key), pool.token_source(a.key)) == (170, "gateway")


def test_estimated_tokens_are_kept_apart_from_reported_ones() -> None:
    a = pod("a")
    pool = make_pool(a)
    pool.acquire(a).release(10, 200, 0.0)
    pool.acquire(a).release(7, 200, 0.0, estimated=True)
    pool.credit_tokens(a.key, 3, estimated=True)
    assert (pool.output_tokens_total(a.key), pool.estimated_tokens_total(a.key)) == (20, 10)
    snapshot = pool.snapshot(0.0)["pods"][a.key]
    assert (snapshot["output_tokens_estimated"], snapshot["token_source"]) == (10, "gateway")


def test_a_probe_that_finds_the_engine_queueing_above_the_old_cap_keeps_what_it_ran() -> None:
    """A cap learned from a reading just after some requests finished (253 of 256) fences the
    engine below its batch: the probe lets it fill, and what it then runs with a queue stays."""
    a = pod("a")
    pool = PodPool(CapacityEstimator(), 3.0, saturation_probe_s=60.0)
    pool.set_pods([a])
    for t in range(4):
        _scrape(pool, a, 253, 3, float(t))
    assert pool.saturation(a.key) == 253
    leases = [pool.acquire(a) for _ in range(253)]
    _scrape(pool, a, 250, 0, 64.0)  # held at the cap by the gateway, engine queue empty: probed
    assert pool.saturation(a.key) == 317
    _scrape(pool, a, 256, 4, 65.0)
    assert pool.saturation(a.key) == 256
    del leases


def test_silent_tells_pods_whose_open_streams_all_went_quiet_once_per_silence() -> None:
    a, b, c = pod("a"), pod("b"), pod("c")
    pool = make_pool(a, b, c)
    for p in (a, b):
        pool.stream_started(p.key, 10)
        pool.stream_alive(p.key, 1.0)
    pool.stream_alive(b.key, 1.4)  # b's streams still send
    assert pool.silent(1.5, 0.3) == [a]  # c has no open stream: nothing to hear from
    assert pool.silent(1.6, 0.3) == []  # told once
    assert pool.silent(2.0, 0.3) == [b]
    pool.stream_alive(a.key, 2.0)  # a chunk: a new silence may be told
    assert pool.silent(2.2, 0.3) == []
    assert pool.silent(2.4, 0.3) == [a]
    pool.stream_alive(a.key, 2.5)
    pool.scrape_failed(a.key)  # out of rotation already: no probe from the watch
    assert pool.silent(3.0, 0.3) == []
    pool.stream_ended(b.key, 10)
    pool.stream_alive(b.key, 3.0)
    assert pool.silent(4.0, 0.3) == []  # its only stream ended
    pool.stream_ended(b.key, 10)  # an extra end does not go below none open
    pool.stream_started(b.key, 10)
    pool.stream_alive(b.key, 4.0)
    assert pool.silent(4.5, 0.3) == [b]


def test_a_removed_pods_open_streams_are_kept_until_it_returns() -> None:
    a = pod("a")
    pool = make_pool(a)
    lease = pool.acquire(a)
    pool.stream_started(a.key, 10)
    pool.stream_alive(a.key, 1.0)
    pool.set_pods([])
    assert pool.silent(5.0, 0.3) == []  # not listed: not probed
    pool.set_pods([a])
    assert pool.silent(5.0, 0.3) == [a]  # its stream is still open and quiet
    pool.stream_ended(a.key, 10)
    lease.release(3, 200, 5.0)
    pool.stream_alive(a.key, 6.0)
    assert pool.silent(9.0, 0.3) == []
