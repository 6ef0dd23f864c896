"""OpenTelemetry spans per request (HETERO_GATEWAY_OTEL): a plugin started in-process with it on
exports over OTLP/gRPC to a real receiver on loopback (the collector's trace service, from
OpenTelemetry's own protos), driven through its real ext_proc gRPC server as Envoy drives it.
A client's `traceparent` is honoured, the upstream request carries the gateway's `upstream`
span, and a request the gateway refuses ends its trace with an error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from plugin.core.types import Pod
from tests.component.test_extproc_grpc import (
    CHAT_BODY,
    MODEL,
    SETTINGS_ENV,
    Stream,
    _connected,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    sse_chunks,
)
from tests.helpers import StartGateway, write_pods_file

pytestmark = pytest.mark.component

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
GONE = "5bf92f3577b34da6a3ce929d0e0e4737"


@pytest.fixture
def pods_file(tmp_path: Path, reserve_port: Callable[[], int]) -> Path:
    """Two pods on loopback ports that refuse connections: nothing is forwarded to them."""
    pods = [Pod(n, "default", MODEL, "127.0.0.1", reserve_port(), 0) for n in ("a", "b")]
    return write_pods_file(tmp_path / "pods.yaml", pods)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP's trace service: keeps every span exported to it."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest_asyncio.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Receiver]:
    server = grpc.aio.server()
    found = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # The exporter reads OpenTelemetry's own variables from the environment.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    yield found
    await server.stop(None)


def _attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def test_a_request_is_one_trace_joined_to_the_clients_and_passed_upstream(
    pods_file: Path, start_gateway: StartGateway, receiver: Receiver
) -> None:
    gateway = await start_gateway(pods_file, {**SETTINGS_ENV, "HETERO_GATEWAY_OTEL": "true"})
    async for r in _connected(gateway, pods_file):
        stream = Stream(r.stub)
        traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        await stream.send(request_headers(extra={"traceparent": traceparent}))
        reply = await stream.send(request_body(CHAT_BODY))
        sent = {
            k: v.decode()
            for k, v in set_headers(reply.request_body.response.header_mutation).items()
        }
        pod = r.key_of(sent["target-pod"])
        await stream.send(response_headers())
        for chunk in sse_chunks(5):
            await stream.send(response_body(chunk))
        await stream.send(response_body(b"", end_of_stream=True))
        await stream.finish()
        # Gone before its body: the stream ends, its trace ends as cancelled.
        gone = Stream(r.stub)
        await gone.send(
            request_headers(
                request_id="req-3", extra={"traceparent": f"00-{GONE}-{CLIENT_SPAN}-01"}
            )
        )
        await gone.finish()
        # Refused by the gateway itself: an unknown model is a 400 and an error span.
        refused = Stream(r.stub)
        await refused.send(request_headers(request_id="req-2"))
        await refused.send(request_body({**CHAT_BODY, "model": "no-such-model"}))
    await gateway.stop()  # flushes the exporter
    spans = {s.name: s for s in receiver.spans if s.trace_id.hex() == TRACE_ID}
    assert set(spans) == {"gateway request", "routing decision", "upstream"}
    root = spans["gateway request"]
    assert root.parent_span_id.hex() == CLIENT_SPAN  # joined to the client's trace
    assert root.kind == trace_pb2.Span.SPAN_KIND_SERVER
    attrs = _attrs(root)
    assert (
        attrs["hetero_gateway.pod"] == pod and attrs["hetero_gateway.model"] == CHAT_BODY["model"]
    )
    assert attrs["hetero_gateway.strategy"] and attrs["http.response.status_code"] == 200
    assert attrs["hetero_gateway.output_tokens"] == 5
    for child in ("routing decision", "upstream"):
        assert spans[child].parent_span_id == root.span_id
    # The engine's parent: the traceparent Envoy sends on names the upstream span.
    upstream = spans["upstream"]
    assert upstream.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    assert sent["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"
    assert root.start_time_unix_nano <= upstream.start_time_unix_nano
    assert upstream.end_time_unix_nano <= root.end_time_unix_nano
    (cancelled,) = [s for s in receiver.spans if s.trace_id.hex() == GONE]
    assert cancelled.name == "gateway request"
    assert cancelled.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert _attrs(cancelled)["http.response.status_code"] == 499
    # The refused request: its own trace (no traceparent), status error, the 400.
    other = [s for s in receiver.spans if s.trace_id.hex() not in (TRACE_ID, GONE)]
    refused_root = next(s for s in other if s.name == "gateway request")
    assert refused_root.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert _attrs(refused_root)["http.response.status_code"] == 400
    assert _attrs(refused_root)["hetero_gateway.error"] == "UnknownModel"


async def test_off_by_default_no_spans_and_no_header(
    pods_file: Path, start_gateway: StartGateway, receiver: Receiver
) -> None:
    gateway = await start_gateway(pods_file, SETTINGS_ENV)
    async for r in _connected(gateway, pods_file):
        stream = Stream(r.stub)
        await stream.send(request_headers(extra={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}))
        reply = await stream.send(request_body(CHAT_BODY))
        assert "traceparent" not in set_headers(reply.request_body.response.header_mutation)
    await gateway.stop()
    await asyncio.sleep(0.1)
    assert receiver.spans == []
