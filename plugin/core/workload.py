"""From traced traffic and GPU profiles to the optimizer's problem, for one model.

The gateway's trace windows (`plugin.core.trace`) say how many requests of each size (a log2
bucket of input and output tokens) completed, and how many arrived. The optimizer plans for the
mean rate of the last few minutes: the completions give the mix of sizes, the arrivals the level
(completions lag arrivals by a request's duration, so under rising traffic the arrivals are the
fresher figure). A window with arrivals but no completion (every request still running) gives no
mix: its arrivals are spread over the mix of the other windows.

Missing windows are not traffic-free windows: gateways write nothing for an empty window, and
a Redis that restarted (or tracing just turned on) holds only the windows since. So the rate is
taken over the span the windows cover, from the oldest one found to the end of the newest closed
window, at most the look-back: a fleet is not scaled to a quarter of its traffic because three
quarters of its history were lost. (Traffic that really stopped still counts its silent windows:
they lie between the oldest window found and the end.)

Each bucket maps to one cell of each deployment's profile: the tick nearest in log2, clamped to
the grid at both ends as AIBrix's optimizer does (a size above the largest tick is planned at
the largest cell, which is optimistic for it: `ModelProblem.beyond_grid` says how much traffic
that is, and the service logs it). Buckets that land on the same cell of every profile are
merged, so the problem has at most one row per distinct cell tuple, not per bucket.

A deployment without a profile is left out of the problem (the service leaves it alone and
reports it); a deployment is matched to its profile by name (`aibrix:profile_<model>_<name>`), as
AIBrix does, whatever its namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from plugin.core.optimizer import Candidate, Problem
from plugin.core.profile import GpuProfile, beyond_grid

__all__ = [
    "Deployment",
    "ModelProblem",
    "Traffic",
    "TrafficCell",
    "WindowCounts",
    "build_problem",
    "traffic",
]


class WindowCounts(Protocol):
    """What the workload reads of one trace window (`plugin.core.trace.TraceWindow`)."""

    @property
    def start(self) -> int: ...

    @property
    def total_reqs(self) -> int: ...

    def cells(self) -> Iterator[tuple[float, float, int]]: ...


@dataclass(frozen=True, slots=True)
class Deployment:
    """One deployment (one GPU type) serving a model, as discovery found it."""

    namespace: str
    name: str
    model: str
    replicas: int  # what it runs now (spec.replicas, or the pods found)
    min_replicas: int = 0  # `model.aibrix.ai/min_replicas`

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class TrafficCell:
    input_tokens: float
    output_tokens: float
    rate: float  # req/s


@dataclass(frozen=True, slots=True)
class Traffic:
    cells: tuple[TrafficCell, ...]
    arrivals: int  # requests that arrived over the look-back
    completions: int  # requests that completed (with token counts) over it
    windows: int  # windows found
    span_s: float = 0.0  # the seconds the rate is taken over

    @property
    def rate(self) -> float:
        return sum(c.rate for c in self.cells)


def traffic(
    windows: Iterable[WindowCounts], lookback_s: float, until: int | None = None
) -> Traffic:
    """The mean request rate per size bucket over the span the windows cover: from the oldest
    window's start to `until` (the end of the newest closed window), at most `lookback_s`
    seconds; the whole look-back when `until` is None."""
    if not lookback_s > 0:
        raise ValueError("lookback_s must be > 0")
    counts: dict[tuple[float, float], int] = {}
    arrivals = completions = found = 0
    oldest: int | None = None
    for window in windows:
        found += 1
        oldest = window.start if oldest is None else min(oldest, window.start)
        arrivals += window.total_reqs
        for input_tokens, output_tokens, count in window.cells():
            if count > 0:
                key = (input_tokens, output_tokens)
                counts[key] = counts.get(key, 0) + count
                completions += count
    span = float(lookback_s)
    if until is not None and oldest is not None:
        span = min(span, max(float(until - oldest), 1.0))
    if completions == 0:
        return Traffic((), arrivals, 0, found, span)
    level = max(arrivals, completions) / completions / span
    cells = tuple(
        TrafficCell(i, o, n * level) for (i, o), n in sorted(counts.items(), key=lambda kv: kv[0])
    )
    return Traffic(cells, arrivals, completions, found, span)


@dataclass(frozen=True, slots=True)
class ModelProblem:
    """The solver's problem for one model, with what it was built from (for /debug/plan)."""

    model: str
    problem: Problem
    cells: tuple[tuple[float, float], ...]  # a representative (input, output) per problem cell
    deployments: tuple[Deployment, ...]  # in the order of problem.candidates
    unprofiled: tuple[Deployment, ...]  # left alone: no profile
    traffic: Traffic
    beyond_grid: float = 0.0  # req/s of sizes more than half a doubling above some profile's grid


def build_problem(
    model: str,
    deployments: Sequence[Deployment],
    profiles: Mapping[str, GpuProfile],
    load: Traffic,
    headroom: float = 1.0,
    caps: Mapping[str, int] | None = None,
    attainment: float = 1.0,
) -> ModelProblem:
    """The problem for `model`: a candidate per profiled deployment (`profiles` by deployment
    name), a cell per distinct tuple of profile cells the traffic lands on. `caps` holds each
    deployment's availability cap, by `namespace/name` or by bare name."""
    caps = caps or {}
    ours = sorted((d for d in deployments if d.model == model), key=lambda d: d.key)
    profiled = [d for d in ours if d.name in profiles]
    unprofiled = tuple(d for d in ours if d.name not in profiles)
    groups: dict[tuple[tuple[int, int], ...], list[TrafficCell]] = {}
    beyond = 0.0
    for cell in load.cells:
        key = tuple(
            profiles[d.name].clamped_cell(cell.input_tokens, cell.output_tokens) for d in profiled
        )
        groups.setdefault(key, []).append(cell)
        if any(
            beyond_grid(p.out_ticks, cell.output_tokens)
            or beyond_grid(p.in_ticks, cell.input_tokens)
            for p in (profiles[d.name] for d in profiled)
        ):
            beyond += cell.rate
    ordered = sorted(groups.items(), key=lambda kv: (kv[1][0].input_tokens, kv[1][0].output_tokens))
    rates = tuple(sum(c.rate for c in cells) for _, cells in ordered)
    candidates = []
    for k, d in enumerate(profiled):
        profile = profiles[d.name]
        tputs = tuple(profile.tputs[key[k][0]][key[k][1]] for key, _ in ordered)
        mix = tuple(profile.mix_tputs[key[k][0]][key[k][1]] for key, _ in ordered)
        late = tuple(profile.late_tputs[key[k][0]][key[k][1]] for key, _ in ordered)
        cap = caps.get(d.key, caps.get(d.name))
        candidates.append(
            Candidate(
                name=d.key,
                cost=profile.cost,
                tputs=tputs,
                mix_tputs=mix,
                late_tputs=late,
                min_replicas=d.min_replicas if cap is None else min(d.min_replicas, cap),
                max_replicas=cap,
            )
        )
    return ModelProblem(
        model=model,
        problem=Problem(
            rates=rates, candidates=tuple(candidates), headroom=headroom, attainment=attainment
        ),
        cells=tuple((cells[0].input_tokens, cells[0].output_tokens) for _, cells in ordered),
        deployments=tuple(profiled),
        unprofiled=unprofiled,
        traffic=load,
        beyond_grid=beyond,
    )
