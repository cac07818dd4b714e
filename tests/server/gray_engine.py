"""A fake engine for gray-failure tests: healthy on /health, /v1/models and /metrics, misbehaving on completions.

`GrayEngine(fault)` serves HTTP/1.1 (keep-alive, streams in chunked encoding) on a loopback port from its own
thread. Its `fault` may change while it runs:

- ``ok``: answers like an engine: a JSON completion, or a stream of data events ending with ``[DONE]``,
  after ``delay`` seconds;
- ``hang``: reads the request and never answers (holds the connection until the client closes it);
- ``500``: answers 500 with an OpenAI-style JSON error;
- ``cut``: sends the head and one chunk (one SSE event, or half of the JSON body), then closes;
- ``html``: answers 200 with an HTML error page (``text/html``), streamed or not;
- ``not_sse``: a stream whose first event carries no ``data:`` line;
- ``comment_first``: a good stream that starts with a comment-only event (``: keep-alive``);
- ``no_done``: a stream that ends cleanly (last chunk sent) without its ``data: [DONE]`` event.

Every completion request is counted (`completions`, with the time it arrived, and `headers`); only this object's own
thread and sockets are ever stopped.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

__all__ = ["FAULTS", "GrayEngine"]

FAULTS = ("ok", "hang", "500", "cut", "html", "not_sse", "comment_first", "no_done")
_HTML = b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>upstream sidecar</body></html>"


class GrayEngine:
    """One fake engine on ``127.0.0.1:port``; `start` it, set `fault` at will, `stop` it."""

    def __init__(self, fault: str = "ok", *, model: str = "m", delay: float = 0.0, chunks: int = 3) -> None:
        assert fault in FAULTS, fault
        self.fault = fault
        self.model = model
        self.delay = delay
        self.chunks = chunks
        self.port = 0
        #: Arrival times (monotonic) of completion requests.
        self.completions: list[float] = []
        #: The headers of each completion request (lower-cased names), in arrival order.
        self.headers: list[dict[str, str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GrayEngine:
        self._thread = threading.Thread(target=self._run, name=f"gray-engine-{self.fault}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("expected the fake engine to listen within 10 s; it did not")
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        loop.close()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        """Close the listener and every connection, and wait for their tasks to end."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:  # aborted connections end their tasks (a read fails); nothing is cancelled
            await asyncio.wait(tasks, timeout=5)
        await self._server.wait_closed()

    def count_since(self, since: float) -> int:
        """Completion requests that arrived at or after ``since`` (monotonic)."""
        return sum(1 for at in list(self.completions) if at >= since)

    # -- HTTP ------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                    self.headers.append(headers)
                if not await self._answer(method, path, body, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _answer(
        self, method: str, path: str, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection is to close."""
        if method == "GET" and path == "/health":
            return await _send(writer, 200, "application/json", b"{}")
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "gray"}]}
            return await _send(writer, 200, "application/json", json.dumps(models).encode())
        if method == "GET" and path == "/metrics":
            return await _send(writer, 200, "text/plain; version=0.0.4", b"# a fake engine\n")
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return await _send(writer, 404, "application/json", b'{"error": {"message": "not found"}}')
        self.completions.append(time.monotonic())
        try:
            request: dict[str, Any] = json.loads(body)
        except ValueError:
            return await _send(writer, 400, "application/json", b'{"error": {"message": "bad json"}}')
        stream = bool(request.get("stream"))
        fault = self.fault
        if fault == "hang":
            await reader.read()  # until the client closes
            return False
        if fault == "500":
            error = b'{"error": {"message": "internal error", "type": "server_error", "code": 500}}'
            return await _send(writer, 500, "application/json", error)
        if fault == "html":
            return await _send(writer, 200, "text/html; charset=utf-8", _HTML)
        if self.delay:
            await asyncio.sleep(self.delay)
        if not stream:
            answer = json.dumps(_completion(self.model)).encode()
            if fault == "cut":
                head = _head(200, "application/json", f"content-length: {len(answer)}\r\n")
                writer.write(head + answer[: len(answer) // 2])
                await writer.drain()
                return False
            return await _send(writer, 200, "application/json", answer)
        writer.write(_head(200, "text/event-stream", "transfer-encoding: chunked\r\ncache-control: no-cache\r\n"))
        if fault == "not_sse":
            writer.write(_chunk(b"event: ping\n\n"))
        elif fault == "comment_first":
            writer.write(_chunk(b": keep-alive\n\n"))
        events = [b"data: " + json.dumps(_delta(self.model, f"t{i} ")).encode() + b"\n\n" for i in range(self.chunks)]
        writer.write(_chunk(events[0]))
        await writer.drain()
        if fault == "cut":
            return False
        for event in events[1:]:
            writer.write(_chunk(event))
        if fault != "no_done":
            writer.write(_chunk(b"data: [DONE]\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _head(status: int, content_type: str, extra: str = "") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}[status]
    return f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n{extra}\r\n".encode("latin-1")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _send(writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes) -> bool:
    writer.write(_head(status, content_type, f"content-length: {len(body)}\r\n") + body)
    await writer.drain()
    return True


def _completion(model: str) -> dict[str, Any]:
    return {
        "id": "cmpl-gray",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }


def _delta(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-gray",
        "object": "chat.completion.chunk",
        "model": model,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
