"""Model config profiles (AIBrix's `model.aibrix.ai/config` pod annotation): named sets of
routing options per model, chosen per request by the `config-profile` header.

The document, as AIBrix reads it (`pkg/plugins/gateway/configprofiles`; its design doc
`docs/source/designs/model-config-profiles.rst`)::

    {"defaultProfile": "default",
     "profiles": {
        "default": {"routingStrategy": "load-balance"},
        "long-input": {"routingStrategy": "least-request",
                       "routingConfig": {"promptTokensGte": 8192,
                                         "loadBalance": {"kvPressureAlpha": 0},
                                         "autoBlend": {"loadBalanceWeight": 2}}}}}

- `routingStrategy`: a strategy name or weighted list, used when the request has no
  `routing-strategy` header (the header wins; then the profile; then `ROUTING_ALGORITHM`).
- `routingConfig.loadBalance`: `queuedWeight`, `kvPressureAlpha`, `kvCriticalFree` (the
  load-balance score) and `imbalanceFactor`, `imbalanceMinGap` (the imbalance gate), each
  overriding its `AIBRIX_LOAD_BALANCE_*` variable for requests of this profile.
- `routingConfig.autoBlend`: `loadBalanceWeight`, `leastRequestWeight`, `prefixCacheWeight`,
  `prefixCacheLoadBalanceWeight`, overriding the `AIBRIX_ROUTING_AUTO_BLEND_*` variables.
- `routingConfig.promptTokensGte` / `promptTokensLt` / `maxTokensGte` / `maxTokensLt`: the
  ranges `config-profile: auto` selects by.
- `routingConfig.admission` (this gateway's): `maxWaitMs`, the longest a request of this
  profile waits in admission's queue, and `classMaxWaitMs` (`{"batch": 2000}`), its class's own,
  overriding `HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS` and `HETERO_GATEWAY_CLASS_MAX_WAIT_MS` for
  its requests (never beyond the longest wait those allow: Envoy's hold timeout is set from
  them). A class the gateway does not have never matches.
- `clientHeaders` (beside `profiles`; this gateway's, AIBrix ignores it): which routing headers
  the model's clients may send (`plugin.core.header_policy`).

Selection (`ModelConfig.select`): a named profile if it exists, else `defaultProfile`, else
`default`. `auto` (any case) takes the profile whose range hints all hold for the request (a
hint on a size the request does not state never holds), the most hints first, then the bounds
closest to the request's sizes; with none, the default profile. (AIBrix's tests fix these
choices; the closest-bound rule is this gateway's reading of them.) Other
fields (AIBrix's `pd`, `vtc`, `preble`, prompt buckets) are accepted and ignored.

A value of the wrong type or out of range is reported in `problems` and ignored; the rest of
the document applies. A document that is not a JSON object with at least one profile yields
no config (also reported).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import orjson

from plugin.core.header_policy import HeaderPolicy, policy_from_doc
from plugin.core.strategy_list import MAX_WEIGHT, parse_blend
from plugin.errors import RequestError

__all__ = [
    "AUTO",
    "CONFIG_ANNOTATION",
    "ConfigProfile",
    "ModelConfig",
    "overridden",
    "parse_model_config",
]

CONFIG_ANNOTATION = "model.aibrix.ai/config"
AUTO = "auto"
DEFAULT_PROFILE = "default"
T = TypeVar("T")
_HINTS = ("promptTokensGte", "promptTokensLt", "maxTokensGte", "maxTokensLt")


@dataclass(frozen=True, slots=True)
class ConfigProfile:
    """One named profile; None fields leave the gateway's own setting."""

    name: str
    routing_strategy: str | None = None
    hints: Mapping[str, int] = field(default_factory=dict)  # promptTokensGte, ... (auto)
    # Fields of the settings they override (`overridden`): LoadBalanceSettings, the imbalance
    # gate's ImbalanceSettings, AutoBlend.
    load_balance: Mapping[str, float] = field(default_factory=dict)
    imbalance: Mapping[str, float] = field(default_factory=dict)
    auto_blend: Mapping[str, int] = field(default_factory=dict)
    # Admission's waits for the requests of this profile (None / empty: the gateway's).
    admission_wait_ms: int | None = None
    admission_class_wait_ms: Mapping[str, int] = field(default_factory=dict)

    @property
    def overrides_routing(self) -> bool:
        """Whether requests of this profile route with other settings than the gateway's."""
        return bool(self.load_balance or self.imbalance or self.auto_blend)

    def matches(self, prompt_tokens: int | None, max_tokens: int | None) -> bool:
        """Whether every range hint holds (a hint on an unknown size does not)."""
        for hint, bound in self.hints.items():
            value = prompt_tokens if hint.startswith("prompt") else max_tokens
            if value is None:
                return False
            if hint.endswith("Gte") and not value >= bound:
                return False
            if hint.endswith("Lt") and not value < bound:
                return False
        return True

    def fit(self, prompt_tokens: int, max_tokens: int | None) -> tuple[float, ...]:
        """How well a matching profile fits, larger first: more hints, then bounds closer to
        the request's sizes (of `promptTokensLt` 512 and 2048, 100 prompt tokens take 512)."""
        distance = 0.0
        for hint, bound in self.hints.items():
            value = prompt_tokens if hint.startswith("prompt") else max_tokens
            distance += abs((value or 0) - bound)
        return (len(self.hints), -distance)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    default_profile: str
    profiles: Mapping[str, ConfigProfile]
    client_headers: HeaderPolicy | None = None  # None: the gateway-wide policy alone

    def fallback(self) -> ConfigProfile | None:
        return self.profiles.get(self.default_profile) or self.profiles.get(DEFAULT_PROFILE)

    def select(
        self, header: str | None, prompt_tokens: int | None, max_tokens: int | None
    ) -> ConfigProfile | None:
        """The profile a request runs with (module doc); None when no default exists."""
        name = (header or "").strip()
        if name.lower() == AUTO:
            fitting = [
                p
                for p in self.profiles.values()
                if p.hints and p.matches(prompt_tokens, max_tokens)
            ]
            if fitting:
                return max(fitting, key=lambda p: (p.fit(prompt_tokens or 0, max_tokens), p.name))
            return self.fallback()
        if name and name in self.profiles:
            return self.profiles[name]
        return self.fallback()


