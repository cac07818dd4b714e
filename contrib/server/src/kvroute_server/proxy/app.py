"""The routing proxy as an ASGI application: its route table, request parsing, lifespan.

``ProxyApp(config)`` is an ASGI callable (run it with uvicorn, see `kvroute_server.cli`).
Per request: read and validate the body, build a `RouteRequest`, and hand it to the
`Forwarder` (`kvroute_server.proxy.forwarding`), which asks the `Router` for a lease, forwards the
original bytes to the chosen backend and passes the answer back, retrying before the first
byte (see docs/serve.md). The backends themselves (membership, health, adapters' tasks) are the
`BackendSet` (`kvroute_server.fleet.backends`), which the admin API (`kvroute_server.ops.admin`) and
discovery (`kvroute_server.fleet.discovery`) change.

The rooms import one way: ``app`` -> ``forwarding``, ``admin`` -> ``backends`` -> ``health``;
nothing imports ``app``, except the entry points that run it (``cli``, ``workers``).

Hostile input: every body the proxy cannot route gets a 4xx in OpenAI's error shape
(`kvroute_server.http.asgi.loads_body` turns any parse failure into `InvalidBody`), a body over
the limit gets its 413 before the connection closes, bodies over 1 MiB are parsed in a
worker thread so that they do not stall other requests, and an unexpected exception is
logged once and answered 500 with a JSON body.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import anyio.to_thread
import structlog

from kvroute.adapters import kv_event_sink
from kvroute.errors import InvalidRequest
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.request import AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, Endpoint, RouteRequest
from kvroute.router import Router
from kvroute.session_ids import SessionSource, parse_sources
from kvroute.sessions import Sessions
from kvroute.strategy import HasPromptTokenizer
from kvroute_server.config import ServerConfig
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.fleet.discovery import Discovery
from kvroute_server.fleet.warm_join import WarmJoin
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
    send_bytes,
    send_error_draining,
    send_json,
)
from kvroute_server.ops.admin import AdminApi
from kvroute_server.ops.journal import ONE_PROCESS, WorkerContext
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.ops.peers import PeerSync
from kvroute_server.ops.shadow import ProxyShadows
from kvroute_server.ops.status import StatusRoutes
from kvroute_server.ops.tracing import create_tracing
from kvroute_server.proxy.forwarding import Exchange, Forwarder, count_reject, reject
from kvroute_server.proxy.slo import SloHost, slo_choice

__all__ = ["ProxyApp"]

log = structlog.get_logger(__name__)
#: The access log (``--access-log``) has a logger name of its own, so that a host can route or filter it apart.
access_log = structlog.get_logger("kvroute_server.access")

_ROUTE_HEADERS = {
    AFFINITY_HEADER.encode(): AFFINITY_HEADER,
    LORA_HEADER.encode(): LORA_HEADER,
}
_REQUEST_ID = REQUEST_ID_HEADER.encode()
_CONTENT_LENGTH = b"content-length"
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
#: Scope key under which `_proxy` leaves the request id for the last-resort error answer.
_SCOPE_REQUEST_ID = "kvroute.request_id"


def _invalid(exc: InvalidRequest | RecursionError) -> InvalidBody:
    if isinstance(exc, RecursionError):
        return InvalidBody("The request body nests too deeply to be routed.", code="invalid_json")
    return InvalidBody(str(exc), code="invalid_value", param=exc.param)


def _parse(
    raw: bytes,
    endpoint: Endpoint | None,
    headers: dict[str, str],
    request_id: str,
    sources: Sequence[SessionSource],
) -> tuple[object, RouteRequest | None]:
    """The body's JSON and, on the generation routes, its `RouteRequest`; any fault is an `InvalidBody`.

    Touches no shared state, so it may run in a worker thread.
    """
    body = loads_body(raw)
    if endpoint is None:
        return body, None
    try:
        return body, RouteRequest.from_openai(
            body, endpoint=endpoint, headers=headers, request_id=request_id, session_sources=sources
        )
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


async def _internal_error(metrics: ProxyMetrics, scope: Scope, guard: _ResponseGuard, exc: Exception) -> None:
    """Last resort for a bug: log it once, answer 500 in OpenAI's shape unless the response has started.

    When it has, returning leaves it incomplete and the ASGI server closes the connection,
    which is all a client can be told mid-response.
    """
    request_id = scope.get(_SCOPE_REQUEST_ID)
    log.error(
        "request_failed",
        request_id=request_id,
        method=scope.get("method"),
        path=scope.get("path"),
        response_started=guard.started,
        error=f"{type(exc).__name__}: {exc}",
        exc_info=exc,
    )
    if guard.started:
        return
    headers = [(_REQUEST_ID, request_id.encode("latin-1"))] if request_id else []
    await reject(
        metrics,
        guard.send,
        500,
        f"The proxy failed to handle this request ({type(exc).__name__}); the error is in its log.",
        code="internal_error",
        headers=headers,
    )


def _sessions(config: ServerConfig) -> tuple[tuple[SessionSource, ...], dict[bytes, str], Sessions | None]:
    """The session-id sources, the request headers the parser reads (the route headers and the sources'),
    and the router's bindings; no sources and no bindings when sessions are off."""
    settings = config.sessions
    sources = parse_sources(settings.sources) if settings.enabled else ()
    headers = dict(_ROUTE_HEADERS)
    for source in sources:
        if source.kind == "header":
            headers[source.name.encode("latin-1")] = source.name
    if not settings.enabled:
        return sources, headers, None
    sessions = Sessions(ttl_s=settings.ttl, max_sessions=settings.max_sessions, agree=settings.agree)
    sessions.conversations = settings.conversations
    return sources, headers, sessions


class ProxyApp:
    """The OpenAI-compatible routing proxy (an ASGI 3 application with lifespan).

    Its parts: ``fleet`` and ``backends`` (the `BackendSet`), ``router``, ``forwarder``,
    ``metrics``, ``routes`` (the `RouteTable`) and the optional ones, each a null object that does
    nothing when off: ``discovery``, ``warm_join``, ``shadows``, ``admin`` (on with an admin token)
    and ``status``.

    ``worker`` is set in the workers of ``kvroute serve --workers N`` (see
    `kvroute_server.ops.workers`): metrics are then shared between the workers and admin
    changes reach all of them through the shared journal.
    """

    def __init__(
        self, config: ServerConfig, *, plugins: PluginManager | None = None, worker: WorkerContext | None = None
    ) -> None:
        self.config = config
        self.worker = worker or ONE_PROCESS
        self.plugins = plugins or PluginManager()
        self.fleet = Fleet()
        shared = self.worker.count > 1 and self.worker.shared_metrics
        self.metrics = ProxyMetrics(self.fleet, config.strategy, shared=shared, worker=str(self.worker.index))
        self.backends = BackendSet(
            self.fleet,
            self.plugins,
            config.health,
            self.metrics,
            connect_timeout=config.timeouts.connect,
            backends=config.backends,
        )
        # Each optional part is an object that does nothing when it is off, so none is checked for here.
        self.discovery = Discovery.create(
            config.discovery, config.discovery_policy, self.backends, self.metrics, self.plugins
        )
        self.warm_join = WarmJoin.create(config.warm_join, self.backends, self.plugins)  # before the router: a hook
        # Sessions (docs/serve.md, "Sessions"): the sources the request parser reads, and the router's bindings.
        self._session_sources, self._route_headers, sessions = _sessions(config)
        self.router = Router.create(
            self.fleet, config.strategy, config.options, plugins=self.plugins, sessions=sessions, slo=slo_choice(config)
        )
        self.peers = PeerSync.create(config, self.router, self.metrics, self.plugins)  # replica sync (--peer*)
        # Shadow strategies (docs/serve.md, "Shadow strategies").
        self.shadows = ProxyShadows.create(config, self.fleet, self.metrics, self.plugins)
        # Objectives and admission (docs/serve.md, "Objectives and admission"); admission is off by default.
        self.slo = SloHost(config, self.router, self.metrics)
        self.forwarder = Forwarder(config, self.router, self.backends, self.metrics, self.shadows, self.slo)
        self.admin = AdminApi.create(self.backends, config.admin_token, worker=self.worker)
        # OpenTelemetry spans (docs/tracing.md): NoTracing unless an OTLP endpoint is configured.
        self.tracing = create_tracing(config.tracing, self.fleet, self.metrics, str(self.worker.index))
        # The status page (docs/serve.md, "Status page").
        self.status = StatusRoutes.create(
            config, self.fleet, self.backends, self.router, self.metrics, self.discovery, self.worker
        )
        self._shared_metrics = shared
        self._parse_limiter: anyio.CapacityLimiter | None = None
        self._created = int(time.time())
        self.routes: RouteTable[App] = RouteTable()
        self.routes.add("POST", "/v1/chat/completions", self._chat)
        self.routes.add("POST", "/v1/completions", self._completions)
        self.routes.add("GET", "/v1/models", self._models)
        self.routes.add("GET", "/health", self._health)
        self.routes.add("GET", "/metrics", self._metrics)
        self.status.add_routes(self.routes)
        self.peers.add_routes(self.routes)
        for path in config.passthrough_paths:  # never in place of a route above
            if path not in self.routes:
                self.routes.add("POST", path, self._passthrough)
        self.admin.add_routes(self.routes)  # under /admin/, after every exact path

    # -- lifecycle --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ProxyApp]:
        """Run the backend set (upstream session, health, adapters), the admin journal and the parity check."""
        strategy = self.router.strategy
        try:
            async with self.backends.running(kv_event_sink(strategy)), anyio.create_task_group() as tg:
                await tg.start(self.discovery.run)  # each source's first answer, before any request
                # Admin changes made before this worker started (it may be a restart), before any request.
                await tg.start(self.admin.follow)
                await tg.start(self.warm_join.run, self.router)  # after the initial fleet: later adds are joins
                await tg.start(self.peers.run)
                if isinstance(strategy, HasPromptTokenizer) and strategy.prompt_tokenizer is not None:
                    tg.start_soon(self.backends.check_parity, strategy)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self.forwarder.upstream.close()  # the forwarded requests' idle keep-alive connections
            self.router.close()
            self.shadows.close()
            self.tracing.close()  # export what is queued, bounded in time

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
                await _internal_error(self.metrics, scope, guard, exc)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.routes.find(scope["method"], scope["path"])
        if isinstance(found, Refusal):
            await reject(self.metrics, send, found.status, found.message, code=found.code, headers=list(found.headers))
            return
        handler, _ = found
        await handler(scope, receive, send)

    async def _parse_request(
        self, raw: bytes, endpoint: Endpoint | None, headers: dict[str, str], request_id: str
    ) -> RouteRequest:
        """`_parse` on the event loop, or in a worker thread for a large body; raises `InvalidBody`."""
        if len(raw) <= _THREAD_PARSE_BYTES:
            body, request = _parse(raw, endpoint, headers, request_id, self._session_sources)
        else:
            if self._parse_limiter is None:
                self._parse_limiter = anyio.CapacityLimiter(_THREAD_PARSES)
            body, request = await anyio.to_thread.run_sync(
                _parse, raw, endpoint, headers, request_id, self._session_sources, limiter=self._parse_limiter
            )
        if request is not None:
            return request
        try:
            return self._route_request(body, endpoint, headers, request_id)
        except (InvalidRequest, RecursionError) as exc:
            raise _invalid(exc) from None

    # -- simple routes ----------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = [
            {"id": m, "object": "model", "created": self._created, "owned_by": "kvroute"}
            for m in self.backends.all_models()
        ]
        await send_json(send, 200, {"object": "list", "data": data})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        members = list(self.fleet)
        routable = sum(s.routable for s in members)
        body: dict[str, object] = {"status": "ok" if routable else "unavailable", "backends": len(members)}
        body["routable"] = routable
        if self.config.discovery:
            body["discovery"] = self.discovery.describe()
        await send_json(send, 200 if routable else 503, body)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, content_type = self.metrics.exposition(next((v for k, v in scope["headers"] if k == b"accept"), b""))
        await send_bytes(send, 200, body, content_type=content_type)

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
        sources = self._session_sources
        if endpoint is not None:
            return RouteRequest.from_openai(
                body, endpoint=endpoint, headers=headers, request_id=request_id, session_sources=sources
            )
        # Pass-through routes: route like the equivalent generation request when the body
        # has messages / a prompt / an input, else on the model alone.
        if not isinstance(body, dict):
            raise InvalidRequest(f"The request body must be a JSON object (got {type(body).__name__}).")
        shaped = dict(body)
        if not isinstance(shaped.get("model"), str) or not shaped["model"]:
            models = self.backends.all_models()
            shaped["model"] = models[0] if models else "default"
        if isinstance(shaped.get("messages"), list) and shaped["messages"]:
            return RouteRequest.from_openai(
                shaped, endpoint="chat", headers=headers, request_id=request_id, session_sources=sources
            )
        prompt = shaped.get("prompt", shaped.get("input"))
        if prompt:
            shaped["prompt"] = prompt
            try:
                return RouteRequest.from_openai(
                    shaped, endpoint="completions", headers=headers, request_id=request_id, session_sources=sources
                )
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
                    await reject(self.metrics, send, 400, f"Content-Length must be an integer (got {value!r}).")
                    return
            elif name == _REQUEST_ID:
                request_id = value.decode("latin-1")[:200] or None
            elif name in self._route_headers:
                route_headers[self._route_headers[name]] = value.decode("latin-1")
        ex = Exchange(request_id or os.urandom(16).hex(), started)
        ex.trace = self.tracing.start(scope, ex.request_id)
        scope[_SCOPE_REQUEST_ID] = ex.request_id
        if self._shared_metrics:
            self.metrics.worker_in_flight_child.inc()
        try:
            await self._handle(scope, receive, send, endpoint, ex, declared, route_headers)
        except Exception as exc:
            # Answered by the last-resort handler in __call__ (500, or a cut-off response).
            ex.status = ex.status or 500  # a status already set went out with the response
            ex.outcome, ex.error = RequestOutcome.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
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
        ex: Exchange,
        declared: int | None,
        route_headers: dict[str, str],
    ) -> None:
        id_header = (_REQUEST_ID, ex.request_id.encode("latin-1"))
        limit = self.config.max_body_bytes
        try:
            raw = await read_body(receive, limit, declared)
        except BodyTooLarge as exc:
            count_reject(self.metrics, 413, ex, str(exc))
            await send_error_draining(
                receive,
                send,
                413,
                str(exc),
                code="request_too_large",
                headers=[id_header],
                max_bytes=max(4 * limit, _DRAIN_MIN_BYTES),
                max_seconds=_DRAIN_SECONDS,
                idle_seconds=_DRAIN_IDLE_SECONDS,
            )
            return
        except ClientGone:
            ex.outcome = RequestOutcome.CANCELLED
            return
        try:
            request = await self._parse_request(raw, endpoint, route_headers, ex.request_id)
        except InvalidBody as exc:
            await reject(self.metrics, send, 400, str(exc), code=exc.code, param=exc.param, headers=[id_header], ex=ex)
            return
        request = self.slo.apply(request, scope["headers"])
        ex.model = request.model
        ex.stream = request.stream
        if request.session_ignored is not None:
            self.metrics.child(self.metrics.session_ids_ignored, request.session_ignored).inc()
        await self.forwarder.forward(request, raw, scope, receive, send, ex, id_header)

    def _finish(self, ex: Exchange) -> None:
        duration = time.perf_counter() - ex.started
        self.metrics.request_done(ex.backend, ex.outcome, duration if ex.backend != "none" else None, ex.trace.exemplar)
        ex.trace.end(ex, duration)
        self.status.finished(ex, duration)
        self.slo.finished(ex)
        if self.config.access_log:
            _access_line(ex, self.router.strategy_name, duration)


def _access_line(ex: Exchange, strategy: str, duration: float) -> None:
    """The access log's one line per request (``--access-log``, on by default)."""
    access_log.bind().info(  # bind(): skips the lazy proxy's failed attribute lookup (0.4 µs)
        "request",
        request_id=ex.request_id,
        model=ex.model,
        strategy=strategy,
        backend=ex.backend,
        reason=ex.reason,
        key=f"{ex.key:016x}" if ex.key is not None else None,
        spilled=ex.spilled,
        status=ex.status,
        outcome=ex.outcome.value,  # the plain word, whatever renderer the host configured
        attempts=ex.attempts,
        stream=ex.stream,
        ttft_s=round(ex.ttft, 6) if ex.ttft is not None else None,
        duration_s=round(duration, 6),
        error=ex.error,
    )
