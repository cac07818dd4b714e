"""kvroute serve's spans, exported by the real OpenTelemetry SDK and OTLP exporters to receivers on loopback.

The client is the real ``openai`` SDK; the engines are the emulator and the gray-failure fake engine (which
records the headers it got, so the ``traceparent`` the proxy sent upstream can be checked).
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread, TracingConfig
from kvroute_server.ops.tracing import NoTracing
from tests.contrib.tracing.receiver import GrpcReceiver, HttpReceiver, ReceivedSpan
from tests.server.gray_engine import GrayEngine
from tests.server.harness import MODEL, Servers

#: A prompt no span attribute may contain.
SECRET = "the-prompt-text-must-never-leave-the-proxy"


@pytest.fixture
def servers() -> Iterator[Servers]:
    registry = Servers()
    try:
        yield registry
    finally:
        registry.stop_all()


@pytest.fixture
def receiver() -> Iterator[HttpReceiver]:
    found = HttpReceiver().start()
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture
def engines() -> Iterator[list[GrayEngine]]:
    started: list[GrayEngine] = []
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def _engine(engines: list[GrayEngine], fault: str = "ok") -> GrayEngine:
    engine = GrayEngine(fault, model=MODEL).start()
    engines.append(engine)
    return engine


def _client(proxy: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=30)


def _traceparent(rng: random.Random, sampled: bool = True) -> tuple[str, str, str]:
    """A client's W3C context: (header value, trace id, parent span id)."""
    trace_id, span_id = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def _flush(proxy: ServerThread) -> None:
    assert proxy.app.tracing.processor.force_flush(10_000)


def _by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def _chat(client: openai.OpenAI, traceparent: str | None = None, **kw: Any) -> Any:
    headers = {"traceparent": traceparent} if traceparent else {}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SECRET}], max_tokens=4, extra_headers=headers, **kw
    )


