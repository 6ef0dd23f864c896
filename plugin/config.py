"""The one place that reads configuration.

Every knob is an environment variable (AIBrix's name where AIBrix has one), declared once below as
a `Var`: name, kind (the parser and its bounds), typed default and a one-line doc. Everything else
comes from those declarations: validation (`load_settings`), the `--help` of the flags that
override a variable (`Var.add_flag`) and the README's configuration table
(`python -m plugin.config --write-readme docs/configuration.md`; a test fails while it differs).
Values are validated at start-up: a bad one raises `ConfigError` naming the variable, so the
process never starts half-configured.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

from plugin.core.pool import EjectionPolicy
from plugin.core.strategies import LoadBalanceSettings, SloSettings, strategy_names
from plugin.core.strategies.blend import MAX_WEIGHT, AutoBlend, parse_blend
from plugin.core.strategies.gate import ImbalanceSettings
from plugin.core.strategies.prefix_cache import PrefixCacheSettings
from plugin.errors import ConfigError, RequestError

V = TypeVar("V")
V_co = TypeVar("V_co", covariant=True)
N = TypeVar("N", int, float)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DISCOVERY_KINDS = ("file", "kubernetes")
DEFAULT_K8S_LABEL_SELECTOR = "model.aibrix.ai/name"
# AIBrix names a pod's deployment (GPU type) by this label; it maps the pod to its profile.
DEFAULT_DEPLOYMENT_LABEL = "app.kubernetes.io/name"
DEFAULT_GPU_LABEL = DEFAULT_DEPLOYMENT_LABEL
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

README_TABLE_BEGIN = "<!-- config-table:begin -->"
README_TABLE_END = "<!-- config-table:end -->"


# --- kinds: how a variable's text becomes a value ------------------------------------------------


class Invalid(Exception):
    """A kind refuses a value; the text follows `NAME='value'` in the ConfigError."""

    def __init__(self, tail: str) -> None:
        super().__init__(tail)
        self.tail = tail


class Kind(Generic[V_co]):
    """Parses and checks one variable's text, and says what it accepts (the README's type)."""

    strip = True  # surrounding spaces are not part of the value
    blank_is_value = False  # set but blank is a value of its own, not "use the default"
    flag_type: Callable[[str], Any] = str  # argparse `type=` of a flag standing for the variable
    choices: tuple[str, ...] | None = None  # argparse `choices=` of such a flag

    @property
    def type_text(self) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> V_co:
        """The value of `text` (stripped unless `strip` is False), or raise `Invalid`."""
        raise NotImplementedError


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class _Number(Kind[N]):
    """A finite number with optional bounds: `gt` (exclusive), `ge` and `le` (inclusive)."""

    gt: N | None = None
    ge: N | None = None
    le: N | None = None
    unit: str = ""  # only in the error message: "milliseconds"
    noun: str = ""  # the error message's "is not <noun> ...", else "an integer" / "a number"

    word = ""
    default_noun = ""

    def convert(self, text: str) -> N:
        raise NotImplementedError

    @property
    def bounds(self) -> str:
        low = self.gt if self.gt is not None else self.ge
        if low is not None and self.le is not None:
            left = "(" if self.gt is not None else "["
            return f" in {left}{_number(low)}, {_number(self.le)}]"
        if self.gt is not None:
            return f" > {_number(self.gt)}"
        if self.ge is not None:
            return f" >= {_number(self.ge)}"
        if self.le is not None:
            return f" <= {_number(self.le)}"
        return ""

    @property
    def type_text(self) -> str:
        return self.word + self.bounds

    @property
    def expected(self) -> str:
        unit = f" ({self.unit})" if self.unit else ""
        return f"{self.noun or self.default_noun}{self.bounds}{unit}"

    def parse(self, text: str) -> N:
        try:
            value = self.convert(text)
        except ValueError:
            raise Invalid(f" is not {self.expected}") from None
        if (
            (isinstance(value, float) and not math.isfinite(value))
            or (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.le is not None and not value <= self.le)
        ):
            raise Invalid(f" is not {self.expected}")
        return value


@dataclass(frozen=True)
class Int(_Number[int]):
    word = "int"
    default_noun = "an integer"
    flag_type = int

    def convert(self, text: str) -> int:
        return int(text)


@dataclass(frozen=True)
class Float(_Number[float]):
    word = "float"
    default_noun = "a number"
    flag_type = float

    def convert(self, text: str) -> float:
        return float(text)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Bool(Kind[bool]):
    @property
    def type_text(self) -> str:
        return "bool"

    def parse(self, text: str) -> bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise Invalid(" is not a boolean (true/false)")


def _one_of(words: Sequence[str]) -> str:
    quoted = [f"`{w}`" for w in words]
    return ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]


@dataclass(frozen=True)
class Choice(Kind[str]):
    """One of a few words, in any case; the value is the word as declared."""

    choices: tuple[str, ...]

    @property
    def type_text(self) -> str:
        return _one_of(self.choices)

    def parse(self, text: str) -> str:
        for word in self.choices:
            if text.lower() == word.lower():
                return word
        raise Invalid(f" is not one of {', '.join(self.choices)}")


class StrategyName(Kind[str]):
    """A registered strategy's name or a weighted list of them (`prefix-cache:5,load-balance`),
    checked when read (so a strategy registered later counts)."""

    @property
    def type_text(self) -> str:
        return "strategy name or `name:weight,...`"

    def parse(self, text: str) -> str:
        try:
            members = parse_blend(text)
        except RequestError as exc:
            raise Invalid(f" is not a strategy list ({exc})") from None
        for name, _ in members:
            if name not in strategy_names():
                known = ", ".join(sorted(strategy_names()))
                raise Invalid(f" names an unknown strategy {name} (known: {known})")
        if not any(weight > 0 for _, weight in members):
            raise Invalid(" gives every strategy weight 0")
        return text.strip()


@dataclass(frozen=True)
class Text(Kind[str]):
    """Any text; `what` is the README's type (string, path)."""

    what: str = "string"
    strip: bool = True

    @property
    def type_text(self) -> str:
        return self.what

    def parse(self, text: str) -> str:
        return text


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


