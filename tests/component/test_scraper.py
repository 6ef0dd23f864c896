"""Engine metrics: the exposition parser (unit), then the scraper against real HTTP servers.

The component tests run real aiohttp servers on loopback and a fake clock, so staleness and
capacity refresh are checked by moving time, never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from plugin.adapters.discovery import parse_pods
from plugin.adapters.scraper import (
    _WANTED,
    _WANTED_SAMPLE,
    MetricsScraper,
    parse_engine_metrics,
)
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.strategies import Route, build_strategies
from plugin.core.types import EngineMetrics, Pod, RequestInfo
from tests.helpers import ServeApp, eventually

pytestmark = pytest.mark.component

MODEL = "m"
MAX_AGE_S = 3.0

# A trimmed but faithful vLLM (V1) exposition: HELP/TYPE lines, engine + model_name labels,
# counters and histograms around the three gauges the gateway reads.
_L = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
VLLM_TEXT = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{_L}}} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{_L}}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{_L}}} 0.4375
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{_L}}} 123456.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{{_L},le="0.01"}} 3.0
vllm:time_to_first_token_seconds_bucket{{{_L},le="0.1"}} 30.0
vllm:time_to_first_token_seconds_bucket{{{_L},le="+Inf"}} 42.0
vllm:time_to_first_token_seconds_count{{{_L}}} 42.0
vllm:time_to_first_token_seconds_sum{{{_L}}} 3.5
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{{_L},le="1.0"}} 10.0
vllm:e2e_request_latency_seconds_bucket{{{_L},le="+Inf"}} 42.0
vllm:e2e_request_latency_seconds_count{{{_L}}} 42.0
vllm:e2e_request_latency_seconds_sum{{{_L}}} 61.0
"""

OLD_VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""

SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.8
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="m"} 950.0
"""

TWO_LABEL_SETS_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b"} 4
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 1
vllm:num_requests_waiting{model_name="b"} 2
"""


@dataclass(frozen=True)
class Reading:
    """What a page built by `trtllm_page` or `xllm_page` says."""

    running: float = 5.0
    waiting: float = 2.0
    kv: float = 0.375
    generated: float = 1234.0


_OBSERVED = (0.02, 0.3, 1.7)  # seconds each histogram of a built page holds


def _histogram(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> None:
    """A latency histogram with a few observations: the bulk of a real page."""
    histogram = Histogram(name, "Latency.", list(labels), registry=registry)
    for seconds in _OBSERVED:
        (histogram.labels(**labels) if labels else histogram).observe(seconds)


def trtllm_page(
    reading: Reading,
    *,
    max_active: float | None = 64.0,
    max_static: float | None = 256.0,
    engine_type: str = "pytorch",
) -> str:
    """A `trtllm-serve` page in its exposition shape (tensorrt_llm/metrics/collector.py): names
    prefixed `trtllm_`, labelled by model_name and engine_type, counters and histograms around
    the gauges the gateway reads."""
    registry = CollectorRegistry()
    labels = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine_type": engine_type}
    names = list(labels)

    def gauge(name: str, value: float) -> None:
        Gauge(name, f"{name}.", names, registry=registry).labels(**labels).set(value)

    Counter(
        "trtllm_request_success",
        "Finished requests.",
        [*names, "finished_reason"],
        registry=registry,
    ).labels(**labels, finished_reason="stop").inc(42)
    _histogram(registry, "trtllm_e2e_request_latency_seconds", labels)
    _histogram(registry, "trtllm_time_to_first_token_seconds", labels)
    _histogram(registry, "trtllm_request_queue_time_seconds", labels)
    gauge("trtllm_num_requests_running", reading.running)
    gauge("trtllm_num_requests_waiting", reading.waiting)
    gauge("trtllm_kv_cache_utilization", reading.kv)
    Counter("trtllm_generation_tokens", "Generated tokens.", names, registry=registry).labels(
        **labels
    ).inc(reading.generated)
    if max_active is not None:
        gauge("trtllm_max_num_active_requests", max_active)
    if max_static is not None:
        gauge("trtllm_max_batch_size_static", max_static)
    _histogram(registry, "trtllm_time_per_output_token_seconds", labels)
    return generate_latest(registry).decode()


class _NamedCounter:
    """A counter whose sample is named exactly `name`, as xLLM's C++ exporter writes it
    (prometheus_client's `Counter` appends `_total` to every counter name)."""

    def __init__(self, name: str, value: float) -> None:
        self.name, self.value = name, value

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, "Generated tokens.", "counter")
        metric.add_sample(self.name, {}, self.value)
        return [metric]


def xllm_page(
    reading: Reading,
    *,
    kv_name: str = "kv_cache_utilization_perc",
    generated_name: str = "num_generated_tokens_total",
) -> str:
    """An xLLM page in its exposition shape (common/metrics.cpp): names without a prefix, the KV
    gauge a fraction whatever its name says, the token counter under either of its names."""
    registry = CollectorRegistry()

    def gauge(name: str, value: float) -> None:
        Gauge(name, f"{name}.", registry=registry).set(value)

    _histogram(registry, "time_to_first_token_latency_milliseconds", {})
    gauge("num_running_requests", reading.running)
    gauge("num_waiting_requests", reading.waiting)
    gauge(kv_name, reading.kv)
    registry.register(_NamedCounter(generated_name, reading.generated))
    _histogram(registry, "inter_token_latency_milliseconds", {})
    return generate_latest(registry).decode()


