"""The Kubernetes manifests in deploy/ and the Dockerfile, checked without a cluster.

Each overlay is rendered with `kubectl kustomize` (`kustomize build` where kubectl is missing; once
per session; a machine with neither skips, or fails in CI), every Envoy Gateway, Gateway API and
AIBrix PodAutoscaler object is validated against the CRD schemas of the shared data (`crds/`, the
`crd_dir` fixture of tests/conftest.py; unknown fields rejected, as kubectl's strict field
validation does), the CEL rules those CRDs enforce on the fields we use are mirrored, and the names,
ports, limits and timeouts that must agree across objects, with the plugin's own defaults
(plugin.config, plugin.adapters.envoy_config) and with the Dockerfile are compared; so are the GPU
optimizer's ports, Redis, RBAC and the PodAutoscalers that read its answer.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from plugin.adapters.envoy_config import ORIGINAL_DST_CLUSTER, EnvoyOptions, render_bootstrap
from plugin.adapters.steering import (
    LB_METADATA_NAMESPACE,
    REPLY_METADATA_NAMESPACE,
    TARGET_POD_HEADER,
)
from plugin.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENV_VARS,
    MAX_REQUEST_HEADERS,
    OPTIMIZER_PORT,
    Settings,
    load_settings,
)
from plugin.core.header_policy import CLIENT_ROUTING_HEADERS
from plugin.core.request import LLM_PATHS, MODELS_PATH
from plugin.errors import ConfigError
from tests.helpers import (
    REPO,
    YAML_LOADER,
    Kustomize,
    RenderError,
    bootstrap_hcm,
    find,
    one,
)

pytestmark = pytest.mark.component

Obj = dict[str, Any]
Crds = dict[tuple[str, str, str], Obj]  # (group, version, kind) -> the CRD's version entry

DEPLOY = REPO / "deploy"
OVERLAYS = ("original-dst", "override-host")  # the two ways Envoy follows the pick
# original-dst + deploy/components/shared-state (Redis, 2 replicas) + deploy/components/optimizer
SHARED_STATE = "shared-state"
AUTOSCALING = "autoscaling"  # shared-state + AIBrix PodAutoscalers for the sample model
MONITORING = "monitoring"  # shared-state + deploy/components/monitoring (dashboard, alert rules)
ALL_OVERLAYS = (*OVERLAYS, SHARED_STATE, AUTOSCALING, MONITORING)
SHARED_STATE_COMPONENT = DEPLOY / "components" / SHARED_STATE
OPTIMIZER_COMPONENT = DEPLOY / "components" / "optimizer"
OPENAI_ERRORS_COMPONENT = DEPLOY / "components" / "openai-errors"
ORIGINAL_DST_POLICY = "hetero-gateway-original-dst"
OPENAI_ERRORS_POLICY = "hetero-gateway-openai-errors"
GATEWAY_GROUPS = ("gateway.envoyproxy.io", "gateway.networking.k8s.io")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "GatewayClass"}
PART_OF = ("app.kubernetes.io/part-of", "hetero-gateway")
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # DESIGN.md section 4
TRACING_FLAG = "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG"
# The GPU optimizer (deploy/components/optimizer): its objects' name, its image (the Dockerfile
# built with the `optimizer` extra), its settings' ConfigMap and the variables that ConfigMap may
# set away from plugin.config's defaults on purpose (discovery from Kubernetes; availability caps
# equal to the PodAutoscalers' maxReplicas).
OPTIMIZER = "hetero-gateway-gpu-optimizer"
OPTIMIZER_IMAGE = "hetero-gateway-optimizer"
OPTIMIZER_ENV = "hetero-gateway-gpu-optimizer-env"
OPTIMIZER_DESIGNED_VARS = {"HETERO_GATEWAY_DISCOVERY", "HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS"}
OPTIMIZER_REDIS_POLICY = "hetero-gateway-redis-from-gpu-optimizer"
OPTIMIZER_OBJECTS = {
    ("ConfigMap", OPTIMIZER_ENV),
    ("ServiceAccount", OPTIMIZER),
    ("ClusterRole", OPTIMIZER),
    ("ClusterRoleBinding", OPTIMIZER),
    ("Deployment", OPTIMIZER),
    ("Service", OPTIMIZER),
    ("NetworkPolicy", OPTIMIZER_REDIS_POLICY),
}
# Variables the manifests may set away from plugin.config's defaults on purpose (Kubernetes
# discovery, Redis, replica identity).
DESIGNED_VARS = {
    "HETERO_GATEWAY_DISCOVERY",
    "HETERO_GATEWAY_K8S_NAMESPACE",
    "REDIS_HOST",
    "REDIS_PORT",
    "REDIS_PASSWORD",
    "POD_NAME",
    "POD_NAMESPACE",
    TRACING_FLAG,  # on where Redis is (the optimizer reads the traces)
    "HETERO_GATEWAY_MAX_REQUEST_HEADERS",  # Envoy Gateway's listener limit, not envoy-config's
    "HETERO_GATEWAY_CLIENT_HEADERS",  # locked in deploy/components/locked-routing
}


# --- rendering -----------------------------------------------------------------------------------


def resource_id(obj: Obj) -> tuple[str, str, str, str]:
    """(group, kind, namespace, name): what kustomize keeps unique."""
    meta = obj.get("metadata", {})
    return group_of(obj), obj["kind"], meta.get("namespace", ""), meta["name"]


def group_of(obj: Obj) -> str:
    return str(obj["apiVersion"]).rpartition("/")[0]


def quantity_bytes(value: int | str) -> int:
    """A Kubernetes quantity ("4Mi", "128Mi", 4194304) in bytes; binary suffixes only."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi)?", value)
    assert m, f"unsupported quantity {value!r}"
    return int(m.group(1)) * {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}[m.group(2)]


def duration_s(value: str) -> float:
    """A Gateway API / Envoy Gateway duration ("60s", "1m30s", "500ms", "0s") in seconds."""
    parts = re.findall(r"([0-9]+)(h|ms|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(int(n) * scale[u] for n, u in parts)


# --- CRD schemas ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def crds(crd_dir: Path) -> Crds:
    """(group, version, kind) -> the CRD's version entry, for every served version."""
    versions: Crds = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(encoding="utf-8"), Loader=YAML_LOADER):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    versions[(spec["group"], version["name"], spec["names"]["kind"])] = version
    return versions


