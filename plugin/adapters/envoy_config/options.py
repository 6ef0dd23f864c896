"""What a rendered bootstrap is made of: `EnvoyOptions` (the product's choices, checked) and
the names the renderer and the plugin share."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from plugin.config import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_REQUEST_BYTES
from plugin.config import (
    ENVOY_MAX_MESSAGE_TIMEOUT_S,
    ENVOY_MESSAGE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_HEADERS,
)

MAX_MESSAGE_ENV = MAX_MESSAGE_BYTES.name

EXT_PROC_CLUSTER = "hetero_gateway_ext_proc"
ORIGINAL_DST_CLUSTER = "hetero_gateway_original_dst"
OVERRIDE_HOST_CLUSTER = "hetero_gateway_override_host"
# How the pick reaches Envoy: "original-dst" connects to whatever IP:PORT `target-pod` names
# (AIBrix's wiring); "override-host" picks among a known endpoint list by the `envoy.lb`
# metadata the plugin sets (the Gateway API Inference Extension's protocol) and falls back to
# round robin when there is no pick, which is what lets fail-open really serve.
STEERING_MODES = ("original-dst", "override-host")
COUNT_MODES = ("observe", "streamed", "engine")
# How long Envoy keeps the counting stream (observability_mode) open once the request is gone.
# Its default, 5 s, holds the in-flight slot of a request its client cancelled 5 s longer (a
# whole response ends with its last chunk instead, which the plugin sees). In the `engine` count
# mode the stream's end is the response's end, so it closes at once (checked on Envoy 1.40: with
# 20 ms the plugin sees the stream end with the response); in `observe` mode the plugin is given
# time to read the chunks already sent before the stream is closed under it.
ENGINE_COUNT_CLOSE_S = 0.02
OBSERVE_COUNT_CLOSE_S = 0.2
COUNT_FILTER = "hetero_gateway.count"

_INT32_MAX = 2**31 - 1
_H2_MIN_WINDOW = 65535  # HTTP/2's initial window; Envoy only accepts raising it.
# Envoy's circuit-breaker defaults are 1024 connections / pending / requests per cluster. Each
# in-flight LLM request holds one upstream request and one ext_proc stream for its whole (long,
# streamed) life, so 1024 would cap the gateway at 1024 concurrent generations. Admission control
# is the plugin's job (it answers 503 by ImmediateResponse), not Envoy's.
_CIRCUIT_BREAKER_LIMIT = 1_000_000
# Long LLM streams: no per-request deadline, but a stream silent for this long is dead.
_STREAM_IDLE_TIMEOUT_S = 300.0


def _type_url(message: str) -> str:
    return f"type.googleapis.com/{message}"


def _duration(seconds: float) -> str:
    """A protobuf Duration in YAML form ("60s", "0.2s"), exact to the nanosecond."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not _is_ip(host) or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"endpoint must be IP:PORT, got {endpoint!r}")
    return host, int(port)


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    """What varies between deployments; everything else in the bootstrap is fixed on purpose."""

    listen_host: str = "0.0.0.0"
    listen_port: int = 8888
    admin_host: str = "127.0.0.1"
    admin_port: int = 9901
    extproc_host: str = "127.0.0.1"
    extproc_port: int = 50052
    # How long Envoy waits for the plugin's reply to one message before the failure mode applies
    # (a hung plugin stalls a request no longer). Envoy's default, 200 ms, is too tight for a
    # loaded Python process; AIBrix uses 60 s, which lets a hung plugin stall every request.
    message_timeout_s: float = ENVOY_MESSAGE_TIMEOUT_S
    # The longest a reply may take when the plugin asks for more (`override_message_timeout`,
    # sent for a request it holds in the SLO queue): at least HETERO_GATEWAY_SLO_MAX_WAIT_MS + 1 s.
    max_message_timeout_s: float = ENVOY_MAX_MESSAGE_TIMEOUT_S
    # Must equal the plugin's gRPC max message size: a BUFFERED body larger than Envoy's buffer
    # gets 413, and one larger than the gRPC limit breaks the ext_proc stream.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # The HCM's max_headers_count; the plugin reads the same variable (MAX_REQUEST_HEADERS).
    max_request_headers: int = MAX_REQUEST_HEADERS.default
    # ext_proc `failure_mode_allow`. Refused with ORIGINAL_DST: with the plugin down nothing
    # strips a client's own target-pod header, which would then pick any address.
    fail_open: bool = False
    upstream_connect_timeout_s: float = 5.0
    # How the plugin sees response chunks to count tokens. "observe": a second ext_proc filter in
    # observability_mode gets every chunk and Envoy never waits for the plugin on the response
    # path; "streamed": the routing filter itself gets the chunks (response body STREAMED) and
    # Envoy waits for a reply to each (about +0.9 ms per chunk against +0.2 ms:
    # docs/architecture.md, docs/plugin-cost.md); "engine": the counting filter gets no body at
    # all, only the response's status and end (for the in-flight count), and capacity is learned
    # from each engine's own generated-token counter (vLLM, SGLang), read at every scrape: no
    # per-token cost in Envoy or the plugin.
    count_mode: str = "observe"
    steering: str = "original-dst"
    # IP:PORT of every engine, for the override-host cluster (it can only pick its members).
    endpoints: tuple[str, ...] = ()
    # IP:PORT of each plugin replica, in place of extproc_host/extproc_port: one cluster over
    # all of them, checked by gRPC health and ejected on a refused connection. The replicas
    # share state through Redis, which hands a request over when its two streams reach
    # different replicas.
    extproc_replicas: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.count_mode not in COUNT_MODES:
            raise ValueError(f"count_mode must be one of {COUNT_MODES}, got {self.count_mode!r}")
        if self.steering not in STEERING_MODES:
            raise ValueError(f"steering must be one of {STEERING_MODES}, got {self.steering!r}")
        if self.steering == "override-host" and not self.endpoints:
            raise ValueError("override-host steering needs the engines' endpoints (IP:PORT)")
        if self.fail_open and self.steering == "original-dst":
            raise ValueError(
                "--fail-open with ORIGINAL_DST steering is unsafe: while the plugin is down, a"
                " client's own target-pod header would send the request to any address it names."
                " Fail closed (the default), or fail open with --steering override-host"
                " --endpoints ..., which can only pick the listed engines"
            )
        for endpoint in (*self.endpoints, *self.extproc_replicas):
            _split_endpoint(endpoint)
        for name in ("listen_host", "admin_host"):
            host = getattr(self, name)
            if not _is_ip(host):
                raise ValueError(f"{name} must be an IP address (Envoy binds it), got {host!r}")
        if not self.extproc_host:
            raise ValueError("extproc_host must not be empty")
        for name in ("listen_port", "admin_port", "extproc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0-65535, got {port}")
        if not 0 <= self.message_timeout_s <= 3600:  # Envoy's validation rule for the field.
            raise ValueError(
                f"message_timeout_s must be in [0, 3600], got {self.message_timeout_s}"
            )
        if not self.message_timeout_s <= self.max_message_timeout_s <= 3600:
            raise ValueError(
                f"max_message_timeout_s must be in [message_timeout_s, 3600], got "
                f"{self.max_message_timeout_s} (held requests need it above the longest hold)"
            )
        if not 0 < self.max_request_bytes <= _INT32_MAX:  # gRPC sizes and H2 windows are int32.
            raise ValueError(
                f"max_request_bytes must be in 1-{_INT32_MAX}, got {self.max_request_bytes}"
            )
        if not self.upstream_connect_timeout_s > 0:  # Envoy requires connect_timeout > 0.
            raise ValueError(
                f"upstream_connect_timeout_s must be > 0, got {self.upstream_connect_timeout_s}"
            )
