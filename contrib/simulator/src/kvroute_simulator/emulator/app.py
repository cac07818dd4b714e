"""An ASGI server that answers like a vLLM OpenAI-compatible server, backed by the engine model.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming with
``[DONE]`` and ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's Prometheus names), ``POST /tokenize``, ``POST /detokenize``,
``GET /version``, ``GET /load``, and the test controls ``GET|POST /emulator/faults`` and
``GET /emulator/stats``. See docs/emulator.md.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
import structlog

from kvroute import __version__
from kvroute.hashing import hash64, hash_parts
from kvroute_server._asgi import (
    BodyTooLarge,
    ClientGone,
    InvalidBody,
    Receive,
    Scope,
    Send,
    dumps,
    loads_body,
    read_body,
    send_bytes,
    send_error,
    send_json,
)
from kvroute_simulator.emulator.metrics import CONTENT_TYPE, EmulatedMetrics
from kvroute_simulator.emulator.realtime import RealTimeEngine, Stream
from kvroute_simulator.engine import CostModel, Engine, EngineConfig, EngineRequest
from kvroute_simulator.tokens import TokenSeq, Vocabulary, vocabulary

__all__ = ["EmulatorApp", "EmulatorConfig", "Faults", "tokenize_chat", "tokenize_text"]

log = structlog.get_logger(__name__)

_MAX_BODY = 64 * 1024 * 1024


@attrs.frozen(kw_only=True)
class EmulatorConfig:
    """What the emulated server serves and how its engine is sized (vLLM's flag names)."""

    model: str = "emulated"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    time_scale: float = 1.0
    default_max_tokens: int = 16
    prompt_tokens_details: bool = True
    engine_index: str = "0"

    def engine(self) -> Engine:
        """A fresh engine model with these settings (the cost model is the simulator's default)."""
        sizes: dict[str, Any] = {}
        if self.num_gpu_blocks is not None:
            sizes["capacity_blocks"] = self.num_gpu_blocks
        config = EngineConfig(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            **sizes,
        )
        return Engine(config, CostModel(), name=self.model, coalesce_decodes=False)


@attrs.define
class Faults:
    """Failures to inject, changeable at runtime through ``POST /emulator/faults``.

    Counts are "how many of the next requests"; ``-1`` means every request until changed.
    """

    error_next: int = 0
    error_status: int = 500
    die_next: int = 0
    die_after_events: int = 1
    delay_s: float = 0.0
    health_status: int = 200

    def take(self, name: str) -> bool:
        value: int = getattr(self, name)
        if value == 0:
            return False
        if value > 0:
            setattr(self, name, value - 1)
        return True


@attrs.define
class EmulatorStats:
    """What the emulator saw (for tests): requests, disconnects, requests aborted in the engine, faults fired."""

    requests: int = 0
    completed: int = 0
    client_disconnects: int = 0
    aborted: int = 0
    errors_injected: int = 0
    deaths_injected: int = 0


class _Die(Exception):
    """Raised to make the ASGI server drop the connection (an injected crash)."""


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def tokenize_text(text: str, vocab: Vocabulary | None = None) -> tuple[int, ...]:
    """The emulator's tokenizer: whitespace-separated words -> ids of the simulator's vocabulary."""
    return (vocab or vocabulary()).encode(text)


def tokenize_chat(
    messages: object, vocab: Vocabulary | None = None, *, add_generation_prompt: bool = True
) -> tuple[int, ...]:
    """The emulator's chat template: per message ``<|role|>`` + content words + ``<|end|>``, then ``<|assistant|>``."""
    vocab = vocab or vocabulary()
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list of message objects.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise _BadRequest(f"'messages[{i}]' must be an object with a string 'role'.", "messages")
    try:
        return vocab.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise _BadRequest(str(exc), "messages") from None


def _prompt_tokens(body: Mapping[str, Any], vocab: Vocabulary) -> tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return vocab.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    raise _BadRequest("'prompt' must be a string, a list of one string, or a list of token ids.", "prompt")


class EmulatorApp:
    """A fake vLLM server (ASGI 3 with lifespan) whose timing and caching come from the engine model."""

    def __init__(self, config: EmulatorConfig | None = None, faults: Faults | None = None) -> None:
        self.config = config or EmulatorConfig()
        self.faults = faults or Faults()
        self.stats = EmulatorStats()
        self.vocab = vocabulary()
        self.engine = self.config.engine()
        self.metrics = EmulatedMetrics(self.config.model, self.engine, engine_index=self.config.engine_index)
        self.runner: RealTimeEngine | None = None
        self._created = int(time.time())
        self._routes = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("GET", "/version"): self._version,
            ("GET", "/load"): self._load,
            ("GET", "/emulator/faults"): self._get_faults,
            ("POST", "/emulator/faults"): self._set_faults,
            ("GET", "/emulator/stats"): self._get_stats,
        }

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EmulatorApp]:
        """Run the engine's clock for the duration of the block."""
        self.runner = RealTimeEngine(self.engine, self.config.time_scale)
        task = asyncio.create_task(self.runner.run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.runner = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            assert message["type"] == "lifespan.startup"
            async with self.running():
                await send({"type": "lifespan.startup.complete"})
                await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        if handler is None:
            await send_error(send, 404, f"Not Found: {scope['method']} {scope['path']}", code="not_found")
            return
        try:
            await handler(scope, receive, send)
        except ClientGone:
            return
        except _BadRequest as exc:
            await send_error(send, exc.status, str(exc), param=exc.param, code=exc.code)

    # -- helpers ----------------------------------------------------------------------

    async def _json(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
        if not content_type.split(b";")[0].strip().lower() == b"application/json":
            # vLLM (FastAPI) refuses any other media type the same way.
            raise _BadRequest("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")
        try:
            raw = await read_body(receive, _MAX_BODY)
        except BodyTooLarge as exc:
            raise _BadRequest(str(exc), status=413) from None
        try:
            body = loads_body(raw)
        except InvalidBody as exc:
            raise _BadRequest(str(exc), code=exc.code) from None
        if not isinstance(body, dict):
            raise _BadRequest("The request body must be a JSON object.")
        return body

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise _BadRequest(f"The model `{model}` does not exist.", "model", status=404, code="model_not_found")

    def _output_tokens(self, prompt: tuple[int, ...], count: int) -> tuple[int, ...]:
        key = hash64(array.array("q", prompt).tobytes())
        words = self.vocab.word_ids()
        return tuple(words[hash_parts(key, i) % len(words)] for i in range(count))

    # -- generation -------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json(scope, receive)
        self._check_model(body)
        prompt = tokenize_chat(body.get("messages"), self.vocab)
        await self._generate(scope, receive, send, body, prompt, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json(scope, receive)
        self._check_model(body)
        await self._generate(scope, receive, send, body, _prompt_tokens(body, self.vocab), chat=False)

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, body: dict[str, Any], prompt: tuple[int, ...], *, chat: bool
    ) -> None:
        assert self.runner is not None, "the emulator is not running (lifespan not started)"
        self.stats.requests += 1
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _BadRequest(f"'max_tokens' must be an integer >= 1 (got {max_tokens!r}).", "max_tokens")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise _BadRequest(f"The emulator only supports n=1 (got {n!r}).", "n")
        stream_flag = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        if not prompt:
            raise _BadRequest("The prompt must hold at least one token.", "prompt")
        extra = body.get("cache_salt")
        lora = body.get("lora_adapter")
        extra_key = None if extra is None and lora is None else f"{lora}|{extra}"
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        if self.faults.take("error_next"):
            self.stats.errors_injected += 1
            await send_error(send, self.faults.error_status, "Injected failure (emulator fault).", code="injected")
            return
        die = self.faults.take("die_next")
        output = self._output_tokens(prompt, max_tokens)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            engine_request = EngineRequest(
                request_id, TokenSeq.of(prompt), max_tokens, output_tokens=output, extra_key=extra_key
            )
            stream = self.runner.submit(engine_request)
        except ValueError as exc:
            raise _BadRequest(str(exc), "messages" if chat else "prompt") from None

        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not stream.done:
                gone = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            if stream_flag:
                await self._stream(send, stream, output, request_id, chat, include_usage, die)
            else:
                await self._complete(send, stream, output, request_id, chat, die)
            self.stats.completed += 1
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            self.stats.client_disconnects += 1
        finally:
            watcher.cancel()
            # A response that will not be delivered (client gone, injected crash) is aborted in the
            # engine, as vLLM aborts a request whose client disconnects.
            if not stream.done and self.runner.abort(stream):
                self.stats.aborted += 1
            self.runner.detach(stream)
            if stream.first_token_at is not None:
                self.metrics.ttft.observe(stream.first_token_at - stream.submitted_at)
            if stream.done:
                self.metrics.e2e.observe(time.monotonic() - stream.submitted_at)
                self.metrics.prompt_tokens.inc(len(prompt))
                self.metrics.generation_tokens.inc(len(output))
                self.metrics.finished("length")

    def _usage(self, stream: Stream, prompt_len: int, completion: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion,
            "completion_tokens": completion,
        }
        if self.config.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": stream.cached_tokens}
        return usage

    def _text(self, output: tuple[int, ...], start: int, end: int) -> str:
        words = self.vocab.decode(output[start:end])
        return words if start == 0 or not words else " " + words

    async def _complete(
        self, send: Send, stream: Stream, output: tuple[int, ...], request_id: str, chat: bool, die: bool
    ) -> None:
        while not stream.done:
            await stream.next_tokens()
        text = self.vocab.decode(output)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        payload = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [choice],
            "usage": self._usage(stream, len(stream.seq.request.prompt), len(output)),
        }
        if die:
            self.stats.deaths_injected += 1
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            raise _Die("injected crash before the body")
        await send_json(send, 200, payload)

    async def _stream(
        self,
        send: Send,
        stream: Stream,
        output: tuple[int, ...],
        request_id: str,
        chat: bool,
        include_usage: bool,
        die: bool,
    ) -> None:
        created = int(time.time())
        model = self.config.model
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": kind, "created": created, "model": model}
        started = False
        events = 0
        while True:
            start, end = await stream.next_tokens()
            if not started:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"),
                        ],
                    }
                )
                started = True
                if chat:
                    role = {
                        **head,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    await send(
                        {"type": "http.response.body", "body": b"data: " + dumps(role) + b"\n\n", "more_body": True}
                    )
            last = stream.done and end >= len(output)
            if end > start or last:
                text = self._text(output, start, end)
                finish = "length" if last else None
                if chat:
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": {"content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + dumps({**head, "choices": [choice]}) + b"\n\n",
                        "more_body": True,
                    }
                )
                events += 1
                if die and events >= self.faults.die_after_events:
                    self.stats.deaths_injected += 1
                    raise _Die("injected crash mid-stream")
            if last:
                break
        tail = b""
        if include_usage:
            usage = {**head, "choices": [], "usage": self._usage(stream, len(stream.seq.request.prompt), len(output))}
            tail = b"data: " + dumps(usage) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})

    # -- other routes -----------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = self.config.model
        card = {
            "id": model,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [],
        }
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = self.faults.health_status
        await send_bytes(send, status, b"", content_type=b"application/json")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.metrics.render(), content_type=CONTENT_TYPE)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json(scope, receive)
        self._check_model(body)
        if "messages" in body:
            tokens = tokenize_chat(
                body["messages"], self.vocab, add_generation_prompt=bool(body.get("add_generation_prompt", True))
            )
        else:
            tokens = _prompt_tokens(body, self.vocab)
        await send_json(
            send,
            200,
            {
                "count": len(tokens),
                "max_model_len": self.config.max_model_len,
                "tokens": list(tokens),
                "token_strs": None,
            },
        )

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json(scope, receive)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.vocab.size for t in tokens):
            raise _BadRequest(f"'tokens' must be a list of ids below {self.vocab.size}.", "tokens")
        await send_json(send, 200, {"prompt": self.vocab.decode(tokens)})

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": f"kvroute-emulator {__version__}"})

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"server_load": self.engine.in_flight})

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, attrs.asdict(self.faults))

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json(scope, receive)
        fields = {f.name: f.type for f in attrs.fields(Faults)}
        for key, value in body.items():
            if key not in fields:
                raise _BadRequest(f"unknown fault {key!r} (expected some of: {', '.join(fields)}).", key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _BadRequest(f"fault {key!r} must be a number (got {value!r}).", key)
            setattr(self.faults, key, float(value) if key == "delay_s" else int(value))
        await send_json(send, 200, attrs.asdict(self.faults))

    async def _get_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine.stats
        await send_json(
            send,
            200,
            {
                **attrs.asdict(self.stats),
                "engine": {
                    "prompt_tokens": engine.prompt_tokens,
                    "hit_tokens": engine.hit_tokens,
                    "finished": engine.finished,
                    "aborted": engine.aborted,
                },
                "running": self.engine.num_running,
                "waiting": self.engine.num_waiting,
            },
        )
