"""The project's one error hierarchy, and the one place that maps a request error to a reply.

`GatewayError` is the root. `ConfigError` stops start-up. `RequestError` subclasses are the errors
the plugin itself decides for a request; `error_reply` turns one into the status, OpenAI-shaped JSON
body and `x-error-*` header that Envoy returns to the client unchanged (ImmediateResponse). The
mapping is pure so it is tested without gRPC; the ext_proc adapter only wraps it in protobuf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson


class GatewayError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(GatewayError):
    """Bad configuration: start-up stops with this message (it names the variable or file)."""


class TraceFormatError(GatewayError, ValueError):
    """A request-trace window's document is not in AIBrix's format (`plugin.core.trace`); the
    message says which field. A reader skips that window."""


class RequestError(GatewayError):
    """An error decided for one request; subclasses fix status, code and the `x-error-*` header."""

    status: int = 500
    code: str | None = None
    param: str | None = None
    header: tuple[str, str] = ("x-error-routing", "true")
    # Headers beyond `header` the reply carries (`retry-after`, say).
    extra_headers: tuple[tuple[str, str], ...] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequestBody(RequestError):
    """The body of an LLM request is not a JSON object."""

    status = 400
    header = ("x-error-request-body-processing", "true")


class BadRequestHeader(RequestError):
    """A request header the plugin reads (an SLO target) holds a value it cannot use."""

    status = 400
    header = ("x-error-request-header-processing", "true")

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.param = name


class TooManyHeaders(RequestError):
    """With the headers the gateway adds, the request would exceed Envoy's header count limit
    (Envoy would answer an empty 503)."""

    status = 431
    header = ("x-error-request-header-processing", "true")

    def __init__(self, count: int, added: int, limit: int) -> None:
        super().__init__(
            f"too many request headers: {count} as Envoy counts them (its own included) and the "
            f"{added} the gateway adds exceed its limit of {limit}; send at least "
            f"{count + added - limit} fewer"
        )


ECHO_LIMIT = 256  # characters of client text an error message repeats


def echo(text: str) -> str:
    """Client text as an error message repeats it: bounded, so a 4 MiB model name gets a small
    400 (within gRPC's and Envoy's limits) that still shows what was sent."""
    if len(text) <= ECHO_LIMIT:
        return text
    return f"{text[:ECHO_LIMIT]}... ({len(text)} characters)"


class NoModel(RequestError):
    """The request names no model."""

    status = 400
    code = "model_not_found"
    param = "model"
    header = ("x-error-no-model-backends", "true")

    def __init__(self) -> None:
        super().__init__("no model in request body")


class MethodNotAllowed(RequestError):
    """A path the gateway serves asked with another method than its own (405, as the OpenAI
    API answers): POST on the LLM paths, GET on `/v1/models`."""

    status = 405
    code = "method_not_allowed"
    header = ("allow", "POST")

    def __init__(self, method: str, path: str, allowed: str = "POST") -> None:
        super().__init__(f"method {echo(method)} is not allowed on {path}: use {allowed}")
        self.header = ("allow", allowed)


class UnknownModel(RequestError):
    """No pod serves the requested model at all."""

    status = 400
    code = "model_not_found"
    param = "model"

    def __init__(self, model: str) -> None:
        super().__init__(f"model {echo(model)} does not exist")
        # The name comes from the client: keep the header value printable and short.
        safe = "".join(c for c in model[:128] if " " <= c <= "~") or "invalid"
        self.header = ("x-error-no-model-backends", safe)


class NoReadyPod(RequestError):
    """The model has pods, but none is ready now."""

    status = 503
    header = ("x-error-no-model-backends", "true")

    def __init__(self, model: str) -> None:
        super().__init__(f"no ready pods for model {model}")


class UnknownStrategy(RequestError):
    """The `routing-strategy` header names no registered strategy."""

    status = 400
    header = ("x-error-routing", "true")

    def __init__(self, strategy: str, why: str = "") -> None:
        reason = f": {why}" if why else ""
        super().__init__(f"incorrect routing strategy {echo(strategy)}{reason}")


class Unauthorized(RequestError):
    """The gateway's bearer token is set and the request does not carry it."""

    status = 401
    code = "invalid_api_key"
    header = ("x-error-auth", "true")

    def __init__(self) -> None:
        super().__init__("missing or incorrect API key: send Authorization: Bearer <token>")