def strict_schema(node: Any) -> Any:
    """A Kubernetes structural schema as JSON Schema that also rejects unknown fields.

    The API server prunes unknown fields and kubectl (strict field validation, the default) rejects
    them, so a misspelt field must fail here too: every object schema with `properties` gets
    `additionalProperties: false` unless it preserves unknown fields. `x-kubernetes-*` extensions
    are dropped (CEL rules are mirrored by hand below), `nullable` becomes a null type.
    """
    if isinstance(node, list):
        return [strict_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: strict_schema(value)
        for key, value in node.items()
        if not key.startswith("x-kubernetes-") and key not in ("description", "nullable")
    }
    if "properties" in node:
        # Property names are data here, not schema keywords.
        out["properties"] = {k: strict_schema(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def schema_errors(crds: Crds, obj: Obj) -> list[str]:
    group, _, version = str(obj["apiVersion"]).rpartition("/")
    entry = crds.get((group, version, obj["kind"]))
    assert entry is not None, f"no served CRD version for {obj['apiVersion']} {obj['kind']}"
    schema = strict_schema(entry["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in validator.iter_errors(obj)
    ]


def cel_messages(crds: Crds, kind: str) -> set[str]:
    """Every x-kubernetes-validations message in the served CRD versions of `kind`."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []) or []:
                found.add(rule["message"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for (_, _, k), entry in crds.items():
        if k == kind:
            walk(entry["schema"])
    return found


# --- the rendered tree ---------------------------------------------------------------------------


def test_crds_for_every_gateway_kind_we_use_are_present(crds: Crds) -> None:
    kinds = {k for (_, _, k) in crds}
    wanted = {
        "GatewayClass",
        "Gateway",
        "HTTPRoute",
        "EnvoyExtensionPolicy",
        "EnvoyPatchPolicy",
        "ClientTrafficPolicy",
        "BackendTrafficPolicy",
    }
    assert wanted <= kinds, f"missing CRDs: {sorted(wanted - kinds)}"


# --- what deploy/ relies on kustomize for --------------------------------------------------------


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_patches_images_and_labels_touch_only_what_they_name(
    tmp_path: Path, render: Kustomize
) -> None:
    _write_tree(
        tmp_path,
        {
            "d.yaml": (
                "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d, namespace: n}\n"
                "spec:\n  template:\n    spec:\n      containers:\n"
                "        - {name: a, image: 'reg:5000/app:1'}\n        - {name: b, image: other}\n"
                "      initContainers:\n        - {name: c, image: app}\n"
            ),
            "kustomization.yaml": (
                "resources: [d.yaml]\n"
                "images:\n  - {name: 'reg:5000/app', newTag: '2'}\n"
                "  - {name: app, newName: r/app, digest: 'sha256:f'}\n"
                "labels: [{pairs: {team: llm}}]\n"
                "patches:\n  - target: {kind: Deployment, name: d}\n    patch: |-\n"
                "      - {op: add, path: /spec/replicas, value: 3}\n"
                "      - {op: remove, path: /spec/template/spec/containers/1}\n"
            ),
        },
    )
    [dep] = render.build(tmp_path)
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["template"]["spec"]["containers"] == [
        {"name": "a", "image": "reg:5000/app:2"}
    ]
    assert dep["spec"]["template"]["spec"]["initContainers"][0]["image"] == "r/app@sha256:f"
    # `labels` (unlike the deprecated `commonLabels`) leave selectors and pod templates alone.
    assert dep["metadata"]["labels"] == {"team": "llm"}
    assert "labels" not in dep["spec"]["template"].get("metadata", {})


_CM = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a, namespace: n}\ndata: {X: '1'}\n"
_COMPONENT = (
    "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\nresources: [s.yaml]\n"
    "patches:\n  - target: {kind: ConfigMap, name: a}\n    patch: |-\n"
    "      - {op: replace, path: /data/X, value: '2'}\n"
)
_SERVICE = "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: n}\n"
_TREE = {
    "base/kustomization.yaml": "resources: [cm.yaml]\n",
    "base/cm.yaml": _CM,
    "again/kustomization.yaml": "resources: [cm.yaml]\n",
    "again/cm.yaml": _CM,
    "comp/kustomization.yaml": _COMPONENT,
    "comp/s.yaml": _SERVICE,
}


def test_components_patch_what_the_including_overlay_brought(
    tmp_path: Path, render: Kustomize
) -> None:
    overlay = "resources: [../base]\ncomponents: [../comp]\nlabels: [{pairs: {p: q}}]\n"
    _write_tree(tmp_path, {**_TREE, "ov/kustomization.yaml": overlay})
    objs = {o["kind"]: o for o in render.build(tmp_path / "ov")}
    assert set(objs) == {"ConfigMap", "Service"}
    cm, svc = objs["ConfigMap"], objs["Service"]
    # The component patches what the overlay's resources brought and adds its own objects;
    # the overlay's labels then reach both.
    assert cm["data"] == {"X": "2"}
    assert cm["metadata"]["labels"] == svc["metadata"]["labels"] == {"p": "q"}


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        pytest.param(
            "resources: [../comp]\n", "expected kind != 'Component'", id="component-as-resource"
        ),
        pytest.param(
            "resources: [../base]\ncomponents: [../base]\n",
            "expected kind 'Component'",
            id="kustomization-as-component",
        ),
        pytest.param("components: [../base/cm.yaml]\n", "file is not directory", id="file"),
        pytest.param("resources: [../base, ../again]\n", "already registered id", id="duplicate"),
        pytest.param("resources: [missing.yaml]\n", "no such file", id="missing-file"),
    ],
)
def test_a_broken_kustomization_fails_with_kubectls_message(
    tmp_path: Path, render: Kustomize, overlay: str, message: str
) -> None:
    _write_tree(tmp_path, {**_TREE, "ov/kustomization.yaml": overlay})
    with pytest.raises(RenderError, match=message):
        render.build(tmp_path / "ov")


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_objects_are_well_formed(overlay: str, render: Kustomize) -> None:
    objs = render(overlay)
    ids = [resource_id(o) for o in objs]
    assert len(ids) == len(set(ids))
    for obj in objs:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        meta = obj.get("metadata", {})
        assert meta.get("name"), obj
        label = f"{obj['kind']}/{meta['name']}"
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in meta, f"{label} is cluster-scoped"
        else:
            assert meta.get("namespace") == "hetero-gateway", f"{label} has no namespace"
        assert meta.get("labels", {}).get(PART_OF[0]) == PART_OF[1], label


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_gateway_objects_validate_against_crd_schemas(
    overlay: str, render: Kustomize, crds: Crds
) -> None:
    checked = [o for o in render(overlay) if group_of(o) in GATEWAY_GROUPS]
    expected = {
        "GatewayClass",
        "Gateway",
        "HTTPRoute",
        "EnvoyExtensionPolicy",
        "ClientTrafficPolicy",
        "BackendTrafficPolicy",
    } | ({"EnvoyPatchPolicy"} if overlay != "override-host" else set())
    assert {o["kind"] for o in checked} == expected
    problems = {f"{o['kind']}/{o['metadata']['name']}": schema_errors(crds, o) for o in checked}
    assert problems == {key: [] for key in problems}, problems


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value

    return mutate


@pytest.mark.parametrize(
    ("kind", "mutate", "expect"),
    [
        pytest.param(
            "EnvoyExtensionPolicy",
            _set("spec.extProc.0.messageTimout", "60s"),
            "messageTimout",
            id="misspelt-field",
        ),
        pytest.param(
            "EnvoyExtensionPolicy",
            _set("spec.extProc.0.processingMode.request.body", "Buffer"),
            "Buffer",
            id="bad-enum",
        ),
        pytest.param(
            "EnvoyExtensionPolicy",
            _set("spec.extProc.0.messageTimeout", "1 minute"),
            "does not match",
            id="bad-duration",
        ),
        pytest.param(
            "ClientTrafficPolicy", _set("spec.connection.bufferLimit", "4MB"), "4MB", id="quantity"
        ),
        pytest.param("HTTPRoute", _set("spec.rules.0.matches.0.method", "post"), "post", id="verb"),
        pytest.param(
            "EnvoyPatchPolicy", _set("spec.type", "MergePatch"), "MergePatch", id="patch-type"
        ),
    ],
)
def test_schema_check_catches_mistakes(
    kind: str, mutate: Callable[[Obj], None], expect: str, render: Kustomize, crds: Crds
) -> None:
    obj = find(render("original-dst"), kind)[0]
    assert schema_errors(crds, obj) == []
    mutate(obj)
    errors = schema_errors(crds, obj)
    assert any(expect in e for e in errors), errors


# CEL rules (x-kubernetes-validations) the API server would enforce on the fields we use, by their
# message in the CRD; the test fails if a message disappears from the CRDs, so the mirror stays
# honest.
def _target_refs_ok(spec: Obj, kinds: set[str]) -> bool:
    refs = spec.get("targetRefs")
    return (
        ("targetRef" in spec) != (refs is not None)
        and all(r["group"] == "gateway.networking.k8s.io" for r in refs or [])
        and all(r["kind"] in kinds for r in refs or [])
    )


_ROUTE_OR_GATEWAY = {
    "Gateway",
    "ListenerSet",
    "HTTPRoute",
    "GRPCRoute",
    "TCPRoute",
    "UDPRoute",
    "TLSRoute",
}
_CEL_RULES: list[tuple[str, str, Callable[[Obj], bool]]] = [
    (
        "EnvoyExtensionPolicy",
        "either targetRef or targetRefs must be used",
        lambda s: _target_refs_ok(s, _ROUTE_OR_GATEWAY),
    ),
    (
        "EnvoyExtensionPolicy",
        "BackendRefs must be used, backendRef is not supported.",
        lambda s: all("backendRef" not in e and e.get("backendRefs") for e in s["extProc"]),
    ),
    (
        "EnvoyExtensionPolicy",
        "Must have port for Service reference",
        lambda s: all(
            "port" in ref
            for e in s["extProc"]
            for ref in e["backendRefs"]
            if ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
        ),
    ),
    (
        "EnvoyExtensionPolicy",
        "If shadowMode is enabled, body processing mode must be Streamed or unset.",
        lambda s: all(
            not e.get("shadowMode")
            or all(
                e.get("processingMode", {}).get(d, {}).get("body", "Streamed") == "Streamed"
                for d in ("request", "response")
            )
            for e in s["extProc"]
        ),
    ),
    (
        "EnvoyExtensionPolicy",
        "If FullDuplexStreamed body processing mode is used, FailOpen must be false.",
        lambda s: all(
            not e.get("failOpen")
            or all(
                e.get("processingMode", {}).get(d, {}).get("body") != "FullDuplexStreamed"
                for d in ("request", "response")
            )
            for e in s["extProc"]
        ),
    ),
    (
        "EnvoyExtensionPolicy",
        "writableNamespaces cannot contain well-known Envoy HTTP filter namespaces",
        lambda s: all(
            not ns.startswith("envoy.filters.http")
            for e in s["extProc"]
            for ns in e.get("metadata", {}).get("writableNamespaces", [])
        ),
    ),
    (
        "ClientTrafficPolicy",
        "either targetRef or targetRefs must be used",
        lambda s: _target_refs_ok(s, {"Gateway", "ListenerSet"}),
    ),
    (
        "BackendTrafficPolicy",
        "either targetRef or targetRefs must be used",
        lambda s: _target_refs_ok(s, _ROUTE_OR_GATEWAY),
    ),
    (
        "BackendTrafficPolicy",
        "If LoadBalancer type is consistentHash, consistentHash field needs to be set.",
        lambda s: (
            "loadBalancer" not in s
            or (s["loadBalancer"]["type"] == "ConsistentHash")
            == ("consistentHash" in s["loadBalancer"])
        ),
    ),
    (
        "BackendTrafficPolicy",
        "EndpointOverride is not supported for DynamicModule load balancers.",
        lambda s: (
            "loadBalancer" not in s
            or s["loadBalancer"]["type"] != "DynamicModule"
            or "endpointOverride" not in s["loadBalancer"]
        ),
    ),
    (
        "HTTPRoute",
        "value must be an absolute path and start with '/' when type one of "
        "['Exact', 'PathPrefix']",
        lambda s: all(
            m["path"]["value"].startswith("/")
            for r in s["rules"]
            for m in r.get("matches", [])
            if "path" in m
        ),
    ),
]


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
@pytest.mark.parametrize(
    ("kind", "message", "rule"), _CEL_RULES, ids=[f"{k}:{m[:40]}" for k, m, _ in _CEL_RULES]
)
def test_cel_rules_hold(
    overlay: str,
    kind: str,
    message: str,
    rule: Callable[[Obj], bool],
    render: Kustomize,
    crds: Crds,
) -> None:
    assert message in cel_messages(crds, kind), f"the {kind} CRD no longer has this rule: {message}"
    objs = find(render(overlay), kind)
    assert objs
    for obj in objs:
        assert rule(obj["spec"]), f"{kind}/{obj['metadata']['name']}: {message}"


# --- cross-references and agreement with the plugin ----------------------------------------------


def _service_port(service: Obj, port: int) -> Obj:
    entries: list[Obj] = [p for p in service["spec"]["ports"] if p["port"] == port]
    [entry] = entries
    return entry


def _container_port(container: Obj, name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def _plugin_container(objs: list[Obj]) -> Obj:
    dep = one(objs, "Deployment", "hetero-gateway")
    containers: list[Obj] = dep["spec"]["template"]["spec"]["containers"]
    [container] = containers
    return container


def _selects(service: Obj, pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())


def _binding_of(objs: list[Obj], account: Obj) -> Obj:
    """The one (Cluster)RoleBinding that names this ServiceAccount."""
    subject = {
        "kind": "ServiceAccount",
        **{k: account["metadata"][k] for k in ("name", "namespace")},
    }
    bindings = [
        b
        for b in find(objs, "ClusterRoleBinding") + find(objs, "RoleBinding")
        if subject in b.get("subjects", [])
    ]
    assert len(bindings) == 1, [b["metadata"]["name"] for b in bindings]
    return bindings[0]


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_extension_policy_wires_the_plugin(overlay: str, render: Kustomize) -> None:
    objs = render(overlay)
    eep = one(objs, "EnvoyExtensionPolicy")
    route = one(objs, "HTTPRoute")
    assert eep["spec"]["targetRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "HTTPRoute",
            "name": route["metadata"]["name"],
        }
    ]
    routing, counting = eep["spec"]["extProc"]

    # Both filters reach the plugin's gRPC port through its Service.
    dep = one(objs, "Deployment", "hetero-gateway")
    grpc_port = _container_port(_plugin_container(objs), "grpc")
    assert grpc_port == Settings().grpc_port
    for ext in (routing, counting):
        [ref] = ext["backendRefs"]
        service = one(objs, "Service", ref["name"])
        assert service["metadata"]["namespace"] == eep["metadata"]["namespace"]
        assert _service_port(service, ref["port"])["targetPort"] in ("grpc", grpc_port)
        assert _selects(service, dep["spec"]["template"]["metadata"]["labels"])
        assert ext["backendSettings"] == routing["backendSettings"]

    # Routing: the modes, timeout, status and metadata of the standalone bootstrap.
    standalone = EnvoyOptions()
    assert routing["processingMode"] == {
        "request": {"body": "Buffered"},
        "response": {},
        "allowModeOverride": False,
    }
    # Envoy Gateway cannot raise one message's timeout for a held request (no maxMessageTimeout),
    # so its message timeout is the standalone config's longest wait for a reply.
    assert duration_s(routing["messageTimeout"]) == standalone.max_message_timeout_s
    assert routing["statusOnError"] == 503
    assert routing["metadata"]["writableNamespaces"] == [
        LB_METADATA_NAMESPACE,
        REPLY_METADATA_NAMESPACE,
    ]
    assert "shadowMode" not in routing
    # Fail-open only where a request without a pick still has somewhere to go.
    assert routing["failOpen"] is (overlay == "override-host")

    # Counting: after routing (sees target-pod), never waited on, best effort.
    assert counting["shadowMode"] is True
    assert counting["processingMode"] == {"request": {}, "response": {"body": "Streamed"}}
    assert counting["failOpen"] is True

    # Long-lived streams must not be capped by Envoy's default circuit breakers (1024).
    breaker = routing["backendSettings"]["circuitBreaker"]
    assert min(breaker.values()) >= 100_000


def test_variants_differ_only_where_they_must(render: Kustomize) -> None:
    fail_closed, fail_open = (render(o) for o in OVERLAYS)
    eep_closed = one(fail_closed, "EnvoyExtensionPolicy")
    eep_open = one(fail_open, "EnvoyExtensionPolicy")
    eep_open["spec"]["extProc"][0]["failOpen"] = False
    assert eep_open == eep_closed
    btp_open = one(fail_open, "BackendTrafficPolicy")
    btp_open["spec"].pop("loadBalancer")
    assert btp_open == one(fail_closed, "BackendTrafficPolicy")
    # The envoy-protections component raises the listener's header limit, and the plugin's.
    env_closed = next(o for o in fail_closed if o["metadata"]["name"] == "hetero-gateway-env")
    env_open = next(o for o in fail_open if o["metadata"]["name"] == "hetero-gateway-env")
    assert env_closed["data"].pop(MAX_REQUEST_HEADERS.name) == str(MAX_REQUEST_HEADERS.default)
    assert env_open["data"].pop(MAX_REQUEST_HEADERS.name) == "100"
    rest = {
        resource_id(o): o
        for o in fail_closed
        if o["kind"] not in ("EnvoyPatchPolicy", "EnvoyExtensionPolicy", "BackendTrafficPolicy")
    }
    assert rest == {
        resource_id(o): o
        for o in fail_open
        if o["kind"] not in ("EnvoyExtensionPolicy", "BackendTrafficPolicy")
    }


def test_route_rule_zero_holds_exactly_the_paths_the_plugin_routes(render: Kustomize) -> None:
    route = one(render("original-dst"), "HTTPRoute")
    llm_rule, rest = route["spec"]["rules"]
    assert {(m["method"], m["path"]["type"], m["path"]["value"]) for m in llm_rule["matches"]} == {
        ("POST", "Exact", path) for path in LLM_PATHS
    }
    # The whole streamed answer must fit: no route deadline (the idle timeout ends dead streams).
    assert duration_s(llm_rule["timeouts"]["request"]) == 0
    # The only other path is the model list, which the plugin answers: an engine's own endpoints
    # are not reachable through the gateway.
    assert rest["matches"] == [{"method": "GET", "path": {"type": "Exact", "value": MODELS_PATH}}]
    assert llm_rule["backendRefs"] == rest["backendRefs"]


_JSONPATH = re.compile(r"\.\.routes\[\?match\(@\.name, '(?P<regex>[^']+)'\)\]")


def test_patch_policy_names_match_the_rendered_resources(render: Kustomize) -> None:
    objs = render("original-dst")
    epp = one(objs, "EnvoyPatchPolicy", ORIGINAL_DST_POLICY)
    gateway = one(objs, "Gateway")
    route = one(objs, "HTTPRoute")
    ns = gateway["metadata"]["namespace"]

    # Envoy Gateway applies a patch policy only in its target Gateway's namespace.
    assert epp["spec"]["targetRef"] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": gateway["metadata"]["name"],
    }
    assert epp["metadata"]["namespace"] == ns
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]

    cluster_patch, route_patch = epp["spec"]["jsonPatches"]
    assert cluster_patch["type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    assert cluster_patch["operation"]["op"] == "add" and cluster_patch["operation"]["path"] == ""
    added = cluster_patch["operation"]["value"]["name"]
    assert cluster_patch["name"] == added

    # Route configuration name: <gateway namespace>/<gateway>/<listener>, for a real listener.
    assert route_patch["type"] == "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
    listeners = {
        f"{ns}/{gateway['metadata']['name']}/{listener['name']}"
        for listener in gateway["spec"]["listeners"]
    }
    section = route["spec"]["parentRefs"][0]["sectionName"]
    assert route_patch["name"] in listeners
    assert route_patch["name"].endswith(f"/{section}")

    # The JSONPath selects exactly the Envoy routes generated from the HTTPRoute's rule 0
    # (httproute/<ns>/<route>/rule/<i>/match/<j>/<hostname>) and points them at the new cluster.
    op = route_patch["operation"]
    assert op["op"] == "replace" and op["path"] == "/route/cluster" and op["value"] == added
    m = _JSONPATH.fullmatch(op["jsonPath"])
    assert m, op["jsonPath"]
    regex = re.compile(m.group("regex"))
    prefix = f"httproute/{route['metadata']['namespace']}/{route['metadata']['name']}"
    for rule_index, rule in enumerate(route["spec"]["rules"]):
        for match_index in range(len(rule["matches"])):
            for host in ("*", "llm_example_com"):
                name = f"{prefix}/rule/{rule_index}/match/{match_index}/{host}"
                assert bool(regex.fullmatch(name)) is (rule_index == 0), name


def test_patch_policy_cluster_is_the_standalone_original_dst_cluster(render: Kustomize) -> None:
    epp = one(render("original-dst"), "EnvoyPatchPolicy", ORIGINAL_DST_POLICY)
    cluster = epp["spec"]["jsonPatches"][0]["operation"]["value"]
    [standalone] = [
        c
        for c in render_bootstrap(EnvoyOptions())["static_resources"]["clusters"]
        if c["name"] == ORIGINAL_DST_CLUSTER
    ]
    # The same cluster `hetero-gateway envoy-config` renders (and Envoy accepts in
    # test_envoy_config): ORIGINAL_DST on `target-pod`, its buffer and circuit breakers.
    assert cluster == standalone
    assert cluster["original_dst_lb_config"]["http_header_name"] == TARGET_POD_HEADER


def check_openai_errors(objs: list[Obj]) -> None:
    """The listener patch adds exactly the standalone bootstrap's local-reply mappers to the
    Gateway's own listener, where Envoy Gateway documents its HTTP connection manager."""
    epp = one(objs, "EnvoyPatchPolicy", OPENAI_ERRORS_POLICY)
    gateway = one(objs, "Gateway")
    ns, name = gateway["metadata"]["namespace"], gateway["metadata"]["name"]
    assert epp["metadata"]["namespace"] == ns
    assert epp["spec"]["targetRef"] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": name,
    }
    [patch] = epp["spec"]["jsonPatches"]
    assert patch["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener"
    assert patch["name"] in {
        f"{ns}/{name}/{listener['name']}" for listener in gateway["spec"]["listeners"]
    }
    op = patch["operation"]
    assert (op["op"], op["path"]) == (
        "add",
        "/default_filter_chain/filters/0/typed_config/local_reply_config",
    )
    hcm = bootstrap_hcm(render_bootstrap(EnvoyOptions()))
    # The mappers Envoy accepts in test_envoy_config and the data-plane tests exercise.
    assert op["value"] == hcm["local_reply_config"]
    # They spare the plugin's own replies only if the routing filter may write their marker.
    routing = one(objs, "EnvoyExtensionPolicy")["spec"]["extProc"][0]
    assert REPLY_METADATA_NAMESPACE in routing["metadata"]["writableNamespaces"]
    spared = [
        f["metadata_filter"]["matcher"]["filter"]
        for m in op["value"]["mappers"]
        for f in m["filter"]["and_filter"]["filters"]
        if "metadata_filter" in f
    ]
    assert spared == [REPLY_METADATA_NAMESPACE] * len(op["value"]["mappers"])


def test_original_dst_maps_envoys_own_errors_to_openai_shape(render: Kustomize) -> None:
    check_openai_errors(render("original-dst"))


def test_openai_errors_component_also_fits_override_host(tmp_path: Path, render: Kustomize) -> None:
    """Opt-in for override-host (it needs EnvoyPatchPolicy enabled, which that variant otherwise
    does not); the variant stays fail-open and gets no other patch."""
    objs = override_host_with(tmp_path, render, OPENAI_ERRORS_COMPONENT)
    check_openai_errors(objs)
    assert [o["metadata"]["name"] for o in find(objs, "EnvoyPatchPolicy")] == [OPENAI_ERRORS_POLICY]
    assert one(objs, "EnvoyExtensionPolicy")["spec"]["extProc"][0]["failOpen"] is True


def test_override_host_follows_the_pick_and_falls_back_to_round_robin(render: Kustomize) -> None:
    objs = render("override-host")
    assert find(objs, "EnvoyPatchPolicy") == []
    route = one(objs, "HTTPRoute")
    btp = one(objs, "BackendTrafficPolicy")
    assert btp["spec"]["targetRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "HTTPRoute",
            "name": route["metadata"]["name"],
        }
    ]
    assert btp["spec"]["loadBalancer"] == {
        "type": "RoundRobin",
        "endpointOverride": {"extractFrom": [{"header": DESTINATION_HEADER}]},
    }
    # The pick (pod IP:model.aibrix.ai/port) must be an endpoint of the route's cluster, whose
    # endpoints are the Service's pods at its targetPort.
    for ref in {(b["name"], b["port"]) for r in route["spec"]["rules"] for b in r["backendRefs"]}:
        service = one(objs, "Service", ref[0])
        target = _service_port(service, ref[1])["targetPort"]
        pods = [
            d["spec"]["template"]["metadata"]["labels"]
            for d in find(objs, "Deployment")
            if _selects(service, d["spec"]["template"]["metadata"]["labels"])
        ]
        assert pods
        assert {int(labels["model.aibrix.ai/port"]) for labels in pods} == {target}


def test_fail_closed_variant_has_no_endpoint_override(render: Kustomize) -> None:
    btp = one(render("original-dst"), "BackendTrafficPolicy")
    assert "loadBalancer" not in btp["spec"]


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_buffer_limits_equal_the_plugin_message_limit(overlay: str, render: Kustomize) -> None:
    objs = render(overlay)
    limit = DEFAULT_MAX_MESSAGE_BYTES
    assert EnvoyOptions().max_request_bytes == limit
    env = one(objs, "ConfigMap", "hetero-gateway-env")["data"]
    assert int(env["AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES"]) == limit
    # Listener (413 above it for a BUFFERED body) and upstream buffers.
    assert (
        quantity_bytes(one(objs, "ClientTrafficPolicy")["spec"]["connection"]["bufferLimit"])
        == limit
    )
    assert (
        quantity_bytes(one(objs, "BackendTrafficPolicy")["spec"]["connection"]["bufferLimit"])
        == limit
    )
    # A full body fits one HTTP/2 stream window toward the plugin, with room for framing.
    http2 = one(objs, "EnvoyExtensionPolicy")["spec"]["extProc"][0]["backendSettings"]["http2"]
    assert quantity_bytes(http2["initialStreamWindowSize"]) >= 2 * limit
    assert quantity_bytes(http2["initialConnectionWindowSize"]) >= quantity_bytes(
        http2["initialStreamWindowSize"]
    )
    for epp in find(objs, "EnvoyPatchPolicy"):
        if epp["metadata"]["name"] == ORIGINAL_DST_POLICY:  # the cluster it adds
            value = epp["spec"]["jsonPatches"][0]["operation"]["value"]
            assert value["per_connection_buffer_limit_bytes"] == limit


def test_stream_idle_timeout_matches_the_standalone_bootstrap(render: Kustomize) -> None:
    ctp = one(render("original-dst"), "ClientTrafficPolicy")
    listener = render_bootstrap(EnvoyOptions())["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert duration_s(ctp["spec"]["timeout"]["http"]["streamIdleTimeout"]) == duration_s(
        hcm["stream_idle_timeout"]
    )


def check_plugin_probes_and_resources(container: Obj) -> None:
    """Readiness from the plugin's gRPC health service, liveness from /healthz, requests set."""
    defaults = Settings()
    # Kubernetes' native gRPC probe (1.27+) asks grpc.health.v1 on the ext_proc port: SERVING
    # only once discovery has loaded, NOT_SERVING while draining. The port must be a number and
    # the one the plugin listens on (plugin.config's default, which the ConfigMap keeps).
    readiness = container["readinessProbe"]
    probe_kinds = {"grpc", "httpGet", "tcpSocket", "exec"}
    assert set(readiness) & probe_kinds == {"grpc"}, readiness
    assert readiness["grpc"].get("service", "") == "", "the plugin reports health on service ''"
    assert readiness["grpc"]["port"] == defaults.grpc_port
    assert _container_port(container, "grpc") == defaults.grpc_port
    liveness = container["livenessProbe"]
    assert set(liveness) & probe_kinds == {"httpGet"}, liveness
    assert liveness["httpGet"] == {"path": "/healthz", "port": "http"}
    assert _container_port(container, "http") == defaults.http_port
    requests = container.get("resources", {}).get("requests", {})
    assert requests.get("cpu") and requests.get("memory"), container.get("resources")


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(_set("readinessProbe.grpc.port", 50051), id="wrong-port"),
        pytest.param(_set("readinessProbe.grpc.port", "grpc"), id="named-port"),
        pytest.param(
            _set("readinessProbe", {"httpGet": {"path": "/readyz", "port": "http"}}),
            id="http-readiness",
        ),
        pytest.param(_set("readinessProbe.grpc.service", "x"), id="unknown-service"),
        pytest.param(_set("livenessProbe", {"grpc": {"port": 50052}}), id="grpc-liveness"),
        pytest.param(_set("resources", {"limits": {"memory": "1Gi"}}), id="no-requests"),
    ],
)
def test_probe_check_catches_mistakes(mutate: Callable[[Obj], None], render: Kustomize) -> None:
    container = _plugin_container(render("original-dst"))
    check_plugin_probes_and_resources(container)
    mutate(container)
    with pytest.raises(AssertionError):
        check_plugin_probes_and_resources(container)


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_plugin_deployment_matches_plugin_defaults(overlay: str, render: Kustomize) -> None:
    objs = render(overlay)
    defaults = Settings()
    dep = one(objs, "Deployment", "hetero-gateway")
    pod = dep["spec"]["template"]["spec"]
    container = _plugin_container(objs)
    assert _container_port(container, "grpc") == defaults.grpc_port
    assert _container_port(container, "http") == defaults.http_port
    assert container["image"].startswith("hetero-gateway:")
    check_plugin_probes_and_resources(container)
    service = one(objs, "Service", "hetero-gateway")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "grpc": (defaults.grpc_port, "grpc"),
        "http": (defaults.http_port, "http"),
    }

    # Settings: every variable is one the plugin documents (or one designed for discovery/Redis),
    # and the values are its defaults, so load_settings accepts them and changes nothing.
    [source] = container["envFrom"]
    env = one(objs, "ConfigMap", source["configMapRef"]["name"])["data"]
    known = {v.name for v in ENV_VARS} | DESIGNED_VARS
    assert set(env) <= known, sorted(set(env) - known)
    # (The designed variables are held fixed: once plugin.config reads them, they may differ from
    # its defaults on purpose, e.g. discovery from Kubernetes rather than a file.)
    assert load_settings(env) == load_settings({k: v for k, v in env.items() if k in DESIGNED_VARS})
    assert int(env["HETERO_GATEWAY_GRPC_PORT"]) == defaults.grpc_port
    assert env["HETERO_GATEWAY_DISCOVERY"] == "kubernetes"
    # A rolling update must not cut answers in flight: the preStop pause plus the plugin's
    # drain must end before Kubernetes kills the pod.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_s = load_settings(env).drain_s
    assert drain_s > 0
    assert float(pre_stop[1]) + drain_s < pod["terminationGracePeriodSeconds"]
    direct = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert direct["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert direct["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert direct["REDIS_PASSWORD"]["secretKeyRef"]["optional"] is True
    assert set(direct) <= known

    # Identity and RBAC: the pod's service account may get/list/watch pods.
    sa = one(objs, "ServiceAccount", pod["serviceAccountName"])
    binding = _binding_of(objs, sa)
    role = one(objs, "ClusterRole", binding["roleRef"]["name"])
    assert any(
        r["apiGroups"] == [""]
        and "pods" in r["resources"]
        and {"get", "list", "watch"} <= set(r["verbs"])
        for r in role["rules"]
    )

    # Non-root, as the image's USER.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _dockerfile_uid()
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_sample_model_spans_two_gpu_types_behind_one_service(render: Kustomize) -> None:
    objs = render("original-dst")
    service = one(objs, "Service", "llama-3-8b")
    model = service["spec"]["selector"]["model.aibrix.ai/name"]
    engines = [
        d
        for d in find(objs, "Deployment")
        if _selects(service, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(engines) == 2
    products = {
        d["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for d in engines
    }
    assert len(products) == 2
    for dep in engines:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["model.aibrix.ai/name"] == model
        assert labels["model.aibrix.ai/engine"] == "vllm"
        [container] = dep["spec"]["template"]["spec"]["containers"]
        # The body's "model" is the label: vLLM must serve under that name, on the labelled port.
        assert f"--served-model-name={model}" in container["args"]
        assert f"--port={labels['model.aibrix.ai/port']}" in container["args"]
        assert _container_port(container, "http") == int(labels["model.aibrix.ai/port"])
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


# --- shared state: Redis for several plugin replicas --------------------------------------------

REDIS = "hetero-gateway-redis"


def _pod_labels(dep: Obj) -> dict[str, str]:
    labels: dict[str, str] = dep["spec"]["template"]["metadata"]["labels"]
    return labels


def _redis_args(container: Obj) -> dict[str, str]:
    """`redis-server`'s options (`--name value`) from the container's `sh -c` command."""
    shell, flag, script = container["command"]
    assert (shell, flag) == ("sh", "-c")
    words = shlex.split(script)
    assert words[:2] == ["exec", "redis-server"], words
    options = words[2:]
    args = {}
    while options and options[0].startswith("--"):
        args[options[0]] = options[1]
        options = options[2:]
    # What is left passes the password only when the Secret holds one.
    assert options == ["${REDIS_PASSWORD:+--requirepass", "$REDIS_PASSWORD}"], options
    return args


def _service_links(service: Obj) -> set[str]:
    """The variables Kubernetes puts in every pod of the namespace for `service`."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    names = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
    for port in service["spec"]["ports"]:
        if "name" in port:
            names.add(f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}")
        base = f"{prefix}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
        names |= {base, f"{base}_PROTO", f"{base}_PORT", f"{base}_ADDR"}
    return names


def check_shared_state(objs: list[Obj]) -> None:
    """Redis in the namespace, the plugin pointed at it, several plugin replicas."""
    plugin = one(objs, "Deployment", "hetero-gateway")
    assert plugin["spec"]["replicas"] >= 2
    redis_dep = one(objs, "Deployment", REDIS)
    # The Redis pods are in exactly one Service; it selects nothing else.
    services = [s for s in find(objs, "Service") if _selects(s, _pod_labels(redis_dep))]
    assert len(services) == 1, [s["metadata"]["name"] for s in services]
    service = services[0]
    deployments = find(objs, "Deployment")
    assert [d["metadata"]["name"] for d in deployments if _selects(service, _pod_labels(d))] == [
        REDIS
    ]
    assert redis_dep["spec"]["selector"]["matchLabels"].items() <= _pod_labels(redis_dep).items()
    ns = service["metadata"]["namespace"]
    assert redis_dep["metadata"]["namespace"] == plugin["metadata"]["namespace"] == ns

    # The plugin resolves REDIS_HOST in-cluster: `<service>.<namespace>.svc`, on the Service port.
    container = _plugin_container(objs)
    [source] = container["envFrom"]
    env = one(objs, "ConfigMap", source["configMapRef"]["name"])["data"]
    settings = load_settings({**env, "POD_NAME": "p-0", "POD_NAMESPACE": ns})
    assert settings.redis is not None
    assert settings.redis.host == f"{service['metadata']['name']}.{ns}.svc"
    assert settings.redis.gateway_id == f"{ns}/p-0"
    [port] = service["spec"]["ports"]
    assert settings.redis.port == port["port"]

    # Redis listens where the Service sends, answers its probes there and persists nothing.
    pod = redis_dep["spec"]["template"]["spec"]
    [redis] = pod["containers"]
    assert redis["image"] == "redis:7-alpine"
    target = port["targetPort"]
    listen = _container_port(redis, target) if isinstance(target, str) else target
    args = _redis_args(redis)
    assert int(args["--port"]) == listen == settings.redis.port
    assert args.get("--save") == "" and args.get("--appendonly") == "no", args
    probe = redis["readinessProbe"]
    if "exec" in probe:
        assert probe["exec"]["command"] == [
            "sh",
            "-c",
            f"redis-cli -p {listen} ping | grep -qx PONG",
        ]
    else:
        assert probe["tcpSocket"]["port"] in (listen, target)
    # One instance, never two at once (the replicas would split between them).
    assert redis_dep["spec"]["replicas"] == 1
    assert redis_dep["spec"]["strategy"] == {"type": "Recreate"}

    # Non-root, small, and the password from the Secret the plugin reads.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert redis["securityContext"]["allowPrivilegeEscalation"] is False
    requests = redis["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory")
    plugin_secret = {e["name"]: e for e in container["env"]}["REDIS_PASSWORD"]["valueFrom"]
    redis_env = {e["name"]: e["valueFrom"] for e in redis["env"]}
    assert redis_env["REDIS_PASSWORD"] == plugin_secret
    assert redis_env["REDISCLI_AUTH"] == plugin_secret
    assert plugin_secret["secretKeyRef"]["optional"] is True

    # Only the plugin's pods may connect, on the Redis port.
    policy = one(objs, "NetworkPolicy", REDIS)
    assert (
        policy["spec"]["podSelector"]["matchLabels"] == redis_dep["spec"]["selector"]["matchLabels"]
    )
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= _pod_labels(plugin).items()
    assert rule["ports"] == [{"protocol": "TCP", "port": target}]

    # No Service's link variables (`<NAME>_PORT=tcp://...`) shadow one the plugin (or the
    # optimizer beside it) reads.
    known = {v.name for v in ENV_VARS} | DESIGNED_VARS
    for svc in find(objs, "Service"):
        assert not _service_links(svc) & known, svc["metadata"]["name"]


def test_shared_state_overlay_runs_replicas_against_one_redis(render: Kustomize) -> None:
    check_shared_state(render(SHARED_STATE))


def test_shared_state_overlay_changes_only_redis_optimizer_and_lock_things(
    render: Kustomize,
) -> None:
    shared = {resource_id(o): o for o in render(SHARED_STATE)}
    plain = {resource_id(o): o for o in render("original-dst")}
    added = {(kind, name) for _, kind, _, name in set(shared) - set(plain)}
    assert added == {
        ("Deployment", REDIS),
        ("Service", REDIS),
        ("NetworkPolicy", REDIS),
        *OPTIMIZER_OBJECTS,
    }
    assert set(plain) <= set(shared)
    config = next(rid for rid in plain if rid[1] == "ConfigMap")
    plugin = next(rid for rid in plain if rid[1:4:2] == ("Deployment", "hetero-gateway"))
    assert plain[config]["data"]["REDIS_HOST"] == ""  # the plain variants keep state local
    # ...and trace nothing: the flag without Redis stops the plugin at start-up.
    assert TRACING_FLAG not in plain[config]["data"]
    for rid, obj in plain.items():
        other = copy.deepcopy(shared[rid])
        if rid == config:
            other["data"]["REDIS_HOST"] = ""
            del other["data"][TRACING_FLAG]
            # A shared gateway: clients steer nothing (deploy/components/locked-routing).
            locked = load_settings(other["data"]).client_headers
            assert sorted(locked.rules) == sorted(CLIENT_ROUTING_HEADERS)
            assert all(rule.values == frozenset() for rule in locked.rules.values())
            del other["data"]["HETERO_GATEWAY_CLIENT_HEADERS"]
            del other["data"]["HETERO_GATEWAY_DENIED_HEADER_ACTION"]
        if rid == plugin:
            other["spec"]["replicas"] = obj["spec"]["replicas"]
        assert other == obj, rid


def _edit(
    kind: str, name: str, path: str, change: Callable[[Any], Any]
) -> Callable[[list[Obj]], None]:
    """Replace the value at `path` (dots, list indexes as numbers) of one object with change(it)."""

    def mutate(objs: list[Obj]) -> None:
        *parents, last = path.split(".")
        node: Any = one(objs, kind, name)
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last
        node[key] = change(node[key])

    return mutate


def _both(*changes: Callable[[list[Obj]], None]) -> Callable[[list[Obj]], None]:
    def mutate(objs: list[Obj]) -> None:
        for change in changes:
            change(objs)

    return mutate


_REDIS_SCRIPT = "spec.template.spec.containers.0.command.2"


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(
            _edit("ConfigMap", "hetero-gateway-env", "data.REDIS_HOST", lambda _: "redis"),
            id="short-host",
        ),
        pytest.param(
            _edit("ConfigMap", "hetero-gateway-env", "data.REDIS_HOST", lambda _: ""),
            id="no-host",
        ),
        pytest.param(
            _edit("ConfigMap", "hetero-gateway-env", "data.REDIS_PORT", lambda _: "6380"),
            id="wrong-port",
        ),
        pytest.param(
            _edit("Deployment", "hetero-gateway", "spec.replicas", lambda _: 1), id="one-replica"
        ),
        pytest.param(
            _edit(
                "Service",
                REDIS,
                "spec.selector",
                lambda _: {"app.kubernetes.io/name": "hetero-gateway"},
            ),
            id="service-selects-plugin",
        ),
        pytest.param(
            _edit("Deployment", REDIS, _REDIS_SCRIPT, lambda s: s.replace('--save "" ', "")),
            id="snapshots",
        ),
        pytest.param(
            _edit(
                "Deployment",
                REDIS,
                _REDIS_SCRIPT,
                lambda s: s.replace("--port 6379", "--port 6380"),
            ),
            id="listens-elsewhere",
        ),
        pytest.param(
            _edit("Deployment", REDIS, "spec.template.spec.securityContext.runAsUser", lambda _: 0),
            id="root",
        ),
        pytest.param(
            _edit(
                "NetworkPolicy",
                REDIS,
                "spec.ingress.0.from.0.podSelector.matchLabels",
                lambda _: {"a": "b"},
            ),
            id="policy-blocks-plugin",
        ),
        pytest.param(
            _both(
                _edit("Service", REDIS, "metadata.name", lambda _: "redis"),
                _edit(
                    "ConfigMap",
                    "hetero-gateway-env",
                    "data.REDIS_HOST",
                    lambda _: "redis.hetero-gateway.svc",
                ),
            ),
            id="service-named-redis",
        ),
    ],
)
def test_shared_state_check_catches_mistakes(
    mutate: Callable[[list[Obj]], None], render: Kustomize
) -> None:
    objs = render(SHARED_STATE)
    check_shared_state(objs)
    mutate(objs)
    # (The settings loader itself refuses some: tracing without a Redis host.)
    with pytest.raises((AssertionError, ConfigError)):
        check_shared_state(objs)


def override_host_with(tmp_path: Path, render: Kustomize, *components: Path) -> list[Obj]:
    """The override-host overlay with `components` added, rendered."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = [os.path.relpath(c, overlay) for c in components]
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(DEPLOY / 'overlays' / 'override-host', overlay)}]\n"
        f"components: [{', '.join(rel)}]\n"
    )
    return render.build(overlay)


def test_shared_state_component_also_fits_override_host(tmp_path: Path, render: Kustomize) -> None:
    """The component adds to either variant; here to override-host, which stays fail-open."""
    objs = override_host_with(tmp_path, render, SHARED_STATE_COMPONENT)
    check_shared_state(objs)
    assert one(objs, "EnvoyExtensionPolicy")["spec"]["extProc"][0]["failOpen"] is True
    assert find(objs, "EnvoyPatchPolicy") == []


# --- the GPU optimizer ---------------------------------------------------------------------------

_PROBE_KINDS = {"grpc", "httpGet", "tcpSocket", "exec"}


def _port_number(container: Obj, port: int | str) -> int:
    """A probe's or Service's target port: a number, or the name of one of the container's."""
    return _container_port(container, port) if isinstance(port, str) else port


def _env_value(objs: list[Obj], entry: Obj) -> str:
    """A container variable's value: literal, or a key of a ConfigMap in the rendered output."""
    if "value" in entry:
        return str(entry["value"])
    ref = entry["valueFrom"]["configMapKeyRef"]
    return str(one(objs, "ConfigMap", ref["name"])["data"][ref["key"]])


def _container_env(objs: list[Obj], container: Obj) -> dict[str, str]:
    """The container's environment from its ConfigMaps and literals (Secrets and the downward API
    left out)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry or "configMapKeyRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = _env_value(objs, entry)
    return env


def _optimizer_container(objs: list[Obj]) -> Obj:
    containers: list[Obj] = one(objs, "Deployment", OPTIMIZER)["spec"]["template"]["spec"][
        "containers"
    ]
    [container] = containers
    return container


def _grants(role: Obj) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every combination the role's rules allow."""
    out = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, URLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def _admits(policy: Obj, pod_labels: dict[str, str], target_labels: dict[str, str]) -> list[Obj]:
    """The ingress rules of `policy` that let pods with `pod_labels` reach `target_labels` pods."""
    if not policy["spec"]["podSelector"]["matchLabels"].items() <= target_labels.items():
        return []
    rules: list[Obj] = [
        rule
        for rule in policy["spec"].get("ingress", [])
        if any(
            "namespaceSelector" not in peer
            and peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
            for peer in rule["from"]
        )
    ]
    return rules


def check_optimizer(objs: list[Obj]) -> None:
    """The optimizer: its image and command, one port everywhere, Redis, RBAC, tracing on."""
    dep = one(objs, "Deployment", OPTIMIZER)
    ns = dep["metadata"]["namespace"]
    pod = dep["spec"]["template"]["spec"]
    container = _optimizer_container(objs)
    plugin = _plugin_container(objs)

    # The plugin's Dockerfile built with the optimizer extra, the same release, its sub-command.
    name, _, tag = container["image"].rpartition(":")
    assert name == OPTIMIZER_IMAGE, container["image"]
    assert tag == plugin["image"].rpartition(":")[2]
    assert container["command"] == ["hetero-gateway", "optimizer"]
    assert "args" not in container

    # Its settings, as its own loader reads them: every variable one plugin.config documents, the
    # ConfigMap's values its defaults but for the designed ones, discovery from Kubernetes.
    env = _container_env(objs, container)
    known = {v.name for v in ENV_VARS}
    assert set(env) <= known, sorted(set(env) - known)
    [source] = container["envFrom"]
    assert source["configMapRef"]["name"] == OPTIMIZER_ENV
    tunables = one(objs, "ConfigMap", OPTIMIZER_ENV)["data"]
    assert load_settings(tunables) == load_settings(
        {k: v for k, v in tunables.items() if k in OPTIMIZER_DESIGNED_VARS}
    )
    settings = load_settings({**env, "POD_NAME": "o-0", "POD_NAMESPACE": ns})
    assert settings.discovery == "kubernetes"

    # One port: the one it listens on, the container port, both probes, the Service.
    port = settings.optimizer.port
    assert port == OPTIMIZER_PORT.default
    assert _container_port(container, "http") == port
    for probe in (container["readinessProbe"], container["livenessProbe"]):
        assert set(probe) & _PROBE_KINDS == {"httpGet"}, probe
        assert probe["httpGet"]["path"] == "/healthz"
        assert _port_number(container, probe["httpGet"]["port"]) == port
    service = one(objs, "Service", OPTIMIZER)
    assert service["metadata"]["namespace"] == ns
    [service_port] = service["spec"]["ports"]
    assert service_port["port"] == port
    assert _port_number(container, service_port["targetPort"]) == port
    assert [
        d["metadata"]["name"] for d in find(objs, "Deployment") if _selects(service, _pod_labels(d))
    ] == [OPTIMIZER]
    assert dep["spec"]["selector"]["matchLabels"].items() <= _pod_labels(dep).items()
    # One process holds the scale-down hysteresis: never two answering at once.
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}

    # The gateway's Redis (`<service>.<namespace>.svc`, the Service port) and namespaces, with the
    # gateway's password, and a NetworkPolicy that lets it in.
    gateway_env = _container_env(objs, plugin)
    gateway = load_settings({**gateway_env, "POD_NAME": "p-0", "POD_NAMESPACE": ns})
    redis_service = one(objs, "Service", REDIS)
    [redis_port] = redis_service["spec"]["ports"]
    assert settings.redis is not None and gateway.redis is not None
    assert settings.redis.host == gateway.redis.host
    assert settings.redis.host == f"{REDIS}.{redis_service['metadata']['namespace']}.svc"
    assert settings.redis.port == gateway.redis.port == redis_port["port"]
    assert settings.k8s_namespaces == gateway.k8s_namespaces
    secrets = {e["name"]: e["valueFrom"] for e in container["env"] if "valueFrom" in e}
    plugin_secrets = {e["name"]: e["valueFrom"] for e in plugin["env"] if "valueFrom" in e}
    assert secrets["REDIS_PASSWORD"] == plugin_secrets["REDIS_PASSWORD"]
    redis_dep = one(objs, "Deployment", REDIS)
    admitted = [
        rule
        for policy in find(objs, "NetworkPolicy")
        for rule in _admits(policy, _pod_labels(dep), _pod_labels(redis_dep))
    ]
    assert admitted, "no NetworkPolicy lets the optimizer reach Redis"
    [redis_container] = redis_dep["spec"]["template"]["spec"]["containers"]
    assert any(
        _port_number(redis_container, p["port"])
        == _port_number(redis_container, redis_port["targetPort"])
        for rule in admitted
        for p in rule["ports"]
    )

    # Tracing on in the gateway (the optimizer's input; the loader refuses it without Redis).
    assert gateway_env[TRACING_FLAG] == "true"
    assert gateway.tracing is True

    # Its own account, which may read Deployments and nothing else.
    account = one(objs, "ServiceAccount", pod["serviceAccountName"])
    assert account["metadata"]["namespace"] == ns
    plugin_pod = one(objs, "Deployment", "hetero-gateway")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] != plugin_pod["serviceAccountName"]
    binding = _binding_of(objs, account)
    role = one(objs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert _grants(role) == {("apps", "deployments", v) for v in ("get", "list", "watch")}

    # Non-root as the image's USER, locked down like the plugin, bounded.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _dockerfile_uid()
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    resources = container["resources"]
    assert resources["requests"].get("cpu") and resources["requests"].get("memory"), resources
    assert resources["limits"].get("memory"), resources

    # No `<SERVICE>_PORT=tcp://...` link variables in its environment, and no Service whose
    # links would shadow a variable it reads where links are on.
    assert pod["enableServiceLinks"] is False
    for svc in find(objs, "Service"):
        assert not _service_links(svc) & known, svc["metadata"]["name"]


@pytest.mark.parametrize("overlay", [SHARED_STATE, AUTOSCALING])
def test_optimizer_serves_on_one_port_reads_redis_and_only_reads_deployments(
    overlay: str, render: Kustomize
) -> None:
    check_optimizer(render(overlay))


_OPT_CONTAINER = "spec.template.spec.containers.0"


def _add_service_named(name: str) -> Callable[[list[Obj]], None]:
    """Add a copy of the optimizer's Service under another name."""

    def mutate(objs: list[Obj]) -> None:
        service = copy.deepcopy(one(objs, "Service", OPTIMIZER))
        service["metadata"]["name"] = name
        objs.append(service)

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(
            _edit("Deployment", OPTIMIZER, f"{_OPT_CONTAINER}.env.0.value", lambda _: "8091"),
            id="port-variable",
        ),
        pytest.param(
            _edit(
                "Deployment", OPTIMIZER, f"{_OPT_CONTAINER}.ports.0.containerPort", lambda _: 8091
            ),
            id="container-port",
        ),
        pytest.param(
            _edit(
                "Deployment",
                OPTIMIZER,
                f"{_OPT_CONTAINER}.readinessProbe.httpGet.port",
                lambda _: 8080,
            ),
            id="readiness-port",
        ),
        pytest.param(
            _edit(
                "Deployment",
                OPTIMIZER,
                f"{_OPT_CONTAINER}.livenessProbe.httpGet.path",
                lambda _: "/metrics",
            ),
            id="liveness-path",
        ),
        pytest.param(
            _edit("Service", OPTIMIZER, "spec.ports.0.targetPort", lambda _: 8080),
            id="service-target",
        ),
        pytest.param(
            _edit("Deployment", OPTIMIZER, f"{_OPT_CONTAINER}.command.1", lambda _: "serve"),
            id="serve-command",
        ),
        pytest.param(
            _edit(
                "Deployment", OPTIMIZER, f"{_OPT_CONTAINER}.image", lambda _: "hetero-gateway:0.1.0"
            ),
            id="plugin-image",
        ),
        pytest.param(
            _edit(
                "Deployment",
                OPTIMIZER,
                f"{_OPT_CONTAINER}.env.1",
                lambda _: {"name": "REDIS_HOST", "value": "redis"},
            ),
            id="short-redis-host",
        ),
        pytest.param(
            _edit(
                "NetworkPolicy",
                OPTIMIZER_REDIS_POLICY,
                "spec.ingress.0.from.0.podSelector.matchLabels",
                lambda _: {"a": "b"},
            ),
            id="redis-blocked",
        ),
        pytest.param(
            _edit("ClusterRole", OPTIMIZER, "rules.0.verbs", lambda v: [*v, "patch"]),
            id="rbac-patch",
        ),
        pytest.param(
            _edit(
                "ClusterRole", OPTIMIZER, "rules.0.resources", lambda v: [*v, "deployments/scale"]
            ),
            id="rbac-scale",
        ),
        pytest.param(
            _edit("ClusterRole", OPTIMIZER, "rules.0.apiGroups", lambda _: ["*"]),
            id="rbac-any-group",
        ),
        pytest.param(
            _edit("ClusterRoleBinding", OPTIMIZER, "subjects.0.name", lambda _: "hetero-gateway"),
            id="binds-plugin-account",
        ),
        pytest.param(
            _edit(
                "Deployment",
                OPTIMIZER,
                "spec.template.spec.serviceAccountName",
                lambda _: "hetero-gateway",
            ),
            id="plugin-account",
        ),
        pytest.param(
            _edit("ConfigMap", "hetero-gateway-env", f"data.{TRACING_FLAG}", lambda _: "false"),
            id="tracing-off",
        ),
        pytest.param(
            _edit("Deployment", OPTIMIZER, "spec.replicas", lambda _: 2), id="two-replicas"
        ),
        pytest.param(
            _edit(
                "Deployment", OPTIMIZER, "spec.template.spec.securityContext.runAsUser", lambda _: 0
            ),
            id="root",
        ),
        pytest.param(
            _edit(
                "Deployment",
                OPTIMIZER,
                "spec.template.spec.enableServiceLinks",
                lambda _: True,
            ),
            id="service-links",
        ),
        pytest.param(_add_service_named("hetero-gateway-optimizer"), id="service-shadows-port"),
    ],
)
def test_optimizer_check_catches_mistakes(
    mutate: Callable[[list[Obj]], None], render: Kustomize
) -> None:
    objs = render(SHARED_STATE)
    check_optimizer(objs)
    mutate(objs)
    with pytest.raises(AssertionError):
        check_optimizer(objs)


