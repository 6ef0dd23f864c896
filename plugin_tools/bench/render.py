"""The benchmark's outputs: `bench.json` (every figure), `bench.md` (tables) and PNG plots.

Plots use matplotlib's object API (`Figure`, Agg) rather than pyplot, so nothing global changes
and no display is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

__all__ = ["JSON_NAME", "MD_NAME", "PLOT_NAMES", "markdown", "write_outputs"]

JSON_NAME = "bench.json"
MD_NAME = "bench.md"
PLOT_NAMES = {
    "overhead": "bench-overhead.png",
    "streaming": "bench-streaming.png",
    "routing": "bench-utilisation.png",
}


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def _signed(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):+.{digits}f}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100.0 * float(value):.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _overhead_md(part: Mapping[str, Any], variants: Mapping[str, str]) -> list[str]:
    stack = part["stack"]
    lines = [
        "## (a) Overhead",
        "",
        f"Every request is a streamed chat completion ({stack['prompt_words']}-word prompt, "
        f"{stack['max_tokens']} output tokens, {stack['tokens_per_chunk']} token per SSE event, "
        f"usage requested) served by one `{stack['preset']}` mock engine at time scale "
        f"{stack['time_scale']:g}. Latency: {part['latency_requests_per_variant']} requests per "
        f"variant at concurrency {part['latency_concurrency']}, the variants taking turns "
        "request by request. Throughput: concurrency "
        f"{part['throughput_concurrency']} for {part['throughput_seconds_per_variant']:g} s per "
        f"variant, in {part['rounds']} interleaved rounds. CPU: user + system time of the "
        "plugin process and of the variant's Envoy, from "
        "/proc, over the throughput runs, per request sent. `x direct` is the figure over "
        "direct's; the plugin's CPU is divided by what Envoy alone spent per request. The client, "
        "the engine, Envoy and the plugin share the same cores, so requests/s is the whole "
        "machine's and the CPU per request is the steadier cost figure.",
        "",
    ]
    rows = []
    for name in variants:
        r = part["variants"].get(name)
        if r is None:
            continue
        rows.append(
            [
                name,
                _num(r["requests_per_s"], 0),
                _num(r["rps_ratio"]),
                _num(r["latency_p50_ms"]),
                _signed(r["added_p50_ms"]),
                _num(r["p50_ratio"]),
                _num(r["latency_p99_ms"]),
                _signed(r["added_p99_ms"]),
                _num(r["p99_ratio"]),
                _num(r["plugin_cpu_ms_per_request"], 3),
                _num(r["plugin_cpu_ratio"]),
                _num(r["envoy_cpu_ms_per_request"], 3),
                _num(r["envoy_cpu_ratio"]),
                str(r["latency_errors"] + r["throughput_errors"]),
            ]
        )
    header = [
        "variant",
        "req/s",
        "x direct",
        "p50 ms",
        "added",
        "x direct",
        "p99 ms",
        "added",
        "x direct",
        "plugin CPU ms/req",
        "x direct Envoy CPU",
        "Envoy CPU ms/req",
        "x direct",
        "errors",
    ]
    return [*lines, *_table(header, rows), ""]


def _streaming_md(part: Mapping[str, Any], variants: Mapping[str, str]) -> list[str]:
    stack = part["stack"]
    lines = [
        "## (b) Streaming",
        "",
        f"Every request is a streamed chat completion of {stack['max_tokens']} output tokens, "
        f"{stack['tokens_per_chunk']} token per SSE event, from one `{stack['preset']}` mock "
        f"engine at time scale {stack['time_scale']:g} (tokens paced a few ms apart, so each "
        f"travels as its own chunk); {part['requests_per_variant']} requests per variant and "
        "concurrency. At concurrency 1 the variants take turns request by request; above it each "
        f"variant carries the load alone, in {part['rounds']} interleaved rounds. The client "
        "times every SSE event from the moment its request left. "
        "`chunk delay`: the median arrival of chunk k minus direct's, averaged over the chunks "
        "(the request path shifts every chunk too). `response path`: the chunk delay minus "
        "`buffered`'s, which routes alike but does not process the response body: what "
        "streaming the response through the plugin adds to each chunk. `gap`: the interval "
        "between consecutive chunks (jitter).",
        "",
    ]
    header = [
        "variant",
        "chunk delay ms",
        "first chunk",
        "last chunk",
        "response path ms",
        "arrival x direct",
        "gap p50 ms",
        "x direct",
        "gap p99 ms",
        "x direct",
        "errors",
    ]
    for concurrency, block in part["by_concurrency"].items():
        rows = []
        for name in variants:
            r = block["variants"].get(name)
            if r is None:
                continue
            rows.append(
                [
                    name,
                    _signed(r["chunk_delay_ms"]),
                    _signed(r["first_chunk_delay_ms"]),
                    _signed(r["last_chunk_delay_ms"]),
                    _signed(r["response_path_delay_ms"]),
                    _num(r["chunk_arrival_ratio"]),
                    _num(r["gap_p50_ms"]),
                    _num(r["gap_p50_ratio"]),
                    _num(r["gap_p99_ms"]),
                    _num(r["gap_p99_ratio"]),
                    str(r["errors"]),
                ]
            )
        lines += [f"### Concurrency {concurrency}", "", *_table(header, rows), ""]
    return lines


def _routing_md(part: Mapping[str, Any]) -> list[str]:
    cfg = part["config"]
    lines = [
        "## (c) Routing quality",
        "",
        f"The `up` demo's comparison on the fleet {', '.join(cfg['fleet'])} (mock engines at time "
        f"scale {cfg['time_scale']:g}, {cfg['tokens_per_chunk']} tokens per SSE chunk): the same "
        f"seeded open-loop load at {cfg['load']:.0%} of the fleet's saturated output rate with "
        f"each strategy in turn, {cfg['warmup_s']:g} s warm-up then "
        f"{cfg['seconds_per_strategy']:g} s measured. `token share`: the replica's share of "
        "the output tokens delivered, to compare with `capacity share` (its share of the "
        "fleet's saturated output tokens/s). "
        "`utilisation`: delivered over saturated output tokens/s. `share distance`: half the sum "
        "of |token share - capacity share|. `TPOT spread`: slowest replica's p50 time per output "
        "token over the fastest's.",
        "",
    ]
    header = [
        "replica",
        "requests",
        "request share",
        "token share",
        "capacity share",
        "utilisation",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "latency p99 ms",
    ]
    for strategy, block in part["strategies"].items():
        rows = [
            [
                name,
                str(r["requests"]),
                _pct(r["request_share"]),
                _pct(r["token_share"]),
                _pct(r["capacity_share"]),
                _pct(r["utilization"]),
                _num(r["tpot_p50_ms"], 1),
                _num(r["tpot_p99_ms"], 1),
                _num(r["p99_ms"], 0),
            ]
            for name, r in block["replicas"].items()
        ]
        fleet = block["fleet"]
        rows.append(
            [
                "fleet",
                str(fleet["requests"]),
                "",
                "",
                "",
                _pct(fleet["utilization"]),
                _num(fleet["tpot_p50_ms"], 1),
                _num(fleet["tpot_p99_ms"], 1),
                _num(fleet["latency_p99_ms"], 0),
            ]
        )
        lines += [f"### {strategy}", "", *_table(header, rows), ""]
    header = [
        "strategy",
        "requests",
        "errors",
        "share distance",
        "TPOT spread",
        "fleet TPOT p50 ms",
        "fleet TPOT p99 ms",
        "fleet latency p99 ms",
    ]
    rows = [
        [
            strategy,
            str(b["fleet"]["requests"]),
            str(b["fleet"]["errors"]),
            _num(b["share_distance"], 3),
            _num(b["tpot_p50_spread"]),
            _num(b["fleet"]["tpot_p50_ms"], 1),
            _num(b["fleet"]["tpot_p99_ms"], 1),
            _num(b["fleet"]["latency_p99_ms"], 0),
        ]
        for strategy, b in part["strategies"].items()
    ]
    lines += ["### Strategies side by side", "", *_table(header, rows), ""]
    return lines


def markdown(doc: Mapping[str, Any], command: str) -> str:
    """The tables of `doc`, with the command and the conditions they were measured under."""
    machine = doc["machine"]
    variants: Mapping[str, str] = doc["variants"]
    start = ", ".join(f"{x:.2f}" for x in machine["loadavg_start"])
    end = ", ".join(f"{x:.2f}" for x in machine["loadavg_end"])
    lines = [
        "# End-to-end benchmark",
        "",
        f"Generated by `{command}`: Envoy {machine.get('envoy') or '(version unknown)'}, the "
        "plugin and mock engines as separate processes on loopback, load from the command's own "
        f"Python process on the same {machine['cpus']} CPUs (load average {start} at the start, "
        f"{end} at the end). Overhead and streaming figures are compared with `direct` (Envoy "
        "alone) from the same command, the variants interleaved in rounds; compare ratios, not "
        "absolute times, across runs. Every figure is in `bench.json`; times are milliseconds "
        "and percentiles nearest-rank.",
        "",
    ]
    for part, error in doc.get("failed", {}).items():
        lines += [f"**The {part} part failed** and has no figures here: `{error}`", ""]
    if "overhead" in doc or "streaming" in doc:
        lines += ["## Variants", ""]
        lines += _table(["variant", "what Envoy and the plugin do"], list(variants.items()))
        lines.append("")
    if "overhead" in doc:
        lines += _overhead_md(doc["overhead"], variants)
        lines += [f"![overhead]({PLOT_NAMES['overhead']})", ""]
    if "streaming" in doc:
        lines += _streaming_md(doc["streaming"], variants)
        lines += [f"![streaming]({PLOT_NAMES['streaming']})", ""]
    if "routing" in doc:
        lines += _routing_md(doc["routing"])
        lines += [f"![utilisation]({PLOT_NAMES['routing']})", ""]
    return "\n".join(lines)


# --- plots ---------------------------------------------------------------------------------------


def _bars(
    ax: Any,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    colors: Mapping[str, str] | None = None,
) -> None:
    """Grouped bars: one group per label in `groups`, one bar per series."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label, color=(colors or {}).get(label))
    ax.set_xticks(range(len(groups)), list(groups))


