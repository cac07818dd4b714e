"""Loopback servers for the proxy tests: emulators and proxies in threads, stopped by the owner.

``KVROUTE_TEST_HTTP=httptools pytest tests/server`` runs every proxy the harness starts on uvicorn's
stock HTTP protocol instead of kvroute's own (a test that names a protocol keeps its own).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread
from kvroute_simulator.emulator import EmulatorApp, EmulatorConfig

MODEL = "m"
#: Fast emulators: a simulated second lasts 20 ms.
TIME_SCALE = 0.02
#: The HTTP protocol of the proxies the harness starts (`kvroute_server.http.runner.HTTP_PROTOCOLS`).
PROXY_HTTP = os.environ.get("KVROUTE_TEST_HTTP", "kvroute")


class Servers:
    """Starts emulators and proxies in threads and stops every one of them at teardown."""

    def __init__(self) -> None:
        self.started: list[ServerThread] = []

    def emulator(self, **config: Any) -> ServerThread:
        config.setdefault("model", MODEL)
        config.setdefault("time_scale", TIME_SCALE)
        config.setdefault("num_gpu_blocks", 4096)
        server = ServerThread(EmulatorApp(EmulatorConfig(**config))).start()
        self.started.append(server)
        return server

    def emulators(self, count: int, **config: Any) -> list[ServerThread]:
        return [self.emulator(**config) for _ in range(count)]

    def proxy(
        self, backends: list[ServerThread] | None = None, *, http: str | None = None, **config: Any
    ) -> ServerThread:
        """A proxy in front of ``backends``; ``http`` names its HTTP protocol (default: `PROXY_HTTP`)."""
        if backends is not None:
            config["backends"] = tuple(BackendConfig(id=f"e{i}", url=b.url) for i, b in enumerate(backends))
        config.setdefault("health", HealthConfig(interval=0.2, timeout=1.0, unhealthy_threshold=2, healthy_threshold=1))
        config.setdefault("access_log", False)
        config.setdefault("strategy", "least-outstanding")
        if config["strategy"] in ("least-outstanding", "random"):
            config.setdefault("options", {"seed": 0})  # deterministic tie-breaks
        server = ServerThread(ProxyApp(ServerConfig(**config)), http=http or PROXY_HTTP).start()
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in reversed(self.started):
            server.stop()
        self.started.clear()


def in_loop(server: ServerThread, function: Any, *args: Any) -> Any:
    """Call ``function(*args)`` inside a task on the server's event loop (as the admin API does)."""
    import asyncio

    async def call() -> Any:
        return function(*args)

    assert server.loop is not None
    return asyncio.run_coroutine_threadsafe(call(), server.loop).result(timeout=10)


def http(
    method: str,
    url: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """A small blocking HTTP call: returns (status, lower-case headers, body)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def chat_body(text: str, *, max_tokens: int = 4, stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    """A chat request body with one user message."""
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
