"""The uvicorn glue: response head coalescing and the thread runner."""

from __future__ import annotations

import asyncio

import pytest

from kvroute_server.runner import ServerThread, _CoalescingTransport
from tests.server.harness import http


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, lines: list[bytes]) -> None:
        self.writes.append(b"".join(lines))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


class TestCoalescingTransport:
    @pytest.mark.anyio
    async def test_head_and_first_body_leave_in_one_write(self) -> None:
        """A response head is held and written together with the first body bytes."""
        raw = _Recorder()
        transport = _CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        transport.write(HEAD)
        assert raw.writes == []
        transport.write(b"data: 1\n\n")
        transport.write(b"data: 2\n\n")
        assert raw.writes == [HEAD + b"data: 1\n\n", b"data: 2\n\n"]

    @pytest.mark.anyio
    async def test_held_head_is_flushed_by_the_next_loop_tick(self) -> None:
        """An app that sends only the head still gets it out on the next event-loop iteration."""
        raw = _Recorder()
        transport = _CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        transport.write(HEAD)
        await asyncio.sleep(0)
        assert raw.writes == [HEAD]

    @pytest.mark.anyio
    async def test_interim_responses_and_close(self) -> None:
        """1xx heads are never held; close() flushes a held head first; other calls are delegated."""
        raw = _Recorder()
        transport = _CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert raw.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        transport.write(HEAD)
        transport.close()
        assert raw.writes[-1] == HEAD and raw.closed
        assert transport.get_extra_info("socket") == "info:socket"


class TestServerThread:
    def test_start_serve_stop(self) -> None:
        """A ServerThread serves an ASGI app on a free port and stops on exit."""

        async def app(scope: dict[str, object], receive: object, send: object) -> None:
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 204, "headers": []})  # type: ignore[operator]
            await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

        with ServerThread(app) as server:
            assert server.port > 0
            assert http("GET", server.url + "/")[0] == 204
        with pytest.raises(OSError):
            http("GET", server.url + "/", timeout=2)
