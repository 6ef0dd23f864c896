"""The pool's records: one per pod (`PodRecord`) and one per model (`ModelState`).

Everything the gateway knows of a pod lives in its record, so a pod that leaves discovery's list
takes all of it along at once (a state kept in several maps keyed by pod lost some of it and
kept the rest when a pod left and came back). Pure data and small rules; `PodPool` owns them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plugin.core.batch_cap import BatchCap
from plugin.core.config_profile import ModelConfig
from plugin.core.pod_speed import PodSpeed
from plugin.core.types import EngineMetrics, Pod
from plugin.core.view import CandidateView

__all__ = ["EjectionPolicy", "Health", "ModelState", "PodRecord", "Scraped"]


@dataclass(slots=True)
class Scraped:
    metrics: EngineMetrics
    at: float
    fresh_until: float  # at + the pool's max age: fresh while now <= fresh_until


@dataclass(slots=True)
class ModelState:
    """One model's candidate view and what keeps it current between requests."""

    view: CandidateView
    pods: list[Pod]
    any_ready: bool
    now: float = -math.inf  # the clock time the view was last brought up to
    dirty: bool = True  # the routable set (readiness, ejections) must be recomputed
    next_heal: float = math.inf  # the earliest end of an ejection among the model's pods
    stale: list[tuple[float, int]] = field(default_factory=list)  # heap: (fresh until, order)
    config: ModelConfig | None = None  # the first pod's `model.aibrix.ai/config`, if any
    # Pods without a learned capacity: where they start (`plugin.core.fair_start`).
    # (capacity scored, where from, slow-start share of the start)
    starts: dict[str, tuple[float, str, float]] = field(default_factory=dict)

    def recompute(self, now: float, records: Mapping[str, PodRecord]) -> None:
        """Bring the view to `now` from scratch: metrics freshness and the routable set (when
        it changed, an ejection ended or `now` went back; `PodPool.candidates`)."""
        view = self.view
        self.stale = []
        for order, candidate in enumerate(view.slots):
            scraped = records[candidate.pod.key].scraped
            if scraped is not None and now <= scraped.fresh_until:
                candidate.waiting = scraped.metrics.waiting
                candidate.kv_usage = scraped.metrics.kv_usage
                candidate.cpu_kv_usage = scraped.metrics.cpu_kv_usage
                self.stale.append((scraped.fresh_until, order))
            else:
                candidate.waiting = candidate.kv_usage = candidate.cpu_kv_usage = None
        heapq.heapify(self.stale)
        ready = [(o, records[pod.key]) for o, pod in enumerate(self.pods) if pod.ready]
        # Out of rotation: pods whose engine fails requests (5xx), and pods whose engine does
        # not answer its scrapes. If that leaves none, the unreachable ones come back first (a
        # metrics endpoint nobody can reach, say a wrong port, must not disable the 5xx rule),
        # then every ready pod (better a try than a certain 503).
        serving = [(o, r) for o, r in ready if not r.ejected(now)]
        healthy = [o for o, r in serving if not r.unreachable]
        heal = [h.ejected_until for _, r in ready if (h := r.health) and h.ejected_until > now]
        self.next_heal = min(heal, default=math.inf)
        self.now = now
        self.dirty = False
        view.set_members(healthy or [o for o, _ in serving] or [o for o, _ in ready])

    def expire(self, now: float, records: Mapping[str, PodRecord]) -> None:
        """Candidates whose metrics went stale by `now` read None again."""
        stale = self.stale
        while stale and stale[0][0] < now:
            self._expire(heapq.heappop(stale)[1], now, records)

    def _expire(self, order: int, now: float, records: Mapping[str, PodRecord]) -> None:
        candidate = self.view.slots[order]
        scraped = records[candidate.pod.key].scraped
        if scraped is not None and now <= scraped.fresh_until:
            return  # a later scrape pushed its own entry
        if (
            candidate.waiting is not None
            or candidate.kv_usage is not None
            or candidate.cpu_kv_usage is not None
        ):
            candidate.waiting = candidate.kv_usage = candidate.cpu_kv_usage = None
            self.view.changed(order)

    def show_scrape(self, order: int, scraped: Scraped, saturation: int | None) -> None:
        """A scrape of the pod at `order` was read: its candidate shows it while fresh."""
        candidate = self.view.slots[order]
        candidate.saturation = saturation
        if self.dirty:
            return  # the next request recomputes the whole view
        metrics = scraped.metrics
        if self.now <= scraped.fresh_until:
            candidate.waiting, candidate.kv_usage = metrics.waiting, metrics.kv_usage
            candidate.cpu_kv_usage = metrics.cpu_kv_usage
            stale = self.stale
            heapq.heappush(stale, (scraped.fresh_until, order))
            if len(stale) > 2 * len(self.view.slots) + 64:  # a model nobody asks for lately
                self.dirty = True
        else:
            candidate.waiting = candidate.kv_usage = candidate.cpu_kv_usage = None
        self.view.changed(order)


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """Passive health: a pod whose engine keeps failing leaves the candidates for a while.

    Without it a dead replica that answers 503 in milliseconds always has zero requests in flight,
    scores 0 and attracts most of the traffic. Like Envoy's outlier detection: after
    `consecutive_5xx` upstream 5xx in a row the pod is ejected for `base_s`, doubling with each
    ejection in a row up to `max_s`; one success resets it. If every pod of a model is ejected,
    they all stay candidates (better a try than a certain 503).
    """

    consecutive_5xx: int = 3
    base_s: float = 5.0
    max_s: float = 60.0


