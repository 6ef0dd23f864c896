"""The routing headers clients may send: rules, the variable's syntax, a model's override."""

from __future__ import annotations

import pytest

from plugin.adapters.steering import CONFIG_PROFILE_HEADER
from plugin.config import load_settings
from plugin.core.config_profile import parse_model_config
from plugin.core.header_policy import (
    CLIENT_ROUTING_HEADERS,
    HeaderPolicy,
    HeaderRule,
    parse_header_policy,
)
from plugin.core.request import SLO_TPOT_HEADER, SLO_TTFT_HEADER
from plugin.core.selector import EXTERNAL_FILTER_HEADER
from plugin.errors import ConfigError

pytestmark = pytest.mark.unit

STRATEGIES = ("random", "least-request", "load-balance", "slo")


def test_rules_deny_allow_or_list_values() -> None:
    policy = parse_header_policy(
        " routing-strategy = slo|load-balance ;external-filter=DENY; config-profile=allow;"
        " x-slo-ttft-ms=500|1000"
    )
    assert policy.rules["external-filter"] == HeaderRule(frozenset())
    assert policy.rules["config-profile"] == HeaderRule(None)
    headers = {
        "routing-strategy": "slo",
        "external-filter": "gpu=a100",
        "config-profile": "anything",
        "x-slo-ttft-ms": "2000",
        "x-slo-tpot-ms": "50",  # no rule: allowed
    }
    assert policy.denied(headers) == ["external-filter", "x-slo-ttft-ms"]
    assert policy.denied({"x-slo-ttft-ms": " 500 "}) == []
    assert policy.denied({}) == []


def test_every_strategy_of_a_weighted_list_must_be_allowed() -> None:
    rule = parse_header_policy("routing-strategy=slo|load-balance").rules["routing-strategy"]
    assert rule.allows("routing-strategy", "slo:3, load-balance:1")
    assert not rule.allows("routing-strategy", "slo:3,random:1")
    assert not rule.allows("routing-strategy", "random")
    # Not a strategy list: routing answers its own 400, the lock does not judge it.
    assert rule.allows("routing-strategy", "slo:x")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("model=deny", "not a client routing header"),
        ("routing-strategy", "is not name=rule"),
        ("external-filter=deny; external-filter=allow", "two rules"),
        ("x-slo-ttft-ms= | ", "is not deny, allow or values"),
    ],
)
def test_a_malformed_policy_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_header_policy(text)


def test_the_variable_stops_start_up_naming_itself_and_unknown_strategies() -> None:
    assert not load_settings({}).client_headers  # default: every header allowed
    assert load_settings({}).denied_header_action == "reject"
    with pytest.raises(ConfigError, match=r"HETERO_GATEWAY_CLIENT_HEADERS=.*not a client routing"):
        load_settings({"HETERO_GATEWAY_CLIENT_HEADERS": "model=deny"})
    with pytest.raises(ConfigError, match="unknown strategy no-such"):
        load_settings({"HETERO_GATEWAY_CLIENT_HEADERS": "routing-strategy=slo|no-such"})
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_DENIED_HEADER_ACTION"):
        load_settings({"HETERO_GATEWAY_DENIED_HEADER_ACTION": "drop"})


def test_a_model_s_rules_replace_the_gateway_s_header_by_header() -> None:
    gateway = parse_header_policy("routing-strategy=slo; external-filter=deny")
    config, problems = parse_model_config(
        {
            "profiles": {"default": {"routingStrategy": "slo"}},
            "clientHeaders": {
                "external-filter": "allow",
                "config-profile": ["fast", "cheap"],
                "x-slo-ttft-ms": [],  # an empty list allows no value
                "model": "deny",
                "x-slo-tpot-ms": 5,
            },
        },
        STRATEGIES,
    )
    assert config is not None and config.client_headers is not None
    assert [p.split(":")[0] for p in problems] == [
        "clientHeaders.model",
        "clientHeaders.x-slo-tpot-ms",
    ]
    merged = gateway.under(config.client_headers)
    headers = {
        "routing-strategy": "random",
        "external-filter": "gpu=a100",
        "config-profile": "fast",
        "x-slo-ttft-ms": "500",
    }
    assert merged.denied(headers) == ["routing-strategy", "x-slo-ttft-ms"]
    assert gateway.denied(headers) == ["routing-strategy", "external-filter"]
    assert gateway.under(None) is gateway


def test_a_config_with_locks_and_no_profiles_is_kept() -> None:
    config, problems = parse_model_config({"clientHeaders": {"routing-strategy": "deny"}}, ())
    assert problems == [] and config is not None
    assert config.select(None, 10, 10) is None  # no profile: the gateway's own settings
    assert config.client_headers == HeaderPolicy({"routing-strategy": HeaderRule(frozenset())})
    assert parse_model_config({"clientHeaders": 3}, ())[1] == [
        "clientHeaders: not an object; ignored"
    ]


def test_the_locked_names_are_the_headers_routing_reads() -> None:
    """The policy sits below the modules that name these headers (layers): same names."""
    assert CLIENT_ROUTING_HEADERS == (
        "routing-strategy",
        EXTERNAL_FILTER_HEADER,
        CONFIG_PROFILE_HEADER,
        SLO_TTFT_HEADER,
        SLO_TPOT_HEADER,
    )
