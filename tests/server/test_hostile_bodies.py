"""Hostile request bodies: every one gets a 4xx in OpenAI's error shape, never a 500 or a reset.

The corpus runs against one proxy per class (`proxy` fixture, class scope); the oversized
bodies are sent by clients that write the whole body before reading, as ``http.client``,
``urllib`` and ``requests`` do, which is the case where a reset would hide the 413 from them.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from http.client import HTTPConnection, IncompleteRead
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvroute_server.http import asgi
from kvroute_server.http.asgi import InvalidBody, loads_body
from kvroute_server.http.runner import ServerThread
from kvroute_server.proxy import app as app_module
from tests.server.harness import MODEL, Servers, chat_body, http

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
_ORJSON = asgi._orjson is not None


def _nested(depth: int, open_: bytes = b"[", close: bytes = b"]", inner: bytes = b"1") -> bytes:
    return open_ * depth + inner + close * depth


def _chat_with(messages: bytes) -> bytes:
    return b'{"model": "m", "messages": ' + messages + b"}"


def _part(value: bytes) -> bytes:
    """A chat body whose only content part (of an unknown type, so rendered as canonical JSON) holds ``value``."""
    return _chat_with(b'[{"role": "user", "content": [{"type": "x", "v": ' + value + b"}]}]")


_MILLION_ZEROS = b"[" + b"0," * 999_999 + b"0]"

#: (id, path, raw body, content type, expected status, expected code or None for "any").
CORPUS: list[tuple[str, str, bytes, str, int, str | None]] = [
    ("deep-arrays-100k", CHAT, _chat_with(_nested(100_000)), "application/json", 400, "invalid_json"),
    ("deep-objects-100k", CHAT, _chat_with(_nested(100_000, b'{"a":', b"}")), "application/json", 400, "invalid_json"),
    ("deep-mixed-100k", CHAT, _chat_with(_nested(50_000, b'[{"a":', b"}]")), "application/json", 400, "invalid_json"),
    ("deep-unclosed-100k", CHAT, _chat_with(b"[" * 100_000), "application/json", 400, "invalid_json"),
    # Deep enough to pass a 1,024-level parser, too deep for Python's recursion when rendered.
    ("deep-1015-in-a-part", CHAT, _part(_nested(1015)), "application/json", 400, None),
    ("million-element-body", CHAT, _MILLION_ZEROS, "application/json", 400, "invalid_value"),
    ("million-element-messages", CHAT, _chat_with(_MILLION_ZEROS), "application/json", 400, "invalid_value"),
    (
        "million-element-content",
        CHAT,
        _chat_with(b'[{"role": "user", "content": ' + _MILLION_ZEROS + b"}]"),
        "application/json",
        400,
        "invalid_value",
    ),
    (
        "million-element-prompt",
        "/v1/completions",
        b'{"model": "m", "prompt": [' + b'"a",' * 999_999 + b"1]}",
        "application/json",
        400,
        "invalid_value",
    ),
    ("invalid-utf8", CHAT, b'{"model": "m\xff\xfe", "messages": []}', "application/json", 400, "invalid_encoding"),
    (
        "utf8-encoded-surrogate",
        CHAT,
        _chat_with(b'[{"role": "user", "content": "\xed\xa0\x80"}]'),
        "application/json",
        400,
        "invalid_encoding",
    ),
    (
        "overlong-utf8",
        CHAT,
        _chat_with(b'[{"role": "user", "content": "\xc0\xaf"}]'),
        "application/json",
        400,
        "invalid_encoding",
    ),
    ("utf16-body", CHAT, json.dumps(chat_body("hi")).encode("utf-16"), "application/json", 400, None),
    (
        "nan",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        "application/json",
        400,
        "invalid_json",
    ),
    (
        "infinity",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        "application/json",
        400,
        "invalid_json",
    ),
    (
        "minus-infinity",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}',
        "application/json",
        400,
        "invalid_json",
    ),
    (
        "5000-digit-integer",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
        "application/json",
        400,
        "invalid_json",
    ),
    (
        "float-overflow",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [1e400]}',
        "application/json",
        400,
        "invalid_json",
    ),
    (
        "duplicate-key-last-invalid",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "model": 7}',
        "application/json",
        400,
        "invalid_value",
    ),
    (
        "duplicate-messages-last-empty",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "messages": []}',
        "application/json",
        400,
        "invalid_value",
    ),
    ("top-level-array", CHAT, b"[1, 2]", "application/json", 400, "invalid_value"),
    ("top-level-string", CHAT, b'"hello"', "application/json", 400, "invalid_value"),
    ("top-level-number", CHAT, b"42", "application/json", 400, "invalid_value"),
    ("top-level-true", CHAT, b"true", "application/json", 400, "invalid_value"),
    ("top-level-null", CHAT, b"null", "application/json", 400, "invalid_value"),
    ("empty-body", CHAT, b"", "application/json", 400, "invalid_json"),
    ("whitespace-body", CHAT, b" \r\n\t ", "application/json", 400, "invalid_json"),
    ("nul-bytes", CHAT, b"\x00" * 64, "application/json", 400, "invalid_json"),
    (
        "byte-order-mark",
        CHAT,
        b"\xef\xbb\xbf" + json.dumps(chat_body("hi")).encode(),
        "application/json",
        400,
        "invalid_json",
    ),
    ("truncated", CHAT, json.dumps(chat_body("hi")).encode()[:-7], "application/json", 400, "invalid_json"),
    ("trailing-garbage", CHAT, json.dumps(chat_body("hi")).encode() + b" }{", "application/json", 400, "invalid_json"),
    ("two-documents", CHAT, json.dumps(chat_body("hi")).encode() * 2, "application/json", 400, "invalid_json"),
    ("form-encoded", CHAT, b"model=m&messages=hi", "application/x-www-form-urlencoded", 400, "invalid_json"),
    (
        "multipart",
        CHAT,
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b--\r\n',
        "multipart/form-data; boundary=b",
        400,
        "invalid_json",
    ),
    ("plain-text", CHAT, b"hello, model", "text/plain", 400, "invalid_json"),
    (
        "lone-high-surrogate",
        CHAT,
        _chat_with(b'[{"role": "user", "content": "a\\ud800b"}]'),
        "application/json",
        400 if _ORJSON else 200,
        "invalid_json" if _ORJSON else None,
    ),
    (
        "lone-low-surrogate-model",
        CHAT,
        b'{"model": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}',
        "application/json",
        400 if _ORJSON else 404,
        None,
    ),
    (
        "deep-passthrough",
        "/v1/embeddings",
        b'{"model": "m", "input": ' + _nested(100_000) + b"}",
        "application/json",
        400,
        "invalid_json",
    ),
    ("top-level-array-passthrough", "/v1/embeddings", b"[" * 10 + b"]" * 10, "application/json", 400, "invalid_value"),
]


def _post(
    url: str, raw: bytes, content_type: str = "application/json", timeout: float = 30.0
) -> tuple[int, dict[str, str], bytes]:
    return http("POST", url, raw=raw, headers={"content-type": content_type}, timeout=timeout)


def assert_openai_error(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The body is OpenAI's error object, served as JSON with the request id; returns ``error``."""
    assert headers.get("content-type") == "application/json", (status, headers, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), error
    return error


