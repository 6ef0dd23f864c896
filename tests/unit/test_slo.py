"""SLO routing in the core: output prediction, profile fit, load accounting, the three
strategies and the gateway queue, with a hand-driven clock and no sockets."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from scipy import stats

from plugin.adapters.http import queue_families
from plugin.core.capacity import CapacityEstimator
from plugin.core.latency import Felt
from plugin.core.pool import PodPool
from plugin.core.profile import GpuProfile, ProfileBook, parse_profile, profile_key
from plugin.core.request import parse_request
from plugin.core.router import WAIT_BUCKETS_S, Decision, Router, Waiter, WaitStats
from plugin.core.selector import parse_selector
from plugin.core.strategies import OutputHistory, SloSettings, Strategy, build_strategies
from plugin.core.strategies.slo import burst_room, fit, poisson_quantile
from plugin.core.types import Candidate, Pod, RequestInfo, SloTarget
from plugin.errors import QueueFull, RoutingFailed, ShuttingDown
from tests.helpers import chat_body, make_pod

pytestmark = pytest.mark.unit  # the metrics test renders text, no sockets

MODEL = "m"
SLO_STRATEGIES = ("slo", "slo-least-load-pulling", "slo-least-load", "slo-pack-load")
AIBRIX_A100 = "simulator-llama2-7b-a100.json"  # in the shared data's aibrix-profiles


@dataclass
class Clock:
    t: float = 100.0

    def __call__(self) -> float:
        return self.t


def grid_profile(
    gpu: str, tput: float, e2e: float, slo_e2e: float = 5.0, percentile: int = 0
) -> GpuProfile:
    """Outputs 4 and 512 tokens, input 128; the 512-token cell never meets the SLO. Checked at
    the mean by default, so a pod is full at 1.0 (`burst_room` widens that for percentiles)."""
    return GpuProfile(
        gpu,
        1.0,
        (4, 512),
        (128,),
        ((tput,), (0.0,)),
        0.0,
        ((e2e,), (e2e * 10,)),
        ((e2e / 10,), (e2e,)),  # TTFT
        percentile=percentile,
        slos={"e2e": slo_e2e},
    )


def pod(name: str, deployment: str | None, model: str = MODEL) -> Pod:
    return make_pod(
        name,
        model=model,
        port=8000 + len(name),
        metrics_port=8000,
        labels={"gpu": deployment or ""},
        deployment=deployment,
    )


def setup(
    *pods: Pod,
    default: str = "least-request",
    max_wait_s: float = 30.0,
    profiles: Mapping[str, GpuProfile] | None = None,
) -> tuple[Router, PodPool, Clock, ProfileBook]:
    """A router over `pods` with the profiles `fast` and `slow` of `grid_profile`, or with
    `profiles` (by profile key) instead."""
    clock = Clock()
    pool = PodPool(CapacityEstimator())
    book = ProfileBook()
    book.replace(
        {
            profile_key(MODEL, "fast"): grid_profile("fast", tput=10.0, e2e=1.0),  # 0.1 each
            profile_key(MODEL, "slow"): grid_profile("slow", tput=2.0, e2e=1.0),  # 0.5 each
        }
        if profiles is None
        else profiles
    )
    pool.use_profiles(book)
    pool.set_pods(pods)
    strategies = build_strategies(SloSettings(max_wait_s=max_wait_s))
    router = Router(pool, strategies, default, random.Random(0), clock)
    return router, pool, clock, book


def req(clock: Clock, **kw: object) -> RequestInfo:
    base: dict[str, object] = {"prompt_tokens": 128, "max_tokens": 4, "arrived_at": clock.t}
    return RequestInfo(MODEL, **(base | kw))  # type: ignore[arg-type]


def strategy(router: Router, name: str) -> Strategy:
    return router.strategy_for(name)


def routed_once(
    router: Router, clock: Clock, name: str, path: str, waited: float = 0.0, **kw: object
) -> str:
    """The pod `name` routes a request to (`kw`: the request's fields; `waited`: seconds since
    it arrived), through the view or, with `path` "list", the list path (a pod selector); its
    lease released at once."""
    request = req(clock, arrived_at=clock.t - waited, **kw)
    if path == "list":
        request = dataclasses.replace(request, pod_selector=parse_selector("gpu"))
    decision = router.admit(request, strategy(router, name))
    assert isinstance(decision, Decision)
    decision.lease.release()
    return decision.lease.pod.key


def test_history_predicts_the_modal_output_bucket_of_the_same_input_size() -> None:
    h = OutputHistory(window_s=240.0)
    assert h.predict(MODEL, 100, 0.0) is None
    for out in (60, 64, 70, 500):  # buckets 6, 6, 6, 9
        h.record(MODEL, 128, out, 0.0)
    h.record(MODEL, 4000, 8, 0.0)
    assert h.predict(MODEL, 120, 1.0) == 64
    assert h.predict(MODEL, 4096, 1.0) == 8
    assert h.predict(MODEL, 16, 1.0) == 64  # no such input size: all of them
    h.record(MODEL, 128, 500, 10.0)
    h.record(MODEL, 128, 510, 10.0)
    h.record(MODEL, 128, 520, 10.0)
    assert h.predict(MODEL, 128, 11.0) == 512  # 4 of bucket 9 against 3 of bucket 6
    assert h.predict(MODEL, 128, 245.0) == 512  # the t=0 ones left the window
    assert h.predict(MODEL, 128, 260.0) is None


def test_fit_consumption_and_slack() -> None:
    c = Candidate(pod("a", "fast"), 0, None, None, None)
    profile = grid_profile("fast", tput=10.0, e2e=0.5)
    f = fit(c, profile, RequestInfo(MODEL, prompt_tokens=128), 4)
    assert f.consumption == pytest.approx(0.2) and f.slack_s == 4.5
    never = fit(c, profile, RequestInfo(MODEL, prompt_tokens=128), 512)
    assert never.consumption == float("inf")
    # Sizes outside the grid take its edge: below it the smallest cell, above it the border
    # cell, marked as a guess on that axis.
    small = fit(c, profile, RequestInfo(MODEL, prompt_tokens=3), 1)
    assert (small.cell, small.above) == ((0, 0), ()) and small.consumption == pytest.approx(0.2)
    big = fit(c, profile, RequestInfo(MODEL, prompt_tokens=100_000), 4)
    assert (big.cell, big.above) == ((0, 0), ("input",))
    assert big.consumption == pytest.approx(0.2)

    # The request's own target wins over the profile's: waiting does not change TPOT, so a TPOT
    # the profile meets (0.5 s / 4 tokens) leaves only the gateway's bound, one it misses none.
    def slack(target: SloTarget) -> float:
        return fit(c, profile, RequestInfo(MODEL, prompt_tokens=128, slo=target), 4).slack_s

    assert slack(SloTarget(tpot_s=0.2)) == float("inf")
    assert slack(SloTarget(tpot_s=0.1)) == float("-inf")
    assert slack(SloTarget(ttft_s=0.3)) == pytest.approx(0.3 - 0.05)  # the profile's TTFT grid
    tpat = GpuProfile("t", 1.0, (4,), (128,), ((10.0,),), 0.0, ((0.5,),), slos={"tpat": 0.01})
    f = fit(c, tpat, RequestInfo(MODEL, prompt_tokens=128), 4)
    assert f.slack_s == pytest.approx((0.01 - 0.5 / 132) * 132)

    # A profile built for several SLOs: the request may wait only while all hold. TPOT (met, and
    # waiting does not change it) would allow any wait; the TTFT left (0.3 - 0.05) decides.
    both = dataclasses.replace(profile, slos={"tpot": 0.2, "ttft": 0.3})
    f = fit(c, both, RequestInfo(MODEL, prompt_tokens=128), 4)
    assert f.slack_s == pytest.approx(0.25)


def test_a_long_prompt_takes_what_it_costs_in_a_mix_not_what_its_size_sustains_alone() -> None:
    # 4096-token prompts sustain 0.5 req/s alone (collisions) but count as two 2048s inside
    # a mix: 2 req/s, so a request of them takes 1 / (2 x 1 s) of the pod, not 1 / 0.5.
    c = Candidate(pod("a", "fast"), 0, None, None, None)
    profile = GpuProfile(
        "fast", 1.0, (64,), (2048, 4096), ((4.0, 0.5),), 0.0, ((0.5, 1.0),), ((0.2, 0.4),)
    )
    long = fit(c, profile, RequestInfo(MODEL, prompt_tokens=4096), 64)
    assert long.consumption == pytest.approx(0.5)
    # So an a100 serving one long prompt still has room for another next to it.
    router, pool, clock, _ = setup(pod("a", "fast"), profiles={profile_key(MODEL, "fast"): profile})
    slo = strategy(router, "slo")
    routes = [router.admit(req(clock, prompt_tokens=4096, max_tokens=64), slo) for _ in range(2)]
    assert all(isinstance(r, Decision) for r in routes)
    assert pool.load("ns/a") == pytest.approx(1.0)
    # A third finds the pod full and waits (charged by its size alone, so would the second).
    assert isinstance(router.admit(req(clock, prompt_tokens=4096, max_tokens=64), slo), Waiter)


def long_and_short_profile(percentile: int = 99, long_ttft: float = 0.4) -> GpuProfile:
    """Inputs 64 and 4096, 32 tokens out: a short request takes 1 / (20 x 0.35) of the pod, a
    long one 1 / (1 x 1.25) = 0.8 (TTFT 1 s at p99; a long prompt's TTFT `long_ttft`)."""
    return GpuProfile(
        "fast",
        1.0,
        (32,),
        (64, 4096),
        ((20.0, 1.0),),
        0.0,
        ((0.35, 1.25),),
        ((0.05, long_ttft),),
        percentile=percentile,
        slos={"ttft": 1.0},
    )


def test_a_streaming_request_takes_what_the_same_answer_to_a_short_prompt_does() -> None:
    c = Candidate(pod("a", "fast"), 0, None, None, None)
    profile = long_and_short_profile()
    long = fit(c, profile, RequestInfo(MODEL, prompt_tokens=4096), 32)
    short = fit(c, profile, RequestInfo(MODEL, prompt_tokens=64), 32)
    assert long.consumption == pytest.approx(0.8)
    assert long.streaming == pytest.approx(1 / 7) == short.consumption == short.streaming
    router, _, clock, _ = setup(pod("a", "fast"), profiles={profile_key(MODEL, "fast"): profile})
    for name in SLO_STRATEGIES:
        routed = router.admit(req(clock, prompt_tokens=4096, max_tokens=32), strategy(router, name))
        assert isinstance(routed, Decision)
        assert routed.lease.load == pytest.approx(0.8)
        # Packing keeps the whole share: room is how full it packs a pod, and a pod packed by
        # shrunk shares collides more long prompts than its profile was measured with.
        kept = 0.8 if name == "slo-pack-load" else 1 / 7
        assert routed.lease.streaming_load == pytest.approx(kept), name
        routed.lease.release()
    routed = router.admit(req(clock, prompt_tokens=64, max_tokens=32), strategy(router, "slo"))
    assert isinstance(routed, Decision)
    assert routed.lease.streaming_load == routed.lease.load  # nothing to give back


def test_a_request_held_behind_a_long_prompt_goes_once_that_prompt_is_prefilled() -> None:
    """The engine would queue the second long prompt behind the first one's prefill only; the
    gateway holds it that long too, not until the first answer ends. (Checked at the mean, the
    profile leaves no room for a burst: `burst_room`.)"""
    profile = long_and_short_profile(percentile=0)
    router, pool, clock, _ = setup(pod("a", "fast"), profiles={profile_key(MODEL, "fast"): profile})
    slo = strategy(router, "slo")
    first = router.admit(req(clock, prompt_tokens=4096, max_tokens=32), slo)
    assert isinstance(first, Decision)
    held = router.admit(req(clock, prompt_tokens=4096, max_tokens=32), slo)
    assert isinstance(held, Waiter)  # 0.8 + 0.8: no room while the first one prefills
    clock.t += 0.4
    first.lease.streaming()  # its first chunk: the held one takes the room it left
    assert held.done
    second = held.result()
    assert second.lease.pod.key == "ns/a"
    assert pool.load("ns/a") == pytest.approx(1 / 7 + 0.8)
    first.lease.streaming()  # once only
    assert pool.load("ns/a") == pytest.approx(1 / 7 + 0.8)
    first.lease.release()
    second.lease.release()
    second.lease.streaming()  # after the release: nothing
    assert pool.load("ns/a") == 0.0 and pool.inflight("ns/a") == 0


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("mean", [0.2, 0.5, 1.0, 1.25, 7.0, 10.0, 49.0, 50.0, 80.0, 400.0, 5000.0])
def test_the_burst_a_profile_went_through_is_scipy_s_poisson_quantile(
    mean: float, p: float
) -> None:
    assert poisson_quantile(mean, p) == stats.poisson.ppf(p, mean)


def test_burst_room_counts_the_cell_alone_in_shares_and_keeps_the_mean_for_mean_profiles() -> None:
    c = Candidate(pod("a", "fast"), 0, None, None, None)
    # The long cell alone: 1 req/s x 1.25 s in flight; p99 of Poisson(1.25) is 4 of 0.8 each.
    # (A long prompt's TTFT of 0.2 s lets 5 prefill within 1 s: the count binds.)
    long = fit(c, long_and_short_profile(99, 0.2), RequestInfo(MODEL, prompt_tokens=4096), 32)
    assert burst_room(long) == pytest.approx(3.2)
    mean = fit(c, long_and_short_profile(0), RequestInfo(MODEL, prompt_tokens=4096), 32)
    assert mean.consumption == long.consumption and burst_room(mean) == 1.0
    # A cell priced by the mix (5 req/s, from the smaller prompt's 20 / 4) keeps the burst its
    # own stream went through (0.5 x 1 s in flight: 3 at p99, 0.6 shares): never below 1.0.
    profile = GpuProfile(
        "fast", 1.0, (32,), (1024, 4096), ((20.0, 0.5),), 0.0, ((1.0, 1.0),), percentile=99
    )
    mixed = fit(c, profile, RequestInfo(MODEL, prompt_tokens=4096), 32)
    assert mixed.consumption == pytest.approx(0.2) and burst_room(mixed) == 1.0


def test_a_pod_below_its_mean_comes_before_a_less_loaded_one_only_within_its_burst() -> None:
    """Burst room replaces holding, not the pick: a pod with room below its mean occupancy
    takes the request even where another, less loaded, would take it only as a burst."""
    fast = long_and_short_profile(99, long_ttft=0.2)  # a long prompt: 0.8 of the pod
    other = dataclasses.replace(fast, gpu="other", e2e=((0.35, 1 / 0.6),))  # 0.6 of it
    a, b = pod("a", "fast"), pod("b", "other")
    router, pool, clock, _ = setup(
        a, b, profiles={profile_key(MODEL, "fast"): fast, profile_key(MODEL, "other"): other}
    )
    pool.acquire(a, load=0.3)  # 0.3 + 0.8 > 1: room only as a burst (3.2)
    pool.acquire(b, load=0.35)  # 0.35 + 0.6 <= 1: room below the mean
    for name in ("slo", "slo-least-load-pulling"):
        routed = router.admit(req(clock, prompt_tokens=4096, max_tokens=32), strategy(router, name))
        assert isinstance(routed, Decision) and routed.lease.pod.key == "ns/b", name
        routed.lease.release()


def test_a_burst_is_at_most_what_prefills_one_after_another_within_the_ttft() -> None:
    """A p99 profile whose long cell had 3.6 in flight on average (1 req/s x 3.6 s) went
    through bursts of 9 (the Poisson quantile); routed together they prefill one after another,
    and at 0.4 s each only 2 make a 1 s TTFT: the burst is 2 of them (2 x 1/3.6 shares: still
    the mean, 1.0)."""
    c = Candidate(pod("a", "fast"), 0, None, None, None)
    profile = dataclasses.replace(
        long_and_short_profile(99), e2e=((0.35, 3.6),), ttft=((0.05, 0.4),)
    )
    long = fit(c, profile, RequestInfo(MODEL, prompt_tokens=4096), 32)
    assert poisson_quantile(3.6, 0.99) == 9
    assert long.consumption == pytest.approx(1 / 3.6) and burst_room(long) == 1.0
    slow = dataclasses.replace(profile, ttft=((0.05, 0.6),))  # one at a time within 1 s
    assert burst_room(fit(c, slow, RequestInfo(MODEL, prompt_tokens=4096), 32)) == 1.0
    tight = long_and_short_profile(99, long_ttft=0.3)  # 3 prefill within 1 s
    assert burst_room(fit(c, tight, RequestInfo(MODEL, prompt_tokens=4096), 32)) == pytest.approx(
        2.4
    )


def test_pulling_routes_the_burst_a_p99_profile_absorbed_and_packing_does_not() -> None:
    """At 1 long prompt a second on average (m = 1.25 in flight), a Poisson stream has 4 in
    flight 1% of the time, and the profile met its p99 TTFT through that: `slo` routes 4 at
    once (3.2 shares) and holds the fifth, if 4 prefill within the TTFT one after another (at
    0.4 s each, 2 do). Checked at the mean it holds the second."""
    for percentile, long_ttft, routed in ((99, 0.2, 4), (90, 0.2, 3), (99, 0.4, 2), (0, 0.2, 1)):
        profile = long_and_short_profile(percentile, long_ttft)
        router, pool, clock, _ = setup(
            pod("a", "fast"), profiles={profile_key(MODEL, "fast"): profile}
        )
        slo = strategy(router, "slo")
        answers = [
            router.admit(req(clock, prompt_tokens=4096, max_tokens=32), slo) for _ in range(6)
        ]
        kinds = [type(a).__name__ for a in answers]
        assert kinds == ["Decision"] * routed + ["Waiter"] * (6 - routed), percentile
        assert pool.load("ns/a") == pytest.approx(0.8 * routed)
    # Packing keeps the mean as the pod's room: a second pod takes the second long prompt.
    profile = long_and_short_profile(99)
    router, pool, clock, _ = setup(
        pod("a", "fast"), pod("b", "fast"), profiles={profile_key(MODEL, "fast"): profile}
    )
    pack = strategy(router, "slo-pack-load")
    for _ in range(2):
        assert isinstance(
            router.admit(req(clock, prompt_tokens=4096, max_tokens=32), pack), Decision
        )
    assert (pool.inflight("ns/a"), pool.inflight("ns/b")) == (1, 1)


def test_pulling_fills_by_least_load_then_holds_then_wakes_on_release() -> None:
    router, pool, clock, _ = setup(pod("f", "fast"), pod("s", "slow"))
    slo = strategy(router, "slo")
    decisions = [router.admit(req(clock), slo) for _ in range(12)]
    assert all(isinstance(d, Decision) for d in decisions)
    assert (pool.inflight("ns/f"), pool.inflight("ns/s")) == (10, 2)
    assert pool.load("ns/f") == pytest.approx(1.0) and pool.load("ns/s") == pytest.approx(1.0)
    held = router.admit(req(clock), slo)
    assert isinstance(held, Waiter) and held.deadline == clock.t + 4.0  # 5 s target - 1 s
    first = decisions[0]
    assert isinstance(first, Decision)
    first.lease.release()  # room again: the held request takes it
    assert held.done
    granted = held.result()
    assert granted.lease.pod.key == first.lease.pod.key and router.waiting() == 0
    assert decisions[0].strategy == "slo"


def test_an_idle_pod_takes_a_request_whose_consumption_exceeds_one() -> None:
    """A profile whose best passing rate was low (tputs x e2e < 1) must not keep a request off
    an empty pod forever: an idle pod always has room, a busy one has none for it."""
    router, pool, clock, book = setup(pod("s", "slow"))
    low = dataclasses.replace(grid_profile("slow", tput=0.5, e2e=1.0), created=1.0)  # newer
    book.replace({profile_key(MODEL, "slow"): low})
    pool.profiles_changed()
    slo = strategy(router, "slo")
    first = router.admit(req(clock), slo)
    assert isinstance(first, Decision) and pool.load("ns/s") == pytest.approx(2.0)
    assert isinstance(router.admit(req(clock), slo), Waiter)


def test_a_held_request_is_rejected_when_its_slo_runs_out() -> None:
    router, _, clock, _ = setup(pod("s", "slow"), max_wait_s=2.0)
    slo = strategy(router, "slo-least-load-pulling")
    for _ in range(2):
        assert isinstance(router.admit(req(clock), slo), Decision)
    held = router.admit(req(clock), slo)
    assert isinstance(held, Waiter) and held.deadline == clock.t + 2.0  # max wait < slack
    clock.t += 2.0
    router.expire(held)
    with pytest.raises(RoutingFailed, match="can no longer be met"):
        held.result()
    late = req(clock, arrived_at=clock.t - 5.0)  # already waited longer than its slack
    with pytest.raises(RoutingFailed, match="can no longer be met"):
        router.admit(late, slo)
    # Both count as SLO outcomes of the model (no deployment served them).
    assert router.slo_outcomes.counts == {(MODEL, "", "rejected"): 2}


def test_served_requests_count_as_met_or_late_by_what_their_client_felt() -> None:
    router, _, clock, _ = setup(pod("f", "fast"))
    by_profile = router.admit(req(clock), strategy(router, "slo"))  # the profile's SLO
    own = router.admit(req(clock, slo=SloTarget(ttft_s=0.5)), strategy(router, "least-request"))
    plain = router.admit(req(clock), strategy(router, "least-request"))  # no SLO: not counted
    assert isinstance(by_profile, Decision) and by_profile.profiled is not None
    assert isinstance(own, Decision) and isinstance(plain, Decision)
    targets = SloTarget.from_slos(by_profile.profiled.profile.slos)
    assert targets.e2e_s is not None
    router.finished(by_profile, 200, Felt(0.1, 0.001, targets.e2e_s / 2, 20))
    router.finished(own, 200, Felt(0.6, 0.001, 1.0, 20))  # its own TTFT target: 0.5 s
    router.finished(plain, 200, Felt(9.0, 0.5, 30.0, 20))
    router.finished(own, 500, Felt(0.1, 0.001, 1.0, 20))  # an engine error is not an outcome
    # A target with no latency SLO in it (an older profile's empty `slos`) judges nothing.
    router.finished(dataclasses.replace(own, request=req(clock, slo=SloTarget())), 200, None)
    router.finished(
        dataclasses.replace(own, request=req(clock, slo=SloTarget())),
        200,
        Felt(99.0, 9.0, 99.0, 20),
    )
    deployment = by_profile.lease.pod.deployment
    assert router.slo_outcomes.counts == {
        (MODEL, deployment, "met"): 1,
        (MODEL, deployment, "late"): 1,
    }


def test_no_gpu_type_can_serve_the_size_is_rejected_at_once() -> None:
    router, _, clock, _ = setup(pod("f", "fast"), pod("s", "slow"))
    with pytest.raises(RoutingFailed, match="no GPU type"):
        router.admit(req(clock, max_tokens=500), strategy(router, "slo"))
    # Nor a TTFT target below what every GPU type's profile expects (0.1 s).
    with pytest.raises(RoutingFailed, match="no GPU type"):
        router.admit(req(clock, slo=SloTarget(ttft_s=0.05)), strategy(router, "slo-least-load"))


@pytest.mark.parametrize("other", ["never", "too-slow"])
@pytest.mark.parametrize("path", ["view", "list"])
def test_pulling_prefers_a_gpu_type_that_meets_the_slo_however_long_the_answer_runs(
    path: str, other: str
) -> None:
    """Both GPU types meet the SLO for the predicted 4-token answer and have room; only the
    fast one would for the 512 tokens `max_tokens` allows (the other never serves 512 tokens,
    or serves them 1 s past the 5 s E2E). `slo` routes to the fast one although the other pod
    is less loaded; with no longer cap, with room on the fast ones gone, or once the request
    has waited past what the fast one leaves at 512 tokens (1 s; so no type qualifies), the
    least loaded takes it again, never a hold. `slo-least-load` keeps the least loaded."""
    fast = GpuProfile(
        "fast", 1.0, (4, 512), (128,), ((10.0,), (1.0,)), 0.0,
        ((1.0,), (4.0,)), ((0.1,), (0.4,)), slos={"e2e": 5.0},
    )  # fmt: skip
    slow = grid_profile("slow", tput=2.0, e2e=1.0)  # never meets the SLO at 512 tokens
    if other == "too-slow":  # serves 512 tokens at some rate, but in 6 s
        slow = dataclasses.replace(slow, tputs=((2.0,), (1.0,)), e2e=((1.0,), (6.0,)))
    f, ff, s = pod("f", "fast"), pod("ff", "fast"), pod("s", "slow")
    router, pool, clock, _ = setup(
        f, ff, s, profiles={profile_key(MODEL, "fast"): fast, profile_key(MODEL, "slow"): slow}
    )
    for _ in range(3):
        router.completed(MODEL, 128, 4, 200)  # answers are short: the prediction is 4
    pool.acquire(f, load=0.5)
    pool.acquire(ff, load=0.7)

    def routed_to(name: str, max_tokens: int | None, waited: float = 0.0) -> str:
        return routed_once(router, clock, name, path, max_tokens=max_tokens, waited=waited)

    assert routed_to("slo", 512) == "ns/f"
    assert routed_to("slo-least-load-pulling", 512) == "ns/f"
    assert routed_to("slo", 512, waited=0.5) == "ns/f"  # 1 s left at 512 tokens
    assert routed_to("slo", 512, waited=1.5) == "ns/s"  # none left: the least loaded
    assert routed_to("slo", 4) == "ns/s"  # no answer longer than predicted
    assert routed_to("slo-least-load", 512) == "ns/s"
    pool.acquire(f, load=0.45)  # 0.95 + 0.1 > 1: the fast pods are full
    pool.acquire(ff, load=0.25)
    assert routed_to("slo", 512) == "ns/s"


def test_where_no_gpu_type_makes_the_longest_answer_the_pick_is_as_without_the_rule() -> None:
    """No type serves 512-token answers: the preference keeps every pod with room below its
    mean (b, c: the least loaded of them takes it), and does not hand the request to the burst
    room, where a pod past its mean but less loaded (a) would have won."""

    def with_long_answers(profile: GpuProfile, gpu: str) -> GpuProfile:
        (rates,), (e2e,), (ttft,) = profile.tputs, profile.e2e or (), profile.ttft or ()
        return dataclasses.replace(
            profile,
            gpu=gpu,
            out_ticks=(32, 512),
            tputs=(rates, (0.0, 0.0)),
            e2e=(e2e, (9.0, 9.0)),
            ttft=(ttft, ttft),
        )

    base = long_and_short_profile(99, long_ttft=0.2)  # a long prompt: 0.8 of a pod
    lighter = dataclasses.replace(base, e2e=((0.35, 1 / 0.6),))  # a long prompt: 0.6 of it
    profiles = {
        profile_key(MODEL, "fast"): with_long_answers(base, "fast"),
        profile_key(MODEL, "b"): with_long_answers(lighter, "b"),
        profile_key(MODEL, "c"): with_long_answers(lighter, "c"),
    }
    a, b, c = pod("a", "fast"), pod("b", "b"), pod("c", "c")
    router, pool, clock, _ = setup(a, b, c, profiles=profiles)
    for _ in range(3):
        router.completed(MODEL, 4096, 32, 200)  # the prediction is 32
    pool.acquire(a, load=0.3)  # 0.3 + 0.8 > 1: room only as a burst (3.2)
    pool.acquire(b, load=0.35)  # 0.35 + 0.6 <= 1: room below the mean
    pool.acquire(c, load=0.38)
    routed = router.admit(req(clock, prompt_tokens=4096, max_tokens=512), strategy(router, "slo"))
    assert isinstance(routed, Decision) and routed.lease.pod.key == "ns/b"


@pytest.mark.parametrize("path", ["view", "list"])
def test_pulling_prefers_a_gpu_type_with_no_prefill_in_the_way(path: str) -> None:
    """A 640-token prompt routed to the fast pod takes 5 s to prefill there (its profile
    prefills 128 tokens in 1 s, its E2E at the request's cell); the next request, with about
    4 s of slack on the fast type, goes to the slow one although the fast pod is less loaded,
    and goes back once the queue has run down below its slack. `slo-least-load` keeps the
    least loaded; with no pod of another type with room the pick is as without the rule."""
    f, s = pod("f", "fast"), pod("s", "slow")
    router, pool, clock, _ = setup(f, s)
    pool.acquire(s, load=0.3)

    def routed_to(name: str, prompt_tokens: int = 128, waited: float = 0.0) -> str:
        return routed_once(router, clock, name, path, prompt_tokens=prompt_tokens, waited=waited)

    # Each routed prompt queues its tokens at 128 a second on its pod; the slack of a request
    # is the 5 s E2E SLO less its 1 s E2E.
    assert routed_to("slo") == "ns/f"  # nothing queued: the least loaded (f: 1 s queued)
    assert routed_to("slo", prompt_tokens=640) == "ns/f"  # f: 6 s
    assert routed_to("slo") == "ns/s"  # 6 s > 4 s on f (s: 1 s)
    assert routed_to("slo-least-load-pulling") == "ns/s"  # (s: 2 s)
    assert routed_to("slo-least-load") == "ns/f"  # (f: 7 s)
    clock.t += 0.5  # f: 6.5 s left

    def queued() -> tuple[float, float]:  # as /debug/pods shows the queues
        pods = pool.snapshot(clock.t)["pods"]
        return pods["ns/f"]["prefill_queue_s"], pods["ns/s"]["prefill_queue_s"]

    assert queued() == pytest.approx((6.5, 1.5))
    assert routed_to("slo") == "ns/s"  # (s: 2.5 s left)
    clock.t += 3.0  # f: 3.5 s left, within the slack
    assert routed_to("slo", waited=1.0) == "ns/s"  # but not within what a wait left (s: 1 s)
    assert routed_to("slo") == "ns/f"  # (f: 4.5 s)
    assert routed_to("slo", prompt_tokens=640) == "ns/s"  # f: 4.5 s > 4 s (s: 6 s)
    assert routed_to("slo") == "ns/f"  # s: 6 s, f: 4.5 s: neither clear, the least loaded
    pool.acquire(s, load=0.65)  # 0.95 + 0.5 > 1: no room on the slow pod
    clock.t += 10.0
    assert queued() == (0.0, 0.0)  # both queues ran down
    assert routed_to("slo", prompt_tokens=640) == "ns/f"  # f: 5 s
    assert routed_to("slo") == "ns/f"  # past its slack, but the only pod with room


def test_a_profile_s_prefill_speed_is_read_off_its_shortest_answers() -> None:
    """The largest prompt's extra tokens over the smallest one's, over the extra seconds of the
    first output row (what both answers' decode steps take cancels out), from the idle E2E where
    measured, else the E2E at the cell's rate, else the TTFT; at least the plain tokens over
    seconds; None without any time."""
    base = long_and_short_profile()
    assert base.in_ticks == (64, 4096) and base.e2e == ((0.35, 1.25),)
    assert base.prefill_tokens_per_s == pytest.approx(4032 / 0.9)  # not 4096 / 1.25
    idle = dataclasses.replace(base, e2e_idle=((0.1, 0.5),))
    assert idle.prefill_tokens_per_s == pytest.approx(4032 / 0.4)
    only_ttft = dataclasses.replace(base, e2e=None, ttft=((0.05, 0.25),))
    assert only_ttft.prefill_tokens_per_s == pytest.approx(4032 / 0.2)
    # A slope below the plain ratio (times at noise level) does not undercut it.
    noisy = dataclasses.replace(base, e2e_idle=((0.001, 1.0),))
    assert noisy.prefill_tokens_per_s == pytest.approx(64 / 0.001)
    one_size = dataclasses.replace(base, e2e_idle=((math.nan, 0.5),))
    assert one_size.prefill_tokens_per_s == pytest.approx(4096 / 0.5)
    assert dataclasses.replace(base, e2e=None, ttft=None).prefill_tokens_per_s is None


def test_a_profile_s_decode_speed_and_slo_batch_come_from_its_shortest_prompts() -> None:
    """Decode speed: the best rate x answer length at the shortest prompt; the SLO batch:
    Little's law at its longest answers (rate x mean E2E)."""
    profile = GpuProfile(
        "fast",
        1.0,
        (32, 512),
        (64, 4096),
        ((20.0, 1.0), (3.0, 0.2)),
        0.0,
        ((0.35, 1.25), (9.0, 12.0)),
        slos={"tpot": 0.05},
    )
    assert profile.decode_tokens_per_s == pytest.approx(3.0 * 512)  # not 20 x 32
    assert profile.slo_batch == 27  # 3 req/s x 9 s
    never = dataclasses.replace(profile, tputs=((20.0, 1.0), (0.0, 0.0)))
    assert never.slo_batch == 7  # the longest answers with a rate: 20 x 0.35
    assert dataclasses.replace(profile, e2e=None).slo_batch is None
    assert dataclasses.replace(profile, tputs=((0.0, 1.0), (0.0, 0.2))).decode_tokens_per_s is None


def test_history_drives_the_cell() -> None:
    router, _, clock, _ = setup(pod("f", "fast"))
    for _ in range(3):
        router.completed(MODEL, 128, 500, 200)  # this model answers long
    with pytest.raises(RoutingFailed, match="no GPU type"):
        router.admit(req(clock, max_tokens=None), strategy(router, "slo"))
    # max_tokens caps the prediction: a short request still fits.
    assert isinstance(router.admit(req(clock, max_tokens=4), strategy(router, "slo")), Decision)
    router.completed(MODEL, 128, 900, 503)  # failures teach nothing
    router.completed(MODEL, 128, 0, 200)


def test_least_load_ignores_room_and_pack_load_fills_the_fullest() -> None:
    router, pool, clock, _ = setup(pod("f", "fast"), pod("s", "slow"))
    least, pack = strategy(router, "slo-least-load"), strategy(router, "slo-pack-load")
    first = router.admit(req(clock), pack)
    assert isinstance(first, Decision)
    busy = first.lease.pod.key
    second = router.admit(req(clock), pack)
    assert isinstance(second, Decision) and second.lease.pod.key == busy  # the fullest with room
    for _ in range(20):
        assert isinstance(router.admit(req(clock), least), Decision)  # room never holds it
    assert pool.load("ns/f") > 1.0 or pool.load("ns/s") > 1.0


def test_pack_load_fills_the_gpu_type_cheapest_per_request_first() -> None:
    # Slow pods take 0.5 of a pod a request (2 req/s at cost 1), the fast one 0.1 (10 req/s).
    router, pool, clock, _ = setup(pod("s1", "slow"), pod("s2", "slow"), pod("f", "fast"))
    pack, least = strategy(router, "slo-pack-load"), strategy(router, "slo-least-load")
    while pool.load("ns/s1") == 0:  # a slow pod busier than the fast one
        assert isinstance(router.admit(req(clock), least), Decision)
    assert pool.load("ns/s1") > pool.load("ns/f")
    # The fast pod first, until it has no room, then the fullest slow pod with room.
    keys: list[str] = []
    while not keys or keys[-1] == "ns/f":
        decision = router.admit(req(clock), pack)
        assert isinstance(decision, Decision)
        keys.append(decision.lease.pod.key)
    assert len(keys) > 1 and pool.load("ns/f") == pytest.approx(1.0)
    # Priced per replica, the slow type can be the cheaper per request: then it packs first.
    pricey = dataclasses.replace(grid_profile("fast", tput=10.0, e2e=1.0), cost=10.0)
    router, _, clock, _ = setup(
        pod("s", "slow"),
        pod("f", "fast"),
        profiles={
            profile_key(MODEL, "fast"): pricey,
            profile_key(MODEL, "slow"): grid_profile("slow", tput=2.0, e2e=1.0),
        },
    )
    pack = strategy(router, "slo-pack-load")
    picks = [router.admit(req(clock), pack) for _ in range(3)]
    assert [d.lease.pod.key for d in picks if isinstance(d, Decision)] == ["ns/s", "ns/s", "ns/f"]


def test_the_most_urgent_waiter_goes_first() -> None:
    router, _, clock, _ = setup(pod("s", "slow"))
    slo = strategy(router, "slo")
    leases = [router.admit(req(clock), slo) for _ in range(2)]
    relaxed = router.admit(req(clock), slo)
    urgent = router.admit(req(clock, slo=SloTarget(ttft_s=0.3)), slo)  # slack 0.3 - 0.1
    assert isinstance(relaxed, Waiter) and isinstance(urgent, Waiter)
    first = leases[0]
    assert isinstance(first, Decision)
    first.lease.release()
    assert urgent.done and not relaxed.done


def test_a_model_without_profiles_uses_the_default_strategy() -> None:
    router, pool, clock, _ = setup(pod("a", None), pod("bb", None), default="round-robin")
    picks = []
    for _ in range(4):
        d = router.admit(req(clock), strategy(router, "slo"))
        assert isinstance(d, Decision) and d.strategy == "slo"  # the client's name echoed
        picks.append(d.lease.pod.name)
    assert picks == ["a", "bb", "a", "bb"]  # round-robin's turn, not least-load's
    assert pool.load("ns/a") == 0.0


def test_released_load_returns_to_zero() -> None:
    router, pool, clock, _ = setup(pod("f", "fast"))
    ds = [router.admit(req(clock), strategy(router, "slo")) for _ in range(7)]
    for d in ds:
        assert isinstance(d, Decision)
        d.lease.release()
    assert pool.load("ns/f") == 0.0
    (candidate,) = pool.candidates(MODEL, clock.t)
    assert candidate.load == 0.0 and candidate.profile is not None


def test_the_queue_is_bounded_per_model_and_drains_with_an_answer() -> None:
    router, _, clock, _ = setup(pod("s", "slow"))
    router.max_waiting = 2
    slo = strategy(router, "slo")
    for _ in range(2):
        assert isinstance(router.admit(req(clock), slo), Decision)
    held = [router.admit(req(clock), slo) for _ in range(2)]
    assert all(isinstance(w, Waiter) for w in held)
    with pytest.raises(QueueFull):
        router.admit(req(clock), slo)
    clock.t += 0.3
    assert router.reject_waiting(ShuttingDown("bye")) == 2 and router.waiting() == 0
    for w in held:
        assert isinstance(w, Waiter)
        with pytest.raises(ShuttingDown):
            w.result()
    waits = router.waits  # the queue-full request never waited: not in the histogram
    rejected = waits.by_outcome[False]
    assert (waits.by_outcome[True].count, rejected.count) == (0, 2)
    assert rejected.total == pytest.approx(0.6)
    assert rejected.cumulative()[WAIT_BUCKETS_S.index(0.5)] == 2  # cumulative buckets
    assert rejected.cumulative()[WAIT_BUCKETS_S.index(0.25)] == 0


def test_queue_metrics_are_valid_prometheus_histograms() -> None:
    waits = WaitStats()
    waits.observe(0.03, routed=True)
    waits.observe(7.0, routed=False)

    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            return queue_families(waits)

    registry = CollectorRegistry()
    registry.register(One())
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in families["hetero_gateway_wait_seconds"].samples
    }
    assert (
        samples[("hetero_gateway_wait_seconds_bucket", (("le", "0.05"), ("outcome", "routed")))]
        == 1
    )
    assert (
        samples[("hetero_gateway_wait_seconds_bucket", (("le", "5.0"), ("outcome", "rejected")))]
        == 0
    )
    assert samples[("hetero_gateway_wait_seconds_count", (("outcome", "rejected"),))] == 1


