"""The per-model view kept current by events picks exactly what a pass over a fresh list picks.

Random pools go through random event sequences (leases taken and released, scrapes, capacity
refreshes, ejections, other gateways' counts, the clock moving on and sometimes back); at each
step the view must hold the same candidates a straightforward rebuild from the pool's public
state gives, and every strategy must pick the same pod from the view (its sorted indexes) as
from that plain list (the reference pass), with the same seeded random draws.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.core import view as view_module
from plugin.core.admission import has_room, with_room
from plugin.core.capacity import CapacityEstimator
from plugin.core.fair_start import starting_capacities
from plugin.core.pool import EjectionPolicy, Lease, PodPool
from plugin.core.profile import GpuProfile, ProfileBook, profile_key
from plugin.core.strategies import (
    LoadBalanceSettings,
    Reject,
    Route,
    SloSettings,
    Wait,
    build_strategies,
)
from plugin.core.types import Candidate, EngineMetrics, Pod, RequestInfo, SloTarget
from plugin.core.view import CandidateView, usable_capacity

pytestmark = pytest.mark.unit

MODEL = "m"
MAX_AGE_S = 2.0
KV = (None, 0.0, 0.2, 0.5, 0.93, 0.97, 1.0, float("nan"))
WAITING = (None, 0.0, 0.0, 1.0, 2.0, float("nan"))
SETTINGS = (
    LoadBalanceSettings(),
    LoadBalanceSettings(avoid_full_batches=False),
    LoadBalanceSettings(queued_weight=0.5, kv_pressure_alpha=0.0, kv_critical_free=0.05),
)


def reference_candidates(pool: PodPool, pods: list[Pod], now: float) -> list[Candidate]:
    """What `PodPool.candidates` promises, built the plain way from the pool's public state."""
    ready = [p for p in pods if p.ready]
    healthy = [p for p in ready if not pool.ejected(p.key, now)] or ready
    # A pod that has not learned its capacity is scored at where it starts.
    starts = starting_capacities(pods, pool.capacity)
    out = []
    for p in healthy:
        scraped = pool.scraped(p.key)
        fresh = scraped is not None and now <= scraped[1]
        # Full at the cap; a learned one plus its 1/64 slack (at least 1).
        full_at = pool.saturation(p.key)
        if full_at is not None and pool.saturation_source(p.key) == "learned":
            full_at += max(1, full_at // 64)
        out.append(
            Candidate(
                p,
                pool.inflight(p.key) + pool.remote_inflight(p.key),
                scraped[0].waiting if fresh and scraped else None,
                scraped[0].kv_usage if fresh and scraped else None,
                starts[p.key][0] if p.key in starts else pool.capacity(p.key),
                full_at,
                cpu_kv_usage=scraped[0].cpu_kv_usage if fresh and scraped else None,
            )
        )
    return out


def fields(c: Candidate) -> tuple[object, ...]:
    # repr: NaN equals itself, and 0.0 vs -0.0 would show
    return (
        c.pod.key,
        c.running,
        repr(c.waiting),
        repr(c.kv_usage),
        repr(c.cpu_kv_usage),
        c.capacity,
        c.saturation,
    )


def check(pool: PodPool, pods: list[Pod], now: float, seed: int) -> None:
    view = pool.candidates(MODEL, now)
    assert isinstance(view, CandidateView)
    plain = reference_candidates(pool, pods, now)
    assert [fields(c) for c in view] == [fields(c) for c in plain]
    # The sums the view keeps current, against the plain sums over the same candidates.
    assert view.running_total == sum(c.running for c in plain)
    known = [c.capacity for c in plain if c.capacity is not None and usable_capacity(c.capacity)]
    assert view.known_capacities == len(known)
    assert view.capacity_total == pytest.approx(sum(known))
    for top in (True, False):  # admission's room, counted by the view
        assert has_room(view, top) == has_room(plain, top)
        assert [c.pod.key for c in with_room(view, top)] == [
            c.pod.key for c in with_room(plain, top)
        ]
    request = RequestInfo(MODEL)
    for lb in SETTINGS:
        fast, slow = build_strategies(lb), build_strategies(lb)
        for name in sorted(fast):
            a = fast[name].admit(view, request, random.Random(seed), now)
            b = slow[name].admit(plain, request, random.Random(seed), now)
            assert isinstance(a, Route) and isinstance(b, Route)
            assert a.candidate.pod.key == b.candidate.pod.key, (name, lb)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30))
