"""Kubernetes pod source: the pod parser, then the real client against a small local API server.

`FakeApiServer` speaks just enough of the pods list/watch API over real HTTP on loopback: every
change gets the next resourceVersion, goes into a history that a watch replays from the version it
asks for, and reaches every open watch whose namespace and label selector match. The test drives
what a real API server does on its own: ending watches (timeoutSeconds), bookmarks, 410 Gone (as
an ERROR event on an open watch, or as the answer to the next watch), holding a list while the
state changes, and restarting. Every wait is bounded and polls a condition.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from kubernetes import client

from plugin.adapters.kubernetes import (
    ENGINE_KEY,
    MAX_NUM_SEQS_KEY,
    METRIC_PORT_KEY,
    METRICS_PATH_KEY,
    MODEL_KEY,
    PORT_KEY,
    KubernetesSource,
    MalformedPod,
    load_client_configuration,
    pod_from_object,
    unique_endpoints,
)
from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.types import Pod
from plugin.errors import ConfigError
from tests.helpers import WAIT_S, eventually, free_port, pod_obj

pytestmark = pytest.mark.component

# Every wait polls (helpers.eventually, every 10 ms, at most WAIT_S), because the conditions live
# on both sides of a thread (the worker logs, the server counts, the loop delivers).
LOGGER = "plugin.adapters.kubernetes"
WATCH_TIMEOUT_S = 60


# --- pod_from_object ----------------------------------------------------------------------------


def test_defaults() -> None:
    pod = pod_from_object(pod_obj("p0", "team", ip="10.1.2.3"))
    assert pod == Pod(
        name="p0",
        namespace="team",
        model="m",
        address="10.1.2.3",
        port=8000,
        metrics_port=8000,
        engine="vllm",
        ready=True,
        labels={"app": "engine", MODEL_KEY: "m"},
    )
    assert pod.key == "team/p0"


def test_port_metric_port_and_engine_labels() -> None:
    labels = {PORT_KEY: "30000", METRIC_PORT_KEY: "30001", ENGINE_KEY: "sglang"}
    pod = pod_from_object(pod_obj("p0", labels=labels))
    assert pod is not None
    assert (pod.port, pod.metrics_port, pod.engine) == (30000, 30001, "sglang")


def test_metric_port_defaults_to_the_port() -> None:
    pod = pod_from_object(pod_obj("p0", labels={PORT_KEY: "9000"}))
    assert pod is not None
    assert (pod.port, pod.metrics_port) == (9000, 9000)


def test_annotation_names_the_model_when_no_label_does() -> None:
    obj = pod_obj(
        "p0", model=None, annotations={MODEL_KEY: "meta-llama/Llama-3-8B", PORT_KEY: "81"}
    )
    pod = pod_from_object(obj)
    assert pod is not None
    assert (pod.model, pod.port) == ("meta-llama/Llama-3-8B", 81)


@pytest.mark.parametrize(
    ("container", "annotations", "cap"),
    [
        pytest.param({"args": ["--model", "x", "--max-num-seqs", "128"]}, {}, 128, id="vllm-args"),
        pytest.param({"args": ["--max-num-seqs=64"]}, {}, 64, id="vllm-equals"),
        pytest.param(
            {"command": ["sh", "-c", "python3 -m sglang.launch_server --max-running-requests 48"]},
            {},
            48,
            id="sglang-in-a-shell-command",
        ),
        pytest.param({"args": ["--max-num-seqs", "many"]}, {}, None, id="not-a-number"),
        pytest.param({"args": ["--max-num-seqs"]}, {}, None, id="flag-without-value"),
        pytest.param(
            {"args": ["--max-num-seqs", "128"]}, {MAX_NUM_SEQS_KEY: "96"}, 96, id="annotation-wins"
        ),
        pytest.param({}, {MAX_NUM_SEQS_KEY: "0"}, None, id="bad-annotation-ignored"),
        pytest.param({}, {}, None, id="undeclared"),
    ],
)
def test_the_batch_cap_a_pod_declares(
    container: dict[str, Any], annotations: dict[str, str], cap: int | None
) -> None:
    obj = pod_obj("p0", annotations=annotations)
    obj["spec"]["containers"][0].update(container)
    pod = pod_from_object(obj)
    assert pod is not None and pod.max_num_seqs == cap


@pytest.mark.parametrize(
    ("engine", "annotations", "path"),
    [
        pytest.param(None, {}, "/metrics", id="default"),
        pytest.param("trtllm", {}, "/prometheus/metrics", id="trtllm-default"),
        pytest.param("xllm", {}, "/metrics", id="xllm-default"),
        pytest.param(None, {METRICS_PATH_KEY: "/stats"}, "/stats", id="annotation"),
        pytest.param("trtllm", {METRICS_PATH_KEY: "/metrics"}, "/metrics", id="annotation-wins"),
    ],
)
def test_the_metrics_path_of_a_pod(
    engine: str | None, annotations: dict[str, str], path: str
) -> None:
    labels = {ENGINE_KEY: engine} if engine else {}
    pod = pod_from_object(pod_obj("p0", labels=labels, annotations=annotations))
    assert pod is not None and pod.metrics_path == path


def test_a_bad_metrics_path_annotation_is_logged_and_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    obj = pod_obj("p0", labels={ENGINE_KEY: "trtllm"}, annotations={METRICS_PATH_KEY: "metrics"})
    pod = pod_from_object(obj)
    assert pod is not None and pod.metrics_path == "/prometheus/metrics"  # the engine's default
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert METRICS_PATH_KEY in record.getMessage() and "'metrics'" in record.getMessage()


def test_label_wins_over_annotation() -> None:
    obj = pod_obj("p0", model="from-label", annotations={MODEL_KEY: "from-annotation"})
    pod = pod_from_object(obj)
    assert pod is not None
    assert pod.model == "from-label"


def test_ipv6_pod() -> None:
    pod = pod_from_object(pod_obj("p0", ip="fd00:0::1"))
    assert pod is not None
    assert pod.endpoint == "[fd00::1]:8000"


@pytest.mark.parametrize(
    ("obj", "ready"),
    [
        (pod_obj("p", ready=True), True),
        (pod_obj("p", ready=False), False),
        (pod_obj("p", ready=None), False),
        (pod_obj("p", ready=True, deleting=True), False),
        (pod_obj("p", ready=True, phase="Pending"), True),
    ],
    ids=["ready", "not-ready", "no-conditions", "terminating", "ready-condition-decides"],
)
def test_readiness(obj: dict[str, Any], ready: bool) -> None:
    pod = pod_from_object(obj)
    assert pod is not None
    assert pod.ready is ready


@pytest.mark.parametrize(
    "obj",
    [
        pod_obj("p", model=None),
        pod_obj("p", model=""),
        pod_obj("p", ip=None),
        pod_obj("p", ip=""),
        pod_obj("p", phase="Succeeded"),
        pod_obj("p", phase="Failed"),
    ],
    ids=["no-model", "empty-model", "no-ip", "empty-ip", "succeeded", "failed"],
)
def test_pods_that_are_not_delivered(obj: dict[str, Any]) -> None:
    assert pod_from_object(obj) is None


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (pod_obj("p", labels={PORT_KEY: "http"}), f"{PORT_KEY} must be a port number, got 'http'"),
        (pod_obj("p", labels={PORT_KEY: "0"}), f"{PORT_KEY} must be a port number"),
        (pod_obj("p", labels={PORT_KEY: "65536"}), f"{PORT_KEY} must be a port number"),
        (pod_obj("p", labels={PORT_KEY: "-1"}), f"{PORT_KEY} must be a port number"),
        (pod_obj("p", labels={PORT_KEY: "8000.0"}), f"{PORT_KEY} must be a port number"),
        (pod_obj("p", labels={PORT_KEY: " 8000"}), f"{PORT_KEY} must be a port number"),
        (pod_obj("p", labels={METRIC_PORT_KEY: "x"}), f"{METRIC_PORT_KEY} must be a port number"),
        (pod_obj("p", ip="10.0.0.256"), "status.podIP is not an IP address: '10.0.0.256'"),
        ({"metadata": {"name": "p"}, "status": {}}, "without metadata.namespace"),
    ],
    ids=[
        "port-word",
        "port-zero",
        "port-too-big",
        "port-negative",
        "port-float",
        "port-space",
        "metric-port-word",
        "bad-ip",
        "no-namespace",
    ],
)
def test_malformed_pods_raise(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(MalformedPod, match=message):
        pod_from_object(obj)


def test_unique_endpoints_keeps_the_ready_pod() -> None:
    def pod(name: str, ready: bool, address: str = "10.0.0.9") -> Pod:
        return Pod(name, "default", "m", address, 8000, 8000, ready=ready)

    pods = [pod("a", False), pod("b", True), pod("c", True), pod("d", False, "10.0.0.8")]
    assert [p.name for p in unique_endpoints(pods)] == ["b", "d"]


# --- a small API server -------------------------------------------------------------------------


@dataclass
class Seen:
    """One request as the server received it."""

    path: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass(eq=False)  # kept in a set: identity, not value
class _Conn:
    namespace: str | None
    selector: list[tuple[str, str | None]]
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | str] = field(default_factory=asyncio.Queue)


def _parse_selector(text: str) -> list[tuple[str, str | None]]:
    """`key` (exists) and `key=value` requirements, comma-separated: what these tests send."""
    out: list[tuple[str, str | None]] = []
    for part in filter(None, text.split(",")):
        key, eq, value = part.partition("=")
        out.append((key, value if eq else None))
    return out


def _matches(
    obj: dict[str, Any], namespace: str | None, selector: list[tuple[str, str | None]]
) -> bool:
    meta = obj["metadata"]
    if namespace is not None and meta["namespace"] != namespace:
        return False
    labels = meta.get("labels") or {}
    return all(k in labels and (v is None or labels[k] == v) for k, v in selector)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


GONE = _status(410, "Expired", "too old resource version")


class FakeApiServer:
    """GET /api/v1/pods and /api/v1/namespaces/{ns}/pods: a PodList, or with watch=true (or 1) a
    chunked stream of newline-delimited watch events, replayed from `resourceVersion` and then
    live. State survives `stop`/`start`, as etcd outlives an API server restart."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.requests: list[Seen] = []
        self.list_gate = asyncio.Event()
        self.list_gate.set()
        self.expire_next_watch: str | None = None  # "event" or "status": that watch gets 410
        self.port = 0
        self._conns: set[_Conn] = set()
        self._runner: web.AppRunner | None = None

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._handle)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.port = int(runner.addresses[0][1])
        self._runner = runner

    async def stop(self, abort: bool = False) -> None:
        """Stop serving; `abort` breaks open watches off instead of ending them cleanly."""
        for conn in self._conns:
            conn.queue.put_nowait("abort" if abort else "end")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # what the test drives ----------------------------------------------------------------------
    def put(self, obj: dict[str, Any]) -> None:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        self._record("MODIFIED" if key in self.pods else "ADDED", obj)

    def delete(self, name: str, namespace: str = "default") -> None:
        self._record("DELETED", self.pods[f"{namespace}/{name}"])

    def end_watches(self) -> None:
        """Every open watch ends as when its timeoutSeconds runs out."""
        for conn in self._conns:
            conn.queue.put_nowait("end")

    def expire_open_watches(self) -> None:
        for conn in self._conns:
            conn.queue.put_nowait({"type": "ERROR", "object": GONE})
            conn.queue.put_nowait("end")

    def bookmark(self) -> int:
        """Advance the version with a change no watched selector sees, then bookmark it."""
        self.put(pod_obj("unlabelled", model=None, labels={"other": "x"}))
        for conn in self._conns:
            if conn.bookmarks:
                obj = {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.rv)},
                }
                conn.queue.put_nowait({"type": "BOOKMARK", "object": obj})
        return self.rv

    @property
    def open_watches(self) -> int:
        return len(self._conns)

    def lists(self) -> list[Seen]:
        return [r for r in self.requests if not r.watch]

    def watches(self) -> list[Seen]:
        return [r for r in self.requests if r.watch]

    # the API -----------------------------------------------------------------------------------
    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if kind == "DELETED":
            del self.pods[key]
        else:
            self.pods[key] = obj
        self.history.append((self.rv, kind, obj))
        for conn in self._conns:
            if _matches(obj, conn.namespace, conn.selector):
                conn.queue.put_nowait({"type": kind, "object": obj})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.path, dict(request.query))
        self.requests.append(seen)
        namespace = request.match_info.get("namespace")
        selector = _parse_selector(request.query.get("labelSelector", ""))
        if not seen.watch:
            await self.list_gate.wait()
            items = [o for o in self.pods.values() if _matches(o, namespace, selector)]
            return web.json_response(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": items,
                }
            )
        if self.expire_next_watch == "status":
            self.expire_next_watch = None
            return web.json_response(GONE, status=410)
        conn = _Conn(namespace, selector, request.query.get("allowWatchBookmarks") == "true")
        if self.expire_next_watch == "event":
            self.expire_next_watch = None
            conn.queue.put_nowait({"type": "ERROR", "object": GONE})
            conn.queue.put_nowait("end")
        else:
            since = int(request.query["resourceVersion"])
            for rv, kind, obj in self.history:
                if rv > since and _matches(obj, namespace, selector):
                    conn.queue.put_nowait({"type": kind, "object": obj})
            self._conns.add(conn)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            while True:
                item = await conn.queue.get()
                if item == "end":
                    break
                if item == "abort":
                    assert request.transport is not None
                    request.transport.abort()
                    break
                await resp.write(json.dumps(item).encode() + b"\n")
        except ConnectionResetError:
            pass  # the client went away
        finally:
            self._conns.discard(conn)
        return resp


