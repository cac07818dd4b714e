"""Tracing on: the proxy's OpenTelemetry spans (imported by `kvroute_server.ops.tracing` only when tracing is on).

See `kvroute_server.ops.tracing` for what the spans are and where the request path calls them.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry.propagate import get_global_textmap
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer, set_span_in_context
from prometheus_client import Counter

import kvroute_tracing
from kvroute.fleet import Fleet
from kvroute.ranks import RANK_HEADER
from kvroute.request import RouteRequest
from kvroute.strategy import Decision
from kvroute_server.http.asgi import Scope, Send
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_tracing import ExportSettings, decision_attributes, names, request_attributes

if TYPE_CHECKING:
    from kvroute.shadow import ShadowRound

__all__ = ["LiveTrace", "ProxyTracing"]

log = structlog.get_logger(__name__)

#: Request headers the W3C propagators read (only these are decoded for extraction).
_CONTEXT_HEADERS = frozenset({b"traceparent", b"tracestate", b"baggage"})
#: Outcomes that mark the server span as an error (the client got no good answer, and not by its own doing).
_ERRORS = frozenset(
    {
        RequestOutcome.UPSTREAM_ERROR,
        RequestOutcome.FAILED,
        RequestOutcome.STREAM_ERROR,
        RequestOutcome.TIMEOUT,
        RequestOutcome.NO_BACKEND,
        RequestOutcome.INTERNAL_ERROR,
    }
)


class ProxyTracing:
    """Tracing on: a tracer provider of this app's own, exporting over OTLP from a background thread."""

    enabled = True

    def __init__(self, settings: ExportSettings, fleet: Fleet, metrics: ProxyMetrics, worker: str) -> None:
        self.settings = settings
        self._fleet = fleet
        registry = metrics.registry
        self.dropped = Counter(
            "kvroute_trace_spans_dropped",
            "Finished spans not exported: the export queue was full, or the collector failed to take them.",
            ["reason"],
            registry=registry,
        )
        self._dropped = {reason: self.dropped.labels(reason) for reason in ("queue_full", "export_failed")}
        self.provider, self.processor = kvroute_tracing.build_provider(
            settings,
            on_drop=self._count_drop,
            resource_attributes={
                "service.instance.id": f"{os.uname().nodename}:{os.getpid()}",
                "kvroute.worker": worker,
            },
        )
        self.tracer: Tracer = self.provider.get_tracer(kvroute_tracing.names.SCOPE)
        self.propagator = get_global_textmap()  # OTEL_PROPAGATORS; by default W3C trace context and baggage
        log.info("tracing_on", endpoint=settings.endpoint, protocol=settings.protocol, worker=worker)

    def _count_drop(self, reason: str, count: int) -> None:
        self._dropped[reason].inc(count)

    def start(self, scope: Scope, request_id: str) -> LiveTrace:
        """The request's server span, continuing the client's trace context if it sent one."""
        return LiveTrace(self, scope, request_id)

    def candidates(self, model: str, exclude: set[str]) -> list[str]:
        return [state.id for state in self._fleet.candidates(model, exclude)]

    def close(self) -> None:
        """Export what is queued (bounded in time) and stop the export thread."""
        self.processor.shutdown()


