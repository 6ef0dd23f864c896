"""The scraper's HTTP client against real servers on loopback: aiohttp's for well-behaved
engines, raw asyncio servers for the odd answers an engine (or a proxy in front of it) can give."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from plugin.adapters.metrics_http import Address, MetricsClient, request_bytes
from plugin.errors import EngineUnreachable, MetricsPageUnusable
from tests.helpers import ServeApp

pytestmark = pytest.mark.component

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
RawServe = Callable[[Handler], Awaitable[int]]


@pytest_asyncio.fixture
async def raw_serve() -> AsyncIterator[RawServe]:
    """A raw TCP server on loopback per call; its port."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> int:
        async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(closing, "127.0.0.1", 0)
        servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def _client(timeout_s: float = 2.0, max_bytes: int = 1 << 20) -> MetricsClient:
    return MetricsClient(timeout_s=timeout_s, max_bytes=max_bytes)


async def test_a_connection_is_kept_and_reused(serve_app: ServeApp) -> None:
    peers: list[tuple[str, int]] = []

    async def metrics(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        assert request.headers["Accept-Encoding"] == "identity"
        return web.Response(text=f"n {request.query['x']}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    port = await serve_app(app)
    client = _client()
    answers = [
        await client.get("127.0.0.1", port, request_bytes("127.0.0.1", port, f"/metrics?x={i}"))
        for i in range(3)
    ]
    client.close()
    assert [(status, body) for status, _, body in answers] == [
        (200, b"n 0\n"),
        (200, b"n 1\n"),
        (200, b"n 2\n"),
    ]
    assert len(set(peers)) == 1  # one connection for the three


async def test_concurrent_gets_to_one_engine_use_separate_connections(
    serve_app: ServeApp,
) -> None:
    release = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    port = await serve_app(app)
    client = _client()
    request = request_bytes("127.0.0.1", port, "/metrics")
    both = asyncio.gather(*(client.get("127.0.0.1", port, request) for _ in range(2)))
    await asyncio.sleep(0.05)
    release.set()
    assert [body for _, _, body in await both] == [b"ok\n", b"ok\n"]
    client.close()


async def test_chunked_and_close_delimited_bodies_are_read_whole(raw_serve: RawServe) -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"a 1\n", b"b 2\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # the client keeps the connection

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nc 3\n")
        await writer.drain()
        writer.close()

    client = _client()
    for handler, expected in ((chunked, b"a 1\nb 2\n"), (until_close, b"c 3\n")):
        port = await raw_serve(handler)
        status, _, body = await client.get(
            "127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics")
        )
        assert (status, body) == (200, expected)
    client.close()


async def test_an_idle_connection_the_engine_closed_is_replaced(raw_serve: RawServe) -> None:
    """An engine's keep-alive timeout closes a kept connection just as the next scrape leaves:
    the scrape is retried once on a new connection, not counted as the engine being down."""
    connections = 0

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nx 1\n")
        await writer.drain()
        # Closes as soon as the next request arrives, without answering it.
        await reader.read(1)
        writer.close()

    port = await raw_serve(once)
    client = _client()
    request = request_bytes("127.0.0.1", port, "/metrics")
    for _ in range(3):
        assert (await client.get("127.0.0.1", port, request))[2] == b"x 1\n"
    client.close()
    assert connections == 3


async def test_a_new_connection_closed_before_an_answer_is_unreachable(
    raw_serve: RawServe,
) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    port = await raw_serve(hang_up)
    with pytest.raises(EngineUnreachable):
        await _client().get("127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics"))


async def test_a_refused_connection_is_unreachable_and_a_silent_one_times_out(
    raw_serve: RawServe, reserved_port: int
) -> None:
    with pytest.raises(EngineUnreachable):
        await _client().get(
            "127.0.0.1", reserved_port, request_bytes("127.0.0.1", reserved_port, "/m")
        )

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    port = await raw_serve(silent)
    with pytest.raises(TimeoutError):
        await _client(timeout_s=0.2).get(
            "127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics")
        )


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()


async def _each_at_its_own_deadline(client: MetricsClient, port: int, apart_s: float) -> float:
    """Start a scrape of a silent engine, another `apart_s` later: the first times out while
    the second is still waiting, then the second; the seconds the second took."""
    request = request_bytes("127.0.0.1", port, "/metrics")
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(client.get("127.0.0.1", port, request))
    await asyncio.sleep(apart_s)
    second_started = loop.time()
    second = asyncio.create_task(client.get("127.0.0.1", port, request))
    async with asyncio.timeout(5.0):
        with pytest.raises(TimeoutError):
            await first
        assert not second.done()  # its deadline is later
        with pytest.raises(TimeoutError):
            await second
    client.close()
    return loop.time() - second_started


