"""The gateway's view of its pods: discovery's list, in-flight counts, engine metrics, capacity.

Pure state with time passed in. The ext_proc adapter asks it for candidates and takes a `Lease`
per routed request; the lease gives the in-flight slot back exactly once and credits the counted
output tokens to the replica's capacity counter.

Each pod has one record (`plugin.core.pool_state`); batch-cap learning (`batch_cap`), speed
watches (`pod_speed`) and shared token counters (`shared_tokens`) are their own classes. Other
gateways' in-flight counts (`set_remote_inflight`, fed by a sync loop outside the core) add to a
candidate's `running`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from plugin.core.batch_cap import CapLearning
from plugin.core.capacity import CapacityEstimator
from plugin.core.config_profile import ModelConfig
from plugin.core.fair_start import (
    SLOW_START_MIN,
    SLOW_START_WINDOW_S,
    slow_start_share,
    starting_capacities,
)
from plugin.core.lease import Lease
from plugin.core.pod_speed import PodSpeed
from plugin.core.pool_state import EjectionPolicy, ModelState, PodRecord, Scraped
from plugin.core.profile import GpuProfile, ProfileBook
from plugin.core.shared_tokens import SharedTokens
from plugin.core.types import Candidate, EngineMetrics, Pod
from plugin.core.view import CandidateView, usable_capacity
from plugin.errors import NoReadyPod, UnknownModel

__all__ = ["EjectionPolicy", "Learned", "Lease", "PodPool"]

# What one replica learned of a pod from scraping it, for the others (`PodPool.learned`):
# (capacity estimate, short window, batch cap, where the cap comes from).
Learned = tuple[float | None, bool, int | None, str | None]


class PodPool:
    """Discovery's pods of every model, one record each, and the candidate views routing reads."""

    __slots__ = (
        "_by_endpoint",
        "_capacity",
        "_caps",
        "_ejection",
        "_fair_start",
        "_metrics_max_age_s",
        "_models",
        "_now",
        "_pods",
        "_profiles",
        "_ready_since",
        "_records",
        "_remote",
        "_remote_load",
        "_shared",
        "_slow_start",
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
        fair_start: bool = True,
        slow_start_s: float = SLOW_START_WINDOW_S,
        slow_start_min: float = SLOW_START_MIN,
    ) -> None:
        """`fair_start`: a pod without a learned capacity starts from its deployment's peers
        (`plugin.core.fair_start`); False leaves it without one (scored at the pool's mean).
        `slow_start_s`: the start is ramped in over this long from `slow_start_min` of it
        (0: no ramp)."""
        self._capacity = capacity
        self._fair_start = fair_start
        self._slow_start = (slow_start_s, slow_start_min)
        self._ready_since: dict[str, float] = {}  # pods scored at a start: first tick ready
        self._now: float | None = None  # the last capacity refresh
        self._caps = CapLearning(saturation_probe_s, saturation_scrapes)
        self._ejection = ejection or EjectionPolicy()
        self._metrics_max_age_s = metrics_max_age_s
        self._pods: dict[str, Pod] = {}  # discovery's list, in its order
        self._records: dict[str, PodRecord] = {}  # listed pods, and removed ones with leases
        self._by_endpoint: dict[str, Pod] = {}
        self._models: dict[str, ModelState] = {}
        self._profiles: ProfileBook | None = None  # GPU profiles by deployment (SLO routing)
        # Other gateways' in-flight counts per pod, as the last sync read them (replaced whole).
        self._remote: dict[str, int] = {}
        self._remote_load: dict[str, float] = {}  # and the SLO load they take of each pod
        self._shared = SharedTokens()
        self.loaded = False  # True once discovery delivered its first list
        # Told after every lease release or shrink (`Lease.streaming`): the router wakes
        # requests held for that model.
        self.on_release: Callable[[Pod], None] | None = None
        # A request on this pod failed (5xx): the scraper checks the engine at once, so a dead
        # one leaves rotation after one failure instead of at the next scrape tick.
        self.on_failure: Callable[[Pod], None] | None = None
        # Told after anything else that may let a held request in: new pods, a scrape tick
        # (metrics and capacity), other gateways' counts.
        self.on_change: Callable[[], None] | None = None

    def _listed(self, key: str) -> PodRecord | None:
        record = self._records.get(key)
        return record if record is not None and record.listed else None

    # discovery -------------------------------------------------------------------------------
    def set_pods(self, pods: Iterable[Pod]) -> None:
        """Replace the pod list. State of pods that stay is kept; in-flight counts of removed
        pods stay until their leases release (no count is lost or leaked)."""
        new = {p.key: p for p in pods}
        by_model: dict[str, list[Pod]] = {}
        records = self._records
        for key in self._pods.keys() - new.keys():
            self._capacity.forget(key)
            self._ready_since.pop(key, None)
            gone = records.pop(key)
            if gone.inflight:  # its streams still end (`stream_ended`), also if it comes back
                records[key] = gone.leases_only()
        for pod in new.values():
            by_model.setdefault(pod.model, []).append(pod)
            self._capacity.ensure(pod.key)
            kept = records.get(pod.key)
            if kept is None:
                records[pod.key] = PodRecord()
            else:
                kept.listed, kept.slot = True, None
        self._pods = new
        self._by_endpoint = {p.endpoint: p for p in new.values()}
        old_models, self._models = self._models, {}
        for model, model_pods in by_model.items():
            state = old_models.get(model)
            if state is None or state.pods != model_pods:  # else the model kept its view
                state = self._new_model(model, model_pods, state)
            self._models[model] = state
            for order, pod in enumerate(model_pods):
                records[pod.key].slot = (state, order)
        self.loaded = True
        self._changed()

    def _new_model(self, model: str, pods: list[Pod], old: ModelState | None) -> ModelState:
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
        state = ModelState(
            CandidateView(model, slots), pods, any(p.ready for p in pods), config=config
        )
        self._set_capacities(state)  # new pods start from their peers (a new view: dirty)
        return state

    def _new_candidate(self, pod: Pod) -> Candidate:
        key = pod.key
        record = self._records[key]
        return Candidate(
            pod,
            record.inflight + self._remote.get(key, 0),
            None,
            None,
            self._capacity.estimate(key),
            record.cap.full_at(pod.max_num_seqs),
            record.load + self._remote_load.get(key, 0.0),
            self._profile_of(pod),
            prefill_free_at=record.prefill_free_at,
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
            if self._set_capacities(state) and not state.dirty:  # starts may scale by them
                state.view.reindex()
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
            state.recompute(now, self._records)
        else:  # the common case, inline: nothing expired
            state.now = now
            stale = state.stale
            if stale and stale[0][0] < now:
                state.expire(now, self._records)
        return state.view

    def _inflight_changed(self, key: str, record: PodRecord | None) -> None:
        if record is None or record.slot is None:
            return
        state, order = record.slot
        candidate = state.view.slots[order]
        running = record.inflight + self._remote.get(key, 0)
        load = record.load + self._remote_load.get(key, 0.0)
        candidate.prefill_free_at = record.prefill_free_at  # no index orders by it
        if candidate.running != running or candidate.load != load:
            candidate.running = running
            candidate.load = load
            state.view.changed(order)

    def acquire(
        self,
        pod: Pod,
        load: float = 0.0,
        prompt_tokens: int = 0,
        streaming_load: float | None = None,
        now: float | None = None,
    ) -> Lease:
        """Take an in-flight slot on `pod`; `load` is the request's share of it (SLO routing)
        until its response streams, `streaming_load` from then on (`Lease.streaming`; None: the
        same), `prompt_tokens` its prompt's (what the engine prefills before its first chunk).
        With `now` (a request routed here, not one adopted from another gateway) its prompt
        joins the pod's prefill queue (`Candidate.prefill_free_at`)."""
        key = pod.key
        record = self._records.get(key)
        if record is None:  # a pod the caller knows and discovery no longer lists
            record = self._records[key] = PodRecord(listed=False)
        prompt_tokens = max(prompt_tokens, 0)
        record.take(load, prompt_tokens)
        if now is not None and prompt_tokens and record.slot is not None:
            state, order = record.slot
            profile = state.view.slots[order].profile
            speed = None if profile is None else profile.prefill_tokens_per_s
            if speed:
                start = max(now, record.prefill_free_at)
                record.prefill_free_at = start + prompt_tokens / speed
        self._inflight_changed(key, record)
        return Lease(self, pod, load, prompt_tokens, streaming_load)

    def lease_streaming(self, lease: Lease) -> None:
        """`Lease.streaming`'s work: the pod's load drops to the lease's streaming share."""
        key = lease.key
        record = self._records[key]
        record.load = max(0.0, record.load - (lease.load - lease.streaming_load))
        lease.load = lease.streaming_load
        self._inflight_changed(key, record)
        if self.on_release is not None:
            self.on_release(lease.pod)

    def pod_by_endpoint(self, endpoint: str) -> Pod | None:
        """The pod behind a `target-pod` IP:PORT (the counting filter knows only that)."""
        return self._by_endpoint.get(endpoint)

    def credit_tokens(self, key: str, output_tokens: int, estimated: bool = False) -> None:
        """Output tokens a pod completed, counted apart from the in-flight lease."""
        record = self._listed(key)
        if output_tokens > 0 and record is not None:
            self._credit(key, record, output_tokens, estimated)

    def _credit(self, key: str, record: PodRecord, tokens: int, estimated: bool) -> None:
        record.counted += tokens
        if estimated:
            record.estimated += tokens
        if record.speed.engine_tokens is None:  # else the engine's counter teaches capacity
            self._shared.credit(self._capacity, key, record, tokens)

    def lease_ended(
        self, lease: Lease, output_tokens: int, status: int, now: float | None, estimated: bool
    ) -> None:
        """`Lease.release`'s work: the counts return, the tokens and the status are learned."""
        pod = lease.pod
        key = pod.key
        record = self._records[key]
        record.give_back(lease.load, lease.prompt_tokens)
        self._inflight_changed(key, record)
        if not record.listed:  # removed while in flight: nothing to learn, maybe nothing left
            if not record.inflight:
                del self._records[key]
        else:
            if output_tokens > 0:
                self._credit(key, record, output_tokens, estimated)
            if status and now is not None:
                record.record_outcome(status >= 500, now, self._ejection)
                if status >= 500 and self.on_failure is not None:
                    self.on_failure(pod)
        if self.on_release is not None:
            self.on_release(pod)  # a freed slot may let a held request in

    def ejected(self, key: str, now: float) -> bool:
        """Out of rotation for a while: its engine kept failing requests (`EjectionPolicy`)."""
        record = self._records.get(key)
        return record is not None and record.ejected(now)

    def unreachable(self, key: str) -> bool:
        """Out of rotation until its engine answers a metrics scrape again."""
        record = self._records.get(key)
        return record is not None and record.unreachable

    def tokens_per_chunk(self, key: str) -> float | None:
        """Output tokens per chunk of the pod's streams, once its chunk-gap watch learned it
        from streams that ended with the engine's count (None before, or for an unknown pod)."""
        record = self._records.get(key)
        return None if record is None else record.speed.tokens_per_chunk()

    def metrics_unusable(self, key: str) -> str | None:
        """Why the engine's last answer to a scrape was of no use; None if it was usable."""
        record = self._records.get(key)
        return None if record is None else record.metrics_unusable

    def scrape_failed(self, key: str) -> None:
        """The engine did not answer its metrics scrape (refused, reset or timed out: dead or
        hung): it leaves the candidates at once, not after some requests failed or hung on it,
        and comes back with the next scrape it answers. If every pod of a model is out, all
        stay candidates."""
        if (record := self._listed(key)) is not None:
            record.unanswered()

    def scrape_unusable(self, key: str, why: str) -> None:
        """The engine answered its metrics scrape with nothing usable (`why`: not 200, no known
        metric...): it is alive, so it stays in (or comes back to) rotation, routed by this
        gateway's in-flight counts and learned capacity while its engine metrics go stale."""
        if (record := self._listed(key)) is not None:
            record.answered(why)

    # background ------------------------------------------------------------------------------
    def update_metrics(
        self, key: str, metrics: EngineMetrics, now: float, learned: Learned | None = None
    ) -> None:
        """A scrape of the pod, made at `now`: its capacity and batch cap are learned from it,
        or, with `learned` (what the replica that scraped it learned: `PodPool.learned` there),
        taken as they are. Taken, the replicas sharing the scrapes see the same capacity and
        cap, and a replica spends on each pod it does not scrape about half of what learning
        it cost (`docs/plugin-cost.md`)."""
        record = self._listed(key)
        if record is None:
            return
        record.answered(None)
        scraped = record.scraped = Scraped(metrics, now, now + self._metrics_max_age_s)
        declared = self._pods[key].max_num_seqs
        if learned is None:
            record.speed.read_generated(self._capacity, key, metrics, now)
            on_pod = record.inflight + self._remote.get(key, 0)
            record.cap.read(metrics, now, declared, on_pod, self._caps)
        else:
            estimate, fast, cap, cap_source = learned
            # Not fast: the gateways' counts teach the capacity, here as there (a counter in
            # the metrics notwithstanding: its capacity is not adopted, so its counts go on).
            record.speed.adopt(metrics if fast else None)
            self._capacity.adopt(key, estimate, fast)
            record.cap.adopt(cap, cap_source, now)
        assert record.slot is not None  # every listed pod has one
        state, order = record.slot
        state.show_scrape(order, scraped, record.cap.full_at(declared))

    def learned(self, key: str) -> Learned:
        """What this replica learned of the pod from its scrapes, for the replicas that take
        it (`update_metrics`): its capacity estimate and whether its window is the short one,
        its batch cap and where that comes from (the pod's declaration left out: each replica
        has it)."""
        record = self._listed(key)
        if record is None:
            return None, False, None, None
        capacity = self._capacity
        cap = record.cap
        return capacity.estimate(key), capacity.is_fast(key), cap.value(None), cap.source(None)

    def stream_started(self, key: str, prompt_tokens: int = 0) -> None:
        """One of this gateway's responses from the pod sent its first chunk (its prompt of
        `prompt_tokens` was prefilled in the steps just run)."""
        if (record := self._records.get(key)) is not None:
            record.stream_started(prompt_tokens)

    def stream_ended(
        self, key: str, prompt_tokens: int = 0, output_tokens: int = 0, events: int = 0
    ) -> None:
        """A response that had started (`stream_started`, with the same `prompt_tokens`)
        ended, after `events` chunks that carried `output_tokens` (the watch learns how many
        tokens the pod sends a chunk)."""
        if (record := self._records.get(key)) is not None:
            record.stream_ended(prompt_tokens, output_tokens, events)

    def stream_alive(self, key: str, now: float) -> None:
        """A chunk of one of the pod's open streams came at `now` (for `silent`)."""
        if (record := self._records.get(key)) is not None:
            record.last_chunk_at = now

    def silent(self, now: float, silent_s: float) -> list[Pod]:
        """Listed pods in rotation with open streams none of which sent a chunk for over
        `silent_s`: an engine that hung mid-generation. The scraper probes them at once, so
        the hang is seen within about two scrape timeouts, not at the next scrape tick after
        more requests were routed into it. Each silence is told once (`PodRecord.tell_silence`)."""
        return [self._pods[k] for k, r in self._records.items() if r.tell_silence(now, silent_s)]

    def observe_chunk_gap(self, key: str, gap_s: float, count: int = 1) -> None:
        """Seconds between two chunks of one of the pod's streams (`count` streams saw it):
        its `GapWatch` rescales the capacity estimate when the pod's speed changed, and routing
        sees the new estimate at once, not at the end of the scrape tick. While some of this
        gateway's requests on the pod have no first chunk yet, its steps may carry their
        prefills: the watch counts their prompt tokens in the work that may explain a longer
        step."""
        record = self._listed(key)
        if record is None:
            return
        scraped = record.scraped
        waiting = record.inflight_prompt - record.streaming_prompt
        batch = record.inflight + self._remote.get(key, 0)
        kv = None if scraped is None else scraped.metrics.kv_usage
        if not record.speed.read_gap(self._capacity, key, gap_s, count, batch, waiting, kv):
            return
        if record.slot is not None:
            state = record.slot[0]
            self._set_capacities(state)  # peers may start from this estimate
            if not state.dirty:
                state.view.reindex()  # the capacity sum moved too
        self._changed()

    def refresh_capacity(self, now: float) -> None:
        """End of a scrape tick: capacity estimates move on, and the metrics just read count."""
        self._capacity.refresh(now)
        self._now = now
        for state in self._models.values():
            if self._set_capacities(state) and not state.dirty:
                state.view.reindex()  # here, on the scrape tick, not on a request
        self._changed()

    def _set_capacities(self, state: ModelState) -> bool:
        """Each candidate's capacity: its learned estimate, else where it starts
        (`plugin.core.fair_start`). True when one moved."""
        estimate = self._capacity.estimate
        slots = state.view.slots
        learned = [estimate(candidate.pod.key) for candidate in slots]
        found: dict[str, tuple[float, str]] = {}
        # Starts only for pods without a learned capacity: none in a settled fleet, where
        # looking for them again cost a pass over the pods each tick.
        if self._fair_start and not all(map(usable_capacity, learned)):
            profiles = None if self._profiles is None else self._profile_of
            found = starting_capacities(state.pods, estimate, profiles)
        starts = state.starts = self._ramped(found) if found else {}
        moved = False
        for candidate, capacity in zip(slots, learned, strict=True):
            start = starts.get(candidate.pod.key) if starts else None
            if start is not None:
                capacity = start[0]
            if capacity != candidate.capacity:
                candidate.capacity = capacity
                moved = True
        return moved

    def _ramped(self, found: dict[str, tuple[float, str]]) -> dict[str, tuple[float, str, float]]:
        """Starts scored at their slow-start share (`plugin.core.fair_start`): a pod's age counts
        from the last capacity refresh (the scrape tick) before it was first seen ready. Costs
        per pod without an estimate, not per pod."""
        window, least = self._slow_start
        now, since, pods = self._now, self._ready_since, self._pods
        ramped: dict[str, tuple[float, str, float]] = {}
        for key, (capacity, source) in found.items():
            first = since.get(key)
            if first is None and now is not None and (pod := pods.get(key)) and pod.ready:
                first = since[key] = now
            age = 0.0 if first is None or now is None else now - first
            share = slow_start_share(age, window, least)
            ramped[key] = (capacity * share, source, share)
        return ramped

    # shared state (several gateways) ---------------------------------------------------------
    def set_remote_inflight(
        self, counts: Mapping[str, int], loads: Mapping[str, float] | None = None
    ) -> None:
        """Other gateways' in-flight counts and SLO loads per pod key (replaces the previous
        view; no `loads`: none)."""
        old_counts, old_loads = self._remote, self._remote_load
        counts = self._remote = {k: v for k, v in counts.items() if v > 0}
        loads = self._remote_load = {k: v for k, v in (loads or {}).items() if v > 0}
        # Only the pods whose share moved: at 10,000 pods a call per pod every sync (100 ms)
        # was a tenth of a core.
        moved = {k for k in old_counts.keys() | counts.keys() if old_counts.get(k) != counts.get(k)}
        moved.update(k for k in old_loads.keys() | loads.keys() if old_loads.get(k) != loads.get(k))
        records = self._records
        for key in moved:
            self._inflight_changed(key, records.get(key))
        self._changed()

    @property
    def shared_tokens(self) -> bool:
        """True while the capacity estimator is fed from the shared token counters."""
        return self._shared.active

    def take_unpublished_tokens(self) -> dict[str, int]:
        """Tokens counted while shared and not yet handed out; the caller adds them to the shared
        counters and must pass them to `leave_shared_tokens` if that may have failed."""
        return self._shared.take(self._records)

    def apply_shared_tokens(self, totals: Mapping[str, int | None]) -> None:
        """The shared counters as just read, after this gateway's taken tokens were added."""
        self._shared.apply(self._capacity, self._records, totals)

    def leave_shared_tokens(self, taken: Mapping[str, int]) -> None:
        """The shared store failed: `taken` may never have been stored; count locally."""
        self._shared.leave(self._capacity, self._records, taken)

    # observation (of one pod, by key; 0 or None for a pod the pool does not know) -----------
    def inflight(self, key: str) -> int:
        """Requests this gateway has in flight on the pod."""
        return r.inflight if (r := self._records.get(key)) else 0

    def prompt_tokens(self, key: str) -> tuple[int, int]:
        """Prompt tokens of this gateway's requests in flight on the pod, and of those the ones
        whose first chunk came (prefilled)."""
        return (r.inflight_prompt, r.streaming_prompt) if (r := self._records.get(key)) else (0, 0)

    def load(self, key: str) -> float:
        """Summed share of the pod this gateway's requests take (SLO routing's accounting)."""
        return r.load if (r := self._records.get(key)) else 0.0

    def remote_inflight(self, key: str) -> int:
        """Requests other gateways have in flight on the pod, as last synced."""
        return self._remote.get(key, 0)

    def remote_load(self, key: str) -> float:
        """The SLO load other gateways' requests take of the pod, as last synced."""
        return self._remote_load.get(key, 0.0)

    def routed_total(self, key: str) -> int:
        return r.routed if (r := self._records.get(key)) else 0

    def output_tokens_total(self, key: str) -> int:
        """Output tokens this gateway counted from the pod (other gateways' not included)."""
        return r.counted if (r := self._listed(key)) else 0

    def estimated_tokens_total(self, key: str) -> int:
        """Of `output_tokens_total`, the tokens the engine did not report (estimated)."""
        return r.estimated if (r := self._listed(key)) else 0

    def token_source(self, key: str) -> str:
        """`engine` (capacity learned from its generated-token counter) or `gateway`."""
        return r.token_source if (r := self._listed(key)) else "gateway"

    def speed(self, key: str) -> PodSpeed | None:
        """The pod's engine counter and speed watches."""
        return r.speed if (r := self._listed(key)) else None

    def capacity(self, key: str) -> float | None:
        return self._capacity.estimate(key)

    def _start(self, pod: Pod) -> tuple[float, str, float] | None:
        """Where a pod without a learned capacity starts, as routing scores it."""
        state = self._models.get(pod.model)
        return None if state is None else state.starts.get(pod.key)

    def scraped(self, key: str) -> tuple[EngineMetrics, float] | None:
        """The pod's last engine metrics and the clock time they count until."""
        entry = r.scraped if (r := self._records.get(key)) else None
        return None if entry is None else (entry.metrics, entry.fresh_until)

    def saturation(self, key: str) -> int | None:
        """The engine's batch cap: declared by its pod, else exported by its engine, else
        learned; None while unknown."""
        return r.cap.value(self._pods[key].max_num_seqs) if (r := self._listed(key)) else None

    def saturation_source(self, key: str) -> str | None:
        """Where `saturation` comes from: `declared` (the pod says: pods file, annotation,
        engine flag), `engine` (the engine's metrics export it), `learned`, or None (unknown)."""
        return r.cap.source(self._pods[key].max_num_seqs) if (r := self._listed(key)) else None

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-ready view for /debug/pods and tests."""
        pods = {
            key: self._records[key].describe(
                pod, now, self.remote_inflight(key), self.capacity(key), self._start(pod)
            )
            for key, pod in sorted(self._pods.items())
        }
        for key, described in pods.items():
            # The replica that scrapes the pod learned its capacity and batch cap.
            described["learned_by_scraping_replica"] = self._capacity.is_adopted(key)
        orphans = {k: r.inflight for k, r in self._records.items() if not r.listed and r.inflight}
        return {"pods": pods, "inflight_removed_pods": orphans}
