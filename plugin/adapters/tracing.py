"""Request tracing for the GPU optimizer: count on the request path, write merged windows to Redis.

On with `AIBRIX_GPU_OPTIMIZER_TRACING_FLAG` (which needs `REDIS_HOST`). Two halves:

- `TraceRecorder`, called by the ext_proc adapter on the request path. Each call is a dict
  increment on plain ints: no clock, no JSON, no Redis, nothing allocated but the counter.
  `arrived`: a request for a model the gateway serves (routed, held or refused: demand is demand;
  an unknown model is not counted, or any client could create keys). `started`/`ended`: a routed
  request's lease taken and given back, counted by the second it arrived (its `arrived_at`), so
  that a window's close can tell the requests in flight that arrived before the window began.
  `completed`: a response whose token usage the engine reported; its size bucket.
- `TraceFlusher`, a background task. Just after each 10 s boundary it closes the window that
  ended (takes the recorder's counts, adds the gateway queue's length and what is in flight),
  then writes each model's window to its key with ONE server-side Lua script, which merges this
  gateway's counts into what other gateway replicas already wrote to the same key, atomically.
  AIBrix's gateways each SET the key, so with several replicas the last writer wins and the
  optimizer sees a fraction of the traffic; here every replica's requests are counted.

The merge (`MERGE_SCRIPT`): the counts, `meta_total_reqs`, `meta_pending_reqs` and
`meta_queueing_reqs` are added to the document already there (each replica's pending and queued
requests are its own); `meta_v`, `meta_interval_sec`, `meta_precision` are set; the key is SET
again with a 600 s expiry, so it lives 600 s after its last write. A document of another
precision or interval, or not a JSON object, cannot be merged and is replaced. Each write carries
an id, recorded in a companion set (`hetero-gateway:trace-writes:<trace key>`, same expiry): a
write retried after its reply was lost is not added twice.

Failures never touch the request path: a write that fails (Redis down, slow, refusing) keeps its
windows and the next flush retries them; one warning is logged when writes start failing and a
reminder each minute while they do; windows whose key would already have expired (600 s) are
dropped, so memory stays bounded through any outage. `hetero_gateway_trace_flush_errors_total`
and `hetero_gateway_trace_windows_dropped_total` on `/metrics` show it.

Time: windows are aligned to the wall clock (every gateway's windows meet in the same keys); the
flusher's wall clock and the request path's clock (`arrived_at`) are injected, and so is the
interval, so tests close windows without waiting for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError

from plugin.adapters.redis_state import KEY_PREFIX, connect, describe_error
from plugin.config import RedisSettings
from plugin.core.trace import (
    TRACE_INTERVAL_S,
    TRACE_PRECISION,
    TRACE_TTL_S,
    TraceWindow,
    tick,
    trace_key,
    window_start,
)

__all__ = ["MERGE_SCRIPT", "TraceFlusher", "TraceRecorder", "writes_key"]

log = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.05  # after the boundary: a request finishing on it lands in its window
TIMEOUT_S = 2.0  # one flush (every window it writes) at most this long
REMINDER_S = 60.0  # while writes fail, a reminder in the log at most this often

# A bucket as one int on the request path (no string, no tuple): tick(in) * _CELL + tick(out).
# A tick is round(log2(tokens) * precision): below 4096 for any count of tokens below 2**409.
_CELL = 4096


def writes_key(key: str) -> str:
    """The set of write ids already merged into trace key `key`."""
    return f"{KEY_PREFIX}:trace-writes:{key}"


# KEYS[1] the window's trace key, KEYS[2] the ids of the writes merged into it; ARGV[1] this
# write's id, ARGV[2] this gateway's window (JSON), ARGV[3] the expiry in seconds.
# Returns 0: already merged (a retry), 1: the key was new, 2: merged, 3: replaced a document that
# could not be merged (another precision or interval, or not a JSON object).
MERGE_SCRIPT = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then
  return 0
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
local mine = cjson.decode(ARGV[2])
local function is_meta(k)
  return string.sub(k, 1, 5) == 'meta_'
end
local function mergeable(old)
  if type(old) ~= 'table' then return false end
  for k, _ in pairs(old) do
    if type(k) ~= 'string' then return false end
  end
  return (tonumber(old.meta_precision) or 1) == mine.meta_precision
    and (tonumber(old.meta_interval_sec) or 10) == mine.meta_interval_sec
end
local doc = {}
local outcome = 1
local raw = redis.call('GET', KEYS[1])
if raw then
  local ok, old = pcall(cjson.decode, raw)
  if ok and mergeable(old) then
    doc = old
    outcome = 2
    if (tonumber(old.meta_v) or 1) < 3 then
      local sum = 0
      for k, v in pairs(old) do
        if not is_meta(k) then sum = sum + (tonumber(v) or 0) end
      end
      doc.meta_total_reqs = sum
    end
  else
    outcome = 3
  end
end
for k, v in pairs(mine) do
  if not is_meta(k) then
    doc[k] = (tonumber(doc[k]) or 0) + v
  end
end
for _, k in ipairs({'meta_total_reqs', 'meta_pending_reqs', 'meta_queueing_reqs'}) do
  doc[k] = (tonumber(doc[k]) or 0) + mine[k]
end
doc.meta_v = mine.meta_v
doc.meta_interval_sec = mine.meta_interval_sec
doc.meta_precision = mine.meta_precision
redis.call('SET', KEYS[1], cjson.encode(doc), 'EX', ARGV[3])
return outcome
"""


