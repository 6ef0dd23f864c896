"""Steady-state profiling: per cell, the largest Poisson rate one replica sustains within an SLO.

AIBrix's sweep keeps a rate when 100 requests' throughput, counted to the last response, stays
within 0.9 of the offered rate; that caps a point at about a dozen requests in flight and leaves
profiles near a tenth of what a GPU sustains (AIBrix 0.8.0, `gen_profile.py`, `benchmark.sh`,
`gpu_benchmark.py` under `gpu_optimizer/optimizer/profiling/`). Here each probe is long
enough to reach a steady state and is judged on it:

- **Probe.** Poisson arrivals at one rate: a warm-up long enough for the batch to fill
  (`warmup_s`: twice the cell's idle E2E, or twice the longest E2E the SLO allows, whichever is
  longer; near capacity a continuous-batching engine takes several E2Es to settle), then the
  judged requests (at least `judged_requests(p)`, and a warm-up's worth). Nothing sent during
  the warm-up is judged; nothing is sent after the last judged request, so the drain is never
  counted as throughput.
- **Stable**: over the judged window the completions keep up with the arrivals (the in-flight
  count, averaged over the window's first and last thirds, grows by less than `1 - KEEP_UP` of
  the arrivals between them) and TTFT does not grow (the last third's median within `GROWTH` of
  the first's, plus a few steps' slack).
- **Meets the SLO at percentile p, per request**: each judged request meets every target
  (TTFT, TPOT as (E2E - TTFT) / (output - 1), E2E, TPAT), a failed request never does, and the
  95% upper bound on the share of misses (Clopper-Pearson) is at most 1 - p/100: at p99 that
  takes 299 requests with no miss. When the bounds straddle 1 - p/100 the probe is too close to
  call: it runs again with twice the judged requests, up to `JUDGED_CAP` times the minimum (or
  what `MAX_PROBE_S` of sends allows at its rate, if less), where the share seen decides. At
  percentile 0 (AIBrix's mean) each metric's mean meets its target instead.
- **Search** (`CellSearch`): from a start rate, double while probes pass, halve while they
  fail, then bisect geometrically until the highest pass and the lowest fail are within
  `RATIO` (10%); the highest pass is then confirmed with two more seeds on probes
  `CONFIRM_LENGTH` times as long, within `MAX_PROBE_S` of sends (near a batch cap a queue may
  run away only after a while, and only for some arrival streams); a failure there makes it
  the new lowest fail and the search goes on. A cell's search may start with a ceiling: a rate
  that failed for a smaller cell fails for this one too, along the axes where more tokens are
  never easier for the SLO (`bounding_axes`).

Pure: no clock, no I/O; the live sweep (`plugin_tools.profile.sweep`) and the simulator
(`plugin_tools.sim.profiles`) run the probes and feed the outcomes back.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import orjson

from plugin.core.profile import GpuProfile
from plugin.core.types import SloTarget
from plugin.errors import ConfigError
from plugin_tools.profile.build import BenchmarkRow
from plugin_tools.stats import interpolated_percentiles

__all__ = [
    "CONFIDENCE",
    "RATIO",
    "CellHistory",
    "CellSearch",
    "GridSearch",
    "Outcome",
    "Probe",
    "ProbePlan",
    "SteadyProfile",
    "Verdict",
    "bounding_axes",
    "build_steady_profile",
    "cell_probes",
    "history_from_rows",
    "idle_passed",
    "judge",
    "judged_requests",
    "miss_upper_bound",
    "plan_probe",
    "pooled_gaps",
    "probe_rows",
    "slo_e2e_bound",
    "sweep_grid",
    "sweep_wall_seconds",
    "swept_slo",
]

CONFIDENCE = 0.95  # of the upper bound on the share of requests that miss the SLO
RATIO = 1.1  # the search stops when the lowest failing rate is within 10% of the highest pass
KEEP_UP = 0.9  # completions over arrivals in the judged window
GROWTH = 1.5  # the last third's median TTFT over the first third's, at most
INSTANTS = 60  # times in the window at which the in-flight count is read
JUDGED_WARMUPS = 1.0  # the judged window lasts at least this many warm-ups
MAX_PROBE_S = 600.0  # sends a confirmation or a longer run may last (a GPU's time is dear)
CONFIRM_LENGTH = 4  # a confirmation runs four times as long: near a cliff, short runs pass
JUDGED_CAP = 8  # a probe too close to call grows up to 8 x the fewest judged (2,392 at p99)
GROWTH_SLACK_S = 0.05  # TTFT may also grow by this much (a few engine steps of jitter)
WARMUP_E2ES = 2.0  # warm-up: this many idle E2Es at least
IDLE_REQUESTS = 3  # sent one at a time to learn the cell's idle E2E
MAX_PROBES = 24  # per cell; the search gives its best answer so far when it runs out


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request of a probe (times in seconds; `sent_s` from the probe's start)."""

    sent_s: float
    ok: bool
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int = 0
    gaps: tuple[float, ...] = ()  # between network chunks (AIBrix's pooled TPOT)

    @property
    def done_s(self) -> float:
        return self.sent_s + self.e2e_s if self.ok else math.inf

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, this request's own."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slo: SloTarget) -> bool:
        return self.ok and slo.met(
            self.ttft_s, self.tpot_s, self.e2e_s, self.prompt_tokens + self.output_tokens
        )


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in logs (n up to tens of thousands)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k + 1):
        log_term = math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        total += math.exp(log_term + i * lp + (n - i) * lq)
    return min(total, 1.0)


