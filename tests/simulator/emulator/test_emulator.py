"""The engine emulator answers like vLLM: routes, SSE, usage with cached tokens, Prometheus metrics."""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from kvroute_server import ServerThread
from kvroute_simulator.emulator import EmulatorApp, EmulatorConfig, RealTimeEngine, tokenize_chat, tokenize_text
from kvroute_simulator.emulator.cli import emulate
from kvroute_simulator.engine import EngineRequest
from kvroute_simulator.tokens import TokenSeq, vocabulary
from tests.server.harness import http

LONG = "alpha beta gamma delta epsilon zeta eta theta " * 20  # 160 words


def _chat(url: str, text: str, **extra: object) -> tuple[int, dict[str, object]]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}
    status, _, raw = http("POST", url + "/v1/chat/completions", body)
    return status, json.loads(raw) if raw and not raw.startswith(b"data:") else {"raw": raw}


class TestRoutes:
    def test_models_health_version_load(self, emulator: ServerThread) -> None:
        """/v1/models, /health, /version and /load have vLLM's shapes."""
        status, _, raw = http("GET", emulator.url + "/v1/models")
        card = json.loads(raw)["data"][0]
        assert status == 200 and card["id"] == "m" and card["owned_by"] == "vllm" and card["max_model_len"] == 32768
        assert http("GET", emulator.url + "/health")[0] == 200
        assert json.loads(http("GET", emulator.url + "/version")[2])["version"].startswith("kvroute-emulator")
        assert json.loads(http("GET", emulator.url + "/load")[2]) == {"server_load": 0}

    def test_repeated_prompt_reports_cached_tokens(self, emulator: ServerThread) -> None:
        """The second identical prompt reports its full cached blocks in usage.prompt_tokens_details."""
        status, first = _chat(emulator.url, LONG)
        assert status == 200
        usage = first["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # type: ignore[index]
        _, second = _chat(emulator.url, LONG)
        prompt = usage["prompt_tokens"]  # type: ignore[index]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16  # type: ignore[index]

    def test_cache_salt_separates_tenants(self, emulator: ServerThread) -> None:
        """The same prompt under another cache_salt does not hit the first tenant's blocks."""
        _chat(emulator.url, LONG, cache_salt="tenant-a")
        _, other = _chat(emulator.url, LONG, cache_salt="tenant-b")
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]

    def test_next_turn_hits_the_answer(self, emulator: ServerThread) -> None:
        """A follow-up turn containing the previous answer reuses blocks beyond the first prompt."""
        _, first = _chat(emulator.url, LONG, max_tokens=40)
        answer = first["choices"][0]["message"]["content"]  # type: ignore[index]
        body = {
            "model": "m",
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": LONG},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "more"},
            ],
        }
        second = json.loads(http("POST", emulator.url + "/v1/chat/completions", body)[2])
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"]  # type: ignore[index]

    def test_stream_shape(self, emulator: ServerThread) -> None:
        """A stream starts with the role, carries one token per event, ends with usage (when asked) and [DONE]."""
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, headers, raw = http("POST", emulator.url + "/v1/chat/completions", body)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["delta"]["content"] for c in content).split()) == 4

    def test_completions_with_token_ids_and_determinism(self, emulator: ServerThread) -> None:
        """Token-id prompts are accepted and the same prompt always gives the same text."""
        body = {"model": "m", "prompt": [10, 11, 12, 13], "max_tokens": 5}
        texts = {
            json.loads(http("POST", emulator.url + "/v1/completions", body)[2])["choices"][0]["text"] for _ in range(2)
        }
        assert len(texts) == 1 and len(texts.pop().split()) == 5

    def test_tokenize_matches_usage(self, emulator: ServerThread) -> None:
        """/tokenize counts the same prompt tokens a request reports; /detokenize inverts it."""
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]
        tokens = json.loads(http("POST", emulator.url + "/tokenize", {"model": "m", "messages": messages})[2])
        reply = json.loads(
            http("POST", emulator.url + "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 1})[
                2
            ]
        )
        assert tokens["count"] == reply["usage"]["prompt_tokens"] == len(tokens["tokens"])
        words = vocabulary().decode([40, 41, 42])
        ids = json.loads(http("POST", emulator.url + "/tokenize", {"prompt": words})[2])["tokens"]
        assert ids == [40, 41, 42]
        assert json.loads(http("POST", emulator.url + "/detokenize", {"tokens": ids})[2])["prompt"] == words

    @pytest.mark.parametrize(
        ("body", "status", "param"),
        [
            ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
            ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
            ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
            ({"model": "m", "messages": "x"}, 400, "messages"),
            ({"model": "m", "messages": [{"role": "user", "content": "x " * 40000}], "max_tokens": 1}, 400, "messages"),
        ],
    )
    def test_bad_requests(self, emulator: ServerThread, body: dict[str, object], status: int, param: str) -> None:
        """Invalid requests get vLLM-like 4xx errors naming the parameter."""
        got, _, raw = http("POST", emulator.url + "/v1/chat/completions", body)
        assert got == status and json.loads(raw)["error"]["param"] == param

    @pytest.mark.parametrize(
        "raw",
        [
            b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"model": "m", "n": ' + b"9" * 5000 + b"}",
        ],
        ids=["deep", "long-number"],
    )
    def test_hostile_json_is_a_400(self, emulator: ServerThread, raw: bytes) -> None:
        """JSON nested 100,000 deep or a 5,000-digit number gets a 400 JSON error, not a 500."""
        got, _, answer = http("POST", emulator.url + "/v1/chat/completions", raw=raw)
        assert got == 400 and json.loads(answer)["error"]["message"]


