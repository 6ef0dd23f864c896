"""Admission's pure rules: tenant identity, priority classes, fair order in GPU time."""

from __future__ import annotations

import random

import pytest

from plugin.core.admission import (
    DEFAULT_TENANT,
    ClassTable,
    FairQueue,
    Tenancy,
    gpu_seconds,
    token_digest,
)

pytestmark = pytest.mark.unit


def test_the_tenant_comes_from_the_header_then_the_token_s_digest_then_the_default() -> None:
    tenancy = Tenancy("x-tenant", {token_digest("sk-team-a"): "team-a"})
    assert tenancy.tenant("search", "Bearer sk-team-a") == "search"  # the header wins
    assert tenancy.tenant(None, "Bearer sk-team-a") == "team-a"
    assert tenancy.tenant("", "bearer   sk-team-a ") == "team-a"  # case, spaces
    assert tenancy.tenant(None, "Bearer sk-unknown") == DEFAULT_TENANT
    assert tenancy.tenant(None, "Basic c2stdGVhbS1h") == DEFAULT_TENANT
    assert tenancy.tenant(None, None) == DEFAULT_TENANT
    # Without a header configured, a value sent in one is not read.
    assert Tenancy(None, {}).tenant("search", None) == DEFAULT_TENANT


def test_a_request_waits_in_its_tenant_s_class_or_one_it_may_ask_for() -> None:
    table = ClassTable(
        ("interactive", "standard", "batch"),
        tenants={"chat": "interactive", "etl": "batch"},
        default="standard",
        may_ask={"etl": "standard", "chat": "interactive"},
    )
    assert table.rank("chat") == 0
    assert table.rank("etl") == 2
    assert table.rank("someone") == 1  # the default class
    assert table.rank("etl", "standard") == 1  # may ask, up to its ceiling
    assert table.rank("etl", "interactive") == 1  # not above it
    assert table.rank("chat", "batch") == 2  # lower is always allowed
    assert table.rank("someone", "batch") == 2  # by anyone: stepping down costs others nothing
    assert table.rank("someone", "interactive") == 1  # not above its own without a ceiling
    low_ceiling = ClassTable(
        ("interactive", "batch"), {"chat": "interactive"}, "batch", {"chat": "batch"}
    )
    assert low_ceiling.rank("chat", "interactive") == 0  # a ceiling never takes its own class
    assert table.rank("etl", "no-such-class") == 2  # unknown: its own class
    with pytest.raises(ValueError, match="unknown priority class 'gold'"):
        ClassTable(("a", "b"), tenants={"t": "gold"}, default="a")
    with pytest.raises(ValueError, match="distinct"):
        ClassTable(("a", "a"), default="a")


def test_gpu_time_is_tokens_over_the_serving_replica_s_speeds() -> None:
    # The same 1,000-token answer holds a slow replica's GPU three times as long.
    assert gpu_seconds(0, 1000, 500.0) == pytest.approx(2.0)
    assert gpu_seconds(0, 1000, 1600.0) == pytest.approx(0.625)
    assert gpu_seconds(4000, 1000, 500.0, 8000.0) == pytest.approx(2.5)
    # What no speed prices costs nothing (a replica not learned yet).
    assert gpu_seconds(4000, 1000, None, None) == 0.0
    assert gpu_seconds(4000, 1000, 0.0, 8000.0) == pytest.approx(0.5)


def test_the_highest_class_goes_first_then_the_least_used_tenant_then_arrival() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.charge("heavy", 10.0)
    queue.push("batch-1", "light", rank=1)
    queue.push("heavy-1", "heavy", rank=0)
    queue.push("heavy-2", "heavy", rank=0)
    queue.push("light-1", "light", rank=0)  # lifted to heavy's 10 as it joins class 0
    assert queue.usage["light"] == pytest.approx(10.0)
    assert len(queue) == 4 and queue.waiting(0) == 3 and queue.waiting(1) == 1
    assert queue.peek() == "heavy-1"  # equal usage: the older request's tenant
    assert queue.pop() == ("heavy-1", "heavy")
    queue.charge("heavy", 1.0)
    assert queue.pop() == ("light-1", "light")  # now the less used one
    assert queue.pop() == ("heavy-2", "heavy")
    assert queue.pop() == ("batch-1", "light")  # the lower class only once the higher is empty
    assert queue.pop() is None and queue.peek() is None


