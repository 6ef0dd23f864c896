"""The ext_proc gRPC servicer: one processor per Envoy stream, one role per processor type.

Envoy opens a stream per request for each ext_proc filter. The routing filter's stream gets a
`RoutingProcessor` (request headers, buffered body, response headers, and the response body with
`--count-mode streamed`); the counting filter's stream, which Envoy runs in observability mode,
gets a `CountingProcessor`. The first message says which (`observability_mode`).

Only this module builds Envoy protobuf. Decisions come from `Router` (pure); token counting from
`ResponseTokens` around the pure `UsageScanner`. A request its strategy holds makes `handle`
return an awaitable instead of a reply; the servicer awaits it, so a held request costs a parked
coroutine, not a thread. Whatever ends the stream (response end, client cancel, reset, error),
`close()` releases the in-flight slot exactly once, and a held request leaves its queue.
`docs/architecture.md` follows one request through.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from plugin.adapters.steering import (
    CONFIG_PROFILE_HEADER,
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    PICK_ONLY,
    PROFILE_ECHO_HEADER,
    PROMPT_TOKENS_HEADER,
    REPLY_METADATA_NAMESPACE,
    STRIP_USAGE_KEY,
    STRIPS_USAGE,
    TARGET_POD_HEADER,
)
from plugin.config import ENVOY_MAX_MESSAGE_TIMEOUT_S, MAX_REQUEST_HEADERS
from plugin.core.auth import BearerToken
from plugin.core.pool import PodPool
from plugin.core.request import (
    LLM_PATHS,
    MODELS_PATH,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    USAGE_OPTION_PATHS,
    models_list,
    parse_request,
    parse_slo,
    with_usage_requested,
)
from plugin.core.router import Decision, Router, Waiter
from plugin.core.selector import EXTERNAL_FILTER_HEADER, parse_selector
from plugin.core.types import Pod, RequestInfo
from plugin.core.usage import Usage, UsageScanner
from plugin.errors import (
    BadRequestBody,
    MethodNotAllowed,
    RequestError,
    TooManyHeaders,
    Unauthorized,
    UnknownModel,
    error_reply,
)

if TYPE_CHECKING:  # imported by `serve` only when tracing is on
    from plugin.adapters.tracing import TraceRecorder

__all__ = [
    "CountingProcessor",
    "ErrorCounts",
    "ExtProcServicer",
    "Processor",
    "ResponseTokens",
    "RoutingProcessor",
    "immediate_response",
]

log = logging.getLogger(__name__)
DEFAULT_MAX_HEADERS = MAX_REQUEST_HEADERS.default

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON_HEADERS = (("content-type", "application/json"),)
_WANTED = frozenset(
    {
        ":path",
        ":method",
        "content-length",
        "authorization",
        "routing-strategy",
        CONFIG_PROFILE_HEADER,
        "x-request-id",
        SLO_TTFT_HEADER,
        SLO_TPOT_HEADER,
        EXTERNAL_FILTER_HEADER,
    }
)

# Replies that carry nothing are built once and reused.
# The steering headers are the plugin's to set: one a client sent is removed on every request,
# routed or not, so nobody can point Envoy's ORIGINAL_DST cluster at an address of their choice.
# Set by the plugin only: a client's copy is removed (the echo included, so it cannot be spoofed).
_STEERING_HEADERS = (
    TARGET_POD_HEADER,
    DESTINATION_HEADER,
    PROMPT_TOKENS_HEADER,
    PROFILE_ECHO_HEADER,
)
_STEERING_SET = frozenset(_STEERING_HEADERS)
# Headers a routed request always gets (the steering ones but the profile echo); `routing-strategy`
# and `x-request-id` are added too when the client did not send them, and the profile echo when it
# asked for a profile.
_ALWAYS_ADDED = len(_STEERING_HEADERS) - 1
_CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=list(_STEERING_HEADERS))
        )
    )
)
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # raw_value, not value: Envoy answers 503 "invalid override header value" otherwise.
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


# Marks the plugin's own replies for Envoy: its local-reply mappers (which turn Envoy's own error
# texts into OpenAI JSON) leave a reply carrying this alone (envoy_config._local_reply_config).
_PLUGIN_REPLY = struct_pb2.Struct()
_PLUGIN_REPLY.fields[REPLY_METADATA_NAMESPACE].struct_value.fields["reply"].string_value = "plugin"


def _immediate(
    status: int, body: bytes, headers: Iterable[tuple[str, str]], details: str
) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in headers]),
            body=body,
            details=details,
        ),
        dynamic_metadata=_PLUGIN_REPLY,
    )


def immediate_response(err: RequestError) -> pb.ProcessingResponse:
    reply = error_reply(err)
    return _immediate(
        reply.status, reply.body, reply.headers, f"hetero_gateway_{type(err).__name__}"
    )


def _status(msg: pb.HttpHeaders) -> int:
    for h in msg.headers.headers:
        if h.key == ":status":
            raw = h.raw_value or h.value.encode()
            return int(raw) if raw.isdigit() else 0
    return 0


def _value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else str(h.value)


class ErrorCounts:
    """Errors the plugin answered itself, by (status, error class); read by /metrics."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str], int] = {}

    def add(self, err: RequestError) -> None:
        key = (err.status, type(err).__name__)
        self.counts[key] = self.counts.get(key, 0) + 1


