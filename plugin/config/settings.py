"""The typed settings the gateway runs with, loaded from the environment by `load_settings`."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from plugin.config.kinds import Invalid
from plugin.config.variables import (
    _EJECT,
    ADMISSION,
    ADMISSION_MAX_WAIT_MS,
    AUTH_BEARER_TOKEN,
    AUTO_BLEND_LB_WEIGHT,
    AUTO_BLEND_LR_WEIGHT,
    AUTO_BLEND_PC_LB_WEIGHT,
    AUTO_BLEND_PC_WEIGHT,
    CAPACITY_TAU_S,
    CAPACITY_WINDOW_S,
    CLASS_MAX_WAIT_MS,
    CLIENT_HEADERS,
    DENIED_HEADER_ACTION,
    DEPLOYMENT_LABEL,
    DISCOVERY,
    DRAIN_S,
    EJECT_BASE_S,
    EJECT_CONSECUTIVE_5XX,
    GRPC_PORT,
    HTTP_PORT,
    IMBALANCE_FACTOR,
    IMBALANCE_GATE,
    IMBALANCE_MIN_GAP,
    K8S_LABEL_SELECTOR,
    K8S_NAMESPACE,
    LB_AVOID_FULL_BATCHES,
    LB_KV_CRITICAL_FREE,
    LB_KV_PRESSURE_ALPHA,
    LB_QUEUED_WEIGHT,
    LOG_LEVEL,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_HEADERS,
    MAX_WAITING,
    METRIC_REFRESH_MS,
    METRICS_MAX_AGE_INTERVALS,
    OPTIMIZER_ATTAINMENT,
    OPTIMIZER_HEADROOM,
    OPTIMIZER_LOOKBACK_S,
    OPTIMIZER_MAX_REPLICAS,
    OPTIMIZER_PORT,
    OPTIMIZER_SCALE_DOWN_WINDOWS,
    OTEL,
    PC_BLOCK_NUMBER,
    PC_BLOCK_SIZE,
    POD_LATENCY,
    POD_NAME,
    POD_NAMESPACE,
    PODS_FILE,
    PRIORITY_CLASSES,
    PROFILE_DIR,
    REDIS_DB,
    REDIS_HOST,
    REDIS_PASSWORD,
    REDIS_PORT,
    REDIS_SYNC_MS,
    REDIS_TTL_MS,
    REMOVED_VARS,
    ROUTING_ALGORITHM,
    SCRAPE_TIMEOUT_MS,
    SHARED_PREFIX_INDEX,
    SHARED_SCRAPE,
    SLO_MAX_WAIT_MS,
    SLOW_START_MIN_PERCENT,
    SLOW_START_WINDOW_S,
    TENANT_CLASSES,
    TENANT_GPU_SECONDS_PER_MINUTE,
    TENANT_HEADER,
    TENANT_MAY_ASK,
    TENANT_REQUESTS_PER_MINUTE,
    TENANT_TOKENS,
    TENANT_TOKENS_PER_MINUTE,
    TENANT_WEIGHTS,
    TRACING,
    WORKERS,
)
from plugin.core.admission import AdmissionSettings, ClassTable, Tenancy
from plugin.core.header_policy import HeaderPolicy
from plugin.core.limits import Limit, LimitTable
from plugin.core.pool import EjectionPolicy
from plugin.core.strategies import LoadBalanceSettings, SloSettings
from plugin.core.strategies.blend import AutoBlend
from plugin.core.strategies.gate import ImbalanceSettings
from plugin.core.strategies.prefix_cache import PrefixCacheSettings
from plugin.errors import ConfigError

# --- typed settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where shared state lives and how this gateway takes part in it."""

    host: str
    port: int = REDIS_PORT.default
    db: int = REDIS_DB.default
    password: str | None = field(default=None, repr=False)
    gateway_id: str = "gateway"
    sync_interval_s: float = REDIS_SYNC_MS.default / 1000.0
    ttl_s: float = REDIS_TTL_MS.default / 1000.0
    shared_scrape: bool = SHARED_SCRAPE.default
    shared_prefix_index: bool = SHARED_PREFIX_INDEX.default


