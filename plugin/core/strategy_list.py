"""The syntax of a `routing-strategy` value: `name[:weight]` members, comma separated.

Its own module, below the strategies, so a config profile's `routingStrategy` is checked with
the very parser the header goes through, without the config parser importing any strategy.
"""

from __future__ import annotations

from plugin.errors import UnknownStrategy

__all__ = ["MAX_WEIGHT", "parse_blend"]

MAX_WEIGHT = 1_000_000
MAX_BLEND_CHARS = 256  # a header longer than this is refused, not parsed
MAX_MEMBERS = 8


def parse_blend(text: str) -> list[tuple[str, int]]:
    """`a:2,b,c:0` -> [("a", 2), ("b", 1), ("c", 0)]; malformed -> UnknownStrategy (400)."""
    text = text.strip()
    if len(text) > MAX_BLEND_CHARS:
        raise UnknownStrategy(text[:64], f"routing strategy list longer than {MAX_BLEND_CHARS}")
    members: list[tuple[str, int]] = []
    for raw in text.split(","):
        name, sep, weight_text = raw.strip().partition(":")
        name = name.strip()
        if not name:
            raise UnknownStrategy(text, "empty strategy name in the list")
        weight = 1
        if sep:
            weight_text = weight_text.strip()
            if not weight_text.isdigit() or int(weight_text) > MAX_WEIGHT:
                raise UnknownStrategy(
                    text, f"weight of {name} must be an integer from 0 to {MAX_WEIGHT}"
                )
            weight = int(weight_text)
        if any(n == name for n, _ in members):
            raise UnknownStrategy(text, f"{name} is named twice")
        members.append((name, weight))
    if len(members) > MAX_MEMBERS:
        raise UnknownStrategy(text, f"at most {MAX_MEMBERS} strategies in a list")
    return members
