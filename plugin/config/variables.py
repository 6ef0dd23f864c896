"""Every variable, declared once (`Var`), in `ENV_VARS` in the order of the configuration
table; the constants the declarations and their readers share.
"""

from __future__ import annotations

import argparse
from typing import Any

from plugin.config.kinds import (
    Bool,
    Caps,
    Choice,
    Flag,
    Float,
    HeaderPolicyText,
    Host,
    Int,
    LabelKey,
    LabelSelector,
    Names,
    Namespaces,
    Pairs,
    StrategyName,
    Text,
    Var,
)
from plugin.core import fair_start
from plugin.core.header_policy import HeaderPolicy
from plugin.core.pool import EjectionPolicy
from plugin.core.strategies import LoadBalanceSettings
from plugin.core.strategies.blend import MAX_WEIGHT, AutoBlend
from plugin.core.strategies.gate import ImbalanceSettings
from plugin.core.strategies.prefix_cache import PrefixCacheSettings

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DISCOVERY_KINDS = ("file", "kubernetes")
DEFAULT_K8S_LABEL_SELECTOR = "model.aibrix.ai/name"
# AIBrix names a pod's deployment (GPU type) by this label; it maps the pod to its profile.
DEFAULT_DEPLOYMENT_LABEL = "app.kubernetes.io/name"
# Variables that no longer exist, and what replaces them: setting one stops start-up, naming it.
REMOVED_VARS = {
    "HETERO_GATEWAY_GPU_LABEL": "the GPU type is the pod's deployment now, named by the label in"
    " AIBRIX_POD_DEPLOYMENT_LABEL (the one that maps a pod to its GPU profile): set that instead",
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_MS = "milliseconds"
_S = "seconds"

ROUTING_ALGORITHM: Var[str] = Var(
    "ROUTING_ALGORITHM",
    StrategyName(),
    "load-balance",
    "Strategy used when a request has no `routing-strategy` header: a name or a weighted list"
    " (`prefix-cache:5,load-balance:4`), auto-blended like the header.",
)
_GATE = ImbalanceSettings()
IMBALANCE_GATE: Var[str] = Var(
    "HETERO_GATEWAY_IMBALANCE_GATE",
    Choice(("capacity", "count", "off")),
    "capacity",
    "The load-imbalance gate ahead of every strategy but the SLO ones: `capacity` compares load"
    " per unit of learned capacity (a fast replica is not a hotspot for carrying its share),"
    " `count` is AIBrix's rule on raw running counts, `off` has no gate (see Routing).",
)
IMBALANCE_MIN_GAP: Var[float] = Var(
    "AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP",
    Float(ge=0),
    _GATE.min_gap,
    "Imbalance gate: it fires when the busiest replica's load exceeds the least loaded's by at"
    " least this many requests (and, with 3 replicas or more, the factor below holds).",
)
IMBALANCE_FACTOR: Var[float] = Var(
    "AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR",
    Float(ge=0),
    _GATE.factor,
    "Imbalance gate: ... and the busiest's load exceeds this times (the others' mean + 1).",
)
_AUTO = AutoBlend()
AUTO_BLEND_LB_WEIGHT: Var[int] = Var(
    "AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT",
    Int(le=MAX_WEIGHT),
    _AUTO.load_balance_weight,
    "Auto-blend: the load-balance weight added behind a scoring strategy the request names"
    " without load-balance; 0 or less turns auto-blend off (see Routing).",
)
AUTO_BLEND_LR_WEIGHT: Var[int] = Var(
    "AIBRIX_ROUTING_AUTO_BLEND_LEAST_REQUEST_WEIGHT",
    Int(ge=0, le=MAX_WEIGHT),
    _AUTO.least_request_weight,
    "Auto-blend: least-request's weight when a bare `least-request` is blended with"
    " `load-balance:1`.",
)
AUTO_BLEND_PC_WEIGHT: Var[int] = Var(
    "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_WEIGHT",
    Int(ge=0, le=MAX_WEIGHT),
    _AUTO.prefix_cache_weight,
    "Auto-blend: prefix-cache's weight when a bare `prefix-cache` is blended.",
)
AUTO_BLEND_PC_LB_WEIGHT: Var[int] = Var(
    "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_LOAD_BALANCE_WEIGHT",
    Int(ge=0, le=MAX_WEIGHT),
    _AUTO.prefix_cache_load_balance_weight,
    "Auto-blend: load-balance's weight behind a bare `prefix-cache`.",
)

# A strategy's own settings: declare its variables with `strategy="<its name>"` and defaults
# taken from its settings type, list them in ENV_VARS, build that type from them in a
# `_<strategy>_settings(env)` called by load_settings into a new Settings field, and return the
# field from Settings.strategy_settings(); then regenerate the README table (module docstring).
_LB = LoadBalanceSettings()
LB_QUEUED_WEIGHT: Var[float] = Var(
    "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT",
    Float(ge=0),
    _LB.queued_weight,
    "lambda, the weight of engine-queued requests in the score.",
    strategy="load-balance",
)
LB_KV_PRESSURE_ALPHA: Var[float] = Var(
    "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA",
    Float(ge=0),
    _LB.kv_pressure_alpha,
    "alpha, the strength of the KV-pressure penalty (1 + alpha * (1 - kvFree)^2).",
    strategy="load-balance",
)
LB_KV_CRITICAL_FREE: Var[float] = Var(
    "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE",
    Float(ge=0, le=1),
    _LB.kv_critical_free,
    "replicas with less free KV cache than this are passed over.",
    strategy="load-balance",
)
LB_AVOID_FULL_BATCHES: Var[bool] = Var(
    "HETERO_GATEWAY_LB_AVOID_FULL_BATCHES",
    Bool(),
    _LB.avoid_full_batches,
    "pass over a replica whose engine batch is full while another has room; `false` is the"
    " reference algorithm (see Routing).",
    strategy="load-balance",
)

_PC = PrefixCacheSettings()
PC_BLOCK_SIZE: Var[int] = Var(
    "AIBRIX_PREFIX_CACHE_BLOCK_SIZE",
    Int(ge=1, le=1 << 20),
    _PC.block_chars,
    "characters per hashed prompt block (AIBrix's `character` tokenizer: a byte is a token).",
    strategy="prefix-cache",
)
PC_BLOCK_NUMBER: Var[int] = Var(
    "AIBRIX_PREFIX_CACHE_BLOCK_NUMBER",
    Int(ge=1, le=100_000_000),
    _PC.max_blocks,
    "block hashes the index keeps over all models, least recently sent evicted first (about"
    " 190 bytes each).",
    strategy="prefix-cache",
)

METRIC_REFRESH_MS: Var[int] = Var(
    "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS",
    Int(gt=0, unit=_MS),
    1000,
    "Engine metrics scrape period; capacity estimates refresh on the same tick.",
)
MAX_MESSAGE_BYTES: Var[int] = Var(
    "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES",
    Int(ge=1, le=2**31 - 1, unit="bytes"),  # gRPC sizes and HTTP/2 windows are int32
    DEFAULT_MAX_MESSAGE_BYTES,
    "Largest request body accepted: the plugin's gRPC message limit and, in `envoy-config`'s"
    " output, Envoy's buffer limit, so the two stay equal.",
    flag=Flag("envoy-config", "--max-request-bytes"),
)
AUTH_BEARER_TOKEN: Var[str | None] = Var(
    "AIBRIX_AUTH_BEARER_TOKEN",
    Text(),
    None,
    "When set, every request must send `Authorization: Bearer <this token>` or get a 401"
    " (compared in constant time; never logged).",
)
# Envoy's own default `max_headers_count`, and the room above it for the headers routing adds
# (at most 8: target-pod, the destination, prompt-size and lease headers, routing-strategy,
# x-request-id, the profile echo, content-length), with room to spare for what Envoy itself adds
# before it.
ENVOY_DEFAULT_MAX_HEADERS = 100
ROUTING_HEADER_ROOM = 16
MAX_REQUEST_HEADERS: Var[int] = Var(
    "HETERO_GATEWAY_MAX_REQUEST_HEADERS",
    Int(ge=16, le=10000),
    ENVOY_DEFAULT_MAX_HEADERS + ROUTING_HEADER_ROOM,
    "Envoy's `max_headers_count`, as the listener has it (`envoy-config` renders it): Envoy's"
    " default 100 plus room for the headers routing adds, so every request Envoy alone would"
    " accept is routed; the plugin answers 431 to a request that would exceed it once its own"
    " headers are added, instead of Envoy's empty 503. Under Envoy Gateway, whose listener keeps"
    " 100, set 100.",
)
CLIENT_HEADERS: Var[HeaderPolicy] = Var(
    "HETERO_GATEWAY_CLIENT_HEADERS",
    HeaderPolicyText(),
    HeaderPolicy(),
    "Which routing headers clients may send (`routing-strategy`, `external-filter`,"
    " `config-profile`, `x-slo-ttft-ms`, `x-slo-tpot-ms`): per header `deny`, `allow` or the values"
    " allowed, separated by a bar, `;` between headers (`external-filter=deny`; for"
    " `routing-strategy` each strategy of a weighted list must be allowed; docs/routing.md). A"
    " model's config document overrides it per header (`clientHeaders`). Unset: clients steer, as"
    " under AIBrix.",
    shown_default="(none)",
)
DENIED_HEADER_ACTION: Var[str] = Var(
    "HETERO_GATEWAY_DENIED_HEADER_ACTION",
    Choice(("reject", "ignore")),
    "reject",
    "What a request sending a header `HETERO_GATEWAY_CLIENT_HEADERS` does not allow gets:"
    " `reject`, a 403 in OpenAI's shape naming the header; `ignore`, routed as if it had not sent"
    " it (logged once per header).",
)
PODS_FILE: Var[str | None] = Var(
    "HETERO_GATEWAY_PODS_FILE",
    Text("path", strip=False),
    None,
    "Static pod discovery file (YAML).",
    flag=Flag("serve", "--pods"),
)
_PORT = Int(ge=0, le=65535, noun="a port")
GRPC_PORT: Var[int] = Var(
    "HETERO_GATEWAY_GRPC_PORT",
    _PORT,
    50052,
    "ext_proc gRPC port.",
    flag=Flag("serve", "--grpc-port"),
)
HTTP_PORT: Var[int] = Var(
    "HETERO_GATEWAY_HTTP_PORT",
    _PORT,
    8080,
    "HTTP port for /metrics, /healthz, /readyz and /debug/pods.",
    flag=Flag("serve", "--http-port"),
)
WORKERS: Var[int] = Var(
    "HETERO_GATEWAY_WORKERS",
    Int(ge=1, le=64),
    1,
    "Plugin processes on this host, sharing the gRPC port (SO_REUSEPORT: the kernel spreads"
    " Envoy's connections over them) and their state through Redis (needs REDIS_HOST); worker i"
    " serves HTTP on the HTTP port + i and publishes as POD_NAME-w<i>. One Python process uses"
    " one core.",
    flag=Flag("serve", "--workers"),
)
SCRAPE_TIMEOUT_MS: Var[int] = Var(
    "HETERO_GATEWAY_SCRAPE_TIMEOUT_MS",
    Int(gt=0, unit=_MS),
    500,
    "Timeout of one engine /metrics scrape.",
)
METRICS_MAX_AGE_INTERVALS: Var[int] = Var(
    "HETERO_GATEWAY_METRICS_MAX_AGE_INTERVALS",
    Int(gt=0),
    3,
    "Engine metrics older than this many refresh intervals count as missing.",
)
CAPACITY_WINDOW_S: Var[float] = Var(
    "HETERO_GATEWAY_CAPACITY_WINDOW_S",
    Float(gt=0, unit=_S),
    60.0,
    "Window over which completed output tokens become a rate.",
)
CAPACITY_TAU_S: Var[float] = Var(
    "HETERO_GATEWAY_CAPACITY_TAU_S",
    Float(gt=0, unit=_S),
    10.0,
    "Time constant of the EWMA that smooths the capacity estimate.",
)
SLOW_START_WINDOW_S: Var[float] = Var(
    "HETERO_GATEWAY_SLOW_START_WINDOW_S",
    Float(ge=0, le=3600, unit=_S),
    fair_start.SLOW_START_WINDOW_S,
    "A pod that has not learned its capacity is scored at a share of where it starts, growing"
    " linearly to all of it over this long after it turns ready (Envoy's slow start; 0: off);"
    " its own estimate replaces the start as soon as it has one.",
)
SLOW_START_MIN_PERCENT: Var[float] = Var(
    "HETERO_GATEWAY_SLOW_START_MIN_PERCENT",
    Float(gt=0, le=100),
    100 * fair_start.SLOW_START_MIN,
    "The share of its start, in percent, a pod that just turned ready is scored at (Envoy's"
    " `min_weight_percent`, whose default is 10).",
)
_EJECT = EjectionPolicy()
EJECT_CONSECUTIVE_5XX: Var[int] = Var(
    "HETERO_GATEWAY_EJECT_CONSECUTIVE_5XX",
    Int(gt=0),
    _EJECT.consecutive_5xx,
    "Upstream 5xx in a row (503 from a dead engine included) that eject a pod from routing.",
)
EJECT_BASE_S: Var[float] = Var(
    "HETERO_GATEWAY_EJECT_BASE_S",
    Float(gt=0, unit=_S),
    _EJECT.base_s,
    f"First ejection time; it doubles with each ejection in a row, up to {_EJECT.max_s:g} s"
    " (or this, if longer).",
)
LOG_LEVEL: Var[str] = Var(
    "HETERO_GATEWAY_LOG_LEVEL", Choice(LOG_LEVELS), "INFO", "Python logging level."
)
DRAIN_S: Var[float] = Var(
    "HETERO_GATEWAY_DRAIN_S",
    Float(ge=0, le=3600, unit=_S),
    20.0,
    "On SIGTERM: refuse new ext_proc streams, report not ready (gRPC health, `/readyz`), and"
    " give in-flight requests up to this long to finish; keep it below the pod's"
    " `terminationGracePeriodSeconds`.",
)
DISCOVERY: Var[str] = Var(
    "HETERO_GATEWAY_DISCOVERY",
    Choice(DISCOVERY_KINDS),
    "file",
    "Pod source: the YAML file, or pods listed and watched in the Kubernetes API.",
    flag=Flag("serve", "--discovery"),
)
K8S_NAMESPACE: Var[tuple[str, ...]] = Var(
    "HETERO_GATEWAY_K8S_NAMESPACE",
    Namespaces(),
    (),
    "Namespaces whose pods Kubernetes discovery watches; empty watches every namespace.",
    shown_default="(all)",
)
K8S_LABEL_SELECTOR: Var[str] = Var(
    "HETERO_GATEWAY_K8S_LABEL_SELECTOR",
    LabelSelector(),
    DEFAULT_K8S_LABEL_SELECTOR,
    "Which pods Kubernetes discovery lists; empty lists every pod in scope and keeps those"
    " naming a model by label or annotation.",
)
# The ext_proc timeouts of the Envoy config this project renders (`envoy-config`): a reply to one
# message within ENVOY_MESSAGE_TIMEOUT_S (a hung plugin stalls a request no longer, then the
# wiring's failure mode applies), except a request the gateway holds: its stream first tells
# Envoy to wait up to the longest hold plus 1 s (`override_message_timeout`), which Envoy allows
# up to ENVOY_MAX_MESSAGE_TIMEOUT_S. So no gateway wait may be longer than that less 1 s.
ENVOY_MESSAGE_TIMEOUT_S = 1.0
ENVOY_MAX_MESSAGE_TIMEOUT_S = 60.0
SLO_MAX_WAIT_MS: Var[int] = Var(
    "HETERO_GATEWAY_SLO_MAX_WAIT_MS",
    Int(gt=0, le=int(ENVOY_MAX_MESSAGE_TIMEOUT_S * 1000) - 1000, unit=_MS),
    30000,
    "SLO strategies: the longest a request waits at the gateway for a replica with room (less if"
    " its SLO runs out first); at most Envoy's ext_proc max_message_timeout (60 s) less 1 s.",
)
MAX_WAITING: Var[int] = Var(
    "HETERO_GATEWAY_MAX_WAITING",
    Int(ge=1),
    1000,
    "Requests a strategy may hold at the gateway per model; one more is rejected at once with"
    " 503 (`x-error-routing`).",
)
ADMISSION: Var[bool] = Var(
    "HETERO_GATEWAY_ADMISSION",
    Bool(),
    False,
    "Admission for every request (docs/admission.md): while a model's fleet is full (each replica"
    " at its batch cap, or queueing where no cap is known) requests wait in a fair queue, higher"
    " priority classes first, then the tenant with the least GPU time; shed with 503 and"
    " `retry-after`. Off: routed at once, as under AIBrix.",
)
TENANT_HEADER: Var[str | None] = Var(
    "HETERO_GATEWAY_TENANT_HEADER",
    Text("header name"),
    None,
    "Admission: the request header naming its tenant (set by an auth layer in front; strip it from"
    " outside traffic). Unset, or absent from a request: the bearer token decides.",
    shown_default="(none)",
)
TENANT_TOKENS: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_TOKENS",
    Pairs("tenant:sha256"),
    (),
    "Admission: tenants by bearer token, each as the SHA-256 (hex) of its token (`sha256sum` of"
    " the token without a newline); the tokens themselves are never configured, logged or"
    " exported. A request with neither header nor listed token is tenant `default`.",
    shown_default="(none)",
)
PRIORITY_CLASSES: Var[tuple[str, ...]] = Var(
    "HETERO_GATEWAY_PRIORITY_CLASSES",
    Names(),
    ("default",),
    "Admission: the priority classes, highest first (`interactive,batch`); a full fleet serves a"
    " higher class's waiting requests first and sheds the lowest first.",
)
TENANT_CLASSES: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_CLASSES",
    Pairs("tenant:class"),
    (),
    "Admission: each tenant's priority class; a tenant not listed is in the lowest class.",
    shown_default="(none)",
)
TENANT_MAY_ASK: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_MAY_ASK",
    Pairs("tenant:class"),
    (),
    "Admission: tenants whose requests may ask for a class above their own by the"
    " `x-priority-class` header, each up to the class given; any request may ask for a lower one.",
    shown_default="(none)",
)
TENANT_WEIGHTS: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_WEIGHTS",
    Pairs("tenant:weight"),
    (),
    "Admission: a tenant's share of GPU time against others of its class while both wait"
    " (default 1 each: `a:3` gets three times the GPU-seconds of a tenant at 1).",
    shown_default="(none)",
)
ADMISSION_MAX_WAIT_MS: Var[int] = Var(
    "HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS",
    Int(gt=0, le=int(ENVOY_MAX_MESSAGE_TIMEOUT_S * 1000) - 1000, unit=_MS),
    30000,
    "Admission: the longest a request waits for room before a 503 with `retry-after`; at most"
    " Envoy's ext_proc max_message_timeout (60 s) less 1 s. `HETERO_GATEWAY_MAX_WAITING` bounds"
    " the queue per model.",
)
CLASS_MAX_WAIT_MS: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_CLASS_MAX_WAIT_MS",
    Pairs("class:milliseconds"),
    (),
    "Admission: a class's own longest wait, instead of `HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS`"
    " (`batch:2000`: a batch request is refused with `retry-after` after 2 s rather than served"
    " late); same bounds.",
    shown_default="(none)",
)
TENANT_REQUESTS_PER_MINUTE: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE",
    Pairs("tenant:requests", star=True),
    (),
    "Admission: requests a tenant may send in any minute, across every gateway replica (through"
    " Redis; without it, each replica holds its share); `*` sets it for each tenant not named."
    " Beyond: 429 `rate_limit_exceeded` with `retry-after`.",
    shown_default="(none)",
)
TENANT_TOKENS_PER_MINUTE: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE",
    Pairs("tenant:tokens", star=True),
    (),
    "Admission: prompt and output tokens a tenant may use in any minute, as"
    " `HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE`; a request reserves its prompt and"
    " `max_tokens` before it is routed and is settled at what it used.",
    shown_default="(none)",
)
TENANT_GPU_SECONDS_PER_MINUTE: Var[tuple[tuple[str, str], ...]] = Var(
    "HETERO_GATEWAY_TENANT_GPU_SECONDS_PER_MINUTE",
    Pairs("tenant:seconds", star=True),
    (),
    "Admission: GPU-seconds a tenant's requests may take in any minute (priced per replica, as"
    " admission's fairness counts them), as `HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE`.",
    shown_default="(none)",
)
DEPLOYMENT_LABEL: Var[str] = Var(
    "AIBRIX_POD_DEPLOYMENT_LABEL",
    LabelKey(),
    DEFAULT_DEPLOYMENT_LABEL,
    "Pod label whose value names the pod's deployment (GPU type): what maps it to its GPU profile,"
    " in both discovery sources, and the `gpu` of `/debug/pods` and `hetero_gateway_pod_info`.",
)
PROFILE_DIR: Var[str | None] = Var(
    "HETERO_GATEWAY_PROFILE_DIR",
    Text(what="path"),
    None,
    "Directory of GPU profiles (`<model>/<deployment>.json`, AIBrix's format), read at start and"
    " every 10 s; with Redis, profiles are read from `aibrix:profile_*` keys instead.",
)
REDIS_PORT: Var[int] = Var("REDIS_PORT", Int(ge=1, le=65535, noun="a port"), 6379, "Redis port.")
REDIS_DB: Var[int] = Var(
    "REDIS_DB", Int(ge=0, le=1_000_000), 0, "Redis database number, for every use of Redis."
)
REDIS_HOST: Var[str | None] = Var(
    "REDIS_HOST",
    Host(port_var=REDIS_PORT.name),
    None,
    "Redis for state shared by several gateway replicas (see Several gateways); unset keeps all"
    " state in the process.",
)
REDIS_PASSWORD: Var[str | None] = Var(
    "REDIS_PASSWORD", Text(strip=False), None, "Redis password (AUTH)."
)
POD_NAME: Var[str | None] = Var(
    "POD_NAME",
    Text(),
    None,
    "This gateway's name in the shared state; must differ between replicas.",
    shown_default="(hostname)",
)
POD_NAMESPACE: Var[str | None] = Var(
    "POD_NAMESPACE",
    Text(),
    None,
    "When set, the gateway's shared-state name is `POD_NAMESPACE/POD_NAME`.",
)
REDIS_SYNC_MS: Var[int] = Var(
    "HETERO_GATEWAY_REDIS_SYNC_MS",
    Int(gt=0, unit=_MS),
    100,
    "Period of the shared-state sync (publish this gateway's counts, read everyone's); nothing on"
    " the request path waits for Redis.",
)
REDIS_TTL_MS: Var[int] = Var(
    "HETERO_GATEWAY_REDIS_TTL_MS",
    Int(gt=0, unit=_MS),
    2000,
    "Expiry of a gateway's published in-flight counts: a gateway that stops syncing drops out of"
    " the others' view this long after its last sync.",
    also=">= 2 x sync",
)
SHARED_SCRAPE: Var[bool] = Var(
    "HETERO_GATEWAY_SHARED_SCRAPE",
    Bool(),
    True,
    "Share engine scrapes among the gateway replicas: each engine is scraped by one replica per"
    " period and the others read what it published; a replica's share moves to the others"
    " within two periods when it stops. `false`: every replica scrapes every engine.",
    also="needs `REDIS_HOST`",
)
SHARED_PREFIX_INDEX: Var[bool] = Var(
    "HETERO_GATEWAY_SHARED_PREFIX_INDEX",
    Bool(),
    True,
    "Share the `prefix-cache` index among the gateway replicas: each publishes the prompts it"
    " routed at its sync and adds the others', so a prefix matches the same pods whichever"
    " replica routes it. `false`: each replica learns only what it routed.",
    also="needs `REDIS_HOST`",
)
POD_LATENCY: Var[bool] = Var(
    "HETERO_GATEWAY_POD_LATENCY",
    Bool(),
    True,
    "The latency histograms (TTFT, TPOT, E2E, output tokens) per pod; `false`: per model and"
    " GPU type only (an empty `pod` label), 4 histograms a GPU type instead of a pod, for fleets"
    " of thousands of pods.",
)
OTEL: Var[bool] = Var(
    "HETERO_GATEWAY_OTEL",
    Bool(),
    False,
    "OpenTelemetry spans per request (decision, queue wait, upstream; a client's `traceparent`"
    " honoured and passed on), exported over OTLP as the standard `OTEL_EXPORTER_OTLP_*`"
    " variables say.",
    also="needs the `otel` extra",
)
TRACING: Var[bool] = Var(
    "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG",
    Bool(),
    False,
    "Record request traces for the GPU optimizer: every 10 s, per model, the window's arrivals and"
    " completed requests' sizes, merged with the other gateways' into Redis key"
    " `aibrix:<model>_request_trace_<unix>` (see Request traces).",
    also="needs `REDIS_HOST`",
)

