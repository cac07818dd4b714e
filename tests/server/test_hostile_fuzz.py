"""Fuzzing the proxy with request bodies: every answer is a 2xx or a 4xx with a JSON body.

One proxy, started once for the class, in front of a stub backend that answers every
request at once with 200, so that what is tested is the proxy's own handling of the body
(parsing, the `RouteRequest`, the strategy), not an engine's. A thread sends ordinary
requests the whole time: they must all succeed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig
from kvroute_server.http.asgi import read_body, send_json
from kvroute_server.http.runner import ServerThread
from tests.hypothesis_strategies import conversations
from tests.server.harness import MODEL, chat_body, http

pytestmark = pytest.mark.e2e

_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
#: Enough examples to cover the shapes, few enough for a few seconds per test.
_FUZZ = settings(
    max_examples=250, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


class StubBackend:
    """An OpenAI-compatible backend that serves model ``m`` and answers every generation with 200 at once."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await read_body(receive, 1 << 30)
        if scope["path"] == "/v1/models":
            await send_json(send, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            await send_json(send, 200, {"id": "stub", "object": "chat.completion", "choices": []})


class _Background:
    """Sends an ordinary chat request every few milliseconds until stopped; records the statuses."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(0.02):
            self.statuses.append(http("POST", self.url, chat_body(f"ordinary {i}"), timeout=10)[0])
            i += 1

    def __enter__(self) -> _Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture(scope="class")
def proxy() -> Iterator[ServerThread]:
    """The stub backend and one prefix-aware proxy in front of it, for the whole class."""
    backend = ServerThread(StubBackend()).start()
    config = ServerConfig(
        backends=(BackendConfig(id="stub", url=backend.url, models=(MODEL,)),),
        health=HealthConfig(interval=0.2, timeout=1.0),
        strategy="consistent-hash",
        access_log=False,
        max_body_bytes=64 * 1024,
    )
    server = ServerThread(ProxyApp(config)).start()
    try:
        yield server
    finally:
        server.stop()
        backend.stop()


def check_answer(status: int, headers: dict[str, str], body: bytes) -> None:
    """A 2xx, or a 4xx in OpenAI's error shape served as JSON."""
    assert 200 <= status < 300 or 400 <= status < 500, (status, body[:300])
    assert headers.get("content-type") == "application/json", (status, headers)
    if status >= 400:
        error = json.loads(body)["error"]
        assert error["message"] and error["code"] and set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), error


# -- strategies ---------------------------------------------------------------------------

#: Any code point, lone surrogates included (written as \\u escapes or, unencodable, dropped by the encoder below).
_any_text = st.text(st.characters(exclude_categories=()), max_size=20)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and the infinities included: json.dumps writes them as NaN / Infinity
    | _any_text
)
json_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_any_text, inner, max_size=4), max_leaves=25
)

#: A content part: text, an image, or anything.
_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "x"]) | json_values},
    optional={
        "text": _any_text | json_values,
        "image_url": json_values,
        "input_audio": json_values,
    },
)
_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", ""]) | json_values},
    optional={
        "content": _any_text | st.lists(_parts | json_values, max_size=3) | json_values,
        "name": json_values,
        "tool_calls": json_values,
    },
)
#: Bodies shaped like generation requests with fields of any type: they reach deep into `RouteRequest`.
request_shaped = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "other", ""]) | json_values},
    optional={
        "messages": st.lists(_messages | json_values, max_size=4) | conversations | json_values,
        "prompt": _any_text
        | st.lists(st.integers(-5, 2**64), max_size=4)
        | st.lists(_any_text, max_size=3)
        | json_values,
        "input": json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-3, 2**65) | json_values,
        "max_completion_tokens": json_values,
        "tools": st.lists(json_values, max_size=3) | json_values,
        "cache_salt": _any_text | json_values,
        "lora_adapter": json_values,
        "chat_template_kwargs": json_values,
    },
)


