"""Write a study's figures: JSON (NaN as null), a Markdown table and PNG plots."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

__all__ = ["format_markdown", "write_json", "write_plots"]

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


def format_markdown(doc: Mapping[str, Any]) -> str:
    reps = " / ".join(doc["replicas"])
    g_star = doc["g_star"]
    caps = ", ".join(f"{k} {_f(v)}" for k, v in doc["slo_capacity"].items())
    lines = [
        f"G* = {_f(g_star)} req/s (SLO capacity per replica, alone: {caps}); "
        f"SLO TTFT <= {doc['slo']['ttft_s']:g} s and TPOT <= {doc['slo']['tpot_s'] * 1000:g} ms, "
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
        "| strategy | load | attainment | goodput | TTFT p99 s | TPOT p50 | TPOT p99 | "
        "e2e/token p99 | TPOT p50 max/min | share | TPOT p50 per replica | utilisation |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in doc["strategies"].items():
        for load in s["attainment"]:
            lines.append(
                f"| {name} | {load} | {_f(s['attainment'][load], 3)} | {_f(s['goodput'][load])}"
                f" | {_f(s['ttft_p99'][load])} | {_f(s['tpot_p50'][load], 0, 1000)}"
                f" | {_f(s['tpot_p99'][load], 0, 1000)}"
                f" | {_f(s['e2e_per_token_p99'][load], 0, 1000)}"
                f" | {_f(s['tpot_p50_ratio'][load])} | {_per_replica(s['share'][load])}"
                f" | {_per_replica(s['tpot_p50_per_replica'][load], 0, 1000)}"
                f" | {_per_replica(s['utilization'][load])} |"
            )
    lines += ["", f"utilisation = {UTILIZATION}."]
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