def test_idling_earns_no_credit_but_a_tenant_keeps_its_lead_while_it_waits() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a-1", "a", 0)
    queue.charge("a", 50.0)  # a has been served a lot while b was away
    queue.push("b-1", "b", 0)  # b was idle: it starts at a's 50, not at 0
    assert queue.usage["b"] == pytest.approx(50.0)
    queue.push("a-2", "a", 0)
    queue.charge("b", -5.0)  # b's estimate was 5 GPU-seconds too high: settled
    assert queue.usage["b"] == pytest.approx(45.0)
    assert [queue.pop() for _ in range(3)] == [("b-1", "b"), ("a-1", "a"), ("a-2", "a")]
    queue.charge("a", -1000.0)  # never below zero
    assert queue.usage["a"] == 0.0


def test_weights_scale_a_tenant_s_share() -> None:
    queue: FairQueue[int] = FairQueue({"gold": 3.0})
    for i in range(40):
        queue.push(i, "gold" if i % 2 else "plain", 0)
    served = {"gold": 0, "plain": 0}
    for _ in range(20):
        popped = queue.pop()
        assert popped is not None
        served[popped[1]] += 1
        queue.charge(popped[1], 1.0)
    assert served == {"gold": 15, "plain": 5}
    with pytest.raises(ValueError, match="weight of tenant 'x'"):
        FairQueue({"x": 0.0})


def test_a_cancelled_request_leaves_the_queue() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a-1", "a", 0)
    queue.push("a-2", "a", 0)
    queue.push("b-1", "b", 1)
    assert queue.remove("a-1") and not queue.remove("a-1")
    assert queue.remove("b-1")
    assert len(queue) == 1 and queue.waiting(1) == 0
    assert queue.pop() == ("a-2", "a")
    with pytest.raises(ValueError, match="already waits"):
        queue.push("x", "a", 0)
        queue.push("x", "a", 0)


def test_usage_of_idle_tenants_is_forgotten_least_recent_first() -> None:
    queue: FairQueue[str] = FairQueue()
    for tenant in ("a", "b", "c", "d"):
        queue.charge(tenant, 1.0)
    queue.charge("a", 1.0)  # a used most recently
    queue.push("d-1", "d", 0)  # d waits: kept whatever its age
    queue.forget_idle(keep=2)
    assert sorted(queue.usage) == ["a", "d"]


def test_gpu_seconds_served_stay_even_where_tokens_and_requests_do_not() -> None:
    """Two tenants, both always backlogged: `slow`'s requests land on a replica that learned
    500 tokens/s, `fast`'s on one at 1,600. Charged in GPU-seconds, each gets the same GPU time
    (within one request), so `fast` is served 3.2 times the requests; charged per request
    (the same rule with a cost of 1), each gets as many requests and `slow` three times the
    GPU time."""
    rng = random.Random(7)
    speeds = {"slow": 500.0, "fast": 1600.0}

    def serve(by_gpu_time: bool) -> tuple[dict[str, float], dict[str, int]]:
        queue: FairQueue[int] = FairQueue()
        gpu = {"slow": 0.0, "fast": 0.0}
        count = {"slow": 0, "fast": 0}
        for i in range(400):
            queue.push(i, "slow" if i % 10 == 0 else "fast", 0)  # fast sends 9x as many
            queue.push(1000 + i, "slow", 0)  # ... and slow keeps a backlog of its own
        for _ in range(300):
            popped = queue.pop()
            assert popped is not None
            tenant = popped[1]
            output = rng.randint(200, 400)
            spent = gpu_seconds(0, output, speeds[tenant])
            gpu[tenant] += spent
            count[tenant] += 1
            queue.charge(tenant, spent if by_gpu_time else 1.0)
        return gpu, count

    gpu, count = serve(by_gpu_time=True)
    assert abs(gpu["slow"] - gpu["fast"]) <= 400 / 500.0  # within the largest request
    assert count["fast"] / count["slow"] == pytest.approx(3.2, rel=0.15)
    gpu, count = serve(by_gpu_time=False)
    assert abs(count["slow"] - count["fast"]) <= 1
    assert gpu["slow"] / gpu["fast"] == pytest.approx(3.2, rel=0.15)


def test_in_order_lists_what_pop_would_take_while_usage_stands() -> None:
    queue: FairQueue[str] = FairQueue()
    for item, tenant, rank in (
        ("b1", "b", 1),
        ("a1", "a", 1),
        ("top", "c", 0),
        ("a2", "a", 1),
        ("b2", "b", 1),
    ):
        queue.push(item, tenant, rank)
    queue.charge("b", 5.0)
    listed = queue.in_order(10)
    assert listed == ["top", "a1", "a2", "b1", "b2"]
    assert [queue.pop()[0] for _ in range(5)] == listed  # type: ignore[index]
    assert queue.in_order(3) == []
