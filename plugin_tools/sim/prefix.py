"""Prefix caching in the fleet simulator: `prefix-cache` alone, auto-blended with load-balance
(AIBrix's `prefix-cache:5,load-balance:4`), and `load-balance` alone, on a mixed fleet serving
prompts that share long prefixes (`plugin_tools.sim.workload.SharedPrefix`).

Engines cache the prefixes they prefilled (`plugin_tools.sim.engine`, a share of their KV cache,
least recently used out); the hit rate is what the engines found cached, in prompt tokens, as
vLLM's `prefix_cache_hits_total / prefix_cache_queries_total` would say. `prefix-cache` keeps
each document where it was cached, whatever the replica's speed; load-balance alone spreads every
document over every replica and recomputes it on each; the blend trades the two. Loads are
fractions of G* as the other studies take it (each replica's largest SLO-meeting rate alone,
summed), measured here without prefix caching: what the fleet sustains with nothing cached.

`python -m plugin_tools.sim.prefix` prints the Markdown table (`--help` for the knobs);
`prefix_study` and `format_markdown` give the figures and the table to a caller.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from plugin.core.strategies import Strategy, build_strategies
from plugin.core.strategies.blend import AutoBlend, resolve
from plugin.core.types import SloTarget
from plugin_tools.docsection import write_section
from plugin_tools.sim.engine import parse_fleet
from plugin_tools.sim.fleet import simulate
from plugin_tools.sim.metrics import DEFAULT_SLO, summarize
from plugin_tools.sim.report import (
    add_study_arguments,
    describe_slo,
    slo_seconds,
    study_command,
    study_loads,
)
from plugin_tools.sim.sweep import Scenario, slo_capacities
from plugin_tools.sim.workload import Arrivals, SharedPrefix

__all__ = [
    "DEFAULT_FLEET",
    "DEFAULT_LOADS",
    "DEFAULT_WORKLOAD",
    "VARIANTS",
    "PrefixRow",
    "PrefixStudy",
    "format_markdown",
    "main",
    "prefix_study",
]

DEFAULT_FLEET = "a100,l20,v100"
# Cached prefixes let the fleet serve more than G* (measured with nothing cached).
DEFAULT_LOADS = (0.8, 1.2, 1.6)
# 128 documents of 1,500 tokens each asked short questions, popularity Zipf 0.6: more documents
# than the fleet's prefix caches hold together (about 73 + 35 + 16 on a100, l20, v100), so where
# a document is sent decides whether it is recomputed (RAG over a corpus, many system prompts).
DEFAULT_WORKLOAD = SharedPrefix(groups=128, shared_tokens=1500, zipf=0.6)


def _named(text: str, auto: AutoBlend | None) -> Callable[[Scenario], Strategy]:
    def build(scenario: Scenario) -> Strategy:
        # Fresh per run: prefix-cache's index is state.
        return resolve(text, build_strategies(scenario.gateway.params), auto)

    return build


# What routes: a name for the table, and a fresh strategy for a scenario.
VARIANTS: tuple[tuple[str, Callable[[Scenario], Strategy]], ...] = (
    ("prefix-cache alone", _named("prefix-cache", None)),
    ("prefix-cache:5,load-balance:4 (auto-blend)", _named("prefix-cache", AutoBlend())),
    ("load-balance", _named("load-balance", None)),
)


@dataclass(frozen=True, slots=True)
class PrefixRow:
    """One run: a variant at one load."""

    variant: str
    load: float  # fraction of G* (without prefix caching)
    rate: float  # req/s offered
    hit_rate: float  # prompt tokens found cached / prompt tokens admitted, all engines
    gateway_hit_rate: float  # the prefix index's own view (prefix-cache runs), NaN otherwise
    attainment: float
    ttft_p50: float  # s
    ttft_p99: float  # s
    tpot_p99: float  # s
    shares: tuple[float, ...]  # of the measured requests, per replica


@dataclass(frozen=True, slots=True)
class PrefixStudy:
    fleet: str
    replicas: tuple[str, ...]
    g_star: float
    slo: SloTarget
    workload: SharedPrefix
    measured_requests: int
    warmup_s: float
    seed: int
    rows: tuple[PrefixRow, ...]


def prefix_study(
    fleet: str = DEFAULT_FLEET,
    loads: Sequence[float] = DEFAULT_LOADS,
    *,
    workload: SharedPrefix = DEFAULT_WORKLOAD,
    measured_requests: int = 2000,
    warmup_s: float = 60.0,
    seed: int = 1,
    slo: SloTarget = DEFAULT_SLO,
) -> PrefixStudy:
    """Every variant at every load, on the same seeded requests per load."""
    scenario = Scenario(
        tuple(parse_fleet(fleet)),
        workload,
        slo=slo,
        measured_requests=measured_requests,
        warmup_s=warmup_s,
        seed=seed,
    )
    # G* with nothing shared: the same lengths, every prompt prefilled in full.
    capacities = slo_capacities(scenario)
    g_star = sum(capacities.values())
    rows: list[PrefixRow] = []
    for load in loads:
        rate = load * g_star
        n = int(rate * warmup_s) + measured_requests
        requests = workload.requests(Arrivals(), rate, n, random.Random(seed))
        for variant, build in VARIANTS:
            strategy = build(scenario)
            result = simulate(
                scenario.profiles,
                strategy,
                requests,
                warmup_s=warmup_s,
                gateway=scenario.gateway,
                seed=seed,
                max_tokens=workload.max_output,
            )
            figures = summarize(result, slo)
            queried = sum(w.prefix_query_tokens for w in result.windows)
            hit = sum(w.prefix_hit_tokens for w in result.windows)
            rows.append(
                PrefixRow(
                    variant,
                    load,
                    rate,
                    hit / queried if queried else float("nan"),
                    _index_hit_rate(strategy),
                    figures["attainment"],
                    figures["ttft_p50"],
                    figures["ttft_p99"],
                    figures["tpot_p99"],
                    tuple(r["share"] for r in figures["replicas"].values()),
                )
            )
    return PrefixStudy(
        fleet,
        tuple(capacities),
        g_star,
        slo,
        workload,
        measured_requests,
        warmup_s,
        seed,
        tuple(rows),
    )


def _index_hit_rate(strategy: Strategy) -> float:
    """Matched / prompt blocks as prefix-cache's index counted them (warm-up included)."""
    members = getattr(strategy, "members", None)
    holders = [s for s, _ in members] if members is not None else [strategy]
    for holder in holders:
        stats = getattr(holder, "stats", None)
        if isinstance(stats, dict):
            blocks = sum(s.prompt_blocks for s in stats.values())
            matched = sum(s.matched_blocks for s in stats.values())
            return matched / blocks if blocks else float("nan")
    return float("nan")


