"""OpenTelemetry spans per request: optional (`pip install 'hetero-gateway[otel]'`, switched on
by HETERO_GATEWAY_OTEL), exported over OTLP as the standard `OTEL_*` variables say
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, ...). Off, nothing here is imported and
the request path pays one `is None` test per request.

Per request, one trace (W3C trace context: a client's `traceparent` is honoured, and the
upstream request carries the gateway's, so the engine's own spans join it):

- `gateway request` (server): arrival at the gateway to the response's end; attributes: model,
  strategy, pod, GPU type, the profile's predicted E2E, status, output tokens, TTFT;
- `routing decision`: from the whole body to the decision (or to the request being held);
- `queue wait`: a held request's time at the gateway, routed or rejected;
- `upstream` (client): from routing to the response's end, the span the engine sees as parent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from plugin.core.latency import Felt
from plugin.core.router import Decision

__all__ = ["PREFIX", "RequestSpans", "SpanSet", "otlp_provider"]

PREFIX = "hetero_gateway."  # attribute names
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_provider(exporter: SpanExporter | None = None) -> TracerProvider:
    """A provider exporting in batches over OTLP/gRPC (or to `exporter`), service
    `hetero-gateway` unless OTEL_SERVICE_NAME says otherwise."""
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "hetero-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class SpanSet:
    """One request's spans, made as its stream goes (`RequestSpans` starts it)."""

    __slots__ = ("_decision", "_queue", "_tracer", "root", "upstream")

    def __init__(self, tracer: Tracer, root: Span) -> None:
        self._tracer = tracer
        self.root = root
        self._decision: Span | None = None
        self._queue: Span | None = None
        self.upstream: Span | None = None

    def _child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        context = trace.set_span_in_context(self.root)
        return self._tracer.start_span(name, context=context, kind=kind)

    def deciding(self) -> None:
        """The whole body is in: the routing decision starts."""
        self._decision = self._child("routing decision")

    def held(self) -> None:
        """The strategy holds the request: the decision ends, the wait in the queue starts."""
        if self._decision is not None:
            self._decision.end()
            self._decision = None
        self._queue = self._child("queue wait")

    def routed(self, decision: Decision, waited: bool) -> str | None:
        """Routed: the decision (or the wait) ends, `upstream` starts; its `traceparent`, for
        the request Envoy sends on (None when the SDK writes none: OTEL_SDK_DISABLED)."""
        for span in (self._decision, self._queue):
            if span is not None:
                span.set_attribute(PREFIX + "outcome", "routed")
                span.end()
        self._decision = self._queue = None
        pod = decision.lease.pod
        attributes: dict[str, str | float | bool] = {
            PREFIX + "model": pod.model,
            PREFIX + "strategy": decision.strategy,
            PREFIX + "pod": pod.key,
            PREFIX + "gpu": pod.deployment or "",
            PREFIX + "held": waited,
        }
        if decision.expected_e2e_s is not None:
            attributes[PREFIX + "predicted_e2e_s"] = decision.expected_e2e_s
        self.root.set_attributes(attributes)
        self.upstream = self._child("upstream", SpanKind.CLIENT)
        self.upstream.set_attributes(
            {"server.address": pod.address, "server.port": pod.port, PREFIX + "pod": pod.key}
        )
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.upstream))
        return carrier.get("traceparent")

    def failed(self, error_type: str, message: str, status: int) -> None:
        """Answered by the gateway itself (rejected, malformed, no pod): every span ends."""
        for span in (self._decision, self._queue):
            if span is not None:
                span.set_attribute(PREFIX + "outcome", "rejected")
                span.end()
        self._decision = self._queue = None
        self.root.set_attributes(
            {"http.response.status_code": status, PREFIX + "error": error_type}
        )
        self.root.set_status(Status(StatusCode.ERROR, message))
        self.root.end()

    def handed_off(self) -> None:
        """The lease ended without this replica seeing the response (another replica's
        counting stream took it over, or none claimed it): the spans end here, said so."""
        self.root.set_attribute(PREFIX + "counted_elsewhere", True)
        self.ended(0, 0, None)

    def ended(self, status: int, output_tokens: int, felt: Felt | None) -> None:
        """The response ended (or was cut)."""
        if self.upstream is not None:
            self.upstream.set_attribute("http.response.status_code", status)
            self.upstream.end()
            self.upstream = None
        root = self.root
        root.set_attributes(
            {"http.response.status_code": status, PREFIX + "output_tokens": output_tokens}
        )
        if felt is not None and felt.ttft is not None:
            root.set_attribute(PREFIX + "ttft_s", felt.ttft)
        if status >= 500:
            root.set_status(Status(StatusCode.ERROR, f"upstream answered {status}"))
        root.end()


class RequestSpans:
    """Starts each request's `SpanSet` from its headers (the client's trace context, if any)."""

    __slots__ = ("_tracer",)

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._tracer = provider.get_tracer("hetero-gateway")

    def start(self, headers: Mapping[str, str], arrived_ns: int | None = None) -> SpanSet:
        context = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        root = self._tracer.start_span(
            "gateway request",
            context=context,
            kind=SpanKind.SERVER,
            start_time=arrived_ns if arrived_ns is not None else time.time_ns(),
        )
        return SpanSet(self._tracer, root)