# --- parse_engine_metrics -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM_TEXT, EngineMetrics(running=7.0, waiting=2.0, kv_usage=0.4375)),
        (OLD_VLLM_TEXT, EngineMetrics(running=4.0, waiting=0.0, kv_usage=0.25)),
        (SGLANG_TEXT, EngineMetrics(running=3.0, waiting=1.0, kv_usage=0.8)),
        (TWO_LABEL_SETS_TEXT, EngineMetrics(running=7.0, waiting=3.0, kv_usage=None)),
        (
            "vllm:kv_cache_usage_perc 0.5\nvllm:gpu_cache_usage_perc 0.9\n",
            EngineMetrics(kv_usage=0.5),
        ),
        (
            "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
            "vllm:kv_cache_usage_perc NaN\n",
            EngineMetrics(running=2.0, waiting=1.0, kv_usage=None),
        ),
        (
            "vllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.3\n",
            EngineMetrics(kv_usage=0.3),
        ),
        ("vllm:num_requests_waiting NaN\n", EngineMetrics()),
        ("", EngineMetrics()),
        ("# HELP up ok\n# TYPE up gauge\nup 1\nprocess_open_fds 12\n", EngineMetrics()),
        # A zero is a value, not a missing metric.
        (
            "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            "vllm:kv_cache_usage_perc 0\n",
            EngineMetrics(running=0.0, waiting=0.0, kv_usage=0.0),
        ),
    ],
    ids=[
        "vllm-realistic",
        "vllm-old-gpu-cache-name",
        "sglang",
        "two-label-sets-summed",
        "new-kv-name-wins",
        "nan-kv-is-missing",
        "nan-new-kv-falls-back-to-old-name",
        "nan-only-is-missing",
        "empty",
        "unrelated-metrics-only",
        "zeros-are-values",
    ],
)
def test_parse_engine_metrics(text: str, expected: EngineMetrics) -> None:
    assert parse_engine_metrics(text) == expected


def test_cpu_kv_usage_is_read_where_vllm_exports_it() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.4\n"
        "# TYPE vllm:cpu_cache_usage_perc gauge\nvllm:cpu_cache_usage_perc 0.25\n"
    )
    metrics = parse_engine_metrics(text)
    assert (metrics.kv_usage, metrics.cpu_kv_usage) == (0.4, 0.25)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "# TYPE vllm:generation_tokens counter\n"
            'vllm:generation_tokens_total{model_name="m"} 1234.0\n'
            'vllm:generation_tokens_created{model_name="m"} 1.7e9\n',
            1234.0,
            id="vllm",
        ),
        pytest.param(
            'sglang:generation_tokens_total{model_name="m",tp="0"} 10.0\n'
            'sglang:generation_tokens_total{model_name="m",tp="1"} 10.0\n',
            10.0,
            id="sglang-tensor-parallel-ranks-count-once",
        ),
        pytest.param(
            'vllm:generation_tokens_total{engine="0"} 5\n'
            'vllm:generation_tokens_total{engine="1"} 7\n',
            12.0,
            id="data-parallel-engines-add-up",
        ),
        pytest.param("vllm:num_requests_running 1\n", None, id="not-exported"),
    ],
)
def test_the_engines_generated_token_counter_is_read(text: str, expected: float | None) -> None:
    assert parse_engine_metrics(text).generation_tokens == expected


def _expected(
    reading: Reading, max_batch: float | None = None, *, histograms: bool = False
) -> EngineMetrics:
    """What a built page parses to; `histograms`: its queue-time and per-token latency
    histograms are read too (TensorRT-LLM exports both)."""
    held = (sum(_OBSERVED), float(len(_OBSERVED))) if histograms else (None, None)
    return EngineMetrics(
        running=reading.running,
        waiting=reading.waiting,
        kv_usage=reading.kv,
        generation_tokens=reading.generated,
        max_batch=max_batch,
        queue_time_sum=held[0],
        queue_time_count=held[1],
        token_latency_sum=held[0],
        token_latency_count=held[1],
    )


@pytest.mark.parametrize(
    ("max_active", "max_static", "cap"),
    [
        pytest.param(64.0, 256.0, 64.0, id="max-active-requests"),
        pytest.param(None, 256.0, 256.0, id="static-batch-size-else"),
        pytest.param(0.0, 256.0, 256.0, id="zero-active-is-no-cap"),
        pytest.param(None, None, None, id="no-cap-exported"),
    ],
)
def test_a_tensorrt_llm_page_is_read(
    max_active: float | None, max_static: float | None, cap: float | None
) -> None:
    reading = Reading(running=9.0, waiting=3.0, kv=0.625, generated=98765.0)
    page = trtllm_page(reading, max_active=max_active, max_static=max_static)
    assert "# TYPE trtllm_num_requests_running gauge" in page  # the page's real shape
    assert parse_engine_metrics(page) == _expected(reading, cap, histograms=True)


