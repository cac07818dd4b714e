"""Benchmark the backend adapters' parsing costs on captured and documented engine data (not a test).

Usage: python benchmarks/bench_adapters.py [--repeat N] [--json FILE]

Rows (median and p99 per call, microseconds), all on one core, nothing on the network:

* ``vllm /metrics, whole text``: prometheus-client's parser on a whole captured vLLM 0.32 body
  (``tests/e2e/vllm/fixtures/metrics_busy.txt``, ~600 lines): what a naive adapter would pay
  per backend per health round.
* ``vllm /metrics, parse_prometheus``: the adapter's parse (only the families it reads go through the parser).
* ``vllm KV batch decode``: ``decode_message`` on each of the 11 captured ZMQ messages, per message.
* ``vllm KV apply 2,048-token store``: decoding and applying the first captured ``BlockStored``
  (16 blocks of 128 tokens: the router re-hashes them from their token ids) to a fresh index.
* ``trtllm /metrics merge`` and ``trtllm /kv_cache_events parse+apply``: the documented-format fixtures.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvroute_tensorrt_llm import TrtllmEventFeed, merge_iteration_stats, parse_events
from kvroute_tokenizer_prefix import BlockIndex
from kvroute_vllm import VllmEventFeed, decode_message, parse_prometheus
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / "tests" / "e2e" / "vllm" / "fixtures"
TRT = ROOT / "tests" / "contrib" / "tensorrt-llm" / "fixtures"


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    metrics = (VLLM / "metrics_busy.txt").read_text()
    messages = [
        [base64.b64decode(f) for f in m["frames_b64"]]
        for m in json.loads((VLLM / "kv_events.json").read_text())["messages"]
    ]
    trt_metrics = json.loads((TRT / "metrics_sequence.json").read_text())
    trt_events = json.loads((TRT / "kv_cache_events_sequence.json").read_text())

    def decode_all() -> None:
        for frames in messages:
            decode_message(frames, b"kv")

    def apply_first() -> None:
        VllmEventFeed("b", BlockIndex(128)).receive(decode_message(messages[0], b"kv"))

    def trt_merge() -> None:
        stats = None
        for answer in trt_metrics:
            stats = merge_iteration_stats(stats, answer)

    def trt_apply() -> None:
        feed = TrtllmEventFeed("t", BlockIndex(32))
        for answer in trt_events:
            feed.receive(parse_events(answer))

    rows = [
        ("vllm /metrics, whole text", lambda: list(text_string_to_metric_families(metrics)), 1),
        ("vllm /metrics, parse_prometheus", lambda: parse_prometheus(metrics), 1),
        ("vllm KV batch decode (per message)", decode_all, len(messages)),
        ("vllm KV apply 2,048-token store", apply_first, 1),
        ("trtllm /metrics merge (4 answers)", trt_merge, 1),
        ("trtllm /kv_cache_events parse+apply (6 answers)", trt_apply, 1),
    ]
    out = []
    print(f"{'row':<50} {'p50 us':>10} {'p99 us':>10}")
    for name, fn, per in rows:
        fn()  # warm up
        p50, p99 = _time(fn, args.repeat)
        out.append({"row": name, "p50_us": round(p50 / per, 1), "p99_us": round(p99 / per, 1)})
        print(f"{name:<50} {p50 / per:>10.1f} {p99 / per:>10.1f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
