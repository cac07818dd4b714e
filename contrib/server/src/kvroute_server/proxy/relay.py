"""Relaying one attempt's answer to the client: a whole body once it is complete and checked, or a stream.

What a request went through is kept in an `Exchange`; an attempt that failed before any byte reached the
client returns a `Failure` (the forwarder may retry it). A non-streamed answer is read whole and checked
(`kvroute_server.proxy.answers`) before anything is sent, so it is never cut; a stream is committed only
once its first data event arrived, and one that breaks or ends without ``[DONE]`` after that ends with an
SSE error event. Every outcome is reported to the outlier detector.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import attrs

from kvroute.shadow import ShadowRound
from kvroute.strategy import Decision
from kvroute_server.config import ServerConfig
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.fleet.outliers import OutlierDetector
from kvroute_server.http.asgi import Send
from kvroute_server.http.client import UpstreamResponse
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.ops.tracing import NO_TRACE, RequestTrace
from kvroute_server.proxy.answers import (
    answered_like,
    ends_with_done,
    event_end,
    first_data_event,
    is_json_object,
    stream_error_event,
)
from kvroute_server.proxy.headers import filter_response_headers
from kvroute_server.proxy.usage import UsageSniffer

__all__ = ["Exchange", "Failure", "Header", "Relayer", "relay_stream", "relay_whole"]

Header = tuple[bytes, bytes]
#: Transport failures: `UpstreamConnectionError` (an ``OSError``) for a connection that failed,
#: ``TimeoutError`` (also one) for our own first-byte and idle timeouts; `_is_timeout` tells them apart.
_TRANSPORT_ERRORS = OSError


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError)


class Relayer(Protocol):
    """What relaying needs of the forwarder."""

    config: ServerConfig
    metrics: ProxyMetrics
    backends: BackendSet
    outliers: OutlierDetector
    backend_header: bytes | None


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
    #: The data-parallel rank sent upstream (``X-data-parallel-rank``) on the last attempt, if any.
    rank: int | None = None
    #: The last attempt's decision, for the status page's decision log (kvroute_server.ops.status).
    decision: Decision | None = None
    #: Every strategy's verdict on this request when shadows are on (kvroute_server.ops.shadow), else None.
    shadow: ShadowRound | None = None
    #: The prompt's size estimate in tokens and the generation budget (the outlier detector's likeness).
    prompt_tokens: int = 0
    max_tokens: int | None = None
    #: The token counts the backend reported in its usage, when it did.
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    usage_completion_tokens: int | None = None
    #: The request's spans (`kvroute_server.ops.tracing`): `NO_TRACE` when tracing is off.
    trace: RequestTrace = NO_TRACE


@attrs.define
class Failure:
    """An attempt that failed before any byte reached the client (may be retried)."""

    reason: str
    message: str
    connection: bool = False
    status: int = 502
    body: bytes | None = None
    headers: list[Header] = attrs.field(factory=list)
    #: The attempt's first-byte deadline expired (an outlier cause of its own).
    deadline: bool = False


async def relay_whole(
    fw: Relayer,
    response: UpstreamResponse,
    first: bytes,
    send: Send,
    ex: Exchange,
    id_header: Header,
    first_byte: float,
) -> Failure | None:
    """A complete (non-streamed) body: read it all, then answer, or fail on a 5xx or a non-JSON 200 for a retry."""
    backend_id = ex.backend
    parts = [first]
    try:
        while first and not response.at_eof():
            chunk = await response.readany(asyncio.get_running_loop().time() + fw.config.timeouts.idle)
            if not chunk:
                break
            parts.append(chunk)
    except _TRANSPORT_ERRORS as exc:
        return Failure(
            "connection_error",
            f"{backend_id}: body cut short: {type(exc).__name__}: {exc}",
            connection=not _is_timeout(exc),
        )
    body = b"".join(parts)
    status = response.status
    out_headers = filter_response_headers(response.raw_headers)
    if status >= 500:
        return Failure("upstream_5xx", f"{backend_id} answered {status}", status=status, body=body, headers=out_headers)
    if status == 200 and not is_json_object(body):  # an HTML error page, an empty or truncated body
        kind = response.content_type or "no content type"
        return Failure("invalid_answer", f"{backend_id} answered {status} with a body that is not JSON ({kind})")
    sniffer = UsageSniffer()
    sniffer.feed(body)
    _record_usage(fw.metrics, backend_id, sniffer, ex)
    ok = status < 400  # a 4xx is the client's: the backend answered, but its time is no first-byte sample
    fw.outliers.succeeded(
        backend_id,
        answered_like(ex.stream, ex.prompt_tokens, ex.max_tokens, sniffer),
        first_byte if ok else None,
        ex.model,
    )
    out_headers.append(id_header)
    if fw.backend_header is not None:
        out_headers.append((fw.backend_header, backend_id.encode()))
    out_headers.append((b"content-length", str(len(body)).encode()))
    ex.status = status
    ex.outcome = RequestOutcome.OK if status < 400 else RequestOutcome.CLIENT_ERROR
    ex.response_started = True
    ex.complete = True
    await send({"type": "http.response.start", "status": status, "headers": out_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return None


async def relay_stream(
    fw: Relayer, response: UpstreamResponse, first: bytes, send: Send, ex: Exchange, id_header: Header
) -> Failure | None:
    """Pass SSE events through as they arrive; never split an event on failure."""
    backend_id = ex.backend
    idle = fw.config.timeouts.idle
    loop = asyncio.get_running_loop()
    sniffer = UsageSniffer()
    pending = first
    try:
        # Wait for the first complete event that is not only comments before committing to this
        # backend, so that a backend dying before it, or answering garbage, is a failure the client
        # never sees.
        while (verdict := first_data_event(pending[: event_end(pending)])) is None:
            chunk = await response.readany(loop.time() + idle)
            if not chunk:
                break
            pending += chunk
    except _TRANSPORT_ERRORS as exc:
        return Failure(
            "connection_error",
            f"{backend_id}: stream failed before its first event: {type(exc).__name__}: {exc}",
            connection=not _is_timeout(exc),
        )
    if verdict is None:
        return Failure("connection_error", f"{backend_id}: stream ended before its first event", connection=True)
    if not verdict:
        return Failure("invalid_answer", f"{backend_id}: the stream's first event is not an SSE data event")
    cut = event_end(pending)

    headers = filter_response_headers(response.raw_headers)
    headers.append(id_header)
    if fw.backend_header is not None:
        headers.append((fw.backend_header, backend_id.encode()))
    ex.status = response.status
    ex.response_started = True
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    tail, pending = pending[:cut], pending[cut:]
    sniffer.feed(tail)
    await send({"type": "http.response.body", "body": tail, "more_body": True})
    try:
        while True:
            chunk = await response.readany(loop.time() + idle)
            if not chunk:
                break
            if pending:
                chunk = pending + chunk
            cut = event_end(chunk)
            if cut == len(chunk):
                pending = b""
            else:
                chunk, pending = chunk[:cut], chunk[cut:]
                if not chunk:
                    continue
            sniffer.feed(chunk)
            tail = chunk
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except _TRANSPORT_ERRORS as exc:
        timed_out = _is_timeout(exc)
        why = "went idle" if timed_out else "failed"
        ex.error = f"{backend_id}: stream {why}: {type(exc).__name__}: {exc}"
        if not timed_out:
            fw.backends.health.connection_failed(backend_id, ex.error)
        await _end_broken(fw, send, ex, sniffer, f"The backend's stream {why} after it started ({backend_id}).")
        return None
    _record_usage(fw.metrics, backend_id, sniffer, ex)
    if not ends_with_done(pending if pending.strip() else tail):  # closed early: a partial event is dropped
        ex.error = f"{backend_id}: stream ended without [DONE]"
        await _end_broken(fw, send, ex, None, f"The backend's stream ended early ({backend_id}).")
        return None
    ex.complete = True
    ex.outcome = RequestOutcome.OK
    await send({"type": "http.response.body", "body": pending, "more_body": False})
    fw.outliers.succeeded(
        backend_id, answered_like(ex.stream, ex.prompt_tokens, ex.max_tokens, sniffer), ex.ttft, ex.model
    )
    return None


def _record_usage(metrics: ProxyMetrics, backend_id: str, sniffer: UsageSniffer, ex: Exchange) -> None:
    """Count the prompt and cached tokens the engine reported in its usage, and keep its counts in ``ex``."""
    ex.usage_prompt_tokens, ex.usage_cached_tokens = sniffer.prompt_tokens, sniffer.cached_tokens
    ex.usage_completion_tokens = sniffer.completion_tokens
    if sniffer.prompt_tokens is not None:
        metrics.child(metrics.prompt_tokens, backend_id).inc(sniffer.prompt_tokens)
    if sniffer.cached_tokens is not None:
        metrics.child(metrics.cached_tokens, backend_id).inc(sniffer.cached_tokens)


async def _end_broken(fw: Relayer, send: Send, ex: Exchange, sniffer: UsageSniffer | None, message: str) -> None:
    """End a stream that broke after it started with an SSE error event (then ``[DONE]``)."""
    ex.outcome = RequestOutcome.STREAM_ERROR
    ex.complete = True
    fw.outliers.failed(ex.backend, "stream_error")
    body = stream_error_event(message, "upstream_stream_error")
    await send({"type": "http.response.body", "body": body, "more_body": False})
    if sniffer is not None:
        _record_usage(fw.metrics, ex.backend, sniffer, ex)