@dataclass(frozen=True)
class Host(Kind[str]):
    """A host name or address alone; `port_var` names the variable the port goes in."""

    port_var: str

    @property
    def type_text(self) -> str:
        return "host"

    def parse(self, text: str) -> str:
        if any(c.isspace() or c == "/" for c in text):
            raise Invalid(" is not a host name or address")
        if ":" in text and not _is_ipv6(text):
            raise Invalid(f": give the host alone; the port goes in {self.port_var}")
        return text


# A DNS-1123 label, as Kubernetes namespaces are.
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# A label key: optional DNS prefix and "/", then a name of at most 63 characters.
_LABEL_KEY_RE = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


def _is_label_key(key: str) -> bool:
    return len(key) <= 317 and _LABEL_KEY_RE.fullmatch(key) is not None


class Namespaces(Kind[tuple[str, ...]]):
    """Comma-separated namespace names, deduplicated in order; empty means every namespace."""

    @property
    def type_text(self) -> str:
        return "comma-separated list"

    def parse(self, text: str) -> tuple[str, ...]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        for n in names:
            if not _NAMESPACE_RE.fullmatch(n):
                raise Invalid(f": {n!r} is not a Kubernetes namespace name")
        return tuple(dict.fromkeys(names))


class LabelKey(Kind[str]):
    @property
    def type_text(self) -> str:
        return "label key"

    def parse(self, text: str) -> str:
        if not _is_label_key(text):
            raise Invalid(" is not a Kubernetes label key")
        return text


_LABEL_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_SELECTOR_TERM_RE = re.compile(
    rf"\s*(?:!\s*(?P<absent>\S+)"
    rf"|(?P<key>[^\s!=,()]+)\s*(?:(?:==|=|!=)\s*{_LABEL_VALUE}"
    rf"|\s(?:in|notin)\s*\(\s*{_LABEL_VALUE}(?:\s*,\s*{_LABEL_VALUE})*\s*\))?)\s*"
)


