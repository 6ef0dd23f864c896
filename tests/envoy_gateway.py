"""Envoy Gateway's xDS for deploy/, modelled in our own words (no cluster): the Gateway listener,
its route configuration and clusters as Envoy Gateway's translator generates them for the
version our CRDs pin, from the rendered manifests; our EnvoyPatchPolicies applied the way Envoy
Gateway applies them; and the whole as a static bootstrap a real Envoy runs.

What the translator generates (read from its translator test data; docs/deploy.md, "Protections
under Envoy Gateway"): each extProc entry of the EnvoyExtensionPolicy becomes an HTTP filter named
`envoy.filters.http.ext_proc/envoyextensionpolicy/<ns>/<policy>/extproc/<i>`, disabled on the
listener and enabled per route with an empty `FilterConfig`, its cluster named as the name's
tail; processing phases SKIP unless the policy names them; the connection manager of a plain HTTP
listener sits at `/default_filter_chain/filters/0/typed_config` of listener
`<ns>/<gateway>/<listener>`, with `headers_with_underscores_action` set and routes from RDS under
the same name; a route per HTTPRoute match, `httproute/<ns>/<route>/rule/<i>/match/<j>/<host>`.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpath

from tests.helpers import one

Obj = dict[str, Any]

EXT_PROC = "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
BODY_MODES = {"Buffered": "BUFFERED", "Streamed": "STREAMED", "BufferedPartial": "BUFFERED_PARTIAL"}
STATUS_NAMES = {503: "ServiceUnavailable", 500: "InternalServerError", 502: "BadGateway"}


def _type(name: str) -> str:
    return f"type.googleapis.com/{name}"


class EgModel:
    """Envoy Gateway's xDS for one Gateway listener, one HTTPRoute and one EnvoyExtensionPolicy."""

    def __init__(
        self, objects: list[Obj], plugin_port: int = 50052, model_port: int = 8000
    ) -> None:
        self.plugin_port, self.model_port = plugin_port, model_port
        self.gateway = one(objects, "Gateway")
        self.route = one(objects, "HTTPRoute")
        self.policy = one(objects, "EnvoyExtensionPolicy")
        listener = self.gateway["spec"]["listeners"][0]
        namespace = self.gateway["metadata"]["namespace"]
        self.name = f"{namespace}/{self.gateway['metadata']['name']}/{listener['name']}"
        self.port = 10000 + int(listener["port"])  # Envoy Gateway's unprivileged listener port

    def filter_name(self, index: int) -> str:
        meta = self.policy["metadata"]
        return (
            f"envoy.filters.http.ext_proc/envoyextensionpolicy/{meta['namespace']}/"
            f"{meta['name']}/extproc/{index}"
        )

    def cluster_name(self, index: int) -> str:
        return self.filter_name(index).split("/", 1)[1]

    def ext_proc(self, index: int, entry: Obj) -> Obj:
        """One extProc entry as the translator maps it (processing phases SKIP unless named)."""
        ref = entry["backendRefs"][0]
        namespace = self.policy["metadata"]["namespace"]
        mode = entry.get("processingMode", {})
        processing = {
            "request_header_mode": "SKIP",
            "response_header_mode": "SKIP",
            "request_body_mode": "NONE",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        }
        for phase in ("request", "response"):
            if phase in mode:
                processing[f"{phase}_header_mode"] = "SEND"
                body = (mode[phase] or {}).get("body")
                if body is not None:
                    processing[f"{phase}_body_mode"] = BODY_MODES[body]
        config: Obj = {
            "@type": _type(EXT_PROC),
            "grpc_service": {
                "envoy_grpc": {
                    "cluster_name": self.cluster_name(index),
                    "authority": f"{ref['name']}.{namespace}:{ref['port']}",
                },
                "timeout": "10s",
            },
            "processing_mode": processing,
        }
        if entry.get("failOpen"):
            config["failure_mode_allow"] = True
        if "messageTimeout" in entry:
            config["message_timeout"] = entry["messageTimeout"]
        if entry.get("shadowMode"):
            config["observability_mode"] = True
        if "statusOnError" in entry:
            config["status_on_error"] = {"code": STATUS_NAMES[entry["statusOnError"]]}
        if mode.get("allowModeOverride"):
            config["allow_mode_override"] = True
        metadata = entry.get("metadata", {})
        options = {}
        if metadata.get("accessibleNamespaces"):
            options["forwarding_namespaces"] = {"untyped": metadata["accessibleNamespaces"]}
        if metadata.get("writableNamespaces"):
            options["receiving_namespaces"] = {"untyped": metadata["writableNamespaces"]}
        if options:
            config["metadata_options"] = options
        return {"name": self.filter_name(index), "disabled": True, "typed_config": config}

    def listener(self) -> Obj:
        filters = [self.ext_proc(i, e) for i, e in enumerate(self.policy["spec"]["extProc"])]
        router = {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _type("envoy.extensions.filters.http.router.v3.Router")},
        }
        hcm = {
            "@type": _type(HCM),
            "stat_prefix": f"http-{self.port}",
            "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
            "rds": {
                "route_config_name": self.name,
                "config_source": {"ads": {}, "resource_api_version": "V3"},
            },
            "http_filters": [*filters, router],
            "use_remote_address": True,
        }
        return {
            "name": self.name,
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": self.port}},
            "default_filter_chain": {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            },
        }

    def route_configuration(self) -> Obj:
        enabled = {
            self.filter_name(i): {
                "@type": _type("envoy.config.route.v3.FilterConfig"),
                "config": {},
            }
            for i in range(len(self.policy["spec"]["extProc"]))
        }
        routes = []
        for i, rule in enumerate(self.route["spec"]["rules"]):
            for j, match in enumerate(rule["matches"]):
                path = match["path"]
                envoy_match: Obj = (
                    {"path": path["value"]}
                    if path["type"] == "Exact"
                    else {"prefix": path["value"]}
                )
                if "method" in match:
                    envoy_match["headers"] = [
                        {"name": ":method", "string_match": {"exact": match["method"]}}
                    ]
                name = f"{self.rule_cluster(i)}/match/{j}/*"
                routes.append(
                    {
                        "name": name,
                        "match": envoy_match,
                        "route": {
                            "cluster": self.rule_cluster(i),
                            **(
                                {"timeout": rule["timeouts"]["request"]}
                                if "request" in rule.get("timeouts", {})
                                else {}
                            ),
                        },
                        "typed_per_filter_config": copy.deepcopy(enabled),
                    }
                )
        return {
            "name": self.name,
            "virtual_hosts": [{"name": f"{self.name}/*", "domains": ["*"], "routes": routes}],
        }

    def rule_cluster(self, index: int) -> str:
        meta = self.route["metadata"]
        return f"httproute/{meta['namespace']}/{meta['name']}/rule/{index}"

    def clusters(self) -> list[Obj]:
        def static(name: str, port: int, http2: bool = False) -> Obj:
            cluster: Obj = {
                "name": name,
                "type": "STATIC",
                "connect_timeout": "10s",
                "load_assignment": {
                    "cluster_name": name,
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {
                                                "address": "127.0.0.1",
                                                "port_value": port,
                                            }
                                        }
                                    }
                                }
                            ]
                        }
                    ],
                },
            }
            if http2:
                options = _type("envoy.extensions.upstreams.http.v3.HttpProtocolOptions")
                cluster["typed_extension_protocol_options"] = {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": options,
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                }
            return cluster

        extprocs = self.policy["spec"]["extProc"]
        rules = self.route["spec"]["rules"]
        return [
            *(
                static(self.cluster_name(i), self.plugin_port, http2=True)
                for i in range(len(extprocs))
            ),
            *(static(self.rule_cluster(i), self.model_port) for i in range(len(rules))),
        ]


