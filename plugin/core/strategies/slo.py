"""SLO routing (AIBrix's `slo` family): GPU profiles say what each deployment sustains per request
size; a request goes where it fits within its SLO, or waits at the gateway until it does.

For one request and one pod:

- **Size.** Prompt tokens as `RequestInfo` estimates them; output tokens as the router predicts
  them from the model's recent completions (`OutputHistory`: the most frequent log2 output
  bucket among completions with the same log2 input bucket in the last 240 s, else among all of
  them), capped by `max_tokens`; with no history, `max_tokens`; with neither, the profiles'
  smallest output tick (the shortest answer they describe).
- **Cell.** The profile of the pod's deployment (`Candidate.profile`), the cell nearest in log2,
  clamped to the grid (`GpuProfile.cell`): a size below the grid (a 3-token prompt against
  ticks from 128) takes the smallest tick, as a request is never harder than the smallest cell;
  a size above it takes the border cell, a guess rather than a refusal, and the route says so
  (`ProfiledRoute.above`: the router counts such requests per model and axis and warns once per
  model). This holds in every strategy of the family, on a list and on the view's groups.
- **Consumption.** A request uses `1 / (mix_tputs x e2e)` of a pod (Little's law: `rate x e2e`
  is how many such requests the pod serves at once within the SLO); a pod is full at 1.0, and an
  idle pod always has room (a consumption above 1 only means one request at a time). The rate is
  what the cell counts for inside a mix (`GpuProfile.mix_tputs`: a long prompt costs at most as
  many shorter ones as its prompt is longer), not what a stream of that size alone sustains,
  which collisions between long prompts set. `tputs` 0 means this GPU type never meets the SLO
  at that size. Once the request's response streams (its first chunk: the engine is done with
  its prompt), its share drops to that of the same answer to the grid's shortest prompt
  (`Route.streaming_load`, `Lease.streaming`): a long prompt takes the pod for its prefill,
  and a request held behind it needs to wait for that prefill only, as it would in the
  engine's own queue, not for the whole answer. `slo-pack-load` keeps the whole share: room is
  how full it packs a pod, and packing by shrunk shares puts more long prompts on one pod than
  its profile was measured with (in the simulator's chat + long mix it sustained 1.00 G* so,
  1.03 with whole shares).
- **Slack**: the request's `x-slo-tpot-ms` and `x-slo-ttft-ms` when it sends one, else every
  latency SLO of the profile (TPOT, TTFT, TPAT, E2E), against the profile's expectation (E2E and
  TTFT from its grids; TPOT and TPAT as shares of E2E): the longest the request may wait and
  still make all of them (waiting adds to TTFT and E2E, to TPAT over its tokens, and not to
  TPOT). AIBrix takes the first SLO in that order; with TPOT first a request could then wait out
  its TTFT, so the least slack over all of them decides here.
- **Prediction.** A route carries where the request sits in the profile (`ProfiledRoute`) and the
  E2E the profile predicts for it at the pod's SLO load with the request
  (`GpuProfile.e2e_at`: between the cell's idle E2E and its loaded one where the profile has
  `e2e_idle`, else the loaded one); the router compares it with what the request then takes
  (`plugin.core.drift`).

Strategies (never blended with others):

- `slo-least-load-pulling` and `slo`: the least loaded pod with room; with none, the request
  waits at the gateway (most urgent first: waited + expected - target) until a lease ends and
  frees room, or is rejected (503) as soon as its SLO can no longer be met. A request that
  finds no pod below its mean occupancy (1.0) is not held yet: a pod still has room up to the
  burst of the request's cell the profile's own measurement went through (`burst_room`: the
  profile's percentile of the Poisson number of the cell's requests in flight at its `tputs`,
  in shares), since holding at the mean refuses states the engine served within the SLO when
  it was profiled. Pods below the mean come first, so where one has room the pick is as it
  was, but for one thing: among pods with room, those of a GPU type that would still meet
  the SLO should the answer run to the request's `max_tokens` come first
  (`_longest_answer_fits`): the prediction is the most frequent length, and a GPU type whose
  time per token sits at the SLO is late on every answer that runs long (in the simulator's
  chat + long mix, an L20 at TPAT 20 ms: `slo` served 1.1% late at 0.5 G* before this
  preference, 0.6% with it);
- `slo-least-load`: the least loaded pod that can serve the size, room ignored;
- `slo-pack-load`: the fullest pod that still has room (fewer pods busy), of the GPU type that
  serves the request for the least (its profile's `cost` over the cell's rate, `SloFit.price`);
  with none, the least loaded, as `slo-least-load`. Packing the slow type first would fill it
  to what it sustains of each size alone, where a long prompt's prefill stalls everything
  decoding beside it; packing the cheapest per request leaves the others idle to scale down.

A request no GPU type can serve within its SLO (every profiled pod at `tputs` 0 in its cell, the
border cell for a size above the grid) is rejected at once. Pods without a profile are not
candidates while some pod of the model has one; a model with none at all is routed by the
gateway's default strategy (the router does that).
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from plugin.core.profile import GpuProfile, ProfiledRoute
from plugin.core.strategies.base import (
    Admission,
    Reject,
    Route,
    Strategy,
    Wait,
    register_strategy,
    require_candidates,
)
from plugin.core.strategies.simple import LeastRequest, random_min
from plugin.core.types import Candidate, RequestInfo
from plugin.core.view import CandidateView, Run, choose_tied, tied_run
from plugin.errors import SloUnmeetable

__all__ = [
    "HISTORY_WINDOW_S",
    "OutputHistory",
    "SloFit",
    "SloSettings",
    "SloStrategy",
    "burst_room",
    "fit",
    "poisson_quantile",
]

HISTORY_WINDOW_S = 240.0
ROOM = 1.0 + 1e-9  # a pod is full at 1.0 (the epsilon absorbs float sums of consumptions)
_EXACT_BELOW = 50.0  # Poisson means from here on take the normal approximation
PRICE_TIE = 1.0 + 1e-9  # GPU types this close in price per request pack as one


def _bucket(tokens: int) -> int:
    return round(math.log2(tokens)) if tokens > 0 else 0


class OutputHistory:
    """Completed requests per model over the last 240 s, counted by (input bucket, output
    bucket) as they arrive and leave the window, so a prediction costs O(buckets)."""

    __slots__ = ("_counts", "_entries", "window_s")

    def __init__(self, window_s: float = HISTORY_WINDOW_S) -> None:
        self.window_s = window_s
        self._entries: dict[str, deque[tuple[float, int, int]]] = {}
        self._counts: dict[str, dict[int, Counter[int]]] = {}  # model -> input -> outputs

    def record(self, model: str, prompt_tokens: int, output_tokens: int, now: float) -> None:
        if output_tokens <= 0:
            return
        entry = (now, _bucket(prompt_tokens), _bucket(output_tokens))
        self._entries.setdefault(model, deque()).append(entry)
        self._counts.setdefault(model, {}).setdefault(entry[1], Counter())[entry[2]] += 1
        self._trim(model, now)

    def _trim(self, model: str, now: float) -> None:
        entries = self._entries.get(model)
        if not entries:
            return
        counts = self._counts[model]
        horizon = now - self.window_s
        while entries and entries[0][0] < horizon:
            _, inp, out = entries.popleft()
            by_out = counts[inp]
            by_out[out] -= 1
            if by_out[out] <= 0:
                del by_out[out]
                if not by_out:
                    del counts[inp]

    def predict(self, model: str, prompt_tokens: int, now: float) -> int | None:
        """Output tokens most often seen for this input size lately (2 ** the modal bucket;
        ties to the longer), or over all sizes; None without history."""
        if model not in self._entries:
            return None
        self._trim(model, now)
        counts = self._counts.get(model)
        if not counts:
            return None
        same = counts.get(_bucket(prompt_tokens))
        if not same:
            same = Counter()
            for by_out in counts.values():
                same.update(by_out)
        best = max(same.items(), key=lambda kv: (kv[1], kv[0]))[0]
        return int(2**best)


@dataclass(frozen=True, slots=True)
class SloSettings:
    """The SLO strategies' own knob (`HETERO_GATEWAY_SLO_MAX_WAIT_MS`)."""

    max_wait_s: float = 30.0  # never hold a request longer (below Envoy's message timeout)


