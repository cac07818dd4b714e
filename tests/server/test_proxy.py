"""End to end: the openai SDK -> kvroute proxy -> emulators, all on loopback."""

from __future__ import annotations

import http.client as httplib
import json
from collections import Counter

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute_server import HealthConfig
from kvroute_server.fleet.adapter_http import _nodelay_socket
from tests.server.harness import MODEL, Servers, chat_body, http

pytestmark = pytest.mark.e2e


def _client(proxy_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy_url + "/v1", api_key="test-key", max_retries=0, timeout=30)


def _metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    status, _, body = http("GET", url + "/metrics")
    assert status == 200
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


class TestOpenAISdk:
    def test_chat_non_streaming(self, servers: Servers) -> None:
        """A chat completion through the proxy returns the emulator's answer and usage with cached_tokens."""
        proxy = servers.proxy(servers.emulators(2))
        reply = _client(proxy.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me a story " * 20}], max_tokens=5
        )
        assert reply.choices[0].finish_reason == "length"
        assert len(reply.choices[0].message.content.split()) == 5
        assert reply.usage.completion_tokens == 5
        assert reply.usage.prompt_tokens_details.cached_tokens == 0

    def test_chat_streaming_with_usage(self, servers: Servers) -> None:
        """A streamed chat arrives chunk by chunk, ends cleanly, and carries usage when asked."""
        proxy = servers.proxy(servers.emulators(2))
        stream = _client(proxy.url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream please " * 10}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text.split()) == 6
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    def test_stream_is_passed_through_not_buffered(self, servers: Servers) -> None:
        """The first streamed event reaches the client while the backend is still generating."""
        emulator = servers.emulator(time_scale=1.0)  # 1,000 decode steps of 15 ms: 15 s of generation
        proxy = servers.proxy([emulator])
        conn = httplib.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(chat_body("go", max_tokens=1000, stream=True)),
                {"content-type": "application/json"},
            )
            response = conn.getresponse()
            assert response.status == 200
            assert response.read1(65536).startswith(b"data: ")
            stats = json.loads(http("GET", emulator.url + "/emulator/stats")[2])
            assert stats["running"] == 1 and stats["completed"] == 0
        finally:
            conn.close()  # leave early: the rest of the test suite need not wait 15 s

    def test_completions_both_modes(self, servers: Servers) -> None:
        """Legacy completions work streamed and not, and give the same text for the same prompt."""
        proxy = servers.proxy(servers.emulators(1))
        client = _client(proxy.url)
        whole = client.completions.create(model=MODEL, prompt="one two three four", max_tokens=4)
        parts = client.completions.create(model=MODEL, prompt="one two three four", max_tokens=4, stream=True)
        assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text

    def test_models_union(self, servers: Servers) -> None:
        """/v1/models lists the union of the models the emulators report."""
        a = servers.emulator(model="alpha")
        b = servers.emulator(model="beta")
        proxy = servers.proxy([a, b])
        # Models are discovered by the first probe round, which runs at startup.
        ids = sorted(m.id for m in _client(proxy.url).models.list())
        for _ in range(50):
            if ids == ["alpha", "beta"]:
                break
            import time

            time.sleep(0.05)
            ids = sorted(m.id for m in _client(proxy.url).models.list())
        assert ids == ["alpha", "beta"]

    def test_requests_go_to_the_backend_serving_the_model(self, servers: Servers) -> None:
        """With two models on two backends, each request lands on the backend that serves its model."""
        a = servers.emulator(model="alpha")
        b = servers.emulator(model="beta")
        proxy = servers.proxy([a, b])
        import time

        for _ in range(100):
            if json.loads(http("GET", proxy.url + "/v1/models")[2])["data"].__len__() == 2:
                break
            time.sleep(0.05)
        for model, backend in (("alpha", "e0"), ("beta", "e1")) * 3:
            status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", chat_body("hi", model=model))
            assert status == 200 and headers["x-kvroute-backend"] == backend


