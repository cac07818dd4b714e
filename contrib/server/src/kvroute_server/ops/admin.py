"""The admin API: list, add, remove, drain and re-weight backends at runtime.

Off unless an admin token is configured; every call needs ``Authorization: Bearer <token>``.
The admin API talks to the proxy's `BackendSet` (and through it the `Fleet`, so the strategy
sees a change like any other membership change), never to the app. With ``kvroute serve
--workers N`` a change also goes through the workers' shared journal (`kvroute_server.ops.journal`),
which this API owns, so every worker makes it before the call returns.

=======  ================================  ================================================
GET      /admin/backends                   every backend with its live state
POST     /admin/backends                   add one (body: a backend table as in the TOML)
GET      /admin/backends/{id}              one backend
PATCH    /admin/backends/{id}              change ``weight``
DELETE   /admin/backends/{id}              remove now (requests in flight finish)
POST     /admin/backends/{id}/drain        stop new requests; ``{"remove": true}`` removes it once idle
POST     /admin/backends/{id}/undrain      take new requests again
=======  ================================  ================================================
"""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import unquote

import anyio
import structlog
from anyio.abc import TaskStatus

from kvroute.errors import ConfigError, UnknownBackend
from kvroute_server.config import BackendConfig
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.http.asgi import (
    App,
    BodyTooLarge,
    ClientGone,
    InvalidBody,
    Receive,
    Refusal,
    RouteTable,
    Scope,
    Send,
    loads_body,
    read_body,
    send_error,
    send_json,
)
from kvroute_server.ops.journal import ONE_PROCESS, AdminJournal, WorkerContext

__all__ = ["AdminApi", "NoAdminApi"]

log = structlog.get_logger(__name__)

_MAX_ADMIN_BODY = 64 * 1024


def _routes() -> RouteTable[str]:
    """Each admin route's action (an action and its backend id are what the admin journal records)."""
    routes: RouteTable[str] = RouteTable(
        not_found="Unknown admin route: {method} {path}.",
        not_allowed="Method {method} is not allowed here (allowed: {allowed}).",
    )
    for method, path, action in [
        ("GET", "/admin/backends", "list"),
        ("POST", "/admin/backends", "add"),
        ("GET", "/admin/backends/{id}", "get"),
        ("PATCH", "/admin/backends/{id}", "weight"),
        ("DELETE", "/admin/backends/{id}", "remove"),
        ("POST", "/admin/backends/{id}/drain", "drain"),
        ("POST", "/admin/backends/{id}/undrain", "undrain"),
    ]:
        routes.add(method, path, action)
    return routes


_ROUTES = _routes()


