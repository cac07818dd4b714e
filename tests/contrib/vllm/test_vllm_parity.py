"""``kvroute check-parity`` against vLLM's captured /tokenize answers, with the tiny model's own tokenizer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from click.testing import CliRunner
from kvroute_tokenizer_prefix import load_tokenizer
from kvroute_vllm import VllmAdapter
from structlog.testing import capture_logs

from kvroute.adapters import HttpReply
from kvroute_server.parity import check_backend, check_parity, sample_chats, sample_prompts, startup_check
from tests.contrib.vllm.vllm_fakes import FakeHttp, fixture_text, json_reply, kv_events

pytestmark = pytest.mark.anyio

KINDS = {"vllm": VllmAdapter.create}
PROMPTS = [("bakumi", "Hello world, bakumi tosa.")]
CHATS = [
    ("hello", [{"role": "user", "content": "Hello world"}]),
    (
        "system-parts",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello world"}]},
        ],
    ),
]
MODELS = {
    "object": "list",
    "data": [{"id": "tiny-llama", "object": "model", "owned_by": "vllm", "root": "/m", "max_model_len": 8192}],
}


def _captured() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for item in json.loads(fixture_text("tokenize.json")):
        request = dict(item["request"])
        if request.get("messages") == [{"role": "user", "content": "<chat_prompt in kv_events.json>"}]:
            request["messages"] = [{"role": "user", "content": kv_events()["chat_prompt"]}]
        out.append((request, item["response"]))
    return out


def _tokenize(body: object) -> HttpReply:
    """vLLM's /tokenize as captured: the answer to the identical request, else 400."""
    for request, response in _captured():
        if request == body:
            return json_reply(response)
    return json_reply({"error": {"message": "not captured", "type": "BadRequestError"}}, 400)


def _engine(**routes: Any) -> FakeHttp:
    http = FakeHttp(
        {
            ("GET", "/v1/models"): json_reply(MODELS),
            ("GET", "/metrics"): HttpReply(200, fixture_text("metrics_idle.txt").encode()),
            ("POST", "/tokenize"): _tokenize,
        }
    )
    for key, reply in routes.items():
        method, _, path = key.partition("_")
        http.set(method.upper(), "/" + path.replace("__", "/"), reply)
    return http


