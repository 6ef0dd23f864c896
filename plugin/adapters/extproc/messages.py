"""What the ext_proc streams send back: headers, immediate (OpenAI-shaped) replies, error
counts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from google.protobuf import struct_pb2
from hetero_gateway_protos.envoy.config.core.v3 import base_pb2
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.type.v3 import http_status_pb2

from plugin.adapters.steering import (
    CONFIG_PROFILE_HEADER,
    DESTINATION_HEADER,
    LEASE_HEADER,
    PROFILE_ECHO_HEADER,
    PROMPT_TOKENS_HEADER,
    REPLY_METADATA_NAMESPACE,
    RESERVATION_HEADER,
    TARGET_POD_HEADER,
)
from plugin.config import MAX_REQUEST_HEADERS
from plugin.core.request import (
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
)
from plugin.core.selector import EXTERNAL_FILTER_HEADER
from plugin.errors import (
    RequestError,
    error_reply,
)

if TYPE_CHECKING:  # imported by `serve` only when tracing is on
    pass


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
        "traceparent",  # W3C trace context, read when OpenTelemetry spans are on
        "tracestate",
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
    LEASE_HEADER,
    RESERVATION_HEADER,
)
_STEERING_SET = frozenset(_STEERING_HEADERS)
# Headers a routed request always gets (the steering ones but the profile echo, the lease and
# the reservation);
# `routing-strategy` and `x-request-id` are added too when the client did not send them, the
# profile echo when it asked for a profile, the lease where the routing stream only picks (and
# the reservation where it picks for a rate-limited tenant).
_ALWAYS_ADDED = len(_STEERING_HEADERS) - 3
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
# texts into OpenAI JSON) leave a reply carrying this alone (`envoy_config.filters`).
_PLUGIN_REPLY = struct_pb2.Struct()
_PLUGIN_REPLY.fields[REPLY_METADATA_NAMESPACE].struct_value.fields["reply"].string_value = "plugin"


def _immediate(
    status: int, body: bytes, headers: Iterable[tuple[str, str]], details: str
) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            # The enum is open: any status travels as its number.
            status=http_status_pb2.HttpStatus(code=cast("http_status_pb2.StatusCode", status)),
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
