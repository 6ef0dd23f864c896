"""From a parsed request to a lease on one pod, now or later: the decision, without protobuf.

`Router.admit` asks the request's strategy once. `Route` takes the in-flight lease at once and
returns a `Decision`; `Reject` raises its error; `Wait` parks the request as a `Waiter` in its
model's queue (first come, first asked). Whenever a lease is released or the pool changes (new
pods, a scrape tick, other gateways' counts; the pool tells the router), the waiting requests of
that model (or of all models) are asked again in arrival order; at a waiter's deadline the
adapter calls `expire`, which asks once more and then rejects. A waiter tells its owner through
`notify` (the ext_proc adapter resolves an asyncio future with it) and the owner takes the
outcome with `result()`.
If the owner goes away first (the client cancelled), `cancel()` takes the waiter out of the
queue and gives back a lease it was granted but never took: nothing leaks.

The router never sleeps and never reads a clock of its own: time comes from the injected clock,
and waiting is the adapter's business. Nor does it log: what an operator should hear (a request
beyond a GPU profile's grid, a profile cell off from served traffic; `plugin.core.drift`) goes
to `on_warning`, which the gateway logs. `docs/architecture.md` draws the whole path.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plugin.core.admission import (
    LOOK_PAST,
    Admission,
    Charge,
    FairQueue,
    gpu_seconds,
    has_room,
    with_room,
)
from plugin.core.config_profile import ConfigProfile, overridden
from plugin.core.drift import BeyondGrid, ProfileDrift
from plugin.core.latency import (
    DECISION_BUCKETS_S,
    ClientLatency,
    Felt,
    Histogram,
    SloOutcomes,
)
from plugin.core.limits import Reservation
from plugin.core.pool import Lease, PodPool
from plugin.core.profile import ProfiledRoute
from plugin.core.strategies import OutputHistory, Reject, Route, Strategy, Wait, blend
from plugin.core.strategies.base import FALLBACK
from plugin.core.strategies.gate import ImbalanceGate, Wrapped
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import (
    NoMatchingPod,
    Overloaded,
    QueueFull,
    RequestError,
    RoutingFailed,
    SloUnmeetable,
    UnknownStrategy,
)

__all__ = [
    "RATIO_BUCKETS",
    "WAIT_BUCKETS_S",
    "Decision",
    "PredictionStats",
    "Router",
    "WaitStats",
    "Waiter",
]

_RESOLVED_CACHE = 1024  # routing-strategy strings kept resolved

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Actual / predicted latency: 1.0 is a profile that predicts exactly; finer steps around it.
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


class WaitStats:
    """How long held requests waited, routed or rejected (a histogram read by /metrics). Why
    they were rejected is in the request-error counts, by error class, like every other error."""

    __slots__ = ("by_outcome",)

    def __init__(self) -> None:
        self.by_outcome = {routed: Histogram(WAIT_BUCKETS_S) for routed in (True, False)}

    def observe(self, waited_s: float, routed: bool) -> None:
        self.by_outcome[routed].observe(waited_s)


class PredictionStats:
    """How a request's end-to-end latency compared with its GPU profile's prediction: actual /
    predicted, per deployment, for requests an SLO strategy routed and an engine served (200).
    The prediction is the cell's E2E at the pod's load when the request was routed
    (`GpuProfile.e2e_at`); per cell, `plugin.core.drift` keeps the same comparison.

    Actual runs from the routing decision (after any wait at the gateway) to the end of the
    response, so it measures the profile, not the queue (the wait histogram has that).
    """

    __slots__ = ("ratios",)

    def __init__(self) -> None:
        self.ratios: dict[str, Histogram] = {}

    def observe(self, deployment: str, predicted_s: float, actual_s: float) -> None:
        if not predicted_s > 0 or actual_s < 0:
            return
        buckets = self.ratios.get(deployment)
        if buckets is None:
            buckets = self.ratios[deployment] = Histogram(RATIO_BUCKETS)
        buckets.observe(actual_s / predicted_s)


@dataclass(frozen=True, slots=True)
class Decision:
    lease: Lease
    strategy: str
    request: RequestInfo
    routed_at: float = 0.0
    expected_e2e_s: float | None = None  # the profile's prediction, when a strategy made one
    profiled: ProfiledRoute | None = None  # where it sits in its GPU profile (SLO strategies)
    # The adapter's OpenTelemetry spans of this request (`plugin.adapters.otel`), opaque here.
    spans: Any = None
    # What admission charged its tenant when it was routed (None: admission is off).
    charge: Charge | None = None
    # What it holds of its tenant's rate limits until it ends (None: not limited).
    reservation: Reservation | None = None


class Waiter:
    """A request held by its strategy until it can be routed, rejected, or its deadline passes."""

    __slots__ = (
        "_cancelled",
        "_decision",
        "_error",
        "_router",
        "_taken",
        "admitting",
        "deadline",
        "notify",
        "on_timeout",
        "priority",
        "request",
        "reservation",
        "since",
        "strategy",
    )

    def __init__(
        self, router: Router, request: RequestInfo, strategy: Strategy, wait: Wait
    ) -> None:
        self._router = router
        self.request = request
        self.strategy = strategy
        self.deadline = wait.deadline
        self.on_timeout = wait.timeout_error()
        self.priority = wait.priority
        self.since = router.now()  # when it started to wait
        self._decision: Decision | None = None
        self._error: RequestError | None = None
        self._taken = False
        self._cancelled = False
        # Held by admission (in its model's fair queue) rather than by its strategy.
        self.admitting = False
        # What it holds of its tenant's rate limits, given back unless it is routed.
        self.reservation: Reservation | None = None
        # Called once when the outcome is known (granted or rejected); the owner then calls
        # `result()`. Also called, with no outcome yet (`done` False), when admission hands the
        # request to a strategy that holds it with another deadline: the owner re-reads
        # `deadline`. Set by the owner; the default does nothing.
        self.notify: Callable[[], None] = _nothing

    @property
    def done(self) -> bool:
        """True once granted a lease, rejected or cancelled: nothing will ask for it again."""
        return self._decision is not None or self._error is not None or self._cancelled

    def result(self) -> Decision:
        """The granted decision (the caller now owns its lease); raises the rejection."""
        if self._error is not None:
            raise self._error
        if self._decision is None:
            raise RuntimeError("the waiter has no outcome yet")
        self._taken = True
        return self._decision

    def cancel(self) -> None:
        """The owner gives up: leave the queue; a granted lease not taken is released."""
        self._cancelled = True
        self._router._forget(self)
        if self._decision is None or not self._taken:
            self._router._give_back(self.reservation)
        if self._decision is not None and not self._taken:
            self._taken = True
            self._decision.lease.release()
            self._router._refund(self._decision)

    def _settle(self, decision: Decision | None, error: RequestError | None) -> None:
        self._decision, self._error = decision, error
        self.notify()


def _nothing() -> None:
    return None


def _unheard(message: str) -> None:
    return None


class _Table:
    """Strategies with the settings they route with (the gateway's, or a config profile's),
    and the resolution of `routing-strategy` strings against them, cached."""

    __slots__ = ("auto_blend", "gate", "resolved", "strategies")

    def __init__(
        self,
        strategies: Mapping[str, Strategy],
        auto_blend: blend.AutoBlend | None,
        gate: ImbalanceGate | None,
    ) -> None:
        self.strategies = strategies
        self.auto_blend = auto_blend
        self.gate = gate
        self.resolved: dict[str, Strategy] = {}

    def resolve(self, text: str) -> Strategy:
        """`text`'s strategy (`blend.resolve`), behind the imbalance gate unless it is an SLO
        one (those keep their own pod choice, as AIBrix exempts them), under the name the
        client sent (it sees its own string, whatever routes); 400 for a bad string."""
        found = self.resolved.get(text)
        if found is None:
            found = blend.resolve(text, self.strategies, self.auto_blend)
            gate = None if found.needs_profiles else self.gate
            if gate is not None or found.name != text:
                found = Wrapped(found, text, gate)
            if len(self.resolved) >= _RESOLVED_CACHE:
                self.resolved.clear()  # clients sending endless variants pay a parse each
            self.resolved[text] = found
        return found


class Router:
    """Chooses a pod for a request with the named (or default) strategy."""

    __slots__ = (
        "_clock",
        "_default",
        "_default_strategy",
        "_draining",
        "_profile_gates",
        "_profiles",
        "_rng",
        "_strategies",
        "_table",
        "_waiting",
        "_waking",
        "_wall",
        "admission",
        "beyond",
        "decision_time",
        "drift",
        "gate",
        "history",
        "latency",
        "max_waiting",
        "on_warning",
        "pool",
        "predictions",
        "slo_outcomes",
        "waits",
    )

    def __init__(
        self,
        pool: PodPool,
        strategies: Mapping[str, Strategy],
        default_strategy: str,
        rng: random.Random,
        clock: Callable[[], float],
        history: OutputHistory | None = None,
        max_waiting: int = 1000,
        auto_blend: blend.AutoBlend | None = None,
        gate: ImbalanceGate | None = None,
        admission: Admission | None = None,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self.pool = pool
        # Set: every request passes its model's fair queue when the fleet is full.
        self.admission = admission
        self._draining: set[str] = set()  # models whose admission queue is being dispatched
        self._strategies = dict(strategies)
        self.gate = gate
        self._table = _Table(self._strategies, auto_blend, gate)
        try:
            self._default_strategy = self._table.resolve(default_strategy)
        except UnknownStrategy as exc:
            raise ValueError(f"unknown default strategy {default_strategy}: {exc}") from None
        self._profiles: dict[int, tuple[ConfigProfile, _Table]] = {}
        self._profile_gates: list[ImbalanceGate] = []  # gates with a profile's settings
        self._default = default_strategy
        self._rng = rng
        self._clock = clock
        # Wall-clock time for the tenants' rate limits, whose windows line up across gateway
        # replicas (`clock` may be monotonic); `clock` itself when not given (the simulator).
        self._wall = wall_clock or clock
        self._waiting: dict[str, list[Waiter]] = {}  # model -> waiters in arrival order
        self._waking: set[str] = set()  # models being woken (no re-entry)
        # Completed requests' sizes, for the strategies that predict output length (SLO).
        self.history = history or OutputHistory()
        self.max_waiting = max_waiting  # per model; a request beyond is rejected (QueueFull)
        self.waits = WaitStats()
        self.predictions = PredictionStats()
        self.latency = ClientLatency()  # per pod, as clients feel it (fed by the streams)
        # Parse to decision (routed or held) per request, timed by the routing stream.
        self.decision_time = Histogram(DECISION_BUCKETS_S)
        self.slo_outcomes = SloOutcomes()
        # GPU profiles against traffic: requests beyond a grid, cells off from what they served.
        self.beyond = BeyondGrid()
        self.drift = ProfileDrift()
        # Told what an operator should hear (the gateway logs it as a WARNING); set by the owner.
        self.on_warning: Callable[[str], None] = _unheard
        pool.on_release = self._on_release
        pool.on_change = self.wake

    def now(self) -> float:
        return self._clock()

    def pods_removed(self, keys: Sequence[str]) -> None:
        """Pods left discovery: strategies that remember pods (prefix-cache) forget them, so a
        pod that comes back under the same name is not credited with a cache it lost; their
        latency series go (bounded labels)."""
        if not keys:
            return
        for strategy in self._strategies.values():
            strategy.forget(*keys)
        self.latency.forget(keys)

    def imbalance_fired(self) -> dict[str, int]:
        """Requests the imbalance gates routed themselves, per model (none without a gate)."""
        fired: dict[str, int] = {}
        for gate in [self.gate, *self._profile_gates]:
            if gate is not None:
                for model, count in gate.fired.items():
                    fired[model] = fired.get(model, 0) + count
        return fired

    def fallback(self, decision: Decision) -> Pod | None:
        """Another pod the request may go to (routable, and matching its `external-filter`), for
        a proxy that retries a failed connection elsewhere (Envoy's override_host walks the
        list); None if there is none. Any other one, at random: a retry is rare, and a pass
        over the pool would cost every request O(pods)."""
        try:
            view = self._candidates(decision.request, self._clock())
        except RequestError:
            return None
        n = len(view)
        if n < 2:
            return None
        chosen = decision.lease.pod
        for _ in range(4):
            pod = view[self._rng.randrange(n)].pod
            if pod.key != chosen.key:
                return pod
        return next((c.pod for c in view if c.pod.key != chosen.key), None)

    def finished(
        self,
        decision: Decision,
        status: int,
        felt: Felt | None = None,
        output_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """A routed request's response ended: compare its latency with the prediction (per
        deployment, and per profile cell: `plugin.core.drift`); with an SLO (its own, or its
        profile's) and `felt` by its client, count whether it met it. Admission settles its
        tenant's charge with the `output_tokens` it produced (when counted); its rate limits are
        settled with them and `prompt_tokens`, the engine's count of its prompt where it
        reported one (else the gateway's estimate)."""
        request, profiled = decision.request, decision.profiled
        charge = decision.charge
        if charge is not None and output_tokens is not None and self.admission is not None:
            self.admission.settle(request, output_tokens, charge)
        if decision.reservation is not None:
            self._settle_limits(decision, status, output_tokens, prompt_tokens)
        target = request.slo
        if target is None and profiled is not None:
            target = profiled.profile.target
        if target is not None and target.slos() and felt is not None and status == 200:
            met = felt.met(target, request.prompt_tokens)
            pod = decision.lease.pod
            self.slo_outcomes.count(pod.model, pod.deployment or "", "met" if met else "late")
        if decision.expected_e2e_s is not None and status == 200:
            pod = decision.lease.pod
            deployment = pod.deployment or ""
            actual = self._clock() - decision.routed_at
            self.predictions.observe(deployment, decision.expected_e2e_s, actual)
            if decision.profiled is not None:
                warning = self.drift.observe(pod.model, deployment, decision.profiled, actual)
                if warning is not None:
                    self.on_warning(warning)

    def _decided(
        self,
        answer: Route,
        request: RequestInfo,
        name: str,
        lease: Lease,
        now: float,
        charge: Charge | None = None,
        reservation: Reservation | None = None,
    ) -> Decision:
        """The decision for a route taken; a request beyond its profile's grid is counted."""
        profiled = answer.profiled
        if profiled is not None and profiled.above:
            pod = lease.pod
            warning = self.beyond.observe(
                pod.model, pod.deployment or "", profiled, request.prompt_tokens
            )
            if warning is not None:
                self.on_warning(warning)
        return Decision(
            lease,
            name,
            request,
            now,
            answer.expected_e2e_s,
            profiled,
            charge=charge,
            reservation=reservation,
        )

    def completed(self, model: str, prompt_tokens: int, output_tokens: int, status: int) -> None:
        """A response ended: a successful one teaches the output-length history."""
        if status == 200 and output_tokens > 0:
            self.history.record(model, prompt_tokens, output_tokens, self._clock())

    def strategy_for(self, header: str | None) -> Strategy:
        """The `routing-strategy` header's strategy (a name or a weighted list, auto-blended;
        `plugin.core.strategies.blend`), else the default; unknown or malformed -> 400. The
        strategy's `name` is what the client sees echoed: the string it sent."""
        text = header.strip() if header else ""
        if not text:
            return self._default_strategy
        return self._table.resolve(text)

    def select(
        self, request: RequestInfo, header: str | None, config_profile: str | None = None
    ) -> tuple[Strategy, ConfigProfile | None]:
        """The strategy for a parsed request and the model config profile it runs with
        (`plugin.core.config_profile`): the `routing-strategy` header first, then the
        profile's `routingStrategy`, then the default; the profile's load-balance, gate and
        auto-blend settings apply to whichever routes. Without a config on the model's pods
        this is `strategy_for(header)`."""
        config = self.pool.model_config(request.model)
        if config is None:
            return self.strategy_for(header), None
        profile = config.select(config_profile, request.prompt_tokens, request.max_tokens)
        if profile is None:
            return self.strategy_for(header), None
        text = header.strip() if header else ""
        table = self._profile_table(profile) if profile.overrides_routing else self._table
        if text:
            return table.resolve(text), profile
        if profile.routing_strategy:
            try:
                return table.resolve(profile.routing_strategy), profile
            except UnknownStrategy:
                # A strategy this gateway does not have (AIBrix's `pd`, `least-latency`, ...):
                # the operator's config, not the client's request, so route by the default.
                pass
        if table is self._table:
            return self._default_strategy, profile
        return table.resolve(self._default), profile

    def _profile_table(self, profile: ConfigProfile) -> _Table:
        """Strategies, gate and auto-blend with the profile's settings (cached per profile
        object; discovery makes new objects when a config changes)."""
        found = self._profiles.get(id(profile))
        if found is not None and found[0] is profile:
            return found[1]
        if len(self._profiles) >= _RESOLVED_CACHE:
            self._profiles.clear()
        base = self._table
        strategies = {name: s.for_profile(profile) for name, s in base.strategies.items()}
        base_gate = base.gate.settings if base.gate is not None else None
        gate_settings = overridden(base_gate, profile.imbalance)
        gate = base.gate
        if gate_settings is not None and gate_settings != base_gate:
            gate = ImbalanceGate(gate_settings)
            self._profile_gates.append(gate)
        table = _Table(strategies, overridden(base.auto_blend, profile.auto_blend), gate)
        self._profiles[id(profile)] = (profile, table)
        return table

    def admit(
        self, request: RequestInfo, strategy: Strategy, profile: ConfigProfile | None = None
    ) -> Decision | Waiter:
        """Ask the strategy once: a decision (lease taken), a waiter (queued), or the error.

        With admission on, a request whose model's fleet is full, or whose model has requests
        waiting for room already, waits in the model's fair queue first (`plugin.core.admission`)
        and meets its strategy when its turn and some room come.

        A strategy that `needs_profiles` (SLO routing) hands a model none of whose pods has a
        GPU profile (its `profiled` says so) to the default strategy (or, if that needs them
        too, to least-request).

        `profile`: the model config profile the request runs with (`select`), whose
        `routingConfig.admission` may set how long it waits for room.

        With rate limits, the tenant's reservation is taken first (`plugin.core.limits`; over a
        limit: `RateLimited`, 429) and given back if the request is not routed.
        """
        now = self._clock()
        admission = self.admission
        limits = admission.limits if admission is not None else None
        if limits is None:
            return self._admit(request, strategy, now, None, profile)
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = self.history.predict(request.model, request.prompt_tokens, now) or 0
        reservation = limits.reserve(
            request.tenant, request.prompt_tokens + max_tokens, self._wall()
        )
        try:
            return self._admit(request, strategy, now, reservation, profile)
        except BaseException:
            self._give_back(reservation)
            raise

    def _admit(
        self,
        request: RequestInfo,
        strategy: Strategy,
        now: float,
        reservation: Reservation | None,
        profile: ConfigProfile | None = None,
    ) -> Decision | Waiter:
        candidates = self._candidates(request, now)
        admission = self.admission
        if admission is not None:
            top = admission.rank(request) == 0
            if admission.should_hold(request.model, candidates, 0 if top else 1):
                waiter = self._hold_for_room(
                    admission, request, strategy, now, reservation, profile
                )
                if waiter.done:  # room at once (queued behind none): routed, or its error
                    return waiter.result()
                return waiter
            candidates = with_room(candidates, top)
        asked = strategy  # the name the client sees echoed, whoever routes
        answer, strategy, request = self._ask_strategy(request, strategy, candidates, now)
        if type(answer) is Route:
            return self._take(answer, request, strategy, asked.name, now, reservation)
        if type(answer) is Reject:
            self._rejected(request, answer.error)
            raise answer.error
        if type(answer) is Wait:
            held = len(self._waiting.get(request.model, ()))
            if held >= self.max_waiting:
                raise QueueFull(f"{held} {request.model} requests already wait at the gateway")
            waiter = Waiter(self, request, strategy, answer)
            waiter.reservation = reservation
            self._waiting.setdefault(request.model, []).append(waiter)
            return waiter
        raise TypeError(f"strategy {strategy.name} answered {answer!r}")

    def _ask_strategy(
        self,
        request: RequestInfo,
        strategy: Strategy,
        candidates: Sequence[Candidate],
        now: float,
    ) -> tuple[object, Strategy, RequestInfo]:
        """The strategy's answer, the strategy that gave it (SLO routing without profiles
        hands over) and the request as it saw it (an SLO one gets its predicted output)."""
        if strategy.needs_profiles:
            if not strategy.profiled(candidates):
                strategy = self._without_profiles()
            else:
                predicted = self.history.predict(request.model, request.prompt_tokens, now)
                if predicted is not None:
                    request = dataclasses.replace(request, predicted_output_tokens=predicted)
        return strategy.admit(candidates, request, self._rng, now), strategy, request

    def _take(
        self,
        answer: Route,
        request: RequestInfo,
        strategy: Strategy,
        name: str,
        now: float,
        reservation: Reservation | None = None,
    ) -> Decision:
        """Take the lease a `Route` answer names; admission charges the tenant's estimate and
        prices its rate-limit reservation at the replica."""
        lease = self.pool.acquire(
            answer.candidate.pod,
            answer.load,
            request.prompt_tokens,
            answer.streaming_load,
            now,
        )
        strategy.routed(answer.candidate, request)
        admission = self.admission
        charge = None
        if admission is not None:
            predicted = request.predicted_output_tokens
            if predicted is None:  # priced by the model's history of answers to such prompts
                predicted = self.history.predict(request.model, request.prompt_tokens, now)
            charge = admission.estimate(request, answer.candidate, predicted)
            admission.charge(request.model, request.tenant, charge.gpu_s)
            if reservation is not None and admission.limits is not None:
                # What `reserve` checked: the whole `max_tokens` while the request runs.
                output = request.max_tokens or predicted or 0
                spent = gpu_seconds(
                    request.prompt_tokens,
                    output,
                    charge.decode_tokens_per_s,
                    charge.prefill_tokens_per_s,
                )
                admission.limits.priced(reservation, spent, self._wall())
        return self._decided(answer, request, name, lease, now, charge, reservation)

    # admission -------------------------------------------------------------------------------
    def _hold_for_room(
        self,
        admission: Admission,
        request: RequestInfo,
        strategy: Strategy,
        now: float,
        reservation: Reservation | None = None,
        profile: ConfigProfile | None = None,
    ) -> Waiter:
        """Queue the request for room in its class; a full queue sheds its lowest class (or
        refuses this one); then dispatch whatever room there is."""
        model = request.model
        queue = admission.queue(model)
        rank = admission.rank(request)
        if len(queue) >= admission.settings.max_waiting:
            shed = queue.shed(rank)
            if not isinstance(shed, Waiter):
                admission.count_shed(request, "full")
                raise self._overloaded(
                    admission, model, rank, now, f"{len(queue)} requests already wait"
                )
            admission.count_shed(shed.request, "displaced")
            shed.admitting = False
            self._settled(
                shed,
                None,
                self._overloaded(
                    admission,
                    model,
                    admission.rank(shed.request),
                    now,
                    "a request of a higher priority class took its place in the full queue",
                ),
            )
        wait = Wait(now + admission.max_wait_s(rank, profile))
        waiter = Waiter(self, request, strategy, wait)
        waiter.admitting = True
        waiter.reservation = reservation
        queue.push(waiter, request.tenant, rank)
        self._dispatch_queue(model)
        return waiter

    def _overloaded(
        self, admission: Admission, model: str, rank: int, now: float, why: str
    ) -> Overloaded:
        """503 with `retry-after`: how long the class's oldest waiter has waited."""
        oldest = admission.queue(model).oldest(rank)
        waited = now - oldest.since if isinstance(oldest, Waiter) else 0.0
        return Overloaded(f"the {model} fleet is full: {why}", waited)

    def _dispatch_queue(self, model: str) -> None:
        """While the model's fleet has room, its fair queue's head meets its strategy."""
        admission = self.admission
        if admission is None or model in self._draining:
            return
        queue = admission.queues.get(model)
        if not queue:
            return
        self._draining.add(model)
        try:
            while queue:
                waiter = queue.peek()
                assert isinstance(waiter, Waiter)
                now = self._clock()
                try:
                    candidates = self._candidates(waiter.request, now)
                except RequestError as err:  # the model lost its pods while it waited
                    queue.pop()
                    waiter.admitting = False
                    self._settled(waiter, None, err)
                    continue
                top = admission.rank(waiter.request) == 0
                if has_room(candidates, top):
                    queue.pop()
                else:
                    if waiter.request.pod_selector is None:
                        break
                    found = self._past_filtered_head(admission, queue, now)
                    if found is None:
                        break
                    waiter, candidates, top = found
                    queue.remove(waiter)
                waiter.admitting = False
                try:
                    self._ask(waiter, final=False, candidates=with_room(candidates, top))
                except Exception as exc:  # a strategy's bug must not orphan the request
                    self._forget(waiter)
                    self._settled(waiter, None, RoutingFailed(f"routing failed: {exc!r}"))
                    self.on_warning(f"strategy {waiter.strategy.name} failed: {exc!r}")
                    continue
                if not waiter.done:
                    # Its strategy holds it (no lease taken, so the room is still there): the
                    # next release dispatches the next one, or the queue would empty into holds.
                    break
        finally:
            self._draining.discard(model)

    def _past_filtered_head(
        self, admission: Admission, queue: FairQueue[object], now: float
    ) -> tuple[Waiter, Sequence[Candidate], bool] | None:
        """The head's `external-filter` matches only full replicas: the first of the next
        waiting requests (`LOOK_PAST`, in queue order) whose own candidates have room, with
        them and whether it is of the top class; None when none has."""
        for item in queue.in_order(LOOK_PAST):
            assert isinstance(item, Waiter)
            try:
                candidates = self._candidates(item.request, now)
            except RequestError:
                continue  # answered when it reaches the head
            top = admission.rank(item.request) == 0
            if has_room(candidates, top):
                return item, candidates, top
        return None

    def _candidates(self, request: RequestInfo, now: float) -> Sequence[Candidate]:
        """The model's candidates, narrowed to those its `external-filter` selector matches."""
        view = self.pool.candidates(request.model, now)
        selector = request.pod_selector
        if selector is None or not selector.requirements:
            return view
        chosen = [c for c in view if selector.matches(c.pod.labels)]
        if not chosen:
            raise NoMatchingPod(request.model, selector.text)
        return chosen

    def _without_profiles(self) -> Strategy:
        default = self._default_strategy
        if default.needs_profiles:
            return self._strategies[FALLBACK]
        return default

    def route(self, request: RequestInfo, strategy: Strategy) -> Decision:
        """Admit for a caller that cannot wait (the simulator): a `Wait` is a routing failure."""
        outcome = self.admit(request, strategy)
        if isinstance(outcome, Waiter):
            outcome.cancel()
            raise RoutingFailed(
                f"strategy {strategy.name} held the request; this caller cannot wait"
            )
        return outcome

    # waiting ---------------------------------------------------------------------------------
    def waiting(self, model: str | None = None) -> int:
        """Requests held, for one model or all."""
        if model is not None:
            queued = self.admission.waiting(model) if self.admission is not None else 0
            return len(self._waiting.get(model, ())) + queued
        return sum(self.waiting_by_model().values())

    def waiting_by_model(self) -> dict[str, int]:
        """Requests held per model, by their strategies and by admission alike."""
        counts = {m: len(q) for m, q in self._waiting.items()}
        if self.admission is not None:
            for m, queue in self.admission.queues.items():
                if queue:
                    counts[m] = counts.get(m, 0) + len(queue)
        return counts

    def wake(self, model: str | None = None) -> None:
        """Ask the waiting requests of `model` (or of every model) again, oldest first; then
        let admission's queues dispatch into whatever room there is."""
        if self._waiting:
            for m in [model] if model is not None else list(self._waiting):
                self._wake_model(m)
        admission = self.admission
        if admission is not None and admission.queues:
            for m in [model] if model is not None else list(admission.queues):
                self._dispatch_queue(m)

    def reject_waiting(self, error: RequestError) -> int:
        """Answer every held request with `error` now (the gateway drains); returns how many."""
        held = [w for queue in self._waiting.values() for w in queue]
        if self.admission is not None:
            queued = [w for q in self.admission.queues.values() for w in q.items()]
            held += [w for w in queued if isinstance(w, Waiter)]
        for waiter in held:
            self._forget(waiter)
            self._settled(waiter, None, error)
        return len(held)

    def expire(self, waiter: Waiter) -> None:
        """The waiter's deadline came: ask once more; a later deadline keeps it waiting, else
        it is rejected with its timeout error."""
        if waiter.done:
            return
        if waiter.admitting:  # its class's longest wait: shed
            admission = self.admission
            assert admission is not None
            now = self._clock()
            if now < waiter.deadline:
                return
            rank = admission.rank(waiter.request)
            admission.count_shed(waiter.request, "timeout")
            error = self._overloaded(
                admission,
                waiter.request.model,
                rank,
                now,
                f"the request waited {now - waiter.since:.1f} s for room",
            )
            self._forget(waiter)
            self._settled(waiter, None, error)
            return
        self._ask(waiter, final=True)

    def _on_release(self, pod: Pod) -> None:
        if self._waiting:
            self._wake_model(pod.model)
        if self.admission is not None:
            self._dispatch_queue(pod.model)

    def _wake_model(self, model: str) -> None:
        queue = self._waiting.get(model)
        if not queue or model in self._waking:
            return
        self._waking.add(model)
        try:
            # Highest priority first; sorted() is stable, so equal priorities go oldest first.
            for waiter in sorted(queue, key=lambda w: -w.priority):
                if not waiter.done:
                    self._ask(waiter, final=False)
        finally:
            self._waking.discard(model)

    def _ask(
        self, waiter: Waiter, final: bool, candidates: Sequence[Candidate] | None = None
    ) -> None:
        """Ask a held request's strategy again; with `candidates`, admission hands it over and
        its strategy meets it for the first time (and may hold it in turn)."""
        now = self._clock()
        strategy = waiter.strategy
        name = strategy.name
        try:
            if candidates is None:
                candidates = self._candidates(waiter.request, now)
                answer: object = strategy.admit(candidates, waiter.request, self._rng, now)
            else:
                answer, strategy, waiter.request = self._ask_strategy(
                    waiter.request, strategy, candidates, now
                )
                waiter.strategy = strategy
                if type(answer) is Wait:  # held by its strategy from here
                    waiter.on_timeout = answer.timeout_error()
                    waiter.priority = answer.priority
                    waiter.deadline = answer.deadline
                    self._waiting.setdefault(waiter.request.model, []).append(waiter)
                    waiter.notify()  # no outcome yet: its owner re-reads the deadline
                    return
        except RequestError as err:  # the model lost its pods while the request waited
            self._forget(waiter)
            self._settled(waiter, None, err)
            return
        if type(answer) is Route:
            self._forget(waiter)
            decision = self._take(answer, waiter.request, strategy, name, now, waiter.reservation)
            self._settled(waiter, decision, None)
        elif type(answer) is Reject:
            self._forget(waiter)
            self._settled(waiter, None, answer.error)
        elif type(answer) is Wait:
            waiter.on_timeout = answer.timeout_error()
            waiter.priority = answer.priority
            if answer.deadline > now or not final:
                waiter.deadline = answer.deadline
            else:
                self._forget(waiter)
                self._settled(waiter, None, waiter.on_timeout)
        else:
            raise TypeError(f"strategy {strategy.name} answered {answer!r}")

    def _settled(
        self, waiter: Waiter, decision: Decision | None, error: RequestError | None
    ) -> None:
        self.waits.observe(self._clock() - waiter.since, routed=decision is not None)
        if error is not None:
            self._give_back(waiter.reservation)
            self._rejected(waiter.request, error)
        waiter._settle(decision, error)

    # rate limits -----------------------------------------------------------------------------
    def limit_headers(self, decision: Decision) -> list[tuple[str, str]]:
        """The `x-ratelimit-*` headers of a routed request's response (none if not limited)."""
        admission = self.admission
        limits = admission.limits if admission is not None else None
        if limits is None or decision.reservation is None:
            return []
        return limits.headers(decision.request.tenant, self._wall())

    def handed_reservation(self, decision: Decision) -> str | None:
        """What a routed request reserved of its tenant's limits, as text for whichever gateway
        sees it end (`settle_handed`): its bucket, amounts, the speeds its charge was priced at,
        and its tenant (last: it may hold anything). None when it reserved nothing."""
        reservation, charge = decision.reservation, decision.charge
        if reservation is None or not reservation.open:
            return None
        r, t, g = reservation.amounts
        decode = charge.decode_tokens_per_s if charge is not None else None
        prefill = charge.prefill_tokens_per_s if charge is not None else None
        speeds = ";".join("" if s is None else f"{s:.6g}" for s in (decode, prefill))
        return f"{reservation.bucket};{r:.17g};{t:.17g};{g:.17g};{speeds};{reservation.tenant}"

    def settle_handed(
        self, text: str, status: int, prompt_tokens: int, output_tokens: int | None
    ) -> bool:
        """Settle a request another gateway routed and reserved (`handed_reservation`'s text)
        at what it used, in this gateway's usage; False when the text cannot be read."""
        admission = self.admission
        limits = admission.limits if admission is not None else None
        if limits is None:
            return False
        parts = text.split(";", 6)
        try:
            bucket = int(parts[0])
            reserved = [float(x) for x in parts[1:4]]
            decode, prefill = (float(x) if x else None for x in parts[4:6])
            tenant = parts[6]
        except (IndexError, ValueError):
            return False
        if not all(math.isfinite(x) and x >= 0 for x in reserved):
            return False
        now = self._wall()
        if status != 200:
            limits.settle_handed(tenant, bucket, reserved, 0, 0.0, now)
        elif output_tokens is not None:
            spent = gpu_seconds(prompt_tokens, output_tokens, decode, prefill)
            tokens = prompt_tokens + output_tokens
            limits.settle_handed(tenant, bucket, reserved, tokens, spent, now)
        return True

    def _refund(self, decision: Decision) -> None:
        """A granted request its client gave up before taking it: its tenant's charge back."""
        admission, charge = self.admission, decision.charge
        if admission is not None and charge is not None:
            request = decision.request
            admission.charge(request.model, request.tenant, -charge.gpu_s)

    def _give_back(self, reservation: Reservation | None) -> None:
        """A request that will not run gives its rate-limit reservation back."""
        admission = self.admission
        if reservation is not None and admission is not None and admission.limits is not None:
            admission.limits.release(reservation, self._wall())

    def _settle_limits(
        self,
        decision: Decision,
        status: int,
        output_tokens: int | None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Settle a routed request's reservation at what it used: its prompt and the output
        counted, priced as its charge was; an error answer counts as its request only; an
        uncounted output keeps what was reserved."""
        admission = self.admission
        limits = admission.limits if admission is not None else None
        reservation = decision.reservation
        if limits is None or reservation is None:
            return
        if status != 200:
            limits.settle(reservation, 0, 0.0, self._wall())
            return
        if output_tokens is None:
            reservation.open = False
            return
        charge = decision.charge
        if prompt_tokens is None or prompt_tokens < 0:
            prompt_tokens = decision.request.prompt_tokens
        spent = 0.0
        if charge is not None:
            spent = gpu_seconds(
                prompt_tokens,
                output_tokens,
                charge.decode_tokens_per_s,
                charge.prefill_tokens_per_s,
            )
        limits.settle(reservation, prompt_tokens + output_tokens, spent, self._wall())

    def _rejected(self, request: RequestInfo, error: RequestError) -> None:
        """A request refused because its SLO could not be met counts as an SLO outcome."""
        if isinstance(error, SloUnmeetable):
            self.slo_outcomes.count(request.model, "", "rejected")

    def _forget(self, waiter: Waiter) -> None:
        model = waiter.request.model
        if waiter.admitting:
            waiter.admitting = False
            if self.admission is not None:
                self.admission.queue(model).remove(waiter)
            return
        queue = self._waiting.get(model)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del self._waiting[model]
