"""Writing answers: the response head and the body's framing, and the answers the server gives on its own."""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus

from kvroute_server.http.asgi import dumps, openai_error
from kvroute_server.http.cycle import Cycle
from kvroute_server.http.reader import MAX_HEAD_BYTES

__all__ = ["CONTINUE", "HEAD_TOO_LARGE", "INTERNAL_ERROR", "INVALID_HTTP_RESPONSE", "frame_body", "response_head"]

#: Control characters that must not appear in a response header value (tab is allowed).
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_NAME = re.compile(rb"[\x00-\x20\x7f()<>@,;:\\\"/\[\]?={}]")


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def _error_response(status: int, message: str, code: str) -> bytes:
    body = dumps(openai_error(status, message, code=code))
    head = _STATUS_LINES[status] + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % len(body) + body


#: The answer to bytes that are not a valid HTTP/1.1 request (the app never sees them).
INVALID_HTTP_RESPONSE = _error_response(
    400,
    "The request is not valid HTTP/1.1 (malformed request line, header, Content-Length or chunked encoding).",
    "invalid_http",
)
HEAD_TOO_LARGE = _error_response(
    431, f"The request line and headers must be at most {MAX_HEAD_BYTES} bytes.", "request_header_too_large"
)
INTERNAL_ERROR = _error_response(500, "The server failed to handle this request.", "internal_error")
#: The interim answer to ``Expect: 100-continue``, sent when the app first reads the body.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def response_head(cycle: Cycle, status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The response head; decides the body's framing (Content-Length, chunked, none) and keep-alive on ``cycle``.

    Raises ``RuntimeError`` for a header name or value that would break the head (control
    characters, separators in a name): an app cannot smuggle a header or a second answer.
    """
    parts = [_STATUS_LINES.get(status) or _status_line(status)]
    close = False
    names = []
    values = []
    for name, value in headers:
        name = name.lower()
        names.append(name)
        values.append(value)
        if name == b"content-length":
            if cycle.length_left is None:
                cycle.length_left = int(value)
        elif name == b"transfer-encoding":
            if value.lower() == b"chunked":
                cycle.chunked = True
                cycle.length_left = None
        elif name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
            cycle.keep_alive = False
            close = True
        parts += (name, b": ", value, b"\r\n")
    # One search each over all names and all values (a tab, allowed in values, joins them).
    if _BAD_NAME.search(b"".join(names)) or _BAD_VALUE.search(b"\t".join(values)):
        bad = next((n, v) for n, v in zip(names, values, strict=True) if _BAD_NAME.search(n) or _BAD_VALUE.search(v))
        raise RuntimeError(f"Invalid HTTP response header {bad[0]!r}: {bad[1]!r}")
    if not cycle.keep_alive and not close:
        parts.append(b"connection: close\r\n")
    if status in (204, 304):  # no body, whatever the headers say
        cycle.chunked = False
        cycle.length_left = None
    elif cycle.length_left is None and not cycle.chunked and not cycle.is_head:
        cycle.chunked = True
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def frame_body(cycle: Cycle, body: bytes, more: bool) -> bytes:
    """``body`` as it goes on the wire under the framing `response_head` chose (nothing for HEAD, 204, 304).

    Raises ``RuntimeError`` when the app sends more or fewer bytes than its Content-Length.
    """
    if cycle.is_head:
        return b""
    if cycle.chunked:
        if body:
            body = b"%x\r\n%b\r\n" % (len(body), body)
        if not more:
            body += b"0\r\n\r\n"
    elif cycle.length_left is not None:
        cycle.length_left -= len(body)
        if cycle.length_left < 0:
            raise RuntimeError("Response content longer than Content-Length")
        if not more and cycle.length_left:
            raise RuntimeError("Response content shorter than Content-Length")
    return body
