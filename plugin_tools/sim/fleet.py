"""A gateway in front of simulated engines: discrete events, simulated time, no I/O.

Routing goes through the plugin's own `Router`, `PodPool` and strategies. They see only what the
real gateway sees: the in-flight counts it keeps itself, engine metrics sampled on the scrape
interval (optionally delivered late), and capacity learned from the output tokens of completed
requests. Nothing of the engines' internals reaches a strategy: the only path from an engine to
the gateway is `EngineSnapshot` (what vLLM's /metrics would say) through `PodPool.update_metrics`.

Requests are admitted as the gateway admits them (`Router.admit`): a strategy may route one at
once, reject it, or hold it. A held request is driven in simulated time as the ext_proc adapter
drives it in real time: the router's `notify` schedules its outcome, and an event at its deadline
calls `Router.expire` (again at a later deadline if the strategy sets one; a deadline moved
earlier while it waits takes effect at the one scheduled, as in the adapter). A rejected request
never reaches an engine and is recorded as such. Each completion teaches the router's output
history (`Router.completed`), which SLO routing predicts output lengths from; the GPU profiles
SLO routing reads come in as a `ProfileBook` keyed by GPU type (each pod's deployment).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plugin.core.admission import Admission, AdmissionSettings
from plugin.core.capacity import CapacityEstimator
from plugin.core.fair_start import SLOW_START_MIN, SLOW_START_WINDOW_S
from plugin.core.pool import Lease, PodPool
from plugin.core.profile import ProfileBook
from plugin.core.router import Decision, Router, Waiter
from plugin.core.strategies import LoadBalanceSettings, Strategy, build_strategies
from plugin.core.types import EngineMetrics, Pod, RequestInfo
from plugin.errors import RequestError
from plugin_tools.sim.engine import GpuProfile, SimEngine, SimSeq
from plugin_tools.sim.workload import SimRequest

__all__ = [
    "GatewayModel",
    "RequestRecord",
    "RunResult",
    "SpeedSwap",
    "replica_names",
    "simulate",
]

MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class GatewayModel:
    """What the gateway observes and how often (the plugin's defaults)."""

    scrape_interval_s: float = 1.0  # engine metrics and capacity refresh on this tick
    metrics_delay_s: float = 0.0  # staleness: how old a scrape is when the gateway gets it
    metrics_max_age_intervals: int = 3
    capacity_window_s: float = 60.0
    capacity_tau_s: float = 10.0
    params: LoadBalanceSettings = field(default_factory=LoadBalanceSettings)
    # The engines export their generated-token counter (vLLM, SGLang) with each scrape, so
    # capacity is learned from it rather than from completed requests' counted tokens.
    engine_tokens: bool = False
    # The gateway sees each stream's response chunks (its counting filter reads them), so the
    # gaps between them feed the chunk-gap speed watch (`plugin.core.capacity.GapWatch`).
    chunk_gaps: bool = False
    # Tokens per SSE event of the engines' streams (SGLang's `--stream-interval`, TensorRT-LLM,
    # speculative decoding): a stream's chunk then comes every this many steps, their phases
    # spread, so about 1/this of the batch gets one from each step, after the last this many.
    tokens_per_event: int = 1
    # A replica without a learned capacity starts from its GPU type's peers (False: it is
    # scored at the mean of the pool's estimates, the rule before; `plugin.core.fair_start`).
    fair_start: bool = True
    # ... ramped in over this long from `slow_start_min` of it (0: scored at all of it at once).
    slow_start_s: float = SLOW_START_WINDOW_S
    slow_start_min: float = SLOW_START_MIN


@dataclass(frozen=True, slots=True)
class SpeedSwap:
    """At `at_s`, replicas `a` and `b` exchange their step costs (a GPU slowed by a neighbour,
    a replica restarted with other engine args): each keeps its KV cache and batch cap."""

    at_s: float
    a: int
    b: int
    # The gateway is told this long after the swap (None: never): their capacity estimates are
    # exchanged then, as a perfect detector with that delay would (the bound for any way of
    # learning the change).
    told_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestRecord:
    replica: int  # index into the fleet; -1 when it never reached one
    arrival: float
    first_token: float  # -1 when never
    finish: float  # -1 when never
    prompt_tokens: int
    output_tokens: int
    measured: bool  # arrived inside the measured window (after the warm-up)
    # When the gateway routed or rejected it (-1: never decided, as when the run ended first).
    decided: float = -1.0
    rejected: bool = False  # the strategy rejected it (at once or after waiting at the gateway)
    tenant: str = "default"
    gpu_s: float = 0.0  # GPU time it took on its engine (`SimSeq.gpu_s`)

    @property
    def completed(self) -> bool:
        return self.finish >= 0

    @property
    def wait(self) -> float:
        """Time held at the gateway before it was routed or rejected (inf: never decided)."""
        return self.decided - self.arrival if self.decided >= 0 else float("inf")

    @property
    def e2e(self) -> float:
        """From arrival at the gateway to the last token (inf when never)."""
        return self.finish - self.arrival if self.finish >= 0 else float("inf")

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival if self.first_token >= 0 else float("inf")

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token answers)."""
        if self.finish < 0:
            return float("inf")
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    @property
    def e2e_per_token(self) -> float:
        if self.finish < 0:
            return float("inf")
        return (self.finish - self.arrival) / self.output_tokens


@dataclass(frozen=True, slots=True)
class ReplicaWindow:
    """An engine's counters over the measured window."""

    output_tokens: int
    busy_s: float
    preemptions: int
    # Prompt tokens admitted and, of those, found in the engine's prefix cache.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RunResult:
    replicas: tuple[str, ...]
    profiles: tuple[GpuProfile, ...]
    records: tuple[RequestRecord, ...]
    window_s: float  # from the first to the last measured arrival
    windows: tuple[ReplicaWindow, ...]