def test_latency_is_compared_with_the_profile_s_prediction() -> None:
    """`hetero_gateway_slo_e2e_ratio`: actual / predicted E2E, from the routing decision (after
    the wait) to the response's end, for served SLO-routed requests only."""
    router, _, clock, _ = setup(pod("f", "fast"), pod("s", "slow"))
    slo = strategy(router, "slo")
    routed = [router.admit(req(clock), slo) for _ in range(3)]
    clock.t += 2.0  # predicted 1.0 s (both profiles' E2E): twice as slow
    for d, status in zip(routed, (200, 200, 503), strict=True):
        assert isinstance(d, Decision) and d.expected_e2e_s == pytest.approx(1.0)
        router.finished(d, status)
    plain = router.admit(req(clock), strategy(router, "least-request"))
    assert isinstance(plain, Decision) and plain.expected_e2e_s is None
    router.finished(plain, 200)  # no prediction: not counted

    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            return queue_families(router.waits, router.predictions)

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    family = {f.name: f for f in text_string_to_metric_families(text)}[
        "hetero_gateway_slo_e2e_ratio"
    ]
    by = {(s.name, s.labels.get("deployment"), s.labels.get("le")): s.value for s in family.samples}
    total = sum(v for (n, _, _), v in by.items() if n.endswith("_count"))
    assert total == 2  # the 503 and the unpredicted request are left out
    for deployment in {d.lease.pod.deployment for d in routed[:2] if isinstance(d, Decision)}:
        assert by[("hetero_gateway_slo_e2e_ratio_bucket", deployment, "1.5")] == 0
        assert by[("hetero_gateway_slo_e2e_ratio_bucket", deployment, "2.0")] >= 1


