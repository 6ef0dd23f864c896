"""Data plane, operator-locked routing headers: through a real Envoy, a request that sends a
header the operator locked gets the plugin's 403 in OpenAI's shape (Envoy's local-reply mappers
leave it as written), one that sends an allowed value is routed by it, and with the `ignore`
action the locked header is dropped and the request served by the default strategy."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from tests.helpers import chat_body

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio]

MODEL = "llama-3-8b"
LOCK = "routing-strategy=least-request|random; external-filter=deny"


async def _post(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=chat_body(MODEL, 4), headers=headers) as r,
    ):
        return r.status, dict(r.headers), await r.read()


@pytest.mark.parametrize("action", ["reject", "ignore"])
async def test_locked_headers_through_envoy(tmp_path: Path, action: str) -> None:
    spec = FleetSpec(
        model=MODEL,
        presets=("a100", "l20"),
        listen_port=free_port(),
        plugin_env={
            "HETERO_GATEWAY_CLIENT_HEADERS": LOCK,
            "HETERO_GATEWAY_DENIED_HEADER_ACTION": action,
        },
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        allowed = await _post(fleet.envoy_url, {"routing-strategy": "least-request"})
        locked = await _post(fleet.envoy_url, {"routing-strategy": "round-robin"})
        selector = await _post(fleet.envoy_url, {"external-filter": "gpu=none"})
    status, headers, _ = allowed
    assert status == 200 and headers["routing-strategy"] == "least-request"
    for (status, headers, body), name in (
        (locked, "routing-strategy"),
        (selector, "external-filter"),
    ):
        if action == "reject":
            assert status == 403, body[:200]
            error = orjson.loads(body)["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "permission_error",
                "header_not_allowed",
                name,
            )
        else:
            # Dropped: served by the default strategy (a selector matching nothing would fail).
            assert status == 200, body[:200]
            assert headers["routing-strategy"] == "load-balance"