class TestCheckBackend:
    async def test_identical_to_the_captured_engine(self, tiny_tokenizer: str) -> None:
        """The router's tokenizer and template give vLLM's exact ids; the engine's block size is read from /metrics."""
        report = await check_backend(
            _engine(), load_tokenizer(tiny_tokenizer), backend="http://e", prompts=PROMPTS, chats=CHATS, kinds=KINDS
        )
        assert report.ok and report.compared == 3 and report.model == "tiny-llama"
        assert (report.engine_block_size, report.block_size_source) == (128, "vllm adapter")
        assert [c.router_count for c in report.cases] == [15, 14, 24]

    async def test_long_captured_chat(self, tiny_tokenizer: str) -> None:
        """The 3,302-token chat prompt captured with the KV events tokenizes identically."""
        chats = [("long", [{"role": "user", "content": kv_events()["chat_prompt"]}])]
        report = await check_backend(
            _engine(), load_tokenizer(tiny_tokenizer), backend="e", prompts=[], chats=chats, kinds=KINDS
        )
        assert report.ok and report.cases[0].router_count == 3302

    async def test_chat_template_mismatch_is_shown(self, tiny_tokenizer: str) -> None:
        """Another chat template makes the chats differ; the report names the first differing token."""
        tokenizer = load_tokenizer(
            tiny_tokenizer, chat_template="{% for m in messages %}<|begin|>{{ m['content'] }}{% endfor %}"
        )
        report = await check_backend(_engine(), tokenizer, backend="e", prompts=PROMPTS, chats=CHATS[:1], kinds=KINDS)
        assert not report.ok
        prompt, chat = report.cases
        assert prompt.status == "ok" and chat.status == "mismatch"
        assert chat.first_difference == 1 and chat.engine_around[:3] == (0, 5, 206)
        assert "first difference at token 1" in chat.describe() and report.lines()[-1].startswith("  FAIL")

    async def test_block_size_disagreement_fails(self, tiny_tokenizer: str) -> None:
        """A strategy hashing 16-token blocks in front of a 128-token engine fails the check."""
        report = await check_backend(
            _engine(),
            load_tokenizer(tiny_tokenizer),
            backend="e",
            prompts=PROMPTS,
            chats=[],
            router_block_size=16,
            kinds=KINDS,
        )
        assert not report.block_size_ok and not report.ok
        assert any("DIFFERS" in line for line in report.lines())

    async def test_usage_counts_without_tokenize(self, tiny_tokenizer: str) -> None:
        """An engine without /tokenize (TensorRT-LLM) is compared on usage.prompt_tokens, and says so."""
        http = _engine()
        http.routes.pop(("POST", "/tokenize"))
        http.set("POST", "/v1/completions", json_reply({"usage": {"prompt_tokens": 15, "completion_tokens": 1}}))
        http.set("POST", "/v1/chat/completions", json_reply({"usage": {"prompt_tokens": 13, "completion_tokens": 1}}))
        report = await check_backend(
            http, load_tokenizer(tiny_tokenizer), backend="e", prompts=PROMPTS, chats=CHATS[:1], kinds=KINDS
        )
        assert [(c.method, c.status) for c in report.cases] == [("usage", "ok"), ("usage", "mismatch")]
        assert (
            "POST",
            "/v1/completions",
            {"model": "tiny-llama", "prompt": PROMPTS[0][1], "max_tokens": 1, "stream": False},
        ) in http.calls

    async def test_refused_samples_are_skipped(self, tiny_tokenizer: str) -> None:
        """A sample the engine refuses is skipped; with nothing compared the check does not pass."""
        report = await check_backend(
            _engine(),
            load_tokenizer(tiny_tokenizer),
            backend="e",
            prompts=[("other", "not captured")],
            chats=[],
            kinds=KINDS,
        )
        assert report.cases[0].status == "skipped" and "not captured" in (report.cases[0].note or "")
        assert report.compared == 0 and not report.ok

    async def test_unreachable_engine_is_an_error(self, tiny_tokenizer: str) -> None:
        """Transport failures end up in the report's error."""
        http = FakeHttp({("GET", "/v1/models"): OSError("connection refused")})
        report = await check_backend(http, load_tokenizer(tiny_tokenizer), backend="e", kinds=KINDS)
        assert report.error is not None and "connection refused" in report.error and not report.ok

    def test_built_in_samples_fit_a_small_context(self, tiny_tokenizer: str) -> None:
        """The built-in samples stay under 8,192 tokens with a small-vocabulary tokenizer (usage fallback needs it)."""
        from kvroute.request import RouteRequest

        tokenizer = load_tokenizer(tiny_tokenizer)
        for _, text in sample_prompts():
            assert len(tokenizer.encode_text(text, add_special_tokens=True)) < 8192
        for _, messages in sample_chats():
            request = RouteRequest.from_openai({"model": "m", "messages": messages})
            assert len(tokenizer.encode_text(tokenizer.render(request))) < 8192


class _Strategy:
    def __init__(self, tokenizer: Any, block_size: int | None = None) -> None:
        self.prompt_tokenizer = tokenizer
        self.block_size = block_size