@pytest.mark.parametrize("kv_name", ["kv_cache_utilization_perc", "kv_cache_utilization"])
@pytest.mark.parametrize(
    "generated_name", ["num_generated_tokens_total", "num_processing_tokens_total_generated"]
)
def test_an_xllm_page_is_read(kv_name: str, generated_name: str) -> None:
    reading = Reading(running=4.0, waiting=1.0, kv=0.5, generated=4321.0)
    page = xllm_page(reading, kv_name=kv_name, generated_name=generated_name)
    assert parse_engine_metrics(page) == _expected(reading)


def test_vllm_names_win_over_engines_read_after_it() -> None:
    vllm = VLLM_TEXT + f"vllm:generation_tokens_total{{{_L}}} 77.0\n"
    page = vllm + xllm_page(Reading(running=1.0, waiting=0.0, kv=0.9, generated=1.0))
    assert parse_engine_metrics(page) == parse_engine_metrics(vllm)


def test_a_longer_name_that_begins_with_a_wanted_one_is_not_read_as_it() -> None:
    """xLLM's names have no prefix: the scan for `num_running_requests` also finds lines of
    metrics named after it, and only the exact name counts."""
    text = (
        'num_running_requests_per_dp{dp="0"} 90\n'
        "num_running_requests 3\n"
        'kv_cache_utilization_perc_bucket{le="0.5"} 7\n'
        "kv_cache_utilization 0.75\n"
        "kv_cache_utilization_perc 0.25\n"
        "num_waiting_requests_total 50\n"
    )
    assert parse_engine_metrics(text) == EngineMetrics(running=3.0, kv_usage=0.25)


def test_kv_usage_of_two_engines_stays_a_fraction() -> None:
    text = (
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.6\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.7\n'
    )
    # Data-parallel engines share the load: the pod's usage is their mean, not their sum.
    assert parse_engine_metrics(text).kv_usage == pytest.approx(0.65)


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_running{model_name="m" 3\n',
        'vllm:num_requests_running{model_name="m"} three\n',
    ],
    ids=["unterminated-labels", "non-numeric-value"],
)
def test_parse_engine_metrics_rejects_garbled_wanted_lines(text: str) -> None:
    # The scraper catches ValueError (and only that, besides transport errors) as a failed scrape.
    with pytest.raises(ValueError):
        parse_engine_metrics(text)


@pytest.mark.parametrize(
    "text",
    ["<html><body>Not Found</body></html>\n", "this is not metrics\n", '{"running": 3}'],
    ids=["html-page", "prose", "json"],
)
def test_pages_without_engine_metrics_parse_to_nothing(text: str) -> None:
    # Only the wanted sample lines are parsed; the scraper counts an empty result as a failure.
    assert parse_engine_metrics(text) == EngineMetrics()


def test_only_wanted_lines_are_parsed() -> None:
    # A broken line of another family no longer spoils the page (nor costs parse time).
    text = (
        "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 4\n'
        'vllm:some_histogram_bucket{le="+Inf" BROKEN\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )
    assert parse_engine_metrics(text) == EngineMetrics(running=4.0, kv_usage=0.25)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("vlm:_num{}=\"', \n#HELPTYPE0.5NaN+Inf-\\\t"))))
def test_parse_engine_metrics_raises_nothing_but_value_error(text: str) -> None:
    try:
        result = parse_engine_metrics(text)
    except ValueError:
        return  # a failed scrape, which the scraper counts
    for value in (result.running, result.waiting, result.kv_usage):
        assert value is None or isinstance(value, float)


def test_every_wanted_name_and_only_it_is_read() -> None:
    """The names are matched as a prefix tree (`_name_pattern`): each wanted name is read, and
    a longer name that starts with it, or a shorter one it starts with, is not."""
    for name in sorted(_WANTED):
        page = (
            f'{name}{{engine="0"}} 3\n{name}_extra{{engine="0"}} 99\n{name[:-1]} 98\n'
            f"# {name} 97\n{name}\t5\n"
        )
        found = _WANTED_SAMPLE.findall("\n" + page)
        assert [(n, rest.strip()) for n, _, rest in found] == [(name, "3"), (name, "5")], name


# --- MetricsScraper against real HTTP servers ---------------------------------------------------


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Engine:
    """A real /metrics endpoint whose reply the test controls."""

    port: int
    status: int = 200
    body: str = VLLM_TEXT
    hits: int = 0
    hang: bool = False  # answer nothing (a hung engine): the scrape times out


ServeFn = Callable[[Engine], Awaitable[Engine]]


