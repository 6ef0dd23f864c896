"""The gRPC ExternalProcessor service: one processor per stream, by its metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import duration_pb2
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from plugin.adapters.steering import (
    PICK_ONLY,
    STRIPS_USAGE,
)
from plugin.config import ENVOY_MAX_MESSAGE_TIMEOUT_S
from plugin.core.auth import BearerToken
from plugin.core.router import Router

if TYPE_CHECKING:  # imported by `serve` only when tracing (or OpenTelemetry) is on
    from plugin.adapters.otel import RequestSpans
    from plugin.adapters.tracing import TraceRecorder


from plugin.adapters.extproc.counting import CountingProcessor
from plugin.adapters.extproc.locks import HeaderLock
from plugin.adapters.extproc.messages import _WANTED, DEFAULT_MAX_HEADERS, ErrorCounts
from plugin.adapters.extproc.routing import RoutingProcessor
from plugin.adapters.extproc.tokens import LeaseHandoff, Processor


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        router: Router,
        hold_timeout_s: float = ENVOY_MAX_MESSAGE_TIMEOUT_S,
        max_headers: int = DEFAULT_MAX_HEADERS,
        tracer: TraceRecorder | None = None,
        auth: BearerToken | None = None,
        lock: HeaderLock | None = None,
        gateway_id: str = "",
        otel: RequestSpans | None = None,
    ) -> None:
        """`tracer`, when tracing is on, hears of every request's arrival, routing, end and
        reported size (a dict increment each); `auth`, when set, is the bearer token every
        request must carry (AIBRIX_AUTH_BEARER_TOKEN); `lock`, the routing headers clients may
        not send (HETERO_GATEWAY_CLIENT_HEADERS); `gateway_id`, this replica's name in lease
        headers (`LeaseHandoff`)."""
        self.router = router
        self.auth = auth
        self.lock = lock or HeaderLock()
        self.tracer = tracer
        self.otel = otel  # OpenTelemetry spans per request, when on
        self.errors = ErrorCounts()
        self.max_headers = max_headers
        # Sent before a held request's wait: Envoy then waits this long for the body reply
        # instead of its message_timeout (about 1 s), up to its max_message_timeout.
        timeout = duration_pb2.Duration()
        timeout.FromMilliseconds(round(hold_timeout_s * 1000))
        self._hold_notice = pb.ProcessingResponse(override_message_timeout=timeout)
        self.handoff = LeaseHandoff(router, tracer=tracer, gateway_id=gateway_id)
        # The request headers a routing stream keeps: admission reads two more.
        self.wanted = _WANTED
        if router.admission is not None:
            settings = router.admission.settings
            extra = {settings.class_header, settings.tenancy.header}
            self.wanted = _WANTED | {h for h in extra if h}

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
            self.lock,
            self.otel,
            self.wanted,
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
