"""Talking to backends: the proxied requests' own HTTP/1.1 client, header rules, usage sniffing.

Two clients, for two kinds of traffic:

* `UpstreamPool`, for the requests the proxy forwards (the hot path): keep-alive HTTP/1.1
  connections per backend, written and parsed with the least Python possible (one write for
  the head and body, httptools' C parser for the answer, the body handed over chunk by chunk
  as it arrives). aiohttp's client spent about 30 % of the proxy's CPU per request on the same
  job; this one about a quarter of that (docs/performance.md, "Proxy throughput").
* an aiohttp session (`create_session`), for everything else: health probes, telemetry polls,
  KV events, parity checks (`BackendHttp`), where convenience counts more than microseconds.

aiohttp was chosen over httpx after measuring streaming pass-through
(benchmarks/bench_http_clients.py, figures in docs/performance.md).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import re
import socket
import ssl
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import attrs
import httptools

from kvroute.adapters import HttpReply

__all__ = [
    "HOP_BY_HOP",
    "BackendHttp",
    "UpstreamConnectionError",
    "UpstreamPool",
    "UpstreamResponse",
    "UsageSniffer",
    "create_session",
    "filter_request_headers",
    "filter_response_headers",
]

#: RFC 9110 section 7.6.1 connection-specific headers, never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed or owned by the proxy on the way up.
_DROP_UP = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}
# Recomputed by the ASGI server on the way down.
_DROP_DOWN = HOP_BY_HOP | {"content-length", "date", "server"}
# The same, as the bytes names of a backend's answer are compared with.
_DROP_DOWN_BYTES = frozenset(name.encode("ascii") for name in _DROP_DOWN)


def _named_by_connection(value: bytes) -> frozenset[str]:
    """The header names a Connection header's ``value`` lists, beyond those always dropped (lower case).

    RFC 9110 section 7.6.1: a header named in Connection is hop-by-hop too. Almost every
    Connection header says ``keep-alive`` or ``close``, already in `HOP_BY_HOP`, so the
    answer is mostly empty. Short values are cached (the same few come again and again);
    long ones are not, so that a client cannot fill the cache with large values.
    """
    if len(value) > 64:
        return _parse_connection(value)
    return _parse_connection_cached(value)


def _parse_connection(value: bytes) -> frozenset[str]:
    """`_named_by_connection` without the cache: comma-separated tokens, trimmed and lower-cased as text."""
    tokens = (token.strip().lower() for token in value.decode("latin-1").split(","))
    return frozenset(token for token in tokens if token) - HOP_BY_HOP


_parse_connection_cached = functools.lru_cache(maxsize=256)(_parse_connection)


def filter_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    *,
    forward_authorization: bool,
    api_key: str | None,
    request_id: str,
) -> dict[str, str]:
    """Headers to send upstream: hop-by-hop dropped, Authorization forwarded or replaced, request id set.

    Names listed in a Connection header are removed after the pass, only when there are such
    names beyond the usual ``keep-alive``/``close``: the last value of each other name is
    kept, in the order the names first came, as if they had been skipped in the pass.
    """
    drop_authorization = api_key is not None or not forward_authorization
    out: dict[str, str] = {}
    named: frozenset[str] = frozenset()
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        if name in _DROP_UP:
            if name == "connection":
                named |= _named_by_connection(raw_value)
            continue
        if name == "authorization" and drop_authorization:
            continue
        out[name] = raw_value.decode("latin-1")
    for name in named:
        out.pop(name, None)
    if api_key is not None:
        out["authorization"] = f"Bearer {api_key}"
    out["x-request-id"] = request_id
    return out


def filter_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Headers to send back to the client: hop-by-hop and length/date/server dropped, names in lower case.

    One pass in bytes: ``bytes.lower`` and ``str.lower`` agree on whether a Latin-1 name is one
    of the (ASCII) dropped names. Names listed in a Connection header are dropped in a second
    pass, only when there are such names beyond the usual ``keep-alive``/``close``.
    """
    out: list[tuple[bytes, bytes]] = []
    named: frozenset[str] = frozenset()
    for name, value in headers:
        lower = name.lower()
        if lower in _DROP_DOWN_BYTES:
            if lower == b"connection":
                named |= _named_by_connection(value)
            continue
        out.append((lower, value))
    if named:
        out = [(name, value) for name, value in out if name.decode("latin-1").lower() not in named]
    return out


#: A count of more than 18 digits is no token count (and ``int`` refuses numbers over 4,300 digits):
#: such a value is not matched, so a hostile backend cannot make the sniffer raise.
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,18})(?!\d)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,18})(?!\d)')


