"""Data plane, admission (`docs/admission.md`): through a real Envoy to a mock engine whose GPU
profile keeps one request in flight within its SLO, an interactive request that arrives after a
batch one is served first, and the batch one, once it has waited its limit, is answered 503 in
OpenAI's shape with `retry-after`, which Envoy hands to the client unchanged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from tests.helpers import chat_body, write_one_at_a_time_profile

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio]

MODEL = "llama-3-8b"


async def _post(url: str, tenant: str) -> tuple[int, dict[str, str], bytes, float]:
    """(status, headers, body, seconds taken) of one chat completion through Envoy."""
    started = time.monotonic()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
        session.post(
            f"{url}/v1/chat/completions",
            json=chat_body(MODEL, 32, content="x" * 64),
            headers={"x-tenant": tenant},
        ) as resp,
    ):
        body = await resp.read()
        headers = {k.lower(): v for k, v in resp.headers.items()}
        return resp.status, headers, body, time.monotonic() - started


async def test_the_interactive_class_goes_first_and_the_batch_one_is_shed(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    write_one_at_a_time_profile(profiles, MODEL)
    spec = FleetSpec(
        model=MODEL,
        presets=("a100",),
        time_scale=6.0,  # 32 tokens take about 2 s
        listen_port=free_port(),
        plugin_env={
            "HETERO_GATEWAY_PROFILE_DIR": str(profiles),
            "HETERO_GATEWAY_ADMISSION": "on",
            "HETERO_GATEWAY_TENANT_HEADER": "x-tenant",
            "HETERO_GATEWAY_PRIORITY_CLASSES": "interactive,batch",
            "HETERO_GATEWAY_TENANT_CLASSES": "chat:interactive",
            "HETERO_GATEWAY_ADMISSION_MAX_WAIT_MS": "3000",
        },
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        first = asyncio.create_task(_post(fleet.envoy_url, "bulk"))
        await asyncio.sleep(0.3)  # on the a100, which holds one within its SLO
        waiting = asyncio.create_task(_post(fleet.envoy_url, "bulk"))
        await asyncio.sleep(0.3)
        chat = await _post(fleet.envoy_url, "chat")  # queued after the second, served first
        shed = await waiting
        served = await first
    assert served[0] == 200 and chat[0] == 200
    assert chat[3] > 1.0  # it waited for the first to end
    status, headers, body, took = shed
    assert status == 503, body
    assert int(headers["retry-after"]) >= 1
    assert headers.get("x-error-routing") == "true"
    assert orjson.loads(body)["error"]["type"] == "overloaded_error"
    assert took >= 2.9  # its limit, while the interactive request held the a100


async def test_a_tenant_s_limit_holds_through_envoy_with_openai_s_headers(tmp_path: Path) -> None:
    """With the default (pick-only) wiring the routing stream never sees the response: Envoy's
    route adds the `x-ratelimit-*` headers from the plugin's metadata; the request over the
    limit is a 429 with `retry-after` at the client."""
    spec = FleetSpec(
        model=MODEL,
        presets=("a100",),
        time_scale=8.0,
        listen_port=free_port(),
        plugin_env={
            "HETERO_GATEWAY_ADMISSION": "on",
            "HETERO_GATEWAY_TENANT_HEADER": "x-tenant",
            "HETERO_GATEWAY_TENANT_REQUESTS_PER_MINUTE": "team:2",
            "HETERO_GATEWAY_TENANT_TOKENS_PER_MINUTE": "team:100000",
        },
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        first = await _post(fleet.envoy_url, "team")
        second = await _post(fleet.envoy_url, "team")
        refused = await _post(fleet.envoy_url, "team")
        other = await _post(fleet.envoy_url, "someone-else")
    assert first[0] == second[0] == other[0] == 200
    headers = first[1]
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 100000
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    assert "x-ratelimit-limit-gpu-seconds" not in headers  # not limited in GPU time
    assert second[1]["x-ratelimit-remaining-requests"] == "0"
    assert not any(k.startswith("x-ratelimit") for k in other[1])  # no limits, no headers
    status, headers, body, _ = refused
    assert status == 429, body
    assert int(headers["retry-after"]) >= 50
    assert headers["x-error-rpm-exceeded"] == "true"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    error = orjson.loads(body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
