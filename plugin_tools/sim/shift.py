"""A replica's speed changes under steady load: how soon the capacity estimates re-rank, and
load-balance's p99 time per output token before, during and after the change, against
least-request (which adapts at once: it counts requests, not speed).

The fastest and the slowest replica of the fleet exchange step costs at a known time (a GPU
slowed by a neighbour, a replica restarted with other engine args); Poisson arrivals at a fixed
fraction of G* (the sum over replicas of the largest rate each serves alone within the SLO).
Variants: least-request; load-balance learning from the output tokens the gateway counts in
completed responses (the default wiring); load-balance learning from the engines' own
generated-token counters (`vllm:generation_tokens_total`, read at each scrape), which also feed
the speed watch (`plugin.core.capacity.SpeedWatch`: a sudden change of a replica's tokens per
running request rescales its estimate at once); the same with the chunk-gap watch beside it
(`GapWatch`: where the gateway sees each stream's chunks, their gaps show a change within a
fraction of a second); and two bounds, load-balance whose estimates the
simulator exchanges at the swap or one scrape (1 s) after it, as a perfect detector with that
delay would.

Windows: before counts the requests that arrived in the STEADY_S before the swap and finished
before it; during, those the swap touched in its first minute (running at the swap, or arriving
in the DURING_S after it); after, those that arrived later (`transition_window`). The part of
the transition that routing decides is reported apart: the requests of the first minute that
arrived after the swap (those running at it were placed before anything changed).

The re-rank time is how long after the swap the estimates put the new fast replica above the
new slow one for good; traffic follows from the first of five 2 s bins in a row in each of which
the new fast replica was sent more requests than the new slow one (the estimates are achieved
throughput, so at a low load their order waits for the traffic; the scores that route it can
turn first); flips before the swap count order changes of any two estimates in a
fleet where nothing changed (flapping under noise).

`python -m plugin_tools.sim.shift` prints the Markdown table (`--help` for the knobs);
`--sweep-loads` adds a table over loads and seeds (`shift_sweep`); `--still` runs fleets where
nothing changes and counts what the speed watches did there (`still_sweep`: they must not act).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from plugin.core.pool import PodPool
from plugin.core.types import SloTarget
from plugin_tools.docsection import write_section
from plugin_tools.sim.engine import parse_fleet
from plugin_tools.sim.fleet import (
    GatewayModel,
    RunResult,
    SpeedSwap,
    replica_names,
    simulate,
)
from plugin_tools.sim.metrics import DEFAULT_SLO
from plugin_tools.sim.report import study_command
from plugin_tools.sim.sweep import Scenario, make_strategy, slo_capacities
from plugin_tools.sim.workload import (
    CHAT,
    LONG,
    Arrivals,
    LengthSource,
    MixedLengths,
    SimRequest,
    SyntheticLengths,
    generate,
)

__all__ = [
    "DEFAULT_FLEET",
    "VARIANTS",
    "ShiftRow",
    "ShiftStudy",
    "format_markdown",
    "format_sweep",
    "shift_study",
    "shift_sweep",
    "still_sweep",
    "traffic_follows",
    "transition_window",
]

DEFAULT_FLEET = "a100,l20,v100"
WARMUP_S = 120.0  # learning before anything is measured
STEADY_S = 120.0  # measured, nothing changes; then the swap
AFTER_S = 240.0  # after the swap
DURING_S = 60.0  # the transition window the issue names
FOLLOW_BIN_S = 2.0  # arrivals counted per bin when judging where traffic goes
FOLLOW_BINS = 5  # bins in a row: the traffic has turned, not one lucky bin
# (label, strategy, what the gateway observes, when it is told of the swap: None never)
VARIANTS: tuple[tuple[str, str, GatewayModel, float | None], ...] = (
    ("least-request", "least-request", GatewayModel(), None),
    ("load-balance, gateway counts", "load-balance", GatewayModel(), None),
    ("load-balance, engine counter", "load-balance", GatewayModel(engine_tokens=True), None),
    (
        "load-balance, chunk gaps",
        "load-balance",
        GatewayModel(engine_tokens=True, chunk_gaps=True),
        None,
    ),
    # Bounds: the estimates exchanged at the swap or one scrape after it, as a perfect detector
    # with that delay would do.
    ("load-balance, told at the swap", "load-balance", GatewayModel(engine_tokens=True), 0.0),
    ("load-balance, told 1 s later", "load-balance", GatewayModel(engine_tokens=True), 1.0),
)


@dataclass(frozen=True, slots=True)
class ShiftRow:
    variant: str
    tpot_p99: tuple[float, float, float]  # s: before, during (first 60 s), after the swap
    routed_after_p99: float  # s: of the first minute's requests, those arriving after the swap
    rerank_s: float | None  # None: no estimates (least-request), inf: never re-ranked
    follows_s: float  # traffic follows the swap (`traffic_follows`); inf: never
    flips_before: int | None
    estimates: tuple[tuple[float, tuple[float | None, ...]], ...]  # (t, per replica) each scrape


@dataclass(frozen=True, slots=True)
class ShiftStudy:
    fleet: str
    replicas: tuple[str, ...]
    swapped: tuple[int, int]
    load: float
    rate: float
    swap_at_s: float
    seed: int
    rows: tuple[ShiftRow, ...]


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def transition_window(
    arrival: float,
    finish: float,
    at: float,
    *,
    steady_s: float = STEADY_S,
    during_s: float = DURING_S,
    after_s: float = AFTER_S,
) -> int | None:
    """Which window a request counts in: 0 before the swap (it arrived in the `steady_s` before
    it and finished before it), 1 during (it was running at the swap or arrived in the
    `during_s` after it: every request the change touched in its first minute), 2 after (it
    arrived later, within `after_s`); None outside them. A request that straddles the swap is
    the transition's cost, not the steady state's: counted before, it would charge a strategy
    that puts more requests on the replica that slows down for the swap before it happened."""
    if arrival < at - steady_s or arrival >= at + after_s:
        return None
    if finish < at:
        return 0
    return 1 if arrival < at + during_s else 2


def _tpot_windows(result: RunResult, at: float) -> tuple[tuple[float, float, float], float]:
    """p99 TPOT before, during and after the swap, and of the requests in the transition that
    arrived after the swap."""
    tpots: tuple[list[float], ...] = ([], [], [])
    routed_after: list[float] = []
    for r in result.records:
        if r.completed and r.output_tokens > 1:
            window = transition_window(r.arrival, r.finish, at)
            if window is not None:
                tpots[window].append(r.tpot)
                if window == 1 and r.arrival >= at:
                    routed_after.append(r.tpot)
    before, during, after = (_p99(t) for t in tpots)
    return (before, during, after), _p99(routed_after)


def _rerank(
    estimates: Sequence[tuple[float, tuple[float | None, ...]]], at: float, fast: int, slow: int
) -> float:
    """Seconds after `at` from which the new fast replica's estimate stays above the new slow
    one's to the end; inf if it never does."""
    since: float | None = None
    for t, values in estimates:
        if t < at:
            continue
        a, b = values[fast], values[slow]
        if a is not None and b is not None and a > b:
            if since is None:
                since = t
        else:
            since = None
    return math.inf if since is None else since - at


