"""The counting stream (observability mode): the response's tokens, the lease's end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from plugin.adapters.steering import (
    LEASE_HEADER,
    PROMPT_TOKENS_HEADER,
    RESERVATION_HEADER,
    TARGET_POD_HEADER,
)
from plugin.core.pool import Lease
from plugin.core.router import Decision, Router
from plugin.core.types import Pod

if TYPE_CHECKING:  # imported by `serve` only when tracing is on
    from plugin.adapters.tracing import TraceRecorder


from plugin.adapters.extproc.messages import _status, _value
from plugin.adapters.extproc.tokens import (
    ChunkGaps,
    LeaseHandoff,
    ResponseTokens,
    _finish,
    _trace_completed,
)


class CountingProcessor:
    """The counting filter's stream (observability mode): credit a response's output tokens.

    The pod comes from the `target-pod` header the routing filter set. Envoy does not wait for
    this stream and it gets no replies. With a pick-only routing filter this stream claims the
    request's lease (`LeaseHandoff`), or takes the count over when the routing stream ran on
    another plugin replica, and ends it with the response's tokens and status; else the routing
    stream holds the lease and this one only credits tokens. Either way once, when the body ends
    or the stream closes.
    """

    __slots__ = (
        "_adopted",
        "_decision",
        "_handoff",
        "_pod",
        "_prompt_tokens",
        "_reserved",
        "_router",
        "_tokens",
        "_tracer",
    )
    finished = False  # Envoy ends this stream; the plugin never answers on it

    def __init__(
        self,
        router: Router,
        handoff: LeaseHandoff | None = None,
        tracer: TraceRecorder | None = None,
    ) -> None:
        self._router = router
        self._handoff = handoff
        self._tracer = tracer
        self._decision: Decision | None = None  # the lease the routing stream passed on
        self._adopted: Lease | None = None  # the count taken over from another replica
        self._pod: Pod | None = None
        self._prompt_tokens = 0
        self._reserved = ""  # what the routing replica reserved of the tenant's limits
        self._tokens = ResponseTokens()

    def handle(self, req: pb.ProcessingRequest) -> None:
        phase = req.WhichOneof("request")
        if phase == "response_body":
            body = req.response_body
            self._tokens.feed(body.body, body.end_of_stream)
            if body.end_of_stream:
                self.close()
        elif phase == "request_headers":
            endpoint = request_id = lease = ""
            for h in req.request_headers.headers.headers:
                if h.key == TARGET_POD_HEADER:
                    endpoint = _value(h)
                    self._pod = self._router.pool.pod_by_endpoint(endpoint)
                elif h.key == PROMPT_TOKENS_HEADER:
                    text = _value(h)
                    ok = text.isascii() and text.isdigit() and len(text) < 10
                    self._prompt_tokens = int(text) if ok else 0
                elif h.key == "x-request-id":
                    request_id = _value(h)
                elif h.key == LEASE_HEADER:
                    lease = _value(h)
                elif h.key == RESERVATION_HEADER:
                    self._reserved = _value(h)
            pod, router, handoff = self._pod, self._router, self._handoff
            if pod is not None and self._tokens.gaps is None:
                self._tokens.gaps = ChunkGaps(
                    router.pool,
                    pod.key,
                    router.now,
                    self._prompt_tokens,
                    latency=router.latency,
                    pod=pod,
                )
            if handoff is not None and endpoint:
                key = (request_id, endpoint)
                self._decision = handoff.claim(key)
                if self._decision is not None:
                    held: Lease | None = self._decision.lease
                elif lease and pod is not None:
                    held = self._adopted = handoff.adopt(pod, lease, key, self._prompt_tokens)
                else:
                    held = None
                if self._tokens.gaps is not None:
                    self._tokens.gaps.lease = held
                    if self._decision is not None:  # the client's wait at the gateway counts
                        self._tokens.gaps.started_at = self._decision.request.arrived_at
        elif phase == "response_headers" and self._pod is not None:
            self._tokens.status = _status(req.response_headers)

    def close(self) -> None:
        pod, decision, adopted = self._pod, self._decision, self._adopted
        self._pod = self._decision = self._adopted = None  # once
        self._tokens.close_gaps()
        if decision is not None:  # this stream holds the request's lease: end it
            _finish(self._router, decision, self._tokens, self._tracer)
        elif pod is not None:
            pool, tokens = self._router.pool, self._tokens
            output = tokens.counted(pool.tokens_per_chunk(pod.key))
            if adopted is not None:  # the count this replica took over ends with the tokens
                adopted.release(output, tokens.status, self._router.now(), tokens.estimated())
                if self._reserved:  # and the tenant's limits settle here what it used
                    usage = tokens.usage()
                    prompt = usage.prompt_tokens if usage is not None else self._prompt_tokens
                    self._router.settle_handed(self._reserved, tokens.status, prompt, output)
            else:
                pool.credit_tokens(pod.key, output, tokens.estimated())
            self._router.completed(pod.model, self._prompt_tokens, output, tokens.status)
            if self._tracer is not None:
                tracer, prompt = self._tracer, self._prompt_tokens
                _trace_completed(tracer, pod.model, self._tokens, prompt, output)