class ChunkGaps:
    """The times between one response's chunks, for its pod's speed watch
    (`PodPool.observe_chunk_gap`): each new SSE event is one engine step after the one before
    (k steps where an engine sends k tokens per event: the watch compares the pod with itself).
    The first event marks the stream as started (its prompt of `prompt_tokens` was prefilled);
    `close` ends it."""

    __slots__ = ("_clock", "_events", "_last", "_pool", "key", "prompt_tokens")

    def __init__(
        self, pool: PodPool, key: str, clock: Callable[[], float], prompt_tokens: int = 0
    ) -> None:
        self._pool = pool
        self.key = key
        self._clock = clock
        self.prompt_tokens = prompt_tokens
        self._events = 0
        self._last: float | None = None

    def seen(self, events: int) -> None:
        """The response's data events so far."""
        new = events - self._events
        if new <= 0:
            return
        now = self._clock()
        last = self._last
        if last is None:
            self._pool.stream_started(self.key, self.prompt_tokens)
        else:
            self._pool.observe_chunk_gap(self.key, (now - last) / new)
        self._last = now
        self._events = events

    def close(self, output_tokens: int = 0) -> None:
        """The response ended (or was cut) with `output_tokens` in the events seen."""
        if self._last is not None:
            self._last = None
            self._pool.stream_ended(self.key, self.prompt_tokens, output_tokens, self._events)


class ResponseTokens:
    """The output tokens of one response, from its status and body chunks.

    Only a 200 is scanned: an error body carries no usage worth crediting. The scanner is made
    on the first body chunk, so a stream that never sees the body allocates none. With `gaps`
    set, the times between its events feed the pod's speed watch.
    """

    __slots__ = ("_scanner", "gaps", "status")

    def __init__(self) -> None:
        self.status = 0
        self._scanner: UsageScanner | None = None
        self.gaps: ChunkGaps | None = None

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        if self.status != 200:
            return
        scanner = self._scanner
        if scanner is None:
            scanner = self._scanner = UsageScanner()
        scanner.feed(chunk, end_of_stream)
        if self.gaps is not None:
            self.gaps.seen(scanner.data_events)

    def close_gaps(self) -> None:
        if self.gaps is not None:
            # An estimate counts events, which would read k tokens an event as one.
            self.gaps.close(0 if self.estimated() else self.output_tokens())
            self.gaps = None

    def output_tokens(self) -> int:
        return 0 if self._scanner is None else self._scanner.output_tokens()

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
    output, status = tokens.output_tokens(), tokens.status
    if not decision.lease.release(output, status, router.now(), tokens.estimated()):
        return
    request = decision.request
    router.completed(request.model, request.prompt_tokens, output, status)
    router.finished(decision, status)
    if tracer is not None:
        tracer.ended(request.model, request.arrived_at)
        _trace_completed(tracer, request.model, tokens, request.prompt_tokens)


def _trace_completed(
    tracer: TraceRecorder, model: str, tokens: ResponseTokens, prompt_estimate: int
) -> None:
    """A size sample for the optimizer: the engine's counts when it reported them; else, for a
    served response whose tokens this stream counted (a stream without `include_usage`), the
    prompt's estimate and the counted chunks, so such traffic is not invisible to the plan."""
    usage = tokens.usage()
    if usage is not None:
        tracer.completed(model, usage.prompt_tokens, usage.completion_tokens)
    elif tokens.status == 200 and (output := tokens.output_tokens()) > 0:
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

