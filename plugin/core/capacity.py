"""Per-replica capacity learned from completed output tokens (README "Routing").

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
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["CapacityEstimator", "SpeedWatch"]

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


class _Track:
    __slots__ = ("estimate", "fast", "samples", "total")

    def __init__(self) -> None:
        self.total = 0
        self.samples: deque[tuple[float, int]] = deque()
        self.estimate: float | None = None
        self.fast = False


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
        track.total += tokens

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


class SpeedWatch:
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

    __slots__ = ("batch", "seen_s", "speed", "streak")

    def __init__(self) -> None:
        self.speed: float | None = None  # usual tokens per running request per second
        self.batch: float | None = None  # usual running count
        self.seen_s = 0.0  # how long the usual speed has been followed
        self.streak: list[float] = []  # speeds of the scrapes in a row that moved

    def observe(
        self, tokens: float, running_before: float, running_now: float, dt: float
    ) -> float | None:
        batch = (running_before + running_now) / 2
        if dt <= 0 or tokens < 0 or batch < SHIFT_MIN_RUNNING or not batch < math.inf:
            self.streak.clear()
            return None
        speed = tokens / (batch * dt)
        usual, usual_batch = self.speed, self.batch
        if usual is None or usual_batch is None or usual <= 0:
            self.speed, self.batch, self.seen_s = speed, batch, 0.0
            return None
        ratio = speed / usual
        if ratio >= SHIFT_RATIO:
            moved = batch >= (1 - SHIFT_BATCH_BAND) * usual_batch
        else:
            moved = ratio <= 1 / SHIFT_RATIO and batch <= (1 + SHIFT_BATCH_BAND) * usual_batch
        streak = self.streak
        if moved and self.seen_s >= SHIFT_TAU_S:
            if streak and (ratio > 1) != (streak[-1] > usual):
                streak.clear()  # it moved the other way: start again
            streak.append(speed)
            if len(streak) < SHIFT_SCRAPES:
                return None
            new = sorted(streak)[len(streak) // 2]
            streak.clear()
            self.speed, self.batch = new, batch  # the new usual, at once
            self.seen_s = 0.0  # and a tau of it before another change counts
            return new / usual
        streak.clear()
        self.seen_s += dt
        alpha = 1.0 - math.exp(-dt / SHIFT_TAU_S)
        self.speed = usual + alpha * (speed - usual)
        self.batch = usual_batch + alpha * (batch - usual_batch)
        return None