def encode(value: object, ascii_only: bool) -> bytes:
    """JSON text of ``value``; with ``ascii_only`` lone surrogates become \\u escapes, else they are dropped."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    return text.encode("utf-8", "ignore" if not ascii_only else "strict")


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A valid chat body cut short, with a byte replaced, or with bytes inserted."""
    raw = json.dumps(draw(st.sampled_from([chat_body("hello there"), chat_body("x", stream=True)]))).encode()
    at = draw(st.integers(0, len(raw)))
    how = draw(st.sampled_from(["cut", "replace", "insert"]))
    if how == "cut":
        return raw[:at]
    junk = draw(st.binary(min_size=1, max_size=4))
    return raw[:at] + junk + raw[at + (1 if how == "replace" else 0) :]


#: Raw JSON text that ``json.dumps`` cannot produce: deep nesting, 6,000-digit numbers, non-finite
#: literals, escaped lone surrogates.
_fragments = st.one_of(
    st.integers(2, 6000).map(lambda n: "[" * n + "]" * n),
    st.integers(2, 6000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.integers(2, 3000).map(lambda n: '[{"type":"x","v":' * n + "0" + "}]" * n),
    st.integers(1, 6000).map(lambda n: "9" * n),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", '"\\ud800"', '"x\\udfff"', '"\\ud800\\ud800"']),
)
_HOLE = "\x00hole"


@st.composite
def spliced(draw: st.DrawFn) -> bytes:
    """A request-shaped body with one value (a field, or a message's content) replaced by a raw fragment."""
    body = dict(draw(request_shaped))
    field = draw(st.sampled_from(["model", "messages", "prompt", "max_tokens", "stream", "tools", "content", "part"]))
    if field == "content":
        body["messages"] = [{"role": "user", "content": _HOLE}]
    elif field == "part":
        body["messages"] = [{"role": "user", "content": [{"type": "x", "v": _HOLE}]}]
    else:
        body[field] = _HOLE
    return json.dumps(body).replace(json.dumps(_HOLE), draw(_fragments)).encode()


class TestFuzzProxy:
    """Fuzzed bodies never get a 5xx or a hang from the proxy, and ordinary requests meanwhile all succeed."""

    def _fuzz(self, proxy: ServerThread, bodies: st.SearchStrategy[bytes]) -> set[int]:
        """Run the fuzz with ordinary requests alongside; returns the statuses the fuzzed bodies got."""
        statuses: set[int] = set()
        with _Background(proxy.url + "/v1/chat/completions") as background:

            @_FUZZ
            @given(path=st.sampled_from(_PATHS), raw=bodies)
            def check(path: str, raw: bytes) -> None:
                status, headers, body = http("POST", proxy.url + path, raw=raw, timeout=10)
                statuses.add(status)
                check_answer(status, headers, body)

            check()
        assert background.statuses and set(background.statuses) == {200}
        assert http("POST", proxy.url + "/v1/chat/completions", chat_body("after the fuzz"))[0] == 200
        return statuses

    def test_arbitrary_bytes(self, proxy: ServerThread) -> None:
        """Any bytes (mostly not JSON, often not UTF-8) get a 2xx or a 4xx JSON error."""
        self._fuzz(proxy, st.binary(max_size=512))

    def test_arbitrary_json(self, proxy: ServerThread) -> None:
        """Any JSON document, NaN and lone surrogates included, gets a 2xx or a 4xx JSON error."""
        self._fuzz(proxy, st.builds(encode, json_values, st.booleans()))

    def test_request_shaped_json(self, proxy: ServerThread) -> None:
        """Bodies shaped like chat and completion requests, with fields of any type, get a 2xx or a 4xx JSON error."""
        statuses = self._fuzz(proxy, st.builds(encode, request_shaped, st.booleans()))
        assert {200, 400} <= statuses  # both routed and refused bodies were reached

    def test_spliced_hostile_values(self, proxy: ServerThread) -> None:
        """Request-shaped bodies holding deep nesting, huge numbers, NaN or lone surrogates get a 4xx JSON error or a
        2xx."""
        assert 400 in self._fuzz(proxy, spliced())

    def test_mangled_requests(self, proxy: ServerThread) -> None:
        """Valid chat bodies cut short or with bytes replaced or inserted get a 2xx or a 4xx JSON error."""
        assert {200, 400} <= self._fuzz(proxy, mangled())
