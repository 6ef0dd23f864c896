"""Configuration: defaults, overrides, a clear error naming each bad variable, and the one
declaration per variable that validation, the flags' help and the README's table come from."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import plugin.config as config
from plugin.config import (
    ENV_VARS,
    README_TABLE_BEGIN,
    README_TABLE_END,
    Choice,
    Float,
    Int,
    RedisSettings,
    Settings,
    Var,
    load_settings,
    max_message_bytes,
)
from plugin.core.header_policy import HeaderPolicy
from plugin.core.limits import Limit
from plugin.core.pool import EjectionPolicy
from plugin.core.strategies import LoadBalanceSettings, settings_type, strategy_names
from plugin.errors import ConfigError
from tests.helpers import REPO

pytestmark = pytest.mark.unit

CONFIGURATION_DOC = REPO / "docs" / "configuration.md"


def test_defaults() -> None:
    s = load_settings({})
    assert s.default_strategy == "load-balance"
    assert (
        s.load_balance.queued_weight,
        s.load_balance.kv_pressure_alpha,
        s.load_balance.kv_critical_free,
    ) == (0.0, 2.0, 0.10)
    assert s.metric_refresh_interval_s == 1.0
    assert s.max_message_bytes == 4 * 1024 * 1024
    assert (s.grpc_port, s.http_port) == (50052, 8080)


def test_overrides() -> None:
    s = load_settings(
        {
            "ROUTING_ALGORITHM": "least-request",
            "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT": "0.5",
            "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA": "3",
            "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE": "0.2",
            "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "250",
            "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES": "1048576",
            "HETERO_GATEWAY_METRICS_MAX_AGE_INTERVALS": "4",
        }
    )
    assert s.default_strategy == "least-request"
    assert s.load_balance.queued_weight == 0.5
    assert s.load_balance.kv_pressure_alpha == 3.0
    assert s.load_balance.kv_critical_free == 0.2
    assert s.metric_refresh_interval_s == 0.25
    assert s.metrics_max_age_s == pytest.approx(1.0)
    assert s.max_message_bytes == 1048576


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ROUTING_ALGORITHM", "fastest"),
        ("AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT", "-1"),
        ("AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA", "abc"),
        ("AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA", "nan"),
        ("AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE", "1.5"),
        ("AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS", "0"),
        ("AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES", "4MiB"),
        ("HETERO_GATEWAY_GRPC_PORT", "70000"),
        ("HETERO_GATEWAY_CAPACITY_TAU_S", "inf"),
        ("HETERO_GATEWAY_LOG_LEVEL", "LOUD"),
    ],
)
def test_bad_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings({name: value})


def test_every_declared_variable_is_listed_once() -> None:
    declared = [v for v in vars(config.variables).values() if isinstance(v, Var)]
    assert sorted(v.name for v in declared) == sorted(v.name for v in ENV_VARS)
    assert len({v.name for v in ENV_VARS}) == len(ENV_VARS)


def test_the_configuration_doc_documents_every_variable() -> None:
    readme = CONFIGURATION_DOC.read_text(encoding="utf-8")
    for var in ENV_VARS:
        assert f"| `{var.name}` |" in readme, var.name


@pytest.mark.parametrize(
    ("raw", "expected"), [(None, True), ("false", False), ("0", False), ("TRUE", True)]
)
def test_avoid_full_batches_switch(raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {"HETERO_GATEWAY_LB_AVOID_FULL_BATCHES": raw}
    assert load_settings(env).load_balance.avoid_full_batches is expected


def test_avoid_full_batches_rejects_a_non_boolean() -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_LB_AVOID_FULL_BATCHES"):
        load_settings({"HETERO_GATEWAY_LB_AVOID_FULL_BATCHES": "maybe"})


# --- discovery, GPU label and shared state ------------------------------------------------------


def test_discovery_and_shared_state_defaults() -> None:
    s = load_settings({})
    assert s.discovery == "file"
    assert s.k8s_namespaces == ()
    assert s.k8s_label_selector == "model.aibrix.ai/name"
    assert s.deployment_label == "app.kubernetes.io/name"  # also names the GPU type
    assert s.redis is None  # no REDIS_HOST: state stays in the process


def test_kubernetes_discovery_settings() -> None:
    s = load_settings(
        {
            "HETERO_GATEWAY_DISCOVERY": "Kubernetes",
            "HETERO_GATEWAY_K8S_NAMESPACE": " team-a, team-b ,team-a,",
            "HETERO_GATEWAY_K8S_LABEL_SELECTOR": "model.aibrix.ai/name,tier=gpu",
            "AIBRIX_POD_DEPLOYMENT_LABEL": "nvidia.com/gpu.product",
        }
    )
    assert s.discovery == "kubernetes"
    assert s.k8s_namespaces == ("team-a", "team-b")
    assert s.k8s_label_selector == "model.aibrix.ai/name,tier=gpu"
    assert s.deployment_label == "nvidia.com/gpu.product"


def test_redis_settings_and_gateway_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(
        {
            "REDIS_HOST": "redis.infra",
            "REDIS_PORT": "6380",
            "REDIS_PASSWORD": "secret",
            "POD_NAME": "gw-0",
            "POD_NAMESPACE": "hetero-gateway",
            "HETERO_GATEWAY_REDIS_SYNC_MS": "50",
            "HETERO_GATEWAY_REDIS_TTL_MS": "1000",
        }
    )
    assert s.redis == RedisSettings(
        host="redis.infra",
        port=6380,
        password="secret",
        gateway_id="hetero-gateway/gw-0",
        sync_interval_s=0.05,
        ttl_s=1.0,
    )
    assert "secret" not in repr(s)  # a logged Settings does not leak the password

    monkeypatch.setattr("socket.gethostname", lambda: "host-7")
    s = load_settings({"REDIS_HOST": "10.0.0.5"})
    assert s.redis is not None
    assert (s.redis.port, s.redis.password, s.redis.gateway_id) == (6379, None, "host-7")
    assert (s.redis.sync_interval_s, s.redis.ttl_s) == (0.1, 2.0)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"HETERO_GATEWAY_DISCOVERY": "consul"}, "HETERO_GATEWAY_DISCOVERY"),
        ({"HETERO_GATEWAY_K8S_NAMESPACE": "Team_A"}, "HETERO_GATEWAY_K8S_NAMESPACE"),
        ({"HETERO_GATEWAY_GPU_LABEL": "gpu"}, "HETERO_GATEWAY_GPU_LABEL"),  # merged, refused
        ({"REDIS_HOST": "r", "REDIS_PORT": "0"}, "REDIS_PORT"),
        ({"REDIS_PORT": "redis"}, "REDIS_PORT"),
        ({"REDIS_HOST": "a b"}, "REDIS_HOST"),
        ({"HETERO_GATEWAY_REDIS_SYNC_MS": "0"}, "HETERO_GATEWAY_REDIS_SYNC_MS"),
        ({"HETERO_GATEWAY_REDIS_TTL_MS": "-1"}, "HETERO_GATEWAY_REDIS_TTL_MS"),
        (
            {"HETERO_GATEWAY_REDIS_SYNC_MS": "100", "HETERO_GATEWAY_REDIS_TTL_MS": "150"},
            "HETERO_GATEWAY_REDIS_TTL_MS",
        ),
    ],
    ids=[
        "unknown-discovery",
        "namespace-not-dns",
        "label-with-space",
        "redis-port-zero",
        "redis-port-word",
        "redis-host-space",
        "sync-zero",
        "ttl-negative",
        "ttl-below-two-syncs",
    ],
)
def test_bad_discovery_or_redis_value_names_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_settings(env)


def test_drain_seconds() -> None:
    assert load_settings({}).drain_s == 20.0
    assert load_settings({"HETERO_GATEWAY_DRAIN_S": "2.5"}).drain_s == 2.5
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_DRAIN_S"):
        load_settings({"HETERO_GATEWAY_DRAIN_S": "-1"})


@pytest.mark.parametrize("host", ["redis:6379", "10.0.0.5:6379"])
def test_redis_host_with_a_port_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="REDIS_PORT"):
        load_settings({"REDIS_HOST": host})


def test_tracing_is_off_by_default_and_on_with_redis() -> None:
    assert load_settings({}).tracing is False
    on = load_settings({"AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": "true", "REDIS_HOST": "redis"})
    assert on.tracing is True
    assert on.redis is not None


@pytest.mark.parametrize("value", ["true", "1", "on"])
def test_tracing_without_redis_stops_start_up_naming_both(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": value})
    assert "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG" in str(info.value)
    assert "REDIS_HOST" in str(info.value)


def test_redis_host_may_be_an_ipv6_address() -> None:
    settings = load_settings({"REDIS_HOST": "fd00::5"})
    assert settings.redis is not None and settings.redis.host == "fd00::5"


@pytest.mark.parametrize(
    "selector",
    ["model.aibrix.ai/name", "", "app=vllm,tier!=canary", "env in (prod, staging),!legacy", "a==b"],
    ids=["default", "every-pod", "equality", "set-and-absence", "double-equals"],
)
def test_label_selector_syntax_is_accepted(selector: str) -> None:
    env = {"HETERO_GATEWAY_K8S_LABEL_SELECTOR": selector}
    assert load_settings(env).k8s_label_selector == selector


@pytest.mark.parametrize(
    "selector", ["x in (a b", "=b", "a=b c", "!", "bad key=1", "a=-b"], ids=str
)
def test_a_malformed_label_selector_stops_start_up(selector: str) -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_K8S_LABEL_SELECTOR"):
        load_settings({"HETERO_GATEWAY_K8S_LABEL_SELECTOR": selector})


# --- one declaration per variable -----------------------------------------------------------------

VARS = {v.name: v for v in ENV_VARS}
PLACEHOLDERS = {"(none)", "(all)", "(hostname)"}  # defaults shown as words, not as values

# At least one refused value per variable (free text takes anything, so it has none): the
# declared bounds, tested from outside the declarations.
BAD_VALUES: dict[str, tuple[str, ...]] = {
    "ROUTING_ALGORITHM": (
        "fastest",
        "Load-Balance",
        "load-balance:-1",
        "load-balance:1.5",
        "load-balance:0",
        "least-request,least-request",
        "least-request,,load-balance",
        "load-balance:1000001",
    ),
    "AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT": ("1.5", "1000001", "x"),
    "HETERO_GATEWAY_IMBALANCE_GATE": ("raw", "on"),
    "AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP": ("-1", "nan", "x"),
    "AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR": ("-0.5", "inf"),
    "AIBRIX_PREFIX_CACHE_BLOCK_SIZE": ("0", "1.5", str(2**20 + 1)),
    "AIBRIX_PREFIX_CACHE_BLOCK_NUMBER": ("0", "-5", "many"),
    "AIBRIX_ROUTING_AUTO_BLEND_LEAST_REQUEST_WEIGHT": ("-1", "1000001"),
    "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_WEIGHT": ("-1", "1.5"),
    "AIBRIX_ROUTING_AUTO_BLEND_PREFIX_CACHE_LOAD_BALANCE_WEIGHT": ("-1", "x"),
    "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT": ("-0.001", "nan", "x"),
    "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA": ("-1", "inf"),
    "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE": ("-0.1", "1.01"),
    "HETERO_GATEWAY_LB_AVOID_FULL_BATCHES": ("maybe", "2"),
    "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": ("0", "-1", "1.5"),
    "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES": ("0", str(2**31), "4MiB"),
    "HETERO_GATEWAY_MAX_REQUEST_HEADERS": ("15", "10001", "lots"),
    "HETERO_GATEWAY_CLIENT_HEADERS": ("model=deny", "routing-strategy", "routing-strategy=nope"),
    "HETERO_GATEWAY_DENIED_HEADER_ACTION": ("drop", "403"),
    "HETERO_GATEWAY_GRPC_PORT": ("-1", "65536", "http"),
    "HETERO_GATEWAY_HTTP_PORT": ("-1", "65536"),
    "HETERO_GATEWAY_WORKERS": ("0", "65", "2.5", "two"),
    "HETERO_GATEWAY_SCRAPE_TIMEOUT_MS": ("0", "0.5"),
    "HETERO_GATEWAY_METRICS_MAX_AGE_INTERVALS": ("0", "1.5"),
    "HETERO_GATEWAY_CAPACITY_WINDOW_S": ("0", "-inf"),
    "HETERO_GATEWAY_CAPACITY_TAU_S": ("0", "nan"),
    "HETERO_GATEWAY_SLOW_START_WINDOW_S": ("-1", "3601", "soon"),
    "HETERO_GATEWAY_SLOW_START_MIN_PERCENT": ("0", "100.5", "-2"),
    "HETERO_GATEWAY_EJECT_CONSECUTIVE_5XX": ("0", "three"),
    "HETERO_GATEWAY_EJECT_BASE_S": ("0", "-5"),
    "HETERO_GATEWAY_LOG_LEVEL": ("LOUD", "TRACE"),
    "HETERO_GATEWAY_DRAIN_S": ("-0.5", "3600.5"),
    "HETERO_GATEWAY_DISCOVERY": ("consul",),
    "HETERO_GATEWAY_K8S_NAMESPACE": ("Team_A", "ok,-bad"),
    "HETERO_GATEWAY_K8S_LABEL_SELECTOR": ("a=b c",),
    "AIBRIX_POD_DEPLOYMENT_LABEL": ("gpu type", "/name"),
    "HETERO_GATEWAY_SLO_MAX_WAIT_MS": ("0", "59001", "x"),
    "HETERO_GATEWAY_MAX_WAITING": ("0", "-1", "many"),
    "HETERO_GATEWAY_ADMISSION": ("maybe",),
    "HETERO_GATEWAY_TENANT_TOKENS": ("alice", "alice:", "al ice:ab", "a:1,a:2"),
    "HETERO_GATEWAY_PRIORITY_CLASSES": ("a,a", "in teractive"),
    "HETERO_GATEWAY_TENANT_CLASSES": ("chat", ":batch"),
    "HETERO_GATEWAY_TENANT_MAY_ASK": ("chat=interactive",),
    "HETERO_GATEWAY_TENANT_WEIGHTS": ("a", "a:1,a:2"),
    "HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS": ("0", "59001", "x"),
    "HETERO_GATEWAY_CLASS_MAX_WAIT_MS": ("batch", "batch:", "a b:1"),
    "HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE": ("a", "a:1,a:2", "**:1"),
    "HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE": ("a:", "a b:1"),
    "HETERO_GATEWAY_TENANT_GPU_SECONDS_PER_MINUTE": ("*", ":1"),
    "REDIS_DB": ("-1", "x", "1.5"),
    "REDIS_HOST": ("a b", "redis/0", "redis:6379"),
    "REDIS_PORT": ("0", "65536"),
    "HETERO_GATEWAY_REDIS_SYNC_MS": ("0",),
    "HETERO_GATEWAY_REDIS_TTL_MS": ("-1", "0"),
    "AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": ("maybe", "2"),
    "HETERO_GATEWAY_SHARED_SCRAPE": ("maybe", "2"),
    "HETERO_GATEWAY_SHARED_PREFIX_INDEX": ("maybe", "2"),
    "HETERO_GATEWAY_OTEL": ("maybe", "2"),
    "HETERO_GATEWAY_POD_LATENCY": ("maybe", "2"),
    "HETERO_GATEWAY_OPTIMIZER_PORT": ("-1", "65536"),
    "HETERO_GATEWAY_OPTIMIZER_LOOKBACK_S": ("5", "610", "1.5"),
    "HETERO_GATEWAY_OPTIMIZER_HEADROOM": ("0.99", "nan", "x"),
    "HETERO_GATEWAY_OPTIMIZER_ATTAINMENT": ("0", "1.01", "-0.5", "nan"),
    "HETERO_GATEWAY_OPTIMIZER_SCALE_DOWN_WINDOWS": ("0", "361"),
    "HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS": ("a100", "a100=-1", "A100=2", "a/b/c=1", "a=x"),
}
FREE_TEXT = {
    "HETERO_GATEWAY_TENANT_HEADER",  # any header name
    "HETERO_GATEWAY_PODS_FILE",
    "HETERO_GATEWAY_PROFILE_DIR",  # checked when the gateway starts (a directory)
    "REDIS_PASSWORD",
    "AIBRIX_AUTH_BEARER_TOKEN",
    "POD_NAME",
    "POD_NAMESPACE",
}

# Values on a bound that is inclusive: accepted, and read as given.
EDGE_VALUES: list[tuple[str, str, Any]] = [
    ("AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT", "0", 0.0),
    ("AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE", "0", 0.0),
    ("AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE", "1", 1.0),
    ("AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES", "1", 1),
    ("AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES", str(2**31 - 1), 2**31 - 1),
    ("HETERO_GATEWAY_GRPC_PORT", "0", 0),
    ("HETERO_GATEWAY_HTTP_PORT", "65535", 65535),
    ("HETERO_GATEWAY_DRAIN_S", "0", 0.0),
    ("HETERO_GATEWAY_DRAIN_S", "3600", 3600.0),
    ("REDIS_PORT", "1", 1),
    ("HETERO_GATEWAY_LOG_LEVEL", " debug ", "DEBUG"),
    ("HETERO_GATEWAY_DISCOVERY", "KUBERNETES", "kubernetes"),
    ("HETERO_GATEWAY_LB_AVOID_FULL_BATCHES", "off", False),
    ("HETERO_GATEWAY_K8S_LABEL_SELECTOR", "  ", ""),  # set but blank: every pod in scope
    ("REDIS_PASSWORD", " pass word ", " pass word "),  # a password keeps its spaces
    ("HETERO_GATEWAY_OPTIMIZER_LOOKBACK_S", "600", 600),
    ("HETERO_GATEWAY_OPTIMIZER_HEADROOM", "1", 1.0),
    ("HETERO_GATEWAY_OPTIMIZER_ATTAINMENT", "1", 1.0),
    ("HETERO_GATEWAY_OPTIMIZER_MAX_REPLICAS", " a100=0 , ", (("a100", 0),)),
]


def test_names_are_unique_and_every_variable_is_in_the_table() -> None:
    assert len(VARS) == len(ENV_VARS)
    assert set(BAD_VALUES) | FREE_TEXT == set(VARS), set(VARS) ^ (set(BAD_VALUES) | FREE_TEXT)
    assert not set(BAD_VALUES) & FREE_TEXT


@pytest.mark.parametrize("var", ENV_VARS, ids=lambda v: v.name)
def test_unset_or_blank_reads_the_default(var: Var[Any]) -> None:
    assert var.read({}) == var.default
    if not var.kind.blank_is_value:
        assert var.read({var.name: ""}) == var.default


@pytest.mark.parametrize("var", ENV_VARS, ids=lambda v: v.name)
def test_the_shown_default_parses_to_the_default(var: Var[Any]) -> None:
    # The README's default column is what the variable means when unset: setting it to that
    # text changes nothing, for the variable and for the whole configuration.
    if var.default_text in PLACEHOLDERS:
        assert var.default is None or var.default == () or var.default == HeaderPolicy()
        return
    assert var.read({var.name: var.default_text}) == var.default
    assert load_settings({var.name: var.default_text}) == load_settings({})


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, values in BAD_VALUES.items() for value in values],
)
def test_an_out_of_bounds_value_is_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}=") as info:
        VARS[name].read({name: value})
    assert repr(value) in str(info.value)
    with pytest.raises(ConfigError, match=f"^{name}="):
        load_settings({name: value})


@pytest.mark.parametrize(("name", "value", "expected"), EDGE_VALUES)
def test_a_value_on_an_inclusive_bound_is_accepted(name: str, value: str, expected: Any) -> None:
    assert VARS[name].read({name: value}) == expected


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE",
            "1.5",
            "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE='1.5' is not a number in [0, 1]",
        ),
        (
            "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS",
            "0",
            "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS='0' is not an integer > 0 (milliseconds)",
        ),
        ("HETERO_GATEWAY_GRPC_PORT", "70000", "HETERO_GATEWAY_GRPC_PORT='70000' is not a port in"),
        ("HETERO_GATEWAY_LB_AVOID_FULL_BATCHES", "maybe", "is not a boolean (true/false)"),
        ("HETERO_GATEWAY_DISCOVERY", "consul", "is not one of file, kubernetes"),
        (
            "ROUTING_ALGORITHM",
            "fastest",
            "names an unknown strategy fastest (known: ",
        ),
        ("ROUTING_ALGORITHM", "least-request:x", "weight of least-request must be an integer"),
        ("ROUTING_ALGORITHM", "random:0", "gives every strategy weight 0"),
        ("REDIS_HOST", "redis:6379", "give the host alone; the port goes in REDIS_PORT"),
    ],
)
def test_the_message_says_what_was_expected(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({name: value})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        (Int(gt=0), "int > 0"),
        (Int(ge=0, le=65535), "int in [0, 65535]"),
        (Float(ge=0), "float >= 0"),
        (Float(gt=0, le=1), "float in (0, 1]"),
        (Float(le=2.5), "float <= 2.5"),
        (Choice(("file", "kubernetes")), "`file` or `kubernetes`"),
        (Choice(("a", "b", "c")), "`a`, `b` or `c`"),
    ],
)
def test_the_type_text_comes_from_the_kind(kind: Any, text: str) -> None:
    assert kind.type_text == text


def test_settings_defaults_are_the_declared_defaults() -> None:
    assert Settings() == load_settings({})
    assert Settings().load_balance == LoadBalanceSettings()
    assert load_settings({}).ejection == EjectionPolicy()


class RecordingEnv(Mapping[str, str]):
    """An environment that remembers which variables were looked up."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.data = dict(values)
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("configuration must look variables up by name, not list them")

    def __len__(self) -> int:
        return len(self.data)


