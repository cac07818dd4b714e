"""Data-parallel ranks through the proxy: per-rank prefix hit rates with rank routing and without.

One `kvroute emulate` engine with ``--data-parallel-size 4`` (400 KV blocks per rank, KV events on), behind
`kvroute serve --strategy tokenizer-prefix`, both in threads on loopback. Traffic: 16 documents of 600 words,
8 questions about each, shuffled with the seed, 4 clients at a time.

* ``rank routing``: the backend is of kind ``vllm``, so the adapter follows each rank's KV events, the index
  keeps one slot per rank and the proxy sends ``X-data-parallel-rank``.
* ``engine balancer``: the same engine as kind ``openai``: no events, no rank header; the engine's own
  balancer (vLLM's: least ``4 x waiting + running``) picks the rank.

Printed per row and seed: the engine's prefix hit rate (``vllm:prefix_cache_hits_total`` over
``..._queries_total``, summed and per ``engine`` label) and the requests each rank got.

Run: ``python benchmarks/bench_ranks.py`` (about a minute), ``--seeds 0,1,2``. Results in docs/performance.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread
from kvroute_simulator.emulator import EmulatorApp, EmulatorConfig
from kvroute_simulator.emulator.kv_events import KvEventsConfig
from tests.server.harness import http

RANKS = 4
DOCUMENTS = 16
QUESTIONS = 8


def _engine_counters(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """Prefix-cache hits and queries per ``engine`` label, from the emulator's /metrics."""
    _, _, text = http("GET", url + "/metrics")
    hits: dict[str, float] = {}
    queries: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            engine = sample.labels.get("engine", "0")
            if sample.name == "vllm:prefix_cache_hits_total":
                hits[engine] = sample.value
            elif sample.name == "vllm:prefix_cache_queries_total":
                queries[engine] = sample.value
    return hits, queries


def run(rank_routing: bool, seed: int) -> dict[str, Any]:
    events = KvEventsConfig(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
    engine = ServerThread(
        EmulatorApp(
            EmulatorConfig(model="m", time_scale=0.02, num_gpu_blocks=400, data_parallel_size=RANKS, kv_events=events)
        )
    ).start()
    backend = BackendConfig(id="dp", url=engine.url, kind="vllm" if rank_routing else "openai")
    config = ServerConfig(
        backends=(backend,), strategy="tokenizer-prefix", health=HealthConfig(interval=0.5), access_log=False
    )
    proxy = ServerThread(ProxyApp(config)).start()
    try:
        time.sleep(2.0)  # the first health round, the first load poll and the event subscriptions
        rng = random.Random(seed)
        documents = [" ".join(f"w{rng.randrange(5000)}" for _ in range(600)) for _ in range(DOCUMENTS)]
        work = [(d, q) for q in range(QUESTIONS) for d in range(DOCUMENTS)]
        rng.shuffle(work)

        def one(item: tuple[int, int]) -> int:
            d, q = item
            content = f"{documents[d]} question {q} about it?"
            body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            return http("POST", proxy.url + "/v1/chat/completions", body)[0]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(one, work))
        hits, queries = _engine_counters(engine.url)
        _, _, stats = http("GET", engine.url + "/emulator/stats")
        per_rank = [r.get("requests") for r in json.loads(stats).get("ranks", [])]
        return {
            "ok": codes.count(200),
            "hit_rate": round(sum(hits.values()) / max(1.0, sum(queries.values())), 3),
            "per_rank_hit": [
                round(hits.get(str(r), 0.0) / queries[str(r)], 2) if queries.get(str(r)) else None for r in range(RANKS)
            ],
            "requests_per_rank": per_rank,
        }
    finally:
        proxy.stop()
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the traffic (default 0,1,2)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    print("| routing | seed | requests ok | prefix hit rate | per rank | requests per rank |")
    print("|---|---|---|---|---|---|")
    for rank_routing in (True, False):
        label = "rank routing (kind vllm)" if rank_routing else "engine balancer (kind openai)"
        for seed in seeds:
            r = run(rank_routing, seed)
            total = DOCUMENTS * QUESTIONS
            print(
                f"| {label} | {seed} | {r['ok']}/{total} | {r['hit_rate']} | {r['per_rank_hit']} | "
                f"{r['requests_per_rank']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