@pytest.fixture
def serve(serve_app: ServeApp) -> ServeFn:
    """Serves an `Engine`'s /metrics on loopback and sets its port."""

    async def start(engine: Engine) -> Engine:
        async def metrics(_: web.Request) -> web.Response:
            engine.hits += 1
            if engine.hang:
                await asyncio.sleep(30.0)
            if engine.status != 200:
                return web.Response(status=engine.status, text="boom")
            return web.Response(text=engine.body, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        engine.port = await serve_app(app)
        return engine

    return start


def _pod(name: str, port: int, address: str = "127.0.0.1") -> Pod:
    return Pod(
        name=name, namespace="ns", model=MODEL, address=address, port=port, metrics_port=port
    )


@dataclass
class Fleet:
    pool: PodPool
    scraper: MetricsScraper
    clock: FakeClock
    a: Pod
    b: Pod
    c: Pod
    engine_a: Engine
    engine_b: Engine


@pytest_asyncio.fixture
async def fleet(serve: ServeFn, reserved_port: int) -> Fleet:
    engine_a = await serve(Engine(port=0))
    engine_b = await serve(Engine(port=0, status=500))
    a, b, c = _pod("a", engine_a.port), _pod("b", engine_b.port), _pod("c", reserved_port)
    pool = PodPool(CapacityEstimator(window_s=60.0, tau_s=10.0), metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([a, b, c])
    clock = FakeClock()
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=2.0, clock=clock)
    return Fleet(pool, scraper, clock, a, b, c, engine_a, engine_b)


def _one_pod_scraper(pod: Pod) -> tuple[PodPool, MetricsScraper]:
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([pod])
    return pool, MetricsScraper(pool, interval_s=1.0, timeout_s=2.0, clock=FakeClock())


def _by_key(pool: PodPool, now: float) -> dict[str, tuple[float | None, float | None]]:
    return {c.pod.key: (c.waiting, c.kv_usage) for c in pool.candidates(MODEL, now)}


async def test_tick_records_good_pod_and_counts_failing_ones(fleet: Fleet) -> None:
    """a answers its page, b answers 500 (alive, page of no use), c refuses the connection."""
    await fleet.scraper.tick()

    assert fleet.engine_a.hits == 1 and fleet.engine_b.hits == 1
    a, b, c = fleet.a.key, fleet.b.key, fleet.c.key
    assert fleet.scraper.errors_total == {(b, "unusable"): 1, (c, "unreachable"): 1}
    now = fleet.clock.now
    # c is out of rotation; b stays in it, with no engine metrics (routed by in-flight counts).
    assert _by_key(fleet.pool, now) == {a: (2.0, 0.4375), b: (None, None)}
    pods = fleet.pool.snapshot(now)["pods"]
    assert pods[a]["engine"] == {"running": 7.0, "waiting": 2.0, "kv_usage": 0.4375, "age_s": 0}
    assert pods[b]["engine"] is None and pods[c]["engine"] is None
    assert [k for k, v in pods.items() if v["unreachable"]] == [c]
    assert {k: v["metrics_unusable"] for k, v in pods.items()} == {
        a: None,
        b: "HTTP 500 Internal Server Error",
        c: None,
    }

    # Only the pod that did not answer is out: requests go to both others by their counts.
    strategy = build_strategies()["least-request"]
    leases = []
    for _ in range(6):
        answer = strategy.admit(
            fleet.pool.candidates(MODEL, now), RequestInfo(MODEL), random.Random(0), now
        )
        assert isinstance(answer, Route) and answer.candidate.pod != fleet.c
        leases.append(fleet.pool.acquire(answer.candidate.pod))
    assert (fleet.pool.inflight(a), fleet.pool.inflight(b)) == (3, 3)

    await fleet.scraper.tick()
    assert fleet.scraper.errors_total == {(b, "unusable"): 2, (c, "unreachable"): 2}


async def test_a_pod_that_answers_again_comes_back_and_one_that_stops_leaves(fleet: Fleet) -> None:
    """Unreachable, then answering with a page of no use: back in rotation; then refusing
    again: out."""
    await fleet.scraper.tick()
    c = fleet.c.key
    assert fleet.pool.unreachable(c)
    fleet.pool.set_pods(
        [
            fleet.a,
            fleet.b,
            dataclasses.replace(
                fleet.c, port=fleet.engine_b.port, metrics_port=fleet.engine_b.port
            ),
        ]
    )
    await fleet.scraper.tick()
    assert not fleet.pool.unreachable(c)
    assert c in _by_key(fleet.pool, fleet.clock.now)
    fleet.pool.set_pods([fleet.a, fleet.b, fleet.c])  # its old, refused address
    await fleet.scraper.tick()
    assert fleet.pool.unreachable(c) and c not in _by_key(fleet.pool, fleet.clock.now)


async def test_garbage_body_counts_as_an_unusable_scrape(serve: ServeFn) -> None:
    engine = await serve(Engine(port=0, body="<html><body>Not Found</body></html>\n"))
    pod = _pod("g", engine.port)
    pool, scraper = _one_pod_scraper(pod)

    await scraper.tick()

    assert engine.hits == 2  # asked by name, then for the whole page in case that holds more
    assert scraper.errors_total == {(pod.key, "unusable"): 1}
    described = pool.snapshot(100.0)["pods"][pod.key]
    assert described["engine"] is None and not described["unreachable"]
    assert described["metrics_unusable"] == "no known engine metric on the page"


@pytest.mark.parametrize(
    ("age_s", "visible"),
    [(0.0, True), (MAX_AGE_S, True), (MAX_AGE_S + 0.5, False), (60.0, False)],
    ids=["fresh", "exactly-max-age", "just-stale", "long-stale"],
)
async def test_stale_metrics_are_hidden_from_strategies(
    fleet: Fleet, age_s: float, visible: bool
) -> None:
    scraped_at = fleet.clock.now
    await fleet.scraper.tick()
    fleet.clock.now = scraped_at + age_s

    expected = (2.0, 0.4375) if visible else (None, None)
    assert _by_key(fleet.pool, fleet.clock.now)[fleet.a.key] == expected


async def test_failing_scrape_keeps_old_metrics_until_they_go_stale(fleet: Fleet) -> None:
    await fleet.scraper.tick()
    first = fleet.clock.now
    fleet.engine_a.status = 503
    fleet.clock.now = first + 2.0
    await fleet.scraper.tick()

    assert fleet.scraper.errors_total[(fleet.a.key, "unusable")] == 1
    # Still within max age of the last good scrape: visible.
    assert _by_key(fleet.pool, fleet.clock.now)[fleet.a.key] == (2.0, 0.4375)
    # The failed tick did not refresh the timestamp: past max age of the first scrape, hidden.
    assert _by_key(fleet.pool, first + MAX_AGE_S + 0.5)[fleet.a.key] == (None, None)

    # Recovery: a good scrape with new values is recorded at the new time.
    fleet.engine_a.status = 200
    fleet.engine_a.body = "vllm:num_requests_waiting 5\nvllm:kv_cache_usage_perc 0.9\n"
    fleet.clock.now = first + 10.0
    await fleet.scraper.tick()
    assert _by_key(fleet.pool, fleet.clock.now)[fleet.a.key] == (5.0, 0.9)
    assert fleet.scraper.errors_total[(fleet.a.key, "unusable")] == 1
    assert fleet.pool.snapshot(fleet.clock.now)["pods"][fleet.a.key]["metrics_unusable"] is None


async def test_tick_refreshes_capacity(fleet: Fleet) -> None:
    pool, key = fleet.pool, fleet.a.key
    await fleet.scraper.tick()  # first refresh: the window's base
    assert pool.capacity(key) is None

    lease = pool.acquire(fleet.a)
    assert pool.inflight(key) == 1
    assert lease.release(500) is True
    assert lease.release(500) is False  # exactly once
    assert pool.inflight(key) == 0
    assert pool.output_tokens_total(key) == 500
    assert pool.capacity(key) is None  # counted, but not a rate until the next refresh

    fleet.clock.now += 10.0
    await fleet.scraper.tick()
    assert pool.capacity(key) == pytest.approx(50.0)
    assert pool.capacity(fleet.b.key) is None  # no tokens, no estimate
    assert next(
        c for c in pool.candidates(MODEL, fleet.clock.now) if c.pod.key == key
    ).capacity == (pytest.approx(50.0))


async def test_tick_with_no_pods_still_refreshes_capacity() -> None:
    estimator = CapacityEstimator(window_s=60.0, tau_s=10.0)
    pool = PodPool(estimator)
    clock = FakeClock(0.0)
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=1.0, clock=clock)
    estimator.add_tokens("gone/pod", 0)
    await scraper.tick()
    estimator.add_tokens("gone/pod", 100)
    clock.now = 4.0
    await scraper.tick()
    assert estimator.estimate("gone/pod") == pytest.approx(25.0)
    assert scraper.errors_total == {}