def test_optimizer_component_also_fits_override_host(tmp_path: Path, render: Kustomize) -> None:
    """Both components added to override-host: Redis, the optimizer, tracing; still fail-open."""
    objs = override_host_with(tmp_path, render, SHARED_STATE_COMPONENT, OPTIMIZER_COMPONENT)
    check_shared_state(objs)
    check_optimizer(objs)
    assert one(objs, "EnvoyExtensionPolicy")["spec"]["extProc"][0]["failOpen"] is True


# --- AIBrix PodAutoscalers fed by the optimizer ---------------------------------------------------

REPLICAS_METRIC = "vllm:deployment_replicas"
# The optimizer serves replicas in 1/100-GPU units: a target of 100 makes its answer the count.
REPLICAS_TARGET = "100"
MIN_REPLICAS_LABEL = "model.aibrix.ai/min_replicas"


def check_autoscalers(objs: list[Obj]) -> None:
    """One PodAutoscaler per model Deployment, each reading its own answer from the optimizer."""
    service = one(objs, "Service", OPTIMIZER)
    service_ns = service["metadata"]["namespace"]
    [service_port] = service["spec"]["ports"]
    hosts = {f"{OPTIMIZER}.{service_ns}.svc", f"{OPTIMIZER}.{service_ns}.svc.cluster.local"}
    caps = load_settings(_container_env(objs, _optimizer_container(objs))).optimizer.max_replicas
    targets = []
    for autoscaler in find(objs, "PodAutoscaler"):
        spec = autoscaler["spec"]
        ns = autoscaler["metadata"]["namespace"]
        # AIBrix scales a Deployment of the PodAutoscaler's own namespace.
        ref = spec["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), ref
        assert ref.get("namespace", ns) == ns
        deps = [
            d for d in find(objs, "Deployment", ref["name"]) if d["metadata"]["namespace"] == ns
        ]
        assert len(deps) == 1, f"scaleTargetRef: no Deployment {ns}/{ref['name']}"
        dep = deps[0]
        targets.append((ns, ref["name"]))
        # The optimizer finds the Deployment by its model label and plans with its floor.
        labels = dep["metadata"]["labels"]
        assert labels.get("model.aibrix.ai/name"), labels
        assert spec["minReplicas"] == int(labels[MIN_REPLICAS_LABEL])
        assert spec["maxReplicas"] >= spec["minReplicas"]
        # The optimizer plans no more of this GPU type than the autoscaler would start.
        assert caps.get(f"{ns}/{ref['name']}", caps.get(ref["name"])) == spec["maxReplicas"]
        # The optimizer's Service, port and `/metrics/<namespace>/<deployment>` of this target.
        [source] = spec["metricsSources"]
        assert (source["metricSourceType"], source["protocolType"]) == ("domain", "http")
        host, _, port = source["endpoint"].rpartition(":")
        assert host in hosts, source["endpoint"]
        assert int(port) == service_port["port"]
        assert "port" not in source  # a domain source's port is the endpoint's
        assert source["path"] == f"/metrics/{ns}/{ref['name']}"
        assert (source["targetMetric"], source["targetValue"]) == (REPLICAS_METRIC, REPLICAS_TARGET)
    # Every model Deployment (pods labelled with a model) is scaled, none by two autoscalers.
    models = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in find(objs, "Deployment")
        if "model.aibrix.ai/name" in _pod_labels(d)
    }
    assert len(models) == 2
    assert sorted(targets) == sorted(models)