def test_a_woken_request_skips_a_gpu_type_its_wait_has_ruled_out() -> None:
    """Slack is per GPU type: after waiting 2.5 s a request can still make its 5 s E2E on the
    fast type (1 s expected) but no longer on the slow one (3 s), even if the slow pod frees."""
    router, pool, clock, book = setup(pod("f", "fast"), pod("s", "slow"))
    slow = dataclasses.replace(grid_profile("slow", tput=0.5, e2e=3.0), created=1.0)
    fast = grid_profile("fast", tput=10.0, e2e=1.0)
    book.replace({profile_key(MODEL, "slow"): slow, profile_key(MODEL, "fast"): fast})
    pool.profiles_changed()
    slo = strategy(router, "slo")
    leases = [router.admit(req(clock), slo) for _ in range(11)]  # 10 fill f, 1 fills s
    assert all(isinstance(d, Decision) for d in leases)
    assert (pool.inflight("ns/f"), pool.inflight("ns/s")) == (10, 1)
    held = router.admit(req(clock), slo)
    assert isinstance(held, Waiter) and held.deadline == clock.t + 4.0  # the fast type's slack
    clock.t += 2.5
    on_slow = next(d for d in leases if isinstance(d, Decision) and d.lease.pod.name == "s")
    on_slow.lease.release()
    assert not held.done and pool.inflight("ns/s") == 0  # the slow pod is free, but too slow
    on_fast = next(d for d in leases if isinstance(d, Decision) and d.lease.pod.name == "f")
    on_fast.lease.release()
    assert held.done and held.result().lease.pod.name == "f"


