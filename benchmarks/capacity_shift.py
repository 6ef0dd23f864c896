"""Capacity shift through real Envoy: a fast and a slow mock engine exchange speeds mid-run.

For each strategy (least-request, then load-balance) a fresh stack of the demo's kind starts:
three mock engines (a100, l20 and v100 presets at the demo's time scale), the plugin and Envoy;
once with the engines sending each token in its own SSE event (no stream interval), once
with eight tokens an event (the demo's default, which keeps its CPU low on small machines): the
chunk-gap watch sees one gap per event, so the second sees a change eight steps later.
An open-loop load at `LOAD` of the fleet's saturated output rate runs for WARMUP_S + STEADY_S +
AFTER_S seconds; at WARMUP_S + STEADY_S the a100 and the v100 exchange step costs (the mock
engine's `PUT /mock/step-costs`: another tenant on the fast GPU, a replica restarted with other
engine args). The plugin's `/debug/pods` is read every second for each pod's capacity estimate
(learned from the engines' own token counters, with the scrape and chunk-gap watches).

Reported: p99 time per output token of the requests that arrived in the STEADY_S before the
swap and finished before it, of those running at the swap or arriving in the first DURING_S
after it (and apart, those of them running at the swap, placed before anything changed, and
those that arrived after it: what routing decided), and of those arriving later; how long after
the swap load-balance's
estimates put the new fast replica above the new slow one for good; each replica's share.

    python benchmarks/capacity_shift.py       # about 18 minutes

Writes the `capacity-shift-envoy` section of docs/benchmarks.md and
docs/bench/capacity-shift-envoy.png.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from plugin_tools.demo.fleet import LocalFleet, free_port
from plugin_tools.demo.loadgen import Workload, run_open_loop
from plugin_tools.demo.report import RequestResult
from plugin_tools.demo.up import DEMO_OUTPUT_TOKENS, DEMO_PROMPT_WORDS, UpOptions, fleet_spec
from plugin_tools.docsection import write_section
from plugin_tools.sim.shift import traffic_follows, transition_window

WARMUP_S = 60.0
STEADY_S = 60.0
DURING_S = 60.0
AFTER_S = 120.0
LOAD = 0.7
TOKENS_PER_EVENT = (1, 8)
STRATEGIES = ("least-request", "load-balance")
FAST, SLOW = "a100-0", "v100-0"
COSTS = ("a_ms", "b_ms", "prefill_ms_per_token")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Run:
    strategy: str
    tokens_per_event: int
    rate: float
    results: list[RequestResult]
    estimates: list[tuple[float, dict[str, float | None]]]  # (s since start, per pod name)
    names: dict[str, str]  # what a result's `replica` says (pod name or IP:port) -> pod name


async def _swap(session: aiohttp.ClientSession, urls: dict[str, str]) -> None:
    """The fast and the slow engine exchange step costs."""
    costs = {}
    for name in (FAST, SLOW):
        async with session.get(f"{urls[name]}/mock/step-costs") as resp:
            costs[name] = await resp.json()
    for name, other in ((FAST, SLOW), (SLOW, FAST)):
        body = {k: costs[other][k] for k in COSTS}
        async with session.put(f"{urls[name]}/mock/step-costs", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{name}: {resp.status} {await resp.text()}")


async def run(strategy: str, tokens_per_event: int) -> Run:
    opts = UpOptions(port=free_port(), tokens_per_chunk=tokens_per_event)
    total = WARMUP_S + STEADY_S + AFTER_S
    async with LocalFleet(fleet_spec(opts)) as fleet, aiohttp.ClientSession() as session:
        saturated = sum(e.saturated_tokens_per_s for e in fleet.engines)
        rate = LOAD * saturated / DEMO_OUTPUT_TOKENS.mean()
        urls = {e.name: e.url for e in fleet.engines}
        workload = Workload(rate, total, DEMO_PROMPT_WORDS, DEMO_OUTPUT_TOKENS, seed=opts.seed)
        start = time.monotonic()
        load = asyncio.create_task(
            run_open_loop(fleet.envoy_url, opts.model, workload, strategy=strategy)
        )
        estimates: list[tuple[float, dict[str, float | None]]] = []
        swapped = False
        while not load.done():
            await asyncio.sleep(1.0)
            now = time.monotonic() - start
            if not swapped and now >= WARMUP_S + STEADY_S:
                await _swap(session, urls)
                swapped = True
                print(f"  {strategy}: swapped at {now:.1f} s", file=sys.stderr, flush=True)
            async with session.get(f"{fleet.plugin_url}/debug/pods") as resp:
                pods = (await resp.json())["pods"]
            estimates.append((now, {p["name"]: p["capacity_tokens_per_s"] for p in pods.values()}))
        names = {e.name: e.name for e in fleet.engines}
        names.update({f"127.0.0.1:{e.port}": e.name for e in fleet.engines})
        return Run(strategy, tokens_per_event, rate, await load, estimates, names)


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def windows(results: list[RequestResult]) -> list[tuple[float, list[RequestResult]]]:
    """(p99 TPOT, requests) before, during and after the transition (`transition_window`: a
    request running at the swap counts in the transition, not before it)."""
    at = WARMUP_S + STEADY_S
    mine: tuple[list[RequestResult], ...] = ([], [], [])
    for r in results:
        if r.ok and r.latency_s is not None:
            finish = r.started_at + r.latency_s
            window = transition_window(
                r.started_at, finish, at, steady_s=STEADY_S, during_s=DURING_S, after_s=AFTER_S
            )
            if window is not None:
                mine[window].append(r)
    return [(_p99([t for r in m if (t := r.tpot_s) is not None]), m) for m in mine]


def rerank(estimates: list[tuple[float, dict[str, float | None]]]) -> float:
    """Seconds after the swap from which the new fast replica's estimate stays above the new
    slow one's; inf if it never does."""
    at = WARMUP_S + STEADY_S
    since: float | None = None
    for t, values in estimates:
        if t < at:
            continue
        new_fast, new_slow = values.get(SLOW), values.get(FAST)
        if new_fast is not None and new_slow is not None and new_fast > new_slow:
            since = t if since is None else since
        else:
            since = None
    return math.inf if since is None else since - at


