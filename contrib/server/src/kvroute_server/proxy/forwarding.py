"""Forwarding one request upstream: attempts, retries before the first byte, SSE pass-through, disconnects.

`Forwarder.forward` asks the `Router` for a lease, sends the client's original bytes to the
chosen backend and passes the answer back: SSE event by event as it arrives, anything else once
complete. An attempt that fails before any byte reached the client (connection error, 5xx, a
stream that ends before its first event) is retried on another backend, up to ``max_attempts``;
the backends tried so far are the router's ``exclude``, and nothing else is. A client that goes
away cancels the request and the upstream call with it.

What a request went through is kept in an `Exchange`, which the app logs and counts at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import attrs
import structlog

from kvroute.errors import NoBackendAvailable
from kvroute.request import RouteRequest
from kvroute.router import Lease, Router
from kvroute.shadow import ShadowRound
from kvroute.strategy import Decision
from kvroute_server.config import ServerConfig
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.http.asgi import Receive, Scope, Send, dumps, openai_error, send_error
from kvroute_server.http.client import UpstreamPool, UpstreamResponse
from kvroute_server.http.protocol import DISCONNECT_EXTENSION, DisconnectNotice
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.ops.shadow import NoShadows, ProxyShadows
from kvroute_server.proxy.headers import filter_request_headers, filter_response_headers
from kvroute_server.proxy.usage import UsageSniffer

__all__ = ["Exchange", "Forwarder", "count_reject", "reject"]

log = structlog.get_logger(__name__)

_SSE = "text/event-stream"
#: Transport failures: `UpstreamConnectionError` (an ``OSError``) for a connection that failed,
#: ``TimeoutError`` (also one) for our own first-byte and idle timeouts; `_is_timeout` tells them apart.
_TRANSPORT_ERRORS = OSError

Header = tuple[bytes, bytes]


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError)


@attrs.define
class Exchange:
    """What one client request has gone through so far (for the log line and metrics)."""

    request_id: str
    started: float
    status: int = 0
    backend: str = "none"
    outcome: RequestOutcome = RequestOutcome.REJECTED
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
    #: The last attempt's decision, for the status page's decision log (kvroute_server.ops.status).
    decision: Decision | None = None
    #: Every strategy's verdict on this request when shadows are on (kvroute_server.ops.shadow), else None.
    shadow: ShadowRound | None = None


@attrs.define
class _Failure:
    """An attempt that failed before any byte reached the client (may be retried)."""

    reason: str
    message: str
    connection: bool = False
    status: int = 502
    body: bytes | None = None
    headers: list[Header] = attrs.field(factory=list)


async def reject(
    metrics: ProxyMetrics,
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: list[Header] | None = None,
    ex: Exchange | None = None,
) -> None:
    """Answer with an OpenAI-style error of the proxy's own, counted; ``ex`` records it unless it has a status."""
    count_reject(metrics, status, ex, message)
    await send_error(send, status, message, code=code, param=param, headers=headers or ())


def count_reject(metrics: ProxyMetrics, status: int, ex: Exchange | None, message: str) -> None:
    """Count an answer of the proxy's own (``kvroute_rejected_requests``) and record it in ``ex``."""
    metrics.child(metrics.rejected, str(status)).inc()
    if ex is not None and not ex.status:
        ex.status, ex.outcome, ex.error = status, RequestOutcome.REJECTED, message


