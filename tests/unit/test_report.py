"""Demo statistics: hand-built results in, exact figures out."""

from __future__ import annotations

import math
import statistics
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugin_tools.demo.report import (
    REPLICA_KEYS,
    RequestResult,
    demo_json,
    format_table,
    summarize,
)
from plugin_tools.stats import interpolated_percentiles, percentile

pytestmark = pytest.mark.unit

SATURATED = {"a100": 300.0, "l20": 150.0, "v100": 50.0}


def ok(
    replica: str | None,
    at: float,
    *,
    ttft: float = 0.1,
    latency: float = 1.1,
    tokens: int = 11,
    lag: float = 0.0,
) -> RequestResult:
    return RequestResult(replica, 200, at, ttft, latency, tokens, send_lag_s=lag)


def failed(replica: str | None, at: float, status: int = 503) -> RequestResult:
    return RequestResult(replica, status, at, None, 0.01, 0, error=f"HTTP {status}")


# ---------------------------------------------------------------------------------------------
# RequestResult.tpot_s and percentile


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (ok("a", 0, ttft=0.1, latency=1.1, tokens=11), 0.1),
        (ok("a", 0, ttft=0.5, latency=0.7, tokens=2), 0.2),
        (ok("a", 0, tokens=1), None),
        (ok("a", 0, tokens=0), None),
        (RequestResult("a", 0, 0.0, 0.1, None, 5, error="cut"), None),
        (RequestResult("a", 200, 0.0, None, 1.0, 5), None),
    ],
    ids=["ten-gaps", "two-tokens", "one-token", "no-tokens", "no-latency", "no-ttft"],
)
def test_tpot(result: RequestResult, expected: float | None) -> None:
    if expected is None:
        assert result.tpot_s is None
    else:
        assert result.tpot_s == pytest.approx(expected)


@pytest.mark.parametrize(
    ("samples", "p", "expected"),
    [
        ([], 50, None),
        ([7.0], 99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),  # rank ceil(2.0) = 2
        ([4.0, 3.0, 2.0, 1.0], 50, 2.0),  # unsorted input
        ([1.0, 2.0, 3.0, 4.0, 5.0], 50, 3.0),
        ([float(i) for i in range(1, 101)], 99, 99.0),
        ([float(i) for i in range(1, 101)], 100, 100.0),
        ([float(i) for i in range(1, 11)], 99, 10.0),  # rank ceil(9.9) = 10
    ],
    ids=["empty", "single", "even", "unsorted", "odd", "p99-of-100", "p100", "p99-of-10"],
)
def test_percentile_nearest_rank(samples: list[float], p: float, expected: float | None) -> None:
    assert percentile(samples, p) == expected


@pytest.mark.parametrize("p", [0, -1, 101])
def test_percentile_rejects_out_of_range(p: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], p)


@given(
    st.lists(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False), min_size=2, max_size=300),
    st.lists(st.integers(min_value=1, max_value=99), min_size=1, max_size=5),
)
def test_interpolated_percentiles_are_statistics_quantiles_to_the_bit(
    samples: list[float], ps: list[int]
) -> None:
    """One sort for several percentiles, the same values as `statistics.quantiles` (what
    AIBrix's NumPy percentile is, and what the rows were before)."""
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    assert interpolated_percentiles(samples, ps) == tuple(cuts[p - 1] for p in ps)


@pytest.mark.parametrize("ps", [(0,), (100,), (50, 101)])
def test_interpolated_percentiles_reject_out_of_range(ps: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"1\.\.99"):
        interpolated_percentiles([1.0, 2.0], ps)


# ---------------------------------------------------------------------------------------------
# summarize


def _results() -> list[RequestResult]:
    """Window [10, 20): a100 gets 3 ok, l20 1 ok + 1 error, v100 nothing; plus noise outside."""
    return [
        ok("a100", 9.99, tokens=1000),  # before the window
        ok("a100", 10.0, ttft=0.1, latency=1.1, tokens=11),  # tpot 0.1
        ok("a100", 12.0, ttft=0.2, latency=2.2, tokens=11),  # tpot 0.2
        ok("a100", 15.0, ttft=0.1, latency=3.1, tokens=11),  # tpot 0.3
        ok("l20", 11.0, ttft=0.5, latency=4.5, tokens=5),  # tpot 1.0
        failed("l20", 13.0),
        failed(None, 14.0, status=0),  # transport error, no replica
        ok("l20", 20.0, tokens=1000),  # end is exclusive
    ]


def test_summarize_window_and_errors() -> None:
    s = summarize(_results(), saturated_tokens_per_s=SATURATED, window=(10.0, 20.0))
    fleet = s["fleet"]
    assert fleet["requests"] == 6
    assert fleet["errors"] == 2
    assert fleet["output_tokens_per_s"] == pytest.approx((11 * 3 + 5) / 10.0)
    assert fleet["utilization"] == pytest.approx(3.8 / 500.0)
    assert fleet["tpot_p50_ms"] == pytest.approx(200.0)  # of [100, 200, 300, 1000]
    assert fleet["tpot_p99_ms"] == pytest.approx(1000.0)
    assert fleet["latency_p50_ms"] == pytest.approx(2200.0)  # of [1100, 2200, 3100, 4500]
    assert fleet["latency_p99_ms"] == pytest.approx(4500.0)
    assert fleet["late_requests"] == 0