def miss_upper_bound(misses: int, n: int, confidence: float = CONFIDENCE) -> float:
    """Clopper-Pearson upper bound on the share of misses after `misses` of `n` (1.0 for n 0).

    The p at which seeing `misses` or fewer has probability 1 - confidence, found by bisection
    (the binomial tail falls monotonically in p). Written out rather than taken from SciPy's
    beta quantile because the tools' `demo` extra does not carry SciPy.
    """
    if n <= 0:
        return 1.0
    if misses >= n:
        return 1.0
    alpha = 1.0 - confidence
    lo, hi = misses / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _binomial_cdf(misses, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def miss_lower_bound(misses: int, n: int, confidence: float = CONFIDENCE) -> float:
    """Clopper-Pearson lower bound on the share of misses (0.0 with no miss): the p at which
    seeing `misses` or more has probability 1 - confidence."""
    if misses <= 0 or n <= 0:
        return 0.0
    alpha = 1.0 - confidence
    lo, hi = 0.0, misses / n
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 - _binomial_cdf(misses - 1, n, mid) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


def idle_passed(outcomes: Sequence[Outcome], slo: SloTarget) -> bool:
    """The idle probe's verdict: most of its requests, sent one at a time, met the SLO."""
    return sum(1 for o in outcomes if o.meets(slo)) * 2 > len(outcomes)


def judged_requests(percentile: int, confidence: float = CONFIDENCE) -> int:
    """The fewest judged requests with which a probe without a miss can pass at `percentile`
    (299 at p99, 29 at p90, 5 at p50); at 0 (the mean) a statistic, not a bound: 30."""
    if percentile <= 0:
        return 30
    allowed = 1.0 - percentile / 100.0
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - allowed))


def slo_e2e_bound(slo: SloTarget, prompt_tokens: int, output_tokens: int) -> float:
    """The longest E2E a request of this size may take and meet `slo` (inf when unbounded)."""
    bounds = [math.inf]
    if slo.e2e_s is not None:
        bounds.append(slo.e2e_s)
    if slo.tpat_s is not None:
        bounds.append(slo.tpat_s * (prompt_tokens + output_tokens))
    if slo.ttft_s is not None and slo.tpot_s is not None:
        bounds.append(slo.ttft_s + slo.tpot_s * max(output_tokens - 1, 0))
    return min(bounds)


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """How many requests a probe sends and which of them are judged."""

    rate: float
    warmup: int  # the first requests, not judged
    requests: int  # warm-up and judged together
    judged_cap: int = 0  # a probe too close to call grows (doubling its judged) up to this
    sequential: bool = False  # the idle probe: each request sent when the previous one ended

    @property
    def seconds(self) -> float:
        """Expected span of the sends."""
        return self.requests / self.rate


def plan_probe(
    rate: float,
    idle_e2e_s: float,
    slo: SloTarget,
    percentile: int,
    prompt_tokens: int,
    output_tokens: int,
    *,
    confirm: bool = False,
) -> ProbePlan:
    """A probe long enough to reach and show a steady state at `rate` (module doc); a
    confirmation judges `CONFIRM_LENGTH` times as many requests."""
    if not rate > 0:
        raise ValueError(f"a probe needs a positive rate, got {rate}")
    longest = slo_e2e_bound(slo, prompt_tokens, output_tokens)
    warmup_s = WARMUP_E2ES * idle_e2e_s
    if math.isfinite(longest):
        warmup_s = max(warmup_s, WARMUP_E2ES * longest)
    warm = math.ceil(rate * warmup_s)
    fewest = judged_requests(percentile)
    judged = max(fewest, math.ceil(JUDGED_WARMUPS * warm))
    # What a budget of MAX_PROBE_S of sends allows beyond that: the fewest a verdict needs are
    # never cut, the longer confirmations and the runs of a probe too close to call are.
    budget = max(judged, math.floor(rate * MAX_PROBE_S))
    if confirm:
        judged = max(judged, min(CONFIRM_LENGTH * judged, budget))
    return ProbePlan(rate, warm, warm + judged, min(JUDGED_CAP * fewest, budget))