@dataclass(frozen=True, slots=True)
class SloFit:
    """How one request fits one pod's profile."""

    candidate: Candidate
    profile: GpuProfile  # the candidate's (its deployment's)
    consumption: float  # share of the pod the request takes; inf: never within the SLO
    slack_s: float  # how long it may wait and still make its SLO (inf: only the gateway's bound)
    cell: tuple[int, int] = (0, 0)  # (out, in) in the profile's grid
    above: tuple[str, ...] = ()  # axes on which the request lies above the grid
    streaming: float = math.nan  # its share once its response streams (NaN: `consumption`)

    @property
    def price(self) -> float:
        """What the request costs on this GPU type: the profile's `cost` (per replica) over
        the rate a replica sustains of its cell inside a mix; inf where it never meets the SLO."""
        rate = self.profile.mix_tputs[self.cell[0]][self.cell[1]]
        return self.profile.cost / rate if rate > 0 else math.inf


def _slack_s(
    profile: GpuProfile,
    cell: tuple[int, int],
    request: RequestInfo,
    prompt: int,
    output: int,
    e2e: float,
) -> float:
    """How long the request may still wait at the gateway and meet its SLO (seconds), given the
    E2E the profile expects for it on the pod (`e2e`, at the pod's load: `GpuProfile.e2e_at`).

    The SLO is the request's own TPOT and TTFT targets if it sends one, else every latency SLO
    the profile was built for; the slack is the least over them, so a request waits only while
    all can still be met. Waiting adds to TTFT and E2E one for one, and to TPAT spread over the
    request's tokens; it does not change TPOT, so a TPOT the profile meets leaves only the
    gateway's own bound (and one it misses cannot be met at all). The profile's own TPOT target
    is met wherever `tputs` > 0 (that is what the sweep judged); a request's own is checked
    against the profile's per-request TPOT, (E2E - TTFT) / (output - 1).
    """
    i, j = cell
    ttft = profile.ttft[i][j] if profile.ttft is not None else math.nan
    slo = request.slo
    own = slo is not None and (slo.ttft_s is not None or slo.tpot_s is not None)
    target = slo if own and slo is not None else profile.target
    slacks = [math.inf]  # a profile without SLOs (the older format): no deadline of its own
    if own and target.tpot_s is not None:
        if math.isfinite(ttft) and output > 1:
            expected = (e2e - ttft) / (output - 1)
        else:
            expected = e2e / max(output, 1)
        slacks.append(math.inf if not expected > target.tpot_s else -math.inf)  # NaN: unknown
    if target.ttft_s is not None:
        slacks.append(target.ttft_s - ttft if math.isfinite(ttft) else target.ttft_s)
    if not own and target.tpat_s is not None and math.isfinite(e2e):
        tokens = max(prompt + output, 1)
        slacks.append((target.tpat_s - e2e / tokens) * tokens)
    if not own and target.e2e_s is not None:
        slacks.append(target.e2e_s - e2e if math.isfinite(e2e) else target.e2e_s)
    return min(slacks)


