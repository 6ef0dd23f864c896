"""GPU profiles in AIBrix's format: what one GPU type (a deployment) sustains per request size.

A profile holds, for a grid of output x input token counts (`indexes = [[out ticks], [in
ticks]]`), the highest request rate the deployment served within the SLO it was built for
(`tputs[out][in]`, requests/s; 0 where no tested rate met it), the mean end-to-end latency at
that rate (`e2e`, seconds) and, when a TTFT SLO was set, the mean TTFT (`ttft`). `slos` records
how it was built (`percentile` and each SLO set, by AIBrix's argument names: `e2e`, `ttft`,
`tpot`, `tpat`, `tput`, `tt`). Older AIBrix profiles have neither `e2e` nor `slos`; they load
with those empty. This project's profiles may also carry `e2e_idle` (same [out][in] shape: the
mean E2E of the cell's requests on an otherwise idle replica), written after AIBrix's keys,
which AIBrix's readers ignore: with it the E2E a request should take is interpolated between
idle and the profile's load (`GpuProfile.e2e_at`).

What a cell's requests cost inside a mix of sizes (`GpuProfile.mix_tputs`): a cell's `tputs` is
what a stream of that size ALONE sustains. For long prompts that is set by collisions (two 4k
prompts arriving together blow the TTFT), not by the work: the simulated a100 sustains 0.46 req/s
of 4096:64 alone, yet inside the chat mix such a prompt costs little more than its prefill. So a
cell counts, inside a mix, as at most `in / in'` requests of the cell one input tick smaller (the
same output): prefill work grows linearly with prompt tokens, and `k` requests of the smaller
prompt do the same prefill and `k` times the decode, so this bounds the work from above (the
attention's quadratic part is a few percent at these lengths). Applied tick by tick up the input
axis, `mix_tputs >= tputs` everywhere, equal where the cell is bound by its own throughput; 0
stays 0 (a size the GPU type never serves within the SLO stays unserved). The gateway charges a
request `1 / (mix_tputs x e2e)` of a pod; the optimizer sums `rate / mix_tputs` per replica and
keeps each cell's rate within `tputs` per replica.

A request's size maps to the cell whose ticks are nearest in log2 (`GpuProfile.cell`), clamped
to the grid: a size below the grid takes the smallest tick (a request is never harder than the
smallest cell), a size above it the border cell, which says nothing sure of it (`above_grid`
tells which axes lie more than half a doubling beyond the largest tick; the gateway counts
such requests).

Pure data and arithmetic: `plugin_tools.profile` builds profiles, the gateway loads them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plugin.errors import ConfigError

__all__ = [
    "SLO_NAMES",
    "GpuProfile",
    "ProfileBook",
    "ProfiledRoute",
    "SloTarget",
    "beyond_grid",
    "decode_speed",
    "late_rates",
    "mix_rates",
    "nearest_tick",
    "parse_profile",
    "prefill_speed",
    "profile_key",
    "slo_batch",
]

# AIBrix's SLO argument names, in the order its profile builder applies them.
SLO_NAMES = ("tput", "tt", "e2e", "ttft", "tpat", "tpot")
REDIS_PROFILE_PREFIX = "aibrix:profile_"


def profile_key(model: str, deployment: str) -> str:
    """The Redis key AIBrix's tools and gateway use for a deployment's profile."""
    return f"{REDIS_PROFILE_PREFIX}{model}_{deployment}"


Grid = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True)
class SloTarget:
    """Latency targets in seconds, each optional (None: not set); one vocabulary for a request's
    own targets (`x-slo-ttft-ms`, `x-slo-tpot-ms` set the first two), a GPU profile's `slos` and
    the fleet simulator's SLO.

    - `ttft_s`: time to the first token;
    - `tpot_s`: time per output token after the first ((E2E - TTFT) / (output tokens - 1));
    - `e2e_s`: end-to-end latency of the request;
    - `tpat_s`: time per all tokens, AIBrix's e2e-per-token SLO: E2E / (prompt + output tokens).

    A measurement meets a target when it is at most the target (NaN never meets one).
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tpat_s: float | None = None

    @classmethod
    def from_slos(cls, slos: Mapping[str, float]) -> SloTarget:
        """From a profile's `slos` (AIBrix's names); the others (`tput`, `tt`, `percentile`)
        are not latency targets and are left out."""
        return cls(slos.get("ttft"), slos.get("tpot"), slos.get("e2e"), slos.get("tpat"))

    def slos(self) -> dict[str, float]:
        """The targets that are set, by AIBrix's names (what a profile is built for)."""
        named = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s, "tpat": self.tpat_s}
        return {name: value for name, value in named.items() if value is not None}

    def met(self, ttft_s: float, tpot_s: float, e2e_s: float, tokens: int) -> bool:
        """Whether measured latencies meet every target that is set; `tokens` is prompt +
        output tokens (TPAT's denominator). A target not set is met by any measurement."""
        checks = (
            (self.ttft_s, ttft_s),
            (self.tpot_s, tpot_s),
            (self.e2e_s, e2e_s),
            (self.tpat_s, e2e_s / tokens if tokens > 0 else float("inf")),
        )
        return all(target is None or measured <= target for target, measured in checks)


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
    # [out][in] mean end-to-end seconds of the cell's requests on an otherwise idle replica
    # (this project's key, not AIBrix's; None: not measured).
    e2e_idle: Grid | None = None
    # [out][in] req/s the cell's requests count for inside a mix (module doc); derived.
    mix_tputs: Grid = field(init=False, repr=False, compare=False)
    # [out][in] the same for requests served late, beyond the SLO (`late_rates`); derived.
    late_tputs: Grid = field(init=False, repr=False, compare=False)
    # `slos` as latency targets (`SloTarget.from_slos`); derived once, read on every SLO fit.
    target: SloTarget = field(init=False, repr=False, compare=False)
    # Prompt tokens a replica prefills a second (`prefill_speed`); derived, None if unknown.
    prefill_tokens_per_s: float | None = field(init=False, repr=False, compare=False)
    # Output tokens a replica decodes a second within the SLO (`decode_speed`); derived.
    decode_tokens_per_s: float | None = field(init=False, repr=False, compare=False)
    # Requests a replica holds in flight and still keeps its SLO (`slo_batch`); derived.
    slo_batch: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mix_tputs", mix_rates(self.tputs, self.in_ticks))
        object.__setattr__(self, "late_tputs", late_rates(self.mix_tputs, self.in_ticks))
        object.__setattr__(self, "target", SloTarget.from_slos(self.slos))
        object.__setattr__(self, "prefill_tokens_per_s", prefill_speed(self))
        object.__setattr__(self, "decode_tokens_per_s", decode_speed(self))
        object.__setattr__(self, "slo_batch", slo_batch(self))

    def to_json(self) -> dict[str, Any]:
        """The document AIBrix writes (same keys, same order), then `e2e_idle` when known."""
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
        if self.e2e_idle is not None:  # after AIBrix's keys; its readers ignore it
            doc["e2e_idle"] = [list(row) for row in self.e2e_idle]
        return doc

    def cell(self, input_tokens: int, output_tokens: int) -> tuple[int, int]:
        """The (out, in) cell whose ticks are nearest in log2 to the request's sizes, clamped to
        the grid: a size below it takes the smallest tick (never harder than the smallest cell),
        a size above it the border cell (`above_grid` says when that is a guess)."""
        return _nearest(self.out_ticks, output_tokens), _nearest(self.in_ticks, input_tokens)

    def above_grid(self, input_tokens: int, output_tokens: int) -> tuple[str, ...]:
        """The axes (`"output"`, `"input"`) on which the sizes lie more than half a doubling
        above the grid's largest tick: the border cell `cell` gives them describes smaller
        requests. Empty for a size within the grid or below it."""
        out = output_tokens > self.out_ticks[-1] and beyond_grid(self.out_ticks, output_tokens)
        inp = input_tokens > self.in_ticks[-1] and beyond_grid(self.in_ticks, input_tokens)
        if out:
            return _BOTH if inp else _OUTPUT
        return _INPUT if inp else ()

    def e2e_at(self, cell: tuple[int, int], load: float) -> float | None:
        """The cell's mean E2E (seconds) at a replica `load` (its SLO load, 1.0 full; clamped
        to [0, 1]): `e2e_idle + (e2e - e2e_idle) x load` where the profile has an idle E2E for
        the cell, else `e2e` (the load the profile ran at); None without a positive `e2e`."""
        i, j = cell
        e2e = self.e2e[i][j] if self.e2e is not None else math.nan
        if not (e2e > 0 and math.isfinite(e2e)):
            return None
        idle = self.idle_e2e(cell)
        if idle is None:
            return e2e
        return idle + (e2e - idle) * min(max(load, 0.0), 1.0)

    def idle_e2e(self, cell: tuple[int, int]) -> float | None:
        """The cell's mean E2E on an idle replica (seconds), None where not measured."""
        if self.e2e_idle is None:
            return None
        idle = self.e2e_idle[cell[0]][cell[1]]
        return idle if idle > 0 and math.isfinite(idle) else None

    def clamped_cell(self, input_tokens: float, output_tokens: float) -> tuple[int, int]:
        """The (out, in) cell nearest in log2, clamped to the grid at both ends (AIBrix's
        optimizer plans a size outside the grid at the border cell)."""
        return nearest_tick(self.out_ticks, output_tokens), nearest_tick(
            self.in_ticks, input_tokens
        )