_HandoffKey: TypeAlias = tuple[str, str]  # (request id, IP:PORT of the pod)


class LeaseHandoff:
    """Leases the routing stream passed to the counting stream of the same request.

    Keyed by request id and pod endpoint (both in the counting stream's request headers, set by
    the routing filter); two concurrent requests with the same client-sent id on the same pod
    hold interchangeable leases, so a queue per key is exact enough.
    """

    __slots__ = ("_parked", "_router", "_timeout_s", "_tracer", "expired")

    def __init__(
        self,
        router: Router,
        timeout_s: float = HANDOFF_TIMEOUT_S,
        tracer: TraceRecorder | None = None,
    ) -> None:
        self._router = router
        self._timeout_s = timeout_s
        self._tracer = tracer
        self._parked: dict[_HandoffKey, list[tuple[Decision, asyncio.TimerHandle]]] = {}
        self.expired = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._parked.values())

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

    def _expire(self, key: _HandoffKey, decision: Decision) -> None:
        queue = self._parked.get(key, [])
        for i, (parked, _) in enumerate(queue):
            if parked is decision:
                del queue[i]
                break
        if not queue:
            self._parked.pop(key, None)
        self.expired += 1
        if decision.lease.release(0, 0, self._router.now()) and self._tracer is not None:
            self._tracer.ended(decision.request.model, decision.request.arrived_at)
        log.warning(
            "no counting stream claimed request %s within %.0f s: its in-flight slot is given "
            "back (is the counting filter configured after the routing filter?)",
            key[0],
            self._timeout_s,
        )


