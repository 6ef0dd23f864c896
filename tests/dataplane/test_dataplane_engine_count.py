"""Data plane with `count_mode="engine"`: no response chunk reaches the plugin; the counting
stream sees each response's status and end (the in-flight count), and capacity is learned from
the engines' own generated-token counters, read at every scrape."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet
from plugin_tools.demo.loadgen import LengthDist, Workload, run_open_loop
from tests.helpers import debug_pods, metric_sum, poll

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def fleet_spec() -> FleetSpec:
    return FleetSpec(
        model=MODEL,
        time_scale=1.0,
        tokens_per_chunk=4,
        count_mode="engine",
        plugin_env={"AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "250"},
    )


async def _inflight(session: aiohttp.ClientSession, fleet: LocalFleet) -> int:
    state = await debug_pods(session, fleet.plugin_url)
    return sum(p["inflight"] for p in state["pods"].values())


async def test_in_flight_slots_come_back_with_the_response_end(fleet: LocalFleet) -> None:
    """Without a body the counting stream's end is the response's end: the slot comes back
    then, not when Envoy's deferred close (5 s by default) would end it."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 64,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.envoy_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            payload = await resp.read()
            assert await _inflight(session, fleet) == 1  # still held: the stream is open
        assert payload.rstrip().endswith(b"data: [DONE]")
        # Well before Envoy's default deferred close of 5 s would have ended the stream.
        await poll(lambda: _inflight(session, fleet), lambda n: n == 0, "slot back", limit_s=2.5)


async def test_capacity_is_learned_from_the_engines_counters_with_no_chunk_counted(
    fleet: LocalFleet,
) -> None:
    async with aiohttp.ClientSession() as session:
        before = await debug_pods(session, fleet.plugin_url)
        workload = Workload(
            rate_per_s=12,
            duration_s=4,
            prompt_words=LengthDist(median=8, sigma=0.3, low=2, high=32),
            output_tokens=LengthDist(median=40, sigma=0.5, low=4, high=120),
            seed=5,
        )
        results = await run_open_loop(
            fleet.envoy_url, MODEL, workload, strategy="least-request", request_timeout_s=60
        )
        assert results and all(r.ok for r in results)
        await poll(lambda: _inflight(session, fleet), lambda n: n == 0, "no slot held", limit_s=5)
        await asyncio.sleep(0.6)  # two scrapes: every engine's last tokens are read
        after = await debug_pods(session, fleet.plugin_url)
        generated = {
            e.name: await metric_sum(session, e.url, "vllm:generation_tokens_total")
            for e in fleet.engines
        }
    assert sum(generated.values()) >= sum(r.output_tokens for r in results) > 0
    for key, pod in after["pods"].items():
        assert pod["token_source"] == "engine", key
        # No body reached the plugin: it counted nothing itself.
        assert pod["output_tokens_total"] == before["pods"][key]["output_tokens_total"] == 0
        assert pod["routed_total"] > before["pods"][key]["routed_total"]
        assert pod["capacity_tokens_per_s"] is not None and pod["capacity_tokens_per_s"] > 0