class LabelSelector(Kind[str]):
    """Kubernetes' label selector syntax (`a`, `!a`, `a=b`, `a!=b`, `a in (b,c)`, `a notin (b)`,
    joined by commas): a typo must stop start-up, not turn into an endless retry of HTTP 400s.
    Set but empty is a value: every pod in scope."""

    blank_is_value = True

    @property
    def type_text(self) -> str:
        return "label selector"

    def parse(self, text: str) -> str:
        terms, depth, start = [], 0, 0
        for i, ch in enumerate(text):
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                terms.append(text[start:i])
                start = i + 1
        if text:
            terms.append(text[start:])
        for term in terms:
            match = _SELECTOR_TERM_RE.fullmatch(term)
            key = match and (match.group("absent") or match.group("key"))
            if not match or not key or not _is_label_key(key):
                raise Invalid(f": {term.strip()!r} is not a label selector term")
        return text


class Caps(Kind[tuple[tuple[str, int], ...]]):
    """`deployment=N` pairs, comma-separated; a deployment is `name` or `namespace/name`."""

    @property
    def type_text(self) -> str:
        return "`deployment=N`, comma-separated"

    def parse(self, text: str) -> tuple[tuple[str, int], ...]:
        caps: dict[str, int] = {}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            name, sep, count = item.partition("=")
            name = name.strip()
            if not sep or not _DEPLOYMENT_RE.fullmatch(name):
                raise Invalid(
                    f": {item!r} is not deployment=N (deployment: name or namespace/name)"
                )
            try:
                value = int(count)
            except ValueError:
                value = -1
            if value < 0:
                raise Invalid(f": {item!r} does not give a replica count >= 0")
            caps[name] = value
        return tuple(caps.items())


_DEPLOYMENT_RE = re.compile(
    r"(?:[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?/)?[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?"
)


# --- declarations --------------------------------------------------------------------------------


class Flag(NamedTuple):
    """A command-line flag that stands for a variable in one command (it wins over the variable)."""

    command: str
    option: str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    def __str__(self) -> str:
        return f"{self.command} {self.option}"


