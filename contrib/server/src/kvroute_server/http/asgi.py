"""Small ASGI helpers shared by the proxy and the emulator: routing, bodies, JSON replies, OpenAI errors.

The proxy is a plain ASGI callable rather than a framework app: a request passes through
one dictionary lookup (`RouteTable`) and straight to its handler, which keeps the added
latency low and gives the handler full control over when response bytes leave (see
docs/serve.md). The proxy's routes, its admin API, its status routes and the emulator all
route through a `RouteTable`; what it cannot route it answers with a `Refusal`, a 404 or
405 in OpenAI's error shape.

Request bodies come from anyone, so `loads_body` never lets a body raise anything but
`InvalidBody`: it parses with orjson when installed (2x faster than ``json`` on chat
bodies, strict RFC 8259, nesting limited to 1,024 levels), else with ``json`` made as
strict (no ``NaN``/``Infinity``, ``RecursionError`` caught).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, NamedTuple, TypeVar

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - the `server` extra installs it
    _orjson = None  # type: ignore[assignment]

__all__ = [
    "MAX_JSON_DEPTH",
    "App",
    "Header",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "BodyTooLarge",
    "ClientGone",
    "InvalidBody",
    "Refusal",
    "RouteTable",
    "drain_body",
    "dumps",
    "loads_body",
    "openai_error",
    "read_body",
    "request_headers",
    "send_bytes",
    "send_error",
    "send_error_draining",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: An ASGI application (or one route's handler): ``await app(scope, receive, send)``.
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Header = tuple[bytes, bytes]

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


class InvalidBody(Exception):
    """A request body that is not what the route accepts; ``code`` and ``param`` go in the 400 answer."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


#: How deep JSON values may nest: orjson's fixed limit; ``json`` stops near the interpreter's
#: recursion limit (1,000 frames by default), a little less deep.
MAX_JSON_DEPTH = 1024


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:24]}{'...' if len(text) > 24 else ''} is too large for a double")
    return value


def _stdlib_loads(raw: bytes) -> Any:
    """``json.loads`` refusing what orjson refuses: ``NaN``, ``Infinity`` and numbers beyond a double."""
    return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)


def loads_body(raw: bytes) -> Any:
    """Parse a request body as JSON; any failure is an `InvalidBody` (code ``invalid_encoding`` or ``invalid_json``).

    Never raises anything else, whatever the bytes: no ``RecursionError`` on deep nesting,
    no ``ValueError`` on a 5,000-digit integer.
    """
    try:
        if _orjson is not None:
            return _orjson.loads(raw)
        return _stdlib_loads(raw)
    except RecursionError:
        error: str = f"it nests deeper than the interpreter allows (at most about {MAX_JSON_DEPTH} levels)"
    except ValueError as exc:  # JSONDecodeError (orjson's too), UnicodeDecodeError, NaN, too many digits
        if isinstance(exc, json.JSONDecodeError):
            error = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
            if "depth limit" in exc.msg:  # orjson's message
                error = f"it nests deeper than {MAX_JSON_DEPTH} levels"
        elif "integer string conversion" in str(exc):
            error = f"a number has more than {sys.get_int_max_str_digits()} digits"
        else:
            error = str(exc)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidBody(
            f"The request body must be UTF-8 encoded JSON (invalid byte at offset {exc.start}).",
            code="invalid_encoding",
        ) from None
    raise InvalidBody(f"The request body is not valid JSON: {error}.", code="invalid_json")


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


async def drain_body(receive: Receive, *, max_bytes: int, max_seconds: float, idle_seconds: float) -> int:
    """Read and discard what is left of the request body, within bounds; returns the bytes discarded.

    Stops at the end of the body, when the client leaves, after ``max_bytes``, after
    ``max_seconds`` in all or after ``idle_seconds`` without a message. Used after an early
    answer (413): closing a socket that still has unread bytes sends a reset, and a client
    still sending would lose the answer with it.
    """
    discarded = 0
    deadline = time.monotonic() + max_seconds
    while discarded < max_bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            async with asyncio.timeout(min(idle_seconds, left)):
                message = await receive()
        except TimeoutError:
            break
        if message["type"] != "http.request":
            break
        discarded += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return discarded


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
    """Compact UTF-8 JSON; strings that cannot be UTF-8 (lone surrogates) are written as ``\\u`` escapes."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode("ascii")


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


async def send_error_draining(
    receive: Receive,
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
    max_bytes: int,
    max_seconds: float,
    idle_seconds: float,
) -> int:
    """Answer with an OpenAI-style error before the request body is read, then drain it and close.

    The whole answer (``Connection: close`` and a ``Content-Length``) leaves at once; the
    response is ended only after `drain_body`, so the server closes a socket with nothing
    left unread and a client still sending its body reads the answer instead of a reset.
    This is nginx's lingering close. Returns the bytes discarded.
    """
    body = dumps(openai_error(status, message, code=code))
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    discarded = await drain_body(receive, max_bytes=max_bytes, max_seconds=max_seconds, idle_seconds=idle_seconds)
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return discarded


# -- routing ------------------------------------------------------------------------------

H = TypeVar("H")
_NO_PARAMS: Mapping[str, str] = MappingProxyType({})


class Refusal(NamedTuple):
    """What to answer a request no route takes: a 404 or 405 in OpenAI's error shape."""

    status: int
    message: str
    code: str
    headers: tuple[Header, ...] = ()

    async def send(self, send: Send) -> None:
        """Answer with this refusal (`send_error`)."""
        await send_error(send, self.status, self.message, code=self.code, headers=self.headers)