def _zero(value: Any) -> float:
    return 0.0 if value is None else float(value)


def _plot_overhead(part: Mapping[str, Any], variants: Sequence[str], path: Path) -> None:
    from matplotlib.figure import Figure

    rows = part["variants"]
    names = [v for v in variants if v in rows]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    _bars(
        left,
        names,
        {
            "requests/s": [_zero(rows[n]["rps_ratio"]) for n in names],
            "p50 latency": [_zero(rows[n]["p50_ratio"]) for n in names],
            "p99 latency": [_zero(rows[n]["p99_ratio"]) for n in names],
        },
    )
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("x direct (Envoy alone)")
    left.set_title("Throughput and latency against Envoy alone")
    left.legend()
    envoy = [_zero(rows[n]["envoy_cpu_ms_per_request"]) for n in names]
    plugin = [_zero(rows[n]["plugin_cpu_ms_per_request"]) for n in names]
    right.bar(names, envoy, label="Envoy")
    right.bar(names, plugin, bottom=envoy, label="plugin")
    right.set_ylabel("CPU ms per request")
    right.set_title("CPU per request (user + system)")
    right.legend()
    fig.savefig(path, dpi=100)


def _plot_streaming(part: Mapping[str, Any], variants: Sequence[str], path: Path) -> None:
    from matplotlib.figure import Figure

    blocks = part["by_concurrency"]
    fig = Figure(figsize=(5.5 * len(blocks), 4.2), layout="constrained")
    axes = fig.subplots(1, len(blocks), squeeze=False)[0]
    for ax, (concurrency, block) in zip(axes, blocks.items(), strict=True):
        rows = block["variants"]
        base = rows.get("direct", {}).get("median_arrivals_ms") or []
        for name in variants:
            arrivals = rows.get(name, {}).get("median_arrivals_ms") or []
            if name == "direct" or not arrivals or len(arrivals) != len(base):
                continue
            ax.plot(
                range(1, len(arrivals) + 1),
                [a - b for a, b in zip(arrivals, base, strict=True)],
                marker=".",
                label=name,
            )
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("SSE chunk (the last carries usage)")
        ax.set_ylabel("median arrival - direct's, ms")
        ax.set_title(f"Added delay per chunk, concurrency {concurrency}")
        ax.legend()
    fig.savefig(path, dpi=100)


