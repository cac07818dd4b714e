"""A tiny OpenAI-compatible server on loopback for integration tests, one per backend.

Each `FakeBackend` answers ``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE),
``/health`` and ``/v1/models``; records every body it received; can hold requests until
the test opens its gate (to observe requests in flight); and can be told to fail.
Ports are chosen by the OS. Used by the LiteLLM, examples and template tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import attrs
from aiohttp import web

__all__ = ["FakeBackend", "eventually", "fake_backends"]


@attrs.define(eq=False)
class FakeBackend:
    """One fake engine: what it received, what it is holding, and how it answers."""

    name: str
    received: list[dict[str, Any]] = attrs.field(factory=list)
    held: int = 0
    status: int = 200
    gate: asyncio.Event = attrs.field(factory=asyncio.Event)
    port: int = 0
    _runner: web.AppRunner | None = None

    def __attrs_post_init__(self) -> None:
        self.gate.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hold(self) -> None:
        """Hold every new request until :meth:`release` (they count as held meanwhile)."""
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def prompts(self) -> list[str]:
        """The last user message (chat) or prompt (completions) of each request received."""
        out = []
        for body in self.received:
            if "messages" in body:
                out.append(str(body["messages"][-1].get("content")))
            else:
                out.append(str(body.get("prompt")))
        return out

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.held += 1
        try:
            await self.gate.wait()
        finally:
            self.held -= 1
        if self.status != 200:
            return web.json_response(
                {"error": {"message": f"{self.name} is failing on purpose", "type": "server_error"}}, status=self.status
            )
        chat = request.path.endswith("/chat/completions")
        model = body.get("model", "m")
        text = f"from {self.name}"
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for piece, finish in ((text, None), ("", "stop")):
                if chat:
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": {"content": piece} if piece else {},
                        "finish_reason": finish,
                    }
                    kind = "chat.completion.chunk"
                else:
                    choice = {"index": 0, "text": piece, "finish_reason": finish}
                    kind = "text_completion"
                chunk = {"id": "c-1", "object": kind, "created": 0, "model": model, "choices": [choice]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            return web.json_response(
                {
                    "id": "c-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        return web.json_response(
            {
                "id": "c-1",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "fake"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def fake_backends(count: int) -> AsyncIterator[list[FakeBackend]]:
    """Start ``count`` fake backends named ``b0``, ``b1``...; stop them on exit."""
    backends = [FakeBackend(f"b{i}") for i in range(count)]
    try:
        for backend in backends:
            await backend.start()
        yield backends
    finally:
        for backend in backends:
            await backend.stop()


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait until ``predicate()`` holds, polling; ``TimeoutError`` after ``within`` seconds.

    For state that other code (LiteLLM's background callbacks, a server's handlers) changes
    without offering an event to wait on.
    """
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the state itself
            await anyio.sleep(0.01)
