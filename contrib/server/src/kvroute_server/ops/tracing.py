"""OpenTelemetry spans for the proxy's requests (docs/tracing.md); nothing at all when tracing is off.

Per request: a server span (continuing the client's W3C ``traceparent`` when it sent one), a ``kvroute.route``
span for each routing decision, and a ``kvroute.attempt`` span for each try upstream, whose context goes to
the engine as ``traceparent``/``tracestate`` so that the engine's own span is the attempt's child.

The app and the forwarder talk to a `RequestTrace` held by the request's `Exchange`. With tracing off
that is `NO_TRACE`, whose methods do nothing, and OpenTelemetry is never imported; with tracing on it
is a ``LiveTrace`` (`kvroute_server.ops.tracing_otel`, imported only then). Spans are exported by
kvroute-tracing's bounded processor, from a thread: a slow or absent collector drops spans
(``kvroute_trace_spans_dropped_total``), never requests.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.errors import ConfigError
from kvroute.fleet import Fleet
from kvroute.request import RouteRequest
from kvroute.strategy import Decision
from kvroute_server.config import TracingConfig
from kvroute_server.http.asgi import Scope, Send
from kvroute_server.ops.metrics import ProxyMetrics

if TYPE_CHECKING:
    from kvroute.shadow import ShadowRound
    from kvroute_server.ops.tracing_otel import ProxyTracing

__all__ = ["NO_TRACE", "NoTracing", "RequestTrace", "create_tracing"]


class RequestTrace(Protocol):
    """One request's spans: `NO_TRACE` when tracing is off, else a `kvroute_server.ops.tracing_otel.LiveTrace`."""

    #: The exemplar (``{"trace_id": ...}``) the request's histograms carry, ``None`` when not sampled.
    @property
    def exemplar(self) -> dict[str, str] | None: ...

    def counting(self, send: Send) -> Send:
        """``send``, wrapped to count the body bytes sent to the client when traced."""
        ...

    def routed(self, request: RouteRequest, decision: Decision, exclude: set[str], shadow: ShadowRound | None) -> None:
        """A routing decision was made (before its attempt)."""
        ...

    def attempt(self, backend_id: str, number: int, headers: dict[str, str]) -> None:
        """An attempt starts: its span begins and its context is written into the upstream ``headers``."""
        ...

    def first_byte(self, seconds: float, status: int) -> None:
        """The attempt's backend answered (status and first body bytes) after ``seconds``."""
        ...

    def attempt_done(self, failure: Any, status: int) -> None:
        """The attempt ended: ``failure`` (a `Failure`) when it may be retried, else ``None``."""
        ...

    def end(self, ex: Any, duration: float) -> None:
        """The request ended: the server span gets the outcome and ends."""
        ...


class _NoTrace:
    """Tracing off: every method does nothing."""

    __slots__ = ()

    exemplar = None

    def counting(self, send: Send) -> Send:
        return send

    def routed(self, request: RouteRequest, decision: Decision, exclude: set[str], shadow: ShadowRound | None) -> None:
        pass

    def attempt(self, backend_id: str, number: int, headers: dict[str, str]) -> None:
        pass

    def first_byte(self, seconds: float, status: int) -> None:
        pass

    def attempt_done(self, failure: Any, status: int) -> None:
        pass

    def end(self, ex: Any, duration: float) -> None:
        pass


NO_TRACE: RequestTrace = _NoTrace()


class NoTracing:
    """Tracing off: every request gets `NO_TRACE`."""

    enabled = False

    def start(self, scope: Scope, request_id: str) -> RequestTrace:
        return NO_TRACE

    def close(self) -> None:
        pass


def create_tracing(
    config: TracingConfig, fleet: Fleet, metrics: ProxyMetrics, worker: str = "0"
) -> NoTracing | ProxyTracing:
    """`ProxyTracing` when an OTLP endpoint is configured (settings or ``OTEL_*``), else `NoTracing`."""
    wanted = config.endpoint is not None or any(
        os.environ.get(name) for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not wanted:
        return NoTracing()  # OpenTelemetry not even imported
    try:
        import kvroute_tracing
    except ImportError:
        raise ConfigError(
            "tracing is configured (an OTLP endpoint is set) but kvroute-tracing is not installed: "
            'pip install "kvroute[tracing]".'
        ) from None
    try:
        settings = kvroute_tracing.resolve(
            config.endpoint, config.protocol, config.sample_ratio, config.service_name, config.max_queue
        )
    except kvroute_tracing.TracingConfigError as exc:
        raise ConfigError(str(exc)) from None
    if settings is None:
        return NoTracing()  # OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none
    from kvroute_server.ops.tracing_otel import ProxyTracing

    return ProxyTracing(settings, fleet, metrics, worker)
