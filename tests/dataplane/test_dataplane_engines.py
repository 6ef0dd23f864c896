"""Data plane, engines that hang or die: out of rotation within about a second from the plugin's
own scrapes, back as soon as they answer again.

Scrapes run every second with a 500 ms timeout (the defaults). A hung engine (SIGSTOP: its socket
accepts, nothing answers) times its scrape out; a dead one refuses it. Either way the pod leaves
the candidates at once, instead of collecting requests that hang (a hung engine keeps a high
learned capacity and a low score) or fail in bursts per ejection cycle.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from tests.helpers import chat_body

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio]

MODEL = "llama-3-8b"
DETECT_S = 2.0  # one scrape period (1 s) plus its timeout (0.5 s), plus slack for a loaded machine


async def _pod_state(fleet: LocalFleet, name: str) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{fleet.plugin_url}/debug/pods") as resp,
    ):
        pods = (await resp.json())["pods"]
    return next(p for p in pods.values() if p["name"] == name)


async def _until(fleet: LocalFleet, name: str, unreachable: bool, within_s: float) -> float:
    """Seconds until /debug/pods shows the pod (un)reachable; fails after `within_s`."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if (await _pod_state(fleet, name))["unreachable"] is unreachable:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} not {'un' if unreachable else ''}reachable within {within_s} s")


async def _send(fleet: LocalFleet, n: int, strategy: str) -> list[tuple[str, str | None]]:
    """`n` short requests one after another: (engine that served it, or `HTTP <status>` when
    none did; the pod the plugin picked)."""
    sent = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(n):
            async with session.post(
                f"{fleet.envoy_url}/v1/chat/completions",
                json=chat_body(MODEL, 2),
                headers={"routing-strategy": strategy},
            ) as resp:
                await resp.read()
                engine = resp.headers.get("x-mock-engine", f"HTTP {resp.status}")
                sent.append((engine, resp.headers.get("target-pod")))
    return sent


async def _served_by(fleet: LocalFleet, n: int, strategy: str = "least-request") -> Counter[str]:
    """Which engine served each of `n` short requests, one after another. Under least-request
    every pod is idle at each pick, so it picks at random among them: "a pod gets some of 6"
    fails 1 time in 64 there; round-robin alternates, so a pod back in rotation gets exactly
    half."""
    return Counter(engine for engine, _ in await _send(fleet, n, strategy))


def _engine(fleet: LocalFleet, preset: str) -> tuple[str, int]:
    e = next(e for e in fleet.engines if e.preset == preset)
    assert e.proc is not None
    return e.name, e.proc.pid


async def test_a_hung_engine_leaves_rotation_and_returns_when_it_answers(tmp_path: Path) -> None:
    spec = FleetSpec(model=MODEL, presets=("a100", "l20"), listen_port=free_port())
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        name, pid = _engine(fleet, "a100")
        assert (await _served_by(fleet, 4, "round-robin"))[name] == 2
        os.kill(pid, signal.SIGSTOP)
        try:
            assert await _until(fleet, name, True, DETECT_S) < DETECT_S
            assert (await _served_by(fleet, 6)) == Counter({"l20-0": 6})
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await _until(fleet, name, False, DETECT_S) < DETECT_S
        assert (await _served_by(fleet, 6, "round-robin"))[name] == 3  # back in rotation


async def test_a_dead_engine_costs_no_burst_and_is_back_within_seconds(tmp_path: Path) -> None:
    spec = FleetSpec(model=MODEL, presets=("a100", "l20"), listen_port=free_port())
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        name, _ = _engine(fleet, "a100")
        engine = next(e for e in fleet.engines if e.name == name)
        await fleet.stop_process(engine.proc)
        await _until(fleet, name, True, DETECT_S)
        # Out of rotation: no request is sent to it, so none fails (no ejection cycles).
        assert (await _served_by(fleet, 8)) == Counter({"l20-0": 8})
        await fleet.restart_engine(engine)
        assert await _until(fleet, name, False, DETECT_S) < DETECT_S
        assert (await _served_by(fleet, 6, "round-robin"))[name] == 3  # back in rotation


async def test_the_503_for_an_engine_that_refuses_is_openai_json(tmp_path: Path) -> None:
    """The only engine is gone: Envoy's own 503 (connection refused) reaches the client in
    OpenAI's error shape, saying what failed."""
    spec = FleetSpec(model=MODEL, presets=("a100",), listen_port=free_port())
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        await fleet.stop_process(fleet.engines[0].proc)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{fleet.envoy_url}/v1/chat/completions", json=chat_body(MODEL, 2)) as r,
        ):
            assert r.status == 503 and r.headers["content-type"] == "application/json"
            error = (await r.json())["error"]
    assert (error["type"], error["code"]) == ("overloaded_error", "service_unavailable")
    assert "connection" in error["message"]


async def test_override_host_retries_a_refused_connection_on_another_replica(
    tmp_path: Path,
) -> None:
    """The override_host wiring: the plugin lists a fallback after its pick, and Envoy retries a
    refused connection once on it, so an engine that just died costs no failed request even
    before the gateway notices (scrapes slowed to 30 s here so it does not)."""
    spec = FleetSpec(
        model=MODEL,
        presets=("a100", "l20"),
        listen_port=free_port(),
        fail_open=True,
        steering="override-host",
        plugin_env={"AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "30000"},
    )
    async with LocalFleet(spec, str(tmp_path)) as fleet:
        dead = next(e for e in fleet.engines if e.preset == "a100")
        await fleet.stop_process(dead.proc)
        sent = await _send(fleet, 6, "round-robin")
    assert [engine for engine, _ in sent] == ["l20-0"] * 6  # every one served
    picked = [pod for _, pod in sent]
    assert picked.count(dead.name) == 3  # round robin did pick the dead one: retried each time