# --- the source against it ----------------------------------------------------------------------


class Recorder:
    """Feeds the source's deliveries into a real pool and keeps each one."""

    def __init__(self) -> None:
        self.pool = PodPool(CapacityEstimator())
        self.deliveries: list[list[Pod]] = []

    def on_update(self, pods: list[Pod]) -> None:
        self.pool.set_pods(pods)
        self.deliveries.append(pods)

    @property
    def last(self) -> dict[str, Pod]:
        return {p.key: p for p in self.deliveries[-1]} if self.deliveries else {}

    async def until(self, check: Callable[[dict[str, Pod]], bool], what: str) -> dict[str, Pod]:
        await eventually(lambda: bool(self.deliveries) and check(self.last), what)
        return self.last


def client_config(port: int) -> client.Configuration:
    cfg = client.Configuration(host=f"http://127.0.0.1:{port}")
    cfg.no_proxy = "*"  # the loopback server, whatever the environment says about proxies
    return cfg


class Running:
    """A source running against a server, torn down with a check that its thread has ended."""

    def __init__(self, server: FakeApiServer, **kwargs: Any) -> None:
        kwargs.setdefault("backoff_s", 0.02)
        kwargs.setdefault("max_backoff_s", 0.1)
        kwargs.setdefault("watch_timeout_s", WATCH_TIMEOUT_S)
        kwargs.setdefault("request_timeout_s", 5.0)
        self.source = KubernetesSource(configuration=client_config(server.port), **kwargs)
        self.rec = Recorder()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.source.run(self.rec.on_update))

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test() -> Iterator[None]:
    yield
    for thread in threading.enumerate():
        if thread.name == "k8s-pod-source":
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a worker thread outlived its run()"


