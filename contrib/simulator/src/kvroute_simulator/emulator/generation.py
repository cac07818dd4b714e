"""The emulator's generation requests: submit to the engine, deliver (JSON or SSE), abort, count.

:class:`GenerationHandler` serves ``/v1/chat/completions`` and ``/v1/completions`` once the app has
read the body and the prompt: it applies the request's options and the injected faults,
submits the request to the real-time engine, delivers the output as one JSON body or as
server-sent events, aborts the request in the engine when its client goes away, and records
the metrics and counters.
"""

from __future__ import annotations

import array
import asyncio
import time
import uuid
from typing import Any

from kvroute.hashing import hash64, hash_parts
from kvroute_server.http.asgi import Receive, Send, dumps, send_error, send_json
from kvroute_simulator.emulator.config import EmulatorConfig, EmulatorStats, Faults
from kvroute_simulator.emulator.metrics import EmulatedMetrics
from kvroute_simulator.emulator.parsing import BadRequest
from kvroute_simulator.emulator.realtime import RealTimeEngine, Stream
from kvroute_simulator.engine import EngineRequest
from kvroute_simulator.tokens import TokenSeq, Vocabulary

__all__ = ["GenerationHandler"]


class _Die(Exception):
    """Raised to make the ASGI server drop the connection (an injected crash)."""


class GenerationHandler:
    """Serves generation requests on an emulator's engine, with its settings, faults, counters and metrics."""

    def __init__(
        self,
        config: EmulatorConfig,
        faults: Faults,
        stats: EmulatorStats,
        vocab: Vocabulary,
        metrics: EmulatedMetrics,
    ) -> None:
        self.config = config
        self.faults = faults
        self.stats = stats
        self.vocab = vocab
        self.metrics = metrics

    async def generate(
        self,
        runner: RealTimeEngine | None,
        receive: Receive,
        send: Send,
        body: dict[str, Any],
        prompt: tuple[int, ...],
        *,
        chat: bool,
        rank: int | None = None,
    ) -> None:
        """Serve one request for ``prompt`` (``chat``: a chat completion) on ``runner``, as ``body`` asks.

        ``rank``: the data-parallel rank the request names (None: the engine's balancer picks).
        """
        assert runner is not None, "the emulator is not running (lifespan not started)"
        self.stats.requests += 1
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"'max_tokens' must be an integer >= 1 (got {max_tokens!r}).", "max_tokens")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise BadRequest(f"The emulator only supports n=1 (got {n!r}).", "n")
        stream_flag = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        if not prompt:
            raise BadRequest("The prompt must hold at least one token.", "prompt")
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
            stream = runner.submit(engine_request, rank)
        except ValueError as exc:
            raise BadRequest(str(exc), "messages" if chat else "prompt") from None

        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not stream.done:
                gone = True
                task.cancel()

        metrics = self.metrics.rank(stream.rank)
        self.stats.rank_requests[stream.rank] += 1
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
            if not stream.done and runner.abort(stream):
                self.stats.aborted += 1
            runner.detach(stream)
            if stream.first_token_at is not None:
                metrics.ttft.observe(stream.first_token_at - stream.submitted_at)
            if stream.done:
                metrics.e2e.observe(time.monotonic() - stream.submitted_at)
                metrics.prompt_tokens.inc(len(prompt))
                metrics.generation_tokens.inc(len(output))
                metrics.finished("length")

    def _output_tokens(self, prompt: tuple[int, ...], count: int) -> tuple[int, ...]:
        key = hash64(array.array("q", prompt).tobytes())
        words = self.vocab.word_ids()
        return tuple(words[hash_parts(key, i) % len(words)] for i in range(count))

    # -- generation -------------------------------------------------------------------

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