def fit(
    candidate: Candidate, profile: GpuProfile, request: RequestInfo, output_tokens: int
) -> SloFit:
    """The request on this pod: its cell (clamped to the grid, `GpuProfile.cell`), the share
    of the pod it takes and how long it may wait."""
    prompt = request.prompt_tokens
    cell = profile.cell(prompt, output_tokens)
    above = profile.above_grid(prompt, output_tokens)
    i, j = cell
    if profile.tputs[i][j] <= 0:
        return SloFit(candidate, profile, math.inf, -math.inf, cell, above)
    consumption = _share(profile, i, j)
    # Once it streams, its prompt is done: it costs what the same answer to the shortest prompt
    # of the grid does.
    streaming = min(consumption, _share(profile, i, 0)) if profile.tputs[i][0] > 0 else consumption
    slack = _slack_at(candidate, profile, request, cell, output_tokens, consumption)
    return SloFit(candidate, profile, consumption, slack, cell, above, streaming)


def _slack_at(
    candidate: Candidate,
    profile: GpuProfile,
    request: RequestInfo,
    cell: tuple[int, int],
    output_tokens: int,
    consumption: float,
) -> float:
    """The request's slack in `cell` on the pod, the E2E read at the pod's load with its
    `consumption` added (`GpuProfile.e2e_at`)."""
    at_load = profile.e2e_at(cell, candidate.load + consumption)
    e2e = math.nan if at_load is None else at_load
    return _slack_s(profile, cell, request, request.prompt_tokens, output_tokens, e2e)


