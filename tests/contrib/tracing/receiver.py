"""OTLP trace receivers the tests run on loopback: HTTP (protobuf bodies) and gRPC (the trace service).

Both decode what the exporters send with `opentelemetry-proto`'s generated messages and keep every span as a
`ReceivedSpan`. The HTTP one can also misbehave on purpose: ``fail`` answers 503, ``hang`` holds each export
until the receiver stops (a collector that accepted the connection and went quiet).
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
import zlib
from concurrent import futures
from typing import Any

import attrs
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

__all__ = ["GrpcReceiver", "HttpReceiver", "ReceivedSpan"]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind is None:
        return None
    return getattr(value, kind)


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items if isinstance(kv, KeyValue)}


@attrs.frozen
class ReceivedSpan:
    """One span as the collector got it: ids in hex, kind and status by name, attributes and resource decoded."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    status: str
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int


class _Store:
    """The spans received so far, with a condition to wait on."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._cond = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=Span.SpanKind.Name(span.kind),
                            status=Status.StatusCode.Name(span.status.code),
                            status_message=span.status.message,
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._cond:
            self.requests += 1
            self.spans.extend(received)
            self._cond.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds; fails the test after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [(s.name, s.trace_id[:8]) for s in self.spans]
                    raise AssertionError(f"expected spans within {timeout} s; got {len(self.spans)}: {names}")
                self._cond.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str, count: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans of one trace, once at least ``count`` of them arrived."""
        spans = self.wait_for(lambda spans: sum(s.trace_id == trace_id for s in spans) >= count, timeout)
        return [s for s in spans if s.trace_id == trace_id]


class HttpReceiver(_Store):
    """OTLP/HTTP on ``http://127.0.0.1:port`` (``POST /v1/traces``); ``mode`` is ``ok``, ``fail`` or ``hang``."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        assert mode in ("ok", "fail", "hang"), mode
        self.mode = mode
        self.stopped = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if receiver.mode == "hang":
                    receiver.stopped.wait(60)
                    return
                if receiver.mode == "fail":
                    self._answer(503, b"")
                    return
                encoding = self.headers.get("content-encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                self._answer(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver(_Store):
    """OTLP/gRPC on ``127.0.0.1:port``: a grpc server implementing the trace service's ``Export``."""

    def __init__(self) -> None:
        import grpc  # only here: the HTTP receiver's users (the monitoring env) need no grpcio
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GrpcReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait(5)
