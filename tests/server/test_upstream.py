"""Unit rules of the upstream path: header filtering, usage sniffing, SSE event boundaries."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_server.proxy.answers import event_end, stream_error_event
from kvroute_server.proxy.headers import HOP_BY_HOP, filter_request_headers, filter_response_headers
from kvroute_server.proxy.usage import UsageSniffer


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


# -- a simple model of the header rules, to hold the optimised filters to --------------

_NAMES = ["X-A", "x-a", "x-b", "X-\xc0", "x-\xe0", "authorization", "x-request-id", "Keep-Alive", "host", "te", "date"]
_TOKENS = [*_NAMES, "keep-alive", "close", "", "X-B"]
_SPACE = st.sampled_from(["", " ", "\t", "\xa0", "\x85", "\x1f"])
_connection_value = st.lists(st.tuples(_SPACE, st.sampled_from(_TOKENS), _SPACE), max_size=4).map(
    lambda parts: ",".join(f"{before}{token}{after}" for before, token, after in parts)
)
_header = st.one_of(
    st.tuples(st.sampled_from(["connection", "Connection"]), _connection_value),
    st.tuples(st.sampled_from(_NAMES), st.sampled_from(["1", "2", "v\xe9"])),
)
_headers = st.lists(_header, max_size=8).map(
    lambda pairs: [(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs]
)


def _model_drop(raw: list[tuple[bytes, bytes]], always: frozenset[str]) -> set[str]:
    """The lower-case names not to forward: ``always``, plus each name listed in any Connection header."""
    named = {
        token.strip().lower()
        for name, value in raw
        if name.decode("latin-1").lower() == "connection"
        for token in value.decode("latin-1").split(",")
    }
    return set(always) | (named - {""})


def _model_request(raw: list[tuple[bytes, bytes]], forward: bool, api_key: str | None) -> dict[str, str]:
    drop = _model_drop(raw, HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"})
    if api_key is not None or not forward:
        drop.add("authorization")
    out = {}
    for name, value in raw:
        if name.decode("latin-1").lower() not in drop:
            out[name.decode("latin-1").lower()] = value.decode("latin-1")
    if api_key is not None:
        out["authorization"] = f"Bearer {api_key}"
    out["x-request-id"] = "rid"
    return out


def _model_response(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    drop = _model_drop(raw, HOP_BY_HOP | {"content-length", "date", "server"})
    return [(name.lower(), value) for name, value in raw if name.decode("latin-1").lower() not in drop]


class TestRequestHeaders:
    def test_hop_by_hop_and_owned_headers_are_dropped(self) -> None:
        """Connection-level headers, those named in Connection, Host and Content-Length never go upstream."""
        out = filter_request_headers(
            _raw(
                {
                    "Host": "proxy",
                    "Connection": "keep-alive, X-Secret",
                    "Keep-Alive": "5",
                    "TE": "trailers",
                    "Transfer-Encoding": "chunked",
                    "Upgrade": "h2c",
                    "Proxy-Authorization": "x",
                    "X-Secret": "s",
                    "Content-Length": "10",
                    "Accept-Encoding": "gzip",
                    "Content-Type": "application/json",
                    "X-Custom": "kept",
                }
            ),
            forward_authorization=True,
            api_key=None,
            request_id="rid",
        )
        assert out == {"content-type": "application/json", "x-custom": "kept", "x-request-id": "rid"}

    def test_authorization_forwarded_by_default(self) -> None:
        """The client's Authorization reaches the backend unless told otherwise."""
        out = filter_request_headers(
            _raw({"Authorization": "Bearer client"}), forward_authorization=True, api_key=None, request_id="r"
        )
        assert out["authorization"] == "Bearer client"

    def test_authorization_replaced_by_backend_key(self) -> None:
        """A backend api_key replaces the client's credentials."""
        out = filter_request_headers(
            _raw({"Authorization": "Bearer client"}), forward_authorization=True, api_key="k", request_id="r"
        )
        assert out["authorization"] == "Bearer k"

    def test_authorization_dropped_when_not_forwarded(self) -> None:
        """forward_authorization=False strips the client's credentials."""
        out = filter_request_headers(
            _raw({"Authorization": "Bearer client"}), forward_authorization=False, api_key=None, request_id="r"
        )
        assert "authorization" not in out

    def test_request_id_overrides_client_value(self) -> None:
        """The upstream x-request-id is the proxy's id for the request (the caller's when it sent one)."""
        out = filter_request_headers(
            _raw({"X-Request-Id": "old"}), forward_authorization=True, api_key=None, request_id="new"
        )
        assert out["x-request-id"] == "new"

    def test_names_listed_in_connection_are_dropped_wherever_they_come(self) -> None:
        """A name listed in any Connection header is dropped, even before that header; others keep their last value."""
        raw = [
            (b"x-a", b"1"),
            (b"connection", b"keep-alive"),
            (b"X-C", b"1"),
            (b"connection", b" X-A ,, x-b"),
            (b"x-b", b"2"),
            (b"x-c", b"2"),
        ]
        out = filter_request_headers(raw, forward_authorization=True, api_key=None, request_id="r")
        assert list(out.items()) == [("x-c", "2"), ("x-request-id", "r")]

    @settings(max_examples=400, derandomize=True, deadline=None)
    @given(_headers, st.booleans(), st.sampled_from([None, "k"]))
    def test_same_as_the_model(self, raw: list[tuple[bytes, bytes]], forward: bool, api_key: str | None) -> None:
        """Any header list is filtered as the model says: names, values, order, Latin-1 case and spacing rules."""
        out = filter_request_headers(raw, forward_authorization=forward, api_key=api_key, request_id="rid")
        assert list(out.items()) == list(_model_request(raw, forward, api_key).items())


