"""The HTTP client the backend adapters use: health probes, telemetry polls, KV events, parity checks.

An aiohttp session (`create_session`) shared by the backend set, and `BackendHttp`, one
backend's `kvroute.adapters.HttpClient` on it. These calls are few and convenience counts more
than microseconds here; the proxied requests themselves go through
`kvroute_server.http.client.UpstreamPool`. aiohttp was chosen over httpx after measuring
streaming pass-through (benchmarks/bench_http_clients.py, figures in docs/performance.md).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any

import aiohttp
import attrs

from kvroute.adapters import HttpReply

__all__ = ["BackendHttp", "create_session"]


def _nodelay_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """Socket factory for aiohttp: TCP_NODELAY before connecting (aiohttp also sets it later)."""
    family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family=family, type=type_, proto=proto)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def create_session(connect_timeout: float, *, pool_limit: int = 0, keepalive_s: float = 60.0) -> aiohttp.ClientSession:
    """The shared upstream session: unlimited keep-alive pool, no auto-decompression, no cookies."""
    connector = aiohttp.TCPConnector(
        limit=pool_limit, keepalive_timeout=keepalive_s, ttl_dns_cache=60, socket_factory=_nodelay_socket
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, connect=None, sock_read=None),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
        raise_for_status=False,
    )


@attrs.define
class BackendHttp:
    """`kvroute.adapters.HttpClient` for one backend: health probes, telemetry polls, KV events, parity."""

    session: aiohttp.ClientSession
    base_url: str
    timeout: float
    headers: Mapping[str, str] = attrs.field(factory=dict)

    async def get(self, path: str) -> HttpReply:
        return await self._call("GET", path, None)

    def with_timeout(self, seconds: float) -> BackendHttp:
        """The same client with another per-call timeout (for engine endpoints that hold their answer)."""
        return attrs.evolve(self, timeout=seconds)

    async def post(self, path: str, body: object) -> HttpReply:
        """``POST path`` with ``body`` as JSON (`kvroute.adapters.HttpClient`)."""
        return await self._call("POST", path, body)

    async def _call(self, method: str, path: str, body: object) -> HttpReply:
        url = self.base_url + (path if path.startswith("/") else "/" + path)
        data = None
        headers = self.headers
        if method == "POST":
            # The shared session skips automatic headers (the proxy forwards the client's own),
            # so the JSON content type is set here: engines reject a POST without it.
            data = json.dumps(body, separators=(",", ":")).encode("utf-8")
            headers = {**headers, "content-type": "application/json"}
        try:
            async with self.session.request(
                method, url, headers=headers, data=data, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as response:
                return HttpReply(response.status, await response.read())
        except aiohttp.ClientError as exc:
            raise OSError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc
