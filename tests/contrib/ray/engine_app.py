"""A Ray Serve deployment that emulates an engine, and the seeded workload the router tests drive.

Each replica runs the simulator's engine model (`kvroute_simulator.engine`, through the
emulator's `RealTimeEngine`): a paged KV cache with prefix reuse and LRU eviction, chunked
prefill and the calibrated step cost model. No GPU and no weights: a request's prompt is tokenized
with the emulator's word-level tokenizer, submitted, and answered when the engine finishes it.
The answer carries the replica's own counters for that request: cached prompt tokens and the
time to first token in the engine's (virtual) time, so queueing behind cold prefills shows.

Replicas import this module by name: the tests put the repository root on the workers'
``PYTHONPATH`` (conftest's ``runtime_env``).
"""

from __future__ import annotations

import asyncio
import random
import types
import uuid
from typing import Any

from kvroute_ray import body_of
from ray import serve

from kvroute_simulator.emulator.config import EmulatorConfig
from kvroute_simulator.emulator.parsing import tokenize_chat, tokenize_text
from kvroute_simulator.emulator.realtime import RealTimeEngine
from kvroute_simulator.engine import EngineRequest
from kvroute_simulator.tokens import TokenSeq

#: KV cache blocks per replica (16 tokens each): about 7 of the workload's 24 documents fit in one.
CAPACITY_BLOCKS = 700
BLOCK_SIZE = 16


@serve.deployment(num_replicas=4, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
class EmulatedEngine:
    """One engine: prefix cache and prefill time from the simulator's model, in real time."""

    def __init__(self, capacity_blocks: int = CAPACITY_BLOCKS, time_scale: float = 1.0) -> None:
        config = EmulatorConfig(num_gpu_blocks=capacity_blocks, block_size=BLOCK_SIZE, time_scale=time_scale)
        self.runner = RealTimeEngine(config.engine(), time_scale)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._task: asyncio.Task[None] | None = None
        self.requests = 0

    async def __call__(self, request: Any) -> dict[str, Any]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.runner.run())
        body = body_of(request)
        if body is None:  # the routers got nothing to read either: answer without the engine
            return {"replica": self.replica, "unparsed": True, "prompt_tokens": 0, "cached_tokens": 0, "ttft_ms": 0.0}
        prompt = tokenize_chat(body["messages"]) if body.get("messages") else tokenize_text(str(body["prompt"]))
        max_tokens = int(body.get("max_tokens") or 4)
        stream = self.runner.submit(EngineRequest(uuid.uuid4().hex, TokenSeq.of(prompt), max_tokens))
        while not stream.done:
            await stream.next_tokens()
        seq = stream.seq
        self.requests += 1
        assert seq.first_token_time is not None
        return {
            "replica": self.replica,
            "prompt_tokens": len(prompt),
            "cached_tokens": seq.cached_tokens or 0,
            "ttft_ms": (seq.first_token_time - seq.arrival) * 1000.0,
        }


def documents(count: int = 24, words: int = 1500, seed: int = 7) -> list[str]:
    """``count`` distinct shared prefixes (system prompts, documents) of ``words`` words each."""
    rng = random.Random(seed)
    return [" ".join(f"d{i}w{rng.randrange(50_000)}" for _ in range(words)) for i in range(count)]


def workload(
    requests: int, *, seed: int = 11, docs: int = 24, doc_words: int = 1500, tail_words: int = 60
) -> list[types.SimpleNamespace]:
    """A seeded stream of completions requests: a Zipf-popular document, then a unique question.

    Each is a ``SimpleNamespace`` with ``model``, ``prompt`` and ``max_tokens`` attributes: the
    shape Ray Serve LLM's request objects and direct streaming's routing payload both have, which
    is what Ray's ``PrefixCacheAffinityRouter`` reads (it needs a ``prompt`` or ``messages`` attribute).
    """
    texts = documents(docs, doc_words, seed)
    rng = random.Random(seed + 1)
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(docs)]
    out = []
    for n in range(requests):
        doc = rng.choices(range(docs), weights)[0]
        tail = " ".join(f"q{n}w{rng.randrange(50_000)}" for _ in range(tail_words))
        out.append(types.SimpleNamespace(model="emulated", prompt=f"{texts[doc]} {tail}", max_tokens=4))
    return out


def arrival_gaps(requests: int, rate: float, seed: int = 13) -> list[float]:
    """Seeded exponential gaps (seconds) between ``requests`` arrivals at ``rate`` per second."""
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(requests)]
