"""Setting up OpenTelemetry the way ``kvroute serve`` does: a tracer provider of its own, an OTLP exporter, a
bounded queue.

The standard ``OTEL_*`` environment variables work as the OpenTelemetry specification says (endpoint, protocol,
headers, timeout, service name, resource attributes, sampler, ``OTEL_SDK_DISABLED``); settings given explicitly
(``kvroute serve --otlp-endpoint``, ``[tracing]``) win over them. The provider is never made the process's global
one, so that several proxies (or a proxy and its host's own tracing) in one process do not share it.

Spans are exported from one background thread per provider through `BoundedSpanProcessor`: a request only
appends its finished spans to a bounded queue; when the collector is slow, down or hung the queue fills and
further spans are dropped and counted, never waited for.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
import structlog
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

__all__ = [
    "PROTOCOLS",
    "BoundedSpanProcessor",
    "ExportSettings",
    "TracingConfigError",
    "build_provider",
    "make_exporter",
    "resolve",
]

log = structlog.get_logger(__name__)

#: The OTLP protocols kvroute exports with (``OTEL_EXPORTER_OTLP_PROTOCOL`` values).
PROTOCOLS = ("http/protobuf", "grpc")
_HTTP_PATH = "/v1/traces"
#: Called with why spans were dropped (``queue_full`` or ``export_failed``) and how many.
DropCallback = Callable[[str, int], None]


class TracingConfigError(ValueError):
    """A tracing setting or ``OTEL_*`` variable that cannot be used; the message names it and the value."""


@attrs.frozen
class ExportSettings:
    """Where and how spans go, as resolved from explicit settings and the environment (`resolve`)."""

    endpoint: str
    protocol: str
    #: ``None``: the sampler the ``OTEL_TRACES_SAMPLER`` variables name (the SDK's default: parent-based, always on).
    sample_ratio: float | None = None
    service_name: str | None = None
    max_queue: int = 2048
    max_batch: int = 512
    schedule_delay_s: float = 0.5
    #: Whether ``endpoint`` is the signal's full URL (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), used as it is.
    full_url: bool = False


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() == "true"


def resolve(
    endpoint: str | None,
    protocol: str | None,
    sample_ratio: float | None,
    service_name: str | None,
    max_queue: int,
    environ: Mapping[str, str] | None = None,
) -> ExportSettings | None:
    """The export settings, or ``None`` when tracing is off: no endpoint given nor in the environment,
    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``."""
    env = os.environ if environ is None else environ
    if _flag(env, "OTEL_SDK_DISABLED"):
        return None
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()}
    if exporters == {"none"}:
        return None
    if exporters - {"otlp"}:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER must be 'otlp' or 'none' for kvroute (got {env['OTEL_TRACES_EXPORTER']!r})."
        )
    full_url = False
    if endpoint is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
        full_url = endpoint is not None
        endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    if endpoint is None:
        return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingConfigError(
            f"the OTLP endpoint must be an http:// or https:// URL such as 'http://127.0.0.1:4318' (got {endpoint!r})."
        )
    protocol = (
        protocol
        or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in PROTOCOLS:
        raise TracingConfigError(f"the OTLP protocol must be one of {', '.join(PROTOCOLS)} (got {protocol!r}).")
    return ExportSettings(
        endpoint=endpoint,
        protocol=protocol,
        sample_ratio=sample_ratio,
        service_name=service_name,
        max_queue=max_queue,
        max_batch=min(512, max_queue),
        full_url=full_url,
    )


def make_exporter(settings: ExportSettings) -> SpanExporter:
    """The OTLP span exporter for the settings' protocol; headers and timeout come from the ``OTEL_*`` variables."""
    endpoint = settings.endpoint
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        parts = urlsplit(endpoint)
        return GrpcExporter(endpoint=f"{parts.hostname}:{parts.port or 4317}", insecure=parts.scheme == "http")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    if not settings.full_url and not endpoint.rstrip("/").endswith(_HTTP_PATH):
        endpoint = endpoint.rstrip("/") + _HTTP_PATH
    return HttpExporter(endpoint=endpoint)


def _sampler(settings: ExportSettings) -> Sampler | None:
    if settings.sample_ratio is None:
        return None  # the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG
    return ParentBased(TraceIdRatioBased(settings.sample_ratio))