def overridden(base: T, fields: Mapping[str, Any]) -> T:
    """`base` (a settings dataclass) with a profile's `fields` in place of its own; None (a
    feature that is off, such as the imbalance gate) stays None."""
    if base is None or not fields:
        return base
    return cast(T, dataclasses.replace(cast(Any, base), **fields))


def _number(value: Any, where: str, problems: list[str], lo: float, hi: float) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (lo <= value <= hi) or (isinstance(value, float) and math.isnan(value)):
        problems.append(f"{where}: {value!r} is not a number in [{lo:g}, {hi:g}]; ignored")
        return None
    return float(value)


def _integer(value: Any, where: str, problems: list[str], lo: int, hi: int) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        problems.append(f"{where}: {value!r} is not an integer in [{lo}, {hi}]; ignored")
        return None
    return value


# routingConfig.loadBalance: JSON name -> (settings object, field, bounds)
_LOAD_BALANCE = {
    "queuedWeight": ("load_balance", "queued_weight", 0.0, 1e6),
    "kvPressureAlpha": ("load_balance", "kv_pressure_alpha", 0.0, 1e6),
    "kvCriticalFree": ("load_balance", "kv_critical_free", 0.0, 1.0),
    "imbalanceFactor": ("imbalance", "factor", 0.0, 1e6),
    "imbalanceMinGap": ("imbalance", "min_gap", 0.0, 1e9),
}
_AUTO_BLEND = {
    "loadBalanceWeight": "load_balance_weight",
    "leastRequestWeight": "least_request_weight",
    "prefixCacheWeight": "prefix_cache_weight",
    "prefixCacheLoadBalanceWeight": "prefix_cache_load_balance_weight",
}


