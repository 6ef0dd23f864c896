"""The routing stream: parse, choose a pod (or hold the request), tell Envoy where to send it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING

from google.protobuf import struct_pb2
from hetero_gateway_protos.envoy.config.core.v3 import base_pb2
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from plugin.adapters.steering import (
    CONFIG_PROFILE_HEADER,
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    LEASE_HEADER,
    PROFILE_ECHO_HEADER,
    PROMPT_TOKENS_HEADER,
    REPLY_METADATA_NAMESPACE,
    RESERVATION_HEADER,
    STRIP_USAGE_KEY,
    TARGET_POD_HEADER,
)
from plugin.core.auth import BearerToken
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
from plugin.core.types import RequestInfo
from plugin.errors import (
    BadRequestBody,
    MethodNotAllowed,
    RequestError,
    TooManyHeaders,
    Unauthorized,
    UnknownModel,
)

if TYPE_CHECKING:  # imported by `serve` only when tracing (or OpenTelemetry) is on
    from plugin.adapters.otel import RequestSpans, SpanSet
    from plugin.adapters.tracing import TraceRecorder


from plugin.adapters.extproc.locks import HeaderLock
from plugin.adapters.extproc.messages import (
    _ALWAYS_ADDED,
    _CONTINUE_REQUEST_BODY,
    _CONTINUE_REQUEST_HEADERS,
    _CONTINUE_REQUEST_TRAILERS,
    _CONTINUE_RESPONSE_BODY,
    _CONTINUE_RESPONSE_HEADERS,
    _CONTINUE_RESPONSE_TRAILERS,
    _JSON_HEADERS,
    _STEERING_SET,
    _WANTED,
    DEFAULT_MAX_HEADERS,
    ErrorCounts,
    _header,
    _immediate,
    _status,
    _value,
    immediate_response,
)
from plugin.adapters.extproc.tokens import (
    ChunkGaps,
    LeaseHandoff,
    Reply,
    ResponseTokens,
    _finish,
)

log = logging.getLogger(__name__)


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
        "_lock",
        "_max_headers",
        "_otel",
        "_passthrough",
        "_profile",
        "_router",
        "_spans",
        "_strips_usage",
        "_tokens",
        "_tracer",
        "_usage_body",
        "_wanted",
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
        lock: HeaderLock | None = None,
        otel: RequestSpans | None = None,
        wanted: frozenset[str] = _WANTED,
    ) -> None:
        self._router = router
        self._wanted = wanted  # the request headers kept (`_WANTED`, with admission's)
        self._otel = otel  # set: OpenTelemetry spans per request
        self._spans: SpanSet | None = None
        self._lock = lock or HeaderLock()  # the routing headers clients may not send
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
    def _limited(self) -> bool:
        """Rate limits are on: a pick may carry a reservation header too."""
        admission = self._router.admission
        return admission is not None and admission.limits is not None

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
        if self._spans is not None:
            self._spans.failed(type(err).__name__, err.message, err.status)
            self._spans = None
        log.debug("request error %s: %s", type(err).__name__, err.message)
        return immediate_response(err)

    def _on_request_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        self._arrived_at = self._router.now()
        headers = self._headers
        steering = 0  # client-sent steering headers: removed by this reply
        wanted = self._wanted
        for h in msg.headers.headers:
            if h.key in wanted:
                headers[h.key] = _value(h)
            elif h.key in _STEERING_SET:
                steering += 1
        if self._auth is not None and not self._auth.authorizes(headers.get("authorization")):
            return self._fail(Unauthorized())
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "POST")
        if path == MODELS_PATH:
            if method != "GET":
                return self._fail(MethodNotAllowed(method, path, "GET"))
            # No single engine knows every model behind the gateway; the gateway does.
            body = models_list(self._router.pool.serving_models())
            return _immediate(200, body, _JSON_HEADERS, "hetero_gateway_models")
        if path not in LLM_PATHS:
            self._passthrough = True
            return _CONTINUE_REQUEST_HEADERS
        if self._otel is not None:
            self._spans = self._otel.start(headers)
        if method != "POST":
            return self._fail(MethodNotAllowed(method, path))
        # Envoy refuses a mutation that takes the request over its header count limit, with an
        # empty 503: say so first, in a 431 the client can act on.
        added = (
            _ALWAYS_ADDED
            + ("routing-strategy" not in headers)
            + ("x-request-id" not in headers)
            + (CONFIG_PROFILE_HEADER in headers)
            + (self._handoff is not None) * (1 + self._limited)
            + (self._otel is not None and "traceparent" not in headers)
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
        started = time.perf_counter()
        if self._spans is not None:
            self._spans.deciding()
        body = b"".join(self._body_parts)
        self._body_parts = []
        headers = self._headers
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        request: RequestInfo | None = None
        try:
            request = parse_request(body, request_id, arrived_at=self._arrived_at)
            self._lock.check(request.model, self._router.pool.model_config(request.model), headers)
            slo = parse_slo(headers.get(SLO_TTFT_HEADER), headers.get(SLO_TPOT_HEADER))
            selector_text = headers.get(EXTERNAL_FILTER_HEADER)
            if slo is not None or selector_text:
                selector = parse_selector(selector_text) if selector_text else None
                request = dataclasses.replace(request, slo=slo, pod_selector=selector)
            admission = self._router.admission
            if admission is not None:
                settings = admission.settings
                tenancy = settings.tenancy
                tenant = tenancy.tenant(
                    headers.get(tenancy.header) if tenancy.header else None,
                    headers.get("authorization"),
                )
                request = dataclasses.replace(
                    request, tenant=tenant, priority_class=headers.get(settings.class_header)
                )
            strategy, profile = self._router.select(
                request, headers.get("routing-strategy"), headers.get(CONFIG_PROFILE_HEADER)
            )
            if profile is not None and CONFIG_PROFILE_HEADER in headers:
                self._profile = profile.name  # echoed: the profile the request ran with
            outcome = self._router.admit(request, strategy, profile)
        except RequestError as err:
            # A request for a served model counts as traffic even when refused (no ready pod,
            # a full queue): it is demand. An unknown model does not (clients name any model).
            if self._tracer is not None and request is not None and type(err) is not UnknownModel:
                self._tracer.arrived(request.model)
            return self._fail(err)
        self._router.decision_time.observe(time.perf_counter() - started)
        if self._tracer is not None:
            self._tracer.arrived(request.model)
        if self._strips_usage and request.stream and headers.get(":path") in USAGE_OPTION_PATHS:
            self._usage_body = with_usage_requested(body, request)
        if isinstance(outcome, Waiter):
            if self._spans is not None:
                self._spans.held()
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
                # Woken without an outcome: admission handed it to a strategy that holds it
                # with a deadline of its own, read again above.
                if not waiter.done and waiter.deadline <= router.now():
                    router.expire(waiter)  # granted, rejected, or a later deadline
            decision = waiter.result()
        except RequestError as err:
            return self._fail(err)
        finally:
            waiter.cancel()  # a no-op once the decision is taken
        return self._routed(decision, held=True)

    def _routed(self, decision: Decision, held: bool = False) -> pb.ProcessingResponse:
        traced: list[base_pb2.HeaderValueOption] = []
        if self._spans is not None:  # the upstream request carries the gateway's span
            traceparent = self._spans.routed(decision, held)
            decision = dataclasses.replace(decision, spans=self._spans)
            self._spans = None  # the decision's now: whichever stream ends the lease ends them
            if traceparent is not None:
                traced.append(_header("traceparent", traceparent))
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
                *traced,
            ]
        )
        if self._handoff is not None:
            lease = self._handoff.lease_header(decision.lease)
            mutation.set_headers.append(_header(LEASE_HEADER, lease))
            reserved = self._router.handed_reservation(decision)
            if reserved is not None:  # a counting stream on another replica settles it
                mutation.set_headers.append(_header(RESERVATION_HEADER, reserved))
        if self._profile is not None:
            mutation.set_headers.append(_header(PROFILE_ECHO_HEADER, self._profile))
        metadata = struct_pb2.Struct()
        metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[
            DESTINATION_HEADER
        ].string_value = destination
        if self._handoff is not None:  # Envoy's route adds the `target-pod` response header
            reply = metadata.fields[REPLY_METADATA_NAMESPACE].struct_value.fields
            reply["pod"].string_value = decision.lease.pod.name
            if decision.reservation is not None:  # and the tenant's `x-ratelimit-*`, as of now
                for key, value in self._router.limit_headers(decision):
                    reply[key].string_value = value
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
        if decision.reservation is not None:  # the tenant's rate limits, as OpenAI sends them
            for key, value in self._router.limit_headers(decision):
                mutation.set_headers.append(_header(key, value))
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
                    router.pool,
                    decision.lease.key,
                    router.now,
                    decision.request.prompt_tokens,
                    decision.lease,
                    router.latency,
                    decision.lease.pod,
                    decision.request.arrived_at,
                )
            tokens.feed(msg.body, msg.end_of_stream)
            if msg.end_of_stream:
                self.close()
        return _CONTINUE_RESPONSE_BODY

    def close(self) -> None:
        """Release the in-flight slot once, crediting the tokens counted so far; a request
        that never got that far (its client went away while it waited) ends its spans."""
        if self._spans is not None:
            self._spans.failed("Cancelled", "the stream ended before the request was routed", 499)
            self._spans = None
        decision = self._decision
        if decision is not None and not decision.lease.released:
            _finish(self._router, decision, self._tokens, self._tracer)
