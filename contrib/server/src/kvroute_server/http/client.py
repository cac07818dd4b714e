"""The proxied requests' own HTTP/1.1 client: `UpstreamPool` and the answers it returns.

Keep-alive HTTP/1.1 connections per backend, written and parsed with the least Python
possible: one write for the head and body, httptools' C parser for the answer, the body handed
over chunk by chunk as it arrives. aiohttp's client spent about 30 % of the proxy's CPU per
request on the same job; this one about a quarter of that (docs/performance.md, "Proxy throughput").
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import attrs
import httptools

__all__ = ["UpstreamConnectionError", "UpstreamPool", "UpstreamResponse"]


class UpstreamConnectionError(ConnectionError):
    """A backend could not be reached, closed the connection early or answered something that is not HTTP/1.x.

    A ``ConnectionError`` (an ``OSError``), never a ``TimeoutError``: a connect timeout is a
    connection failure, not the first-byte or idle timeout the caller keeps itself.
    """


#: Read at most this much of a backend's answer ahead of the client: above it, reading pauses.
_READ_HIGH_WATER = 256 * 1024


class UpstreamResponse:
    """A backend's answer: status and headers at once, the body as it arrives (`readany`).

    Its surface is the part of aiohttp's ``ClientResponse`` the forwarder needs (``status``,
    ``content_type``, ``raw_headers``, ``readany()``, ``at_eof()``, ``release()``,
    ``close()``), so that the forwarding logic does not depend on which client answers.
    """

    __slots__ = ("_buffer", "_buffered", "_conn", "_done", "_error", "_waiter", "content_type", "raw_headers", "status")

    def __init__(self, conn: _Connection, status: int, raw_headers: list[tuple[bytes, bytes]], content_type: str):
        self._conn: _Connection | None = conn
        self.status = status
        self.raw_headers = raw_headers
        self.content_type = content_type
        self._buffer: list[bytes] = []
        self._buffered = 0  # bytes in _buffer, kept as they come and go (not summed on each arrival)
        self._done = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def readany(self, deadline: float | None = None) -> bytes:
        """The body bytes received since the last call, waiting for some; ``b""`` at the end of the body.

        ``deadline`` (event-loop time): a wait past it raises ``TimeoutError``. The timer is only
        set when there is something to wait for (one ``call_at``, cheaper than ``asyncio.timeout``).
        """
        if not self._buffer and not self._done and self._error is None:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_at(deadline, _expire, waiter) if deadline is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        if self._buffer:
            data = self._buffer[0] if len(self._buffer) == 1 else b"".join(self._buffer)
            self._buffer.clear()
            self._buffered = 0
            if self._conn is not None:
                self._conn.resume()
            return data
        if self._error is not None:
            raise self._error
        return b""

    def at_eof(self) -> bool:
        """True once the whole body has arrived and been read."""
        return self._done and not self._buffer

    def release(self) -> None:
        """Done with a fully read answer: its connection goes back to the pool (or closes when it must)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(reuse=self._done and self._error is None)

    def close(self) -> None:
        """Done before the end of the answer: close its connection, so that the backend sees the client leave."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(reuse=False)

    # -- fed by the connection --

    def _feed(self, data: bytes) -> None:
        self._buffer.append(data)
        self._buffered += len(data)
        self._wake()

    def _end(self, error: Exception | None) -> None:
        if not self._done and self._error is None:
            if error is None:
                self._done = True
            else:
                self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[Any]) -> None:
    """A deadline timer: the wait it guards ends with ``TimeoutError``."""
    if not waiter.done():
        waiter.set_exception(TimeoutError("the deadline passed"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a backend, answering one request at a time (httptools' parser)."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._content_type = b""
        self._complete = False
        self._keep_alive = False
        self._paused = False
        self._until_close = True  # no Content-Length, not chunked: the body ends when the connection does

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self._fail(UpstreamConnectionError(f"{self.pool.name}: unexpected bytes on an idle connection"))
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamConnectionError(f"{self.pool.name}: the answer is not valid HTTP/1.1 ({exc})"))

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    # -- httptools callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        lower = name.lower()
        if lower == b"content-type":
            self._content_type = value
        elif lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._until_close = False

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self._headers = []
            self._content_type = b""
            return
        # Asked now: httptools forgets the answer's keep-alive once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        content_type = self._content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
        self._response = UpstreamResponse(self, status, self._headers, content_type or "application/octet-stream")
        head = self._head
        if head is not None and not head.done():
            head.set_result(self._response)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is not None:
            response._feed(body)
            if not self._paused and response._buffered > _READ_HIGH_WATER and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._complete = True
        if self._response is not None:
            self._response._end(None)

    # -- used by the pool and the response --

    def request(self, head: bytes, body: bytes) -> asyncio.Future[UpstreamResponse]:
        """Send one request (head and body in one write); the future resolves with the answer's head."""
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._head = asyncio.get_running_loop().create_future()
        self._response = None
        self._headers = []
        self._content_type = b""
        self._complete = False
        self._keep_alive = False
        self._until_close = True
        if len(body) <= 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        return self._head

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def finished(self, *, reuse: bool) -> None:
        """The answer was handed over (or given up): pool the connection when it can serve another request."""
        keep = reuse and self._complete and self._keep_alive and not self.closed
        self._parser = None
        self._head = None
        self._response = None
        if keep:
            self.resume()
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: Exception) -> None:
        self._parser = None
        self.close()
        self._deliver(error)

    def _lost(self, exc: Exception | None) -> None:
        if self.closed and self._head is None:
            return
        self.closed = True
        if self._response is not None and not self._complete and self._until_close and exc is None:
            self._complete = True  # a body framed by the end of the connection: it is whole
            self._response._end(None)
            return
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self._deliver(
            UpstreamConnectionError(f"{self.pool.name}: the connection closed before the answer ended{detail}")
        )

    def _deliver(self, error: Exception) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        elif self._response is not None and not self._complete:
            self._response._end(error)