def test_load_settings_reads_exactly_the_declared_variables() -> None:
    # Read <=> declared: no hidden knob, and no declared variable that does nothing; a removed
    # variable is looked at only to refuse it.
    env = RecordingEnv({})
    load_settings(env)
    expected = set(VARS) | set(config.REMOVED_VARS)
    assert env.asked == expected, env.asked ^ expected


def test_max_message_bytes_reads_only_its_variable() -> None:
    env = RecordingEnv({"AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES": "1024", "REDIS_HOST": "a:1"})
    assert max_message_bytes(env) == 1024
    assert env.asked == {"AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES"}
    with pytest.raises(ConfigError, match="AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES"):
        max_message_bytes({"AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES": str(2**31)})


@pytest.mark.parametrize(("base", "max_s"), [("5", 60.0), ("60", 60.0), ("90", 90.0)])
def test_ejection_backoff_caps_at_60_s_or_the_base(base: str, max_s: float) -> None:
    policy = load_settings({"HETERO_GATEWAY_EJECT_BASE_S": base}).ejection
    assert (policy.base_s, policy.max_s) == (float(base), max_s)


def test_redis_ttl_is_checked_against_the_sync_even_without_redis() -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_REDIS_TTL_MS=199 must be at least"):
        load_settings({"HETERO_GATEWAY_REDIS_SYNC_MS": "100", "HETERO_GATEWAY_REDIS_TTL_MS": "199"})
    ok = {"HETERO_GATEWAY_REDIS_SYNC_MS": "100", "HETERO_GATEWAY_REDIS_TTL_MS": "200"}
    assert load_settings(ok).redis is None