def _plot_routing(part: Mapping[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    strategies: Mapping[str, Any] = part["strategies"]
    first: Mapping[str, Any] = next(iter(strategies.values()), {"replicas": {}})
    replicas = list(first["replicas"])
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    # One colour per strategy in both panels; capacity in grey.
    colors = {"capacity share": "0.6"}
    for i, strategy in enumerate(strategies):
        colors[strategy] = colors[f"{strategy} token share"] = f"C{i}"
    shares: dict[str, list[float]] = {
        "capacity share": [_zero(first["replicas"][r]["capacity_share"]) for r in replicas]
    }
    for strategy, block in strategies.items():
        shares[f"{strategy} token share"] = [
            _zero(block["replicas"].get(r, {}).get("token_share")) for r in replicas
        ]
    _bars(left, replicas, shares, colors)
    left.set_ylabel("share of output tokens/s")
    left.set_title("Share per replica vs capacity share")
    left.legend()
    _bars(
        right,
        replicas,
        {
            strategy: [_zero(block["replicas"].get(r, {}).get("utilization")) for r in replicas]
            for strategy, block in strategies.items()
        },
        colors,
    )
    right.axhline(part["config"]["load"], color="black", linewidth=0.8, linestyle="--")
    right.set_ylabel("delivered / saturated output tokens/s")
    right.set_title("Utilisation per replica (dashed: offered load)")
    right.legend()
    fig.savefig(path, dpi=100)


def write_outputs(doc: Mapping[str, Any], out_dir: Path, command: str) -> list[Path]:
    """Write the JSON, the Markdown and one PNG per measured part; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / JSON_NAME, out_dir / MD_NAME]
    written[0].write_bytes(
        orjson.dumps({"command": command, **doc}, option=orjson.OPT_INDENT_2) + b"\n"
    )
    written[1].write_text(markdown(doc, command), encoding="utf-8")
    variants = list(doc["variants"])
    if "overhead" in doc:
        written.append(out_dir / PLOT_NAMES["overhead"])
        _plot_overhead(doc["overhead"], variants, written[-1])
    if "streaming" in doc:
        written.append(out_dir / PLOT_NAMES["streaming"])
        _plot_streaming(doc["streaming"], variants, written[-1])
    if "routing" in doc:
        written.append(out_dir / PLOT_NAMES["routing"])
        _plot_routing(doc["routing"], written[-1])
    return written
