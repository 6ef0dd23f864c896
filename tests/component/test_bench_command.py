"""`hetero-gateway bench` without Envoy: the benchmark's bootstraps, its arithmetic on hand-built
timings, its interleaved client against a loopback server, and its command line.

The figures themselves are a benchmark (docs/bench/); no timing is asserted anywhere here. The
run of `bench --quick` through a real Envoy is in tests/dataplane/test_dataplane_bench.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from plugin.adapters import envoy_config as ec
from plugin.adapters.envoy_config import EnvoyOptions, render_bootstrap
from plugin.errors import ConfigError
from plugin_tools.bench import cli as bench_cli
from plugin_tools.bench.client import Batch, Timing, run_interleaved
from plugin_tools.bench.options import BenchOptions
from plugin_tools.bench.stats import CpuTotals, overhead_summary, routing_summary, streaming_summary
from plugin_tools.demo.envoy_layout import BENCH_UPSTREAM_CLUSTER, BenchLayout, bench_bootstrap
from tests.helpers import ServeApp, bootstrap_hcm, routing_filter

pytestmark = pytest.mark.component

UPSTREAM = ("127.0.0.1", 9000)


def _filters(boot: dict[str, Any]) -> list[str]:
    return [f["name"] for f in bootstrap_hcm(boot)["http_filters"]]


def _clusters(boot: dict[str, Any]) -> list[str]:
    return [c["name"] for c in boot["static_resources"]["clusters"]]


def _route_cluster(boot: dict[str, Any]) -> str:
    cluster: str = bootstrap_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"][0]["route"][
        "cluster"
    ]
    return cluster


# --- the benchmark's bootstraps ------------------------------------------------------------------


def test_default_layout_is_the_product_bootstrap() -> None:
    assert bench_bootstrap(EnvoyOptions(), BenchLayout()) == render_bootstrap(EnvoyOptions())


def test_direct_layout_is_envoy_alone_to_one_endpoint() -> None:
    boot = bench_bootstrap(EnvoyOptions(), BenchLayout(plugin=False, upstream=UPSTREAM))
    assert _filters(boot) == ["envoy.filters.http.router"]
    assert _clusters(boot) == [BENCH_UPSTREAM_CLUSTER]
    assert _route_cluster(boot) == BENCH_UPSTREAM_CLUSTER
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
            BENCH_UPSTREAM_CLUSTER,
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
    boot = bench_bootstrap(EnvoyOptions(count_mode=count_mode), layout)
    assert _filters(boot) == filters
    mode = routing_filter(boot)["processing_mode"]
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


async def test_interleaved_runs_take_turns_and_time_every_event(serve_app: ServeApp) -> None:
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
    port = await serve_app(app)
    urls = {name: f"http://127.0.0.1:{port}/{name}" for name in ("a", "b")}
    timings = await run_interleaved(
        urls, b"{}", requests_per_url=3, max_seconds=30, record_chunks=True
    )
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