# --- sizes outside a profile's grid --------------------------------------------------------------


def aibrix_a100(profile_dir: Path) -> GpuProfile:
    """AIBrix's sample A100 profile: outputs 4..512, inputs 128..2048, p99 E2E under 5 s."""
    return parse_profile(json.loads((profile_dir / AIBRIX_A100).read_text()))


def admit_by(router: Router, request: RequestInfo, name: str, path: str) -> Decision:
    """Admit under strategy `name`, from the pool's view (`path` "view": the grouped index) or
    from a plain list (an `external-filter` selecting every pod makes the router pass one)."""
    if path == "list":
        request = dataclasses.replace(request, pod_selector=parse_selector("gpu"))
    decision = router.admit(request, strategy(router, name))
    assert isinstance(decision, Decision)
    return decision


@pytest.mark.parametrize("path", ["view", "list"])
@pytest.mark.parametrize("name", SLO_STRATEGIES)
def test_a_prompt_below_the_grid_routes_at_the_smallest_cell(
    profile_dir: Path, name: str, path: str
) -> None:
    """AIBrix's A100 profile starts its inputs at 128 tokens: a chat request of 3 prompt tokens
    is routed at the smallest cell (no request is harder than it), not refused with 503, under
    every SLO strategy; it is no guess, so nothing is counted."""
    a100 = aibrix_a100(profile_dir)
    router, _, clock, _ = setup(
        pod("a", "a100"), pod("bb", "a100"), profiles={profile_key(MODEL, "a100"): a100}
    )
    request = parse_request(orjson.dumps(chat_body(MODEL)), "r", arrived_at=clock.t)
    assert (request.prompt_tokens, request.max_tokens) == (3, None)
    decision = admit_by(router, request, name, path)
    assert decision.profiled is not None
    assert (decision.profiled.cell, decision.profiled.above) == ((0, 0), ())
    assert decision.expected_e2e_s == pytest.approx(a100.e2e[0][0] if a100.e2e else 0.0)
    assert router.beyond.counts == {}


