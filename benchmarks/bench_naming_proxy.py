"""Placement and backend names through the proxy: the same engines under four naming schemes.

Issue 24 found the default strategy's hit rate moving 12 points (0.844 -> 0.722) when the same seven
engines were named ``e0..e6`` instead of by URL: with long shared prompts, few prompts per engine's
cache and no spill at that load, the hash of the names decides which engine gets more prompts than its
cache holds. This benchmark replays one seeded workload through ``kvroute serve`` for every (naming,
strategy) row, on fresh engines each time, and prints hit rate and the busiest/idlest engine's share.

The traffic: ``--documents`` long shared prompts (a system message of ``--prompt-chars`` characters,
about 107 blocks of 32 tokens at the default 27,000), each request one of them picked uniformly
(seeded) plus a unique question of 200-400 characters; Poisson arrivals at ``--rate``, streamed chat
completions with 16 output tokens. The fleet: ``--engines`` ``kvroute emulate`` engines of ``--blocks``
blocks each (512: about 4.8 prompts), LRU eviction as in vLLM.

Namings (``--namings``): ``url`` (``--backend URL``: the id is the URL), ``e`` (``e0..e6``), ``gpu``
(``gpu-a..gpu-g``), ``pod`` (``vllm-0.vllm.ns.svc`` style). Strategies (``--strategies``): ``default``
(no ``--strategy``: the proxy's default) and any strategy name, e.g. ``bounded-cache``.

Run: ``nice -n 10 python benchmarks/bench_naming_proxy.py`` (8 rows of about 70 s); ``--seeds 0,1,2`` for
more workloads, ``--requests 60`` for a smoke run, ``--json FILE``. Every process is started in its
own process group and stopped by its pid when its row ends. Results: docs/performance.md ("Placement
and backend names").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_proxy as bp
from bench_agents import KVROUTE, engine_stats, pct, started
from bench_short_prefix import filler

MODEL = "m"
BLOCK_SIZE = 32


def names(scheme: str, urls: Sequence[str]) -> list[str]:
    """The backend ids of ``urls`` under ``scheme``; ``url`` keeps the URL as the id."""
    if scheme == "url":
        return list(urls)
    if scheme == "e":
        return [f"e{i}" for i in range(len(urls))]
    if scheme == "gpu":
        return [f"gpu-{chr(ord('a') + i)}" for i in range(len(urls))]
    if scheme == "pod":
        return [f"vllm-{i}.vllm.serving.svc" for i in range(len(urls))]
    raise SystemExit(f"bench_naming: --namings: expected url, e, gpu or pod (got {scheme!r})")


def workload(seed: int, requests: int, documents: int, prompt_chars: int, rate: float) -> list[tuple[float, dict]]:
    """(send time, chat body) pairs: a uniformly picked shared document plus a unique question each."""
    rng = random.Random(seed)
    docs = [f"Document {i} of seed {seed}. " + filler(rng, prompt_chars) for i in range(documents)]
    out = []
    at = 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        question = f"Question {i}: " + filler(rng, rng.randrange(200, 400))
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": rng.choice(docs)}, {"role": "user", "content": question}],
            "max_tokens": 16,
            "stream": True,
        }
        out.append((at, body))
    return out


@contextlib.contextmanager
def fleet(naming: str, strategy: str, args: argparse.Namespace) -> Iterator[tuple[str, list[str]]]:
    """Fresh engines and one router; yields (the router's URL, the engines' URLs); stops them all after."""
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-naming-")))
        engines = []
        for i in range(args.engines):
            port = bp.free_port()
            url = f"http://127.0.0.1:{port}"
            emulate = [*KVROUTE, "emulate", "--port", str(port), "--model", MODEL,
                       "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(args.blocks)]  # fmt: skip
            stack.enter_context(started(emulate, url + "/health", logs / f"engine-{i}.log"))
            engines.append(url)
        port = bp.free_port()
        front = f"http://127.0.0.1:{port}"
        command = [*KVROUTE, "serve", "--port", str(port), "--no-access-log", "--log-level", "warning"]
        if strategy != "default":
            command += ["--strategy", strategy]
        for ident, url in zip(names(naming, engines), engines, strict=True):
            command += ["--backend", url if ident == url else f"{ident}={url}"]
        stack.enter_context(started(command, front + "/health", logs / "router.log"))
        yield front, engines


async def drive(reqs: Sequence[tuple[float, dict]], front: str) -> tuple[list[float], list[str]]:
    """Send each request at its time; the TTFTs (first SSE bytes) and the errors."""
    ttfts: list[float] = []
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(at: float, body: dict) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent = time.perf_counter()
            try:
                async with session.post(front + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        errors.append(f"status {resp.status}: {(await resp.text())[:200]}")
                        return
                    first = None
                    async for _chunk in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - sent
                    if first is not None:
                        ttfts.append(first)
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        async with asyncio.TaskGroup() as tg:
            for at, body in reqs:
                tg.create_task(one(at, body))
    return ttfts, errors


def run_row(naming: str, strategy: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    reqs = workload(seed, args.requests, args.documents, args.prompt_chars, args.rate)
    began = time.monotonic()
    load = os.getloadavg()[0]
    with fleet(naming, strategy, args) as (front, engines):

        async def bounded() -> tuple[list[float], list[str], list[dict[str, Any]]]:
            async with asyncio.timeout(args.timeout):
                ttfts, errors = await drive(reqs, front)
            return ttfts, errors, await engine_stats(engines)

        ttfts, errors, stats = asyncio.run(bounded())
    hit = sum(s["engine"]["hit_tokens"] for s in stats)
    prompt = sum(s["engine"]["prompt_tokens"] for s in stats)
    counts = sorted(s["requests"] for s in stats)
    total = max(sum(counts), 1)
    return {
        "naming": naming,
        "strategy": strategy,
        "seed": seed,
        "hit_rate": hit / prompt if prompt else 0.0,
        "busiest": counts[-1] / total,
        "idlest": counts[0] / total,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1000,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
        "errors": len(errors),
        "error_samples": errors[:3],
        "seconds": time.monotonic() - began,
        "load_before": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namings", default="url,e,gpu,pod", help="naming schemes, comma-separated [url,e,gpu,pod]")
    parser.add_argument("--strategies", default="default,bounded-cache", help="[default,bounded-cache]")
    parser.add_argument("--seeds", default="0", help="workload seeds, comma-separated [0]")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second on average [6]")
    parser.add_argument("--documents", type=int, default=24, help="shared prompts [24]")
    parser.add_argument("--prompt-chars", type=int, default=27_000, help="characters per shared prompt [27000]")
    parser.add_argument("--engines", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=512, help=f"KV blocks of {BLOCK_SIZE} tokens per engine [512]")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one row's traffic may take [600]")
    parser.add_argument("--json", type=Path, help="write the rows' figures to this file")
    args = parser.parse_args()
    namings = [n.strip() for n in args.namings.split(",") if n.strip()]
    for naming in namings:
        names(naming, ["u"])  # a wrong scheme fails before any engine starts
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"{args.requests} requests at {args.rate:g}/s over {args.documents} shared prompts of {args.prompt_chars:,} "
        f"characters; {args.engines} emulators of {args.blocks} blocks of {BLOCK_SIZE} tokens; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    print(
        "| strategy | naming | seed | hit rate | of the strategy's best | busiest / idlest | TTFT p50 / p99 | errors |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for strategy in strategies:
        mine = []
        for seed in seeds:
            for naming in namings:
                row = run_row(naming, strategy, seed, args)
                rows.append(row)
                mine.append(row)
                best = max(r["hit_rate"] for r in mine)
                print(
                    f"| {strategy} | {naming} | {seed} | {row['hit_rate']:.3f} | {row['hit_rate'] / best:.1%} | "
                    f"{row['busiest']:.1%} / {row['idlest']:.1%} | {row['ttft_p50_ms']:.0f} / "
                    f"{row['ttft_p99_ms']:.0f} ms | {row['errors']} |",
                    flush=True,
                )
                for sample in row["error_samples"]:
                    print(f"  error: {sample}", file=sys.stderr)
        best = max(r["hit_rate"] for r in mine)
        worst = min(r["hit_rate"] for r in mine)
        print(f"{strategy}: worst row {worst / best:.1%} of its best ({worst:.3f} / {best:.3f})", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