class RouteTable(Generic[H]):
    """Method and path to handler, with the 404 and 405 answers for what it does not route.

    A path is exact (``/v1/models``: one dictionary lookup) or a pattern whose ``{name}``
    segments match any one segment (``/admin/backends/{id}/drain``: its values come back by
    name); exact paths are tried first, then patterns in the order they were added, then
    mounts (`mount`: every method on every path under a prefix). A handler is usually an
    ASGI callable (`App`), but the table holds any value ``H``.

    The answers' messages are templates with ``{method}``, ``{path}`` and ``{allowed}`` (the
    path's methods, comma-separated, in the order they were added; the 405 also carries them in
    an ``Allow`` header). Without ``not_allowed``, a known path with another method is a 404.
    """

    def __init__(
        self,
        *,
        not_found: str = "Unknown route: {method} {path}.",
        not_found_code: str = "unknown_url",
        not_allowed: str | None = "Method {method} is not allowed on {path} (allowed: {allowed}).",
    ) -> None:
        self._not_found = not_found
        self._not_found_code = not_found_code
        self._not_allowed = not_allowed
        self._exact: dict[str, dict[str, H]] = {}
        self._patterns: list[tuple[tuple[str, ...], dict[str, H]]] = []
        self._mounts: list[tuple[str, H]] = []

    def add(self, method: str, path: str, handler: H) -> None:
        """Route ``method`` on ``path`` to ``handler`` (replacing the one it had)."""
        segments = tuple(path.split("/"))
        if not any(_is_parameter(s) for s in segments):
            self._exact.setdefault(path, {})[method] = handler
            return
        for known, methods in self._patterns:
            if known == segments:
                methods[method] = handler
                return
        self._patterns.append((segments, {method: handler}))

    def mount(self, prefix: str, handler: H) -> None:
        """Route every method on every path starting with ``prefix`` that no other route takes to ``handler``."""
        self._mounts.append((prefix, handler))

    def __contains__(self, path: object) -> bool:
        """Whether an exact route has ``path`` (whatever its methods)."""
        return path in self._exact

    def find(
        self, method: str, path: str, *, segments: Sequence[str] | None = None
    ) -> tuple[H, Mapping[str, str]] | Refusal:
        """The handler for ``method`` on ``path`` and the pattern's values by name, or the `Refusal` to answer.

        ``segments`` is ``path`` already split at ``/``, for a caller that decodes each segment on
        its own (so that an encoded ``/`` inside an id is not a separator); patterns match those.
        """
        methods = self._exact.get(path)
        if methods is not None:
            handler = methods.get(method)
            if handler is not None:  # the request path's case: one lookup more than a dict of dicts
                return handler, _NO_PARAMS
        params: Mapping[str, str] = _NO_PARAMS
        if methods is None and self._patterns:
            methods, params = self._match(path.split("/") if segments is None else segments)
        if methods is None:
            for prefix, mounted in self._mounts:
                if path.startswith(prefix):
                    return mounted, _NO_PARAMS
            return Refusal(404, self._not_found.format(method=method, path=path), self._not_found_code)
        handler = methods.get(method)
        if handler is not None:
            return handler, params
        if self._not_allowed is None:
            return Refusal(404, self._not_found.format(method=method, path=path), self._not_found_code)
        allowed = ", ".join(methods)
        message = self._not_allowed.format(method=method, path=path, allowed=allowed)
        return Refusal(405, message, "method_not_allowed", ((b"allow", allowed.encode()),))

    def _match(self, segments: Sequence[str]) -> tuple[dict[str, H] | None, Mapping[str, str]]:
        for pattern, methods in self._patterns:
            if len(pattern) == len(segments):
                params: dict[str, str] = {}
                for want, got in zip(pattern, segments, strict=True):
                    if _is_parameter(want):
                        params[want[1:-1]] = got
                    elif want != got:
                        break
                else:
                    return methods, params
        return None, _NO_PARAMS


def _is_parameter(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")