@dataclass(frozen=True, slots=True)
class ProfiledRoute:
    """A request routed by a GPU profile: where it sits in the profile and what the profile
    predicts for it, so the gateway can check the profile against what the request then takes
    (`plugin.core.drift`) and count sizes the profile does not cover."""

    profile: GpuProfile  # the profile of the pod's deployment
    cell: tuple[int, int]  # (out, in) indexes into its grid
    output_tokens: int  # the output size the strategy assumed (the prompt's is the request's)
    load: float  # the pod's SLO load with this request, when it was routed (1.0: full)
    e2e_s: float | None  # the profile's E2E at that load (`GpuProfile.e2e_at`); None: no E2E
    above: tuple[str, ...] = ()  # axes on which the request lies above the grid

    @property
    def ticks(self) -> tuple[int, int]:
        """The cell as (output tick, input tick)."""
        return self.profile.out_ticks[self.cell[0]], self.profile.in_ticks[self.cell[1]]


def mix_rates(tputs: Grid, in_ticks: Sequence[int]) -> Grid:
    """Each cell's rate inside a mix (module doc): the larger of its own `tputs` and the rate
    the cell one input tick smaller counts for inside a mix, divided by the ticks' ratio. Cells
    at 0 stay 0 and pass no bound on (a gap in the grid breaks the chain)."""
    rows = []
    for row in tputs:
        mixed: list[float] = []
        for j, tput in enumerate(row):
            rate = tput
            if tput > 0 and j > 0 and mixed[j - 1] > 0:
                rate = max(tput, mixed[j - 1] * in_ticks[j - 1] / in_ticks[j])
            mixed.append(rate)
        rows.append(tuple(mixed))
    return tuple(rows)


