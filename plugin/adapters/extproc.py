"""The ext_proc gRPC servicer: one `StreamProcessor` per Envoy stream, one method per phase.

Only this module builds Envoy protobuf. Decisions come from `Router` (pure); token counting from
`UsageScanner` (pure). Whatever ends the stream (response end, client cancel, reset, error), the
in-flight slot is released exactly once in `close()`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from plugin.adapters.steering import DESTINATION_HEADER, LB_METADATA_NAMESPACE, TARGET_POD_HEADER
from plugin.core.router import LLM_PATHS, MODELS_PATH, Decision, Router, models_list, parse_request
from plugin.core.types import Pod
from plugin.core.usage import UsageScanner
from plugin.errors import BadRequestBody, RequestError, error_reply

log = logging.getLogger(__name__)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON_HEADERS = (("content-type", "application/json"),)
_WANTED = frozenset({":path", ":method", "routing-strategy", "x-request-id"})

# Replies that carry nothing are built once and reused.
# The steering headers are the plugin's to set: one a client sent is removed on every request,
# routed or not, so nobody can point Envoy's ORIGINAL_DST cluster at an address of their choice.
_STEERING_HEADERS = (TARGET_POD_HEADER, DESTINATION_HEADER)
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


def _immediate(
    status: int, body: bytes, headers: Iterable[tuple[str, str]], details: str
) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in headers]),
            body=body,
            details=details,
        )
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


class ErrorCounts:
    """Errors the plugin answered itself, by (status, error class); read by /metrics."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str], int] = {}

    def add(self, err: RequestError) -> None:
        key = (err.status, type(err).__name__)
        self.counts[key] = self.counts.get(key, 0) + 1


class StreamProcessor:
    """State of one HTTP request's ext_proc stream."""

    __slots__ = (
        "_body_parts",
        "_counted",
        "_decision",
        "_errors",
        "_headers",
        "_passthrough",
        "_router",
        "_scanner",
        "_upstream_status",
    )

    def __init__(self, router: Router, errors: ErrorCounts) -> None:
        self._router = router
        self._errors = errors
        self._headers: dict[str, str] = {}
        self._passthrough = False
        self._body_parts: list[bytes] = []
        self._decision: Decision | None = None
        self._counted: Pod | None = None  # counting filter: the pod whose tokens it counts
        self._scanner: UsageScanner | None = None
        self._upstream_status = 0

    @property
    def decision(self) -> Decision | None:
        return self._decision

    def handle(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        """The reply to one message; None for the counting filter, whose messages get none."""
        if req.observability_mode:
            self._observe(req)
            return None
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
        headers = self._headers
        for h in msg.headers.headers:
            if h.key in _WANTED:
                headers[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "POST")
        if path == MODELS_PATH and method == "GET":
            # No single engine knows every model behind the gateway; the gateway does.
            body = models_list(self._router.pool.serving_models())
            return _immediate(200, body, _JSON_HEADERS, "hetero_gateway_models")
        if path not in LLM_PATHS or method != "POST":
            self._passthrough = True
            return _CONTINUE_REQUEST_HEADERS
        if msg.end_of_stream:
            return self._fail(BadRequestBody("request body is empty"))
        return _CONTINUE_REQUEST_HEADERS

    def _on_request_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if self._passthrough or self._decision is not None:
            return _CONTINUE_REQUEST_BODY  # routed once; a stray later body must not route again
        self._body_parts.append(msg.body)
        if not msg.end_of_stream:
            return _CONTINUE_REQUEST_BODY  # BUFFERED sends one message; be safe with more
        body = b"".join(self._body_parts)
        self._body_parts = []
        request_id = self._headers.get("x-request-id") or uuid.uuid4().hex
        try:
            strategy = self._router.strategy_for(self._headers.get("routing-strategy"))
            decision = self._router.route(parse_request(body, request_id), strategy)
        except RequestError as err:
            return self._fail(err)
        self._decision = decision
        endpoint = decision.lease.pod.endpoint
        mutation = pb.HeaderMutation(
            set_headers=[
                _header(TARGET_POD_HEADER, endpoint),
                _header(DESTINATION_HEADER, endpoint),
                _header("routing-strategy", decision.strategy),
                _header("x-request-id", request_id),
            ]
        )
        metadata = struct_pb2.Struct()
        metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[
            DESTINATION_HEADER
        ].string_value = endpoint
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=pb.CommonResponse(header_mutation=mutation)),
            dynamic_metadata=metadata,
        )

    def _on_response_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        decision = self._decision
        if decision is None:
            return _CONTINUE_RESPONSE_HEADERS
        self._upstream_status = _status(msg)
        if msg.end_of_stream:
            self.close()
        pod = decision.lease.pod
        mutation = pb.HeaderMutation(
            set_headers=[
                _header("request-id", decision.request.request_id),
                _header("routing-strategy", decision.strategy),
                _header(TARGET_POD_HEADER, pod.name),
                _header("target-pod-ip", pod.endpoint),
            ]
        )
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation)
            )
        )

    def _on_response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        # Only with --count-mode streamed does the routing filter get the body; the scanner is
        # made on the first chunk so the default wiring allocates none per request. Only a 200
        # is scanned: an error body carries no usage worth crediting.
        if self._decision is None or self._upstream_status != 200:
            return _CONTINUE_RESPONSE_BODY
        scanner = self._scanner
        if scanner is None:
            scanner = self._scanner = UsageScanner()
        scanner.feed(msg.body, msg.end_of_stream)
        if msg.end_of_stream:
            self.close()
        return _CONTINUE_RESPONSE_BODY

    def _observe(self, req: pb.ProcessingRequest) -> None:
        """The counting filter's stream: find the pod from `target-pod`, count its tokens.

        Envoy does not wait for this stream, and the routing filter's stream (which holds the
        in-flight lease) lives until the response ends, so counting here only credits tokens.
        """
        phase = req.WhichOneof("request")
        if phase == "response_body":
            scanner = self._scanner
            if scanner is not None:
                scanner.feed(req.response_body.body, req.response_body.end_of_stream)
                if req.response_body.end_of_stream:
                    self._credit()
        elif phase == "request_headers":
            for h in req.request_headers.headers.headers:
                if h.key == TARGET_POD_HEADER:
                    endpoint = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
                    self._counted = self._router.pool.pod_by_endpoint(endpoint)
                    break
        elif phase == "response_headers" and self._counted is not None:
            self._upstream_status = _status(req.response_headers)
            if self._upstream_status == 200:  # an error body is not scanned
                self._scanner = UsageScanner()

    def _credit(self) -> None:
        pod, scanner = self._counted, self._scanner
        self._counted = None  # once
        if pod is not None and scanner is not None:  # a scanner exists only for a 200
            self._router.pool.credit_tokens(pod.key, scanner.output_tokens())

    def close(self) -> None:
        """Release the in-flight slot once, crediting the tokens counted so far."""
        if self._counted is not None:
            self._credit()
            return
        decision = self._decision
        if decision is None or decision.lease.released:
            return
        scanner = self._scanner
        tokens = 0 if scanner is None else scanner.output_tokens()  # only a 200 has one
        decision.lease.release(tokens, self._upstream_status, self._router.now())


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, router: Router) -> None:
        self.router = router
        self.errors = ErrorCounts()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        processor = StreamProcessor(self.router, self.errors)
        try:
            async for req in request_iterator:
                reply = processor.handle(req)
                if reply is not None:
                    yield reply
        finally:
            processor.close()
