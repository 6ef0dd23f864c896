"""Model config profiles (`model.aibrix.ai/config`): parsing, selection (named, default, auto),
what a profile changes in routing, and where profiles come from (annotation, pods file)."""

from __future__ import annotations

import random

import orjson
import pytest

from plugin.adapters.discovery import parse_pods
from plugin.adapters.kubernetes import pod_from_object
from plugin.core.capacity import CapacityEstimator
from plugin.core.config_profile import ModelConfig, overridden, parse_model_config
from plugin.core.pool import PodPool
from plugin.core.router import Decision, Router
from plugin.core.strategies import build_strategies, strategy_names
from plugin.core.strategies.blend import AutoBlend, Blend
from plugin.core.strategies.gate import ImbalanceGate, ImbalanceSettings, Wrapped
from plugin.core.strategies.load_balance import LoadBalance, LoadBalanceSettings
from plugin.core.types import EngineMetrics, Pod, RequestInfo
from tests.helpers import pod_obj

pytestmark = pytest.mark.unit

MODEL = "m"

# AIBrix's own selection cases (configprofiles_test.go, TestResolveConfigForRequest...).
AUTO_DOC = {
    "defaultProfile": "default",
    "profiles": {
        "default": {"routingStrategy": "random"},
        "large-input": {
            "routingStrategy": "least-request",
            "routingConfig": {"promptTokensGte": 8192},
        },
        "offline-generation": {
            "routingStrategy": "round-robin",
            "routingConfig": {"maxTokensGte": 2048},
        },
        "combined": {
            "routingStrategy": "least-request",
            "routingConfig": {"promptTokensGte": 8192, "maxTokensGte": 2048},
        },
        "broad-short-input": {
            "routingStrategy": "least-request",
            "routingConfig": {"promptTokensLt": 2048},
        },
        "narrow-short-input": {
            "routingStrategy": "power-of-two",
            "routingConfig": {"promptTokensLt": 512},
        },
        "broad-short-output": {
            "routingStrategy": "least-request",
            "routingConfig": {"maxTokensLt": 4096},
        },
        "narrow-short-output": {
            "routingStrategy": "random",
            "routingConfig": {"maxTokensLt": 1024},
        },
    },
}


def config(doc: object) -> ModelConfig:
    parsed, problems = parse_model_config(orjson.dumps(doc), strategy_names())
    assert parsed is not None, problems
    return parsed


@pytest.mark.parametrize(
    ("header", "prompt", "max_tokens", "chosen"),
    [
        ("auto", 9000, None, "large-input"),
        ("auto", 4000, 2048, "offline-generation"),
        ("auto", 9000, 2048, "combined"),  # the more specific match
        ("auto", 100, None, "narrow-short-input"),  # the narrower upper bound
        ("auto", 4000, 512, "narrow-short-output"),
        ("auto", 4000, None, "default"),  # nothing fits: the default profile
        (" AUTO ", 9000, None, "large-input"),
        ("combined", 1, 1, "combined"),  # named
        ("missing", 9000, None, "default"),  # unknown: the default
        (None, 9000, None, "default"),
    ],
)
def test_selection_follows_aibrix(
    header: str | None, prompt: int, max_tokens: int | None, chosen: str
) -> None:
    profile = config(AUTO_DOC).select(header, prompt, max_tokens)
    assert profile is not None and profile.name == chosen


def test_a_max_tokens_hint_never_holds_when_the_request_sets_none() -> None:
    profile = config(AUTO_DOC).select("auto", 4000, None)
    assert profile is not None and profile.name == "default"


def test_default_profile_and_its_fallback() -> None:
    doc = {"defaultProfile": "fast", "profiles": {"fast": {}, "default": {}}}
    chosen = config(doc).select(None, 1, None)
    assert chosen is not None and chosen.name == "fast"
    no_default: dict[str, object] = {"profiles": {"only": {}}}
    assert config(no_default).select(None, 1, None) is None  # nothing to fall back to


