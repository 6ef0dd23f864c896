"""What `hetero-gateway bench` measures and for how long; light, so the CLI reads the defaults
from here without importing the benchmark itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

from plugin.errors import ConfigError

__all__ = ["PARTS", "BenchOptions"]

PARTS = ("overhead", "streaming", "routing")
_MAX_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """Counts and windows of every part; each batch is also capped in time by the runner."""

    parts: tuple[str, ...] = PARTS
    requests: int = 200  # per variant: latency at concurrency 1, and each streaming concurrency
    seconds: float = 6.0  # per variant: the throughput window, split over the rounds
    rounds: int = 2  # the variants run interleaved, round after round
    concurrency: int = 32  # closed-loop workers of the throughput runs
    stream_concurrency: tuple[int, ...] = (1, 16)
    routing_seconds: float = 45.0  # measured per strategy
    # Per strategy, left out of the figures. One capacity window (60 s): until the previous
    # strategy's completions have left it, load-balance scores with estimates learned under it.
    routing_warmup: float = 60.0
    routing_load: float = 0.8  # fraction of the fleet's saturated output tokens/s
    routing_time_scale: float = 4.0  # as `up`: every engine slowed alike so 2 cores keep up
    seed: int = 1
    progress: bool = True

    def check(self) -> None:
        """Fail before anything starts, naming the flag."""
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            raise ConfigError(f"--parts: unknown {unknown} (known: {', '.join(PARTS)})")
        for flag, count in (
            ("--requests", self.requests),
            ("--rounds", self.rounds),
            ("--concurrency", self.concurrency),
        ):
            if count < 1:
                raise ConfigError(f"{flag} must be >= 1")
        if not self.stream_concurrency or min(self.stream_concurrency) < 1:
            raise ConfigError("--stream-concurrency needs positive integers")
        for flag, value, low in (
            ("--seconds", self.seconds, 0.0),
            ("--routing-seconds", self.routing_seconds, 0.0),
            ("--routing-time-scale", self.routing_time_scale, 0.0),
        ):
            if not (math.isfinite(value) and low < value <= _MAX_SECONDS):
                raise ConfigError(f"{flag} must be in (0, {_MAX_SECONDS:g}]")
        if not (math.isfinite(self.routing_warmup) and 0 <= self.routing_warmup <= _MAX_SECONDS):
            raise ConfigError(f"--routing-warmup must be in [0, {_MAX_SECONDS:g}]")
        if not (math.isfinite(self.routing_load) and 0 < self.routing_load <= 2):
            raise ConfigError("--routing-load must be in (0, 2]")
