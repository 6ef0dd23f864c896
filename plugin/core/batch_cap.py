"""One replica's batch cap: declared by its pod, exported by its engine, or learned from scrapes.

The full-batch rule of the strategies passes over a replica at its batch cap (`Candidate.
saturation`). Most engines do not export their cap (vLLM's `--max-num-seqs`), so the gateway
learns it from what a full engine shows: a queue held while it runs the most it has ever run.
Pure state with time passed in; the pool owns one per pod.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plugin.core.types import EngineMetrics

__all__ = ["HELD_STEPS", "KV_BOUND", "BatchCap", "CapLearning"]

# KV-cache usage at or above which a queue is put down to the KV cache, not to a batch cap.
KV_BOUND = 0.9
# Engine steps (mean inter-token latency) the requests admitted since the last scrape must have
# waited on average for a queue to count as held by a full batch: one that only waits for the
# next step waits half a step on average.
HELD_STEPS = 2.0


@dataclass(frozen=True, slots=True)
class CapLearning:
    """How caps are learned and probed (`PodPool`'s settings)."""

    probe_s: float = 60.0  # a cap nothing confirmed for this long, but pressed on, is probed
    scrapes: int = 4  # scrapes in a row that must see a queue at the same top


@dataclass(slots=True)
class _Cap:
    """A learned batch cap: when the engine last confirmed it (queued at it), and whether it ran
    at it since (only a cap that holds traffic back is worth probing)."""

    value: int
    confirmed: float
    pressed: bool = False
    probed_from: int | None = None  # the value before a probe, until the probe is settled


class BatchCap:
    """One engine's batch cap as the scrapes show it (`read`); `value(declared)` is the cap
    the strategies see, the pod's declared one first."""

    __slots__ = ("_clock", "_exported", "_learned", "_peak", "_streak")

    def __init__(self) -> None:
        self._exported: int | None = None  # the cap the engine exports (TensorRT-LLM), if any
        self._learned: _Cap | None = None
        self._streak: tuple[float, int] | None = None  # (top running, scrapes in a row)
        self._peak = 0.0  # the most the engine was seen running
        # The engine's queue-time and inter-token-latency sums and counts at the last scrape.
        self._clock: tuple[float, float, float, float] | None = None

    def value(self, declared: int | None) -> int | None:
        """The cap: `declared` (the pod's), else exported by the engine, else learned; None
        while unknown."""
        if declared is not None:
            return declared
        if self._exported is not None:
            return self._exported
        return None if self._learned is None else self._learned.value

    def source(self, declared: int | None) -> str | None:
        """Where `value` comes from: `declared`, `engine`, `learned`, or None (unknown)."""
        if declared is not None:
            return "declared"
        if self._exported is not None:
            return "engine"
        return "learned" if self._learned is not None else None

    def full_at(self, declared: int | None) -> int | None:
        """The in-flight count at which the full-batch rule passes the replica over: its
        declared or exported cap, or its learned cap plus a 1/64 slack. A learned cap can read
        a request or two low (a full engine scraped just after some requests finished); fenced
        exactly there, the engine would never run its real batch and the cap would never be
        raised to it."""
        cap = self.value(declared)
        if cap is None or self.source(declared) != "learned":
            return cap
        return cap + max(1, cap // 64)

    def adopt(self, cap: int | None, source: str | None, now: float) -> None:
        """Take the cap another gateway replica learned from its scrapes of the engine
        (`value` and `source` there, the pod's declaration aside): `engine`, `learned`, or None
        (none yet). Taken as confirmed now, and as the most the engine was seen running: a
        replica that takes the scrapes over neither probes it at once nor learns a lower one
        from a queue below it."""
        if source == "engine" and cap is not None:
            self._exported, self._learned = cap, None
        elif source == "learned" and cap is not None:
            self._exported = None
            learned = self._learned
            if learned is not None and learned.value == cap:  # unchanged: confirmed in place
                learned.confirmed, learned.pressed, learned.probed_from = now, False, None
            else:
                self._learned = _Cap(cap, now)
        else:
            self._exported = self._learned = None
        if cap is not None and cap > self._peak:
            self._peak = float(cap)
        self._streak = None
        self._clock = None  # queue times are read afresh from the next own scrape

    def _read_exported(self, cap: float | None) -> None:
        """Keep the batch cap the engine exports, if it exports one (a finite number >= 1); what
        was learned before it did is dropped. An engine that stops exporting it (a restart with
        another version) has its cap learned again."""
        if cap is None or not 1 <= cap < math.inf:
            self._exported = None
            return
        self._exported = int(cap)
        self._learned = None
        self._streak = None

    def read(
        self,
        metrics: EngineMetrics,
        now: float,
        declared: int | None,
        on_pod: int,
        learning: CapLearning,
    ) -> None:
        """A scrape (`on_pod`: the requests the gateways hold on the pod). An engine at its
        batch cap keeps a queue while running the most it has ever run: that number is its
        cap (unless the pod declares one, `Pod.max_num_seqs`, or its engine exports one:
        either wins).

        - Learned (or corrected) when a queue shows in `learning.scrapes` scrapes in a row
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
        - Probed: a cap the engine has not confirmed for `learning.probe_s` grows by a quarter,
          if since then the gateways held as many requests on the pod as the cap while the
          engine queued none. A false cap stops the very traffic that would prove it wrong;
          the probe lets a little more through, and the engine either runs it (the cap was
          low) or queues at the old cap again (it is back at once). A cap nothing presses on
          stays.
        """
        self._read_exported(metrics.max_batch)
        held_back = self._waited_steps(metrics)
        running, waiting = metrics.running, metrics.waiting
        if running is None or waiting is None or not 1 <= running < math.inf:  # NaN, inf
            return
        if declared is not None or self._exported is not None:
            return
        if running > self._peak:
            self._peak = running
        queued = waiting >= 1
        # Where the engine says how long its queue held requests, only a queue that held them
        # for steps counts (`HELD_STEPS`): at high load with long steps nearly every scrape
        # finds a few requests waiting for the next step, at a steady running count.
        held = queued and held_back is not False
        kv = metrics.kv_usage
        streak, top = 0, running
        if held and not (kv is not None and kv >= KV_BOUND):
            last = self._streak
            if last is not None and last[0] - max(1.0, last[0] / 64) <= running <= last[0]:
                top, streak = last[0], last[1] + 1  # held at (or just under) the same top
            elif running >= self._peak:
                streak = 1  # a new top: a queue at the peak starts a streak
        self._streak = (top, streak) if streak else None
        cap = self._learned
        if streak >= learning.scrapes:
            self._learned = _Cap(int(top), now)
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
                cap.pressed = cap.pressed or (on_pod >= cap.value and not queued)
                if cap.pressed and now - cap.confirmed > learning.probe_s:
                    cap.probed_from = cap.value
                    cap.value = max(cap.value + 1, math.ceil(cap.value * 1.25))
                    cap.confirmed, cap.pressed = now, False

    def _waited_steps(self, metrics: EngineMetrics) -> bool | None:
        """Did the requests the engine counted in its queue-time histogram since the last scrape
        (vLLM counts a request when it finishes) wait `HELD_STEPS` steps or more on average?
        None when the engine does not say (no histograms, a first read, a restart, no step ran,
        none counted)."""
        qs, qc = metrics.queue_time_sum, metrics.queue_time_count
        ls, lc = metrics.token_latency_sum, metrics.token_latency_count
        if qs is None or qc is None or ls is None or lc is None:
            self._clock = None
            return None
        inf = math.inf
        if not (0 <= qs < inf and 0 <= qc < inf and 0 <= ls < inf and 0 <= lc < inf):
            self._clock = None  # NaN, inf, negative
            return None
        last, self._clock = self._clock, (qs, qc, ls, lc)
        if last is None:
            return None
        # Spelled out, not zipped: this runs for every pod on every scrape tick.
        waited, admitted, latency, tokens = qs - last[0], qc - last[1], ls - last[2], lc - last[3]
        if min(waited, admitted, latency, tokens) < 0 or tokens <= 0:
            return None  # a restarted engine, or one that ran no step
        if admitted <= 0:
            return None  # vLLM observes queue times as requests finish: none finished
        return waited / admitted >= HELD_STEPS * latency / tokens
