"""`hetero-gateway serve --workers N` as a user runs it: a supervisor process and N workers on
one gRPC port, sharing state through a real `redis-server`.

The pods refuse connections (nothing is forwarded); what is checked is the process model: every
worker serves (gRPC health on the one port, its own HTTP port, its own name in Redis), a worker
killed -9 is started again, and SIGTERM stops them all.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from plugin.core.types import Pod
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import (
    extproc_exchange,
    free_port,
    metric_sum,
    poll,
    redis_env,
    write_pods_file,
)

pytestmark = pytest.mark.component

LIMIT_S = 20.0  # starting Python processes on a busy 2-core machine
ROUTED = "hetero_gateway_routed_requests_total"


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


async def shared_names(http_ports: list[int]) -> list[str] | None:
    """Each worker's name in the shared state, once every one answers and syncs; else None."""
    names = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        for port in http_ports:
            try:
                async with session.get(f"http://127.0.0.1:{port}/debug/pods") as resp:
                    state = (await resp.json())["shared_state"]
            except (aiohttp.ClientError, TimeoutError):
                return None
            if state["mode"] != "shared" or state["other_gateways"] != len(http_ports) - 1:
                return None
            names.append(state["gateway"])
    return names


async def test_workers_share_one_port_restart_when_killed_and_stop_on_sigterm(
    tmp_path: Path, reserve_port: Callable[[], int], redis_server: RedisServer
) -> None:
    pods = [Pod(n, "default", "m", "127.0.0.1", reserve_port(), 0) for n in ("a", "b")]
    pods_file = write_pods_file(tmp_path / "pods.yaml", pods)
    grpc_port, http_port = free_port(), free_port()
    env = {
        **os.environ,
        **redis_env(redis_server, "gw"),
        "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "30000",
    }
    argv = [sys.executable, "-m", "plugin", "serve", "--workers", "2", "--host", "127.0.0.1"]
    argv += ["--pods", str(pods_file), "--grpc-port", str(grpc_port)]
    argv += ["--http-port", str(http_port)]
    supervisor = await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL
    )
    try:
        ports = [http_port, http_port + 1]
        names = await poll(
            lambda: shared_names(ports), lambda n: n is not None, "both workers", limit_s=LIMIT_S
        )
        assert names == ["gw-w0", "gw-w1"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # The kernel spreads connections over the workers: one request on each of 16 of them
        # (a connection each: no shared subchannels) reaches both workers, but for 2^-15.
        for _ in range(16):
            options = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options) as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process(
                    iter(extproc_exchange("m", 3))
                )
                assert len([reply async for reply in call]) == 4
        async with aiohttp.ClientSession() as session:
            routed = [
                await metric_sum(session, f"http://127.0.0.1:{port}", ROUTED) for port in ports
            ]
        assert sum(routed) == 16 and min(routed) > 0, routed

        first = children(supervisor.pid)
        assert len(first) == 2
        os.kill(first[1], signal.SIGKILL)

        async def replaced() -> list[int]:
            await asyncio.sleep(0)
            return children(supervisor.pid)

        now = await poll(
            replaced,
            lambda pids: len(pids) == 2 and first[1] not in pids,
            "the killed worker started again",
            limit_s=LIMIT_S,
        )
        assert first[0] in now  # the other worker was left alone
        await poll(
            lambda: shared_names(ports), lambda n: n is not None, "both again", limit_s=LIMIT_S
        )

        supervisor.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(supervisor.wait(), LIMIT_S) == 0
        assert not [pid for pid in now if running(pid)], "a worker outlived the supervisor"
    finally:
        if supervisor.returncode is None:
            for pid in children(supervisor.pid):
                os.kill(pid, signal.SIGKILL)
            supervisor.kill()
            await supervisor.wait()


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