def test_invalid_values_are_reported_and_ignored_and_the_rest_applies() -> None:
    doc = {
        "profiles": {
            "default": {
                "routingStrategy": "least-request:x",
                "routingConfig": {
                    "loadBalance": {"kvCriticalFree": 2, "kvPressureAlpha": 0, "queuedWeight": "1"},
                    "autoBlend": {"prefixCacheWeight": -1, "loadBalanceWeight": 0},
                    "promptTokensGte": "big",
                    "pd": {"anything": True},  # AIBrix's other sections: accepted, ignored
                },
            },
            "broken": "not an object",
        }
    }
    parsed, problems = parse_model_config(orjson.dumps(doc), strategy_names())
    assert parsed is not None and list(parsed.profiles) == ["default"]
    profile = parsed.profiles["default"]
    assert profile.routing_strategy is None
    assert dict(profile.load_balance) == {"kv_pressure_alpha": 0.0}
    assert dict(profile.auto_blend) == {"load_balance_weight": 0}
    assert not profile.hints
    text = "\n".join(problems)
    for bad in (
        "kvCriticalFree",
        "queuedWeight",
        "prefixCacheWeight",
        "promptTokensGte",
        "routingStrategy",
        "broken",
    ):
        assert bad in text


@pytest.mark.parametrize("raw", [b"{", b"[]", b'{"profiles": {}}', b'{"profiles": {"a": 1}}'])
def test_an_unusable_document_gives_no_config_and_says_why(raw: bytes) -> None:
    parsed, problems = parse_model_config(raw, strategy_names())
    assert parsed is None and problems


def test_a_profile_overrides_only_what_it_names() -> None:
    doc = {
        "profiles": {
            "default": {
                "routingConfig": {
                    "loadBalance": {"kvCriticalFree": 0.3, "imbalanceMinGap": 2},
                    "autoBlend": {"leastRequestWeight": 7},
                }
            }
        }
    }
    profile = config(doc).profiles["default"]
    balance = LoadBalance(LoadBalanceSettings(kv_pressure_alpha=3.0)).for_profile(profile)
    assert balance.params == LoadBalanceSettings(kv_pressure_alpha=3.0, kv_critical_free=0.3)
    assert overridden(ImbalanceSettings(factor=4.0), profile.imbalance) == ImbalanceSettings(
        min_gap=2, factor=4.0
    )
    assert overridden(None, profile.imbalance) is None  # a gate that is off stays off
    assert overridden(AutoBlend(), profile.auto_blend) == AutoBlend(least_request_weight=7)
    plain = LoadBalance(LoadBalanceSettings())
    assert plain.for_profile(config({"profiles": {"p": {}}}).profiles["p"]) is plain


# where profiles come from -------------------------------------------------------------------


def test_the_pod_annotation_carries_the_config_and_equal_texts_share_one_object() -> None:
    text = orjson.dumps(AUTO_DOC).decode()
    pods = [
        pod_from_object(
            pod_obj(f"p{i}", ip=f"10.0.0.{i + 1}", annotations={"model.aibrix.ai/config": text})
        )
        for i in range(2)
    ]
    assert pods[0] is not None and pods[1] is not None
    assert pods[0].model_config is not None
    assert pods[0].model_config is pods[1].model_config
    broken = pod_from_object(pod_obj("p9", annotations={"model.aibrix.ai/config": "{nope"}))
    assert broken is not None and broken.model_config is None  # logged, the pod still routes


def test_the_pods_file_gives_a_model_its_config() -> None:
    doc = {
        "models": {
            MODEL: {
                "config": AUTO_DOC,
                "pods": [{"name": "a", "address": "10.0.0.1", "port": 8000}],
            },
            "other": {"pods": [{"name": "b", "address": "10.0.0.2", "port": 8000}]},
        }
    }
    pods = {p.model: p for p in parse_pods(doc, "pods.yaml")}
    carried = pods[MODEL].model_config
    assert carried is not None and "combined" in carried.profiles
    assert pods["other"].model_config is None


# what a profile changes in routing --------------------------------------------------------


def router_with(doc: object, gate: bool = False) -> tuple[Router, PodPool, list[Pod]]:
    parsed = config(doc)
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=10.0)
    pods = [
        Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000, model_config=parsed) for i in range(2)
    ]
    pool.set_pods(pods)
    router = Router(
        pool,
        build_strategies(),
        "load-balance",
        random.Random(0),
        lambda: 1.0,
        auto_blend=AutoBlend(),
        gate=ImbalanceGate() if gate else None,
    )
    return router, pool, pods


