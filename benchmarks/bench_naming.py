"""Placement robust to backend naming: the same fleet under several naming patterns and seeds.

Hash placement depends on the backends' ids, so the same engines named ``e0..e6`` or by URL can give
a strategy different figures (issue 24: the default reached hit rate 0.844 with URL names and 0.722
with ``e0..e6`` on 7 engines whose caches held ~4.8 long prompts each). For each workload, seed and
naming pattern (`kvroute_simulator.SimulationConfig.backend_names`), this runs the strategies through
``kvroute simulate``'s engine and prints one Markdown row per (workload, strategy): the hit rate per
seed over the namings (worst-best), the worst over the best naming for the seed where they differ
most (the target: at least 0.97), and the busiest instance's share over a fair share (the worst run).

Workloads: ``tight-long-prefix`` (issue 24's shape: 24 prompts of 8,000 tokens, 300 requests at 6/s,
each engine's KV cache holding 4.8 prompts), ``long-prefix``, ``short-prefix`` and
``multi-turn-short`` at their defaults, 7 instances.

Run: ``python benchmarks/bench_naming.py`` (seeds 0,1,2, four namings; a few minutes on 2 cores);
``--seeds``, ``--namings``, ``--workloads``, ``--strategies``, ``-o STRATEGY.KEY=VALUE``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import attrs

from kvroute.cli import configure_logging
from kvroute_simulator.driver import SimulationConfig, compare
from kvroute_simulator.workloads import make_workload

NAMINGS = ("i{index}", "e{index}", "http://10.0.0.{index}:8000", "engine-{index}")
#: Tokens per KV block in the simulated engines, and the tight workload's prompt length.
BLOCK_SIZE = 16
PROMPT_TOKENS = 8000
WORKLOADS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (workload, workload options, engine options)
    "tight-long-prefix": (
        "long-prefix",
        {"groups": 24, "requests": 300, "rate": 6.0, "prefix_tokens": PROMPT_TOKENS},
        {"capacity_blocks": round(4.8 * PROMPT_TOKENS / BLOCK_SIZE)},
    ),
    "long-prefix": ("long-prefix", {}, {}),
    "short-prefix": ("short-prefix", {}, {}),
    "multi-turn-short": ("multi-turn-short", {}, {}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--strategies", default="bounded-load", help="comma-separated strategies")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--namings", default=",".join(NAMINGS), help="comma-separated patterns with {index}")
    parser.add_argument("--instances", type=int, default=7)
    parser.add_argument(
        "-o", "--strategy-option", action="append", default=[], metavar="STRATEGY.KEY=VALUE", help="a strategy option"
    )
    args = parser.parse_args(argv)
    configure_logging("warning")
    strategies = [s for s in args.strategies.split(",") if s]
    options: dict[str, dict[str, str]] = {}
    for item in args.strategy_option:
        name, _, rest = item.partition(".")
        option, _, value = rest.partition("=")
        options.setdefault(name, {})[option] = value
    seeds = [int(s) for s in args.seeds.split(",")]
    namings = [n for n in args.namings.split(",") if n]
    print(
        "| workload | strategy | hit rate per seed (worst-best over namings) "
        "| worst / best over namings (worst seed) | busiest vs fair (worst run) |"
    )
    print("|---|---|---|---|---|")
    for name in args.workloads.split(","):
        workload, workload_options, engine_options = WORKLOADS[name]
        hits: dict[str, dict[int, list[float]]] = {s: {seed: [] for seed in seeds} for s in strategies}
        busiest: dict[str, float] = dict.fromkeys(strategies, 0.0)
        for seed in seeds:
            arrivals = list(make_workload(workload, seed=seed, **workload_options).arrivals())
            for naming in namings:
                config = SimulationConfig(instances=args.instances, seed=seed, backend_names=naming)
                if engine_options:
                    config = attrs.evolve(config, engine=attrs.evolve(config.engine, **engine_options))
                for result in compare(arrivals, strategies, config, options=options, workload=workload).results:
                    hits[result.strategy][seed].append(result.hit_rate)
                    busiest[result.strategy] = max(busiest[result.strategy], result.share_max * args.instances)
        for strategy in strategies:
            per_seed = hits[strategy]
            worst = min(min(v) / max(v) for v in per_seed.values())
            cells = ", ".join(f"{min(v):.1%}-{max(v):.1%}" for v in per_seed.values())
            print(f"| {name} | {strategy} | {cells} | {worst:.3f} | {busiest[strategy]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
