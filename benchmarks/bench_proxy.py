"""Added latency and throughput of `kvroute serve` over talking to an engine emulator directly.

Method (recorded with the figures in docs/performance.md, section "Proxy overhead"):

* One emulator (``kvroute emulate``, time scale 1e-4 so the engine's own time is tiny and
  constant) and one proxy (``kvroute serve``, default options: access log on, health checks
  on, strategy least-outstanding) run as separate processes on loopback, as in production.
* The client is aiohttp on uvloop in this process. Each measured request is sent twice over:
  straight to the emulator and through the proxy, alternating in batches so drift hits both.
* Non-streaming: time from sending to the whole response read. Streaming: time to the first
  SSE event (the first chunk a user would see), and to the end of the stream.
* Concurrency 1 gives the added latency a single user feels (p50/p99 of via-proxy minus the
  same percentile direct); concurrency 32 gives requests per second and tail latency.
* The proxy process's CPU time per request (user + system, from /proc) is reported too: it does
  not depend on what else the machine is doing, unlike the latencies.

A second part (``--routing``, also run by default) shows routing quality end to end: four
emulators (time scale 0.5, 512 KV blocks of 16 tokens each: room for four of the prefixes)
behind the proxy, 8 shared 2,000-token prefixes with a unique question each, 320 streamed
requests at concurrency 8, once per strategy with fresh emulators. It reports the TTFT the
client measured and the fleet's prefix-cache hit rate read from the emulators' own
``vllm:prefix_cache_*`` counters.

Run: ``python benchmarks/bench_proxy.py`` (about two minutes on 2 cores), ``--quick`` for a
smoke run, ``--json`` for machine-readable output, ``--only overhead|routing`` for one part,
``--workers N`` to run the proxy as ``kvroute serve --workers N`` (its CPU is then the supervisor's
and its workers' together).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp

PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@contextlib.contextmanager
def process(args: Sequence[str], ready_url: str, log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process in its own group, wait for it, and stop it (by its pid) afterwards.

    Its output goes to ``log`` when given (e.g. the proxy's JSON log lines), else nowhere.
    """
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("wb")) if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(ready_url)
        # free_port() can race with other programs: a server that lost its port exits at once,
        # while whoever took the port answers the readiness check.
        time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"{args[3]} exited with {proc.returncode} (port taken?): {' '.join(args)}")
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live children (the workers of --workers N), from /proc."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@contextlib.contextmanager
def emulator_and_proxy(extra_proxy_args: Sequence[str] = ()) -> Iterator[tuple[str, str, int]]:
    """An emulator and a proxy in front of it; yields (direct URL, proxy URL, proxy pid)."""
    e_port, p_port = free_port(), free_port()
    direct = f"http://127.0.0.1:{e_port}"
    via = f"http://127.0.0.1:{p_port}"
    emulator = [
        PYTHON,
        "-m",
        "kvroute",
        "emulate",
        "--port",
        str(e_port),
        "--model",
        "m",
        "--time-scale",
        "0.0001",
        "--num-gpu-blocks",
        "4096",
    ]
    proxy = [PYTHON, "-m", "kvroute", "serve", "--port", str(p_port), "--backend", f"e0={direct}", *extra_proxy_args]
    with process(emulator, direct + "/health"), process(proxy, via + "/health") as proxy_process:
        yield direct, via, proxy_process.pid


def body(i: int, stream: bool) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"benchmark request {i % 64} " + "word " * 200}],
        "max_tokens": 16,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


async def one(session: aiohttp.ClientSession, url: str, i: int, stream: bool) -> tuple[float, float]:
    """Returns (seconds to first body chunk, seconds to the end)."""
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body(i, stream)) as response:
        first = None
        async for _ in response.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        if response.status != 200:
            raise RuntimeError(f"{url}: status {response.status}")
    end = time.perf_counter() - t0
    return (first if first is not None else end), end