class TraceRecorder:
    """What the request path counts between two window closes (see the module docstring)."""

    __slots__ = ("_arrivals", "_counts", "_live", "precision")

    def __init__(self, precision: int = TRACE_PRECISION) -> None:
        self.precision = precision
        self._arrivals: dict[str, int] = {}  # model -> requests arrived since the last close
        self._counts: dict[str, dict[int, int]] = {}  # model -> bucket -> completed since then
        # model -> second of arrival (floor of `arrived_at`) -> routed requests still in flight
        self._live: dict[str, dict[int, int]] = {}

    # the request path --------------------------------------------------------------------------
    def arrived(self, model: str) -> None:
        arrivals = self._arrivals
        arrivals[model] = arrivals.get(model, 0) + 1

    def completed(self, model: str, input_tokens: int, output_tokens: int) -> None:
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = {}
        p = self.precision
        cell = tick(input_tokens, p) * _CELL + tick(output_tokens, p)
        counts[cell] = counts.get(cell, 0) + 1

    def started(self, model: str, arrived_at: float) -> None:
        live = self._live.get(model)
        if live is None:
            live = self._live[model] = {}
        second = math.floor(arrived_at)
        live[second] = live.get(second, 0) + 1

    def ended(self, model: str, arrived_at: float) -> None:
        live = self._live.get(model)
        if live is None:
            return
        second = math.floor(arrived_at)
        left = live.get(second, 0) - 1
        if left > 0:
            live[second] = left
        else:
            live.pop(second, None)

    # the flusher -------------------------------------------------------------------------------
    def in_flight(self, model: str) -> int:
        """Routed requests of `model` still in flight."""
        return sum(self._live.get(model, {}).values())

    def close(
        self,
        start: int,
        started_at: float,
        queueing: Mapping[str, int],
        interval_s: int = TRACE_INTERVAL_S,
    ) -> list[TraceWindow]:
        """The window `start` ends now: a `TraceWindow` per model that had arrivals or
        completions since the last close (an empty window is not written), and the counters
        restart at zero. `started_at` is the window's start on the clock of `arrived_at`: the
        window's pending requests are those in flight now that arrived a whole second before it
        (a request arriving in the second the window began counts as the window's own).
        `queueing` is the number of requests held per model now."""
        arrivals, self._arrivals = self._arrivals, {}
        counts, self._counts = self._counts, {}
        cutoff = math.floor(started_at)
        windows = []
        for model in sorted(arrivals.keys() | counts.keys()):
            cells = counts.get(model, {})
            total = arrivals.get(model, 0)
            if not total and not cells:
                continue
            live = self._live.get(model, {})
            windows.append(
                TraceWindow(
                    model=model,
                    start=start,
                    counts={f"{c // _CELL}:{c % _CELL}": n for c, n in sorted(cells.items())},
                    total_reqs=total,
                    pending_reqs=sum(n for second, n in live.items() if second < cutoff),
                    queueing_reqs=queueing.get(model, 0),
                    interval_s=interval_s,
                    precision=self.precision,
                )
            )
        return windows