def test_podautoscalers_validate_against_the_crd_schema(render: Kustomize, crds: Crds) -> None:
    autoscalers = find(render(AUTOSCALING), "PodAutoscaler")
    assert len(autoscalers) == 2
    problems = {o["metadata"]["name"]: schema_errors(crds, o) for o in autoscalers}
    assert problems == {key: [] for key in problems}, problems


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        pytest.param(
            _set("spec.metricsSources.0.metricSource", "domain"), "metricSource", id="unknown-field"
        ),
        pytest.param(
            _set("spec.metricsSources.0.metricSourceType", "Domain"), "Domain", id="bad-enum"
        ),
        pytest.param(_set("spec.scalingStrategy", "kpa"), "kpa", id="strategy"),
        pytest.param(_set("spec.maxReplicas", "4"), "'4'", id="type"),
        pytest.param(_set("spec.scaleTargetRef.deployment", "x"), "deployment", id="target-field"),
        pytest.param(_set("spec.metricsSources", []), "[]", id="no-source"),
    ],
)
def test_podautoscaler_schema_check_catches_mistakes(
    mutate: Callable[[Obj], None], expect: str, render: Kustomize, crds: Crds
) -> None:
    obj = find(render(AUTOSCALING), "PodAutoscaler")[0]
    assert schema_errors(crds, obj) == []
    mutate(obj)
    errors = schema_errors(crds, obj)
    assert any(expect in e for e in errors), errors