@pytest.fixture(scope="class")
def proxy() -> Iterator[ServerThread]:
    """One emulator and one prefix-aware proxy (it hashes the routing text) for the whole class."""
    servers = Servers()
    try:
        yield servers.proxy(servers.emulators(1), strategy="consistent-hash", options={})
    finally:
        servers.stop_all()


class TestLoadsBody:
    """`loads_body` raises nothing but `InvalidBody`, with orjson and with the standard library alike."""

    @pytest.fixture(params=["installed", "stdlib"])
    def parser(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[bytes], Any]:
        if request.param == "stdlib":
            monkeypatch.setattr(asgi, "_orjson", None)
        return loads_body

    @pytest.mark.parametrize(
        ("raw", "code"),
        [
            (_nested(100_000), "invalid_json"),
            (_nested(100_000, b'{"a":', b"}"), "invalid_json"),
            (b"[NaN]", "invalid_json"),
            (b"[-Infinity]", "invalid_json"),
            (b"[" + b"7" * 5000 + b"]", "invalid_json"),
            (b"[1e400]", "invalid_json"),
            (b'["\xff"]', "invalid_encoding"),
            (b'["\xed\xa0\x80"]', "invalid_encoding"),
            (b"", "invalid_json"),
            (b"{} {}", "invalid_json"),
        ],
        ids=[
            "deep-arrays",
            "deep-objects",
            "nan",
            "infinity",
            "5000-digits",
            "float-overflow",
            "invalid-utf8",
            "encoded-surrogate",
            "empty",
            "two-documents",
        ],
    )
    def test_hostile_documents(self, parser: Callable[[bytes], Any], raw: bytes, code: str) -> None:
        """Each hostile document is an `InvalidBody` with its code and a message saying what is wrong."""
        with pytest.raises(InvalidBody) as caught:
            parser(raw)
        assert caught.value.code == code
        assert str(caught.value).startswith("The request body ")

    def test_nesting_message(self, parser: Callable[[bytes], Any]) -> None:
        """Too deep a document is reported as such, not as a generic syntax error."""
        with pytest.raises(InvalidBody, match="nests deeper"):
            parser(_nested(5000))

    def test_valid_documents(self, parser: Callable[[bytes], Any]) -> None:
        """Ordinary JSON (surrogate pairs, big integers, 500 levels) parses as ``json`` would."""
        raw = json.dumps({"a": ["\U0001f600", 2**62, -1.5, None, True], "b": json.loads(_nested(500))}).encode()
        assert parser(raw) == json.loads(raw)

    @settings(
        max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(raw=st.binary(max_size=300) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def test_any_bytes(self, parser: Callable[[bytes], Any], raw: bytes) -> None:
        """Any bytes either parse or raise `InvalidBody`, never another exception."""
        try:
            parser(raw)
        except InvalidBody as exc:
            assert exc.code in ("invalid_json", "invalid_encoding")


class TestHostileCorpus:
    """Against one running proxy: each hostile body gets its 4xx JSON error and ordinary requests keep working."""

    @pytest.mark.parametrize(
        ("path", "raw", "content_type", "status", "code"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS]
    )
    def test_corpus(
        self, proxy: ServerThread, path: str, raw: bytes, content_type: str, status: int, code: str | None
    ) -> None:
        """The body gets the expected status with an OpenAI-style JSON error (and a 200 right after it still works)."""
        got, headers, body = _post(proxy.url + path, raw, content_type)
        assert got == status, body[:300]
        if got >= 400:
            error = assert_openai_error(got, headers, body)
            assert headers["x-request-id"]
            if code is not None:
                assert error["code"] == code, error
        assert http("POST", proxy.url + CHAT, chat_body("still fine"))[0] == 200

    def test_duplicate_keys_last_wins(self, proxy: ServerThread) -> None:
        """Duplicate keys are valid JSON: the last one wins, as in the backends' own (Python) parsers."""
        raw = b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}], "model": "m", "max_tokens": 2}'
        status, _, body = _post(proxy.url + CHAT, raw)
        assert status == 200 and json.loads(body)["model"] == MODEL

    def test_large_bodies_parsed_off_the_event_loop(self, proxy: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
        """A body over 1 MiB is parsed in a worker thread and forwarded (200), a small one is parsed on the event
        loop."""
        threads: list[str] = []
        parse = app_module._parse

        def recording(*args: Any) -> Any:
            threads.append(threading.current_thread().name)
            return parse(*args)

        monkeypatch.setattr(app_module, "_parse", recording)
        large = {**chat_body("large", max_tokens=1), "user": "u" * (1200 * 1024)}  # 'user' is not routed on
        assert _post(proxy.url + CHAT, json.dumps(large).encode())[0] == 200
        assert _post(proxy.url + CHAT, json.dumps(chat_body("small")).encode())[0] == 200
        loop_thread = proxy._thread.name if proxy._thread is not None else None
        assert threads[1] == loop_thread and threads[0] != loop_thread

    def test_streams_in_flight_survive_the_corpus(self, proxy: ServerThread) -> None:
        """Streams running while the whole corpus is sent all complete with [DONE]."""
        results: list[bytes] = []

        def stream(i: int) -> None:
            status, _, body = http("POST", proxy.url + CHAT, chat_body(f"story {i}", max_tokens=200, stream=True))
            assert status == 200
            results.append(body)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for _, path, raw, content_type, status, _ in CORPUS:
            assert _post(proxy.url + path, raw, content_type)[0] == status
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == 3
        assert all(body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body for body in results)


def _send_then_read(
    port: int, headers: dict[str, str], body: Iterator[bytes], *, chunked: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """POST with `HTTPConnection`: the whole body is written before the response is read."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest("POST", CHAT, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if chunked:
            conn.putheader("transfer-encoding", "chunked")
        conn.endheaders()
        for piece in body:
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


_MIB = 1024 * 1024


def _megabytes(count: int) -> Iterator[bytes]:
    piece = b"x" * _MIB
    for _ in range(count):
        yield piece


class TestOversizedBodies:
    """A body over ``max_body_bytes`` gets 413 in OpenAI's shape, read by a client that is still sending."""

    @pytest.mark.parametrize("connection", ["close", "keep-alive"])
    def test_80_mb_with_content_length(self, proxy: ServerThread, connection: str) -> None:
        """An 80 MB body declared in Content-Length: the client reads 413 and the connection is closed after it."""
        headers = {"content-type": "application/json", "content-length": str(80 * _MIB), "connection": connection}
        status, got, body = _send_then_read(proxy.port, headers, _megabytes(80))
        assert status == 413
        error = assert_openai_error(status, got, body)
        assert error["code"] == "request_too_large" and "33554432" in error["message"]
        assert got["connection"] == "close" and got["x-request-id"]

    @pytest.mark.parametrize("connection", ["close", "keep-alive"])
    def test_80_mb_chunked(self, proxy: ServerThread, connection: str) -> None:
        """An 80 MB chunked body: counted as it arrives, the client reads 413 all the same."""
        headers = {"content-type": "application/json", "connection": connection}
        status, got, body = _send_then_read(proxy.port, headers, _megabytes(80), chunked=True)
        assert status == 413
        assert assert_openai_error(status, got, body)["code"] == "request_too_large"

    def test_client_that_stops_sending(self, proxy: ServerThread) -> None:
        """A client that declares 80 MB, sends 1 MB and waits gets the 413, then the connection closes."""
        head = (
            f"POST {CHAT} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {80 * _MIB}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(head.encode() + b"x" * _MIB)
            reply = b""
            while data := sock.recv(65536):  # ends when the proxy closes (after its idle bound)
                reply += data
        assert reply.startswith(b"HTTP/1.1 413 ")
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"

    def test_proxy_still_serves_afterwards(self, proxy: ServerThread) -> None:
        """After the oversized bodies, an ordinary request is answered 200."""
        assert http("POST", proxy.url + CHAT, chat_body("after"))[0] == 200


class TestMalformedHttp:
    """Requests uvicorn itself cannot parse get a 400 in OpenAI's shape, not uvicorn's plain text."""

    @pytest.mark.parametrize(
        "request_bytes",
        [
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            b"zz\r\nabc\r\n0\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 12abc\r\n\r\n{}",
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n"
            b"transfer-encoding: chunked\r\n\r\n{}",
        ],
        ids=["bad-chunk-size", "bad-content-length", "length-and-chunked"],
    )
    def test_invalid_framing(self, proxy: ServerThread, request_bytes: bytes) -> None:
        """A body with broken framing gets 400 JSON with code ``invalid_http`` and the connection closes."""
        if proxy.http != "kvroute":  # uvicorn's own protocol answers plain text (pinned in test_http_differential)
            pytest.skip("kvroute's protocol's contract")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(request_bytes)
            reply = b""
            while data := sock.recv(65536):
                reply += data
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http"


class TestInternalErrors:
    """A bug in request handling is logged once and answered 500 in OpenAI's shape, and the proxy goes on."""

    def test_unexpected_exception(
        self, servers: Servers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An exception while routing gives 500 JSON with the request id; one ``request_failed`` event, no uvicorn
        traceback."""
        proxy = servers.proxy(servers.emulators(1))

        def broken(*args: object) -> None:
            raise TypeError("a bug")

        monkeypatch.setattr(app_module, "_parse", broken)
        with capture_logs() as events, caplog.at_level(logging.ERROR, logger="uvicorn.error"):
            status, headers, body = http("POST", proxy.url + CHAT, chat_body("hi"), headers={"x-request-id": "req-1"})
        assert status == 500
        error = assert_openai_error(status, headers, body)
        assert error["code"] == "internal_error" and "TypeError" in error["message"]
        assert headers["x-request-id"] == "req-1"
        failed = [e for e in events if e["event"] == "request_failed"]
        assert len(failed) == 1 and failed[0]["request_id"] == "req-1" and failed[0]["error"] == "TypeError: a bug"
        assert not [r for r in caplog.records if r.name.startswith("uvicorn")]
        monkeypatch.undo()
        assert http("POST", proxy.url + CHAT, chat_body("hi"))[0] == 200

    def test_after_the_response_started(self, servers: Servers) -> None:
        """An exception after the head was sent is logged once and the connection is closed (the client sees it cut)."""
        proxy = servers.proxy(servers.emulators(1))

        async def half(scope: object, receive: object, send: Callable[[dict[str, Any]], Any]) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
            await send({"type": "http.response.body", "body": b"{", "more_body": True})
            raise RuntimeError("half way")

        proxy.app.routes.add("GET", "/v1/models", half)
        with capture_logs() as events, pytest.raises(IncompleteRead):
            http("GET", proxy.url + "/v1/models")
        failed = [e for e in events if e["event"] == "request_failed"]
        assert len(failed) == 1 and failed[0]["response_started"] is True
        assert http("POST", proxy.url + CHAT, chat_body("hi"))[0] == 200
