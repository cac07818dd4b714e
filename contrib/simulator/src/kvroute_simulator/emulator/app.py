"""An ASGI server that answers like a vLLM OpenAI-compatible server, backed by the engine model.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming with
``[DONE]`` and ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's Prometheus names), ``POST /tokenize``, ``POST /detokenize``,
``GET /version``, ``GET /load``, and the test controls ``GET|POST /emulator/faults`` and
``GET /emulator/stats``. See docs/emulator.md.

This module holds the ASGI entry point and the HTTP handlers; request parsing is in
:mod:`~kvroute_simulator.emulator.parsing`, the generation requests' bookkeeping (engine
streams, delivery, aborts) in :mod:`~kvroute_simulator.emulator.generation`, and the
settings, faults and counters in :mod:`~kvroute_simulator.emulator.config`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import attrs
import structlog

from kvroute import __version__
from kvroute_server.http.asgi import (
    App,
    ClientGone,
    Receive,
    Refusal,
    RouteTable,
    Scope,
    Send,
    send_bytes,
    send_error,
    send_json,
)
from kvroute_simulator.emulator.config import EmulatorConfig, EmulatorStats, Faults
from kvroute_simulator.emulator.generation import GenerationHandler
from kvroute_simulator.emulator.metrics import CONTENT_TYPE, EmulatedMetrics
from kvroute_simulator.emulator.parsing import (
    BadRequest,
    check_model,
    prompt_tokens,
    read_json,
    tokenize_chat,
    tokenize_text,
)
from kvroute_simulator.emulator.realtime import RealTimeEngine
from kvroute_simulator.tokens import vocabulary

__all__ = ["EmulatorApp", "EmulatorConfig", "Faults", "tokenize_chat", "tokenize_text"]

log = structlog.get_logger(__name__)


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
        self._generation = GenerationHandler(self.config, self.faults, self.stats, self.vocab, self.metrics)
        self._created = int(time.time())
        # vLLM answers an unknown route and a known one with another method alike: 404.
        self.routes: RouteTable[App] = RouteTable(
            not_found="Not Found: {method} {path}", not_found_code="not_found", not_allowed=None
        )
        for method, path, handler in [
            ("POST", "/v1/chat/completions", self._chat),
            ("POST", "/v1/completions", self._completions),
            ("GET", "/v1/models", self._models),
            ("GET", "/health", self._health),
            ("GET", "/metrics", self._metrics),
            ("POST", "/tokenize", self._tokenize),
            ("POST", "/detokenize", self._detokenize),
            ("GET", "/version", self._version),
            ("GET", "/load", self._load),
            ("GET", "/emulator/faults", self._get_faults),
            ("POST", "/emulator/faults", self._set_faults),
            ("GET", "/emulator/stats", self._get_stats),
        ]:
            self.routes.add(method, path, handler)

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
        found = self.routes.find(scope["method"], scope["path"])
        if isinstance(found, Refusal):
            await found.send(send)
            return
        handler, _ = found
        try:
            await handler(scope, receive, send)
        except ClientGone:
            return
        except BadRequest as exc:
            await send_error(send, exc.status, str(exc), param=exc.param, code=exc.code)

    # -- generation -------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_json(scope, receive)
        check_model(body, self.config.model)
        prompt = tokenize_chat(body.get("messages"), self.vocab)
        await self._generation.generate(self.runner, receive, send, body, prompt, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_json(scope, receive)
        check_model(body, self.config.model)
        await self._generation.generate(self.runner, receive, send, body, prompt_tokens(body, self.vocab), chat=False)

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
        body = await read_json(scope, receive)
        check_model(body, self.config.model)
        if "messages" in body:
            tokens = tokenize_chat(
                body["messages"], self.vocab, add_generation_prompt=bool(body.get("add_generation_prompt", True))
            )
        else:
            tokens = prompt_tokens(body, self.vocab)
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
        body = await read_json(scope, receive)
        check_model(body, self.config.model)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.vocab.size for t in tokens):
            raise BadRequest(f"'tokens' must be a list of ids below {self.vocab.size}.", "tokens")
        await send_json(send, 200, {"prompt": self.vocab.decode(tokens)})

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": f"kvroute-emulator {__version__}"})

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"server_load": self.engine.in_flight})

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, attrs.asdict(self.faults))

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_json(scope, receive)
        fields = {f.name: f.type for f in attrs.fields(Faults)}
        for key, value in body.items():
            if key not in fields:
                raise BadRequest(f"unknown fault {key!r} (expected some of: {', '.join(fields)}).", key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadRequest(f"fault {key!r} must be a number (got {value!r}).", key)
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
