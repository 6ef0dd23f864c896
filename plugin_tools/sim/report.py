"""Write a study's figures: JSON (NaN as null), a Markdown table and PNG plots."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from plugin.core.types import SloTarget

__all__ = [
    "describe_slo",
    "format_markdown",
    "format_slo_routing",
    "slo_seconds",
    "write_json",
    "write_plots",
]

UTILIZATION = (
    "a replica's output tokens/s over the measured window / its saturated decode rate"
    " (max_num_seqs sequences in every step, no prefill)"
)


def write_json(doc: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def _f(value: Any, digits: int = 2, scale: float = 1.0) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return f"{value * scale:.{digits}f}"


def _per_replica(values: Mapping[str, float], digits: int = 2, scale: float = 1.0) -> str:
    return " / ".join(_f(v, digits, scale) for v in values.values())


def slo_seconds(slo: SloTarget) -> dict[str, float]:
    """The targets that are set, as the JSON's `slo` records them (`ttft_s`, ... in seconds)."""
    return {k: v for k, v in dataclasses.asdict(slo).items() if v is not None}


def describe_slo(slo: Mapping[str, float]) -> str:
    """`TTFT <= 1 s and TPOT <= 60 ms` from the JSON's `slo` (the targets set, in seconds)."""
    parts = []
    for key, label in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("e2e_s", "E2E"),
        ("tpat_s", "TPAT"),
    ):
        value = slo.get(key)
        if value is None:
            continue
        parts.append(f"{label} <= {value:g} s" if value >= 1 else f"{label} <= {value * 1000:g} ms")
    return " and ".join(parts)


def format_markdown(doc: Mapping[str, Any]) -> str:
    reps = " / ".join(doc["replicas"])
    g_star = doc["g_star"]
    caps = ", ".join(f"{k} {_f(v)}" for k, v in doc["slo_capacity"].items())
    lines = [
        f"G* = {_f(g_star)} req/s (SLO capacity per replica, alone: {caps}); "
        f"SLO {describe_slo(doc['slo'])}, "
        f"sustained = attainment >= {doc['target'] * 100:g}%.",
        "",
        "| strategy | max sustainable rate (req/s) | / G* |",
        "| --- | --- | --- |",
    ]
    for name, s in doc["strategies"].items():
        lines.append(f"| {name} | {_f(s['max_rate'])} | {_f(s['max_rate_over_g_star'])} |")
    lines += [
        "",
        f"Per load (fraction of G*); per-replica columns are {reps}. TPOT and e2e/token in ms.",
        "",
    ]
    lines += _per_load(
        doc,
        (
            "load",
            "attainment",
            "goodput",
            "TTFT p99 s",
            "TPOT p50",
            "TPOT p99",
            "e2e/token p99",
            "TPOT p50 max/min",
            "share",
            "TPOT p50 per replica",
            "utilisation",
        ),
        lambda s, load: (
            _f(s["attainment"][load], 3),
            _f(s["goodput"][load]),
            _f(s["ttft_p99"][load]),
            _f(s["tpot_p50"][load], 0, 1000),
            _f(s["tpot_p99"][load], 0, 1000),
            _f(s["e2e_per_token_p99"][load], 0, 1000),
            _f(s["tpot_p50_ratio"][load]),
            _per_replica(s["share"][load]),
            _per_replica(s["tpot_p50_per_replica"][load], 0, 1000),
            _per_replica(s["utilization"][load]),
        ),
    )
    lines += ["", f"utilisation = {UTILIZATION}."]
    if "profiles" in doc:
        lines += ["", *_slo_tables(doc)]
    return "\n".join(lines) + "\n"


SLO_DEFINITIONS = (
    "attainment: share of the measured requests that completed within every SLO target, times"
    " counted from arrival at the gateway (rejected and dropped requests are misses); goodput:"
    " requests meeting the SLO per second of the measured window; rejected: requests the"
    " strategy refused, at once or at the end of a wait at the gateway; wait: time from arrival"
    " to routing, of the requests routed"
)


