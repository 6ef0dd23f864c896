"""Engine metrics scraper: every refresh interval, GET each pod's metrics page concurrently.

Engine health comes from what the engine does. A refused, reset or timed-out connection says it
is down: the pod leaves rotation at once (`PodPool.scrape_failed`). An answer is proof of life:
a page that is of no use (not 200, a redirect, too big, no known metric) keeps the pod in
rotation, flagged, routed by the gateway's own in-flight counts and learned capacity
(`PodPool.scrape_unusable`). Either is logged once per streak and counted by cause; nothing on
the request path waits for a scrape. Capacity estimates refresh on the same tick
(`docs/architecture.md`, step 7 of a request's path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlencode

from prometheus_client.parser import text_string_to_metric_families

from plugin.adapters.engines import histogram_pairs, metric_names, stepwise_counters
from plugin.adapters.metrics_http import MetricsClient, request_bytes
from plugin.core.pool import Learned, PodPool
from plugin.core.scrape_share import ScrapeShares
from plugin.core.types import EngineMetrics, Pod
from plugin.errors import EngineUnreachable, MetricsPageUnusable

log = logging.getLogger(__name__)

# Sample names per engine field, first match wins (`plugin.adapters.engines`, one row per engine).
_RUNNING = metric_names("running")
_WAITING = metric_names("waiting")
_KV = metric_names("kv_usage")
_CPU_KV = metric_names("cpu_kv_usage")
_GENERATED = metric_names("generation_tokens")
_MAX_BATCH = metric_names("max_batch")
_STEPWISE = stepwise_counters()
# Histograms' sums and counts, a family's pair at the same place in each tuple.
_QUEUE_SUM, _QUEUE_COUNT = (tuple(p) for p in zip(*histogram_pairs("queue_time"), strict=True))
_ITL_SUM, _ITL_COUNT = (tuple(p) for p in zip(*histogram_pairs("token_latency"), strict=True))
_WANTED = frozenset(
    _RUNNING
    + _WAITING
    + _KV
    + _CPU_KV
    + _GENERATED
    + _MAX_BATCH
    + _QUEUE_SUM
    + _QUEUE_COUNT
    + _ITL_SUM
    + _ITL_COUNT
)
# Labels that name a tensor-parallel rank: ranks of one engine report the same tokens, so label
# sets that differ only there are one engine (the largest value is kept), not several.
_RANK_LABELS = frozenset({"tp", "tp_rank"})
# A real vLLM page is hundreds of lines (histograms per model); parsing all of it in pure Python
# on the event loop that answers Envoy costs tens of ms per pod. Only the wanted lines are parsed.
MAX_METRICS_BYTES = 8 * 1024 * 1024
# Scrapes in flight at once: a few workers share a tick's pods (`MetricsScraper.scrape_all`).
MAX_CONCURRENT_SCRAPES = 64
# How often the stall watch looks for pods whose streams went quiet (`PodPool.silent`).
SILENCE_CHECK_S = 0.1
_NOTHING = EngineMetrics()
# Ask for the wanted samples by name: prometheus_client, which vLLM, SGLang and TensorRT-LLM
# serve their pages with, then renders those samples only (its exposition honours `name[]`
# query parameters), about 10 lines instead of about 440 for vLLM: less work for the engine
# and for the gateway. An engine that ignores the parameters sends its whole page, read as
# before. Uncompressed (`plugin.adapters.metrics_http`).
_WANTED_QUERY = urlencode([("name[]", name) for name in sorted(_WANTED)])
UNREACHABLE, UNUSABLE = "unreachable", "unusable"  # the causes of a failed scrape


class ScrapeExchange(Protocol):
    """Scrapes shared with the other gateway replicas (`plugin.adapters.redis_state`)."""

    up: bool  # False: this replica scrapes every pod itself
    shares: ScrapeShares | None

    async def exchange_scrapes(
        self, records: Mapping[str, list[Any]]
    ) -> Iterator[tuple[str, float, int, dict[str, Any]]]: ...


# A scrape's outcome as the gateways share it: ["ok", stepwise, *the fields below, *what the
# scraping replica learned of the pod (`plugin.core.pool.Learned`)], ["down"] (refused, reset or
# timed out) or ["unusable", why]. A record without the learned part (a replica of an earlier
# release) is learned from here as well.
_SHARED_FIELDS = tuple(f for f in EngineMetrics._fields if f != "generation_tokens_stepwise")
OK, DOWN = "ok", "down"
_PLAIN = 2 + len(_SHARED_FIELDS)  # the length of a record without the learned part
_CAP_SOURCES = frozenset({"engine", "learned", None})


_shared_values = operator.attrgetter(*_SHARED_FIELDS)


def encode_scrape(metrics: EngineMetrics, learned: Learned | None = None) -> list[Any]:
    """A successful scrape as the gateways share it, with what the replica learned from it."""
    record = [OK, metrics.generation_tokens_stepwise, *_shared_values(metrics)]
    if learned is not None:
        record.extend(learned)
    return record


# Where the stepwise flag sits among EngineMetrics' fields: a record is decoded positionally
# (at 10,000 pods a replica decodes the others' 8,000 records a second; keywords cost a third
# more).
_STEPWISE_AT = EngineMetrics._fields.index("generation_tokens_stepwise")


def decode_scrape(values: list[Any]) -> tuple[EngineMetrics, Learned | None]:
    """A successful scrape from what `encode_scrape` wrote (after JSON), and what its replica
    learned (None in a record without it); raises ValueError or TypeError for a record of
    another shape."""
    size = len(values)
    if size == _PLAIN:
        learned = None
    elif size == _PLAIN + 4:
        estimate, fast, cap, source = values[_PLAIN:]
        if source not in _CAP_SOURCES:
            raise ValueError(f"unknown batch cap source {source!r}")
        if not isinstance(fast, bool):
            raise TypeError(f"short window {fast!r}")
        batch = None if cap is None else int(cap)
        if batch is not None and batch < 1:  # a cap of none would fence the engine off
            raise ValueError(f"batch cap {cap!r}")
        learned = (None if estimate is None else float(estimate), fast, batch, source)
    else:
        raise ValueError("wrong length")
    floats: list[Any] = [None if v is None else float(v) for v in values[2:_PLAIN]]
    floats.insert(_STEPWISE_AT, bool(values[1]))
    return EngineMetrics._make(floats), learned


def _name_pattern(names: Iterable[str]) -> str:
    """A regex that matches any of these names, their shared prefixes factored out
    (`vllm:(?:num_requests_(?:running|waiting)|...)`): Python's `re` tries the branches of a
    plain alternation one after another at every line, about 30 of them here, and a whole
    vLLM page has about 440 lines."""
    tree: dict[str, Any] = {}
    for name in names:
        node = tree
        for char in name:
            node = node.setdefault(char, {})
        node[""] = {}  # a name ends here

    def branches(node: dict[str, Any]) -> str:
        alternatives = []
        for char in sorted(node, reverse=True):  # the end of a name ("") last: longest first
            text, child = re.escape(char), node[char]
            while len(child) == 1 and "" not in child:  # a run with no fork
                ((char, child),) = child.items()
                text += re.escape(char)
            alternatives.append(text + (branches(child) if child else ""))
        if len(alternatives) == 1:
            return alternatives[0]
        return "(?:" + "|".join(alternatives) + ")"

    return branches(tree)


# One scan of the page for the wanted samples, each as (name, labels, the rest of the line): a
# line that starts with a wanted name followed by its labels, a space or a tab (so a longer
# name never passes for a shorter one). The labels run to the line's last `}` (a label value
# may hold spaces and braces; the value and timestamp after it hold neither). The page is
# scanned with a newline put in front, so every line starts after one; the regex engine skips
# from newline to newline in C, where a Python loop over a real vLLM page's 440 lines cost
# about 2.4 times as much (`docs/plugin-cost.md`); the names as a prefix tree cost a third of
# a plain alternation's time on a whole page.
_WANTED_SAMPLE = re.compile(
    "\n(" + _name_pattern(sorted(_WANTED)) + ")(?=[{ \t\r\n]|\\Z)(\\{[^\n]*\\})?([^\n]*)"
)
# The engine a token counter's label set names (its labels but the tensor-parallel rank's),
# per label set seen on pages, parsed once by prometheus_client (which also rejects a garbled
# one): a pod's series are the same text every scrape, so only the value changes. Bounded:
# cleared when full, then refilled from the next pages.
_ENGINES: dict[str, tuple[tuple[str, str], ...]] = {}
MAX_SERIES = 65536


def _engine(series: str) -> tuple[tuple[str, str], ...]:
    """The engine a sample's series names (`_ENGINES`); ValueError for a garbled one."""
    known = _ENGINES.get(series)
    if known is None:
        for family in text_string_to_metric_families(series + " 0\n"):
            for sample in family.samples:
                labels = sample.labels.items()
                known = tuple(sorted((k, v) for k, v in labels if k not in _RANK_LABELS))
        if known is None:
            raise ValueError(f"no sample in {series!r}")
        if len(_ENGINES) >= MAX_SERIES:
            _ENGINES.clear()
        _ENGINES[series] = known
    return known


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Combine each wanted sample across label sets (one pod may label by model or by engine).

    Request and token counts (and batch caps) add up; KV usage is a fraction, so label sets
    (say, data-parallel engines) are averaged. Token counters of tensor-parallel ranks of one
    engine count once. A NaN label set is skipped rather than spoiling the others. A malformed
    sample raises ValueError.
    """
    found: dict[str, list[float]] = {}
    generated: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for name, labels, rest in _WANTED_SAMPLE.findall("\n" + text):
        fields = rest.split(None, 1)
        if not fields:
            raise ValueError(f"a sample without a value: {name}{labels}{rest}")
        value = float(fields[0])
        # A garbled label set fails the page (`_engine`, for a label set not seen before).
        engine = _ENGINES.get(name + labels) if labels else ()
        if engine is None:
            engine = _engine(name + labels)
        if value != value or (value < 1 and name in _MAX_BATCH_NAMES):  # NaN: skipped
            continue
        if name in _GENERATED_NAMES:
            per_engine = generated.setdefault(name, {})
            per_engine[engine] = max(value, per_engine.get(engine, value))
        else:
            found.setdefault(name, []).append(value)
    for name, per_engine in generated.items():
        found[name] = list(per_engine.values())
    if not found:
        return _NOTHING
    names = tuple(found)
    pick = _PICKS.get(names)
    if pick is None:
        pick = _pick(names)
    running, waiting, kv, cpu_kv, tokens, stepwise, batch, q_sum, q_count, l_sum, l_count = pick
    return EngineMetrics(
        None if running is None else sum(found[running]),
        None if waiting is None else sum(found[waiting]),
        None if kv is None else sum(found[kv]) / len(found[kv]),
        None if cpu_kv is None else sum(found[cpu_kv]) / len(found[cpu_kv]),
        None if tokens is None else sum(found[tokens]),
        stepwise,
        None if batch is None else sum(found[batch]),
        None if q_sum is None else sum(found[q_sum]),
        None if q_count is None else sum(found[q_count]),
        None if l_sum is None else sum(found[l_sum]),
        None if l_count is None else sum(found[l_count]),
    )


# The samples a page's fields are read from, per set of names found on it (in the order of
# EngineMetrics' fields): a page shows the same names scrape after scrape, so which of the
# engines' names each field takes is worked out once, not on every page (`_pick`).
_PICKS: dict[tuple[str, ...], tuple[Any, ...]] = {}
_GENERATED_NAMES = frozenset(_GENERATED)
_MAX_BATCH_NAMES = frozenset(_MAX_BATCH)
MAX_PICKS = 1024


def _pick(names: tuple[str, ...]) -> tuple[Any, ...]:
    """For a page on which these sample names were found: each field's sample (the first of
    its names found; a histogram's sum and count from the first family with both), at the
    positions of `EngineMetrics`' fields, the stepwise flag at its place."""
    present = set(names)

    def first(candidates: tuple[str, ...]) -> str | None:
        return next((n for n in candidates if n in present), None)

    def pair(sums: tuple[str, ...], counts: tuple[str, ...]) -> tuple[str | None, str | None]:
        for total, count in zip(sums, counts, strict=True):
            if total in present and count in present:
                return total, count
        return None, None

    tokens = first(_GENERATED)
    pick = (
        first(_RUNNING),
        first(_WAITING),
        first(_KV),
        first(_CPU_KV),
        tokens,
        tokens in _STEPWISE,
        first(_MAX_BATCH),
        *pair(_QUEUE_SUM, _QUEUE_COUNT),
        *pair(_ITL_SUM, _ITL_COUNT),
    )
    if len(_PICKS) >= MAX_PICKS:
        _PICKS.clear()
    _PICKS[names] = pick
    return pick


