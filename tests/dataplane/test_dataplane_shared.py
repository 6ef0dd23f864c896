"""Data plane with two gateway replicas: two plugin processes, each behind its own real Envoy,
sharing state through one `redis-server`, in front of one fleet of mock engines.

Traffic goes through both Envoys at once, so each gateway routes and counts about half of every
replica's requests. With shared token counters both gateways must still learn each replica's
whole output rate: their capacity estimates agree with each other and with what the engines
really generated (the engines' own `vllm:generation_tokens_total`).
"""

from __future__ import annotations

import asyncio
import functools
import time

import aiohttp
import pytest

from plugin_tools.demo.fleet import ExtraGateway, FleetSpec, LocalFleet
from plugin_tools.demo.loadgen import LengthDist, Workload, run_open_loop
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import debug_pods, metric_sum, poll, redis_env

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"
WINDOW_S = 20.0  # capacity window, shortened so that a test-length run fills it
TRAFFIC_S = 40.0
READ_AT_S = 36.0  # when the estimates are read, traffic still flowing


@pytest.fixture(scope="module")
def fleet_spec(module_redis: RedisServer) -> FleetSpec:
    """The first gateway, gw-a, pointed at the module's Redis (the conftest's `fleet` runs it;
    its `second_gateway`, gw-b, shares these settings and Redis)."""
    return FleetSpec(
        model=MODEL,
        time_scale=2.0,
        tokens_per_chunk=4,
        plugin_env={
            **redis_env(module_redis, "gw-a"),
            "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "500",
            "HETERO_GATEWAY_CAPACITY_WINDOW_S": str(WINDOW_S),
            "HETERO_GATEWAY_CAPACITY_TAU_S": "2",
        },
    )


async def generated(session: aiohttp.ClientSession, fleet: LocalFleet) -> dict[str, float]:
    """Each engine's own count of the output tokens it generated."""
    return {
        f"default/{e.name}": await metric_sum(session, e.url, "vllm:generation_tokens_total")
        for e in fleet.engines
    }


@pytest.mark.slow(
    reason="open-loop load through two gateways until both have learned every replica's capacity"
)
async def test_two_gateways_agree_on_each_replicas_capacity(
    fleet: LocalFleet, second_gateway: ExtraGateway
) -> None:
    second = second_gateway
    urls = {"gw-a": fleet.plugin_url, "gw-b": second.plugin_url}
    saturated = sum(e.saturated_tokens_per_s for e in fleet.engines)
    out = LengthDist(median=24, sigma=0.5, low=4, high=96)
    per_gateway_rate = 0.3 * saturated / out.mean()  # 60% of the fleet's capacity in all

    def workload(seed: int) -> Workload:
        return Workload(
            rate_per_s=per_gateway_rate,
            duration_s=TRAFFIC_S,
            prompt_words=LengthDist(median=16, sigma=0.5, low=2, high=64),
            output_tokens=out,
            seed=seed,
        )

    async with aiohttp.ClientSession() as session:
        for name, url in urls.items():  # both joined the shared state
            await poll(
                functools.partial(debug_pods, session, url),
                lambda doc: (
                    (doc["shared_state"]["mode"], doc["shared_state"]["other_gateways"])
                    == ("shared", 1)
                ),
                f"{name} to join the shared state",
                limit_s=10,
                interval_s=0.2,
            )

        loads = [
            asyncio.ensure_future(
                run_open_loop(url, MODEL, workload(seed), strategy="load-balance")
            )
            for url, seed in ((fleet.envoy_url, 1), (second.envoy_url, 2))
        ]
        t0 = time.monotonic()
        saw_remote = {name: False for name in urls}
        base: dict[str, float] | None = None
        base_t = 0.0
        while (elapsed := time.monotonic() - t0) < READ_AT_S:
            if base is None and elapsed >= READ_AT_S - WINDOW_S:
                base = await generated(session, fleet)
                base_t = time.monotonic()
            for name, url in urls.items():
                pods = (await debug_pods(session, url))["pods"]
                saw_remote[name] |= any(p["inflight_remote"] > 0 for p in pods.values())
            await asyncio.sleep(0.5)
        assert base is not None
        states = {name: await debug_pods(session, url) for name, url in urls.items()}
        end = await generated(session, fleet)
        span = time.monotonic() - base_t
        results = await asyncio.gather(*loads)

    failed = [r for rs in results for r in rs if not r.ok]
    assert not failed, [r.error for r in failed][:3]
    # Each gateway saw the other's requests in flight (routing used the sum).
    assert saw_remote == {"gw-a": True, "gw-b": True}
    real = {key: (end[key] - base[key]) / span for key in end}
    for key, rate in real.items():
        a = states["gw-a"]["pods"][key]["capacity_tokens_per_s"]
        b = states["gw-b"]["pods"][key]["capacity_tokens_per_s"]
        print(f"{key}: engine {rate:.0f} tok/s, gw-a {a:.0f}, gw-b {b:.0f}")
        assert a is not None and b is not None, key
        assert abs(a - b) <= 0.10 * max(a, b), (key, a, b)
        for estimate in (a, b):
            assert abs(estimate - rate) <= 0.15 * rate, (key, estimate, rate)
        assert states["gw-a"]["pods"][key]["gpu"] == key.split("/")[1].split("-")[0]
        # Each gateway counted only its own part of the replica's output, yet estimated all of it.
        counted = {
            name: states[name]["pods"][key]["output_tokens_total"] for name in ("gw-a", "gw-b")
        }
        assert all(n > 0 for n in counted.values()), counted
