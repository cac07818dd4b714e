"""Warm join behind `kvroute serve`: TTFT of the requests whose prefix moves to a joining backend.

Five `kvroute emulate` engines (`--time-scale 0.25`: a simulated second lasts 0.25 wall seconds);
four serve behind `kvroute serve` (default strategy, bounded-load) and the fifth is added through
the admin API (`POST /admin/backends`) after 12 wall seconds of traffic. Traffic: 40 system
prompts of ~2,000 tokens, each request one of them at random plus a short question, streamed,
`max_tokens` 8, Poisson arrivals at 10 requests per wall second. Variants of the proxy:

    off       no warm join
    prefill   --prefill 16                  (pre-fill the joining backend with its hottest prefixes)
    slow      --slow-start WINDOW/2         (ramp its weight over half the window)
    both      --prefill 16 --slow-start WINDOW/2

Measured: the TTFT the client sees (to the first SSE line, in simulated seconds) of the requests
sent in the window after the join (15 wall seconds: the simulated minute). "Moved" requests are
those whose system prompt's home is the new backend at the end (one probe request per prompt after
the window, when any ramp is over); "first moved" is the first request of each moved prompt after
the join, the one that pays the cold prefill when there is no warm join.

Each run prints one JSON line: p50/p90 per group, and the pre-fill's planned and sent prefixes
and its time, from the proxy's log. With more than one seed it then prints, per variant, the
median over the seeds of each run's p90 and the p50 of the pooled first-moved TTFTs: the method of
the table in docs/warm-join.md ("Measured"). Reproduce it with

    python benchmarks/bench_warm_join.py --seeds 4-8

(all four variants, five seeds each: 20 runs of about 35 s). The seed fixes the arrival times and
the prompt of each request; the TTFTs depend on the machine. ``--variants off --seeds 1`` for a
smoke run; ``--out DIR`` keeps each run's proxy log and request rows (a temporary directory
otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_proxy as bp

KVROUTE = [sys.executable, "-m", "kvroute"]
TOKEN = "bench-admin-token-0123456789"
SYSTEMS = 40
SYSTEM_WORDS = 2000
VARIANTS = ("off", "prefill", "slow", "both")
NEW = "new"  # the joining backend's id


def warm_flags(variant: str, window: float) -> list[str]:
    """`kvroute serve` flags of a variant; slow start ramps over half the measured window."""
    prefill = ["--prefill", "16"]
    slow = ["--slow-start", str(window / 2)]
    return {"off": [], "prefill": prefill, "slow": slow, "both": prefill + slow}[variant]


def system_prompt(i: int) -> str:
    return f"You are assistant {i}. " + " ".join(f"policy{i}w{j}" for j in range(SYSTEM_WORDS))


async def chat(client: httpx.AsyncClient, proxy: str, system: int, n: int, t0: float) -> dict[str, Any]:
    """One streamed request; its send time since `t0`, backend, status and TTFT (wall seconds)."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system_prompt(system)},
            {"role": "user", "content": f"question {n} about item {n * 7919 % 1000}"},
        ],
        "max_tokens": 8,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", proxy + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: "):
                ttft = time.perf_counter() - start
    backend = response.headers.get("x-kvroute-backend")
    return {"t": start - t0, "system": system, "backend": backend, "ttft": ttft, "status": response.status_code}


