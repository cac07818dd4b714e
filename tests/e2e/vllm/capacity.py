"""The capacity-tight case, for emulators and real vLLM alike (standard library only).

Two engines with small KV caches (100 blocks of 128 tokens), eight long system prompts whose
working set (~144 blocks) fits the fleet's 200 blocks only when split by footprint, and 48 streamed chats
at concurrency 2, each a system prompt and its own short question. `run_case` sends them through a fresh
``kvroute serve`` with one strategy and reports the engines' own prefix-cache counters.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.e2e.vllm.proxy import start_proxy
from tests.e2e.vllm.servers import get_text, metric_value

__all__ = ["HITS", "QUERIES", "capacity_workload", "engine_counters", "run_case", "stream_chats"]

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
        for _ in range(count)
    )


def capacity_workload(
    model: str, *, seed: int = 15, prompts: int = 8, chats: int = 48, prompt_words: int = 1200, question_words: int = 24
) -> list[dict[str, Any]]:
    """``chats`` streamed chat bodies over ``prompts`` system prompts of ``prompt_words`` words, in a seeded order.

    Every prompt is used ``chats / prompts`` times; each chat has its own question. 1,200 words are about
    2,300 tokens for the tiny model's tokenizer; the emulator counts one token per word.
    """
    rng = random.Random(seed)
    systems = [f"System prompt {p}. " + _words(rng, prompt_words) for p in range(prompts)]
    order = [p for p in range(prompts) for _ in range(chats // prompts)]
    rng.shuffle(order)
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": systems[p]},
                {"role": "user", "content": f"Question {i}: {_words(rng, question_words)}?"},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        for i, p in enumerate(order)
    ]


def _stream(url: str, body: Mapping[str, Any]) -> str:
    """Send one streamed chat and read it to the end; the backend the proxy chose."""
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        raw = response.read()
        backend = response.headers.get("x-kvroute-backend", "")
    if b"data: [DONE]" not in raw:
        raise AssertionError(f"expected a stream ending with data: [DONE], got {raw[-200:]!r}")
    return str(backend)


def stream_chats(url: str, bodies: Sequence[Mapping[str, Any]], concurrency: int = 2) -> Counter[str]:
    """Send ``bodies`` in order from ``concurrency`` closed-loop clients; requests per backend."""
    placed: Counter[str] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()
    queue = list(reversed(bodies))

    def client() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                body = queue.pop()
            try:
                backend = _stream(url, body)
            except BaseException as exc:  # reported by the caller
                with lock:
                    errors.append(exc)
                return
            with lock:
                placed[backend] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=1800)
    if errors:
        raise errors[0]
    return placed


def engine_counters(engine_urls: Sequence[str]) -> list[tuple[float, float]]:
    """Each engine's (prefix-cache hit tokens, query tokens) from its own ``/metrics``."""
    out = []
    for url in engine_urls:
        text = get_text(url + "/metrics")
        out.append((metric_value(text, HITS), metric_value(text, QUERIES)))
    return out


def run_case(
    engine_urls: Sequence[str],
    strategy: str,
    options: Mapping[str, Any],
    bodies: Sequence[Mapping[str, Any]],
    workdir: Path,
    *,
    reset: Callable[[], None],
    adapter_options: str = "",
    name: str | None = None,
) -> dict[str, Any]:
    """``reset()`` the engines' caches, send ``bodies`` through a fresh proxy, and report the engines' hit deltas."""
    reset()
    before = engine_counters(engine_urls)
    started = time.monotonic()
    with start_proxy(engine_urls, strategy, options, workdir, adapter_options=adapter_options, name=name) as proxy:
        placed = stream_chats(proxy.url, bodies)
    time.sleep(0.5)  # the engines publish a step's counters right after it
    after = engine_counters(engine_urls)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "strategy": name or strategy,
        "options": dict(options),
        "engine_hit_tokens": hits,
        "engine_query_tokens": queries,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "per_engine_hit_rate": [
            round((a[0] - b[0]) / max(1.0, a[1] - b[1]), 4) for a, b in zip(after, before, strict=True)
        ],
        "requests_per_backend": dict(sorted(placed.items())),
        "seconds": round(time.monotonic() - started, 1),
    }