def test_view_and_indexes_match_the_plain_pass(seed: int, n: int) -> None:
    rng = random.Random(seed)
    pool = PodPool(
        CapacityEstimator(window_s=10.0, tau_s=2.0),
        metrics_max_age_s=MAX_AGE_S,
        ejection=EjectionPolicy(consecutive_5xx=2, base_s=3.0, max_s=6.0),
        saturation_probe_s=5.0,
        slow_start_s=0.0,  # starts as `starting_capacities` finds them (the ramp: test_fair_start)
    )
    pods = [
        Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000, ready=rng.random() < 0.9)
        for i in range(n)
    ]
    other = Pod("q0", "ns", "other", "10.0.0.2", 9000, 9000)
    pool.set_pods([*pods, other])
    if not any(p.ready for p in pods):
        return  # NoReadyPod: covered elsewhere
    leases: list[Lease] = []
    now = 0.0
    for _ in range(120):
        roll = rng.random()
        target = rng.choice(pods)
        if roll < 0.25:
            leases.append(pool.acquire(target))
        elif roll < 0.45 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            status = rng.choice((200, 200, 200, 503))
            lease.release(rng.choice((0, 50, 400)), status, now)
        elif roll < 0.65:
            running = float(rng.randint(0, 4))
            metrics = EngineMetrics(
                running, rng.choice(WAITING), rng.choice(KV), rng.choice((None, 0.0, 0.3, 0.3))
            )
            if rng.random() < 0.2:  # an engine that exports its batch cap (TensorRT-LLM)
                metrics = metrics._replace(max_batch=rng.choice((0.0, 2.0, 3.0)))
            pool.update_metrics(target.key, metrics, now)
        elif roll < 0.72:
            pool.credit_tokens(target.key, rng.choice((100, 100, 700)))
            pool.refresh_capacity(now)
        elif roll < 0.76:
            counts = {p.key: rng.randint(0, 2) for p in rng.sample(pods, min(3, len(pods)))}
            pool.set_remote_inflight(counts)
        elif roll < 0.78 and rng.random() < 0.3:
            pods = pods[1:] + pods[:1] if len(pods) > 1 else pods  # discovery reorders
            pool.set_pods([*pods, other])
        elif roll < 0.80:
            now = max(0.0, now - rng.uniform(0.0, 3.0))  # a caller with an older clock
        else:
            now += rng.choice((0.0, 0.1, 0.5, 1.0, 2.0, 2.5))
        if rng.random() < 0.5:
            check(pool, pods, now, rng.randrange(1 << 30))
    for lease in leases:
        lease.release()
    check(pool, pods, now, 7)
    assert all(c.running == pool.remote_inflight(c.pod.key) for c in pool.candidates(MODEL, now))


def test_a_large_pool_is_not_rebuilt_per_request() -> None:
    """The view is the same object between requests and its candidates are updated in place."""
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=3.0)
    pods = [Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000) for i in range(1000)]
    pool.set_pods(pods)
    first = pool.candidates(MODEL, 1.0)
    picked = build_strategies()["least-request"].admit(
        first, RequestInfo(MODEL), random.Random(1), 1.0
    )
    assert isinstance(picked, Route)
    lease = pool.acquire(picked.candidate.pod)
    again = pool.candidates(MODEL, 1.5)
    assert again is first
    assert picked.candidate.running == 1  # the same Candidate object, updated by the lease
    lease.release()
    assert picked.candidate.running == 0


def test_when_every_replica_with_room_is_below_the_kv_guardrail_a_full_one_takes_it() -> None:
    """The full-batch rule yields to the guardrail: from the view's indexes as from the list."""
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=10.0)
    full = Pod("full", "ns", MODEL, "10.0.0.1", 8000, 8000, max_num_seqs=2)
    tight = Pod("tight", "ns", MODEL, "10.0.0.1", 8001, 8000)
    pool.set_pods([full, tight])
    pool.update_metrics(full.key, EngineMetrics(2.0, 1.0, 0.5), 2.0)
    pool.update_metrics(tight.key, EngineMetrics(1.0, 0.0, 0.97), 2.0)
    leases = [pool.acquire(full), pool.acquire(full)]
    assert pool.saturation(full.key) == 2
    view = pool.candidates(MODEL, 2.5)
    plain = reference_candidates(pool, [full, tight], 2.5)
    lb = build_strategies()["load-balance"]
    for candidates in (view, plain):
        answer = lb.admit(candidates, RequestInfo(MODEL), random.Random(0), 2.5)
        assert isinstance(answer, Route) and answer.candidate.pod is full
    for lease in leases:
        lease.release()


def slo_profile(gpu: str, rng: random.Random) -> GpuProfile:
    """A 2 x 2 grid (outputs 16/256, inputs 128/2048) with random rates, some cells at 0."""
    tputs = tuple(tuple(rng.choice((0.0, 0.5, 2.0, 8.0)) for _ in range(2)) for _ in range(2))
    e2e = tuple(tuple(rng.choice((0.4, 1.0, 3.0)) for _ in range(2)) for _ in range(2))
    ttft = tuple(tuple(v / 10 for v in row) for row in e2e)
    slos = rng.choice(({"e2e": 2.0}, {"ttft": 0.2, "e2e": 5.0}, {"tpat": 0.01}, {}))
    return GpuProfile(gpu, 1.0, (16, 256), (128, 2048), tputs, 0.0, e2e, ttft, 99, slos)


