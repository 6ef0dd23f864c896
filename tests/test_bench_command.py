"""`hetero-gateway bench`: the command runs on a tiny configuration and writes well-formed output.

The figures themselves are a benchmark (docs/bench/); no timing is asserted anywhere here. First
come checks that need no Envoy: the benchmark's bootstraps and its arithmetic on hand-built
timings; then one data-plane run of `bench --quick`.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from plugin.adapters import envoy_config as ec
from plugin.adapters.envoy_config import BenchLayout, EnvoyOptions, render_bootstrap
from plugin.errors import ConfigError
from plugin_tools.bench import cli as bench_cli
from plugin_tools.bench.client import Batch, Timing, run_interleaved
from plugin_tools.bench.options import BenchOptions
from plugin_tools.bench.stats import CpuTotals, overhead_summary, routing_summary, streaming_summary
from plugin_tools.demo.fleet import free_port

# Spelled out (not imported) so a renamed variant or key fails here.
VARIANTS = ["direct", "headers", "buffered", "observe", "streamed"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
UPSTREAM = ("127.0.0.1", 9000)


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    listener = boot["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _filters(boot: dict[str, Any]) -> list[str]:
    return [f["name"] for f in _hcm(boot)["http_filters"]]


def _clusters(boot: dict[str, Any]) -> list[str]:
    return [c["name"] for c in boot["static_resources"]["clusters"]]


def _route_cluster(boot: dict[str, Any]) -> str:
    cluster: str = _hcm(boot)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"]
    return cluster


# --- the benchmark's bootstraps ------------------------------------------------------------------


def test_default_layout_is_the_product_bootstrap() -> None:
    assert render_bootstrap(EnvoyOptions(), BenchLayout()) == render_bootstrap(EnvoyOptions())


def test_direct_layout_is_envoy_alone_to_one_endpoint() -> None:
    boot = render_bootstrap(EnvoyOptions(), BenchLayout(plugin=False, upstream=UPSTREAM))
    assert _filters(boot) == ["envoy.filters.http.router"]
    assert _clusters(boot) == [ec.BENCH_UPSTREAM_CLUSTER]
    assert _route_cluster(boot) == ec.BENCH_UPSTREAM_CLUSTER
    (cluster,) = boot["static_resources"]["clusters"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9000}


@pytest.mark.parametrize(
    ("layout", "count_mode", "filters", "request_body", "response_body", "cluster"),
    [
        (
            BenchLayout(request_body=False, count=False, upstream=UPSTREAM),
            "observe",
            ["envoy.filters.http.ext_proc", "envoy.filters.http.router"],
            "NONE",
            "NONE",
            ec.BENCH_UPSTREAM_CLUSTER,
        ),
        (
            BenchLayout(count=False),
            "observe",
            ["envoy.filters.http.ext_proc", "envoy.filters.http.router"],
            "BUFFERED",
            "NONE",
            ec.ORIGINAL_DST_CLUSTER,
        ),
        (
            BenchLayout(count=False),
            "streamed",
            ["envoy.filters.http.ext_proc", "envoy.filters.http.router"],
            "BUFFERED",
            "NONE",
            ec.ORIGINAL_DST_CLUSTER,
        ),
    ],
    ids=["headers-only", "buffered-no-count", "no-count-beats-streamed"],
)
def test_plugin_layouts(
    layout: BenchLayout,
    count_mode: str,
    filters: list[str],
    request_body: str,
    response_body: str,
    cluster: str,
) -> None:
    boot = render_bootstrap(EnvoyOptions(count_mode=count_mode), layout)
    assert _filters(boot) == filters
    mode = _hcm(boot)["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == request_body
    assert mode["response_body_mode"] == response_body
    assert _route_cluster(boot) == cluster
    assert ec.EXT_PROC_CLUSTER in _clusters(boot)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"plugin": False},
        {"request_body": False},
        {"plugin": False, "upstream": ("localhost", 9000)},
        {"plugin": False, "upstream": ("127.0.0.1", 0)},
    ],
    ids=["direct-needs-upstream", "headers-only-needs-upstream", "upstream-not-ip", "port-0"],
)
def test_bad_layouts_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BenchLayout(**kwargs)


# --- arithmetic ----------------------------------------------------------------------------------


def _ok(latency_ms: float, chunks_ms: tuple[float, ...] = ()) -> Timing:
    return Timing(200, latency_ms / 1000, tuple(c / 1000 for c in chunks_ms))


def test_overhead_is_reported_against_direct() -> None:
    latency = {
        "direct": [_ok(10.0), _ok(10.0), _ok(20.0)],
        "buffered": [_ok(12.0), _ok(12.0), _ok(30.0), Timing(503, None, error="HTTP 503")],
    }
    direct, buffered = CpuTotals(), CpuTotals()
    direct.add(Batch([_ok(1.0)] * 100, elapsed_s=0.5), plugin_cpu_s=0.0, envoy_cpu_s=0.05)
    buffered.add(Batch([_ok(1.0)] * 50, elapsed_s=0.5), plugin_cpu_s=0.05, envoy_cpu_s=0.05)
    rows = overhead_summary(latency, {"direct": direct, "buffered": buffered})
    assert list(rows) == ["direct", "buffered"]
    d, b = rows["direct"], rows["buffered"]
    assert d["p50_ratio"] == d["rps_ratio"] == d["envoy_cpu_ratio"] == 1.0
    assert b["latency_errors"] == 1
    assert b["added_p50_ms"] == pytest.approx(2.0)
    assert b["p50_ratio"] == pytest.approx(1.2)
    assert b["p99_ratio"] == pytest.approx(1.5)
    assert b["requests_per_s"] == pytest.approx(100.0)
    assert b["rps_ratio"] == pytest.approx(0.5)
    assert b["plugin_cpu_ms_per_request"] == pytest.approx(1.0)
    assert b["plugin_cpu_ratio"] == pytest.approx(2.0)  # over direct's Envoy CPU per request
    assert b["envoy_cpu_ratio"] == pytest.approx(2.0)


def test_missing_cpu_gives_no_ratio() -> None:
    totals = CpuTotals()
    totals.add(Batch([_ok(1.0)], elapsed_s=1.0), plugin_cpu_s=None, envoy_cpu_s=0.001)
    rows = overhead_summary({}, {"direct": totals})
    assert rows["direct"]["plugin_cpu_ms_per_request"] is None
    assert rows["direct"]["gateway_cpu_ratio"] is None


def test_streaming_delay_per_chunk_and_response_path() -> None:
    timings = {
        "direct": [_ok(5, (1, 2, 3)), _ok(5, (1, 2, 3))],
        "buffered": [_ok(6, (2, 3, 4)), _ok(6, (2, 3, 4))],
        "streamed": [_ok(7, (2.5, 3.5, 5.5)), _ok(7, (2.5, 3.5, 5.5)), _ok(1, (1,))],
    }
    rows = streaming_summary(timings)
    assert rows["buffered"]["chunk_delay_ms"] == pytest.approx(1.0)
    assert rows["buffered"]["response_path_delay_ms"] is None
    streamed = rows["streamed"]
    assert streamed["chunks_per_response"] == 3
    assert streamed["irregular_responses"] == 1  # the cut stream is left out, and counted
    assert streamed["first_chunk_delay_ms"] == pytest.approx(1.5)
    assert streamed["last_chunk_delay_ms"] == pytest.approx(2.5)
    assert streamed["chunk_delay_ms"] == pytest.approx(11 / 6)
    assert streamed["response_path_delay_ms"] == pytest.approx(11 / 6 - 1)
    assert streamed["chunk_arrival_ratio"] == pytest.approx(11.5 / 6)
    assert streamed["gap_p99_ratio"] == pytest.approx(2.0)


def _replica(requests: int, capacity_share: float, tokens_per_s: float) -> dict[str, Any]:
    return {
        "requests": requests,
        "request_share": 0.0,
        "capacity_share": capacity_share,
        "output_tokens_per_s": tokens_per_s,
        "utilization": 0.5,
        "tpot_p50_ms": 10.0 * capacity_share,
        "tpot_p99_ms": None,
        "p50_ms": None,
        "p99_ms": None,
        "errors": 0,
    }


def test_routing_token_shares_and_distance() -> None:
    summary = {
        "fleet": {"requests": 4},
        "replicas": {"fast": _replica(3, 0.75, 300.0), "slow": _replica(1, 0.25, 300.0)},
    }
    block = routing_summary({"load-balance": summary})["load-balance"]
    assert block["replicas"]["fast"]["token_share"] == pytest.approx(0.5)
    assert block["share_distance"] == pytest.approx(0.25)
    assert block["tpot_p50_spread"] == pytest.approx(3.0)
    assert "errors" not in block["replicas"]["fast"]  # exactly the demo's replica keys + share


# --- client --------------------------------------------------------------------------------------


async def test_interleaved_runs_take_turns_and_time_every_event() -> None:
    hits: list[str] = []

    async def sse(request: web.Request) -> web.StreamResponse:
        hits.append(request.match_info["name"])
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for event in (b"{}", b'{"usage": {}}', b"[DONE]"):
            await resp.write(b"data: " + event + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/{name}", sse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        urls = {name: f"http://127.0.0.1:{port}/{name}" for name in ("a", "b")}
        timings = await run_interleaved(
            urls, b"{}", requests_per_url=3, max_seconds=30, record_chunks=True
        )
    finally:
        await runner.cleanup()
    assert hits == ["a", "b", "b", "a", "a", "b"]  # each round starts one further along
    for name in urls:
        assert len(timings[name]) == 3
        for t in timings[name]:
            assert t.ok and t.latency_s is not None
            assert len(t.chunks) == 2 and 0 < t.chunks[0] <= t.chunks[1] <= t.latency_s


# --- command line --------------------------------------------------------------------------------


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetero-gateway")
    bench_cli.register_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_quick_values_yield_to_explicit_flags() -> None:
    opts = bench_cli.options_from_args(_args(["--quick", "--requests", "7", "--parts", "routing"]))
    assert opts.requests == 7 and opts.parts == ("routing",)
    assert opts.rounds == bench_cli.QUICK["rounds"]
    assert bench_cli.options_from_args(_args([])) == BenchOptions()


def test_recorded_command_names_the_flags_but_no_absolute_path(tmp_path: Path) -> None:
    args = _args(["--stream-concurrency", "1,4", "--seed", "3", "--out-dir", str(tmp_path)])
    assert bench_cli.command_line(args) == (
        "hetero-gateway bench --stream-concurrency 1,4 --seed 3"
    )
    assert bench_cli.command_line(_args(["--out-dir", "out"])) == (
        "hetero-gateway bench --out-dir out"
    )


@pytest.mark.parametrize(
    "argv",
    [["--parts", "overhead,nope"], ["--requests", "0"], ["--routing-load", "3"]],
    ids=["unknown-part", "no-requests", "load-over-2"],
)
def test_bad_options_fail_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        bench_cli.options_from_args(_args(argv)).check()


# --- the command, end to end ---------------------------------------------------------------------


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.dataplane
def test_bench_quick_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plugin",
            "bench",
            "--quick",
            "--no-progress",
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

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