def format_markdown(study: PrefixStudy) -> str:
    """The study as a short setup line and a table, a row per load and variant."""
    replicas = " / ".join(study.replicas)
    w = study.workload
    lines = [
        f"Fleet {study.fleet} ({replicas}); {w.groups} shared prefixes of {w.shared_tokens} "
        f"tokens (Zipf {w.zipf:g} popularity) each followed by a question of its own (median "
        f"{w.question.median:g} tokens), answers median {w.output.median:g} tokens; engines "
        f"cache prefixes in a quarter of their KV cache. G* = {study.g_star:.2f} req/s (without "
        f"prefix caching); SLO {describe_slo(slo_seconds(study.slo))}; "
        f"{study.measured_requests} measured requests per run after {study.warmup_s:g} s of "
        f"warm-up, seed {study.seed}.",
        "",
        "| load (x G*) | req/s | routing | hit rate | index hit rate | attainment "
        f"| TTFT p50 s | TTFT p99 s | TPOT p99 ms | share ({replicas}) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in study.rows:
        index = (
            "-" if row.gateway_hit_rate != row.gateway_hit_rate else f"{row.gateway_hit_rate:.1%}"
        )
        lines.append(
            f"| {row.load:g} | {row.rate:.2f} | {row.variant} | {row.hit_rate:.1%} | {index} "
            f"| {row.attainment:.3f} | {row.ttft_p50:.3f} | {row.ttft_p99:.2f} "
            f"| {row.tpot_p99 * 1000:.1f} | {' / '.join(f'{s:.2f}' for s in row.shares)} |"
        )
    lines += [
        "",
        "hit rate: prompt tokens the engines found in their prefix cache over the prompt tokens "
        "they admitted, in the measured window; index hit rate: the same share as prefix-cache's "
        "own index counted it at routing time (whole run, blocks of 128 characters); attainment: "
        "share of the measured requests that completed within every SLO target.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plugin_tools.sim.prefix",
        description="prefix-cache alone, auto-blended with load-balance, and load-balance on a"
        " shared-prefix workload over a mixed fleet in the simulator; prints a Markdown table",
    )
    add_study_arguments(parser, DEFAULT_FLEET, DEFAULT_LOADS)
    parser.add_argument("--groups", type=int, default=DEFAULT_WORKLOAD.groups)
    parser.add_argument("--shared-tokens", type=int, default=DEFAULT_WORKLOAD.shared_tokens)
    parser.add_argument("--zipf", type=float, default=DEFAULT_WORKLOAD.zipf)
    args = parser.parse_args(argv)
    loads = study_loads(parser, args)
    try:
        workload = replace(
            DEFAULT_WORKLOAD, groups=args.groups, shared_tokens=args.shared_tokens, zipf=args.zipf
        )
        study = prefix_study(
            args.fleet,
            loads,
            workload=workload,
            measured_requests=args.requests,
            warmup_s=args.warmup,
            seed=args.seed,
        )
    except ValueError as exc:
        parser.error(str(exc))
    table = format_markdown(study)
    sys.stdout.write(table)
    if args.doc is not None:
        command = study_command("python -m plugin_tools.sim.prefix", argv)
        text = (
            "## Prefix caching: prefix-cache, auto-blended and load-balance\n\n"
            f"Generated by `{command} --doc docs/benchmarks.md` in the fleet simulator, whose"
            " engines keep a prefix cache (`plugin_tools/sim/engine.py`): prompts that share a"
            " long prefix, routed by `prefix-cache` alone, by AIBrix's auto-blend of it with"
            " load-balance (what a bare `routing-strategy: prefix-cache` header gets by default)"
            " and by `load-balance` alone.\n\n" + table
        )
        write_section(args.doc, "prefix-cache", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