@pytest_asyncio.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    srv = FakeApiServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest_asyncio.fixture
async def running(server: FakeApiServer) -> AsyncIterator[Running]:
    run = Running(server)
    try:
        yield run
    finally:
        if run.task is not None:
            await run.stop()


def _keys(pods: dict[str, Pod]) -> list[str]:
    return sorted(pods)


async def test_lifecycle_add_ready_unready_ip_change_terminate_delete(
    server: FakeApiServer, running: Running
) -> None:
    server.put(pod_obj("a100-0", ip="10.0.0.1"))
    running.start()
    rec = running.rec
    first = await rec.until(lambda p: "default/a100-0" in p, "initial list")
    assert first["default/a100-0"].ready
    await eventually(lambda: server.open_watches == 1, "a watch is open")

    # Exactly what the real client sent: a list with the selector, then a watch from its version.
    (listed,) = server.lists()
    assert listed.path == "/api/v1/pods"
    assert listed.query == {"labelSelector": MODEL_KEY}
    (watched,) = server.watches()
    timeout = int(watched.query.pop("timeoutSeconds"))
    assert WATCH_TIMEOUT_S <= timeout <= 2 * WATCH_TIMEOUT_S
    assert watched.query == {
        "labelSelector": MODEL_KEY,
        "watch": "true",
        "resourceVersion": str(server.rv),
        "allowWatchBookmarks": "true",
    }

    # Added without an IP: nothing to route to or scrape yet.
    server.put(pod_obj("l20-0", ip=None, ready=None, phase="Pending"))
    server.put(pod_obj("marker", ip="10.0.0.99"))
    pods = await rec.until(lambda p: "default/marker" in p, "marker pod")
    assert "default/l20-0" not in pods

    server.put(pod_obj("l20-0", ip="10.0.0.2", ready=False))
    pods = await rec.until(lambda p: "default/l20-0" in p, "pod with an IP")
    assert not pods["default/l20-0"].ready
    assert rec.pool.serving_models() == ["m"]

    server.put(pod_obj("l20-0", ip="10.0.0.2", ready=True))
    await rec.until(lambda p: p["default/l20-0"].ready, "becomes ready")
    assert sorted(c.pod.key for c in rec.pool.candidates("m", 0.0)) == [
        "default/a100-0",
        "default/l20-0",
        "default/marker",
    ]

    server.put(pod_obj("a100-0", ip="10.0.0.1", ready=False))
    await rec.until(lambda p: not p["default/a100-0"].ready, "loses readiness")
    assert "default/a100-0" not in {c.pod.key for c in rec.pool.candidates("m", 0.0)}

    server.put(pod_obj("l20-0", ip="10.0.0.7", ready=True))
    pods = await rec.until(lambda p: p["default/l20-0"].address == "10.0.0.7", "IP change")
    assert rec.pool.pod_by_endpoint("10.0.0.7:8000") == pods["default/l20-0"]
    assert rec.pool.pod_by_endpoint("10.0.0.2:8000") is None

    server.put(pod_obj("l20-0", ip="10.0.0.7", ready=True, deleting=True))
    await rec.until(lambda p: not p["default/l20-0"].ready, "terminating")

    server.delete("l20-0")
    pods = await rec.until(lambda p: "default/l20-0" not in p, "deleted")
    assert _keys(pods) == ["default/a100-0", "default/marker"]

    # One list, one watch: every change came over the watch.
    assert (len(server.lists()), len(server.watches())) == (1, 1)


