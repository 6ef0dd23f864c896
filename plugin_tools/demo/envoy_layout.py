"""Departures from the product's Envoy bootstrap that only the benchmarks use.

Each one gives up routing or token counting, which is the point when measuring what they cost;
`envoy-config` offers none of them, so the runtime's renderer knows nothing of them. A layout is
applied to the product bootstrap (`render_bootstrap`) as an edit of its plain dict: what stays is
exactly what the product renders.
"""

from __future__ import annotations

import copy
import ipaddress
from dataclasses import dataclass
from typing import Any

from plugin.adapters.envoy_config import (
    COUNT_FILTER,
    EXT_PROC_CLUSTER,
    EnvoyOptions,
    render_bootstrap,
)
from plugin.adapters.envoy_config.render import bootstrap_dump

__all__ = ["BENCH_UPSTREAM_CLUSTER", "BenchLayout", "bench_bootstrap", "bench_bootstrap_yaml"]

BENCH_UPSTREAM_CLUSTER = "hetero_gateway_bench_upstream"
_ROUTING_FILTER = "envoy.filters.http.ext_proc"
_STRIP_USAGE_FILTER = "hetero_gateway.strip_usage"
_ROUTER_FILTER = "envoy.filters.http.router"


@dataclass(frozen=True, slots=True)
class BenchLayout:
    """What to give up; the default is the product bootstrap."""

    # False: no ext_proc filter at all (the "Envoy direct" baseline).
    plugin: bool = True
    # False: the routing filter asks for request headers only (request_body_mode NONE). The
    # plugin routes from the body's model, so it picks nothing and `upstream` must be set.
    request_body: bool = True
    # False: no token counting (no counting or strip-usage filter, response body NONE on the
    # routing filter, which then keeps its response phase, as it does without a counting filter).
    count: bool = True
    # (IP, port): route every request to this one endpoint (a STATIC cluster) instead of the
    # cluster the plugin steers.
    upstream: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.upstream is None:
            if not self.plugin or not self.request_body:
                raise ValueError("without the plugin or the request body, set `upstream`")
            return
        host, port = self.upstream
        try:  # an IP, as Envoy's STATIC cluster needs
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"upstream host must be an IP address, got {host!r}") from None
        if not 0 < port <= 65535:
            raise ValueError(f"upstream port must be in 1-65535, got {port}")


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    listener = boot["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def bench_bootstrap(opts: EnvoyOptions, layout: BenchLayout | None = None) -> dict[str, Any]:
    """The product bootstrap for `opts`, with `layout`'s departures."""
    boot = copy.deepcopy(render_bootstrap(opts))
    layout = layout or BenchLayout()
    hcm = _hcm(boot)
    filters: list[dict[str, Any]] = hcm["http_filters"]
    routes: list[dict[str, Any]] = hcm["route_config"]["virtual_hosts"][0]["routes"]
    clusters: list[dict[str, Any]] = boot["static_resources"]["clusters"]
    if not layout.count:
        filters[:] = [f for f in filters if f["name"] not in (COUNT_FILTER, _STRIP_USAGE_FILTER)]
        for f in filters:
            if f["name"] == _ROUTING_FILTER:
                config = f["typed_config"]
                config["grpc_service"].pop(
                    "initial_metadata", None
                )  # neither picks only nor strips
                config["processing_mode"]["response_header_mode"] = "SEND"
                config["processing_mode"]["response_body_mode"] = "NONE"
        for route in routes:
            route.pop("response_headers_to_add", None)  # the plugin's reply sets them
    if not layout.request_body:
        for f in filters:
            if f["name"] == _ROUTING_FILTER:
                f["typed_config"]["processing_mode"]["request_body_mode"] = "NONE"
    if layout.upstream is not None:
        forward = dict(routes[0]["route"], cluster=BENCH_UPSTREAM_CLUSTER)
        forward.pop("retry_policy", None)
        routes[:] = [{"match": {"prefix": "/"}, "route": forward}]  # every path, one endpoint
        steered = clusters[0]
        host, port = layout.upstream
        clusters[0] = {
            "name": BENCH_UPSTREAM_CLUSTER,
            "type": "STATIC",
            "connect_timeout": steered["connect_timeout"],
            "per_connection_buffer_limit_bytes": steered["per_connection_buffer_limit_bytes"],
            "circuit_breakers": steered["circuit_breakers"],
            "load_assignment": {
                "cluster_name": BENCH_UPSTREAM_CLUSTER,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {"address": host, "port_value": port}
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
    if not layout.plugin:
        filters[:] = [f for f in filters if f["name"] == _ROUTER_FILTER]
        clusters[:] = [c for c in clusters if c["name"] != EXT_PROC_CLUSTER]
    return boot


def bench_bootstrap_yaml(opts: EnvoyOptions, layout: BenchLayout | None = None) -> str:
    """YAML text of `bench_bootstrap`, dumped as the product's is."""
    return bootstrap_dump(bench_bootstrap(opts, layout))
