"""The pool's shared-state seam, in memory: other gateways' in-flight counts and fleet-wide token
counters fed in by a sync loop, and switching between shared and local mode without crediting a
token twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.types import EngineMetrics, Pod
from tests.helpers import make_pod

pytestmark = pytest.mark.unit


def pod(name: str) -> Pod:
    return make_pod(name)


A, B = pod("a"), pod("b")


def make() -> tuple[PodPool, CapacityEstimator]:
    estimator = CapacityEstimator()
    pool = PodPool(estimator)
    pool.set_pods([A, B])
    return pool, estimator


def running(pool: PodPool) -> dict[str, int]:
    return {c.pod.key: c.running for c in pool.candidates("m", 0.0)}


def test_remote_inflight_adds_to_running_and_replaces_the_previous_view() -> None:
    pool, _ = make()
    pool.acquire(A)
    pool.set_remote_inflight({A.key: 3, B.key: 2, "other/pod": 5})
    assert running(pool) == {A.key: 4, B.key: 2}
    assert (pool.inflight(A.key), pool.remote_inflight(A.key)) == (1, 3)
    pool.set_remote_inflight({B.key: 1, A.key: 0, "x/y": -2})
    assert running(pool) == {A.key: 1, B.key: 1}
    snap = pool.snapshot(0.0)["pods"]
    assert (snap[A.key]["inflight"], snap[A.key]["inflight_remote"]) == (1, 0)
    assert snap[B.key]["inflight_remote"] == 1


def test_local_mode_credits_the_estimator_directly() -> None:
    pool, estimator = make()
    assert pool.shared_tokens is False
    pool.acquire(A).release(10, 200, 0.0)
    pool.credit_tokens(B.key, 4)
    assert (estimator.total(A.key), estimator.total(B.key)) == (10, 4)
    assert pool.take_unpublished_tokens() == {}


def test_first_shared_read_sets_baselines_then_increases_are_credited() -> None:
    pool, estimator = make()
    pool.acquire(A).release(10, 200, 0.0)  # local: credited at once
    pool.apply_shared_tokens({A.key: 1000, B.key: None})  # baselines only
    assert pool.shared_tokens is True
    assert estimator.total(A.key) == 10

    pool.acquire(A).release(7, 200, 0.0)
    pool.credit_tokens(B.key, 3)
    assert estimator.total(A.key) == 10  # waits for the shared counter
    assert pool.output_tokens_total(A.key) == 17  # what this gateway counted, at once
    taken = pool.take_unpublished_tokens()
    assert taken == {A.key: 7, B.key: 3}
    assert pool.take_unpublished_tokens() == {}
    # The store now holds our 7 and 3 plus 20 tokens another gateway counted on A.
    pool.apply_shared_tokens({A.key: 1000 + 7 + 20, B.key: 3})
    assert (estimator.total(A.key), estimator.total(B.key)) == (10 + 27, 3)
    assert (pool.output_tokens_total(A.key), pool.output_tokens_total(B.key)) == (17, 3)


def test_counter_that_goes_backwards_restarted_from_zero_not_a_negative_rate() -> None:
    pool, estimator = make()
    pool.apply_shared_tokens({A.key: 500})
    pool.apply_shared_tokens({A.key: 600})
    assert estimator.total(A.key) == 100
    # The store restarted empty (or the key expired) and then received 40 tokens, ours among
    # them: all 40 are new.
    pool.apply_shared_tokens({A.key: 40})
    assert estimator.total(A.key) == 140
    pool.apply_shared_tokens({A.key: 55})
    assert estimator.total(A.key) == 155
    pool.apply_shared_tokens({A.key: None})  # gone: reads as 0, nothing gained
    assert estimator.total(A.key) == 155
    pool.apply_shared_tokens({A.key: 5})
    assert estimator.total(A.key) == 160


def test_leaving_shared_mode_credits_taken_and_unpublished_tokens_locally() -> None:
    pool, estimator = make()
    pool.apply_shared_tokens({A.key: 0, B.key: 0})
    pool.credit_tokens(A.key, 5)
    taken = pool.take_unpublished_tokens()
    pool.credit_tokens(A.key, 2)  # counted while the failing round trip was in flight
    pool.leave_shared_tokens(taken)
    assert pool.shared_tokens is False
    assert estimator.total(A.key) == 7
    pool.credit_tokens(A.key, 1)  # local again
    assert estimator.total(A.key) == 8
    # Back in shared mode: the first read only sets baselines, whatever the store holds (it may
    # hold the 5 if the failed round trip did store them).
    pool.apply_shared_tokens({A.key: 5, B.key: 0})
    assert estimator.total(A.key) == 8


def test_removed_pods_drop_their_shared_state() -> None:
    pool, estimator = make()
    pool.apply_shared_tokens({A.key: 10, B.key: 10})
    pool.credit_tokens(B.key, 4)
    pool.set_pods([A])
    assert pool.take_unpublished_tokens() == {}
    pool.apply_shared_tokens({A.key: 12, B.key: 99})
    assert estimator.total(A.key) == 2
    assert estimator.total(B.key) == 0
    pool.credit_tokens(B.key, 3)  # unknown pod: ignored
    assert pool.output_tokens_total(B.key) == 0


# One gateway against an in-memory store: whatever order credits, successful syncs and failed
# ones (whose increments the store may or may not have applied) come in, once a last sync has
# run every counted token reached the estimator exactly once.
_op = st.one_of(
    st.tuples(st.just("credit"), st.sampled_from([A.key, B.key]), st.integers(1, 50)),
    st.tuples(st.just("sync"), st.just(""), st.just(0)),
    st.tuples(st.just("fail-stored"), st.just(""), st.just(0)),
    st.tuples(st.just("fail-lost"), st.just(""), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=60))
def test_every_token_is_credited_exactly_once_across_mode_switches(
    ops: list[tuple[str, str, int]],
) -> None:
    pool, estimator = make()
    store: dict[str, int] = {}
    counted = {A.key: 0, B.key: 0}

    def sync() -> None:
        for key, n in pool.take_unpublished_tokens().items():
            store[key] = store.get(key, 0) + n
        pool.apply_shared_tokens({k: store.get(k) for k in (A.key, B.key)})

    for kind, key, n in ops:
        if kind == "credit":
            pool.credit_tokens(key, n)
            counted[key] += n
        elif kind == "sync":
            sync()
        else:
            taken = pool.take_unpublished_tokens()
            if kind == "fail-stored":
                for k, v in taken.items():
                    store[k] = store.get(k, 0) + v
            pool.leave_shared_tokens(taken)
    sync()
    sync()
    assert {k: estimator.total(k) for k in counted} == counted
    assert {k: pool.output_tokens_total(k) for k in counted} == counted


def test_a_pod_whose_engine_counts_its_tokens_is_not_shared_through_the_store() -> None:
    """Every gateway reads the engine's own counter: adding the gateways' counts on top through
    the store would credit each token again."""
    pool, estimator = make()
    pool.apply_shared_tokens({A.key: 0, B.key: 0})
    pool.update_metrics(A.key, EngineMetrics(running=1, waiting=0, generation_tokens=500), 0.0)
    pool.acquire(A).release(9, 200, 0.0)
    pool.acquire(B).release(4, 200, 0.0)
    assert pool.take_unpublished_tokens() == {B.key: 4}
    pool.apply_shared_tokens({A.key: 300, B.key: 4})  # another gateway's count on A: ignored
    pool.update_metrics(A.key, EngineMetrics(running=1, waiting=0, generation_tokens=560), 1.0)
    assert (estimator.total(A.key), estimator.total(B.key)) == (60, 4)


def _counter(tokens: float, running: float = 8.0) -> EngineMetrics:
    return EngineMetrics(
        running=running, waiting=0.0, generation_tokens=tokens, generation_tokens_stepwise=True
    )


def test_a_pod_another_replica_scrapes_takes_what_that_replica_learned() -> None:
    """`update_metrics` with what the owner learned: its capacity and batch cap, taken as
    they are; nothing learned here from the counter (refreshes leave the estimate alone)."""
    owner, _ = make()
    for second in range(6):  # the owner learns from its scrapes: 1,000 tokens a second
        owner.update_metrics(A.key, _counter(1000.0 * second), float(second))
        owner.refresh_capacity(float(second))
    learned = owner.learned(A.key)
    assert learned[0] is not None and 900 < learned[0] < 1100
    assert learned[1] is True  # the engine's counter: the short window
    peer, estimator = make()
    peer.update_metrics(A.key, _counter(9000.0), 6.0, (learned[0], True, 40, "learned"))
    peer.refresh_capacity(7.0)
    assert peer.capacity(A.key) == learned[0]
    assert estimator.total(A.key) == 0  # no tokens counted here
    assert (peer.saturation(A.key), peer.saturation_source(A.key)) == (40, "learned")
    assert peer.token_source(A.key) == "engine"
    assert peer.scraped(A.key) is not None
    described = peer.snapshot(7.0)["pods"]
    assert described[A.key]["learned_by_scraping_replica"] is True
    assert described[B.key]["learned_by_scraping_replica"] is False
    assert owner.snapshot(7.0)["pods"][A.key]["learned_by_scraping_replica"] is False
    peer.update_metrics(A.key, _counter(9500.0), 7.0, (2500.0, True, 64, "engine"))
    peer.refresh_capacity(8.0)
    assert peer.capacity(A.key) == 2500.0
    assert (peer.saturation(A.key), peer.saturation_source(A.key)) == (64, "engine")
    peer.update_metrics(A.key, _counter(9600.0), 8.0, (None, True, None, None))
    assert peer.capacity(A.key) == 2500.0  # nothing learned there yet: keeps its own
    assert peer.saturation(A.key) is None


def test_a_replica_that_takes_the_scrapes_over_learns_on_from_the_adopted_estimate() -> None:
    """The owner died: the next scrapes are this replica's own. Its window starts then, from
    the adopted estimate, and the tokens generated since the last adopted read count."""
    pool, estimator = make()
    pool.update_metrics(A.key, _counter(5000.0), 0.0, (1000.0, True, None, None))
    pool.refresh_capacity(0.0)
    for second in range(1, 12):  # scraped here now: 3,000 tokens a second
        pool.update_metrics(A.key, _counter(5000.0 + 3000.0 * second), float(second))
        pool.refresh_capacity(float(second))
    assert estimator.total(A.key) == 33000  # from the adopted read on, none lost
    assert pool.snapshot(11.0)["pods"][A.key]["learned_by_scraping_replica"] is False
    capacity = pool.capacity(A.key)
    assert capacity is not None and 2500 < capacity <= 3000  # followed from 1,000 to 3,000


def test_a_capacity_the_gateways_counts_teach_is_learned_by_each_replica() -> None:
    """An engine without a token counter: every replica has all the tokens from the shared
    counters, so none adopts the owner's estimate (it would be its own a sync later)."""
    pool, estimator = make()
    no_counter = EngineMetrics(running=4.0, waiting=0.0)
    pool.update_metrics(A.key, no_counter, 0.0, (1000.0, False, None, None))
    assert pool.capacity(A.key) is None
    pool.credit_tokens(A.key, 600)
    pool.refresh_capacity(0.0)
    pool.credit_tokens(A.key, 600)
    pool.refresh_capacity(1.0)
    assert estimator.total(A.key) == 1200
    assert pool.capacity(A.key) == 600.0
    assert pool.token_source(A.key) == "gateway"


