"""`RoutingMiddleware`: kvroute's decision inside any ASGI app (Starlette, FastAPI, ...).

For each ``POST`` to an OpenAI-compatible path, the middleware reads the body, builds a
`kvroute.RouteRequest` exactly as ``kvroute serve`` does, leases a backend from the
`kvroute.Router`, and calls the app with the lease in the ASGI scope's ``state`` (which
Starlette exposes as ``request.state.kvroute_lease``). The app forwards the body to
``lease.backend.url`` however it likes. The request counts as in flight on that backend
until the last byte of the app's response has been sent, or the app raised, or the client
went away; a 5xx response counts as a failure. Other requests pass through untouched.

Errors are answered in OpenAI's shape: 400 for a body kvroute cannot route (the message
names the field), 413 for a body over ``max_body_bytes``, 503 when no backend can take it.

No framework is imported: the middleware speaks plain ASGI 3.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from kvroute.errors import InvalidRequest, KvrouteError, NoBackendAvailable
from kvroute.logs import get_logger
from kvroute.ranks import RANK_HEADER, rank_for
from kvroute.request import Endpoint, RouteRequest
from kvroute.router import Lease, Router, status_for
from kvroute.strategy import Status

__all__ = ["DEFAULT_PATHS", "STATE_KEY", "RoutingMiddleware", "lease_from", "upstream_headers"]

log = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Key of the lease in ``scope["state"]`` (``request.state.kvroute_lease`` in Starlette).
STATE_KEY = "kvroute_lease"
#: The OpenAI-compatible paths routed by default, with the body shape each one has.
DEFAULT_PATHS: Mapping[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

_ERROR_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}


def lease_from(request_or_scope: object) -> Lease:
    """The lease the middleware placed for this request (a Starlette ``Request`` or an ASGI scope).

    Raises `KvrouteError` when the middleware did not route this request (wrong path or
    method, or the middleware is not installed).
    """
    scope = getattr(request_or_scope, "scope", request_or_scope)
    state = scope.get("state") if isinstance(scope, Mapping) else None
    lease = state.get(STATE_KEY) if isinstance(state, Mapping) else None
    if not isinstance(lease, Lease):
        raise KvrouteError(
            "no kvroute lease on this request: add RoutingMiddleware to the app and send a POST to one of "
            f"its routed paths (got scope path {scope.get('path') if isinstance(scope, Mapping) else None!r})."
        )
    return lease


def upstream_headers(lease: Lease) -> dict[str, str]:
    """Headers the app adds to its request to ``lease.backend``, as ``kvroute serve`` does.

    Today one: ``x-data-parallel-rank`` when the backend has several data-parallel ranks and the
    decision names one (`kvroute.ranks.rank_for`), so the prefix reaches the rank that caches it.
    Empty otherwise. The app should also drop a client's own ``x-data-parallel-rank``.
    """
    rank = rank_for(lease.decision, lease.state)
    return {} if rank is None else {RANK_HEADER: str(rank)}


async def _send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": None}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyTooLarge(Exception):
    pass


class RoutingMiddleware:
    """Lease a backend for every OpenAI-compatible ``POST`` and keep it until the response ends.

    :param app: the ASGI app to wrap.
    :param router: the `kvroute.Router` deciding (build it with ``Router.create(fleet, name, options)``).
    :param paths: path -> ``"chat"`` or ``"completions"``; other paths pass through.
    :param max_body_bytes: larger bodies get a 413 without reaching the app.
    :param backend_header: response header naming the chosen backend (``None``: not added).
    """

    def __init__(
        self,
        app: ASGIApp,
        router: Router,
        *,
        paths: Mapping[str, Endpoint] = DEFAULT_PATHS,
        max_body_bytes: int = 32 * 1024 * 1024,
        backend_header: str | None = "x-kvroute-backend",
    ) -> None:
        bad = {p: e for p, e in paths.items() if e not in ("chat", "completions")}
        if bad:
            raise ValueError(f"each path must map to 'chat' or 'completions' (got {bad!r}).")
        if max_body_bytes < 1:
            raise ValueError(f"'max_body_bytes' must be >= 1 (got {max_body_bytes!r}).")
        self.app = app
        self.router = router
        self.paths = dict(paths)
        self.max_body_bytes = max_body_bytes
        self._header = backend_header.lower().encode("latin-1") if backend_header else None

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionResetError("the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.paths.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        try:
            raw = await self._read_body(receive)
        except _BodyTooLarge:
            await _send_error(send, 413, f"The request body must be at most {self.max_body_bytes} bytes.")
            return
        except ConnectionResetError:
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            body = json.loads(raw)
            request = RouteRequest.from_openai(body, endpoint=endpoint, headers=headers)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and InvalidRequest are ValueErrors
            param = exc.param if isinstance(exc, InvalidRequest) else None
            if isinstance(exc, RecursionError):
                message = "The request body nests too deeply to be routed."
            else:
                message = str(exc) if isinstance(exc, InvalidRequest) else f"The request body must be JSON ({exc})."
            await _send_error(send, 400, message, param)
            return
        try:
            lease = self.router.acquire(request)
        except NoBackendAvailable as exc:
            await _send_error(send, 503, str(exc))
            return
        await self._run(scope, send, raw, receive, lease)

    async def _run(self, scope: Scope, send: Send, raw: bytes, receive: Receive, lease: Lease) -> None:
        scope.setdefault("state", {})[STATE_KEY] = lease
        replayed = False
        finished = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        async def send_through(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.start":
                status = int(message.get("status", 200))
                if status >= 500:
                    lease.fail(f"HTTP {status}")
                if self._header is not None:
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (self._header, lease.backend.id.encode())],
                    }
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
                self.router.release(lease)

        try:
            await self.app(scope, replay, send_through)
        except BaseException as exc:
            self.router.release(lease, *status_for(exc))
            raise
        finally:
            if not finished:
                # The app returned without finishing a response: the client went away.
                self.router.release(lease, Status.CANCELLED, "response not completed")