def _profile(
    name: str, doc: Any, problems: list[str], strategies: Collection[str]
) -> ConfigProfile | None:
    where = f"profiles.{name}"
    if not isinstance(doc, dict):
        problems.append(f"{where}: not an object; profile ignored")
        return None
    strategy = doc.get("routingStrategy")
    if strategy is not None:
        try:
            if not isinstance(strategy, str):
                raise TypeError
            unknown = [n for n, _ in parse_blend(strategy) if n not in strategies]
            if unknown:
                problems.append(
                    f"{where}.routingStrategy: this gateway has no {', '.join(unknown)[:80]};"
                    " its requests route by the default strategy"
                )
                strategy = None
        except (TypeError, RequestError):
            problems.append(
                f"{where}.routingStrategy: {str(strategy)[:80]!r} is not a strategy list; ignored"
            )
            strategy = None
    config = doc.get("routingConfig")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        problems.append(f"{where}.routingConfig: not an object; ignored")
        config = {}
    hints: dict[str, int] = {}
    for hint in _HINTS:
        if hint in config:
            got = _integer(config[hint], f"{where}.routingConfig.{hint}", problems, 0, 2**31 - 1)
            if got is not None:
                hints[hint] = got
    overrides: dict[str, dict[str, float]] = {"load_balance": {}, "imbalance": {}}
    load_balance = config.get("loadBalance", {})
    if not isinstance(load_balance, dict):
        problems.append(f"{where}.routingConfig.loadBalance: not an object; ignored")
        load_balance = {}
    for key, (target, attr, lo, hi) in _LOAD_BALANCE.items():
        if key in load_balance:
            number = _number(
                load_balance[key], f"{where}.routingConfig.loadBalance.{key}", problems, lo, hi
            )
            if number is not None:
                overrides[target][attr] = number
    auto_blend_doc = config.get("autoBlend", {})
    if not isinstance(auto_blend_doc, dict):
        problems.append(f"{where}.routingConfig.autoBlend: not an object; ignored")
        auto_blend_doc = {}
    auto_blend: dict[str, int] = {}
    for key, attr in _AUTO_BLEND.items():
        if key in auto_blend_doc:
            low = -MAX_WEIGHT if key == "loadBalanceWeight" else 0  # <= 0 turns auto-blend off
            got_int = _integer(
                auto_blend_doc[key],
                f"{where}.routingConfig.autoBlend.{key}",
                problems,
                low,
                MAX_WEIGHT,
            )
            if got_int is not None:
                auto_blend[attr] = got_int
    wait_ms, class_wait_ms = _admission(config.get("admission", {}), where, problems)
    return ConfigProfile(
        name,
        strategy,
        hints,
        overrides["load_balance"],
        overrides["imbalance"],
        auto_blend,
        wait_ms,
        class_wait_ms,
    )


_MAX_WAIT_MS = 59_000  # Envoy's ext_proc message timeout (60 s) less 1 s, as the variables'


def _admission(doc: Any, where: str, problems: list[str]) -> tuple[int | None, dict[str, int]]:
    """`routingConfig.admission`: the profile's longest wait and its classes' own."""
    where = f"{where}.routingConfig.admission"
    if not isinstance(doc, dict):
        problems.append(f"{where}: not an object; ignored")
        return None, {}
    wait_ms = None
    if "maxWaitMs" in doc:
        wait_ms = _integer(doc["maxWaitMs"], f"{where}.maxWaitMs", problems, 1, _MAX_WAIT_MS)
    classes: dict[str, int] = {}
    by_class = doc.get("classMaxWaitMs", {})
    if not isinstance(by_class, dict):
        problems.append(f"{where}.classMaxWaitMs: not an object; ignored")
        by_class = {}
    for name, value in by_class.items():
        got = _integer(value, f"{where}.classMaxWaitMs.{name}", problems, 1, _MAX_WAIT_MS)
        if got is not None:
            classes[str(name)] = got
    return wait_ms, classes


def parse_model_config(
    raw: str | bytes | Mapping[str, Any], strategies: Collection[str]
) -> tuple[ModelConfig | None, list[str]]:
    """The config a pod carries, and what in it was ignored and why (for the log);
    `strategies`: the names this gateway routes by (a `routingStrategy` naming another is
    ignored)."""
    problems: list[str] = []
    if isinstance(raw, str | bytes):
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return None, [f"not JSON ({exc}); config ignored"]
    else:
        doc = raw
    if not isinstance(doc, dict):
        return None, ["not a JSON object; config ignored"]
    profiles_doc = doc.get("profiles")
    if (profiles_doc is None or profiles_doc == {}) and "clientHeaders" in doc:
        # Headers locked for the model, and no profiles.
        client_headers = policy_from_doc(doc["clientHeaders"], problems)
        return ModelConfig(DEFAULT_PROFILE, {}, client_headers), problems
    if not isinstance(profiles_doc, dict) or not profiles_doc:
        return None, ["no profiles; config ignored"]
    profiles = {
        str(name): profile
        for name, body in profiles_doc.items()
        if (profile := _profile(str(name), body, problems, strategies)) is not None
    }
    if not profiles:
        return None, [*problems, "no usable profile; config ignored"]
    default = doc.get("defaultProfile", DEFAULT_PROFILE)
    if not isinstance(default, str) or not default:
        problems.append(f"defaultProfile: {default!r} is not a name; {DEFAULT_PROFILE!r} used")
        default = DEFAULT_PROFILE
    client_headers = policy_from_doc(doc.get("clientHeaders"), problems)
    return ModelConfig(default, profiles, client_headers), problems