def longer(plan: ProbePlan) -> ProbePlan:
    """The same probe with twice the judged requests (a verdict too close to call)."""
    judged = plan.requests - plan.warmup
    return replace(plan, requests=plan.warmup + 2 * judged)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one probe showed."""

    stable: bool
    meets: bool
    judged: int
    misses: int
    miss_bound: float  # 95% upper bound on the share of misses (NaN at percentile 0)
    throughput: float  # completions per second over the judged window
    window_s: float
    reason: str = ""  # why it failed, for the log and the JSONL
    decided: bool = True  # False: stable, but the misses are too close to call at this size

    @property
    def passed(self) -> bool:
        return self.stable and self.meets


def _thirds(
    values: Sequence[float], middle: Callable[[Sequence[float]], float]
) -> tuple[float, float]:
    """`middle` (mean or median) of the first and of the last third of `values`."""
    n = max(len(values) // 3, 1)
    return middle(values[:n]), middle(values[-n:])


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def judge(outcomes: Sequence[Outcome], plan: ProbePlan, slo: SloTarget, percentile: int) -> Verdict:
    """Stable and within the SLO at `percentile` (module doc)."""
    ordered = sorted(outcomes, key=lambda o: o.sent_s)
    judged = ordered[plan.warmup :]
    if len(judged) < 2:
        return Verdict(False, False, len(judged), 0, 1.0, 0.0, 0.0, "too few judged requests")
    start, end = judged[0].sent_s, judged[-1].sent_s
    window = max(end - start, 1e-9)
    completed = sum(1 for o in ordered if start <= o.done_s <= end)
    throughput = completed / window
    reasons = []
    # In flight at INSTANTS times over the window (sent by then, less done by then), averaged
    # over the window's first and last thirds: between the two, completions fell short of
    # arrivals by exactly the growth. Two single instants would be as noisy as the batch.
    sends = [o.sent_s for o in ordered]
    dones = sorted(o.done_s for o in ordered)
    instants = [start + window * (k + 0.5) / INSTANTS for k in range(INSTANTS)]
    load = [float(bisect_right(sends, t) - bisect_right(dones, t)) for t in instants]
    first_load, last_load = _thirds(load, _mean)
    arrived = (len(judged) - 1) * 2 / 3  # between the thirds' centres
    if last_load - first_load > (1 - KEEP_UP) * arrived:
        reasons.append(
            f"completions {arrived - (last_load - first_load):.0f} of {arrived:.0f} arrivals "
            f"(in flight {first_load:.0f} -> {last_load:.0f})"
        )
    ttfts = [o.ttft_s if o.ok else math.inf for o in judged]
    first_ttft, last_ttft = _thirds(ttfts, _median)
    if last_ttft > max(GROWTH * first_ttft, first_ttft + GROWTH_SLACK_S):
        reasons.append(f"TTFT grew {first_ttft:.3f} -> {last_ttft:.3f} s")
    stable = not reasons
    misses = sum(1 for o in judged if not o.meets(slo))
    if percentile <= 0:
        bound = math.nan
        meets = misses < len(judged) and _means_meet(judged, slo)
    else:
        allowed = 1.0 - percentile / 100.0 + 1e-12
        bound = miss_upper_bound(misses, len(judged))
        meets = bound <= allowed
        if not meets and stable and miss_lower_bound(misses, len(judged)) <= allowed:
            if len(judged) < plan.judged_cap:  # too close to call: a longer probe decides
                why = f"{misses} of {len(judged)} missed the SLO: too close to call"
                return Verdict(
                    stable, False, len(judged), misses, bound, throughput, window, why, False
                )
            meets = misses / len(judged) <= allowed  # at the cap, the share seen decides
    if not meets:
        reasons.append(f"{misses} of {len(judged)} missed the SLO")
    why = "; ".join(reasons)
    return Verdict(stable, meets, len(judged), misses, bound, throughput, window, why)


def _means_meet(judged: Sequence[Outcome], slo: SloTarget) -> bool:
    ok = [o for o in judged if o.ok]
    if len(ok) < len(judged):
        return False
    n = len(ok)
    return slo.met(
        sum(o.ttft_s for o in ok) / n,
        sum(o.tpot_s for o in ok) / n,
        sum(o.e2e_s for o in ok) / n,
        1,  # TPAT below: each request over its own tokens
    ) and (
        slo.tpat_s is None
        or sum(o.e2e_s / max(o.prompt_tokens + o.output_tokens, 1) for o in ok) / n <= slo.tpat_s
    )


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe the search asks for: a rate and the seed of its arrivals."""

    rate: float
    seed: int
    kind: str  # "idle" (one request at a time), "search" or "confirm"


