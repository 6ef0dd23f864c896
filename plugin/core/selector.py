"""Kubernetes label selectors, for AIBrix's `external-filter` request header.

AIBrix's gateway narrows a request's candidate pods to those matching the label selector in the
`external-filter` header before its strategy picks (`selectTargetPod`, `FilterPodsByLabelSelector`);
its profile benchmark uses that to measure one GPU type through the gateway. The header holds a
selector in the syntax `kubectl get pods -l` takes (Kubernetes "Labels and Selectors"):

    gpu=a100                  equality (`==` too): the label is present with that value
    gpu!=a100                 the label is absent or has another value
    gpu in (a100,h100)        present, one of the values
    gpu notin (a100,h100)     absent, or none of the values
    gpu        !gpu           present / absent
    vram>40    vram<40        present, an integer, greater / less than the integer given

Requirements are separated by commas and all must hold; an empty selector matches every pod.
Keys are qualified names (an optional DNS-subdomain prefix and `/`, then at most 63 characters
of alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric); values are empty or such a
name part. Anything else is a 400 that names the header, not a silent "match nothing".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from plugin.errors import BadRequestHeader, echo

__all__ = ["EXTERNAL_FILTER_HEADER", "LabelSelector", "parse_selector"]

EXTERNAL_FILTER_HEADER = "external-filter"

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?"
_KEY_RE = re.compile(rf"(?:{_PREFIX}/)?{_NAME}")
_VALUE_RE = re.compile(rf"(?:{_NAME})?")
# One requirement: optional `!`, a key, then an operator and its operand (or nothing).
_TOKEN_RE = re.compile(
    r"""\s*(?:
        (?P<not>!)\s*(?P<nkey>[^\s,=!<>()]+)
      | (?P<key>[^\s,=!<>()]+)\s*
        (?:
            (?P<op>==|=|!=|<|>)\s*(?P<value>[^\s,=!<>()]*)
          | (?P<setop>in|notin)\s*\(\s*(?P<values>[^()]*)\)
        )?
    )\s*(?:,|$)""",
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class _Requirement:
    key: str
    op: str  # exists, !exists, in, notin, gt, lt
    values: frozenset[str] = frozenset()
    number: int = 0

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!exists":
            return value is None
        if self.op == "in":
            return value is not None and value in self.values
        if self.op == "notin":
            return value is None or value not in self.values
        if value is None:
            return False
        try:
            have = int(value)
        except ValueError:
            return False
        return have > self.number if self.op == "gt" else have < self.number


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A parsed selector: `matches(pod.labels)` when every requirement holds."""

    text: str
    requirements: tuple[_Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def _bad(text: str, why: str) -> BadRequestHeader:
    return BadRequestHeader(
        EXTERNAL_FILTER_HEADER, f"invalid {EXTERNAL_FILTER_HEADER} selector {echo(text)!r}: {why}"
    )


def _key(text: str, key: str) -> str:
    if not _KEY_RE.fullmatch(key) or len(key.rpartition("/")[2]) > 63:
        raise _bad(text, f"{echo(key)!r} is not a valid label key")
    return key


def _value(text: str, value: str) -> str:
    if not _VALUE_RE.fullmatch(value) or len(value) > 63:
        raise _bad(text, f"{echo(value)!r} is not a valid label value")
    return value


@lru_cache(maxsize=256)
def parse_selector(text: str) -> LabelSelector:
    """Parse a selector (cached: a sweep sends the same header on every request).

    Raises `BadRequestHeader` (400) naming `external-filter` when the text is not a selector.
    """
    requirements: list[_Requirement] = []
    pos, end = 0, len(text)
    if not text.strip():
        return LabelSelector(text, ())
    while pos < end:
        m = _TOKEN_RE.match(text, pos)
        if m is None or m.end() == pos:
            raise _bad(text, f"cannot parse at character {pos}")
        pos = m.end()
        if m.group("not"):
            requirements.append(_Requirement(_key(text, m.group("nkey")), "!exists"))
            continue
        key = _key(text, m.group("key"))
        op, setop = m.group("op"), m.group("setop")
        if op in ("=", "==", "!="):
            value = _value(text, m.group("value"))
            requirements.append(
                _Requirement(key, "in" if op != "!=" else "notin", frozenset((value,)))
            )
        elif op in ("<", ">"):
            raw = m.group("value")
            try:
                number = int(raw)
            except ValueError:
                raise _bad(text, f"{echo(raw)!r} after {op} is not an integer") from None
            requirements.append(_Requirement(key, "gt" if op == ">" else "lt", number=number))
        elif setop:
            values = [v.strip() for v in m.group("values").split(",")]
            if not any(values):
                raise _bad(text, f"'{setop}' needs at least one value")
            requirements.append(
                _Requirement(key, setop, frozenset(_value(text, v) for v in values))
            )
        else:
            requirements.append(_Requirement(key, "exists"))
        if pos == end and text.rstrip().endswith(","):
            raise _bad(text, "ends with a comma")
    return LabelSelector(text, tuple(requirements))
