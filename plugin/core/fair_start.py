"""Where a replica without a learned capacity starts: from its own GPU type, not the fleet's.

A replica's capacity is learned from the tokens it completes (`plugin.core.capacity`); a new one
has none yet. Scoring it at the mean of the model's learned capacities floods a slow newcomer
among fast peers (a new V100 among A100s takes an A100's share until it has learned), the flaw
the review of AIBrix PR 2771 names in AIBrix's version of this formula. So a replica without an
estimate starts from the mean learned capacity of its peers of the same deployment (the GPU-type
label, `AIBRIX_POD_DEPLOYMENT_LABEL`: same GPU, same engine arguments), else from the lowest
learned capacity among the model's replicas: a newcomer of unknown speed is taken to be as slow
as the slowest one seen, and earns more as it learns. With nothing learned anywhere every
replica scores alike, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from plugin.core.types import Pod
from plugin.core.view import usable_capacity

__all__ = ["DEPLOYMENT", "LOWEST", "starting_capacities"]

DEPLOYMENT = "deployment"  # the mean of its deployment's learned capacities
LOWEST = "lowest"  # the lowest learned capacity among the model's replicas


def starting_capacities(
    pods: Iterable[Pod], learned: Callable[[str], float | None]
) -> dict[str, tuple[float, str]]:
    """For each pod without a usable learned capacity (`learned(key)`), its starting capacity and
    where it came from (`DEPLOYMENT` or `LOWEST`); pods with one, or with nothing to start
    from, are left out."""
    peers: dict[str, list[float]] = {}
    lowest: float | None = None
    new: list[Pod] = []
    for pod in pods:
        capacity = learned(pod.key)
        if capacity is None or not usable_capacity(capacity):
            new.append(pod)
            continue
        if pod.deployment:
            peers.setdefault(pod.deployment, []).append(capacity)
        lowest = capacity if lowest is None else min(lowest, capacity)
    starts: dict[str, tuple[float, str]] = {}
    if lowest is None:
        return starts
    for pod in new:
        same = peers.get(pod.deployment) if pod.deployment else None
        starts[pod.key] = (sum(same) / len(same), DEPLOYMENT) if same else (lowest, LOWEST)
    return starts
