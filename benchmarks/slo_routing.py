"""SLO routing through a real Envoy on a mixed mock fleet: attainment and goodput per strategy.

Starts two mock engines (a100, v100), the plugin and Envoy; sweeps each GPU type through the
gateway with `profile sweep`'s steady-state search (narrowed by the `external-filter` header)
judged at p90 TTFT <= 1 s (`--percentile`), builds each profile with `profile build`'s code and
restarts the plugin on them; then offers the same mix (short chat prompts at 6/s and 4,200-word
prompts at 1/s, 32 output tokens, Poisson) for 30 s under each strategy, and the same at half
the rates. Prints the figures and writes them to the `slo-envoy` section of docs/benchmarks.md.

    python benchmarks/slo_routing.py             # about 25 minutes on 2 cores (the sweeps)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from plugin_tools.bench.slo import SloBench, run_bench
from plugin_tools.docsection import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| strategy | attainment | goodput/s | p99 TTFT ms | p99 TPOT ms | served | rejected "
        "| served late | latest reject past deadline ms | rejected behind a prefill of their "
        "class (its first token after their arrival, ms) | long prompts served by |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        long = run["by_kind"].get("long", {})
        by_gpu = ", ".join(f"{g} {n}" for g, n in long.get("served_by_gpu", {}).items()) or "-"
        late = run["max_reject_late_s"]
        behind = [b for b in run.get("rejected_behind_s", []) if b is not None]
        ahead = ", ".join(_ms(b) for b in sorted(behind))
        behind_cell = f"{len(behind)} ({ahead})" if behind else str(len(behind))
        lines.append(
            f"| {run['strategy']} | {run['attainment']:.3f} | {run['goodput_per_s']:.2f} "
            f"| {_ms(run['p99_ttft_s'])} | {_ms(run['p99_tpot_s'])} | {run['served']} "
            f"| {run['rejected']} ({run['rejected'] / max(run['offered'], 1):.1%}) "
            f"| {run['served_late']} | {_ms(max(0.0, late) if late is not None else None)} "
            f"| {behind_cell} | {by_gpu} |"
        )
    return lines


def render(doc: dict[str, Any]) -> str:
    bench = doc["bench"]
    mix = ", ".join(
        f"{m['name']} ({m['prompt_words']} words in, {m['output_tokens']} out, {m['rate_per_s']}/s)"
        for m in bench["mix"]
    )
    sweep = bench["sweep"]
    lines = [
        "## SLO routing through Envoy",
        "",
        "`python benchmarks/slo_routing.py`: mock engines "
        f"{', '.join(bench['presets'])} (one each, time scale {bench['time_scale']}), the plugin "
        "and a real Envoy on loopback. Each GPU type is profiled through the gateway by "
        "`profile sweep`'s steady-state search (the default) narrowed by `external-filter`, "
        f"inputs {list(sweep['inputs'])} x outputs {list(sweep['outputs'])} tokens, rates "
        f"{sweep['rates'][0]:g}..{sweep['rates'][1]:g} req/s, judged at p{bench['percentile']} "
        f"TTFT <= {bench['ttft_slo_s']} s, and built by `profile build`; "
        f"`HETERO_GATEWAY_SLO_MAX_WAIT_MS={bench['max_wait_ms']}`. Then the same mix for "
        f"{bench['duration_s']:.0f} s under each strategy: {mix}; then the same at "
        f"{bench['light']:g} x those rates. Attainment counts every offered request (a "
        "rejection is a miss); goodput is requests served within the SLO per second; served "
        "late: served with a TTFT over the SLO; TTFT and TPOT are the client's, p99 over served "
        "requests.",
        "",
        "### The mix",
        "",
        *_table([r for r in doc["runs"] if r.get("mix", "full") == "full"]),
        "",
        f"### The mix at {bench['light']:g} x its rates",
        "",
        *_table([r for r in doc["runs"] if r.get("mix") == "light"]),
        "",
        "Profiles the sweeps produced (requests/s each GPU type sustains within the SLO, per "
        "input length, 32 output tokens"
        + ("" if doc.get("swept", True) else "; swept by an earlier run, reused with `--profiles`")
        + "):",
        "",
    ]
    for gpu, p in doc["profiles"].items():
        cells = ", ".join(
            f"{inp} in: {t:.2f}/s" for inp, t in zip(p["indexes"][1], p["tputs"][0], strict=True)
        )
        lines.append(f"- {gpu}: {cells}")
    lines += [
        "",
        "How to read it. `least-request` and `load-balance` send some long prompts to the v100, "
        "where a 4k-token prefill alone takes longer than the whole TTFT budget and stalls "
        "every request decoding beside it. The SLO strategies read from the profiles that the "
        "v100 never serves long prompts within the SLO (its `tputs` there is 0) and keep them on "
        "the a100. `slo` (pulling) also holds a request while no replica has room by its "
        "profile and answers 503 at its deadline (the arrival plus the TTFT budget the profile "
        "leaves) instead of serving it late. Room is counted in shares of what the steady sweep "
        "found each GPU type sustains (a long prompt by what it costs inside the mix, "
        "`mix_tputs`), and a pod is full for `slo` at the burst of the request's cell its "
        "profile went through (`burst_room`), not at the mean; "
        "with AIBrix's sweep (100 prompts a point, rates kept up "
        "within 0.9) `slo` rejected 21 of 203 requests of this mix. Figures vary from run to "
        "run by a few points (one machine, 2 cores).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per strategy")
    parser.add_argument(
        "--percentile",
        type=int,
        default=90,
        choices=(50, 90, 99),
        help="the share of requests within the TTFT SLO the sweep judges (p99 takes hours: "
        "299 requests a probe at about 1 req/s for the long prompts)",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        help="keep the swept profiles in this directory; if it already holds one per GPU type "
        "(an earlier run's), route by them and skip the sweeps (about 20 minutes)",
    )
    parser.add_argument(
        "--strategies", help="comma-separated strategies to run (default: all five)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--json", type=Path, help="also write every figure (per request class too) to this file"
    )
    args = parser.parse_args()
    bench = replace(SloBench(), duration_s=args.duration, percentile=args.percentile)
    if args.strategies:
        bench = replace(bench, strategies=tuple(args.strategies.split(",")))
    with tempfile.TemporaryDirectory(prefix="slo-bench-") as tmp:
        doc = asyncio.run(
            run_bench(
                bench, Path(tmp), log=lambda m: print(m, file=sys.stderr), profile_dir=args.profiles
            )
        )
    if args.json:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    text = render(doc)
    print(text)
    if not args.no_write and args.strategies:
        print("a subset of the strategies: docs/benchmarks.md left as it is", file=sys.stderr)
    elif not args.no_write:
        print(f"wrote {write_section(DOC, 'slo-envoy', text).name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
