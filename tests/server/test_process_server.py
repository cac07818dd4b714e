"""`ProcessServer`, the uvicorn server of a whole ``kvroute serve`` process, and the HTTP protocol it runs."""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import time
from typing import Any

import pytest

from kvroute.errors import ConfigError
from kvroute_server import BackendConfig, ServerConfig
from kvroute_server.http.protocol import INVALID_HTTP_RESPONSE, HttpProtocol
from kvroute_server.http.runner import GC_THRESHOLDS, ProcessServer, ServerThread, make_uvicorn_config
from kvroute_server.ops.workers import Supervisor


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """A minimal ASGI app with a lifespan that leaves an object graph behind at startup."""
    if scope["type"] == "lifespan":
        await receive()
        scope.setdefault("state", {})["tables"] = [{"block": i} for i in range(1000)]
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})


class TestProcessServer:
    @pytest.mark.anyio
    async def test_objects_alive_after_startup_are_frozen(self) -> None:
        """Once the app has started, the objects then alive are out of the collector's walks (gc.freeze) and the
        young generation is larger."""
        assert gc.get_freeze_count() == 0
        defaults = gc.get_threshold()
        server = ProcessServer(make_uvicorn_config(_app, "127.0.0.1", 0, loop="asyncio"))
        task = asyncio.create_task(server.serve())
        try:
            for _ in range(500):
                if server.started:
                    break
                await asyncio.sleep(0.01)
            assert server.started
            assert gc.get_freeze_count() > 1000
            assert gc.get_threshold() == GC_THRESHOLDS
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            gc.unfreeze()
            gc.set_threshold(*defaults)


#: What uvicorn's own protocol answers to bytes that are not HTTP (kvroute's is `INVALID_HTTP_RESPONSE`).
UVICORN_400 = b"Invalid HTTP request received."


def _bad_request(port: int) -> bytes:
    """Everything a server sends back to a request line that is not HTTP, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET\r\n\r\n")
        reply = b""
        while data := sock.recv(65536):
            reply += data
    return reply


class TestHttpChoice:
    def test_kvroute_is_the_default(self) -> None:
        """Without a choice, uvicorn runs kvroute's own protocol class."""
        assert make_uvicorn_config(_app, "127.0.0.1", 0).http is HttpProtocol

    def test_httptools_is_uvicorns_protocol(self) -> None:
        """``http="httptools"`` hands uvicorn the name of its stock protocol."""
        assert make_uvicorn_config(_app, "127.0.0.1", 0, http="httptools").http == "httptools"

    @pytest.mark.parametrize("name", ["h11", "auto", "HttpProtocol", ""])
    def test_other_names_are_refused(self, name: str) -> None:
        """A name that is neither protocol is refused, saying what was expected and what was got."""
        message = f"'http' must be one of kvroute, httptools (got {name!r})."
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            make_uvicorn_config(_app, "127.0.0.1", 0, http=name)
        with pytest.raises(ValueError, match="must be one of"):
            ServerThread(_app, http=name)

    @pytest.mark.parametrize("http, answer", [("kvroute", INVALID_HTTP_RESPONSE), ("httptools", UVICORN_400)])
    def test_server_thread_serves_with_the_named_protocol(self, http: str, answer: bytes) -> None:
        """A `ServerThread` serves with the protocol it names (told apart by their answers to bytes that are not
        HTTP)."""
        with ServerThread(_app, http=http) as server:
            assert _bad_request(server.port).endswith(answer)


class TestSupervisorHttp:
    def test_other_names_are_refused(self) -> None:
        """A supervisor is refused a protocol name that is neither, before any worker starts."""
        config = ServerConfig(backends=(BackendConfig(id="e0", url="http://127.0.0.1:9"),), workers=2)
        with pytest.raises(ConfigError, match=re.escape("'http' must be one of kvroute, httptools (got 'h11').")):
            Supervisor(config, http="h11")

    @pytest.mark.parametrize("http, answer", [("kvroute", INVALID_HTTP_RESPONSE), ("httptools", UVICORN_400)])
    def test_workers_serve_with_the_named_protocol(self, http: str, answer: bytes) -> None:
        """Every ``--workers`` process serves with the protocol the supervisor was given."""
        config = ServerConfig(
            backends=(BackendConfig(id="e0", url="http://127.0.0.1:9"),), port=0, workers=1, shutdown_timeout=1.0
        )
        supervisor = Supervisor(config, log_level="error", http=http)
        supervisor.start()
        try:
            deadline = time.monotonic() + 30
            reply = b""
            while time.monotonic() < deadline:
                supervisor.check()
                try:
                    reply = _bad_request(supervisor.address[1])
                except OSError:
                    reply = b""
                if reply:
                    break
                time.sleep(0.1)
            assert reply.endswith(answer), reply
        finally:
            supervisor.stop()
