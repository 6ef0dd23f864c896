"""The router with admission on: requests wait in their model's fair queue while the fleet is
full, leave it by class and GPU-time fairness as room appears, and are shed with a 503 and
`retry-after` when they wait too long or a higher class needs their place."""

from __future__ import annotations

import dataclasses
import random

import pytest

from plugin.core.admission import OTHER_TENANTS, Admission, AdmissionSettings, ClassTable
from plugin.core.capacity import CapacityEstimator
from plugin.core.config_profile import ConfigProfile
from plugin.core.limits import Limit as TenantLimit
from plugin.core.limits import LimitTable
from plugin.core.pool import PodPool
from plugin.core.router import Decision, Router, Waiter
from plugin.core.selector import parse_selector
from plugin.core.strategies import build_strategies
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import Overloaded, RateLimited, RoutingFailed, error_reply
from tests.helpers import make_pod
from tests.unit.test_router import Clock, Limit

MODEL = "m"

pytestmark = pytest.mark.unit


def capped(name: str, cap: int) -> Pod:
    """A pod whose engine batch holds `cap` requests (declared, as `max_num_seqs` says)."""
    return dataclasses.replace(make_pod(name, port=8000 + len(name)), max_num_seqs=cap)


CLASSES = ClassTable(("interactive", "batch"), {"chat": "interactive"}, default="batch")


def setup(
    cap: int = 1,
    max_wait_s: float = 5.0,
    max_waiting: int = 10,
    strategy: str = "least-request",
    limits: LimitTable | None = None,
) -> tuple[Router, PodPool, Clock]:
    pool = PodPool(CapacityEstimator())
    pool.set_pods([capped("a", cap)])
    clock = Clock()
    strategies = build_strategies()
    settings = AdmissionSettings(
        classes=CLASSES,
        max_wait_s=max_wait_s,
        max_waiting=max_waiting,
        limits=limits or LimitTable(),
    )
    router = Router(
        pool, strategies, strategy, random.Random(0), clock, admission=Admission(settings)
    )
    return router, pool, clock


def req(tenant: str, at: float = 0.0, **kw: object) -> RequestInfo:
    return RequestInfo(MODEL, tenant=tenant, arrived_at=at, **kw)  # type: ignore[arg-type]


def admit(router: Router, request: RequestInfo) -> Decision | Waiter:
    return router.admit(request, router.strategy_for(None))


def routed(outcome: Decision | Waiter) -> Decision:
    assert isinstance(outcome, Decision), outcome
    return outcome


def waiting(outcome: Decision | Waiter) -> Waiter:
    assert isinstance(outcome, Waiter), outcome
    assert outcome.admitting and not outcome.done
    return outcome


def test_with_room_nothing_waits() -> None:
    router, pool, _ = setup(cap=2)
    first, second = (routed(admit(router, req("t"))) for _ in range(2))
    assert pool.inflight("ns/a") == 2 and router.waiting(MODEL) == 0
    assert first.charge is not None and second.charge is not None  # charged (0: speed unknown)


def test_a_full_fleet_queues_and_a_release_dispatches_the_head() -> None:
    router, pool, _ = setup(cap=1)
    first = routed(admit(router, req("t")))
    held = waiting(admit(router, req("t")))
    assert router.waiting(MODEL) == 1 and router.waiting_by_model() == {MODEL: 1}
    told: list[bool] = []
    held.notify = lambda: told.append(held.done)
    first.lease.release(5, 200, 1.0)
    assert told == [True] and not held.admitting
    decision = held.result()
    assert decision.lease.pod.name == "a" and pool.inflight("ns/a") == 1
    assert router.waiting(MODEL) == 0


def test_an_arrival_waits_behind_others_even_when_room_appears_between() -> None:
    """FIFO across the fleet being full: a newcomer does not jump those already waiting."""
    router, _, _ = setup(cap=1)
    first = routed(admit(router, req("t")))
    older = waiting(admit(router, req("t")))
    first.lease.release()  # the older one takes the room
    assert older.done
    newer = waiting(admit(router, req("t")))
    assert not newer.done


def test_the_higher_class_leaves_the_queue_first() -> None:
    router, _, _ = setup(cap=1)
    first = routed(admit(router, req("t")))
    batch = waiting(admit(router, req("bulk")))
    chat = waiting(admit(router, req("chat")))
    first.lease.release()
    assert chat.done and not batch.done
    chat.result().lease.release()
    assert batch.done