class RoutingProcessor:
    """The routing filter's stream: route the request, hold its lease until the response ends."""

    __slots__ = (
        "_arrived_at",
        "_auth",
        "_body_parts",
        "_decision",
        "_errors",
        "_handoff",
        "_headers",
        "_max_headers",
        "_passthrough",
        "_profile",
        "_router",
        "_strips_usage",
        "_tokens",
        "_tracer",
        "_usage_body",
        "finished",
    )

    def __init__(
        self,
        router: Router,
        errors: ErrorCounts,
        max_headers: int = DEFAULT_MAX_HEADERS,
        handoff: LeaseHandoff | None = None,
        tracer: TraceRecorder | None = None,
        auth: BearerToken | None = None,
        strips_usage: bool = False,
    ) -> None:
        self._router = router
        self._errors = errors
        # Envoy takes usage-only chunks out of marked streams: a stream that did not ask for
        # usage may be made to (its rewritten body, once routed, in `_usage_body`).
        self._strips_usage = strips_usage
        self._usage_body: bytes | None = None
        self._max_headers = max_headers
        self._auth = auth  # set: every request must carry the gateway's bearer token
        self._handoff = handoff  # set: pick only, the counting stream takes the lease
        self._tracer = tracer
        self.finished = False  # nothing more to do: the servicer ends the stream
        self._headers: dict[str, str] = {}
        self._passthrough = False
        self._body_parts: list[bytes] = []
        self._decision: Decision | None = None
        self._tokens = ResponseTokens()
        self._arrived_at = 0.0
        self._profile: str | None = None  # the config profile to echo, when one was asked for

    @property
    def decision(self) -> Decision | None:
        return self._decision

    def handle(self, req: pb.ProcessingRequest) -> Reply:
        phase = req.WhichOneof("request")
        if phase == "response_body":
            return self._on_response_body(req.response_body)
        if phase == "request_headers":
            return self._on_request_headers(req.request_headers)
        if phase == "request_body":
            return self._on_request_body(req.request_body)
        if phase == "response_headers":
            return self._on_response_headers(req.response_headers)
        if phase == "request_trailers":
            return _CONTINUE_REQUEST_TRAILERS
        if phase == "response_trailers":
            return _CONTINUE_RESPONSE_TRAILERS
        raise ValueError(f"unexpected ext_proc message {phase}")

    def _fail(self, err: RequestError) -> pb.ProcessingResponse:
        self._errors.add(err)
        log.debug("request error %s: %s", type(err).__name__, err.message)
        return immediate_response(err)

    def _on_request_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        self._arrived_at = self._router.now()
        headers = self._headers
        steering = 0  # client-sent steering headers: removed by this reply
        for h in msg.headers.headers:
            if h.key in _WANTED:
                headers[h.key] = _value(h)
            elif h.key in _STEERING_SET:
                steering += 1
        if self._auth is not None and not self._auth.authorizes(headers.get("authorization")):
            return self._fail(Unauthorized())
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "POST")
        if path == MODELS_PATH and method == "GET":
            # No single engine knows every model behind the gateway; the gateway does.
            body = models_list(self._router.pool.serving_models())
            return _immediate(200, body, _JSON_HEADERS, "hetero_gateway_models")
        if path not in LLM_PATHS:
            self._passthrough = True
            return _CONTINUE_REQUEST_HEADERS
        if method != "POST":
            return self._fail(MethodNotAllowed(method, path))
        # Envoy refuses a mutation that takes the request over its header count limit, with an
        # empty 503: say so first, in a 431 the client can act on.
        added = (
            _ALWAYS_ADDED
            + ("routing-strategy" not in headers)
            + ("x-request-id" not in headers)
            + (CONFIG_PROFILE_HEADER in headers)
        )
        count = len(msg.headers.headers)
        if count - steering + added > self._max_headers:
            return self._fail(TooManyHeaders(count, added, self._max_headers))
        if msg.end_of_stream:
            return self._fail(BadRequestBody("request body is empty"))
        return _CONTINUE_REQUEST_HEADERS

    def _on_request_body(self, msg: pb.HttpBody) -> Reply:
        if self._passthrough or self._decision is not None:
            return _CONTINUE_REQUEST_BODY  # routed once; a stray later body must not route again
        self._body_parts.append(msg.body)
        if not msg.end_of_stream:
            return _CONTINUE_REQUEST_BODY  # BUFFERED sends one message; be safe with more
        body = b"".join(self._body_parts)
        self._body_parts = []
        headers = self._headers
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        request: RequestInfo | None = None
        try:
            slo = parse_slo(headers.get(SLO_TTFT_HEADER), headers.get(SLO_TPOT_HEADER))
            selector_text = headers.get(EXTERNAL_FILTER_HEADER)
            selector = parse_selector(selector_text) if selector_text else None
            request = parse_request(
                body, request_id, arrived_at=self._arrived_at, slo=slo, pod_selector=selector
            )
            strategy, profile = self._router.select(
                request, headers.get("routing-strategy"), headers.get(CONFIG_PROFILE_HEADER)
            )
            if profile is not None and CONFIG_PROFILE_HEADER in headers:
                self._profile = profile.name  # echoed: the profile the request ran with
            outcome = self._router.admit(request, strategy)
        except RequestError as err:
            # A request for a served model counts as traffic even when refused (no ready pod,
            # a full queue): it is demand. An unknown model does not (clients name any model).
            if self._tracer is not None and request is not None and type(err) is not UnknownModel:
                self._tracer.arrived(request.model)
            return self._fail(err)
        if self._tracer is not None:
            self._tracer.arrived(request.model)
        if self._strips_usage and request.stream and headers.get(":path") in USAGE_OPTION_PATHS:
            self._usage_body = with_usage_requested(body, request)
        if isinstance(outcome, Waiter):
            return self._held(outcome)
        return self._routed(outcome)

    async def _held(self, waiter: Waiter) -> pb.ProcessingResponse:
        """Park until the router grants or rejects the request, or its deadline passes.

        Cancellation (the client went away, Envoy reset the stream) lands here as
        CancelledError; `cancel()` then takes the request out of its queue and gives back a
        lease it was granted but never took.
        """
        router = self._router
        loop = asyncio.get_running_loop()
        try:
            while not waiter.done:
                woken = loop.create_future()

                def notify(fut: asyncio.Future[None] = woken) -> None:
                    if not fut.done():
                        fut.set_result(None)

                waiter.notify = notify
                delay = waiter.deadline - router.now()
                if delay > 0:
                    try:
                        async with asyncio.timeout(delay):
                            await woken
                    except TimeoutError:
                        pass
                if not waiter.done:
                    router.expire(waiter)  # granted, rejected, or a later deadline
            decision = waiter.result()
        except RequestError as err:
            return self._fail(err)
        finally:
            waiter.cancel()  # a no-op once the decision is taken
        return self._routed(decision)

    def _routed(self, decision: Decision) -> pb.ProcessingResponse:
        if self._tracer is not None:
            self._tracer.started(decision.request.model, decision.request.arrived_at)
        endpoint = decision.lease.pod.endpoint
        if self._handoff is not None:
            # Pick only: the counting stream of this request takes the lease from here.
            self._handoff.park((decision.request.request_id, endpoint), decision)
            self.finished = True
        else:
            self._decision = decision
        # The Inference Extension's destination may list fallbacks, in the header and the
        # metadata alike (its protocol forbids them to differ): the override_host wiring retries
        # a refused connection once, on the next endpoint listed. `target-pod` (ORIGINAL_DST)
        # names the pick alone.
        fallback = self._router.fallback(decision)
        destination = endpoint if fallback is None else f"{endpoint},{fallback.endpoint}"
        mutation = pb.HeaderMutation(
            set_headers=[
                _header(TARGET_POD_HEADER, endpoint),
                _header(DESTINATION_HEADER, destination),
                _header("routing-strategy", decision.strategy),
                _header("x-request-id", decision.request.request_id),
                _header(PROMPT_TOKENS_HEADER, str(decision.request.prompt_tokens)),
            ]
        )
        if self._profile is not None:
            mutation.set_headers.append(_header(PROFILE_ECHO_HEADER, self._profile))
        metadata = struct_pb2.Struct()
        metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[
            DESTINATION_HEADER
        ].string_value = destination
        if self._handoff is not None:  # Envoy's route adds the `target-pod` response header
            metadata.fields[REPLY_METADATA_NAMESPACE].struct_value.fields[
                "pod"
            ].string_value = decision.lease.pod.name
        common = pb.CommonResponse(header_mutation=mutation)
        body = self._usage_body
        if body is not None:
            # The engine is asked for usage; Envoy takes its usage chunk out of the stream again.
            self._usage_body = None
            common.body_mutation.body = body
            if "content-length" in self._headers:  # else Envoy refuses the mutated body
                common.header_mutation.set_headers.append(_header("content-length", str(len(body))))
            metadata.fields[REPLY_METADATA_NAMESPACE].struct_value.fields[
                STRIP_USAGE_KEY
            ].bool_value = True
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
        )

    def _on_response_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        decision = self._decision
        if decision is None:
            return _CONTINUE_RESPONSE_HEADERS
        self._tokens.status = _status(msg)
        if msg.end_of_stream:
            self.close()
        pod = decision.lease.pod
        mutation = pb.HeaderMutation(
            set_headers=[
                _header("request-id", decision.request.request_id),
                _header("routing-strategy", decision.strategy),
                _header(TARGET_POD_HEADER, pod.name),
                _header("target-pod-ip", pod.endpoint),
                *([_header(PROFILE_ECHO_HEADER, self._profile)] if self._profile else []),
            ]
        )
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation)
            )
        )

    def _on_response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        # Only with --count-mode streamed does the routing filter get the body.
        decision = self._decision
        if decision is not None:
            tokens = self._tokens
            if tokens.gaps is None and not decision.lease.released:
                router = self._router
                tokens.gaps = ChunkGaps(
                    router.pool, decision.lease.key, router.now, decision.request.prompt_tokens
                )
            tokens.feed(msg.body, msg.end_of_stream)
            if msg.end_of_stream:
                self.close()
        return _CONTINUE_RESPONSE_BODY

    def close(self) -> None:
        """Release the in-flight slot once, crediting the tokens counted so far."""
        decision = self._decision
        if decision is not None and not decision.lease.released:
            _finish(self._router, decision, self._tokens, self._tracer)


