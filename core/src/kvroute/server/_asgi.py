"""Small ASGI helpers shared by the proxy and the emulator: bodies, JSON replies, OpenAI errors.

The proxy is a plain ASGI callable rather than a framework app: a request passes through
one dictionary lookup and straight to its handler, which keeps the added latency low and
gives the handler full control over when response bytes leave (see docs/serve.md).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

__all__ = [
    "Receive",
    "Scope",
    "Send",
    "BodyTooLarge",
    "openai_error",
    "read_body",
    "request_headers",
    "send_bytes",
    "send_error",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")

#: OpenAI's error ``type`` for each status we produce.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class BodyTooLarge(Exception):
    """The request body is larger than the configured limit."""

    def __init__(self, limit: int, got: int | None) -> None:
        self.limit = limit
        self.got = got
        got_text = f"{got} bytes" if got is not None else "more than that"
        super().__init__(f"The request body must be at most {limit} bytes (got {got_text}).")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers as a dict of lower-case names (latin-1 decoded, last value wins)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


async def read_body(receive: Receive, limit: int, declared: int | None = None) -> bytes:
    """Read the whole request body, refusing more than ``limit`` bytes."""
    if declared is not None and declared > limit:
        raise BodyTooLarge(limit, declared)
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge(limit, len(body))
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit, None)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (),
    content_type: bytes = b"application/json",
) -> None:
    """Send a complete response in two ASGI messages."""
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


async def send_json(send: Send, status: int, value: Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send ``value`` as a JSON response."""
    await send_bytes(send, status, dumps(value), headers)


def openai_error(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send an OpenAI-style error response."""
    await send_json(send, status, openai_error(status, message, code=code, param=param), headers)