def _per_load(
    doc: Mapping[str, Any],
    columns: Sequence[str],
    cells: Callable[[Mapping[str, Any], str], Sequence[str]],
) -> list[str]:
    """A table with a row per strategy and load (the load is the first of `columns`);
    `cells(figures of the strategy, load)` gives the rest of the row."""
    lines = [
        "| " + " | ".join(("strategy", *columns)) + " |",
        "| " + " | ".join("---" for _ in range(len(columns) + 1)) + " |",
    ]
    for name, s in doc["strategies"].items():
        for load in s["attainment"]:
            lines.append("| " + " | ".join((name, load, *cells(s, load))) + " |")
    return lines


def _slo_tables(doc: Mapping[str, Any]) -> list[str]:
    """Per strategy and load: attainment, goodput, rejections and the gateway's wait."""
    g_star = doc["g_star"]
    return _per_load(
        doc,
        (
            "load (x G*)",
            "offered req/s",
            "attainment",
            "goodput req/s",
            "rejected",
            "dropped",
            "wait p50 s",
            "wait p99 s",
        ),
        lambda s, load: (
            _f(float(load) * g_star),
            _f(s["attainment"][load], 3),
            _f(s["goodput"][load]),
            f"{s['rejected'][load]} / {s['requests'][load]}",
            str(s["dropped"][load]),
            _f(s["wait_p50"][load]),
            _f(s["wait_p99"][load]),
        ),
    )


def _sweep_rule(sweep: dict[str, Any]) -> str:
    if sweep.get("rule", "aibrix") == "steady":
        return (
            "the steady-state search, per cell the largest Poisson rate one replica sustains "
            f"within the SLO (rates {sweep.get('floor', sweep['rates'][0]):g}.."
            f"{sweep['rates'][-1]:g} req/s)"
        )
    return (
        f"AIBrix's sweep and rule, {sweep['prompts']} Poisson requests per doubling rate "
        f"{sweep['rates'][0]:g}..{sweep['rates'][-1]:g} req/s"
    )


def _profile_cells(doc: Mapping[str, Any]) -> str:
    parts = []
    for gpu, profile in doc["profiles"].items():
        cells = [v for row in profile["tputs"] for v in row]
        parts.append(f"{gpu} {sum(1 for v in cells if v > 0)} of {len(cells)}")
    return ", ".join(parts)


def format_slo_routing(doc: Mapping[str, Any]) -> str:
    """The Markdown section of a run with SLO routing: setup, command, the figures per load
    and the max sustainable rates (for `docs/benchmarks.md`, through `write_section`)."""
    sweep = doc["sweep"]
    target = f"{doc['target'] * 100:g}%"
    alone = ", ".join(f"{k} {_f(v)}" for k, v in doc["slo_capacity"].items())
    setup = [
        f"- **Fleet** {', '.join(doc['replicas'])}; **workload** `{doc['workload']}`, "
        f"{doc['arrivals']} arrivals; every request asks for at most {doc['max_tokens']} output "
        "tokens (`max_tokens`, the workload's longest answer), and SLO routing predicts the "
        "rest from completions.",
        f"- **SLO** {describe_slo(doc['slo'])}; the profiles check it at "
        f"p{sweep['percentile']}. G\\* = {_f(doc['g_star'])} req/s ({alone} alone at "
        f">= {target} attainment); loads are fractions of it.",
        f"- **GPU profiles** from a simulated `profile sweep` per GPU type (one engine alone) "
        f"over inputs {sweep['inputs'][0]}..{sweep['inputs'][-1]} and outputs "
        f"{sweep['outputs'][0]}..{sweep['outputs'][-1]} tokens, each doubling, built by "
        f"`profile build`: {_sweep_rule(sweep)}. Cells where the GPU type meets the SLO: "
        f"{_profile_cells(doc)}.",
        f"- {doc['measured_requests']} measured requests per run after {doc['warmup_s']:g} s of "
        "warm-up.",
    ]
    lines = [
        "## SLO routing in the simulator",
        "",
        f"Command ({doc['elapsed_s']:.0f} s here, 2-core machine; deterministic for the seed):",
        "",
        "```sh",
        doc["command"],
        "```",
        "",
        *(textwrap.fill(item, 100, subsequent_indent="  ") for item in setup),
        "",
        *_slo_tables(doc),
        "",
        f"| strategy | max sustainable rate at >= {target} (req/s) | / G* |",
        "| --- | --- | --- |",
    ]
    for name, s in doc["strategies"].items():
        lines.append(f"| {name} | {_f(s['max_rate'])} | {_f(s['max_rate_over_g_star'])} |")
    lines += ["", textwrap.fill(SLO_DEFINITIONS + ".", 100)]
    return "\n".join(lines) + "\n"