class MetricsScraper:
    def __init__(
        self,
        pool: PodPool,
        *,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        exchange: ScrapeExchange | None = None,
    ) -> None:
        self._pool = pool
        self._interval_s = interval_s
        # Set: the pods are shared out among the gateway replicas that share this exchange.
        self.exchange = exchange
        self._seen: dict[str, float] = {}  # pod key -> when the latest scrape of it was made
        # This tick's scrapes to share: each record led by when the scrape was made.
        self._outbox: dict[str, list[Any]] | None = None
        self._peer_writes: dict[str, int] = {}  # gateway id -> the write of it last read
        self._last_tick_at: float | None = None  # the start of the previous shared tick
        self._wake = asyncio.Event()
        self._timeout_s = timeout_s
        self._clock = clock
        self._failing: dict[str, str] = {}  # pod key -> the cause of its failing streak
        self._client = MetricsClient(timeout_s=timeout_s, max_bytes=MAX_METRICS_BYTES)
        self._running = False  # probes wait for `run`
        self._probing: set[str] = set()
        self._probes: set[asyncio.Task[None]] = set()  # held: a task must not be collected
        self.errors_total: dict[tuple[str, str], int] = {}  # (pod key, cause) -> failed scrapes
        # The request per pod address and path, built once.
        self._requests: dict[tuple[str, int, str], bytes] = {}
        # Pod addresses whose engine drops our samples from a page asked for by name.
        self._full_pages: set[tuple[str, int, str]] = set()
        # Set once a tick has scraped every discovered pod (answered or not): the gateway
        # reports ready from then on, not while it would route blind to engines it has not
        # seen (a dead one among them).
        self.first_round = asyncio.Event()

    def _request(self, pod: Pod, by_name: bool) -> bytes:
        """The GET of the pod's metrics page: by name (`name[]`) unless the pod's engine
        answered such a request with none of our samples (`_full_pages`)."""
        where = (pod.address, pod.metrics_port, pod.metrics_path)
        request = self._requests.get(where) if by_name else None
        if request is None:
            target = pod.metrics_path
            if by_name and where not in self._full_pages:
                target += ("&" if "?" in target else "?") + _WANTED_QUERY
            request = request_bytes(pod.address, pod.metrics_port, target)
            if by_name:
                self._requests[where] = request
        return request

    async def _page(self, pod: Pod, request: bytes) -> EngineMetrics:
        # A redirect is not followed: /metrics answering 302 must not make the gateway fetch
        # whatever address it names every tick.
        status, reason, body = await self._client.get(pod.address, pod.metrics_port, request)
        if status != 200:
            raise MetricsPageUnusable(f"HTTP {status} {reason}".rstrip())
        try:
            return parse_engine_metrics(body.decode("utf-8", "replace"))
        except ValueError as exc:
            raise MetricsPageUnusable(f"malformed metrics: {exc}") from exc

    async def _scrape(self, pod: Pod) -> None:
        where = (pod.address, pod.metrics_port, pod.metrics_path)
        try:
            metrics = await self._page(pod, self._request(pod, by_name=True))
            if metrics == _NOTHING and where not in self._full_pages:
                # An engine may honour `name[]` and still leave our samples out (a
                # prometheus_client registry whose collectors declare no names, such as
                # vLLM's multiprocess mode): read its whole page from now on if that has them.
                metrics = await self._page(pod, self._request(pod, by_name=False))
                if metrics != _NOTHING:
                    self._full_pages.add(where)
                    self._requests.pop(where, None)
                    log.info(
                        "metrics page of %s leaves the gateway's samples out when asked for "
                        "them by name: reading its whole page",
                        pod.key,
                    )
            if metrics == _NOTHING:
                raise MetricsPageUnusable("no known engine metric on the page")
        except MetricsPageUnusable as exc:
            self._pool.scrape_unusable(pod.key, str(exc))
            self._failed(pod, UNUSABLE, str(exc))
            self._made(pod.key, [UNUSABLE, str(exc)])
            return
        except (EngineUnreachable, TimeoutError) as exc:
            self._pool.scrape_failed(pod.key)
            self._failed(pod, UNREACHABLE, str(exc) or repr(exc))
            self._made(pod.key, [DOWN])
            return
        if self._failing.pop(pod.key, None) is not None:
            log.info("metrics scrape of %s recovered", pod.key)
        pool = self._pool
        pool.update_metrics(pod.key, metrics, self._clock())
        if self._outbox is not None:
            self._made(pod.key, encode_scrape(metrics, pool.learned(pod.key)))
        else:
            self._made(pod.key, None)

    def _made(self, key: str, record: list[Any] | None) -> None:
        now = self._seen[key] = self._clock()
        if self._outbox is not None and record is not None:
            record.insert(0, now)  # made at: its age when shared (`_trade`)
            self._outbox[key] = record

    def _failed(self, pod: Pod, cause: str, why: str) -> None:
        """Count a failed scrape; log the first of a streak of the same cause."""
        key = (pod.key, cause)
        self.errors_total[key] = self.errors_total.get(key, 0) + 1
        if self._failing.get(pod.key) == cause:
            return
        self._failing[pod.key] = cause
        host = f"[{pod.address}]" if ":" in pod.address else pod.address
        url = f"http://{host}:{pod.metrics_port}{pod.metrics_path}"
        if cause == UNREACHABLE:
            log.warning(
                "metrics scrape of %s (%s) failed: %s; out of rotation until it answers",
                pod.key,
                url,
                why,
            )
        else:
            log.warning(
                "metrics page of %s (%s) is of no use: %s; it stays in rotation, routed by the "
                "gateway's own counts (check the pod's metrics port and path)",
                pod.key,
                url,
                why,
            )

    async def _worker(self, queue: Iterator[Pod]) -> None:
        """Scrape pods one after another until none is left: a few workers share the tick's
        pods, which costs less than a task per pod behind a semaphore at a thousand pods."""
        for pod in queue:
            try:
                await self._scrape(pod)
            except Exception:  # a bug on one page must not stop the tick for the others
                log.exception("metrics scrape of %s raised", pod.key)

    async def scrape_all(self, pods: Sequence[Pod]) -> None:
        """Scrape these pods, at most MAX_CONCURRENT_SCRAPES at a time."""
        queue = iter(pods)
        workers = min(MAX_CONCURRENT_SCRAPES, len(pods))
        await asyncio.gather(*(self._worker(queue) for _ in range(workers)))

    async def tick(self) -> None:
        pods = self._pool.pods()
        exchange = self.exchange
        shares = None if exchange is None or not exchange.up else exchange.shares
        if shares is None:
            mine: Sequence[Pod] = pods
        else:
            # This replica's share, and any pod no replica has told about since 1.5 periods
            # before the previous tick (a replica that just died, one that does not list the
            # pod, this one starting up): others' scrapes are read once a tick, up to two
            # periods after they were made. Counted from the previous tick, not from now, so
            # that ticks that run late (a busy event loop) do not scrape every pod.
            now = self._clock()
            last, self._last_tick_at = self._last_tick_at, now
            stale = (now if last is None else last) - 1.5 * self._interval_s
            seen = self._seen
            mine = [p for p in pods if shares.mine(p.key) or seen.get(p.key, -math.inf) < stale]
            self._outbox = {}
        try:
            await self.scrape_all(mine)
            if exchange is not None and shares is not None:
                await self._trade(exchange, shares, {p.key for p in mine})
        finally:
            self._outbox = None
            self._pool.refresh_capacity(self._clock())
            if self._pool.loaded:
                self.first_round.set()
        present = {p.key for p in pods}
        if len(self._requests) > 2 * len(pods) + 64:  # addresses of pods long gone
            wheres = {(p.address, p.metrics_port, p.metrics_path) for p in pods}
            self._requests = {k: v for k, v in self._requests.items() if k in wheres}
            self._full_pages &= wheres
            self._client.keep_only((p.address, p.metrics_port) for p in pods)
        for key in [k for k in self.errors_total if k[0] not in present]:
            del self.errors_total[key]
        for gone in self._failing.keys() - present:
            del self._failing[gone]
        if len(self._seen) > 2 * len(pods) + 64:
            self._seen = {k: v for k, v in self._seen.items() if k in present}
        if shares is not None:
            shares.forget(present)

    async def _trade(
        self, exchange: ScrapeExchange, shares: ScrapeShares, scraped: set[str]
    ) -> None:
        """Publish this tick's scrapes; apply the other replicas' newer ones."""
        records = self._outbox or {}
        now = self._clock()
        for record in records.values():  # in place: no second list per record
            record[0] = round(now - record[0], 3)
        peers: Iterable[tuple[str, float, int, dict[str, Any]]]
        try:
            peers = await exchange.exchange_scrapes(records)
        except Exception as exc:  # Redis trouble: the sync loop reports it; pods go stale
            log.debug("exchanging scrapes failed: %r", exc)
            peers = ()
        now = self._clock()
        applied = 0
        for gateway, age_s, writes, pods in peers:
            if self._peer_writes.get(gateway) != writes:  # else read before
                self._peer_writes[gateway] = writes
                for key, record in pods.items():
                    if key not in scraped and self._apply(key, record, now - age_s):
                        applied += 1
            del pods  # one peer's records alive at a time (`RedisState.exchange_scrapes`)
        for gone in self._peer_writes.keys() - set(shares.scrapers):
            del self._peer_writes[gone]
        shares.scraped, shares.from_peers = len(scraped), applied

    def _apply(self, key: str, record: Any, written_at: float) -> bool:
        """Another replica's scrape of a pod, made `record[0]` s before `written_at`; applied
        when newer than what this replica knows of the pod, with what that replica learned of
        the pod taken as it is (`PodPool.update_metrics`). A record of another shape is
        skipped."""
        try:
            made_at = written_at - float(record[0])
            if made_at <= self._seen.get(key, -math.inf):
                return False
            kind = record[1]
            if kind == OK:
                metrics, learned = decode_scrape(record[1:])
                self._pool.update_metrics(key, metrics, made_at, learned)
            elif kind == DOWN:
                self._pool.scrape_failed(key)
            elif kind == UNUSABLE:
                self._pool.scrape_unusable(key, str(record[2]))
            else:
                return False
        except (IndexError, TypeError, ValueError, OverflowError):
            return False
        self._seen[key] = made_at
        return True

    def close(self) -> None:
        """Close the connections kept to engines (`run` does it when it stops)."""
        self._client.close()

    def wake(self) -> None:
        """Run the next tick now (the replicas sharing the scrapes changed)."""
        self._wake.set()

    def probe(self, pod: Pod) -> None:
        """Scrape this pod now, outside the tick (a request on it just failed): a dead engine
        refuses at once and leaves rotation, instead of taking requests until the next tick.
        At most one probe per pod at a time; none before `run`."""
        if not self._running or pod.key in self._probing:
            return
        self._probing.add(pod.key)
        task = asyncio.get_running_loop().create_task(self._probe(pod))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, pod: Pod) -> None:
        # The pod leaves `_probing` in the same step that records the probe's verdict: a done
        # callback runs a loop turn later, and a failure seen in that turn asked for no probe.
        try:
            await self._scrape(pod)
        finally:
            self._probing.discard(pod.key)

    async def run(self) -> None:
        # Each pod keeps its connection alive between ticks (`MetricsClient`).
        self._running = True
        watch = asyncio.get_running_loop().create_task(self._watch_silence())
        task = asyncio.current_task()
        try:
            next_at = self._clock()
            while True:
                # The Redis client (the scrape exchange) can swallow a cancellation that
                # lands as its call completes on Python 3.11; the task stays marked as
                # cancelling, so honour that here, or stopping would wait forever.
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError
                # Cleared before the tick reads who scrapes what: a change of scrapers
                # during the tick wakes the next one at once instead of being lost.
                self._wake.clear()
                try:
                    await self.tick()
                except Exception:  # a bug here must not stop scraping for good
                    log.exception("metrics refresh failed")
                # A tick that overran does not make the next ones run back to back.
                next_at = max(next_at + self._interval_s, self._clock())
                # `asyncio.timeout`, not `wait_for` (which can swallow a cancellation too).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, next_at - self._clock())):
                        await self._wake.wait()
                    # Woken: the scrapers changed, and pods of one that left are this
                    # replica's now. The period restarts from this tick.
                    next_at = self._clock()
        finally:
            watch.cancel()
            self._running = False
            self.close()

    async def _watch_silence(self) -> None:
        """Probe pods whose open streams all went quiet for longer than a scrape may take
        (`PodPool.silent`): a hung engine leaves rotation a probe's timeout later, not at the
        next tick. Between ticks only: the watch costs one pass over the pods per period."""
        silent_s = self._timeout_s
        while True:
            await asyncio.sleep(SILENCE_CHECK_S)
            try:
                for pod in self._pool.silent(self._clock(), silent_s):
                    log.debug("streams of %s silent for over %.2f s: probing it", pod.key, silent_s)
                    self.probe(pod)
            except Exception:  # a bug here must not stop the watch, nor scraping
                log.exception("stream silence watch failed")