def test_autoscalers_scale_each_model_deployment_to_the_optimizers_answer(
    render: Kustomize,
) -> None:
    check_autoscalers(render(AUTOSCALING))


_A100 = "llama-3-8b-a100-optimizer"
_L20 = "llama-3-8b-l20-optimizer"
_SOURCE = "spec.metricsSources.0"


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(
            _edit(
                "PodAutoscaler",
                _A100,
                f"{_SOURCE}.path",
                lambda _: "/metrics/default/llama-3-8b-a100",
            ),
            id="path-namespace",
        ),
        pytest.param(
            _edit("PodAutoscaler", _A100, f"{_SOURCE}.path", lambda p: p.replace("a100", "l20")),
            id="path-other-deployment",
        ),
        pytest.param(
            _edit(
                "PodAutoscaler", _A100, f"{_SOURCE}.endpoint", lambda e: e.replace(":8090", ":8080")
            ),
            id="endpoint-port",
        ),
        pytest.param(
            _edit(
                "PodAutoscaler",
                _A100,
                f"{_SOURCE}.endpoint",
                lambda _: "aibrix-gpu-optimizer.aibrix-system.svc.cluster.local:8090",
            ),
            id="endpoint-aibrix-optimizer",
        ),
        pytest.param(
            _edit("PodAutoscaler", _A100, "spec.scaleTargetRef.name", lambda _: "llama-3-8b"),
            id="no-such-deployment",
        ),
        pytest.param(
            _both(
                _edit(
                    "PodAutoscaler", _L20, "spec.scaleTargetRef.name", lambda _: "llama-3-8b-a100"
                ),
                _edit("PodAutoscaler", _L20, f"{_SOURCE}.path", lambda p: p.replace("l20", "a100")),
                _edit("PodAutoscaler", _L20, "spec.maxReplicas", lambda _: 4),
            ),
            id="one-deployment-twice",
        ),
        pytest.param(
            _edit("PodAutoscaler", _A100, f"{_SOURCE}.targetValue", lambda _: "1"),
            id="target-value",
        ),
        pytest.param(
            _edit(
                "PodAutoscaler",
                _A100,
                f"{_SOURCE}.targetMetric",
                lambda _: "vllm:num_requests_running",
            ),
            id="target-metric",
        ),
        pytest.param(
            _edit("PodAutoscaler", _A100, "spec.minReplicas", lambda _: 0), id="below-floor"
        ),
        pytest.param(
            _edit("PodAutoscaler", _A100, "spec.maxReplicas", lambda _: 0), id="max-below-min"
        ),
        pytest.param(
            _edit("PodAutoscaler", _L20, "spec.maxReplicas", lambda n: n + 1), id="max-above-cap"
        ),
        pytest.param(
            _edit(
                "ConfigMap",
                OPTIMIZER_ENV,
                "data.HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS",
                lambda _: "",
            ),
            id="no-caps",
        ),
    ],
)
def test_autoscaler_check_catches_mistakes(
    mutate: Callable[[list[Obj]], None], render: Kustomize
) -> None:
    objs = render(AUTOSCALING)
    check_autoscalers(objs)
    mutate(objs)
    with pytest.raises(AssertionError):
        check_autoscalers(objs)