async def test_unchanged_pods_are_not_redelivered(server: FakeApiServer, running: Running) -> None:
    server.put(pod_obj("p0"))
    running.start()
    await running.rec.until(lambda p: "default/p0" in p, "initial list")
    count = len(running.rec.deliveries)
    # A status change the source does not read (say, a container restart count) changes nothing.
    obj = pod_obj("p0")
    obj["status"]["containerStatuses"] = [{"name": "vllm", "restartCount": 1}]
    server.put(obj)
    server.put(pod_obj("p1", ip="10.0.0.2"))
    await running.rec.until(lambda p: "default/p1" in p, "next change")
    assert len(running.rec.deliveries) == count + 1


async def test_objects_the_client_models_reject_do_not_poison_the_watch(
    server: FakeApiServer, running: Running
) -> None:
    odd = pod_obj("odd-list", ip="10.0.0.2")
    del odd["spec"]["containers"]  # required by the client's V1PodSpec model
    server.put(odd)
    running.start()
    await running.rec.until(lambda p: "default/odd-list" in p, "initial list")
    odd = pod_obj("odd-watch", ip="10.0.0.3")
    odd["spec"]["containers"] = "not a list"
    server.put(odd)
    await running.rec.until(lambda p: "default/odd-watch" in p, "watched")
    assert len(server.watches()) == 1


