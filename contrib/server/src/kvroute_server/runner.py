"""Running ASGI apps under uvicorn: the CLI's blocking ``serve`` and a thread helper for tests.

Both use `NoDelayHttpToolsProtocol` (or the h11 equivalent when httptools is missing), which
sets TCP_NODELAY on every accepted connection explicitly: asyncio and uvloop already do, and
this keeps it true whatever loop runs the server. A streamed first chunk must never wait
for Nagle's algorithm and a delayed ACK. It also answers a request uvicorn cannot parse
(broken chunk framing, a bad header line) with a 400 in OpenAI's error shape rather than
uvicorn's plain text.

A server process (`run_server`, and each worker of ``--workers N``) runs `ProcessServer`, which
freezes the garbage collector's view of everything that exists once the app has started
(``gc.freeze()``): imports, the router's tables, the tokenizer. Without it, each full collection
walked all of those objects again and held the event loop for up to 100 ms (measured under
``kvroute serve``: the proxy's p99 latency, docs/performance.md). Objects created afterwards are
collected as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvroute_server._asgi import dumps, openai_error

__all__ = ["ProcessServer", "ServerThread", "make_uvicorn_config", "nodelay_protocol", "run_server"]


def _set_nodelay(transport: Any) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _CoalescingTransport:
    """Holds a response's status line and headers until its first body bytes, then writes both at once.

    uvicorn writes the head on ``http.response.start`` and the body on the next message: two
    syscalls and, with TCP_NODELAY, two packets, so the client waits for the second one. The
    ASGI app sends both in the same event-loop tick, so the head is held at most until the end
    of that tick (a ``call_soon`` flush keeps any other app's timing unchanged). Interim 1xx
    responses are never held. Everything else is delegated to the real transport.
    """

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) > 65536:
                self._transport.writelines([held, data])
            else:
                self._transport.write(held + data)
            return
        if data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 1") and data.endswith(b"\r\n\r\n"):
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        self.write(b"".join(lines))

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _invalid_http_response() -> bytes:
    """uvicorn's answer to a request it cannot parse, in OpenAI's error shape (the app never sees the request)."""
    message = "The request is not valid HTTP/1.1 (malformed request line, header, Content-Length or chunked encoding)."
    body = dumps(openai_error(400, message, code="invalid_http"))
    head = (
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    return head + body


_INVALID_HTTP = _invalid_http_response()


def nodelay_protocol() -> type[asyncio.Protocol]:
    """uvicorn's fastest available HTTP protocol class: TCP_NODELAY set on connect, head and body coalesced."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # httptools not installed: the pure-Python h11 parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]

    class NoDelayProtocol(Base):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            _set_nodelay(transport)
            super().connection_made(transport)
            self.transport = _CoalescingTransport(transport, asyncio.get_running_loop())  # type: ignore[assignment]

        def send_400_response(self, msg: str) -> None:
            # uvicorn's own answer is plain text; ``msg`` is always "Invalid HTTP request received.".
            self.transport.write(_INVALID_HTTP)
            self.transport.close()

    return NoDelayProtocol


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def make_uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "warning", **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config with our choices: uvloop when installed, TCP_NODELAY, no access log of its own."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    kwargs.setdefault("loop", loop)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=nodelay_protocol(),
        lifespan="on",
        access_log=False,
        log_level=log_level,
        server_header=False,
        proxy_headers=False,  # the proxy does not use the client address; skip uvicorn's middleware
        date_header=False,
        timeout_keep_alive=75,
        backlog=4096,
        **kwargs,
    )


class ProcessServer(uvicorn.Server):
    """The uvicorn server of a whole process: after the app's startup, the objects alive then are frozen.

    ``gc.freeze()`` moves them to a generation that collections never walk (see the module
    docstring). Only for a process that serves one app until it exits: the frozen objects stay
    for good, which is why `ServerThread` (tests, several apps per process) does not do it.
    """

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        gc.collect()
        gc.freeze()


def run_server(
    app: Any, host: str, port: int, *, log_level: str = "warning", shutdown_timeout: float | None = None
) -> None:
    """Serve ``app`` until interrupted (blocking); a stop waits at most ``shutdown_timeout`` s for requests in
    flight."""
    extra = {} if shutdown_timeout is None else {"timeout_graceful_shutdown": shutdown_timeout}
    ProcessServer(make_uvicorn_config(app, host, port, log_level=log_level, **extra)).run()


class ServerThread:
    """Run an ASGI app under uvicorn in a background thread, on a free loopback port.

    ``with ServerThread(app) as server: ... server.url ...`` waits until the server is up
    (lifespan done) and stops it on exit; ``kill()`` drops every connection at once, like
    a crashed process (for failure tests).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 15.0) -> None:
        self.app = app
        self.host = host
        self._requested_port = port
        self.port = port
        self._startup_timeout = startup_timeout
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def server(self) -> uvicorn.Server:
        assert self._server is not None, "server not started"
        return self._server

    def start(self) -> ServerThread:
        config = make_uvicorn_config(self.app, self.host, self._requested_port, loop="asyncio")
        self._server = server = uvicorn.Server(config)

        def run() -> None:
            loop = _new_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                loop.run_until_complete(server.serve())
            finally:
                # After kill() the lifespan never ran its shutdown: cancel what is left.
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()
                asyncio.set_event_loop(None)

        self._thread = threading.Thread(target=run, name=f"uvicorn-{id(self):x}", daemon=True)
        self._thread.start()
        deadline = self._startup_timeout
        step = 0.01
        while not server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup (see its log)")
            deadline -= step
            if deadline <= 0:
                self.stop()
                raise TimeoutError(f"the server did not start within {self._startup_timeout} s")
            threading.Event().wait(step)
        sockets = [s for srv in server.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1]
        return self

    def kill(self) -> None:
        """Close the listening socket and every open connection now, then stop the server."""
        server, loop = self._server, self.loop
        if server is None or loop is None or loop.is_closed():
            return

        def close_all() -> None:
            for srv in server.servers:
                srv.close()
            for conn in list(server.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            server.force_exit = True
            server.should_exit = True

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(close_all)
        self._join()

    def stop(self) -> None:
        """Graceful stop: finish requests in flight, run the lifespan shutdown."""
        if self._server is not None:
            self._server.should_exit = True
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                raise RuntimeError("the server thread did not stop within 30 s")
            self._thread = None

    def connections_nodelay(self) -> list[bool]:
        """TCP_NODELAY of every open server-side connection (for tests)."""
        out = []
        for conn in list(self.server.server_state.connections):
            transport = getattr(conn, "transport", None)
            sock = transport.get_extra_info("socket") if transport is not None else None  # delegated
            if sock is not None:
                out.append(bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        return out

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(app: Any) -> Iterator[ServerThread]:
    """``with serving(app) as server:`` — a `ServerThread` as a context manager."""
    thread = ServerThread(app).start()
    try:
        yield thread
    finally:
        thread.stop()