def test_within_a_class_the_tenant_with_less_gpu_time_goes_first() -> None:
    router, _, _ = setup(cap=1)
    admission = router.admission
    assert admission is not None
    first = routed(admit(router, req("t")))
    heavy = waiting(admit(router, req("heavy")))
    light = waiting(admit(router, req("light")))
    admission.charge(MODEL, "heavy", 10.0)
    admission.charge(MODEL, "light", 1.0)
    first.lease.release()
    assert light.done and not heavy.done


def test_a_request_asking_for_a_class_its_tenant_may_not_use_keeps_its_own() -> None:
    router, _, _ = setup(cap=1)
    first = routed(admit(router, req("t")))
    chat = waiting(admit(router, req("chat")))
    sneaky = waiting(admit(router, req("bulk", priority_class="interactive")))
    first.lease.release()
    assert chat.done and not sneaky.done


def test_waiting_past_the_class_limit_is_a_503_with_retry_after() -> None:
    router, pool, clock = setup(cap=1, max_wait_s=5.0)
    routed(admit(router, req("t")))
    held = waiting(admit(router, req("t")))
    clock.t = 4.0
    router.expire(held)  # early: nothing happens
    assert not held.done
    clock.t = 5.0
    router.expire(held)
    with pytest.raises(Overloaded) as caught:
        held.result()
    reply = error_reply(caught.value)
    assert reply.status == 503 and ("retry-after", "5") in reply.headers
    assert router.admission is not None
    assert router.admission.shed == {(MODEL, "batch", "timeout"): 1}
    assert router.waiting(MODEL) == 0 and pool.inflight("ns/a") == 1


def test_a_class_may_have_its_own_longest_wait() -> None:
    pool = PodPool(CapacityEstimator())
    pool.set_pods([capped("a", 1)])
    clock = Clock()
    settings = AdmissionSettings(classes=CLASSES, max_wait_s=5.0, class_max_wait_s={"batch": 1})
    router = Router(
        pool,
        build_strategies(),
        "least-request",
        random.Random(0),
        clock,
        admission=Admission(settings),
    )
    routed(admit(router, req("t")))
    assert waiting(admit(router, req("bulk"))).deadline == 1.0
    assert waiting(admit(router, req("chat"))).deadline == 5.0


def test_a_full_queue_sheds_the_newest_of_the_lowest_class_for_a_higher_one() -> None:
    router, _, _ = setup(cap=1, max_waiting=2)
    admission = router.admission
    assert admission is not None
    routed(admit(router, req("t")))
    old_bulk = waiting(admit(router, req("bulk")))
    new_bulk = waiting(admit(router, req("bulk")))
    with pytest.raises(Overloaded):  # a batch arrival into a full queue is refused itself
        admit(router, req("bulk"))
    chat = waiting(admit(router, req("chat")))
    assert new_bulk.done and not old_bulk.done and not chat.done
    with pytest.raises(Overloaded):
        new_bulk.result()
    assert router.waiting(MODEL) == 2
    assert admission.shed == {(MODEL, "batch", "full"): 1, (MODEL, "batch", "displaced"): 1}
    assert admission.waiting_by_class() == {(MODEL, "interactive"): 1, (MODEL, "batch"): 1}


def test_a_cancelled_waiter_leaves_the_queue_and_takes_nothing() -> None:
    router, pool, _ = setup(cap=1)
    first = routed(admit(router, req("t")))
    held = waiting(admit(router, req("t")))
    held.cancel()
    assert router.waiting(MODEL) == 0
    first.lease.release()
    assert pool.inflight("ns/a") == 0
    with pytest.raises(RuntimeError):  # never granted
        held.result()


def test_a_drain_answers_queued_requests_too() -> None:
    router, _, _ = setup(cap=1)
    routed(admit(router, req("t")))
    held = waiting(admit(router, req("t")))
    assert router.reject_waiting(Overloaded("draining", 1.0)) == 1
    with pytest.raises(Overloaded):
        held.result()