@pytest.mark.parametrize("how", ["open-watch-error-event", "resume-error-event", "resume-status"])
async def test_watch_expiry_relists_and_sees_changes_made_meanwhile(
    server: FakeApiServer, running: Running, how: str
) -> None:
    server.put(pod_obj("stays", ip="10.0.0.1"))
    server.put(pod_obj("goes", ip="10.0.0.2"))
    server.put(pod_obj("flips", ip="10.0.0.3", ready=True))
    running.start()
    rec = running.rec
    await rec.until(lambda p: len(p) == 3, "initial list")
    await eventually(lambda: server.open_watches == 1, "a watch is open")

    server.list_gate.clear()  # the relist waits until the changes below are made
    if how == "open-watch-error-event":
        server.expire_open_watches()
    else:
        server.expire_next_watch = "event" if how == "resume-error-event" else "status"
        server.end_watches()
    await eventually(lambda: len(server.lists()) == 2, "relist after 410")
    assert server.open_watches == 0

    # Changes while no watch is open, older than any watch the source could resume.
    server.delete("goes")
    server.put(pod_obj("flips", ip="10.0.0.3", ready=False))
    server.put(pod_obj("new", ip="10.0.0.4"))
    delivered = len(rec.deliveries)
    server.list_gate.set()

    pods = await rec.until(lambda p: "default/new" in p, "relisted state")
    assert _keys(pods) == ["default/flips", "default/new", "default/stays"]
    assert not pods["default/flips"].ready
    assert len(rec.deliveries) == delivered + 1  # the relist is one delivery, not three
    await eventually(lambda: server.open_watches == 1, "watching again")
    assert server.watches()[-1].query["resourceVersion"] == str(server.rv)

    # The new watch works.
    server.delete("stays")
    await rec.until(lambda p: "default/stays" not in p, "delete after relist")


