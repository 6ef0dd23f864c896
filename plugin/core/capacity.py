"""Per-replica capacity learned from completed output tokens (`docs/routing.md`).

On every refresh, each replica's cumulative completed-token counter becomes a rate over a window
of about a minute; an EWMA with time constant tau smooths it (alpha = 1 - exp(-dt / tau)). A window
with no completed tokens keeps the previous estimate: an idle replica is not slow.

Tokens counted when responses end arrive in lumps (a long answer credits all its tokens at once),
hence the long window. A replica whose engine's own counter feeds it (tokens as they are
generated, step by step) is tracked `fast`: a 15 s window and 5 s tau, which follow a change of
its speed within about 20 s and, in the simulator, do not flap under Poisson noise
(`python -m plugin_tools.sim.shift`).

A window still lags a sudden change of speed (another tenant on the GPU, throttling, a restart
with other engine args), and an achieved rate can only show a replica that became fast once
traffic moves to it. `SpeedWatch` sees the change itself, in the tokens each running request
gets per second from one scrape to the next: where that moves by half or more at about the same
batch, scrape after scrape, the estimate is rescaled by it at once (`CapacityEstimator.rescale`).

A scrape comes once a second, and each second a change goes unseen the fast replica keeps most of
the load while it is slow. Where the gateway sees the response chunks anyway (its counting
filter reads them), `GapWatch` watches the gaps between the chunks of each stream: one engine
step apart, so a change shows within ten steps, a fraction of a second (k steps apart where an
engine sends k tokens an event, which the watch learns: the change shows k steps later). In the
simulator, load-balance told of a swap of speeds at the moment it happens keeps its first minute
below least-request's in every run, told a second later in about half (docs/benchmarks.md). A step
that runs a prefill is longer for every stream in it, so the watch weighs what the gateway
knows of the prompts its steps may have prefilled (`PodPool.observe_chunk_gap`): a round counts
as slower only beyond the most those prefills add. (Leaving out every round while any request
waited for its first chunk gave the watch nothing to read at high request rates, where nearly
every step admits a prompt.) When one watch acts, the other takes the change as its usual
(`rebase`): one change, one rescale.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["CapacityEstimator", "GapWatch", "SpeedWatch"]

# A speed change SpeedWatch acts on: tokens per running request per second moved by this factor
# (either way) ...
SHIFT_RATIO = 1.5
# ... in this many scrapes in a row ...
SHIFT_SCRAPES = 4
# ... at a batch no further than this share from the usual one the way that could explain it
# (`SpeedWatch`).
SHIFT_BATCH_BAND = 0.25
# Fewer running requests say too little about a replica's speed.
SHIFT_MIN_RUNNING = 2.0
# Time constant of the usual speed and batch.
SHIFT_TAU_S = 10.0
# GapWatch: a change holds for this many rounds of chunk gaps in a row (a round is about one
# engine step) ...
GAP_ROUNDS = 10
# ... spanning at least this long, so that a burst of long prefills stalling a few steps, or a
# pause of the gateway's own event loop, is no change.
GAP_SPAN_S = 0.3
GAP_SPEEDUP_RATIO = 2.0
# A slowdown this large holds for fewer rounds (still over GAP_SPAN_S): a step that much longer,
# round after round beyond what its batch and its prefills can add, has no other cause,
# and each step it goes unseen the replica is sent requests that will run slow to their end.
GAP_BIG_RATIO = 2.0
GAP_BIG_ROUNDS = 3
# A prompt token a round's steps may have prefilled weighs this many running streams: a step
# costs a fixed part, a part per decoding sequence and a part per prefill token, and the last is
# at most about the second on the GPUs profiled (the simulator's presets: 0.3-1.0 of it), so a
# round whose prefills are a share s of its batch took at most (1 + s) times its decoding alone.
PREFILL_TOKEN_WEIGHT = 1.0
# Up to this share a round is read as it is (a round at it is at most SHIFT_RATIO slower for its
# prefills, and the fixed part of a step, 50-75 streams' worth on the simulator's presets, makes
# it much less); above, only as a slowdown beyond what its prefills can add (`GapWatch`).
PREFILL_SHARE = 0.5
# Each finished stream moves a replica's tokens per chunk by this share (`GapWatch.ended`): an
# engine restarted with a stream interval or speculative decoding shows within a few dozen.
PER_EVENT_WEIGHT = 0.05


class _Usual:
    """What SpeedWatch and GapWatch share: a replica's usual figure and batch, followed slowly
    (tau `SHIFT_TAU_S`), and a streak of readings that moved from it."""

    __slots__ = ("batch", "seen_s", "streak", "streak_s", "value")

    def __init__(self) -> None:
        self.value: float | None = None  # the usual figure
        self.batch: float | None = None  # the usual batch
        self.seen_s = 0.0  # how long the usual figure has been followed
        self.streak: list[float] = []  # readings in a row that moved
        self.streak_s = 0.0  # the time they took

    def interrupt(self) -> None:
        """The readings around this one are not in a row (a gap in the data, a restart)."""
        self.streak.clear()
        self.streak_s = 0.0

    def _follow(
        self, value: float, batch: float, moved: bool, dt: float, rounds: int, span_s: float
    ) -> float | None:
        """A reading (`moved`: far enough from the usual one, at a batch that cannot explain
        it). The new usual figure once readings moved the same way `rounds` times in a row over
        at least `span_s`, after a tau of history: the streak's median, at once. Else None, and
        the usual figure follows unmoved readings slowly."""
        usual, usual_batch = self.value, self.batch
        if usual is None or usual_batch is None:
            return None
        streak = self.streak
        if moved and self.seen_s >= SHIFT_TAU_S:
            if streak and (value > usual) != (streak[-1] > usual):
                self.interrupt()  # it moved the other way: start again
            streak.append(value)
            self.streak_s += dt
            if len(streak) < rounds or self.streak_s < span_s:
                return None
            new = sorted(streak)[len(streak) // 2]
            self.interrupt()
            self.value, self.batch = new, batch  # the new usual, at once
            self.seen_s = 0.0  # and a tau of it before another change counts
            return new
        self.interrupt()
        self.seen_s += dt
        alpha = 1.0 - math.exp(-dt / SHIFT_TAU_S)
        self.value = usual + alpha * (value - usual)
        self.batch = usual_batch + alpha * (batch - usual_batch)
        return None

    # How the usual figure goes with speed: 1 for a speed, -1 for a time per chunk.
    _PER_SPEED = 1

    def rebase(self, factor: float) -> None:
        """Another watch saw the replica's speed change by `factor`: take it as the usual and
        wait a tau before another change counts (so one change is not acted on twice)."""
        if self.value is not None and 0 < factor < math.inf:
            self.value *= factor**self._PER_SPEED
        self.interrupt()
        self.seen_s = 0.0


class GapWatch(_Usual):
    """One replica's gap between two chunks of a stream, step by step (module doc).

    `add` takes one gap between consecutive chunks of one of the replica's streams (seconds per
    chunk), `count` streams that saw it (the simulator passes a step's whole batch at once), the
    replica's requests in flight, and the prompt tokens of those still waiting for their first
    chunk; `started` the prompt tokens of a stream whose first chunk just came; `ended` the
    tokens and chunks of a stream that ended. Where each chunk carries k tokens (`per_event`,
    learned from `ended`: SGLang's stream interval, TensorRT-LLM, speculative decoding) a gap
    spans k steps and a stream sends a chunk every k steps. Gaps gather into rounds of about
    one engine step (the replica's requests in flight over k, at least 2), and each round's
    median is one reading (a stall of one stream does not set it).

    A round's gaps may span prefills: of the prompts that started in the k rounds up to it, and
    of those that waited through all of it (a long prompt prefilled in chunks over several
    steps); prompts that came and went within it are the ones that started. Weighing a prompt
    token as `PREFILL_TOKEN_WEIGHT` running streams, gaps whose k steps prefilled a share s of
    k times the batch took at most (1 + s) times those steps' decoding alone, and less where a
    step's fixed part is large. Up to `PREFILL_SHARE` the round is read as it is; above, it
    counts only as a slowdown that its decoding alone (its gap over 1 + s) shows, and is
    otherwise left out (it breaks no streak and moves nothing). A batch q times the usual one
    makes a step at most q times longer, so a slower round counts by its gap over q. The rules
    are `SpeedWatch`'s: slower by `SHIFT_RATIO` (faster by `GAP_SPEEDUP_RATIO`) beyond what
    the batch explains, for `GAP_ROUNDS` rounds in a row (the last `GAP_BIG_ROUNDS` if each of
    them was `GAP_BIG_RATIO` slower), k - 1 more (one stall lengthens the gaps of k rounds),
    over at least `GAP_SPAN_S` of the rounds' own time, after a tau of history. The result is
    the factor by which the replica's output rate changed (the usual gap over the streak's
    median, for a slowdown times the batch's growth), or None. A round's own time assumes the
    gateway sees every stream of the replica; with several gateway replicas it sees a part and
    a round spans several steps (the watch is then slower, not wrong).
    """

    __slots__ = (
        "_big",
        "_earlier",
        "_ended_events",
        "_ended_tokens",
        "_lingering",
        "_round",
        "_round_n",
        "_started",
        "per_event",
    )
    _PER_SPEED = -1

    def __init__(self) -> None:
        super().__init__()
        self._round: list[tuple[float, int]] = []
        self._round_n = 0
        self._started = 0.0  # prompt tokens of streams that started in this round
        self._earlier: deque[float] = deque()  # ... in the rounds before it a gap still spans
        self._lingering = math.inf  # the fewest prompt tokens waiting at any gap of this round
        self._big = 0  # readings in a row at least GAP_BIG_RATIO slower
        # Tokens a stream gets per chunk, so steps per gap: 1 unless the engine sends several
        # tokens an event (`ended`).
        self.per_event = 1.0
        self._ended_tokens = 0.0  # the finished streams' tokens and chunks, followed
        self._ended_events = 0.0

    @property
    def gap(self) -> float | None:
        """The usual seconds between two chunks of a stream."""
        return self.value

    def started(self, prompt_tokens: float) -> None:
        """A stream's first chunk came: its prompt was prefilled in the steps just run."""
        if 0 < prompt_tokens < math.inf:
            self._started += prompt_tokens

    def ended(self, tokens: int, events: int) -> None:
        """One of the replica's streams ended with `tokens` output tokens in `events` chunks:
        how many steps a gap spans (an engine's stream interval, speculative decoding). The
        chunks that carry no token (the role, the usage) make it a little low: a round then
        spans a little more than a step."""
        if events < 2 or tokens <= 0:
            return
        self._ended_tokens += PER_EVENT_WEIGHT * (tokens - self._ended_tokens)
        self._ended_events += PER_EVENT_WEIGHT * (events - self._ended_events)
        self.per_event = max(1.0, self._ended_tokens / self._ended_events)

    @property
    def per_event_learned(self) -> bool:
        """Some stream has ended: `per_event` is learned, not assumed."""
        return self._ended_events > 0

    def add(
        self, gap: float, count: int, batch: float, waiting_tokens: float = 0.0
    ) -> float | None:
        if waiting_tokens < self._lingering:
            self._lingering = max(0.0, waiting_tokens)
        if not (0 < gap < math.inf and count > 0):
            return None
        self._round.append((gap, count))
        self._round_n += count
        steps = self.per_event
        if self._round_n < max(SHIFT_MIN_RUNNING, batch / steps):
            return None
        half, seen, median = self._round_n / 2, 0, 0.0
        for median, n in sorted(self._round):  # noqa: B007 (the median is where it stops)
            seen += n
            if seen >= half:
                break
        earlier = self._earlier
        prefilled = self._started + self._lingering + sum(earlier)
        share = PREFILL_TOKEN_WEIGHT * prefilled / (max(batch, 1.0) * steps)
        earlier.append(self._started)
        while len(earlier) >= steps:
            earlier.popleft()
        # The round's own time: each stream sends a chunk a gap, so batch / steps chunks come
        # in a step (the round), more where a round takes at least SHIFT_MIN_RUNNING chunks.
        took = median * min(1.0, self._round_n / max(batch, 1.0))
        self._round.clear()
        self._round_n = 0
        self._started = 0.0
        self._lingering = math.inf
        return self._observe(median, batch, share, took)

    def _observe(self, gap: float, batch: float, share: float, took: float) -> float | None:
        """One round: its median `gap`, the prefills' `share`, the round's own time `took`."""
        if batch < SHIFT_MIN_RUNNING or not (batch < math.inf and share < math.inf):
            self.interrupt()
            return None
        heavy = share > PREFILL_SHARE
        if heavy:
            gap /= 1 + share  # the least its steps' decoding alone took
        usual, usual_batch = self.value, self.batch
        if usual is None or usual_batch is None:
            if not heavy:
                self.value, self.batch, self.seen_s = gap, batch, 0.0
            return None
        # A gap spans k steps, so one stall (a long prefill, a pause of the gateway's event
        # loop) lengthens the gaps of the k rounds after it: a run must outlast them.
        beyond_one = math.ceil(self.per_event) - 1
        rounds = GAP_ROUNDS + beyond_one
        grown = 1.0
        if gap >= SHIFT_RATIO * usual:
            grown = max(1.0, batch / usual_batch)
            # A step costs a fixed part plus a part per stream, so a batch q times the usual
            # makes it at most q times longer: the rest is the replica's own.
            beyond = gap / grown
            moved = beyond >= SHIFT_RATIO * usual
            if moved and beyond >= GAP_BIG_RATIO * usual:
                self._big += 1
            elif not heavy:  # a heavy round's slowdown is only a floor: it breaks no run
                self._big = 0
            if self._big >= GAP_BIG_ROUNDS + beyond_one:
                rounds = GAP_BIG_ROUNDS + beyond_one
        else:
            if not heavy:
                self._big = 0
            fast = not heavy and gap * GAP_SPEEDUP_RATIO <= usual
            moved = fast and batch >= (1 - SHIFT_BATCH_BAND) * usual_batch
        if heavy and not moved:
            # No slowdown beyond its prefills, and no measure of the usual gap: the usual pair
            # of gap and batch stays as it was (a batch followed without its gap would read a
            # step of the old batch as the new one's).
            return None
        new = self._follow(gap, batch, moved, took, rounds, GAP_SPAN_S)
        # The replica's output rate moved by its streams' speed times its batch's growth (a
        # slowdown's; a speed-up is taken at its streams' speed alone).
        return None if new is None else usual / new * grown

    def interrupt(self) -> None:
        super().interrupt()
        self._big = 0


class _Track:
    __slots__ = ("adopted", "estimate", "fast", "samples", "total")

    def __init__(self) -> None:
        self.total = 0
        self.samples: deque[tuple[float, int]] = deque()
        self.estimate: float | None = None
        self.fast = False
        # The estimate is another gateway replica's, which scrapes the replica (`adopt`): this
        # one keeps no window of its own for it until it counts tokens of it again.
        self.adopted = False


def _learn_here(track: _Track) -> None:
    """An adopted estimate is learned here again: the window starts now, from the adopted
    estimate, not from a count that stood still while adopted."""
    track.adopted = False
    track.samples.clear()


class CapacityEstimator:
    __slots__ = ("_fast_tau_s", "_fast_window_s", "_last_refresh", "_tau_s", "_tracks", "_window_s")

    def __init__(
        self,
        window_s: float = 60.0,
        tau_s: float = 10.0,
        fast_window_s: float = 15.0,
        fast_tau_s: float = 5.0,
    ) -> None:
        if min(window_s, tau_s, fast_window_s, fast_tau_s) <= 0:
            raise ValueError("windows and time constants must be positive")
        self._window_s = window_s
        self._tau_s = tau_s
        self._fast_window_s = fast_window_s
        self._fast_tau_s = fast_tau_s
        self._tracks: dict[str, _Track] = {}
        self._last_refresh: float | None = None

    def add_tokens(self, key: str, tokens: int) -> None:
        """Count output tokens a replica completed (called when a response ends)."""
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track()
        elif track.adopted:  # this replica took over the scrapes
            _learn_here(track)
        track.total += tokens

    def adopt(self, key: str, estimate: float | None, fast: bool) -> None:
        """Take the estimate another gateway replica learned from its scrapes of the replica
        (`plugin.adapters.scraper`): the replicas then score it alike, and this one spends
        nothing learning it. Only a `fast` one, taught by the engine's own counter (the same
        for every gateway replica); where the gateways' counts teach it, each replica has all of
        them from the shared counters and learns it itself. None (not learned there yet) keeps
        this one's estimate."""
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track()
        if not fast:
            if track.adopted:  # the engine stopped exporting its counter
                _learn_here(track)
            track.fast = False
            return
        track.adopted = track.fast = True
        if estimate is not None and 0 < estimate < math.inf:
            track.estimate = estimate

    def total(self, key: str) -> int:
        track = self._tracks.get(key)
        return 0 if track is None else track.total

    def estimate(self, key: str) -> float | None:
        track = self._tracks.get(key)
        return None if track is None else track.estimate

    def estimates(self) -> dict[str, float]:
        return {k: t.estimate for k, t in self._tracks.items() if t.estimate is not None}

    def ensure(self, key: str) -> None:
        """Start tracking a replica so its first window begins when it appears, not later."""
        if key not in self._tracks:
            self._tracks[key] = _Track()

    def forget(self, key: str) -> None:
        self._tracks.pop(key, None)

    def set_fast(self, key: str, fast: bool) -> None:
        """Track the replica with the short window (its tokens come as they are generated)."""
        self.ensure(key)
        self._tracks[key].fast = fast

    def rescale(self, key: str, factor: float) -> None:
        """The replica's speed changed by `factor`: scale its estimate, and start its window
        afresh so tokens from before the change do not pull the estimate back."""
        track = self._tracks.get(key)
        if track is None or track.estimate is None or not 0 < factor < math.inf:
            return
        track.estimate *= factor
        if track.samples:
            track.samples = deque([track.samples[-1]])

    def is_adopted(self, key: str) -> bool:
        """The estimate is another gateway replica's (`adopt`), not learned here."""
        track = self._tracks.get(key)
        return track is not None and track.adopted

    def is_fast(self, key: str) -> bool:
        track = self._tracks.get(key)
        return track is not None and track.fast

    def refresh(self, now: float) -> None:
        """Turn each counter into a windowed rate and fold it into the EWMA."""
        dt = 0.0 if self._last_refresh is None else now - self._last_refresh
        self._last_refresh = now
        slow = (now - self._window_s, 1.0 - math.exp(-dt / self._tau_s))
        fast = (now - self._fast_window_s, 1.0 - math.exp(-dt / self._fast_tau_s))
        for track in self._tracks.values():
            if track.adopted:
                continue
            horizon, alpha = fast if track.fast else slow
            samples = track.samples
            samples.append((now, track.total))
            # Keep one sample at or before the horizon as the window's base.
            while len(samples) > 2 and samples[1][0] <= horizon:
                samples.popleft()
            base_t, base_total = samples[0]
            span = now - base_t
            delta = track.total - base_total
            if span <= 0 or delta <= 0:
                continue  # no completed tokens in the window: keep the estimate
            rate = delta / span
            if track.estimate is None:
                track.estimate = rate  # first estimate: the measured rate, not a ramp from zero
            else:
                track.estimate += alpha * (rate - track.estimate)


class SpeedWatch(_Usual):
    """One replica's speed per running request, scrape by scrape (module doc).

    `observe` takes what one scrape interval saw: the engine's generated tokens in it, its
    running count at both ends and the interval's length. Its result is the factor by which the
    replica's speed changed, once a change held for `SHIFT_SCRAPES` scrapes in a row; None
    otherwise. The usual speed and batch follow slowly (tau `SHIFT_TAU_S`), not while a change
    is being confirmed, and a change counts only after they were followed for a tau.

    A step costs a fixed part plus a part per sequence, so a batch a quarter larger than the
    usual one makes each sequence less than a quarter slower, and a smaller batch never makes
    it slower: slower at a batch at most `SHIFT_BATCH_BAND` above the usual one, or faster at
    one at most that far below it, is the replica's own speed. The factor is the streak's median
    (a second of stall behind a long prefill does not set it).
    """

    __slots__ = ()

    @property
    def speed(self) -> float | None:
        """The usual tokens per running request per second."""
        return self.value

    def observe(
        self, tokens: float, running_before: float, running_now: float, dt: float
    ) -> float | None:
        batch = (running_before + running_now) / 2
        if dt <= 0 or tokens < 0 or batch < SHIFT_MIN_RUNNING or not batch < math.inf:
            self.interrupt()
            return None
        speed = tokens / (batch * dt)
        usual, usual_batch = self.value, self.batch
        if usual is None or usual_batch is None or usual <= 0:
            self.value, self.batch, self.seen_s = speed, batch, 0.0
            return None
        ratio = speed / usual
        if ratio >= SHIFT_RATIO:
            moved = batch >= (1 - SHIFT_BATCH_BAND) * usual_batch
        else:
            moved = ratio <= 1 / SHIFT_RATIO and batch <= (1 + SHIFT_BATCH_BAND) * usual_batch
        new = self._follow(speed, batch, moved, dt, SHIFT_SCRAPES, 0.0)
        return None if new is None else new / usual
