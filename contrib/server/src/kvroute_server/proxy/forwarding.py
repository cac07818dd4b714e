"""Forwarding one request upstream: attempts, retries before the first byte, SSE pass-through, disconnects.

`Forwarder.forward` asks the `Router` for a lease, sends the client's original bytes to the chosen backend and
passes the answer back: SSE event by event as it arrives, anything else once complete. An attempt that fails
before any byte reached the client (connection error, 5xx, a stream that ends before its first event, an answer
that is not a completion: `proxy.answers`, no first byte within its deadline) is retried on another backend, up
to ``max_attempts``; the backends tried so far are the router's ``exclude``, and nothing else is. A client that
goes away cancels the request and the upstream call with it.

Every attempt's outcome goes to the outlier detector (`kvroute_server.fleet.outliers`), which also sets each
attempt's first-byte deadline from the fleet's first-byte times for like requests; the last attempt, or one with
no other candidate left, waits the whole ``first_byte`` timeout.

What a request went through is kept in an `Exchange`, which the app logs and counts at the end.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from kvroute.errors import NoBackendAvailable
from kvroute.ranks import rank_for
from kvroute.request import RouteRequest
from kvroute.router import Lease, Router
from kvroute_server.config import ServerConfig
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.fleet.outliers import likeness
from kvroute_server.http.asgi import Receive, Scope, Send, send_error
from kvroute_server.http.client import UpstreamPool, UpstreamResponse
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.ops.shadow import NoShadows, ProxyShadows
from kvroute_server.proxy.answers import prompt_tokens_estimate
from kvroute_server.proxy.client_watch import watch_client
from kvroute_server.proxy.headers import filter_request_headers
from kvroute_server.proxy.relay import Exchange, Failure, Header, relay_stream, relay_whole
from kvroute_server.proxy.slo import SloHost

__all__ = ["Exchange", "Forwarder", "count_reject", "reject"]

log = structlog.get_logger(__name__)

_SSE = "text/event-stream"
#: Transport failures: `UpstreamConnectionError` (an ``OSError``) for a connection that failed,
#: ``TimeoutError`` (also one) for our own first-byte and idle timeouts; `_is_timeout` tells them apart.
_TRANSPORT_ERRORS = OSError


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError)


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


class Forwarder:
    """Sends requests to the backends the router picks, retrying on another before the first byte."""

    def __init__(
        self,
        config: ServerConfig,
        router: Router,
        backends: BackendSet,
        metrics: ProxyMetrics,
        shadows: ProxyShadows | NoShadows,
        slo: SloHost | None = None,
    ) -> None:
        self.config = config
        #: Objectives, admission and the latency predictor's observations (`kvroute_server.proxy.slo`).
        self.slo = slo or SloHost(config, router, metrics)
        self.router = router
        self.backends = backends
        self.metrics = metrics
        self.shadows = shadows
        #: The proxied requests' own client (keep-alive connections per backend host).
        self.upstream = UpstreamPool(config.timeouts.connect)
        self._shared_metrics = metrics.shared
        self.backend_header = config.backend_header.lower().encode() if config.backend_header else None
        self.outliers = backends.health.outliers
        self.outliers.configure(config.outliers, config.timeouts)

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
        stop_watching = watch_client(scope, receive, ex, task)
        send = ex.trace.counting(send)  # the same ``send`` when tracing is off
        try:
            if await self.slo.admission.admit(request, send, ex, id_header):  # False: answered (shed)
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
        failed: set[str] = set()  # backends that failed this request: never tried again
        avoid = failed  # the router's exclude: those, and on a retry the backends whose last attempt failed
        last: Failure | None = None
        ex.prompt_tokens = prompt_tokens_estimate(request.token_ids, request.text)
        ex.max_tokens = request.max_tokens
        for _ in range(self.config.max_attempts):
            failure: Failure | None = None
            try:
                with self.router.route(request, exclude=avoid) as lease:  # acquire and release are synchronous
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
                    ex.trace.routed(request, decision, avoid, ex.shadow)
                    if self._shared_metrics:
                        gauge = self.metrics.in_flight_child(decision.backend.id)
                        gauge.inc()
                        try:
                            failure = await self._attempt(lease, request, raw, scope, send, ex, id_header, failed)
                        finally:
                            gauge.dec()
                    else:
                        failure = await self._attempt(lease, request, raw, scope, send, ex, id_header, failed)
                    ex.trace.attempt_done(failure, ex.status)
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
            avoid = self._avoid(request, failed, ex.attempts + 1 >= self.config.max_attempts)
            self.metrics.child(self.metrics.retries, lease.backend.id, failure.reason).inc()
            self.outliers.failed(lease.backend.id, failure.reason, deadline=failure.deadline)
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
            if self.backend_header is not None:
                headers.append((self.backend_header, ex.backend.encode()))
            await send({"type": "http.response.start", "status": last.status, "headers": headers})
            await send({"type": "http.response.body", "body": last.body, "more_body": False})
        else:
            await reject(self.metrics, send, last.status, last.message, code=last.reason, headers=[id_header])

    def _avoid(self, request: RouteRequest, failed: set[str], last: bool) -> set[str]:
        """What a retry excludes: the backends that failed this request and, while others are left, for the last
        attempt those not known to answer, else those whose last attempt failed (a fleet with several faulty
        engines should not spend a request's attempts on them)."""
        fleet = self.backends.fleet
        choices = [self.outliers.untrusted(s.id for s in fleet)] if last else []
        choices.append(self.outliers.suspects())
        for doubtful in choices:
            wider = failed | doubtful
            if wider != failed and fleet.candidates(request.model, wider):
                return wider
        return failed

    def _deadline(self, request: RouteRequest, ex: Exchange, backend_id: str, failed: set[str]) -> float:
        """The attempt's first-byte deadline: the hard timeout for the last attempt or when no other backend is left."""
        hard = self.config.timeouts.first_byte
        if ex.attempts >= self.config.max_attempts:
            return hard
        soft = self.outliers.deadline(likeness(request.stream, ex.prompt_tokens, request.max_tokens))
        if soft < hard and not self.backends.fleet.candidates(request.model, {*failed, backend_id}):
            return hard
        return soft

    async def _attempt(
        self,
        lease: Lease,
        request: RouteRequest,
        raw: bytes,
        scope: Scope,
        send: Send,
        ex: Exchange,
        id_header: Header,
        failed: set[str],
    ) -> Failure | None:
        """One try on ``lease.backend``; returns a `Failure` when nothing reached the client."""
        backend_id = lease.backend.id
        config = self.backends.config(backend_id)
        query = scope["query_string"]
        target = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        ex.rank = rank = rank_for(lease.decision, lease.state)
        forged: list[str] = []
        headers = filter_request_headers(
            scope["headers"],
            forward_authorization=self.config.forward_authorization,
            api_key=config.api_key if config is not None else None,
            request_id=ex.request_id,
            rank=rank,
            forged=forged,
        )
        ex.trace.attempt(backend_id, ex.attempts, headers)  # its span, and its context into the headers
        if forged and ex.attempts == 1:
            self.metrics.child(self.metrics.dropped_headers, forged[0]).inc()
        if rank is not None:
            self.metrics.child(self.metrics.rank_requests, backend_id, str(rank)).inc()
        timeouts = self.config.timeouts
        seconds = self._deadline(request, ex, backend_id, failed)
        sent_at = time.perf_counter()
        response: UpstreamResponse | None = None
        try:
            try:
                deadline = asyncio.get_running_loop().time() + seconds
                response = await self.upstream.post(lease.backend.url, target, raw, headers, deadline)
                first = await response.readany(deadline)
            except _TRANSPORT_ERRORS as exc:
                if not _is_timeout(exc):
                    return Failure("connection_error", f"{backend_id}: {type(exc).__name__}: {exc}", connection=True)
                if seconds < timeouts.first_byte:  # cancelled (the connection closes) and retried elsewhere
                    message = f"{backend_id}: no first byte within its {seconds:.3g} s deadline"
                    return Failure("first_byte_deadline", message, status=504, deadline=True)
                self.outliers.failed(backend_id, "timeout", deadline=True)
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
            first_byte = time.perf_counter() - sent_at
            ex.trace.first_byte(first_byte, status)
            if sse and status < 400:
                ex.ttft = first_byte
                self.metrics.child(self.metrics.ttft, backend_id).observe(ex.ttft, ex.trace.exemplar)
                self.slo.first_byte(request, first_byte)
                failure = await relay_stream(self, response, first, send, ex, id_header)
                if failure is None and ex.outcome is RequestOutcome.OK:
                    self.slo.stream_done(request, ex, time.perf_counter() - sent_at)
                return failure
            return await relay_whole(self, response, first, send, ex, id_header, first_byte)
        finally:
            if response is not None:
                if response.at_eof():
                    response.release()  # fully read: the connection goes back to the pool
                else:
                    response.close()  # cut short or cancelled: the backend sees the disconnect


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
