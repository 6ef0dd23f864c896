"""What each inference engine speaks, one row per engine: the names of the metrics the scraper
reads, where its metrics page is, and the flag that sets its batch cap.

A new engine is one row here plus its test (`tests/component/test_scraper.py` parses a real page
of it); the scraper, discovery (the metrics path) and the Kubernetes source (the batch-cap flag)
read this table, and `docs/engines.md` is rendered from it (`python -m plugin.adapters.engines
--write docs/engines.md`; a test fails while it differs). Where engines share a field, the
scraper takes the first name found in table order: vLLM (newer name first), SGLang,
TensorRT-LLM (`trtllm-serve`, tensorrt_llm/metrics/collector.py), xLLM (common/metrics.cpp:
no prefix).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = [
    "ENGINES",
    "EngineDialect",
    "batch_cap_flags",
    "default_metrics_path",
    "metric_names",
    "render_markdown",
    "stepwise_counters",
]


@dataclass(frozen=True, slots=True)
class EngineDialect:
    """One engine; each metric field lists its sample names, preferred first."""

    name: str  # AIBrix's `model.aibrix.ai/engine` value
    title: str
    metrics_path: str = "/metrics"  # where it serves its Prometheus page
    batch_cap_flags: tuple[str, ...] = ()  # its command-line flag(s) for the batch cap
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()  # fractions 0..1
    cpu_kv_usage: tuple[str, ...] = ()  # KV offloaded to CPU, 0..1
    # Cumulative output tokens it generated: exact, and costs nothing per token to read.
    generation_tokens: tuple[str, ...] = ()
    # The counter grows per engine step (vLLM's), not as requests finish (SGLang's): only then
    # does one scrape interval's increase tell the replica's speed (`SpeedWatch`).
    generation_stepwise: bool = False
    max_batch: tuple[str, ...] = ()  # the batch cap it exports (0: not reported yet)
    # Histogram (sum, count) pairs: request queue time, and inter-token latency.
    queue_time: tuple[tuple[str, str], ...] = ()
    token_latency: tuple[tuple[str, str], ...] = ()


ENGINES: tuple[EngineDialect, ...] = (
    EngineDialect(
        "vllm",
        "vLLM",
        batch_cap_flags=("--max-num-seqs",),
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        cpu_kv_usage=("vllm:cpu_cache_usage_perc",),
        generation_tokens=("vllm:generation_tokens_total",),
        generation_stepwise=True,
        queue_time=(
            ("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"),
        ),
        token_latency=(
            ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"),
            (
                "vllm:time_per_output_token_seconds_sum",
                "vllm:time_per_output_token_seconds_count",
            ),
        ),
    ),
    EngineDialect(
        "sglang",
        "SGLang",
        batch_cap_flags=("--max-running-requests",),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        generation_tokens=("sglang:generation_tokens_total",),
    ),
    EngineDialect(
        "trtllm",
        "TensorRT-LLM",
        metrics_path="/prometheus/metrics",
        running=("trtllm_num_requests_running",),
        waiting=("trtllm_num_requests_waiting",),
        kv_usage=("trtllm_kv_cache_utilization",),
        generation_tokens=("trtllm_generation_tokens_total",),
        max_batch=("trtllm_max_num_active_requests", "trtllm_max_batch_size_static"),
        queue_time=(
            ("trtllm_request_queue_time_seconds_sum", "trtllm_request_queue_time_seconds_count"),
        ),
        token_latency=(
            (
                "trtllm_time_per_output_token_seconds_sum",
                "trtllm_time_per_output_token_seconds_count",
            ),
        ),
    ),
    EngineDialect(
        "xllm",
        "xLLM",
        running=("num_running_requests",),
        waiting=("num_waiting_requests",),
        # `kv_cache_utilization` is the older name AIBrix reads (pkg/metrics/metrics.go).
        kv_usage=("kv_cache_utilization_perc", "kv_cache_utilization"),
        generation_tokens=("num_generated_tokens_total", "num_processing_tokens_total_generated"),
    ),
)

_BY_NAME = {engine.name: engine for engine in ENGINES}


def metric_names(field: str) -> tuple[str, ...]:
    """Every engine's sample names for one metric field, in table order (first match wins)."""
    names: list[str] = []
    for engine in ENGINES:
        names.extend(getattr(engine, field))
    return tuple(names)


def histogram_pairs(field: str) -> tuple[tuple[str, str], ...]:
    """Every engine's (sum, count) names for one histogram field, in table order."""
    pairs: list[tuple[str, str]] = []
    for engine in ENGINES:
        pairs.extend(getattr(engine, field))
    return tuple(pairs)


def stepwise_counters() -> frozenset[str]:
    """Generated-token counters that grow per engine step."""
    return frozenset(
        name
        for engine in ENGINES
        if engine.generation_stepwise
        for name in engine.generation_tokens
    )


def batch_cap_flags() -> tuple[str, ...]:
    return tuple(flag for engine in ENGINES for flag in engine.batch_cap_flags)


def default_metrics_path(engine: str) -> str:
    """Where an engine serves its metrics when its pod does not say. Only a name in the table
    gets its own path; any other spelling is not guessed at (its pod sets the path)."""
    known = _BY_NAME.get(engine)
    return "/metrics" if known is None else known.metrics_path


_COLUMNS = {
    "metrics_path": "metrics page",
    "batch_cap_flags": "batch-cap flag",
    "running": "running",
    "waiting": "waiting",
    "kv_usage": "KV cache usage",
    "cpu_kv_usage": "CPU KV usage",
    "generation_tokens": "generated tokens",
    "max_batch": "exported batch cap",
    "queue_time": "queue time (sum, count)",
    "token_latency": "inter-token latency (sum, count)",
}


def _cell(value: object) -> str:
    if isinstance(value, tuple):
        parts = [" / ".join(v) if isinstance(v, tuple) else v for v in value]
        return "<br>".join(f"`{p}`" for p in parts) or "-"
    return f"`{value}`"


def render_markdown() -> str:
    """`docs/engines.md`: the table, one column per engine, rendered from `ENGINES`."""
    assert set(_COLUMNS) | {"name", "title", "generation_stepwise"} == {
        f.name for f in fields(EngineDialect)
    }
    head = "| | " + " | ".join(f"{e.title} (`{e.name}`)" for e in ENGINES) + " |"
    lines = [
        "# Engines the gateway reads",
        "",
        "Generated from `plugin/adapters/engines.py` by `python -m plugin.adapters.engines "
        "--write docs/engines.md`; do not edit. The name in each heading is the pod's "
        "`model.aibrix.ai/engine` value. Where engines share a field the scraper takes the first "
        "name found, left to right, top to bottom. A generated-token counter that grows per "
        "step (the speed watch reads it) is marked *stepwise*.",
        "",
        head,
        "|" + " --- |" * (len(ENGINES) + 1),
    ]
    for field, title in _COLUMNS.items():
        cells = []
        for engine in ENGINES:
            cell = _cell(getattr(engine, field))
            if field == "generation_tokens" and engine.generation_stepwise:
                cell += " (*stepwise*)"
            cells.append(cell)
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugin.adapters.engines")
    parser.add_argument("--write", metavar="PATH", help="write the table here (else stdout)")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.write is None:
        sys.stdout.write(text)
    else:
        Path(args.write).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