def late_rates(mix: Grid, in_ticks: Sequence[int]) -> Grid:
    """What a cell counts for inside a mix when its requests are served late (the optimizer's
    attainment target): `mix_tputs` where the GPU type serves the cell within the SLO; where it
    never does (0), the same bound carried on up the input axis, the rate of the cell one input
    tick smaller divided by the ticks' ratio (its prefill grows with the prompt; the engine
    still does the work, only later than the SLO). 0 where no smaller prompt of the same output
    is served at all: nothing to go by."""
    rows = []
    for row in mix:
        late: list[float] = []
        for j, rate in enumerate(row):
            if rate <= 0 and j > 0 and late[j - 1] > 0:
                rate = late[j - 1] * in_ticks[j - 1] / in_ticks[j]
            late.append(rate)
        rows.append(tuple(late))
    return tuple(rows)


def nearest_tick(ticks: Sequence[int], tokens: float) -> int:
    """Index of the tick nearest in log2 to `tokens`, clamped to the grid (a tie goes to the
    larger, costlier tick)."""
    if not ticks:
        raise ValueError("a profile grid has at least one tick")
    x = math.log2(max(tokens, 1.0))
    return min(range(len(ticks)), key=lambda k: (abs(math.log2(ticks[k]) - x), -k))


_OUTPUT = ("output",)
_INPUT = ("input",)
_BOTH = ("output", "input")


