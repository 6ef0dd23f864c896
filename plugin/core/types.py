"""Core value types: a pod as discovery describes it, and what a strategy sees of a candidate.

`SloTarget` lives beside the GPU profiles (`plugin.core.profile`), whose `slos` it reads once
per profile; it is imported from here as well."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from plugin.core.config_profile import ModelConfig
from plugin.core.profile import GpuProfile
from plugin.core.profile import SloTarget as SloTarget  # its old home: importers keep it
from plugin.core.selector import LabelSelector


@dataclass(frozen=True, slots=True)
class Pod:
    """One replica of one model. Every per-pod state is keyed by `key` (namespace/name).

    `key` and `endpoint` are computed once: the pool reads them on every lease and every
    discovery update, for every pod.
    """

    name: str
    namespace: str
    model: str
    address: str
    port: int
    metrics_port: int
    engine: str = "vllm"
    ready: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)
    # The deployment (GPU type) the pod belongs to, from the label discovery is configured to
    # read (AIBRIX_POD_DEPLOYMENT_LABEL): what maps a pod to its GPU profile. None: unlabelled.
    deployment: str | None = None
    # AIBrix's `model.aibrix.ai/config` (annotation, or `config` in the pods file), parsed by
    # discovery; None without one (`plugin.core.config_profile`).
    model_config: ModelConfig | None = field(default=None, repr=False)
    # The engine's batch cap as declared (the pods file's `maxNumSeqs`, the pod's annotation or
    # its engine's `--max-num-seqs` / `--max-running-requests` flag); None: read from its
    # metrics instead (the cap its engine exports, else learned).
    max_num_seqs: int | None = None
    # The HTTP path of the engine's Prometheus page on `metrics_port`: TensorRT-LLM's
    # `trtllm-serve` serves it at /prometheus/metrics, the others at /metrics.
    metrics_path: str = "/metrics"
    key: str = field(init=False, repr=False, compare=False)
    # IP:PORT as Envoy's ORIGINAL_DST cluster reads it from `target-pod`.
    endpoint: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        host = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "key", f"{self.namespace}/{self.name}")
        object.__setattr__(self, "endpoint", f"{host}:{self.port}")


class EngineMetrics(NamedTuple):
    """Engine-reported values; None when the engine does not export them.

    A named tuple, not a frozen dataclass: one is made per pod and scrape tick (at 10,000 pods
    with five gateways sharing the scrapes, 10,000 a second per gateway, most of them decoded
    from the others' records), and a frozen dataclass's `__init__` (a guarded `__setattr__` per
    field) cost 3.4 us against 0.9 here. Immutable all the same."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    cpu_kv_usage: float | None = None  # 0..1, KV blocks offloaded to CPU (vLLM), where exported
    # The engine's own cumulative count of output tokens it generated (vLLM's and SGLang's
    # `*:generation_tokens_total`): where exported, capacity is learned from its increase per
    # scrape, exactly and with no per-token cost at the gateway.
    generation_tokens: float | None = None
    # The counter grows step by step as tokens are generated (vLLM's), not as requests finish
    # (SGLang's): only then does one scrape interval's increase tell the replica's speed
    # (`plugin.core.capacity.SpeedWatch`).
    generation_tokens_stepwise: bool = False
    # The batch cap the engine exports (TensorRT-LLM's `trtllm_max_num_active_requests`): where
    # the pod declares none, it counts as declared (`PodPool.saturation`).
    max_batch: float | None = None
    # Cumulative sums and counts of the engine's request queue-time and inter-token-latency
    # histograms (vLLM's `vllm:request_queue_time_seconds`, `vllm:inter_token_latency_seconds`;
    # vLLM observes a request's queue time when it finishes): how long the requests that
    # finished between two scrapes had waited, in engine steps, tells a queue held by a full
    # batch from one that waits for the next step (`BatchCap`, `plugin.core.batch_cap`).
    queue_time_sum: float | None = None
    queue_time_count: float | None = None
    token_latency_sum: float | None = None
    token_latency_count: float | None = None


@dataclass(slots=True)
class Candidate:
    """What a strategy may read about one routable pod: nothing else reaches it."""

    pod: Pod
    running: int  # in flight, as the gateway counts them
    waiting: float | None  # engine queue; None when unknown or stale
    kv_usage: float | None  # 0..1; None when unknown, stale or NaN
    capacity: float | None  # learned output tokens/s; None before the first estimate
    # In-flight requests at which the engine's batch is full: its declared cap (or the one its
    # engine exports), or its learned cap plus a 1/64 slack (`BatchCap.full_at`); None while no
    # cap is known.
    saturation: int | None = None
    # Share of the pod this gateway's requests take by their strategies' accounting (SLO
    # routing: 1.0 is full); 0 when no strategy accounts for load.
    load: float = 0.0
    # The GPU profile of the pod's deployment, None without one (`plugin.core.profile`).
    profile: GpuProfile | None = None
    # CPU KV-cache usage 0..1 where the engine exports it (vLLM's `vllm:cpu_cache_usage_perc`);
    # load-balance breaks ties by GPU + CPU usage, as AIBrix does. None when unknown or stale.
    cpu_kv_usage: float | None = None
    # Clock time at which the pod will have prefilled the prompts this gateway routed to it,
    # as a queue served in arrival order at its profile's prefill speed
    # (`GpuProfile.prefill_tokens_per_s`): a request routed now waits for that before its own
    # prefill (an engine gives prefills a step's token budget in arrival order). 0: nothing.
    prefill_free_at: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the gateway knows of a request when it routes it (`plugin.core.request` builds it).

    Prompt sizes are what the body holds: characters of its text parts and the tokenizer's
    estimate of their tokens (token-id prompts count exactly). `max_tokens` is the body's
    `max_completion_tokens` or `max_tokens`, None when absent. `arrived_at` is clock time when
    the request's headers reached the gateway.
    """

    model: str
    stream: bool = False
    include_usage: bool = False
    body_bytes: int = 0
    request_id: str = ""
    prompt_chars: int = 0
    prompt_tokens: int = 0
    max_tokens: int | None = None
    slo: SloTarget | None = None
    arrived_at: float = 0.0
    # Output tokens the model's recent completions predict for a prompt of this size (the
    # router fills it in from its history; None without history).
    predicted_output_tokens: int | None = None
    # AIBrix's `external-filter` header: only pods whose labels match may serve the request.
    pod_selector: LabelSelector | None = None
    # The prompt's text parts in order, as the body holds them (chat contents, completion
    # strings; a token-id prompt as 4 characters an id): what prefix-cache hashes. References to
    # the parsed body's strings, so collecting them costs an append each; left out of the repr.
    prompt_parts: tuple[str, ...] = field(default=(), repr=False)
    # Who sent it and the priority class it asked for (`plugin.core.admission`): set by the
    # adapter when admission is on; the class is a request, its tenant's ceiling applies.
    tenant: str = "default"
    priority_class: str | None = None