def write_plots(doc: Mapping[str, Any], prefix: Path) -> list[Path]:
    """`PREFIX-attainment.png` (attainment vs load) and `PREFIX-utilization.png` (utilisation
    per replica at the highest load of the sweep that does not exceed 0.85 of G*)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix.parent.mkdir(parents=True, exist_ok=True)
    strategies: Mapping[str, Any] = doc["strategies"]
    paths = [
        prefix.with_name(prefix.name + "-attainment.png"),
        prefix.with_name(prefix.name + "-utilization.png"),
    ]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, s in strategies.items():
        loads = [float(k) for k in s["attainment"]]
        ax.plot(loads, [100 * v for v in s["attainment"].values()], marker="o", label=name)
    ax.axhline(100 * doc["target"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("offered load (fraction of G*)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"{' + '.join(doc['replicas'])}: SLO attainment")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    loads = [float(x) for x in doc["loads"]]
    chosen = max((x for x in loads if x <= 0.85), default=min(loads))
    key = f"{chosen:g}"
    replicas = list(doc["replicas"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(strategies))
    for i, (name, s) in enumerate(strategies.items()):
        values = [s["utilization"][key][r] for r in replicas]
        xs = [j + i * width for j in range(len(replicas))]
        ax.bar(xs, [100 * v for v in values], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(replicas))], replicas)
    ax.set_ylabel("utilisation (% of saturated decode rate)")
    ax.set_title(f"utilisation per replica at {key} of G*")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def add_study_arguments(
    parser: argparse.ArgumentParser, fleet: str, loads: Sequence[float]
) -> None:
    """The arguments every load study takes: fleet, loads, run size, seed and `--doc`."""
    parser.add_argument("--fleet", default=fleet, help=f"GPU types, e.g. {fleet}")
    parser.add_argument(
        "--loads",
        default=",".join(f"{x:g}" for x in loads),
        help="fractions of G* (comma-separated)",
    )
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per run")
    parser.add_argument("--warmup", type=float, default=60.0, help="simulated seconds of warm-up")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--doc", type=Path, help="also write the table into this Markdown file's section"
    )


def study_loads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    """The parsed `--loads` (positive fractions of G*); exits through `parser` on a bad one, or
    on a bad run size."""
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--loads {args.loads!r}: expected numbers separated by commas")
    if not loads or any(x <= 0 for x in loads):
        parser.error("--loads: expected positive fractions of G*")
    if args.requests < 10 or args.warmup < 0:
        parser.error("--requests >= 10 and --warmup >= 0")
    return loads


def study_command(prog: str, argv: Sequence[str] | None) -> str:
    """The command a generated section names: `prog` and its arguments (the process's own when
    `argv` is None) without `--doc` and its value, which the section adds back."""
    given = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for arg in given:
        if skip:
            skip = False
        elif arg == "--doc":
            skip = True
        elif not arg.startswith("--doc="):
            kept.append(arg)
    return " ".join([prog, *kept])
