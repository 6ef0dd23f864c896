"""GPU profiles in AIBrix's format: what one GPU type (a deployment) sustains per request size.

A profile holds, for a grid of output x input token counts (`indexes = [[out ticks], [in
ticks]]`), the highest request rate the deployment served within the SLO it was built for
(`tputs[out][in]`, requests/s; 0 where no tested rate met it), the mean end-to-end latency at
that rate (`e2e`, seconds) and, when a TTFT SLO was set, the mean TTFT (`ttft`). `slos` records
how it was built (`percentile` and each SLO set, by AIBrix's argument names: `e2e`, `ttft`,
`tpot`, `tpat`, `tput`, `tt`). Older AIBrix profiles have neither `e2e` nor `slos`; they load
with those empty.

Pure data and arithmetic: `plugin_tools.profile` builds profiles, the gateway loads them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plugin.errors import ConfigError

__all__ = ["SLO_NAMES", "GpuProfile", "ProfileBook", "nearest_tick", "parse_profile", "profile_key"]

# AIBrix's SLO argument names, in the order its profile builder applies them.
SLO_NAMES = ("tput", "tt", "e2e", "ttft", "tpat", "tpot")
REDIS_PROFILE_PREFIX = "aibrix:profile_"


def profile_key(model: str, deployment: str) -> str:
    """The Redis key AIBrix's tools and gateway use for a deployment's profile."""
    return f"{REDIS_PROFILE_PREFIX}{model}_{deployment}"


Grid = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True)
class GpuProfile:
    gpu: str  # the deployment the profile describes
    cost: float
    out_ticks: tuple[int, ...]
    in_ticks: tuple[int, ...]
    tputs: Grid  # [out][in] requests/s within the SLO; 0: never within it
    created: float
    e2e: Grid | None = None  # [out][in] mean end-to-end seconds at that rate
    ttft: Grid | None = None  # [out][in] mean TTFT seconds, when a TTFT SLO was set
    percentile: int = 0  # 0: the SLOs were checked against means
    slos: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The document AIBrix writes (same keys, same order)."""
        doc: dict[str, Any] = {
            "gpu": self.gpu,
            "cost": self.cost,
            "tputs": [list(row) for row in self.tputs],
            "indexes": [list(self.out_ticks), list(self.in_ticks)],
            "created": self.created,
        }
        if self.e2e is not None:
            doc["e2e"] = [list(row) for row in self.e2e]
        if self.ttft is not None:
            doc["ttft"] = [list(row) for row in self.ttft]
        doc["slos"] = {"percentile": self.percentile, **self.slos}
        return doc

    def cell(self, input_tokens: int, output_tokens: int) -> tuple[int, int] | None:
        """The (out, in) cell whose ticks are nearest in log2 to the request's sizes, or None
        when either size lies more than half a doubling outside the grid."""
        i = _nearest(self.out_ticks, output_tokens)
        j = _nearest(self.in_ticks, input_tokens)
        return None if i is None or j is None else (i, j)

    def clamped_cell(self, input_tokens: float, output_tokens: float) -> tuple[int, int]:
        """The (out, in) cell nearest in log2, clamped to the grid at both ends (AIBrix's
        optimizer plans a size outside the grid at the border cell)."""
        return nearest_tick(self.out_ticks, output_tokens), nearest_tick(
            self.in_ticks, input_tokens
        )


def nearest_tick(ticks: Sequence[int], tokens: float) -> int:
    """Index of the tick nearest in log2 to `tokens`, clamped to the grid (a tie goes to the
    larger, costlier tick)."""
    if not ticks:
        raise ValueError("a profile grid has at least one tick")
    x = math.log2(max(tokens, 1.0))
    return min(range(len(ticks)), key=lambda k: (abs(math.log2(ticks[k]) - x), -k))


@functools.lru_cache(maxsize=4096)
def _nearest(ticks: tuple[int, ...], tokens: int) -> int | None:
    """Index of the tick nearest in log2, or None more than half a doubling outside the grid.

    Cached: SLO routing asks it for every deployment on every request, and a fleet sees few
    distinct (grid, size) pairs."""
    k = nearest_tick(ticks, tokens)
    x = math.log2(max(tokens, 1))
    return k if abs(math.log2(ticks[k]) - x) <= 0.5 or _inside(ticks, x) else None