def test_autoscaling_overlay_adds_only_the_podautoscalers_and_caps(render: Kustomize) -> None:
    """shared-state applies without AIBrix; the autoscaling overlay is it plus the CRD's objects
    and the optimizer's availability caps to match them."""
    scaled = {resource_id(o): o for o in render(AUTOSCALING)}
    shared = {resource_id(o): o for o in render(SHARED_STATE)}
    assert {rid[1] for rid in set(scaled) - set(shared)} == {"PodAutoscaler"}
    assert find(list(shared.values()), "PodAutoscaler") == []
    caps = "HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS"
    for rid, obj in shared.items():
        other = copy.deepcopy(scaled[rid])
        if rid[1:4:2] == ("ConfigMap", OPTIMIZER_ENV):
            assert obj["data"][caps] == "" and other["data"][caps]
            other["data"][caps] = ""
        assert other == obj, rid


# --- Dockerfile ----------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, args = line.partition(" ")
            out.append((instruction.upper(), args.strip()))
    return out


def _dockerfile_uid() -> int:
    users = [args for ins, args in _dockerfile() if ins == "USER"]
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "a numeric USER lets Kubernetes check runAsNonRoot"
    return int(uid)


def _final_stage() -> list[tuple[str, str]]:
    steps = _dockerfile()
    last_from = max(i for i, (ins, _) in enumerate(steps) if ins == "FROM")
    return steps[last_from:]


