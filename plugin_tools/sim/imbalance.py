"""The load-imbalance gate in the fleet simulator: load-balance alone, behind AIBrix's raw-count
gate and behind the capacity-aware gate, on a mixed fleet where the fast replica rightly carries
more requests than the slow ones.

AIBrix's gate compares running-request counts: the fast replica's larger share reads as a hotspot,
and the gate sends requests to the slow replicas instead, whose time per token is longer. The
capacity-aware gate compares requests per unit of learned capacity and leaves load-balance's
split alone (`plugin.core.strategies.gate`). Loads are fractions of G*, the sum over replicas of
the largest rate each serves alone within the SLO (`plugin_tools.sim.sweep.slo_capacities`).

`python -m plugin_tools.sim.imbalance` prints the Markdown table (`--help` for the knobs);
`gate_study` and `format_markdown` give the figures and the table to a caller.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from plugin.core.strategies import Strategy
from plugin.core.strategies.gate import ImbalanceGate, ImbalanceSettings, Wrapped
from plugin.core.types import SloTarget
from plugin_tools.docsection import write_section
from plugin_tools.sim.engine import parse_fleet
from plugin_tools.sim.fleet import MODEL, simulate
from plugin_tools.sim.metrics import DEFAULT_SLO, summarize
from plugin_tools.sim.report import (
    add_study_arguments,
    describe_slo,
    slo_seconds,
    study_command,
    study_loads,
)
from plugin_tools.sim.sweep import Scenario, make_strategy, slo_capacities
from plugin_tools.sim.workload import CHAT, LengthSource

__all__ = [
    "DEFAULT_FLEET",
    "DEFAULT_LOADS",
    "VARIANTS",
    "GateRow",
    "GateStudy",
    "format_markdown",
    "gate_study",
    "main",
]

DEFAULT_FLEET = "a100,3xa10"
DEFAULT_LOADS = (0.5, 0.7, 0.85, 1.0, 1.1)
STRATEGY = "load-balance"
# What stands ahead of load-balance: nothing, AIBrix's rule, ours (AIBrix's defaults for both).
VARIANTS: tuple[tuple[str, ImbalanceSettings | None], ...] = (
    ("no gate", None),
    ("raw-count gate (AIBrix)", ImbalanceSettings(capacity_aware=False)),
    ("capacity-aware gate", ImbalanceSettings()),
)


@dataclass(frozen=True, slots=True)
class GateRow:
    """One run: a variant at one load."""

    variant: str
    load: float  # fraction of G*
    rate: float  # req/s offered
    attainment: float  # share of measured requests within the SLO
    tpot_p99: float  # s
    ttft_p99: float  # s
    fired: float  # share of all requests (warm-up included) the gate routed
    shares: tuple[float, ...]  # of the measured requests, per replica


@dataclass(frozen=True, slots=True)
class GateStudy:
    fleet: str
    replicas: tuple[str, ...]
    g_star: float
    slo: SloTarget
    measured_requests: int
    warmup_s: float
    seed: int
    rows: tuple[GateRow, ...]


def _strategy(
    scenario: Scenario, settings: ImbalanceSettings | None
) -> tuple[Strategy, ImbalanceGate | None]:
    inner = make_strategy(STRATEGY, scenario)
    if settings is None:
        return inner, None
    gate = ImbalanceGate(settings)
    return Wrapped(inner, gate=gate), gate


def gate_study(
    fleet: str = DEFAULT_FLEET,
    loads: Sequence[float] = DEFAULT_LOADS,
    *,
    measured_requests: int = 2000,
    warmup_s: float = 60.0,
    seed: int = 1,
    lengths: LengthSource = CHAT,
    slo: SloTarget = DEFAULT_SLO,
) -> GateStudy:
    """Every variant at every load, on the same seeded requests per load."""
    scenario = Scenario(
        tuple(parse_fleet(fleet)),
        lengths,
        slo=slo,
        measured_requests=measured_requests,
        warmup_s=warmup_s,
        seed=seed,
    )
    capacities = slo_capacities(scenario)
    g_star = sum(capacities.values())
    rows: list[GateRow] = []
    for load in loads:
        requests = scenario.requests(load * g_star)
        for variant, settings in VARIANTS:
            strategy, gate = _strategy(scenario, settings)
            result = simulate(
                scenario.profiles,
                strategy,
                requests,
                warmup_s=scenario.warmup_s,
                gateway=scenario.gateway,
                seed=scenario.seed,
                max_tokens=lengths.max_output,
            )
            figures = summarize(result, slo)
            fired = 0 if gate is None else gate.fired.get(MODEL, 0)
            rows.append(
                GateRow(
                    variant,
                    load,
                    load * g_star,
                    figures["attainment"],
                    figures["tpot_p99"],
                    figures["ttft_p99"],
                    fired / len(requests),
                    tuple(r["share"] for r in figures["replicas"].values()),
                )
            )
    return GateStudy(
        fleet,
        tuple(capacities),
        g_star,
        slo,
        measured_requests,
        warmup_s,
        seed,
        tuple(rows),
    )


def format_markdown(study: GateStudy) -> str:
    """The study as a short setup line and a table, a row per load and variant."""
    replicas = " / ".join(study.replicas)
    lines = [
        f"Fleet {study.fleet} ({replicas}); `{STRATEGY}` with no gate, behind AIBrix's raw-count "
        "gate and behind the capacity-aware gate (AIBrix's defaults: min gap 8, factor 2). "
        f"G* = {study.g_star:.2f} req/s; SLO {describe_slo(slo_seconds(study.slo))}; "
        f"{study.measured_requests} measured requests per run after {study.warmup_s:g} s of "
        f"warm-up, seed {study.seed}.",
        "",
        "| load (x G*) | req/s | gate | attainment | TPOT p99 ms | TTFT p99 s | gate fired |"
        f" share ({replicas}) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in study.rows:
        lines.append(
            f"| {row.load:g} | {row.rate:.2f} | {row.variant} | {row.attainment:.3f} "
            f"| {row.tpot_p99 * 1000:.1f} | {row.ttft_p99:.2f} | {row.fired:.1%} "
            f"| {' / '.join(f'{s:.2f}' for s in row.shares)} |"
        )
    lines += [
        "",
        "attainment: share of the measured requests that completed within every SLO target; "
        "gate fired: share of all requests (warm-up included) the gate routed itself.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plugin_tools.sim.imbalance",
        description="load-balance with no gate, AIBrix's raw-count imbalance gate and the"
        " capacity-aware one, on a mixed fleet in the simulator; prints a Markdown table",
    )
    add_study_arguments(parser, DEFAULT_FLEET, DEFAULT_LOADS)
    args = parser.parse_args(argv)
    loads = study_loads(parser, args)
    try:
        study = gate_study(
            args.fleet, loads, measured_requests=args.requests, warmup_s=args.warmup, seed=args.seed
        )
    except ValueError as exc:
        parser.error(str(exc))
    table = format_markdown(study)
    sys.stdout.write(table)
    if args.doc is not None:
        command = study_command("python -m plugin_tools.sim.imbalance", argv)
        text = (
            "## Load-imbalance gate: raw counts against capacity\n\n"
            f"Generated by `{command} --doc docs/benchmarks.md` (about 4 s): load-balance"
            " alone, behind AIBrix's imbalance gate on raw running counts, and behind ours, which"
            " compares load per unit of learned capacity (`HETERO_GATEWAY_IMBALANCE_GATE`"
            " `count` / `capacity`; `AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP` 8,"
            " `..._FACTOR` 2.0). On a mixed fleet the fast replica rightly carries more"
            " requests; raw counts read that as a hotspot and send its traffic to the slow"
            " ones.\n\n" + table
        )
        write_section(args.doc, "imbalance-gate", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