class HeaderNotAllowed(RequestError):
    """The request sends a routing header the operator locked (`plugin.core.header_policy`)."""

    status = 403
    code = "header_not_allowed"
    header = ("x-error-request-header-processing", "true")

    def __init__(self, name: str, rule: str) -> None:
        allowed = "it may not be sent" if rule == "deny" else f"allowed values: {echo(rule)}"
        super().__init__(f"header {name} is locked by the gateway's operator: {allowed}")
        self.param = name


class RoutingFailed(RequestError):
    """A strategy excluded every candidate (or rejected the request)."""

    status = 503
    header = ("x-error-routing", "true")


class NoMatchingPod(RoutingFailed):
    """No ready pod of the model matches the request's `external-filter` label selector."""

    def __init__(self, model: str, selector: str) -> None:
        super().__init__(
            f"no ready pod of model {echo(model)} matches external-filter {echo(selector)!r}"
        )


class SloUnmeetable(RoutingFailed):
    """No replica can serve the request within its SLO, now or before its deadline."""


class QueueFull(RoutingFailed):
    """The model's gateway queue holds as many requests as it may (`HETERO_GATEWAY_MAX_WAITING`)."""


class Overloaded(RoutingFailed):
    """Admission shed the request: it waited as long as its priority class may, or a request of
    a higher class took its place in a full queue (`plugin.core.admission`). `retry-after` (whole
    seconds, as HTTP has it) says when a retry may find room."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        self.extra_headers = (("retry-after", str(self.retry_after_s)),)


class RateLimited(RequestError):
    """The request would take its tenant past a rate limit (`plugin.core.limits`): 429 with
    `retry-after` (whole seconds) when waiting helps; none when the request alone is larger
    than the limit. AIBrix's `x-error-rpm-exceeded` / `x-error-tpm-exceeded` headers mark which
    limit (`x-error-gpu-seconds-exceeded` for GPU time)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, kind: str, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.kind = kind  # requests, tokens or gpu-seconds
        short = {"requests": "rpm", "tokens": "tpm"}.get(kind, kind)
        self.header = (f"x-error-{short}-exceeded", "true")
        self.retry_after_s = None if retry_after_s is None else max(1, math.ceil(retry_after_s))
        if self.retry_after_s is not None:
            self.extra_headers = (("retry-after", str(self.retry_after_s)),)


class ShuttingDown(RoutingFailed):
    """The gateway is draining: a request it held is answered now, not left to time out."""


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    431: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (AIBrix's table)."""
    return _TYPE_BY_STATUS.get(status, "api_error")


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """What the client receives: status, JSON body, headers (content-type included)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...]


def error_reply(err: RequestError) -> ErrorReply:
    body = orjson.dumps(
        {
            "error": {
                "message": err.message,
                "type": error_type(err.status),
                "param": err.param,
                "code": err.code,
            }
        }
    )
    return ErrorReply(
        status=err.status,
        body=body,
        headers=(("content-type", "application/json"), err.header, *err.extra_headers),
    )


class OptimizerInputError(GatewayError, ValueError):
    """The GPU optimizer was handed a problem it cannot solve as stated (mismatched lengths, a
    negative or non-finite rate, tput or cost, headroom below 1, min_replicas above the cap);
    the message names the field."""


class MetricsPageError(GatewayError):
    """An engine's metrics page could not be read (`plugin.adapters.metrics_http`)."""


class EngineUnreachable(MetricsPageError):
    """No answer: refused, reset, timed out, or closed before the status line. The pod leaves
    rotation until it answers."""


class MetricsPageUnusable(MetricsPageError):
    """The engine answered with nothing the gateway can use (not 200, malformed, cut off, too
    big). Proof of life: the pod stays in rotation, routed by the gateway's own counts."""