def beyond_grid(ticks: Sequence[int], tokens: float) -> bool:
    """Whether `tokens` lies more than half a doubling above the largest tick (the nearest
    tick in log2 is then the last one only by clamping)."""
    return math.log2(max(tokens, 1.0)) > math.log2(ticks[-1]) + 0.5


@functools.lru_cache(maxsize=4096)
def _nearest(ticks: tuple[int, ...], tokens: int) -> int:
    """`nearest_tick`, cached: SLO routing asks it for every deployment on every request, and a
    fleet sees few distinct (grid, size) pairs."""
    return nearest_tick(ticks, tokens)


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
    idle = doc.get("e2e_idle")  # this project's key (AIBrix's readers ignore it)
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
        e2e_idle=None if idle is None else _grid(idle, rows, cols, "e2e_idle"),
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


def prefill_speed(profile: GpuProfile) -> float | None:
    """Prompt tokens a replica prefills a second, read off the grid's shortest answers, each
    time from the idle E2E where measured, else the E2E at the cell's rate (it holds queueing,
    so the speed reads low), else the TTFT: the extra prompt tokens of the grid's largest
    prompt over its smallest, over the extra seconds they took. Differencing takes out what
    both answers share, their decode steps and a step's fixed cost: a shortest answer of 32
    tokens is as much decode as a 4k prompt's prefill on an A100, and the largest prompt's
    tokens over its seconds alone read half its speed. At least that plain ratio (the speed
    with one usable prompt size), which a slope at noise level must not undercut. None without
    any usable time."""
    for grid in (profile.e2e_idle, profile.e2e, profile.ttft):
        if grid is None:
            continue
        usable = [
            (tokens, seconds)
            for tokens, seconds in zip(profile.in_ticks, grid[0], strict=True)
            if seconds > 0 and math.isfinite(seconds)
        ]
        if not usable:
            continue
        plain = max(tokens / seconds for tokens, seconds in usable)
        (least, least_s), (most, most_s) = usable[0], usable[-1]
        if most > least and most_s > least_s:
            return max(plain, (most - least) / (most_s - least_s))
        return plain
    return None


def decode_speed(profile: GpuProfile) -> float | None:
    """Output tokens a replica produces a second within the SLO when it decodes: at the grid's
    shortest prompt, the best over answer lengths of the cell's rate times its answer length
    (a batch's tokens, so one token's share of the GPU is its inverse). None when no cell of
    that row is ever within the SLO."""
    rates = [row[0] for row in profile.tputs]
    best = max((r * t for r, t in zip(rates, profile.out_ticks, strict=True)), default=0.0)
    return best if best > 0 and math.isfinite(best) else None


def slo_batch(profile: GpuProfile) -> int | None:
    """Requests a replica holds in flight while it keeps its SLO: by Little's law, the rate of
    the grid's longest answers to its shortest prompt (decode-bound: what a batch's time per
    token limits) times their mean E2E at that rate. An engine's own cap is what fits its
    memory; this is what keeps the profile's SLO. At least 1; None without an E2E grid or a
    rate within the SLO in that column."""
    if profile.e2e is None:
        return None
    for row in range(len(profile.out_ticks) - 1, -1, -1):
        rate, e2e = profile.tputs[row][0], profile.e2e[row][0]
        if rate > 0 and e2e > 0 and math.isfinite(rate * e2e):
            return max(1, math.floor(rate * e2e))
    return None
