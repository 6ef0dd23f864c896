"""Which routing headers a client may send: operator-locked routing.

By default a client steers its own request, as AIBrix lets it: the strategy
(`routing-strategy`), the pods (`external-filter`), the model config profile
(`config-profile`) and its SLO (`x-slo-ttft-ms`, `x-slo-tpot-ms`). On a gateway shared by
tenants the operator locks them (AIBrix issue 2766 asks for a policy clients cannot override).

A policy has a rule per header; a header without a rule is allowed:

- `deny`: the client may not send it;
- `allow`: it may (the default; lifts a rule the gateway-wide policy set, for one model);
- an allow-list, `v1|v2`: only these values. For `routing-strategy` every strategy of a weighted
  list must be on it; for the others the whole value must match.

`HETERO_GATEWAY_CLIENT_HEADERS` holds the gateway-wide policy as `name=rule` entries separated by
`;` (`routing-strategy=slo|load-balance; external-filter=deny`). A model narrows or lifts it per
header with a `clientHeaders` object in its config document (`model.aibrix.ai/config`, beside
`profiles`): `{"routing-strategy": ["slo"], "external-filter": "deny"}`. What a denied header
gets, a 403 or being ignored, is `HETERO_GATEWAY_DENIED_HEADER_ACTION`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plugin.core.strategy_list import parse_blend
from plugin.errors import RequestError

__all__ = [
    "CLIENT_ROUTING_HEADERS",
    "STRATEGY_HEADER",
    "HeaderPolicy",
    "HeaderRule",
    "parse_header_policy",
    "policy_from_doc",
]

STRATEGY_HEADER = "routing-strategy"
CLIENT_ROUTING_HEADERS = (
    STRATEGY_HEADER,
    "external-filter",
    "config-profile",
    "x-slo-ttft-ms",
    "x-slo-tpot-ms",
)
DENY, ALLOW = "deny", "allow"


@dataclass(frozen=True, slots=True)
class HeaderRule:
    """One header's rule: `values` None allows any value, else only those (empty: none)."""

    values: frozenset[str] | None = None

    def allows(self, header: str, value: str) -> bool:
        values = self.values
        if values is None:
            return True
        if not values:
            return False
        if header == STRATEGY_HEADER:
            try:
                return all(name in values for name, _ in parse_blend(value))
            except RequestError:
                return True  # not a strategy list: routing answers its own 400
        return value.strip() in values

    def describe(self) -> str:
        if self.values is None:
            return ALLOW
        return DENY if not self.values else "|".join(sorted(self.values))


@dataclass(frozen=True, slots=True)
class HeaderPolicy:
    """A rule per locked header (`rules`); a header without one is allowed."""

    rules: Mapping[str, HeaderRule] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(rule.values is not None for rule in self.rules.values())

    def denied(self, headers: Mapping[str, str]) -> list[str]:
        """The headers of `headers` (lower-case names) this policy does not allow."""
        return [
            name
            for name, rule in self.rules.items()
            if (value := headers.get(name)) is not None and not rule.allows(name, value)
        ]

    def under(self, model: HeaderPolicy | None) -> HeaderPolicy:
        """This gateway-wide policy with a model's rules in place of its own, header by header."""
        if model is None or not model.rules:
            return self
        return HeaderPolicy({**self.rules, **model.rules})


def _rule(text: str) -> HeaderRule:
    word = text.strip()
    if word.lower() == DENY:
        return HeaderRule(frozenset())
    if word.lower() == ALLOW:
        return HeaderRule(None)
    values = frozenset(v.strip() for v in word.split("|") if v.strip())
    if not values:
        raise ValueError(f"{text!r} is not deny, allow or values separated by |")
    return HeaderRule(values)


def _checked_name(name: str) -> str:
    header = name.strip().lower()
    if header not in CLIENT_ROUTING_HEADERS:
        raise ValueError(
            f"{name.strip()!r} is not a client routing header ({', '.join(CLIENT_ROUTING_HEADERS)})"
        )
    return header


def parse_header_policy(text: str) -> HeaderPolicy:
    """`name=rule; name=rule` (module doc); raises ValueError saying what is wrong."""
    rules: dict[str, HeaderRule] = {}
    for entry in text.split(";"):
        if not entry.strip():
            continue
        name, sep, rule = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry.strip()!r} is not name=rule")
        header = _checked_name(name)
        if header in rules:
            raise ValueError(f"{header} has two rules")
        rules[header] = _rule(rule)
    return HeaderPolicy(rules)


def policy_from_doc(doc: Any, problems: list[str]) -> HeaderPolicy | None:
    """A model config document's `clientHeaders` (None when it has none); what is malformed
    in it is reported in `problems` and left out."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        problems.append("clientHeaders: not an object; ignored")
        return None
    rules: dict[str, HeaderRule] = {}
    for name, rule in doc.items():
        where = f"clientHeaders.{str(name)[:80]}"
        try:
            header = _checked_name(str(name))
            if isinstance(rule, list) and all(isinstance(v, str) for v in rule):
                rules[header] = HeaderRule(frozenset(v.strip() for v in rule if v.strip()))
            elif isinstance(rule, str):
                rules[header] = _rule(rule)
            else:
                raise ValueError(f"{str(rule)[:80]!r} is not deny, allow or a list of values")
        except ValueError as exc:
            problems.append(f"{where}: {exc}; ignored")
    return HeaderPolicy(rules)
