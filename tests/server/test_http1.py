"""kvroute's HTTP/1.1 server protocol (`kvroute_server.http.protocol`): framing, keep-alive, pipelining, disconnects.

Most tests drive `HttpProtocol` directly with a recording transport (what it writes, when it
closes); the last class runs it under uvicorn on loopback with real sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvroute_server.http.protocol import DISCONNECT_EXTENSION, INVALID_HTTP_RESPONSE, DisconnectNotice, HttpProtocol
from kvroute_server.http.runner import ServerThread

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _Transport:
    """Records writes; ``close`` reports the connection lost to the protocol, as asyncio does."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True
        self.protocol: HttpProtocol | None = None

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            assert self.protocol is not None
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name)

    @property
    def data(self) -> bytes:
        return b"".join(self.writes)


def _connect(app: App, *, keep_alive_s: float = 75.0) -> tuple[HttpProtocol, _Transport, Any]:
    config = types.SimpleNamespace(loaded_app=app, root_path="", timeout_keep_alive=keep_alive_s)
    state = types.SimpleNamespace(connections=set(), tasks=set(), total_requests=0)
    protocol = HttpProtocol(config, state, {}, asyncio.get_running_loop())
    transport = _Transport()
    transport.protocol = protocol
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport, state


async def _settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def _ok(body: bytes = b"hello", headers: list[tuple[bytes, bytes]] | None = None) -> App:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        length = [(b"content-length", str(len(body)).encode())] if headers is None else headers
        await send({"type": "http.response.start", "status": 200, "headers": length})
        await send({"type": "http.response.body", "body": body})

    return app


def _recording(seen: list[dict[str, Any]]) -> App:
    """`_ok`'s app that also keeps each scope it is given."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope)
        await _ok()(scope, receive, send)

    return app


GET = b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n"


class TestScope:
    @pytest.mark.anyio
    async def test_scope_fields(self) -> None:
        """The scope has ASGI's fields: decoded path, raw path, query, lower-case headers, addresses, extension."""
        seen: list[dict[str, Any]] = []
        protocol, _, _ = _connect(_recording(seen))
        protocol.data_received(b"GET /v1/a%20b?x=1&y=2 HTTP/1.1\r\nHost: t\r\nX-Thing: V\r\n\r\n")
        await _settle()
        scope = seen[0]
        assert scope["type"] == "http" and scope["method"] == "GET" and scope["http_version"] == "1.1"
        assert scope["path"] == "/v1/a b" and scope["raw_path"] == b"/v1/a%20b" and scope["query_string"] == b"x=1&y=2"
        assert scope["headers"] == [(b"host", b"t"), (b"x-thing", b"V")]
        assert scope["client"] == ("127.0.0.1", 5000) and scope["server"] == ("127.0.0.1", 8000)
        assert scope["scheme"] == "http" and scope["asgi"]["version"] == "3.0"
        assert isinstance(scope["extensions"][DISCONNECT_EXTENSION], DisconnectNotice)

    @pytest.mark.anyio
    async def test_absolute_form_target(self) -> None:
        """A request target in absolute form gives the path and query alone."""
        seen: list[dict[str, Any]] = []
        protocol, _, _ = _connect(_recording(seen))
        protocol.data_received(b"GET http://example.com/v1/models?a=b HTTP/1.1\r\nhost: t\r\n\r\n")
        await _settle()
        assert seen[0]["path"] == "/v1/models" and seen[0]["query_string"] == b"a=b"


