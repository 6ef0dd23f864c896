"""The typed environment-variable library: kinds (how a variable's text becomes a value, with
its bounds), `Var` (one declared variable) and `Flag` (a command-line flag standing for one).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from plugin.core.header_policy import STRATEGY_HEADER, HeaderPolicy, parse_header_policy
from plugin.core.strategies import strategy_names
from plugin.core.strategies.blend import parse_blend
from plugin.errors import ConfigError, RequestError

V = TypeVar("V")
V_co = TypeVar("V_co", covariant=True)
N = TypeVar("N", int, float)

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


class HeaderPolicyText(Kind[HeaderPolicy]):
    """`name=rule; ...` (`plugin.core.header_policy`): which routing headers clients may send."""

    @property
    def type_text(self) -> str:
        return "`header=rule; ...` (a rule: `deny`, `allow` or the values allowed)"

    def parse(self, text: str) -> HeaderPolicy:
        try:
            policy = parse_header_policy(text)
        except ValueError as exc:
            raise Invalid(f": {exc}") from None
        rule = policy.rules.get(STRATEGY_HEADER)
        unknown = sorted((rule.values or set()) - set(strategy_names())) if rule else []
        if unknown:
            known = ", ".join(sorted(strategy_names()))
            raise Invalid(f": {STRATEGY_HEADER} allows an unknown strategy {unknown[0]} ({known})")
        return policy


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


_NAME_RE = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.]{0,62}")


class Names(Kind[tuple[str, ...]]):
    """Comma-separated names (letters, digits, `-_.`), in order, each once."""

    @property
    def type_text(self) -> str:
        return "comma-separated names"

    def parse(self, text: str) -> tuple[str, ...]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        for n in names:
            if not _NAME_RE.fullmatch(n):
                raise Invalid(f": {n!r} is not a name (letters, digits, -_.; at most 63)")
        if len(set(names)) != len(names):
            raise Invalid(": a name is listed twice")
        return tuple(names)


@dataclass(frozen=True)
class Pairs(Kind[tuple[tuple[str, str], ...]]):
    """`key:value` pairs, comma-separated, each key once; `what` shows one (`tenant:class`).
    A key is a name (as `Names`), or `*` where `star` allows it; a value is checked by whoever
    reads it."""

    what: str
    star: bool = False

    @property
    def type_text(self) -> str:
        return f"`{self.what}`, comma-separated"

    def parse(self, text: str) -> tuple[tuple[str, str], ...]:
        pairs: dict[str, str] = {}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            key, sep, value = (part.strip() for part in item.partition(":"))
            named = _NAME_RE.fullmatch(key) or (self.star and key == "*")
            if not sep or not value or not named:
                raise Invalid(f": {item!r} is not {self.what}")
            if key in pairs:
                raise Invalid(f": {key!r} is given twice")
            pairs[key] = value
        return tuple(pairs.items())


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
