"""Data plane, failure of the plugin itself: the override_host wiring with fail-open keeps serving.

With ORIGINAL_DST, a request the plugin did not route has nowhere to go (fail-closed answers 503:
tests/dataplane/test_dataplane.py).
With a STATIC cluster under the override_host policy and the ext_proc
filter failing open, Envoy falls back to round robin over the engines while the plugin is down,
and the plugin's picks take over again once it is back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet
from tests.helpers import chat_body

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def fleet_spec() -> FleetSpec:
    """The override_host wiring, failing open (the conftest's `fleet` runs it)."""
    return FleetSpec(
        model=MODEL, time_scale=1.0, tokens_per_chunk=4, fail_open=True, steering="override-host"
    )


@dataclass
class Outcome:
    status: int
    complete: bool  # the SSE stream ended with [DONE]
    engine: str
    routed_by_plugin: bool  # the plugin's response headers are present
    started: float
    late: float  # how long after its slot in the open-loop schedule it was sent


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def one_request(
    session: aiohttp.ClientSession, url: str, load: Load, scheduled: float
) -> None:
    body = chat_body(MODEL, 24, stream=True, content="hello")
    started = time.monotonic()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            text = (await resp.read()).decode()
            load.outcomes.append(
                Outcome(
                    resp.status,
                    text.rstrip().endswith("data: [DONE]"),
                    resp.headers.get("x-mock-engine", ""),
                    "target-pod" in resp.headers,
                    started,
                    started - scheduled,
                )
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        load.errors.append(repr(exc))


async def offer(url: str, rate: float, done: asyncio.Event, load: Load) -> None:
    """Open-loop: one request every 1/rate s, whatever happens to the earlier ones, until `done`."""
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        n = 0
        while not done.is_set():
            scheduled = start + n / rate
            tasks.append(asyncio.create_task(one_request(session, url, load, scheduled)))
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        await asyncio.gather(*tasks)


async def ext_proc_stats(fleet: LocalFleet) -> dict[str, int]:
    """Envoy's counters of its ext_proc filters (streams failed, message timeouts, failures let
    through): a failure message carries them, so a flake names its cause."""
    url = f"http://127.0.0.1:{fleet.admin_port}/stats?filter=ext_proc\\.&format=json"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        doc = await resp.json()
    return {s["name"]: int(s["value"]) for s in doc["stats"] if "value" in s}


async def test_fail_open_serves_every_request_while_the_plugin_is_down(fleet: LocalFleet) -> None:
    load = Load()
    done = asyncio.Event()
    traffic = asyncio.create_task(offer(fleet.envoy_url, rate=20.0, done=done, load=load))
    await asyncio.sleep(3.0)
    stats = {"up": await ext_proc_stats(fleet)}
    stopped_at = time.monotonic()
    await fleet.stop_process(fleet.plugin)  # drains: in-flight requests finish first
    await asyncio.sleep(3.0)
    restarted_at = time.monotonic()
    await fleet.start_plugin()
    ready_at = time.monotonic()
    stats["ready"] = await ext_proc_stats(fleet)
    # Phases are timed from the events, not from a fixed schedule: the drain and the restart
    # take as long as they take on a loaded machine.
    await asyncio.sleep(4.0)
    done.set()
    await traffic
    stats["end"] = await ext_proc_stats(fleet)

    assert not load.errors, load.errors[:3]
    assert len(load.outcomes) >= 150
    bad = [o for o in load.outcomes if o.status != 200 or not o.complete]
    assert not bad, f"{len(bad)} requests failed or were cut: {bad[:3]}"

    before = [o for o in load.outcomes if o.started < stopped_at - 0.5]
    down = [o for o in load.outcomes if stopped_at + 0.5 < o.started < restarted_at]
    after = [o for o in load.outcomes if o.started > ready_at + 0.5]
    assert before and down and after
    # Before and after: the plugin picked every replica. While it is down: nobody picks, and
    # Envoy's round robin spreads the requests over all the engines.
    unrouted = [
        f"sent {o.started - stopped_at:+.2f} s from the stop, {o.started - ready_at:+.2f} s from "
        f"ready, {o.late:.2f} s late"
        for o in before + after
        if not o.routed_by_plugin
    ]
    assert not unrouted, f"not routed by the plugin: {unrouted}; Envoy's ext_proc stats: {stats}"
    allowed = "http.hetero_gateway.ext_proc.failure_mode_allowed"
    assert stats["ready"][allowed] - stats["up"][allowed] >= len(down), stats
    assert not any(o.routed_by_plugin for o in down)
    spread = Counter(o.engine for o in down)
    assert set(spread) == {e.name for e in fleet.engines}, spread
    assert max(spread.values()) - min(spread.values()) <= 2, spread


async def test_steering_uses_the_plugins_pick(fleet: LocalFleet) -> None:
    """With the plugin up, the engine that served is the one the plugin named."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(12):
            body = chat_body(MODEL, 2, content="hi")
            async with session.post(f"{fleet.envoy_url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                picked = resp.headers["target-pod"]
                assert resp.headers["x-mock-engine"] == picked