def _share(run: Run, mine: list[RequestResult], name: str) -> float:
    if not mine:
        return math.nan
    return sum(1 for r in mine if run.names.get(r.replica or "") == name) / len(mine)


def plot(load_balance: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = sorted(load_balance.estimates[-1][1]) if load_balance.estimates else []
    for name in names:
        points = [(t, e) for t, v in load_balance.estimates if (e := v.get(name)) is not None]
        ax.plot([t for t, _ in points], [e for _, e in points], label=name)
    ax.axvline(WARMUP_S + STEADY_S, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("capacity estimate (tokens/s)")
    ax.set_title(f"load-balance through Envoy: {FAST} and {SLOW} exchange speeds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main() -> None:
    runs = []
    for k in TOKENS_PER_EVENT:
        for strategy in STRATEGIES:
            print(f"{strategy}, {k} tokens an event ...", file=sys.stderr, flush=True)
            runs.append(await run(strategy, k))
    names = (FAST, "l20-0", SLOW)
    lines = [
        "| tokens an event | strategy | TPOT p99 ms before | during (first 60 s) "
        "| of which running at the swap | of which arrived after it | after | re-rank s "
        f"| traffic follows s | share before ({' / '.join(names)}) | share after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    failed = 0
    for r in runs:
        (before, b_reqs), (during, d_reqs), (after, a_reqs) = windows(r.results)
        at = WARMUP_S + STEADY_S
        routed_after = _p99(
            [t for x in d_reqs if x.started_at >= at and (t := x.tpot_s) is not None]
        )
        running = _p99([t for x in d_reqs if x.started_at < at and (t := x.tpot_s) is not None])
        failed += sum(not x.ok for x in r.results)
        re = "-" if r.strategy == "least-request" else f"{rerank(r.estimates):.0f}"
        routed = ((x.started_at, r.names.get(x.replica or "")) for x in r.results if x.ok)
        follows = traffic_follows(routed, at, SLOW, FAST, span_s=AFTER_S)
        lines.append(
            f"| {r.tokens_per_event} | {r.strategy} | {1000 * before:.1f} | {1000 * during:.1f} "
            f"| {1000 * running:.1f} | {1000 * routed_after:.1f} | {1000 * after:.1f} | {re} "
            f"| {follows:.0f} "
            f"| {' / '.join(f'{_share(r, b_reqs, n):.2f}' for n in names)} "
            f"| {' / '.join(f'{_share(r, a_reqs, n):.2f}' for n in names)} |"
        )
    table = "\n".join(lines)
    print(table)
    image = ROOT / "docs" / "bench" / "capacity-shift-envoy.png"
    plot(runs[1], image)  # load-balance, a token an event
    sent = sum(len(r.results) for r in runs)
    write_section(
        ROOT / "docs" / "benchmarks.md",
        "capacity-shift-envoy",
        "## Capacity shift through Envoy\n\n"
        "Generated by `python benchmarks/capacity_shift.py` (about 18 minutes): the demo's stack"
        " (mock engines a100, l20, v100 at the demo's time scale, the plugin, Envoy) under"
        f" Poisson load at {LOAD:g} of the fleet's saturated output rate"
        f" ({runs[0].rate:.1f} req/s), one fresh stack per strategy and engine streaming"
        " (each token its own SSE event, as an engine streams without a stream interval; eight"
        " tokens an event,"
        f" the demo's default); after {WARMUP_S:g} s of"
        f" warm-up and {STEADY_S:g} s measured, the a100 and the v100 exchange step costs"
        " (`PUT /mock/step-costs`). load-balance learns from the engines' token counters, with"
        " the scrape and chunk-gap watches (the demo counts in `observe` mode). Re-rank:"
        " seconds after the swap from which the plugin's estimate of"
        " the new fast replica stays above the new slow one's (`/debug/pods`, read each"
        " second). Traffic follows: seconds after the swap to the first of five 2 s bins in a"
        " row in each of which the new fast replica was sent more requests than the new slow"
        " one. Windows: before counts requests that arrived in the"
        f" {STEADY_S:g} s before the swap and finished before it; during, those running at the"
        f" swap or arriving in the {DURING_S:g} s after it (and apart, those of them running at"
        " the swap, placed before the change, and those that arrived after it, placed after);"
        " after, those arriving later."
        f" {sent} requests, {failed} failed.\n\n"
        + table
        + "\n\n![capacity estimates around the swap, load-balance, a token an event]"
        "(bench/capacity-shift-envoy.png)\n",
    )
    print("wrote docs/benchmarks.md", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
