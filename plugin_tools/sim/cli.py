"""`hetero-gateway simulate`: the fleet simulator's study from the command line."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_STRATEGIES = (
    "random,round-robin,least-request,power-of-two,capacity-weighted,load-balance,"
    "load-balance-reference"
)
DEFAULT_LOADS = "0.5,0.6,0.7,0.8,0.85,0.9,0.95,1.0,1.1"
DEFAULT_TRACE_DIR = "../shared/data/traces"


def register_cli(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a mixed GPU fleet behind the gateway's strategies (no GPU, no Envoy)",
        description=(
            "Simulates engines per scheduler step behind the plugin's own router and strategies."
            " Finds each replica's SLO capacity and G*, sweeps load in fractions of G* and"
            " bisects each strategy's max sustainable rate. Deterministic for a seed."
        ),
    )
    p.add_argument(
        "--fleet", default="a100,l20,v100", help="GPU types, e.g. a100,l20,v100 or 3xa100"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[GPU.]FIELD=VALUE",
        help="override a GPU parameter (a_ms, b_ms, p_ms, kv_tokens, max_num_seqs,"
        " max_batched_tokens), for all or one type: --set a100.max_num_seqs=32",
    )
    p.add_argument(
        "--workload",
        default="chat",
        help="chat, long (prompts over 4k tokens, short answers), azure-conv, azure-code or a"
        " mix: chat:0.8,long:0.2",
    )
    p.add_argument("--trace-dir", default=DEFAULT_TRACE_DIR, help="folder of the Azure trace CSVs")
    p.add_argument(
        "--arrivals",
        default="poisson",
        help="poisson, gamma:CV (burstier when CV > 1) or trace (the trace's own gaps, rescaled)",
    )
    slo = "SLO in seconds (with no --slo-* flag: TTFT 1 s and TPOT 0.06 s)"
    p.add_argument("--slo-ttft", type=float, help=f"TTFT {slo}")
    p.add_argument("--slo-tpot", type=float, help=f"TPOT (per output token after the first) {slo}")
    p.add_argument("--slo-e2e", type=float, help=f"end-to-end latency {slo}")
    p.add_argument("--slo-tpat", type=float, help=f"TPAT (E2E / (prompt + output tokens)) {slo}")
    p.add_argument("--target", type=float, default=0.99, help="attainment that counts as sustained")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated, run in turn")
    p.add_argument("--loads", default=DEFAULT_LOADS, help="fractions of G* to sweep")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per run")
    p.add_argument("--warmup", type=float, default=120.0, help="simulated seconds before measuring")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="gateway metrics period (s)")
    p.add_argument("--metrics-delay", type=float, default=0.0, help="age of a scrape when used (s)")
    p.add_argument("--queued-weight", type=float, default=0.0, help="load-balance lambda")
    p.add_argument("--seed", type=int, default=1, help="one seed: the same tables every run")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    p.add_argument("--md", type=Path, help="Markdown table (default: next to --json)")
    p.add_argument("--plots", type=Path, help="PNG prefix (default: next to --json)")
    p.add_argument(
        "--doc",
        type=Path,
        help="with SLO strategies: write their figures as a marked section of this Markdown"
        " file (docs/benchmarks.md), keeping the rest of it",
    )
    p.add_argument("--doc-section", default="simulate-slo", help="the section's marker name")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _overrides(items: list[str]) -> dict[str, float | int]:
    from plugin.errors import ConfigError

    out: dict[str, float | int] = {}
    fields = {"a_ms", "b_ms", "p_ms", "kv_tokens", "max_num_seqs", "max_batched_tokens"}
    for item in items:
        key, sep, raw = item.partition("=")
        field = key.rpartition(".")[2]
        if not sep or field not in fields:
            raise ConfigError(
                f"--set {item!r}: expected [GPU.]FIELD=VALUE, FIELD in {sorted(fields)}"
            )
        try:
            out[key] = float(raw) if field.endswith("_ms") else int(raw)
        except ValueError:
            raise ConfigError(f"--set {item!r}: {raw!r} is not a number") from None
    return out


def _floats(raw: str, what: str) -> list[float]:
    from plugin.errors import ConfigError

    try:
        values = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} {raw!r}: expected numbers separated by commas") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"{what} {raw!r}: expected positive numbers")
    return values


def slo_target(args: argparse.Namespace) -> Any:
    """The --slo-* flags given, or the default SLO when none is."""
    from plugin.core.types import SloTarget
    from plugin.errors import ConfigError
    from plugin_tools.sim.metrics import DEFAULT_SLO

    given = (args.slo_ttft, args.slo_tpot, args.slo_e2e, args.slo_tpat)
    if all(v is None for v in given):
        return DEFAULT_SLO
    if any(v is not None and not v > 0 for v in given):
        raise ConfigError("--slo-* targets must be positive seconds")
    return SloTarget(*given)


def build_scenario(args: argparse.Namespace) -> Any:
    from plugin.core.strategies import LoadBalanceSettings
    from plugin.errors import ConfigError
    from plugin_tools.sim.engine import parse_fleet
    from plugin_tools.sim.fleet import GatewayModel
    from plugin_tools.sim.sweep import Scenario
    from plugin_tools.sim.traces import parse_workload
    from plugin_tools.sim.workload import Arrivals

    try:
        profiles = parse_fleet(args.fleet, **_overrides(args.set))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--fleet/--set: {exc}") from None
    lengths, traces = parse_workload(args.workload, Path(args.trace_dir))
    kind, _, cv = args.arrivals.partition(":")
    try:
        if kind == "trace":
            if len(traces) != 1:
                raise ConfigError("--arrivals trace needs exactly one trace workload")
            arrivals = Arrivals("trace", trace_times=next(iter(traces.values())).times)
        else:
            arrivals = Arrivals(kind, float(cv) if cv else 1.0)
    except ValueError as exc:
        raise ConfigError(f"--arrivals {args.arrivals!r}: {exc}") from None
    if args.requests < 10 or args.warmup < 0 or args.scrape_interval <= 0:
        raise ConfigError("--requests >= 10, --warmup >= 0 and --scrape-interval > 0")
    if not 0 < args.target <= 1:
        raise ConfigError("--target must be in (0, 1]")
    return Scenario(
        tuple(profiles),
        lengths,
        arrivals,
        slo_target(args),
        GatewayModel(
            scrape_interval_s=args.scrape_interval,
            metrics_delay_s=args.metrics_delay,
            params=LoadBalanceSettings(queued_weight=args.queued_weight),
        ),
        measured_requests=args.requests,
        warmup_s=args.warmup,
        seed=args.seed,
        target=args.target,
    )


def run(args: argparse.Namespace) -> int:
    from plugin_tools.extras import require_demo_extra

    require_demo_extra("simulate", ("matplotlib", "tqdm"))
    from tqdm import tqdm

    from plugin_tools.sim.report import (
        UTILIZATION,
        format_markdown,
        slo_seconds,
        write_json,
        write_plots,
    )
    from plugin_tools.sim.sweep import reads_profiles, study

    scenario = build_scenario(args)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    loads = _floats(args.loads, "--loads")
    started = time.monotonic()
    slo_routing = any(reads_profiles(s) for s in strategies)
    if args.doc and not slo_routing:
        from plugin.errors import ConfigError

        raise ConfigError("--doc writes the figures of SLO strategies; --strategies has none")
    units = 1 + len(strategies) + slo_routing  # + the GPU profiles
    with tqdm(total=units, desc="simulate", disable=args.no_progress, file=sys.stderr) as bar:

        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        try:
            doc = study(scenario, strategies, loads, progress)
        except ValueError as exc:
            from plugin.errors import ConfigError

            raise ConfigError(str(exc)) from None
    doc.update(
        command="hetero-gateway simulate " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
        fleet=args.fleet,
        overrides=args.set,
        workload=args.workload,
        arrivals=args.arrivals,
        slo=slo_seconds(scenario.slo),
        target=args.target,
        seed=args.seed,
        max_tokens=scenario.lengths.max_output,
        measured_requests=args.requests,
        warmup_s=args.warmup,
        scrape_interval_s=args.scrape_interval,
        metrics_delay_s=args.metrics_delay,
        definitions={
            "utilization": UTILIZATION,
            "busy": "fraction of the measured window the engine spent running steps",
            "g_star": "sum over replicas of the largest rate each serves alone at the target"
            " attainment",
            "max_rate": "largest offered rate (req/s) with attainment >= target (bisection)",
            "tpot_p50_ratio": "max / min over replicas of the per-replica p50 TPOT",
            "rejected": "measured requests the strategy refused, at once or after waiting at"
            " the gateway (a miss; not among the dropped)",
            "wait_p50": "time from arrival to routing of the routed requests (also wait_p99)",
        },
        elapsed_s=round(time.monotonic() - started, 1),
    )
    markdown = format_markdown(doc)
    print(markdown, end="")
    if args.json:
        write_json(doc, args.json)
    md = args.md or (args.json.with_suffix(".md") if args.json else None)
    if md:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(f"Command: `{doc['command']}`\n\n" + markdown)
    if args.doc:
        from plugin_tools.docsection import write_section
        from plugin_tools.sim.report import format_slo_routing

        print(
            f"wrote {write_section(args.doc, args.doc_section, format_slo_routing(doc))}",
            file=sys.stderr,
        )
    prefix = args.plots or (args.json.with_suffix("") if args.json else None)
    if prefix:
        for path in write_plots(doc, prefix):
            print(f"wrote {path}", file=sys.stderr)
    return 0
