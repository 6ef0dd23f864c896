"""Static pod discovery: the document's validation, its defaults, and the file watcher.

The watcher tests run the real `StaticFileSource.run` against a temporary file with a short poll
and wait (bounded) for what it reports: a delivery, or the log line of an ignored edit.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from plugin.adapters.discovery import StaticFileSource, load_pods_file, parse_pods
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.types import Pod
from plugin.errors import ConfigError

pytestmark = pytest.mark.component

SRC = "pods.yaml"
POLL_S = 0.02
WAIT_S = 5.0  # upper bound of every wait; a passing run waits a few polls


def _doc(*pods: Any, model: str = "m") -> dict[str, Any]:
    return {"models": {model: {"pods": list(pods)}}}


def _entry(name: str = "p0", port: Any = 8000, **extra: Any) -> dict[str, Any]:
    return {"name": name, "address": "10.0.0.1", "port": port} | extra


# --- parse_pods ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        (None, f"{SRC}: expected a mapping with a 'models' mapping"),
        ([], f"{SRC}: expected a mapping with a 'models' mapping"),
        ({}, f"{SRC}: expected a mapping with a 'models' mapping"),
        ({"models": ["m"]}, f"{SRC}: expected a mapping with a 'models' mapping"),
        ({"models": {"m": None}}, f"{SRC}: models.m.pods must be a list"),
        ({"models": {"m": {}}}, f"{SRC}: models.m.pods must be a list"),
        ({"models": {"m": {"pods": {"name": "p0"}}}}, f"{SRC}: models.m.pods must be a list"),
        (_doc("p0"), f"{SRC}: models.m.pods[0] must be a mapping"),
        (_doc({"address": "10.0.0.1", "port": 1}), f"{SRC}: models.m.pods[0].name is required"),
        (_doc({"name": "", "address": "a", "port": 1}), "models.m.pods[0].name is required"),
        (_doc({"name": "p0", "port": 1}), f"{SRC}: models.m.pods[0].address is required"),
        (_doc(_entry(port=0)), f"{SRC}: models.m.pods[0].port must be a port number, got 0"),
        (_doc(_entry(port=65536)), "models.m.pods[0].port must be a port number, got 65536"),
        (_doc(_entry(port="8000")), "models.m.pods[0].port must be a port number, got '8000'"),
        (_doc(_entry(port=True)), "models.m.pods[0].port must be a port number, got True"),
        (
            _doc({"name": "p0", "address": "10.0.0.1"}),
            "models.m.pods[0].port must be a port number",
        ),
        (_doc(_entry(address="engine.local")), "models.m.pods[0].address must be an IP address"),
        (_doc(_entry(address="10.0.0.1:8000")), "models.m.pods[0].address must be an IP address"),
        (_doc(_entry(ready="false")), "models.m.pods[0].ready must be true or false"),
        (
            _doc(_entry("p0"), _entry("p1")),
            "models.m.pods[1]: endpoint 10.0.0.1:8000 is already pod default/p0",
        ),
        (_doc(_entry(metricsPort=-1)), "models.m.pods[0].metricsPort must be a port number"),
        (
            _doc(_entry("p0"), _entry("p0", port=8001)),
            f"{SRC}: models.m.pods[1]: pod default/p0 listed twice",
        ),
        (
            {
                "models": {
                    "m1": {"pods": [_entry("p0", namespace="ns")]},
                    "m2": {"pods": [_entry("p0", namespace="ns")]},
                }
            },
            f"{SRC}: models.m2.pods[0]: pod ns/p0 listed twice",
        ),
        (_doc(_entry(labels=["gpu"])), f"{SRC}: models.m.pods[0].labels must be a mapping"),
        (_doc(_entry(labels="gpu=a100")), "models.m.pods[0].labels must be a mapping"),
    ],
    ids=[
        "doc-null",
        "doc-list",
        "models-missing",
        "models-not-mapping",
        "model-spec-null",
        "pods-missing",
        "pods-not-list",
        "entry-not-mapping",
        "name-missing",
        "name-empty",
        "address-missing",
        "port-zero",
        "port-too-big",
        "port-string",
        "port-bool",
        "port-missing",
        "address-hostname",
        "address-with-port",
        "ready-string",
        "endpoint-twice",
        "metrics-port-negative",
        "duplicate-in-model",
        "duplicate-across-models",
        "labels-list",
        "labels-string",
    ],
)
def test_parse_pods_errors_name_source_and_entry(doc: Any, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pods(doc, SRC)
    message = str(info.value)
    assert message.startswith(f"{SRC}: ")
    assert where in message


def test_parse_pods_defaults() -> None:
    (pod,) = parse_pods(_doc(_entry("p0", port=8000)), SRC)
    assert pod == Pod(
        name="p0",
        namespace="default",
        model="m",
        address="10.0.0.1",
        port=8000,
        metrics_port=8000,
        engine="vllm",
        ready=True,
        labels={},
    )
    assert pod.key == "default/p0"
    assert pod.endpoint == "10.0.0.1:8000"


def test_parse_pods_every_field() -> None:
    entry = _entry(
        "s0",
        port=30000,
        namespace="team",
        metricsPort=30001,
        engine="sglang",
        ready=False,
        labels={"gpu": "l20", "replicas": 2},
    )
    (pod,) = parse_pods(_doc(entry, model="qwen"), SRC)
    assert (pod.key, pod.model, pod.port, pod.metrics_port) == ("team/s0", "qwen", 30000, 30001)
    assert (pod.engine, pod.ready) == ("sglang", False)
    assert pod.labels == {"gpu": "l20", "replicas": "2"}  # label values become strings


def test_a_batch_cap_is_declared_per_pod_or_for_the_model() -> None:
    doc = {
        "models": {
            "m": {
                "maxNumSeqs": 128,
                "pods": [_entry("p0"), _entry("p1", port=8001, maxNumSeqs=32)],
            },
            "n": {"pods": [_entry("q0", port=8002)]},
        }
    }
    caps = {p.name: p.max_num_seqs for p in parse_pods(doc, SRC)}
    assert caps == {"p0": 128, "p1": 32, "q0": None}


@pytest.mark.parametrize("bad", [0, -4, "256", True, 2.5])
def test_a_bad_batch_cap_names_where_it_is(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"models\.m\.pods\[0\]\.maxNumSeqs must be a positive"):
        parse_pods(_doc(_entry(maxNumSeqs=bad)), SRC)
    with pytest.raises(ConfigError, match=r"models\.m\.maxNumSeqs must be a positive"):
        parse_pods({"models": {"m": {"maxNumSeqs": bad, "pods": []}}}, SRC)


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        pytest.param({}, "/metrics", id="default"),
        pytest.param({"engine": "trtllm"}, "/prometheus/metrics", id="trtllm-default"),
        pytest.param({"engine": "sglang"}, "/metrics", id="sglang-default"),
        pytest.param({"metricsPath": "/stats/prom"}, "/stats/prom", id="declared"),
        pytest.param(
            {"engine": "trtllm", "metricsPath": "/metrics"}, "/metrics", id="declared-wins"
        ),
    ],
)
def test_the_metrics_path_of_a_pod(extra: dict[str, Any], path: str) -> None:
    (pod,) = parse_pods(_doc(_entry(**extra)), SRC)
    assert pod.metrics_path == path


@pytest.mark.parametrize("bad", ["metrics", "", "http://10.0.0.1/metrics", 8000, ["/metrics"]])
def test_a_bad_metrics_path_names_where_it_is(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"^pods\.yaml: models\.m\.pods\[0\]\.metricsPath must"):
        parse_pods(_doc(_entry(metricsPath=bad)), SRC)


def test_same_name_in_two_namespaces_is_two_pods() -> None:
    pods = parse_pods(
        _doc(_entry("p0", namespace="a"), _entry("p0", port=8001, namespace="b")), SRC
    )
    assert [p.key for p in pods] == ["a/p0", "b/p0"]
    pool = PodPool(CapacityEstimator())
    pool.set_pods(pods)
    assert sorted(c.pod.key for c in pool.candidates("m", 0.0)) == ["a/p0", "b/p0"]


def test_ipv6_address_endpoint_is_bracketed() -> None:
    (pod,) = parse_pods(_doc({"name": "v6", "address": "fd00::1", "port": 8000}), SRC)
    assert pod.endpoint == "[fd00::1]:8000"


def test_two_models_keep_their_own_pods() -> None:
    doc = {
        "models": {
            "a": {"pods": [_entry("x", port=8001)]},
            "b": {"pods": [_entry("y", port=8002), _entry("z", port=8003)]},
        }
    }
    pods = parse_pods(doc, SRC)
    assert [(p.model, p.name) for p in pods] == [("a", "x"), ("b", "y"), ("b", "z")]


def test_empty_pod_list_is_valid() -> None:
    assert parse_pods(_doc(), SRC) == []


# --- load_pods_file -----------------------------------------------------------------------------


def _write(path: Path, content: dict[str, Any] | str, stamp: list[int] | None = None) -> None:
    """Write the file and give it a strictly newer mtime, as a later real edit would have."""
    text = content if isinstance(content, str) else yaml.safe_dump(content)
    path.write_text(text, encoding="utf-8")
    if stamp is not None:
        stamp[0] += 1_000_000_000
        os.utime(path, ns=(stamp[0], stamp[0]))


def test_load_pods_file_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    _write(path, _doc(_entry("p0"), _entry("p1", port=8001)))
    assert [p.key for p in load_pods_file(str(path))] == ["default/p0", "default/p1"]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read pods file"),
        ("models: [unclosed\n", "is not valid YAML"),
        ("models:\n  m:\n    pods:\n      - name: p0\n        port: 1\n", ".address is required"),
        ("", "expected a mapping with a 'models' mapping"),
    ],
    ids=["missing-file", "bad-yaml", "invalid-entry", "empty-file"],
)
def test_load_pods_file_errors_name_the_file(
    tmp_path: Path, content: str | None, fragment: str
) -> None:
    path = tmp_path / "pods.yaml"
    if content is not None:
        _write(path, content)
    with pytest.raises(ConfigError) as info:
        load_pods_file(str(path))
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_static_source_bad_file_at_start_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    _write(path, _doc(_entry("p0"), {"name": "p1", "address": "10.0.0.2", "port": "x"}))
    with pytest.raises(ConfigError, match=r"models\.m\.pods\[1\]\.port") as info:
        StaticFileSource(str(path))
    assert str(path) in str(info.value)


# --- StaticFileSource watching a file -----------------------------------------------------------


class Watch:
    """Runs a source into a real pool, recording each delivery and counting its polls."""

    def __init__(self, source: StaticFileSource, caplog: pytest.LogCaptureFixture) -> None:
        self.source = source
        self.caplog = caplog
        self.pool = PodPool(CapacityEstimator())
        self.deliveries: list[list[str]] = []
        self.polls = 0
        self._activity = asyncio.Event()
        stat = source._stat

        def counting_stat() -> tuple[int, int] | None:
            # Called once per poll; the rest of the poll runs before the source yields again,
            # so a waiter woken by this sees the poll's outcome (delivery or log line).
            self.polls += 1
            self._activity.set()
            return stat()

        source._stat = counting_stat  # type: ignore[method-assign]

    def on_update(self, pods: list[Pod]) -> None:
        self.pool.set_pods(pods)
        self.deliveries.append([p.key for p in pods])
        self._activity.set()

    async def _until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not done():
                self._activity.clear()
                await self._activity.wait()

    async def next_delivery(self) -> list[str]:
        count = len(self.deliveries)
        await self._until(lambda: len(self.deliveries) > count)
        return self.deliveries[-1]

    async def ignored_edits(self, count: int) -> None:
        """Wait until the source has logged `count` ignored edits in total."""
        await self._until(lambda: self.ignored() >= count)

    async def wait_polls(self, count: int) -> None:
        target = self.polls + count
        await self._until(lambda: self.polls >= target)

    def ignored(self) -> int:
        return sum(
            "ignoring changed pods file" in r.getMessage()
            for r in self.caplog.records
            if r.name == "plugin.adapters.discovery"
        )

    def pool_keys(self) -> list[str]:
        return sorted(p.key for p in self.pool.pods())


@pytest_asyncio.fixture
async def watched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[tuple[Watch, Path, list[int]]]:
    caplog.set_level(logging.INFO, logger="plugin.adapters.discovery")
    path = tmp_path / "pods.yaml"
    stamp = [1_700_000_000_000_000_000]
    _write(path, _doc(_entry("p0")), stamp)
    watch = Watch(StaticFileSource(str(path), poll_s=POLL_S), caplog)
    task = asyncio.create_task(watch.source.run(watch.on_update))
    try:
        assert await watch.next_delivery() == ["default/p0"]  # the first list, at once
        yield watch, path, stamp
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_good_edit_is_delivered(watched: tuple[Watch, Path, list[int]]) -> None:
    watch, path, stamp = watched
    _write(path, _doc(_entry("p0"), _entry("p1", port=8001)), stamp)
    assert await watch.next_delivery() == ["default/p0", "default/p1"]
    assert watch.pool_keys() == ["default/p0", "default/p1"]


async def test_bad_edit_is_ignored_and_last_good_list_keeps_serving(
    watched: tuple[Watch, Path, list[int]],
) -> None:
    watch, path, stamp = watched
    _write(path, _doc(_entry("p0"), _entry("p1", port=8001)), stamp)
    await watch.next_delivery()

    _write(path, "models: [unclosed\n", stamp)
    await watch.ignored_edits(1)
    _write(path, _doc(_entry("p0"), {"name": "p2", "address": "10.0.0.3", "port": -5}), stamp)
    await watch.ignored_edits(2)

    assert watch.deliveries == [["default/p0"], ["default/p0", "default/p1"]]
    assert watch.pool_keys() == ["default/p0", "default/p1"]
    assert [c.pod.key for c in watch.pool.candidates("m", 0.0)] == ["default/p0", "default/p1"]

    # A good edit after bad ones is delivered again.
    _write(path, _doc(_entry("p3", port=8003)), stamp)
    assert await watch.next_delivery() == ["default/p3"]
    assert watch.pool_keys() == ["default/p3"]


async def test_deleted_file_keeps_last_list_and_recreation_is_delivered(
    watched: tuple[Watch, Path, list[int]],
) -> None:
    watch, path, stamp = watched
    path.unlink()
    await watch.ignored_edits(1)
    assert watch.deliveries == [["default/p0"]]
    assert watch.pool_keys() == ["default/p0"]

    _write(path, _doc(_entry("p9", port=8009)), stamp)
    assert await watch.next_delivery() == ["default/p9"]


async def test_unchanged_file_is_not_redelivered(watched: tuple[Watch, Path, list[int]]) -> None:
    watch, path, stamp = watched
    await watch.wait_polls(3)
    assert watch.deliveries == [["default/p0"]]

    _write(path, "models: [unclosed\n", stamp)
    await watch.ignored_edits(1)
    await watch.wait_polls(3)
    assert watch.ignored() == 1  # the same bad file is not re-read and re-logged every poll
    assert watch.deliveries == [["default/p0"]]