def test_dockerfile_runs_serve_as_non_root_on_the_plugin_ports() -> None:
    steps = _dockerfile()
    froms = [args for ins, args in steps if ins == "FROM"]
    assert all(re.match(r"python:\$\{PYTHON_VERSION\}-slim\b", f) for f in froms), froms
    assert re.search(r"PYTHON_VERSION=3\.1[1-9]\b", " ".join(a for i, a in steps if i == "ARG"))
    final = _final_stage()
    assert [a for i, a in final if i == "ENTRYPOINT"] == ['["hetero-gateway", "serve"]']
    exposed = {int(p) for i, a in final if i == "EXPOSE" for p in a.split()}
    assert exposed == {Settings().grpc_port, Settings().http_port}
    assert _dockerfile_uid() != 0


def _pip_installs(build_args: dict[str, str]) -> list[list[str]]:
    """Each `pip install`'s arguments as the build's shell expands them with these build args.

    Docker passes the ARGs (their defaults unless given) to RUN as environment variables and the
    shell expands them, so `sh` does the same here.
    """
    steps = _dockerfile()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for ins, args in steps:
        if ins == "ARG":
            name, _, default = args.partition("=")
            env[name] = shlex.split(default)[0] if default else ""
    env.update(build_args)
    runs = " ".join(a for i, a in steps if i == "RUN")
    installs = re.findall(r"pip install ([^&]+)", runs)
    assert installs, "no pip install"
    out = []
    for args in installs:
        proc = subprocess.run(
            ["sh", "-c", f"printf '%s\\0' {args}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        out.append(proc.stdout.split("\0")[:-1])
    return out


def test_dockerfile_installs_runtime_dependencies_only() -> None:
    # The default build (the plugin): no extras, which would add tools, test or solver packages.
    assert _pip_installs({}) == [["--no-cache-dir", "."]]


def test_dockerfile_builds_the_optimizer_image_with_scipy() -> None:
    # `--build-arg EXTRAS=optimizer` (docs/deploy.md): the runtime plus the optimizer extra only.
    assert _pip_installs({"EXTRAS": "optimizer"}) == [["--no-cache-dir", ".[optimizer]"]]
    with (REPO / "pyproject.toml").open("rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(re.match(r"scipy\b", req) for req in extras["optimizer"]), extras["optimizer"]


def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies() -> None:
    sources: set[str] = set()
    for ins, args in _dockerfile():
        if ins == "COPY" and "--from=" not in args:
            *srcs, _dest = args.split()
            sources.update(s.rstrip("/") for s in srcs)
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such path"
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # Everything is excluded first (.git, .venv, caches, docs images, ...), then the sources
    # come back, then bytecode caches inside them go again.
    assert patterns[0] == "*"
    assert {p[1:].rstrip("/") for p in patterns if p.startswith("!")} == sources
    assert "**/__pycache__" in patterns
