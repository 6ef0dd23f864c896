"""The GPU optimizer service: traced traffic + GPU profiles -> replicas per deployment, over HTTP.

Every 10 s, 2 s after a trace window closes (the gateways flush just after the boundary), it
lists each model's deployments, reads the last `lookback` seconds of trace windows from Redis,
builds the model's problem (`plugin.core.workload`), solves it off the event loop
(`plugin.core.optimizer`, SciPy's HiGHS) and passes each deployment's count through the
scale-down gate. AIBrix's PodAutoscaler reads the result from `GET /metrics/<ns>/<deployment>`
as `vllm:deployment_replicas{model_name="<m>"} <replicas x 100>` (1/100-GPU units, paired with
`targetValue: "100"`).

What it answers for a monitored deployment: an operator's override (`PUT /scale`) wins over the
plan; a deployment without a profile, or before the first plan, gets what it runs now
(the autoscaler holds it steady). Failures degrade, never flap: deployments that cannot be
listed keep the last list; traces that cannot be read keep the last plan (an outage of Redis must
not look like an idle fleet and scale everything to its minimum).
"""

from __future__ import annotations

from plugin.adapters.optimizer.http import (
    build_app,
    replicas_text,
)
from plugin.adapters.optimizer.run import (
    OptimizerService,
    deployment_source,
    run_until_signal,
)
from plugin.adapters.optimizer.sources import (
    MIN_REPLICAS_LABEL,
    MODEL_LABEL,
    READ_DELAY_S,
    REPLICA_UNITS,
    TRACE_READ_TIMEOUT_S,
    DeploymentSource,
    KubernetesDeployments,
    PodsFileDeployments,
    RedisTraces,
    TraceSource,
    UnknownDeployment,
)
from plugin.adapters.optimizer.state import (
    Optimizer,
)

__all__ = [
    "MIN_REPLICAS_LABEL",
    "MODEL_LABEL",
    "READ_DELAY_S",
    "REPLICA_UNITS",
    "TRACE_READ_TIMEOUT_S",
    "DeploymentSource",
    "KubernetesDeployments",
    "Optimizer",
    "OptimizerService",
    "PodsFileDeployments",
    "RedisTraces",
    "TraceSource",
    "UnknownDeployment",
    "build_app",
    "deployment_source",
    "replicas_text",
    "run_until_signal",
]