async def traffic(
    proxy: str, join_url: str, seed: int, before: float, window: float, rate: float
) -> tuple[float, list[dict[str, Any]], dict[int, str]]:
    """Poisson traffic with the join after `before` seconds; returns (join time, rows, each prompt's home after)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    joined_at = None
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:

        async def record(system: int, n: int) -> None:
            rows.append(await chat(client, proxy, system, n, t0))

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            n = 0
            while (now := time.perf_counter() - t0) < before + window:
                if joined_at is None and now >= before:
                    response = await client.post(
                        proxy + "/admin/backends",
                        json={"id": NEW, "url": join_url},
                        headers={"authorization": f"Bearer {TOKEN}"},
                    )
                    if response.status_code != 201:
                        raise RuntimeError(f"expected 201 adding the backend, got {response.status_code}")
                    joined_at = time.perf_counter() - t0
                tg.create_task(record(rng.randrange(SYSTEMS), n))
                n += 1
                await asyncio.sleep(rng.expovariate(rate))
        homes = {}
        for system in range(SYSTEMS):
            probe = await chat(client, proxy, system, 10**6 + system, t0)
            homes[system] = probe["backend"]
    assert joined_at is not None  # the loop runs past `before`
    return joined_at, rows, homes


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile, None for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def run_once(variant: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One variant on fresh engines and proxy; TTFT summary in simulated seconds."""
    urls = [f"http://127.0.0.1:{bp.free_port()}" for _ in range(5)]
    proxy = f"http://127.0.0.1:{bp.free_port()}"
    log = out / f"serve-{variant}-{seed}.log"
    serve = [*KVROUTE, "serve", "--port", proxy.rsplit(":", 1)[1], "--admin-token", TOKEN, "--no-access-log"]
    serve += warm_flags(variant, args.window)
    serve += [arg for i, url in enumerate(urls[:4]) for arg in ("--backend", f"e{i}={url}")]
    with contextlib.ExitStack() as stack:
        for url in urls:
            emulate = [*KVROUTE, "emulate", "--port", url.rsplit(":", 1)[1], "--model", "m"]
            stack.enter_context(bp.process([*emulate, "--time-scale", str(args.time_scale)], url + "/health"))
        stack.enter_context(bp.process(serve, proxy + "/health", log))

        async def bounded() -> tuple[float, list[dict[str, Any]], dict[int, str]]:
            async with asyncio.timeout(args.seconds_before + args.window + args.timeout):
                return await traffic(proxy, urls[4], seed, args.seconds_before, args.window, args.rate)

        joined_at, rows, homes = asyncio.run(bounded())
    (out / f"rows-{variant}-{seed}.json").write_text(json.dumps({"joined_at": joined_at, "homes": homes, "rows": rows}))

    after = [r for r in rows if r["t"] >= joined_at and r["ttft"] is not None]
    moved = [r for r in after if homes[r["system"]] == NEW]
    first_moved = {}
    for r in sorted(moved, key=lambda r: r["t"]):
        first_moved.setdefault(r["system"], r)
    # The proxy's warm-join log lines, by event (the proxy logs JSON when its output is not a terminal).
    lines = [line for line in log.read_text().splitlines() if '"warm_join_' in line]
    events = {e["event"]: e for e in map(json.loads, lines)}

    def ttfts(group: list[dict[str, Any]]) -> list[float]:
        return [r["ttft"] / args.time_scale for r in group]

    groups = {
        "moved": ttfts(moved),
        "first_moved": ttfts(list(first_moved.values())),
        "stayed": ttfts([r for r in after if homes[r["system"]] != NEW]),
        "all": ttfts(after),
    }
    result: dict[str, Any] = {"variant": variant, "seed": seed, "requests_after": len(after)}
    result["moved_prefixes"] = sum(1 for home in homes.values() if home == NEW)
    for name, values in groups.items():
        result[f"{name}_n"] = len(values)
        for q in (50, 90):
            value = quantile(values, q / 100)
            result[f"{name}_p{q}"] = None if value is None else round(value, 4)
    result["first_moved_ttfts"] = groups["first_moved"]
    result["errors"] = sum(1 for r in rows if r["status"] != 200)
    result["prefill"] = None
    if "--prefill" in serve:
        # A pre-fill with nothing planned logs only warm_join_started.
        prefilled = events.get("warm_join_prefilled", {"planned": events.get("warm_join_started", {}).get("prefixes")})
        result["prefill"] = {k: prefilled.get(k) for k in ("planned", "sent", "failed", "took_s")}
    return result


def median_table(results: list[dict[str, Any]]) -> str:
    """Per variant: the median over seeds of each run's p90 (ms), and the pooled first-moved p50."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    def median(runs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    lines = [
        "| variant | runs | moved prefixes | moved TTFT p90 | first request of each moved prefix, p50 (pooled) "
        "| other requests TTFT p90 | all requests TTFT p90 | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        runs = [r for r in results if r["variant"] == variant]
        if not runs:
            continue
        pooled = [t for r in runs for t in r["first_moved_ttfts"]]
        moved = sorted(r["moved_prefixes"] for r in runs)
        lines.append(
            f"| {variant} | {len(runs)} | {moved[0]}-{moved[-1]} | {ms(median(runs, 'moved_p90'))} "
            f"| {ms(quantile(pooled, 0.5))} | {ms(median(runs, 'stayed_p90'))} | {ms(median(runs, 'all_p90'))} "
            f"| {sum(r['errors'] for r in runs)} |"
        )
    return "\n".join(lines)


def seed_list(text: str) -> list[int]:
    """'4-8' or '1,3,5' -> seeds."""
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--seeds", type=seed_list, default=seed_list("4-8"), help="'4-8' (default) or '1,2'")
    parser.add_argument("--time-scale", type=float, default=0.25, help="emulators' wall s per simulated s")
    parser.add_argument("--seconds-before", type=float, default=12, help="wall seconds of traffic before the join")
    parser.add_argument("--window", type=float, default=15, help="wall seconds measured after the join")
    parser.add_argument("--rate", type=float, default=10, help="requests per wall second (Poisson)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a run may overrun its traffic")
    parser.add_argument("--out", type=Path, help="keep proxy logs and request rows here (default: a temp dir)")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: expected some of {', '.join(VARIANTS)}, got {', '.join(unknown)}")

    with contextlib.ExitStack() as stack:
        if args.out is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="warmjoin-")))
        else:
            out = args.out
            out.mkdir(parents=True, exist_ok=True)
        results = []
        for seed in args.seeds:
            for variant in variants:
                result = run_once(variant, seed, args, out)
                results.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "first_moved_ttfts"}), flush=True)
    if len(args.seeds) > 1:
        print(median_table(results))


if __name__ == "__main__":
    main()
