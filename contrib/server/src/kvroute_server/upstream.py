"""Talking to backends: one aiohttp session with keep-alive pools, header rules, usage sniffing.

aiohttp was chosen over httpx after measuring streaming pass-through
(benchmarks/bench_http_clients.py, figures in docs/performance.md).
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import attrs

from kvroute.adapters import HttpReply

__all__ = [
    "HOP_BY_HOP",
    "BackendHttp",
    "UsageSniffer",
    "create_session",
    "filter_request_headers",
    "filter_response_headers",
]

#: RFC 9110 section 7.6.1 connection-specific headers, never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed or owned by the proxy on the way up.
_DROP_UP = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}
# Recomputed by the ASGI server on the way down.
_DROP_DOWN = HOP_BY_HOP | {"content-length", "date", "server"}


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    out: set[str] = set()
    for name, value in headers:
        if name == "connection":
            out.update(t.strip().lower() for t in value.split(",") if t.strip())
    return out


def filter_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    *,
    forward_authorization: bool,
    api_key: str | None,
    request_id: str,
) -> dict[str, str]:
    """Headers to send upstream: hop-by-hop dropped, Authorization forwarded or replaced, request id set."""
    pairs = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in raw]
    drop = _DROP_UP | _connection_tokens(pairs)
    out: dict[str, str] = {}
    for name, value in pairs:
        if name in drop or (name == "authorization" and (api_key is not None or not forward_authorization)):
            continue
        out[name] = value
    if api_key is not None:
        out["authorization"] = f"Bearer {api_key}"
    out["x-request-id"] = request_id
    return out


def filter_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Headers to send back to the client: hop-by-hop and length/date/server dropped."""
    items = list(headers)
    tokens = _connection_tokens((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in items)
    drop = _DROP_DOWN | tokens
    return [(k.lower(), v) for k, v in items if k.decode("latin-1").lower() not in drop]


_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


@attrs.define
class UsageSniffer:
    """Finds ``usage.prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` in passing bytes.

    Bytes are scanned only when a chunk mentions ``usage``; a short tail of the previous
    chunk is kept so that a number split across two chunks is still found. The last
    values seen win (streams carry usage once, at the end).
    """

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    _tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        self._tail = data[-256:]
        if b"prompt_tokens" not in data:
            return
        for match in _PROMPT.finditer(data):
            self.prompt_tokens = int(match.group(1))
        for match in _CACHED.finditer(data):
            self.cached_tokens = int(match.group(1))


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