def replica_names(profiles: Sequence[GpuProfile]) -> list[str]:
    """`a100-0`, `l20-0`, `a100-1`, ...: the GPU type and its index within that type."""
    seen: dict[str, int] = {}
    names: list[str] = []
    for p in profiles:
        i = seen.get(p.name, 0)
        seen[p.name] = i + 1
        names.append(f"{p.name}-{i}")
    return names


def _counters(engine: SimEngine) -> tuple[int, float, int, int, int]:
    """An engine's cumulative counters, in `ReplicaWindow`'s field order."""
    return (
        engine.generated_tokens,
        engine.busy_s,
        engine.preemptions,
        engine.prefix_query_tokens,
        engine.prefix_hit_tokens,
    )


_STEP, _SCRAPE, _DELIVER, _MARK, _DECIDED, _DEADLINE, _SWAP, _TELL = 0, 1, 2, 3, 4, 5, 6, 7


def simulate(
    profiles: Sequence[GpuProfile],
    strategy: Strategy,
    requests: Sequence[SimRequest],
    *,
    warmup_s: float,
    gateway: GatewayModel | None = None,
    seed: int = 0,
    drain_limit_s: float = 600.0,
    book: ProfileBook | None = None,
    max_tokens: int | None = None,
    swap: SpeedSwap | None = None,
    on_scrape: Callable[[float, PodPool], None] | None = None,
    admission: AdmissionSettings | None = None,
) -> RunResult:
    """Run `requests` through a gateway with `strategy` in front of one engine per profile.

    Requests arriving before `warmup_s` warm the gateway's estimates and are not measured.
    Requests still unfinished `drain_limit_s` after the last arrival count as dropped, as do
    requests whose whole sequence cannot fit a replica's KV cache. `book` holds the GPU
    profiles SLO routing reads (each pod's deployment is its GPU type's name); `max_tokens` is
    what every request's body asks for at most. `swap` changes two replicas' speeds mid-run;
    `on_scrape(now, pool)` sees the gateway's state after each scrape tick. `admission` turns
    the gateway's admission queue on (`plugin.core.admission`; requests carry their tenants).
    """
    gw = gateway or GatewayModel()
    names = replica_names(profiles)
    engines = [SimEngine(n, p) for n, p in zip(names, profiles, strict=True)]
    pods = [
        Pod(n, "sim", MODEL, f"10.0.{i // 250}.{i % 250 + 1}", 8000, 8000, deployment=p.name)
        for i, (n, p) in enumerate(zip(names, profiles, strict=True))
    ]
    index = {p.key: i for i, p in enumerate(pods)}
    estimator = CapacityEstimator(gw.capacity_window_s, gw.capacity_tau_s)
    pool = PodPool(
        estimator,
        gw.scrape_interval_s * gw.metrics_max_age_intervals,
        fair_start=gw.fair_start,
        slow_start_s=gw.slow_start_s,
        slow_start_min=gw.slow_start_min,
    )
    if book is not None:
        pool.use_profiles(book)
    pool.set_pods(pods)
    now = 0.0
    rng = random.Random(f"router-{seed}")  # not the workload's stream
    strategies = {strategy.name: strategy}
    if getattr(strategy, "needs_profiles", False):  # the router's fallback without profiles
        strategies.setdefault("least-request", build_strategies()["least-request"])
    router = Router(
        pool,
        strategies,
        strategy.name,
        rng,
        lambda: now,
        admission=None if admission is None else Admission(admission),
    )

    events: list[tuple[float, int, int, Any]] = []
    counter = 0

    def push(t: float, kind: int, data: Any) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, data))

    busy = [False] * len(engines)
    per_event = max(1, gw.tokens_per_event)
    # The last steps' durations, per engine: a stream's gap between two chunks spans them.
    spanned = [deque[float](maxlen=per_event) for _ in engines]
    chunk_share = [0.0] * len(engines)  # streams owed a chunk, in part
    seqs: list[SimSeq] = []
    placed = [-1] * len(requests)
    decided = [-1.0] * len(requests)
    rejected = [False] * len(requests)
    leases: dict[int, Lease] = {}
    decisions: dict[int, Decision] = {}  # charged by admission, settled when they end
    held: dict[Waiter, int] = {}  # requests waiting at the gateway -> their index

    def start_step(i: int) -> None:
        plan = engines[i].plan_step()
        if plan is None:
            busy[i] = False
            spanned[i].clear()  # no stream spans an idle engine's pause
            chunk_share[i] = 0.0
            return
        busy[i] = True
        duration, chunks = plan
        push(now + duration, _STEP, (i, duration, chunks))

    def place(k: int, decision: Decision) -> None:
        """The gateway routed request `k`: to the engine, or dropped if it can never fit."""
        lease = decision.lease
        i = index[lease.key]
        seq = seqs[k]
        decided[k] = now
        if not engines[i].fits(seq):
            lease.release(0, 0, now)  # dropped: the gateway sees an immediate failure
            return
        placed[k] = i
        leases[seq.rid] = lease
        if decision.charge is not None:
            decisions[seq.rid] = decision
        engines[i].submit(seq)
        if not busy[i]:
            start_step(i)

    def reject(k: int) -> None:
        decided[k] = now
        rejected[k] = True

    def hold(k: int, waiter: Waiter) -> None:
        held[waiter] = k
        waiter.notify = lambda: push(now, _DECIDED, waiter)
        push(waiter.deadline, _DEADLINE, waiter)

    measured = [r.arrival >= warmup_s for r in requests]
    measured_times = [r.arrival for r, m in zip(requests, measured, strict=True) if m]
    t_start = measured_times[0] if measured_times else 0.0
    t_stop = measured_times[-1] if measured_times else 0.0
    marks: list[list[tuple[int, float, int, int, int]]] = []
    push(t_start, _MARK, None)
    push(t_stop, _MARK, None)
    push(gw.scrape_interval_s, _SCRAPE, None)
    if swap is not None:
        push(swap.at_s, _SWAP, swap)

    last_arrival = requests[-1].arrival if requests else 0.0
    limit = last_arrival + drain_limit_s
    n = len(requests)
    next_req = 0
    while True:
        t_event = events[0][0] if events else float("inf")
        if next_req < n and requests[next_req].arrival < t_event:
            req = requests[next_req]
            now = req.arrival
            k = next_req
            next_req += 1
            seqs.append(
                SimSeq(
                    k,
                    now,
                    req.prompt_tokens,
                    req.output_tokens,
                    req.prefix_group,
                    req.shared_tokens,
                )
            )
            info = RequestInfo(
                MODEL,
                stream=True,
                include_usage=True,
                prompt_chars=sum(map(len, req.prompt_parts)),
                prompt_tokens=req.prompt_tokens,
                max_tokens=max_tokens,
                arrived_at=now,
                prompt_parts=req.prompt_parts,
                tenant=req.tenant,
            )
            try:
                outcome = router.admit(info, strategy)
            except RequestError:
                reject(k)
                continue
            if isinstance(outcome, Waiter):
                hold(k, outcome)
            else:
                place(k, outcome)
            continue
        if next_req >= n and not any(busy) and not held:
            break
        t, _, kind, data = heapq.heappop(events)
        if t > limit:
            break
        now = t
        if kind == _STEP:
            i, duration, chunks = data
            decoded = engines[i].decoding  # streams that get a chunk from this step
            done = engines[i].finish_step(now, duration, chunks)
            for seq, _ in chunks:
                if seq.first_token_at == now:  # its first chunk: its prompt is done
                    leases[seq.rid].streaming()
            if gw.chunk_gaps:
                key = pods[i].key
                steps = spanned[i]
                steps.append(duration)
                chunk_share[i] += decoded / per_event
                sent = int(chunk_share[i])
                chunk_share[i] -= sent
                if sent and len(steps) == per_event:
                    pool.observe_chunk_gap(key, sum(steps), sent)
                for seq, _ in chunks:
                    if seq.first_token_at == now:  # its first chunk: it streams from here
                        pool.stream_started(key, seq.prompt_tokens)
            for seq in done:
                if gw.chunk_gaps:  # its chunks, with the role's and the usage's
                    chunks_sent = -(-seq.output_tokens // per_event) + 2
                    pool.stream_ended(
                        pods[i].key, seq.prompt_tokens, seq.output_tokens, chunks_sent
                    )
                router.completed(MODEL, seq.prompt_tokens, seq.output_tokens, 200)
                leases.pop(seq.rid).release(seq.output_tokens, 200, now)
                charged = decisions.pop(seq.rid, None)
                if charged is not None:  # admission settles its tenant's charge
                    router.finished(charged, 200, None, seq.output_tokens)
            start_step(i)
        elif kind == _DECIDED:
            if not data.done:  # admission handed it to a strategy that holds it: new deadline
                push(data.deadline, _DEADLINE, data)
                continue
            k = held.pop(data, -1)
            if k < 0:  # told twice (handed over, then decided) before either event ran
                continue
            try:
                decision = data.result()
            except RequestError:
                reject(k)
            else:
                place(k, decision)
        elif kind == _DEADLINE:
            waiter = data
            if waiter.done:
                continue
            if waiter.deadline <= now:
                router.expire(waiter)  # routed, rejected, or a later deadline
            if not waiter.done:
                push(waiter.deadline, _DEADLINE, waiter)
        elif kind == _SCRAPE:
            for i, engine in enumerate(engines):
                snap = engine.snapshot()
                metrics = EngineMetrics(
                    float(snap.running),
                    float(snap.waiting),
                    snap.kv_usage,
                    generation_tokens=float(engine.generated_tokens) if gw.engine_tokens else None,
                    generation_tokens_stepwise=gw.engine_tokens,  # counted per step, as vLLM
                )
                if gw.metrics_delay_s > 0:
                    push(now + gw.metrics_delay_s, _DELIVER, (pods[i].key, metrics))
                else:
                    pool.update_metrics(pods[i].key, metrics, now)
            pool.refresh_capacity(now)
            if on_scrape is not None:
                on_scrape(now, pool)
            push(now + gw.scrape_interval_s, _SCRAPE, None)
        elif kind == _SWAP:
            first, second = engines[data.a], engines[data.b]
            one, other = first.profile, second.profile
            first.profile = replace(one, a_ms=other.a_ms, b_ms=other.b_ms, p_ms=other.p_ms)
            second.profile = replace(other, a_ms=one.a_ms, b_ms=one.b_ms, p_ms=one.p_ms)
            if data.told_after_s is not None:
                push(now + data.told_after_s, _TELL, data)
        elif kind == _TELL:
            key_a, key_b = pods[data.a].key, pods[data.b].key
            est_a, est_b = estimator.estimate(key_a), estimator.estimate(key_b)
            if est_a and est_b:
                estimator.rescale(key_a, est_b / est_a)
                estimator.rescale(key_b, est_a / est_b)
                pool.refresh_capacity(now)  # routing sees estimates as each tick ends
        elif kind == _DELIVER:
            key, metrics = data
            # Stamped on arrival, as the plugin's scraper does: a late scrape is stale data,
            # not an old one.
            pool.update_metrics(key, metrics, now)
        else:
            marks.append([_counters(e) for e in engines])

    while len(marks) < 2:
        marks.append([_counters(e) for e in engines])
    windows = tuple(
        ReplicaWindow(b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3] - a[3], b[4] - a[4])
        for a, b in zip(marks[0], marks[1], strict=True)
    )
    records = tuple(
        RequestRecord(
            placed[k],
            s.arrival,
            s.first_token_at,
            s.finish_at,
            s.prompt_tokens,
            s.output_tokens,
            measured[k],
            decided[k],
            rejected[k],
            requests[k].tenant,
            s.gpu_s,
        )
        for k, s in enumerate(seqs)
    )
    return RunResult(tuple(names), tuple(profiles), records, max(0.0, t_stop - t_start), windows)
