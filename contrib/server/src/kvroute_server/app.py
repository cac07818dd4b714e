"""The routing proxy as an ASGI application.

``ProxyApp(config)`` is an ASGI callable (run it with uvicorn, see `kvroute_server.cli`).
Per request: read and validate the body, build a `RouteRequest`, ask the `Router` for a
lease, forward the original bytes to the chosen backend, and pass the answer back:
SSE event by event as it arrives, anything else once complete. Failures before the first
byte reaches the client are retried on another backend (see docs/serve.md).

Hostile input: every body the proxy cannot route gets a 4xx in OpenAI's error shape
(`kvroute_server._asgi.loads_body` turns any parse failure into `InvalidBody`), a body over
the limit gets its 413 before the connection closes, bodies over 1 MiB are parsed in a
worker thread so that they do not stall other requests, and an unexpected exception is
logged once and answered 500 with a JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import attrs
import structlog
from anyio.abc import TaskGroup

from kvroute.adapters import KvEventSink, kv_event_sink
from kvroute.backend import Backend
from kvroute.errors import ConfigError, InvalidRequest, NoBackendAvailable, UnknownBackend
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.request import AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, Endpoint, RouteRequest
from kvroute.router import Lease, Router
from kvroute_server._asgi import (
    BodyTooLarge,
    ClientGone,
    InvalidBody,
    Receive,
    Scope,
    Send,
    dumps,
    loads_body,
    openai_error,
    read_body,
    send_bytes,
    send_error,
    send_error_draining,
    send_json,
)
from kvroute_server.config import BackendConfig, ServerConfig
from kvroute_server.health import HealthChecker
from kvroute_server.journal import AdminJournal, WorkerContext
from kvroute_server.metrics import CONTENT_TYPE, ProxyMetrics
from kvroute_server.upstream import (
    BackendHttp,
    UsageSniffer,
    create_session,
    filter_request_headers,
    filter_response_headers,
)

__all__ = ["ProxyApp"]

log = structlog.get_logger("kvroute_server.access")
_events = structlog.get_logger(__name__)

_ROUTE_HEADERS = {
    AFFINITY_HEADER.encode(): AFFINITY_HEADER,
    LORA_HEADER.encode(): LORA_HEADER,
}
_REQUEST_ID = REQUEST_ID_HEADER.encode()
_CONTENT_LENGTH = b"content-length"
_SSE = "text/event-stream"
#: Timeout of one HTTP call made by an adapter's event feed or the parity check (seconds).
_EVENTS_HTTP_TIMEOUT = 10.0
#: Transport failures. ``TimeoutError`` is an ``OSError``; `_is_timeout` tells our own
#: timeouts (first byte, idle) from aiohttp's connect timeouts, which are connection errors.
_TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)
#: After a 413, the rest of the body is read and discarded (so that the client reads the answer
#: rather than a reset) up to the larger of this and 4x ``max_body_bytes``, for at most
#: `_DRAIN_SECONDS` in all and `_DRAIN_IDLE_SECONDS` between two reads; then the connection closes.
_DRAIN_MIN_BYTES = 256 * 1024 * 1024
_DRAIN_SECONDS = 10.0
_DRAIN_IDLE_SECONDS = 2.0
#: Bodies larger than this are parsed (JSON, then the `RouteRequest`) in a worker thread:
#: 32 MiB of small messages takes seconds of CPU, which must not stall the event loop.
_THREAD_PARSE_BYTES = 1024 * 1024
#: At most this many such parses at once (each holds the parsed body in memory).
_THREAD_PARSES = 2
#: Request bodies larger than this go upstream as a stream written in 64 KiB pieces.
_LARGE_UPSTREAM_BODY = 1024 * 1024
#: Scope key under which `_proxy` leaves the request id for the last-resort error answer.
_SCOPE_REQUEST_ID = "kvroute.request_id"


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError)


@attrs.define
class _Failure:
    """An attempt that failed before any byte reached the client (may be retried)."""

    reason: str
    message: str
    connection: bool = False
    status: int = 502
    body: bytes | None = None
    headers: list[tuple[bytes, bytes]] = attrs.field(factory=list)


@attrs.define
class _Exchange:
    """What one client request has gone through so far (for the log line and metrics)."""

    request_id: str
    started: float
    status: int = 0
    backend: str = "none"
    outcome: str = "rejected"
    model: str | None = None
    reason: str | None = None
    key: int | None = None
    spilled: bool = False
    attempts: int = 0
    ttft: float | None = None
    stream: bool = False
    response_started: bool = False
    complete: bool = False
    client_gone: bool = False
    error: str | None = None


def _event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in ``data`` (0 when none is complete)."""
    end = data.rfind(b"\n\n")
    end = end + 2 if end >= 0 else 0
    crlf = data.rfind(b"\r\n\r\n")
    if crlf >= 0 and crlf + 4 > end:
        end = crlf + 4
    return end


