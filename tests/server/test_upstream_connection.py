"""The upstream client's connection on an in-memory transport: the request head it writes, read back-pressure."""

from __future__ import annotations

import pytest

from kvroute_server.http.client import UpstreamPool, _Connection

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class MemoryTransport:
    """Records what the connection writes and whether it paused reading; answers each write with ``answer``."""

    def __init__(self, answer: bytes = OK) -> None:
        self.answer = answer
        self.written = b""
        self.paused = False
        self.protocol: _Connection | None = None

    def write(self, data: bytes) -> None:
        self.written += data
        if self.answer and self.protocol is not None:
            self.protocol.data_received(self.answer)

    def writelines(self, parts: list[bytes]) -> None:
        self.write(b"".join(parts))

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        pass


def pooled(pool: UpstreamPool, url: str, transport: MemoryTransport) -> _Connection:
    """An idle connection to ``url`` over ``transport``, put in ``pool`` for the next request."""
    host = pool._target(url).pool
    conn = _Connection(host)
    transport.protocol = conn
    conn.connection_made(transport)  # type: ignore[arg-type]
    host.put(conn)
    return conn


@pytest.mark.anyio
class TestRequestHead:
    async def test_head_bytes(self) -> None:
        """The head is the request line under the base path, Host, Content-Length, then the headers in order."""
        pool, transport = UpstreamPool(1.0), MemoryTransport()
        pooled(pool, "http://127.0.0.1:9/base/", transport)
        response = await pool.post("http://127.0.0.1:9/base/", "/v1/x?a=1", b"0123456789" * 1000, {"b": "2", "a": "1"})
        response.release()
        assert transport.written == (
            b"POST /base/v1/x?a=1 HTTP/1.1\r\nhost: 127.0.0.1:9\r\ncontent-length: 10000\r\nb: 2\r\na: 1\r\n\r\n"
            + b"0123456789" * 1000
        )

    async def test_non_ascii_path_and_host(self) -> None:
        """A non-ASCII path is percent-encoded, a non-ASCII host IDNA-encoded; Latin-1 header values pass as such."""
        pool, transport = UpstreamPool(1.0), MemoryTransport()
        pooled(pool, "http://bücher.example:8080", transport)
        response = await pool.post("http://bücher.example:8080", "/v1/x?q=é", b"", {"x-v": "caf\xe9"})
        response.release()
        assert transport.written == (
            b"POST /v1/x?q=%C3%A9 HTTP/1.1\r\nhost: xn--bcher-kva.example:8080\r\ncontent-length: 0\r\n"
            b"x-v: caf\xe9\r\n\r\n"
        )

    async def test_value_outside_latin1_refused_before_writing(self) -> None:
        """A header value that Latin-1 cannot encode is refused, and nothing is written."""
        pool, transport = UpstreamPool(1.0), MemoryTransport()
        pooled(pool, "http://127.0.0.1:9", transport)
        with pytest.raises(UnicodeEncodeError):
            await pool.post("http://127.0.0.1:9", "/", b"x", {"authorization": "Bearer \u20ac"})
        assert transport.written == b""


@pytest.mark.anyio
class TestReadBackPressure:
    async def test_pauses_above_the_high_water_mark_and_resumes_once_read(self) -> None:
        """Reading pauses when more than 256 KiB wait unread, resumes once read, and counts afresh after a read."""
        pool, transport = UpstreamPool(1.0), MemoryTransport(answer=b"")
        conn = pooled(pool, "http://127.0.0.1:9", transport)
        head = conn.request(b"POST / HTTP/1.1\r\n\r\n", b"")
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 500000\r\n\r\n" + b"a" * 200_000)
        response = head.result()
        assert not transport.paused
        conn.data_received(b"a" * 100_000)
        assert transport.paused
        assert len(await response.readany()) == 300_000
        assert not transport.paused
        conn.data_received(b"a" * 100_000)
        assert not transport.paused, "200 KB read before must not count towards the next pause"
        assert len(await response.readany()) == 100_000
        conn.data_received(b"a" * 100_000)
        assert len(await response.readany()) == 100_000
        assert response.at_eof()
        response.release()
        assert pool._target("http://127.0.0.1:9").pool.idle[-1] is conn, "a whole answer leaves its connection pooled"