@dataclass(slots=True)
class Health:
    failures: int = 0
    ejections: int = 0
    ejected_until: float = float("-inf")


@dataclass(slots=True)
class PodRecord:
    """Everything the pool knows of one pod.

    A pod removed while this gateway's requests are still out on it keeps a record with only
    their counts (`listed` False, the rest fresh) until the last lease is released; one that
    comes back under the same key picks those counts up and learns everything else anew.
    """

    listed: bool = True  # in discovery's list (else only the lease counts below matter)
    slot: tuple[ModelState, int] | None = None  # its model's view and its position in it
    # This gateway's leases on the pod.
    inflight: int = 0
    inflight_prompt: int = 0  # their prompt tokens (`Lease.prompt_tokens`)
    prefill_free_at: float = 0.0  # `Candidate.prefill_free_at`
    streaming_prompt: int = 0  # of those, the ones whose first chunk came (prefilled)
    # Its responses this gateway watches between their first chunk and their end, and when the
    # last chunk of any came (`PodPool.silent`: a hung engine sends none).
    open_streams: int = 0
    last_chunk_at: float = 0.0
    silence_told: float = -1.0  # `last_chunk_at` when its silence was last told
    load: float = 0.0  # summed `Lease.load` (SLO routing)
    # What it served (for metrics and the capacity estimate).
    routed: int = 0
    counted: int = 0  # output tokens this gateway counted
    estimated: int = 0  # of those, the ones the engine did not report
    unpublished: int = 0  # counted while tokens are shared, not yet handed out
    shared_seen: int | None = None  # its shared token counter at the previous read
    # Health and what its engine showed.
    health: Health | None = None
    unreachable: bool = False  # its last metrics scrape failed: out of rotation until one works
    # Why its engine's last answer to a scrape was of no use (in rotation all the same).
    metrics_unusable: str | None = None
    scraped: Scraped | None = None
    cap: BatchCap = field(default_factory=BatchCap)
    speed: PodSpeed = field(default_factory=PodSpeed)

    @property
    def token_source(self) -> str:
        """Where the pod's capacity is learned from: `engine` (its generated-token counter)
        or `gateway` (the output tokens counted in its responses)."""
        return "gateway" if self.speed.engine_tokens is None else "engine"

    def unanswered(self) -> None:
        """Its engine did not answer a scrape: out of rotation."""
        if not self.unreachable:
            self.unreachable = True
            self.mark_dirty()

    def answered(self, unusable: str | None) -> None:
        """Its engine answered a scrape (`unusable`: why the page was of no use, else None)."""
        self.metrics_unusable = unusable
        if self.unreachable:
            # Back in rotation, and an ejection for failed requests (a dead engine refusing
            # connections) ends with it, instead of waiting out its backoff.
            self.unreachable = False
            self.health = None
            self.mark_dirty()

    def take(self, load: float, prompt_tokens: int) -> None:
        """A lease on the pod (`PodPool.acquire`)."""
        self.inflight += 1
        self.inflight_prompt += prompt_tokens
        self.routed += 1
        if load:
            self.load += load

    def give_back(self, load: float, prompt_tokens: int) -> None:
        """A lease released: its counts return, never below 0."""
        self.inflight -= 1
        if self.inflight > 0:
            if load:
                self.load = max(0.0, self.load - load)
        else:
            self.inflight = 0
            self.load = 0.0  # nothing in flight: exactly 0, whatever the float sums
        if prompt_tokens:
            self.inflight_prompt = max(0, self.inflight_prompt - prompt_tokens)

    def stream_started(self, prompt_tokens: int) -> None:
        """One of its responses sent its first chunk (`PodPool.stream_started`)."""
        self.open_streams += 1
        if prompt_tokens <= 0:
            return  # nothing known to have been prefilled
        self.streaming_prompt += prompt_tokens
        if (watch := self.speed.gaps) is not None:
            watch.started(prompt_tokens)

    def stream_ended(self, prompt_tokens: int, output_tokens: int, events: int) -> None:
        """A started response ended (`PodPool.stream_ended`)."""
        self.open_streams = max(0, self.open_streams - 1)
        if prompt_tokens > 0:
            self.streaming_prompt = max(0, self.streaming_prompt - prompt_tokens)
        if (watch := self.speed.gaps) is not None:
            watch.ended(output_tokens, events)

    def tell_silence(self, now: float, silent_s: float) -> bool:
        """Whether a listed pod in rotation has open streams none of which sent a chunk for
        over `silent_s`, not told since its last chunk (a probe that finds the engine alive, a
        long prefill stalling its streams, is not repeated until the next chunk)."""
        if (
            self.open_streams
            and self.listed
            and not self.unreachable
            and now - self.last_chunk_at > silent_s
            and self.silence_told != self.last_chunk_at
        ):
            self.silence_told = self.last_chunk_at
            return True
        return False

    def leases_only(self) -> PodRecord:
        """The record of the pod once removed: its lease counts, nothing learned."""
        return PodRecord(
            listed=False,
            inflight=self.inflight,
            inflight_prompt=self.inflight_prompt,
            streaming_prompt=self.streaming_prompt,
            open_streams=self.open_streams,
            last_chunk_at=self.last_chunk_at,
            load=self.load,
        )

    def ejected(self, now: float) -> bool:
        h = self.health
        return h is not None and h.ejected_until > now

    def mark_dirty(self) -> None:
        """The pod's routable state changed: its model's view recomputes the routable set."""
        if self.slot is not None:
            self.slot[0].dirty = True

    def record_outcome(self, failed: bool, now: float, policy: EjectionPolicy) -> None:
        """A request on the pod ended, failed (5xx) or not: eject after `policy`'s failures in
        a row, end the ejection with a success after it."""
        h = self.health
        if not failed:
            if h is not None:
                if h.ejected_until > now:
                    h.failures = 0  # a request from before the ejection: it does not end it
                else:
                    self.health = None
                    if h.ejections:
                        # The ejection is over as of this clock; a view last brought up to date
                        # by an older one still holds the pod out until it ends (`next_heal`).
                        self.mark_dirty()
            return
        if h is None:
            h = self.health = Health()
        h.failures += 1
        if h.failures >= policy.consecutive_5xx and h.ejected_until <= now:
            h.ejections += 1
            h.failures = 0
            doublings = min(h.ejections - 1, 30)  # bounded: a pod dead for days must not overflow
            h.ejected_until = now + min(policy.max_s, policy.base_s * 2**doublings)
            self.mark_dirty()

    def describe(
        self,
        pod: Pod,
        now: float,
        remote: int,
        capacity: float | None,
        start: tuple[float, str, float] | None = None,
    ) -> dict[str, Any]:
        """The pod's `/debug/pods` entry (JSON-ready), with other gateways' in-flight count,
        the capacity estimate and, without one, where the pod's capacity starts (the pool keeps
        them)."""
        scraped, speed, cap = self.scraped, self.speed, self.cap
        per_chunk = speed.tokens_per_chunk()
        return {
            "name": pod.name,
            "namespace": pod.namespace,
            "model": pod.model,
            "endpoint": pod.endpoint,
            "ready": pod.ready,
            "labels": dict(pod.labels),
            "deployment": pod.deployment,
            # The model config profiles the pod carries (`model.aibrix.ai/config`).
            "config_profiles": None
            if pod.model_config is None
            else sorted(pod.model_config.profiles),
            "inflight": self.inflight,
            "inflight_remote": remote,
            "load": round(self.load, 6),
            # Seconds until the prompts this gateway routed here are prefilled, at the GPU
            # profile's prefill speed (`Candidate.prefill_free_at`; 0: none queued).
            "prefill_queue_s": round(max(0.0, self.prefill_free_at - now), 3),
            "routed_total": self.routed,
            "output_tokens_total": self.counted,
            "output_tokens_estimated": self.estimated,
            "token_source": self.token_source,
            "capacity_tokens_per_s": capacity,
            # Not learned yet: the capacity it is scored at, from what (its deployment's peers,
            # the profiles' ratio, or the lowest learned) and the slow start's share of it.
            "capacity_start": None
            if start is None
            else {
                "tokens_per_s": round(start[0], 3),
                "from": start[1],
                "slow_start_share": round(start[2], 3),
            },
            "speed_changes": speed.rescaled,
            "speed_changes_from_chunk_gaps": speed.rescaled_by_gaps,
            # Output tokens per chunk of its streams, as the chunk-gap watch learned it.
            "tokens_per_chunk": None if per_chunk is None else round(per_chunk, 2),
            "saturation": cap.value(pod.max_num_seqs),
            "saturation_source": cap.source(pod.max_num_seqs),
            "ejected": self.ejected(now),
            "unreachable": self.unreachable,
            "metrics_unusable": self.metrics_unusable,
            "engine": None
            if scraped is None
            else {
                "running": scraped.metrics.running,
                "waiting": scraped.metrics.waiting,
                "kv_usage": scraped.metrics.kv_usage,
                "age_s": round(now - scraped.at, 3),
            },
        }