def _invalid(exc: InvalidRequest | RecursionError) -> InvalidBody:
    if isinstance(exc, RecursionError):
        return InvalidBody("The request body nests too deeply to be routed.", code="invalid_json")
    return InvalidBody(str(exc), code="invalid_value", param=exc.param)


def _parse(
    raw: bytes, endpoint: Endpoint | None, headers: dict[str, str], request_id: str
) -> tuple[object, RouteRequest | None]:
    """The body's JSON and, on the generation routes, its `RouteRequest`; any fault is an `InvalidBody`.

    Touches no shared state, so it may run in a worker thread.
    """
    body = loads_body(raw)
    if endpoint is None:
        return body, None
    try:
        return body, RouteRequest.from_openai(body, endpoint=endpoint, headers=headers, request_id=request_id)
    except (InvalidRequest, RecursionError) as exc:
        raise _invalid(exc) from None


class _ResponseGuard:
    """Wraps an ASGI ``send`` to tell whether the response has started (for the last-resort handler)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Any) -> None:
        self.started = True
        await self.send(message)


def _stream_error_event(message: str, code: str) -> bytes:
    body = openai_error(502, message, code=code)
    return b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n"


class ProxyApp:
    """The OpenAI-compatible routing proxy (an ASGI 3 application with lifespan).

    ``worker`` is set in the workers of ``kvroute serve --workers N`` (see
    `kvroute_server.workers`): metrics are then shared between the workers and admin
    changes reach all of them through the shared journal.
    """

    def __init__(
        self, config: ServerConfig, *, plugins: PluginManager | None = None, worker: WorkerContext | None = None
    ) -> None:
        self.config = config
        self.worker = worker
        self.plugins = plugins or PluginManager()
        self.fleet = Fleet()
        self.backend_configs: dict[str, BackendConfig] = {}
        self.adapters: dict[str, Any] = {}
        self.discovered_models: dict[str, frozenset[str]] = {}
        self._exclusions: dict[str, frozenset[str] | None] = {}
        for backend in config.backends:
            self._register(backend)
        self.router = Router.create(self.fleet, config.strategy, config.options, plugins=self.plugins)
        several = worker is not None and worker.count > 1
        shared = several and worker is not None and worker.shared_metrics
        self.metrics = ProxyMetrics(self.fleet, config.strategy, shared=shared, worker=str(worker.index if worker else 0))
        self._shared_metrics = shared
        self.fleet.subscribe(lambda event: self._exclusions.clear())
        self.health = HealthChecker(
            self.fleet, self.adapters, self._http_for, config.health, self.metrics, self._models_discovered
        )
        self._session: aiohttp.ClientSession | None = None
        self._task_group: TaskGroup | None = None
        self._sink: KvEventSink | None = None
        self._event_scopes: dict[str, anyio.CancelScope] = {}
        self._backend_header = config.backend_header.lower().encode() if config.backend_header else None
        self._parse_limiter: anyio.CapacityLimiter | None = None
        self._created = int(time.time())
        from kvroute_server.admin import AdminApi

        self.admin = AdminApi(self) if config.admin_token else None
        #: The admin journal shared with the other workers (several workers with the admin API on).
        self.journal = AdminJournal(worker, self.admin.replay) if several and worker and self.admin else None
        handler = Callable[[Scope, Receive, Send], Awaitable[None]]
        self._routes: dict[str, dict[str, handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
        }
        for path in config.passthrough_paths:
            self._routes.setdefault(path, {"POST": self._passthrough})

    # -- fleet management (used by the admin API and at start) ---------------------------

    def _register(self, config: BackendConfig) -> Backend:
        backend = config.to_backend()
        registration = self.plugins.backend_kinds.get(config.kind)
        if registration is None:
            known = ", ".join(sorted(self.plugins.backend_kinds)) or "none"
            raise ConfigError(f"backend {config.id!r}: unknown kind {config.kind!r} (installed kinds: {known}).")
        try:
            adapter = registration.factory(backend, **dict(config.adapter_options))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"backend {config.id!r}: adapter for kind {config.kind!r} rejected its options: {exc}") from None
        self.fleet.add(backend)
        self.backend_configs[config.id] = config
        self.adapters[config.id] = adapter
        return backend

    def add_backend(self, config: BackendConfig) -> Backend:
        """Add a backend at runtime; probed at once when health checks are on.

        Call it (and `remove_backend`, `drain_backend`) from a task on the proxy's event loop,
        as the admin API does.
        """
        backend = self._register(config)
        self.health.wake()
        self._start_events(config.id)
        return backend

    def remove_backend(self, backend_id: str) -> None:
        """Remove a backend now; requests already on it finish."""
        self.fleet.remove(backend_id)
        scope = self._event_scopes.pop(backend_id, None)
        if scope is not None:
            scope.cancel()
        self.backend_configs.pop(backend_id, None)
        self.adapters.pop(backend_id, None)
        self.discovered_models.pop(backend_id, None)
        self.health.forget(backend_id)

    def drain_backend(self, backend_id: str, *, remove: bool = False, draining: bool = True) -> None:
        """Stop new requests to a backend; with ``remove``, remove it once idle."""
        self.fleet.drain(backend_id, draining)
        if remove and draining and self._task_group is not None:
            self._task_group.start_soon(self._remove_when_idle, backend_id)

    async def _remove_when_idle(self, backend_id: str) -> None:
        while True:
            try:
                state = self.fleet.get(backend_id)
            except UnknownBackend:
                return
            if not state.draining:
                return
            if state.in_flight == 0:
                self.remove_backend(backend_id)
                _events.info("backend_drained_and_removed", backend=backend_id)
                return
            await anyio.sleep(0.05)

    def _models_discovered(self, backend_id: str, models: list[str]) -> None:
        if backend_id in self.fleet:
            self.discovered_models[backend_id] = frozenset(models)
            self._exclusions.clear()

    def served_models(self, backend_id: str) -> frozenset[str] | None:
        """Declared models, else discovered ones; ``None`` when unknown (serves anything)."""
        config = self.backend_configs.get(backend_id)
        if config is not None and config.models:
            return frozenset(config.models)
        return self.discovered_models.get(backend_id) or None

    def all_models(self) -> list[str]:
        out: set[str] = set()
        for state in self.fleet:
            out |= self.served_models(state.id) or frozenset()
        return sorted(out)

    def _excluded_for(self, model: str) -> frozenset[str] | None:
        """Backends that do not serve ``model``; ``None`` when no backend does (unknown model)."""
        try:
            return self._exclusions[model]
        except KeyError:
            pass
        members = list(self.fleet)
        excluded = frozenset(
            s.id for s in members if (served := self.served_models(s.id)) is not None and model not in served
        )
        result = None if members and len(excluded) == len(members) else excluded
        if len(self._exclusions) > 4096:
            self._exclusions.clear()
        self._exclusions[model] = result
        return result

    def _http_for(self, backend_id: str, timeout: float | None = None) -> BackendHttp:
        assert self._session is not None, "the proxy is not running (no upstream session)"
        config = self.backend_configs[backend_id]
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        return BackendHttp(self._session, config.url, timeout or self.config.health.timeout, headers)

    # -- adapters' background work: KV event feeds, tokenizer parity -------------------

    def _start_events(self, backend_id: str) -> None:
        """Run the backend's adapter ``run_events`` feeding the strategy's sink, until removal."""
        if self._task_group is None or self._sink is None:
            return
        adapter = self.adapters.get(backend_id)
        run_events = getattr(adapter, "run_events", None)
        if run_events is None:
            return
        http = self._http_for(backend_id, max(self.config.health.timeout, _EVENTS_HTTP_TIMEOUT))
        sink = self._sink

        async def follow() -> None:
            with anyio.CancelScope() as scope:
                if self.adapters.get(backend_id) is not adapter:
                    return  # removed before the task started
                self._event_scopes[backend_id] = scope
                try:
                    await run_events(http, sink)
                except Exception as exc:  # an adapter bug must not take the proxy down
                    _events.error("kv_events_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}")

        self._task_group.start_soon(follow, name=f"kv-events {backend_id}")

    async def _check_parity(self) -> None:
        """After the first health round, compare the strategy's tokenizer with each backend's."""
        if getattr(self.router.strategy, "prompt_tokenizer", None) is None:
            return
        from kvroute_server.parity import startup_check

        if self.config.health.enabled:
            await self.health.first_round.wait()
        targets = [
            (state.id, self.backend_configs[state.id].url, self._http_for(state.id, _EVENTS_HTTP_TIMEOUT))
            for state in self.fleet
            if state.routable and state.id in self.backend_configs
        ]
        try:
            await startup_check(self.router.strategy, targets)
        except Exception as exc:
            _events.error("tokenizer_parity_failed", error=f"{type(exc).__name__}: {exc}")

    # -- lifecycle --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ProxyApp]:
        """Open the upstream session and start health checks; close both on exit."""
        self._session = create_session(self.config.timeouts.connect)
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                if self.config.health.enabled:
                    await tg.start(self.health.run)
                self._sink = kv_event_sink(self.router.strategy)
                for backend_id in list(self.adapters):
                    self._start_events(backend_id)
                if self.journal is not None:
                    # Admin changes made before this worker started (it may be a restart), before any request.
                    replayed = self.journal.catch_up()
                    self.journal.publish()
                    if replayed:
                        _events.info("admin_changes_replayed", count=replayed)
                    tg.start_soon(self.journal.follow)
                tg.start_soon(self._check_parity)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._task_group = None
            self._event_scopes.clear()
            if self.journal is not None:
                self.journal.close()
            await self._session.close()
            self._session = None
            self.router.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        try:
            async with self.running():
                await send({"type": "lifespan.startup.complete"})
                message = await receive()
        except Exception as exc:  # report to the ASGI server instead of crashing it
            await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
            return
        await send({"type": "lifespan.shutdown.complete"})

    # -- ASGI entry -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            guard = _ResponseGuard(send)
            try:
                await self._dispatch(scope, receive, guard)
            except Exception as exc:
                await self._internal_error(scope, guard, exc)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        methods = self._routes.get(path)
        if methods is None:
            if self.admin is not None and path.startswith("/admin/"):
                await self.admin(scope, receive, send)
                return
            await self._reject(send, 404, f"Unknown route: {scope['method']} {path}.", code="unknown_url")
            return
        handler = methods.get(scope["method"])
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            await self._reject(
                send, 405, f"Method {scope['method']} is not allowed on {path} (allowed: {allow.decode()}).",
                code="method_not_allowed", headers=[(b"allow", allow)],
            )
            return
        await handler(scope, receive, send)

    async def _internal_error(self, scope: Scope, guard: _ResponseGuard, exc: Exception) -> None:
        """Last resort for a bug: log it once, answer 500 in OpenAI's shape unless the response has started.

        When it has, returning leaves it incomplete and the ASGI server closes the connection,
        which is all a client can be told mid-response.
        """
        request_id = scope.get(_SCOPE_REQUEST_ID)
        _events.error(
            "request_failed", request_id=request_id, method=scope.get("method"), path=scope.get("path"),
            response_started=guard.started, error=f"{type(exc).__name__}: {exc}", exc_info=exc,
        )
        if guard.started:
            return
        headers = [(_REQUEST_ID, request_id.encode("latin-1"))] if request_id else []
        await self._reject(
            guard.send, 500, f"The proxy failed to handle this request ({type(exc).__name__}); the error is in its log.",
            code="internal_error", headers=headers,
        )

    async def _parse_request(
        self, raw: bytes, endpoint: Endpoint | None, headers: dict[str, str], request_id: str
    ) -> RouteRequest:
        """`_parse` on the event loop, or in a worker thread for a large body; raises `InvalidBody`."""
        if len(raw) <= _THREAD_PARSE_BYTES:
            body, request = _parse(raw, endpoint, headers, request_id)
        else:
            if self._parse_limiter is None:
                self._parse_limiter = anyio.CapacityLimiter(_THREAD_PARSES)
            body, request = await anyio.to_thread.run_sync(
                _parse, raw, endpoint, headers, request_id, limiter=self._parse_limiter
            )
        if request is not None:
            return request
        try:
            return self._route_request(body, endpoint, headers, request_id)
        except (InvalidRequest, RecursionError) as exc:
            raise _invalid(exc) from None

    def _count_reject(self, status: int, ex: _Exchange | None, message: str) -> None:
        self.metrics.child(self.metrics.rejected, str(status)).inc()
        if ex is not None and not ex.status:
            ex.status, ex.outcome, ex.error = status, "rejected", message

    async def _reject(
        self,
        send: Send,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        ex: _Exchange | None = None,
    ) -> None:
        self._count_reject(status, ex, message)
        await send_error(send, status, message, code=code, param=param, headers=headers or ())

    # -- simple routes ----------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = [
            {"id": m, "object": "model", "created": self._created, "owned_by": "kvroute"} for m in self.all_models()
        ]
        await send_json(send, 200, {"object": "list", "data": data})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        members = list(self.fleet)
        routable = sum(s.routable for s in members)
        body = {"status": "ok" if routable else "unavailable", "backends": len(members), "routable": routable}
        await send_json(send, 200 if routable else 503, body)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.metrics.render(), content_type=CONTENT_TYPE)

    # -- proxied routes ---------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy(scope, receive, send, "chat")

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy(scope, receive, send, "completions")

    async def _passthrough(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy(scope, receive, send, None)

    def _route_request(
        self, body: object, endpoint: Endpoint | None, headers: dict[str, str], request_id: str
    ) -> RouteRequest:
        if endpoint is not None:
            return RouteRequest.from_openai(body, endpoint=endpoint, headers=headers, request_id=request_id)
        # Pass-through routes: route like the equivalent generation request when the body
        # has messages / a prompt / an input, else on the model alone.
        if not isinstance(body, dict):
            raise InvalidRequest(f"The request body must be a JSON object (got {type(body).__name__}).")
        shaped = dict(body)
        if not isinstance(shaped.get("model"), str) or not shaped["model"]:
            models = self.all_models()
            shaped["model"] = models[0] if models else "default"
        if isinstance(shaped.get("messages"), list) and shaped["messages"]:
            return RouteRequest.from_openai(shaped, endpoint="chat", headers=headers, request_id=request_id)
        prompt = shaped.get("prompt", shaped.get("input"))
        if prompt:
            shaped["prompt"] = prompt
            try:
                return RouteRequest.from_openai(shaped, endpoint="completions", headers=headers, request_id=request_id)
            except InvalidRequest:
                pass
        return RouteRequest.from_text("", model=shaped["model"], request_id=request_id)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint | None) -> None:
        started = time.perf_counter()
        declared: int | None = None
        request_id: str | None = None
        route_headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == _CONTENT_LENGTH:
                try:
                    declared = int(value)
                except ValueError:
                    await self._reject(send, 400, f"Content-Length must be an integer (got {value!r}).")
                    return
            elif name == _REQUEST_ID:
                request_id = value.decode("latin-1")[:200] or None
            elif name in _ROUTE_HEADERS:
                route_headers[_ROUTE_HEADERS[name]] = value.decode("latin-1")
        ex = _Exchange(request_id or os.urandom(16).hex(), started)
        scope[_SCOPE_REQUEST_ID] = ex.request_id
        if self._shared_metrics:
            self.metrics.worker_in_flight_child.inc()
        try:
            await self._handle(scope, receive, send, endpoint, ex, declared, route_headers)
        except Exception as exc:
            # Answered by the last-resort handler in __call__ (500, or a cut-off response).
            ex.status = ex.status or 500  # a status already set went out with the response
            ex.outcome, ex.error = "internal_error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self._shared_metrics:
                self.metrics.worker_in_flight_child.dec()
            self._finish(ex)

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        endpoint: Endpoint | None,
        ex: _Exchange,
        declared: int | None,
        route_headers: dict[str, str],
    ) -> None:
        id_header = (_REQUEST_ID, ex.request_id.encode("latin-1"))
        limit = self.config.max_body_bytes
        try:
            raw = await read_body(receive, limit, declared)
        except BodyTooLarge as exc:
            self._count_reject(413, ex, str(exc))
            await send_error_draining(
                receive, send, 413, str(exc), code="request_too_large", headers=[id_header],
                max_bytes=max(4 * limit, _DRAIN_MIN_BYTES), max_seconds=_DRAIN_SECONDS, idle_seconds=_DRAIN_IDLE_SECONDS,
            )
            return
        except ClientGone:
            ex.outcome = "cancelled"
            return
        try:
            request = await self._parse_request(raw, endpoint, route_headers, ex.request_id)
        except InvalidBody as exc:
            await self._reject(send, 400, str(exc), code=exc.code, param=exc.param, headers=[id_header], ex=ex)
            return
        ex.model = request.model
        ex.stream = request.stream
        excluded = self._excluded_for(request.model)
        if excluded is None:
            await self._reject(
                send, 404, f"The model {request.model!r} does not exist (served: {', '.join(self.all_models()) or 'none'}).",
                code="model_not_found", param="model", headers=[id_header], ex=ex,
            )
            return

        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(_watch_disconnect(receive, ex, task))
        try:
            await self._forward(request, raw, scope, send, ex, excluded, id_header)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
            ex.outcome = "cancelled"
        finally:
            watcher.cancel()

    def _finish(self, ex: _Exchange) -> None:
        duration = time.perf_counter() - ex.started
        self.metrics.request_done(ex.backend, ex.outcome, duration if ex.backend != "none" else None)
        if self.config.access_log:
            log.info(
                "request",
                request_id=ex.request_id,
                model=ex.model,
                strategy=self.router.strategy_name,
                backend=ex.backend,
                reason=ex.reason,
                key=f"{ex.key:016x}" if ex.key is not None else None,
                spilled=ex.spilled,
                status=ex.status,
                outcome=ex.outcome,
                attempts=ex.attempts,
                stream=ex.stream,
                ttft_s=round(ex.ttft, 6) if ex.ttft is not None else None,
                duration_s=round(duration, 6),
                error=ex.error,
            )

    async def _forward(
        self,
        request: RouteRequest,
        raw: bytes,
        scope: Scope,
        send: Send,
        ex: _Exchange,
        excluded: frozenset[str],
        id_header: tuple[bytes, bytes],
    ) -> None:
        exclude = set(excluded)
        last: _Failure | None = None
        for _ in range(self.config.max_attempts):
            failure: _Failure | None = None
            try:
                async with self.router.route(request, exclude=exclude) as lease:
                    ex.attempts += 1
                    decision = lease.decision
                    ex.backend, ex.reason, ex.key, ex.spilled = (
                        decision.backend.id, decision.reason, decision.key, decision.spilled
                    )
                    self.metrics.observe_decision(decision.duration_s)
                    if decision.spilled:
                        cause = decision.spill_reason or decision.reason
                        self.metrics.spills.labels(self.router.strategy_name, str(cause)).inc()
                    if self._shared_metrics:
                        gauge = self.metrics.in_flight_child(decision.backend.id)
                        gauge.inc()
                        try:
                            failure = await self._attempt(lease, raw, scope, send, ex, id_header)
                        finally:
                            gauge.dec()
                    else:
                        failure = await self._attempt(lease, raw, scope, send, ex, id_header)
                    if failure is not None:
                        lease.fail(failure.message)
            except NoBackendAvailable as exc:
                if last is None:
                    ex.status, ex.outcome, ex.error = 503, "no_backend", str(exc)
                    await self._reject(
                        send, 503, str(exc), code="no_backend_available",
                        headers=[(b"retry-after", str(self.config.retry_after_s).encode()), id_header],
                    )
                    return
                break
            if failure is None:
                return
            last = failure
            exclude.add(lease.backend.id)
            self.metrics.retries.labels(lease.backend.id, failure.reason).inc()
            if failure.connection:
                self.health.connection_failed(lease.backend.id, failure.message)
            _events.info(
                "attempt_failed", request_id=ex.request_id, backend=lease.backend.id, reason=failure.reason,
                error=failure.message,
            )
        assert last is not None
        ex.status, ex.outcome, ex.error = last.status, "upstream_error" if last.body is not None else "failed", last.message
        if last.body is not None:
            headers = [*last.headers, id_header]
            if self._backend_header is not None:
                headers.append((self._backend_header, ex.backend.encode()))
            await send({"type": "http.response.start", "status": last.status, "headers": headers})
            await send({"type": "http.response.body", "body": last.body, "more_body": False})
        else:
            await self._reject(send, last.status, last.message, code=last.reason, headers=[id_header])

    async def _attempt(
        self,
        lease: Lease,
        raw: bytes,
        scope: Scope,
        send: Send,
        ex: _Exchange,
        id_header: tuple[bytes, bytes],
    ) -> _Failure | None:
        """One try on ``lease.backend``; returns a `_Failure` when nothing reached the client."""
        assert self._session is not None
        backend_id = lease.backend.id
        config = self.backend_configs.get(backend_id)
        path = scope["path"]
        url = lease.backend.url + path + (("?" + scope["query_string"].decode("latin-1")) if scope["query_string"] else "")
        headers = filter_request_headers(
            scope["headers"],
            forward_authorization=self.config.forward_authorization,
            api_key=config.api_key if config is not None else None,
            request_id=ex.request_id,
        )
        timeouts = self.config.timeouts
        sent_at = time.perf_counter()
        response: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout(timeouts.first_byte):
                    # aiohttp warns (ResourceWarning) on raw bytes over 1 MiB: hand it a stream instead.
                    data = raw if len(raw) <= _LARGE_UPSTREAM_BODY else io.BytesIO(raw)
                    response = await self._session.post(url, data=data, headers=headers)
                    first = await response.content.readany()
            except _TRANSPORT_ERRORS as exc:
                if not _is_timeout(exc):
                    return _Failure("connection_error", f"{backend_id}: {type(exc).__name__}: {exc}", connection=True)
                ex.status, ex.outcome = 504, "timeout"
                ex.error = f"no response from {backend_id} within {timeouts.first_byte} s"
                await self._reject(
                    send, 504, f"The backend did not answer within {timeouts.first_byte} s.",
                    code="upstream_timeout", headers=[id_header],
                )
                return None
            status = response.status
            sse = response.content_type == _SSE
            if sse and status < 400:
                ex.ttft = time.perf_counter() - sent_at
                self.metrics.child(self.metrics.ttft, backend_id).observe(ex.ttft)
                return await self._stream(response, first, send, ex, id_header)
            # A complete (non-streamed) body: read it all, then answer or retry.
            parts = [first]
            try:
                while first and not response.content.at_eof():
                    async with asyncio.timeout(timeouts.idle):
                        chunk = await response.content.readany()
                    if not chunk:
                        break
                    parts.append(chunk)
            except _TRANSPORT_ERRORS as exc:
                return _Failure(
                    "connection_error", f"{backend_id}: body cut short: {type(exc).__name__}: {exc}",
                    connection=not _is_timeout(exc),
                )
            body = b"".join(parts)
            out_headers = filter_response_headers(response.raw_headers)
            if status >= 500:
                return _Failure("upstream_5xx", f"{backend_id} answered {status}", status=status, body=body, headers=out_headers)
            sniffer = UsageSniffer()
            sniffer.feed(body)
            self._record_usage(backend_id, sniffer)
            out_headers.append(id_header)
            if self._backend_header is not None:
                out_headers.append((self._backend_header, backend_id.encode()))
            out_headers.append((b"content-length", str(len(body)).encode()))
            ex.status = status
            ex.outcome = "ok" if status < 400 else "client_error"
            ex.response_started = True
            ex.complete = True
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return None
        finally:
            if response is not None:
                if response.content.at_eof():
                    response.release()  # fully read: the connection goes back to the pool
                else:
                    response.close()  # cut short or cancelled: the backend sees the disconnect

    async def _stream(
        self, response: aiohttp.ClientResponse, first: bytes, send: Send, ex: _Exchange, id_header: tuple[bytes, bytes]
    ) -> _Failure | None:
        """Pass SSE events through as they arrive; never split an event on failure."""
        backend_id = ex.backend
        idle = self.config.timeouts.idle
        sniffer = UsageSniffer()
        pending = first
        content = response.content
        try:
            # Wait for the first complete event before committing to this backend, so that
            # a backend dying before it is still a failure the client never sees.
            while not _event_end(pending):
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
                if not chunk:
                    break
                pending += chunk
        except _TRANSPORT_ERRORS as exc:
            return _Failure(
                "connection_error", f"{backend_id}: stream failed before its first event: {type(exc).__name__}: {exc}",
                connection=not _is_timeout(exc),
            )
        cut = _event_end(pending)
        if not cut:
            return _Failure("connection_error", f"{backend_id}: stream ended before its first event", connection=True)

        headers = filter_response_headers(response.raw_headers)
        headers.append(id_header)
        if self._backend_header is not None:
            headers.append((self._backend_header, backend_id.encode()))
        ex.status = response.status
        ex.response_started = True
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        out, pending = pending[:cut], pending[cut:]
        sniffer.feed(out)
        await send({"type": "http.response.body", "body": out, "more_body": True})
        try:
            while True:
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
                if not chunk:
                    break
                if pending:
                    chunk = pending + chunk
                cut = _event_end(chunk)
                if cut == len(chunk):
                    pending = b""
                else:
                    chunk, pending = chunk[:cut], chunk[cut:]
                    if not chunk:
                        continue
                sniffer.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except _TRANSPORT_ERRORS as exc:
            timed_out = _is_timeout(exc)
            why = "went idle" if timed_out else "failed"
            ex.outcome, ex.error = "stream_error", f"{backend_id}: stream {why}: {type(exc).__name__}: {exc}"
            if not timed_out:
                self.health.connection_failed(backend_id, ex.error)
            ex.complete = True
            await send(
                {
                    "type": "http.response.body",
                    "body": _stream_error_event(f"The backend's stream {why} after it started ({backend_id}).", "upstream_stream_error"),
                    "more_body": False,
                }
            )
            self._record_usage(backend_id, sniffer)
            return None
        ex.complete = True
        ex.outcome = "ok"
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        self._record_usage(backend_id, sniffer)
        return None

    def _record_usage(self, backend_id: str, sniffer: UsageSniffer) -> None:
        metrics = self.metrics
        if sniffer.prompt_tokens is not None:
            metrics.child(metrics.prompt_tokens, backend_id).inc(sniffer.prompt_tokens)
        if sniffer.cached_tokens is not None:
            metrics.child(metrics.cached_tokens, backend_id).inc(sniffer.cached_tokens)


async def _watch_disconnect(receive: Receive, ex: _Exchange, task: asyncio.Task[Any]) -> None:
    """Cancel the request's task when its client goes away before the response is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ex.complete:
                ex.client_gone = True
                task.cancel()
            return
