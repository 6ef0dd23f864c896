"""The one place that reads configuration.

Every knob is an environment variable (AIBrix's name where AIBrix has one); the `serve` flags
override the few that an operator sets per process. Values are validated at start-up: a bad one
raises `ConfigError` naming the variable, so the process never starts half-configured.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from plugin.core.pool import EjectionPolicy
from plugin.core.strategies import StrategyParams, strategy_names
from plugin.errors import ConfigError

T = TypeVar("T", int, float)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


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
)


@dataclass(frozen=True, slots=True)
class Settings:
    default_strategy: str = "load-balance"
    strategy: StrategyParams = field(default_factory=StrategyParams)
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


def _ejection_policy(consecutive_5xx: int, base_s: float) -> EjectionPolicy:
    """Backoff doubles up to 60 s, or up to the base when an operator set a longer one."""
    return EjectionPolicy(consecutive_5xx=consecutive_5xx, base_s=base_s, max_s=max(60.0, base_s))


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every variable; raise ConfigError naming the first bad one."""
    env = os.environ if env is None else env
    strategy = env.get("ROUTING_ALGORITHM", "").strip() or "load-balance"
    if strategy not in strategy_names():
        raise ConfigError(
            f"ROUTING_ALGORITHM={strategy!r} is not a known strategy "
            f"(known: {', '.join(sorted(strategy_names()))})"
        )
    params = StrategyParams(
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
    return Settings(
        default_strategy=strategy,
        strategy=params,
        metric_refresh_interval_s=refresh_ms / 1000.0,
        max_message_bytes=_parse(
            env,
            "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES",
            int,
            DEFAULT_MAX_MESSAGE_BYTES,
            lambda v: 0 < v < 2**31,
            "a positive integer number of bytes below 2^31",
        ),
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
    )
