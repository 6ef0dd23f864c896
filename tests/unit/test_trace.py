"""Request traces without Redis: the format (keys, buckets, windows, AIBrix's versions 1 to 4),
what the recorder counts and how a window closes, and where the request path tells it.

The format is AIBrix's so that each optimizer reads the other's gateways: a key or a bucket off
by one, or a document AIBrix's reader would refuse, breaks the loop silently, hence the exact
values here. The request path is driven in-process through the ext_proc processors (no sockets),
in each of the three wirings (streamed, observe with pick-only, observe without): every request
must be counted exactly once.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

from plugin.adapters.extproc import ExtProcServicer, Processor
from plugin.adapters.tracing import TraceFlusher, TraceRecorder
from plugin.config import RedisSettings
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.router import Router
from plugin.core.strategies import build_strategies
from plugin.core.trace import (
    TRACE_INTERVAL_S,
    TRACE_PRECISION,
    TRACE_TTL_S,
    TRACE_VERSION,
    TraceWindow,
    bucket,
    tick,
    trace_key,
    window_start,
)
from plugin.core.types import Pod
from plugin.errors import GatewayError, TraceFormatError
from tests.helpers import chat_body, header_map

pytestmark = pytest.mark.unit

MODEL = "llama-3-8b"
AIBRIX_CELL = re.compile(r"^(\d+):(\d+)$")  # what AIBrix's reader accepts


# --- the format ---------------------------------------------------------------------------------


def test_constants_are_aibrix_s() -> None:
    assert (TRACE_INTERVAL_S, TRACE_PRECISION, TRACE_VERSION, TRACE_TTL_S) == (10, 10, 4, 600)


def test_trace_key() -> None:
    # Labelled with the window's end, as AIBrix's gateway writes and its optimizer reads it.
    assert trace_key("llama-3-8b", 1700000000) == "aibrix:llama-3-8b_request_trace_1700000010"


@pytest.mark.parametrize(
    ("t", "interval", "start"),
    [
        (0.0, 10, 0),
        (9.999, 10, 0),
        (10.0, 10, 10),
        (1700000005.5, 10, 1700000000),
        (1700000009.9999, 10, 1700000000),
        (1700000010.0, 10, 1700000010),
        (-0.5, 10, -10),
        (12.5, 1, 12),
    ],
    ids=str,
)
def test_window_start_is_aligned(t: float, interval: int, start: int) -> None:
    assert window_start(t, interval) == start
    assert isinstance(window_start(t, interval), int)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (0, 0),  # zero tokens: 0, as AIBrix writes it
        (1, 0),
        (2, 10),
        (3, 16),  # log2(3) * 10 = 15.85
        (1000, 100),  # 99.66
        (1024, 100),
        (100, 66),  # 66.44
        (4096, 120),
    ],
    ids=str,
)
def test_tick(tokens: int, expected: int) -> None:
    assert tick(tokens) == expected


@pytest.mark.parametrize(
    ("input_tokens", "output_tokens", "key"),
    [(0, 0, "0:0"), (128, 0, "70:0"), (0, 16, "0:40"), (1000, 100, "100:66"), (2, 4, "10:20")],
    ids=str,
)
def test_bucket(input_tokens: int, output_tokens: int, key: str) -> None:
    assert bucket(input_tokens, output_tokens) == key
    assert AIBRIX_CELL.match(key)


def test_bucket_precision_and_negative_tokens() -> None:
    assert bucket(1024, 8, precision=1) == "10:3"
    with pytest.raises(ValueError, match="negative"):
        bucket(-1, 5)


def window(**kw: Any) -> TraceWindow:
    args: dict[str, Any] = {
        "model": MODEL,
        "start": 1700000000,
        "counts": {"100:66": 3, "0:40": 1},
        "total_reqs": 5,
        "pending_reqs": 2,
        "queueing_reqs": 1,
    }
    return TraceWindow(**(args | kw))


def test_to_json_is_aibrix_s_document() -> None:
    assert window().to_json() == {
        "0:40": 1,
        "100:66": 3,
        "meta_v": 4,
        "meta_interval_sec": 10,
        "meta_precision": 10,
        "meta_total_reqs": 5,
        "meta_pending_reqs": 2,
        "meta_queueing_reqs": 1,
    }


def test_to_json_parse_round_trip_through_json_text() -> None:
    w = window()
    assert TraceWindow.parse(MODEL, w.start, orjson.loads(orjson.dumps(w.to_json()))) == w


@given(
    counts=st.dictionaries(
        st.tuples(st.integers(0, 400), st.integers(0, 400)).map(lambda c: f"{c[0]}:{c[1]}"),
        st.integers(1, 10**9),
        max_size=20,
    ),
    meta=st.tuples(st.integers(0, 10**9), st.integers(0, 10**6), st.integers(0, 10**6)),
    interval=st.integers(1, 60),
    precision=st.integers(10, 100),  # ticks up to 400 are sizes below 2**40 tokens
)
def test_round_trip_of_any_window(
    counts: dict[str, int], meta: tuple[int, int, int], interval: int, precision: int
) -> None:
    w = TraceWindow(MODEL, 40, counts, *meta, interval_s=interval, precision=precision)
    assert TraceWindow.parse(MODEL, 40, orjson.loads(orjson.dumps(w.to_json()))) == w


def test_cells_are_tokens_counts() -> None:
    cells = sorted(window(counts={"100:66": 3, "0:0": 2, "10:20": 1}).cells())
    assert cells == [(1.0, 1.0, 2), (2.0, 4.0, 1), (pytest.approx(1024.0), 2**6.6, 3)]


def test_empty() -> None:
    assert window(counts={}, total_reqs=0, pending_reqs=4, queueing_reqs=2).empty
    assert not window(counts={}, total_reqs=1).empty
    assert not window(counts={"0:0": 1}, total_reqs=0).empty


# AIBrix's versions, as its gateways wrote them: v1 counts alone (precision 1), v2 adds the
# interval and precision, v3 the arrivals and pending requests; v4 (this gateway) the queue.
@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"10:7": 3, "12:5": 1}, ({"10:7": 3, "12:5": 1}, 4, 0, 0, 10, 1)),
        (
            {"100:66": 3, "meta_v": 2, "meta_interval_sec": 10, "meta_precision": 10},
            ({"100:66": 3}, 3, 0, 0, 10, 10),
        ),
        (
            {
                "100:66": 3,
                "meta_v": 3,
                "meta_interval_sec": 10,
                "meta_precision": 10,
                "meta_total_reqs": 7,
                "meta_pending_reqs": 2,
                "meta_len": 1,  # AIBrix's: an unknown meta_ field is ignored
            },
            ({"100:66": 3}, 7, 2, 0, 10, 10),
        ),
        (
            {
                "meta_v": 3,
                "meta_interval_sec": 5,
                "meta_precision": 10,
                "meta_total_reqs": 4,
                "meta_pending_reqs": 0,
                "meta_queueing_reqs": 9,  # not in version 3: ignored
            },
            ({}, 4, 0, 0, 5, 10),
        ),
        (
            {
                "07:3": 2,  # one bucket however it is spelled
                "7:3": 1,
                "meta_v": 4,
                "meta_interval_sec": 10,
                "meta_precision": 10,
                "meta_total_reqs": 3,
                "meta_pending_reqs": 1,
                "meta_queueing_reqs": 5,
            },
            ({"7:3": 3}, 3, 1, 5, 10, 10),
        ),
        ({"1:1": 2.0, "meta_v": 1}, ({"1:1": 2}, 2, 0, 0, 10, 1)),  # an integral float
    ],
    ids=["v1", "v2", "v3", "v3-no-counts", "v4", "integral-float"],
)
def test_parse_aibrix_versions(
    doc: dict[str, Any], expected: tuple[dict[str, int], int, int, int, int, int]
) -> None:
    w = TraceWindow.parse(MODEL, 1700000000, doc)
    counts, total, pending, queueing, interval, precision = expected
    assert (w.model, w.start) == (MODEL, 1700000000)
    assert w.counts == counts
    assert (w.total_reqs, w.pending_reqs, w.queueing_reqs) == (total, pending, queueing)
    assert (w.interval_s, w.precision) == (interval, precision)


def test_v1_cells_read_at_precision_1() -> None:
    (cell,) = TraceWindow.parse(MODEL, 0, {"10:7": 3}).cells()
    assert cell == (1024.0, 128.0, 3)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "JSON object"),
        ({"1-2": 3}, "'1-2'"),  # the separator of AIBrix's docstring, not of its reader
        ({"1:2:3": 3}, "'1:2:3'"),
        ({"a:b": 3}, "'a:b'"),
        ({" 1:2": 3}, "' 1:2'"),
        ({"1:2": -1}, "count '1:2'"),
        ({"1:2": "5"}, "count '1:2'"),
        ({"1:2": True}, "count '1:2'"),
        ({"1:2": 1.5}, "count '1:2'"),
        ({"1:2": float("inf")}, "count '1:2'"),
        ({"1:2": None}, "count '1:2'"),
        ({"20000:10": 1}, "beyond 2**40 tokens"),  # 2 ** 2000 overflows a float
        ({"41:0": 1}, "beyond"),  # precision 1 (version 1): 2**41 tokens
        ({"meta_v": 0}, "meta_v"),
        ({"meta_v": 5}, "newer than this reader"),
        ({"meta_v": "4"}, "meta_v"),
        ({"meta_v": 4, "meta_precision": 0}, "meta_precision"),
        ({"meta_v": 4, "meta_interval_sec": 0}, "meta_interval_sec"),
        ({"meta_v": 4, "meta_total_reqs": -1}, "meta_total_reqs"),
        ({"meta_v": 3, "meta_pending_reqs": "2"}, "meta_pending_reqs"),
        ({"meta_v": 4, "meta_queueing_reqs": [1]}, "meta_queueing_reqs"),
    ],
    ids=str,
)
def test_a_bad_document_raises_trace_format_error(doc: Any, message: str) -> None:
    with pytest.raises(TraceFormatError, match=re.escape(message)):
        TraceWindow.parse(MODEL, 0, doc)


def test_trace_format_error_is_in_the_hierarchy() -> None:
    assert issubclass(TraceFormatError, GatewayError)
    assert issubclass(TraceFormatError, ValueError)


# --- the recorder and the closing of a window ---------------------------------------------------


@dataclass
class Clock:
    t: float

    def __call__(self) -> float:
        return self.t


def test_recorder_closes_a_window_and_starts_again() -> None:
    rec = TraceRecorder()
    for _ in range(3):
        rec.arrived(MODEL)
    rec.arrived("other")
    rec.completed(MODEL, 1000, 100)
    rec.completed(MODEL, 1024, 100)  # the same bucket
    rec.completed(MODEL, 0, 0)
    windows = rec.close(1700000000, 50.0, {MODEL: 2})
    assert [w.model for w in windows] == [MODEL, "other"]
    mine, other = windows
    assert mine == TraceWindow(MODEL, 1700000000, {"0:0": 1, "100:66": 2}, 3, 0, 2)
    assert other == TraceWindow("other", 1700000000, {}, 1, 0, 0)
    assert rec.close(1700000010, 60.0, {MODEL: 2}) == []  # nothing since: nothing written


def test_a_window_with_only_completions_is_written() -> None:
    rec = TraceRecorder()
    rec.completed(MODEL, 8, 8)
    (w,) = rec.close(10, 10.0, {})
    assert (w.total_reqs, w.counts) == (0, {"30:30": 1})


def test_pending_are_in_flight_requests_that_arrived_before_the_window() -> None:
    rec = TraceRecorder()
    rec.started(MODEL, 94.2)  # arrived in an earlier window, still running
    rec.started(MODEL, 98.9)  # a whole second before the window's start (100): pending
    rec.started(MODEL, 101.5)  # arrived in the window
    rec.started(MODEL, 90.0)
    rec.ended(MODEL, 90.0)  # finished: not in flight
    rec.arrived(MODEL)
    (w,) = rec.close(1700000000, 100.0, {})
    assert w.pending_reqs == 2
    assert rec.in_flight(MODEL) == 3
    rec.ended(MODEL, 94.2)
    rec.ended(MODEL, 94.2)  # a second end of the same second does not go negative
    rec.ended("unknown", 1.0)
    assert rec.in_flight(MODEL) == 2


@dataclass
class Flushing:
    """A flusher on hand-driven clocks (never connected: close_windows needs no Redis)."""

    wall: Clock = field(default_factory=lambda: Clock(1700000003.0))
    mono: Clock = field(default_factory=lambda: Clock(503.0))  # wall - 1699999500
    recorder: TraceRecorder = field(default_factory=TraceRecorder)
    queue: dict[str, int] = field(default_factory=dict)
    flusher: TraceFlusher = field(init=False)

    def __post_init__(self) -> None:
        self.flusher = TraceFlusher(
            self.recorder,
            RedisSettings(host="127.0.0.1", port=1),
            queueing=lambda: self.queue,
            clock=self.mono,
            wall_clock=self.wall,
        )

    def advance(self, seconds: float) -> None:
        self.wall.t += seconds
        self.mono.t += seconds


def test_close_windows_on_the_boundary() -> None:
    f = Flushing()
    f.recorder.arrived(MODEL)
    f.recorder.started(MODEL, f.mono.t - 10)  # arrived in the previous window
    f.advance(6.0)  # 1700000009: the window has not ended
    assert f.flusher.close_windows() == 0
    f.advance(1.05)  # 1700000010.05
    f.queue[MODEL] = 4
    assert f.flusher.close_windows() == 1
    (w,) = f.flusher.pending
    assert (w.start, w.total_reqs, w.pending_reqs, w.queueing_reqs) == (1700000000, 1, 1, 4)
    assert f.flusher.close_windows() == 0  # closed once


def test_a_late_wake_counts_everything_in_the_latest_closed_window() -> None:
    f = Flushing()
    f.recorder.arrived(MODEL)
    f.advance(32.0)  # 1700000035: three boundaries passed
    assert f.flusher.close_windows() == 1
    assert [w.start for w in f.flusher.pending] == [1700000020]


def test_the_final_close_takes_the_open_window() -> None:
    f = Flushing()
    f.recorder.arrived(MODEL)
    assert f.flusher.close_windows(final=True) == 1
    assert [w.start for w in f.flusher.pending] == [1700000000]


def test_a_wall_clock_that_goes_back_is_followed() -> None:
    f = Flushing()
    f.wall.t -= 3600
    f.recorder.arrived(MODEL)
    assert f.flusher.close_windows() == 0
    f.wall.t += 10
    assert f.flusher.close_windows() == 1
    assert [w.start for w in f.flusher.pending] == [1700000000 - 3600]


# --- the request path ---------------------------------------------------------------------------

PODS = [Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8001 + i, 8001 + i) for i in range(2)]
USAGE = {"prompt_tokens": 1000, "completion_tokens": 100}  # bucket "100:66"


@dataclass
class RequestPath:
    router: Router
    recorder: TraceRecorder
    servicer: ExtProcServicer


def request_path(pods: Sequence[Pod] = PODS) -> RequestPath:
    pool = PodPool(CapacityEstimator())
    pool.set_pods(pods)
    clock = Clock(1000.0)
    router = Router(pool, build_strategies(), "least-request", random.Random(0), clock)
    recorder = TraceRecorder()
    return RequestPath(router, recorder, ExtProcServicer(router, tracer=recorder))


def headers(extra: dict[str, str] | None = None, observed: bool = False) -> pb.ProcessingRequest:
    values = {":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "r1"}
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(values | (extra or {})))
    )
    req.observability_mode = observed
    return req


def body(model: str = MODEL) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        request_body=pb.HttpBody(body=orjson.dumps(chat_body(model)), end_of_stream=True)
    )


def response(
    status: int = 200, observed: bool = False, usage: bool = True
) -> list[pb.ProcessingRequest]:
    head = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map({":status": str(status)}))
    )
    if usage:
        content = orjson.dumps({"choices": [], "usage": USAGE})
    else:  # a stream sent without stream_options.include_usage: three chunks, no usage
        chunk = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        content = chunk * 3 + b"data: [DONE]\n\n"
    tail = pb.ProcessingRequest(response_body=pb.HttpBody(body=content, end_of_stream=True))
    head.observability_mode = tail.observability_mode = observed
    return [head, tail]


def routed_to(reply: object) -> str:
    assert isinstance(reply, pb.ProcessingResponse), reply
    mutation = reply.request_body.response.header_mutation
    (endpoint,) = (h.header.raw_value for h in mutation.set_headers if h.header.key == "target-pod")
    return bytes(endpoint).decode()


def feed(processor: Processor, messages: Sequence[pb.ProcessingRequest]) -> None:
    for m in messages:
        processor.handle(m)


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
@pytest.mark.parametrize("wiring", ["streamed", "observe-pick-only", "observe"])
async def test_each_request_is_counted_once_in_every_wiring(wiring: str, usage: bool) -> None:
    p = request_path()
    rec = p.recorder
    routing = p.servicer.processor_for(headers(), pick_only=wiring == "observe-pick-only")
    routing.handle(headers())
    endpoint = routed_to(routing.handle(body()))
    assert rec.in_flight(MODEL) == 1
    counting = None
    if wiring != "streamed":
        target = {"target-pod": endpoint, "x-hetero-gateway-prompt-tokens": "3"}
        counting = p.servicer.processor_for(headers(target, observed=True))
        counting.handle(headers(target, observed=True))
    if wiring == "observe":  # the routing stream sees the response headers only
        routing.handle(response()[0])
    if counting is None:
        feed(routing, response(usage=usage))
    else:
        feed(counting, response(observed=True, usage=usage))
        counting.close()
    routing.close()
    assert rec.in_flight(MODEL) == 0
    (w,) = rec.close(1700000000, 0.0, {})
    if usage:
        assert (w.total_reqs, w.counts) == (1, {"100:66": 1})
    else:  # the prompt's estimate and the three counted chunks (tick(3) = 16): still one sample
        assert w.total_reqs == 1 and sum(w.counts.values()) == 1, w.counts
        (key,) = w.counts
        assert key.endswith(f":{tick(3)}"), key


async def test_a_failed_response_ends_without_a_size() -> None:
    p = request_path()
    routing = p.servicer.processor_for(headers())
    routing.handle(headers())
    routing.handle(body())
    feed(routing, response(503))
    routing.close()
    assert p.recorder.in_flight(MODEL) == 0
    (w,) = p.recorder.close(1700000000, 0.0, {})
    assert (w.total_reqs, w.counts) == (1, {})


async def test_a_parked_lease_nobody_claims_ends_in_flight() -> None:
    p = request_path()
    p.servicer.handoff._timeout_s = 0.0
    routing = p.servicer.processor_for(headers(), pick_only=True)
    routing.handle(headers())
    routing.handle(body())
    routing.close()
    assert p.recorder.in_flight(MODEL) == 1
    for _ in range(10):
        if p.servicer.handoff.expired:
            break
        await asyncio.sleep(0.01)
    assert p.recorder.in_flight(MODEL) == 0


async def test_refused_requests_for_a_served_model_are_arrivals_unknown_models_are_not() -> None:
    down = Pod("down", "ns", "scaled-down", "10.0.0.2", 9000, 9000, ready=False)
    p = request_path([*PODS, down])
    for model in ("scaled-down", "no-such-model"):
        routing = p.servicer.processor_for(headers())
        routing.handle(headers())
        reply = routing.handle(body(model))
        assert isinstance(reply, pb.ProcessingResponse)
        assert reply.immediate_response.status.code in (400, 503)
        routing.close()
    windows = p.recorder.close(1700000000, 0.0, {})
    assert [(w.model, w.total_reqs) for w in windows] == [("scaled-down", 1)]
