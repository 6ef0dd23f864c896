"""The gateway's view of its pods: discovery's list, in-flight counts, engine metrics, capacity.

Pure state with time passed in. The ext_proc adapter asks it for candidates and takes a `Lease`
per routed request; the lease gives the in-flight slot back exactly once and credits the counted
output tokens to the replica's capacity counter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from plugin.core.capacity import CapacityEstimator
from plugin.core.types import Candidate, EngineMetrics, Pod
from plugin.errors import NoReadyPod, UnknownModel

__all__ = ["Lease", "PodPool"]


class Lease:
    """One routed request's hold on a pod's in-flight slot."""

    __slots__ = ("_pool", "key", "pod", "released")

    def __init__(self, pool: PodPool, pod: Pod) -> None:
        self._pool = pool
        self.pod = pod
        self.key = pod.key
        self.released = False

    def release(self, output_tokens: int = 0) -> bool:
        """Give the slot back and credit tokens; later calls do nothing (returns False)."""
        if self.released:
            return False
        self.released = True
        self._pool._on_release(self.key, output_tokens)
        return True


@dataclass(slots=True)
class _Scraped:
    metrics: EngineMetrics
    at: float


class PodPool:
    __slots__ = (
        "_by_model",
        "_capacity",
        "_inflight",
        "_metrics",
        "_metrics_max_age_s",
        "_pods",
        "_routed",
        "loaded",
    )

    def __init__(self, capacity: CapacityEstimator, metrics_max_age_s: float = 3.0) -> None:
        self._capacity = capacity
        self._metrics_max_age_s = metrics_max_age_s
        self._pods: dict[str, Pod] = {}
        self._by_model: dict[str, list[Pod]] = {}
        self._inflight: dict[str, int] = {}
        self._routed: dict[str, int] = {}
        self._metrics: dict[str, _Scraped] = {}
        self.loaded = False  # True once discovery delivered its first list

    # discovery -------------------------------------------------------------------------------
    def set_pods(self, pods: Iterable[Pod]) -> None:
        """Replace the pod list. State of pods that stay is kept; in-flight counts of removed
        pods stay until their leases release (no count is lost or leaked)."""
        new = {p.key: p for p in pods}
        by_model: dict[str, list[Pod]] = {}
        for pod in new.values():
            by_model.setdefault(pod.model, []).append(pod)
            self._capacity.ensure(pod.key)
        for key in self._pods.keys() - new.keys():
            self._metrics.pop(key, None)
            self._capacity.forget(key)
        self._pods = new
        self._by_model = by_model
        self.loaded = True

    def pods(self) -> list[Pod]:
        return list(self._pods.values())

    def models(self) -> list[str]:
        return sorted(self._by_model)

    # request path ----------------------------------------------------------------------------
    def candidates(self, model: str, now: float) -> list[Candidate]:
        """Routable pods of a model with what a strategy may see of them."""
        pods = self._by_model.get(model)
        if not pods:
            raise UnknownModel(model)
        max_age = self._metrics_max_age_s
        out: list[Candidate] = []
        for pod in pods:
            if not pod.ready:
                continue
            key = pod.key
            scraped = self._metrics.get(key)
            waiting = kv = None
            if scraped is not None and now - scraped.at <= max_age:
                waiting = scraped.metrics.waiting
                kv = scraped.metrics.kv_usage
            out.append(
                Candidate(
                    pod, self._inflight.get(key, 0), waiting, kv, self._capacity.estimate(key)
                )
            )
        if not out:
            raise NoReadyPod(model)
        return out

    def acquire(self, pod: Pod) -> Lease:
        key = pod.key
        self._inflight[key] = self._inflight.get(key, 0) + 1
        self._routed[key] = self._routed.get(key, 0) + 1
        return Lease(self, pod)

    def _on_release(self, key: str, output_tokens: int) -> None:
        left = self._inflight.get(key, 0) - 1
        if left > 0:
            self._inflight[key] = left
        else:
            self._inflight.pop(key, None)
        if output_tokens > 0:
            self._capacity.add_tokens(key, output_tokens)

    # background ------------------------------------------------------------------------------
    def update_metrics(self, key: str, metrics: EngineMetrics, now: float) -> None:
        if key in self._pods:
            self._metrics[key] = _Scraped(metrics, now)

    def refresh_capacity(self, now: float) -> None:
        self._capacity.refresh(now)

    # observation -----------------------------------------------------------------------------
    def inflight(self, key: str) -> int:
        return self._inflight.get(key, 0)

    def routed_total(self, key: str) -> int:
        return self._routed.get(key, 0)

    def output_tokens_total(self, key: str) -> int:
        return self._capacity.total(key)

    def capacity(self, key: str) -> float | None:
        return self._capacity.estimate(key)

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-ready view for /debug/pods and tests."""
        pods: dict[str, Any] = {}
        for key, pod in sorted(self._pods.items()):
            scraped = self._metrics.get(key)
            pods[key] = {
                "name": pod.name,
                "namespace": pod.namespace,
                "model": pod.model,
                "endpoint": pod.endpoint,
                "ready": pod.ready,
                "labels": dict(pod.labels),
                "inflight": self.inflight(key),
                "routed_total": self.routed_total(key),
                "output_tokens_total": self.output_tokens_total(key),
                "capacity_tokens_per_s": self.capacity(key),
                "engine": None
                if scraped is None
                else {
                    "running": scraped.metrics.running,
                    "waiting": scraped.metrics.waiting,
                    "kv_usage": scraped.metrics.kv_usage,
                    "age_s": round(now - scraped.at, 3),
                },
            }
        orphans = {k: v for k, v in self._inflight.items() if k not in self._pods}
        return {"pods": pods, "inflight_removed_pods": orphans}