class TestSpanTree:
    def test_client_trace_is_continued_with_route_and_attempt_children(
        self, servers: Servers, receiver: HttpReceiver
    ) -> None:
        """A request carrying a traceparent yields a server span under the client's span, with a route span and an
        attempt span as its children, all in the client's trace."""
        emulators = servers.emulators(2)
        proxy = servers.proxy(emulators, tracing=TracingConfig(endpoint=receiver.url))
        header, trace_id, parent = _traceparent(random.Random(1))
        _chat(_client(proxy), header)
        _flush(proxy)
        spans = receiver.trace(trace_id, 3)
        (server,) = _by_name(spans, "POST /v1/chat/completions")
        (route,) = _by_name(spans, "kvroute.route")
        (attempt,) = _by_name(spans, "kvroute.attempt")
        assert server.parent_span_id == parent
        assert server.kind == "SPAN_KIND_SERVER"
        assert route.parent_span_id == server.span_id
        assert attempt.parent_span_id == server.span_id
        assert attempt.kind == "SPAN_KIND_CLIENT"
        assert server.start_ns <= route.start_ns <= route.end_ns <= attempt.end_ns <= server.end_ns
        assert server.status == "STATUS_CODE_UNSET"
        assert server.resource["service.name"] == "kvroute"

    def test_attributes_follow_genai_conventions_and_hold_no_prompt(
        self, servers: Servers, receiver: HttpReceiver
    ) -> None:
        """The server span carries GenAI request and usage attributes, the route span the decision, the attempt span
        the backend, status, first byte and bytes; no attribute anywhere holds the prompt text."""
        emulators = servers.emulators(2)
        proxy = servers.proxy(emulators, tracing=TracingConfig(endpoint=receiver.url), strategy="consistent-hash")
        header, trace_id, _ = _traceparent(random.Random(2))
        answer = _chat(_client(proxy), header)
        _flush(proxy)
        spans = receiver.trace(trace_id, 3)
        server = _by_name(spans, "POST /v1/chat/completions")[0]
        route = _by_name(spans, "kvroute.route")[0]
        attempt = _by_name(spans, "kvroute.attempt")[0]
        assert server.attributes["gen_ai.request.model"] == MODEL
        assert server.attributes["gen_ai.operation.name"] == "chat"
        assert server.attributes["gen_ai.request.max_tokens"] == 4
        assert server.attributes["gen_ai.request.stream"] is False
        assert server.attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
        assert server.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
        assert server.attributes["http.response.status_code"] == 200
        assert server.attributes["kvroute.outcome"] == "ok"
        assert route.attributes["kvroute.route.strategy"] == "consistent-hash"
        assert len(route.attributes["kvroute.route.key"]) == 16
        assert route.attributes["kvroute.route.candidate_count"] == 2
        assert sorted(route.attributes["kvroute.route.candidates"]) == ["e0", "e1"]
        chosen = route.attributes["kvroute.route.backend"]
        assert chosen in ("e0", "e1")
        assert route.attributes["kvroute.route.spilled"] is False
        assert attempt.attributes["kvroute.attempt.backend"] == chosen
        assert attempt.attributes["kvroute.attempt.number"] == 1
        assert attempt.attributes["http.response.status_code"] == 200
        assert attempt.attributes["kvroute.attempt.first_byte_s"] > 0
        assert attempt.attributes["kvroute.attempt.response_bytes"] > 50
        for span in spans:
            for value in span.attributes.values():
                assert SECRET not in str(value), (span.name, value)

    def test_streamed_request_has_ttft(self, servers: Servers, receiver: HttpReceiver) -> None:
        """A streamed request's server span says stream and carries the TTFT the proxy measured."""
        proxy = servers.proxy(servers.emulators(1), tracing=TracingConfig(endpoint=receiver.url))
        header, trace_id, _ = _traceparent(random.Random(3))
        chunks = list(_chat(_client(proxy), header, stream=True))
        assert chunks
        _flush(proxy)
        server = _by_name(receiver.trace(trace_id, 3), "POST /v1/chat/completions")[0]
        assert server.attributes["gen_ai.request.stream"] is True
        assert server.attributes["kvroute.ttft_s"] > 0

    def test_new_trace_without_incoming_context(self, servers: Servers, receiver: HttpReceiver) -> None:
        """Without a traceparent the server span is a root of a new trace."""
        proxy = servers.proxy(servers.emulators(1), tracing=TracingConfig(endpoint=receiver.url))
        _chat(_client(proxy))
        _flush(proxy)
        spans = receiver.wait_for(lambda s: len(s) >= 3)
        server = _by_name(spans, "POST /v1/chat/completions")[0]
        assert server.parent_span_id == ""
        assert {s.trace_id for s in spans} == {server.trace_id}


