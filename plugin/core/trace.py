"""Request traces in AIBrix's format: what the gateway tells the GPU optimizer about its traffic.

AIBrix's GPU optimizer plans from the traffic its gateways record, one JSON document per model
and 10 s window at Redis key `aibrix:<model>_request_trace_<unix>`, `<unix>` a multiple of 10:
the window's END, the boundary at which it is written. (AIBrix's gateway writes each window just
after its boundary under that time rounded down to 10 s, and its optimizer reads key
`ts - ts % 10` about 2 s after a boundary and never returns to it: a key labelled with the start
would be read before it was written.)
Writing the same documents lets AIBrix's optimizer read this gateway's traffic, and this
project's optimizer read AIBrix's gateways'. A document holds:

- counts of requests that COMPLETED in the window with token counts the engine reported, keyed
  `"<a>:<b>"` with `a = round(log2(input tokens) * precision)` and `b` the same of output tokens
  (0 for zero tokens): a log2 histogram of request sizes, `precision` steps per doubling;
- `meta_v` (4), `meta_interval_sec` (10), `meta_precision` (10);
- `meta_total_reqs`: requests that ARRIVED in the window (from version 3 on, the rate the
  optimizer plans for: completions lag arrivals by a request's duration);
- `meta_pending_reqs`: requests in flight at the window's end that arrived before it started;
- `meta_queueing_reqs` (version 4): requests held in the gateway's queue at the window's end.

Readers accept versions 1 to 4 as AIBrix's reader does: before version 2 there is no meta data
(precision 1), before version 3 the request count is the sum of the counts.

Pure: no clock, no I/O. The gateway's recorder and flusher (`plugin.adapters.tracing`) count
and write; the optimizer (`plugin.core.workload`) reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from plugin.errors import TraceFormatError

__all__ = [
    "TRACE_INTERVAL_S",
    "TRACE_KEY_PREFIX",
    "TRACE_PRECISION",
    "TRACE_TTL_S",
    "TRACE_VERSION",
    "TraceWindow",
    "bucket",
    "tick",
    "trace_key",
    "window_start",
]

TRACE_INTERVAL_S = 10  # seconds per window
TRACE_PRECISION = 10  # buckets per doubling of tokens
TRACE_VERSION = 4  # 4 adds meta_queueing_reqs to AIBrix's version 3
TRACE_TTL_S = 600  # a window's key expires this long after its last write
TRACE_KEY_PREFIX = "aibrix:"

_META = "meta_"
_CELL_RE = re.compile(r"^(\d+):(\d+)$")  # what AIBrix's reader accepts
_MAX_VERSION = TRACE_VERSION
MAX_LOG2_TOKENS = 40  # a bucket beyond 2**40 tokens is a corrupt key (and 2**x would overflow)


def trace_key(model: str, window_start: int, interval: int = TRACE_INTERVAL_S) -> str:
    """The Redis key of a model's trace window starting at `window_start` (unix seconds): it is
    labelled with the window's end, `window_start + interval`, as AIBrix labels it."""
    return f"{TRACE_KEY_PREFIX}{model}_request_trace_{window_start + interval}"


def window_start(t: float, interval: int = TRACE_INTERVAL_S) -> int:
    """The start of the window holding unix time `t`: a multiple of `interval`."""
    return math.floor(t / interval) * interval


def tick(tokens: int, precision: int = TRACE_PRECISION) -> int:
    """One side of a bucket: round(log2(tokens) * precision), 0 for zero tokens."""
    if tokens < 0:
        raise ValueError(f"a token count cannot be negative, got {tokens}")
    if tokens == 0:
        return 0
    return math.floor(math.log2(tokens) * precision + 0.5)  # halves away from zero, as AIBrix


def bucket(input_tokens: int, output_tokens: int, precision: int = TRACE_PRECISION) -> str:
    """The count key of a request of this size: `"<tick(in)>:<tick(out)>"`."""
    return f"{tick(input_tokens, precision)}:{tick(output_tokens, precision)}"