def test_a_strategy_that_holds_the_dispatched_request_gets_it_with_its_own_deadline() -> None:
    """Admission's room is a batch slot; a strategy may still want to wait (SLO routing):
    the request moves to its hold, and its owner hears the new deadline."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([capped("a", 2)])
    clock = Clock()
    limit = Limit(limit=1, wait_s=3.0)
    router = Router(
        pool,
        {limit.name: limit},
        limit.name,
        random.Random(0),
        clock,
        admission=Admission(AdmissionSettings(max_wait_s=20.0)),
    )
    one = routed(router.admit(req("t"), limit))
    routed_two = router.admit(req("t"), limit)  # admission has room, the strategy holds it
    assert isinstance(routed_two, Waiter) and not routed_two.admitting
    assert routed_two.deadline == 3.0
    one.lease.release()
    assert routed_two.done


def test_the_settlement_charges_what_the_request_really_took() -> None:
    router, pool, _ = setup(cap=4)
    admission = router.admission
    assert admission is not None
    pool.candidates(MODEL, 0.0)[0].capacity = 100.0  # learned output tokens/s
    decision = routed(admit(router, req("t", max_tokens=200)))
    assert decision.charge is not None and decision.charge.gpu_s == pytest.approx(2.0)
    assert admission.queue(MODEL).usage["t"] == pytest.approx(2.0)
    decision.lease.release(50, 200, 1.0)
    router.finished(decision, 200, output_tokens=50)
    assert admission.queue(MODEL).usage["t"] == pytest.approx(0.5)
    assert admission.gpu_seconds == {(MODEL, "t"): pytest.approx(0.5)}  # for /metrics


def test_the_gpu_time_metric_keeps_a_bounded_number_of_tenants() -> None:
    admission = Admission(AdmissionSettings(max_tenants=2))
    candidate = Candidate(capped("a", 4), 0, None, None, 100.0)
    for tenant in ("a", "b", "c", "d"):
        request = req(tenant)
        admission.settle(request, 100, admission.estimate(request, candidate))
    assert admission.gpu_seconds == {
        (MODEL, "a"): pytest.approx(1.0),
        (MODEL, "b"): pytest.approx(1.0),
        (MODEL, OTHER_TENANTS): pytest.approx(2.0),
    }


@pytest.mark.parametrize(
    ("measure", "charged", "settled"),
    [("gpu-seconds", 2.0 + 0.01, 0.5 + 0.01), ("tokens", 210.0, 60.0), ("requests", 1.0, 1.0)],
)
def test_fairness_counts_what_its_measure_says(
    measure: str, charged: float, settled: float
) -> None:
    """GPU-seconds price prompt and output at the replica's speeds; the peers' measures (for
    comparison) count tokens or requests whatever the replica."""
    admission = Admission(AdmissionSettings(measure=measure))
    candidate = Candidate(capped("a", 4), 0, None, None, 100.0)
    speeds = {"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": None, "slo_batch": None}
    candidate.profile = type("P", (), speeds)()  # no decode speed: the learned one prices
    request = req("t", max_tokens=200, prompt_tokens=10)
    charge = admission.estimate(request, candidate)
    assert charge.gpu_s == pytest.approx(charged)
    admission.charge(MODEL, "t", charge.gpu_s)
    admission.settle(request, 50, charge)
    assert admission.queue(MODEL).usage["t"] == pytest.approx(settled)


def test_an_unknown_measure_is_refused() -> None:
    with pytest.raises(ValueError, match="measure"):
        AdmissionSettings(measure="dollars")


def test_a_profile_s_decode_speed_prices_the_output_over_the_learned_throughput() -> None:
    """The learned throughput counts a replica's prefill time too; its profile's decode speed
    does not (`GpuProfile.decode_tokens_per_s`)."""
    admission = Admission(AdmissionSettings())
    candidate = Candidate(capped("a", 4), 0, None, None, 100.0)
    speeds = {"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 400.0, "slo_batch": None}
    candidate.profile = type("P", (), speeds)()
    charge = admission.estimate(req("t", prompt_tokens=10), candidate, predicted=200)
    assert charge.gpu_s == pytest.approx(200 / 400 + 10 / 1000)


def test_a_profile_s_slo_batch_bounds_the_room_below_the_engine_cap() -> None:
    router, pool, _ = setup(cap=8)
    speeds = {"prefill_tokens_per_s": None, "decode_tokens_per_s": None, "slo_batch": 2}
    pool.candidates(MODEL, 0.0)[0].profile = type("P", (), speeds)()
    routed(admit(router, req("t")))
    routed(admit(router, req("t")))
    waiting(admit(router, req("t")))  # two in flight keep the SLO; the engine would take 8


def test_the_top_class_keeps_a_tenth_of_each_replica_s_room() -> None:
    router, pool, _ = setup(cap=10)
    for _ in range(9):
        routed(admit(router, req("bulk")))
    batch = waiting(admit(router, req("bulk")))  # the tenth slot is the interactive class's
    chat = routed(admit(router, req("chat")))
    assert pool.inflight("ns/a") == 10 and not batch.done
    chat.lease.release()
    assert not batch.done  # still the reserved slot
    routed(admit(router, req("chat")))  # while an interactive request takes it at once


def test_a_strategy_that_holds_takes_one_from_the_queue_per_release() -> None:
    """A hold takes no lease, so the room stays: the queue must not empty into holds."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([capped("a", 2)])
    limit = Limit(limit=1, wait_s=20.0)
    router = Router(
        pool,
        {limit.name: limit},
        limit.name,
        random.Random(0),
        Clock(),
        admission=Admission(AdmissionSettings()),
    )
    first = routed(router.admit(req("t"), limit))
    extra = pool.acquire(first.lease.pod)  # the engine's batch is full
    second = waiting(router.admit(req("t"), limit))
    third = waiting(router.admit(req("t"), limit))
    extra.release()  # room for one: the second meets its strategy, which holds it
    assert not second.admitting and not second.done and third.admitting
    assert router.admission is not None and router.admission.waiting(MODEL) == 1
    first.lease.release()
    assert second.done and not third.done