def _share(profile: GpuProfile, i: int, j: int) -> float:
    """The share of a pod one request of cell (i, j) takes, by Little's law: a pod serves
    `mix_tputs x e2e` of them at once within the SLO (the rate as the cell counts inside a mix,
    which is at least `tputs`)."""
    return 1.0 / (profile.mix_tputs[i][j] * _little_e2e(profile, i, j))


def _little_e2e(profile: GpuProfile, i: int, j: int) -> float:
    """The cell's E2E for Little's law (seconds): its grid's, or 1 s without a usable one."""
    e2e = profile.e2e[i][j] if profile.e2e is not None else math.nan
    return e2e if e2e > 0 and math.isfinite(e2e) else 1.0


def _route(chosen: Candidate, best: SloFit, output_tokens: int, shrinks: bool = True) -> Route:
    """Route to `chosen` (a pod of `best`'s deployment, so of its profile), predicting the E2E
    at the pod's SLO load with this request; `shrinks`: its share drops once it streams."""
    load = chosen.load + best.consumption
    e2e = best.profile.e2e_at(best.cell, load)
    profiled = ProfiledRoute(best.profile, best.cell, output_tokens, load, e2e, best.above)
    streaming = best.streaming if shrinks and best.streaming < best.consumption else None
    return Route(chosen, best.consumption, streaming, e2e, profiled)