class LiveTrace:
    """One traced request: the server span, the current attempt's span, what the attempts sent.

    A request the sampler left out costs the server span's sampling decision and one ``traceparent`` (flag
    ``00``, the server span's id) written into each attempt's headers: no other span is started.
    """

    __slots__ = (
        "_attempt",
        "_bytes",
        "_context",
        "_retry_cause",
        "_sent_at",
        "_tracing",
        "_unsampled",
        "exemplar",
        "server",
    )

    def __init__(self, tracing: ProxyTracing, scope: Scope, request_id: str) -> None:
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _CONTEXT_HEADERS
        }
        parent = tracing.propagator.extract(carrier) if carrier else None
        method = scope.get("method", "POST")
        path = scope.get("path", "")
        self._tracing = tracing
        self.server: Span = tracing.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={names.HTTP_METHOD: method, names.URL_PATH: path, names.REQUEST_ID: request_id},
        )
        self._context = set_span_in_context(self.server)
        span_context = self.server.get_span_context()
        self._unsampled: dict[str, str] | None = None
        if span_context.trace_flags.sampled:
            self.exemplar: dict[str, str] | None = {"trace_id": f"{span_context.trace_id:032x}"}
        else:
            self.exemplar = None
            self._unsampled = {}
            tracing.propagator.inject(self._unsampled, context=self._context)
        self._attempt: Span | None = None
        self._bytes = 0
        self._sent_at = 0
        self._retry_cause: str | None = None

    def counting(self, send: Send) -> Send:
        if self._unsampled is not None:
            return send

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.body":
                self._bytes += len(message.get("body", b""))
            await send(message)

        return counted

    def routed(self, request: RouteRequest, decision: Decision, exclude: set[str], shadow: ShadowRound | None) -> None:
        if self._unsampled is not None:
            return
        end = time.time_ns()
        span = self._tracing.tracer.start_span(
            names.ROUTE_SPAN,
            context=self._context,
            start_time=end - int(decision.duration_s * 1e9),
            attributes=decision_attributes(decision, self._tracing.candidates(request.model, exclude)),
        )
        if shadow is not None:
            live = shadow.live
            span.set_attribute(names.PREDICTED_REUSE, live.reuse.chosen)
            shadows = shadow.verdicts[1:]
            span.set_attribute(names.SHADOWS_AGREED, [v.strategy for v in shadows if v.agrees])
            span.set_attribute(names.SHADOWS_DISAGREED, [v.strategy for v in shadows if not v.agrees])
        span.end(end_time=end)
        self.server.set_attributes(request_attributes(request))

    def attempt(self, backend_id: str, number: int, headers: dict[str, str]) -> None:
        if self._unsampled is not None:
            headers.update(self._unsampled)
            return
        attributes: dict[str, Any] = {names.ATTEMPT: number, names.ATTEMPT_BACKEND: backend_id}
        rank = headers.get(RANK_HEADER)  # the rank the proxy chose for this backend, if it has several
        if rank is not None:
            attributes[names.ATTEMPT_RANK] = int(rank)
        if self._retry_cause is not None:
            attributes[names.RETRY_CAUSE] = self._retry_cause
        span = self._tracing.tracer.start_span(
            names.ATTEMPT_SPAN, context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        self._attempt = span
        self._sent_at = self._bytes
        self._tracing.propagator.inject(headers, context=set_span_in_context(span))

    def first_byte(self, seconds: float, status: int) -> None:
        if self._attempt is not None:
            self._attempt.set_attributes({names.FIRST_BYTE: seconds, names.HTTP_STATUS: status})

    def attempt_done(self, failure: Any, status: int) -> None:
        span = self._attempt
        if span is None:
            return
        self._attempt = None
        span.set_attribute(names.BYTES, self._bytes - self._sent_at)
        if failure is not None:
            self._retry_cause = failure.reason
            span.set_attributes({names.FAILURE: failure.reason, names.ERROR_TYPE: failure.reason})
            span.set_status(StatusCode.ERROR, failure.message)
        elif status >= 500:
            span.set_attribute(names.ERROR_TYPE, str(status))
            span.set_status(StatusCode.ERROR, f"answered {status}")
        span.end()

    def end(self, ex: Any, duration: float) -> None:
        if self._attempt is not None:  # cancelled mid-attempt (the client left)
            self._attempt.set_attribute(names.FAILURE, "cancelled")
            self.attempt_done(None, 0)
        server = self.server
        if server.is_recording():
            attributes: dict[str, Any] = {
                names.HTTP_STATUS: ex.status,
                names.OUTCOME: ex.outcome.value,
                names.ATTEMPTS: ex.attempts,
                names.BACKEND: ex.backend,
            }
            if ex.model is not None:
                attributes[names.GEN_AI_REQUEST_MODEL] = ex.model
            if ex.ttft is not None:
                attributes[names.TTFT] = ex.ttft
            for name, value in (
                (names.GEN_AI_INPUT_TOKENS, ex.usage_prompt_tokens),
                (names.GEN_AI_CACHED_INPUT_TOKENS, ex.usage_cached_tokens),
                (names.GEN_AI_OUTPUT_TOKENS, ex.usage_completion_tokens),
            ):
                if value is not None:
                    attributes[name] = value
            server.set_attributes(attributes)
            if ex.outcome in _ERRORS or ex.status >= 500:
                server.set_attribute(names.ERROR_TYPE, ex.outcome.value)
                server.set_status(StatusCode.ERROR, ex.error or ex.outcome.value)
        server.end()