def test_a_strategy_failing_on_a_dispatched_request_answers_it_and_leaks_nothing() -> None:
    class Broken(Limit):
        def admit(self, *args: object, **kw: object) -> Admission:  # type: ignore[override]
            raise KeyError("bug")

    pool = PodPool(CapacityEstimator())
    pool.set_pods([capped("a", 1)])
    broken = Broken(name="broken")
    router = Router(
        pool,
        {"least-request": build_strategies()["least-request"], broken.name: broken},
        "least-request",
        random.Random(0),
        Clock(),
        admission=Admission(AdmissionSettings()),
    )
    warnings: list[str] = []
    router.on_warning = warnings.append
    first = routed(router.admit(req("t"), router.strategy_for(None)))
    held = waiting(router.admit(req("t"), broken))
    first.lease.release()
    with pytest.raises(RoutingFailed):
        held.result()
    assert pool.inflight("ns/a") == 0 and router.waiting() == 0
    assert warnings and "broken" in warnings[0]


# rate limits ---------------------------------------------------------------------------------
def used(router: Router, tenant: str = "t") -> list[float]:
    """The tenant's requests, tokens and GPU-seconds counted in the window now."""
    assert router.admission is not None and router.admission.limits is not None
    return router.admission.limits.totals(router.now()).get(tenant, [0.0, 0.0, 0.0])


def test_a_request_over_its_tenants_limit_is_429_before_it_waits_or_routes() -> None:
    router, pool, _ = setup(cap=4, limits=LimitTable({"t": TenantLimit(tokens=1000)}))
    first = routed(admit(router, req("t", prompt_tokens=100, max_tokens=500)))
    with pytest.raises(RateLimited) as caught:
        admit(router, req("t", prompt_tokens=100, max_tokens=500))
    reply = error_reply(caught.value)
    assert reply.status == 429 and ("x-error-tpm-exceeded", "true") in reply.headers
    assert b'"code":"rate_limit_exceeded"' in reply.body.replace(b" ", b"")
    assert dict(reply.headers)["x-ratelimit-remaining-tokens"] == "400"
    assert "retry-after" in dict(reply.headers)
    assert pool.inflight("ns/a") == 1 and router.waiting(MODEL) == 0
    routed(admit(router, req("other", prompt_tokens=100, max_tokens=5000)))  # not limited
    assert router.limit_headers(first)[:2] == [
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "400"),
    ]


def test_the_settlement_counts_the_prompt_and_the_output_served() -> None:
    router, pool, _ = setup(cap=4, limits=LimitTable({"t": TenantLimit(1000, 1000, 100.0)}))
    pool.candidates(MODEL, 0.0)[0].capacity = 100.0  # output tokens/s: 10 ms a token
    decision = routed(admit(router, req("t", prompt_tokens=100, max_tokens=500)))
    assert used(router) == [1.0, 600.0, pytest.approx(5.0)]  # priced at its replica
    decision.lease.release(40, 200, 1.0)
    router.finished(decision, 200, output_tokens=40)
    assert used(router) == [1.0, 140.0, pytest.approx(0.4)]
    failed = routed(admit(router, req("t", prompt_tokens=100, max_tokens=500)))
    failed.lease.release(0, 500, 2.0)
    router.finished(failed, 500, output_tokens=0)  # an engine's error costs a request only
    assert used(router) == [2.0, 140.0, pytest.approx(0.4)]
    counted = routed(admit(router, req("t", prompt_tokens=100, max_tokens=500)))
    counted.lease.release(10, 200, 3.0)
    router.finished(counted, 200, output_tokens=10, prompt_tokens=130)  # the engine's count
    assert used(router)[:2] == [3.0, 280.0]