class _HostPool:
    """Idle keep-alive connections to one scheme://host:port, newest last (reused first)."""

    def __init__(self, scheme: str, host: str, port: int, keepalive_s: float) -> None:
        self.name = f"{host}:{port}"
        self.scheme = scheme
        self.host = host
        self.port = port
        self.keepalive_s = keepalive_s
        self.idle: collections.deque[_Connection] = collections.deque()

    def take(self, now: float) -> _Connection | None:
        """A live idle connection, closing those that idled too long or were closed by the backend."""
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def put(self, conn: _Connection) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        self.idle.append(conn)


@attrs.frozen
class _Target:
    """What a backend URL means to the client, parsed once."""

    pool: _HostPool
    base_path: str
    host: str  # the Host header's value: the URL's host and port, IDNA-encoded (ASCII)


class UpstreamPool:
    """The client of the proxied requests: ``await pool.post(url, body, headers)`` returns an `UpstreamResponse`.

    Keeps idle connections per backend host for ``keepalive_s`` (no limit on their number,
    like aiohttp's pool); a request takes the most recently used one or opens a
    new one within ``connect_timeout``. Every failure to connect, or a connection that closes
    before the answer ended, is an `UpstreamConnectionError`. The caller keeps its own
    timeouts around ``post`` and ``readany`` and must end each response with ``release()``
    (fully read) or ``close()``.
    """

    def __init__(self, connect_timeout: float, *, keepalive_s: float = 60.0) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self._targets: dict[str, _Target] = {}
        self._pools: dict[tuple[str, str, int], _HostPool] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            scheme = parts.scheme
            port = parts.port or (443 if scheme == "https" else 80)
            host = parts.hostname or ""
            key = (scheme, host, port)
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _HostPool(scheme, host, port, self.keepalive_s)
            host_header = parts.netloc.rpartition("@")[2].encode("idna").decode("ascii")
            target = _Target(pool, parts.path.rstrip("/"), host_header)
            self._targets[base_url] = target
        return target

    async def post(
        self, base_url: str, target: str, body: bytes, headers: Mapping[str, str], deadline: float | None = None
    ) -> UpstreamResponse:
        """``POST`` ``body`` to ``base_url`` + ``target`` (path and query) with ``headers``; returns the answer's head.

        ``Host`` and ``Content-Length`` are the client's own; ``headers`` must hold neither. With a
        ``deadline`` (event-loop time), a head that has not arrived by then raises ``TimeoutError``
        (and so does a connect that has not finished).
        """
        where = self._target(base_url)
        path = where.base_path + target
        if not path.isascii():  # a non-ASCII query or configured path: percent-encoded, as aiohttp does
            path = quote(path, safe="/?&=%:@!$'()*+,;~")
        # The head is put together as text and encoded once (Latin-1, as HTTP/1.1 header values are).
        lines = [f"POST {path} HTTP/1.1\r\nhost: {where.host}\r\ncontent-length: {len(body)}\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value:
                raise ValueError(f"header {name!r} must not contain a line break (got {value!r})")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        pool = where.pool
        loop = asyncio.get_running_loop()
        conn = pool.take(loop.time())
        if conn is None:
            if deadline is None:
                conn = await self._connect(pool)
            else:
                async with asyncio.timeout_at(deadline):
                    conn = await self._connect(pool)
        answer = conn.request(head, body)
        timer = loop.call_at(deadline, _expire, answer) if deadline is not None else None
        try:
            return await answer
        except BaseException:
            conn.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _connect(self, pool: _HostPool) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if pool.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(pool), pool.host, pool.port, ssl=tls)
        except TimeoutError:
            raise UpstreamConnectionError(f"{pool.name}: could not connect within {self.connect_timeout} s") from None
        except OSError as exc:
            raise UpstreamConnectionError(f"{pool.name}: cannot connect: {exc}") from exc
        return conn

    def close(self) -> None:
        """Close every idle connection (connections in use close when their response ends)."""
        for pool in self._pools.values():
            while pool.idle:
                pool.idle.pop().close()