# --- strategies' settings ------------------------------------------------------------------------


def test_strategy_settings_hold_one_object_per_strategy_with_settings() -> None:
    settings = load_settings({"AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT": "0.25"})
    objects = settings.strategy_settings()
    wanted = {settings_type(n) for n in strategy_names()} - {None}
    assert len({type(o) for o in objects}) == len(objects)  # one of each type
    assert {type(o) for o in objects} == wanted
    assert settings.load_balance in objects
    assert settings.load_balance.queued_weight == 0.25


def test_every_strategy_variable_names_a_strategy_with_settings() -> None:
    marked = [v for v in ENV_VARS if v.strategy is not None]
    assert {v.name for v in marked} == {
        "AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT",
        "AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA",
        "AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE",
        "HETERO_GATEWAY_LB_AVOID_FULL_BATCHES",
        "AIBRIX_PREFIX_CACHE_BLOCK_SIZE",
        "AIBRIX_PREFIX_CACHE_BLOCK_NUMBER",
    }
    for var in marked:
        assert var.strategy in strategy_names()
        assert settings_type(var.strategy) is not None
        assert var.meaning.startswith(f"`{var.strategy}` strategy: ")


# --- the configuration table (docs/configuration.md) ------------------------------------------


def test_the_configuration_table_is_the_generated_one() -> None:
    text = CONFIGURATION_DOC.read_text(encoding="utf-8")
    assert config.with_config_table(text) == text, (
        "docs/configuration.md's table differs from plugin/config's declarations;"
        " run: python -m plugin.config --write-readme docs/configuration.md"
    )