@attrs.define
class UsageSniffer:
    """Finds ``usage.prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` in passing bytes.

    Bytes are scanned only when a chunk mentions ``usage``; a short tail of the previous
    chunk is kept so that a number split across two chunks is still found. The last
    values seen win (streams carry usage once, at the end).
    """

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    _tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        self._tail = data[-256:]
        # rfind, not ``in``: bytes' ``in`` first tries its operand as an int (a caught
        # TypeError each time); and usage comes at the end of the bytes that carry it.
        if data.rfind(b"prompt_tokens") < 0:
            return
        prompt = _last_number(_PROMPT, b'"prompt_tokens"', data)
        if prompt is not None:
            self.prompt_tokens = prompt
        cached = _last_number(_CACHED, b'"cached_tokens"', data)
        if cached is not None:
            self.cached_tokens = cached


def _last_number(pattern: re.Pattern[bytes], key: bytes, data: bytes) -> int | None:
    """The number in ``pattern``'s last match in ``data``, None without a match (``pattern`` starts with ``key``).

    Looked for at the key's last mention, not by scanning all of ``data`` with the pattern;
    only when that mention is not followed by a number are all matches looked at.
    """
    at = data.rfind(key)
    if at < 0:
        return None
    match = pattern.match(data, at)
    if match is not None:
        return int(match.group(1))
    numbers = pattern.findall(data)
    return int(numbers[-1]) if numbers else None


def _nodelay_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """Socket factory for aiohttp: TCP_NODELAY before connecting (aiohttp also sets it later)."""
    family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family=family, type=type_, proto=proto)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def create_session(connect_timeout: float, *, pool_limit: int = 0, keepalive_s: float = 60.0) -> aiohttp.ClientSession:
    """The shared upstream session: unlimited keep-alive pool, no auto-decompression, no cookies."""
    connector = aiohttp.TCPConnector(
        limit=pool_limit, keepalive_timeout=keepalive_s, ttl_dns_cache=60, socket_factory=_nodelay_socket
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, connect=None, sock_read=None),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
        raise_for_status=False,
    )


@attrs.define
class BackendHttp:
    """`kvroute.adapters.HttpClient` for one backend: health probes, telemetry polls, KV events, parity."""

    session: aiohttp.ClientSession
    base_url: str
    timeout: float
    headers: Mapping[str, str] = attrs.field(factory=dict)

    async def get(self, path: str) -> HttpReply:
        return await self._call("GET", path, None)

    def with_timeout(self, seconds: float) -> BackendHttp:
        """The same client with another per-call timeout (for engine endpoints that hold their answer)."""
        return attrs.evolve(self, timeout=seconds)

    async def post(self, path: str, body: object) -> HttpReply:
        """``POST path`` with ``body`` as JSON (`kvroute.adapters.HttpClient`)."""
        return await self._call("POST", path, body)

    async def _call(self, method: str, path: str, body: object) -> HttpReply:
        url = self.base_url + (path if path.startswith("/") else "/" + path)
        data = None
        headers = self.headers
        if method == "POST":
            # The shared session skips automatic headers (the proxy forwards the client's own),
            # so the JSON content type is set here: engines reject a POST without it.
            data = json.dumps(body, separators=(",", ":")).encode("utf-8")
            headers = {**headers, "content-type": "application/json"}
        try:
            async with self.session.request(
                method, url, headers=headers, data=data, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as response:
                return HttpReply(response.status, await response.read())
        except aiohttp.ClientError as exc:
            raise OSError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc


# -- the proxied requests' client -------------------------------------------------------


class UpstreamConnectionError(ConnectionError):
    """A backend could not be reached, closed the connection early or answered something that is not HTTP/1.x.

    A ``ConnectionError`` (an ``OSError``), never a ``TimeoutError``: a connect timeout is a
    connection failure, not the first-byte or idle timeout the caller keeps itself.
    """


#: Read at most this much of a backend's answer ahead of the client: above it, reading pauses.
_READ_HIGH_WATER = 256 * 1024


class UpstreamResponse:
    """A backend's answer: status and headers at once, the body as it arrives (`readany`).

    Its surface is the part of aiohttp's ``ClientResponse`` the forwarder used (``status``,
    ``content_type``, ``raw_headers``, ``readany()``, ``at_eof()``, ``release()``,
    ``close()``), so the forwarding logic did not change with the client.
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
    like the aiohttp pool it replaced); a request takes the most recently used one or opens a
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
        if not path.isascii():  # a non-ASCII query or configured path: percent-encoded, as aiohttp did
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