def traffic_follows(
    sent: Iterable[tuple[float, Hashable]],
    at: float,
    fast: Hashable,
    slow: Hashable,
    *,
    span_s: float = AFTER_S,
    bin_s: float = FOLLOW_BIN_S,
) -> float:
    """Seconds after `at` to the first of FOLLOW_BINS bins of `bin_s` in a row in each of which
    the new fast replica was sent more of the arriving requests (`sent`: arrival, replica) than
    the new slow one; inf if that never happens within `span_s`. What a user sees of a re-rank:
    where the requests go, whatever the estimates' order. (Not "for good": where the GPUs'
    memories differ, the fleet settles on other shares later.)"""
    bins = math.ceil(span_s / bin_s)
    to_fast, to_slow = [0] * bins, [0] * bins
    for arrival, replica in sent:
        i = math.floor((arrival - at) / bin_s)
        if 0 <= i < bins:
            if replica == fast:
                to_fast[i] += 1
            elif replica == slow:
                to_slow[i] += 1
    run = 0
    for i in range(bins):
        run = run + 1 if to_fast[i] > to_slow[i] else 0
        if run == FOLLOW_BINS:
            return (i - FOLLOW_BINS + 1) * bin_s
    return math.inf


def _flips(
    estimates: Sequence[tuple[float, tuple[float | None, ...]]], lo: float, hi: float
) -> int:
    flips, last = 0, None
    for t, values in estimates:
        if not lo <= t < hi or any(v is None for v in values):
            continue
        order = tuple(sorted(range(len(values)), key=lambda i: values[i] or 0.0))
        if last is not None and order != last:
            flips += 1
        last = order
    return flips


