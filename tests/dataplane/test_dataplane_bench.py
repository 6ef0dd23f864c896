"""`hetero-gateway bench --quick` end to end: a real Envoy, the plugin and mock engines, every
variant measured; the command exits 0 and writes well-formed JSON, Markdown and plots.

The figures themselves are a benchmark (docs/bench/); no timing is asserted here. The parts that
need no Envoy are in tests/component/test_bench_command.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.helpers import run_cli

pytestmark = pytest.mark.dataplane

# Spelled out (not imported) so a renamed variant or key fails here.
VARIANTS = ["direct", "headers", "buffered", "observe", "streamed"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow(
    reason="the bench command's quick run: Envoy alone and with the plugin, each for a few seconds"
)
def test_bench_quick_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    run_cli("bench", "--quick", "--no-progress", "--out-dir", str(out), timeout_s=300)

    text = (out / "bench.json").read_text(encoding="utf-8")
    assert str(tmp_path) not in text  # no path of this machine in the outputs
    doc = orjson.loads(text)
    assert "failed" not in doc
    assert doc["command"] == "hetero-gateway bench --quick"
    assert {"cpus", "loadavg_start", "loadavg_end", "envoy"} <= set(doc["machine"])
    assert list(doc["variants"]) == VARIANTS

    overhead = doc["overhead"]["variants"]
    assert list(overhead) == VARIANTS
    for name, row in overhead.items():
        assert row["latency_errors"] == 0 and row["throughput_errors"] == 0, name
        assert row["latency_requests"] > 0 and row["throughput_requests"] > 0, name
        for key in (
            "requests_per_s",
            "latency_p50_ms",
            "latency_p99_ms",
            "envoy_cpu_ms_per_request",
        ):
            assert _finite(row[key]) and row[key] > 0, (name, key)
        for key in ("rps_ratio", "p50_ratio", "p99_ratio", "envoy_cpu_ratio"):
            assert _finite(row[key]) and row[key] > 0, (name, key)
        for key in ("added_p50_ms", "added_p99_ms"):
            assert _finite(row[key]), (name, key)
        assert _finite(row["plugin_cpu_ms_per_request"]) and row["plugin_cpu_ms_per_request"] >= 0
        assert _finite(row["plugin_cpu_ratio"]) and row["plugin_cpu_ratio"] >= 0
    assert overhead["direct"]["rps_ratio"] == overhead["direct"]["p50_ratio"] == 1.0

    streaming = doc["streaming"]
    tokens = streaming["stack"]["max_tokens"]
    assert list(streaming["by_concurrency"]) == ["1"]
    rows = streaming["by_concurrency"]["1"]["variants"]
    assert list(rows) == VARIANTS
    for name, row in rows.items():
        assert row["errors"] == 0, name
        assert row["chunks_per_response"] == tokens + 1, name  # one event per token, and usage
        assert len(row["median_arrivals_ms"]) == tokens + 1
        for key in ("chunk_delay_ms", "first_chunk_delay_ms", "last_chunk_delay_ms"):
            assert _finite(row[key]), (name, key)
        for key in ("chunk_arrival_ratio", "gap_p50_ratio", "gap_p99_ratio"):
            assert _finite(row[key]) and row[key] > 0, (name, key)
        has_response_path = name in ("observe", "streamed")
        assert _finite(row["response_path_delay_ms"]) is has_response_path, name

    routing = doc["routing"]["strategies"]
    assert list(routing) == ["least-request", "load-balance"]
    for strategy, block in routing.items():
        assert block["fleet"]["errors"] == 0 and block["fleet"]["requests"] > 0, strategy
        replicas = block["replicas"]
        assert list(replicas) == ["a100-0", "l20-0", "v100-0"]
        for key in ("request_share", "token_share", "capacity_share"):
            assert sum(r[key] for r in replicas.values()) == pytest.approx(1.0, abs=1e-9), key
        for r in replicas.values():
            assert _finite(r["utilization"]) and r["utilization"] >= 0
        assert 0 <= block["share_distance"] <= 1

    md = (out / "bench.md").read_text(encoding="utf-8")
    for heading in ("## (a) Overhead", "## (b) Streaming", "## (c) Routing quality"):
        assert heading in md
    for name in VARIANTS:
        assert md.count(f"| {name} |") == 3, name  # variants, overhead and streaming tables
    for replica in ("a100-0", "l20-0", "v100-0"):
        assert md.count(f"| {replica} |") == 2, replica  # one table per strategy
    assert "| least-request |" in md and "| load-balance |" in md

    for name in ("bench-overhead.png", "bench-streaming.png", "bench-utilisation.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert f"]({name})" in md
