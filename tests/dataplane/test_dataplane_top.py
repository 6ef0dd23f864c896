"""`hetero-gateway top` against a running plugin behind real Envoy: in a real terminal (tmux),
it draws every pod with its GPU type and state, and quits on `q`; piped, it prints plain lines."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from plugin_tools.demo.fleet import LocalFleet
from tests.helpers import require_tool, wait_idle

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]


async def _traffic(fleet: LocalFleet, n: int) -> None:
    body = {
        "model": fleet.spec.model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            url = f"{fleet.envoy_url}/v1/chat/completions"
            async with session.post(url, json=body) as resp:
                assert resp.status == 200
                await resp.read()
        await wait_idle(session, fleet)


async def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """A command run off the event loop (the fleet's plugin shares this process's loop)."""

    def call() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, text=True, **kwargs)

    return await asyncio.to_thread(call)


def _top(fleet: LocalFleet, *extra: str) -> list[str]:
    return [sys.executable, "-m", "plugin", "top", "--url", fleet.plugin_url, *extra]


async def test_piped_it_prints_one_plain_line_per_pod(fleet: LocalFleet) -> None:
    await _traffic(fleet, 6)
    done = await _run(_top(fleet, "--once"), capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# since start")
    rows = [line for line in lines if not line.startswith("#")]
    assert len(rows) == len(fleet.engines)
    for e in fleet.engines:
        row = next(r for r in rows if r.startswith(f"pod={fleet.spec.namespace}/{e.name} "))
        assert f"gpu={e.preset}" in row and "state=up" in row
    assert sum(float(r.split("req_share=")[1].split("%")[0]) for r in rows) == pytest.approx(
        100, abs=2
    )


async def test_in_a_terminal_it_draws_the_pods_and_quits_on_q(
    fleet: LocalFleet, tmp_path: Path
) -> None:
    tmux = require_tool("tmux")
    await _traffic(fleet, 4)
    session = f"top-{tmp_path.name}"
    status = tmp_path / "status"
    # As a user's shell would start it: the test runner's COLUMNS/LINES are not the terminal's.
    top = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", *_top(fleet, "--interval", "0.3")])
    command = f"{top}; echo $? > {shlex.quote(str(status))}"
    await _run(
        [tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "40", command], check=True
    )
    try:
        screen = ""
        for _ in range(100):
            screen = (
                await _run([tmux, "capture-pane", "-p", "-t", session], capture_output=True)
            ).stdout
            if "q quits" in screen and all(e.name in screen for e in fleet.engines):
                break
            await asyncio.sleep(0.1)
        assert "hetero-gateway top" in screen and "q quits" in screen, screen
        for e in fleet.engines:
            lines = [x for x in screen.splitlines() if e.name in x]
            assert len(lines) == 1, screen
            assert e.preset in lines[0] and " up " in f" {lines[0]} ", screen
        await _run([tmux, "send-keys", "-t", session, "q"], check=True)
        for _ in range(100):
            if status.exists() and status.read_text().strip():
                break
            await asyncio.sleep(0.1)
        assert status.read_text().strip() == "0"
    finally:
        await _run([tmux, "kill-session", "-t", session], capture_output=True)