@dataclass(slots=True)
class CellSearch:
    """Double, halve, bisect to `RATIO`, confirm with a second seed (module doc).

    `ceiling`: a rate known to fail (inf if none); `floor`: below it a cell is called
    unservable (0); `limit`: the highest rate the sweep offers (a cell that passes it is
    reported at it).
    """

    start: float
    ceiling: float = math.inf
    floor: float = 1e-3
    limit: float = 4096.0
    seeds: tuple[int, ...] = (1, 2, 3)  # the search's, then the confirmations'
    ratio: float = RATIO
    max_probes: int = MAX_PROBES
    lo: float = 0.0  # highest rate that passed the search seed (and not disproved)
    hi: float = math.inf  # lowest rate that failed
    confirmed_by: set[int] = field(default_factory=set)  # confirmation seeds passed at lo
    unservable: bool = False  # one request alone already misses the SLO
    probes: list[tuple[Probe, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hi = min(self.hi, self.ceiling)
        self.start = min(max(self.start, self.floor), self.limit)
        if self.start >= self.hi:
            self.start = self.hi / 2

    def next(self) -> Probe | None:
        """The next probe, or None when the search is done."""
        if self.unservable or len(self.probes) >= self.max_probes:
            return None
        search_seed = self.seeds[0]
        pending = [seed for seed in self.seeds[1:] if seed not in self.confirmed_by]
        if self.lo <= 0:
            searched = any(p.kind != "idle" for p, _ in self.probes)
            rate = self.hi / 2 if searched else self.start
            if rate < self.floor:
                return None  # nothing down to the floor passes: unservable
            return Probe(rate, search_seed, "search")
        if self.hi == math.inf:
            if self.lo >= self.limit:
                return Probe(self.lo, pending[0], "confirm") if pending else None
            return Probe(min(self.lo * 2, self.limit), search_seed, "search")
        if self.hi / self.lo > self.ratio:
            return Probe(math.sqrt(self.lo * self.hi), search_seed, "search")
        if pending:
            return Probe(self.lo, pending[0], "confirm")
        return None

    def record(self, probe: Probe, passed: bool) -> None:
        self.probes.append((probe, passed))
        if probe.kind == "idle":
            if not passed:
                self.unservable = True
                self.hi = min(self.hi, probe.rate)
            return
        if probe.kind == "confirm":
            if passed:
                self.confirmed_by.add(probe.seed)
                return
            # The pass did not hold with other arrivals: it becomes the lowest failure.
            self.hi = min(self.hi, probe.rate)
            self.lo = self._best_pass_below(self.hi)
            self.confirmed_by = set()
            return
        before = self.lo
        if passed:
            self.lo = max(self.lo, probe.rate)
        else:
            self.hi = min(self.hi, probe.rate)
            if self.lo >= self.hi:  # noise: a lower rate passed where a higher one failed
                self.lo = self._best_pass_below(self.hi)
        if self.lo != before:
            self.confirmed_by = set()

    def _best_pass_below(self, rate: float) -> float:
        passes = [p.rate for p, ok in self.probes if ok and p.kind == "search"]
        return max((r for r in passes if r < rate), default=0.0)

    @property
    def confirmed(self) -> bool:
        """Every confirmation seed passed at the rate found."""
        return self.lo > 0 and set(self.seeds[1:]) <= self.confirmed_by

    @property
    def done(self) -> bool:
        return self.next() is None

    @property
    def result(self) -> float:
        """The sustained rate found (0: unservable down to the floor)."""
        return self.lo


Cell = tuple[int, int]  # (input tokens, output tokens)
PREDICTED_CONCURRENCY = 8.0  # a cell with no finished neighbour starts at 8 requests in flight


@dataclass(slots=True)
class GridSearch:
    """The cells of a sweep in an order that lets each bound the next (module doc).

    A cell is ready once the cells one tick smaller on each axis are finished (so cells on one
    anti-diagonal can run in parallel on several replicas). With `cuts` a cell starts from a
    prediction (a finished neighbour's rate scaled by the ratio of their idle E2Es) under a
    ceiling (the lowest failing rate of any finished cell it dominates); without, every cell
    doubles up from `rate_start`, as a plain sweep would. Which axes bound (`monotone_in`,
    `monotone_out`) depends on the SLO (`bounding_axes`): a longer prompt never makes TTFT,
    TPOT or E2E easier, a longer answer never TTFT or E2E, but per-request TPOT averages over
    the answer (a two-token answer's TPOT is one gap, which one neighbour's prefill can fail),
    and TPAT divides by every token, so neither bounds along the axes it can fall on.
    """

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    rate_start: float = 1.0
    rate_limit: float = 4096.0
    floor: float = 1e-3
    cuts: bool = True
    monotone_in: bool = True
    monotone_out: bool = True
    finished: dict[Cell, CellSearch] = field(default_factory=dict)
    idle: dict[Cell, float] = field(default_factory=dict)
    started: set[Cell] = field(default_factory=set)

    @property
    def cells(self) -> list[Cell]:
        """AIBrix's order: outputs inside inputs."""
        return [(i, o) for i in self.inputs for o in self.outputs]

    def smaller(self, cell: Cell) -> list[Cell]:
        i, o = cell
        out = []
        k, m = self.inputs.index(i), self.outputs.index(o)
        if k > 0:
            out.append((self.inputs[k - 1], o))
        if m > 0:
            out.append((i, self.outputs[m - 1]))
        return out

    def ready(self) -> list[Cell]:
        """Cells not started whose smaller neighbours are finished, in AIBrix's order."""
        return [
            c
            for c in self.cells
            if c not in self.started and all(n in self.finished for n in self.smaller(c))
        ]

    def ceiling(self, cell: Cell) -> float:
        if not self.cuts:
            return math.inf
        i, o = cell
        return min(
            (
                s.hi
                for (fi, fo), s in self.finished.items()
                if (fi == i or (fi < i and self.monotone_in))
                and (fo == o or (fo < o and self.monotone_out))
                and (fi, fo) != cell
            ),
            default=math.inf,
        )

    def begin(self, cell: Cell, idle_e2e_s: float) -> CellSearch:
        """The search of `cell`, whose idle E2E was just measured."""
        self.started.add(cell)
        self.idle[cell] = idle_e2e_s
        start = self.rate_start
        if self.cuts:
            guesses = [
                self.finished[n].lo * self.idle[n] / idle_e2e_s
                for n in self.smaller(cell)
                if self.finished[n].lo > 0 and idle_e2e_s > 0
            ]
            if guesses:
                start = min(guesses)
            elif idle_e2e_s > 0:
                start = PREDICTED_CONCURRENCY / idle_e2e_s
        return CellSearch(start, self.ceiling(cell), self.floor, self.rate_limit)

    def resume(self, cell: Cell, idle_e2e_s: float, start: float, ceiling: float) -> CellSearch:
        """The search of `cell` as a previous run began it (the start and ceiling it recorded;
        a resumed sweep must be given the same floor and limit, `history_from_rows` has them)."""
        self.started.add(cell)
        self.idle[cell] = idle_e2e_s
        return CellSearch(start, ceiling, self.floor, self.rate_limit)

    def finish(self, cell: Cell, search: CellSearch) -> None:
        self.finished[cell] = search

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.inputs) * len(self.outputs)


def _stats(values: Sequence[float]) -> tuple[float, float, float, float]:
    """mean, P50, P90, P99 as AIBrix's benchmark computes them (NaN for no values)."""
    if not values:
        return math.nan, math.nan, math.nan, math.nan
    p50, p90, p99 = interpolated_percentiles(values, (50, 90, 99))
    return sum(values) / len(values), p50, p90, p99


def pooled_gaps(gaps: Sequence[float]) -> dict[str, float | None]:
    """The `pooled_gaps` object of a TPOT row: statistics of every gap between network chunks of
    every served request (AIBrix's TPOT), kept beside the row's own per-request TPOT."""
    stats = dict(zip(("mean", "P50", "P90", "P99"), _stats(gaps), strict=True))
    return {k: None if math.isnan(v) else v for k, v in stats.items()}


def probe_rows(
    cell: Cell,
    probe: Probe,
    outcomes: Sequence[Outcome],
    verdict: Verdict | None,
    *,
    slo: SloTarget,
    percentile: int,
    model: str,
    warmup: int = 0,
    search: CellSearch | None = None,
    idle_e2e_s: float = math.nan,
) -> list[BenchmarkRow]:
    """AIBrix's five rows for one probe, with the verdict on the TPUT row (`passed`, why not,
    the counts) and on the TPOT row the pooled chunk gaps AIBrix's TPOT means (`pooled_gaps`)
    while the row's own statistics are per request. An idle probe (`verdict` None) also
    records the search's start and ceiling, so a resumed sweep begins the cell the same way.

    Statistics are over the judged requests (the idle probe's: all of them); TPUT is the
    completions per second over the judged window, which a stable probe holds at its rate.
    """
    input_tokens, output_tokens = cell
    if verdict is None:  # idle: one request at a time
        judged = list(outcomes)
        throughput = probe.rate
        passed = idle_passed(judged, slo)
        info: dict[str, object] = {"passed": passed, "idle_e2e": idle_e2e_s}
        if search is not None:
            info["start"] = search.start
            info["ceiling"] = None if math.isinf(search.ceiling) else search.ceiling
            info["floor"] = search.floor
            info["limit"] = search.limit
    else:
        judged = sorted(outcomes, key=lambda o: o.sent_s)[warmup:]
        throughput = verdict.throughput
        info = {
            "passed": verdict.passed,
            "stable": verdict.stable,
            "judged": verdict.judged,
            "misses": verdict.misses,
            "miss_bound": None if math.isnan(verdict.miss_bound) else verdict.miss_bound,
            "window_s": verdict.window_s,
            "reason": verdict.reason,
        }
    served = [o for o in judged if o.ok]
    steady = {"probe": probe.kind, **info, "slo": slo.slos(), "percentile": percentile}

    def row(metric: str, stats: tuple[float, ...], extra: dict[str, object]) -> BenchmarkRow:
        mean, p50, p90, p99 = (*stats, math.nan, math.nan, math.nan)[:4]
        return BenchmarkRow(
            input_tokens,
            output_tokens,
            probe.rate,
            metric,
            mean,
            p50,
            p90,
            p99,
            seed=probe.seed,
            model=model,
            samples=len(outcomes),
            extra=extra,
        )

    pooled = pooled_gaps([g for o in served for g in o.gaps])
    return [
        row("TPUT", (throughput,), {"steady": steady}),
        row("TT", (throughput * output_tokens,), {}),
        row("E2E", _stats([o.e2e_s for o in served]), {}),
        row("TTFT", _stats([o.ttft_s for o in served]), {}),
        row(
            "TPOT",
            _stats([o.tpot_s for o in served if o.output_tokens > 1]),
            {"pooled_gaps": pooled},
        ),
    ]


@dataclass(slots=True)
class CellHistory:
    """What a previous run of the sweep measured of one cell (read back from its rows)."""

    idle_e2e_s: float = math.nan
    idle_passed: bool = True
    start: float = math.nan
    ceiling: float = math.inf
    floor: float = math.nan
    limit: float = math.nan
    probes: list[tuple[Probe, bool]] = field(default_factory=list)

    def search(self) -> CellSearch:
        """The cell's search replayed from its verdicts: where it stands, or its answer."""
        replayed = CellSearch(self.start, self.ceiling, self.floor, self.limit)
        for probe, passed in self.probes:
            replayed.record(probe, passed)
        return replayed


def history_from_rows(rows: Sequence[BenchmarkRow]) -> dict[Cell, CellHistory]:
    """Per cell, the idle measurement and the probes' verdicts, in the order they ran, from the
    TPUT rows a steady sweep wrote (rows without a verdict are not ours and are skipped)."""
    out: dict[Cell, CellHistory] = {}
    for r in rows:
        steady = r.extra.get("steady")
        if r.metric != "TPUT" or not isinstance(steady, Mapping):
            continue
        cell = (r.input_tokens, r.output_tokens)
        h = out.setdefault(cell, CellHistory())
        kind = str(steady.get("probe", "search"))
        passed = bool(steady.get("passed"))
        if kind == "idle":
            h.idle_e2e_s = float(steady.get("idle_e2e") or math.nan)
            h.idle_passed = passed
            h.start = float(steady.get("start") or math.nan)
            ceiling = steady.get("ceiling")
            h.ceiling = math.inf if ceiling is None else float(ceiling)
            h.floor = float(steady.get("floor") or math.nan)
            h.limit = float(steady.get("limit") or math.nan)
        h.probes.append((Probe(r.request_rate, r.seed, kind), passed))
    return out


Emit = Callable[[list[BenchmarkRow]], None]


def cell_probes(
    grid: GridSearch,
    cell: Cell,
    slo: SloTarget,
    percentile: int,
    model: str,
    emit: Emit,
    history: CellHistory | None = None,
) -> Generator[tuple[Probe, ProbePlan], list[Outcome], CellSearch]:
    """One cell's search as a generator: it yields the probes to run and is sent their
    outcomes; each probe's rows go to `emit` as soon as it is judged. Probes in `history` (a
    resumed sweep) are replayed, not run again. Returns the finished search."""
    input_tokens, output_tokens = cell
    done = list(history.probes) if history is not None else []
    if history is not None and not math.isnan(history.idle_e2e_s):
        idle_e2e = history.idle_e2e_s
        search = grid.resume(cell, idle_e2e, history.start, history.ceiling)
    else:
        if grid.ceiling(cell) <= grid.floor:  # a smaller cell already failed at the floor
            search = grid.resume(cell, math.nan, grid.floor, grid.ceiling(cell))
            search.unservable = True
            grid.finish(cell, search)
            return search
        plan = ProbePlan(1.0, 0, IDLE_REQUESTS, sequential=True)
        outcomes = yield Probe(0.0, 0, "idle"), plan
        served = sorted(o.e2e_s for o in outcomes if o.ok)
        idle_e2e = served[len(served) // 2] if served else math.inf
        search = grid.begin(cell, idle_e2e)
        rate = len(outcomes) / sum(o.e2e_s for o in outcomes if o.ok) if served else 0.0
        idle = Probe(rate, 0, "idle")
        rows = probe_rows(
            cell,
            idle,
            outcomes,
            None,
            slo=slo,
            percentile=percentile,
            model=model,
            search=search,
            idle_e2e_s=idle_e2e,
        )
        emit(rows)
        done = [(idle, idle_passed(outcomes, slo))]
    for earlier, passed in done:
        search.record(earlier, passed)
    while (probe := search.next()) is not None:
        plan = plan_probe(
            probe.rate,
            idle_e2e,
            slo,
            percentile,
            input_tokens,
            output_tokens,
            confirm=probe.kind == "confirm",
        )
        outcomes = yield probe, plan
        verdict = judge(outcomes, plan, slo, percentile)
        while not verdict.decided:
            plan = longer(plan)
            outcomes = yield probe, plan
            verdict = judge(outcomes, plan, slo, percentile)
        emit(
            probe_rows(
                cell,
                probe,
                outcomes,
                verdict,
                slo=slo,
                percentile=percentile,
                model=model,
                warmup=plan.warmup,
            )
        )
        search.record(probe, verdict.passed)
    grid.finish(cell, search)
    return search


RunProbe = Callable[[Cell, Probe, ProbePlan], list[Outcome]]


def sweep_grid(
    grid: GridSearch,
    slo: SloTarget,
    percentile: int,
    model: str,
    run: RunProbe,
    emit: Emit,
    histories: Mapping[Cell, CellHistory] | None = None,
) -> dict[Cell, CellSearch]:
    """Every cell of `grid`, one probe at a time, `run` measuring each (the simulator's
    driver; the live sweep drives `cell_probes` itself, several cells at once)."""
    histories = histories or {}
    while not grid.done:
        for cell in grid.ready():
            steps = cell_probes(grid, cell, slo, percentile, model, emit, histories.get(cell))
            try:
                probe, plan = next(steps)
                while True:
                    probe, plan = steps.send(run(cell, probe, plan))
            except StopIteration:
                pass
    return dict(grid.finished)


def swept_slo(rows: Sequence[BenchmarkRow]) -> tuple[dict[str, float], int]:
    """The SLO (AIBrix's names) and percentile a steady sweep's rows were judged for; an error
    for rows of several sweeps, or none."""
    swept = {
        (orjson.dumps(dict(sorted(s["slo"].items()))), int(s["percentile"]))
        for r in rows
        if r.metric == "TPUT" and isinstance(s := r.extra.get("steady"), Mapping)
    }
    if len(swept) != 1:
        raise ConfigError(
            "these rows were judged for several SLOs; keep each sweep in a file of its own"
            if swept
            else "these rows carry no steady-state verdicts"
        )
    slo_json, percentile = next(iter(swept))
    return {k: float(v) for k, v in orjson.loads(slo_json).items()}, percentile


@dataclass(frozen=True, slots=True)
class SteadyProfile:
    """A profile built from a steady sweep, and what the builder wants the user to know."""

    profile: GpuProfile
    notes: tuple[str, ...]  # unfinished or missing cells


def build_steady_profile(
    rows: Sequence[BenchmarkRow],
    deployment: str,
    *,
    slos: Mapping[str, float] | None = None,
    percentile: int | None = None,
    cost: float = 1.0,
    created: float,
) -> SteadyProfile:
    """The profile a steady sweep's rows say (`--rule steady`): per cell, the rate its search
    settled on (replayed from the verdicts), the mean E2E and TTFT of the probes at that rate,
    and the idle E2E (`e2e_idle`). The SLO is the one the sweep judged; asking for another
    is an error, since the verdicts hold only for it (`--rule aibrix` re-reads statistics)."""
    histories = history_from_rows(rows)
    if not histories:
        raise ConfigError(
            "these rows carry no steady-state verdicts (AIBrix's benchmark, or an older "
            "sweep): build them with --rule aibrix"
        )
    swept_slos, swept_percentile = swept_slo(rows)
    if slos and dict(slos) != swept_slos:
        raise ConfigError(f"the sweep judged the SLO {swept_slos}, not {dict(slos)}")
    if percentile is not None and percentile != swept_percentile:
        raise ConfigError(f"the sweep judged at percentile {swept_percentile}, not {percentile}")
    means: dict[tuple[int, int, float, str], list[float]] = {}
    for r in rows:
        if r.metric in ("E2E", "TTFT") and not math.isnan(r.mean):
            means.setdefault(
                (r.input_tokens, r.output_tokens, r.request_rate, r.metric), []
            ).append(r.mean)
    in_ticks = tuple(sorted({c[0] for c in histories}))
    out_ticks = tuple(sorted({c[1] for c in histories}))
    notes = []
    tputs: list[tuple[float, ...]] = []
    e2es: list[tuple[float, ...]] = []
    ttfts: list[tuple[float, ...]] = []
    idles: list[tuple[float, ...]] = []
    for out in out_ticks:
        row_t: list[float] = []
        row_e: list[float] = []
        row_f: list[float] = []
        row_i: list[float] = []
        for inp in in_ticks:
            h = histories.get((inp, out))
            if h is None:
                notes.append(f"cell {inp}:{out} was not swept (tputs 0): resume the sweep")
                for grid_row in (row_t, row_e, row_f, row_i):
                    grid_row.append(0.0)
                continue
            search = h.search()
            if not search.done:
                notes.append(f"cell {inp}:{out} is unfinished: resume the sweep")
            rate = search.result
            idle = h.idle_e2e_s if math.isfinite(h.idle_e2e_s) else 0.0
            at = rate if rate > 0 else next((p.rate for p, _ in h.probes), 0.0)
            e2e = means.get((inp, out, at, "E2E"), [idle])
            ttft = means.get((inp, out, at, "TTFT"), [0.0])
            row_t.append(rate)
            row_e.append(sum(e2e) / len(e2e))
            row_f.append(sum(ttft) / len(ttft))
            row_i.append(idle)
        tputs.append(tuple(row_t))
        e2es.append(tuple(row_e))
        ttfts.append(tuple(row_f))
        idles.append(tuple(row_i))
    profile = GpuProfile(
        gpu=deployment,
        cost=cost,
        out_ticks=out_ticks,
        in_ticks=in_ticks,
        tputs=tuple(tputs),
        created=created,
        e2e=tuple(e2es),
        ttft=tuple(ttfts) if "ttft" in swept_slos else None,
        percentile=swept_percentile,
        slos=swept_slos,
        e2e_idle=tuple(idles),
    )
    return SteadyProfile(profile, tuple(notes))


def bounding_axes(slo: SloTarget) -> tuple[bool, bool]:
    """Along which axes (input, output) a smaller cell's failure bounds a larger one for `slo`
    (`GridSearch`)."""
    return slo.tpat_s is None, slo.tpat_s is None and slo.tpot_s is None


def sweep_wall_seconds(
    cell_seconds: Mapping[Cell, float],
    inputs: Sequence[int],
    outputs: Sequence[int],
    replicas: int,
) -> float:
    """How long a sweep whose cells take `cell_seconds` lasts on `replicas` replicas, cells
    started in `GridSearch`'s order as soon as a replica is free and the cells one tick smaller
    on each axis are done (the live sweep's schedule)."""
    done_at: dict[Cell, float] = {}
    free = [0.0] * replicas
    grid = GridSearch(tuple(inputs), tuple(outputs))
    while not grid.done:
        for cell in grid.ready():
            ready_at = max((done_at[n] for n in grid.smaller(cell)), default=0.0)
            k = min(range(replicas), key=lambda r: max(free[r], ready_at))
            start = max(free[k], ready_at)
            free[k] = done_at[cell] = start + cell_seconds.get(cell, 0.0)
            grid.started.add(cell)
            grid.finish(cell, CellSearch(1.0))
    return max(done_at.values(), default=0.0)
