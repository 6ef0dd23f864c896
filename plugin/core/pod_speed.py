"""What the gateway learns of one replica's speed beyond its token counts: the engine's own
generated-token counter and the two watches that notice a sudden change of speed.

A replica whose engine exports a generated-token counter (vLLM's) teaches its capacity from the
counter's increase, and its `SpeedWatch` compares it with the running count scrape by scrape; a
replica whose streams the gateway reads has a `GapWatch` on the gaps between its chunks. Either
watch rescales the capacity estimate once when the speed changes, and the other takes the new
speed as its usual. Pure state with time passed in; the pool owns one per pod.
"""

from __future__ import annotations

import math

from plugin.core.batch_cap import KV_BOUND
from plugin.core.capacity import CapacityEstimator, GapWatch, SpeedWatch
from plugin.core.types import EngineMetrics

__all__ = ["PodSpeed"]


class PodSpeed:
    """One pod's engine counter and speed watches; `rescaled` counts the changes acted on."""

    __slots__ = ("_scrapes", "engine_tokens", "gaps", "rescaled", "rescaled_by_gaps")

    def __init__(self) -> None:
        # The engine's generated-token counter as last read; None: the engine does not export
        # it and the gateway's own counts teach the capacity.
        self.engine_tokens: float | None = None
        # The scrape watch, and the time and running count of its last scrape.
        self._scrapes: tuple[SpeedWatch, float, float] | None = None
        self.gaps: GapWatch | None = None  # on the pod's response chunks, once any was seen
        self.rescaled = 0  # speed changes the watches acted on
        self.rescaled_by_gaps = 0  # of those, the chunk-gap watch's

    def read_generated(
        self, capacity: CapacityEstimator, key: str, metrics: EngineMetrics, now: float
    ) -> None:
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
            if self.engine_tokens is not None:
                self.engine_tokens = None
                capacity.set_fast(key, False)
            self._scrapes = None
            return
        last, self.engine_tokens = self.engine_tokens, total
        seen = self._scrapes
        ran = running if running is not None and 0 <= running < math.inf else None
        if ran is None:
            self._scrapes = None
        else:
            self._scrapes = (SpeedWatch() if seen is None else seen[0], now, ran)
        if last is None:
            capacity.set_fast(key, True)  # tokens as generated: the short window
            return
        gained = total - last if total >= last else total
        if gained > 0:
            capacity.add_tokens(key, round(gained))
        if seen is not None and total < last:
            seen[0].interrupt()  # a restarted engine: the scrapes around it are not in a row
            self.gaps = None  # and its chunks (another stream interval) learned anew
        if seen is not None and ran is not None and total >= last:
            watch, then, ran_then = seen
            kv = metrics.kv_usage
            if not metrics.generation_tokens_stepwise or (kv is not None and kv >= KV_BOUND):
                watch.interrupt()
                return
            factor = watch.observe(gained, ran_then, ran, now - then)
            if factor is not None:
                self._changed(capacity, key, factor, watch)  # routing sees it as the tick ends

    def adopt(self, metrics: EngineMetrics | None) -> None:
        """Another gateway replica scrapes the engine and learns its capacity from the counter
        in `metrics` (`CapacityEstimator.adopt`; None: not from a counter): keep the counter as
        read there, so that the token source is the same everywhere and a replica that takes
        over the scrapes credits the tokens generated since (its scrape watch starts afresh)."""
        total = None if metrics is None else metrics.generation_tokens
        self.engine_tokens = total if total is not None and 0 <= total < math.inf else None
        self._scrapes = None

    def read_gap(
        self,
        capacity: CapacityEstimator,
        key: str,
        gap_s: float,
        count: int,
        batch: int,
        waiting_prompt: int,
        kv_usage: float | None,
    ) -> bool:
        """Seconds between two chunks of one of the pod's streams (`count` streams saw it), with
        `batch` requests on the pod and `waiting_prompt` prompt tokens of them not yet streaming
        (their prefills may lengthen a step). True when the speed change it showed rescaled the
        capacity estimate."""
        watch = self.gaps
        if watch is None:
            watch = self.gaps = GapWatch()
        if kv_usage is not None and kv_usage >= KV_BOUND:
            # A full KV cache preempts and recomputes: steps grow beyond the batch's share (the
            # scrape watch stops there too).
            watch.interrupt()
            return False
        factor = watch.add(gap_s, count, batch, max(0, waiting_prompt))
        if factor is None:
            return False
        self._changed(capacity, key, factor, watch)
        return True

    def _changed(
        self, capacity: CapacityEstimator, key: str, factor: float, seen_by: SpeedWatch | GapWatch
    ) -> None:
        """`seen_by` saw the pod's speed change by `factor`: rescale its estimate once, and the
        pod's other watch takes the new speed as its usual (`rebase`). Not where another
        gateway replica scrapes the pod: it rescales the estimate, for every replica."""
        if capacity.is_adopted(key):
            return
        capacity.rescale(key, factor)
        self.rescaled += 1
        if isinstance(seen_by, GapWatch):
            self.rescaled_by_gaps += 1
        scrapes = self._scrapes
        for other in (None if scrapes is None else scrapes[0], self.gaps):
            if other is not None and other is not seen_by:
                other.rebase(factor)

    def tokens_per_chunk(self) -> float | None:
        """Output tokens per chunk of the pod's streams, once the chunk-gap watch learned it."""
        gaps = self.gaps
        return gaps.per_event if gaps is not None and gaps.per_event_learned else None
