"""The router's admission: route now, reject, or hold until a lease is released or a deadline.

Pure: a hand-driven clock, a pool without sockets, strategies written here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import Lease, PodPool
from plugin.core.router import Decision, Router, Waiter
from plugin.core.selector import parse_selector
from plugin.core.strategies import (
    Admission,
    LoadBalanceSettings,
    Reject,
    Route,
    Strategy,
    Wait,
    build_strategies,
    settings_type,
)
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import NoMatchingPod, NoReadyPod, RoutingFailed, UnknownModel
from tests.helpers import make_pod

MODEL = "m"

pytestmark = pytest.mark.unit


def pod(name: str, model: str = MODEL, ready: bool = True) -> Pod:
    return make_pod(name, model=model, port=8000 + len(name), metrics_port=8000, ready=ready)


@dataclass
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Limit(Strategy):
    """Routes to the least-loaded pod under `limit` in flight; else holds until `arrived + wait_s`.

    `extend` makes it push the deadline on every ask (a strategy that wants more time).
    """

    limit: int = 1
    wait_s: float = 10.0
    extend: bool = False
    name: str = "limit"
    asked: int = 0

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        self.asked += 1
        room = [c for c in candidates if c.running < self.limit]
        if room:
            return Route(min(room, key=lambda c: c.running))
        start = now if self.extend else request.arrived_at
        return Wait(deadline=start + self.wait_s)


def setup(strategy: Strategy, *pods: Pod) -> tuple[Router, PodPool, Clock]:
    pool = PodPool(CapacityEstimator())
    pool.set_pods(pods or (pod("a"),))
    clock = Clock()
    router = Router(pool, {strategy.name: strategy}, strategy.name, random.Random(0), clock)
    return router, pool, clock


def request(at: float = 0.0, model: str = MODEL) -> RequestInfo:
    return RequestInfo(model, arrived_at=at)


def admitted(outcome: Decision | Waiter) -> Lease:
    assert isinstance(outcome, Decision)
    return outcome.lease


def held(outcome: Decision | Waiter) -> Waiter:
    assert isinstance(outcome, Waiter)
    return outcome


def test_a_deferred_request_is_woken_by_a_released_lease() -> None:
    strategy = Limit()
    router, pool, _ = setup(strategy)
    first = admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    woken: list[bool] = []
    waiter.notify = lambda: woken.append(True)
    assert (waiter.done, router.waiting(MODEL), pool.inflight("ns/a")) == (False, 1, 1)

    first.release(10, 200, 1.0)

    assert woken == [True]
    decision = waiter.result()
    assert decision.lease.pod.name == "a" and decision.strategy == "limit"
    assert (router.waiting(), pool.inflight("ns/a")) == (0, 1)
    waiter.cancel()  # after the owner took it: changes nothing
    assert pool.inflight("ns/a") == 1
    decision.lease.release()
    assert pool.inflight("ns/a") == 0


def test_waiters_are_asked_oldest_first() -> None:
    strategy = Limit()
    router, _, _ = setup(strategy)
    lease = admitted(router.admit(request(), strategy))
    older = held(router.admit(request(1.0), strategy))
    younger = held(router.admit(request(2.0), strategy))
    lease.release()
    assert older.done and not younger.done
    assert router.waiting(MODEL) == 1
    older.result().lease.release()
    assert younger.done


def test_the_deadline_rejects_with_the_strategy_error_once_asked_again() -> None:
    strategy = Limit(wait_s=5.0)
    router, pool, clock = setup(strategy)
    admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    assert waiter.deadline == 5.0
    clock.t = 5.0
    asked = strategy.asked
    router.expire(waiter)
    assert strategy.asked == asked + 1  # a last chance before the rejection
    with pytest.raises(RoutingFailed) as err:
        waiter.result()
    assert err.value.status == 503
    assert router.waiting() == 0 and pool.inflight("ns/a") == 1


def test_a_later_deadline_keeps_the_request_waiting() -> None:
    strategy = Limit(wait_s=5.0, extend=True)
    router, _, clock = setup(strategy)
    admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    clock.t = 5.0
    router.expire(waiter)
    assert not waiter.done and waiter.deadline == 10.0 and router.waiting() == 1


def test_expiry_routes_when_room_appeared_without_a_wake() -> None:
    strategy = Limit()
    router, pool, clock = setup(strategy)
    lease = admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    pool.on_release = None  # a release the router did not hear of
    lease.release()
    clock.t = 10.0
    router.expire(waiter)
    assert waiter.result().lease.pod.name == "a"


def test_cancelling_a_waiter_removes_it_and_takes_nothing() -> None:
    strategy = Limit()
    router, pool, _ = setup(strategy)
    lease = admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    waiter.cancel()
    assert router.waiting() == 0
    lease.release()
    assert pool.inflight("ns/a") == 0 and pool.routed_total("ns/a") == 1
    router.expire(waiter)  # a timer that fires after the cancel does nothing
    assert pool.inflight("ns/a") == 0


def test_a_granted_lease_the_owner_never_took_is_given_back_on_cancel() -> None:
    """The grant and the client's cancel race: the lease must not leak."""
    strategy = Limit()
    router, pool, _ = setup(strategy)
    lease = admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    lease.release()
    assert waiter.done and pool.inflight("ns/a") == 1
    waiter.cancel()
    assert pool.inflight("ns/a") == 0