def _families(url: str) -> dict[str, object]:
    text = http("GET", url + "/metrics")[2].decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


class TestMediaType:
    def test_json_content_type_required(self, emulator: ServerThread) -> None:
        """Like vLLM, a POST without Content-Type application/json is refused with 400."""
        status, _, raw = http(
            "POST", emulator.url + "/tokenize", raw=b'{"prompt": "a"}', headers={"content-type": "text/plain"}
        )
        assert status == 400 and "Only 'application/json' is allowed" in json.loads(raw)["error"]["message"]


class TestMetrics:
    def test_vllm_names_types_and_labels(self, emulator: ServerThread) -> None:
        """/metrics has vLLM's families with their types and model_name/engine labels."""
        _chat(emulator.url, LONG)
        _chat(emulator.url, LONG)
        families = _families(emulator.url)
        expected = {
            "vllm:num_requests_running": "gauge",
            "vllm:num_requests_waiting": "gauge",
            "vllm:kv_cache_usage_perc": "gauge",
            "vllm:prefix_cache_queries": "counter",
            "vllm:prefix_cache_hits": "counter",
            "vllm:time_to_first_token_seconds": "histogram",
            "vllm:cache_config_info": "gauge",
        }
        for name, kind in expected.items():
            assert families[name].type == kind, name  # type: ignore[attr-defined]
        queries = {s.name: s for s in families["vllm:prefix_cache_queries"].samples}  # type: ignore[attr-defined]
        total = queries["vllm:prefix_cache_queries_total"]
        assert total.labels == {"model_name": "m", "engine": "0"}
        hits = {s.name: s.value for s in families["vllm:prefix_cache_hits"].samples}["vllm:prefix_cache_hits_total"]  # type: ignore[attr-defined]
        assert 0 < hits < total.value
        info = families["vllm:cache_config_info"].samples[0]  # type: ignore[attr-defined]
        assert info.labels == {
            "block_size": "16",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": "1024",
            "prefix_caching_hash_algo": "sha256",
            "engine": "0",
        }
        ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples}  # type: ignore[attr-defined]
        assert ttft["vllm:time_to_first_token_seconds_count"] == 2

    def test_exposition_lines(self, emulator: ServerThread) -> None:
        """The text carries HELP/TYPE lines and the exact series names routers scrape."""
        text = http("GET", emulator.url + "/metrics")[2].decode()
        for line in (
            "# TYPE vllm:prefix_cache_queries_total counter",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0',
        ):
            assert line in text


class TestFaults:
    def test_injected_errors_and_health(self, emulator: ServerThread) -> None:
        """Faults set at runtime make the next requests fail and /health report a status."""
        assert (
            http(
                "POST", emulator.url + "/emulator/faults", {"error_next": 1, "error_status": 502, "health_status": 503}
            )[0]
            == 200
        )
        assert _chat(emulator.url, "x")[0] == 502
        assert _chat(emulator.url, "x")[0] == 200
        assert http("GET", emulator.url + "/health")[0] == 503
        stats = json.loads(http("GET", emulator.url + "/emulator/stats")[2])
        assert stats["errors_injected"] == 1 and stats["completed"] == 1

    def test_unknown_fault_rejected(self, emulator: ServerThread) -> None:
        """An unknown fault name is a 400 naming the accepted ones."""
        status, _, raw = http("POST", emulator.url + "/emulator/faults", {"explode": 1})
        assert status == 400 and "error_next" in json.loads(raw)["error"]["message"]


