"""Where a replica without a learned capacity starts: from its own GPU type, not the fleet's.

A replica's capacity is learned from the tokens it completes (`plugin.core.capacity`); a new one
has none yet. Scoring it at the mean of the model's learned capacities floods a slow newcomer
among fast peers (a new V100 among A100s takes an A100's share until it has learned), the flaw
the review of AIBrix PR 2771 names in AIBrix's version of this formula. So a replica without an
estimate starts from the mean learned capacity of its peers of the same deployment (the GPU-type
label, `AIBRIX_POD_DEPLOYMENT_LABEL`: same GPU, same engine arguments). The first of its type
has no peers: where GPU profiles (SLO routing's) describe its deployment and a learned one's, it
starts from that replica's capacity scaled by how much faster or slower the profiles say its GPU
is (the mean over learned replicas with a profile); else from the lowest learned capacity among
the model's replicas: a newcomer of unknown speed is taken to be as slow as the slowest one seen,
and earns more as it learns. With nothing learned anywhere every replica scores alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from plugin.core.profile import GpuProfile
from plugin.core.types import Pod
from plugin.core.view import usable_capacity

__all__ = ["DEPLOYMENT", "LOWEST", "PROFILE", "relative_speed", "starting_capacities"]

DEPLOYMENT = "deployment"  # the mean of its deployment's learned capacities
PROFILE = "profile"  # learned capacities of other types, scaled by the GPU profiles
LOWEST = "lowest"  # the lowest learned capacity among the model's replicas


def relative_speed(new: GpuProfile, known: GpuProfile) -> float | None:
    """How many times `known`'s throughput `new` sustains: the geometric mean, over `new`'s
    cells where both profiles sustain some rate, of the ratio of their rates (each cell looked
    up in `known`'s grid by its token sizes); None without such a cell."""
    logs: list[float] = []
    for i, out in enumerate(new.out_ticks):
        for j, inp in enumerate(new.in_ticks):
            mine = new.tputs[i][j]
            ki, kj = known.cell(inp, out)
            theirs = known.tputs[ki][kj]
            if mine > 0 and theirs > 0 and math.isfinite(mine) and math.isfinite(theirs):
                logs.append(math.log(mine / theirs))
    return math.exp(sum(logs) / len(logs)) if logs else None


def starting_capacities(
    pods: Iterable[Pod],
    learned: Callable[[str], float | None],
    profile_of: Callable[[Pod], GpuProfile | None] | None = None,
) -> dict[str, tuple[float, str]]:
    """For each pod without a usable learned capacity (`learned(key)`), its starting capacity and
    where it came from (`DEPLOYMENT`, `PROFILE` with `profile_of`, or `LOWEST`); pods with one,
    or with nothing to start from, are left out."""
    peers: dict[str, list[float]] = {}
    known: list[tuple[Pod, float]] = []
    new: list[Pod] = []
    for pod in pods:
        capacity = learned(pod.key)
        if capacity is None or not usable_capacity(capacity):
            new.append(pod)
            continue
        if pod.deployment:
            peers.setdefault(pod.deployment, []).append(capacity)
        known.append((pod, capacity))
    starts: dict[str, tuple[float, str]] = {}
    if not known:
        return starts
    lowest = min(capacity for _, capacity in known)
    for pod in new:
        same = peers.get(pod.deployment) if pod.deployment else None
        if same:
            starts[pod.key] = (sum(same) / len(same), DEPLOYMENT)
            continue
        scaled = None if profile_of is None else _scaled(pod, known, profile_of)
        starts[pod.key] = (scaled, PROFILE) if scaled is not None else (lowest, LOWEST)
    return starts


def _scaled(
    pod: Pod,
    known: list[tuple[Pod, float]],
    profile_of: Callable[[Pod], GpuProfile | None],
) -> float | None:
    """The mean, over learned replicas with a GPU profile, of their capacity times how fast
    `pod`'s profile says its GPU is against theirs; None when no pair of profiles says."""
    mine = profile_of(pod)
    if mine is None:
        return None
    estimates = []
    for other, capacity in known:
        theirs = profile_of(other)
        speed = None if theirs is None else relative_speed(mine, theirs)
        if speed is not None:
            estimates.append(capacity * speed)
    return sum(estimates) / len(estimates) if estimates else None