class TestStartupCheck:
    async def test_mismatch_is_a_loud_warning(self, tiny_tokenizer: str) -> None:
        """At proxy start, a backend whose tokens differ gets a tokenizer_parity_mismatch warning with the details."""
        strategy = _Strategy(load_tokenizer(tiny_tokenizer, chat_template="{{ messages[0]['content'] }}"))
        with capture_logs() as logs:
            reports = await startup_check(strategy, [("b0", "http://e", _engine())], kinds=KINDS)
        assert len(reports) == 1 and not reports[0].ok
        warnings = [e for e in logs if e["event"] == "tokenizer_parity_mismatch"]
        assert warnings and warnings[0]["log_level"] == "warning" and warnings[0]["backend"] == "b0"

    async def test_match_is_logged_at_info(self, tiny_tokenizer: str) -> None:
        """A backend whose tokens match logs tokenizer_parity_ok with the engine's block size, and no warning."""
        with capture_logs() as logs:
            reports = await startup_check(
                _Strategy(load_tokenizer(tiny_tokenizer)),
                [("b0", "http://e", _engine())],
                kinds=KINDS,
                prompts=PROMPTS,
                chats=CHATS,
            )
        assert reports[0].ok
        (event,) = [e for e in logs if e["event"].startswith("tokenizer_parity")]
        assert (event["event"], event["log_level"], event["engine_block_size"]) == ("tokenizer_parity_ok", "info", 128)

    async def test_strategies_without_a_tokenizer_are_not_checked(self) -> None:
        """A strategy that does not tokenize (bounded-load, random) needs no parity check."""
        assert await startup_check(object(), [("b0", "http://e", _engine())]) == []


class _Handler(BaseHTTPRequestHandler):
    def _reply(self, reply: HttpReply) -> None:
        self.send_response(reply.status)
        self.send_header("content-length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._reply(json_reply(MODELS))
        elif self.path == "/metrics":
            self._reply(HttpReply(200, fixture_text("metrics_idle.txt").encode()))
        else:
            self._reply(HttpReply(404, b"{}"))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self._reply(_tokenize(body) if self.path == "/tokenize" else HttpReply(404, b"{}"))

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class TestCheckParityCommand:
    def _run(self, *args: str) -> Any:
        return CliRunner().invoke(check_parity, list(args), catch_exceptions=False)

    def test_pass_exits_zero(self, engine_url: str, tiny_tokenizer: str) -> None:
        """Matching samples print PASS and the engine's block size, and exit 0."""
        result = self._run(
            "--backend",
            engine_url,
            "--tokenizer",
            tiny_tokenizer,
            "--no-samples",
            "--prompt",
            PROMPTS[0][1],
            "--messages",
            json.dumps(CHATS[1][1]),
        )
        assert result.exit_code == 0, result.output
        assert "engine block size: 128 tokens (vllm adapter)" in result.output and "PASS: 2/2" in result.output

    def test_mismatch_exits_one_with_json(self, engine_url: str, tiny_tokenizer: str) -> None:
        """A mismatching chat template exits 1; --json gives the per-sample details."""
        result = self._run(
            "--backend",
            engine_url,
            "--tokenizer",
            tiny_tokenizer,
            "--chat-template",
            "{{ messages[0]['content'] }}",
            "--no-samples",
            "--messages",
            json.dumps(CHATS[0][1]),
            "--json",
        )
        assert result.exit_code == 1
        (report,) = json.loads(result.output)
        assert report["ok"] is False and report["cases"][0]["status"] == "mismatch"

    def test_unreachable_exits_two(self, tiny_tokenizer: str) -> None:
        """A backend that cannot be reached exits 2 with the error."""
        result = self._run("--backend", "http://127.0.0.1:9", "--tokenizer", tiny_tokenizer, "--timeout", "5")
        assert result.exit_code == 2 and "error:" in result.output

    def test_bad_arguments(self, engine_url: str) -> None:
        """Malformed --messages and --option are usage errors."""
        assert self._run("--backend", engine_url, "--messages", "{").exit_code == 2
        assert self._run("--backend", engine_url, "--option", "novalue").exit_code == 2
        assert "nothing to compare" in self._run("--backend", engine_url, "--no-samples").output