def test_the_table_has_a_row_per_variable_with_its_columns() -> None:
    lines = config.config_table().splitlines()
    assert lines[0] == "| variable | type | default | meaning |"
    rows = [line.split(" | ") for line in lines[2:]]
    assert [r[0].removeprefix("| `").removesuffix("`") for r in rows] == list(VARS)
    for row, var in zip(rows, ENV_VARS, strict=True):
        assert row[1] == var.type_text
        assert row[2] in (var.default_text, f"`{var.default_text}`")
        assert row[3].removesuffix(" |") == var.meaning
        if var.flag is not None:
            assert f"`{var.flag}` overrides it." in row[3]
    assert VARS["HETERO_GATEWAY_REDIS_TTL_MS"].type_text == "int > 0, >= 2 x sync"
    assert VARS["HETERO_GATEWAY_LOG_LEVEL"].type_text.startswith("`DEBUG`, `INFO`")


def test_write_readme_rewrites_only_between_the_markers(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(
        f"# Title\n\nIntro.\n\n{README_TABLE_BEGIN}\n| old | table |\n{README_TABLE_END}"
        "\n\nAfter.\n",
        encoding="utf-8",
    )
    assert config.main(["--check-readme", str(path)]) == 1
    assert config.main(["--write-readme", str(path)]) == 0
    text = path.read_text(encoding="utf-8")
    expected = (
        f"# Title\n\nIntro.\n\n{README_TABLE_BEGIN}\n{config.config_table()}{README_TABLE_END}"
        "\n\nAfter.\n"
    )
    assert text == expected
    assert config.main(["--check-readme", str(path)]) == 0
    assert config.main(["--write-readme", str(path)]) == 0  # idempotent
    assert path.read_text(encoding="utf-8") == expected


def test_a_readme_without_markers_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("no table here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="config-table"):
        config.main(["--write-readme", str(path)])


def test_the_bearer_token_is_read_trimmed_and_never_printed() -> None:
    settings = load_settings({"AIBRIX_AUTH_BEARER_TOKEN": "  s3cret-token "})
    assert settings.auth_bearer_token == "s3cret-token"
    assert "s3cret" not in repr(settings)
    assert load_settings({"AIBRIX_AUTH_BEARER_TOKEN": "   "}).auth_bearer_token is None


def test_the_imbalance_gate_is_capacity_aware_by_default_and_can_be_aibrix_s_or_off() -> None:
    gate = load_settings({}).imbalance
    assert gate is not None and gate.capacity_aware and (gate.min_gap, gate.factor) == (8, 2.0)
    raw = load_settings(
        {
            "HETERO_GATEWAY_IMBALANCE_GATE": "count",
            "AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP": "4",
            "AIBRIX_LOAD_BALANCE_IMBALANCE_FACTOR": "1.5",
        }
    ).imbalance
    assert raw is not None and not raw.capacity_aware and (raw.min_gap, raw.factor) == (4, 1.5)
    assert load_settings({"HETERO_GATEWAY_IMBALANCE_GATE": "off"}).imbalance is None


def test_otel_without_its_extra_stops_start_up_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def missing(name: str, *args: Any) -> Any:
        return None if name.startswith("opentelemetry") else real(name, *args)

    assert load_settings({"HETERO_GATEWAY_OTEL": "true"}).otel is True  # installed here
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(ConfigError, match=r"HETERO_GATEWAY_OTEL=true needs OpenTelemetry: pip"):
        load_settings({"HETERO_GATEWAY_OTEL": "true"})
    assert load_settings({}).otel is False


def test_otel_with_shadowed_protos_stops_start_up_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    real = importlib.import_module

    def shadowed(name: str, *args: Any) -> Any:
        if name.startswith("opentelemetry.exporter"):
            raise ImportError("cannot import name 'InstrumentationScope'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", shadowed)
    with pytest.raises(ConfigError, match=r"HETERO_GATEWAY_OTEL=true: the OTLP exporter .*"
                       r"--force-reinstall --no-deps opentelemetry-proto"):  # fmt: skip
        load_settings({"HETERO_GATEWAY_OTEL": "true"})


def test_admission_reads_its_tables_and_refuses_what_it_cannot_use() -> None:
    digest = hashlib.sha256(b"sk-alice").hexdigest()
    env = {
        "HETERO_GATEWAY_ADMISSION": "on",
        "HETERO_GATEWAY_TENANT_HEADER": "X-Tenant",
        "HETERO_GATEWAY_TENANT_TOKENS": f"alice:{digest.upper()}",
        "HETERO_GATEWAY_PRIORITY_CLASSES": "interactive,batch",
        "HETERO_GATEWAY_TENANT_CLASSES": "alice:interactive",
        "HETERO_GATEWAY_TENANT_WEIGHTS": "alice:3",
        "HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS": "2000",
        "HETERO_GATEWAY_CLASS_MAX_WAIT_MS": "batch:500",
    }
    settings = load_settings(env).admission
    assert settings is not None
    assert settings.tenancy.header == "x-tenant"  # Envoy hands header names over lower-cased
    assert settings.tenancy.tenant(None, "Bearer sk-alice") == "alice"
    assert settings.classes.rank("alice") == 0 and settings.classes.rank("bob") == 1
    assert settings.weights == {"alice": 3.0} and settings.max_wait_s == 2.0
    assert settings.class_max_wait_s == {"batch": 0.5}
    assert load_settings({**env, "HETERO_GATEWAY_ADMISSION": "off"}).admission is None
    for name, value, says in (
        ("HETERO_GATEWAY_TENANT_TOKENS", "alice:sk-alice", "not a SHA-256"),
        ("HETERO_GATEWAY_TENANT_CLASSES", "alice:gold", "'gold' is not a class"),
        ("HETERO_GATEWAY_TENANT_MAY_ASK", "alice:gold", "'gold' is not a class"),
        ("HETERO_GATEWAY_TENANT_WEIGHTS", "alice:0", "not a positive number"),
        ("HETERO_GATEWAY_TENANT_WEIGHTS", "alice:x", "not a positive number"),
        ("HETERO_GATEWAY_CLASS_MAX_WAIT_MS", "gold:500", "'gold' is not a class"),
        ("HETERO_GATEWAY_CLASS_MAX_WAIT_MS", "batch:0", "batch:0 is not an integer in"),
        ("HETERO_GATEWAY_CLASS_MAX_WAIT_MS", "batch:60000", "batch:60000 is not an integer in"),
    ):
        with pytest.raises(ConfigError, match=f"^{name}: .*{says}"):
            load_settings({**env, name: value})


def test_tenant_limits_read_per_kind_with_a_star_for_the_rest() -> None:
    env = {
        "HETERO_GATEWAY_ADMISSION": "on",
        "HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE": "alice:600,*:60",
        "HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE": "alice:100000",
        "HETERO_GATEWAY_TENANT_GPU_SECONDS_PER_MINUTE": "bob:2.5",
    }
    settings = load_settings(env).admission
    assert settings is not None
    table = settings.limits
    assert table.of("alice") == Limit(600.0, 100000.0, None)
    assert table.of("bob") == Limit(None, None, 2.5)
    assert table.of("carol") == Limit(60.0, None, None)
    assert table.window_s == 60.0
    assert not load_settings({"HETERO_GATEWAY_ADMISSION": "on"}).admission.limits  # type: ignore[union-attr]
    for name, value, says in (
        ("HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE", "alice:0", "not a positive number"),
        ("HETERO_GATEWAY_TENANT_GPU_SECONDS_PER_MINUTE", "*:inf", "not a positive number"),
    ):
        with pytest.raises(ConfigError, match=f"^{name}: .*{says}"):
            load_settings({**env, name: value})
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_ADMISSION=on"):
        load_settings({**env, "HETERO_GATEWAY_ADMISSION": "off"})