async def test_watch_that_ends_resumes_from_the_last_version_without_relisting(
    server: FakeApiServer, running: Running
) -> None:
    server.put(pod_obj("p0"))
    running.start()
    rec = running.rec
    await rec.until(lambda p: "default/p0" in p, "initial list")
    await eventually(lambda: server.open_watches == 1, "a watch is open")

    marked = server.bookmark()  # a newer version than any event this watch delivered
    server.end_watches()
    server.put(pod_obj("p1", ip="10.0.0.2"))  # whether before or after the resume: not lost
    await rec.until(lambda p: "default/p1" in p, "change across the resume")

    assert len(server.lists()) == 1
    assert [w.query["resourceVersion"] for w in server.watches()][1] == str(marked)


async def test_malformed_port_is_logged_and_the_pod_skipped(
    server: FakeApiServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    server.put(pod_obj("good", ip="10.0.0.1"))
    server.put(pod_obj("bad-list", ip="10.0.0.2", labels={PORT_KEY: "http"}))
    running.start()
    rec = running.rec
    pods = await rec.until(lambda p: "default/good" in p, "initial list")
    assert _keys(pods) == ["default/good"]

    server.put(pod_obj("bad-watch", ip="10.0.0.3", labels={METRIC_PORT_KEY: "99999"}))
    server.put(pod_obj("bad-watch", ip="10.0.0.4", labels={METRIC_PORT_KEY: "99999"}))
    server.put(pod_obj("later", ip="10.0.0.5"))
    pods = await rec.until(lambda p: "default/later" in p, "a later pod")
    assert _keys(pods) == ["default/good", "default/later"]

    warnings = [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]
    assert warnings == [
        f"skipping pod default/bad-list: {PORT_KEY} must be a port number, got 'http'",
        f"skipping pod default/bad-watch: {METRIC_PORT_KEY} must be a port number, got '99999'",
    ]  # once per pod and reason, not once per event

    # Fixed by the operator: it appears.
    server.put(pod_obj("bad-list", ip="10.0.0.2", labels={PORT_KEY: "8080"}))
    pods = await rec.until(lambda p: "default/bad-list" in p, "fixed pod")
    assert pods["default/bad-list"].endpoint == "10.0.0.2:8080"


async def test_namespace_scoping(server: FakeApiServer) -> None:
    server.put(pod_obj("p0", "team-a", ip="10.0.0.1"))
    server.put(pod_obj("p0", "team-b", ip="10.0.0.2"))
    scoped, everywhere = Running(server, namespace="team-a"), Running(server)
    scoped.start()
    everywhere.start()
    try:
        assert _keys(await scoped.rec.until(bool, "scoped list")) == ["team-a/p0"]
        pods = await everywhere.rec.until(lambda p: len(p) == 2, "cluster-wide list")
        assert _keys(pods) == ["team-a/p0", "team-b/p0"]  # one name, two pods
        await eventually(lambda: server.open_watches == 2, "both watch")

        server.put(pod_obj("p1", "team-b", ip="10.0.0.3"))
        server.put(pod_obj("p1", "team-a", ip="10.0.0.4"))
        await scoped.rec.until(lambda p: "team-a/p1" in p, "scoped watch")
        await everywhere.rec.until(lambda p: len(p) == 4, "cluster-wide watch")
        assert _keys(scoped.rec.last) == ["team-a/p0", "team-a/p1"]
    finally:
        await scoped.stop()
        await everywhere.stop()
    paths = {r.path for r in server.requests}
    assert paths == {"/api/v1/namespaces/team-a/pods", "/api/v1/pods"}


async def test_annotation_only_pods_need_an_empty_selector(server: FakeApiServer) -> None:
    server.put(pod_obj("labelled", ip="10.0.0.1"))
    server.put(pod_obj("annotated", ip="10.0.0.2", model=None, annotations={MODEL_KEY: "org/m"}))
    server.put(pod_obj("unrelated", ip="10.0.0.3", model=None))
    default, unfiltered = Running(server), Running(server, label_selector="")
    default.start()
    unfiltered.start()
    try:
        assert _keys(await default.rec.until(bool, "default")) == ["default/labelled"]
        pods = await unfiltered.rec.until(bool, "unfiltered")
        assert _keys(pods) == ["default/annotated", "default/labelled"]
        assert pods["default/annotated"].model == "org/m"
        # The unfiltered source sends no selector at all, not an empty one.
        assert sorted(r.query.get("labelSelector", "-") for r in server.lists()) == ["-", MODEL_KEY]
    finally:
        await default.stop()
        await unfiltered.stop()


async def test_survives_the_api_server_restarting(
    server: FakeApiServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server.put(pod_obj("p0", ip="10.0.0.1"))
    server.put(pod_obj("p1", ip="10.0.0.2"))
    running.start()
    rec = running.rec
    await rec.until(lambda p: len(p) == 2, "initial list")
    await eventually(lambda: server.open_watches == 1, "a watch is open")

    await server.stop(abort=True)  # the open watch breaks off mid-stream
    await eventually(
        lambda: sum("retrying in" in r.getMessage() for r in caplog.records) >= 2,
        "failed reconnects are logged",
    )
    # Down: the last good list keeps serving.
    assert len(rec.deliveries) == 1
    assert sorted(c.pod.key for c in rec.pool.candidates("m", 0.0)) == ["default/p0", "default/p1"]

    # Changed while the API server was down (etcd keeps them); it comes back on the same port.
    server.delete("p0")
    server.put(pod_obj("p2", ip="10.0.0.3"))
    await server.start()
    pods = await rec.until(lambda p: "default/p2" in p, "state after the restart")
    assert _keys(pods) == ["default/p1", "default/p2"]
    await eventually(lambda: server.open_watches == 1, "watching again")
    server.put(pod_obj("p3", ip="10.0.0.4"))
    await rec.until(lambda p: "default/p3" in p, "watch after the restart")


async def test_first_delivery_waits_for_the_api_server(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv = FakeApiServer()
    srv.port = free_port()  # nothing listens on it yet
    run = Running(srv)
    run.start()
    try:
        await eventually(
            lambda: any("list failed" in r.getMessage() for r in caplog.records),
            "failed list is logged",
        )
        assert run.rec.deliveries == []  # not ready: nothing was ever listed
        srv.put(pod_obj("p0"))
        await srv.start()
        await run.rec.until(lambda p: "default/p0" in p, "first list")
    finally:
        await run.stop()
        await srv.stop()


async def test_empty_list_is_delivered(server: FakeApiServer, running: Running) -> None:
    running.start()
    await eventually(lambda: running.rec.deliveries == [[]], "an empty first delivery")
    assert running.rec.pool.loaded


# --- configuration ------------------------------------------------------------------------------


def test_missing_configuration_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match=r"no in-cluster config .* no usable kubeconfig"):
        load_client_configuration(str(tmp_path / "missing"))


async def test_kubeconfig_is_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: FakeApiServer
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server.url}}],
                "users": [{"name": "u", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        ),
        encoding="utf-8",
    )
    cfg = load_client_configuration(str(path))
    assert cfg.host == server.url
    cfg.no_proxy = "*"
    server.put(pod_obj("p0"))
    source = KubernetesSource(configuration=cfg, backoff_s=0.02, max_backoff_s=0.1)
    assert cfg.retries is None  # the source changed its own copy, not the caller's object
    rec = Recorder()
    task = asyncio.create_task(source.run(rec.on_update))
    try:
        await rec.until(lambda p: "default/p0" in p, "list through the kubeconfig")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(
    "kwargs",
    [{"watch_timeout_s": 0}, {"request_timeout_s": 0}, {"backoff_s": 0}, {"max_backoff_s": 0.5}],
    ids=["watch-timeout", "request-timeout", "backoff", "max-below-backoff"],
)
def test_bad_timings_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KubernetesSource(configuration=client_config(1), **kwargs)