# The GPU optimizer (`hetero-gateway optimizer`): traced traffic -> replicas per deployment.
OPTIMIZER_PORT: Var[int] = Var(
    "HETERO_GATEWAY_OPTIMIZER_PORT",
    _PORT,
    8090,
    "Optimizer: HTTP port for `/metrics/<namespace>/<deployment>` (the autoscaler's), `/metrics`,"
    " `/debug/plan`, `/scale`, `/monitor`, `/update_profile`, `/healthz`.",
    flag=Flag("optimizer", "--port"),
)
OPTIMIZER_LOOKBACK_S: Var[int] = Var(
    "HETERO_GATEWAY_OPTIMIZER_LOOKBACK_S",
    Int(ge=10, le=600, unit="seconds"),
    240,
    "Optimizer: the traffic it plans for is the mean of this many seconds of trace windows.",
    also="a multiple of 10",
)
OPTIMIZER_HEADROOM: Var[float] = Var(
    "HETERO_GATEWAY_OPTIMIZER_HEADROOM",
    Float(ge=1.0),
    1.0,
    "Optimizer: plan for the traced rate times this (1.2 = 20% spare capacity).",
)
OPTIMIZER_ATTAINMENT: Var[float] = Var(
    "HETERO_GATEWAY_OPTIMIZER_ATTAINMENT",
    Float(gt=0, le=1),
    1.0,
    "Optimizer: the least share of requests a plan serves within the SLO; below 1 (0.99 for an"
    " SLO held at p99) the rest may be served late, their work still planned for.",
)
OPTIMIZER_SCALE_DOWN_WINDOWS: Var[int] = Var(
    "HETERO_GATEWAY_OPTIMIZER_SCALE_DOWN_WINDOWS",
    Int(ge=1, le=360),
    6,
    "Optimizer: a deployment scales down only after this many consecutive 10 s plans agree (it"
    " scales up at once); 1 turns hysteresis off.",
)
OPTIMIZER_MAX_REPLICAS: Var[tuple[tuple[str, int], ...]] = Var(
    "HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS",
    Caps(),
    (),
    "Optimizer: availability caps, e.g. `llama-a100=4,prod/llama-h100=0` (GPUs you do not have);"
    " a plan the caps cannot fit serves what it can and reports the rest.",
    shown_default="(none)",
)

