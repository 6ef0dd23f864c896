"""The gateway's view of its pods: discovery's list, in-flight counts, engine metrics, capacity.

Pure state with time passed in. The ext_proc adapter asks it for candidates and takes a `Lease`
per routed request; the lease gives the in-flight slot back exactly once and credits the counted
output tokens to the replica's capacity counter.

Several gateways (shared state): a sync loop outside the core feeds two things in.
- Other gateways' in-flight counts (`set_remote_inflight`): a candidate's `running` is this
  gateway's count plus theirs.
- Fleet-wide completed-token counters. While they are shared, a counted token is not credited to
  the capacity estimator directly: it waits in an unpublished counter that the sync loop adds to
  the shared counter (`take_unpublished_tokens`), and the estimator is credited with each shared
  counter's increase since the previous read (`apply_shared_tokens`), which holds this gateway's
  tokens and everyone else's exactly once. When the shared store fails, `leave_shared_tokens`
  credits what was taken but maybe not stored, and tokens go to the estimator directly again;
  the next successful read only sets new baselines, so nothing is credited twice across a switch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plugin.core.capacity import CapacityEstimator, GapWatch, SpeedWatch
from plugin.core.profile import GpuProfile, ProfileBook
from plugin.core.types import Candidate, EngineMetrics, Pod
from plugin.core.view import CandidateView
from plugin.errors import NoReadyPod, UnknownModel

if TYPE_CHECKING:  # the config module imports the strategies, which import this floor's types
    from plugin.core.config_profile import ModelConfig

__all__ = ["Lease", "PodPool"]


class Lease:
    """One routed request's hold on a pod's in-flight slot (and its share of the pod's load)."""

    __slots__ = ("_pool", "key", "load", "pod", "prompt_tokens", "released")

    def __init__(self, pool: PodPool, pod: Pod, load: float = 0.0, prompt_tokens: int = 0) -> None:
        self._pool = pool
        self.pod = pod
        self.key = pod.key
        self.load = load
        self.prompt_tokens = prompt_tokens
        self.released = False

    def release(
        self,
        output_tokens: int = 0,
        status: int = 0,
        now: float | None = None,
        estimated: bool = False,
    ) -> bool:
        """Give the slot back, credit tokens and report the upstream status (0: none seen);
        `estimated`: the engine did not report the count, the gateway estimated it.

        Later calls do nothing (returns False).
        """
        if self.released:
            return False
        self.released = True
        self._pool._on_release(self, output_tokens, status, now, estimated)
        return True


@dataclass(slots=True)
class _Scraped:
    metrics: EngineMetrics
    at: float
    fresh_until: float  # at + the pool's max age: fresh while now <= fresh_until


@dataclass(slots=True)
class _Model:
    """One model's candidate view and what keeps it current between requests."""

    view: CandidateView
    pods: list[Pod]
    any_ready: bool
    now: float = -math.inf  # the clock time the view was last brought up to
    dirty: bool = True  # the routable set (readiness, ejections) must be recomputed
    next_heal: float = math.inf  # the earliest end of an ejection among the model's pods
    stale: list[tuple[float, int]] = field(default_factory=list)  # heap: (fresh until, order)
    config: ModelConfig | None = None  # the first pod's `model.aibrix.ai/config`, if any


# KV-cache usage at or above which a queue is put down to the KV cache, not to a batch cap.
KV_BOUND = 0.9
# Engine steps (mean inter-token latency) the requests admitted since the last scrape must have
# waited on average for a queue to count as held by a full batch: one that only waits for the
# next step waits half a step on average.
HELD_STEPS = 2.0


@dataclass(slots=True)
class _Cap:
    """A learned batch cap: when the engine last confirmed it (queued at it), and whether it ran
    at it since (only a cap that holds traffic back is worth probing)."""

    value: int
    confirmed: float
    pressed: bool = False
    probed_from: int | None = None  # the value before a probe, until the probe is settled


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
class _Health:
    failures: int = 0
    ejections: int = 0
    ejected_until: float = float("-inf")


class PodPool:
    __slots__ = (
        "_by_endpoint",
        "_capacity",
        "_counted",
        "_ejection",
        "_engine_caps",
        "_engine_tokens",
        "_estimated",
        "_gaps",
        "_health",
        "_inflight",
        "_inflight_prompt",
        "_load",
        "_metrics",
        "_metrics_max_age_s",
        "_models",
        "_peak_running",
        "_pods",
        "_profiles",
        "_queue_clock",
        "_queue_streak",
        "_remote",
        "_rescaled",
        "_rescaled_by_gaps",
        "_routed",
        "_saturation",
        "_saturation_probe_s",
        "_saturation_scrapes",
        "_shared_seen",
        "_shared_tokens",
        "_slot",
        "_speed",
        "_streaming_prompt",
        "_unpublished",
        "_unreachable",
        "loaded",
        "on_change",
        "on_failure",
        "on_release",
    )

    def __init__(
        self,
        capacity: CapacityEstimator,
        metrics_max_age_s: float = 3.0,
        ejection: EjectionPolicy | None = None,
        saturation_probe_s: float = 60.0,
        saturation_scrapes: int = 4,
    ) -> None:
        self._capacity = capacity
        self._saturation_probe_s = saturation_probe_s
        self._saturation_scrapes = saturation_scrapes
        self._ejection = ejection or EjectionPolicy()
        self._health: dict[str, _Health] = {}
        # Pods whose last metrics scrape failed (refused, timed out, not 200): out of rotation
        # until a scrape succeeds again (`scrape_failed`, `update_metrics`).
        self._unreachable: set[str] = set()
        self._metrics_max_age_s = metrics_max_age_s
        self._pods: dict[str, Pod] = {}
        self._by_endpoint: dict[str, Pod] = {}
        self._models: dict[str, _Model] = {}
        self._profiles: ProfileBook | None = None  # GPU profiles by deployment (SLO routing)
        self._slot: dict[str, tuple[_Model, int]] = {}  # pod key -> its model, its position
        self._inflight: dict[str, int] = {}
        self._inflight_prompt: dict[str, int] = {}  # their prompt tokens (`Lease.prompt_tokens`)
        self._load: dict[str, float] = {}  # summed Lease.load of this gateway's requests
        self._routed: dict[str, int] = {}
        self._metrics: dict[str, _Scraped] = {}
        self._saturation: dict[str, _Cap] = {}  # learned batch caps
        # Batch caps the engines export (TensorRT-LLM), as last scraped: for a pod that declares
        # none, one counts as declared (exact, nothing learned).
        self._engine_caps: dict[str, int] = {}
        self._queue_streak: dict[str, tuple[float, int]] = {}  # (top running, scrapes in a row)
        # The engine's queue-time and inter-token-latency sums and counts at the last scrape.
        self._queue_clock: dict[str, tuple[float, float, float, float]] = {}
        self._peak_running: dict[str, float] = {}
        self._counted: dict[str, int] = {}  # output tokens this gateway counted, per pod
        self._estimated: dict[str, int] = {}  # of those, the ones the engine did not report
        # Pods whose engine exports its generated-token counter: its last value. Their capacity
        # is learned from its increase (every gateway reads the same counter, so nothing is
        # shared through the store); what the gateway counts is kept for metrics only.
        self._engine_tokens: dict[str, float] = {}
        # Per engine-counter pod: its speed watch, and the time and running count of its last
        # scrape (`SpeedWatch`).
        self._speed: dict[str, tuple[SpeedWatch, float, float]] = {}
        self._rescaled: dict[str, int] = {}  # speed changes the watches acted on, per pod
        self._rescaled_by_gaps: dict[str, int] = {}  # of those, the chunk-gap watch's
        # Per pod whose response chunks this gateway sees: its chunk-gap watch (`GapWatch`).
        self._gaps: dict[str, GapWatch] = {}
        # The prompt tokens of this gateway's requests on each pod whose first chunk came: the
        # rest of `_inflight_prompt` waits or prefills on the engine (`observe_chunk_gap`).
        self._streaming_prompt: dict[str, int] = {}
        self._remote: dict[str, int] = {}  # other gateways' in-flight counts, per pod
        self._shared_tokens = False  # True: the estimator is fed from shared counters
        self._unpublished: dict[str, int] = {}  # counted while shared, not yet handed out
        self._shared_seen: dict[str, int] = {}  # each shared counter at the previous read
        self.loaded = False  # True once discovery delivered its first list
        # Told after every lease release (the router wakes requests held for that model), and
        # after anything else that may let a held request in: new pods, a scrape tick (metrics
        # and capacity), other gateways' counts.
        self.on_release: Callable[[Pod], None] | None = None
        # A request on this pod failed (5xx): the scraper checks the engine at once, so a dead
        # one leaves rotation after one failure instead of at the next scrape tick.
        self.on_failure: Callable[[Pod], None] | None = None
        self.on_change: Callable[[], None] | None = None

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
            self._saturation.pop(key, None)
            self._engine_caps.pop(key, None)
            self._queue_streak.pop(key, None)
            self._queue_clock.pop(key, None)
            self._peak_running.pop(key, None)
            self._capacity.forget(key)
            self._health.pop(key, None)
            self._unreachable.discard(key)
            self._routed.pop(key, None)
            self._counted.pop(key, None)
            self._estimated.pop(key, None)
            self._engine_tokens.pop(key, None)
            self._speed.pop(key, None)
            self._gaps.pop(key, None)
            # The prompt counts stay, as `_inflight` does: the pod's running streams still end
            # (`stream_ended`), also if it comes back under the same key.
            self._rescaled.pop(key, None)
            self._rescaled_by_gaps.pop(key, None)
            self._unpublished.pop(key, None)
            self._shared_seen.pop(key, None)
        self._pods = new
        self._by_endpoint = {p.endpoint: p for p in new.values()}
        old_models, self._models = self._models, {}
        self._slot = {}
        for model, model_pods in by_model.items():
            state = old_models.get(model)
            if state is None or state.pods != model_pods:  # else the model kept its view
                state = self._new_model(model, model_pods, state)
            self._models[model] = state
            for order, pod in enumerate(model_pods):
                self._slot[pod.key] = (state, order)
        self.loaded = True
        self._changed()

    def _new_model(self, model: str, pods: list[Pod], old: _Model | None) -> _Model:
        """A model's view for a new pod list; candidates of pods that did not change are kept
        (their fields are current), so an update costs little per unchanged pod."""
        kept = {} if old is None else {c.pod.key: c for c in old.view.slots}
        slots = []
        for pod in pods:
            candidate = kept.get(pod.key)
            if candidate is None or (candidate.pod is not pod and candidate.pod != pod):
                candidate = self._new_candidate(pod)
            slots.append(candidate)
        config = next((p.model_config for p in pods if p.model_config is not None), None)
        return _Model(CandidateView(model, slots), pods, any(p.ready for p in pods), config=config)

    def _new_candidate(self, pod: Pod) -> Candidate:
        key = pod.key
        return Candidate(
            pod,
            self._inflight.get(key, 0) + self._remote.get(key, 0),
            None,
            None,
            self._capacity.estimate(key),
            self._full_at(key),
            self._load.get(key, 0.0),
            self._profile_of(pod),
        )

    def _profile_of(self, pod: Pod) -> GpuProfile | None:
        book = self._profiles
        return None if book is None else book.lookup(pod.model, pod.deployment)

    def use_profiles(self, book: ProfileBook) -> None:
        """Read candidates' GPU profiles from `book`; call `profiles_changed` after it changes."""
        self._profiles = book
        self.profiles_changed()

    def profiles_changed(self) -> None:
        """The profile book changed: every candidate's `profile` is looked up again."""
        for state in self._models.values():
            for order, candidate in enumerate(state.view.slots):
                profile = self._profile_of(candidate.pod)
                if profile is not candidate.profile:
                    candidate.profile = profile
                    state.view.changed(order)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def pods(self) -> list[Pod]:
        return list(self._pods.values())

    def model_config(self, model: str) -> ModelConfig | None:
        """The model's config profiles (from its first pod that carries one), if any."""
        state = self._models.get(model)
        return None if state is None else state.config

    def models(self) -> list[str]:
        return sorted(self._models)

    def serving_models(self) -> list[str]:
        """Models with at least one ready pod (what `GET /v1/models` lists)."""
        return sorted(m for m, state in self._models.items() if state.any_ready)

    # request path ----------------------------------------------------------------------------
    def candidates(self, model: str, now: float) -> CandidateView:
        """Routable pods of a model with what a strategy may see of them, as of `now`.

        Ready pods that are not ejected; if every ready pod is ejected, all of them. Engine
        metrics count while `now <= scrape time + metrics_max_age_s`. The view is kept current
        between calls (`plugin.core.view`), so a call costs O(1) plus what expired since the
        last one; a `now` earlier than the last call's recomputes the view from scratch.
        """
        state = self._models.get(model)
        if state is None:
            raise UnknownModel(model)
        if not state.any_ready:
            raise NoReadyPod(model)
        if state.dirty or now < state.now or now >= state.next_heal:
            self._recompute(state, now)
        else:
            state.now = now
            stale = state.stale
            while stale and stale[0][0] < now:
                self._expire_metrics(state, heapq.heappop(stale)[1], now)
        return state.view

    def _recompute(self, state: _Model, now: float) -> None:
        """Bring a model's view to `now` from scratch: metrics freshness and the routable set."""
        view = state.view
        state.stale = []
        for order, candidate in enumerate(view.slots):
            scraped = self._metrics.get(candidate.pod.key)
            if scraped is not None and now <= scraped.fresh_until:
                candidate.waiting = scraped.metrics.waiting
                candidate.kv_usage = scraped.metrics.kv_usage
                candidate.cpu_kv_usage = scraped.metrics.cpu_kv_usage
                state.stale.append((scraped.fresh_until, order))
            else:
                candidate.waiting = candidate.kv_usage = candidate.cpu_kv_usage = None
        heapq.heapify(state.stale)
        ready = [o for o, pod in enumerate(state.pods) if pod.ready]
        # Out of rotation: pods whose engine fails requests (5xx), and pods whose engine does
        # not answer its scrapes. If that leaves none, the unreachable ones come back first (a
        # metrics endpoint nobody can reach, say a wrong port, must not disable the 5xx rule),
        # then every ready pod (better a try than a certain 503).
        serving = [o for o in ready if not self.ejected(state.pods[o].key, now)]
        healthy = [o for o in serving if state.pods[o].key not in self._unreachable]
        heal = [
            h.ejected_until
            for o in ready
            if (h := self._health.get(state.pods[o].key)) is not None and h.ejected_until > now
        ]
        state.next_heal = min(heal, default=math.inf)
        state.now = now
        state.dirty = False
        view.set_members(healthy or serving or ready)

    def _expire_metrics(self, state: _Model, order: int, now: float) -> None:
        candidate = state.view.slots[order]
        scraped = self._metrics.get(candidate.pod.key)
        if scraped is not None and now <= scraped.fresh_until:
            return  # a later scrape pushed its own entry
        if (
            candidate.waiting is not None
            or candidate.kv_usage is not None
            or candidate.cpu_kv_usage is not None
        ):
            candidate.waiting = candidate.kv_usage = candidate.cpu_kv_usage = None
            state.view.changed(order)

    def _inflight_changed(self, key: str) -> None:
        slot = self._slot.get(key)
        if slot is not None:
            state, order = slot
            candidate = state.view.slots[order]
            running = self._inflight.get(key, 0) + self._remote.get(key, 0)
            load = self._load.get(key, 0.0)
            if candidate.running != running or candidate.load != load:
                candidate.running = running
                candidate.load = load
                state.view.changed(order)

    def acquire(self, pod: Pod, load: float = 0.0, prompt_tokens: int = 0) -> Lease:
        """Take an in-flight slot on `pod`; `load` is the request's share of it (SLO routing),
        `prompt_tokens` its prompt's (what the engine prefills before its first chunk)."""
        key = pod.key
        self._inflight[key] = self._inflight.get(key, 0) + 1
        if prompt_tokens > 0:
            self._inflight_prompt[key] = self._inflight_prompt.get(key, 0) + prompt_tokens
        else:
            prompt_tokens = 0
        self._routed[key] = self._routed.get(key, 0) + 1
        if load:
            self._load[key] = self._load.get(key, 0.0) + load
        self._inflight_changed(key)
        return Lease(self, pod, load, prompt_tokens)

    def pod_by_endpoint(self, endpoint: str) -> Pod | None:
        """The pod behind a `target-pod` IP:PORT (the counting filter knows only that)."""
        return self._by_endpoint.get(endpoint)

    def credit_tokens(self, key: str, output_tokens: int, estimated: bool = False) -> None:
        """Output tokens a pod completed, counted apart from the in-flight lease."""
        if output_tokens > 0 and key in self._pods:
            self._credit(key, output_tokens, estimated)

    def _credit(self, key: str, tokens: int, estimated: bool) -> None:
        self._counted[key] = self._counted.get(key, 0) + tokens
        if estimated:
            self._estimated[key] = self._estimated.get(key, 0) + tokens
        if key in self._engine_tokens:
            return  # the engine's own counter teaches its capacity
        if self._shared_tokens:
            self._unpublished[key] = self._unpublished.get(key, 0) + tokens
        else:
            self._capacity.add_tokens(key, tokens)

    def _on_release(
        self, lease: Lease, output_tokens: int, status: int, now: float | None, estimated: bool
    ) -> None:
        pod = lease.pod
        key = pod.key
        left = self._inflight.get(key, 0) - 1
        if left > 0:
            self._inflight[key] = left
            if lease.load:
                self._load[key] = max(0.0, self._load.get(key, 0.0) - lease.load)
        else:
            self._inflight.pop(key, None)
            self._load.pop(key, None)  # nothing in flight: exactly 0, whatever the float sums
        if lease.prompt_tokens:
            _take(self._inflight_prompt, key, lease.prompt_tokens)
        self._inflight_changed(key)
        if key in self._pods:  # else removed while in flight: do not resurrect its state
            if output_tokens > 0:
                self._credit(key, output_tokens, estimated)
            if status and now is not None:
                self._record_outcome(key, status >= 500, now)
                if status >= 500 and self.on_failure is not None:
                    self.on_failure(pod)
        if self.on_release is not None:
            self.on_release(pod)  # a freed slot may let a held request in

    def _record_outcome(self, key: str, failed: bool, now: float) -> None:
        h = self._health.get(key)
        if not failed:
            if h is not None:
                if h.ejected_until > now:
                    h.failures = 0  # a request from before the ejection: it does not end it
                else:
                    del self._health[key]
                    if h.ejections:
                        # The ejection is over as of this clock; a view last brought up to date
                        # by an older one still holds the pod out until it ends (`next_heal`).
                        self._mark_dirty(key)
            return
        if h is None:
            h = self._health[key] = _Health()
        h.failures += 1
        policy = self._ejection
        if h.failures >= policy.consecutive_5xx and h.ejected_until <= now:
            h.ejections += 1
            h.failures = 0
            doublings = min(h.ejections - 1, 30)  # bounded: a pod dead for days must not overflow
            h.ejected_until = now + min(policy.max_s, policy.base_s * 2**doublings)
            self._mark_dirty(key)

    def ejected(self, key: str, now: float) -> bool:
        """Out of rotation for a while: its engine kept failing requests (`EjectionPolicy`)."""
        h = self._health.get(key)
        return h is not None and h.ejected_until > now

    def unreachable(self, key: str) -> bool:
        """Out of rotation until its engine answers a metrics scrape again."""
        return key in self._unreachable

    def scrape_failed(self, key: str) -> None:
        """The engine did not answer its metrics scrape (dead, hung, or not 200): it leaves the
        candidates at once, not after some requests failed or hung on it, and comes back with
        the next scrape it answers. If every pod of a model is out, all stay candidates."""
        if key in self._pods and key not in self._unreachable:
            self._unreachable.add(key)
            self._mark_dirty(key)

    def _mark_dirty(self, key: str) -> None:
        slot = self._slot.get(key)
        if slot is not None:
            slot[0].dirty = True  # the routable set changes

    # background ------------------------------------------------------------------------------
    def update_metrics(self, key: str, metrics: EngineMetrics, now: float) -> None:
        if key not in self._pods:
            return
        if key in self._unreachable:
            # It answers again: back in rotation, and an ejection for failed requests (a dead
            # engine refusing connections) ends with it, instead of waiting out its backoff.
            self._unreachable.discard(key)
            self._health.pop(key, None)
            self._mark_dirty(key)
        scraped = self._metrics[key] = _Scraped(metrics, now, now + self._metrics_max_age_s)
        self._learn_generated(key, metrics, now)
        self._read_engine_cap(key, metrics.max_batch)
        self._learn_saturation(key, metrics, now)
        state, order = self._slot[key]
        candidate = state.view.slots[order]
        candidate.saturation = self._full_at(key)
        if state.dirty:
            return  # the next request recomputes the whole view
        if state.now <= scraped.fresh_until:
            candidate.waiting, candidate.kv_usage = metrics.waiting, metrics.kv_usage
            candidate.cpu_kv_usage = metrics.cpu_kv_usage
            stale = state.stale
            heapq.heappush(stale, (scraped.fresh_until, order))
            if len(stale) > 2 * len(state.view.slots) + 64:  # a model nobody asks for lately
                state.dirty = True
        else:
            candidate.waiting = candidate.kv_usage = candidate.cpu_kv_usage = None
        state.view.changed(order)

    def _learn_generated(self, key: str, metrics: EngineMetrics, now: float) -> None:
        """Credit the increase of the engine's generated-token counter since the last scrape,
        and watch the replica's speed with it (`SpeedWatch`: a sudden change rescales the
        capacity estimate at once; only where the counter grows step by step, as vLLM's does).

        The first value read is a baseline. A counter that went backwards belongs to a
        restarted engine: all of its value is new. An engine that stops exporting it (say, a
        restart with other flags) goes back to the gateway's counts. An engine whose KV cache
        is nearly full preempts and recomputes: its speed then says nothing about its GPU, and
        is not watched.
        """
        total, running = metrics.generation_tokens, metrics.running
        if total is None or not 0 <= total < math.inf:
            if self._engine_tokens.pop(key, None) is not None:
                self._capacity.set_fast(key, False)
            self._speed.pop(key, None)
            return
        last = self._engine_tokens.get(key)
        self._engine_tokens[key] = total
        seen = self._speed.get(key)
        ran = running if running is not None and 0 <= running < math.inf else None
        if ran is None:
            self._speed.pop(key, None)
        else:
            self._speed[key] = (SpeedWatch() if seen is None else seen[0], now, ran)
        if last is None:
            self._capacity.set_fast(key, True)  # tokens as generated: the short window
            return
        gained = total - last if total >= last else total
        if gained > 0:
            self._capacity.add_tokens(key, round(gained))
        if seen is not None and total < last:
            seen[0].interrupt()  # a restarted engine: the scrapes around it are not in a row
            self._gaps.pop(key, None)  # and its chunks (another stream interval) learned anew
        if seen is not None and ran is not None and total >= last:
            watch, then, ran_then = seen
            kv = metrics.kv_usage
            if not metrics.generation_tokens_stepwise or (kv is not None and kv >= KV_BOUND):
                watch.interrupt()
                return
            factor = watch.observe(gained, ran_then, ran, now - then)
            if factor is not None:
                self._speed_changed(key, factor, watch)  # routing sees it as this tick ends

    def _speed_changed(self, key: str, factor: float, seen_by: SpeedWatch | GapWatch) -> None:
        """`seen_by` saw the pod's speed change by `factor`: rescale its estimate once, and the
        pod's other watch takes the new speed as its usual (`rebase`)."""
        self._capacity.rescale(key, factor)
        self._rescaled[key] = self._rescaled.get(key, 0) + 1
        if isinstance(seen_by, GapWatch):
            self._rescaled_by_gaps[key] = self._rescaled_by_gaps.get(key, 0) + 1
        scrapes = self._speed.get(key)
        for other in (None if scrapes is None else scrapes[0], self._gaps.get(key)):
            if other is not None and other is not seen_by:
                other.rebase(factor)

    def stream_started(self, key: str, prompt_tokens: int = 0) -> None:
        """One of this gateway's responses from the pod sent its first chunk (its prompt of
        `prompt_tokens` was prefilled in the steps just run)."""
        if prompt_tokens <= 0:
            return  # nothing known to have been prefilled
        self._streaming_prompt[key] = self._streaming_prompt.get(key, 0) + prompt_tokens
        watch = self._gaps.get(key)
        if watch is not None:
            watch.started(prompt_tokens)

    def stream_ended(
        self, key: str, prompt_tokens: int = 0, output_tokens: int = 0, events: int = 0
    ) -> None:
        """A response that had started (`stream_started`, with the same `prompt_tokens`)
        ended, after `events` chunks that carried `output_tokens` (the watch learns how many
        tokens the pod sends a chunk)."""
        if prompt_tokens > 0:
            _take(self._streaming_prompt, key, prompt_tokens)
        watch = self._gaps.get(key)
        if watch is not None:
            watch.ended(output_tokens, events)

    def observe_chunk_gap(self, key: str, gap_s: float, count: int = 1) -> None:
        """Seconds between two chunks of one of the pod's streams (`count` streams saw it):
        its `GapWatch` rescales the capacity estimate when the pod's speed changed, and routing
        sees the new estimate at once, not at the end of the scrape tick. While some of this
        gateway's requests on the pod have no first chunk yet, its steps may carry their
        prefills: the watch counts their prompt tokens in the work that may explain a longer
        step."""
        if key not in self._pods:
            return
        watch = self._gaps.get(key)
        if watch is None:
            watch = self._gaps[key] = GapWatch()
        scraped = self._metrics.get(key)
        if scraped is not None and (kv := scraped.metrics.kv_usage) is not None and kv >= KV_BOUND:
            # A full KV cache preempts and recomputes: steps grow beyond the batch's share (the
            # scrape watch stops there too).
            watch.interrupt()
            return
        waiting = self._inflight_prompt.get(key, 0) - self._streaming_prompt.get(key, 0)
        batch = self._inflight.get(key, 0) + self._remote.get(key, 0)
        factor = watch.add(gap_s, count, batch, max(0, waiting))
        if factor is None:
            return
        self._speed_changed(key, factor, watch)
        slot = self._slot.get(key)
        if slot is not None:
            state, order = slot
            state.view.slots[order].capacity = self._capacity.estimate(key)
            if not state.dirty:
                state.view.reindex()  # the capacity sum moved too
        self._changed()

    def _read_engine_cap(self, key: str, cap: float | None) -> None:
        """Keep the batch cap the engine exports, if it exports one (a finite number >= 1); what
        was learned before it did is dropped. An engine that stops exporting it (a restart with
        another version) has its cap learned again."""
        if cap is None or not 1 <= cap < math.inf:
            self._engine_caps.pop(key, None)
            return
        self._engine_caps[key] = int(cap)
        self._saturation.pop(key, None)
        self._queue_streak.pop(key, None)

    def _learn_saturation(self, key: str, metrics: EngineMetrics, now: float) -> None:
        """An engine at its batch cap keeps a queue while running the most it has ever run:
        that number is its cap (unless the pod declares one, `Pod.max_num_seqs`, or its engine
        exports one: either wins).

        - Learned (or corrected) when a queue shows in `saturation_scrapes` scrapes in a row
          (4 by default) with the running count at the engine's peak in the first and never
          above it nor more than 1/64 of it below (a full engine, scraped between steps,
          reads its cap less the requests that finished in the step before), and the KV cache
          has room (usage below `KV_BOUND`). A request that just arrived waits for the
          next step, and a burst of long prompts for the step's token budget: that does not pin
          the running count scrape after scrape. An engine whose KV cache is full queues at
          whatever count fits, which is no batch cap (the KV term of the score handles it).
          A streak that begins on such a reading can learn a cap one or two below the real
          one; the first scrape that sees the batch full raises it.
        - Raised when the engine runs more than the cap; confirmed when it queues at the cap.
        - Probed: a cap the engine has not confirmed for `saturation_probe_s` grows by a quarter,
          if since then the gateways held as many requests on the pod as the cap while the
          engine queued none. A false cap stops the very traffic that would prove it wrong;
          the probe lets a little more through, and the engine either runs it (the cap was
          low) or queues at the old cap again (it is back at once). A cap nothing presses on
          stays.
        """
        held_back = self._waited_steps(key, metrics)
        running, waiting = metrics.running, metrics.waiting
        if running is None or waiting is None or not 1 <= running < math.inf:  # NaN, inf
            return
        pod = self._pods[key]
        if pod.max_num_seqs is not None or key in self._engine_caps:
            return
        peak = self._peak_running.get(key, 0.0)
        if running > peak:
            self._peak_running[key] = peak = running
        queued = waiting >= 1
        # Where the engine says how long its queue held requests, only a queue that held them
        # for steps counts (`HELD_STEPS`): at high load with long steps nearly every scrape
        # finds a few requests waiting for the next step, at a steady running count.
        held = queued and held_back is not False
        kv = metrics.kv_usage
        streak, top = 0, running
        if held and not (kv is not None and kv >= KV_BOUND):
            last = self._queue_streak.get(key)
            if last is not None and last[0] - max(1.0, last[0] / 64) <= running <= last[0]:
                top, streak = last[0], last[1] + 1  # held at (or just under) the same top
            elif running >= peak:
                streak = 1  # a new top: a queue at the peak starts a streak
        if streak:
            self._queue_streak[key] = (top, streak)
        else:
            self._queue_streak.pop(key, None)
        cap = self._saturation.get(key)
        if streak >= self._saturation_scrapes:
            self._saturation[key] = _Cap(int(top), now)
        elif cap is not None:
            if running > cap.value or (queued and running >= cap.value):
                cap.value, cap.confirmed, cap.pressed = max(cap.value, int(running)), now, False
                cap.probed_from = None
            elif cap.probed_from is not None and held and running >= cap.probed_from:
                # Probed, and the engine queues at the old cap again (or a little above it: the
                # old one was read just after some requests finished): back at once.
                cap.value = max(cap.probed_from, int(running))
                cap.confirmed, cap.probed_from = now, None
            else:
                # Pressed: the gateways hold as many requests on it as the cap lets through and
                # the engine queues none of them: the cap, not the engine, holds traffic back.
                on_pod = self._inflight.get(key, 0) + self._remote.get(key, 0)
                cap.pressed = cap.pressed or (on_pod >= cap.value and not queued)
                if cap.pressed and now - cap.confirmed > self._saturation_probe_s:
                    cap.probed_from = cap.value
                    cap.value = max(cap.value + 1, math.ceil(cap.value * 1.25))
                    cap.confirmed, cap.pressed = now, False

    def _waited_steps(self, key: str, metrics: EngineMetrics) -> bool | None:
        """Did the requests the engine counted in its queue-time histogram since the last scrape
        (vLLM counts a request when it finishes) wait `HELD_STEPS` steps or more on average?
        None when the engine does not say (no histograms, a first read, a restart, no step ran,
        none counted)."""
        qs, qc = metrics.queue_time_sum, metrics.queue_time_count
        ls, lc = metrics.token_latency_sum, metrics.token_latency_count
        if qs is None or qc is None or ls is None or lc is None:
            self._queue_clock.pop(key, None)
            return None
        now_sums = (qs, qc, ls, lc)
        if not all(0 <= v < math.inf for v in now_sums):  # NaN, inf, negative
            self._queue_clock.pop(key, None)
            return None
        last = self._queue_clock.get(key)
        self._queue_clock[key] = now_sums
        if last is None:
            return None
        waited, admitted, latency, tokens = (a - b for a, b in zip(now_sums, last, strict=True))
        if min(waited, admitted, latency, tokens) < 0 or tokens <= 0:
            return None  # a restarted engine, or one that ran no step
        if admitted <= 0:
            return None  # vLLM observes queue times as requests finish: none finished
        return waited / admitted >= HELD_STEPS * latency / tokens

    def refresh_capacity(self, now: float) -> None:
        """End of a scrape tick: capacity estimates move on, and the metrics just read count."""
        self._capacity.refresh(now)
        for state in self._models.values():
            moved = False
            for candidate in state.view.slots:
                estimate = self._capacity.estimate(candidate.pod.key)
                if estimate != candidate.capacity:
                    candidate.capacity = estimate
                    moved = True
            if moved and not state.dirty:
                state.view.reindex()  # here, on the scrape tick, not on a request
        self._changed()

    # shared state (several gateways) ---------------------------------------------------------
    def set_remote_inflight(self, counts: Mapping[str, int]) -> None:
        """Other gateways' in-flight counts per pod key (replaces the previous view)."""
        old, self._remote = self._remote, {k: v for k, v in counts.items() if v > 0}
        for key in old.keys() | self._remote.keys():
            if old.get(key) != self._remote.get(key):
                self._inflight_changed(key)
        self._changed()

    @property
    def shared_tokens(self) -> bool:
        """True while the capacity estimator is fed from the shared token counters."""
        return self._shared_tokens

    def take_unpublished_tokens(self) -> dict[str, int]:
        """Tokens counted while shared and not yet handed out; the caller adds them to the shared
        counters and must pass them to `leave_shared_tokens` if that may have failed."""
        taken, self._unpublished = self._unpublished, {}
        return taken

    def apply_shared_tokens(self, totals: Mapping[str, int | None]) -> None:
        """The shared counters as just read (after this gateway's taken tokens were added).

        Credits each pod's increase since the previous read; the first read after local mode
        only sets baselines. A missing counter reads as 0; one that went backwards (the store
        restarted or the key expired) started again from 0, so all of its value is new.
        """
        entering = not self._shared_tokens
        for key, total in totals.items():
            if key not in self._pods or key in self._engine_tokens:
                continue
            value = 0 if total is None or total < 0 else total
            last = self._shared_seen.get(key)
            self._shared_seen[key] = value
            if entering or last is None:
                continue
            gained = value - last if value >= last else value  # backwards: a restart from 0
            if gained > 0:
                self._capacity.add_tokens(key, gained)
        self._shared_tokens = True

    def leave_shared_tokens(self, taken: Mapping[str, int]) -> None:
        """The shared store failed: credit `taken` (maybe never stored) and anything unpublished
        to the estimator directly, forget the baselines, and count locally from now on."""
        for source in (taken, self._unpublished):
            for key, tokens in source.items():
                if tokens > 0 and key in self._pods:
                    self._capacity.add_tokens(key, tokens)
        self._unpublished = {}
        self._shared_seen.clear()
        self._shared_tokens = False

    # observation -----------------------------------------------------------------------------
    def inflight(self, key: str) -> int:
        """Requests this gateway has in flight on the pod."""
        return self._inflight.get(key, 0)

    def load(self, key: str) -> float:
        """Summed share of the pod this gateway's requests take (SLO routing's accounting)."""
        return self._load.get(key, 0.0)

    def remote_inflight(self, key: str) -> int:
        """Requests other gateways have in flight on the pod, as last synced."""
        return self._remote.get(key, 0)

    def routed_total(self, key: str) -> int:
        return self._routed.get(key, 0)

    def output_tokens_total(self, key: str) -> int:
        """Output tokens this gateway counted from the pod (other gateways' not included)."""
        return self._counted.get(key, 0)

    def estimated_tokens_total(self, key: str) -> int:
        """Of `output_tokens_total`, the tokens the engine did not report (estimated)."""
        return self._estimated.get(key, 0)

    def token_source(self, key: str) -> str:
        """Where the pod's capacity is learned from: `engine` (its generated-token counter)
        or `gateway` (the output tokens counted in its responses)."""
        return "engine" if key in self._engine_tokens else "gateway"

    def capacity(self, key: str) -> float | None:
        return self._capacity.estimate(key)

    def scraped(self, key: str) -> tuple[EngineMetrics, float] | None:
        """The pod's last engine metrics and the clock time they count until, if any."""
        entry = self._metrics.get(key)
        return None if entry is None else (entry.metrics, entry.fresh_until)

    def _full_at(self, key: str) -> int | None:
        """The in-flight count at which the full-batch rule passes a replica over: its declared
        cap (or the one its engine exports), or its learned cap plus a 1/64 slack. A learned cap
        can read a request or two low (a full engine scraped just after some requests finished);
        fenced exactly there, the engine would never run its real batch and the cap would never
        be raised to it."""
        cap = self.saturation(key)
        if cap is None or self.saturation_source(key) != "learned":
            return cap
        return cap + max(1, cap // 64)

    def saturation(self, key: str) -> int | None:
        """The engine's batch cap: declared by its pod, else exported by its engine, else
        learned; None while unknown."""
        pod = self._pods.get(key)
        if pod is not None and pod.max_num_seqs is not None:
            return pod.max_num_seqs
        exported = self._engine_caps.get(key)
        if exported is not None:
            return exported
        entry = self._saturation.get(key)
        return None if entry is None else entry.value

    def saturation_source(self, key: str) -> str | None:
        """Where `saturation` comes from: `declared` (the pod says: pods file, annotation,
        engine flag), `engine` (the engine's metrics export it), `learned`, or None (unknown)."""
        pod = self._pods.get(key)
        if pod is not None and pod.max_num_seqs is not None:
            return "declared"
        if key in self._engine_caps:
            return "engine"
        return "learned" if key in self._saturation else None

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-ready view for /debug/pods and tests."""
        pods: dict[str, Any] = {}
        for key, pod in sorted(self._pods.items()):
            scraped = self._metrics.get(key)
            gaps = self._gaps.get(key)
            pods[key] = {
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
                "inflight": self.inflight(key),
                "inflight_remote": self.remote_inflight(key),
                "load": round(self.load(key), 6),
                "routed_total": self.routed_total(key),
                "output_tokens_total": self.output_tokens_total(key),
                "output_tokens_estimated": self.estimated_tokens_total(key),
                "token_source": self.token_source(key),
                "capacity_tokens_per_s": self.capacity(key),
                "speed_changes": self._rescaled.get(key, 0),
                "speed_changes_from_chunk_gaps": self._rescaled_by_gaps.get(key, 0),
                # Output tokens per chunk of its streams, as the chunk-gap watch learned it.
                "tokens_per_chunk": round(gaps.per_event, 2)
                if gaps is not None and gaps.per_event_learned
                else None,
                "saturation": self.saturation(key),
                "saturation_source": self.saturation_source(key),
                "ejected": self.ejected(key, now),
                "unreachable": key in self._unreachable,
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


def _take(counts: dict[str, int], key: str, n: int) -> None:
    """Take `n` from a per-pod count, dropping the pod's entry at zero (never below)."""
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
