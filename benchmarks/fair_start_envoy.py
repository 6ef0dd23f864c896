"""A new V100 joins three A100s under steady load, through real Envoy: its first minute.

The demo's kind of stack (mock engines at the demo's time scale, the plugin, Envoy), four
engines: three a100 presets and one v100. The v100 is listed in the pods file but not ready; at
`--join-at` seconds the file says it is ready, so it joins with nothing learned, as a pod that
finished loading its weights does. An open-loop load at `--load` of the four engines' saturated
output rate (the demo's prompts and answers, load-balance) runs throughout. The load is high
enough that the A100s' steps take longer than a V100's with one sequence in it: below that, no
request on a V100 can be as fast as the A100s', however few it is sent. No GPU profiles are
loaded: the V100 is the first of its type, so it starts from the lowest learned capacity, an
A100's (`plugin.core.fair_start`), the hardest case for a fair start.

Each seed runs twice, the slow start off (`HETERO_GATEWAY_SLOW_START_WINDOW_S=0`: scored at its
start at once) and at the defaults. Reported for the requests that arrived in the `--window`
seconds after the join: the v100's share of them, its p99 time per output token and TTFT
against the A100s'.

    python benchmarks/fair_start_envoy.py     # about 15 minutes; section fair-start-envoy
    python benchmarks/fair_start_envoy.py --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from plugin_tools.demo.fleet import PURE_STRATEGIES, FleetSpec, LocalFleet, free_port
from plugin_tools.demo.loadgen import Workload, run_open_loop
from plugin_tools.demo.report import RequestResult
from plugin_tools.demo.up import DEMO_OUTPUT_TOKENS, DEMO_PROMPT_WORDS
from plugin_tools.docsection import write_section
from plugin_tools.mock_engine.model import PRESETS as ENGINE_PRESETS
from plugin_tools.mock_engine.model import step_duration_s

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "fair-start-envoy"
PRESETS = ("a100", "a100", "a100", "v100")
NEWCOMER = "v100-0"
MODES = {"scored at its start at once": "0", "slow start (the defaults)": None}


class JoiningFleet(LocalFleet):
    """A LocalFleet whose pods file lists the newcomer as not ready until `join`."""

    joined = False

    def pods_document(self) -> dict[str, object]:
        document = super().pods_document()
        if not self.joined:
            for model in document["models"].values():  # type: ignore[attr-defined]
                for pod in model["pods"]:
                    if pod["name"] == NEWCOMER:
                        pod["ready"] = False
        return document

    def join(self) -> None:
        self.joined = True
        self.pods_file.write_text(yaml.safe_dump(self.pods_document(), sort_keys=False))


@dataclass(frozen=True, slots=True)
class Outcome:
    share: float  # the newcomer's share of the window's requests over its saturated share
    tpot_p99: float
    a100_tpot_p99: float
    ttft_p99: float
    a100_ttft_p99: float
    served: int  # requests of the window it served
    failed: int  # requests of the whole run that failed


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def run(mode: str, seed: int, args: argparse.Namespace) -> Outcome:
    env = dict(PURE_STRATEGIES)
    window_s = MODES[mode]
    if window_s is not None:
        env["HETERO_GATEWAY_SLOW_START_WINDOW_S"] = window_s
    spec = FleetSpec(presets=PRESETS, listen_port=free_port(), plugin_env=env)
    fleet = JoiningFleet(spec)
    async with fleet:
        saturated = {e.name: e.saturated_tokens_per_s for e in fleet.engines}
        rate = args.load * sum(saturated.values()) / DEMO_OUTPUT_TOKENS.mean()
        total = args.join_at + args.window
        workload = Workload(rate, total, DEMO_PROMPT_WORDS, DEMO_OUTPUT_TOKENS, seed=seed)
        load = asyncio.create_task(
            run_open_loop(fleet.envoy_url, spec.model, workload, strategy="load-balance")
        )
        start = time.monotonic()
        await asyncio.sleep(args.join_at)
        fleet.join()
        joined_at = time.monotonic() - start  # the plugin reads the file within a poll or two
        results = await load
        names = {f"127.0.0.1:{e.port}": e.name for e in fleet.engines}
        names.update({e.name: e.name for e in fleet.engines})
    return outcome(results, names, joined_at, args.window, saturated)


def outcome(
    results: list[RequestResult],
    names: dict[str, str],
    joined_at: float,
    window_s: float,
    saturated: dict[str, float],
) -> Outcome:
    window = [r for r in results if r.ok and joined_at <= r.started_at < joined_at + window_s]
    mine = [r for r in window if names.get(r.replica or "") == NEWCOMER]
    a100s = [r for r in window if names.get(r.replica or "", "").startswith("a100")]
    fair = saturated[NEWCOMER] / sum(saturated.values())
    return Outcome(
        share=len(mine) / len(window) / fair if window else math.nan,
        tpot_p99=_p99([t for r in mine if (t := r.tpot_s) is not None]),
        a100_tpot_p99=_p99([t for r in a100s if (t := r.tpot_s) is not None]),
        ttft_p99=_p99([t for r in mine if (t := r.ttft_s) is not None]),
        a100_ttft_p99=_p99([t for r in a100s if (t := r.ttft_s) is not None]),
        served=len(mine),
        failed=sum(not r.ok for r in results),
    )


def level_batch() -> tuple[float, float]:
    """A V100's step with one sequence (ms, the presets' time), and the A100 batch whose step
    takes as long."""
    a100, v100 = ENGINE_PRESETS["a100"], ENGINE_PRESETS["v100"]
    one = step_duration_s(v100, 1)
    return 1000 * one, (1000 * one - a100.a_ms) / a100.b_ms


def render(rows: dict[str, list[Outcome]], args: argparse.Namespace) -> str:
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    one_ms, batch = level_batch()

    lines = [
        "## A new V100 joins three A100s, through Envoy",
        "",
        f"`python benchmarks/fair_start_envoy.py` (mock engines a100 x 3 and v100 at the demo's"
        f" time scale, the plugin, Envoy; load-balance, the demo's prompts and answers, open loop"
        f" at {args.load:g} of the engines' saturated output rate; {args.seeds} seeds). The v100"
        f" is listed but not ready until {args.join_at:g} s, then joins with nothing learned; no"
        " GPU profiles are loaded, so it starts from the lowest learned capacity, an A100's."
        f" The requests that arrived in the {args.window:g} s after it joined, mean over seeds;"
        " *share* is the v100's share of them over its share of the saturated rate. Times are"
        " as the client measured them, at the mock engines' time scale. The load is set so that"
        f" the A100s' batches exceed about {batch:.0f} sequences, where an A100's step takes as"
        f" long as a V100's with one sequence ({one_ms:.1f} ms before scaling): at lighter loads"
        " no request on the V100 can be as fast as the A100s', however few it is sent.",
        "",
        "| the v100's start | share | requests it served | its p99 TPOT (ms) |"
        " A100s' p99 TPOT (ms) | seeds with its p99 TPOT at most the A100s' |"
        " its p99 TTFT (ms) | A100s' p99 TTFT (ms) | failed requests |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, outs in rows.items():
        level = sum(o.tpot_p99 <= o.a100_tpot_p99 for o in outs)
        lines.append(
            f"| {mode} | {mean([o.share for o in outs]):.2f}x"
            f" | {mean([o.served for o in outs]):.0f}"
            f" | {1000 * mean([o.tpot_p99 for o in outs]):.0f}"
            f" | {1000 * mean([o.a100_tpot_p99 for o in outs]):.0f}"
            f" | {level} of {len(outs)}"
            f" | {1000 * mean([o.ttft_p99 for o in outs]):.0f}"
            f" | {1000 * mean([o.a100_ttft_p99 for o in outs]):.0f}"
            f" | {sum(o.failed for o in outs)} |"
        )
    at_once, ramped = (rows[mode] for mode in MODES)
    lines += [
        "",
        "Scored at all of its start at once (an A100's learned capacity), the v100 takes an"
        " A100's in-flight share in its first second and its p99 TPOT is"
        f" {1000 * mean([o.tpot_p99 for o in at_once]):.0f} ms against the A100s'"
        f" {1000 * mean([o.a100_tpot_p99 for o in at_once]):.0f}; ramped in, it is"
        f" {1000 * mean([o.tpot_p99 for o in ramped]):.0f} against"
        f" {1000 * mean([o.a100_tpot_p99 for o in ramped]):.0f}, and it serves"
        f" {mean([o.share for o in ramped]):.2f}x its share of the saturated rate in that minute:"
        " its own estimate, learned from the little it is sent at first, grows as it is sent"
        " more.",
    ]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> int:
    rows: dict[str, list[Outcome]] = {mode: [] for mode in MODES}
    for seed in range(1, args.seeds + 1):
        for mode in MODES:
            print(f"seed {seed}, {mode} ...", file=sys.stderr, flush=True)
            o = await run(mode, seed, args)
            print(f"  {o}", file=sys.stderr, flush=True)
            rows[mode].append(o)
    text = render(rows, args)
    print(text)
    if not args.no_write:
        write_section(DOC, SECTION, text)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=float, default=0.75, help="share of the saturated rate")
    parser.add_argument("--join-at", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse_args())))
