"""Data plane, a hung plugin and a held request: Envoy waits about 1 s for the plugin's reply to a
message, except for a request the plugin holds in its SLO queue, which it tells Envoy to wait for.

- A plugin stopped with SIGSTOP (hung, not dead: its sockets stay open) stalls a new request
  about one message timeout, then the wiring's failure mode answers: fail-closed an error at
  once instead of after 60 s, fail-open (override-host) the engines by round robin.
- A request held at the gateway for longer than the message timeout is still served: the plugin
  sends `override_message_timeout` before it waits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import orjson
import pytest

from plugin.config import ENVOY_MESSAGE_TIMEOUT_S
from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from tests.helpers import chat_body, write_one_at_a_time_profile

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio]

MODEL = "llama-3-8b"
STALL_BOUND_S = ENVOY_MESSAGE_TIMEOUT_S + 2.0  # the timeout, plus Envoy's and a loaded machine's


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process hangs (SIGSTOP) for the block's duration, then resumes."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def _post(
    url: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str], float]:
    """(status, body, headers, seconds taken) of one chat completion through Envoy."""
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=90)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        data = await resp.read()
        return resp.status, data, dict(resp.headers), time.monotonic() - started


async def _routed_again(fleet: LocalFleet) -> None:
    """After SIGCONT the plugin routes again (its picks carry target-pod)."""
    status, _, headers, _ = await _post(fleet.envoy_url, chat_body(MODEL, 4))
    assert status == 200 and "target-pod" in headers


async def test_a_hung_plugin_fails_closed_within_the_message_timeout(tmp_path: Path) -> None:
    spec = FleetSpec(model=MODEL, presets=("a100",), listen_port=free_port())
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        await _routed_again(fleet)
        assert fleet.plugin is not None
        with stopped(fleet.plugin.pid):
            status, _, _, took = await _post(fleet.envoy_url, chat_body(MODEL, 4))
        assert status >= 500  # fail-closed: no route without the plugin's pick
        assert took < STALL_BOUND_S  # not Envoy's old 60 s
        await _routed_again(fleet)


async def test_a_hung_plugin_fails_open_to_the_engines_within_the_message_timeout(
    tmp_path: Path,
) -> None:
    spec = FleetSpec(
        model=MODEL,
        presets=("a100", "l20"),
        listen_port=free_port(),
        fail_open=True,
        steering="override-host",
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        await _routed_again(fleet)
        assert fleet.plugin is not None
        with stopped(fleet.plugin.pid):
            status, data, headers, took = await _post(fleet.envoy_url, chat_body(MODEL, 4))
        assert status == 200 and orjson.loads(data)["choices"]
        assert "target-pod" not in headers  # served by round robin, not by a pick
        assert took < STALL_BOUND_S
        await _routed_again(fleet)


async def test_a_request_held_longer_than_the_message_timeout_is_served(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    write_one_at_a_time_profile(profiles, MODEL)
    spec = FleetSpec(
        model=MODEL,
        presets=("a100",),
        time_scale=6.0,  # 32 tokens take about 2 s
        listen_port=free_port(),
        plugin_env={
            "HETERO_GATEWAY_PROFILE_DIR": str(profiles),
            "HETERO_GATEWAY_SLO_MAX_WAIT_MS": "10000",
        },
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        body = chat_body(MODEL, 32, content="x" * 64)  # 16 prompt tokens: the profile cell
        slo = {"routing-strategy": "slo"}
        first = asyncio.create_task(_post(fleet.envoy_url, body, slo))
        await asyncio.sleep(0.3)  # the first is on the a100; the second must wait for it
        second = await _post(fleet.envoy_url, body, slo)
        status1, _, _, took1 = await first
    status2, _, headers2, took2 = second
    assert status1 == status2 == 200
    assert headers2.get("routing-strategy") == "slo"
    # It waited for the first to end: longer than Envoy's message timeout, and still served.
    assert took2 > ENVOY_MESSAGE_TIMEOUT_S + 0.5
    assert took2 > took1 - 0.3


async def _stream(url: str) -> tuple[int, bool, dict[str, str]]:
    """One long streamed chat completion: (status, ended with [DONE], response headers)."""
    body = chat_body(MODEL, 200, stream=True)
    timeout = aiohttp.ClientTimeout(total=90)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{url}/v1/chat/completions", json=body) as resp,
        ):
            text = (await resp.read()).decode()
            return resp.status, text.rstrip().endswith("data: [DONE]"), dict(resp.headers)
    except aiohttp.ClientPayloadError:
        return 200, False, {}  # cut mid-stream


async def test_a_plugin_crash_cuts_no_running_generation(tmp_path: Path) -> None:
    """kill -9 of the plugin with generations streaming through the default (fail-closed)
    wiring: the routing stream ended at the pick, so Envoy has nothing to fail them with."""
    spec = FleetSpec(
        model=MODEL,
        presets=("a100", "l20"),
        time_scale=3.0,  # 200 tokens take several seconds
        tokens_per_chunk=1,
        listen_port=free_port(),
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        streams = [asyncio.create_task(_stream(fleet.envoy_url)) for _ in range(8)]
        await asyncio.sleep(1.5)  # all are generating
        assert fleet.plugin is not None
        fleet.plugin.kill()  # SIGKILL: no drain
        results = await asyncio.gather(*streams)
        # The AIBrix response headers still come (from Envoy's route now).
        for status, complete, headers in results:
            assert status == 200 and complete
            assert {"request-id", "routing-strategy", "target-pod", "target-pod-ip"} <= set(headers)
        await fleet.start_plugin()
        await _routed_again(fleet)
