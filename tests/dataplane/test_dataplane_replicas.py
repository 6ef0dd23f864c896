"""Data plane with three plugin replicas behind one Envoy cluster, sharing one `redis-server`.

Envoy spreads each request's two ext_proc streams (routing, counting) over the replicas on its
own, so most requests are routed by one replica and counted by another: the counting replica
takes the count over and Redis carries the claim back to the routing one. A replica killed -9
then cuts no running generation (the routing streams already ended at the pick; counting is
best effort), and every survivor's in-flight counts, its own and those the others publish,
return to 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import aiohttp
import pytest

from plugin_tools.demo.fleet import FleetSpec, LocalFleet, free_port
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import chat_body, debug_pods, metric_sum, poll, redis_env

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def fleet_spec(module_redis: RedisServer) -> FleetSpec:
    """Replica 0 is the fleet's own plugin (the conftest's `fleet` runs it)."""
    return FleetSpec(
        model=MODEL,
        presets=("a100", "l20"),
        time_scale=3.0,
        tokens_per_chunk=1,
        plugin_env=redis_env(module_redis, "replica-0"),
    )


async def stream(session: aiohttp.ClientSession, url: str) -> bool:
    """One long streamed generation; True when it ended with [DONE]."""
    body = chat_body(MODEL, 160, stream=True)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            text = (await resp.read()).decode()
            return resp.status == 200 and text.rstrip().endswith("data: [DONE]")
    except aiohttp.ClientError:
        return False


async def counts(session: aiohttp.ClientSession, plugin_url: str) -> float:
    """What a replica counts in flight: its own leases and the others' published counts."""
    own = await metric_sum(session, plugin_url, "hetero_gateway_inflight_requests")
    return own + await metric_sum(session, plugin_url, "hetero_gateway_remote_inflight_requests")


async def test_a_killed_replica_cuts_nothing_and_every_count_returns_to_zero(
    fleet: LocalFleet,
) -> None:
    replicas = [
        await fleet.start_plugin_replica(f"replica-{i}", {"POD_NAME": f"replica-{i}"})
        for i in (1, 2)
    ]
    port = free_port()
    grpc_ports = (fleet.grpc_port, *(r.grpc_port for r in replicas))
    opts = dataclasses.replace(
        fleet.envoy_options(port, free_port()),
        extproc_replicas=tuple(f"127.0.0.1:{p}" for p in grpc_ports),
    )
    await fleet.start_extra_envoy("replicas-envoy", opts)
    url = f"http://127.0.0.1:{port}"
    victim = replicas[0]
    survivors = [fleet.plugin_url, replicas[1].plugin_url]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        running = [asyncio.create_task(stream(session, url)) for _ in range(12)]
        await asyncio.sleep(1.0)  # every generation is streaming
        taken = 0
        for plugin in (*survivors, victim.plugin_url):
            taken += (await debug_pods(session, plugin))["shared_state"]["counts_taken_over"]
        assert taken > 0, "no request was counted by another replica than the one routing it"
        assert victim.plugin is not None
        victim.plugin.kill()
        assert all(await asyncio.gather(*running)), "a generation was cut"
        for plugin in survivors:
            await poll(
                functools.partial(counts, session, plugin),
                lambda n: n == 0,
                f"{plugin} to count none in flight",
            )


async def test_workers_on_one_port_serve_and_count_every_request(
    module_redis: RedisServer,
) -> None:
    """`serve --workers 2` behind an Envoy of two worker threads: every request is served and
    routed by one of the workers, and the counts end at 0 on both (worker i serves HTTP on the
    HTTP port + i). The kernel spreads connections, not streams: Envoy's two connections may
    both land on one worker (tests/component/test_workers.py shows the spread over many)."""
    spec = FleetSpec(
        model=MODEL,
        presets=("a100", "l20"),
        time_scale=2.0,
        tokens_per_chunk=4,
        plugin_env=redis_env(module_redis, "multi"),
        plugin_workers=2,
        listen_port=free_port(),
    )
    async with LocalFleet(spec) as fleet:
        workers = [fleet.plugin_url, f"http://127.0.0.1:{fleet.http_port + 1}"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for url in workers:  # the second worker may still be starting
                await poll(
                    functools.partial(debug_pods, session, url),
                    lambda doc: doc["shared_state"]["mode"] == "shared",
                    f"{url} to join the shared state",
                    limit_s=20.0,
                )
            done = await asyncio.gather(*(stream(session, fleet.envoy_url) for _ in range(40)))
            assert all(done)
            routed = [
                await metric_sum(session, url, "hetero_gateway_routed_requests_total")
                for url in workers
            ]
            assert sum(routed) == 40, routed
            for url in workers:
                await poll(functools.partial(counts, session, url), lambda n: n == 0, f"{url} at 0")