class TestRouting:
    def test_same_prefix_lands_on_one_backend(self, servers: Servers) -> None:
        """With consistent-hash, requests sharing a long prefix all go to one backend; different prefixes spread."""
        proxy = servers.proxy(servers.emulators(4), strategy="consistent-hash", options={"prefix_length": 1024})
        homes: dict[int, set[str]] = {}
        for group in range(6):
            prefix = f"document {group} " + "lorem ipsum dolor " * 80
            for i in range(5):
                status, headers, _ = http(
                    "POST", proxy.url + "/v1/chat/completions", chat_body(prefix + f" question {i}")
                )
                assert status == 200
                homes.setdefault(group, set()).add(headers["x-kvroute-backend"])
        assert all(len(b) == 1 for b in homes.values())
        assert len({next(iter(b)) for b in homes.values()}) > 1

    def test_prefix_routing_raises_cache_hits_over_random(self, servers: Servers) -> None:
        """The emulators' own prefix-cache hit counters are higher under consistent-hash than under random."""

        def hit_ratio(strategy: str, options: dict[str, object]) -> float:
            fleet = servers.emulators(4)
            proxy = servers.proxy(fleet, strategy=strategy, options=options)
            for i in range(40):
                group = i % 4
                prefix = f"shared context {group} " + "alpha beta gamma delta " * 100
                assert (
                    http(
                        "POST",
                        proxy.url + "/v1/completions",
                        {"model": MODEL, "prompt": prefix + f"q{i}", "max_tokens": 1},
                    )[0]
                    == 200
                )
            hits = queries = 0.0
            for emulator in fleet:
                hits += sum(_metric(emulator.url, "vllm:prefix_cache_hits_total").values())
                queries += sum(_metric(emulator.url, "vllm:prefix_cache_queries_total").values())
            return hits / queries

        hashed = hit_ratio("consistent-hash", {"prefix_length": 1024})
        scattered = hit_ratio("random", {"seed": 7})
        assert hashed > scattered
        assert hashed > 0.8

    def test_backend_header_and_request_id(self, servers: Servers) -> None:
        """The response names the backend and echoes the caller's x-request-id, which reaches the backend too."""
        proxy = servers.proxy(servers.emulators(1))
        status, headers, _ = http(
            "POST", proxy.url + "/v1/chat/completions", chat_body("x"), headers={"x-request-id": "abc-123"}
        )
        assert status == 200
        assert headers["x-kvroute-backend"] == "e0"
        assert headers["x-request-id"] == "abc-123"

    def test_request_id_created_and_header_can_be_turned_off(self, servers: Servers) -> None:
        """Without x-request-id the proxy makes one; backend_header=None hides the backend."""
        proxy = servers.proxy(servers.emulators(1), backend_header=None)
        status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", chat_body("x"))
        assert status == 200
        assert len(headers["x-request-id"]) == 32
        assert "x-kvroute-backend" not in headers

    def test_tcp_nodelay_on_both_sides(self, servers: Servers) -> None:
        """Accepted connections (proxy and emulator) and upstream sockets have TCP_NODELAY set."""
        import socket
        import threading

        emulator = servers.emulator()
        proxy = servers.proxy([emulator])
        assert http("POST", proxy.url + "/v1/chat/completions", chat_body("warm up"))[0] == 200
        # Hold a client connection open to the proxy while a slow stream runs.
        done = threading.Event()

        def slow() -> None:
            http("POST", proxy.url + "/v1/chat/completions", chat_body("slow " * 10, max_tokens=200, stream=True))
            done.set()

        thread = threading.Thread(target=slow)
        thread.start()
        try:
            for _ in range(200):
                if proxy.connections_nodelay() and emulator.connections_nodelay():
                    break
                done.wait(0.01)
            assert proxy.connections_nodelay() and all(proxy.connections_nodelay())
            assert emulator.connections_nodelay() and all(emulator.connections_nodelay())
        finally:
            thread.join(timeout=30)
        sock = _nodelay_socket((socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", 0)))
        try:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            sock.close()

    def test_passthrough_tokenize(self, servers: Servers) -> None:
        """/tokenize is passed through to a backend and answers with the emulator's token ids."""
        proxy = servers.proxy(servers.emulators(2))
        status, _, body = http("POST", proxy.url + "/tokenize", {"model": MODEL, "prompt": "a b c"})
        assert status == 200
        assert json.loads(body)["count"] == 3


class TestObservability:
    def test_metrics_count_requests_tokens_and_ttft(self, servers: Servers) -> None:
        """/metrics counts requests by backend and outcome, cached prompt tokens, TTFT and decisions."""
        proxy = servers.proxy(servers.emulators(1), strategy="least-outstanding")
        text = "same prompt " * 64
        for stream in (False, True):
            body = chat_body(text, stream=stream)
            body["stream_options"] = {"include_usage": True} if stream else None
            assert http("POST", proxy.url + "/v1/chat/completions", body)[0] == 200
        requests = _metric(proxy.url, "kvroute_requests_total")
        assert requests[(("backend", "e0"), ("outcome", "ok"), ("strategy", "least-outstanding"))] == 2
        assert _metric(proxy.url, "kvroute_prompt_tokens_cached_total")[(("backend", "e0"),)] > 0
        assert _metric(proxy.url, "kvroute_upstream_ttft_seconds_count")[(("backend", "e0"),)] == 1
        assert _metric(proxy.url, "kvroute_routing_decision_seconds_count")[(("strategy", "least-outstanding"),)] == 2
        assert _metric(proxy.url, "kvroute_in_flight")[(("backend", "e0"),)] == 0

    def test_health_reflects_routable_backends(self, servers: Servers) -> None:
        """/health answers 200 with routable backends and 503 with none."""
        proxy = servers.proxy(servers.emulators(1))
        assert http("GET", proxy.url + "/health")[0] == 200
        empty = servers.proxy([], health=HealthConfig(interval=0))
        status, _, body = http("GET", empty.url + "/health")
        assert status == 503 and json.loads(body)["routable"] == 0

    def test_access_log_line(self, servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
        """One structured log line per request names the request id, backend, strategy, status and timings."""
        import structlog

        proxy = servers.proxy(servers.emulators(1), access_log=True)
        with structlog.testing.capture_logs() as logs:
            http("POST", proxy.url + "/v1/chat/completions", chat_body("log me"), headers={"x-request-id": "rid-1"})
            http("POST", proxy.url + "/v1/chat/completions", raw=b"{oops", headers={"x-request-id": "rid-2"})
        lines = [entry for entry in logs if entry.get("event") == "request"]
        assert len(lines) == 2
        line = lines[0]
        for key in ("model", "strategy", "backend", "reason", "key", "status", "ttft_s", "duration_s"):
            assert key in line
        assert line["request_id"] == "rid-1" and line["backend"] == "e0" and line["status"] == 200
        bad = lines[1]
        assert (bad["request_id"], bad["status"], bad["outcome"], bad["backend"]) == ("rid-2", 400, "rejected", "none")
        assert "not valid JSON" in bad["error"]
        assert Counter(e["event"] for e in logs)["request"] == 2
