"""The proxy's HTTP/1.1 server protocol: uvicorn runs the process, this parses and answers requests.

uvicorn stays in charge of everything around a connection (listening sockets, lifespan,
signals, graceful shutdown, ``--workers``); `HttpProtocol` replaces its per-connection
protocol class, which it takes through ``uvicorn.Config(http=...)``. Issue 16 measured the
proxy's CPU per request against SGLang's Rust router, and uvicorn's generic protocol spent a
share of it on work this proxy does not need per request: an ``asyncio.Event`` and a
keep-alive timer per request, a regular expression per response header, a wake-up of the
request's disconnect watcher at every response's end, the head and body in two writes joined
by a wrapper. Here (docs/performance.md, "Round 3"):

- the parser is httptools (llhttp, the C parser uvicorn uses too); the request runs as one
  task, started when its headers are complete, as in uvicorn;
- ``receive()`` returns the body without waiting when it has already arrived (the usual case
  for a chat body of a few KB: headers and body come in one read);
- the response head waits for the first body bytes and both leave in one write; the head of a
  streamed answer (no Content-Length) sent alone goes out on the next event-loop iteration, so
  a client waiting for a stream's headers is not held (a head with a Content-Length is of no use
  without its body and waits for it);
- a client that disconnects is reported through the ``kvroute.disconnect`` ASGI extension
  (`DisconnectNotice`, in ``scope["extensions"]``): the app registers a callback instead of
  keeping a task parked in ``receive()`` for every request; ``receive()`` still returns
  ``http.disconnect`` as the ASGI spec says, for apps that do not use the extension;
- one idle timer per connection (re-armed only when it fires) instead of one per request; it
  also closes a connection whose next request head is still unfinished ``timeout_keep_alive``
  seconds after the previous answer (uvicorn's protocol kept such a connection open);
- TCP_NODELAY on every connection, so that a streamed chunk never waits for a delayed ACK.

What it keeps from uvicorn's behaviour: the ASGI 3 HTTP scope (``type``, ``asgi``,
``http_version``, ``server``, ``client``, ``scheme``, ``root_path``, ``headers`` with
lower-case names, ``state``, ``method``, ``path`` percent-decoded, ``raw_path``,
``query_string``), keep-alive and ``Connection: close``, HTTP/1.0, pipelined requests
answered in order, ``Expect: 100-continue`` answered when the app first reads the body,
chunked request bodies, chunked responses when the app gives no Content-Length, HEAD, 204 and
304 without bodies, read back-pressure (reading pauses while more than 64 KiB of body waits
for the app) and write back-pressure (``send`` waits while the transport's buffer is full),
response headers checked for control characters, an answer of 500 when an app fails before
its response started, and a graceful ``shutdown()`` that closes idle connections at once and
busy ones after their response. A request that is not valid HTTP gets a 400 in OpenAI's error
shape and the connection closes. Not supported (``kvroute serve`` never sets them):
uvicorn's ``limit_concurrency``, WebSocket upgrades (an ``Upgrade`` request is answered as a
plain HTTP request and the connection then closes), and uvicorn's own access log.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import socket
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools

from kvroute_server.http.asgi import dumps, openai_error

__all__ = ["DISCONNECT_EXTENSION", "DisconnectNotice", "HttpProtocol", "INVALID_HTTP_RESPONSE"]

#: The ASGI extension (a key of ``scope["extensions"]``) through which an app learns of a client
#: that went away: its value is the request's `DisconnectNotice`.
DISCONNECT_EXTENSION = "kvroute.disconnect"

#: Body bytes buffered for the app before reading from the socket pauses.
_HIGH_WATER = 64 * 1024
#: Request head (request line and headers) size limit; larger heads get a 431.
_MAX_HEAD_BYTES = 64 * 1024
#: Control characters that must not appear in a response header value (tab is allowed).
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_NAME = re.compile(rb"[\x00-\x20\x7f()<>@,;:\\\"/\[\]?={}]")

_logger = logging.getLogger("uvicorn.error")


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def _error_response(status: int, message: str, code: str) -> bytes:
    body = dumps(openai_error(status, message, code=code))
    head = _STATUS_LINES[status] + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % len(body) + body


#: The answer to bytes that are not a valid HTTP/1.1 request (the app never sees them).
INVALID_HTTP_RESPONSE = _error_response(
    400,
    "The request is not valid HTTP/1.1 (malformed request line, header, Content-Length or chunked encoding).",
    "invalid_http",
)
_HEAD_TOO_LARGE = _error_response(
    431, f"The request line and headers must be at most {_MAX_HEAD_BYTES} bytes.", "request_header_too_large"
)
_INTERNAL_ERROR = _error_response(500, "The server failed to handle this request.", "internal_error")


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


class DisconnectNotice:
    """One request's view of its client connection, given to the app as the ``kvroute.disconnect`` extension.

    ``callback`` (set by the app, cleared when it no longer cares) is called once, from the event
    loop, if the client disconnects before the response is complete. ``gone`` says whether it has.
    """

    __slots__ = ("callback", "gone")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.gone = False

    def forget(self) -> None:
        """Drop the callback (the app no longer needs to know)."""
        self.callback = None


class _Cycle:
    """One request and its response on a connection."""

    __slots__ = (
        "body",
        "body_read",
        "chunked",
        "continue_100",
        "head",
        "is_head",
        "keep_alive",
        "length_left",
        "message_done",
        "notice",
        "response_done",
        "response_started",
        "scope",
        "task",
        "waiter",
    )

    def __init__(self, scope: dict[str, Any], keep_alive: bool, continue_100: bool) -> None:
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_100 = continue_100
        self.is_head = scope["method"] == "HEAD"
        self.body = bytearray()
        self.body_read = False  # the app has received the body's last message
        self.message_done = False
        self.response_started = False
        self.response_done = False
        self.head: bytes | None = None  # a response head not yet written (waits for the first body bytes)
        self.chunked = False
        self.length_left: int | None = None
        self.notice = DisconnectNotice()
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class HttpProtocol(asyncio.Protocol):
    """An HTTP/1.1 server connection running an ASGI 3 app; a drop-in ``http`` protocol class for uvicorn."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any] | None = None, _loop: Any = None):
        self.app = config.loaded_app
        self.loop: asyncio.AbstractEventLoop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state if app_state is not None else {}
        self.root_path: str = config.root_path
        self.keep_alive_s: float = config.timeout_keep_alive
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.cycle: _Cycle | None = None  # the request being answered
        self.reading: _Cycle | None = None  # the request being parsed (the same one, or a pipelined next)
        self.waiting: collections.deque[_Cycle] = collections.deque()  # pipelined requests, parsed, not started
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self._idle_since = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._expect_100 = False

    # -- connection -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        self._idle_since = self.loop.time()
        self._idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self.parser = None
        self.waiting.clear()
        cycle = self.cycle
        if cycle is not None and not cycle.response_done:
            notice = cycle.notice
            notice.gone = True
            cycle.wake()
            callback, notice.callback = notice.callback, None
            if callback is not None:
                callback()
        self._resume_writers()

    def eof_received(self) -> bool | None:
        return None  # close the transport: the client finished sending

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._resume_writers()

    def _resume_writers(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def _idle_check(self) -> None:
        """Close a connection that has waited ``timeout_keep_alive`` seconds for its next request."""
        self._idle_timer = None
        if self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_done
        left = self._idle_since + self.keep_alive_s - self.loop.time()
        if not busy and self.reading is None and left <= 0:
            self.transport.close()
            return
        self._idle_timer = self.loop.call_later(max(left, 0.05) if not busy else self.keep_alive_s, self._idle_check)

    def shutdown(self) -> None:
        """Graceful stop (called by uvicorn): close now when idle, else after the response in progress."""
        cycle = self.cycle
        if cycle is None or cycle.response_done:
            self.transport.close()
        else:
            cycle.keep_alive = False
            self.waiting.clear()

    # -- parsing ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade_refused()
        except httptools.HttpParserError as exc:
            self._reject(_HEAD_TOO_LARGE if isinstance(exc.__context__, _HeadTooLarge) else INVALID_HTTP_RESPONSE)

    def _reject(self, response: bytes) -> None:
        """Answer bytes that cannot be parsed with ``response`` and close (the app sees a disconnect).

        A response already under way cannot be followed by another: the connection just closes.
        """
        self.parser = None
        self.reading = None
        self.waiting.clear()
        cycle = self.cycle
        if cycle is None or cycle.response_done or not cycle.response_started:
            self.transport.write(response)
        self.transport.close()

    def _upgrade_refused(self) -> None:
        """An ``Upgrade`` request (e.g. WebSocket): served as plain HTTP; whatever follows is not parsed."""
        self.parser = None
        cycle = self.reading
        if cycle is not None:
            cycle.keep_alive = False
            if not cycle.message_done:
                cycle.message_done = True
                cycle.wake()

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._expect_100 = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > _MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_100 = True
        self._headers.append((name, value))
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > _MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        parser = self.parser
        assert parser is not None
        url = self._url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            raw_path, query = url, b""
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        version = parser.get_http_version()
        root = self.root_path
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": root,
            "headers": self._headers,
            "state": self.app_state.copy(),
            "method": parser.get_method().decode("ascii"),
            "path": root + path if root else path,
            "raw_path": root.encode("ascii") + raw_path if root else raw_path,
            "query_string": query,
        }
        cycle = _Cycle(scope, version != "1.0" and parser.should_keep_alive(), self._expect_100)
        scope["extensions"] = {DISCONNECT_EXTENSION: cycle.notice}
        self.reading = cycle
        if self.cycle is None or self.cycle.response_done:
            self._start(cycle)
        else:  # pipelined: answered after the one in progress
            self.waiting.append(cycle)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.reading
        if cycle is None or cycle.response_done:
            return
        cycle.body += body
        if len(cycle.body) > _HIGH_WATER:
            self._pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.reading
        self.reading = None
        if cycle is None:
            return
        cycle.message_done = True
        cycle.wake()

    def _pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    # -- running the app --------------------------------------------------------------

    def _start(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(self._run(cycle))
        cycle.task = task
        self.tasks.add(task)

    async def _run(self, cycle: _Cycle) -> None:
        try:
            await self.app(cycle.scope, lambda: self._receive(cycle), lambda message: self._send(cycle, message))
        except BaseException as exc:
            _logger.error("Exception in ASGI application", exc_info=exc)
            if not cycle.response_started and not cycle.notice.gone:
                self._finish(cycle, _INTERNAL_ERROR, close=True)
            elif not cycle.response_done:
                self.transport.close()
            if not isinstance(exc, Exception):
                raise
        else:
            if not cycle.response_done and not cycle.notice.gone:
                if cycle.response_started:
                    _logger.error("ASGI callable returned without completing response.")
                    self.transport.close()
                else:
                    _logger.error("ASGI callable returned without starting response.")
                    self._finish(cycle, _INTERNAL_ERROR, close=True)
        finally:
            self.tasks.discard(cycle.task)
            cycle.notice.callback = None

    async def _receive(self, cycle: _Cycle) -> dict[str, Any]:
        if cycle.continue_100:
            cycle.continue_100 = False
            if not self.transport.is_closing() and not cycle.response_started:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        notice = cycle.notice
        if not cycle.body_read:  # the body, as it arrives, up to one message with more_body False
            while not cycle.body and not cycle.message_done and not notice.gone and not cycle.response_done:
                self._resume_reading()
                cycle.waiter = self.loop.create_future()
                await cycle.waiter
            if not notice.gone and not cycle.response_done:
                body = bytes(cycle.body)
                cycle.body = bytearray()
                cycle.body_read = cycle.message_done
                if self.read_paused and not self.waiting:
                    self._resume_reading()
                return {"type": "http.request", "body": body, "more_body": not cycle.message_done}
        while not notice.gone and not cycle.response_done:  # then: wait for the end
            cycle.waiter = self.loop.create_future()
            await cycle.waiter
        return {"type": "http.disconnect"}

    async def _send(self, cycle: _Cycle, message: dict[str, Any]) -> None:
        if self.write_paused and not cycle.notice.gone:
            self._writable = self._writable or self.loop.create_future()
            await self._writable
        if cycle.notice.gone:
            return
        kind = message["type"]
        if not cycle.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            cycle.head = self._head(cycle, message["status"], message.get("headers") or ())
            cycle.response_started = True
            cycle.continue_100 = False
            if cycle.length_left is None:  # streamed: the head must not wait for the app's first chunk
                self.loop.call_soon(self._flush_head, cycle)
            return
        if cycle.response_done:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent, after the response completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got {kind!r}.")
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if cycle.is_head:
            body = b""
        elif cycle.chunked:
            if body:
                body = b"%x\r\n%b\r\n" % (len(body), body)
            if not more:
                body += b"0\r\n\r\n"
        elif cycle.length_left is not None:
            cycle.length_left -= len(body)
            if cycle.length_left < 0:
                raise RuntimeError("Response content longer than Content-Length")
            if not more and cycle.length_left:
                raise RuntimeError("Response content shorter than Content-Length")
        head = cycle.head
        if head is not None:
            cycle.head = None
            body = head + body
        if not more:
            self._finish(cycle, body, close=not cycle.keep_alive)
        elif body:
            self.transport.write(body)

    def _head(self, cycle: _Cycle, status: int, headers: Any) -> bytes:
        """The response head; decides the body's framing (Content-Length, chunked, none)."""
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        close = False
        names = []
        values = []
        for name, value in headers:
            name = name.lower()
            names.append(name)
            values.append(value)
            if name == b"content-length":
                if cycle.length_left is None:
                    cycle.length_left = int(value)
            elif name == b"transfer-encoding":
                if value.lower() == b"chunked":
                    cycle.chunked = True
                    cycle.length_left = None
            elif name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
                cycle.keep_alive = False
                close = True
            parts += (name, b": ", value, b"\r\n")
        # One search each over all names and all values (a tab, allowed in values, joins them).
        if _BAD_NAME.search(b"".join(names)) or _BAD_VALUE.search(b"\t".join(values)):
            bad = next(
                (n, v) for n, v in zip(names, values, strict=True) if _BAD_NAME.search(n) or _BAD_VALUE.search(v)
            )
            raise RuntimeError(f"Invalid HTTP response header {bad[0]!r}: {bad[1]!r}")
        if not cycle.keep_alive and not close:
            parts.append(b"connection: close\r\n")
        if status in (204, 304):  # no body, whatever the headers say
            cycle.chunked = False
            cycle.length_left = None
        elif cycle.length_left is None and not cycle.chunked and not cycle.is_head:
            cycle.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _flush_head(self, cycle: _Cycle) -> None:
        head = cycle.head
        if head is not None and not self.transport.is_closing():
            cycle.head = None
            self.transport.write(head)

    def _finish(self, cycle: _Cycle, data: bytes, *, close: bool) -> None:
        """Write the response's last bytes; then close, or move on to the next request."""
        cycle.response_done = True
        cycle.notice.callback = None
        cycle.wake()
        self.server_state.total_requests += 1
        transport = self.transport
        if transport.is_closing():
            return
        if data:
            transport.write(data)
        if close:
            transport.close()
            return
        self._idle_since = self.loop.time()
        if self.waiting:
            self._start(self.waiting.popleft())
        if not self.waiting:
            self._resume_reading()


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request head exceeds `_MAX_HEAD_BYTES`."""