def _event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in ``data`` (0 when none is complete)."""
    end = data.rfind(b"\n\n")
    end = end + 2 if end >= 0 else 0
    crlf = data.rfind(b"\r\n\r\n")
    if crlf >= 0 and crlf + 4 > end:
        end = crlf + 4
    return end


def _stream_error_event(message: str, code: str) -> bytes:
    body = openai_error(502, message, code=code)
    return b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n"


class Forwarder:
    """Sends requests to the backends the router picks, retrying on another before the first byte."""

    def __init__(
        self,
        config: ServerConfig,
        router: Router,
        backends: BackendSet,
        metrics: ProxyMetrics,
        shadows: ProxyShadows | NoShadows,
    ) -> None:
        self.config = config
        self.router = router
        self.backends = backends
        self.metrics = metrics
        self.shadows = shadows
        #: The proxied requests' own client (keep-alive connections per backend host).
        self.upstream = UpstreamPool(config.timeouts.connect)
        self._shared_metrics = metrics.shared
        self._backend_header = config.backend_header.lower().encode() if config.backend_header else None

    async def forward(
        self,
        request: RouteRequest,
        raw: bytes,
        scope: Scope,
        receive: Receive,
        send: Send,
        ex: Exchange,
        id_header: Header,
    ) -> None:
        """Forward ``raw`` (the body ``request`` was parsed from) and answer; a client leaving cancels it."""
        task = asyncio.current_task()
        assert task is not None
        stop_watching = _watch_client(scope, receive, ex, task)
        try:
            await self._attempts(request, raw, scope, send, ex, id_header)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
            ex.outcome = RequestOutcome.CANCELLED
        finally:
            stop_watching()
            if ex.shadow is not None:
                self.shadows.finished(ex.shadow, ex.outcome, ex.started)

    async def _attempts(
        self, request: RouteRequest, raw: bytes, scope: Scope, send: Send, ex: Exchange, id_header: Header
    ) -> None:
        failed: set[str] = set()  # the router's exclude: only backends that failed this request
        last: _Failure | None = None
        for _ in range(self.config.max_attempts):
            failure: _Failure | None = None
            try:
                with self.router.route(request, exclude=failed) as lease:  # acquire and release are synchronous
                    ex.attempts += 1
                    decision = lease.decision
                    ex.decision = decision  # for the status page's decision log
                    if ex.shadow is None:  # shadows score the first attempt
                        ex.shadow = self.shadows.routed(request, decision, failed)
                    ex.backend, ex.reason, ex.key, ex.spilled = (
                        decision.backend.id,
                        decision.reason,
                        decision.key,
                        decision.spilled,
                    )
                    self.metrics.observe_decision(decision.duration_s)
                    if decision.spilled:
                        cause = decision.spill_reason or decision.reason
                        self.metrics.child(self.metrics.spills, self.router.strategy_name, str(cause)).inc()
                    if self.router.sessions is not None:
                        self.metrics.session_routed(decision, self.router.sessions)
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
                    await _no_backend(self, request, send, ex, id_header, exc)
                    return
                break
            if failure is None:
                return
            last = failure
            failed.add(lease.backend.id)
            self.metrics.child(self.metrics.retries, lease.backend.id, failure.reason).inc()
            if failure.connection:
                self.backends.health.connection_failed(lease.backend.id, failure.message)
            log.info(
                "attempt_failed",
                request_id=ex.request_id,
                backend=lease.backend.id,
                reason=failure.reason,
                error=failure.message,
            )
        assert last is not None
        ex.status, ex.outcome, ex.error = (
            last.status,
            RequestOutcome.UPSTREAM_ERROR if last.body is not None else RequestOutcome.FAILED,
            last.message,
        )
        if last.body is not None:
            headers = [*last.headers, id_header]
            if self._backend_header is not None:
                headers.append((self._backend_header, ex.backend.encode()))
            await send({"type": "http.response.start", "status": last.status, "headers": headers})
            await send({"type": "http.response.body", "body": last.body, "more_body": False})
        else:
            await reject(self.metrics, send, last.status, last.message, code=last.reason, headers=[id_header])

    async def _attempt(
        self, lease: Lease, raw: bytes, scope: Scope, send: Send, ex: Exchange, id_header: Header
    ) -> _Failure | None:
        """One try on ``lease.backend``; returns a `_Failure` when nothing reached the client."""
        backend_id = lease.backend.id
        config = self.backends.config(backend_id)
        query = scope["query_string"]
        target = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        headers = filter_request_headers(
            scope["headers"],
            forward_authorization=self.config.forward_authorization,
            api_key=config.api_key if config is not None else None,
            request_id=ex.request_id,
        )
        timeouts = self.config.timeouts
        sent_at = time.perf_counter()
        response: UpstreamResponse | None = None
        try:
            try:
                deadline = asyncio.get_running_loop().time() + timeouts.first_byte
                response = await self.upstream.post(lease.backend.url, target, raw, headers, deadline)
                first = await response.readany(deadline)
            except _TRANSPORT_ERRORS as exc:
                if not _is_timeout(exc):
                    return _Failure("connection_error", f"{backend_id}: {type(exc).__name__}: {exc}", connection=True)
                ex.status, ex.outcome = 504, RequestOutcome.TIMEOUT
                ex.error = f"no response from {backend_id} within {timeouts.first_byte} s"
                await reject(
                    self.metrics,
                    send,
                    504,
                    f"The backend did not answer within {timeouts.first_byte} s.",
                    code="upstream_timeout",
                    headers=[id_header],
                )
                return None
            status = response.status
            sse = response.content_type == _SSE
            if sse and status < 400:
                ex.ttft = time.perf_counter() - sent_at
                self.metrics.child(self.metrics.ttft, backend_id).observe(ex.ttft)
                return await self._stream(response, first, send, ex, id_header)
            return await self._whole(response, first, send, ex, id_header)
        finally:
            if response is not None:
                if response.at_eof():
                    response.release()  # fully read: the connection goes back to the pool
                else:
                    response.close()  # cut short or cancelled: the backend sees the disconnect

    async def _whole(
        self, response: UpstreamResponse, first: bytes, send: Send, ex: Exchange, id_header: Header
    ) -> _Failure | None:
        """A complete (non-streamed) body: read it all, then answer, or fail on a 5xx for a retry."""
        backend_id = ex.backend
        parts = [first]
        try:
            while first and not response.at_eof():
                chunk = await response.readany(asyncio.get_running_loop().time() + self.config.timeouts.idle)
                if not chunk:
                    break
                parts.append(chunk)
        except _TRANSPORT_ERRORS as exc:
            return _Failure(
                "connection_error",
                f"{backend_id}: body cut short: {type(exc).__name__}: {exc}",
                connection=not _is_timeout(exc),
            )
        body = b"".join(parts)
        status = response.status
        out_headers = filter_response_headers(response.raw_headers)
        if status >= 500:
            return _Failure(
                "upstream_5xx", f"{backend_id} answered {status}", status=status, body=body, headers=out_headers
            )
        sniffer = UsageSniffer()
        sniffer.feed(body)
        self._record_usage(backend_id, sniffer)
        out_headers.append(id_header)
        if self._backend_header is not None:
            out_headers.append((self._backend_header, backend_id.encode()))
        out_headers.append((b"content-length", str(len(body)).encode()))
        ex.status = status
        ex.outcome = RequestOutcome.OK if status < 400 else RequestOutcome.CLIENT_ERROR
        ex.response_started = True
        ex.complete = True
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return None

    async def _stream(
        self, response: UpstreamResponse, first: bytes, send: Send, ex: Exchange, id_header: Header
    ) -> _Failure | None:
        """Pass SSE events through as they arrive; never split an event on failure."""
        backend_id = ex.backend
        idle = self.config.timeouts.idle
        loop = asyncio.get_running_loop()
        sniffer = UsageSniffer()
        pending = first
        try:
            # Wait for the first complete event before committing to this backend, so that
            # a backend dying before it is still a failure the client never sees.
            while not _event_end(pending):
                chunk = await response.readany(loop.time() + idle)
                if not chunk:
                    break
                pending += chunk
        except _TRANSPORT_ERRORS as exc:
            return _Failure(
                "connection_error",
                f"{backend_id}: stream failed before its first event: {type(exc).__name__}: {exc}",
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
                chunk = await response.readany(loop.time() + idle)
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
            ex.outcome = RequestOutcome.STREAM_ERROR
            ex.error = f"{backend_id}: stream {why}: {type(exc).__name__}: {exc}"
            if not timed_out:
                self.backends.health.connection_failed(backend_id, ex.error)
            ex.complete = True
            await send(
                {
                    "type": "http.response.body",
                    "body": _stream_error_event(
                        f"The backend's stream {why} after it started ({backend_id}).", "upstream_stream_error"
                    ),
                    "more_body": False,
                }
            )
            self._record_usage(backend_id, sniffer)
            return None
        ex.complete = True
        ex.outcome = RequestOutcome.OK
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        self._record_usage(backend_id, sniffer)
        return None

    def _record_usage(self, backend_id: str, sniffer: UsageSniffer) -> None:
        metrics = self.metrics
        if sniffer.prompt_tokens is not None:
            metrics.child(metrics.prompt_tokens, backend_id).inc(sniffer.prompt_tokens)
        if sniffer.cached_tokens is not None:
            metrics.child(metrics.cached_tokens, backend_id).inc(sniffer.cached_tokens)


async def _no_backend(
    forwarder: Forwarder, request: RouteRequest, send: Send, ex: Exchange, id_header: Header, exc: NoBackendAvailable
) -> None:
    """No backend could take the first attempt: 404 when none serves the model, else 503."""
    if not forwarder.backends.serves_anywhere(request.model):
        served = ", ".join(forwarder.backends.all_models()) or "none"
        await reject(
            forwarder.metrics,
            send,
            404,
            f"The model {request.model!r} does not exist (served: {served}).",
            code="model_not_found",
            param="model",
            headers=[id_header],
            ex=ex,
        )
        return
    ex.status, ex.outcome, ex.error = 503, RequestOutcome.NO_BACKEND, str(exc)
    await reject(
        forwarder.metrics,
        send,
        503,
        str(exc),
        code="no_backend_available",
        headers=[(b"retry-after", str(forwarder.config.retry_after_s).encode()), id_header],
    )


def _watch_client(scope: Scope, receive: Receive, ex: Exchange, task: asyncio.Task[Any]) -> Callable[[], object]:
    """Have ``task`` cancelled if the client leaves before the response is complete; returns the undo.

    Under kvroute's own HTTP protocol the server calls back (the ``kvroute.disconnect`` extension,
    `kvroute_server.http.protocol`); under any other ASGI server a task waits in ``receive()`` for
    ``http.disconnect``.
    """
    extensions = scope.get("extensions")
    notice: DisconnectNotice | None = extensions.get(DISCONNECT_EXTENSION) if extensions else None
    if notice is not None:
        notice.callback = lambda: _client_gone(ex, task)
        return notice.forget
    return asyncio.create_task(_watch_disconnect(receive, ex, task)).cancel


def _client_gone(ex: Exchange, task: asyncio.Task[Any]) -> None:
    """Cancel the request's task: its client went away before the response was complete."""
    if not ex.complete:
        ex.client_gone = True
        task.cancel()


async def _watch_disconnect(receive: Receive, ex: Exchange, task: asyncio.Task[Any]) -> None:
    """Wait in ``receive()`` for ``http.disconnect`` (ASGI servers without the disconnect extension)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_gone(ex, task)
            return