def slo_request(rng: random.Random, now: float) -> RequestInfo:
    slo = rng.choice((None, None, SloTarget(ttft_s=0.5), SloTarget(tpot_s=0.01)))
    return RequestInfo(
        MODEL,
        prompt_tokens=rng.choice((100, 130, 2000, 100_000)),
        max_tokens=rng.choice((None, 16, 300)),
        slo=slo,
        arrived_at=now - rng.choice((0.0, 0.0, 0.3, 1.5, 40.0)),
        predicted_output_tokens=rng.choice((None, 16, 200)),
    )


def outcome(answer: object) -> tuple[object, ...]:
    if isinstance(answer, Route):
        return ("route", answer.candidate.pod.key, answer.load, answer.expected_e2e_s)
    if isinstance(answer, Reject):
        return ("reject", type(answer.error).__name__, str(answer.error))
    assert isinstance(answer, Wait)
    return ("wait", answer.deadline, answer.priority, str(answer.on_timeout))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), list_ties=st.booleans())
def test_slo_strategies_route_from_the_grouped_index_as_the_plain_pass_does(
    seed: int, n: int, list_ties: bool
) -> None:
    """Pods of up to three deployments (one without a profile, some unlabelled), SLO loads from
    a few values so that ties within and across deployments are common, leases taken and
    released in random order: every SLO strategy answers the view exactly as it answers the
    plain list of the same candidates, random tie-breaks included (both ways of drawing among
    ties across deployments: listing them, and bisecting on the order)."""
    few_tied = view_module._FEW_TIED
    view_module._FEW_TIED = few_tied if list_ties else 0
    try:
        slo_event_sequence(random.Random(seed), n)
    finally:
        view_module._FEW_TIED = few_tied


def slo_event_sequence(rng: random.Random, n: int) -> None:
    book = ProfileBook()
    book.replace({profile_key(MODEL, d): slo_profile(d, rng) for d in ("a100", "l20")})
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=MAX_AGE_S)
    pool.use_profiles(book)
    deployments = ("a100", "l20", "v100", None)  # v100 has no profile
    pods = [
        Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000, deployment=rng.choice(deployments))
        for i in range(n)
    ]
    pool.set_pods(pods)
    strategies = build_strategies(SloSettings(max_wait_s=rng.choice((0.5, 30.0))))
    names = sorted(name for name in strategies if name.startswith("slo"))
    leases: list[Lease] = []
    now = 10.0
    for _ in range(80):
        if rng.random() < 0.55:
            leases.append(pool.acquire(rng.choice(pods), rng.choice((0.0, 0.25, 0.5, 1.0, 1.5))))
        elif leases:
            leases.pop(rng.randrange(len(leases))).release(rng.choice((0, 40)), 200, now)
        now += rng.choice((0.0, 0.5))
        view = pool.candidates(MODEL, now)
        plain = [dataclasses.replace(c) for c in view]  # a list: the strategies' plain pass
        request = slo_request(rng, now)
        draw = rng.randrange(1 << 30)
        for name in names:
            fast = strategies[name].admit(view, request, random.Random(draw), now)
            slow = strategies[name].admit(plain, request, random.Random(draw), now)
            assert outcome(fast) == outcome(slow), name
    for lease in leases:
        lease.release()
    assert all(c.load == 0.0 for c in pool.candidates(MODEL, now))


def test_an_ejection_ended_by_a_later_clock_leaves_no_pod_out() -> None:
    """A success seen with a newer clock than the view's ends the pod's ejection (Hypothesis
    found it: the view kept the pod out until the old ejection's end, while the pool said it
    was back)."""
    pool = PodPool(CapacityEstimator(), ejection=EjectionPolicy(consecutive_5xx=2, base_s=3.0))
    pods = [Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000) for i in range(3)]
    pool.set_pods(pods)
    for _ in range(2):
        pool.acquire(pods[0]).release(0, 503, 10.0)  # ejected until 13.0
    assert [c.pod.key for c in pool.candidates(MODEL, 11.0)] == ["ns/p1", "ns/p2"]
    pool.acquire(pods[0]).release(5, 200, 14.0)  # a caller whose clock is past the ejection
    assert not pool.ejected(pods[0].key, 12.0)
    assert [c.pod.key for c in pool.candidates(MODEL, 12.0)] == ["ns/p0", "ns/p1", "ns/p2"]
