"""Which pod source `serve` builds, and the Kubernetes choice wired end to end.

`MergedSource` is driven by in-memory sources. The end-to-end test runs `hetero-gateway serve
--discovery kubernetes` through the real entry point against a small loopback HTTP server that
answers the pods list of two namespaces (and holds each watch open), reached through a kubeconfig
file: the gateway must load the pods of both namespaces and show each pod's GPU label.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
import yaml

from plugin.adapters.discovery import PodsCallback, StaticFileSource
from plugin.adapters.serve import Gateway, MergedSource, build_source
from plugin.cli import main
from plugin.config import ENV_VARS, load_settings
from plugin.core.types import Pod
from plugin.errors import ConfigError
from tests.helpers import WAIT_S, ObserveServe, debug_pods, make_pod

pytestmark = pytest.mark.component


def pod(name: str, namespace: str = "default", address: str = "10.0.0.1") -> Pod:
    return make_pod(name, namespace=namespace, address=address)


class ListSource:
    """Delivers the given lists in order, then waits to be cancelled."""

    def __init__(self, *lists: list[Pod]) -> None:
        self.lists = lists
        self.go = asyncio.Event()

    async def run(self, on_update: PodsCallback) -> None:
        for pods in self.lists:
            await self.go.wait()
            self.go.clear()
            on_update(pods)
        await asyncio.Event().wait()


async def test_merged_source_delivers_once_every_source_has_then_on_each_change() -> None:
    a = ListSource([pod("a0", "team-a")], [pod("a0", "team-a"), pod("a1", "team-a")])
    b = ListSource([pod("b0", "team-b")])
    seen: list[list[str]] = []
    task = asyncio.ensure_future(
        MergedSource([a, b]).run(lambda ps: seen.append([p.key for p in ps]))
    )
    try:
        a.go.set()
        await asyncio.sleep(0.05)
        assert seen == []  # team-b has not delivered: not ready yet
        b.go.set()
        await asyncio.sleep(0.05)
        assert seen == [["team-a/a0", "team-b/b0"]]
        a.go.set()
        await asyncio.sleep(0.05)
        assert seen[-1] == ["team-a/a0", "team-a/a1", "team-b/b0"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_merged_source_dedupes_endpoints_across_sources() -> None:
    a = ListSource([pod("x", "team-a", "10.0.0.9")])
    b = ListSource([pod("y", "team-b", "10.0.0.9")])
    seen: list[list[str]] = []

    def first(pods: list[Pod]) -> list[Pod]:
        kept: dict[str, Pod] = {}
        for p in pods:
            kept.setdefault(p.endpoint, p)
        return list(kept.values())

    task = asyncio.ensure_future(
        MergedSource([a, b], first).run(lambda ps: seen.append([p.key for p in ps]))
    )
    try:
        a.go.set()
        b.go.set()
        await asyncio.sleep(0.05)
        assert seen == [["team-a/x"]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_file_discovery_needs_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_PODS_FILE"):
        build_source(load_settings({}))
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {"pods": []}}}), encoding="utf-8")
    source = build_source(load_settings({"HETERO_GATEWAY_PODS_FILE": str(path)}))
    assert isinstance(source, StaticFileSource)


def test_kubernetes_discovery_without_a_cluster_config_stops_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(
        "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing")
    )
    with pytest.raises(ConfigError, match="Kubernetes discovery"):
        build_source(load_settings({"HETERO_GATEWAY_DISCOVERY": "kubernetes"}))


# --- end to end against a loopback API server -----------------------------------------------------


def _pod_object(name: str, namespace: str, ip: str, gpu: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"model.aibrix.ai/name": "m", "app.kubernetes.io/name": gpu},
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


PODS = {
    "team-a": [_pod_object("a100-0", "team-a", "10.0.0.1", "llama-a100")],
    "team-b": [_pod_object("l20-0", "team-b", "10.0.0.2", "llama-l20")],
    "other": [_pod_object("v100-0", "other", "10.0.0.3", "llama-v100")],
}


@pytest.fixture
def api_server() -> Iterator[tuple[str, list[str]]]:
    """Answers `GET /api/v1/namespaces/{ns}/pods` (list) and holds watches open, from a thread:
    `serve` runs its own event loop in the test's thread."""
    requests: list[str] = []
    closing = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) != 5 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
                self.send_error(404)
                return
            ns = parts[3]
            watching = "watch=true" in url.query
            requests.append(f"{ns} {'watch' if watching else 'list'}")
            if watching:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.flush()
                closing.wait(30)  # until the test ends
                return
            body = orjson.dumps(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": "7"},
                    "items": PODS.get(ns, []),
                }
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        closing.set()
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


@pytest.fixture
def kubeconfig(
    tmp_path: Path, api_server: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> Path:
    url, _ = api_server
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    for var in ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # The client reads $KUBECONFIG once, when it is imported.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.setitem(sys.modules, "uvloop", None)  # plain asyncio.run in `serve`
    return path


async def _debug_pods(gateway: Gateway) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        return await debug_pods(http, f"http://127.0.0.1:{gateway.http_port}")


def test_serve_discovery_kubernetes_watches_the_configured_namespaces(
    kubeconfig: Path,
    api_server: tuple[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    observe_serve: ObserveServe,
) -> None:
    _, requests = api_server
    monkeypatch.setenv("HETERO_GATEWAY_K8S_NAMESPACE", "team-a,team-b")
    seen = observe_serve(_debug_pods)
    argv = ["serve", "--discovery", "kubernetes", "--host", "127.0.0.1"]
    assert main([*argv, "--grpc-port", "0", "--http-port", "0"]) == 0
    [doc] = seen
    assert {k: v["gpu"] for k, v in doc["pods"].items()} == {
        "team-a/a100-0": "llama-a100",
        "team-b/l20-0": "llama-l20",
    }
    assert doc["shared_state"] == {"mode": "off"}
    assert {"team-a list", "team-b list"} <= set(requests)
    assert not any(r.startswith("other") for r in requests)


def test_the_deployment_label_names_the_gpu_type(
    kubeconfig: Path,
    api_server: tuple[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    observe_serve: ObserveServe,
) -> None:
    monkeypatch.setenv("HETERO_GATEWAY_DISCOVERY", "kubernetes")
    monkeypatch.setenv("HETERO_GATEWAY_K8S_NAMESPACE", "team-a")
    monkeypatch.setenv("AIBRIX_POD_DEPLOYMENT_LABEL", "model.aibrix.ai/name")
    seen = observe_serve(_debug_pods)
    assert main(["serve", "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0"]) == 0
    [doc] = seen
    assert {k: v["gpu"] for k, v in doc["pods"].items()} == {"team-a/a100-0": "m"}


def test_single_namespace_needs_no_merging(kubeconfig: Path) -> None:
    source = build_source(
        dataclasses.replace(
            load_settings({"HETERO_GATEWAY_DISCOVERY": "kubernetes"}), k8s_namespaces=("a",)
        )
    )
    assert type(source).__name__ == "KubernetesSource"
    merged = build_source(
        dataclasses.replace(
            load_settings({"HETERO_GATEWAY_DISCOVERY": "kubernetes"}), k8s_namespaces=("a", "b")
        )
    )
    assert isinstance(merged, MergedSource)
    assert [s.namespace for s in merged.sources] == ["a", "b"]  # type: ignore[attr-defined]
