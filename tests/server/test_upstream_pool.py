"""The proxied requests' HTTP/1.1 client (`UpstreamPool`) against scripted loopback backends."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from kvroute_server.http.client import UpstreamConnectionError, UpstreamPool, UpstreamResponse

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Backend"], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Backend:
    """A loopback server that answers each request on each connection with ``handler``; records what it got."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.client_left = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer, self)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_left.set()
        finally:
            writer.close()


async def read_all(response: UpstreamResponse) -> bytes:
    parts = []
    while chunk := await response.readany():
        parts.append(chunk)
    return b"".join(parts)


@pytest.fixture
async def backend_factory() -> AsyncIterator[Callable[[Handler], Awaitable[Backend]]]:
    started: list[asyncio.Server] = []

    async def start(handler: Handler) -> Backend:
        backend = Backend(handler)
        backend.server = await asyncio.start_server(backend._serve, "127.0.0.1", 0)
        started.append(backend.server)
        return backend

    yield start
    for server in started:
        server.close()


async def answer(data: bytes) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
        writer.write(data)
        await writer.drain()

    return handler


@pytest.mark.anyio
class TestUpstreamPool:
    async def test_request_bytes(self, backend_factory: Callable[[Handler], Awaitable[Backend]]) -> None:
        """The backend gets the request line under the URL's base path, Host, Content-Length, headers and body."""
        backend = await backend_factory(await answer(OK))
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url + "/base", "/v1/chat/completions?x=1", b'{"a":1}', {"x-custom": "v"})
        assert (response.status, response.content_type, await read_all(response)) == (200, "application/json", b"{}")
        response.release()
        host = backend.url.removeprefix("http://").encode()
        assert backend.requests == [
            b"POST /base/v1/chat/completions?x=1 HTTP/1.1\r\nhost: " + host + b"\r\ncontent-length: 7\r\n"
            b"x-custom: v\r\n\r\n" + b'{"a":1}'
        ]
        pool.close()

    async def test_keep_alive_reuses_the_connection(
        self, backend_factory: Callable[[Handler], Awaitable[Backend]]
    ) -> None:
        """A fully read and released answer leaves its connection for the next request."""
        backend = await backend_factory(await answer(OK))
        pool = UpstreamPool(5.0)
        for _ in range(3):
            response = await pool.post(backend.url, "/", b"x", {})
            assert await read_all(response) == b"{}"
            response.release()
        assert (backend.connections, len(backend.requests)) == (1, 3)
        pool.close()

    async def test_connection_close_is_not_reused(
        self, backend_factory: Callable[[Handler], Awaitable[Backend]]
    ) -> None:
        """An answer with ``Connection: close`` closes its connection; the next request opens another."""
        closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
        backend = await backend_factory(await answer(closing))
        pool = UpstreamPool(5.0)
        for _ in range(2):
            response = await pool.post(backend.url, "/", b"x", {})
            assert await read_all(response) == b"{}"
            response.release()
        assert backend.connections == 2
        pool.close()

    async def test_chunks_arrive_as_sent(self, backend_factory: Callable[[Handler], Awaitable[Backend]]) -> None:
        """A chunked answer is handed over chunk by chunk, before the backend has sent the rest."""
        go_on = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n")
            writer.write(b"transfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")
            await writer.drain()
            await go_on.wait()
            writer.write(b"3\r\n1\n\n\r\n0\r\n\r\n")
            await writer.drain()

        backend = await backend_factory(handler)
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url, "/", b"x", {})
        assert response.content_type == "text/event-stream"
        assert await asyncio.wait_for(response.readany(), 5) == b"data: "
        assert not response.at_eof()
        go_on.set()
        assert await read_all(response) == b"1\n\n"
        assert response.at_eof()
        response.release()
        pool.close()

    async def test_deadlines(self, backend_factory: Callable[[Handler], Awaitable[Backend]]) -> None:
        """A head or body bytes not there by the deadline raise TimeoutError; bytes already there never time out."""
        go_on = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
            if len(backend.requests) == 1:
                await go_on.wait()  # the first request: no head until released
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n")
            await writer.drain()
            await go_on.wait()

        backend = await backend_factory(handler)
        pool = UpstreamPool(5.0)
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await pool.post(backend.url, "/", b"x", {}, loop.time() + 0.05)
        response = await pool.post(backend.url, "/", b"x", {}, loop.time() + 5)
        await asyncio.sleep(0.05)
        assert await response.readany(loop.time() - 1) == b"ab"  # buffered: the passed deadline does not matter
        started = loop.time()
        with pytest.raises(TimeoutError):
            await response.readany(loop.time() + 0.05)
        assert 0.04 < loop.time() - started < 2
        response.close()
        go_on.set()
        assert backend.connections == 2  # the timed-out connection was not reused
        pool.close()

    async def test_body_ended_by_close(self, backend_factory: Callable[[Handler], Awaitable[Backend]]) -> None:
        """An answer with neither Content-Length nor chunking ends, whole, when the backend closes."""

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
            await writer.drain()
            writer.close()

        backend = await backend_factory(handler)
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url, "/", b"x", {})
        assert await read_all(response) == b"all of it"
        assert response.at_eof()
        response.release()
        pool.close()

    async def test_cut_short_body_is_a_connection_error(
        self, backend_factory: Callable[[Handler], Awaitable[Backend]]
    ) -> None:
        """A backend closing before its Content-Length is met: the bytes so far, then an UpstreamConnectionError."""

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
            await writer.drain()
            writer.close()

        backend = await backend_factory(handler)
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url, "/", b"x", {})
        assert await response.readany() == b"only ten b"
        with pytest.raises(UpstreamConnectionError, match="closed before the answer ended"):
            await response.readany()
        assert not response.at_eof()
        response.close()
        pool.close()

    async def test_refused_connection(self) -> None:
        """Nothing listening: an UpstreamConnectionError (a ConnectionError, not a TimeoutError)."""
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        pool = UpstreamPool(5.0)
        with pytest.raises(UpstreamConnectionError, match="cannot connect") as caught:
            await pool.post(f"http://127.0.0.1:{port}", "/", b"x", {})
        assert not isinstance(caught.value, TimeoutError)

    async def test_not_http_is_a_connection_error(
        self, backend_factory: Callable[[Handler], Awaitable[Backend]]
    ) -> None:
        """An answer that is not HTTP/1.x fails the request with an UpstreamConnectionError."""
        backend = await backend_factory(await answer(b"SSH-2.0-OpenSSH\r\n\r\n"))
        pool = UpstreamPool(5.0)
        with pytest.raises(UpstreamConnectionError, match="not valid HTTP"):
            await pool.post(backend.url, "/", b"x", {})
        pool.close()

    async def test_idle_connection_closed_by_backend(
        self, backend_factory: Callable[[Handler], Awaitable[Backend]]
    ) -> None:
        """A pooled connection the backend closed meanwhile is dropped; the next request opens a new one."""
        closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
            writer.write(OK)
            await writer.drain()
            writer.close()  # after a keep-alive answer: the backend's idle timeout, early
            closed.set()

        backend = await backend_factory(handler)
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url, "/", b"x", {})
        assert await read_all(response) == b"{}"
        response.release()
        await asyncio.wait_for(closed.wait(), 5)
        await asyncio.sleep(0.05)  # the client side sees the FIN
        response = await pool.post(backend.url, "/", b"x", {})
        assert await read_all(response) == b"{}"
        response.release()
        assert backend.connections == 2
        pool.close()

    async def test_close_mid_answer_reaches_the_backend(
        self, backend_factory: Callable[[Handler], Awaitable[Backend]]
    ) -> None:
        """Closing a response before its end closes the connection: the backend sees its client leave."""

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: Backend) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
            await writer.drain()
            await reader.read(1)  # b"" once the client closed

        backend = await backend_factory(handler)
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url, "/", b"x", {})
        assert await response.readany() == b"a"
        response.close()
        await asyncio.wait_for(backend.client_left.wait(), 5)
        pool.close()

    async def test_interim_answer_skipped(self, backend_factory: Callable[[Handler], Awaitable[Backend]]) -> None:
        """A 1xx interim answer is skipped: the caller gets the final status and its headers only."""
        backend = await backend_factory(await answer(b"HTTP/1.1 100 Continue\r\nx-interim: 1\r\n\r\n" + OK))
        pool = UpstreamPool(5.0)
        response = await pool.post(backend.url, "/", b"x", {})
        assert response.status == 200
        assert [name for name, _ in response.raw_headers] == [b"content-type", b"content-length"]
        assert await read_all(response) == b"{}"
        response.release()
        pool.close()

    async def test_line_break_in_a_header_refused(self) -> None:
        """A header value with a line break is refused before anything is sent (no request smuggling)."""
        pool = UpstreamPool(5.0)
        with pytest.raises(ValueError, match="line break"):
            await pool.post("http://127.0.0.1:9", "/", b"x", {"x-a": "1\r\nx-b: 2"})


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.anyio
class TestUpstreamPoolTls:
    async def _tls_backend(self, cert: Path, key: Path) -> tuple[asyncio.Server, str]:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        backend = Backend(await answer(OK))
        server = await asyncio.start_server(backend._serve, "127.0.0.1", 0, ssl=context)
        return server, f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def test_https_backend_over_tls(
        self, self_signed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An https:// backend is spoken to over TLS, its certificate checked against the trusted ones."""
        monkeypatch.setenv("SSL_CERT_FILE", str(self_signed[0]))  # trust the test certificate
        server, url = await self._tls_backend(*self_signed)
        pool = UpstreamPool(5.0)
        try:
            response = await pool.post(url, "/", b"x", {})
            assert (response.status, await read_all(response)) == (200, b"{}")
            response.release()
        finally:
            pool.close()
            server.close()

    async def test_untrusted_certificate_refused(self, self_signed: tuple[Path, Path]) -> None:
        """A backend whose certificate is not trusted is a connection failure, not a plaintext fallback."""
        server, url = await self._tls_backend(*self_signed)
        pool = UpstreamPool(5.0)
        try:
            with pytest.raises(UpstreamConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await pool.post(url, "/", b"x", {})
        finally:
            pool.close()
            server.close()
