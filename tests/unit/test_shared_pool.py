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
