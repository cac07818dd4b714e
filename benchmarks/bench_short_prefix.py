"""Prefix-cache hit rate per strategy when the shared prefix is shorter than `prefix_length`.

Traffic as in many chat applications: 24 system prompts of ~2,500 characters, each request one of
them (picked at random) followed by its own ~2,000-character question, so a fixed 4,096-character
key always includes the question and hash routing degrades to random. 300 chat requests,
`max_tokens` 16, sent by 8 concurrent clients to `kvroute serve` in front of 7 `kvroute emulate`
engines (`--time-scale 0.05`). Every row starts fresh engines and a fresh proxy, so no row
inherits another's cache.

Printed per strategy (one Markdown row each): the fleet's hit rate, the engines' cached prompt
tokens over their prompt tokens (`hit_tokens` / `prompt_tokens` from each engine's
`/emulator/stats`), and the busiest and idlest engine's share of the requests (from the proxy's
`x-kvroute-backend` header). The rows compare the hash strategies keyed on a fixed
4,096 characters (`prefix_length=4096`) with their defaults (keys cut at message boundaries).
Results in docs/strategies.md (search "prefix_length=4096").

Run: ``python benchmarks/bench_short_prefix.py`` (seed 0, about 2.5 minutes on 2 cores);
``--only random,bounded-cache`` for some rows, ``--requests 60`` for a smoke run. The seed fixes
the prompts, the questions and which prompt each request uses; the order requests arrive in
depends on the 8 clients' timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_proxy as bp

KVROUTE = [sys.executable, "-m", "kvroute"]

# Row label -> (strategy, --option values). "prefix_length=4096" is the fixed key the hash
# strategies used before keys were cut at message boundaries.
RUNS: dict[str, tuple[str, list[str]]] = {
    "random": ("random", []),
    "least-outstanding": ("least-outstanding", []),
    "consistent-hash, prefix_length=4096": ("consistent-hash", ["prefix_length=4096"]),
    "consistent-hash (defaults)": ("consistent-hash", []),
    "bounded-load, prefix_length=4096": ("bounded-load", ["prefix_length=4096"]),
    "bounded-load (defaults)": ("bounded-load", []),
    "bounded-cache (defaults)": ("bounded-cache", []),
    "tokenizer-prefix (defaults)": ("tokenizer-prefix", []),
}

WORDS = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "sigma",
    "omega",
    "cache",
    "prefix",
    "engine",
    "token",
    "block",
    "route",
    "fleet",
    "queue",
    "batch",
    "model",
    "layer",
    "tensor",
    "kernel",
    "vector",
    "matrix",
    "scalar",
    "router",
    "policy",
    "budget",
)


def filler(rng: random.Random, chars: int) -> str:
    """Text of exactly `chars` characters made of numbered words, distinct for each call."""
    words: list[str] = []
    length = 0
    while length < chars:
        word = f"{rng.choice(WORDS)}{rng.randrange(100)}"
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def workload(seed: int, requests: int, prompts: int) -> list[dict[str, Any]]:
    """Chat bodies: one of `prompts` shared ~2,500-character system prompts plus a unique question each."""
    rng = random.Random(seed)
    systems = [f"System prompt {i}. " + filler(rng, 2480) for i in range(prompts)]
    bodies = []
    for i in range(requests):
        messages = [
            {"role": "system", "content": systems[rng.randrange(prompts)]},
            {"role": "user", "content": f"Question {i}: " + filler(rng, 1990)},
        ]
        bodies.append({"model": "m", "max_tokens": 16, "messages": messages})
    return bodies


@contextlib.contextmanager
def fleet(strategy: str, options: Sequence[str], engines: int, time_scale: float) -> Iterator[tuple[str, list[str]]]:
    """Fresh emulators and a proxy over them; yields (proxy URL, engine URLs) and stops them all after."""
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(engines):
            url = f"http://127.0.0.1:{bp.free_port()}"
            port = url.rsplit(":", 1)[1]
            emulate = [*KVROUTE, "emulate", "--port", port, "--model", "m", "--time-scale", str(time_scale)]
            stack.enter_context(bp.process(emulate, url + "/health"))
            urls.append(url)
        proxy = f"http://127.0.0.1:{bp.free_port()}"
        serve = [*KVROUTE, "serve", "--port", proxy.rsplit(":", 1)[1], "--strategy", strategy]
        serve += ["--health-interval", "0", "--no-access-log"]
        serve += [arg for i, url in enumerate(urls) for arg in ("--backend", f"e{i}={url}")]
        serve += [arg for option in options for arg in ("--option", option)]
        stack.enter_context(bp.process(serve, proxy + "/health"))
        yield proxy, urls


async def drive(
    proxy: str, engines: list[str], bodies: list[dict[str, Any]], concurrency: int
) -> tuple[int, int, list[str]]:
    """Send every body through the proxy; return the engines' (hit tokens, prompt tokens) and each request's backend."""
    backends: list[str] = []
    pending = iter(bodies)
    async with httpx.AsyncClient(timeout=120) as client:

        async def client_loop() -> None:
            for body in pending:
                response = await client.post(proxy + "/v1/chat/completions", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"expected status 200 from the proxy, got {response.status_code}")
                backends.append(response.headers.get("x-kvroute-backend", "?"))

        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(client_loop())
        hit = prompt = 0
        for url in engines:
            stats = (await client.get(url + "/emulator/stats")).raise_for_status().json()["engine"]
            hit += stats["hit_tokens"]
            prompt += stats["prompt_tokens"]
    return hit, prompt, backends


def measure(strategy: str, options: Sequence[str], args: argparse.Namespace) -> tuple[float, float, float]:
    """Hit rate and busiest / idlest engine's share of requests for one strategy on fresh engines."""
    bodies = workload(args.seed, args.requests, args.prompts)
    with fleet(strategy, options, args.engines, args.time_scale) as (proxy, engines):

        async def bounded() -> tuple[int, int, list[str]]:
            async with asyncio.timeout(args.timeout):
                return await drive(proxy, engines, bodies, args.concurrency)

        hit, prompt, backends = asyncio.run(bounded())
    counts = Counter(backends)
    shares = sorted(counts.get(f"e{i}", 0) / len(bodies) for i in range(args.engines))
    return hit / prompt, shares[-1], shares[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated substrings of row labels to run (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and questions (default 0)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=24, help="distinct system prompts")
    parser.add_argument("--engines", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=0.05, help="emulators' wall s per simulated s")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one row's traffic may take")
    args = parser.parse_args()
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    runs = {label: run for label, run in RUNS.items() if not wanted or any(w in label for w in wanted)}
    if not runs:
        parser.error(f"--only matched no row (got {args.only!r}; rows: {', '.join(RUNS)})")
    print("| strategy | hit rate | busiest / idlest instance | wall time |")
    print("|---|---|---|---|", flush=True)
    for label, (strategy, options) in runs.items():
        started = time.monotonic()
        hit_rate, busiest, idlest = measure(strategy, options, args)
        took = time.monotonic() - started
        print(f"| {label} | {hit_rate:.1%} | {busiest:.1%} / {idlest:.1%} | {took:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
