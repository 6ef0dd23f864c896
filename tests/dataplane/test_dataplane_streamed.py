"""Data plane with `count_mode="streamed"`: the routing filter itself sees every response chunk
(no second, observability-mode filter). Tokens and in-flight counts must come out the same."""

from __future__ import annotations

import aiohttp
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet
from plugin_tools.demo.loadgen import LengthDist, Workload, run_open_loop
from tests.helpers import debug_pods, metric_sum, wait_idle

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]


MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def fleet_spec() -> FleetSpec:
    """The routing filter counts too (the conftest's `fleet` runs it)."""
    return FleetSpec(model=MODEL, time_scale=1.0, tokens_per_chunk=4, count_mode="streamed")


async def test_streamed_mode_counts_every_token(fleet: LocalFleet) -> None:
    async with aiohttp.ClientSession() as session:
        before = await debug_pods(session, fleet.plugin_url)
        generated_before = [
            await metric_sum(session, e.url, "vllm:generation_tokens_total") for e in fleet.engines
        ]
        workload = Workload(
            rate_per_s=10,
            duration_s=4,
            prompt_words=LengthDist(median=8, sigma=0.3, low=2, high=32),
            output_tokens=LengthDist(median=20, sigma=0.5, low=2, high=80),
            seed=3,
        )
        results = await run_open_loop(
            fleet.envoy_url, MODEL, workload, strategy="load-balance", request_timeout_s=60
        )
        await wait_idle(session, fleet)
        # In this mode the routing stream both holds the lease and counts: no settling needed.
        after = await debug_pods(session, fleet.plugin_url)
        generated_after = [
            await metric_sum(session, e.url, "vllm:generation_tokens_total") for e in fleet.engines
        ]
    assert results and all(r.ok for r in results)
    counted = sum(
        after["pods"][k]["output_tokens_total"] - before["pods"][k]["output_tokens_total"]
        for k in before["pods"]
    )
    assert counted == sum(generated_after) - sum(generated_before)
    assert counted == sum(r.output_tokens for r in results)
