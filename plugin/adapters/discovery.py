"""Pod discovery. `PodSource` is the seam; the static YAML file is the embedded default.

File shape (models and their pods; every pod field but name/address/port is optional):

    models:
      llama-3-8b:
        pods:
          - name: a100-0
            namespace: default        # default "default"
            address: 127.0.0.1
            port: 8000
            metricsPort: 8000         # default: port
            engine: vllm              # default vllm
            metricsPath: /metrics     # default /metrics; /prometheus/metrics for engine trtllm
            ready: true               # default true
            labels: {gpu: a100}
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import yaml

from plugin.adapters.engines import default_metrics_path
from plugin.config import DEFAULT_DEPLOYMENT_LABEL
from plugin.core.config_profile import CONFIG_ANNOTATION, ModelConfig, parse_model_config
from plugin.core.strategies import strategy_names
from plugin.core.types import Pod
from plugin.errors import ConfigError

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=256)
def model_config_from(raw: str) -> ModelConfig | None:
    """A `model.aibrix.ai/config` document, parsed once per distinct text (every pod of a
    deployment carries the same one, and one object per text lets the router cache by it).
    What the document gets wrong is logged, once, and ignored; the rest applies."""
    config, problems = parse_model_config(raw, strategy_names())
    for problem in problems:
        log.warning("%s: %s", CONFIG_ANNOTATION, problem)
    return config


PodsCallback = Callable[[list[Pod]], None]


class PodSource(Protocol):
    """Delivers the full pod list whenever it changes; the first delivery marks readiness."""

    async def run(self, on_update: PodsCallback) -> None: ...


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{what} must be a port number, got {value!r}")
    return value


def _metrics_path(value: Any, what: str) -> str | None:
    """A metrics page path (`metricsPath`): a string starting with "/", or absent."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f'{what} must be an HTTP path starting with "/", got {value!r}')
    return value


def _batch_cap(value: Any, what: str) -> int | None:
    """A declared batch cap (`maxNumSeqs`): a positive integer, or absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{what} must be a positive integer (the engine's batch cap), got {value!r}"
        )
    return value


def parse_pods(
    doc: Any, source: str, deployment_label: str = DEFAULT_DEPLOYMENT_LABEL
) -> list[Pod]:
    """Validate a pods document; errors name the file and the offending entry. A pod's
    deployment is the value of its `deployment_label` label."""
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise ConfigError(f"{source}: expected a mapping with a 'models' mapping")
    pods: list[Pod] = []
    seen: set[str] = set()
    endpoints: dict[str, str] = {}
    for model, spec in doc["models"].items():
        entries = spec.get("pods") if isinstance(spec, dict) else None
        if not isinstance(entries, list):
            raise ConfigError(f"{source}: models.{model}.pods must be a list")
        # The model's config profiles, as the annotation would carry them (an object or its
        # JSON text); every pod of the model gets them.
        model_cap = _batch_cap(spec.get("maxNumSeqs"), f"{source}: models.{model}.maxNumSeqs")
        raw_config = spec.get("config")
        config = None
        if raw_config is not None:
            text = raw_config if isinstance(raw_config, str) else json.dumps(raw_config)
            config = model_config_from(text)
        for i, entry in enumerate(entries):
            where = f"{source}: models.{model}.pods[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} must be a mapping")
            name, address = entry.get("name"), entry.get("address")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}.name is required")
            if not isinstance(address, str) or not address:
                raise ConfigError(f"{where}.address is required")
            try:
                address = str(ipaddress.ip_address(address))
            except ValueError:
                # Envoy's ORIGINAL_DST cluster connects to an IP; a name or IP:PORT would fail
                # every request routed to this pod.
                raise ConfigError(
                    f"{where}.address must be an IP address (port separate), got {address!r}"
                ) from None
            ready = entry.get("ready", True)
            if not isinstance(ready, bool):
                raise ConfigError(f"{where}.ready must be true or false, got {ready!r}")
            port = _int(entry.get("port"), f"{where}.port")
            metrics_port = _int(entry.get("metricsPort", port), f"{where}.metricsPort")
            labels = entry.get("labels") or {}
            if not isinstance(labels, dict):
                raise ConfigError(f"{where}.labels must be a mapping")
            max_num_seqs = _batch_cap(entry.get("maxNumSeqs"), f"{where}.maxNumSeqs") or model_cap
            engine = str(entry.get("engine") or "vllm")
            metrics_path = _metrics_path(entry.get("metricsPath"), f"{where}.metricsPath")
            pod = Pod(
                name=name,
                namespace=str(entry.get("namespace") or "default"),
                model=str(model),
                address=address,
                port=port,
                metrics_port=metrics_port,
                engine=engine,
                ready=ready,
                labels={str(k): str(v) for k, v in labels.items()},
                deployment=str(labels[deployment_label]) if labels.get(deployment_label) else None,
                model_config=config,
                max_num_seqs=max_num_seqs,
                metrics_path=metrics_path or default_metrics_path(engine),
            )
            if pod.key in seen:
                raise ConfigError(f"{where}: pod {pod.key} listed twice")
            seen.add(pod.key)
            if pod.endpoint in endpoints:
                # One engine, one pod entry: in-flight counts and counted tokens are per pod, and
                # the counting filter knows a response only by its IP:PORT.
                raise ConfigError(
                    f"{where}: endpoint {pod.endpoint} is already pod {endpoints[pod.endpoint]}"
                )
            endpoints[pod.endpoint] = pod.key
            pods.append(pod)
    return pods


def load_pods_file(path: str, deployment_label: str = DEFAULT_DEPLOYMENT_LABEL) -> list[Pod]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read pods file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"pods file {path} is not valid YAML: {exc}") from None
    return parse_pods(doc, path, deployment_label)


class StaticFileSource:
    """Reads the file at start (a bad file stops start-up) and re-reads it when it changes.

    A change is read once the file has stayed the same for one poll, so a half-written file is not
    taken for a shorter list. A bad edit is logged and ignored: the last good list keeps serving.
    """

    def __init__(
        self, path: str, poll_s: float = 1.0, deployment_label: str = DEFAULT_DEPLOYMENT_LABEL
    ) -> None:
        self.path = path
        self._poll_s = poll_s
        self._deployment_label = deployment_label
        self._pods = load_pods_file(path, deployment_label)
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    async def run(self, on_update: PodsCallback) -> None:
        on_update(self._pods)
        seen = self._stamp
        while True:
            await asyncio.sleep(self._poll_s)
            stamp = self._stat()
            if stamp != seen:
                seen = stamp  # changed since the last poll: maybe mid-write, look again next poll
                continue
            if stamp == self._stamp:
                continue
            self._stamp = stamp
            try:
                pods = load_pods_file(self.path, self._deployment_label)
            except ConfigError as exc:
                log.error("ignoring changed pods file, keeping the last good list: %s", exc)
                continue
            log.info("pods file changed: %d pods", len(pods))
            self._pods = pods
            on_update(pods)
