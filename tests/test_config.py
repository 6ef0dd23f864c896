"""Configuration: defaults, overrides, and a clear error naming each bad variable."""

from __future__ import annotations

import pytest

from plugin.config import ENV_VARS, RedisSettings, load_settings
from plugin.errors import ConfigError


def test_defaults() -> None:
    s = load_settings({})
    assert s.default_strategy == "load-balance"
    assert (
        s.strategy.queued_weight,
        s.strategy.kv_pressure_alpha,
        s.strategy.kv_critical_free,
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
    assert s.strategy.queued_weight == 0.5
    assert s.strategy.kv_pressure_alpha == 3.0
    assert s.strategy.kv_critical_free == 0.2
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


def test_every_variable_read_is_documented() -> None:
    import inspect
    import re

    import plugin.config as config

    source = inspect.getsource(config.load_settings)
    read = set(re.findall(r'"((?:AIBRIX|HETERO_GATEWAY|ROUTING)_[A-Z_]+)"', source))
    assert len(read) >= 10
    assert read <= {v.name for v in ENV_VARS}


def test_readme_documents_every_variable() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for var in ENV_VARS:
        assert f"| `{var.name}` |" in readme, var.name


@pytest.mark.parametrize(
    ("raw", "expected"), [(None, True), ("false", False), ("0", False), ("TRUE", True)]
)
def test_avoid_full_batches_switch(raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {"HETERO_GATEWAY_LB_AVOID_FULL_BATCHES": raw}
    assert load_settings(env).strategy.avoid_full_batches is expected


def test_avoid_full_batches_rejects_a_non_boolean() -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_LB_AVOID_FULL_BATCHES"):
        load_settings({"HETERO_GATEWAY_LB_AVOID_FULL_BATCHES": "maybe"})


# --- discovery, GPU label and shared state ------------------------------------------------------


def test_discovery_and_shared_state_defaults() -> None:
    s = load_settings({})
    assert s.discovery == "file"
    assert s.k8s_namespaces == ()
    assert s.k8s_label_selector == "model.aibrix.ai/name"
    assert s.gpu_label == "app.kubernetes.io/name"
    assert s.redis is None  # no REDIS_HOST: state stays in the process


def test_kubernetes_discovery_settings() -> None:
    s = load_settings(
        {
            "HETERO_GATEWAY_DISCOVERY": "Kubernetes",
            "HETERO_GATEWAY_K8S_NAMESPACE": " team-a, team-b ,team-a,",
            "HETERO_GATEWAY_K8S_LABEL_SELECTOR": "model.aibrix.ai/name,tier=gpu",
            "HETERO_GATEWAY_GPU_LABEL": "nvidia.com/gpu.product",
        }
    )
    assert s.discovery == "kubernetes"
    assert s.k8s_namespaces == ("team-a", "team-b")
    assert s.k8s_label_selector == "model.aibrix.ai/name,tier=gpu"
    assert s.gpu_label == "nvidia.com/gpu.product"


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
        ({"HETERO_GATEWAY_GPU_LABEL": "gpu type"}, "HETERO_GATEWAY_GPU_LABEL"),
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


def test_every_variable_the_module_reads_is_documented() -> None:
    import inspect
    import re

    import plugin.config as config

    source = inspect.getsource(config)
    read = set(
        re.findall(r'env(?:\.get)?\(\s*"([A-Z][A-Z0-9_]+)"|env,\s*"([A-Z][A-Z0-9_]+)"', source)
    )
    names = {a or b for a, b in read}
    # Read <=> documented: no hidden knob, no documented variable that does nothing.
    assert names == {v.name for v in ENV_VARS}, names ^ {v.name for v in ENV_VARS}


def test_drain_seconds() -> None:
    assert load_settings({}).drain_s == 20.0
    assert load_settings({"HETERO_GATEWAY_DRAIN_S": "2.5"}).drain_s == 2.5
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_DRAIN_S"):
        load_settings({"HETERO_GATEWAY_DRAIN_S": "-1"})


@pytest.mark.parametrize("host", ["redis:6379", "10.0.0.5:6379"])
def test_redis_host_with_a_port_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="REDIS_PORT"):
        load_settings({"REDIS_HOST": host})


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