class TestResponseHeaders:
    def test_response_headers_filtered(self) -> None:
        """Hop-by-hop, length, date and server headers are dropped on the way back; others pass."""
        out = filter_response_headers(
            _raw(
                {
                    "Content-Type": "text/event-stream",
                    "Transfer-Encoding": "chunked",
                    "Connection": "close",
                    "Content-Length": "5",
                    "Date": "x",
                    "Server": "uvicorn",
                    "X-Engine": "vllm",
                }
            )
        )
        assert out == [(b"content-type", b"text/event-stream"), (b"x-engine", b"vllm")]

    def test_names_listed_in_connection_are_dropped(self) -> None:
        """A backend's header named in its Connection header does not reach the client, in any case or spacing."""
        raw = [(b"X-Hop", b"1"), (b"Connection", b"keep-alive,\tx-hop "), (b"X-Kept", b"2")]
        assert filter_response_headers(raw) == [(b"x-kept", b"2")]

    def test_long_connection_value(self) -> None:
        """A long Connection value (not cached) names its headers all the same."""
        value = b", ".join(b"x-hop-%d" % i for i in range(20))
        raw = [(b"X-Hop-7", b"1"), (b"Connection", value), (b"X-Kept", b"2")]
        assert filter_response_headers(raw) == [(b"x-kept", b"2")]

    @settings(max_examples=400, derandomize=True, deadline=None)
    @given(_headers)
    def test_same_as_the_model(self, raw: list[tuple[bytes, bytes]]) -> None:
        """Any header list is filtered as the model says: names lower-cased, order kept, Connection-named ones gone."""
        assert filter_response_headers(raw) == _model_response(raw)


USAGE_EVENT = (
    b'data: {"choices":[],"usage":{"prompt_tokens":1234,"completion_tokens":5,'
    b'"prompt_tokens_details":{"cached_tokens":1024}}}\n\n'
)