def test_a_pool_change_wakes_waiters() -> None:
    strategy = Limit()
    router, pool, _ = setup(strategy, pod("a"))
    admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    pool.set_pods([pod("a"), pod("bb")])
    assert waiter.result().lease.pod.name == "bb"


@pytest.mark.parametrize(
    ("pods", "error"),
    [([], UnknownModel), ([pod("a", ready=False)], NoReadyPod)],
    ids=["model-gone", "no-ready-pod"],
)
def test_a_waiter_whose_model_lost_its_pods_is_rejected(
    pods: list[Pod], error: type[Exception]
) -> None:
    strategy = Limit()
    router, pool, _ = setup(strategy)
    admitted(router.admit(request(), strategy))
    waiter = held(router.admit(request(), strategy))
    pool.set_pods(pods)
    with pytest.raises(error):
        waiter.result()
    assert router.waiting() == 0


def test_a_reject_answer_raises_its_error() -> None:
    @dataclass
    class Refuse(Strategy):
        name: str = "refuse"

        def admit(
            self,
            candidates: Sequence[Candidate],
            request: RequestInfo,
            rng: random.Random,
            now: float,
        ) -> Admission:
            return Reject(RoutingFailed("over budget"))

    strategy = Refuse()
    router, pool, _ = setup(strategy)
    with pytest.raises(RoutingFailed, match="over budget"):
        router.admit(request(), strategy)
    assert pool.inflight("ns/a") == 0 and router.waiting() == 0


def test_route_for_a_caller_that_cannot_wait_fails_and_leaves_no_waiter() -> None:
    strategy = Limit()
    router, _, _ = setup(strategy)
    router.route(request(), strategy)
    with pytest.raises(RoutingFailed):
        router.route(request(), strategy)
    assert router.waiting() == 0


def test_waiters_of_one_model_are_not_woken_by_another() -> None:
    strategy = Limit()
    router, _, _ = setup(strategy, pod("a"), pod("x", model="other"))
    admitted(router.admit(request(), strategy))
    other = admitted(router.admit(request(model="other"), strategy))
    waiter = held(router.admit(request(), strategy))
    asked = strategy.asked
    other.release()
    assert strategy.asked == asked and not waiter.done


def test_pickers_always_route() -> None:
    strategies = build_strategies()
    router, pool, _ = setup(strategies["least-request"], pod("a"), pod("bb"))
    for name, strategy in strategies.items():
        outcome = router.admit(request(), strategy)
        assert isinstance(outcome, Decision) and outcome.strategy == name
    assert pool.inflight("ns/a") + pool.inflight("ns/bb") == len(strategies)


def test_an_external_filter_narrows_every_strategy_to_the_matching_pods() -> None:
    strategies = build_strategies()
    a100 = dataclasses.replace(pod("a"), labels={"gpu": "a100"})
    l20 = dataclasses.replace(pod("bb"), labels={"gpu": "l20"})
    router, pool, _ = setup(strategies["least-request"], a100, l20)
    only_l20 = dataclasses.replace(request(), pod_selector=parse_selector("gpu=l20"))
    for strategy in strategies.values():
        for _ in range(3):  # even once l20 is the busier pod
            outcome = router.admit(only_l20, strategy)
            assert isinstance(outcome, Decision) and outcome.lease.pod.name == "bb"
    assert pool.inflight("ns/a") == 0


def test_an_external_filter_nothing_matches_is_a_routing_error_and_takes_nothing() -> None:
    strategy = Limit()
    router, pool, _ = setup(strategy, dataclasses.replace(pod("a"), labels={"gpu": "a100"}))
    nothing = dataclasses.replace(request(), pod_selector=parse_selector("gpu in (h100,l20)"))
    with pytest.raises(NoMatchingPod) as err:
        router.admit(nothing, strategy)
    assert err.value.status == 503 and "gpu in (h100,l20)" in err.value.message
    assert (pool.inflight("ns/a"), router.waiting()) == (0, 0)


