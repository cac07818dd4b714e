"""A server that replays TensorRT-LLM's answers (fixtures/, written as the engine's serializers write them),
and its client.

``trtllm-serve`` has no CPU build, so the adapter is tested against this: ``GET /metrics`` and
``POST /kv_cache_events`` pop the next answer of their fixture sequence (then answer ``[]``, as
a drained buffer does), ``GET /health`` answers ``health_status`` (503 "LLM is unavailable"
when set so), ``/prometheus/metrics`` exists only when ``prometheus`` is set.

``metrics_hold`` / ``events_hold`` make a call hold its answer that many seconds after taking
it from the buffer, as trtllm-serve does while iterations or events keep coming (its loop ends
only after two seconds without a new item): a client that gives up meanwhile loses the answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import pytest
from aiohttp import web

from kvroute.adapters import HttpReply

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture(name: str) -> Any:
    text = (FIXTURES / name).read_text(encoding="utf-8")
    return json.loads(text) if name.endswith(".json") else text


class ReplayServer:
    """The state behind the replaying app (tests change it between calls)."""

    def __init__(self) -> None:
        self.metrics: list[Any] = fixture("metrics_sequence.json")
        self.events: list[Any] = fixture("kv_cache_events_sequence.json")
        self.prometheus: str | None = None
        self.health_status = 200
        self.events_status = 200
        self.metrics_hold = 0.0
        self.events_hold = 0.0
        self.calls: list[str] = []
        #: Answers taken from a buffer and then lost because the client hung up before the answer was written.
        self.lost: list[Any] = []
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/prometheus/metrics", self._prometheus)
        app.router.add_post("/kv_cache_events", self._events)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        self.calls.append("health")
        if self.health_status == 503:
            return web.Response(status=503, text="LLM is unavailable")
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(fixture("models.json"))

    async def _held(self, request: web.Request, answer: Any, hold: float) -> None:
        if hold:
            try:
                await asyncio.sleep(hold)
            except asyncio.CancelledError:
                self.lost.append(answer)
                raise
            transport = request.transport
            if transport is None or transport.is_closing():
                self.lost.append(answer)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.calls.append("metrics")
        answer = self.metrics.pop(0) if self.metrics else []
        await self._held(request, answer, self.metrics_hold)
        return web.json_response(answer)

    async def _prometheus(self, request: web.Request) -> web.Response:
        self.calls.append("prometheus")
        if self.prometheus is None:
            return web.Response(status=404, text='{"detail":"Not Found"}')
        return web.Response(text=self.prometheus, content_type="text/plain")

    async def _events(self, request: web.Request) -> web.Response:
        self.calls.append("kv_cache_events")
        if self.events_status != 200:
            return web.Response(status=self.events_status)
        answer = self.events.pop(0) if self.events else []
        await self._held(request, answer, self.events_hold)
        # Written as trtllm-serve writes JSON: Python's json, big integers as they are.
        return web.Response(text=json.dumps(answer), content_type="application/json")


@attrs.frozen
class Client:
    """An `HttpClient` (get and post) for one base URL over aiohttp, with a total timeout per call (as the proxy's)."""

    session: aiohttp.ClientSession
    base: str
    timeout: float = 10.0

    async def get(self, path: str) -> HttpReply:
        async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
            return HttpReply(r.status, await r.read())

    async def post(self, path: str, body: object) -> HttpReply:
        async with self.session.post(
            self.base + path, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout)
        ) as r:
            return HttpReply(r.status, await r.read())


@pytest.fixture
def anyio_backend() -> str:
    """The proxy's event loop: asyncio (aiohttp needs it)."""
    return "asyncio"


@pytest.fixture
async def trtllm() -> AsyncIterator[tuple[ReplayServer, Client]]:
    """A replaying server on a free loopback port and a client bound to it."""
    server = ReplayServer()
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    server.url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        yield server, Client(session, server.url)
    await runner.cleanup()