def _show(value: object) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _number(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "(none)"
    return str(value)


@dataclass(frozen=True, slots=True)
class Var(Generic[V]):
    """One environment variable, declared once: the README's row, its validation, its flag."""

    name: str
    kind: Kind[V]
    default: V  # what an unset (or blank) variable means
    doc: str  # one line, Markdown; the README's meaning column
    strategy: str | None = None  # the strategy it configures (None: the gateway itself)
    flag: Flag | None = None
    shown_default: str | None = None  # the default as shown, when the value says too little
    also: str = ""  # a constraint checked across variables, added to the README's type

    @property
    def type_text(self) -> str:
        return f"{self.kind.type_text}, {self.also}" if self.also else self.kind.type_text

    @property
    def default_text(self) -> str:
        return self.shown_default if self.shown_default is not None else _show(self.default)

    @property
    def meaning(self) -> str:
        """The README's meaning: the doc, marked with its strategy and its flag."""
        text = f"`{self.strategy}` strategy: {self.doc}" if self.strategy else self.doc
        return f"{text} `{self.flag}` overrides it." if self.flag else text

    def read(self, env: Mapping[str, str]) -> V:
        """The value in `env`, or the default when unset or blank; ConfigError naming it if bad."""
        raw = env.get(self.name)
        if raw is None:
            return self.default
        text = raw.strip() if self.kind.strip else raw
        if not text and not self.kind.blank_is_value:
            return self.default
        try:
            return self.kind.parse(text)
        except Invalid as bad:
            raise ConfigError(f"{self.name}={raw!r}{bad.tail}") from None

    def flag_help(self) -> str:
        """The `--help` of the flag that stands for the variable (plain text, unescaped)."""
        doc = self.doc.replace("`", "").rstrip(".")
        default = self.default_text.removeprefix("(").removesuffix(")")
        return f"{doc} (default: ${self.name}, else {default})"

    def add_flag(self, parser: argparse.ArgumentParser, **extra: Any) -> None:
        """Add the variable's flag, without an argparse default: None leaves the variable in
        charge. A given value must be checked like the variable's (`serve` passes it through
        `flag_overrides` to `load_settings`; `envoy-config`'s EnvoyOptions has the same bounds)."""
        if self.flag is None:
            raise ValueError(f"{self.name} has no flag")
        parser.add_argument(
            self.flag.option,
            type=self.kind.flag_type,
            choices=self.kind.choices,
            default=None,
            help=self.flag_help().replace("%", "%%"),
            **extra,
        )


def flag_vars(command: str) -> tuple[Var[Any], ...]:
    """The variables that `command` has a flag for, in table order."""
    return tuple(v for v in ENV_VARS if v.flag is not None and v.flag.command == command)


def flag_overrides(command: str, args: argparse.Namespace) -> dict[str, str]:
    """The given flags of `command` as variables: a flag's value is its variable's value."""
    given = {v.name: getattr(args, v.flag.dest) for v in flag_vars(command) if v.flag is not None}
    return {name: str(value) for name, value in given.items() if value is not None}


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
MAX_REQUEST_HEADERS: Var[int] = Var(
    "HETERO_GATEWAY_MAX_REQUEST_HEADERS",
    Int(ge=16, le=10000),
    100,
    "Envoy's `max_headers_count` (its default, and what `envoy-config` renders): the plugin"
    " answers 431 to a request that would exceed it once the plugin's own headers are added,"
    " instead of Envoy's empty 503.",
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
GPU_LABEL: Var[str] = Var(
    "HETERO_GATEWAY_GPU_LABEL",
    LabelKey(),
    DEFAULT_GPU_LABEL,
    "Pod label whose value names the GPU type (`gpu` in `/debug/pods`, `hetero_gateway_pod_info`).",
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
DEPLOYMENT_LABEL: Var[str] = Var(
    "AIBRIX_POD_DEPLOYMENT_LABEL",
    LabelKey(),
    DEFAULT_DEPLOYMENT_LABEL,
    "Pod label whose value names the pod's deployment (GPU type): what maps it to its GPU profile,"
    " in both discovery sources.",
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
    PODS_FILE,
    GRPC_PORT,
    HTTP_PORT,
    SCRAPE_TIMEOUT_MS,
    METRICS_MAX_AGE_INTERVALS,
    CAPACITY_WINDOW_S,
    CAPACITY_TAU_S,
    EJECT_CONSECUTIVE_5XX,
    EJECT_BASE_S,
    LOG_LEVEL,
    DRAIN_S,
    DISCOVERY,
    K8S_NAMESPACE,
    K8S_LABEL_SELECTOR,
    GPU_LABEL,
    SLO_MAX_WAIT_MS,
    MAX_WAITING,
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
    TRACING,
    OPTIMIZER_PORT,
    OPTIMIZER_LOOKBACK_S,
    OPTIMIZER_HEADROOM,
    OPTIMIZER_SCALE_DOWN_WINDOWS,
    OPTIMIZER_MAX_REPLICAS,
)


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


@dataclass(frozen=True, slots=True)
class OptimizerSettings:
    """How the GPU optimizer plans (`hetero-gateway optimizer`)."""

    port: int = OPTIMIZER_PORT.default
    lookback_s: int = OPTIMIZER_LOOKBACK_S.default
    headroom: float = OPTIMIZER_HEADROOM.default
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
    metric_refresh_interval_s: float = METRIC_REFRESH_MS.default / 1000.0
    max_message_bytes: int = MAX_MESSAGE_BYTES.default
    max_request_headers: int = MAX_REQUEST_HEADERS.default
    auth_bearer_token: str | None = field(default=None, repr=False)  # never printed
    pods_file: str | None = PODS_FILE.default
    grpc_port: int = GRPC_PORT.default
    http_port: int = HTTP_PORT.default
    scrape_timeout_s: float = SCRAPE_TIMEOUT_MS.default / 1000.0
    metrics_max_age_intervals: int = METRICS_MAX_AGE_INTERVALS.default
    capacity_window_s: float = CAPACITY_WINDOW_S.default
    capacity_tau_s: float = CAPACITY_TAU_S.default
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    log_level: str = LOG_LEVEL.default
    drain_s: float = DRAIN_S.default
    discovery: str = DISCOVERY.default
    k8s_namespaces: tuple[str, ...] = K8S_NAMESPACE.default  # empty: every namespace
    k8s_label_selector: str = K8S_LABEL_SELECTOR.default
    gpu_label: str = GPU_LABEL.default
    deployment_label: str = DEPLOYMENT_LABEL.default
    profile_dir: str | None = PROFILE_DIR.default
    redis: RedisSettings | None = None  # None: state stays in this process
    tracing: bool = TRACING.default  # request traces for the GPU optimizer (needs redis)
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
        scale_down_windows=OPTIMIZER_SCALE_DOWN_WINDOWS.read(env),
        max_replicas=dict(OPTIMIZER_MAX_REPLICAS.read(env)),
    )


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


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every variable; raise ConfigError naming the first bad one."""
    env = os.environ if env is None else env
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
        pods_file=PODS_FILE.read(env),
        grpc_port=GRPC_PORT.read(env),
        http_port=HTTP_PORT.read(env),
        scrape_timeout_s=SCRAPE_TIMEOUT_MS.read(env) / 1000.0,
        metrics_max_age_intervals=METRICS_MAX_AGE_INTERVALS.read(env),
        capacity_window_s=CAPACITY_WINDOW_S.read(env),
        capacity_tau_s=CAPACITY_TAU_S.read(env),
        ejection=_ejection_policy(EJECT_CONSECUTIVE_5XX.read(env), EJECT_BASE_S.read(env)),
        log_level=LOG_LEVEL.read(env),
        drain_s=DRAIN_S.read(env),
        discovery=DISCOVERY.read(env),
        k8s_namespaces=K8S_NAMESPACE.read(env),
        k8s_label_selector=K8S_LABEL_SELECTOR.read(env),
        gpu_label=GPU_LABEL.read(env),
        slo=SloSettings(max_wait_s=SLO_MAX_WAIT_MS.read(env) / 1000.0),
        max_waiting=MAX_WAITING.read(env),
        deployment_label=DEPLOYMENT_LABEL.read(env),
        profile_dir=PROFILE_DIR.read(env),
        redis=(redis := _redis_settings(env)),
        tracing=_tracing(env, redis),
        optimizer=_optimizer_settings(env),
    )


# --- the README's table --------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_table() -> str:
    """The README's configuration table (Markdown), one row per declaration."""
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for var in ENV_VARS:
        default = var.default_text
        shown = default if default.startswith("(") and default.endswith(")") else f"`{default}`"
        rows.append(f"| `{var.name}` | {_cell(var.type_text)} | {shown} | {_cell(var.meaning)} |")
    return "\n".join(rows) + "\n"


def with_config_table(readme: str) -> str:
    """`readme` with the text between the config-table markers replaced by `config_table()`."""
    begin, end = readme.find(README_TABLE_BEGIN), readme.find(README_TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {README_TABLE_BEGIN} ... {README_TABLE_END} markers")
    head = readme[: begin + len(README_TABLE_BEGIN)]
    return f"{head}\n{config_table()}{readme[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plugin.config",
        description="Print the README's configuration table, or rewrite or check it in a file.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write-readme", metavar="PATH", help="rewrite the table in PATH")
    group.add_argument("--check-readme", metavar="PATH", help="exit 1 if PATH's table differs")
    args = parser.parse_args(argv)
    path_arg = args.write_readme or args.check_readme
    if path_arg is None:
        sys.stdout.write(config_table())
        return 0
    path = Path(path_arg)
    text = path.read_text(encoding="utf-8")
    new = with_config_table(text)
    if args.check_readme:
        if new != text:
            print(f"{path}: configuration table is stale; run {parser.prog} --write-readme {path}")
            return 1
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