@dataclass(frozen=True, slots=True)
class OptimizerSettings:
    """How the GPU optimizer plans (`hetero-gateway optimizer`)."""

    port: int = OPTIMIZER_PORT.default
    lookback_s: int = OPTIMIZER_LOOKBACK_S.default
    headroom: float = OPTIMIZER_HEADROOM.default
    attainment: float = OPTIMIZER_ATTAINMENT.default
    scale_down_windows: int = OPTIMIZER_SCALE_DOWN_WINDOWS.default
    max_replicas: Mapping[str, int] = field(default_factory=dict)  # by name or namespace/name


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting, typed; the defaults are the declarations' (`load_settings({})` equals it)."""

    default_strategy: str = ROUTING_ALGORITHM.default
    auto_blend: AutoBlend = field(default_factory=AutoBlend)
    imbalance: ImbalanceSettings | None = field(default_factory=ImbalanceSettings)  # None: off
    load_balance: LoadBalanceSettings = field(default_factory=LoadBalanceSettings)
    slo: SloSettings = field(default_factory=SloSettings)
    prefix_cache: PrefixCacheSettings = field(default_factory=PrefixCacheSettings)
    max_waiting: int = MAX_WAITING.default
    admission: AdmissionSettings | None = None  # None: off
    metric_refresh_interval_s: float = METRIC_REFRESH_MS.default / 1000.0
    max_message_bytes: int = MAX_MESSAGE_BYTES.default
    max_request_headers: int = MAX_REQUEST_HEADERS.default
    auth_bearer_token: str | None = field(default=None, repr=False)  # never printed
    client_headers: HeaderPolicy = field(default_factory=HeaderPolicy)
    denied_header_action: str = DENIED_HEADER_ACTION.default
    pods_file: str | None = PODS_FILE.default
    grpc_port: int = GRPC_PORT.default
    http_port: int = HTTP_PORT.default
    workers: int = WORKERS.default
    scrape_timeout_s: float = SCRAPE_TIMEOUT_MS.default / 1000.0
    metrics_max_age_intervals: int = METRICS_MAX_AGE_INTERVALS.default
    capacity_window_s: float = CAPACITY_WINDOW_S.default
    capacity_tau_s: float = CAPACITY_TAU_S.default
    slow_start_s: float = SLOW_START_WINDOW_S.default
    slow_start_min: float = SLOW_START_MIN_PERCENT.default / 100.0
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    log_level: str = LOG_LEVEL.default
    drain_s: float = DRAIN_S.default
    discovery: str = DISCOVERY.default
    k8s_namespaces: tuple[str, ...] = K8S_NAMESPACE.default  # empty: every namespace
    k8s_label_selector: str = K8S_LABEL_SELECTOR.default
    deployment_label: str = DEPLOYMENT_LABEL.default
    profile_dir: str | None = PROFILE_DIR.default
    redis: RedisSettings | None = None  # None: state stays in this process
    tracing: bool = TRACING.default  # request traces for the GPU optimizer (needs redis)
    otel: bool = OTEL.default  # OpenTelemetry spans per request (the `otel` extra)
    pod_latency: bool = POD_LATENCY.default  # latency histograms per pod (else per GPU type)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)

    @property
    def metrics_max_age_s(self) -> float:
        return self.metric_refresh_interval_s * self.metrics_max_age_intervals

    def strategy_settings(self) -> tuple[object, ...]:
        """Every strategy's own settings object, for `build_strategies(*...)`."""
        return (self.load_balance, self.slo, self.prefix_cache)


def _load_balance_settings(env: Mapping[str, str]) -> LoadBalanceSettings:
    return LoadBalanceSettings(
        queued_weight=LB_QUEUED_WEIGHT.read(env),
        kv_pressure_alpha=LB_KV_PRESSURE_ALPHA.read(env),
        kv_critical_free=LB_KV_CRITICAL_FREE.read(env),
        avoid_full_batches=LB_AVOID_FULL_BATCHES.read(env),
    )