# Every variable, in the README's order.
ENV_VARS: tuple[Var[Any], ...] = (
    ROUTING_ALGORITHM,
    AUTO_BLEND_LB_WEIGHT,
    AUTO_BLEND_LR_WEIGHT,
    AUTO_BLEND_PC_WEIGHT,
    AUTO_BLEND_PC_LB_WEIGHT,
    IMBALANCE_GATE,
    IMBALANCE_MIN_GAP,
    IMBALANCE_FACTOR,
    LB_QUEUED_WEIGHT,
    LB_KV_PRESSURE_ALPHA,
    LB_KV_CRITICAL_FREE,
    LB_AVOID_FULL_BATCHES,
    PC_BLOCK_SIZE,
    PC_BLOCK_NUMBER,
    METRIC_REFRESH_MS,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_HEADERS,
    AUTH_BEARER_TOKEN,
    CLIENT_HEADERS,
    DENIED_HEADER_ACTION,
    PODS_FILE,
    GRPC_PORT,
    HTTP_PORT,
    WORKERS,
    SCRAPE_TIMEOUT_MS,
    METRICS_MAX_AGE_INTERVALS,
    CAPACITY_WINDOW_S,
    CAPACITY_TAU_S,
    SLOW_START_WINDOW_S,
    SLOW_START_MIN_PERCENT,
    EJECT_CONSECUTIVE_5XX,
    EJECT_BASE_S,
    LOG_LEVEL,
    DRAIN_S,
    DISCOVERY,
    K8S_NAMESPACE,
    K8S_LABEL_SELECTOR,
    SLO_MAX_WAIT_MS,
    MAX_WAITING,
    ADMISSION,
    TENANT_HEADER,
    TENANT_TOKENS,
    PRIORITY_CLASSES,
    TENANT_CLASSES,
    TENANT_MAY_ASK,
    TENANT_WEIGHTS,
    ADMISSION_MAX_WAIT_MS,
    CLASS_MAX_WAIT_MS,
    TENANT_REQUESTS_PER_MINUTE,
    TENANT_TOKENS_PER_MINUTE,
    TENANT_GPU_SECONDS_PER_MINUTE,
    DEPLOYMENT_LABEL,
    PROFILE_DIR,
    REDIS_HOST,
    REDIS_PORT,
    REDIS_DB,
    REDIS_PASSWORD,
    POD_NAME,
    POD_NAMESPACE,
    REDIS_SYNC_MS,
    REDIS_TTL_MS,
    SHARED_SCRAPE,
    SHARED_PREFIX_INDEX,
    TRACING,
    OTEL,
    POD_LATENCY,
    OPTIMIZER_PORT,
    OPTIMIZER_LOOKBACK_S,
    OPTIMIZER_HEADROOM,
    OPTIMIZER_ATTAINMENT,
    OPTIMIZER_SCALE_DOWN_WINDOWS,
    OPTIMIZER_MAX_REPLICAS,
)


def flag_vars(command: str) -> tuple[Var[Any], ...]:
    """The variables that `command` has a flag for, in table order."""
    return tuple(v for v in ENV_VARS if v.flag is not None and v.flag.command == command)


def flag_overrides(command: str, args: argparse.Namespace) -> dict[str, str]:
    """The given flags of `command` as variables: a flag's value is its variable's value."""
    given = {v.name: getattr(args, v.flag.dest) for v in flag_vars(command) if v.flag is not None}
    return {name: str(value) for name, value in given.items() if value is not None}