class Xds:
    """The model's resources, patched in place by EnvoyPatchPolicies."""

    def __init__(self, model: EgModel) -> None:
        self.model = model
        self.listener = model.listener()
        self.routes = model.route_configuration()
        self.clusters = model.clusters()

    def resource(self, kind: str, name: str) -> Obj:
        by_type = {
            _type("envoy.config.listener.v3.Listener"): self.listener,
            _type("envoy.config.route.v3.RouteConfiguration"): self.routes,
        }
        target = by_type.get(kind)
        assert target is not None and target["name"] == name, f"no {kind} named {name}"
        return target

    def apply(self, policy: Obj) -> None:
        for patch in policy["spec"]["jsonPatches"]:
            operation = patch["operation"]
            if patch["type"] == _type("envoy.config.cluster.v3.Cluster"):
                assert operation["op"] == "add" and operation.get("path", "") == ""
                self.clusters.append(copy.deepcopy(operation["value"]))
                continue
            target = self.resource(patch["type"], patch["name"])
            patched = apply_operation(target, operation)
            target.clear()
            target.update(patched)

    def bootstrap(self) -> Obj:
        listener = copy.deepcopy(self.listener)
        hcm = listener["default_filter_chain"]["filters"][0]["typed_config"]
        del hcm["rds"]
        hcm["route_config"] = copy.deepcopy(self.routes)
        return {
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"listeners": [listener], "clusters": self.clusters},
        }

    def http_filter(self, name: str) -> Obj:
        hcm = self.listener["default_filter_chain"]["filters"][0]["typed_config"]
        for f in hcm["http_filters"]:
            if f["name"] == name:
                config: Obj = f["typed_config"]
                return config
        raise AssertionError(f"no http filter {name}")


def apply_operation(resource: Obj, operation: Obj) -> Obj:
    """One JSON Patch operation as Envoy Gateway applies it: at `path`, or, with `jsonPath`, at
    `path` under every node the selector matches (it must match one)."""
    path = operation.get("path", "")
    if "jsonPath" in operation:
        nodes = [str(m.pointer()) for m in jsonpath.finditer(operation["jsonPath"], resource)]
        assert nodes, f"jsonPath {operation['jsonPath']!r} selects nothing"
        paths = [f"{node}/{path.lstrip('/')}" if path else node for node in nodes]
    else:
        paths = [path]
    patch = jsonpath.JSONPatch()
    for at in paths:
        if operation["op"] == "remove":
            patch.remove(at)
        else:
            getattr(patch, operation["op"])(at, copy.deepcopy(operation["value"]))
    patched = patch.apply(copy.deepcopy(resource))
    assert isinstance(patched, dict)
    return patched


def patched(objects: list[Obj], plugin_port: int = 50052, model_port: int = 8000) -> Xds:
    """The model of a rendered overlay with every EnvoyPatchPolicy of it applied."""
    xds = Xds(EgModel(objects, plugin_port, model_port))
    for policy in (o for o in objects if o["kind"] == "EnvoyPatchPolicy"):
        xds.apply(policy)
    return xds
