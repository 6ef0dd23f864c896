"""From a request's headers and body to a lease on one pod: the decision, without protobuf."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import orjson

from plugin.core.pool import Lease, PodPool
from plugin.core.strategies import Strategy
from plugin.core.types import RequestInfo
from plugin.errors import BadRequestBody, NoModel, UnknownStrategy

__all__ = ["LLM_PATHS", "MODELS_PATH", "Decision", "Router", "models_list", "parse_request"]

# Paths whose JSON body names a model and whose response reports usage; others pass through.
LLM_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Answered by the gateway itself from discovery (OpenAI's model list).
MODELS_PATH = "/v1/models"


def models_list(models: Iterable[str]) -> bytes:
    """OpenAI's `GET /v1/models` body for the models discovery knows."""
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "hetero-gateway"} for m in models
    ]
    return orjson.dumps({"object": "list", "data": data})


def parse_request(body: bytes, request_id: str = "") -> RequestInfo:
    """Read what routing needs from an OpenAI-style body; raise the request error otherwise."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequestBody("request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise BadRequestBody("request body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise NoModel()
    stream = doc.get("stream") is True
    options = doc.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return RequestInfo(model, stream, include_usage, len(body), request_id)


@dataclass(frozen=True, slots=True)
class Decision:
    lease: Lease
    strategy: str
    request: RequestInfo


class Router:
    """Chooses a pod for a request with the named (or default) strategy."""

    __slots__ = ("_clock", "_default", "_rng", "_strategies", "pool")

    def __init__(
        self,
        pool: PodPool,
        strategies: Mapping[str, Strategy],
        default_strategy: str,
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        if default_strategy not in strategies:
            raise ValueError(f"unknown default strategy {default_strategy}")
        self.pool = pool
        self._strategies = dict(strategies)
        self._default = default_strategy
        self._rng = rng
        self._clock = clock

    def now(self) -> float:
        return self._clock()

    def strategy_for(self, header: str | None) -> Strategy:
        """The `routing-strategy` header's strategy, else the default; unknown -> 400."""
        name = header.strip() if header else ""
        if not name:
            return self._strategies[self._default]
        strategy = self._strategies.get(name)
        if strategy is None:
            raise UnknownStrategy(name)
        return strategy

    def route(self, request: RequestInfo, strategy: Strategy) -> Decision:
        candidates = self.pool.candidates(request.model, self._clock())
        chosen = strategy.pick(candidates, request, self._rng)
        return Decision(self.pool.acquire(chosen.pod), strategy.name, request)
