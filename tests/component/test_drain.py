"""Shutting down: a gateway that is told to stop lets its in-flight requests finish (a rolling
update must not cut streaming answers), refuses new ones, and never leaks an in-flight count."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from plugin.adapters.discovery import load_pods_file
from plugin.adapters.serve import Gateway
from plugin.core.types import Pod
from tests.helpers import StartGateway, eventually, extproc_exchange, write_pods_file

pytestmark = pytest.mark.component

WAIT_S = 10.0  # bound of every wait; nothing here should take close to it
POD = Pod("a", "ns", "m", "127.0.0.1", 9, 9)  # never contacted: scraping is off, Envoy absent
KEY = POD.key
REQUEST_HEADERS, REQUEST_BODY, RESPONSE_HEADERS, RESPONSE_BODY = extproc_exchange("m", 7)


@pytest_asyncio.fixture
async def gateway(
    tmp_path: Path, request: pytest.FixtureRequest, start_gateway: StartGateway
) -> Gateway:
    """A gateway whose drain limit is the test's parameter (seconds)."""
    env = {
        "HETERO_GATEWAY_DRAIN_S": str(request.param),
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "60000",
    }
    return await start_gateway(write_pods_file(tmp_path / "pods.yaml", [POD]), env)


async def _routed_call(stub: pb_grpc.ExternalProcessorStub) -> grpc.aio.StreamStreamCall:
    """A request that has been routed and now waits for its response: it holds a lease."""
    call = stub.Process()
    for message in (REQUEST_HEADERS, REQUEST_BODY):
        await call.write(message)
        reply = await call.read()
        assert isinstance(reply, pb.ProcessingResponse)
    return call


async def _until(check: Callable[[], bool], what: str) -> None:
    await eventually(check, what, limit_s=WAIT_S, interval_s=0.02)


@pytest.mark.parametrize("gateway", [20.0], indirect=True)
async def test_stop_drains_in_flight_requests_and_refuses_new_ones(gateway: Gateway) -> None:
    url = f"http://127.0.0.1:{gateway.http_port}"
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel,
        aiohttp.ClientSession() as http,
    ):
        stub = pb_grpc.ExternalProcessorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        serving = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        call = await _routed_call(stub)
        assert gateway.pool.inflight(KEY) == 1

        stopping = asyncio.ensure_future(gateway.stop())
        await _until(lambda: gateway.draining, "draining")
        async with http.get(f"{url}/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["status"] == "draining"
        # A new stream is refused (Envoy fails it open or closed by its own configuration).
        with pytest.raises(grpc.aio.AioRpcError):
            fresh = stub.Process()
            await fresh.write(REQUEST_HEADERS)
            await fresh.read()
        assert not stopping.done()

        # The request in flight finishes normally and its tokens are counted.
        for message in (RESPONSE_HEADERS, RESPONSE_BODY):
            await call.write(message)
            assert isinstance(await call.read(), pb.ProcessingResponse)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        async with asyncio.timeout(WAIT_S):
            await stopping  # long before the 20 s drain limit: nothing is left to wait for
    assert gateway.pool.inflight(KEY) == 0
    assert gateway.pool.output_tokens_total(KEY) == 7


@pytest.mark.parametrize("gateway", [0.3], indirect=True)
async def test_drain_limit_closes_what_is_left_without_leaking_a_count(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        call = await _routed_call(pb_grpc.ExternalProcessorStub(channel))
        assert gateway.pool.inflight(KEY) == 1
        async with asyncio.timeout(WAIT_S):
            await gateway.stop()  # the response never comes: cut at the drain limit
        assert await call.code() != grpc.StatusCode.OK
    await _until(lambda: gateway.pool.inflight(KEY) == 0, "lease released")


class _Broken:
    """A pod source that fails after its first delivery."""

    def __init__(self, pods_file: Path) -> None:
        self._path = str(pods_file)

    async def run(self, on_update: Callable[[list[Pod]], None]) -> None:
        on_update(load_pods_file(self._path))
        raise RuntimeError("watch exploded")


async def test_a_dying_background_loop_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, start_gateway: StartGateway
) -> None:
    gw = await start_gateway(_Broken(write_pods_file(tmp_path / "pods.yaml", [POD])))
    await _until(lambda: "pod discovery failed" in caplog.text, "the error log")
    assert "watch exploded" in caplog.text
    assert gw.pool.loaded  # what was delivered keeps serving
