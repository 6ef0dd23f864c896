"""SLO routing through a real Envoy on a mixed mock fleet: attainment and goodput per strategy.

Starts two mock engines (a100, v100), the plugin and Envoy; sweeps each GPU type through the
gateway with `profile sweep`'s code (narrowed by the `external-filter` header), builds each
profile for p99 TTFT <= 1 s with `profile build`'s code and restarts the plugin on them; then
offers the same mix (short chat prompts at 6/s and 4,200-word prompts at 1/s, 32 output tokens,
Poisson) for 30 s under each strategy. Prints the figures and writes them to the `slo-envoy`
section of docs/benchmarks.md.

    python benchmarks/slo_routing.py             # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from plugin_tools.bench.slo import SloBench, run_bench
from plugin_tools.docsection import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def render(doc: dict[str, Any]) -> str:
    bench = doc["bench"]
    mix = ", ".join(
        f"{m['name']} ({m['prompt_words']} words in, {m['output_tokens']} out, {m['rate_per_s']}/s)"
        for m in bench["mix"]
    )
    lines = [
        "## SLO routing through Envoy",
        "",
        "`python benchmarks/slo_routing.py`: mock engines "
        f"{', '.join(bench['presets'])} (one each, time scale {bench['time_scale']}), the plugin "
        "and a real Envoy on loopback. Each GPU type is profiled through the gateway with "
        "`profile sweep`'s code narrowed by `external-filter`, and its profile built for "
        f"p{bench['percentile']} TTFT <= {bench['ttft_slo_s']} s by `profile build`'s code; "
        f"`HETERO_GATEWAY_SLO_MAX_WAIT_MS={bench['max_wait_ms']}`. Then the same mix for "
        f"{bench['duration_s']:.0f} s under each strategy: {mix}. Attainment counts every "
        "offered request (a rejection is a miss); goodput is requests served within the SLO per "
        "second; TTFT and TPOT are the client's, p99 over served requests.",
        "",
        "| strategy | attainment | goodput/s | p99 TTFT ms | p99 TPOT ms | served | rejected "
        "| latest reject past deadline ms | long prompts served by |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in doc["runs"]:
        long = run["by_kind"].get("long", {})
        by_gpu = ", ".join(f"{g} {n}" for g, n in long.get("served_by_gpu", {}).items()) or "-"
        late = run["max_reject_late_s"]
        lines.append(
            f"| {run['strategy']} | {run['attainment']:.3f} | {run['goodput_per_s']:.2f} "
            f"| {_ms(run['p99_ttft_s'])} | {_ms(run['p99_tpot_s'])} | {run['served']} "
            f"| {run['rejected']} | {_ms(max(0.0, late) if late is not None else None)} "
            f"| {by_gpu} |"
        )
    lines += [
        "",
        "Profiles the sweeps produced (requests/s each GPU type sustains within the SLO, per "
        "input length, 32 output tokens):",
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
        "the a100. `slo-least-load` and `slo-pack-load` then route every request at once; what "
        "they miss is mostly short prompts that queued on the a100 behind a long prefill, an "
        "interference a per-size profile cannot see. `slo` (pulling) also holds a request while "
        "no replica has room by its profile and answers 503 at its deadline (the arrival plus "
        "the TTFT budget the profile leaves) instead of serving it late, so its served requests "
        "keep the SLO (within the few ms between the client's clock and the gateway's); the "
        "price is the requests it rejects, because room is counted in shares of the rates the "
        "sweep saw sustained, which for short prompts is the top of the sweep's rate range, not "
        "the a100's ceiling. A sweep over higher rates (more prompts per point, so a kept-up "
        "rate measures as kept up) gives `slo` more room. Figures vary from run to run by a few "
        "points (one machine, 2 cores).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per strategy")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    bench = replace(SloBench(), duration_s=args.duration)
    with tempfile.TemporaryDirectory(prefix="slo-bench-") as tmp:
        doc = asyncio.run(run_bench(bench, Path(tmp), log=lambda m: print(m, file=sys.stderr)))
    text = render(doc)
    print(text)
    if not args.no_write:
        print(f"wrote {write_section(DOC, 'slo-envoy', text).name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