class TraceFlusher:
    """Closes each window just after it ends and merges it into Redis (module docstring)."""

    def __init__(
        self,
        recorder: TraceRecorder,
        settings: RedisSettings,
        *,
        queueing: Callable[[], Mapping[str, int]] = dict,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        interval_s: int = TRACE_INTERVAL_S,
        ttl_s: int = TRACE_TTL_S,
        delay_s: float = FLUSH_DELAY_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        """`clock` is the request path's (what `arrived_at` is measured on), `wall_clock` the
        unix time windows are aligned to; `queueing` says how many requests each model has held
        in the gateway's queue."""
        self.recorder = recorder
        self.settings = settings
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.delay_s = delay_s
        self.timeout_s = timeout_s
        self._queueing = queueing
        self._clock = clock
        self._wall = wall_clock
        self._open = window_start(wall_clock(), interval_s)  # the window counting now
        self._instance = secrets.token_hex(8)
        self._seq = 0
        # write id -> a closed window not written yet (several may share a key: each merges)
        self._pending: dict[str, TraceWindow] = {}
        self._client: Redis | None = None
        self._merge: AsyncScript | None = None
        self.up = True  # False while writes fail (for the log: one warning, then reminders)
        self._reminded_at = 0.0
        self.flush_errors_total = 0
        self.windows_written_total = 0
        self.windows_dropped_total = 0
        self.windows_replaced_total = 0  # merged over a document that could not be merged
        self.last_error: str | None = None

    @property
    def pending(self) -> list[TraceWindow]:
        """Closed windows not written yet, oldest first."""
        return list(self._pending.values())

    def close_windows(self, final: bool = False) -> int:
        """Close the window that ended by now (with `final`, the one still open too), keeping its
        per-model windows for the next flush; returns how many. Counts taken since the previous
        close all go to the window that just ended, even if the loop woke a window late."""
        now = self._wall()
        current = window_start(now, self.interval_s)
        if current < self._open:  # the wall clock went back: follow it
            self._open = current
        if current == self._open and not final:
            return 0
        start = current - self.interval_s if current > self._open else self._open
        if start > self._open:
            log.debug("trace windows %d..%d closed late, counted as %d", self._open, start, start)
        started_at = self._clock() - (now - start)
        windows = self.recorder.close(start, started_at, self._queueing(), self.interval_s)
        self._open = current
        for window in windows:
            self._seq += 1
            self._pending[f"{self._instance}:{self._seq}"] = window
        return len(windows)

    def _drop_expired(self) -> None:
        oldest = self._wall() - self.ttl_s - self.interval_s
        old = [wid for wid, w in self._pending.items() if w.start <= oldest]
        for wid in old:
            del self._pending[wid]
        if old:
            self.windows_dropped_total += len(old)
            log.warning(
                "dropped %d request-trace windows older than %d s that Redis never took",
                len(old),
                self.ttl_s,
            )

    def _connect(self) -> tuple[Redis, AsyncScript]:
        if self._client is None or self._merge is None:
            self._client = connect(self.settings, self.timeout_s)
            self._merge = self._client.register_script(MERGE_SCRIPT)
        return self._client, self._merge

    async def flush(self) -> bool:
        """Merge every closed window not written yet into Redis; False if any write failed
        (those windows stay for the next flush)."""
        self._drop_expired()
        if not self._pending:
            return True
        written = replaced = 0
        failure: BaseException | None = None
        try:
            client, merge = self._connect()
            async with asyncio.timeout(self.timeout_s):
                for wid, window in list(self._pending.items()):
                    key = trace_key(window.model, window.start)
                    args = (wid, orjson.dumps(window.to_json()), self.ttl_s)
                    try:
                        outcome = await merge(keys=[key, writes_key(key)], args=args, client=client)
                    except ResponseError as exc:  # this key only (wrong type, read-only...)
                        failure = exc
                        continue
                    del self._pending[wid]
                    written += 1
                    if outcome == 3:
                        replaced += 1
                        log.warning("trace key %s held a document that could not be merged", key)
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            failure = exc
            await self._drop_client()
        except Exception as exc:  # a bug or an unexpected reply must not end the loop
            log.exception("writing request traces failed unexpectedly")
            failure = exc
            await self._drop_client()
        self.windows_written_total += written
        self.windows_replaced_total += replaced
        if failure is not None:
            self._failed(failure)
            return False
        if not self.up:
            self.up = True
            log.info("request traces written to Redis again (%d windows)", written)
        return True

    def _failed(self, exc: BaseException) -> None:
        self.flush_errors_total += 1
        self.last_error = describe_error(exc)
        now = self._clock()
        s = self.settings
        if self.up:
            self.up = False
            self._reminded_at = now
            log.warning(
                "cannot write request traces to Redis at %s:%d (%s): keeping them to retry at"
                " the next flush",
                s.host,
                s.port,
                self.last_error,
            )
        elif now - self._reminded_at >= REMINDER_S:
            self._reminded_at = now
            log.warning(
                "request traces still not written to Redis at %s:%d (%s): %d windows held",
                s.host,
                s.port,
                self.last_error,
                len(self._pending),
            )

    async def _drop_client(self) -> None:
        client, self._client, self._merge = self._client, None, None
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await client.aclose()

    async def run(self) -> None:
        """Until cancelled: wake just after each boundary, close the window, flush."""
        task = asyncio.current_task()
        while True:
            # As in RedisState.run: on Python 3.11 the client can swallow a cancellation.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            now = self._wall()
            wake = window_start(now, self.interval_s) + self.interval_s + self.delay_s
            await asyncio.sleep(max(0.0, wake - now))
            if self.close_windows() or self._pending:
                await self.flush()

    async def close(self) -> None:
        """On shutdown: close the open window too (its counts so far: other gateways merge
        theirs into the same key) and write what is pending, once; then disconnect."""
        self.close_windows(final=True)
        if self._pending and not await self.flush():
            log.warning("%d request-trace windows not written at shutdown", len(self._pending))
        await self._drop_client()

    def status(self) -> dict[str, Any]:
        """JSON-ready view of the tracer."""
        return {
            "redis": f"{self.settings.host}:{self.settings.port}",
            "writing": self.up,
            "windows_pending": len(self._pending),
            "windows_written_total": self.windows_written_total,
            "windows_dropped_total": self.windows_dropped_total,
            "windows_replaced_total": self.windows_replaced_total,
            "flush_errors_total": self.flush_errors_total,
            "last_error": self.last_error,
        }
