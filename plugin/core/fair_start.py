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

A start is a guess, and the scores send a newcomer every request until its in-flight count
reaches its start's share: at a fleet's rate that is a burst of prompts prefilled together within
a fraction of a second, on a replica that may be slower than its start says (a V100 among A100s
measured in `benchmarks/fair_start.py`: a dozen in half a second, TTFT over 1.5 s behind one long
prompt). So, like Envoy's slow start (`slow_start_config`: a new host's weight times
max(min_weight_percent, time_factor ^ (1 / aggression)), linear here), a start is ramped in:
scored at `slow_start_share(age)` of it, from `SLOW_START_MIN` when the pod turns ready to all of
it after the window. Its own estimate, from what it served, replaces the start outright.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from plugin.core.profile import GpuProfile
from plugin.core.types import Pod
from plugin.core.view import usable_capacity

__all__ = [
    "DEPLOYMENT",
    "LOWEST",
    "PROFILE",
    "SLOW_START_MIN",
    "SLOW_START_WINDOW_S",
    "relative_speed",
    "slow_start_share",
    "starting_capacities",
]

DEPLOYMENT = "deployment"  # the mean of its deployment's learned capacities
PROFILE = "profile"  # learned capacities of other types, scaled by the GPU profiles
LOWEST = "lowest"  # the lowest learned capacity among the model's replicas
# The share of its start a pod that just turned ready is scored at. Envoy's min_weight_percent
# is 10% (so that its EDF scheduler has a reasonable deadline; we have none). From a start taken
# from the fastest type, 10% of an A100 is still several V100s: a new V100 among three A100s
# with no profiles ran its first minute at p99 TPOT 29 ms against their 27 at 10%, 24 at 2%
# (`benchmarks/fair_start.py`, 3 seeds). Its own estimate takes over within seconds.
SLOW_START_MIN = 0.02
SLOW_START_WINDOW_S = 60.0  # about the capacity window: by then its own estimate has taken over


def slow_start_share(age_s: float, window_s: float, least: float = SLOW_START_MIN) -> float:
    """The share of its start a pod ready for `age_s` is scored at: linear from `least` to 1
    over `window_s` (a window of 0: all of it at once)."""
    if window_s <= 0 or age_s >= window_s:
        return 1.0
    return max(least, age_s / window_s)


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
    or with nothing to start from, are left out. Linear in the pods: learned capacities are
    summed per deployment, and each pair of GPU profiles is compared once."""
    sums: dict[str | None, list[float]] = {}  # deployment -> [capacity sum, count]
    profiles: dict[str | None, GpuProfile | None] = {}  # deployment -> its profile
    new: list[Pod] = []
    lowest = math.inf
    for pod in pods:
        capacity = learned(pod.key)
        if capacity is None or not usable_capacity(capacity):
            new.append(pod)
            continue
        total = sums.get(pod.deployment)
        if total is None:
            total = sums[pod.deployment] = [0.0, 0.0]
            if profile_of is not None:
                profiles[pod.deployment] = profile_of(pod)
        total[0] += capacity
        total[1] += 1
        lowest = min(lowest, capacity)
    starts: dict[str, tuple[float, str]] = {}
    if not sums:
        return starts
    scaled: dict[str | None, float | None] = {}  # a newcomer's deployment -> its start
    for pod in new:
        same = sums.get(pod.deployment) if pod.deployment else None
        if same:
            starts[pod.key] = (same[0] / same[1], DEPLOYMENT)
            continue
        if profile_of is None:
            start = None
        elif pod.deployment in scaled:
            start = scaled[pod.deployment]
        else:
            start = scaled[pod.deployment] = _scaled(profile_of(pod), sums, profiles)
        starts[pod.key] = (start, PROFILE) if start is not None else (lowest, LOWEST)
    return starts


def _scaled(
    mine: GpuProfile | None,
    sums: dict[str | None, list[float]],
    profiles: dict[str | None, GpuProfile | None],
) -> float | None:
    """The mean, over learned replicas with a GPU profile, of their capacity times how fast
    `mine` says its GPU is against theirs; None when no pair of profiles says."""
    if mine is None:
        return None
    total = count = 0.0
    for deployment, (capacity_sum, replicas) in sums.items():
        theirs = profiles.get(deployment)
        speed = None if theirs is None else relative_speed(mine, theirs)
        if speed is not None:
            total += capacity_sum * speed
            count += replicas
    return total / count if count else None
