"""Kubernetes pod discovery: list and watch pods through the official client.

The official client is synchronous, so each `run` owns one worker thread that lists, watches and
keeps the pod table; the event loop only receives complete pod lists, coalesced (a burst of events
costs one `on_update`). A failing API server degrades discovery, never the request path: errors are
logged and retried with backoff while the last good list keeps serving.

Which pods: those naming their model with `model.aibrix.ai/name`, as a label or as an annotation
(AIBrix writes the annotation when the name is not a valid label value, e.g. it has a `/`); the
label wins when both are set, as in AIBrix. The server-side label selector defaults to that label so
the API server sends model pods only; an annotation-only pod carries no such label and is seen only
with an empty selector, which lists every pod in scope and filters here. That costs memory and
traffic in a big cluster, so it is opt-in (best with a namespace).

A pod is delivered once it has an IP and has not finished (phase Succeeded or Failed: its IP may
already belong to another pod); it is ready when it is not terminating and its Ready condition is
True. A terminating pod stays, not ready, until it is deleted, so its in-flight requests and
metrics stay visible. A pod with a malformed port label or IP is logged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ipaddress
import json
import logging
import random
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from plugin.adapters.discovery import PodsCallback, model_config_from
from plugin.adapters.engines import batch_cap_flags, default_metrics_path
from plugin.config import DEFAULT_DEPLOYMENT_LABEL
from plugin.core.config_profile import CONFIG_ANNOTATION
from plugin.core.types import Pod
from plugin.errors import ConfigError

__all__ = [
    "ENGINE_KEY",
    "METRICS_PATH_KEY",
    "METRIC_PORT_KEY",
    "MODEL_KEY",
    "PORT_KEY",
    "KubernetesSource",
    "MalformedPod",
    "load_client_configuration",
    "pod_from_object",
]

log = logging.getLogger(__name__)

MODEL_KEY = "model.aibrix.ai/name"
PORT_KEY = "model.aibrix.ai/port"
METRIC_PORT_KEY = "model.aibrix.ai/metric-port"
ENGINE_KEY = "model.aibrix.ai/engine"
# The engine's batch cap, when its flags do not say it (label or annotation; this project's own
# key: AIBrix defines none).
MAX_NUM_SEQS_KEY = "hetero-gateway.io/max-num-seqs"
# The path of the pod's metrics page, as Prometheus's common scrape annotation names it
# (default: where its engine serves it, `engines.default_metrics_path`).
METRICS_PATH_KEY = "prometheus.io/path"
# Engine flags that set the batch cap (`plugin.adapters.engines`).
_BATCH_CAP_FLAGS = batch_cap_flags()
DEFAULT_PORT = 8000
DEFAULT_ENGINE = "vllm"

_PORT_RE = re.compile(r"[0-9]{1,5}")
_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
_STOP_WAIT_S = 2.0  # how long `run` waits for its worker thread when cancelled


class MalformedPod(ValueError):
    """A model pod whose labels or status cannot make a `Pod`; it is skipped, not fatal."""


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): str(v) for k, v in value.items() if v is not None}


def _port(value: str | None, key: str, default: int) -> int:
    if value is None:
        return default
    if not _PORT_RE.fullmatch(value) or not 0 < int(value) < 65536:
        raise MalformedPod(f"{key} must be a port number, got {value!r}")
    return int(value)


def _is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def object_key(obj: Any) -> str | None:
    """namespace/name of a pod object, the key of every per-pod state; None when it has none."""
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(metadata, Mapping):
        return None
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        return None
    return f"{namespace}/{name}"


def pod_from_object(
    obj: Mapping[str, Any], deployment_label: str = DEFAULT_DEPLOYMENT_LABEL
) -> Pod | None:
    """The `Pod` a pod object (API JSON) describes.

    None when it is not a model pod, has no IP yet or has finished; `MalformedPod` when a model pod
    carries a bad port or IP (the caller logs it and skips the pod).
    """
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping) or object_key(obj) is None:
        raise MalformedPod("pod object without metadata.namespace and metadata.name")
    labels = _str_map(metadata.get("labels"))
    annotations = _str_map(metadata.get("annotations"))

    def setting(key: str) -> str | None:
        # Label first, then annotation, as AIBrix reads them; an empty value counts as unset.
        return labels.get(key) or annotations.get(key) or None

    model = setting(MODEL_KEY)
    if model is None:
        return None
    status = obj.get("status")
    if not isinstance(status, Mapping):
        status = {}
    if status.get("phase") in _FINISHED_PHASES:
        return None
    ip = status.get("podIP")
    if not ip:
        return None
    try:
        address = str(ipaddress.ip_address(str(ip)))
    except ValueError:
        raise MalformedPod(f"status.podIP is not an IP address: {ip!r}") from None
    port = _port(setting(PORT_KEY), PORT_KEY, DEFAULT_PORT)
    metrics_port = _port(setting(METRIC_PORT_KEY), METRIC_PORT_KEY, port)
    terminating = metadata.get("deletionTimestamp") is not None
    config = annotations.get(CONFIG_ANNOTATION)
    max_num_seqs = _declared_cap(setting(MAX_NUM_SEQS_KEY), metadata) or _flag_cap(obj)
    engine = setting(ENGINE_KEY) or DEFAULT_ENGINE
    metrics_path = _declared_path(annotations.get(METRICS_PATH_KEY) or None, metadata)
    return Pod(
        name=str(metadata["name"]),
        namespace=str(metadata["namespace"]),
        model=model,
        address=address,
        port=port,
        metrics_port=metrics_port,
        engine=engine,
        ready=not terminating and _is_ready(status),
        labels=labels,
        deployment=labels.get(deployment_label) or None,
        model_config=model_config_from(config) if config else None,
        max_num_seqs=max_num_seqs,
        metrics_path=metrics_path or default_metrics_path(engine),
    )


def _declared_path(raw: str | None, metadata: Mapping[str, Any]) -> str | None:
    """The `METRICS_PATH_KEY` annotation; one not starting with "/" is logged and left out (the
    engine's default path is scraped: the pod still serves)."""
    if raw is None or raw.startswith("/"):
        return raw
    log.warning(
        'pod %s/%s: %s must be an HTTP path starting with "/", got %r; ignored',
        metadata.get("namespace"),
        metadata.get("name"),
        METRICS_PATH_KEY,
        raw,
    )
    return None


def _declared_cap(raw: str | None, metadata: Mapping[str, Any]) -> int | None:
    """The `MAX_NUM_SEQS_KEY` value; a bad one is logged and left out (the cap is then read from
    the engine's flags or learned: the pod still serves)."""
    if raw is None:
        return None
    if raw.strip().isdigit() and int(raw) > 0:
        return int(raw)
    log.warning(
        "pod %s/%s: %s must be a positive integer, got %r; ignored",
        metadata.get("namespace"),
        metadata.get("name"),
        MAX_NUM_SEQS_KEY,
        raw,
    )
    return None


def _flag_cap(obj: Mapping[str, Any]) -> int | None:
    """The batch cap the pod's engine was started with (`--max-num-seqs 256`, `=256`, also
    inside a shell command string), from its containers' command and args; None if unset."""
    spec = obj.get("spec")
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    if not isinstance(containers, list):
        return None
    for container in containers:
        if not isinstance(container, Mapping):
            continue
        words: list[str] = []
        for field in ("command", "args"):
            items = container.get(field)
            if isinstance(items, list):
                words.extend(w for item in items if isinstance(item, str) for w in item.split())
        for i, word in enumerate(words):
            flag, _, value = word.partition("=")
            if flag in _BATCH_CAP_FLAGS:
                value = value or (words[i + 1] if i + 1 < len(words) else "")
                if value.isdigit() and int(value) > 0:
                    return int(value)
    return None


def unique_endpoints(pods: list[Pod]) -> list[Pod]:
    """One pod per IP:PORT, the ready one where there is one.

    The pool finds the pod behind a response by its endpoint; two hostNetwork pods on one node can
    share it, and the one that cannot bind must not take the counted tokens of the one that did.
    """
    chosen: dict[str, Pod] = {}
    for pod in pods:
        held = chosen.get(pod.endpoint)
        if held is None or (pod.ready and not held.ready):
            chosen[pod.endpoint] = pod
    kept = {p.key for p in chosen.values()}
    return [p for p in pods if p.key in kept]


def load_client_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """In-cluster configuration (service account), else the kubeconfig (`kubeconfig`, default
    `$KUBECONFIG` or ~/.kube/config); `ConfigError` naming both when neither loads."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return cfg
    except ConfigException as exc:
        in_cluster = str(exc)
    try:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (ConfigException, OSError) as exc:
        raise ConfigError(
            f"Kubernetes discovery: no in-cluster config ({in_cluster}) and no usable kubeconfig"
            f" ({exc})"
        ) from None
    return cfg


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"  # str() would add every header and the body
    return repr(exc)


class KubernetesSource:
    """Delivers the model pods of one namespace (or all) from the API server's list and watch.

    `configuration` is a `kubernetes.client.Configuration` (tests pass one with an explicit `host`;
    the source works on a copy); without one, the in-cluster config is loaded, falling back to the
    kubeconfig, at construction, so a missing config stops start-up. The first delivery (the first
    successful list, even an empty one) marks readiness; until then a failing API server is
    retried with backoff.
    """

    def __init__(
        self,
        namespace: str | None = None,
        label_selector: str = MODEL_KEY,
        configuration: client.Configuration | None = None,
        *,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        deployment_label: str = DEFAULT_DEPLOYMENT_LABEL,
    ) -> None:
        if watch_timeout_s <= 0 or request_timeout_s <= 0 or not 0 < backoff_s <= max_backoff_s:
            raise ConfigError(
                "Kubernetes discovery: timeouts must be > 0 and 0 < backoff <= max backoff"
            )
        self.namespace = namespace or None  # "" means every namespace, like None
        self.label_selector = label_selector
        cfg = load_client_configuration() if configuration is None else copy.deepcopy(configuration)
        # Retrying is this source's job (backoff, one log line per attempt); urllib3's immediate
        # retries would add nothing but three more warnings per failed attempt.
        cfg.retries = False
        self.configuration = cfg
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.deployment_label = deployment_label

    async def run(self, on_update: PodsCallback) -> None:
        """Deliver pod lists until cancelled; cancelling stops the worker thread too (a list
        request in flight cannot be interrupted: the daemon thread ends when it returns)."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        finished = asyncio.Event()
        latest: list[list[Pod]] = []

        def receive(pods: list[Pod]) -> None:  # on the loop
            latest[:] = [pods]
            changed.set()

        def deliver(pods: list[Pod]) -> None:  # on the worker thread
            loop.call_soon_threadsafe(receive, pods)

        def on_exit() -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                loop.call_soon_threadsafe(finished.set)

        worker = _Worker(self, deliver)
        thread = threading.Thread(
            target=worker.run, args=(on_exit,), name="k8s-pod-source", daemon=True
        )
        thread.start()
        try:
            while True:
                await changed.wait()
                changed.clear()
                on_update(latest.pop())
        finally:
            worker.stop()
            deadline = loop.time() + _STOP_WAIT_S
            while not finished.is_set() and loop.time() < deadline:
                # Again on every turn: a request that started after the last call has its own
                # socket to shut down.
                worker.stop()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await finished.wait()


class _Worker:
    """The list/watch loop and the pod table of one `run`; every method but `stop` runs on its
    thread."""

    def __init__(self, source: KubernetesSource, deliver: Callable[[list[Pod]], None]) -> None:
        self._source = source
        self._deliver = deliver
        self._stopping = threading.Event()
        self._watch: watch.Watch | None = None
        self._pods: dict[str, Pod] = {}
        self._skipped: dict[str, str] = {}  # key -> why, so a pod is not re-logged every event
        self._shadowed: set[str] = set()
        self._published: list[Pod] | None = None
        self._delay = source.backoff_s
        args: tuple[str, ...] = (source.namespace,) if source.namespace else ()
        self._args = args
        self._selector = source.label_selector or None

    def stop(self) -> None:
        """From any thread: end the loop and break off the open watch at once."""
        self._stopping.set()
        current = self._watch
        if current is not None:
            current.stop()  # type: ignore[no-untyped-call]

    def run(self, on_exit: Callable[[], None]) -> None:
        api_client = client.ApiClient(self._source.configuration)
        try:
            api = client.CoreV1Api(api_client)
            func = (
                api.list_namespaced_pod
                if self._source.namespace
                else api.list_pod_for_all_namespaces
            )
            self._loop(func)
        except BaseException:  # nothing may escape a thread; the loop itself catches errors
            log.exception("Kubernetes pod discovery stopped")
        finally:
            api_client.close()  # type: ignore[no-untyped-call]
            on_exit()

    def _loop(self, func: Callable[..., Any]) -> None:
        rv: str | None = None
        expired_before = False
        while not self._stopping.is_set():
            try:
                if rv is None:
                    rv = self._list(func)
                rv = self._watch_once(func, rv)
                expired_before = False
            except ApiException as exc:
                if self._stopping.is_set():
                    break
                if exc.status == 410:
                    log.info("pod watch expired (410 Gone): relisting")
                    rv = None
                    if expired_before:  # expired again at once: do not hammer the API server
                        self._pause(exc, "relist")
                    expired_before = True
                    continue
                self._pause(exc, "list" if rv is None else "watch")
            except Exception as exc:
                if self._stopping.is_set():
                    break
                self._pause(exc, "list" if rv is None else "watch")

    def _pause(self, exc: BaseException, what: str) -> None:
        delay = random.uniform(self._delay / 2, self._delay)  # jitter: replicas do not align
        self._delay = min(self._delay * 2, self._source.max_backoff_s)
        log.warning(
            "Kubernetes pod %s failed: %s; keeping the last %d pods, retrying in %.2f s",
            what,
            _describe(exc),
            len(self._published or ()),
            delay,
        )
        self._stopping.wait(delay)

    def _list(self, func: Callable[..., Any]) -> str:
        # Raw JSON, not the client's models: one parser serves list and watch, one malformed pod
        # cannot fail the whole list, and json.loads is far cheaper than model deserialisation.
        resp = func(
            *self._args,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=(self._source.request_timeout_s, self._source.request_timeout_s),
        )
        try:
            doc = json.loads(resp.data)
        finally:
            resp.release_conn()
        metadata = doc.get("metadata") if isinstance(doc, dict) else None
        rv = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        items = doc.get("items") if isinstance(doc, dict) else None
        if items is None:
            items = []  # an empty list may come without "items"
        if not isinstance(rv, str) or not rv or not isinstance(items, list):
            raise ValueError("pod list without metadata.resourceVersion or items")
        pods: dict[str, Pod] = {}
        for obj in items:
            key, pod = self._parse(obj)
            if key is not None and pod is not None:
                pods[key] = pod
        seen = {object_key(obj) for obj in items}
        self._skipped = {k: v for k, v in self._skipped.items() if k in seen}
        self._pods = pods
        self._delay = self._source.backoff_s
        self._publish()
        log.debug("listed pods at resourceVersion %s: %d model pods", rv, len(pods))
        return rv

    def _watch_once(self, func: Callable[..., Any], rv: str) -> str:
        """Watch from `rv` until the server ends the watch; returns the resourceVersion to resume
        from. A 410 (HTTP status or ERROR event) comes out as ApiException(410)."""
        # "object": events stay plain dicts. The client's models validate strictly, so an object
        # they reject (a field newer than the client) would fail this watch on every retry.
        w = watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        self._watch = w
        if self._stopping.is_set():  # stop() ran before this watch was visible to it
            return rv
        # Randomised like client-go so that replicas' watches do not all end together.
        timeout_s = random.randint(self._source.watch_timeout_s, 2 * self._source.watch_timeout_s)
        try:
            # timeout_seconds also turns off the helper's own silent retry: relists are ours.
            stream = w.stream(  # type: ignore[no-untyped-call]
                func,
                *self._args,
                label_selector=self._selector,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                # A silent dead connection ends after the watch timeout plus a margin.
                _request_timeout=(self._source.request_timeout_s, timeout_s + 30),
            )
            with contextlib.closing(stream):
                for event in stream:
                    if self._stopping.is_set():
                        break
                    self._apply(event.get("type"), event.get("raw_object"))
                    self._delay = self._source.backoff_s
        finally:
            self._watch = None
        self._delay = self._source.backoff_s
        resumed = w.resource_version
        return resumed if isinstance(resumed, str) and resumed else rv

    def _apply(self, kind: Any, obj: Any) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: the helper already took its resourceVersion
        if kind == "DELETED":
            key = object_key(obj)
            if key is None:
                return
            self._skipped.pop(key, None)
            self._pods.pop(key, None)
        else:
            key, pod = self._parse(obj)
            if key is None:
                return
            if pod is None:
                self._pods.pop(key, None)
            else:
                self._pods[key] = pod
        self._publish()

    def _parse(self, obj: Any) -> tuple[str | None, Pod | None]:
        key = object_key(obj)
        if key is None:
            log.warning("ignoring a pod object without metadata.namespace and metadata.name")
            return None, None
        try:
            pod = pod_from_object(obj, self._source.deployment_label)
        except MalformedPod as exc:
            if self._skipped.get(key) != str(exc):
                self._skipped[key] = str(exc)
                log.warning("skipping pod %s: %s", key, exc)
            return key, None
        if self._skipped.pop(key, None) is not None:
            log.info("pod %s is valid again", key)
        return key, pod

    def _publish(self) -> None:
        everyone = sorted(self._pods.values(), key=lambda p: p.key)
        pods = unique_endpoints(everyone)
        shadowed = {p.key for p in everyone} - {p.key for p in pods}
        for key in sorted(shadowed - self._shadowed):
            log.warning(
                "pod %s left out: another pod has its IP:PORT %s", key, self._pods[key].endpoint
            )
        self._shadowed = shadowed
        if pods == self._published or self._stopping.is_set():
            return
        self._published = pods
        try:
            self._deliver(pods)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.stop()