@pytest.mark.parametrize("path", ["view", "list"])
@pytest.mark.parametrize("name", SLO_STRATEGIES)
def test_a_size_above_the_grid_routes_at_the_border_cell_and_is_counted(
    profile_dir: Path, name: str, path: str
) -> None:
    """A 5000-token prompt lies more than half a doubling above the largest input tick (2048):
    it is routed at the border cell (a guess, not a refusal) and counted on the input axis."""
    a100 = aibrix_a100(profile_dir)
    router, _, clock, _ = setup(
        pod("a", "a100"), pod("bb", "a100"), profiles={profile_key(MODEL, "a100"): a100}
    )
    for _ in range(3):
        decision = admit_by(router, req(clock, prompt_tokens=5000), name, path)
        assert decision.profiled is not None
        assert (decision.profiled.cell, decision.profiled.above) == ((0, 4), ("input",))
    assert router.beyond.counts == {(MODEL, "input"): 3}


def test_a_size_above_the_grid_where_the_border_cell_never_meets_the_slo_is_refused(
    profile_dir: Path,
) -> None:
    """The border cell's figures hold for the request as they are: AIBrix's A100 meets the SLO
    at no 512-token output, so a 1000-token answer is refused at once, and not counted."""
    router, _, clock, _ = setup(
        pod("a", "a100"), profiles={profile_key(MODEL, "a100"): aibrix_a100(profile_dir)}
    )
    with pytest.raises(RoutingFailed, match="no GPU type"):
        router.admit(req(clock, max_tokens=1000), strategy(router, "slo"))
    assert router.beyond.counts == {}


