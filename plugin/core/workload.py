"""From traced traffic and GPU profiles to the optimizer's problem, for one model.

The gateway's trace windows (`plugin.core.trace`) say how many requests of each size (a log2
bucket of input and output tokens) completed, and how many arrived. The optimizer plans for the
mean rate of the last few minutes: the completions give the mix of sizes, the arrivals the level
(completions lag arrivals by a request's duration, so under rising traffic the arrivals are the
fresher figure). A window with arrivals but no completion (every request still running) gives no
mix: its arrivals are spread over the mix of the other windows.

Each bucket maps to one cell of each deployment's profile: the tick nearest in log2, a request
smaller than the grid to the smallest tick (a conservative capacity: smaller requests are cheaper)
and one more than half a doubling above the top tick to no cell (the profile never measured
anything that large: that deployment cannot claim it). Buckets that land on the same cell of every
profile are merged, so the problem has at most one row per distinct cell tuple, not per bucket.

A deployment without a profile is left out of the problem (the service leaves it alone and
reports it); a deployment is matched to its profile by name (`aibrix:profile_<model>_<name>`), as
AIBrix does, whatever its namespace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from plugin.core.optimizer import Candidate, Problem
from plugin.core.profile import GpuProfile

__all__ = [
    "Deployment",
    "ModelProblem",
    "Traffic",
    "TrafficCell",
    "WindowCounts",
    "build_problem",
    "nearest_cell",
    "traffic",
]


class WindowCounts(Protocol):
    """What the workload reads of one trace window (`plugin.core.trace.TraceWindow`)."""

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

    @property
    def rate(self) -> float:
        return sum(c.rate for c in self.cells)


def traffic(windows: Iterable[WindowCounts], lookback_s: float) -> Traffic:
    """The mean request rate per size bucket over `lookback_s` seconds of windows."""
    if not lookback_s > 0:
        raise ValueError("lookback_s must be > 0")
    counts: dict[tuple[float, float], int] = {}
    arrivals = completions = found = 0
    for window in windows:
        found += 1
        arrivals += window.total_reqs
        for input_tokens, output_tokens, count in window.cells():
            if count > 0:
                key = (input_tokens, output_tokens)
                counts[key] = counts.get(key, 0) + count
                completions += count
    if completions == 0:
        return Traffic((), arrivals, 0, found)
    level = max(arrivals, completions) / completions / lookback_s
    cells = tuple(
        TrafficCell(i, o, n * level) for (i, o), n in sorted(counts.items(), key=lambda kv: kv[0])
    )
    return Traffic(cells, arrivals, completions, found)


def nearest_cell(ticks: Sequence[int], tokens: float) -> int | None:
    """The tick nearest in log2 to `tokens`; below the grid the smallest; None more than half a
    doubling above the largest."""
    if not ticks:
        return None
    x = math.log2(max(tokens, 1.0))
    if x > math.log2(ticks[-1]) + 0.5:
        return None
    return min(range(len(ticks)), key=lambda k: abs(math.log2(ticks[k]) - x))


@dataclass(frozen=True, slots=True)
class ModelProblem:
    """The solver's problem for one model, with what it was built from (for /debug/plan)."""

    model: str
    problem: Problem
    cells: tuple[tuple[float, float], ...]  # a representative (input, output) per problem cell
    deployments: tuple[Deployment, ...]  # in the order of problem.candidates
    unprofiled: tuple[Deployment, ...]  # left alone: no profile
    traffic: Traffic


def build_problem(
    model: str,
    deployments: Sequence[Deployment],
    profiles: Mapping[str, GpuProfile],
    load: Traffic,
    headroom: float = 1.0,
    caps: Mapping[str, int] | None = None,
) -> ModelProblem:
    """The problem for `model`: a candidate per profiled deployment (`profiles` by deployment
    name), a cell per distinct tuple of profile cells the traffic lands on. `caps` holds each
    deployment's availability cap, by `namespace/name` or by bare name."""
    caps = caps or {}
    ours = sorted((d for d in deployments if d.model == model), key=lambda d: d.key)
    profiled = [d for d in ours if d.name in profiles]
    unprofiled = tuple(d for d in ours if d.name not in profiles)
    groups: dict[tuple[tuple[int, int] | None, ...], list[TrafficCell]] = {}
    for cell in load.cells:
        key = tuple(_cell(profiles[d.name], cell) for d in profiled)
        groups.setdefault(key, []).append(cell)
    ordered = sorted(groups.items(), key=lambda kv: (kv[1][0].input_tokens, kv[1][0].output_tokens))
    rates = tuple(sum(c.rate for c in cells) for _, cells in ordered)
    candidates = []
    for k, d in enumerate(profiled):
        profile = profiles[d.name]
        tputs = tuple(
            0.0 if (idx := key[k]) is None else profile.tputs[idx[0]][idx[1]] for key, _ in ordered
        )
        cap = caps.get(d.key, caps.get(d.name))
        candidates.append(
            Candidate(
                name=d.key,
                cost=profile.cost,
                tputs=tputs,
                min_replicas=d.min_replicas if cap is None else min(d.min_replicas, cap),
                max_replicas=cap,
            )
        )
    return ModelProblem(
        model=model,
        problem=Problem(rates=rates, candidates=tuple(candidates), headroom=headroom),
        cells=tuple((cells[0].input_tokens, cells[0].output_tokens) for _, cells in ordered),
        deployments=tuple(profiled),
        unprofiled=unprofiled,
        traffic=load,
    )


def _cell(profile: GpuProfile, cell: TrafficCell) -> tuple[int, int] | None:
    i = nearest_cell(profile.out_ticks, cell.output_tokens)
    j = nearest_cell(profile.in_ticks, cell.input_tokens)
    return None if i is None or j is None else (i, j)