def _inside(ticks: Sequence[int], x: float) -> bool:
    return bool(ticks) and math.log2(ticks[0]) <= x <= math.log2(ticks[-1])


def _grid(value: Any, rows: int, cols: int, what: str) -> Grid:
    if (
        not isinstance(value, list)
        or len(value) != rows
        or not all(isinstance(r, list) and len(r) == cols for r in value)
    ):
        raise ConfigError(f"profile: {what} must be a {rows} x {cols} list of lists")
    try:
        grid = tuple(tuple(float(v) for v in row) for row in value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"profile: {what} holds a value that is not a number") from exc
    if any(math.isnan(v) or v < 0 for row in grid for v in row):
        raise ConfigError(f"profile: {what} holds a negative or NaN value")
    return grid


def _ticks(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"profile: {what} ticks must be a non-empty list")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ConfigError(f"profile: {what} ticks must be positive integers")
    if list(value) != sorted(set(value)):
        raise ConfigError(f"profile: {what} ticks must be strictly increasing")
    return tuple(value)


def parse_profile(doc: Any) -> GpuProfile:
    """A profile from its JSON document, either AIBrix format; errors say what is wrong."""
    if not isinstance(doc, dict):
        raise ConfigError("profile: expected a JSON object")
    gpu = doc.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise ConfigError("profile: 'gpu' must be a non-empty string")
    indexes = doc.get("indexes")
    if not isinstance(indexes, list) or len(indexes) != 2:
        raise ConfigError("profile: 'indexes' must be [[output ticks], [input ticks]]")
    out_ticks, in_ticks = _ticks(indexes[0], "output"), _ticks(indexes[1], "input")
    rows, cols = len(out_ticks), len(in_ticks)
    cost, created = doc.get("cost", 1.0), doc.get("created", 0.0)
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not cost >= 0:
        raise ConfigError("profile: 'cost' must be a number >= 0")
    if isinstance(created, bool) or not isinstance(created, int | float):
        raise ConfigError("profile: 'created' must be a timestamp")
    slos_doc = doc.get("slos") or {}
    if not isinstance(slos_doc, dict):
        raise ConfigError("profile: 'slos' must be an object")
    percentile = slos_doc.get("percentile", 0)
    if percentile not in (0, 50, 90, 99):
        raise ConfigError("profile: slos.percentile must be 0, 50, 90 or 99")
    slos = {}
    for name in SLO_NAMES:
        if name in slos_doc:
            value = slos_doc[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"profile: slos.{name} must be a number")
            slos[name] = float(value)
    return GpuProfile(
        gpu=gpu,
        cost=float(cost),
        out_ticks=out_ticks,
        in_ticks=in_ticks,
        tputs=_grid(doc.get("tputs"), rows, cols, "tputs"),
        created=float(created),
        e2e=_grid(doc["e2e"], rows, cols, "e2e") if "e2e" in doc else None,
        ttft=_grid(doc["ttft"], rows, cols, "ttft") if "ttft" in doc else None,
        percentile=int(percentile),
        slos=slos,
    )


class ProfileBook:
    """The profiles the gateway knows, by AIBrix's key (`profile_key(model, deployment)`).

    A loader hands in everything it found in one pass (`replace`): a profile is taken when its
    key is new or its `created` is later than the one held, so an older copy written late never
    replaces a newer one; a key the pass did not find is dropped (the profile was deleted). A
    failed pass hands in nothing and changes nothing.
    """

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[str, GpuProfile] = {}

    def replace(self, found: Mapping[str, GpuProfile]) -> list[str]:
        """Apply one complete pass; returns the keys that changed (added, newer, dropped)."""
        changed = [k for k in self._by_key if k not in found]
        kept = {k: v for k, v in self._by_key.items() if k in found}
        for key, profile in found.items():
            held = kept.get(key)
            if held is None or profile.created > held.created:
                kept[key] = profile
                changed.append(key)
        self._by_key = kept
        return changed

    def lookup(self, model: str, deployment: str | None) -> GpuProfile | None:
        return None if deployment is None else self._by_key.get(profile_key(model, deployment))

    def keys(self) -> list[str]:
        return sorted(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)
