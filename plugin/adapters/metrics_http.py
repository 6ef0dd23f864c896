"""GET engines' metrics pages over keep-alive HTTP/1.1 connections, cheaply enough to do it for
thousands of pods every second.

The scraper used aiohttp's client, whose per-request machinery (a request and a response
object, header multidicts, cookie filtering, tracing hooks, a stream reader) cost about 90 us
of CPU per scrape: most of a tick at a thousand pods (`docs/plugin-cost.md`). A scrape needs
none of it: one fixed GET per engine, answered with a small page. Here each engine keeps a
connection, the request's bytes are built once per pod, and the answer is parsed by httptools
(llhttp, the parser uvicorn serves vLLM and SGLang with) in C: about 10 us a scrape.

What a failure means is the scraper's contract (`plugin.adapters.scraper`): `EngineUnreachable`
for a refused or reset connection, or one closed before any answer (a timeout raises
TimeoutError); `MetricsPageUnusable` for an answer that is no use (malformed, cut off, too big).
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Iterable
from typing import cast

import httptools

from plugin.errors import EngineUnreachable, MetricsPageError, MetricsPageUnusable

Address = tuple[str, int]


def request_bytes(address: str, port: int, target: str) -> bytes:
    """The GET request for `target` (a path and query, already encoded) on this engine."""
    host = f"[{address}]" if ":" in address else address
    return (
        f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        # Uncompressed: a scrape every second has bandwidth to spare, not CPU.
        "Accept-Encoding: identity\r\nUser-Agent: hetero-gateway\r\n\r\n"
    ).encode("latin-1")


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int) -> None:
        self._loop = loop
        self._max_bytes = max_bytes
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._answer: asyncio.Future[tuple[int, str, bytes]] | None = None
        self._reason = b""
        self._body: list[bytes] = []
        self._size = 0
        self._framed = False  # the answer says where its body ends (a length or chunks)
        self._encoding = b""
        self._status = 0  # set once the answer's headers are in

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP transport (uvloop's is not a subclass of asyncio's, hence the cast).
        self.transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes) -> asyncio.Future[tuple[int, str, bytes]]:
        """Send the request; the future holds (status, reason, body)."""
        assert self.transport is not None and self._answer is None
        self._answer = answer = self._loop.create_future()
        self._reason, self._body, self._size = b"", [], 0
        self._framed, self._encoding, self._status = False, b"", 0
        self.transport.write(request)
        return answer

    def expire(self) -> None:
        """The scrape's time ran out: its answer fails with TimeoutError."""
        self._fail(TimeoutError())
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._answer is None:
            self.abort()  # bytes nobody asked for: the connection is out of step
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(MetricsPageUnusable(f"malformed HTTP answer: {exc}"))
            self.abort()

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) < 14:  # shorter than the three read here (most headers: a cheap skip)
            return
        lower = name.lower()
        if lower in (b"content-length", b"transfer-encoding"):
            self._framed = True
        elif lower == b"content-encoding":
            self._encoding = value.strip().lower()

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._max_bytes:
            self._fail(self._too_big())
            self.abort()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if not self._parser.should_keep_alive():
            self.closed = True  # the engine closes it after this answer
        self._complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is None or self._answer.done():
            return
        if not self._status:
            self._fail(EngineUnreachable(f"connection closed before an answer: {exc!r}"))
        elif not self._framed and exc is None:
            self._complete()  # a body that ends where the connection does (HTTP/1.0 style)
        else:
            self._fail(
                MetricsPageUnusable(f"broken page: connection lost after {self._size} bytes")
            )

    def _complete(self) -> None:
        answer, self._answer = self._answer, None
        if answer is None or answer.done():
            return
        body = b"".join(self._body)
        if self._encoding in (b"gzip", b"deflate"):  # asked for identity, compressed anyway
            inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header
            try:
                body = inflate.decompress(body, self._max_bytes + 1)
            except zlib.error as exc:
                answer.set_exception(MetricsPageUnusable(f"broken page: {exc}"))
                return
            if len(body) > self._max_bytes:
                answer.set_exception(self._too_big())
                return
        answer.set_result((self._status, self._reason.decode("latin-1"), body))

    def _too_big(self) -> MetricsPageUnusable:
        return MetricsPageUnusable(f"metrics page over {self._max_bytes} bytes")

    def _fail(self, error: MetricsPageError | TimeoutError) -> None:
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(error)