async def test_ipv6_pod_address_is_bracketed(serve_app: ServeApp) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    app = web.Application()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 4\n")

    app.router.add_get("/metrics", metrics)
    try:
        port = await serve_app(app, "::1")
    except OSError:
        pytest.skip("cannot bind ::1")
    pod = _pod("v6", port, address="::1")
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([pod])
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=2.0, clock=FakeClock())
    await scraper.tick()
    assert scraper.errors_total == {}
    assert _by_key(pool, 100.0)[pod.key] == (4.0, None)


async def test_a_large_page_is_read_whole(serve: ServeFn) -> None:
    """A real vLLM page is big and arrives in many socket reads; the wanted lines may be last."""
    filler = "".join(f'vllm:some_histogram_bucket{{le="{i}"}} {i}\n' for i in range(60000))
    body = (
        filler
        + 'vllm:num_requests_running{model_name="m"} 5\n'
        + 'vllm:num_requests_waiting{model_name="m"} 2\n'
        + 'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    assert len(body) > 2_000_000
    engine = await serve(Engine(port=0, body=body))
    pod = _pod("big", engine.port)
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([pod])
    clock = FakeClock()
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=5.0, clock=clock)
    await scraper.tick()
    assert scraper.errors_total == {}
    candidate = pool.candidates(pod.model, clock())[0]
    assert (candidate.running, candidate.waiting, candidate.kv_usage) == (0, 2.0, 0.5)
    assert pool.snapshot(clock())["pods"][pod.key]["engine"]["running"] == 5.0