def _imbalance_settings(env: Mapping[str, str]) -> ImbalanceSettings | None:
    mode = IMBALANCE_GATE.read(env)
    if mode == "off":
        return None
    return ImbalanceSettings(
        min_gap=IMBALANCE_MIN_GAP.read(env),
        factor=IMBALANCE_FACTOR.read(env),
        capacity_aware=mode == "capacity",
    )


_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def _admission_settings(env: Mapping[str, str]) -> AdmissionSettings | None:
    """Admission's settings when it is on; a class, digest or weight that cannot be used stops
    start-up naming its variable."""
    tokens: dict[str, str] = {}
    for tenant, digest in TENANT_TOKENS.read(env):
        if not _DIGEST_RE.fullmatch(digest.lower()):
            raise ConfigError(
                f"{TENANT_TOKENS.name}: the digest of tenant {tenant!r} is not a SHA-256 in hex"
                " (64 characters; the token itself is never configured)"
            )
        tokens[digest.lower()] = tenant
    weights: dict[str, float] = {}
    for tenant, text in TENANT_WEIGHTS.read(env):
        weights[tenant] = _positive(TENANT_WEIGHTS.name, f"the weight of tenant {tenant!r}", text)
    names = PRIORITY_CLASSES.read(env) or PRIORITY_CLASSES.default
    for var in (TENANT_CLASSES, TENANT_MAY_ASK):
        unknown = [c for _, c in var.read(env) if c not in names]
        if unknown:
            raise ConfigError(
                f"{var.name}: {unknown[0]!r} is not a class of"
                f" {PRIORITY_CLASSES.name}={','.join(names)}"
            )
    class_waits: dict[str, float] = {}
    ceiling = ADMISSION_MAX_WAIT_MS.kind
    for name, text in CLASS_MAX_WAIT_MS.read(env):
        if name not in names:
            raise ConfigError(
                f"{CLASS_MAX_WAIT_MS.name}: {name!r} is not a class of"
                f" {PRIORITY_CLASSES.name}={','.join(names)}"
            )
        try:
            class_waits[name] = ceiling.parse(text) / 1000.0
        except Invalid as bad:
            raise ConfigError(f"{CLASS_MAX_WAIT_MS.name}: {name}:{text}{bad.tail}") from None
    header = TENANT_HEADER.read(env)
    limits = _limit_table(env)
    if limits and not ADMISSION.read(env):
        raise ConfigError(
            "tenant limits (HETERO_GATEWAY_TENANT_*_PER_MINUTE) need"
            f" {ADMISSION.name}=on: they are checked by admission"
        )
    settings = AdmissionSettings(
        tenancy=Tenancy(header.lower() if header else None, tokens),
        classes=ClassTable(
            names,
            dict(TENANT_CLASSES.read(env)),
            default=names[-1],
            may_ask=dict(TENANT_MAY_ASK.read(env)),
        ),
        weights=weights,
        max_wait_s=ADMISSION_MAX_WAIT_MS.read(env) / 1000.0,
        class_max_wait_s=class_waits,
        max_waiting=MAX_WAITING.read(env),
        limits=limits,
    )
    return settings if ADMISSION.read(env) else None


