"""The one place that reads configuration.

Every knob is an environment variable (AIBrix's name where AIBrix has one); the `serve` flags
override the few that an operator sets per process. Values are validated at start-up: a bad one
raises `ConfigError` naming the variable, so the process never starts half-configured.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from plugin.core.pool import EjectionPolicy
from plugin.core.strategies import LoadBalanceSettings, strategy_names
from plugin.errors import ConfigError

T = TypeVar("T", int, float)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DISCOVERY_KINDS = ("file", "kubernetes")
DEFAULT_K8S_LABEL_SELECTOR = "model.aibrix.ai/name"
DEFAULT_GPU_LABEL = "app.kubernetes.io/name"


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One documented variable: the README's table is generated from `ENV_VARS`."""

    name: str
    type: str
    default: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "ROUTING_ALGORITHM",
        "string",
        "load-balance",
        "Strategy used when a request has no `routing-strategy` header.",
    ),
    EnvVar(
        "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT",
        "float >= 0",
        "0",
        "lambda: weight of engine-queued requests in the load-balance score.",
    ),
    EnvVar(
        "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA",
        "float >= 0",
        "2.0",
        "alpha: strength of the KV-pressure penalty (1 + alpha * (1 - kvFree)^2).",
    ),
    EnvVar(
        "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE",
        "float in [0, 1]",
        "0.10",
        "Replicas with less free KV cache than this are passed over.",
    ),
    EnvVar(
        "HETERO_GATEWAY_LB_AVOID_FULL_BATCHES",
        "bool",
        "true",
        "load-balance passes over a replica whose engine batch is full (in flight >= the running"
        " count at which its engine kept a queue) while another has room; `false` is the"
        " reference algorithm (docs/benchmarks.md shows why).",
    ),
    EnvVar(
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS",
        "int > 0",
        "1000",
        "Engine metrics scrape period; capacity estimates refresh on the same tick.",
    ),
    EnvVar(
        "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES",
        "int > 0",
        str(DEFAULT_MAX_MESSAGE_BYTES),
        "Largest gRPC message (so request body) accepted; keep equal to Envoy's buffer limit.",
    ),
    EnvVar(
        "HETERO_GATEWAY_PODS_FILE",
        "path",
        "(none)",
        "Static pod discovery file (YAML); `serve --pods` overrides it.",
    ),
    EnvVar("HETERO_GATEWAY_GRPC_PORT", "int", "50052", "ext_proc gRPC port."),
    EnvVar(
        "HETERO_GATEWAY_HTTP_PORT",
        "int",
        "8080",
        "HTTP port for /metrics (Prometheus), /healthz, /readyz and /debug/pods.",
    ),
    EnvVar(
        "HETERO_GATEWAY_SCRAPE_TIMEOUT_MS",
        "int > 0",
        "500",
        "Timeout of one engine /metrics scrape.",
    ),
    EnvVar(
        "HETERO_GATEWAY_METRICS_MAX_AGE_INTERVALS",
        "int > 0",
        "3",
        "Engine metrics older than this many refresh intervals count as missing.",
    ),
    EnvVar(
        "HETERO_GATEWAY_CAPACITY_WINDOW_S",
        "float > 0",
        "60",
        "Window over which completed output tokens become a rate.",
    ),
    EnvVar(
        "HETERO_GATEWAY_CAPACITY_TAU_S",
        "float > 0",
        "10",
        "Time constant of the EWMA that smooths the capacity estimate.",
    ),
    EnvVar(
        "HETERO_GATEWAY_EJECT_CONSECUTIVE_5XX",
        "int > 0",
        "3",
        "Upstream 5xx in a row (503 from a dead engine included) that eject a pod from routing.",
    ),
    EnvVar(
        "HETERO_GATEWAY_EJECT_BASE_S",
        "float > 0",
        "5",
        "First ejection time; it doubles with each ejection in a row, up to 60 s.",
    ),
    EnvVar("HETERO_GATEWAY_LOG_LEVEL", "string", "INFO", "Python logging level."),
    EnvVar(
        "HETERO_GATEWAY_DRAIN_S",
        "float >= 0",
        "20",
        "On SIGTERM the plugin refuses new ext_proc streams, reports not ready (gRPC health and"
        " /readyz) and waits up to this long for in-flight requests to finish before closing"
        " them. Keep it below the pod's terminationGracePeriodSeconds.",
    ),
    EnvVar(
        "HETERO_GATEWAY_DISCOVERY",
        "`file` or `kubernetes`",
        "file",
        "Pod source: the YAML file, or pods listed and watched in the Kubernetes API"
        " (`serve --discovery`).",
    ),
    EnvVar(
        "HETERO_GATEWAY_K8S_NAMESPACE",
        "comma-separated list",
        "(all)",
        "Namespaces whose pods Kubernetes discovery watches; empty watches every namespace.",
    ),
    EnvVar(
        "HETERO_GATEWAY_K8S_LABEL_SELECTOR",
        "label selector",
        DEFAULT_K8S_LABEL_SELECTOR,
        "Which pods Kubernetes discovery lists; empty lists every pod in scope and keeps those"
        " naming a model by label or annotation.",
    ),
    EnvVar(
        "HETERO_GATEWAY_GPU_LABEL",
        "label key",
        DEFAULT_GPU_LABEL,
        "Pod label whose value names the GPU type (shown as `gpu` in /debug/pods and"
        " `hetero_gateway_pod_info`).",
    ),
    EnvVar(
        "REDIS_HOST",
        "host",
        "(none)",
        "Redis for state shared by several gateway replicas; unset keeps all state in the process.",
    ),
    EnvVar("REDIS_PORT", "int", "6379", "Redis port."),
    EnvVar("REDIS_PASSWORD", "string", "(none)", "Redis password (AUTH)."),
    EnvVar(
        "POD_NAME",
        "string",
        "(hostname)",
        "This gateway's name in the shared state; must differ between replicas.",
    ),
    EnvVar(
        "POD_NAMESPACE",
        "string",
        "(none)",
        "Namespace of this gateway; when set, its shared-state name is `POD_NAMESPACE/POD_NAME`.",
    ),
    EnvVar(
        "HETERO_GATEWAY_REDIS_SYNC_MS",
        "int > 0",
        "100",
        "Period of the shared-state sync: publish local in-flight counts and token counts, read"
        " everyone's (no Redis call on the request path).",
    ),
    EnvVar(
        "HETERO_GATEWAY_REDIS_TTL_MS",
        "int >= 2 x sync",
        "2000",
        "Expiry of a gateway's published in-flight counts: a gateway that stops publishing drops"
        " out of the others' view this long after its last sync.",
    ),
)


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where shared state lives and how this gateway takes part in it."""

    host: str
    port: int = 6379
    password: str | None = field(default=None, repr=False)
    gateway_id: str = "gateway"
    sync_interval_s: float = 0.1
    ttl_s: float = 2.0


@dataclass(frozen=True, slots=True)
class Settings:
    default_strategy: str = "load-balance"
    strategy: LoadBalanceSettings = field(default_factory=LoadBalanceSettings)
    metric_refresh_interval_s: float = 1.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    pods_file: str | None = None
    grpc_port: int = 50052
    http_port: int = 8080
    scrape_timeout_s: float = 0.5
    metrics_max_age_intervals: int = 3
    capacity_window_s: float = 60.0
    capacity_tau_s: float = 10.0
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    log_level: str = "INFO"
    drain_s: float = 20.0
    discovery: str = "file"
    k8s_namespaces: tuple[str, ...] = ()  # empty: every namespace
    k8s_label_selector: str = DEFAULT_K8S_LABEL_SELECTOR
    gpu_label: str = DEFAULT_GPU_LABEL
    redis: RedisSettings | None = None  # None: state stays in this process

    @property
    def metrics_max_age_s(self) -> float:
        return self.metric_refresh_interval_s * self.metrics_max_age_intervals


def _parse(
    env: Mapping[str, str],
    name: str,
    conv: Callable[[str], T],
    default: T,
    ok: Callable[[T], bool],
    expect: str,
) -> T:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = conv(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {expect}") from None
    if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
        raise ConfigError(f"{name}={raw!r} is not {expect}")
    return value


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (true/false)")


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    return _parse(env, name, int, default, lambda v: 0 <= v <= 65535, "a port (0-65535)")


# A DNS-1123 label, as Kubernetes namespaces are.
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# A label key: optional DNS prefix and "/", then a name of at most 63 characters.
_LABEL_KEY_RE = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def _namespaces(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = env.get(name, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for n in names:
        if not _NAMESPACE_RE.fullmatch(n):
            raise ConfigError(f"{name}={raw!r}: {n!r} is not a Kubernetes namespace name")
    return tuple(dict.fromkeys(names))


def _redis_settings(env: Mapping[str, str]) -> RedisSettings | None:
    port = _parse(env, "REDIS_PORT", int, 6379, lambda v: 0 < v < 65536, "a port (1-65535)")
    sync_ms = _parse(
        env,
        "HETERO_GATEWAY_REDIS_SYNC_MS",
        int,
        100,
        lambda v: v > 0,
        "a positive integer (milliseconds)",
    )
    ttl_ms = _parse(
        env,
        "HETERO_GATEWAY_REDIS_TTL_MS",
        int,
        2000,
        lambda v: v > 0,
        "a positive integer (milliseconds)",
    )
    if ttl_ms < 2 * sync_ms:
        raise ConfigError(
            f"HETERO_GATEWAY_REDIS_TTL_MS={ttl_ms} must be at least twice"
            f" HETERO_GATEWAY_REDIS_SYNC_MS={sync_ms}, or live gateways' entries expire"
        )
    host = env.get("REDIS_HOST", "").strip()
    if not host:
        return None
    if any(c.isspace() or c == "/" for c in host):
        raise ConfigError(f"REDIS_HOST={host!r} is not a host name or address")
    if ":" in host and not _is_ipv6(host):
        raise ConfigError(f"REDIS_HOST={host!r}: give the host alone; the port goes in REDIS_PORT")
    name = env.get("POD_NAME", "").strip() or socket.gethostname() or "gateway"
    namespace = env.get("POD_NAMESPACE", "").strip()
    return RedisSettings(
        host=host,
        port=port,
        password=env.get("REDIS_PASSWORD") or None,
        gateway_id=f"{namespace}/{name}" if namespace else name,
        sync_interval_s=sync_ms / 1000.0,
        ttl_s=ttl_ms / 1000.0,
    )


def _ejection_policy(consecutive_5xx: int, base_s: float) -> EjectionPolicy:
    """Backoff doubles up to 60 s, or up to the base when an operator set a longer one."""
    return EjectionPolicy(consecutive_5xx=consecutive_5xx, base_s=base_s, max_s=max(60.0, base_s))


def max_message_bytes(env: Mapping[str, str] | None = None) -> int:
    """AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES alone: `envoy-config` needs this one value, and a typo
    in an unrelated variable must not stop it."""
    return _parse(
        os.environ if env is None else env,
        "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES",
        int,
        DEFAULT_MAX_MESSAGE_BYTES,
        lambda v: 0 < v < 2**31,
        "a positive integer number of bytes below 2^31",
    )


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every variable; raise ConfigError naming the first bad one."""
    env = os.environ if env is None else env
    strategy = env.get("ROUTING_ALGORITHM", "").strip() or "load-balance"
    if strategy not in strategy_names():
        raise ConfigError(
            f"ROUTING_ALGORITHM={strategy!r} is not a known strategy "
            f"(known: {', '.join(sorted(strategy_names()))})"
        )
    params = LoadBalanceSettings(
        queued_weight=_parse(
            env, "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT", float, 0.0, lambda v: v >= 0, "a number >= 0"
        ),
        kv_pressure_alpha=_parse(
            env,
            "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA",
            float,
            2.0,
            lambda v: v >= 0,
            "a number >= 0",
        ),
        kv_critical_free=_parse(
            env,
            "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE",
            float,
            0.10,
            lambda v: 0 <= v <= 1,
            "a number in [0, 1]",
        ),
        avoid_full_batches=_bool(env, "HETERO_GATEWAY_LB_AVOID_FULL_BATCHES", True),
    )
    refresh_ms = _parse(
        env,
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS",
        int,
        1000,
        lambda v: v > 0,
        "a positive integer (milliseconds)",
    )
    level = env.get("HETERO_GATEWAY_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ConfigError(f"HETERO_GATEWAY_LOG_LEVEL={level!r} is not a logging level")
    drain_s = _parse(
        env, "HETERO_GATEWAY_DRAIN_S", float, 20.0, lambda v: 0 <= v <= 3600, "seconds in [0, 3600]"
    )
    return Settings(
        drain_s=drain_s,
        default_strategy=strategy,
        strategy=params,
        metric_refresh_interval_s=refresh_ms / 1000.0,
        max_message_bytes=max_message_bytes(env),
        pods_file=env.get("HETERO_GATEWAY_PODS_FILE") or None,
        grpc_port=_port(env, "HETERO_GATEWAY_GRPC_PORT", 50052),
        http_port=_port(env, "HETERO_GATEWAY_HTTP_PORT", 8080),
        scrape_timeout_s=_parse(
            env,
            "HETERO_GATEWAY_SCRAPE_TIMEOUT_MS",
            int,
            500,
            lambda v: v > 0,
            "a positive integer (milliseconds)",
        )
        / 1000.0,
        metrics_max_age_intervals=_parse(
            env,
            "HETERO_GATEWAY_METRICS_MAX_AGE_INTERVALS",
            int,
            3,
            lambda v: v > 0,
            "a positive integer",
        ),
        capacity_window_s=_parse(
            env,
            "HETERO_GATEWAY_CAPACITY_WINDOW_S",
            float,
            60.0,
            lambda v: v > 0,
            "a positive number (seconds)",
        ),
        capacity_tau_s=_parse(
            env,
            "HETERO_GATEWAY_CAPACITY_TAU_S",
            float,
            10.0,
            lambda v: v > 0,
            "a positive number (seconds)",
        ),
        ejection=_ejection_policy(
            consecutive_5xx=_parse(
                env,
                "HETERO_GATEWAY_EJECT_CONSECUTIVE_5XX",
                int,
                3,
                lambda v: v > 0,
                "a positive integer",
            ),
            base_s=_parse(
                env,
                "HETERO_GATEWAY_EJECT_BASE_S",
                float,
                5.0,
                lambda v: v > 0,
                "a positive number (seconds)",
            ),
        ),
        log_level=level,
        discovery=_choice(env, "HETERO_GATEWAY_DISCOVERY", DISCOVERY_KINDS, "file"),
        k8s_namespaces=_namespaces(env, "HETERO_GATEWAY_K8S_NAMESPACE"),
        k8s_label_selector=_label_selector(env, "HETERO_GATEWAY_K8S_LABEL_SELECTOR"),
        gpu_label=_label_key(env, "HETERO_GATEWAY_GPU_LABEL", DEFAULT_GPU_LABEL),
        redis=_redis_settings(env),
    )


_LABEL_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_SELECTOR_TERM_RE = re.compile(
    rf"\s*(?:!\s*(?P<absent>\S+)"
    rf"|(?P<key>[^\s!=,()]+)\s*(?:(?:==|=|!=)\s*{_LABEL_VALUE}"
    rf"|\s(?:in|notin)\s*\(\s*{_LABEL_VALUE}(?:\s*,\s*{_LABEL_VALUE})*\s*\))?)\s*"
)


def _label_selector(env: Mapping[str, str], name: str) -> str:
    """Kubernetes' label selector syntax (`a`, `!a`, `a=b`, `a!=b`, `a in (b,c)`, `a notin (b)`,
    joined by commas): a typo must stop start-up, not turn into an endless retry of HTTP 400s.
    Empty is allowed and means every pod in scope."""
    value = env.get(name, DEFAULT_K8S_LABEL_SELECTOR).strip()
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(value):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            terms.append(value[start:i])
            start = i + 1
    if value:
        terms.append(value[start:])
    for term in terms:
        match = _SELECTOR_TERM_RE.fullmatch(term)
        key = match and (match.group("absent") or match.group("key"))
        if not match or not key or len(key) > 317 or not _LABEL_KEY_RE.fullmatch(key):
            raise ConfigError(f"{name}={value!r}: {term.strip()!r} is not a label selector term")
    return value


def _label_key(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "").strip() or default
    if len(value) > 317 or not _LABEL_KEY_RE.fullmatch(value):
        raise ConfigError(f"{name}={value!r} is not a Kubernetes label key")
    return value
