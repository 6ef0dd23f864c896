"""Per-tenant rate limits (`plugin.core.limits`): the rolling window, reservations and their
settlement, the shared view and its fallback, and the headers."""

from __future__ import annotations

import random

import pytest

from plugin.core.limits import Limit, LimitTable, RateLimits, duration_text
from plugin.errors import RateLimited

pytestmark = pytest.mark.unit


def limits(**kinds: float) -> RateLimits:
    return RateLimits(LimitTable({"team": Limit(**kinds)}))


def test_a_tenant_without_limits_is_not_counted() -> None:
    rl = limits(requests=1)
    assert rl.reserve("other", 100, 0.0) is None
    assert rl.reserve("other", 100, 0.0) is None
    assert rl.headers("other", 0.0) == []
    assert rl.totals(0.0) == {}


def test_every_unnamed_tenant_has_the_star_limit_of_its_own() -> None:
    rl = RateLimits(LimitTable({"big": Limit(requests=3)}, every=Limit(requests=1)))
    rl.reserve("a", 0, 0.0)
    rl.reserve("b", 0, 0.0)  # its own limit, not a's
    with pytest.raises(RateLimited):
        rl.reserve("a", 0, 0.5)
    for _ in range(3):
        rl.reserve("big", 0, 0.5)


def test_requests_beyond_the_limit_get_429_with_retry_after_and_headers() -> None:
    rl = limits(requests=3)
    for t in (0.0, 10.0, 20.0):
        rl.reserve("team", 0, t)
    with pytest.raises(RateLimited) as refused:
        rl.reserve("team", 0, 30.0)
    err = refused.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.header == ("x-error-rpm-exceeded", "true")
    headers = dict(err.extra_headers)
    # The request at 0 s leaves the window (61 one-second buckets) at 61 s: 31 s from now.
    assert headers["retry-after"] == "31"
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "51s"  # the newest, at 20 s, leaves at 81 s
    assert rl.refused == {("team", "requests"): 1}


def test_the_window_rolls_by_buckets_not_by_fixed_minutes() -> None:
    rl = limits(requests=2)
    rl.reserve("team", 0, 58.5)
    rl.reserve("team", 0, 59.5)
    # A fixed minute would start afresh at 60 s: a rolling window still counts both.
    with pytest.raises(RateLimited):
        rl.reserve("team", 0, 61.0)
    with pytest.raises(RateLimited):
        rl.reserve("team", 0, 118.9)
    rl.reserve("team", 0, 119.0)  # the one at 58.5 s left at 119 s
    with pytest.raises(RateLimited):
        rl.reserve("team", 0, 119.5)


def test_tokens_are_reserved_at_max_tokens_and_settled_at_what_was_served() -> None:
    rl = limits(tokens=1000)
    first = rl.reserve("team", 600, 0.0)  # prompt + max_tokens
    with pytest.raises(RateLimited) as refused:
        rl.reserve("team", 600, 1.0)
    assert refused.value.header == ("x-error-tpm-exceeded", "true")
    rl.settle(first, 250, 0.0, 2.0)  # it ended with 250 tokens in all
    second = rl.reserve("team", 600, 3.0)
    assert second is not None
    assert rl.totals(3.0)["team"][:2] == [2.0, 850.0]
    rl.settle(first, 999, 0.0, 4.0)  # settled once only
    assert rl.totals(4.0)["team"][1] == 850.0


def test_a_request_larger_than_the_limit_is_refused_without_retry_after() -> None:
    rl = limits(tokens=1000)
    with pytest.raises(RateLimited) as refused:
        rl.reserve("team", 1500, 0.0)
    assert "too large" in refused.value.message
    assert refused.value.retry_after_s is None
    assert "retry-after" not in dict(refused.value.extra_headers)


def test_a_request_given_back_frees_its_reservation() -> None:
    rl = limits(requests=1, tokens=100)
    held = rl.reserve("team", 100, 0.0)
    rl.release(held, 1.0)
    assert rl.reserve("team", 100, 2.0) is not None
    rl.release(held, 3.0)  # given back once only
    with pytest.raises(RateLimited):
        rl.reserve("team", 1, 4.0)


def test_a_settlement_after_its_bucket_left_the_window_counts_its_excess_now() -> None:
    rl = limits(tokens=10_000)
    held = rl.reserve("team", 100, 0.0)
    rl.settle(held, 3000, 0.0, 150.0)  # a long stream ran past its reservation
    assert rl.totals(150.0)["team"][1] == pytest.approx(2900.0)


def test_gpu_seconds_are_priced_before_routing_at_the_tenants_recent_rate() -> None:
    rl = limits(gpu_seconds=10.0)
    first = rl.reserve("team", 1000, 0.0)
    assert first is not None and first.amounts[2] == 0.0  # nothing learned yet
    rl.priced(first, 4.0, 0.1)  # at the replica it was routed to
    rl.settle(first, 1000, 5.0, 1.0)  # 5 ms a token
    second = rl.reserve("team", 1000, 2.0)
    assert second is not None and second.amounts[2] == pytest.approx(5.0)
    with pytest.raises(RateLimited) as refused:
        rl.reserve("team", 1000, 3.0)  # 5 + 5 + 5 > 10
    assert refused.value.header == ("x-error-gpu-seconds-exceeded", "true")


def test_the_other_gateways_usage_counts_while_shared() -> None:
    rl = limits(tokens=1000)
    rl.set_shared({"team": [3.0, 900.0, 0.0]}, gateways=3)
    with pytest.raises(RateLimited):
        rl.reserve("team", 200, 0.0)
    assert rl.reserve("team", 100, 0.0) is not None
    headers = dict(rl.headers("team", 0.5))
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    # Its own reservation (bucket 0) leaves at 61 s; the others' usage within a window.
    assert headers["x-ratelimit-reset-tokens"] == "1m0.5s"


