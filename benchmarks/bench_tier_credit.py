"""What a prefix hit on a slower KV tier is worth against a GPU hit, from the simulator's engine model.

One engine, idle, serves a query of ``prefix + suffix`` tokens whose prefix is (a) nowhere (cold:
the whole prompt is computed), (b) on the GPU, (c) on the CPU tier, or (d) on a disk tier (the
same mechanism at a disk's bandwidth). The prefix is put on a slower tier by serving it once,
then a filler request that evicts all of it from the GPU into the tier. The figure is the TTFT of
the query (virtual time: deterministic, no machine dependence), and the credit a router should
give a hit on the tier:

    credit = (TTFT cold - TTFT tier) / (TTFT cold - TTFT GPU)

the share of a GPU hit's saving that the slower hit keeps (1: as good as a GPU hit, 0: no better
than recomputing). Assumptions (edit below): a Llama-3-8B-like model on one GPU, KV 128 KiB per
token (32 layers x 8 KV heads x 128 x 2 x bf16), prefill 10,000 tokens/s plus attention, CPU
reload over PCIe at 25 GB/s (10 GB/s: what small-block copies achieve), disk at 3 and 2 GB/s (one NVMe
drive) and 1 GB/s (networked storage).
The copy is not overlapped with compute (pessimistic: vLLM loads asynchronously). Run

    python benchmarks/bench_tier_credit.py            # the table in docs/simulation.md
    python benchmarks/bench_tier_credit.py --json     # one JSON line per row
"""

from __future__ import annotations

import argparse
import json
import math

import attrs

from kvroute_simulator.engine import CostModel, Engine, EngineConfig, EngineRequest
from kvroute_simulator.tokens import TokenSeq

#: Llama-3-8B-like on one GPU: 10k prefill tokens/s; attention scaled from the 70B-on-8 model
#: (32 layers x 32 heads over 80 x 64, on one GPU instead of eight: 1.6 x its per-pair cost).
BASE = CostModel(
    prefill_base_ms=5.0,
    prefill_per_token_ms=0.1,
    attention_ms=1.8e-6,
    decode_base_ms=8.0,
    kv_bytes_per_token=131_072,
    cpu_reload_gb_per_s=25.0,
)
TIERS = {"CPU 25 GB/s": 25.0, "CPU 10 GB/s": 10.0, "disk 3 GB/s": 3.0, "disk 2 GB/s": 2.0, "disk 1 GB/s": 1.0}
PREFIXES = (1024, 4096, 16384, 65536)
SUFFIX = 256
BLOCK = 16


def _request(name: str, start: int, prefix: int, suffix: int, question: int = 9_000_000) -> EngineRequest:
    tokens = list(range(start, start + prefix)) + list(range(question, question + suffix))
    return EngineRequest(name, TokenSeq.of(tokens), 1)


def _serve(engine: Engine, request: EngineRequest, now: float) -> float:
    seq = engine.submit(request, now)
    while (t := engine.next_event_time()) is not None:
        engine.step(t)
    assert seq.ttft is not None
    return seq.ttft


def ttft(prefix: int, where: str, gb_per_s: float = 25.0) -> tuple[float, int, int]:
    """TTFT (s) of the query with its prefix ``where`` ("cold", "GPU", "tier"), and its GPU and tier hit tokens."""
    cost = attrs.evolve(BASE, cpu_reload_gb_per_s=gb_per_s)
    blocks = math.ceil((prefix + SUFFIX + 1) / BLOCK)
    config = EngineConfig(
        capacity_blocks=blocks + 1,
        cpu_capacity_blocks=4 * blocks if where == "tier" else 0,
        max_model_len=(blocks + 2) * BLOCK,
    )
    engine = Engine(config, cost)
    if where != "cold":
        _serve(engine, _request("warm", 0, prefix, SUFFIX, 8_000_000), 0.0)  # the prefix, another question
    if where == "tier":
        # Needs every block of the cache: evicts all of the prefix into the tier.
        _serve(engine, _request("filler", 10_000_000, (blocks + 1) * BLOCK - 1, 0), 100.0)
    before = engine.stats.hit_tokens, engine.stats.cpu_hit_tokens
    took = _serve(engine, _request("query", 0, prefix, SUFFIX), 200.0)
    cpu = engine.stats.cpu_hit_tokens - before[1]
    return took, engine.stats.hit_tokens - before[0] - cpu, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per row")
    args = parser.parse_args()
    rows = []
    for prefix in PREFIXES:
        cold, _, _ = ttft(prefix, "cold")
        gpu, gpu_hits, _ = ttft(prefix, "GPU")
        row: dict[str, object] = {"prefix": prefix, "cold_ms": cold * 1e3, "gpu_ms": gpu * 1e3, "gpu_hit": gpu_hits}
        for name, bandwidth in TIERS.items():
            took, on_gpu, on_tier = ttft(prefix, "tier", bandwidth)
            assert on_gpu == 0 and on_tier == gpu_hits, (prefix, name, on_gpu, on_tier, gpu_hits)
            row[name] = {"ms": took * 1e3, "credit": (cold - took) / (cold - gpu)}
        rows.append(row)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    head = f"{'prefix':>7} {'cold':>9} {'GPU hit':>9} " + " ".join(f"{name:>19}" for name in TIERS)
    print(head)
    for row in rows:
        cells = " ".join(
            f"{row[name]['ms']:>8.1f} ms ({row[name]['credit']:.2f})"  # type: ignore[index]
            for name in TIERS
        )
        print(f"{row['prefix']:>7} {row['cold_ms']:>6.1f} ms {row['gpu_ms']:>6.1f} ms {cells}")
    print("TTFT of a query of prefix + 256 tokens on an idle engine; (credit) = (cold - tier) / (cold - GPU).")


if __name__ == "__main__":
    main()
