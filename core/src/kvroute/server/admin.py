"""The admin API: list, add, remove, drain and re-weight backends at runtime.

Off unless an admin token is configured; every call needs ``Authorization: Bearer <token>``.
Changes go through the `Fleet`, so the strategy sees them like any other membership change.

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
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import structlog

from kvroute.errors import ConfigError, UnknownBackend
from kvroute.server._asgi import BodyTooLarge, ClientGone, Receive, Scope, Send, read_body, send_error, send_json
from kvroute.server.config import BackendConfig

if TYPE_CHECKING:
    from kvroute.server.app import ProxyApp

__all__ = ["AdminApi"]

log = structlog.get_logger(__name__)

_MAX_ADMIN_BODY = 64 * 1024


class AdminApi:
    """ASGI handler for ``/admin/...`` bound to one `ProxyApp`."""

    def __init__(self, app: ProxyApp) -> None:
        assert app.config.admin_token is not None
        self.app = app
        self._token = app.config.admin_token.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token)
        return False

    def describe(self, backend_id: str) -> dict[str, Any]:
        state = self.app.fleet.get(backend_id)
        backend = state.backend
        served = self.app.served_models(backend_id)
        return {
            "id": backend.id,
            "url": backend.url,
            "kind": backend.kind,
            "weight": backend.weight,
            "models": sorted(served) if served else [],
            "labels": dict(backend.labels),
            "healthy": state.healthy,
            "draining": state.draining,
            "in_flight": state.in_flight,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            await send_error(
                send, 401, "The admin API needs 'Authorization: Bearer <admin token>'.", code="invalid_admin_token",
                headers=[(b"www-authenticate", b'Bearer realm="kvroute-admin"')],
            )
            return
        parts = [unquote(p) for p in scope["path"].split("/")[2:]]
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
        try:
            await self._dispatch(parts, method, body, send)
        except UnknownBackend as exc:
            await send_error(send, 404, str(exc), code="backend_not_found")
        except ConfigError as exc:
            await send_error(send, 400, str(exc), code="invalid_backend")

    async def _body(self, receive: Receive, method: str) -> Any:
        raw = await read_body(receive, _MAX_ADMIN_BODY)
        if not raw.strip():
            return {}
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"The admin request body must be UTF-8 JSON: {exc}.") from None

    async def _dispatch(self, parts: list[str], method: str, body: Any, send: Send) -> None:
        app = self.app
        if parts == ["backends"]:
            if method == "GET":
                await send_json(send, 200, {"backends": [self.describe(s.id) for s in app.fleet]})
                return
            if method == "POST":
                config = BackendConfig.from_mapping(body, "admin backend")
                app.add_backend(config)
                log.info("admin_backend_added", backend=config.id, url=config.url)
                await send_json(send, 201, self.describe(config.id))
                return
            await self._not_allowed(send, method, "GET, POST")
            return
        if len(parts) == 2 and parts[0] == "backends":
            backend_id = parts[1]
            if method == "GET":
                await send_json(send, 200, self.describe(backend_id))
            elif method == "DELETE":
                described = self.describe(backend_id)
                app.remove_backend(backend_id)
                log.info("admin_backend_removed", backend=backend_id)
                await send_json(send, 200, {**described, "removed": True})
            elif method == "PATCH":
                if not isinstance(body, dict) or set(body) - {"weight"} or "weight" not in body:
                    raise ConfigError(f"PATCH takes {{\"weight\": <number > 0>}} (got {body!r}).")
                weight = body["weight"]
                if isinstance(weight, bool) or not isinstance(weight, int | float):
                    raise ConfigError(f"'weight' must be a number > 0 (got {weight!r}).")
                app.fleet.set_weight(backend_id, float(weight))
                await send_json(send, 200, self.describe(backend_id))
            else:
                await self._not_allowed(send, method, "GET, PATCH, DELETE")
            return
        if len(parts) == 3 and parts[0] == "backends" and parts[2] in ("drain", "undrain"):
            if method != "POST":
                await self._not_allowed(send, method, "POST")
                return
            backend_id = parts[1]
            remove = bool(body.get("remove", False)) if isinstance(body, dict) else False
            if parts[2] == "drain":
                app.drain_backend(backend_id, remove=remove)
                log.info("admin_backend_draining", backend=backend_id, remove_when_idle=remove)
                await send_json(send, 202, {**self.describe(backend_id), "remove_when_idle": remove})
            else:
                app.drain_backend(backend_id, draining=False)
                await send_json(send, 200, self.describe(backend_id))
            return
        await send_error(send, 404, f"Unknown admin route: {method} /admin/{'/'.join(parts)}.", code="unknown_url")

    async def _not_allowed(self, send: Send, method: str, allowed: str) -> None:
        await send_error(
            send, 405, f"Method {method} is not allowed here (allowed: {allowed}).", code="method_not_allowed",
            headers=[(b"allow", allowed.encode())],
        )
