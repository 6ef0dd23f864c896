"""Where the optimizer's inputs come from: deployments (Kubernetes or the pods file) and request
traces (Redis)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson

from plugin.adapters.discovery import load_pods_file
from plugin.adapters.redis_state import connect
from plugin.config import RedisSettings
from plugin.core.trace import TRACE_INTERVAL_S, TraceWindow, trace_key, window_start
from plugin.core.workload import Deployment
from plugin.errors import GatewayError, TraceFormatError

log = logging.getLogger(__name__)


MODEL_LABEL = "model.aibrix.ai/name"
MIN_REPLICAS_LABEL = "model.aibrix.ai/min_replicas"
READ_DELAY_S = 2.0  # after a window closes: the gateways flush it just after the boundary
TRACE_READ_TIMEOUT_S = 5.0
REPLICA_UNITS = 100  # AIBrix's PodAutoscaler: targetValue "100" = one replica


class UnknownDeployment(GatewayError, LookupError):
    """The request names a deployment the optimizer does not know (or no longer monitors)."""


# --- where deployments come from -----------------------------------------------------------------


class DeploymentSource(Protocol):
    where: str

    async def fetch(self) -> list[Deployment]: ...


def _min_replicas(labels: Mapping[str, str], where: str) -> int:
    raw = labels.get(MIN_REPLICAS_LABEL)
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        log.warning("%s: label %s=%r is not a count; using 0", where, MIN_REPLICAS_LABEL, raw)
        return 0
    return value


class KubernetesDeployments:
    """Deployments labelled `model.aibrix.ai/name`, listed through the official client (in a
    thread: the client is synchronous) once per optimization round."""

    def __init__(self, namespaces: Sequence[str] = (), configuration: Any = None) -> None:
        """`configuration`: a `kubernetes.client.Configuration`; None loads the in-cluster one,
        else the kubeconfig (ConfigError when neither loads)."""
        from kubernetes import client

        from plugin.adapters.kubernetes import load_client_configuration

        cfg = configuration if configuration is not None else load_client_configuration()
        self._api = client.AppsV1Api(client.ApiClient(cfg))
        self._namespaces = tuple(namespaces)
        self.where = "the Kubernetes API"

    async def fetch(self) -> list[Deployment]:
        return await asyncio.to_thread(self._list)

    def _list(self) -> list[Deployment]:
        if self._namespaces:
            items = [
                d
                for ns in self._namespaces
                for d in self._api.list_namespaced_deployment(
                    ns, label_selector=MODEL_LABEL, _request_timeout=10
                ).items
            ]
        else:
            items = self._api.list_deployment_for_all_namespaces(
                label_selector=MODEL_LABEL, _request_timeout=10
            ).items
        found = []
        for d in items:
            meta, spec = d.metadata, d.spec
            if meta is None or not meta.name or not meta.namespace:
                continue
            labels = dict(meta.labels or {})
            if not labels.get(MODEL_LABEL):
                continue
            replicas = spec.replicas if spec is not None else None
            found.append(
                Deployment(
                    namespace=meta.namespace,
                    name=meta.name,
                    model=labels[MODEL_LABEL],
                    # Kubernetes' default when the field is unset.
                    replicas=int(replicas) if replicas is not None else 1,
                    min_replicas=_min_replicas(labels, f"deployment {meta.namespace}/{meta.name}"),
                )
            )
        return found


class PodsFileDeployments:
    """The deployments the pods file names: each distinct (namespace, deployment label, model)
    is one, running as many replicas as it has pods; `model.aibrix.ai/min_replicas` may be set
    on its pods' labels. Pods without the deployment label belong to no deployment."""

    def __init__(self, path: str, deployment_label: str) -> None:
        self.path = path
        self.deployment_label = deployment_label
        self.where = path

    async def fetch(self) -> list[Deployment]:
        pods = await asyncio.to_thread(load_pods_file, self.path, self.deployment_label)
        groups: dict[tuple[str, str, str], list[Mapping[str, str]]] = {}
        for pod in pods:
            if pod.deployment is not None:
                groups.setdefault((pod.namespace, pod.deployment, pod.model), []).append(pod.labels)
        return [
            Deployment(
                namespace=ns,
                name=name,
                model=model,
                replicas=len(labels),
                min_replicas=max(_min_replicas(lb, f"{self.path}: {ns}/{name}") for lb in labels),
            )
            for (ns, name, model), labels in sorted(groups.items())
        ]


# --- where traces come from ----------------------------------------------------------------------


class RedisTraces:
    """Reads a model's closed trace windows of the look-back with one MGET, within
    `timeout_s` and without client retries (a dead Redis costs a round one timeout, not a
    minute of retries per model)."""

    def __init__(self, settings: RedisSettings, timeout_s: float = TRACE_READ_TIMEOUT_S) -> None:
        self._client = connect(settings, timeout_s)
        self._timeout_s = timeout_s
        self.where = f"Redis {settings.host}:{settings.port}/{settings.db}"

    async def windows(self, model: str, now: float, lookback_s: float) -> list[TraceWindow]:
        last = window_start(now) - TRACE_INTERVAL_S  # the newest closed window
        starts = [last - k * TRACE_INTERVAL_S for k in range(int(lookback_s // TRACE_INTERVAL_S))]
        async with asyncio.timeout(self._timeout_s):
            raws = await self._client.mget([trace_key(model, s) for s in starts])
        found = []
        for start, raw in zip(starts, raws, strict=True):
            if raw is None:
                continue  # nothing traced then: gateways write nothing for an empty window
            try:
                found.append(TraceWindow.parse(model, start, orjson.loads(raw)))
            except (orjson.JSONDecodeError, TraceFormatError) as exc:
                log.warning("ignoring trace window %s: %s", trace_key(model, start), exc)
        return found

    async def close(self) -> None:
        await self._client.aclose()


class TraceSource(Protocol):
    where: str

    async def windows(self, model: str, now: float, lookback_s: float) -> list[TraceWindow]: ...
