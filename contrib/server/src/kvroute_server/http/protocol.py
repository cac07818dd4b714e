"""The proxy's HTTP/1.1 server protocol: uvicorn runs the process, this serves each connection.

uvicorn stays in charge of everything around a connection (listening sockets, lifespan,
signals, graceful shutdown, ``--workers``); `HttpProtocol` replaces its per-connection
protocol class, which it takes through ``uvicorn.Config(http=...)``. It is an optimisation,
not a dependency: ``kvroute serve --http httptools`` runs uvicorn's stock protocol instead, and
the proxy behaves the same (tests/server/test_http_differential.py compares the two).

Why a protocol of its own: uvicorn's generic one spends part of the proxy's CPU per request
on work this proxy does not need (measurements: docs/performance.md): an ``asyncio.Event``
and a keep-alive timer per request, a regular expression per response header, a wake-up of
the request's disconnect watcher at every response's end, the head and body in two writes
joined by a wrapper. Here:

- the parser is httptools (llhttp, the C parser uvicorn uses too; `RequestReader` holds its
  callbacks); the request runs as one task, started when its headers are complete, as in uvicorn;
- ``receive()`` returns the body without waiting when it has already arrived (the usual case
  for a chat body of a few KB: headers and body come in one read);
- the response head (`response_head`) waits for the first body bytes and both leave in one
  write; the head of a streamed answer (no Content-Length) sent alone goes out on the next
  event-loop iteration, so a client waiting for a stream's headers is not held (a head with a
  Content-Length is of no use without its body and waits for it);
- a client that disconnects is reported through the ``kvroute.disconnect`` ASGI extension
  (`DisconnectNotice`, in ``scope["extensions"]``): the app registers a callback instead of
  keeping a task parked in ``receive()`` for every request; ``receive()`` still returns
  ``http.disconnect`` as the ASGI spec says, for apps that do not use the extension;
- one idle timer per connection (re-armed only when it fires) instead of one per request; it
  also closes a connection whose next request head is still unfinished ``timeout_keep_alive``
  seconds after the previous answer (uvicorn's protocol keeps such a connection open);
- TCP_NODELAY on every connection, so that a streamed chunk never waits for a delayed ACK.

What it keeps from uvicorn's behaviour: the ASGI 3 HTTP scope (see `kvroute_server.http.reader`),
keep-alive and ``Connection: close``, HTTP/1.0, pipelined requests answered in order,
``Expect: 100-continue`` answered when the app first reads the body, chunked request bodies,
chunked responses when the app gives no Content-Length, HEAD, 204 and 304 without bodies, read
back-pressure (reading pauses while more than 64 KiB of body waits for the app) and write
back-pressure (``send`` waits while the transport's buffer is full), response headers checked
for control characters, an answer of 500 when an app fails before its response started, and a
graceful ``shutdown()`` that closes idle connections at once and busy ones after their
response. A request that is not valid HTTP gets a 400 in OpenAI's error shape and the
connection closes. Not supported (``kvroute serve`` never sets them): uvicorn's
``limit_concurrency``, WebSocket upgrades (an ``Upgrade`` request is answered as a plain HTTP
request and the connection then closes), and uvicorn's own access log.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from typing import Any

import httptools

from kvroute_server.http.cycle import DISCONNECT_EXTENSION, Cycle, DisconnectNotice
from kvroute_server.http.reader import HeadTooLarge, RequestReader
from kvroute_server.http.response import (
    CONTINUE,
    HEAD_TOO_LARGE,
    INTERNAL_ERROR,
    INVALID_HTTP_RESPONSE,
    frame_body,
    response_head,
)

__all__ = ["DISCONNECT_EXTENSION", "DisconnectNotice", "HttpProtocol", "INVALID_HTTP_RESPONSE"]

_logger = logging.getLogger("uvicorn.error")


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


class HttpProtocol(asyncio.Protocol):
    """An HTTP/1.1 server connection running an ASGI 3 app; a drop-in ``http`` protocol class for uvicorn."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any] | None = None, _loop: Any = None):
        self.app = config.loaded_app
        self.loop: asyncio.AbstractEventLoop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        app_state = app_state if app_state is not None else {}
        self.reader = RequestReader(config.root_path, app_state, self._request_ready, self._pause_reading)
        self.keep_alive_s: float = config.timeout_keep_alive
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.cycle: Cycle | None = None  # the request being answered
        self.waiting: collections.deque[Cycle] = collections.deque()  # pipelined requests, parsed, not started
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self._idle_since = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- connection -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = self.reader
        reader.server = _address(transport.get_extra_info("sockname"))
        reader.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext") is not None:
            reader.scheme = "https"
        self._idle_since = self.loop.time()
        self._idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self.reader.parser = None
        self.waiting.clear()
        cycle = self.cycle
        if cycle is not None and not cycle.response_done:
            cycle.client_gone()
        self._resume_writers()

    def eof_received(self) -> bool | None:
        return None  # close the transport: the client finished sending

    def shutdown(self) -> None:
        """Graceful stop (called by uvicorn): close now when idle, else after the response in progress."""
        cycle = self.cycle
        if cycle is None or cycle.response_done:
            self.transport.close()
        else:
            cycle.keep_alive = False
            self.waiting.clear()

    def _idle_check(self) -> None:
        """Close a connection that has waited ``timeout_keep_alive`` seconds for its next request."""
        self._idle_timer = None
        if self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_done
        left = self._idle_since + self.keep_alive_s - self.loop.time()
        if not busy and self.reader.current is None and left <= 0:
            self.transport.close()
            return
        self._idle_timer = self.loop.call_later(max(left, 0.05) if not busy else self.keep_alive_s, self._idle_check)

    # -- flow control -----------------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._resume_writers()

    def _resume_writers(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def _pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    # -- reading ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        parser = self.reader.parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade_refused()
        except httptools.HttpParserError as exc:
            self._reject(HEAD_TOO_LARGE if isinstance(exc.__context__, HeadTooLarge) else INVALID_HTTP_RESPONSE)

    def _reject(self, response: bytes) -> None:
        """Answer bytes that cannot be parsed with ``response`` and close (the app sees a disconnect).

        A response already under way cannot be followed by another: the connection just closes.
        """
        self.reader.parser = None
        self.reader.current = None
        self.waiting.clear()
        cycle = self.cycle
        if cycle is None or cycle.response_done or not cycle.response_started:
            self.transport.write(response)
        self.transport.close()

    def _upgrade_refused(self) -> None:
        """An ``Upgrade`` request (e.g. WebSocket): served as plain HTTP; whatever follows is not parsed."""
        self.reader.parser = None
        cycle = self.reader.current
        if cycle is not None:
            cycle.keep_alive = False
            if not cycle.message_done:
                cycle.message_done = True
                cycle.wake()

    def _request_ready(self, cycle: Cycle) -> None:
        """A request head is complete: run it now, or after the one in progress (pipelining)."""
        if self.cycle is None or self.cycle.response_done:
            self._start(cycle)
        else:
            self.waiting.append(cycle)
            self._pause_reading()

    # -- running the app --------------------------------------------------------------

    def _start(self, cycle: Cycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(self._run(cycle))
        cycle.task = task
        self.tasks.add(task)

    async def _run(self, cycle: Cycle) -> None:
        try:
            await self.app(cycle.scope, lambda: self._receive(cycle), lambda message: self._send(cycle, message))
        except BaseException as exc:
            _logger.error("Exception in ASGI application", exc_info=exc)
            if not cycle.response_started and not cycle.notice.gone:
                self._finish(cycle, INTERNAL_ERROR, close=True)
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
                    self._finish(cycle, INTERNAL_ERROR, close=True)
        finally:
            self.tasks.discard(cycle.task)
            cycle.notice.callback = None

    async def _receive(self, cycle: Cycle) -> dict[str, Any]:
        if cycle.continue_100:
            cycle.continue_100 = False
            if not self.transport.is_closing() and not cycle.response_started:
                self.transport.write(CONTINUE)
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

    async def _send(self, cycle: Cycle, message: dict[str, Any]) -> None:
        if self.write_paused and not cycle.notice.gone:
            self._writable = self._writable or self.loop.create_future()
            await self._writable
        if cycle.notice.gone:
            return
        kind = message["type"]
        if not cycle.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            cycle.head = response_head(cycle, message["status"], message.get("headers") or ())
            cycle.response_started = True
            cycle.continue_100 = False
            if cycle.length_left is None:  # streamed: the head must not wait for the app's first chunk
                self.loop.call_soon(self._flush_head, cycle)
            return
        if cycle.response_done:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent, after the response completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got {kind!r}.")
        more = message.get("more_body", False)
        body = frame_body(cycle, message.get("body", b""), more)
        head = cycle.head
        if head is not None:
            cycle.head = None
            body = head + body
        if not more:
            self._finish(cycle, body, close=not cycle.keep_alive)
        elif body:
            self.transport.write(body)

    def _flush_head(self, cycle: Cycle) -> None:
        head = cycle.head
        if head is not None and not self.transport.is_closing():
            cycle.head = None
            self.transport.write(head)

    def _finish(self, cycle: Cycle, data: bytes, *, close: bool) -> None:
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