def test_a_held_request_keeps_its_external_filter() -> None:
    strategy = Limit()
    a100 = dataclasses.replace(pod("a"), labels={"gpu": "a100"})
    l20 = dataclasses.replace(pod("bb"), labels={"gpu": "l20"})
    router, pool, _ = setup(strategy, a100, l20)
    only_a100 = dataclasses.replace(request(), pod_selector=parse_selector("gpu=a100"))
    first = admitted(router.admit(only_a100, strategy))
    waiter = held(router.admit(only_a100, strategy))  # bb has room, but the filter rules it out
    assert pool.inflight("ns/bb") == 0
    first.release()
    assert waiter.result().lease.pod.name == "a"


def test_each_strategy_gets_its_own_settings() -> None:
    assert settings_type("load-balance") is LoadBalanceSettings
    assert settings_type("least-request") is None
    lb = build_strategies(LoadBalanceSettings(kv_pressure_alpha=0.5))["load-balance"]
    assert getattr(lb, "params") == LoadBalanceSettings(kv_pressure_alpha=0.5)  # noqa: B009
    default = build_strategies()["load-balance"]
    assert getattr(default, "params") == LoadBalanceSettings()  # noqa: B009

    @dataclass(frozen=True)
    class Stray:
        x: int = 1

    with pytest.raises(ValueError, match="Stray"):
        build_strategies(Stray())


# Operations on one pod with limit 2: admit, release the oldest lease, cancel the oldest waiter,
# advance the clock and expire every due waiter.
OPS = st.lists(st.sampled_from(["admit", "release", "cancel", "expire"]), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_nothing_leaks_whatever_the_order(ops: list[str]) -> None:
    strategy = Limit(limit=2, wait_s=3.0)
    router, pool, clock = setup(strategy)
    leases: list[Lease] = []
    waiters: list[Waiter] = []
    for op in ops:
        if op == "admit":
            outcome = router.admit(request(clock.t), strategy)
            if isinstance(outcome, Decision):
                leases.append(outcome.lease)
            else:
                waiters.append(outcome)
        elif op == "release" and leases:
            leases.pop(0).release()
        elif op == "cancel" and waiters:
            waiters.pop(0).cancel()
        elif op == "expire":
            clock.t += 1.0
            for w in list(waiters):
                if not w.done and w.deadline <= clock.t:
                    router.expire(w)
        # Owners take what they were granted and drop what was rejected.
        for w in list(waiters):
            if w.done:
                waiters.remove(w)
                with contextlib.suppress(RoutingFailed):
                    leases.append(w.result().lease)
        assert pool.inflight("ns/a") == len(leases) <= 2
        assert router.waiting() == len(waiters)
    for lease in leases:
        lease.release()
    for w in waiters:
        w.cancel()
    assert pool.inflight("ns/a") == 0 and router.waiting() == 0


def test_a_fallback_is_another_routable_pod_of_the_model() -> None:
    strategy = Limit(limit=10)
    router, _, _ = setup(strategy, pod("a"), pod("bb"), pod("ccc", ready=False))
    decision = admitted_decision(router.admit(request(), strategy))
    for _ in range(20):
        other = router.fallback(decision)
        assert other is not None and other.name == ({"a", "bb"} - {decision.lease.pod.name}).pop()
    alone, _, _ = setup(strategy, pod("a"))
    assert alone.fallback(admitted_decision(alone.admit(request(), strategy))) is None

    # A retry must not leave the pods the request's external-filter allows.
    a100, b100 = (dataclasses.replace(pod(n), labels={"gpu": "a100"}) for n in ("a", "bb"))
    l20 = dataclasses.replace(pod("ccc"), labels={"gpu": "l20"})
    narrowed, _, _ = setup(strategy, a100, b100, l20)
    only_a100 = dataclasses.replace(request(), pod_selector=parse_selector("gpu=a100"))
    decision = admitted_decision(narrowed.admit(only_a100, strategy))
    for _ in range(20):
        other = narrowed.fallback(decision)
        assert other is not None and other.labels["gpu"] == "a100"
        assert other.name != decision.lease.pod.name


def admitted_decision(outcome: Decision | Waiter) -> Decision:
    assert isinstance(outcome, Decision)
    return outcome
