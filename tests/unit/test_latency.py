"""Latency as clients feel it (`plugin.core.latency`), and how a response's stream feeds it
(`ChunkGaps`, `ResponseTokens` in the ext_proc adapter) on a clock the test moves."""

from __future__ import annotations

import orjson
import pytest

from plugin.adapters.extproc import ChunkGaps, ResponseTokens
from plugin.adapters.http import LatencyView, latency_families
from plugin.core.capacity import CapacityEstimator
from plugin.core.latency import (
    DECISION_BUCKETS_S,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    ClientLatency,
    Histogram,
    SloOutcomes,
)
from plugin.core.pool import PodPool
from tests.helpers import make_pod

pytestmark = pytest.mark.unit

POD = make_pod("a100-0", deployment="a100")


def test_a_histogram_counts_each_value_once_and_reads_cumulative() -> None:
    h = Histogram((0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 50.0):
        h.observe(v)
    # `le` buckets: a value on a bound counts in it, as Prometheus's do.
    assert h.cumulative() == [2, 4, 5]
    assert h.count == 6 and h.total == pytest.approx(54.65)


def test_a_response_without_events_has_an_e2e_but_no_first_token() -> None:
    latency = ClientLatency()
    latency.observe("ns/a", "m", "a100", 10.0, None, None, 12.5, 40)
    pod = latency.pods["ns/a"]
    assert (pod.e2e.count, pod.e2e.total, pod.tokens.total) == (1, 2.5, 40)
    assert pod.ttft.count == pod.tpot.count == 0
    latency.forget(["ns/a", "ns/gone"])
    assert latency.pods == {}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _event(text: str) -> bytes:
    doc = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _usage(completion: int) -> bytes:
    doc = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": completion}}
    return b"data: " + orjson.dumps(doc) + b"\n\ndata: [DONE]\n\n"


def _stream(status: int) -> tuple[ClientLatency, ResponseTokens, Clock]:
    clock = Clock()
    pool = PodPool(CapacityEstimator(), 3.0)
    pool.set_pods([POD])
    latency = ClientLatency()
    tokens = ResponseTokens()
    tokens.status = status
    arrived = clock.now
    clock.now += 0.01  # the stream is made a little after the request arrived
    tokens.gaps = ChunkGaps(pool, POD.key, clock, 9, latency=latency, pod=POD, started_at=arrived)
    return latency, tokens, clock


def test_a_stream_gives_ttft_tpot_per_request_e2e_and_tokens() -> None:
    latency, tokens, clock = _stream(200)
    clock.now += 0.29  # first token 0.3 s after arrival
    tokens.feed(_event("a"), False)
    for k in range(10):  # then 10 tokens 40 ms apart, the usage with the last (as vLLM does)
        clock.now += 0.04
        tokens.feed(_event("b") + (_usage(11) if k == 9 else b""), False)
    clock.now += 0.005  # the body's end is read 5 ms later
    tokens.feed(b"", True)
    tokens.close_gaps()
    pod = latency.pods[POD.key]
    assert (pod.model, pod.deployment) == ("m", "a100")
    assert pod.ttft.total == pytest.approx(0.3)
    assert pod.ttft.cumulative()[TTFT_BUCKETS_S.index(0.25)] == 0
    assert pod.ttft.cumulative()[TTFT_BUCKETS_S.index(0.5)] == 1
    assert pod.tpot.total == pytest.approx(0.04)  # (last - first) / (11 - 1)
    assert pod.tpot.cumulative()[TPOT_BUCKETS_S.index(0.03)] == 0
    assert pod.tpot.cumulative()[TPOT_BUCKETS_S.index(0.05)] == 1
    assert pod.e2e.total == pytest.approx(0.705)
    assert pod.tokens.total == 11
    tokens.close_gaps()  # once
    assert pod.e2e.count == 1


def test_an_error_response_is_not_a_latency_sample() -> None:
    latency, tokens, clock = _stream(503)
    clock.now += 0.2
    tokens.feed(b'{"error": "overloaded"}', True)
    tokens.close_gaps()
    assert latency.pods == {}


def test_a_stream_without_usage_counts_its_events() -> None:
    latency, tokens, clock = _stream(200)
    for _ in range(5):
        clock.now += 0.1
        tokens.feed(_event("x"), False)
    tokens.feed(b"data: [DONE]\n\n", True)
    tokens.close_gaps()
    pod = latency.pods[POD.key]
    assert pod.tokens.total == 5
    assert pod.tpot.total == pytest.approx(0.1)


def test_per_gpu_type_only_keeps_one_entry_a_deployment_with_an_empty_pod_label() -> None:
    latency = ClientLatency(per_pod=False)
    for pod in ("ns/a100-0", "ns/a100-1"):
        latency.observe(pod, "m", "a100", 0.0, 0.2, 1.2, 1.3, 11)
    latency.forget(["ns/a100-0"])  # a pod leaving does not reset its GPU type's counts
    (entry,) = latency.pods.values()
    assert entry.ttft.count == 2 and entry.tpot.total == pytest.approx(0.2)
    families = latency_families(LatencyView(latency, Histogram(DECISION_BUCKETS_S), SloOutcomes()))
    ttft = next(f for f in families if f.name == "hetero_gateway_time_to_first_token_seconds")
    assert {s.labels["pod"] for s in ttft.samples} == {""}
    assert {s.labels["deployment"] for s in ttft.samples} == {"a100"}


def test_a_cut_stream_is_not_a_latency_sample() -> None:
    latency, tokens, clock = _stream(200)
    for _ in range(3):
        clock.now += 0.1
        tokens.feed(_event("x"), False)
    tokens.close_gaps()  # the client went away: no end of stream
    assert latency.pods == {} and tokens.felt is None


def test_a_response_whose_body_is_never_seen_is_not_a_latency_sample() -> None:
    latency, tokens, _ = _stream(200)  # --count-mode engine: headers and end, no body
    tokens.close_gaps()
    assert latency.pods == {} and tokens.felt is None
