"""The slow start's variables reach the pool of a running gateway: a pod that appears in the pods
file beside a learned peer is scored at the configured share of its peer's capacity, as
`/debug/pods` shows, and at all of it with the window at 0."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from plugin.adapters.discovery import StaticFileSource
from plugin.core.types import Pod
from tests.helpers import StartGateway, debug_pods, eventually, write_pods_file

pytestmark = pytest.mark.component

MODEL = "m"
LABELS = {"app.kubernetes.io/name": "a100"}


@pytest.mark.parametrize(("window", "share"), [("120", 0.05), ("0", 1.0)])
async def test_a_new_pod_in_the_pods_file_is_ramped_in_as_configured(
    tmp_path: Path,
    start_gateway: StartGateway,
    reserve_port: Callable[[], int],
    window: str,
    share: float,
) -> None:
    a, b = reserve_port(), reserve_port()  # reserved, never listening
    learned = Pod("a", "default", MODEL, "127.0.0.1", a, a, labels=LABELS)
    new = Pod("b", "default", MODEL, "127.0.0.1", b, b, labels=LABELS)
    path = write_pods_file(tmp_path / "pods.yaml", [learned])
    env = {
        "HETERO_GATEWAY_SLOW_START_WINDOW_S": window,
        "HETERO_GATEWAY_SLOW_START_MIN_PERCENT": "5",
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "30000",  # no scrape tick moves the clock
    }
    gateway = await start_gateway(StaticFileSource(str(path), poll_s=0.05), env)
    pool = gateway.pool
    now = time.monotonic() + 1.0
    pool.refresh_capacity(now)
    pool.acquire(learned).release(1000, 200, now)
    pool.refresh_capacity(now + 5.0)
    peer = pool.capacity(learned.key)
    assert peer is not None and peer > 0
    write_pods_file(path, [learned, new])
    await eventually(lambda: new.key in {p.key for p in pool.pods()}, "the new pod listed")
    url = f"http://127.0.0.1:{gateway.http_port}"
    async with aiohttp.ClientSession() as session:
        start = (await debug_pods(session, url))["pods"][new.key]["capacity_start"]
    assert start["from"] == "deployment"
    assert start["slow_start_share"] == pytest.approx(share)
    assert start["tokens_per_s"] == pytest.approx(share * peer, abs=1e-3)