class SloStrategy(Strategy):
    """One member of the family; `mode` is `pulling`, `least` or `pack`.

    Reads each candidate's `profile` and the request's `predicted_output_tokens`. With no
    profiled candidate it routes nothing itself: the router uses its default strategy
    (`needs_profiles`).
    """

    __slots__ = ("mode", "name", "settings")
    needs_profiles = True

    def __init__(self, name: str, mode: str, settings: SloSettings) -> None:
        self.name = name
        self.mode = mode
        self.settings = settings

    def _output_tokens(self, request: RequestInfo, profiles: Sequence[GpuProfile]) -> int:
        predicted = request.predicted_output_tokens
        if predicted is not None:
            return min(predicted, request.max_tokens) if request.max_tokens else predicted
        if request.max_tokens:
            return request.max_tokens
        return min(p.out_ticks[0] for p in profiles)

    def profiled(self, candidates: Sequence[Candidate]) -> bool:
        """Whether some candidate has a GPU profile (else the router routes by its default)."""
        if isinstance(candidates, CandidateView):
            return bool(candidates.grouped_by(_BY_DEPLOYMENT).groups)
        return any(c.profile is not None for c in candidates)

    def admit(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        require_candidates(candidates)
        if isinstance(candidates, CandidateView):
            return self._admit_grouped(candidates, request, rng, now)
        # The rule, as a pass over the pool; the view's grouped index reproduces it exactly.
        profiled = [(c, c.profile) for c in candidates if c.profile is not None]
        if not profiled:  # the router routes such a model by its default strategy
            return Route(_LEAST_REQUEST.pick(candidates, request, rng))
        output = self._output_tokens(request, [p for _, p in profiled])
        fits = [fit(c, p, request, output) for c, p in profiled]
        choice = self._decide(fits, request, output, now, lambda f: f.candidate.load)
        if not isinstance(choice, _Choice):
            return choice
        sign = -1.0 if choice.fullest else 1.0
        keys = [(sign * f.candidate.load,) for f in choice.fits]
        chosen = random_min([f.candidate for f in choice.fits], keys, rng)
        best = next(f for f in choice.fits if f.candidate is chosen)
        return _route(chosen, best, output, self.mode != "pack")

    def _admit_grouped(
        self, view: CandidateView, request: RequestInfo, rng: random.Random, now: float
    ) -> Admission:
        """The same rule from the view's per-deployment load order: every pod of a deployment
        shares its profile, so a request fits the same everywhere in it, and the least (or the
        fullest with room) of a deployment is one end of its sorted loads. O(deployments x
        log pods) instead of a pass over the pool."""
        groups = view.grouped_by(_BY_DEPLOYMENT).groups
        if not groups:
            return Route(_LEAST_REQUEST.pick(view, request, rng))
        firsts = {g: view.slots[entries[0][1]] for g, entries in groups.items()}
        profiles = [c.profile for c in firsts.values() if c.profile is not None]
        output = self._output_tokens(request, profiles)
        fits = [
            fit(c, c.profile, request, output) for c in firsts.values() if c.profile is not None
        ]
        least = {g: entries[0][0][0] for g, entries in groups.items()}
        choice = self._decide(
            fits, request, output, now, lambda f: least[f.candidate.pod.deployment]
        )
        if not isinstance(choice, _Choice):
            return choice
        runs: list[tuple[Run, SloFit]] = []
        for f in choice.fits:
            entries = groups[f.candidate.pod.deployment]
            if choice.fullest:  # the fullest with room: room is a prefix of the load order
                key = entries[_with_room(entries, f.consumption) - 1][0]
            else:
                key = entries[0][0]
            runs.append((tied_run(entries, key), f))
        pick = max if choice.fullest else min
        best_key = pick(run[1] for run, _ in runs)
        tied = [(run, f) for run, f in runs if run[1] == best_key]
        chosen = choose_tied([run for run, _ in tied], view.slots, rng)
        best = next(f for _, f in tied if f.candidate.pod.deployment == chosen.pod.deployment)
        return _route(chosen, best, output, self.mode != "pack")

    def _decide(
        self,
        fits: Sequence[SloFit],
        request: RequestInfo,
        output: int,
        now: float,
        least_load: Callable[[SloFit], float],
    ) -> Reject | Wait | _Choice:
        """Reject, hold, or the fits to route among (`least_load`: the least loaded pod a fit
        stands for, which has room if any of them has)."""
        # A pod serves the request within its SLO if its GPU type meets the profile's SLO at
        # this size (tputs > 0) and the time the request has waited has not used up its slack
        # there (a woken request must not go to a slower GPU type it can no longer make it on).
        waited = now - request.arrived_at
        meets = [f for f in fits if math.isfinite(f.consumption) and f.slack_s >= 0]
        servable = [f for f in meets if f.slack_s >= waited]
        if not meets:
            return Reject(
                SloUnmeetable(
                    f"no GPU type serving {request.model} can meet the SLO for a request of "
                    f"{request.prompt_tokens} prompt and about {output} output tokens"
                )
            )
        if not servable:
            return Reject(
                SloUnmeetable(
                    f"the SLO of this {request.model} request can no longer be met: it waited "
                    f"{waited:.2f} s"
                )
            )
        room = [f for f in servable if _has_room(least_load(f), f.consumption)]
        if self.mode == "pulling" and len(room) > 1:  # GPU types that make it at any length
            room = _longest_answer_fits(room, request, output, waited) or room
        if self.mode == "pulling" and len(room) > 1:  # ... and with no prefill in its way
            room = _clear_of_prefills(room, now, waited) or room
        if not room and self.mode == "pulling":  # before holding it: a burst the profile took
            room = [f for f in servable if _has_room(least_load(f), f.consumption, burst_room(f))]
        if self.mode == "least" or (self.mode == "pack" and not room):
            return _Choice(servable, fullest=False)
        if room and self.mode == "pack":  # the cheapest GPU type per request first
            cheapest = min(f.price for f in room)
            return _Choice([f for f in room if f.price <= cheapest * PRICE_TIE], fullest=True)
        if room:
            return _Choice(room, fullest=False)
        # pulling, and no pod has room: wait while the SLO can still be met.
        slack = max(f.slack_s for f in servable)
        budget = min(slack, self.settings.max_wait_s)
        if waited >= budget:
            return Reject(
                SloUnmeetable(
                    f"the SLO of this {request.model} request can no longer be met: every "
                    f"replica that could serve it is full (waited {waited:.2f} s)"
                )
            )
        return Wait(
            request.arrived_at + budget,
            SloUnmeetable(
                f"the SLO of this {request.model} request can no longer be met: no replica "
                f"had room within {budget:.2f} s"
            ),
            priority=waited - slack,
        )


@dataclass(frozen=True, slots=True)
class _Choice:
    """Route among these fits' pods: the least loaded, or the fullest (pods with room only)."""

    fits: Sequence[SloFit]
    fullest: bool


def _longest_answer_fits(
    fits: Sequence[SloFit], request: RequestInfo, output: int, waited: float
) -> list[SloFit]:
    """Of `fits` (predicted `output` tokens), those whose GPU type would still meet the SLO
    if the answer ran to the request's `max_tokens` (read, like any size, at the grid's
    nearest cell: a cap above the grid is read at its longest answer); all of them without a
    longer cap.

    The prediction is the most frequent answer length, and a chat mix's answers spread wide:
    a GPU type whose time per token sits at the SLO for long answers (an L20 at TPAT 20 ms) is
    late on every answer that runs long. Judged once per GPU type (profile), at its least
    loaded pod among `fits`, the one the pulling strategies route to: one `fit` per type,
    however many pods the list holds."""
    longest = request.max_tokens
    if longest is None or longest <= output:
        return list(fits)
    verdicts: dict[int, bool] = {}
    for key, f in _least_per_profile(fits).items():
        profile = f.profile
        cell = profile.cell(request.prompt_tokens, longest)
        if cell == f.cell:  # the predicted cell, which `f` already meets
            verdicts[key] = True
            continue
        i, j = cell
        verdicts[key] = profile.tputs[i][j] > 0 and (
            _slack_at(f.candidate, profile, request, cell, longest, _share(profile, i, j)) >= waited
        )
    return [f for f in fits if verdicts[id(f.profile)]]


def _least_per_profile(fits: Sequence[SloFit]) -> dict[int, SloFit]:
    """Per GPU type (profile, by identity), the fit of its least loaded pod among `fits`."""
    least: dict[int, SloFit] = {}
    for f in fits:
        known = least.get(id(f.profile))
        if known is None or f.candidate.load < known.candidate.load:
            least[id(f.profile)] = f
    return least


def _clear_of_prefills(fits: Sequence[SloFit], now: float, waited: float) -> list[SloFit]:
    """Of `fits`, those whose GPU type's least loaded pod would start the request's prefill
    soon enough: the prompts routed to it before, queued at its prefill speed
    (`Candidate.prefill_free_at`), leave the request's slack.

    A profile's cells are measured with one size at a time, so a short request's cell says
    nothing of a 16k-token prompt routed to the same pod a moment before: engines prefill in
    arrival order, and the short one's first token waits for the long prefill (in the
    simulator, most of what `slo` still served late). Judged once per GPU type, at the pod the
    pulling strategies route to, as `_longest_answer_fits` does."""
    verdicts = {
        key: f.slack_s - waited >= max(0.0, f.candidate.prefill_free_at - now)
        for key, f in _least_per_profile(fits).items()
    }
    return [f for f in fits if verdicts[id(f.profile)]]


def _has_room(load: float, consumption: float, full: float = 1.0) -> bool:
    """Whether a pod at `load` has room for a request taking `consumption` of it, the pod being
    full at `full` (1.0, or the pulling strategies' `burst_room`). An idle pod always has: a
    profile whose best passing rate was low gives a request a consumption above 1 (tputs x e2e
    < 1), which must not keep it off an empty pod."""
    return load + consumption <= full * ROOM or load <= 0


def burst_room(f: SloFit) -> float:
    """How full a pod may be, counted in shares and with the request in, for `slo` to route a
    request now rather than hold it: the burst of its cell the profile's own measurement went
    through, in shares (see `poisson_quantile`); at least 1.0, and 1.0 for a profile checked at
    the mean (AIBrix's default, percentile 0).

    Under a TTFT SLO the burst is also at most as many of the cell's requests as prefill one
    after another within it (the target over the cell's TTFT): the sweep's bursts were mostly
    requests already decoding, while requests routed together all wait for each other's
    prefill (two 4k prompts of 0.47 s each within a 1 s TTFT, not three)."""
    profile = f.profile
    if not 0 < profile.percentile < 100:
        return 1.0
    i, j = f.cell
    burst = poisson_quantile(
        profile.tputs[i][j] * _little_e2e(profile, i, j), profile.percentile / 100.0
    )
    target = profile.slos.get("ttft")
    ttft = profile.ttft[i][j] if profile.ttft is not None else math.nan
    if target is not None and ttft > 0 and math.isfinite(ttft):
        burst = min(burst, max(1, math.floor(target / ttft)))
    return max(1.0, burst * f.consumption)


@functools.lru_cache(maxsize=4096)
def poisson_quantile(mean: float, p: float) -> int:
    """How many requests of one cell were in flight at once, at the profile's percentile, while
    its sweep measured the cell: a Poisson stream at the cell's rate `tputs` has a Poisson
    number in flight, of `mean = tputs x e2e` (Little's law). The engine absorbed those bursts
    and still met the SLO at that percentile, so holding a request as soon as the mean share
    (1.0) is reached refuses states the profile passed: a cap at the mean blocks like an Erlang
    loss system, half the time for a cell of one request in flight (a 4k prompt), and a held
    request is rejected once its slack runs out. The count is of the cell alone, as measured
    (not of `mix_tputs`, derived), and is given in shares by `burst_room`: 4 requests of a cell
    of 1.25 in flight at p99 (3 at p90), about `mean` for large cells (bursts even out).
    `p` in (0, 1). Cached: a profile has few cells."""
    if not mean > 0 or not math.isfinite(mean):
        return 0
    if mean >= _EXACT_BELOW:
        z = statistics.NormalDist().inv_cdf(p)  # with the skew's first correction
        return math.ceil(mean + z * math.sqrt(mean) + (z * z - 1.0) / 6.0 - 0.5)
    k, term = 0, math.exp(-mean)
    cdf = term
    while cdf < p:
        k += 1
        term *= mean / k
        cdf += term
    return k


def _with_room(entries: Any, consumption: float) -> int:
    """How many of a deployment's load-ordered entries have room (a prefix: room only shrinks
    as load grows)."""
    lo, hi = 0, len(entries)
    while lo < hi:
        mid = (lo + hi) // 2
        if _has_room(entries[mid][0][0], consumption):
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True, eq=False)
class _ByDeployment:
    """Grouped-index spec: profiled candidates by deployment (one profile each), by load."""

    def group(self, candidate: Candidate) -> Hashable | None:
        return candidate.pod.deployment if candidate.profile is not None else None

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        return (candidate.load,)


_BY_DEPLOYMENT = _ByDeployment()
_LEAST_REQUEST = LeastRequest()


def _family(name: str, mode: str) -> None:
    def factory(settings: SloSettings) -> Strategy:
        return SloStrategy(name, mode, settings)

    register_strategy(name, SloSettings)(factory)


_family("slo-least-load-pulling", "pulling")
_family("slo", "pulling")
_family("slo-least-load", "least")
_family("slo-pack-load", "pack")