class TestUsageSniffer:
    @given(st.lists(st.integers(min_value=0, max_value=len(USAGE_EVENT)), max_size=6))
    def test_found_whatever_the_chunking(self, cuts: list[int]) -> None:
        """prompt_tokens and cached_tokens are found however the bytes are split into chunks."""
        body = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n' + USAGE_EVENT + b"data: [DONE]\n\n"
        offset = body.index(USAGE_EVENT)
        points = sorted({0, len(body), *(offset + c for c in cuts)})
        sniffer = UsageSniffer()
        for start, end in itertools.pairwise(points):
            sniffer.feed(body[start:end])
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (1234, 1024)

    def test_completion_tokens_beside_their_details(self) -> None:
        """usage.completion_tokens is found, and completion_tokens_details (a table, not a count) does not hide it."""
        sniffer = UsageSniffer()
        sniffer.feed(
            USAGE_EVENT.replace(b'"prompt_tokens_details"', b'"completion_tokens_details":{},"prompt_tokens_details"')
        )
        assert (sniffer.prompt_tokens, sniffer.completion_tokens, sniffer.cached_tokens) == (1234, 5, 1024)

    def test_last_usage_wins(self) -> None:
        """With two usage objects in the bytes, the later one's numbers are kept."""
        sniffer = UsageSniffer()
        sniffer.feed(USAGE_EVENT + USAGE_EVENT.replace(b"1234", b"77").replace(b"1024", b"66"))
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (77, 66)

    def test_a_last_mention_without_a_number_keeps_the_earlier_number(self) -> None:
        """A later ``"prompt_tokens"`` not followed by a number does not hide the number before it."""
        sniffer = UsageSniffer()
        sniffer.feed(
            USAGE_EVENT + b'data: {"usage":{"prompt_tokens":null,"prompt_tokens_details":{"cached_tokens":"x"}}}'
        )
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (1234, 1024)

    def test_absurd_counts_are_ignored_not_raised(self) -> None:
        """A count of thousands of digits (a hostile backend) is not a token count: ignored, never an exception."""
        huge = b"9" * 5000
        sniffer = UsageSniffer()
        sniffer.feed(USAGE_EVENT.replace(b"1234", huge))
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (None, 1024)
        sniffer.feed(USAGE_EVENT + USAGE_EVENT.replace(b"1024", b"1" * 19))  # later absurd value: earlier one kept
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (1234, 1024)

    def test_pretty_printed_usage(self) -> None:
        """Spaces and line breaks around the colon are allowed (an indented JSON answer)."""
        sniffer = UsageSniffer()
        sniffer.feed(
            json.dumps(
                {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}, indent=2
            ).encode()
        )
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (9, 8)

    def test_cached_tokens_found_next_to_prompt_tokens_details_alone(self) -> None:
        """Bytes mentioning only ``prompt_tokens_details`` are still searched for ``cached_tokens``."""
        sniffer = UsageSniffer()
        sniffer.feed(b'{"prompt_tokens_details":{"cached_tokens":5}}')
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (None, 5)

    @given(st.integers(min_value=1, max_value=2000), st.lists(st.integers(min_value=1, max_value=700), max_size=8))
    def test_found_in_a_long_stream_whatever_the_chunk_sizes(self, filler: int, sizes: list[int]) -> None:
        """Usage after long other events is found with any chunk sizes, also chunks longer than the kept tail."""
        body = b'data: {"x":"' + b"a" * filler + b'"}\n\n' + USAGE_EVENT + b"data: [DONE]\n\n"
        sniffer = UsageSniffer()
        start = 0
        for size in [*sizes, len(body)]:
            sniffer.feed(body[start : start + size])
            start += size
        assert (sniffer.prompt_tokens, sniffer.cached_tokens) == (1234, 1024)

    def test_absent_usage_leaves_none(self) -> None:
        """Without usage nothing is recorded."""
        sniffer = UsageSniffer()
        sniffer.feed(b'data: {"choices":[{"delta":{"content":"prompt_tokens"}}]}\n\n')
        assert sniffer.cached_tokens is None


class TestSseBoundaries:
    @given(
        st.lists(st.text(alphabet='ab: {}"', max_size=20), min_size=1, max_size=5),
        st.text(alphabet="ab: ", max_size=10),
    )
    def testevent_end_cuts_after_last_complete_event(self, events: list[str], partial: str) -> None:
        """event_end points just past the last blank line, so the partial tail is never sent early."""
        complete = "".join(f"data: {e}\n\n" for e in events).encode()
        data = complete + partial.replace("\n", "").encode()
        assert event_end(data) == len(complete)

    def test_crlf_events(self) -> None:
        """CRLF-delimited events are recognised too."""
        assert event_end(b"data: x\r\n\r\ndata: y") == len(b"data: x\r\n\r\n")

    def test_error_event_is_openai_shaped_sse(self) -> None:
        """The mid-stream error is one SSE event with an OpenAI error body, then [DONE]."""
        event = stream_error_event("broke", "upstream_stream_error")
        first, done, rest = event.split(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_error"
        assert done == b"data: [DONE]" and rest == b""


class TestBackendHttpTimeout:
    def test_with_timeout_copies_the_client_with_another_timeout(self) -> None:
        """`with_timeout` gives the same session, URL and headers with the new timeout, leaving the original alone."""
        from kvroute_server.fleet.adapter_http import BackendHttp

        session = object()
        http = BackendHttp(session, "http://127.0.0.1:1", 2.0, {"authorization": "Bearer x"})  # type: ignore[arg-type]
        longer = http.with_timeout(120.0)
        assert (longer.session, longer.base_url, dict(longer.headers), longer.timeout) == (
            session,
            "http://127.0.0.1:1",
            {"authorization": "Bearer x"},
            120.0,
        )
        assert http.timeout == 2.0