class TestTokenizer:
    def test_whitespace_words(self) -> None:
        """Text tokenizes to one id per whitespace-separated word, stably."""
        assert len(tokenize_text("a  b\nc")) == 3
        assert tokenize_text("hello world") == tokenize_text("hello   world")

    def test_chat_template_nests_turns(self) -> None:
        """A conversation's prompt plus its answer is a prefix of the next turn's prompt."""
        first = tokenize_chat([{"role": "user", "content": "hi there"}])
        second = tokenize_chat(
            [
                {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"},
            ]
        )
        assert second[: len(first)] == first


class TestRealTimeEngine:
    @pytest.mark.anyio
    async def test_tokens_arrive_in_order_until_done(self) -> None:
        """A submitted request's tokens become available step by step until the stream is done."""
        import asyncio

        engine = EmulatorConfig(time_scale=0.001, num_gpu_blocks=64).engine()
        runner = RealTimeEngine(engine, time_scale=0.001)
        task = asyncio.create_task(runner.run())
        try:
            stream = runner.submit(EngineRequest("r", TokenSeq.of(range(100, 140)), 6))
            seen = 0
            while not stream.done or seen < 6:
                start, end = await asyncio.wait_for(stream.next_tokens(), 5)
                assert start == seen and end >= start
                seen = end
            assert seen == 6 and stream.first_token_at is not None
        finally:
            task.cancel()

    def test_time_scale_must_be_positive(self) -> None:
        """A zero time scale is refused."""
        with pytest.raises(ValueError, match="time_scale"):
            RealTimeEngine(EmulatorConfig().engine(), time_scale=0)


def _stats(server: ServerThread) -> dict[str, Any]:
    return json.loads(http("GET", server.url + "/emulator/stats")[2])


def _leave_early(server: ServerThread, body: dict[str, object], *, read_first_event: bool) -> None:
    """Send a request, optionally read the first SSE line, then close the connection."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"}
        )
        if read_first_event:
            response = conn.getresponse()
            assert response.status == 200 and response.read1(64).startswith(b"data: ")
            response.close()
    finally:
        conn.close()


class TestClientDisconnect:
    @pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
    def test_a_client_that_leaves_is_aborted_in_the_engine(self, emulator: ServerThread, stream: bool) -> None:
        """Closing the connection aborts the request: it leaves the batch and frees its blocks instead of decoding
        on."""
        # 15,000 tokens: about 2 s of decoding at this time scale, far longer than the test needs.
        body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 15000, "stream": stream}
        _leave_early(emulator, body, read_first_event=stream)
        deadline = time.monotonic() + 10
        while _stats(emulator)["client_disconnects"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = _stats(emulator)
        assert stats["client_disconnects"] == 1 and stats["aborted"] == 1
        assert stats["running"] == stats["waiting"] == 0
        assert stats["engine"]["aborted"] == 1 and stats["engine"]["finished"] == 0
        assert json.loads(http("GET", emulator.url + "/load")[2]) == {"server_load": 0}
        usage = [
            line
            for line in http("GET", emulator.url + "/metrics")[2].decode().splitlines()
            if line.startswith("vllm:kv_cache_usage_perc")
        ]
        assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0

    def test_the_aborted_prompt_stays_cached(self, emulator: ServerThread) -> None:
        """The prompt blocks an aborted request computed are still in the prefix cache for the next request."""
        body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 15000, "stream": True}
        _leave_early(emulator, body, read_first_event=True)
        status, again = _chat(emulator.url, LONG)
        assert status == 200
        prompt = again["usage"]["prompt_tokens"]  # type: ignore[index]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16  # type: ignore[index]


class TestCommand:
    def test_help_lists_options(self) -> None:
        """kvroute emulate --help documents the time scale and the faults."""
        result = CliRunner().invoke(emulate, ["--help"])
        assert result.exit_code == 0
        for option in ("--time-scale", "--block-size", "--num-gpu-blocks", "--fail-next", "--die-next"):
            assert option in result.output

    def test_app_serves_through_server_thread(self) -> None:
        """An EmulatorApp built from options serves on a free port and stops cleanly."""
        with ServerThread(EmulatorApp(EmulatorConfig(model="x", time_scale=0.01, num_gpu_blocks=64))) as server:
            assert http("GET", server.url + "/health")[0] == 200