async def test_each_exchange_times_out_at_its_own_deadline(raw_serve: RawServe) -> None:
    """One timer serves every exchange in flight: one that started later is not failed at an
    earlier one's deadline, and is failed at its own."""
    port = await raw_serve(_silent)
    assert await _each_at_its_own_deadline(_client(timeout_s=0.4), port, 0.2) >= 0.4 - 0.002


async def test_a_scrape_slow_to_connect_times_out_at_its_own_deadline(
    raw_serve: RawServe,
) -> None:
    """A scrape's deadline runs from when it started: one whose connection took long to open
    goes in after a later scrape, with the earlier deadline, and the one timer is moved
    forward for it (left where it was, both would time out at the later deadline)."""

    class SlowToConnect(MetricsClient):
        """The first connection takes 0.5 s to open (a SYN retransmitted, say)."""

        slow = True

        async def _open(self, loop: asyncio.AbstractEventLoop, where: Address) -> Any:
            if self.slow:
                self.slow = False
                await asyncio.sleep(0.5)
            return await super()._open(loop, where)

    port = await raw_serve(_silent)
    await _each_at_its_own_deadline(SlowToConnect(timeout_s=0.6, max_bytes=1 << 20), port, 0.25)


async def test_an_answer_cut_off_by_the_deadline_times_out_and_its_connection_is_dropped(
    raw_serve: RawServe,
) -> None:
    """The deadline covers the whole answer, not only its first bytes: an engine that sends its
    headers and then stalls times out, and the half-read connection is not kept (the next
    scrape opens a new one and reads a whole answer)."""
    connections = 0

    async def stall_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        if connections == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nx 1")
            await writer.drain()
            await reader.read()  # stalls until the client drops it
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ny 2\n")
        await writer.drain()
        await reader.read()

    port = await raw_serve(stall_once)
    client = _client(timeout_s=0.2)
    request = request_bytes("127.0.0.1", port, "/metrics")
    with pytest.raises(TimeoutError):
        await client.get("127.0.0.1", port, request)
    assert (await client.get("127.0.0.1", port, request))[2] == b"y 2\n"
    client.close()
    assert connections == 2


async def test_a_cancelled_get_leaves_no_connection_behind(raw_serve: RawServe) -> None:
    """A scrape cancelled mid-answer (the gateway stopping) drops its connection, and the
    cancellation is not turned into a timeout later."""
    connections = 0
    asked = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        asked.set()
        await reader.read()

    port = await raw_serve(slow)
    client = _client(timeout_s=0.3)
    get = asyncio.create_task(
        client.get("127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics"))
    )
    await asked.wait()
    get.cancel()
    with pytest.raises(asyncio.CancelledError):
        await get
    await asyncio.sleep(0.4)  # past the deadline: its timer must not fire on anything
    assert not any(client._idle.values())
    with pytest.raises(TimeoutError):
        await client.get("127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics"))
    client.close()
    assert connections == 2


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "broken page"),
        (b"SMTP ready\r\n\r\n", "malformed HTTP answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n" + b"x" * 3000, "over 1000 bytes"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 9\r\n\r\nnot gzip!",
            "broken page",
        ),
    ],
)
async def test_an_answer_of_no_use_is_unusable(
    raw_serve: RawServe, answer: bytes, why: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    port = await raw_serve(handler)
    with pytest.raises(MetricsPageUnusable, match=why):
        await _client(max_bytes=1000).get(
            "127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics")
        )


async def test_a_page_compressed_although_not_asked_is_inflated(raw_serve: RawServe) -> None:
    page = gzip.compress(b"vllm:num_requests_running 3\n")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
            % (len(page), page)
        )
        await writer.drain()
        await reader.read()

    port = await raw_serve(handler)
    client = _client()
    answer = await client.get("127.0.0.1", port, request_bytes("127.0.0.1", port, "/metrics"))
    client.close()
    assert answer == (200, "OK", b"vllm:num_requests_running 3\n")


def test_the_request_names_the_host_and_brackets_ipv6() -> None:
    assert request_bytes("::1", 8000, "/metrics").startswith(
        b"GET /metrics HTTP/1.1\r\nHost: [::1]:8000\r\n"
    )
