"""An ASGI server that answers like a vLLM OpenAI-compatible server, backed by the engine model.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming with
``[DONE]`` and ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's Prometheus names), ``POST /tokenize``, ``POST /detokenize``,
``GET /version``, ``GET /load``, ``GET /kv_event_sources``, and the test controls
``GET|POST /emulator/faults`` and ``GET /emulator/stats``. See docs/emulator.md.

With ``data_parallel_size`` > 1 the engine is a `DataParallelEngine`: a generation request goes
to the rank its ``X-data-parallel-rank`` header names (as vLLM reads it: a value that is not an
integer is ignored, one out of range is answered 400), or to the rank vLLM's balancer picks.

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
from kvroute_simulator.emulator.kv_events import KvEventPublisher
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
from kvroute_simulator.engine import DataParallelEngine, EngineStats, engine_ranks
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
        events = self.config.kv_events
        self.publisher = (
            KvEventPublisher(events, self.config.block_size, self.config.data_parallel_size, self.config.host)
            if events is not None and events.enable_kv_cache_events and events.publisher == "zmq"
            else None
        )
        self.engine = self.config.engine(listener=self.publisher)
        self.ranks = engine_ranks(self.engine)
        if self.publisher is not None:
            self.publisher.attach(self.ranks)
        self.stats.rank_requests = [0] * len(self.ranks)
        self.metrics = EmulatedMetrics(self.config.model, self.ranks)
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
            ("GET", "/kv_event_sources", self._kv_event_sources),
            ("GET", "/emulator/faults", self._get_faults),
            ("POST", "/emulator/faults", self._set_faults),
            ("GET", "/emulator/stats", self._get_stats),
        ]:
            self.routes.add(method, path, handler)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EmulatorApp]:
        """Run the engine's clock (and the KV event publisher) for the duration of the block."""
        publisher = self.publisher
        if publisher is not None:
            await publisher.start()
        self.runner = RealTimeEngine(
            self.engine, self.config.time_scale, after_step=None if publisher is None else publisher.flush
        )
        task = asyncio.create_task(self.runner.run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.runner = None
            if publisher is not None:
                publisher.close()

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

    def _rank(self, scope: Scope) -> int | None:
        """The data-parallel rank ``X-data-parallel-rank`` names, as vLLM reads it (not an integer: none)."""
        raw = next((v for k, v in scope["headers"] if k == b"x-data-parallel-rank"), None)
        if raw is None:
            return None
        try:
            rank = int(raw.decode("latin-1"))
        except ValueError:
            return None
        if not 0 <= rank < len(self.ranks):
            # vLLM's input processor refuses it with this message (HTTP 400).
            raise BadRequest(f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)}).")
        return rank

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_json(scope, receive)
        check_model(body, self.config.model)
        prompt = tokenize_chat(body.get("messages"), self.vocab)
        rank = self._rank(scope)
        await self._generation.generate(self.runner, receive, send, body, prompt, chat=True, rank=rank)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_json(scope, receive)
        check_model(body, self.config.model)
        prompt = prompt_tokens(body, self.vocab)
        rank = self._rank(scope)
        await self._generation.generate(self.runner, receive, send, body, prompt, chat=False, rank=rank)

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

    async def _kv_event_sources(self, scope: Scope, receive: Receive, send: Send) -> None:
        # vLLM mounts the route unconditionally and answers {"sources": [...]}, sorted by rank.
        sources = [] if self.publisher is None else self.publisher.sources()
        await send_json(send, 200, {"sources": sources})

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
        engine = self.engine
        dp = engine if isinstance(engine, DataParallelEngine) else None
        ranks = []
        for e in self.ranks:
            stats = e.stats
            ranks.append(
                {
                    "rank": e.rank,
                    "requests": self.stats.rank_requests[e.rank],
                    "routed": dp.routed[e.rank] if dp is not None else 0,
                    "balanced": dp.balanced[e.rank] if dp is not None else 0,
                    "running": e.num_running,
                    "waiting": e.num_waiting,
                    **_counters(stats),
                    "cached_blocks": e.cached_blocks,
                    "cpu_cached_blocks": e.cpu_cached_blocks,
                }
            )
        await send_json(
            send,
            200,
            {
                **attrs.asdict(self.stats),
                "engine": _counters(engine.stats),
                "running": engine.num_running,
                "waiting": engine.num_waiting,
                "ranks": ranks,
                "kv_events": None if self.publisher is None else self.publisher.stats(),
            },
        )


def _counters(stats: EngineStats) -> dict[str, float]:
    """An engine's counters as ``/emulator/stats`` shows them (hits per tier)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "hit_tokens": stats.hit_tokens,
        "gpu_hit_tokens": stats.gpu_hit_tokens,
        "cpu_hit_tokens": stats.cpu_hit_tokens,
        "reload_time": stats.reload_time,
        "evicted_blocks": stats.evicted_blocks,
        "offloaded_blocks": stats.offloaded_blocks,
        "cpu_evicted_blocks": stats.cpu_evicted_blocks,
        "finished": stats.finished,
        "aborted": stats.aborted,
    }