class TestPropagation:
    def test_engine_gets_the_attempt_span_as_parent(
        self, servers: Servers, receiver: HttpReceiver, engines: list[GrayEngine]
    ) -> None:
        """The request to the engine carries a traceparent whose trace is the client's and whose parent is the
        attempt span, with the client's tracestate passed on."""
        engine = _engine(engines)
        proxy = servers.proxy([engine], tracing=TracingConfig(endpoint=receiver.url))  # type: ignore[list-item]
        header, trace_id, _ = _traceparent(random.Random(4))
        _client(proxy).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"traceparent": header, "tracestate": "vendor=abc"},
        )
        _flush(proxy)
        attempt = _by_name(receiver.trace(trace_id, 3), "kvroute.attempt")[0]
        sent = engine.headers[-1]
        assert sent["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"
        assert sent["tracestate"] == "vendor=abc"

    def test_attempt_names_the_data_parallel_rank_sent(
        self, servers: Servers, receiver: HttpReceiver, engines: list[GrayEngine]
    ) -> None:
        """For a backend with 4 data-parallel ranks, the attempt span names the rank the engine was sent."""
        engine = _engine(engines)
        backend = BackendConfig(id="dp", url=engine.url, adapter_options={"data_parallel_size": 4})
        config = ServerConfig(
            backends=(backend,),
            strategy="consistent-hash",
            health=HealthConfig(interval=0, discover_models=False),
            access_log=False,
            tracing=TracingConfig(endpoint=receiver.url),
        )
        proxy = ServerThread(ProxyApp(config)).start()
        servers.started.append(proxy)
        header, trace_id, _ = _traceparent(random.Random(12))
        _chat(_client(proxy), header)
        _flush(proxy)
        attempt = _by_name(receiver.trace(trace_id, 3), "kvroute.attempt")[0]
        sent = int(engine.headers[-1]["x-data-parallel-rank"])
        assert attempt.attributes["kvroute.attempt.data_parallel_rank"] == sent

    def test_tracing_off_passes_the_client_context_through(
        self, servers: Servers, engines: list[GrayEngine], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With tracing off (the default) the proxy makes no spans and forwards the client's traceparent as is."""
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        engine = _engine(engines)
        proxy = servers.proxy([engine])  # type: ignore[list-item]
        assert isinstance(proxy.app.tracing, NoTracing)
        header, _, _ = _traceparent(random.Random(5))
        _chat(_client(proxy), header)
        assert engine.headers[-1]["traceparent"] == header

    def test_unsampled_parent_is_followed(
        self, servers: Servers, receiver: HttpReceiver, engines: list[GrayEngine]
    ) -> None:
        """Parent-based sampling: a client's unsampled context exports nothing, and the engine is told so."""
        engine = _engine(engines)
        proxy = servers.proxy([engine], tracing=TracingConfig(endpoint=receiver.url))  # type: ignore[list-item]
        header, trace_id, _ = _traceparent(random.Random(6), sampled=False)
        _chat(_client(proxy), header)
        _flush(proxy)
        sent = engine.headers[-1]["traceparent"]
        assert sent.startswith(f"00-{trace_id}-") and sent.endswith("-00")
        assert not [s for s in receiver.spans if s.trace_id == trace_id]

    def test_ratio_zero_samples_no_new_trace_but_follows_sampled_parents(
        self, servers: Servers, receiver: HttpReceiver
    ) -> None:
        """With a sample ratio of 0, requests without context are not traced; a sampled parent still is."""
        tracing = TracingConfig(endpoint=receiver.url, sample_ratio=0.0)
        proxy = servers.proxy(servers.emulators(1), tracing=tracing)
        client = _client(proxy)
        for _ in range(5):
            _chat(client)
        header, trace_id, _ = _traceparent(random.Random(7))
        _chat(client, header)
        _flush(proxy)
        receiver.trace(trace_id, 3)
        assert {s.trace_id for s in receiver.spans} == {trace_id}


class TestFailures:
    def test_retry_marks_the_failed_attempt_and_names_the_cause(
        self, servers: Servers, receiver: HttpReceiver, engines: list[GrayEngine]
    ) -> None:
        """A request retried after a 500 has two attempt spans: the first an error (upstream_5xx), the second
        carrying the retry cause; the server span is not an error."""
        bad, good = _engine(engines, "500"), _engine(engines)
        proxy = servers.proxy(
            [bad, good],  # type: ignore[list-item]
            tracing=TracingConfig(endpoint=receiver.url),
            max_attempts=2,
        )
        client = _client(proxy)
        rng = random.Random(8)
        traces = []
        for _ in range(8):
            header, trace_id, _ = _traceparent(rng)
            _chat(client, header)
            traces.append(trace_id)
        _flush(proxy)
        receiver.wait_for(lambda spans: sum(s.name == "POST /v1/chat/completions" for s in spans) >= len(traces))
        retried = [t for t in traces if len(_by_name(receiver.trace(t, 3), "kvroute.attempt")) == 2]
        assert retried, "expected at least one of 8 requests to try the failing backend first"
        spans = receiver.trace(retried[0], 5)
        first, second = sorted(_by_name(spans, "kvroute.attempt"), key=lambda s: s.attributes["kvroute.attempt.number"])
        assert first.status == "STATUS_CODE_ERROR"
        assert first.attributes["kvroute.attempt.failure"] == "upstream_5xx"
        assert first.attributes["http.response.status_code"] == 500
        assert first.attributes["kvroute.attempt.backend"] == "e0"
        assert second.status == "STATUS_CODE_UNSET"
        assert second.attributes["kvroute.attempt.retry_cause"] == "upstream_5xx"
        assert second.attributes["kvroute.attempt.backend"] == "e1"
        assert len(_by_name(spans, "kvroute.route")) == 2
        server = _by_name(spans, "POST /v1/chat/completions")[0]
        assert server.status == "STATUS_CODE_UNSET"
        assert server.attributes["kvroute.attempts"] == 2

    def test_request_that_fails_everywhere_is_an_error(
        self, servers: Servers, receiver: HttpReceiver, engines: list[GrayEngine]
    ) -> None:
        """When every attempt fails the server span and each attempt span have error status, the server span the
        500 the client got."""
        proxy = servers.proxy(
            [_engine(engines, "500"), _engine(engines, "500")],  # type: ignore[list-item]
            tracing=TracingConfig(endpoint=receiver.url),
            max_attempts=2,
        )
        header, trace_id, _ = _traceparent(random.Random(9))
        with pytest.raises(openai.InternalServerError):
            _chat(_client(proxy), header)
        _flush(proxy)
        spans = receiver.trace(trace_id, 5)
        server = _by_name(spans, "POST /v1/chat/completions")[0]
        assert server.status == "STATUS_CODE_ERROR"
        assert server.attributes["http.response.status_code"] == 500
        assert server.attributes["kvroute.outcome"] == "upstream_error"
        attempts = _by_name(spans, "kvroute.attempt")
        assert len(attempts) == 2
        assert all(a.status == "STATUS_CODE_ERROR" for a in attempts)

    def test_hung_collector_drops_and_counts_spans(
        self, servers: Servers, engines: list[GrayEngine], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With a collector that never answers and a queue of 4 spans, every request still succeeds and the
        spans that did not fit are counted in kvroute_trace_spans_dropped_total."""
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
        hung = HttpReceiver("hang").start()
        try:
            proxy = servers.proxy(
                [_engine(engines)],  # type: ignore[list-item]
                tracing=TracingConfig(endpoint=hung.url, max_queue=4),
            )
            client = _client(proxy)
            for _ in range(20):
                assert _chat(client).choices[0].message.content == "ok"
            with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as response:
                text = response.read().decode()
            dropped = [line for line in text.splitlines() if line.startswith("kvroute_trace_spans_dropped_total")]
            counts = {line.split('"')[1]: float(line.split()[-1]) for line in dropped}
            # 60 spans made; the export thread holds at most one batch of 4, the queue 4 more.
            assert counts["queue_full"] >= 60 - 8
        finally:
            hung.stop()


class TestGrpc:
    def test_spans_arrive_over_grpc(self, servers: Servers) -> None:
        """With protocol grpc the same span tree reaches a gRPC trace service."""
        receiver = GrpcReceiver().start()
        try:
            tracing = TracingConfig(endpoint=receiver.url, protocol="grpc")
            proxy = servers.proxy(servers.emulators(1), tracing=tracing)
            header, trace_id, parent = _traceparent(random.Random(10))
            _chat(_client(proxy), header)
            _flush(proxy)
            spans = receiver.trace(trace_id, 3)
            server = _by_name(spans, "POST /v1/chat/completions")[0]
            assert server.parent_span_id == parent
            assert {s.parent_span_id for s in spans if s is not server} == {server.span_id}
        finally:
            receiver.stop()


class TestExemplars:
    def test_duration_and_ttft_histograms_carry_the_trace_id(self, servers: Servers, receiver: HttpReceiver) -> None:
        """Asked for OpenMetrics, /metrics shows the traced request's trace id as the exemplar of its duration and
        TTFT buckets; the classic text format stays without exemplars."""
        proxy = servers.proxy(servers.emulators(1), tracing=TracingConfig(endpoint=receiver.url))
        header, trace_id, _ = _traceparent(random.Random(11))
        list(_chat(_client(proxy), header, stream=True))
        request = urllib.request.Request(
            proxy.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["content-type"].startswith("application/openmetrics-text")
            text = response.read().decode()
        exemplar = f'# {{trace_id="{trace_id}"}}'
        assert any(
            line.startswith("kvroute_request_duration_seconds_bucket") and exemplar in line
            for line in text.splitlines()
        )
        assert any(
            line.startswith("kvroute_upstream_ttft_seconds_bucket") and exemplar in line for line in text.splitlines()
        )
        assert text.rstrip().endswith("# EOF")
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as response:
            assert response.headers["content-type"].startswith("text/plain")
            assert trace_id not in response.read().decode()
