"""Per-replica capacity learned from completed output tokens (README "Routing").

On every refresh, each replica's cumulative completed-token counter becomes a rate over a window
of about a minute; an EWMA with time constant tau smooths it (alpha = 1 - exp(-dt / tau)). A window
with no completed tokens keeps the previous estimate: an idle replica is not slow.

Tokens counted when responses end arrive in lumps (a long answer credits all its tokens at once),
hence the long window. A replica whose engine's own counter feeds it (tokens as they are
generated, step by step) is tracked `fast`: a 15 s window and 5 s tau, which follow a change of
its speed within about 20 s and, in the simulator, do not flap under Poisson noise
(`python -m plugin_tools.sim.shift`).
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["CapacityEstimator"]


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
