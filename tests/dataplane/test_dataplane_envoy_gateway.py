"""Data plane through the Envoy Gateway model: real traffic through the xDS Envoy Gateway would
generate for deploy/overlays/original-dst, with our EnvoyPatchPolicies applied
(`tests/envoy_gateway.py`), run by a real Envoy in front of the plugin and mock engines.

What no cluster is needed to see: the patched routing filter only picks (the AIBrix response
headers come from the route; a plugin killed -9 cuts no running generation), the counting filter
holds each request's in-flight slot to its end, and a request of 100 header lines, which Envoy
alone accepts, is routed. What only a cluster run confirms is in docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from tests.envoy_gateway import patched
from tests.helpers import Kustomize, chat_body, metric_sum, poll

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def fleet_spec() -> FleetSpec:
    """Mock engines and the plugin (the conftest's `fleet`); its own Envoy goes unused."""
    return FleetSpec(model=MODEL, presets=("a100", "l20"), time_scale=3.0, tokens_per_chunk=1)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway_url(fleet: LocalFleet, render: Kustomize) -> str:
    """A real Envoy running the patched Envoy Gateway model, its ext_proc clusters pointed at the
    fleet's plugin; returns its URL."""
    boot: dict[str, Any] = patched(render("original-dst"), plugin_port=fleet.grpc_port).bootstrap()
    port, admin = free_port(), free_port()
    boot["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = boot["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    text = yaml.safe_dump(boot, sort_keys=False)
    await fleet.start_envoy_bootstrap("envoy-gateway-model", text, admin)
    return f"http://127.0.0.1:{port}"


async def stream(
    session: aiohttp.ClientSession, url: str, tokens: int
) -> tuple[bool, dict[str, str]]:
    """One streamed generation: whether it ended with [DONE], and its response headers."""
    body = chat_body(MODEL, tokens, stream=True)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            text = (await resp.read()).decode()
            done = resp.status == 200 and text.rstrip().endswith("data: [DONE]")
            return done, dict(resp.headers)
    except aiohttp.ClientError:
        return False, {}


async def test_the_pick_steers_and_the_counting_stream_holds_the_slot(
    fleet: LocalFleet, gateway_url: str
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        tokens_before = await metric_sum(
            session, fleet.plugin_url, "hetero_gateway_output_tokens_total"
        )
        done, headers = await stream(session, gateway_url, 24)
        assert done
        # From the route, as the patch adds them: the plugin answered no response phase.
        assert headers["target-pod"] in {e.name for e in fleet.engines}
        assert headers["target-pod-ip"] in {f"127.0.0.1:{e.port}" for e in fleet.engines}
        assert headers["routing-strategy"]
        await poll(
            functools.partial(
                metric_sum, session, fleet.plugin_url, "hetero_gateway_output_tokens_total"
            ),
            lambda n: n == tokens_before + 24,
            "the counting stream to credit the tokens",
        )
        await poll(
            functools.partial(
                metric_sum, session, fleet.plugin_url, "hetero_gateway_inflight_requests"
            ),
            lambda n: n == 0,
            "the counting stream to end the lease",
        )


async def test_a_request_of_100_header_lines_is_routed(gateway_url: str) -> None:
    """Envoy's default limit is 100 lines; aiohttp sends 6 of its own."""
    extra = {f"x-extra-{i}": "v" for i in range(94)}
    async with aiohttp.ClientSession() as session:
        body = chat_body(MODEL, 2)
        async with session.post(
            f"{gateway_url}/v1/chat/completions", json=body, headers=extra
        ) as resp:
            assert resp.status == 200, await resp.text()


async def test_a_killed_plugin_cuts_no_running_generation(
    fleet: LocalFleet, gateway_url: str
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        running = [asyncio.create_task(stream(session, gateway_url, 120)) for _ in range(6)]
        await asyncio.sleep(1.0)  # every generation is streaming
        assert fleet.plugin is not None
        fleet.plugin.kill()
        outcomes = await asyncio.gather(*running)
    await fleet.plugin.wait()
    await fleet.start_plugin()  # for whatever runs after
    assert all(done for done, _ in outcomes), "a generation was cut"
