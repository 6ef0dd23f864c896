"""The listener's HTTP filters: the Lua filter, the routing and counting ext_proc filters, the
router; and the local replies Envoy sends in OpenAI's error shape."""

from __future__ import annotations

from importlib import resources
from typing import Any

from plugin.adapters.envoy_config.options import (
    _CIRCUIT_BREAKER_LIMIT,
    COUNT_FILTER,
    ENGINE_COUNT_CLOSE_S,
    EXT_PROC_CLUSTER,
    OBSERVE_COUNT_CLOSE_S,
    EnvoyOptions,
    _duration,
    _type_url,
)
from plugin.adapters.steering import (
    LB_METADATA_NAMESPACE,
    PICK_ONLY,
    PROFILE_ECHO_HEADER,
    REPLY_METADATA_NAMESPACE,
    STRIP_USAGE_KEY,
    STRIPS_USAGE,
    TARGET_POD_HEADER,
)
from plugin.core.limits import HEADERS as LIMIT_HEADERS
from plugin.core.request import LLM_PATHS, MODELS_PATH


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


def _strips_usage(opts: EnvoyOptions) -> bool:
    """The plugin counts response bodies: it may ask engines for usage, and a Lua filter takes
    the usage-only chunk out of streams whose client did not ask for it."""
    return opts.count_mode in ("observe", "streamed")


# The Lua filter that takes the usage-only event out of a stream the plugin asked usage for on
# the client's behalf (`strip_usage.lua`, beside this module;
# tests/dataplane/test_strip_usage_lua.py).
_STRIP_USAGE_LUA = (
    f'local NS, KEY = "{REPLY_METADATA_NAMESPACE}", "{STRIP_USAGE_KEY}"\n'
    + resources.files("plugin.adapters.envoy_config")
    .joinpath("strip_usage.lua")
    .read_text(encoding="utf-8")
)


def _strip_usage_filter() -> dict[str, Any]:
    return {
        "name": "hetero_gateway.strip_usage",
        "typed_config": {
            "@type": _type_url("envoy.extensions.filters.http.lua.v3.Lua"),
            "default_source_code": {"inline_string": _STRIP_USAGE_LUA},
        },
    }


def _pick_only(opts: EnvoyOptions) -> bool:
    """The routing filter only picks (no response phase) when a counting filter follows it:
    its stream then ends at the pick, so a plugin crash cannot cut a streaming response."""
    return opts.count_mode in ("observe", "engine")


# Response headers AIBrix's gateway returns, added by Envoy's route when the routing filter only
# picks (else the plugin sets them in its response-headers reply): from the request headers the
# plugin set and the pod name it put in dynamic metadata. Empty values are left out (unrouted).
_ROUTED_RESPONSE_HEADERS = (
    ("request-id", "%REQ(x-request-id)%"),
    ("routing-strategy", "%REQ(routing-strategy)%"),
    (TARGET_POD_HEADER, f"%DYNAMIC_METADATA({REPLY_METADATA_NAMESPACE}:pod)%"),
    ("target-pod-ip", f"%REQ({TARGET_POD_HEADER})%"),
    (PROFILE_ECHO_HEADER, f"%REQ({PROFILE_ECHO_HEADER})%"),
    # A rate-limited tenant's `x-ratelimit-*`, as the plugin computed them when it routed.
    *((name, f"%DYNAMIC_METADATA({REPLY_METADATA_NAMESPACE}:{name})%") for name in LIMIT_HEADERS),
)


def _ext_proc_filter(opts: EnvoyOptions) -> dict[str, Any]:
    streamed = opts.count_mode == "streamed"
    pick_only = _pick_only(opts)
    metadata = [PICK_ONLY] if pick_only else []
    if _strips_usage(opts):
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
                "request_body_mode": "BUFFERED",
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
            "deferred_close_timeout": _duration(
                ENGINE_COUNT_CLOSE_S if engine else OBSERVE_COUNT_CLOSE_S
            ),
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


def _http_filters(opts: EnvoyOptions) -> list[dict[str, Any]]:
    observe = opts.count_mode in ("observe", "engine")
    return [
        # First in the chain, so last on the response path: whatever counts tokens sees the
        # usage chunk before it is taken out.
        *([_strip_usage_filter()] if _strips_usage(opts) else []),
        _ext_proc_filter(opts),
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