def test_a_model_beyond_its_grid_is_warned_of_once() -> None:
    """One warning per model, naming it, the size and the grid's largest ticks; every request
    beyond the grid is counted, on each axis it exceeds."""
    small = GpuProfile("g", 1.0, (4, 8), (128,), ((10.0,), (10.0,)), 0.0, ((0.5,), (0.5,)))
    router, _, clock, _ = setup(
        pod("a", "g"),
        pod("b", "g", model="other"),
        profiles={profile_key(MODEL, "g"): small, profile_key("other", "g"): small},
    )
    warnings: list[str] = []
    router.on_warning = warnings.append
    for name in SLO_STRATEGIES:
        # Below the grid's inputs and within its outputs, then above it on both axes.
        for prompt, output in ((64, 4), (1000, 1000)):
            request = req(clock, prompt_tokens=prompt, max_tokens=output)
            assert isinstance(router.admit(request, strategy(router, name)), Decision)
    assert router.beyond.counts == {(MODEL, "output"): 4, (MODEL, "input"): 4}
    (warning,) = warnings
    assert f"{MODEL}: a request of 1000 prompt and about 1000 output tokens" in warning
    assert "largest ticks: 8 output, 128 input tokens" in warning
    other = req(clock, prompt_tokens=5000, max_tokens=4)
    assert isinstance(
        router.admit(dataclasses.replace(other, model="other"), strategy(router, "slo")), Decision
    )
    assert len(warnings) == 2 and warnings[1].startswith("other: a request of 5000 prompt")
    assert router.beyond.counts[("other", "input")] == 1
