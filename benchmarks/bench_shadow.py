"""Benchmark the request-path cost of shadow strategies in ``kvroute serve`` (not a test).

Usage: python benchmarks/bench_shadow.py [--quick] [--backends N] [--seed S] [--block-size B]

What one request costs the proxy for the shadow comparison: `ProxyShadows.routed` (the candidates,
the prompt's block hashes, the live decision's score in the fleet cache view, each shadow's pick,
score and record, the metrics) plus `ProxyShadows.finished` (each shadow's request ends), with
the proxy's real metrics. Rows:

* ``off``: no shadow configured: the forwarder's call to `NoShadows.routed`, which does nothing, all that
  runs then (timed apart, a million calls);
* ``view only``: a shadow set with no shadow (the live strategy's scoring alone);
* ``+ NAME``: one shadow of that strategy;
* ``+ 3 shadows``: random, consistent-hash and bounded-load together.

Traffic is seeded: ``--backends`` backends (8), a bounded-load live strategy, prompts of 2 KB and
32 KB of routing text (about 500 and 8,000 tokens at the default 4 characters per unit) made of 64
shared prefixes (half the text) and a unique rest, so views hold blocks and matches are partial.
Rows are interleaved: each request is handed to every configuration in turn, in an order rotated
per request, so drift on a shared machine falls on all rows alike. Median and p99 in microseconds.
"""

from __future__ import annotations

import argparse
import functools
import logging
import random
import statistics
import time
import timeit
from collections.abc import Sequence

import structlog

from kvroute import Backend, CacheView, Fleet, PluginManager, Router, RouteRequest, ShadowSet
from kvroute_server.config import ServerConfig
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.ops.shadow import NoShadows, ProxyShadows

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

LIVE = "bounded-load"
CONFIGS: dict[str, tuple[str, ...]] = {
    "view only": (),
    "+ random": ("random",),
    "+ least-outstanding": ("least-outstanding",),
    "+ consistent-hash": ("consistent-hash",),
    "+ 3 shadows": ("random", "least-outstanding", "consistent-hash"),
}
SIZES = (2 * 1024, 32 * 1024)


def text(rng: random.Random, size: int, prefixes: Sequence[str]) -> str:
    head = rng.choice(prefixes)[: size // 2]
    rest = " ".join(f"w{rng.randrange(10**6)}" for _ in range(size // 8))
    return (head + " " + rest)[:size]


def shadow_set(fleet: Fleet, shadows: tuple[str, ...], plugins: PluginManager, block_size: int) -> ProxyShadows:
    """As `ProxyShadows.create` builds it; ``()`` gives the live scoring alone (the proxy needs a shadow for that)."""
    metrics = ProxyMetrics(fleet, LIVE)
    view = {"block_size": block_size}
    if not shadows:
        live_only = ShadowSet(fleet, LIVE, {}, functools.partial(CacheView, **view))
        return ProxyShadows(live_only, metrics.shadow_metrics(LIVE, ()))
    config = ServerConfig(strategy=LIVE, shadow=shadows, cache_view=view)
    made = ProxyShadows.create(config, fleet, metrics, plugins)
    assert isinstance(made, ProxyShadows)
    return made


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(requests: int, backends: int, seed: int, block_size: int) -> None:
    plugins = PluginManager()
    fleet = Fleet([Backend(f"b{i}", url=f"http://10.0.0.{i}:8000") for i in range(backends)])
    router = Router.create(fleet, LIVE, {"prefix_length": 1024}, plugins=plugins)
    sets = {name: shadow_set(fleet, shadows, plugins, block_size) for name, shadows in CONFIGS.items()}
    rng = random.Random(seed)
    prefixes = [" ".join(f"p{g}x{i}" for i in range(SIZES[-1] // 6)) for g in range(64)]
    print(f"{backends} backends, live {LIVE}, view blocks of {block_size}, {requests} requests per size, seed {seed}")
    # Off: the forwarder's one call per request (Forwarder.shadows is a NoShadows), timed over a million of them.
    probe = RouteRequest.from_text("hi", model="m")
    names = {"off": NoShadows(), "request": probe, "decision": router.decide(probe)[0]}
    per_call = timeit.timeit("off.routed(request, decision, ())", globals=names, number=1_000_000) * 1e3
    print(f"off (no shadow configured): {per_call:.1f} ns per request (one call that does nothing)")
    print(f"{'prompt':>7} {'row':<22} {'median us':>10} {'p99 us':>10}")
    for size in SIZES:
        samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
        names = list(CONFIGS)
        for n in range(requests):
            request = RouteRequest.from_text(text(rng, size, prefixes), model="m", request_id=str(n))
            decision, _ = router.decide(request)
            k = n % len(names)
            for name in names[k:] + names[:k]:
                shadows = sets[name]
                t0 = time.perf_counter_ns()
                round_ = shadows.routed(request, decision, ())
                shadows.finished(round_, RequestOutcome.OK, time.perf_counter())
                samples[name].append((time.perf_counter_ns() - t0) / 1000)
        for name, values in samples.items():
            median, p99 = statistics.median(values), percentile(values, 0.99)
            print(f"{size // 1024:>5} KB {name:<22} {median:>10.1f} {p99:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 requests per size instead of 2,000")
    parser.add_argument("--backends", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16, help="the cache view's block size in tokens")
    args = parser.parse_args()
    run(200 if args.quick else 2000, args.backends, args.seed, args.block_size)


if __name__ == "__main__":
    main()