def shift_study(
    fleet: str = DEFAULT_FLEET,
    load: float = 0.7,
    *,
    seed: int = 1,
    lengths: LengthSource = CHAT,
    slo: SloTarget = DEFAULT_SLO,
    tokens_per_event: int = 1,
) -> ShiftStudy:
    """`tokens_per_event`: the engines stream that many tokens an SSE event (the chunk-gap
    watch then sees one gap per that many steps)."""
    profiles = tuple(parse_fleet(fleet))
    scenario = Scenario(profiles, lengths, slo=slo, warmup_s=WARMUP_S, seed=seed)
    g_star = sum(slo_capacities(scenario).values())
    rate = load * g_star
    speeds = [p.saturated_tokens_per_s() for p in profiles]
    fast, slow = speeds.index(max(speeds)), speeds.index(min(speeds))
    swap_at = WARMUP_S + STEADY_S
    total_s = swap_at + AFTER_S
    requests = generate(lengths, Arrivals(), rate, math.ceil(rate * total_s), random.Random(seed))
    rows = []
    for variant, name, gateway, told in VARIANTS:
        gateway = replace(gateway, tokens_per_event=tokens_per_event)
        estimates: list[tuple[float, tuple[float | None, ...]]] = []

        def record(
            now: float,
            pool: PodPool,
            into: list[tuple[float, tuple[float | None, ...]]] = estimates,
        ) -> None:
            into.append((now, tuple(pool.capacity(p.key) for p in pool.pods())))

        result = simulate(
            profiles,
            make_strategy(name, replace(scenario, gateway=gateway)),
            requests,
            warmup_s=WARMUP_S,
            gateway=gateway,
            seed=seed,
            max_tokens=lengths.max_output,
            swap=SpeedSwap(swap_at, fast, slow, told),
            on_scrape=record,
        )
        learns = name != "least-request"
        windows, routed_after = _tpot_windows(result, swap_at)
        rows.append(
            ShiftRow(
                variant,
                windows,
                routed_after,
                _rerank(estimates, swap_at, slow, fast) if learns else None,
                traffic_follows(
                    ((r.arrival, r.replica) for r in result.records), swap_at, slow, fast
                ),
                _flips(estimates, WARMUP_S, swap_at) if learns else None,
                tuple(estimates),
            )
        )
    return ShiftStudy(
        fleet,
        tuple(replica_names(profiles)),
        (fast, slow),
        load,
        rate,
        swap_at,
        seed,
        tuple(rows),
    )


# Where nothing changes: the fleets, workloads (chat, and chat with a fifth of long prompts,
# whose prefills stall steps) and arrivals (Poisson, and bursty) of `still_sweep`.
STILL_FLEETS = ("a100,3xa10", DEFAULT_FLEET)
STILL_LENGTHS: tuple[SyntheticLengths | MixedLengths, ...] = (
    CHAT,
    MixedLengths(((0.8, CHAT), (0.2, LONG)), name="chat + a fifth long"),
)
STILL_ARRIVALS = (Arrivals(), Arrivals(kind="gamma", cv=2.0))
STILL_S = 600.0


@dataclass(frozen=True, slots=True)
class StillRow:
    fleet: str
    lengths: str
    arrivals: str
    load: float
    by_scrapes: int  # rescales the scrape watch made, over all replicas
    by_chunk_gaps: int  # ... and the chunk-gap watch


def still_sweep(loads: Sequence[float], seed: int = 1, tokens_per_event: int = 1) -> list[StillRow]:
    """Load-balance with both speed watches (`chunk gaps`) for STILL_S simulated seconds in
    fleets where nothing changes, at each load and over the workloads and arrivals above:
    what a watch acts on there is a false alarm (a rescale the traffic pays for)."""
    gateway = next(g for _, _, g, _ in VARIANTS if g.chunk_gaps)
    gateway = replace(gateway, tokens_per_event=tokens_per_event)
    rows = []
    for fleet in STILL_FLEETS:
        profiles = tuple(parse_fleet(fleet))
        for lengths in STILL_LENGTHS:
            scenario = Scenario(profiles, lengths, warmup_s=60.0, seed=seed)
            g_star = sum(slo_capacities(scenario).values())
            for load in loads:
                for arrivals in STILL_ARRIVALS:
                    rate = load * g_star
                    n = math.ceil(rate * STILL_S)
                    requests = generate(lengths, arrivals, rate, n, random.Random(seed))
                    by_scrapes, by_gaps = _still_run(scenario, gateway, requests, seed)
                    kind = "Poisson" if arrivals.kind == "poisson" else f"Gamma cv {arrivals.cv:g}"
                    rows.append(StillRow(fleet, lengths.name, kind, load, by_scrapes, by_gaps))
    return rows