def test_a_request_shed_or_cancelled_while_waiting_gives_its_reservation_back() -> None:
    router, _, clock = setup(cap=1, limits=LimitTable({"t": TenantLimit(tokens=10_000)}))
    first = routed(admit(router, req("t", prompt_tokens=10, max_tokens=90)))
    shed = waiting(admit(router, req("t", prompt_tokens=10, max_tokens=90)))
    gone = waiting(admit(router, req("t", prompt_tokens=10, max_tokens=90)))
    assert used(router)[1] == 300.0
    gone.cancel()
    clock.t = 5.0
    router.expire(shed)
    with pytest.raises(Overloaded):
        shed.result()
    assert used(router)[:2] == [1.0, 100.0]
    first.lease.release()


def test_a_refusal_after_the_reservation_gives_it_back() -> None:
    router, _, _ = setup(cap=1, max_waiting=1, limits=LimitTable({"t": TenantLimit(requests=5)}))
    routed(admit(router, req("t")))
    waiting(admit(router, req("t")))
    with pytest.raises(Overloaded):  # the queue is full: refused after its reservation
        admit(router, req("t"))
    assert used(router)[0] == 2.0


def test_a_request_counted_at_another_gateway_is_settled_there() -> None:
    """Pick only, the counting stream may reach another replica: the routing one hands over
    what it reserved, and the sum of the two gateways' usage is what the request used."""
    table = LimitTable({"t": TenantLimit(tokens=10_000, gpu_seconds=100.0)})
    routing, pool, _ = setup(cap=4, limits=table)
    counting, _, _ = setup(cap=4, limits=table)
    pool.candidates(MODEL, 0.0)[0].capacity = 100.0
    decision = routed(admit(routing, req("t", prompt_tokens=100, max_tokens=500)))
    text = routing.handed_reservation(decision)
    assert text is not None and text.endswith(";t")
    assert counting.settle_handed(text, 200, prompt_tokens=120, output_tokens=30)
    mine, theirs = used(routing), used(counting)
    assert mine[1] + theirs[1] == 150.0  # 600 reserved there, -450 settled here
    assert mine[2] + theirs[2] == pytest.approx(0.3)  # 30 tokens at 100/s
    assert not counting.settle_handed("garbage", 200, 1, 1)
    assert not counting.settle_handed("0;1;nan;0;;;t", 200, 1, 1)


def test_a_config_profile_sets_how_long_its_requests_wait() -> None:
    router, _, clock = setup(cap=1, max_wait_s=5.0)
    quick = ConfigProfile("quick", admission_class_wait_ms={"batch": 1000})
    patient = ConfigProfile("patient", admission_wait_ms=60_000)
    routed(admit(router, req("t")))
    short = router.admit(req("t"), router.strategy_for(None), quick)
    long = router.admit(req("t"), router.strategy_for(None), patient)
    assert isinstance(short, Waiter) and isinstance(long, Waiter)
    assert short.deadline == 1.0
    assert long.deadline == 5.0  # never beyond the settings' longest (Envoy's hold timeout)
    clock.t = 1.0
    router.expire(short)
    with pytest.raises(Overloaded):
        short.result()


def test_a_head_whose_filter_matches_only_full_replicas_does_not_hold_back_others() -> None:
    router, pool, _ = setup(cap=1)
    pods = [
        dataclasses.replace(make_pod(n, port=9000 + i, labels={"gpu": n}), max_num_seqs=1)
        for i, n in enumerate(("a100", "v100"))
    ]
    pool.set_pods(pods)
    only_a = req("t", pod_selector=parse_selector("gpu=a100"))
    first = routed(admit(router, only_a))
    assert first.lease.pod.name == "a100"
    held = waiting(admit(router, only_a))  # its only replica is full: the head
    # Behind it, a request any replica can take goes to the one with room at once.
    other = routed(admit(router, req("u")))
    assert other.lease.pod.name == "v100" and not held.done
    first.lease.release()
    assert held.done and held.result().lease.pod.name == "a100"


def test_a_request_granted_but_given_up_before_it_was_taken_is_not_charged() -> None:
    router, pool, _ = setup(cap=1)
    admission = router.admission
    assert admission is not None
    pool.candidates(MODEL, 0.0)[0].capacity = 100.0
    first = routed(admit(router, req("t", max_tokens=100)))
    held = waiting(admit(router, req("t", max_tokens=100)))
    first.lease.release()
    router.finished(first, 200, output_tokens=100)
    assert held.done and admission.queue(MODEL).usage["t"] == pytest.approx(2.0)
    held.cancel()  # the client went away before its stream took the grant
    assert admission.queue(MODEL).usage["t"] == pytest.approx(1.0)
    assert pool.inflight("ns/a") == 0
