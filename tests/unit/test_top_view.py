"""`hetero-gateway top`'s arithmetic (`plugin_tools.top.view`): quantiles from histogram buckets
as Prometheus's `histogram_quantile` computes them, and shares and quantiles over a window from
two readings of real `/metrics` text rendered by prometheus_client."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from plugin_tools.top.view import parse_snapshot, quantile, view

pytestmark = pytest.mark.unit

INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, ((0.1, 0.0), (0.2, 10.0), (INF, 10.0)), 0.15),  # the rank halfway into (0.1, 0.2]
        (0.99, ((0.1, 0.0), (0.2, 10.0), (INF, 10.0)), 0.199),
        (0.5, ((0.1, 4.0), (0.2, 6.0), (INF, 10.0)), 0.15),
        (0.25, ((0.1, 4.0), (0.2, 6.0), (INF, 10.0)), 0.0625),  # from 0 in the first bucket
        (0.99, ((0.1, 4.0), (0.2, 6.0), (INF, 10.0)), 0.2),  # in +Inf: the last finite bound
        (0.5, ((0.1, 0.0), (INF, 0.0)), None),  # no observations
        (0.5, (), None),
    ],
)
def test_quantile_is_prometheus_histogram_quantile(
    q: float, buckets: tuple[tuple[float, float], ...], expected: float | None
) -> None:
    got = quantile(q, buckets)
    assert got == (None if expected is None else pytest.approx(expected))


def _metrics(ttft: dict[str, list[float]], waiting: float) -> str:
    """A /metrics page as the plugin renders its families (prometheus_client's text format)."""
    registry = CollectorRegistry()
    h = Histogram(
        "hetero_gateway_time_to_first_token_seconds",
        "ttft",
        ["pod", "model", "deployment"],
        buckets=(0.1, 0.5, 1.0),
        registry=registry,
    )
    for pod, values in ttft.items():
        for v in values:
            h.labels(pod, "m", "a100").observe(v)
    Gauge("hetero_gateway_waiting_requests", "held", ["model"], registry=registry).labels("m").set(
        waiting
    )
    return generate_latest(registry).decode()


def _pods(routed: dict[str, int], capacity: Mapping[str, float | None]) -> dict[str, Any]:
    return {
        "pods": {
            key: {
                "deployment": key.split("/")[1].split("-")[0],
                "ready": True,
                "routed_total": n,
                "inflight": 1,
                "inflight_remote": 0,
                "capacity_tokens_per_s": capacity[key],
            }
            for key, n in routed.items()
        }
    }


def test_shares_and_quantiles_cover_the_window_between_two_readings() -> None:
    cap = {"ns/a100-0": 300.0, "ns/v100-0": 100.0}
    first = parse_snapshot(
        0.0,
        _pods({"ns/a100-0": 100, "ns/v100-0": 100}, cap),
        _metrics({"ns/a100-0": [2.0] * 50}, 0),  # slow before the window: left out
    )
    second = parse_snapshot(
        60.0,
        _pods({"ns/a100-0": 130, "ns/v100-0": 110}, cap),
        _metrics({"ns/a100-0": [2.0] * 50 + [0.05] * 30, "ns/v100-0": [0.3] * 10}, 3),
    )
    v = view(second, first)
    assert v.window_s == 60.0 and v.waiting == {"m": 3}
    a100, v100 = v.pods
    assert (a100.key, a100.gpu, a100.state) == ("ns/a100-0", "a100", "up")
    assert a100.request_share == pytest.approx(0.75) and v100.request_share == pytest.approx(0.25)
    assert a100.capacity_share == pytest.approx(0.75) and v100.capacity_share == pytest.approx(0.25)
    # The window's 30 a100 observations all fell in (0, 0.1]: p50 is halfway up that bucket.
    assert a100.ttft_p50 == pytest.approx(0.05)
    assert v100.ttft_p50 == pytest.approx(0.3)  # halfway into (0.1, 0.5]
    # Since start instead: the 50 slow ones dominate.
    assert view(second, None).pods[0].ttft_p50 == pytest.approx(1.0)


def test_a_pod_out_of_rotation_and_one_without_capacity_are_shown_so() -> None:
    pods = _pods({"ns/a100-0": 5, "ns/v100-0": 0}, {"ns/a100-0": None, "ns/v100-0": None})
    pods["pods"]["ns/v100-0"]["unreachable"] = True
    v = view(parse_snapshot(1.0, pods, ""), None)
    assert [r.state for r in v.pods] == ["up", "unreachable"]
    assert all(r.capacity_share is None and r.ttft_p99 is None for r in v.pods)