def _still_run(
    scenario: Scenario, gateway: GatewayModel, requests: Sequence[SimRequest], seed: int
) -> tuple[int, int]:
    """One run of `still_sweep`: the rescales (by the scrape watch, by the chunk-gap watch)."""
    last: list[tuple[float, PodPool]] = []

    def record(now: float, pool: PodPool) -> None:
        last[:] = [(now, pool)]

    simulate(
        scenario.profiles,
        make_strategy("load-balance", scenario),
        requests,
        warmup_s=scenario.warmup_s,
        gateway=gateway,
        seed=seed,
        max_tokens=scenario.lengths.max_output,
        on_scrape=record,
    )
    now, pool = last[-1]
    pods = pool.snapshot(now)["pods"].values()
    by_gaps = sum(p["speed_changes_from_chunk_gaps"] for p in pods)
    return sum(p["speed_changes"] for p in pods) - by_gaps, by_gaps


def format_still(rows: Sequence[StillRow]) -> str:
    """Per fleet, workload and arrivals: each watch's rescales at each load."""
    groups: dict[tuple[str, str, str], list[StillRow]] = {}
    for row in rows:
        groups.setdefault((row.fleet, row.lengths, row.arrivals), []).append(row)
    loads = " / ".join(f"{r.load:g}" for r in next(iter(groups.values()), []))
    lines = [
        f"| fleet | workload | arrivals | rescales by the scrape watch at {loads} x G* "
        "| by the chunk-gap watch |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (fleet, lengths, arrivals), group in groups.items():
        scrapes = " / ".join(str(r.by_scrapes) for r in group)
        gaps = " / ".join(str(r.by_chunk_gaps) for r in group)
        lines.append(f"| {fleet} | {lengths} | {arrivals} | {scrapes} | {gaps} |")
    return "\n".join(lines) + "\n"


def format_markdown(study: ShiftStudy) -> str:
    fast, slow = (study.replicas[i] for i in study.swapped)
    lines = [
        f"Fleet {study.fleet}; {fast} and {slow} exchange speeds at {study.swap_at_s:g} s "
        f"(after {WARMUP_S:g} s of warm-up and {STEADY_S:g} s measured at steady state); "
        f"Poisson arrivals at {study.load:g} x G* = {study.rate:.2f} req/s; seed {study.seed}.",
        "",
        "| variant | TPOT p99 ms before | during (first 60 s) | of which arrived after the swap "
        "| after | re-rank s | traffic follows s | order changes before the swap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in study.rows:
        before, during, after = (f"{1000 * v:.1f}" for v in row.tpot_p99)
        rerank = "-" if row.rerank_s is None else f"{row.rerank_s:.0f}"
        flips = "-" if row.flips_before is None else str(row.flips_before)
        lines.append(
            f"| {row.variant} | {before} | {during} | {1000 * row.routed_after_p99:.1f} "
            f"| {after} | {rerank} | {row.follows_s:.0f} | {flips} |"
        )
    return "\n".join(lines) + "\n"


def shift_sweep(
    fleet: str, loads: Sequence[float], seeds: Sequence[int], tokens_per_event: int = 1
) -> list[ShiftStudy]:
    """The study at every load and seed: how the transition goes beyond one run."""
    return [
        shift_study(fleet, load, seed=seed, tokens_per_event=tokens_per_event)
        for load in loads
        for seed in seeds
    ]


def format_sweep(studies: Sequence[ShiftStudy]) -> str:
    """One row per run: load-balance with the engine counter's speed watch and with the
    chunk-gap watch beside it, against least-request: re-rank, traffic, p99 TPOT before the
    swap and in the first minute after it (and of that minute's requests, those that arrived
    after the swap), with what load-balance told of the swap at once or one scrape later
    (bounds for any detector) gets in that minute."""
    lines = [
        "| load (x G*) | seed | re-rank s: engine counter / chunk gaps "
        "| traffic follows s: engine counter / chunk gaps / least-request "
        "| TPOT p99 ms before: load-balance / least-request "
        "| during: engine counter / chunk gaps / told at the swap / told 1 s later "
        "/ least-request "
        "| during, arrived after the swap: engine counter / chunk gaps / least-request "
        "| order changes before: engine counter / chunk gaps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ms(value: float) -> str:
        return f"{1000 * value:.1f}"

    def rerank(row: ShiftRow) -> str:
        return "-" if row.rerank_s is None else f"{row.rerank_s:.0f}"

    for study in studies:
        rows = {row.variant: row for row in study.rows}
        lb, gaps = rows["load-balance, engine counter"], rows["load-balance, chunk gaps"]
        lr = rows["least-request"]
        told, later = rows["load-balance, told at the swap"], rows["load-balance, told 1 s later"]
        lines.append(
            f"| {study.load:g} | {study.seed} | {rerank(lb)} / {rerank(gaps)} "
            f"| {lb.follows_s:.0f} / {gaps.follows_s:.0f} / {lr.follows_s:.0f} "
            f"| {ms(lb.tpot_p99[0])} / {ms(lr.tpot_p99[0])} "
            f"| {ms(lb.tpot_p99[1])} / {ms(gaps.tpot_p99[1])} / {ms(told.tpot_p99[1])} "
            f"/ {ms(later.tpot_p99[1])} / {ms(lr.tpot_p99[1])} "
            f"| {ms(lb.routed_after_p99)} / {ms(gaps.routed_after_p99)} "
            f"/ {ms(lr.routed_after_p99)} | {lb.flips_before} / {gaps.flips_before} |"
        )
    return "\n".join(lines) + "\n"


def plot(study: ShiftStudy, path: Path) -> None:
    """Each load-balance variant's capacity estimates over time, the swap marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learning = [row for row in study.rows if row.estimates and row.rerank_s is not None]
    cols = min(2, len(learning))
    rows = math.ceil(len(learning) / cols)
    fig, grid = plt.subplots(
        rows, cols, figsize=(5.5 * cols, 3.2 * rows), sharey=True, squeeze=False
    )
    axes = [ax for line in grid for ax in line]
    for ax in axes[len(learning) :]:
        ax.set_visible(False)
    for ax, row in zip(axes, learning, strict=False):
        times = [t for t, _ in row.estimates]
        for i, name in enumerate(study.replicas):
            ax.plot(times, [v[i] if v[i] is not None else float("nan") for _, v in row.estimates],
                    label=name)  # fmt: skip
        ax.axvline(study.swap_at_s, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{row.variant}: re-rank {row.rerank_s:.0f} s", fontsize=9)
        ax.set_xlabel("simulated time (s)")
    for line in grid:
        line[0].set_ylabel("capacity estimate (tokens/s)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plugin_tools.sim.shift",
        description="two replicas exchange speeds under steady load: re-rank time of the"
        " capacity estimates and p99 TPOT around it; prints a Markdown table",
    )
    parser.add_argument("--fleet", default=DEFAULT_FLEET, help="GPU types, e.g. a100,l20,v100")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of G*")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--doc", type=Path, help="also write the table into this Markdown file")
    parser.add_argument("--plot", type=Path, help="also draw the estimates over time (PNG)")
    parser.add_argument(
        "--sweep-loads", help="also run these loads (fractions of G*, comma-separated)"
    )
    parser.add_argument("--sweep-seeds", default="1,2,3", help="seeds of the sweep")
    parser.add_argument(
        "--tokens-per-event",
        type=int,
        default=1,
        help="the engines stream this many tokens an SSE event (SGLang's --stream-interval,"
        " TensorRT-LLM, speculative decoding); the chunk-gap watch sees one gap per that many"
        " steps. Above 1, --doc writes a section of its own, without the plot",
    )
    parser.add_argument(
        "--still",
        action="store_true",
        help="instead: fleets where nothing changes, at loads 0.3-1.0 (or --sweep-loads), for"
        f" {STILL_S:g} s each; what the speed watches acted on there (about a minute)",
    )
    args = parser.parse_args(argv)
    if args.load <= 0:
        parser.error("--load must be positive")
    try:
        loads = [float(x) for x in (args.sweep_loads or "").split(",") if x.strip()]
        seeds = [int(x) for x in args.sweep_seeds.split(",") if x.strip()]
    except ValueError:
        parser.error("--sweep-loads and --sweep-seeds: numbers separated by commas")
    if any(x <= 0 for x in loads):
        parser.error("--sweep-loads must be positive")
    per_event = args.tokens_per_event
    if per_event < 1:
        parser.error("--tokens-per-event must be at least 1")
    suffix, streamed = "", ""
    if per_event > 1:
        suffix = f"-{per_event}-tokens-an-event"
        streamed = f", engines streaming {per_event} tokens an event"
    if args.still:
        loads = loads or [0.3, 0.5, 0.7, 0.8, 0.9, 1.0]
        still = format_still(still_sweep(loads, args.seed, per_event))
        sys.stdout.write(still)
        if args.doc is not None:
            command = study_command("python -m plugin_tools.sim.shift", argv)
            write_section(
                args.doc,
                "capacity-shift-still" + suffix,
                f"Generated by `{command}` (about a minute): load-balance with both speed"
                f" watches for {STILL_S:g} simulated seconds in fleets where nothing changes"
                f" (after 60 s of warm-up{streamed}); the rescales each watch made over the"
                " run's replicas, at each load: a false alarm each.\n\n" + still,
            )
        return 0
    try:
        study = shift_study(args.fleet, args.load, seed=args.seed, tokens_per_event=per_event)
        sweep = format_sweep(shift_sweep(args.fleet, loads, seeds, per_event)) if loads else ""
    except ValueError as exc:
        parser.error(str(exc))
    table = format_markdown(study)
    sys.stdout.write(table + ("\n" + sweep if sweep else ""))
    if args.plot is not None:
        plot(study, args.plot)
    if args.doc is not None and per_event > 1:
        command = study_command("python -m plugin_tools.sim.shift", argv)
        write_section(
            args.doc,
            "capacity-shift" + suffix,
            f"## Capacity shift at {per_event} tokens an event\n\n"
            f"Generated by `{command} --doc docs/benchmarks.md` (about a minute with the"
            " sweep): as above, with the"
            f" engines streaming {per_event} tokens an SSE event, so each gap between two"
            f" chunks of a stream spans {per_event} engine steps.\n\n"
            + table
            + ("\nOver loads and seeds:\n\n" + sweep if sweep else ""),
        )
    elif args.doc is not None:
        command = study_command("python -m plugin_tools.sim.shift", argv)
        text = (
            "## Capacity shift: a fast and a slow replica exchange speeds\n\n"
            f"Generated by `{command} --doc docs/benchmarks.md` (about a minute with the sweep)."
            " least-request adapts at once (it counts requests); load-balance adapts when its"
            " capacity estimates do. With the engines' own token counters (vLLM's and SGLang's"
            " `*:generation_tokens_total`, which credit tokens as they are generated) the"
            " estimator uses a 15 s window and a 5 s time constant instead of a minute and 10 s,"
            " and the speed watch compares each scrape's tokens per running request with the"
            " replica's usual figure: where it moved by 1.5x or more four scrapes in a row, at a"
            " batch that cannot explain it, the estimate is rescaled by the streak's median at"
            " once. Where the gateway sees the response chunks (its counting filter reads"
            " them; `chunk gaps`), the chunk-gap watch also compares the time between two"
            " chunks of a stream, about one engine step, with the replica's usual: a move of"
            " 1.5x slower (2x faster) held for ten steps in a row and 0.3 s (three steps for"
            " 2x slower), beyond what the prompts those steps may have prefilled can add (a step"
            " that prefills is longer for every stream in it), rescales the estimate within a"
            " fraction of a second and routing sees it at once. Re-rank is how long after the"
            " swap the new fast"
            " replica's estimate stays"
            " above the new slow one's: the estimate is achieved throughput, so that also waits"
            " for traffic to move. Traffic follows from the first of five 2 s bins in a row in"
            " each of which the new fast replica was sent more of the arriving requests than the"
            " new slow one.\n\n"
            + table
            + ("\nOver loads and seeds:\n\n" + sweep if sweep else "")
            + "\n![capacity estimates around the swap](sim/capacity-shift.png)\n"
        )
        write_section(args.doc, "capacity-shift", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
