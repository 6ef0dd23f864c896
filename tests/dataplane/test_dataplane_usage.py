"""Exact token counts through real Envoy when the client did not ask for usage: the plugin asks
the engine for it (`stream_options.include_usage`), counts the engine's report, and Envoy's Lua
filter takes the usage chunk out of the stream again, so the client sees what it asked for. The
mock engines send 4 tokens per SSE event, so counting events would credit a quarter."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet
from tests.helpers import debug_pods, metric_sum, wait_idle

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"


@pytest.fixture(scope="module", params=["observe", "streamed"])
def fleet_spec(request: pytest.FixtureRequest) -> FleetSpec:
    return FleetSpec(model=MODEL, time_scale=1.0, tokens_per_chunk=4, count_mode=request.param)


def _events(payload: bytes) -> list[Any]:
    events: list[Any] = []
    for line in payload.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(orjson.loads(line[6:]))
    return events


async def _counts(session: aiohttp.ClientSession, fleet: LocalFleet) -> tuple[int, int, float]:
    """(tokens the plugin counted, of which estimated, tokens the engines generated)."""
    state = await debug_pods(session, fleet.plugin_url)
    counted = sum(p["output_tokens_total"] for p in state["pods"].values())
    estimated = sum(p["output_tokens_estimated"] for p in state["pods"].values())
    generated = 0.0
    for e in fleet.engines:
        generated += await metric_sum(session, e.url, "vllm:generation_tokens_total")
    return counted, estimated, generated


@pytest.mark.parametrize(
    ("options", "usage_chunks"),
    [
        pytest.param(None, 0, id="no-stream-options"),
        pytest.param({"include_usage": False}, 0, id="usage-declined"),
        pytest.param({"include_usage": True}, 1, id="usage-asked-for-is-kept"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_is_credited_the_engines_count_and_the_client_sees_what_it_asked_for(
    fleet: LocalFleet, options: dict[str, bool] | None, usage_chunks: int, path: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 37, "stream": True}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "count me exactly"}]
    else:
        body["prompt"] = "count me exactly"
    if options is not None:
        body["stream_options"] = options
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        counted0, estimated0, generated0 = await _counts(session, fleet)
        async with session.post(f"{fleet.envoy_url}{path}", json=body) as resp:
            assert resp.status == 200
            payload = await resp.read()
        await wait_idle(session, fleet)
        counted1, estimated1, generated1 = await _counts(session, fleet)
    events = _events(payload)
    usage = [e for e in events if e.get("usage")]
    assert len(usage) == usage_chunks
    assert all(e["choices"] for e in events if not e.get("usage"))
    assert payload.rstrip().endswith(b"data: [DONE]")
    assert generated1 - generated0 == 37
    assert counted1 - counted0 == 37
    assert estimated1 == estimated0


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_the_responses_api_is_routed_and_counted(fleet: LocalFleet, stream: bool) -> None:
    body = {"model": MODEL, "input": "count this", "max_output_tokens": 23, "stream": stream}
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        counted0, estimated0, generated0 = await _counts(session, fleet)
        async with session.post(f"{fleet.envoy_url}/v1/responses", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["routing-strategy"]  # the plugin routed it
            assert resp.headers["target-pod"] in {e.name for e in fleet.engines}
            payload = await resp.read()
        await wait_idle(session, fleet)
        counted1, estimated1, generated1 = await _counts(session, fleet)
    if stream:
        assert payload.rstrip().endswith(b"}")  # the Responses API sends no [DONE]
        assert b"response.completed" in payload
    else:
        assert orjson.loads(payload)["usage"]["output_tokens"] == 23
    assert generated1 - generated0 == counted1 - counted0 == 23
    assert estimated1 == estimated0