def _positive(name: str, what: str, text: str) -> float:
    """A table's value that must be a positive, finite number; else start-up stops."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name}: {what} is not a positive number: {text!r}")
    return value


_LIMIT_VARS = (TENANT_REQUESTS_PER_MINUTE, TENANT_TOKENS_PER_MINUTE, TENANT_GPU_SECONDS_PER_MINUTE)


def _limit_table(env: Mapping[str, str]) -> LimitTable:
    """Each tenant's limits a minute from the three tables (`*`: each tenant not named); a
    value that is not a positive number stops start-up naming its variable."""
    by_tenant: dict[str, list[float | None]] = {}
    for k, var in enumerate(_LIMIT_VARS):
        for tenant, text in var.read(env):
            value = _positive(var.name, f"the limit of {tenant!r}", text)
            by_tenant.setdefault(tenant, [None, None, None])[k] = value
    limits = {t: Limit(*values) for t, values in by_tenant.items()}
    every = limits.pop("*", None)
    return LimitTable(limits, every)


def _redis_settings(env: Mapping[str, str]) -> RedisSettings | None:
    host = REDIS_HOST.read(env)
    port = REDIS_PORT.read(env)
    sync_ms = REDIS_SYNC_MS.read(env)
    ttl_ms = REDIS_TTL_MS.read(env)
    if ttl_ms < 2 * sync_ms:
        raise ConfigError(
            f"{REDIS_TTL_MS.name}={ttl_ms} must be at least twice"
            f" {REDIS_SYNC_MS.name}={sync_ms}, or live gateways' entries expire"
        )
    password = REDIS_PASSWORD.read(env)
    db = REDIS_DB.read(env)
    name, namespace = POD_NAME.read(env), POD_NAMESPACE.read(env)
    shared_scrape = SHARED_SCRAPE.read(env)
    shared_prefix_index = SHARED_PREFIX_INDEX.read(env)
    if host is None:
        return None
    name = name or socket.gethostname() or "gateway"
    return RedisSettings(
        host=host,
        port=port,
        db=db,
        password=password,
        gateway_id=f"{namespace}/{name}" if namespace else name,
        sync_interval_s=sync_ms / 1000.0,
        ttl_s=ttl_ms / 1000.0,
        shared_scrape=shared_scrape,
        shared_prefix_index=shared_prefix_index,
    )


def _optimizer_settings(env: Mapping[str, str]) -> OptimizerSettings:
    lookback = OPTIMIZER_LOOKBACK_S.read(env)
    if lookback % 10:
        raise ConfigError(
            f"{OPTIMIZER_LOOKBACK_S.name}={lookback} must be a multiple of 10 (the trace window)"
        )
    return OptimizerSettings(
        port=OPTIMIZER_PORT.read(env),
        lookback_s=lookback,
        headroom=OPTIMIZER_HEADROOM.read(env),
        attainment=OPTIMIZER_ATTAINMENT.read(env),
        scale_down_windows=OPTIMIZER_SCALE_DOWN_WINDOWS.read(env),
        max_replicas=dict(OPTIMIZER_MAX_REPLICAS.read(env)),
    )


# A package that ships its own, older copies of OpenTelemetry's protos at opentelemetry-proto's
# import path (xds-protos does; the plugin no longer installs it: proto/README.md) breaks the
# OTLP exporter when pip installs it second (grpc/grpc#42926, open-telemetry/opentelemetry-python
# #4843: reinstalling opentelemetry-proto fixes it).
OTEL_PROTO_FIX = "pip install --force-reinstall --no-deps opentelemetry-proto"


def _otel(env: Mapping[str, str]) -> bool:
    on = OTEL.read(env)
    if on and importlib.util.find_spec("opentelemetry.sdk") is None:
        raise ConfigError(
            f"{OTEL.name}=true needs OpenTelemetry: pip install 'hetero-gateway[otel]'"
        )
    if on:
        try:
            importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
        except ImportError as exc:
            raise ConfigError(
                f"{OTEL.name}=true: the OTLP exporter does not import ({exc}); another package's"
                f" copies of OpenTelemetry's protos shadow opentelemetry-proto's: {OTEL_PROTO_FIX}"
            ) from None
    return on


def _tracing(env: Mapping[str, str], redis: RedisSettings | None) -> bool:
    on = TRACING.read(env)
    if on and redis is None:
        raise ConfigError(
            f"{TRACING.name}=true needs {REDIS_HOST.name}: the gateway writes its request traces"
            f" to Redis (set {REDIS_HOST.name}, or unset {TRACING.name})"
        )
    return on


def _ejection_policy(consecutive_5xx: int, base_s: float) -> EjectionPolicy:
    """Backoff doubles up to 60 s, or up to the base when an operator set a longer one."""
    return EjectionPolicy(
        consecutive_5xx=consecutive_5xx, base_s=base_s, max_s=max(_EJECT.max_s, base_s)
    )


def max_message_bytes(env: Mapping[str, str] | None = None) -> int:
    """AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES alone: `envoy-config` needs this one value, and a typo
    in an unrelated variable must not stop it."""
    return MAX_MESSAGE_BYTES.read(os.environ if env is None else env)


def max_request_headers(env: Mapping[str, str] | None = None) -> int:
    """HETERO_GATEWAY_MAX_REQUEST_HEADERS alone, for `envoy-config` (as `max_message_bytes`)."""
    return MAX_REQUEST_HEADERS.read(os.environ if env is None else env)


def _workers(env: Mapping[str, str]) -> int:
    workers = WORKERS.read(env)
    if workers > 1 and REDIS_HOST.read(env) is None:
        raise ConfigError(
            f"{WORKERS.name}={workers} needs {REDIS_HOST.name}: the workers share their in-flight"
            f" counts through Redis (set {REDIS_HOST.name}, or run one worker)"
        )
    if workers > 1 and GRPC_PORT.read(env) == 0:
        raise ConfigError(
            f"{WORKERS.name}={workers} needs a fixed {GRPC_PORT.name}: the workers share one port"
        )
    return workers


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every variable; raise ConfigError naming the first bad one."""
    env = os.environ if env is None else env
    for name, instead in REMOVED_VARS.items():
        if name in env:
            raise ConfigError(f"{name} is no longer read: {instead}")
    return Settings(
        default_strategy=ROUTING_ALGORITHM.read(env),
        imbalance=_imbalance_settings(env),
        auto_blend=AutoBlend(
            load_balance_weight=AUTO_BLEND_LB_WEIGHT.read(env),
            least_request_weight=AUTO_BLEND_LR_WEIGHT.read(env),
            prefix_cache_weight=AUTO_BLEND_PC_WEIGHT.read(env),
            prefix_cache_load_balance_weight=AUTO_BLEND_PC_LB_WEIGHT.read(env),
        ),
        load_balance=_load_balance_settings(env),
        prefix_cache=PrefixCacheSettings(
            block_chars=PC_BLOCK_SIZE.read(env), max_blocks=PC_BLOCK_NUMBER.read(env)
        ),
        metric_refresh_interval_s=METRIC_REFRESH_MS.read(env) / 1000.0,
        max_message_bytes=max_message_bytes(env),
        max_request_headers=max_request_headers(env),
        auth_bearer_token=AUTH_BEARER_TOKEN.read(env) or None,
        client_headers=CLIENT_HEADERS.read(env),
        denied_header_action=DENIED_HEADER_ACTION.read(env),
        pods_file=PODS_FILE.read(env),
        grpc_port=GRPC_PORT.read(env),
        http_port=HTTP_PORT.read(env),
        workers=_workers(env),
        scrape_timeout_s=SCRAPE_TIMEOUT_MS.read(env) / 1000.0,
        metrics_max_age_intervals=METRICS_MAX_AGE_INTERVALS.read(env),
        capacity_window_s=CAPACITY_WINDOW_S.read(env),
        capacity_tau_s=CAPACITY_TAU_S.read(env),
        slow_start_s=SLOW_START_WINDOW_S.read(env),
        slow_start_min=SLOW_START_MIN_PERCENT.read(env) / 100.0,
        ejection=_ejection_policy(EJECT_CONSECUTIVE_5XX.read(env), EJECT_BASE_S.read(env)),
        log_level=LOG_LEVEL.read(env),
        drain_s=DRAIN_S.read(env),
        discovery=DISCOVERY.read(env),
        k8s_namespaces=K8S_NAMESPACE.read(env),
        k8s_label_selector=K8S_LABEL_SELECTOR.read(env),
        slo=SloSettings(max_wait_s=SLO_MAX_WAIT_MS.read(env) / 1000.0),
        max_waiting=MAX_WAITING.read(env),
        admission=_admission_settings(env),
        deployment_label=DEPLOYMENT_LABEL.read(env),
        profile_dir=PROFILE_DIR.read(env),
        redis=(redis := _redis_settings(env)),
        tracing=_tracing(env, redis),
        otel=_otel(env),
        pod_latency=POD_LATENCY.read(env),
        optimizer=_optimizer_settings(env),
    )
