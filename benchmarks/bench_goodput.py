"""Goodput under latency objectives through ``kvroute serve``: SLO-aware choice and admission, next to SGLang's router.

The fleet: ``--engines`` ``kvroute emulate`` engines (the simulator's engine model of a 70B model on
8 x H100) at ``--time-scale`` (4: four wall seconds per simulated second, so that 2 shared cores can drive
the fleet past its capacity), ``--max-num-seqs 8`` and a 1,024-block cache each (block size 16): batches
fill and requests wait in the engines' queues near capacity, and each engine holds a few of the shared
prefixes.

The requests (seeded, the same for every row and every rate): ``--groups`` system prompts of about 1,500
words, each request one of them (Zipf-popular) and its own question of 20-60 words, streamed with
``stream_options.include_usage`` and ``max_tokens`` 32, at Poisson times. Each request carries its objectives
as headers (``x-slo-ttft-ms``, ``x-slo-tpot-ms``): TTFT 500 ms and TPOT 50 ms of the emulated hardware,
that is times the time scale on the wall clock (2,000 ms and 200 ms at time scale 4). SGLang's router
ignores them.

The rates: the fleet's capacity is measured first (a closed loop of ``engines x max-num-seqs`` clients (at most
32 per engine) through plain
``kvroute serve`` for ``--calibrate`` seconds: completed requests per second), then each row runs at
``--loads`` times it (0.6, 1.0, 1.5: below, at and above capacity), ``--duration`` seconds of arrivals.

Rows: ``kvroute serve`` with its default strategy (bounded-load) plain, with ``--slo-aware``, with
``--slo-aware --slo-unmet sink`` (routing alone: a request no backend can serve in time goes to the backend
of the longest predicted TTFT), with ``--slo-aware --admission queue`` and with ``--slo-aware --admission
shed`` (backends of kind ``vllm``, so the proxy polls the engines' load), and SGLang's router
(``sglang-router`` 0.3.2 from PyPI in its own virtual environment, installed as bench_vs_sglang.py does)
with ``--policy cache_aware``. Every row starts
fresh engines and a fresh router, stopped by pid afterwards.

Per row (client-side, except the last two columns): requests sent; served (200 and a whole stream); shed (429,
admission's answer); goodput (served requests that met both objectives, per second of the arrival window);
attainment (that as a share of all requests sent); TTFT p50 and p99 and TPOT p50 of the served ones. TTFT is the
time to the first SSE data event, TPOT (time of the last event - the first) / (completion tokens - 1). The last
two columns are the proxy's own (``/status.json``'s ``slo.predictions``, kvroute rows that predict): the share
of streams whose TTFT was predicted within 25 % of the one observed, and the median absolute error (``--json``
also keeps what the predictor learned per backend: rates, TTFT overhead, seat time and seats).

Run: ``nice -n 10 python benchmarks/bench_goodput.py`` (6 rows x 3 loads; about 12 minutes on 2 cores);
``--only NAME,...`` (substrings of the row names), ``--loads``, ``--duration``, ``--engines``,
``--time-scale``, ``--seed``, ``--json FILE``. Results in docs/performance.md ("Goodput under SLOs through
the proxy").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import attrs
from bench_vs_sglang import ensure_sglang_router, free_port, started

KVROUTE = [sys.executable, "-m", "kvroute"]
MODEL = "bench-model"
MAX_TOKENS = 32
MAX_NUM_SEQS = 8
BLOCKS = 1024
#: The objectives on the emulated hardware, in seconds; scaled by the time scale on the wall clock.
TTFT_S, TPOT_S = 0.5, 0.05
#: The words prompts are made of (the emulator tokenizes words).
WORDS = [f"w{i}" for i in range(2000)]


@attrs.frozen
class Row:
    name: str
    kind: str  # "kvroute" or "sglang"
    args: tuple[str, ...] = ()


ROWS = (
    Row("kvroute bounded-load", "kvroute"),
    Row("kvroute bounded-load --slo-aware", "kvroute", ("--slo-aware",)),
    Row("kvroute --slo-aware --slo-unmet sink", "kvroute", ("--slo-aware", "--slo-unmet", "sink")),
    Row("kvroute --slo-aware --admission queue", "kvroute", ("--slo-aware", "--admission", "queue")),
    Row("kvroute --slo-aware --admission shed", "kvroute", ("--slo-aware", "--admission", "shed")),
    Row("SGLang cache_aware", "sglang", ("--policy", "cache_aware")),
)


@attrs.frozen
class Request:
    at: float  # arrival, in units of mean inter-arrival time (scaled by 1/rate)
    group: int
    question: str


def workload(seed: int, count: int, groups: int) -> tuple[list[str], list[Request]]:
    """The system prompts and the requests (arrivals at rate 1: divide by the rate)."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(1500)) for _ in range(groups)]
    weights = [1 / (g + 1) for g in range(groups)]
    t = 0.0
    requests = []
    for _ in range(count):
        t += rng.expovariate(1.0)
        group = rng.choices(range(groups), weights)[0]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        requests.append(Request(t, group, question))
    return systems, requests