def test_the_header_wins_then_the_profile_then_the_default() -> None:
    router, _, _ = router_with({"profiles": {"default": {"routingStrategy": "round-robin"}}})
    request = RequestInfo(MODEL, prompt_tokens=10)
    strategy, profile = router.select(request, None, None)
    assert strategy.name == "round-robin" and profile is not None and profile.name == "default"
    strategy, _ = router.select(request, "random", None)
    assert strategy.name == "random"
    plain = router.select(RequestInfo("no-config-model"), None, None)
    assert plain[1] is None and plain[0].name == "load-balance"


def test_a_profile_s_load_balance_settings_route_its_requests() -> None:
    """kvCriticalFree 0.5 in the profile: a replica at 60% KV usage is below that guardrail for
    this profile's requests only."""
    doc = {
        "profiles": {
            "default": {},
            "roomy": {"routingConfig": {"loadBalance": {"kvCriticalFree": 0.5}}},
        }
    }
    router, pool, pods = router_with(doc)
    pool.update_metrics(pods[0].key, EngineMetrics(0.0, 0.0, 0.6), 1.0)
    pool.update_metrics(pods[1].key, EngineMetrics(0.0, 0.0, 0.0), 1.0)
    lease = pool.acquire(pods[1])  # busier, but the only one above the profile's guardrail
    picks = {}
    for name in ("default", "roomy"):
        strategy, profile = router.select(RequestInfo(MODEL), None, name)
        assert profile is not None and profile.name == name
        decision = router.admit(RequestInfo(MODEL), strategy)
        assert isinstance(decision, Decision)
        picks[name] = decision.lease.pod.name
        decision.lease.release()
    lease.release()
    assert picks == {"default": "p0", "roomy": "p1"}


def test_a_profile_s_auto_blend_and_gate_settings_apply_and_are_cached() -> None:
    doc = {
        "profiles": {
            "default": {
                "routingConfig": {
                    "autoBlend": {"leastRequestWeight": 3},
                    "loadBalance": {"imbalanceMinGap": 1},
                }
            }
        }
    }
    router, _, _ = router_with(doc, gate=True)
    first, _ = router.select(RequestInfo(MODEL), "least-request", None)
    again, _ = router.select(RequestInfo(MODEL), "least-request", None)
    assert first is again
    assert isinstance(first, Wrapped) and first.gate is not None
    assert first.gate.settings.min_gap == 1
    blend = first.inner
    assert isinstance(blend, Blend)
    assert [(s.name, w) for s, w in blend.members] == [("least-request", 3), ("load-balance", 1)]
    balance = router.select(RequestInfo(MODEL), "load-balance", None)[0]
    assert isinstance(balance, Wrapped) and isinstance(balance.inner, LoadBalance)


def test_a_profile_naming_a_strategy_this_gateway_lacks_routes_by_the_default() -> None:
    """AIBrix's configs name strategies this gateway does not have (`pd`, `least-latency`):
    the client sent nothing wrong, so its request routes by the default, not a 400."""
    doc = {
        "profiles": {
            "default": {"routingStrategy": "least-latency"},
            "tuned": {
                "routingStrategy": "pd",
                "routingConfig": {"loadBalance": {"kvPressureAlpha": 0}},
            },
        }
    }
    router, _, _ = router_with(doc)
    for name in ("default", "tuned"):
        strategy, profile = router.select(RequestInfo(MODEL), None, name)
        assert profile is not None and profile.name == name
        assert strategy.name == "load-balance"
        decision = router.admit(RequestInfo(MODEL), strategy)
        assert isinstance(decision, Decision)
        decision.lease.release()
    _, problems = parse_model_config(orjson.dumps(doc), strategy_names())
    assert any("no least-latency" in p for p in problems) and any("no pd" in p for p in problems)


def test_a_profile_s_admission_waits_are_read_and_bad_ones_reported() -> None:
    doc = {
        "profiles": {
            "default": {},
            "patient": {
                "routingConfig": {
                    "admission": {"maxWaitMs": 20000, "classMaxWaitMs": {"batch": 500, "x": -1}}
                }
            },
            "odd": {"routingConfig": {"admission": {"maxWaitMs": 600000}}},
        }
    }
    config, problems = parse_model_config(orjson.dumps(doc), strategy_names())
    assert config is not None
    patient = config.profiles["patient"]
    assert patient.admission_wait_ms == 20000
    assert patient.admission_class_wait_ms == {"batch": 500}
    assert config.profiles["odd"].admission_wait_ms is None
    assert len(problems) == 2 and all("admission" in p for p in problems)
