"""A throwaway `redis-server` child process on a loopback port, for tests and measurements.

No persistence (`--save ''`, `--appendonly no`): a restart comes back empty, like a Redis that
lost its data. `kill()` ends it the hard way (SIGKILL, as a crash or an evicted pod would), and
`start()` brings it back on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from plugin_tools.demo.fleet import StartError, free_port

__all__ = ["RedisServer", "redis_server_binary"]


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self.port = port or free_port()
        self.binary = binary or redis_server_binary()
        self.proc: asyncio.subprocess.Process | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="hetero-gateway-redis-")
        self.log = Path(self._tmp.name) / "redis.log"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout_s: float = 10.0) -> None:
        if self.binary is None:
            raise StartError("redis-server not found on PATH (apt-get install redis-server)")
        if self.running:
            return
        self.proc = await asyncio.create_subprocess_exec(
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._tmp.name,
            "--logfile",
            str(self.log),
            "--daemonize",
            "no",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                break
            if await self.ping():
                return
            await asyncio.sleep(0.05)
        tail = self.log.read_text(errors="replace").splitlines()[-20:] if self.log.exists() else []
        await self.kill()
        raise StartError(f"redis-server did not start on port {self.port}:\n" + "\n".join(tail))

    async def ping(self) -> bool:
        """One PING over a fresh connection (no client library needed)."""
        try:
            async with asyncio.timeout(1.0):
                reader, writer = await asyncio.open_connection(self.host, self.port)
                try:
                    writer.write(b"PING\r\n")
                    await writer.drain()
                    return (await reader.readline()).startswith(b"+PONG")
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except (OSError, TimeoutError):
            return False

    async def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye to clients."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

    async def close(self) -> None:
        await self.kill()
        self._tmp.cleanup()

    async def __aenter__(self) -> RedisServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
