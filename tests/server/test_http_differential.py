"""kvroute's HTTP/1.1 protocol against uvicorn's stock one: the same bytes in, the same answers out.

Two servers on loopback run the same small ASGI app, one on each protocol (``http="kvroute"``
and ``http="httptools"``); raw sockets send each case of a corpus to both and read until the
server closes. Answers are compared byte for byte (status line, headers, body with its
framing, where the connection closes) after normalising only what may differ:

* ``date`` and ``server`` headers (both runners turn them off; dropped anyway);
* the body (and so the content type and length) of an answer the server gives on its own, a
  400 or a 500: kvroute's is JSON in OpenAI's error shape, uvicorn's is plain text. Their
  status and the closing of the connection must agree;
* a request head over 64 KiB: kvroute answers 431 and closes, uvicorn has no limit and serves it;
* an app's response header with a line break: kvroute answers 500, uvicorn closes without an answer.

The proxy app itself is also run under both protocols, in front of a deterministic engine.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig
from kvroute_server.http.runner import HTTP_PROTOCOLS, ServerThread

PROTOCOLS = HTTP_PROTOCOLS
#: Headers the two protocols may each set their own way (both runners turn them off).
UNCOMPARED = frozenset({b"date", b"server"})
#: Statuses a server answers on its own (not the app): only status, connection and closing are compared.
OWN_ANSWERS = frozenset({400, 500})


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app both servers run: routes by path to each kind of answer the corpus needs."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break

    async def start(status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})

    if path == "/stream":  # no Content-Length: chunked, one chunk per message
        await start(200, [(b"content-type", b"text/event-stream")])
        for i in range(3):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    elif path == "/204":
        await start(204, [])
        await send({"type": "http.response.body", "body": b""})
    elif path == "/304":
        await start(304, [(b"etag", b'"v1"')])
        await send({"type": "http.response.body", "body": b""})
    elif path == "/close":
        await start(200, [(b"content-length", b"2"), (b"connection", b"close")])
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/inject":  # a header value that would add a header of its own
        await start(200, [(b"content-length", b"2"), (b"x-a", b"b\r\nset-cookie: evil=1")])
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/fail":
        raise RuntimeError("the app failed before its answer")
    else:  # echo: what the app was given
        seen = b"%s %s ?%s v%s\n" % (
            scope["method"].encode(),
            scope["raw_path"],
            scope["query_string"],
            scope["http_version"].encode(),
        )
        reply = seen + body
        await start(200, [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(reply))])
        await send({"type": "http.response.body", "body": reply})


@pytest.fixture(scope="module")
def app_servers() -> Iterator[dict[str, ServerThread]]:
    """The app on loopback under each protocol."""
    servers = {http: ServerThread(_app, http=http).start() for http in PROTOCOLS}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@attrs.frozen
class Wait:
    """A step of a case: read until ``marker`` has arrived before sending the next bytes."""

    marker: bytes


#: A step of a case: half-close (the client will send nothing more).
SHUT = "shut"


def _exchange(port: int, steps: list[bytes | Wait | str], timeout: float = 10.0) -> bytes:
    """Play ``steps`` on a new connection; every byte the server sent until it closed."""
    received = b""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        for step in steps:
            if isinstance(step, Wait):
                while step.marker not in received:
                    chunk = sock.recv(65536)
                    assert chunk, f"closed before {step.marker!r}: {received!r}"
                    received += chunk
            elif step == SHUT:
                sock.shutdown(socket.SHUT_WR)
            else:
                assert isinstance(step, bytes)
                sock.sendall(step)
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"the server kept the connection open: {received!r}") from None
            if not chunk:
                break
            received += chunk
    return received


@attrs.frozen
class Answer:
    """One response as read off the wire: its status line, its headers (names lower-cased) and its framed body."""

    status_line: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    @property
    def status(self) -> int:
        return int(self.status_line.split(b" ")[1])

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)

    def normalised(self, own: frozenset[int] = OWN_ANSWERS) -> Answer:
        """Without the headers either side may set its own way; the server's ``own`` answers reduced to their
        status."""
        headers = tuple((n, v) for n, v in self.headers if n not in UNCOMPARED)
        if self.status in own:
            keep = {b"connection"}
            return Answer(self.status_line, tuple((n, v) for n, v in headers if n in keep), b"")
        return Answer(self.status_line, headers, self.body)


def _answers(data: bytes, methods: list[str]) -> tuple[list[Answer], bytes]:
    """The responses in ``data`` (``methods``: the requests' methods, in order) and any bytes left unparsed."""
    out: list[Answer] = []
    methods = list(methods)
    while data:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            break
        lines = data[:end].split(b"\r\n")
        headers = tuple((n.strip().lower(), v.strip()) for n, _, v in (line.partition(b":") for line in lines[1:]))
        rest = data[end + 4 :]
        answer = Answer(lines[0], headers, b"")
        status = answer.status
        no_body = status < 200 or status in (204, 304) or (methods and methods[0] == "HEAD")
        if status >= 200 and methods:
            methods.pop(0)
        length = answer.header(b"content-length")
        if no_body:
            body = b""
        elif answer.header(b"transfer-encoding") == b"chunked":
            body, rest = _chunked(rest)
        elif length is not None:
            body, rest = rest[: int(length)], rest[int(length) :]
        else:
            body, rest = rest, b""
        out.append(attrs.evolve(answer, body=body))
        data = rest
    return out, data


def _chunked(data: bytes) -> tuple[bytes, bytes]:
    """A chunked body as sent (sizes and all, so framing is compared too) and what follows it."""
    at = 0
    while True:
        line_end = data.index(b"\r\n", at)
        size = int(data[at:line_end], 16)
        at = line_end + 2 + size + 2
        if size == 0:
            return data[:at], data[at:]


@attrs.frozen
class Case:
    """A corpus entry: the client's steps, the methods of the requests it sends and the statuses both must answer."""

    name: str
    steps: tuple[bytes | Wait | str, ...]
    methods: tuple[str, ...]
    statuses: tuple[int, ...] = ()


def _get(path: str, *extra: str, version: str = "1.1", method: str = "GET") -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nhost: t\r\n" + "".join(f"{h}\r\n" for h in extra) + "\r\n"
    return head.encode("latin-1")


LAST = _get("/last", "connection: close")
CHUNKED_BODY = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"

#: Requests both protocols must answer alike (the server's own 400/500 compared by status and closing).
CORPUS = [
    Case(
        "keep-alive",
        (_get("/echo?a=1"), Wait(b"?a=1"), _get("/echo%20x"), Wait(b"%20x"), LAST),
        ("GET",) * 3,
        (200, 200, 200),
    ),
    Case("pipelining", (_get("/one") + _get("/two") + _get("/three") + LAST,), ("GET",) * 4, (200, 200, 200, 200)),
    Case("chunked request body", (CHUNKED_BODY + LAST,), ("POST", "GET"), (200, 200)),
    Case(
        "content-length body",
        (b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhello" + LAST,),
        ("POST", "GET"),
        (200, 200),
    ),
    Case(
        "expect 100-continue",
        (
            b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n",
            Wait(b"100 Continue\r\n\r\n"),
            b"body" + LAST,
        ),
        ("POST", "GET"),
        (100, 200, 200),
    ),
    Case("HEAD", (_get("/echo", method="HEAD") + LAST,), ("HEAD", "GET"), (200, 200)),
    Case("HEAD of a stream", (_get("/stream", method="HEAD") + LAST,), ("HEAD", "GET"), (200, 200)),
    Case("204", (_get("/204") + LAST,), ("GET", "GET"), (204, 200)),
    Case("304", (_get("/304") + LAST,), ("GET", "GET"), (304, 200)),
    Case("HTTP/1.0", (_get("/echo", version="1.0"),), ("GET",), (200,)),
    Case("HTTP/1.0 keep-alive asked", (_get("/echo", "connection: keep-alive", version="1.0"),), ("GET",), (200,)),
    Case("connection close", (_get("/echo", "connection: close") + _get("/never"),), ("GET",), (200,)),
    Case("app closes", (_get("/close") + _get("/never"),), ("GET",), (200,)),
    Case("streamed answer", (_get("/stream") + LAST,), ("GET", "GET"), (200, 200)),
    Case("app fails", (_get("/fail") + _get("/never"),), ("GET",), (500,)),
    Case(
        "bad chunk size",
        (b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n",),
        (),
        (400,),
    ),
    Case("bad content-length", (b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 1x\r\n\r\n",), (), (400,)),
    Case(
        "two content-lengths",
        (b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",),
        (),
        (400,),
    ),
    Case("control byte in a header name", (b"GET /echo HTTP/1.1\r\nhost: t\r\nx-\x01a: b\r\n\r\n",), (), (400,)),
    Case("NUL in a header value", (b"GET /echo HTTP/1.1\r\nhost: t\r\nx-a: b\x00c\r\n\r\n",), (), (400,)),
    Case("bare CR in a header (injection)", (b"GET /echo HTTP/1.1\r\nhost: t\r\nx-a: b\rx-b: c\r\n\r\n",), (), (400,)),
    Case("space before the colon", (b"GET /echo HTTP/1.1\r\nhost: t\r\nx-a : b\r\n\r\n",), (), (400,)),
    Case("not HTTP", (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(64)),), (), (400,)),
    Case("bad request line", (b"GET\r\n\r\n",), (), (400,)),
    Case("truncated body", (b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\nhello", SHUT), (), ()),
    Case("truncated head", (b"GET /echo HTTP/1.1\r\nhost: t\r\nx-a: ", SHUT), (), ()),
    Case("valid request then garbage", (_get("/echo") + b"\x00\x01garbage\r\n\r\n",), ("GET",), (400,)),
]


def _run(port: int, case: Case) -> tuple[list[Answer], bytes]:
    return _answers(_exchange(port, list(case.steps)), list(case.methods))


class TestSameAnswers:
    @pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
    def test_the_protocols_answer_alike(self, app_servers: dict[str, ServerThread], case: Case) -> None:
        """Each case of the corpus gets the same answers, framing and close from both protocols."""
        results = {http: _run(server.port, case) for http, server in app_servers.items()}
        ours, stock = (results[http] for http in PROTOCOLS)
        assert [a.normalised() for a in ours[0]] == [a.normalised() for a in stock[0]]
        assert ours[1] == stock[1] == b"", "bytes after the last answer"
        assert tuple(a.status for a in ours[0]) == case.statuses

    def test_corpus_distinguishes_framing(self, app_servers: dict[str, ServerThread]) -> None:
        """The comparison sees framing: a streamed answer's chunks are compared with their sizes."""
        answers, _ = _run(app_servers["kvroute"].port, next(c for c in CORPUS if c.name == "streamed answer"))
        assert (
            answers[0].body
            == b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
        )


class TestEachOwnContract:
    def test_own_error_bodies(self, app_servers: dict[str, ServerThread]) -> None:
        """A request that is not HTTP gets kvroute's JSON 400 in OpenAI's shape, and uvicorn's plain-text one."""
        bad = (b"GET\r\n\r\n",)
        ours, _ = _run(app_servers["kvroute"].port, Case("x", bad, ()))
        stock, _ = _run(app_servers["httptools"].port, Case("x", bad, ()))
        assert json.loads(ours[0].body)["error"]["code"] == "invalid_http"
        assert ours[0].header(b"content-type") == b"application/json"
        assert stock[0].body == b"Invalid HTTP request received."

    def test_own_500_bodies(self, app_servers: dict[str, ServerThread]) -> None:
        """An app that fails before its answer gets kvroute's JSON 500, and uvicorn's plain-text one."""
        ours, _ = _run(app_servers["kvroute"].port, Case("x", (_get("/fail"),), ("GET",)))
        stock, _ = _run(app_servers["httptools"].port, Case("x", (_get("/fail"),), ("GET",)))
        assert json.loads(ours[0].body)["error"]["code"] == "internal_error"
        assert stock[0].body == b"Internal Server Error"

    def test_response_header_injection(self, app_servers: dict[str, ServerThread]) -> None:
        """A header value with a line break in it never reaches the wire: kvroute answers 500, uvicorn closes."""
        steps = (_get("/inject") + _get("/never"),)
        ours = _exchange(app_servers["kvroute"].port, list(steps))
        stock = _exchange(app_servers["httptools"].port, list(steps))
        assert b"evil" not in ours and b"evil" not in stock
        assert [a.status for a in _answers(ours, ["GET"])[0]] == [500] and stock == b""

    def test_oversized_head(self, app_servers: dict[str, ServerThread]) -> None:
        """A request head over 64 KiB: kvroute answers 431 and closes; uvicorn has no limit and serves it."""
        big = (_get("/echo", "x-big: " + "a" * 70_000, "connection: close"),)
        ours, _ = _run(app_servers["kvroute"].port, Case("x", big, ("GET",)))
        stock, _ = _run(app_servers["httptools"].port, Case("x", big, ("GET",)))
        assert [a.status for a in ours] == [431] and ours[0].header(b"connection") == b"close"
        assert [a.status for a in stock] == [200]


class _Engine:
    """A deterministic engine: the same chat answer and stream every time, and a model list."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        request = b""
        more = True
        while more:
            message = await receive()
            request += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] == "/v1/models":
            body = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
            await send({"type": "http.response.start", "status": 200, "headers": _json_headers(body)})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if json.loads(request).get("stream"):
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for i in range(3):
                event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        body = (
            b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
            b'"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,'
            b'"total_tokens":6}}'
        )
        await send({"type": "http.response.start", "status": 200, "headers": _json_headers(body)})
        await send({"type": "http.response.body", "body": body})


def _json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]


@pytest.fixture(scope="module")
def proxies() -> Iterator[dict[str, ServerThread]]:
    """The proxy app under each protocol, in front of one deterministic engine."""
    engine = ServerThread(_Engine()).start()
    config = ServerConfig(
        backends=(BackendConfig(id="e0", url=engine.url),),
        health=HealthConfig(interval=0.2, timeout=1.0, unhealthy_threshold=2, healthy_threshold=1),
        access_log=False,
        strategy="least-outstanding",
        options={"seed": 0},
    )
    servers = {http: ServerThread(ProxyApp(config), http=http).start() for http in PROTOCOLS}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        engine.stop()


def _post(path: str, body: dict[str, Any], *extra: str) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
    return (head + "".join(f"{h}\r\n" for h in extra) + "\r\n").encode() + data


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
#: The proxy's requests: answers from the engine (relayed), and the proxy's own refusals (``/last`` is a 404).
PROXY_CORPUS = [
    Case("chat", (_post("/v1/chat/completions", CHAT) + LAST,), ("POST", "GET"), (200, 404)),
    Case("chat stream", (_post("/v1/chat/completions", {**CHAT, "stream": True}) + LAST,), ("POST", "GET"), (200, 404)),
    Case("models", (_get("/v1/models") + LAST,), ("GET", "GET"), (200, 404)),
    Case(
        "not JSON",
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\n{{{" + LAST,),
        ("POST", "GET"),
        (400, 404),
    ),
    Case("unknown path", (_get("/nope") + LAST,), ("GET", "GET"), (404, 404)),
    Case(
        "chat, chunked body, expect",
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
            b"transfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n",
            Wait(b"100 Continue\r\n\r\n"),
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(json.dumps(CHAT)), json.dumps(CHAT).encode()) + LAST,
        ),
        ("POST", "GET"),
        (100, 200, 404),
    ),
    Case(
        "truncated chat body",
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 99\r\n\r\n{", SHUT),
        (),
        (),
    ),
]


def _wait_healthy(server: ServerThread) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        answers, _ = _run(server.port, Case("ready", (_get("/v1/models", "connection: close"),), ("GET",)))
        if answers and answers[0].status == 200:
            return
        time.sleep(0.1)
    raise AssertionError("the proxy found no healthy backend within 20 s")


class TestProxySameAnswers:
    @pytest.mark.parametrize("case", PROXY_CORPUS, ids=[case.name for case in PROXY_CORPUS])
    def test_the_proxy_answers_alike(self, proxies: dict[str, ServerThread], case: Case) -> None:
        """The proxy relays and refuses alike under both protocols (request ids aside)."""
        for server in proxies.values():
            _wait_healthy(server)
        results = {http: _run(server.port, case) for http, server in proxies.items()}

        def comparable(answers: list[Answer]) -> list[Answer]:
            out = []
            for answer in answers:
                answer = answer.normalised(own=frozenset())  # the proxy's own 400s are compared whole
                headers = tuple((n, v) for n, v in answer.headers if n != b"x-request-id")
                body = answer.body
                if answer.header(b"x-request-id") is not None:
                    body = body.replace(answer.header(b"x-request-id") or b"", b"<id>")
                # /v1/models' "created" is each proxy's start time: the two may start a second apart.
                body = re.sub(rb'"created":\d+', b'"created":<t>', body)
                out.append(attrs.evolve(answer, headers=headers, body=body))
            return out

        ours, stock = (results[http] for http in PROTOCOLS)
        assert comparable(ours[0]) == comparable(stock[0])
        assert ours[1] == stock[1] == b""
        assert tuple(a.status for a in ours[0]) == case.statuses