class CountingProcessor:
    """The counting filter's stream (observability mode): credit a response's output tokens.

    The pod comes from the `target-pod` header the routing filter set. Envoy does not wait for
    this stream and it gets no replies. With a pick-only routing filter this stream claims the
    request's lease (`LeaseHandoff`) and ends it with the response's tokens and status; else the
    routing stream holds the lease and this one only credits tokens. Either way once, when the
    body ends or the stream closes.
    """

    __slots__ = (
        "_decision",
        "_handoff",
        "_pod",
        "_prompt_tokens",
        "_router",
        "_tokens",
        "_tracer",
    )
    finished = False  # Envoy ends this stream; the plugin never answers on it

    def __init__(
        self,
        router: Router,
        handoff: LeaseHandoff | None = None,
        tracer: TraceRecorder | None = None,
    ) -> None:
        self._router = router
        self._handoff = handoff
        self._tracer = tracer
        self._decision: Decision | None = None  # the lease the routing stream passed on
        self._pod: Pod | None = None
        self._prompt_tokens = 0
        self._tokens = ResponseTokens()

    def handle(self, req: pb.ProcessingRequest) -> None:
        phase = req.WhichOneof("request")
        if phase == "response_body":
            body = req.response_body
            self._tokens.feed(body.body, body.end_of_stream)
            if body.end_of_stream:
                self.close()
        elif phase == "request_headers":
            endpoint = request_id = ""
            for h in req.request_headers.headers.headers:
                if h.key == TARGET_POD_HEADER:
                    endpoint = _value(h)
                    self._pod = self._router.pool.pod_by_endpoint(endpoint)
                elif h.key == PROMPT_TOKENS_HEADER:
                    text = _value(h)
                    ok = text.isascii() and text.isdigit() and len(text) < 10
                    self._prompt_tokens = int(text) if ok else 0
                elif h.key == "x-request-id":
                    request_id = _value(h)
            pod, router = self._pod, self._router
            if pod is not None and self._tokens.gaps is None:
                self._tokens.gaps = ChunkGaps(router.pool, pod.key, router.now, self._prompt_tokens)
            if self._handoff is not None and endpoint:
                self._decision = self._handoff.claim((request_id, endpoint))
        elif phase == "response_headers" and self._pod is not None:
            self._tokens.status = _status(req.response_headers)

    def close(self) -> None:
        pod, decision = self._pod, self._decision
        self._pod = self._decision = None  # once
        self._tokens.close_gaps()
        if decision is not None:  # this stream holds the request's lease: end it
            _finish(self._router, decision, self._tokens, self._tracer)
        elif pod is not None:
            output = self._tokens.output_tokens()
            self._router.pool.credit_tokens(pod.key, output, self._tokens.estimated())
            self._router.completed(pod.model, self._prompt_tokens, output, self._tokens.status)
            if self._tracer is not None:
                _trace_completed(self._tracer, pod.model, self._tokens, self._prompt_tokens)


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        router: Router,
        hold_timeout_s: float = ENVOY_MAX_MESSAGE_TIMEOUT_S,
        max_headers: int = DEFAULT_MAX_HEADERS,
        tracer: TraceRecorder | None = None,
        auth: BearerToken | None = None,
    ) -> None:
        """`tracer`, when tracing is on, hears of every request's arrival, routing, end and
        reported size (a dict increment each); `auth`, when set, is the bearer token every
        request must carry (AIBRIX_AUTH_BEARER_TOKEN)."""
        self.router = router
        self.auth = auth
        self.tracer = tracer
        self.errors = ErrorCounts()
        self.max_headers = max_headers
        # Sent before a held request's wait: Envoy then waits this long for the body reply
        # instead of its message_timeout (about 1 s), up to its max_message_timeout.
        timeout = duration_pb2.Duration()
        timeout.FromMilliseconds(round(hold_timeout_s * 1000))
        self._hold_notice = pb.ProcessingResponse(override_message_timeout=timeout)
        self.handoff = LeaseHandoff(router, tracer=tracer)

    def processor_for(
        self, first: pb.ProcessingRequest, pick_only: bool = False, strips_usage: bool = False
    ) -> Processor:
        if first.observability_mode:
            return CountingProcessor(self.router, self.handoff, self.tracer)
        handoff = self.handoff if pick_only else None
        return RoutingProcessor(
            self.router,
            self.errors,
            self.max_headers,
            handoff,
            self.tracer,
            self.auth,
            strips_usage,
        )

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        processor: Processor | None = None
        try:
            async for req in request_iterator:
                if processor is None:
                    metadata = tuple(context.invocation_metadata() or ())
                    processor = self.processor_for(
                        req, PICK_ONLY in metadata, STRIPS_USAGE in metadata
                    )
                reply = processor.handle(req)
                if reply is None:
                    continue
                if not isinstance(reply, pb.ProcessingResponse):
                    yield self._hold_notice  # a held request: Envoy must wait longer for it
                    reply = await reply
                yield reply
                if processor.finished:
                    return  # pick only: the stream ends, the counting stream has the lease
        finally:
            if processor is not None:
                processor.close()