async def measure(url: str, count: int, concurrency: int, stream: bool) -> tuple[list[float], list[float], float]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(min(50, count)):  # warm the connection pools and the engine's cache
            await one(session, url, i, stream)
        firsts: list[float] = []
        ends: list[float] = []
        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while next_i < count:
                i = next_i
                next_i += 1
                first, end = await one(session, url, i, stream)
                firsts.append(first)
                ends.append(end)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return firsts, ends, count / elapsed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def compare(
    direct: str, via: str, count: int, concurrency: int, stream: bool, rounds: int, proxy_pid: int | None = None
) -> dict[str, float]:
    d_first: list[float] = []
    d_end: list[float] = []
    v_first: list[float] = []
    v_end: list[float] = []
    d_rps: list[float] = []
    v_rps: list[float] = []
    cpu = 0.0
    for _ in range(rounds):  # alternate so that drift affects both
        f, e, r = await measure(direct, count // rounds, concurrency, stream)
        d_first += f
        d_end += e
        d_rps.append(r)
        before = cpu_seconds(proxy_pid) if proxy_pid else 0.0
        f, e, r = await measure(via, count // rounds, concurrency, stream)
        cpu += cpu_seconds(proxy_pid) - before if proxy_pid else 0.0
        v_first += f
        v_end += e
        v_rps.append(r)
    ms = 1000.0
    out = {
        "direct_p50_ms": pct(d_end, 0.5) * ms,
        "proxy_p50_ms": pct(v_end, 0.5) * ms,
        "added_p50_ms": (pct(v_end, 0.5) - pct(d_end, 0.5)) * ms,
        "added_p99_ms": (pct(v_end, 0.99) - pct(d_end, 0.99)) * ms,
        "direct_rps": statistics.median(d_rps),
        "proxy_rps": statistics.median(v_rps),
    }
    if proxy_pid:
        # measure() adds up to 50 warm-up requests per round; they are in the CPU time too.
        out["proxy_cpu_us_per_request"] = cpu / (count // rounds + min(50, count // rounds)) / rounds * 1e6
    if stream:
        out["added_first_chunk_p50_ms"] = (pct(v_first, 0.5) - pct(d_first, 0.5)) * ms
        out["added_first_chunk_p99_ms"] = (pct(v_first, 0.99) - pct(d_first, 0.99)) * ms
    return out


def run(count: int, rounds: int, extra_proxy_args: Sequence[str]) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    with emulator_and_proxy(extra_proxy_args) as (direct, via, pid):
        for stream in (False, True):
            for concurrency in (1, 32):
                n = count if concurrency == 1 else count * 2
                key = f"{'stream' if stream else 'whole'} c{concurrency}"
                results[key] = asyncio.run(compare(direct, via, n, concurrency, stream, rounds, pid))
    return results


ROUTING_STRATEGIES = (
    ("random", ["--option", "seed=0"]),
    ("least-outstanding", []),
    ("consistent-hash", ["--option", "prefix_length=1024"]),
    ("bounded-load", ["--option", "prefix_length=1024"]),
)


def _prefix_body(i: int, groups: int) -> dict[str, object]:
    group = (i * 7919) % groups  # a fixed, well-mixed order of groups
    prefix = f"shared document {group} " + " ".join(f"w{group}x{k}" for k in range(2000))
    return {
        "model": "m",
        "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": f"question number {i}"}],
        "max_tokens": 16,
        "stream": True,
    }


def _scrape(url: str, names: Sequence[str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


async def _ttfts(url: str, count: int, concurrency: int, groups: int) -> list[float]:
    out: list[float] = []
    next_i = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            nonlocal next_i
            while next_i < count:
                i = next_i
                next_i += 1
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", json=_prefix_body(i, groups)) as response:
                    first = None
                    async for _ in response.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - t0
                    if response.status != 200 or first is None:
                        raise RuntimeError(f"request {i}: status {response.status}")
                out.append(first)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def routing_quality(count: int, concurrency: int = 8, groups: int = 8) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for strategy, options in ROUTING_STRATEGIES:
        ports = [free_port() for _ in range(4)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        p_port = free_port()
        via = f"http://127.0.0.1:{p_port}"
        with contextlib.ExitStack() as stack:
            for i, port in enumerate(ports):
                args = [
                    PYTHON,
                    "-m",
                    "kvroute",
                    "emulate",
                    "--port",
                    str(port),
                    "--model",
                    "m",
                    "--time-scale",
                    "0.5",
                    "--num-gpu-blocks",
                    "512",
                ]
                stack.enter_context(process(args, urls[i] + "/health"))
            proxy = [
                PYTHON,
                "-m",
                "kvroute",
                "serve",
                "--port",
                str(p_port),
                "--strategy",
                strategy,
                *options,
                "--no-access-log",
            ]
            for i, url in enumerate(urls):
                proxy += ["--backend", f"e{i}={url}"]
            stack.enter_context(process(proxy, via + "/health"))
            ttft = asyncio.run(_ttfts(via, count, concurrency, groups))
            hits = queries = 0.0
            for url in urls:
                scraped = _scrape(url, ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"])
                hits += scraped["vllm:prefix_cache_hits_total"]
                queries += scraped["vllm:prefix_cache_queries_total"]
        results[strategy] = {
            "ttft_p50_ms": pct(ttft, 0.5) * 1000,
            "ttft_p90_ms": pct(ttft, 0.9) * 1000,
            "ttft_p99_ms": pct(ttft, 0.99) * 1000,
            "hit_rate": hits / queries if queries else 0.0,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--requests", type=int, default=2000, help="requests per configuration at concurrency 1 (x2 at 32)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternating direct/proxy rounds")
    parser.add_argument("--quick", action="store_true", help="a smoke run (200 requests)")
    parser.add_argument("--no-access-log", action="store_true", help="run the proxy with --no-access-log")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=["overhead", "routing"], help="run one part")
    parser.add_argument("--workers", type=int, default=1, help="run the proxy with --workers N (overhead part)")
    args = parser.parse_args()
    count = 200 if args.quick else args.requests
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    extra = ["--no-access-log"] if args.no_access_log else []
    if args.workers > 1:
        extra += ["--workers", str(args.workers)]
    results = run(count, args.rounds, extra) if args.only != "routing" else {}
    routing = routing_quality(80 if args.quick else 320) if args.only != "overhead" else {}
    if args.json:
        print(json.dumps({"overhead": results, "routing": routing}, indent=2))
        return
    if routing:
        print("routing quality through the proxy (4 emulators, 8 prefixes of 2,000 tokens, streamed, concurrency 8)")
        print(f"{'strategy':<18} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT p99':>9} {'hit rate':>9}")
        for strategy, r in routing.items():
            print(
                f"{strategy:<18} {r['ttft_p50_ms']:>6.1f} ms {r['ttft_p90_ms']:>6.1f} ms {r['ttft_p99_ms']:>6.1f} ms "
                f"{r['hit_rate']:>8.1%}"
            )
    if not results:
        return
    print(
        f"proxy overhead ({count} requests at c1, {count * 2} at c32; "
        f"access log {'off' if args.no_access_log else 'on'}; "
        f"workers {args.workers})"
    )
    header = (
        f"{'case':<12} {'direct p50':>10} {'proxy p50':>10} {'added p50':>10} {'added p99':>10} {'1st chunk +p50':>15} "
        f"{'direct rps':>11} {'proxy rps':>10} {'proxy CPU/req':>14}"
    )
    print(header)
    for key, r in results.items():
        first = f"{r['added_first_chunk_p50_ms']:.3f} ms" if "added_first_chunk_p50_ms" in r else "-"
        print(
            f"{key:<12} {r['direct_p50_ms']:>7.3f} ms {r['proxy_p50_ms']:>7.3f} ms {r['added_p50_ms']:>7.3f} ms "
            f"{r['added_p99_ms']:>7.3f} ms {first:>15} {r['direct_rps']:>11.0f} {r['proxy_rps']:>10.0f} "
            f"{r['proxy_cpu_us_per_request']:>11.0f} us"
        )


if __name__ == "__main__":
    main()