def test_without_the_shared_view_each_gateway_holds_its_share() -> None:
    rl = limits(tokens=900)
    rl.set_shared({}, gateways=3)
    rl.set_local()  # Redis went away: a third of the limit here
    assert rl.reserve("team", 300, 0.0) is not None
    with pytest.raises(RateLimited) as refused:
        rl.reserve("team", 1, 0.0)
    assert "share: 1/3" in refused.value.message
    assert dict(rl.headers("team", 0.0))["x-ratelimit-limit-tokens"] == "300"


def test_peers_usage_for_tenants_not_limited_here_is_ignored() -> None:
    rl = limits(tokens=10)
    rl.set_shared({"stranger": [1.0, 1e9, 0.0], "team": [1.0, float("nan"), 0.0]}, gateways=2)
    assert rl.reserve("team", 10, 0.0) is not None


def test_idle_tenants_are_forgotten() -> None:
    rl = RateLimits(LimitTable(every=Limit(requests=5)), max_tenants=10)
    for i in range(100):
        rl.reserve(f"t{i}", 0, float(i))
    # Only the tenants with usage in the window (61 buckets: 39 s to 99 s) are kept.
    assert sorted(rl.totals(99.0), key=lambda t: int(t[1:])) == [f"t{i}" for i in range(39, 100)]
    assert rl.totals(200.0) == {}


def test_headers_for_each_kind_limited() -> None:
    rl = limits(requests=10, tokens=1000, gpu_seconds=2.5)
    rl.reserve("team", 120, 0.0)
    headers = dict(rl.headers("team", 0.25))
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert headers["x-ratelimit-remaining-tokens"] == "880"
    assert headers["x-ratelimit-limit-gpu-seconds"] == "2.5"
    assert headers["x-ratelimit-reset-tokens"] == "1m0.75s"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0004, "0s"), (0.012, "12ms"), (1.5, "1.5s"), (60, "1m0s"), (61.25, "1m1.25s")],
)
def test_durations_read_as_go_writes_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


def test_no_window_ever_serves_more_than_the_limit_to_a_tenant_at_three_times_it() -> None:
    """A tenant offering 3x its token limit, answers shorter than `max_tokens`: what was served
    in every window (by the second) stays within the limit."""
    rng = random.Random(3)
    limit = 6000.0
    rl = limits(tokens=limit)
    served: list[tuple[float, int]] = []  # (start, tokens) of each admitted request
    ending: list[tuple[float, object, int]] = []
    t = 0.0
    while t < 300.0:
        t += rng.expovariate(3 * limit / 60 / 150)  # 150 tokens a request on average
        for item in [e for e in ending if e[0] <= t]:
            ending.remove(item)
            end, held, tokens = item
            rl.settle(held, tokens, 0.0, end)  # type: ignore[arg-type]
        try:
            held = rl.reserve("team", 200, t)
        except RateLimited:
            continue
        tokens = 50 + rng.randrange(151)  # the engine stopped before max_tokens
        served.append((t, tokens))
        ending.append((t + rng.uniform(0.5, 5.0), held, tokens))
    assert len(served) > 100
    windows = [sum(n for s, n in served if start <= s < start + 60.0) for start in range(0, 240)]
    assert max(windows) <= limit
    assert sum(windows[-60:]) / 60 >= 0.9 * limit  # and the limit is used, not starved


def test_usage_beyond_the_reservation_counts_from_when_it_was_used() -> None:
    rl = limits(tokens=1000)
    held = rl.reserve("team", 100, 0.5)  # no max_tokens: its prediction
    rl.settle(held, 900, 0.0, 59.5)  # a long answer
    with pytest.raises(RateLimited):  # the 800 beyond counts a window from 59.5 s
        rl.reserve("team", 900, 61.5)
    assert rl.reserve("team", 900, 121.0) is not None


def test_a_share_smaller_than_one_request_serves_one_at_a_time() -> None:
    rl = limits(requests=2)
    rl.set_shared({}, gateways=3)
    rl.set_local()  # a third of 2 requests here: one at a time, not none
    assert rl.reserve("team", 0, 0.0) is not None
    with pytest.raises(RateLimited) as refused:
        rl.reserve("team", 0, 1.0)
    assert refused.value.retry_after_s is not None  # it will fit again: not "too large"


def test_a_handed_settlement_refunds_only_what_a_live_reservation_could_hold() -> None:
    rl = limits(tokens=1000)
    rl.reserve("team", 1000, 100.0)
    bucket = 100
    rl.settle_handed("team", bucket + 10**9, [1, 1e12, 0], 0, 0.0, 100.5)  # a future bucket
    rl.settle_handed("team", bucket - 1000, [1, 1e12, 0], 0, 0.0, 100.5)  # long gone
    assert rl.totals(100.5)["team"][1] == 1000.0
    rl.settle_handed("team", bucket, [1, 1e12, 0], 0, 0.0, 100.5)  # at most the limit back
    assert rl.totals(100.5)["team"][1] == 0.0


def test_a_restart_carries_over_what_the_previous_process_published() -> None:
    rl = limits(tokens=1000)
    rl.carry_over({"team": [3.0, 900.0, 0.0], "stranger": [1.0, 5.0, 0.0]}, 10.0)
    assert rl.totals(10.0) == {"team": [3.0, 900.0, 0.0]}
    with pytest.raises(RateLimited):
        rl.reserve("team", 200, 11.0)
