"""Bad input gets the right 4xx in OpenAI's error shape, and never disturbs requests in flight."""

from __future__ import annotations

import json
import threading

import pytest

from tests.server.harness import MODEL, Servers, chat_body, http

pytestmark = pytest.mark.e2e

_LONG = "x" * (70 * 1024)

CASES = [
    # (id, path, raw body, expected status, expected code, expected param)
    ("malformed-json", "/v1/chat/completions", b'{"model": "m", "messages": [', 400, "invalid_json", None),
    ("not-utf8", "/v1/chat/completions", b'{"model": "m\xff\xfe"}', 400, "invalid_encoding", None),
    ("array-body", "/v1/chat/completions", b"[1, 2]", 400, "invalid_value", None),
    (
        "missing-model",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
        400,
        "invalid_value",
        "model",
    ),
    (
        "missing-messages",
        "/v1/chat/completions",
        json.dumps({"model": MODEL}).encode(),
        400,
        "invalid_value",
        "messages",
    ),
    (
        "messages-not-list",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": "hi"}).encode(),
        400,
        "invalid_value",
        "messages",
    ),
    (
        "content-wrong-type",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(),
        400,
        "invalid_value",
        "messages[0].content",
    ),
    (
        "stream-not-bool",
        "/v1/chat/completions",
        json.dumps({**chat_body("hi"), "stream": "yes"}).encode(),
        400,
        "invalid_value",
        "stream",
    ),
    (
        "negative-max-tokens",
        "/v1/chat/completions",
        json.dumps({**chat_body("hi"), "max_tokens": -1}).encode(),
        400,
        "invalid_value",
        "max_tokens",
    ),
    (
        "prompt-wrong-type",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(),
        400,
        "invalid_value",
        "prompt",
    ),
    (
        "unknown-model",
        "/v1/chat/completions",
        json.dumps(chat_body("hi", model="nope")).encode(),
        404,
        "model_not_found",
        "model",
    ),
    ("oversized", "/v1/chat/completions", json.dumps(chat_body(_LONG)).encode(), 413, "request_too_large", None),
]


class TestBadInput:
    @pytest.mark.parametrize(
        ("path", "raw", "status", "code", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
    )
    def test_rejected_with_openai_error(
        self, servers: Servers, path: str, raw: bytes, status: int, code: str, param: str | None
    ) -> None:
        """Each bad request gets its status and an OpenAI-style error naming the problem."""
        proxy = servers.proxy(servers.emulators(1), max_body_bytes=64 * 1024)
        got, headers, body = http("POST", proxy.url + path, raw=raw)
        assert got == status
        error = json.loads(body)["error"]
        assert set(error) >= {"message", "type", "code"}
        assert error["code"] == code and error["message"]
        if param is not None:
            assert error["param"] == param
        assert headers["x-request-id"]

    def test_oversized_chunked_body(self, servers: Servers) -> None:
        """A body without Content-Length is cut off at the limit with 413 as well."""
        import socket

        proxy = servers.proxy(servers.emulators(1), max_body_bytes=1024)
        chunk = b"x" * 4096
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(request)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        assert reply.startswith(b"HTTP/1.1 413 ")
        assert b'"request_too_large"' in reply

    def test_routes_and_methods(self, servers: Servers) -> None:
        """Unknown routes get 404 and known routes with a wrong method get 405, both in OpenAI's shape."""
        proxy = servers.proxy(servers.emulators(1))
        status, _, body = http("GET", proxy.url + "/v1/nothing-here")
        assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
        status, headers, body = http("GET", proxy.url + "/v1/chat/completions")
        assert (
            status == 405 and headers["allow"] == "POST" and json.loads(body)["error"]["code"] == "method_not_allowed"
        )

    def test_no_backend_is_503_with_retry_after(self, servers: Servers) -> None:
        """A fleet with no routable backend answers 503 with Retry-After."""
        proxy = servers.proxy([], retry_after_s=7)
        status, headers, body = http("POST", proxy.url + "/v1/chat/completions", chat_body("hi"))
        assert status == 503
        assert headers["retry-after"] == "7"
        assert json.loads(body)["error"]["code"] == "no_backend_available"

    def test_bad_requests_do_not_disturb_streams_in_flight(self, servers: Servers) -> None:
        """Streams running while every bad-input case is sent all complete with [DONE]."""
        proxy = servers.proxy(servers.emulators(2), max_body_bytes=64 * 1024)
        results: list[bytes] = []

        def stream(i: int) -> None:
            status, _, body = http(
                "POST", proxy.url + "/v1/chat/completions", chat_body(f"long story {i}", max_tokens=300, stream=True)
            )
            assert status == 200
            results.append(body)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for _ in range(3):
            for case in CASES:
                status = http("POST", proxy.url + case[1], raw=case[2])[0]
                assert status == case[3]
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == 4
        assert all(body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body for body in results)
