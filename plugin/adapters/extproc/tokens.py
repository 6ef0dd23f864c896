"""Counting a response's output tokens, the gaps between its chunks, and handing a lease from
the routing stream to the counting stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias

from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from plugin.core.latency import ClientLatency, Felt
from plugin.core.pool import Lease, PodPool
from plugin.core.router import Decision, Router
from plugin.core.types import Pod
from plugin.core.usage import Usage, UsageScanner

if TYPE_CHECKING:  # imported by `serve` only when tracing is on
    from plugin.adapters.tracing import TraceRecorder


log = logging.getLogger(__name__)


class ChunkGaps:
    """The times between one response's chunks, for its pod's speed watch
    (`PodPool.observe_chunk_gap`): each new SSE event is one engine step after the one before
    (k steps where an engine sends k tokens per event: the watch compares the pod with itself).
    The first event marks the stream as started (its prompt of `prompt_tokens` was prefilled)
    and, where this stream holds the request's `lease`, shrinks its share of the pod
    (`Lease.streaming`); `close` ends it and, with `latency` set, records what the client felt
    (`plugin.core.latency`: from `started_at`, the request's arrival, else when this was made)."""

    __slots__ = (
        "_clock",
        "_events",
        "_first",
        "_last",
        "_pool",
        "felt",
        "key",
        "latency",
        "lease",
        "pod",
        "prompt_tokens",
        "started_at",
    )

    def __init__(
        self,
        pool: PodPool,
        key: str,
        clock: Callable[[], float],
        prompt_tokens: int = 0,
        lease: Lease | None = None,
        latency: ClientLatency | None = None,
        pod: Pod | None = None,
        started_at: float | None = None,
    ) -> None:
        self._pool = pool
        self.key = key
        self._clock = clock
        self.prompt_tokens = prompt_tokens
        self.lease = lease
        self.latency = latency
        self.pod = pod
        self.started_at = clock() if started_at is None else started_at
        self._events = 0
        self._first: float | None = None
        self._last: float | None = None
        self.felt: Felt | None = None  # set by `close` when the latency was recorded

    def seen(self, events: int) -> None:
        """The response's data events so far."""
        new = events - self._events
        if new <= 0:
            return
        now = self._clock()
        self._pool.stream_alive(self.key, now)
        last = self._last
        if last is None:
            self._first = now
            self._pool.stream_started(self.key, self.prompt_tokens)
            if self.lease is not None:
                self.lease.streaming()
        else:
            self._pool.observe_chunk_gap(self.key, (now - last) / new)
        self._last = now
        self._events = events

    def close(self, output_tokens: int = 0, served: bool = False) -> None:
        """The response ended (or was cut) with `output_tokens` in the events seen (0: not
        known); `served`: it was a 200, so its latency counts."""
        last = self._last
        if last is not None:
            self._last = None
            self._pool.stream_ended(self.key, self.prompt_tokens, output_tokens, self._events)
        latency, pod = self.latency, self.pod
        if served and latency is not None and pod is not None:
            self.latency = None  # once
            self.felt = latency.observe(
                self.key,
                pod.model,
                pod.deployment or "",
                self.started_at,
                self._first,
                last,
                self._clock(),
                output_tokens or self._events,
            )


class ResponseTokens:
    """The output tokens of one response, from its status and body chunks.

    Only a 200 is scanned: an error body carries no usage worth crediting. The scanner is made
    on the first body chunk, so a stream that never sees the body allocates none. With `gaps`
    set, the times between its events feed the pod's speed watch.
    """

    __slots__ = ("_scanner", "complete", "felt", "gaps", "status")

    def __init__(self) -> None:
        self.status = 0
        self.complete = False  # the body was read to its end (not cut, not unseen)
        self._scanner: UsageScanner | None = None
        self.gaps: ChunkGaps | None = None
        self.felt: Felt | None = None  # as the client felt it, once the gaps are closed

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        if self.status != 200:
            return
        self.complete = end_of_stream
        scanner = self._scanner
        if scanner is None:
            scanner = self._scanner = UsageScanner()
        scanner.feed(chunk, end_of_stream)
        if self.gaps is not None:
            self.gaps.seen(scanner.data_events)

    def close_gaps(self) -> None:
        if self.gaps is not None:
            # An estimate counts events, which would read k tokens an event as one.
            tokens = 0 if self.estimated() else self.output_tokens()
            # A latency sample: a 200 whose body this stream read to its end (not one cut by its
            # client or the engine, nor one whose body it never sees: `--count-mode engine`).
            self.gaps.close(tokens, served=self.status == 200 and self.complete)
            self.felt = self.gaps.felt
            self.gaps = None

    def output_tokens(self) -> int:
        return 0 if self._scanner is None else self._scanner.output_tokens()

    def counted(self, per_chunk: float | None) -> int:
        """The output tokens to credit: the engine's count; without one, the estimate, where a
        stream's chunks count at its pod's learned tokens per chunk (`per_chunk`, None: not
        learned yet), since a stream cut by its client carries no usage and an engine that sends
        k tokens an event would otherwise be credited a k-th of them."""
        scanner = self._scanner
        if scanner is None:
            return 0
        output = scanner.output_tokens()
        if per_chunk is not None and scanner.estimated and scanner.sse:
            return round(output * per_chunk)
        return output

    def estimated(self) -> bool:
        """The count is the gateway's estimate: the engine reported no usage."""
        return self._scanner is not None and self._scanner.estimated

    def usage(self) -> Usage | None:
        """The usage the engine reported, if it did (a 200 whose body carried one)."""
        return None if self._scanner is None else self._scanner.usage


def _finish(
    router: Router, decision: Decision, tokens: ResponseTokens, tracer: TraceRecorder | None
) -> None:
    """A routed request's response ended: give its lease back once, crediting the tokens, and
    tell the router (output history, latency against the prediction) and the tracer."""
    tokens.close_gaps()
    lease = decision.lease
    output, status = tokens.counted(router.pool.tokens_per_chunk(lease.key)), tokens.status
    if not lease.release(output, status, router.now(), tokens.estimated()):
        return
    request = decision.request
    router.completed(request.model, request.prompt_tokens, output, status)
    usage = tokens.usage()  # the engine's prompt count, where it reported one, settles limits
    router.finished(decision, status, tokens.felt, output, usage.prompt_tokens if usage else None)
    if decision.spans is not None:  # OpenTelemetry's, when on (`plugin.adapters.otel`)
        decision.spans.ended(status, output, tokens.felt)
    if tracer is not None:
        tracer.ended(request.model, request.arrived_at)
        _trace_completed(tracer, request.model, tokens, request.prompt_tokens, output)


def _trace_completed(
    tracer: TraceRecorder, model: str, tokens: ResponseTokens, prompt_estimate: int, output: int
) -> None:
    """A size sample for the optimizer: the engine's counts when it reported them; else, for a
    served response whose tokens this stream counted (`output`: a stream without
    `include_usage`), the prompt's estimate and the counted tokens, so such traffic is not
    invisible to the plan."""
    usage = tokens.usage()
    if usage is not None:
        tracer.completed(model, usage.prompt_tokens, usage.completion_tokens)
    elif tokens.status == 200 and output > 0:
        tracer.completed(model, prompt_estimate, output)


# What a processor answers one message with: a reply, an awaitable one (a held request), none.
Reply: TypeAlias = "pb.ProcessingResponse | Awaitable[pb.ProcessingResponse] | None"


class Processor(Protocol):
    """One Envoy stream's state: a reply (or an awaitable one, or none) per message; `finished`
    once it has nothing more to answer (the servicer then ends the stream)."""

    finished: bool

    def handle(self, req: pb.ProcessingRequest) -> Reply: ...

    def close(self) -> None: ...


# With PICK_ONLY in its gRPC metadata (the rendered Envoy config sends it when a counting filter
# follows and the routing filter asks for no response phase), the routing stream ends once the
# pick is made and the counting stream holds the lease: a plugin crash then cannot cut responses
# already streaming (Envoy resets a request whose fail-closed ext_proc stream breaks, even with
# nothing left to ask). Without it (another Envoy config, Envoy Gateway, plugin replicas behind
# one cluster) the routing stream holds the lease to the end.
# How long a parked lease waits for its counting stream, which starts a moment after the pick;
# one never claimed (no counting filter after all) is given back then.
HANDOFF_TIMEOUT_S = 10.0
# Bounds on what a lease header may say, and on the claims owed to one gateway between syncs
# (a gateway away for long loses the oldest; their parked leases expire instead).
MAX_GATEWAY_ID = 256
MAX_LEASE_LOAD = 1e6
MAX_CLAIMS = 100_000

_HandoffKey: TypeAlias = tuple[str, str]  # (request id, IP:PORT of the pod)


class LeaseHandoff:
    """Leases the routing stream passed to the counting stream of the same request.

    Keyed by request id and pod endpoint (both in the counting stream's request headers, set by
    the routing filter); two concurrent requests with the same client-sent id on the same pod
    hold interchangeable leases, so a queue per key is exact enough.

    Several plugin replicas behind one Envoy cluster: the counting stream may reach another
    replica than the routing stream. That replica finds nothing parked, so it takes the count
    over (`adopt`: a lease of its own, with the share the routing replica named in the lease
    header) and owes the routing replica a claim; the shared-state sync carries claims through
    Redis (`take_claims`), and the routing replica gives its parked lease back when its claims
    arrive (`claimed_elsewhere`). The count then moves from one replica's published counts to
    the other's in one sync, never counted twice for longer than a sync period.
    """

    __slots__ = (
        "_claims",
        "_parked",
        "_router",
        "_timeout_s",
        "_tracer",
        "adopted",
        "expired",
        "gateway_id",
        "released_elsewhere",
    )

    def __init__(
        self,
        router: Router,
        timeout_s: float = HANDOFF_TIMEOUT_S,
        tracer: TraceRecorder | None = None,
        gateway_id: str = "",
    ) -> None:
        self._router = router
        self._timeout_s = timeout_s
        self._tracer = tracer
        self.gateway_id = gateway_id
        self._parked: dict[_HandoffKey, list[tuple[Decision, asyncio.TimerHandle]]] = {}
        self._claims: dict[str, list[_HandoffKey]] = {}  # routing gateway -> leases taken over
        self.expired = 0
        self.adopted = 0  # counts taken over from another replica's routing stream
        self.released_elsewhere = 0  # parked leases another replica's counting stream took

    def __len__(self) -> int:
        return sum(len(q) for q in self._parked.values())

    def lease_header(self, lease: Lease) -> str:
        """The lease header's value: this gateway and the lease's share of its pod (a gateway
        without a name, one without shared state, writes one no other replica takes over)."""
        return f"{self.gateway_id};{lease.load:.6g};{lease.streaming_load:.6g}"

    def park(self, key: _HandoffKey, decision: Decision) -> None:
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire, key, decision)
        self._parked.setdefault(key, []).append((decision, timer))

    def claim(self, key: _HandoffKey) -> Decision | None:
        queue = self._parked.get(key)
        if not queue:
            return None
        decision, timer = queue.pop(0)
        timer.cancel()
        if not queue:
            del self._parked[key]
        return decision

    def adopt(self, pod: Pod, header: str, key: _HandoffKey, prompt_tokens: int) -> Lease | None:
        """A counting stream found no parked lease: when the lease header names another
        gateway, hold the request's count here (and owe that gateway a claim). None when it
        names this one (the lease expired, or was claimed already) or cannot be read, and on a
        gateway without shared state, which could never send the claim."""
        parsed = parse_lease_header(header)
        if parsed is None or parsed[0] == self.gateway_id or not self.gateway_id:
            return None
        origin, load, streaming_load = parsed
        lease = self._router.pool.acquire(pod, load, prompt_tokens, streaming_load)
        claims = self._claims.get(origin)
        if claims is None:
            claims = self._claims[origin] = []
        if len(claims) < MAX_CLAIMS:
            claims.append(key)
        self.adopted += 1
        return lease

    def take_claims(self) -> dict[str, list[_HandoffKey]]:
        """The claims owed since the last call, by routing gateway (the sync sends them)."""
        claims, self._claims = self._claims, {}
        return claims

    def return_claims(self, claims: dict[str, list[_HandoffKey]]) -> None:
        """A sync that failed gives its claims back for the next one."""
        for origin, keys in claims.items():
            mine = self._claims.setdefault(origin, [])
            mine[:0] = keys[: max(0, MAX_CLAIMS - len(mine))]

    def claimed_elsewhere(self, keys: Iterable[_HandoffKey]) -> int:
        """Another replica's counting stream took these requests over: give back their parked
        leases (its counting credits the tokens). Returns how many were still parked."""
        now = self._router.now()
        released = 0
        for key in keys:
            decision = self.claim(key)
            if decision is None:
                continue  # expired meanwhile, or a key seen twice
            released += 1
            if decision.lease.release(0, 0, now):
                if self._tracer is not None:
                    self._tracer.ended(decision.request.model, decision.request.arrived_at)
                if decision.spans is not None:
                    decision.spans.handed_off()
        self.released_elsewhere += released
        return released

    def _expire(self, key: _HandoffKey, decision: Decision) -> None:
        queue = self._parked.get(key, [])
        for i, (parked, _) in enumerate(queue):
            if parked is decision:
                del queue[i]
                break
        if not queue:
            self._parked.pop(key, None)
        self.expired += 1
        if decision.lease.release(0, 0, self._router.now()):
            if self._tracer is not None:
                self._tracer.ended(decision.request.model, decision.request.arrived_at)
            if decision.spans is not None:
                decision.spans.handed_off()
        log.warning(
            "no counting stream claimed request %s within %.0f s: its in-flight slot is given "
            "back (is the counting filter configured after the routing filter? with several "
            "plugin replicas, is Redis shared by all of them?)",
            key[0],
            self._timeout_s,
        )


def parse_lease_header(value: str) -> tuple[str, float, float] | None:
    """`gateway;load;streaming load` (`LeaseHandoff.lease_header`); None when malformed."""
    parts = value.split(";")
    if len(parts) != 3 or not parts[0] or len(parts[0]) > MAX_GATEWAY_ID:
        return None
    try:
        load, streaming_load = float(parts[1]), float(parts[2])
    except ValueError:
        return None
    if not (0.0 <= load <= MAX_LEASE_LOAD and 0.0 <= streaming_load <= MAX_LEASE_LOAD):
        return None  # NaN fails both comparisons
    return parts[0], load, streaming_load