@pytest.mark.parametrize(
    ("replica", "expected"),
    [
        (
            "a100",
            {
                "requests": 3,
                "errors": 0,
                "request_share": 3 / 5,
                "capacity_share": 300 / 500,
                "output_tokens_per_s": 3.3,
                "utilization": 3.3 / 300,
                "tpot_p50_ms": 200.0,
                "tpot_p99_ms": 300.0,
                "p50_ms": 2200.0,
                "p99_ms": 3100.0,
            },
        ),
        (
            "l20",
            {
                "requests": 2,
                "errors": 1,
                "request_share": 2 / 5,
                "capacity_share": 150 / 500,
                "output_tokens_per_s": 0.5,
                "utilization": 0.5 / 150,
                "tpot_p50_ms": 1000.0,
                "tpot_p99_ms": 1000.0,
                "p50_ms": 4500.0,
                "p99_ms": 4500.0,
            },
        ),
        (
            "v100",
            {
                "requests": 0,
                "errors": 0,
                "request_share": 0.0,
                "capacity_share": 50 / 500,
                "output_tokens_per_s": 0.0,
                "utilization": 0.0,
                "tpot_p50_ms": None,
                "tpot_p99_ms": None,
                "p50_ms": None,
                "p99_ms": None,
            },
        ),
    ],
    ids=["busy", "with-error", "idle"],
)
def test_summarize_replicas(replica: str, expected: dict[str, Any]) -> None:
    s = summarize(_results(), saturated_tokens_per_s=SATURATED, window=(10.0, 20.0))
    got = s["replicas"][replica]
    assert set(got) == set(expected)
    for key, value in expected.items():
        if value is None:
            assert got[key] is None, key
        else:
            assert got[key] == pytest.approx(value), key


def test_summarize_shares_sum_to_one() -> None:
    s = summarize(_results(), saturated_tokens_per_s=SATURATED, window=(10.0, 20.0))
    reps = s["replicas"].values()
    assert math.fsum(r["capacity_share"] for r in reps) == pytest.approx(1.0)
    assert math.fsum(r["request_share"] for r in reps) == pytest.approx(1.0)


def test_summarize_empty_window() -> None:
    s = summarize(_results(), saturated_tokens_per_s=SATURATED, window=(100.0, 110.0))
    assert s["fleet"]["requests"] == 0
    assert s["fleet"]["tpot_p99_ms"] is None
    assert all(r["requests"] == 0 and r["p99_ms"] is None for r in s["replicas"].values())
    assert list(s["replicas"]) == list(SATURATED)


def test_summarize_unknown_replica_listed_after_known() -> None:
    results = [ok("a100", 1.0), ok("stray", 1.5)]
    s = summarize(results, saturated_tokens_per_s={"a100": 100.0}, window=(0.0, 2.0))
    assert list(s["replicas"]) == ["a100", "stray"]
    assert s["replicas"]["stray"]["capacity_share"] == 0.0
    assert s["replicas"]["stray"]["utilization"] is None
    assert s["replicas"]["a100"]["request_share"] == 0.5


def test_summarize_counts_late_sends() -> None:
    results = [ok("a100", 1.0, lag=0.0), ok("a100", 1.2, lag=0.5)]
    s = summarize(results, saturated_tokens_per_s={"a100": 100.0}, window=(0.0, 2.0))
    assert s["fleet"]["late_requests"] == 1
    assert s["fleet"]["send_lag_p99_ms"] == pytest.approx(500.0)


@pytest.mark.parametrize(
    ("saturated", "window"),
    [
        ({"a": 1.0}, (5.0, 5.0)),
        ({"a": 1.0}, (5.0, 1.0)),
        ({"a": -1.0}, (0.0, 1.0)),
        ({"a": math.nan}, (0.0, 1.0)),
    ],
    ids=["empty-window", "reversed-window", "negative-rate", "nan-rate"],
)
def test_summarize_rejects_bad_input(
    saturated: dict[str, float], window: tuple[float, float]
) -> None:
    with pytest.raises(ValueError):
        summarize([], saturated_tokens_per_s=saturated, window=window)


# ---------------------------------------------------------------------------------------------
# Rendering


def _two_strategies() -> dict[str, dict[str, Any]]:
    before = summarize(_results(), saturated_tokens_per_s=SATURATED, window=(10.0, 20.0))
    after = summarize(
        [ok("a100", 10.5), ok("l20", 11.0), ok("v100", 12.0, lag=1.0)],
        saturated_tokens_per_s=SATURATED,
        window=(10.0, 20.0),
    )
    return {"least-request": before, "load-balance": after}


def test_format_table_lists_every_strategy_and_replica() -> None:
    text = format_table(_two_strategies())
    for name in ("least-request", "load-balance", "a100", "l20", "v100", "fleet"):
        assert name in text
    assert text.count("strategy: ") == 2
    assert "late" in text  # the late send in load-balance is called out
    assert "\t" not in text


def test_format_table_columns_aligned() -> None:
    text = format_table(_two_strategies())
    block = text.split("\n\n")[0].splitlines()
    header, rows = block[1], [line for line in block[3:] if not line.startswith("note")]
    # Right-aligned numeric columns: every row is exactly as wide as the header.
    assert all(len(row) == len(header) for row in rows), block


def test_demo_json_exact_shape() -> None:
    doc = demo_json(_two_strategies())
    assert set(doc) == {"strategies"}
    assert set(doc["strategies"]) == {"least-request", "load-balance"}
    for strat in doc["strategies"].values():
        assert set(strat) == {"fleet", "replicas"}
        assert {"tpot_p99_ms", "latency_p99_ms", "errors"} <= set(strat["fleet"])
        assert set(strat["replicas"]) == set(SATURATED)
        for rep in strat["replicas"].values():
            assert tuple(rep) == REPLICA_KEYS
    orjson.dumps(doc)  # serialisable as is
