"""Running ASGI apps under uvicorn: the CLI's blocking ``serve`` and a thread helper for tests.

uvicorn runs the process (sockets, lifespan, signals, graceful shutdown); each connection is
served by the protocol ``http`` names (`HTTP_PROTOCOLS`): ``"kvroute"``, our own protocol class
`kvroute_server.http.protocol.HttpProtocol` (TCP_NODELAY, a response head and its first body bytes
in one write, the ``kvroute.disconnect`` extension, a 400 in OpenAI's error shape for a request
that is not valid HTTP; why: docs/performance.md), or ``"httptools"``, uvicorn's stock protocol on
the same parser. The proxy works under either; ours costs less CPU per request.

A server process (`run_server`, and each worker of ``--workers N``) runs `ProcessServer`, which
freezes the garbage collector's view of everything that exists once the app has started
(``gc.freeze()``): imports, the router's tables, the tokenizer. Otherwise each full collection
walks all of those objects and holds the event loop for up to 100 ms (the proxy's p99 latency,
docs/performance.md). Objects created afterwards are collected normally, with a larger young
generation (`GC_THRESHOLDS`) because a proxy allocates many short-lived objects per request.
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

from kvroute_server.http.protocol import HttpProtocol

__all__ = ["GC_THRESHOLDS", "HTTP_PROTOCOLS", "ProcessServer", "ServerThread", "make_uvicorn_config", "run_server"]

#: The HTTP/1.1 protocols a server can run, by name: kvroute's own, or uvicorn's stock one.
HTTP_PROTOCOLS = ("kvroute", "httptools")

#: The collector's thresholds in a serving process (Python's defaults: 700, 10, 10). A proxied
#: request allocates a few hundred container objects that reference counting frees anyway; with the
#: default a young-generation collection ran every few requests and cost ~5 % of the CPU per request
#: (A/B in docs/performance.md). Cycles wait longer to be collected, which costs little memory.
GC_THRESHOLDS = (20_000, 20, 20)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _protocol(http: str) -> type[asyncio.Protocol] | str:
    """uvicorn's ``http`` setting for the protocol named ``http`` (one of `HTTP_PROTOCOLS`)."""
    if http == "kvroute":
        return HttpProtocol
    if http == "httptools":
        return "httptools"
    raise ValueError(f"'http' must be one of {', '.join(HTTP_PROTOCOLS)} (got {http!r}).")


def make_uvicorn_config(
    app: Any, host: str, port: int, *, log_level: str = "warning", http: str = "kvroute", **kwargs: Any
) -> uvicorn.Config:
    """A uvicorn config with our choices: uvloop when installed, the HTTP protocol ``http`` names (see
    `HTTP_PROTOCOLS`), no access log of its own."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    kwargs.setdefault("loop", loop)
    return uvicorn.Config(
        app,
        http=_protocol(http),
        host=host,
        port=port,
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
        gc.set_threshold(*GC_THRESHOLDS)


def run_server(
    app: Any,
    host: str,
    port: int,
    *,
    log_level: str = "warning",
    shutdown_timeout: float | None = None,
    http: str = "kvroute",
) -> None:
    """Serve ``app`` until interrupted (blocking) over the HTTP protocol ``http`` names; a stop waits at most
    ``shutdown_timeout`` s for requests in flight."""
    extra = {} if shutdown_timeout is None else {"timeout_graceful_shutdown": shutdown_timeout}
    ProcessServer(make_uvicorn_config(app, host, port, log_level=log_level, http=http, **extra)).run()


class ServerThread:
    """Run an ASGI app under uvicorn in a background thread, on a free loopback port.

    ``with ServerThread(app) as server: ... server.url ...`` waits until the server is up
    (lifespan done) and stops it on exit; ``kill()`` drops every connection at once, like
    a crashed process (for failure tests). ``http`` names the HTTP protocol (`HTTP_PROTOCOLS`).
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        startup_timeout: float = 15.0,
        http: str = "kvroute",
    ) -> None:
        _protocol(http)  # a wrong name fails here, not in the server's thread
        self.app = app
        self.http = http
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
        config = make_uvicorn_config(self.app, self.host, self._requested_port, loop="asyncio", http=self.http)
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