def _count(value: Any, what: str) -> int:
    """A non-negative integer from JSON (an integral float is one: some encoders write 5.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFormatError(f"{what} is {value!r}, not a non-negative integer")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise TraceFormatError(f"{what} is {value!r}, not a non-negative integer")
    if value < 0:
        raise TraceFormatError(f"{what} is {value!r}, not a non-negative integer")
    return int(value)


def _positive(value: Any, what: str) -> int:
    n = _count(value, what)
    if n == 0:
        raise TraceFormatError(f"{what} is 0; it must be positive")
    return n


@dataclass(slots=True)
class TraceWindow:
    """One model's traffic in one window, as one gateway counted it or as read back merged."""

    model: str
    start: int  # unix seconds, a multiple of interval_s
    counts: dict[str, int]  # "<a>:<b>" -> requests completed in the window with that size
    total_reqs: int  # requests that arrived in the window
    pending_reqs: int  # in flight at the window's end, arrived before it started
    queueing_reqs: int  # held in the gateway's queue at the window's end
    interval_s: int = TRACE_INTERVAL_S
    precision: int = TRACE_PRECISION

    @property
    def empty(self) -> bool:
        """Nothing arrived and nothing completed: such a window is not written."""
        return self.total_reqs == 0 and not any(self.counts.values())

    def to_json(self) -> dict[str, Any]:
        """The document written to Redis (counts in key order, then the meta data). A zero
        count is left out: AIBrix's reader refuses one (it takes 0 for a parse failure)."""
        doc: dict[str, Any] = {k: n for k, n in sorted(self.counts.items()) if n}
        doc.update(
            meta_v=TRACE_VERSION,
            meta_interval_sec=self.interval_s,
            meta_precision=self.precision,
            meta_total_reqs=self.total_reqs,
            meta_pending_reqs=self.pending_reqs,
            meta_queueing_reqs=self.queueing_reqs,
        )
        return doc

    @classmethod
    def parse(cls, model: str, start: int, doc: Mapping[str, Any]) -> TraceWindow:
        """A window from its document, any version 1 to 4 (as AIBrix's reader takes them).

        Unknown `meta_*` fields are ignored, as AIBrix's reader does; anything else that is not
        a `"<int>:<int>"` count with a non-negative integer value raises `TraceFormatError`.
        """
        if not isinstance(doc, Mapping):
            raise TraceFormatError(f"a trace window is a JSON object, not {type(doc).__name__}")
        version = _positive(doc.get("meta_v", 1), "meta_v")
        if version > _MAX_VERSION:
            raise TraceFormatError(f"meta_v {version} is newer than this reader ({_MAX_VERSION})")
        precision = _positive(doc.get("meta_precision", 1), "meta_precision")
        interval = TRACE_INTERVAL_S
        if version >= 2:
            interval = _positive(doc.get("meta_interval_sec", interval), "meta_interval_sec")
        counts: dict[str, int] = {}
        for key, value in doc.items():
            if not isinstance(key, str):
                raise TraceFormatError(f"key {key!r} is not a string")
            if key.startswith(_META):
                continue
            match = _CELL_RE.match(key)
            if match is None:
                raise TraceFormatError(f"key {key!r} is neither a meta_ field nor '<int>:<int>'")
            a, b = int(match.group(1)), int(match.group(2))
            if max(a, b) > MAX_LOG2_TOKENS * precision:
                raise TraceFormatError(f"key {key!r} is beyond 2**{MAX_LOG2_TOKENS} tokens")
            cell = f"{a}:{b}"  # "07:3" and "7:3" are one
            counts[cell] = counts.get(cell, 0) + _count(value, f"count {key!r}")
        total = pending = queueing = 0
        if version >= 3:
            total = _count(doc.get("meta_total_reqs", 0), "meta_total_reqs")
            pending = _count(doc.get("meta_pending_reqs", 0), "meta_pending_reqs")
        else:
            total = sum(counts.values())
        if version >= 4:
            queueing = _count(doc.get("meta_queueing_reqs", 0), "meta_queueing_reqs")
        return cls(model, start, counts, total, pending, queueing, interval, precision)

    def cells(self) -> Iterator[tuple[float, float, int]]:
        """(input tokens, output tokens, count) per bucket; tokens = 2 ** (tick / precision), so
        a bucket of zero tokens reads as 1 token."""
        for key, count in self.counts.items():
            a, _, b = key.partition(":")
            yield 2 ** (int(a) / self.precision), 2 ** (int(b) / self.precision), count