def body(systems: Sequence[str], request: Request) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": systems[request.group]},
            {"role": "user", "content": request.question},
        ],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@attrs.define
class Result:
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    complete: bool = False


async def one(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str]) -> Result:
    """Send one streamed chat request; measure TTFT (first data event) and TPOT from its usage."""
    result = Result()
    sent = time.perf_counter()
    first = last = None
    tokens = None
    try:
        async with session.post(url + "/v1/chat/completions", json=payload, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                await response.read()
                return result
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                data = line[5:].strip()
                if data == b"[DONE]":
                    result.complete = True
                    break
                if first is None:
                    first = now
                last = now
                with contextlib.suppress(ValueError):
                    usage = json.loads(data).get("usage")
                    if usage:
                        tokens = usage.get("completion_tokens")
    except (TimeoutError, aiohttp.ClientError):
        return result
    if first is not None:
        result.ttft = first - sent
        if last is not None and tokens and tokens > 1:
            result.tpot = (last - first) / (tokens - 1)
    return result


async def open_loop(
    url: str, systems: Sequence[str], requests: Sequence[Request], rate: float, scale: float
) -> list[Result]:
    headers = {"x-slo-ttft-ms": f"{TTFT_S * scale * 1000:.0f}", "x-slo-tpot-ms": f"{TPOT_S * scale * 1000:.0f}"}
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def at(request: Request) -> Result:
            delay = request.at / rate - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            return await one(session, url, body(systems, request), headers)

        return list(await asyncio.gather(*(at(r) for r in requests)))


async def closed_loop(
    url: str, systems: Sequence[str], requests: Sequence[Request], clients: int, seconds: float
) -> float:
    """Completed requests per second with ``clients`` clients back to back for ``seconds``."""
    done = 0
    stop = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(i: int) -> None:
            nonlocal done
            n = i
            while time.perf_counter() < stop:
                result = await one(session, url, body(systems, requests[n % len(requests)]), {})
                if result.complete:
                    done += 1
                n += clients

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return done / (time.perf_counter() - start)


@contextlib.contextmanager
def fleet_and_router(row: Row, args: argparse.Namespace, sglang: Path) -> Iterator[str]:
    """Fresh engines and a fresh router for one row; yields the router's URL."""
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(args.engines):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            emulate = [*KVROUTE, "emulate", "--port", str(port), "--model", MODEL, "--time-scale", str(args.time_scale),
                       "--max-num-seqs", str(args.max_num_seqs), "--num-gpu-blocks", str(BLOCKS)]  # fmt: skip
            stack.enter_context(started(emulate, url + "/health"))
            urls.append(url)
        port = free_port()
        if row.kind == "sglang":
            command = [str(sglang), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                       "--log-level", "warn", *row.args]  # fmt: skip
        else:
            command = [*KVROUTE, "serve", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", *row.args]
            for i, url in enumerate(urls):
                command += ["--backend", f"id=e{i},url={url},kind=vllm"]
        stack.enter_context(started(command, f"http://127.0.0.1:{port}/health"))
        yield f"http://127.0.0.1:{port}"


def summarise(results: Sequence[Result], window: float, scale: float) -> dict[str, Any]:
    served = [r for r in results if r.complete]
    good = [
        r
        for r in served
        if r.ttft is not None and r.ttft <= TTFT_S * scale and (r.tpot is None or r.tpot <= TPOT_S * scale)
    ]
    ttfts = sorted(r.ttft for r in served if r.ttft is not None)
    tpots = sorted(r.tpot for r in served if r.tpot is not None)

    def q(values: Sequence[float], p: float) -> float | None:
        return values[min(len(values) - 1, int(p * len(values)))] if values else None

    return {
        "sent": len(results),
        "served": len(served),
        "shed": sum(r.status == 429 for r in results),
        "failed": sum(not r.complete and r.status != 429 for r in results),
        "goodput": len(good) / window,
        "attainment": len(good) / len(results) if results else 0.0,
        "ttft_p50": q(ttfts, 0.5),
        "ttft_p99": q(ttfts, 0.99),
        "tpot_p50": statistics.median(tpots) if tpots else None,
    }


def predictor_quality(url: str) -> dict[str, Any]:
    """The proxy's TTFT predictions against the observed first bytes (``/status.json``), when it predicts."""
    with urllib.request.urlopen(url + "/status.json", timeout=10) as response:
        predictions = json.load(response)["slo"]["predictions"]
    return {
        "within_25pct": predictions["within_25pct"],
        "median_abs_error_ms": predictions["median_abs_error_ms"],
        "rates": predictions.get("rates"),  # what the predictor learned per backend (``--json`` only)
    }


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="each engine's batch seats [8]")
    parser.add_argument("--loads", default="0.6,1.0,1.5", help="multiples of the measured capacity [0.6,1.0,1.5]")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run [20]")
    parser.add_argument("--calibrate", type=float, default=20.0, help="seconds of the capacity run [20]")
    parser.add_argument("--capacity", type=float, default=None, help="skip the capacity run: requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="rows whose name contains one of these comma-separated words")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvroute-bench",
    )
    args = parser.parse_args()
    scale = args.time_scale
    loads = [float(x) for x in args.loads.split(",")]
    rows = [r for r in ROWS if not args.only or any(w.strip() in r.name for w in args.only.split(","))]
    sglang = ensure_sglang_router(args.cache_dir) if any(r.kind == "sglang" for r in rows) else Path()
    systems, pool = workload(args.seed, 4000, args.groups)
    capacity = args.capacity
    if capacity is None:
        with fleet_and_router(ROWS[0], args, sglang) as url:
            capacity = asyncio.run(
                closed_loop(url, systems, pool, args.engines * min(args.max_num_seqs, 32), args.calibrate)
            )
        print(f"capacity: {capacity:.2f} requests/s ({args.engines} engines, time scale {scale})", file=sys.stderr)
    out: list[dict[str, Any]] = []
    for load in loads:
        rate = load * capacity
        count = max(1, round(rate * args.duration))
        requests = pool[:count]
        window = requests[-1].at / rate
        for row in rows:
            t0 = time.monotonic()
            with fleet_and_router(row, args, sglang) as url:
                results = asyncio.run(open_loop(url, systems, requests, rate, scale))
                predictions = predictor_quality(url) if row.kind == "kvroute" else {}
            summary = summarise(results, window, scale)
            summary.update(predictions)
            summary.update(row=row.name, load=load, rate=rate, wall_s=time.monotonic() - t0)
            out.append(summary)
            print(json.dumps(summary), file=sys.stderr)
    print(f"\ncapacity {capacity:.2f} req/s; objectives TTFT {TTFT_S * scale * 1000:.0f} ms, "
          f"TPOT {TPOT_S * scale * 1000:.0f} ms (wall clock, time scale {scale:g}); load average "
          f"{os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print("| load | rate (req/s) | router | sent | served | shed | goodput (req/s) | attainment "
          "| TTFT p50 | TTFT p99 | TPOT p50 | TTFT predicted within 25 % | median abs. error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in out:
        print(
            f"| {s['load']:g}x | {s['rate']:.1f} | {s['row']} | {s['sent']} | {s['served']} | {s['shed']} | "
            f"{s['goodput']:.2f} | {100 * s['attainment']:.1f}% | {ms(s['ttft_p50'])} ms | {ms(s['ttft_p99'])} ms | "
            f"{ms(s['tpot_p50'])} ms | {pct(s.get('within_25pct'))} | {num(s.get('median_abs_error_ms'))} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"capacity": capacity, "rows": out}, indent=2))


if __name__ == "__main__":
    main()
