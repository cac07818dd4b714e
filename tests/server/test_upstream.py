"""Unit rules of the upstream path: header filtering, usage sniffing, SSE event boundaries."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from kvroute_server.forwarding import _event_end, _stream_error_event
from kvroute_server.upstream import UsageSniffer, filter_request_headers, filter_response_headers


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


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
    def test_event_end_cuts_after_last_complete_event(self, events: list[str], partial: str) -> None:
        """_event_end points just past the last blank line, so the partial tail is never sent early."""
        complete = "".join(f"data: {e}\n\n" for e in events).encode()
        data = complete + partial.replace("\n", "").encode()
        assert _event_end(data) == len(complete)

    def test_crlf_events(self) -> None:
        """CRLF-delimited events are recognised too."""
        assert _event_end(b"data: x\r\n\r\ndata: y") == len(b"data: x\r\n\r\n")

    def test_error_event_is_openai_shaped_sse(self) -> None:
        """The mid-stream error is one SSE event with an OpenAI error body, then [DONE]."""
        event = _stream_error_event("broke", "upstream_stream_error")
        first, done, rest = event.split(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_error"
        assert done == b"data: [DONE]" and rest == b""


class TestBackendHttpTimeout:
    def test_with_timeout_copies_the_client_with_another_timeout(self) -> None:
        """`with_timeout` gives the same session, URL and headers with the new timeout, leaving the original alone."""
        from kvroute_server.upstream import BackendHttp

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