class AdminApi:
    """ASGI handler for ``/admin/...`` changing one `BackendSet`.

    ``worker`` is set in the workers of ``kvroute serve --workers N``: with more than one, changes
    are shared through the `AdminJournal` (``journal``; run `follow` in the proxy's task group).
    """

    def __init__(self, backends: BackendSet, token: str, *, worker: WorkerContext = ONE_PROCESS) -> None:
        self.backends = backends
        self._token = token.encode()
        #: The admin journal shared with the other workers (several workers only).
        self.journal = AdminJournal(worker, self.replay) if worker.count > 1 else None

    @classmethod
    def create(
        cls, backends: BackendSet, token: str | None, *, worker: WorkerContext = ONE_PROCESS
    ) -> AdminApi | NoAdminApi:
        """The admin API guarded by ``token``; without a token, `NoAdminApi` (``/admin/...`` is an unknown route)."""
        return cls(backends, token, worker=worker) if token else NoAdminApi()

    def add_routes(self, routes: RouteTable[App]) -> None:
        """Take every path under ``/admin/`` that no other route of ``routes`` takes."""
        routes.mount("/admin/", self)

    async def follow(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Replay the changes other workers made (before this one started, then as they come) until cancelled.

        Reports started once the earlier changes are applied, so that no request sees the fleet without them.
        """
        journal = self.journal
        if journal is None:
            task_status.started()
            return
        try:
            replayed = journal.catch_up()
            journal.publish()
            if replayed:
                log.info("admin_changes_replayed", count=replayed)
            task_status.started()
            await journal.follow()
        finally:
            journal.close()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token)
        return False

    def describe(self, backend_id: str) -> dict[str, Any]:
        """One backend as the admin API shows it: identity, served models and live state."""
        state = self.backends.fleet.get(backend_id)
        backend = state.backend
        return {
            "id": backend.id,
            "url": backend.url,
            "kind": backend.kind,
            "weight": backend.weight,
            "models": sorted(state.models),
            "labels": dict(backend.labels),
            "healthy": state.healthy,
            "draining": state.draining,
            "in_flight": state.in_flight,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            await send_error(
                send,
                401,
                "The admin API needs 'Authorization: Bearer <admin token>'.",
                code="invalid_admin_token",
                headers=[(b"www-authenticate", b'Bearer realm="kvroute-admin"')],
            )
            return
        # Each segment is decoded on its own: an encoded "/" in a backend id is part of the id.
        segments = [unquote(p) for p in scope["path"].split("/")]
        method = scope["method"]
        try:
            body = await self._body(receive, method)
        except ClientGone:
            return
        except BodyTooLarge as exc:
            await send_error(send, 413, str(exc), code="request_too_large")
            return
        except ValueError as exc:
            await send_error(send, 400, str(exc), code="invalid_json")
            return
        found = _ROUTES.find(method, "/".join(segments), segments=segments)
        if isinstance(found, Refusal):
            await found.send(send)
            return
        action, params = found
        backend_id = params.get("id")
        try:
            if action == "list":
                await send_json(send, 200, {"backends": [self.describe(s.id) for s in self.backends.fleet]})
            elif action == "get":
                assert backend_id is not None
                await send_json(send, 200, self.describe(backend_id))
            else:
                await self._change(send, action, backend_id, body)
        except UnknownBackend as exc:
            await send_error(send, 404, str(exc), code="backend_not_found")
        except ConfigError as exc:
            await send_error(send, 400, str(exc), code="invalid_backend")

    async def _body(self, receive: Receive, method: str) -> Any:
        raw = await read_body(receive, _MAX_ADMIN_BODY)
        if not raw.strip():
            return {}
        try:
            return loads_body(raw)
        except InvalidBody as exc:
            raise ValueError(f"The admin request body must be UTF-8 JSON: {exc}") from None

    async def _change(self, send: Send, action: str, backend_id: str | None, body: Any) -> None:
        """Make a change; with several workers, through the shared journal so that every worker makes it."""
        journal = self.journal
        if journal is None:
            status, answer = self.perform(action, backend_id, body)
            await send_json(send, status, answer)
            return
        try:
            async with journal.exclusive():
                # No await from here to the append: the change and its place in the journal go together.
                status, answer = self.perform(action, backend_id, body)
                seq = journal.append(action, backend_id, body)
        except TimeoutError as exc:
            await send_error(send, 503, f"The admin change was not made: {exc}.", code="admin_busy")
            return
        answer["workers"] = await journal.wait_for_siblings(seq)
        await send_json(send, status, answer)

    def replay(self, entry: dict[str, Any]) -> None:
        """Make a change another worker made (an admin journal entry)."""
        self.perform(str(entry["action"]), entry.get("backend"), entry.get("body"))

    def perform(self, action: str, backend_id: str | None, body: Any) -> tuple[int, dict[str, Any]]:
        """Make one change in this process (no I/O); returns the answer's status and body.

        Raises `UnknownBackend` (404) or `ConfigError` (400) and then changes nothing.
        """
        backends = self.backends
        if action == "add":
            config = BackendConfig.from_mapping(body, "admin backend")
            backends.add(config)
            log.info("admin_backend_added", backend=config.id, url=config.url)
            return 201, self.describe(config.id)
        assert backend_id is not None, f"admin action {action!r} needs a backend id"
        if action == "remove":
            described = self.describe(backend_id)
            backends.remove(backend_id)
            log.info("admin_backend_removed", backend=backend_id)
            return 200, {**described, "removed": True}
        if action == "weight":
            if not isinstance(body, dict) or set(body) - {"weight"} or "weight" not in body:
                raise ConfigError(f'PATCH takes {{"weight": <number > 0>}} (got {body!r}).')
            weight = body["weight"]
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise ConfigError(f"'weight' must be a number > 0 (got {weight!r}).")
            backends.fleet.set_weight(backend_id, float(weight))
            return 200, self.describe(backend_id)
        if action == "drain":
            remove = bool(body.get("remove", False)) if isinstance(body, dict) else False
            backends.drain(backend_id, remove_when_idle=remove)
            log.info("admin_backend_draining", backend=backend_id, remove_when_idle=remove)
            return 202, {**self.describe(backend_id), "remove_when_idle": remove}
        if action == "undrain":
            backends.drain(backend_id, draining=False)
            return 200, self.describe(backend_id)
        raise ConfigError(f"unknown admin action {action!r} (expected add, remove, weight, drain or undrain).")


class NoAdminApi:
    """No admin token configured: no admin routes and no journal to follow."""

    def add_routes(self, routes: RouteTable[App]) -> None:
        """Add nothing: ``/admin/...`` stays an unknown route."""

    async def follow(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Report started at once: there is nothing to follow."""
        task_status.started()