def test_a_replica_that_takes_a_learned_cap_over_keeps_it_against_a_lower_queue() -> None:
    """The adopted cap counts as the engine's peak: a queue at a lower running count after a
    take-over is no new cap (the scraping replica, which saw the peak, would learn none)."""
    pool, _ = make()
    pool.update_metrics(A.key, _counter(100.0, running=64.0), 0.0, (1000.0, True, 64, "learned"))
    for second in range(1, 8):  # scraped here now: a queue at 30 running, scrape after scrape
        queued = EngineMetrics(running=30.0, waiting=5.0, generation_tokens=100.0 + second)
        pool.update_metrics(A.key, queued, float(second))
    assert (pool.saturation(A.key), pool.saturation_source(A.key)) == (64, "learned")


def test_a_record_without_a_counter_leaves_the_tokens_to_the_gateways_counts() -> None:
    """A record that says its capacity is not from a counter (its metrics have one anyway):
    nothing adopted, and this replica's counts teach the capacity."""
    pool, estimator = make()
    pool.update_metrics(B.key, _counter(100.0), 0.0, (1000.0, False, None, None))
    assert pool.token_source(B.key) == "gateway"
    assert pool.capacity(B.key) is None
    pool.credit_tokens(B.key, 300)
    assert estimator.total(B.key) == 300