def _resource(settings: ExportSettings, attributes: Mapping[str, Any], environ: Mapping[str, str]) -> Resource:
    """The SDK's resource (with ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``), ``service.name`` ``kvroute``
    unless one of those or the settings name it."""
    extra = dict(attributes)
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if settings.service_name is not None:
        extra["service.name"] = settings.service_name
    elif not named:
        extra["service.name"] = "kvroute"
    return Resource.create(extra)


def build_provider(
    settings: ExportSettings,
    *,
    on_drop: DropCallback | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    exporter: SpanExporter | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[TracerProvider, BoundedSpanProcessor]:
    """A tracer provider (not the global one) exporting through a `BoundedSpanProcessor`."""
    env = os.environ if environ is None else environ
    provider = TracerProvider(sampler=_sampler(settings), resource=_resource(settings, resource_attributes or {}, env))
    processor = BoundedSpanProcessor(
        exporter or make_exporter(settings),
        max_queue=settings.max_queue,
        max_batch=settings.max_batch,
        schedule_delay_s=settings.schedule_delay_s,
        on_drop=on_drop,
    )
    provider.add_span_processor(processor)
    return provider, processor


class BoundedSpanProcessor(SpanProcessor):
    """Queues sampled spans (at most ``max_queue``) for one export thread; a full queue drops and counts.

    ``on_end`` runs on the request path: a lock, a length check and an append. The thread exports a batch
    when ``max_batch`` spans wait or every ``schedule_delay_s``; a failed export drops its batch (counted),
    since the exporter has already retried within its own timeout.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = 2048,
        max_batch: int = 512,
        schedule_delay_s: float = 0.5,
        on_drop: DropCallback | None = None,
    ) -> None:
        self._exporter = exporter
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._delay = schedule_delay_s
        self._on_drop = on_drop
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._closed = False  # the exporter is shut down: what is still queued is dropped
        #: Spans dropped so far, by reason (also reported to ``on_drop``), and spans exported.
        self.dropped: collections.Counter[str] = collections.Counter()
        self.exported = 0
        self._thread = threading.Thread(target=self._run, name="kvroute-span-export", daemon=True)
        self._thread.start()

    # -- the request path ----------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopping or not span.context.trace_flags.sampled:
            return
        with self._lock:
            full = len(self._queue) >= self._max_queue
            if not full:
                self._queue.append(span)
                waiting = len(self._queue)
        if full:
            self._drop("queue_full", 1)
        elif waiting >= self._max_batch:
            self._wake.set()

    # -- the export thread -----------------------------------------------------------------------

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        if self._on_drop is not None:
            try:
                self._on_drop(reason, count)
            except Exception:  # a counter must never break a request or the export thread
                log.exception("span_drop_count_failed")

    def _take(self) -> list[ReadableSpan]:
        with self._lock:
            count = min(len(self._queue), self._max_batch)
            if count:
                self._idle.clear()  # under the lock: `force_flush` never sees an empty queue and an idle thread
            return [self._queue.popleft() for _ in range(count)]

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay)
            self._wake.clear()
            while batch := self._take():
                self._export(batch)
            self._idle.set()
            if self._stopping:
                return

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        if self._closed:
            self._drop("export_failed", len(batch))
            return
        try:
            result = self._exporter.export(batch)
        except Exception as exc:
            log.warning("span_export_failed", spans=len(batch), error=f"{type(exc).__name__}: {exc}")
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(batch)
        else:
            self._drop("export_failed", len(batch))

    # -- lifecycle -----------------------------------------------------------------------------

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Wait (at most ``timeout_millis``) until every queued span has been exported or dropped."""
        deadline = time.monotonic() + timeout_millis / 1000
        while time.monotonic() < deadline:
            with self._lock:
                empty = not self._queue
            if empty and self._idle.is_set():
                return True
            self._wake.set()
            time.sleep(0.005)
        return False

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued within ``timeout_s``, then stop; a hung collector does not hold it longer."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._closed = True
        closer = threading.Thread(target=self._exporter.shutdown, name="kvroute-span-export-close", daemon=True)
        closer.start()
        closer.join(max(0.1, timeout_s / 5))