class TestResponses:
    @pytest.mark.anyio
    async def test_head_and_body_in_one_write(self) -> None:
        """A response's head and its whole body leave in one write; the connection stays open."""
        protocol, transport, state = _connect(_ok())
        protocol.data_received(GET)
        await _settle()
        assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"]
        assert not transport.closed and state.total_requests == 1

    @pytest.mark.anyio
    async def test_streamed_body_is_chunked_and_head_is_not_held(self) -> None:
        """Without a Content-Length the body is chunked; a head sent alone goes out on the next loop turn."""
        release = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x")]})
            await release.wait()
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        protocol, transport, _ = _connect(app)
        protocol.data_received(GET)
        await _settle()
        assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-type: x\r\ntransfer-encoding: chunked\r\n\r\n"]
        release.set()
        await _settle()
        assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]

    @pytest.mark.anyio
    async def test_head_with_a_length_waits_for_its_body(self) -> None:
        """A head with a Content-Length is written with the body, however late the body comes."""
        release = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await release.wait()
            await send({"type": "http.response.body", "body": b"ok"})

        protocol, transport, _ = _connect(app)
        protocol.data_received(GET)
        await _settle()
        assert transport.writes == []
        release.set()
        await _settle()
        assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]

    @pytest.mark.anyio
    async def test_head_request_and_204_have_no_body(self) -> None:
        """HEAD answers carry the head only; a 204 is neither chunked nor given a body."""

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            status = 204 if scope["path"] == "/empty" else 200
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"5")]})
            await send({"type": "http.response.body", "body": b"hello" if status == 200 else b""})

        protocol, transport, _ = _connect(app)
        protocol.data_received(b"HEAD /a HTTP/1.1\r\nhost: t\r\n\r\n")
        await _settle()
        protocol.data_received(b"GET /empty HTTP/1.1\r\nhost: t\r\n\r\n")
        await _settle()
        assert transport.writes == [
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
        ]

    @pytest.mark.anyio
    async def test_connection_close_and_http_1_0(self) -> None:
        """``Connection: close`` from the client, and HTTP/1.0, close the connection after the response."""
        for request in (b"GET /a HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n", b"GET /a HTTP/1.0\r\n\r\n"):
            protocol, transport, _ = _connect(_ok())
            protocol.data_received(request)
            await _settle()
            assert transport.data.startswith(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\n")
            assert transport.closed

    @pytest.mark.anyio
    async def test_app_failures(self) -> None:
        """An app that raises before responding gets a 500 JSON answer; a header with CR/LF is refused."""

        async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["path"] == "/inject":
                await send({"type": "http.response.start", "status": 200, "headers": [(b"x", b"a\r\nb: c")]})
            raise ValueError("bug")

        for path in (b"/boom", b"/inject"):
            protocol, transport, _ = _connect(broken)
            protocol.data_received(b"GET " + path + b" HTTP/1.1\r\nhost: t\r\n\r\n")
            await _settle()
            head, _, body = transport.data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 500 ") and json.loads(body)["error"]["code"] == "internal_error"
            assert transport.closed

    @pytest.mark.anyio
    async def test_content_length_mismatch_is_an_app_error(self) -> None:
        """Sending more bytes than the declared Content-Length is refused and the connection closes."""
        protocol, transport, _ = _connect(_ok(b"too long", [(b"content-length", b"3")]))
        protocol.data_received(GET)
        await _settle()
        assert transport.writes == [] and transport.closed


class TestRequests:
    @pytest.mark.anyio
    async def test_body_as_it_arrives_then_disconnect_after_response(self) -> None:
        """A chunked body reaches the app piece by piece; after the response, receive() says disconnect."""
        messages: list[dict[str, Any]] = []
        got_first = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            while True:
                message = await receive()
                messages.append(message)
                got_first.set()
                if not message["more_body"]:
                    break
            await _ok(b"")(scope, _empty, send)
            messages.append(await receive())

        protocol, _, _ = _connect(app)
        protocol.data_received(b"POST /a HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await got_first.wait()
        protocol.data_received(b"2\r\nde\r\n0\r\n\r\n")
        await _settle()
        assert b"".join(m.get("body", b"") for m in messages) == b"abcde"
        assert messages[0] == {"type": "http.request", "body": b"abc", "more_body": True}
        assert messages[-2]["more_body"] is False and messages[-1] == {"type": "http.disconnect"}

    @pytest.mark.anyio
    async def test_expect_100_continue(self) -> None:
        """``Expect: 100-continue`` is answered when the app first reads the body, not before."""
        protocol, transport, _ = _connect(_ok())
        protocol.data_received(b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
        await _settle()
        assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        protocol.data_received(b"{}")
        await _settle()
        assert transport.writes[1].startswith(b"HTTP/1.1 200 OK")

    @pytest.mark.anyio
    async def test_pipelined_requests_are_answered_in_order(self) -> None:
        """Two requests in one read are answered one after the other, in order."""
        order: list[str] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()
            if scope["path"] == "/slow":
                await asyncio.sleep(0.01)
            order.append(scope["path"])
            body = scope["path"].encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
            )
            await send({"type": "http.response.body", "body": body})

        protocol, transport, _ = _connect(app)
        protocol.data_received(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\nGET /fast HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.sleep(0.05)
        assert order == ["/slow", "/fast"]
        assert transport.data.index(b"/slow") < transport.data.index(b"/fast")

    @pytest.mark.anyio
    async def test_large_body_pauses_reading_until_the_app_reads(self) -> None:
        """More than 64 KiB of unread body pauses the socket; the app's receive() resumes it."""
        start = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await start.wait()
            while (await receive())["more_body"]:
                pass
            await _ok()(scope, _empty, send)

        protocol, transport, _ = _connect(app)
        protocol.data_received(b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 200000\r\n\r\n" + b"x" * 70000)
        await _settle()
        assert transport.reading is False
        start.set()
        await _settle()
        assert transport.reading is True
        protocol.data_received(b"x" * 130000)
        await _settle()
        assert transport.data.startswith(b"HTTP/1.1 200 OK")

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("request_bytes", "status", "code"),
        [
            (b"GET /a HTTP/1.1\r\nbad header\r\n\r\n", 400, "invalid_http"),
            (b"GET /a HTTP/1.1\r\nx: " + b"y" * 70000 + b"\r\n\r\n", 431, "request_header_too_large"),
        ],
        ids=["malformed", "huge-head"],
    )
    async def test_unparsable_requests(self, request_bytes: bytes, status: int, code: str) -> None:
        """Bytes that are not a servable request get an OpenAI-style error and the connection closes."""
        protocol, transport, _ = _connect(_ok())
        protocol.data_received(request_bytes)
        await _settle()
        head, _, body = transport.data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status) and json.loads(body)["error"]["code"] == code
        assert transport.closed
        assert INVALID_HTTP_RESPONSE.startswith(b"HTTP/1.1 400 ")


class TestConnection:
    @pytest.mark.anyio
    async def test_disconnect_calls_the_apps_callback(self) -> None:
        """A client leaving mid-request calls the registered callback once and receive() says disconnect."""
        called: list[bool] = []
        messages: list[dict[str, Any]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            notice = scope["extensions"][DISCONNECT_EXTENSION]
            notice.callback = lambda: called.append(notice.gone)
            await receive()
            messages.append(await receive())

        protocol, _, _ = _connect(app)
        protocol.data_received(GET)
        await _settle()
        protocol.connection_lost(None)
        await _settle()
        assert called == [True] and messages == [{"type": "http.disconnect"}]

    @pytest.mark.anyio
    async def test_idle_connection_closes_after_keep_alive(self) -> None:
        """A connection idle for ``timeout_keep_alive`` seconds closes; a busy one does not."""
        protocol, transport, _ = _connect(_ok(), keep_alive_s=0.05)
        protocol.data_received(GET)
        await _settle()
        assert not transport.closed
        await asyncio.sleep(0.2)
        assert transport.closed

    @pytest.mark.anyio
    async def test_a_request_head_left_unfinished_is_closed(self) -> None:
        """Half a request head does not keep a connection: it closes ``timeout_keep_alive`` after the last answer."""
        protocol, transport, _ = _connect(_ok(), keep_alive_s=0.05)
        protocol.data_received(b"GET /a HTTP/1.1\r\nhost: t\r\nx-slow: ")
        await asyncio.sleep(0.2)
        assert transport.closed and transport.writes == []

    @pytest.mark.anyio
    async def test_shutdown(self) -> None:
        """shutdown() closes an idle connection at once and a busy one after its response."""
        release = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await release.wait()
            await _ok()(scope, receive, send)

        idle, idle_transport, _ = _connect(app)
        idle.shutdown()
        assert idle_transport.closed
        busy, busy_transport, _ = _connect(app)
        busy.data_received(GET)
        await _settle()
        busy.shutdown()
        assert not busy_transport.closed
        release.set()
        await _settle()
        assert busy_transport.data.startswith(b"HTTP/1.1 200 OK") and busy_transport.closed


async def _empty() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


class TestOverSockets:
    def test_keep_alive_pipelining_and_nodelay(self) -> None:
        """Under uvicorn on loopback: pipelined requests on one connection, answered in order, TCP_NODELAY set."""

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            await receive()
            body = scope["path"].encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
            )
            await send({"type": "http.response.body", "body": body})

        with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"GET /one HTTP/1.1\r\nhost: t\r\n\r\nGET /two HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
            )
            reply = b""
            while data := sock.recv(65536):
                reply += data
            assert reply.count(b"HTTP/1.1 200 OK") == 2 and reply.index(b"/one") < reply.index(b"/two")
            assert server.connections_nodelay() in ([], [True])