class MetricsClient:
    """Keep-alive connections to engines' metrics endpoints, opened on first use; a connection
    the engine closed is replaced at the next scrape."""

    def __init__(self, *, timeout_s: float, max_bytes: int) -> None:
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._idle: dict[Address, list[_Connection]] = {}
        # The loop the client runs on, kept: `asyncio.get_running_loop` makes a getpid system
        # call each time (its check against a fork), twice a scrape before.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Exchanges in flight and when each times out, and the one timer that times them out
        # (`_expire`): a timer per exchange, set then cancelled, cost about 1 us a scrape on
        # uvloop, an entry in this dict 0.14.
        self._deadlines: dict[_Connection, float] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = math.inf  # when it fires

    async def get(self, address: str, port: int, request: bytes) -> tuple[int, str, bytes]:
        """(status, reason, body) of one exchange, within the timeout. A kept connection the
        engine closed while idle (its keep-alive timeout ran out as the request left) is
        retried once on a new one; a new connection's failure is the engine's.

        The timeout fails the answer (`_Connection.expire`, from `_expire`), not
        `asyncio.timeout` around the exchange: that one's bookkeeping (a context, the task's
        cancel and uncancel) was a tenth of a scrape's CPU; a connection still being opened
        (rare: connections are kept) waits under `asyncio.timeout_at` for what is left of the
        same deadline."""
        where = (address, port)
        loop = self._loop
        if loop is None or not loop.is_running():  # first use, or another loop's client now
            loop = self._loop = asyncio.get_running_loop()
            # A timer of another loop never fires here.
            self._deadlines, self._sweep, self._sweep_at = {}, None, math.inf
        deadline = loop.time() + self._timeout_s
        while True:
            reused, connection = self._kept(where)
            if connection is None:
                async with asyncio.timeout_at(deadline):
                    connection = await self._open(loop, where)
            answer = connection.send(request)
            self._deadlines[connection] = deadline
            if deadline < self._sweep_at:  # the first in flight, or one slow to connect
                self._sweep_until(deadline)
            try:
                result = await answer
            except EngineUnreachable:
                connection.abort()
                if reused:
                    continue
                raise
            except BaseException:  # unusable, timed out or cancelled: not reusable
                connection.abort()
                raise
            finally:
                self._deadlines.pop(connection, None)
            if connection.closed:  # the engine said it closes this one
                connection.abort()
            else:
                self._idle.setdefault(where, []).append(connection)
            return result

    def _sweep_until(self, deadline: float) -> None:
        """The timer, moved to fire at `deadline` (math.inf: none); only once `get` has the
        loop."""
        assert self._loop is not None
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep, self._sweep_at = None, deadline
        if deadline < math.inf:
            self._sweep = self._loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        """Time out the exchanges whose deadline passed (within a millisecond: a timer may
        fire that much early); come back at the next deadline. An exchange's deadline is set
        as its scrape starts, so they come in order except after a slow connect (which moves
        the timer forward): the timer fires about once per timeout while exchanges go on,
        not once per exchange."""
        assert self._loop is not None  # the timer was set on it
        self._sweep = None
        deadlines = self._deadlines
        now = self._loop.time() + 0.001
        due = [c for c, deadline in deadlines.items() if deadline <= now]
        for connection in due:
            del deadlines[connection]
        self._sweep_until(min(deadlines.values(), default=math.inf))
        for connection in due:
            connection.expire()

    def _kept(self, where: Address) -> tuple[bool, _Connection | None]:
        """(True, a kept connection still open), else (False, None)."""
        idle = self._idle.get(where)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return True, connection
        return False, None

    async def _open(self, loop: asyncio.AbstractEventLoop, where: Address) -> _Connection:
        max_bytes = self._max_bytes
        try:
            _, connection = await loop.create_connection(
                lambda: _Connection(loop, max_bytes), where[0], where[1]
            )
        except OSError as exc:  # refused, unreachable, no such host
            raise EngineUnreachable(repr(exc)) from exc
        return connection

    def keep_only(self, addresses: Iterable[Address]) -> None:
        """Close the kept connections of engines no longer scraped."""
        present = set(addresses)
        for where in self._idle.keys() - present:
            for connection in self._idle.pop(where):
                connection.abort()

    def close(self) -> None:
        self.keep_only(())
