"""OpenTelemetry spans of a request whose lease is parked for the counting stream (pick-only
wiring) and then released without it: another replica's counting stream took the request
over, or none claimed it in time. Its trace still ends, saying so (`SpanSet.handed_off`)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plugin.adapters.extproc import LeaseHandoff
from plugin.adapters.otel import PREFIX, RequestSpans
from plugin.core.router import Decision
from tests.unit.test_slo import pod, req, setup

pytestmark = pytest.mark.unit


def _traced(decision: Decision, spans: RequestSpans) -> Decision:
    s = spans.start({})
    s.deciding()
    s.routed(decision, False)
    return dataclasses.replace(decision, spans=s)


@pytest.mark.parametrize("how", ["claimed elsewhere", "expired"])
async def test_a_lease_released_without_its_counting_stream_ends_its_trace(how: str) -> None:
    router, _, clock, _ = setup(pod("a", "fast"))
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    decision = router.admit(req(clock), router.strategy_for("least-request"))
    assert isinstance(decision, Decision)
    decision = _traced(decision, RequestSpans(provider))
    handoff = LeaseHandoff(router, timeout_s=0.01)
    key = ("req-1", decision.lease.pod.endpoint)
    handoff.park(key, decision)
    if how == "claimed elsewhere":
        assert handoff.claimed_elsewhere([key]) == 1
    else:
        await asyncio.sleep(0.05)
        assert handoff.expired == 1
    assert decision.lease.released
    ended = {s.name: s for s in exported.get_finished_spans()}
    assert set(ended) == {"gateway request", "routing decision", "upstream"}
    attributes = ended["gateway request"].attributes or {}
    assert attributes[PREFIX + "counted_elsewhere"] is True
