"""Offloaded KV tiers through the proxy: hit rate and TTFT with tier credit and without, on the same requests.

Four `kvroute emulate` engines (in threads, real time), each with a small GPU tier and a CPU tier five
times larger (``--num-gpu-blocks 160 --num-cpu-blocks 800``, blocks of 16 tokens; blocks the GPU evicts
move to the CPU tier, a CPU hit is copied back at ``--cpu-reload-gbps`` 25 over ``--kv-bytes-per-token``
327,680, the 70B model's), KV events on (``--kv-events-config``), behind `kvroute serve --strategy
tokenizer-prefix` with backends of kind ``vllm``: the index follows each engine's events, each block's
tier among them.

Traffic (seeded): 12 families of documents, each a shared head of 500 words and 3 variants (a tail of 120
words), 4 questions per variant (144 requests), shuffled, 8 clients at a time, ``max_tokens`` 1 (the latency
of a request is its TTFT plus one decode step). ``min_capacity`` 0 on every row, so that the load bound moves
requests at this low concurrency and a family's blocks end up on more than one engine, on different tiers:
that is where a credit decides something.

Rows (the strategy's ``cpu_credit`` / ``disk_credit``):

* ``credit 0.85 / 0.35``: the defaults;
* ``credit 1.0``: a block on the CPU tier counts as a GPU block (what the index did before it kept tiers);
* ``credit 0``: only GPU blocks count (a router that ignores offloaded blocks).

Printed per row: the engines' prefix hit rate (hit tokens over prompt tokens, both tiers), the GPU and CPU
hit tokens, the seconds spent copying CPU blocks back (the engines' ``reload_time``), and the client's
latency p50 / p99. Run: ``python benchmarks/bench_tier_proxy.py`` (about a minute; ``--seeds 0,1``,
``--credits 0.85,1.0,0``). Results in docs/performance.md ("Offloaded tiers through the proxy").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread
from kvroute_simulator.emulator import EmulatorApp, EmulatorConfig
from kvroute_simulator.emulator.kv_events import KvEventsConfig
from tests.server.harness import http

ENGINES = 4
GPU_BLOCKS = 160
CPU_BLOCKS = 800
RELOAD_GBPS = 25.0
FAMILIES = 12
VARIANTS = 3
QUESTIONS = 4
HEAD_WORDS = 500
TAIL_WORDS = 120
CLIENTS = 8


def requests(seed: int) -> list[str]:
    """The seeded prompts: every family's variants, each asked ``QUESTIONS`` times, shuffled."""
    rng = random.Random(seed)
    prompts = []
    for f in range(FAMILIES):
        head = " ".join(f"h{rng.randrange(20000)}" for _ in range(HEAD_WORDS))
        for v in range(VARIANTS):
            tail = " ".join(f"t{rng.randrange(20000)}" for _ in range(TAIL_WORDS))
            prompts += [f"family {f}: {head} variant {v}: {tail} question {q}?" for q in range(QUESTIONS)]
    rng.shuffle(prompts)
    return prompts


def run(cpu_credit: float, disk_credit: float, seed: int) -> dict[str, Any]:
    """One row: fresh engines and proxy, the seed's requests, the engines' counters and the client's latencies."""
    engines = []
    for _ in range(ENGINES):
        events = KvEventsConfig(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
        emulated = EmulatorConfig(
            model="m",
            num_gpu_blocks=GPU_BLOCKS,
            num_cpu_blocks=CPU_BLOCKS,
            cpu_reload_gbps=RELOAD_GBPS,
            kv_events=events,
        )
        engines.append(ServerThread(EmulatorApp(emulated)).start())
    backends = tuple(BackendConfig(id=f"e{i}", url=e.url, kind="vllm") for i, e in enumerate(engines))
    options = {"cpu_credit": cpu_credit, "disk_credit": disk_credit, "min_capacity": 0}
    config = ServerConfig(
        backends=backends,
        strategy="tokenizer-prefix",
        options=options,
        health=HealthConfig(interval=0.5),
        access_log=False,
    )
    proxy = ServerThread(ProxyApp(config)).start()
    try:
        time.sleep(2.0)  # the first health round, the first load poll and the event subscriptions

        def one(prompt: str) -> tuple[int, float]:
            body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
            started = time.perf_counter()
            status = http("POST", proxy.url + "/v1/chat/completions", body, timeout=120)[0]
            return status, time.perf_counter() - started

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(one, requests(seed)))
        totals = {"prompt_tokens": 0.0, "hit_tokens": 0.0, "gpu_hit_tokens": 0.0, "cpu_hit_tokens": 0.0}
        reload_time = 0.0
        for engine in engines:
            stats = json.loads(http("GET", engine.url + "/emulator/stats")[2])["engine"]
            for name in totals:
                totals[name] += stats[name]
            reload_time += stats["reload_time"]
        latencies = sorted(t for status, t in results if status == 200)
        return {
            "ok": len(latencies),
            "total": len(results),
            "hit_rate": totals["hit_tokens"] / max(1.0, totals["prompt_tokens"]),
            "gpu_hit_tokens": int(totals["gpu_hit_tokens"]),
            "cpu_hit_tokens": int(totals["cpu_hit_tokens"]),
            "reload_s": reload_time,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        }
    finally:
        proxy.stop()
        for engine in engines:
            engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="comma-separated seeds of the traffic (default 0)")
    parser.add_argument("--credits", default="0.85,1.0,0", help="cpu_credit per row (disk_credit 0.35 with 0.85)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    credits = [float(c) for c in args.credits.split(",") if c.strip()]
    print("| cpu / disk credit | seed | ok | hit rate | GPU / CPU hit tokens | reload s | latency p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for credit in credits:
        disk = 0.35 if credit == 0.85 else credit
        for seed in seeds:
            r = run(credit, disk, seed)
            print(
                f"| {credit:g} / {disk:g} | {seed} | {r['ok']}/{r['total']} | {r['hit_rate']:.3f} | "
                f"{r['gpu_hit_tokens']:,} / {r['cpu_hit_tokens']:,} | {r['reload_s']:.2f} | "
                f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