@dataclass
class ByNameEngine:
    """An engine page served by prometheus_client's own restricted registry, as vLLM, SGLang
    and TensorRT-LLM serve theirs: `name[]` query parameters narrow the page to those samples.
    Records what each scrape asked for."""

    registry: CollectorRegistry
    asked: list[list[str]]
    encodings: list[str]
    served: list[str]


async def _serve_by_name(
    serve_app: ServeApp, registry: CollectorRegistry
) -> tuple[int, ByNameEngine]:
    engine = ByNameEngine(registry, [], [], [])

    async def metrics(request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        engine.asked.append(names)
        engine.encodings.append(request.headers.get("Accept-Encoding", ""))
        page = generate_latest(registry.restricted_registry(names) if names else registry)
        engine.served.append(page.decode())
        return web.Response(body=page, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return await serve_app(app), engine


def _vllm_registry() -> CollectorRegistry:
    """vLLM's default registry: prometheus_client metrics, which declare their names."""
    registry = CollectorRegistry(auto_describe=True)
    labels = {"engine": "0", "model_name": "m"}
    for name, value in (
        ("vllm:num_requests_running", 5.0),
        ("vllm:num_requests_waiting", 1.0),
        ("vllm:kv_cache_usage_perc", 0.25),
    ):
        Gauge(name, name, list(labels), registry=registry).labels(**labels).set(value)
    Histogram("vllm:e2e_request_latency_seconds", "E2E.", list(labels), registry=registry).labels(
        **labels
    ).observe(1.5)
    return registry


async def test_the_scraper_asks_for_its_samples_by_name_uncompressed(serve_app: ServeApp) -> None:
    port, engine = await _serve_by_name(serve_app, _vllm_registry())
    pod = _pod("v", port)
    pool, scraper = _one_pod_scraper(pod)
    await scraper.tick()
    assert scraper.errors_total == {}
    assert "vllm:num_requests_running" in engine.asked[0]
    assert "vllm:e2e_request_latency_seconds_bucket" not in engine.asked[0]
    assert engine.encodings == ["identity"]  # prometheus_client gzips a page when asked
    assert "vllm:e2e_request_latency_seconds" not in engine.served[0]  # the page is narrowed
    engine_view = pool.snapshot(scraper._clock())["pods"][pod.key]["engine"]
    assert (engine_view["running"], engine_view["waiting"], engine_view["kv_usage"]) == (
        5.0,
        1.0,
        0.25,
    )


class _Unnamed:
    """A collector that declares no names (vLLM's multiprocess collector is one): a
    prometheus_client registry leaves its samples out of a page asked for by name."""

    def collect(self) -> list[Metric]:
        metric = Metric("vllm:num_requests_running", "Running.", "gauge")
        metric.add_sample("vllm:num_requests_running", {"model_name": "m"}, 3.0)
        return [metric]


async def test_an_engine_that_drops_named_samples_is_read_whole_from_then_on(
    serve_app: ServeApp,
) -> None:
    registry = CollectorRegistry()
    registry.register(_Unnamed())
    port, engine = await _serve_by_name(serve_app, registry)
    pod = _pod("mp", port)
    pool, scraper = _one_pod_scraper(pod)
    await scraper.tick()
    assert scraper.errors_total == {}
    assert [bool(names) for names in engine.asked] == [True, False]  # by name, then whole
    assert pool.snapshot(scraper._clock())["pods"][pod.key]["engine"]["running"] == 3.0
    await scraper.tick()
    assert [bool(names) for names in engine.asked] == [True, False, False]


async def test_a_redirect_is_not_followed(serve: ServeFn, serve_app: ServeApp) -> None:
    """A /metrics answering 302 must not make the gateway fetch the address it names."""
    target = await serve(Engine(port=0))

    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.1:{target.port}/metrics")

    app = web.Application()
    app.router.add_get("/metrics", redirect)
    port = await serve_app(app)
    pod = _pod("r", port)
    pool, scraper = _one_pod_scraper(pod)
    await scraper.tick()
    assert target.hits == 0
    assert scraper.errors_total == {(pod.key, "unusable"): 1}  # an answer: still in rotation
    assert not pool.unreachable(pod.key)


async def test_a_failed_request_probes_its_engine_at_once(serve: ServeFn) -> None:
    """A 5xx on a pod makes the scraper scrape it now, not at its next tick: an engine that
    stopped answering leaves rotation after one failed request; one that answers (a 503 page
    included) stays."""
    engine = await serve(Engine(port=0))
    a, b = _pod("a", engine.port), _pod("b", engine.port)
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([a, b])
    scraper = MetricsScraper(pool, interval_s=3600.0, timeout_s=0.3)  # one tick, at start
    pool.on_failure = scraper.probe
    running = asyncio.create_task(scraper.run())
    try:
        await eventually(lambda: engine.hits == 2, "the first tick")
        engine.status = 503  # the engine answers its page with an error: alive
        pool.acquire(a).release(0, 503, 1.0)
        await eventually(lambda: engine.hits == 3, "the probe of a")
        await eventually(lambda: pool.metrics_unusable(a.key) is not None, "a flagged")
        assert not pool.unreachable(a.key)
        engine.hang = True  # the engine behind `a` stops answering
        pool.acquire(a).release(0, 503, 1.0)
        await eventually(lambda: pool.unreachable(a.key), "the probe of a")
        assert engine.hits == 4 and not pool.unreachable(b.key)
        pool.acquire(a).release(0, 503, 1.0)  # another failure while out: probed again
        await eventually(lambda: engine.hits == 5, "a second probe")
        await eventually(lambda: not scraper._probing, "the probe to time out")
        engine.hang, engine.status = False, 200
        pool.acquire(a).release(0, 502, 1.0)
        await eventually(lambda: not pool.unreachable(a.key), "a back once it answers")
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_a_pod_whose_streams_went_silent_is_probed_between_ticks(serve: ServeFn) -> None:
    """A hung engine stops its streams before its next scrape is due: once all of a pod's open
    streams are quiet for a scrape timeout, the stall watch probes it, and an engine that does
    not answer leaves rotation then. One that answers (streams stalled behind a long prefill)
    stays and is probed once per silence."""
    hung, alive = await serve(Engine(port=0)), await serve(Engine(port=0))
    a, b = _pod("a", hung.port), _pod("b", alive.port)
    pool = PodPool(CapacityEstimator(), metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([a, b])
    scraper = MetricsScraper(pool, interval_s=3600.0, timeout_s=0.3)  # one tick, at start
    running = asyncio.create_task(scraper.run())
    try:
        await eventually(lambda: hung.hits == 1 and alive.hits == 1, "the first tick")
        for pod in (a, b):
            pool.stream_started(pod.key, 16)
            pool.stream_alive(pod.key, time.monotonic())
        hung.hang = True  # `a` stops: no chunk, no scrape answer
        # Within the wait, not at the hour's tick: a silence (0.3 s) and a probe's timeout.
        await eventually(lambda: pool.unreachable(a.key), "a out of rotation")
        assert hung.hits == 2
        await eventually(lambda: alive.hits == 2, "the probe of b, silent too")
        assert not pool.unreachable(b.key)  # it answered: it stays
        await asyncio.sleep(0.6)
        assert alive.hits == 2  # the same silence is not probed again
        pool.stream_alive(b.key, time.monotonic())  # a chunk, then silence anew
        await eventually(lambda: alive.hits == 3, "a probe of the new silence")
        pool.stream_ended(b.key, 16)
        pool.stream_alive(b.key, time.monotonic())
        await asyncio.sleep(0.6)
        assert alive.hits == 3  # no open stream: nothing to watch
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_a_tensorrt_llm_pod_is_scraped_at_its_own_path(serve_app: ServeApp) -> None:
    """`trtllm-serve` answers /prometheus/metrics and 404 at /metrics: a pod discovered with
    engine `trtllm` is scraped there, and its page's values reach the pool (running, waiting,
    KV usage, the token counter, and the batch cap the engine exports)."""
    readings = [Reading(running=6.0, waiting=1.0, kv=0.25, generated=1000.0)]
    cap = 48
    paths: list[str] = []

    async def page(request: web.Request) -> web.Response:
        paths.append(request.path)
        return web.Response(
            text=trtllm_page(readings[-1], max_active=cap), content_type="text/plain"
        )

    app = web.Application()
    app.router.add_get("/prometheus/metrics", page)
    port = await serve_app(app)
    entries = [
        {"name": "trt", "address": "127.0.0.1", "port": port, "engine": "trtllm"},
        # The same page scraped where other engines serve theirs: 404, a failed scrape.
        {"name": "vl", "address": "127.0.0.1", "port": port + 1, "metricsPort": port},
    ]
    trt, elsewhere = parse_pods({"models": {MODEL: {"pods": entries}}}, "pods.yaml")
    estimator = CapacityEstimator()
    pool = PodPool(estimator, metrics_max_age_s=MAX_AGE_S)
    pool.set_pods([trt, elsewhere])
    clock = FakeClock()
    scraper = MetricsScraper(pool, interval_s=1.0, timeout_s=2.0, clock=clock)

    await scraper.tick()
    readings.append(Reading(running=7.0, waiting=3.0, kv=0.5, generated=1250.0))
    clock.now += 1.0
    await scraper.tick()

    assert paths == ["/prometheus/metrics"] * 2
    assert scraper.errors_total == {(elsewhere.key, "unusable"): 2}
    last = readings[-1]
    snapshot = pool.snapshot(clock.now)["pods"][trt.key]
    engine = {k: snapshot["engine"][k] for k in ("running", "waiting", "kv_usage")}
    assert engine == {"running": last.running, "waiting": last.waiting, "kv_usage": last.kv}
    assert (snapshot["saturation"], snapshot["saturation_source"]) == (cap, "engine")
    assert snapshot["token_source"] == "engine"
    assert estimator.total(trt.key) == last.generated - readings[0].generated
    # The other pod answers 404 there: in rotation, without engine metrics.
    candidate, other = pool.candidates(MODEL, clock.now)
    assert (candidate.pod, candidate.waiting, candidate.kv_usage) == (trt, last.waiting, last.kv)
    assert (other.pod, other.waiting, other.kv_usage) == (elsewhere, None, None)
    assert candidate.saturation == cap  # exact, as a declared cap


def test_vllm_queue_time_and_token_latency_histograms_are_read_by_sum_and_count() -> None:
    """The newer inter-token latency name wins over the deprecated time-per-output-token one;
    data-parallel label sets add up."""
    page = (
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"} 4.0\n'
        'vllm:request_queue_time_seconds_sum{engine="0"} 1.5\n'
        'vllm:request_queue_time_seconds_count{engine="0"} 4.0\n'
        'vllm:request_queue_time_seconds_sum{engine="1"} 0.5\n'
        'vllm:request_queue_time_seconds_count{engine="1"} 6.0\n'
        'vllm:time_per_output_token_seconds_sum{engine="0"} 99.0\n'
        'vllm:time_per_output_token_seconds_count{engine="0"} 99.0\n'
        'vllm:inter_token_latency_seconds_sum{engine="0"} 2.5\n'
        'vllm:inter_token_latency_seconds_count{engine="0"} 100.0\n'
    )
    m = parse_engine_metrics(page)
    assert (m.queue_time_sum, m.queue_time_count) == (2.0, 10.0)
    assert (m.token_latency_sum, m.token_latency_count) == (2.5, 100.0)
    old = parse_engine_metrics(page.replace("inter_token_latency", "x"))
    assert (old.token_latency_sum, old.token_latency_count) == (99.0, 99.0)


def test_a_histogram_pair_comes_from_one_family_and_tabs_end_a_name() -> None:
    """A NaN sum in the newer family must not pair the older family's sum with the newer's
    count; a label-less sample separated by a tab is read as by prometheus_client."""
    page = (
        "vllm:inter_token_latency_seconds_sum NaN\n"
        "vllm:inter_token_latency_seconds_count 100\n"
        "vllm:time_per_output_token_seconds_sum 50\n"
        "vllm:time_per_output_token_seconds_count 10\n"
        "vllm:num_requests_running\t3\n"
    )
    m = parse_engine_metrics(page)
    assert (m.token_latency_sum, m.token_latency_count) == (50.0, 10.0)
    assert m.running == 3.0


def test_only_vllms_token_counter_counts_step_by_step() -> None:
    """SGLang adds a request's tokens when it finishes: one scrape's increase is no speed."""
    assert parse_engine_metrics("vllm:generation_tokens_total 5\n").generation_tokens_stepwise
    sglang = parse_engine_metrics("sglang:generation_tokens_total 5\n")
    assert sglang.generation_tokens == 5.0 and not sglang.generation_tokens_stepwise
    assert not parse_engine_metrics("vllm:num_requests_running 1\n").generation_tokens_stepwise


@pytest.mark.parametrize(
    ("line", "value"),
    [
        ('vllm:num_requests_running{model_name="a} b"} 3 1700000000000', 3.0),
        ("vllm:num_requests_running\t4", 4.0),
        ('vllm:num_requests_running{model_name="m",} +Inf', math.inf),
    ],
    ids=["brace-and-space-in-a-label-value-and-a-timestamp", "tab", "trailing-comma-inf"],
)
def test_a_value_is_read_after_the_series_whatever_its_labels_hold(line: str, value: float) -> None:
    assert parse_engine_metrics(line + "\n").running == value


def test_a_series_seen_before_is_read_with_its_new_value() -> None:
    """Label sets are parsed once and remembered; the value is read anew on every page."""
    first = parse_engine_metrics('vllm:num_requests_running{model_name="m"} 3\n')
    second = parse_engine_metrics('vllm:num_requests_running{model_name="m"} 7\n')
    assert (first.running, second.running) == (3.0, 7.0)


def test_pages_of_other_engines_in_turn_each_read_by_their_own_names() -> None:
    """Which sample each field takes is worked out once per set of names found: pages of
    another engine, or one whose NaN sample drops a name, must not read another page's."""
    vllm, sglang = parse_engine_metrics(VLLM_TEXT), parse_engine_metrics(SGLANG_TEXT)
    nan_kv = 'vllm:num_requests_running{model_name="m"} 4\nvllm:gpu_cache_usage_perc{a="b"} NaN\n'
    for _ in range(3):
        assert parse_engine_metrics(VLLM_TEXT) == vllm
        assert parse_engine_metrics(SGLANG_TEXT) == sglang
        read = parse_engine_metrics(nan_kv)
        assert (read.running, read.kv_usage) == (4.0, None)
    assert (sglang.running, sglang.waiting, sglang.kv_usage) == (3.0, 1.0, 0.8)
    assert vllm.running is not None and vllm != sglang
