"""A gateway in front of simulated engines: discrete events, simulated time, no I/O.

Routing goes through the plugin's own `Router`, `PodPool` and strategies. They see only what the
real gateway sees: the in-flight counts it keeps itself, engine metrics sampled on the scrape
interval (optionally delivered late), and capacity learned from the output tokens of completed
requests. Nothing of the engines' internals reaches a strategy: the only path from an engine to
the gateway is `EngineSnapshot` (what vLLM's /metrics would say) through `PodPool.update_metrics`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import Lease, PodPool
from plugin.core.router import Router
from plugin.core.strategies import LoadBalanceSettings, Strategy
from plugin.core.types import EngineMetrics, Pod, RequestInfo
from plugin_tools.sim.engine import GpuProfile, SimEngine, SimSeq
from plugin_tools.sim.workload import SimRequest

__all__ = ["GatewayModel", "RequestRecord", "RunResult", "replica_names", "simulate"]

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


@dataclass(frozen=True, slots=True)
class RequestRecord:
    replica: int  # index into the fleet; -1 when it never reached one
    arrival: float
    first_token: float  # -1 when never
    finish: float  # -1 when never
    prompt_tokens: int
    output_tokens: int
    measured: bool  # arrived inside the measured window (after the warm-up)

    @property
    def completed(self) -> bool:
        return self.finish >= 0

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


_STEP, _SCRAPE, _DELIVER, _MARK = 0, 1, 2, 3


def simulate(
    profiles: Sequence[GpuProfile],
    strategy: Strategy,
    requests: Sequence[SimRequest],
    *,
    warmup_s: float,
    gateway: GatewayModel | None = None,
    seed: int = 0,
    drain_limit_s: float = 600.0,
) -> RunResult:
    """Run `requests` through a gateway with `strategy` in front of one engine per profile.

    Requests arriving before `warmup_s` warm the gateway's estimates and are not measured.
    Requests still unfinished `drain_limit_s` after the last arrival count as dropped, as do
    requests whose whole sequence cannot fit a replica's KV cache.
    """
    gw = gateway or GatewayModel()
    names = replica_names(profiles)
    engines = [SimEngine(n, p) for n, p in zip(names, profiles, strict=True)]
    pods = [
        Pod(n, "sim", MODEL, f"10.0.{i // 250}.{i % 250 + 1}", 8000, 8000)
        for i, n in enumerate(names)
    ]
    index = {p.key: i for i, p in enumerate(pods)}
    pool = PodPool(
        CapacityEstimator(gw.capacity_window_s, gw.capacity_tau_s),
        gw.scrape_interval_s * gw.metrics_max_age_intervals,
    )
    pool.set_pods(pods)
    now = 0.0
    rng = random.Random(f"router-{seed}")  # not the workload's stream
    router = Router(pool, {strategy.name: strategy}, strategy.name, rng, lambda: now)
    info = RequestInfo(MODEL, stream=True, include_usage=True)

    events: list[tuple[float, int, int, Any]] = []
    counter = 0

    def push(t: float, kind: int, data: Any) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, data))

    busy = [False] * len(engines)
    seqs: list[SimSeq] = []
    placed: list[int] = []
    leases: dict[int, Lease] = {}

    def start_step(i: int) -> None:
        plan = engines[i].plan_step()
        if plan is None:
            busy[i] = False
            return
        busy[i] = True
        duration, chunks = plan
        push(now + duration, _STEP, (i, duration, chunks))

    measured = [r.arrival >= warmup_s for r in requests]
    measured_times = [r.arrival for r, m in zip(requests, measured, strict=True) if m]
    t_start = measured_times[0] if measured_times else 0.0
    t_stop = measured_times[-1] if measured_times else 0.0
    marks: list[list[tuple[int, float, int]]] = []
    push(t_start, _MARK, None)
    push(t_stop, _MARK, None)
    push(gw.scrape_interval_s, _SCRAPE, None)

    last_arrival = requests[-1].arrival if requests else 0.0
    limit = last_arrival + drain_limit_s
    n = len(requests)
    next_req = 0
    while True:
        t_event = events[0][0] if events else float("inf")
        if next_req < n and requests[next_req].arrival < t_event:
            req = requests[next_req]
            now = req.arrival
            seq = SimSeq(next_req, now, req.prompt_tokens, req.output_tokens)
            seqs.append(seq)
            lease = router.route(info, strategy).lease
            i = index[lease.key]
            next_req += 1
            if not engines[i].fits(seq):
                placed.append(-1)  # dropped: never reached an engine
                lease.release(0, 0, now)  # the gateway sees an immediate failure
                continue
            placed.append(i)
            leases[seq.rid] = lease
            engines[i].submit(seq)
            if not busy[i]:
                start_step(i)
            continue
        if next_req >= n and not any(busy):
            break
        t, _, kind, data = heapq.heappop(events)
        if t > limit:
            break
        now = t
        if kind == _STEP:
            i, duration, chunks = data
            done = engines[i].finish_step(now, duration, chunks)
            for seq in done:
                leases.pop(seq.rid).release(seq.output_tokens, 200, now)
            start_step(i)
        elif kind == _SCRAPE:
            for i, engine in enumerate(engines):
                snap = engine.snapshot()
                metrics = EngineMetrics(float(snap.running), float(snap.waiting), snap.kv_usage)
                if gw.metrics_delay_s > 0:
                    push(now + gw.metrics_delay_s, _DELIVER, (pods[i].key, metrics))
                else:
                    pool.update_metrics(pods[i].key, metrics, now)
            pool.refresh_capacity(now)
            push(now + gw.scrape_interval_s, _SCRAPE, None)
        elif kind == _DELIVER:
            key, metrics = data
            # Stamped on arrival, as the plugin's scraper does: a late scrape is stale data,
            # not an old one.
            pool.update_metrics(key, metrics, now)
        else:
            marks.append([(e.generated_tokens, e.busy_s, e.preemptions) for e in engines])

    while len(marks) < 2:
        marks.append([(e.generated_tokens, e.busy_s, e.preemptions) for e in engines])
    windows = tuple(
        ReplicaWindow(b[0] - a[0], b[1] - a[1], b[2] - a[2])
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
        )
        for k, s in enumerate(seqs)
    )
    return RunResult(tuple(names), tuple(profiles), records, max(0.0, t_stop - t_start), windows)
