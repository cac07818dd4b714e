"""Agent traffic in the simulator: every prefix strategy against the hit-rate bound and a fair share.

For each workload (``agentic``, ``multi-turn-short``) and fleet size (4, 16 and 64 instances),
runs the prefix strategies through ``kvroute simulate``'s engine (`kvroute_simulator.compare`,
seeded) and prints one Markdown row per strategy: hit rate, the bound (one engine with an
infinite cache), hit rate over the bound, and the busiest and idlest instance's share of the
requests over a fair share (1 / instances). A row passes the issue's targets when the hit rate
is at least 97 % of the bound and the busiest instance takes at most 1.25x a fair share (and the
idlest at least 1 / 1.25).

The traffic grows with the fleet so that each instance sees the same load: the workload's own
rate and request count at 7 instances, scaled by ``instances / 7`` (``agentic``: 0.2 sessions
and 2,000 requests per 7 instances; ``multi-turn-short``: 2 conversations per second and 1,500
turns per 7 instances). Results in docs/performance.md ("Agent traffic in the simulator").

Run: ``python benchmarks/bench_agent_traffic.py`` (seed 0; about 25 minutes on 2 cores, most of
it the 64-instance rows); ``--instances 4,16`` or ``--workloads agentic`` for fewer rows,
``--strategies bounded-load`` for one strategy, ``-W KEY=VALUE`` for a workload option
(``-W session_ids=true``), ``--sessions`` for a router that keeps sessions (``kvroute simulate --sessions``),
``-o STRATEGY.KEY=VALUE`` for a strategy option (``-o tokenizer-prefix.cold_choices=2``,
``-o bounded-load.share_factor=off``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvroute.cli import configure_logging
from kvroute_simulator.driver import SimulationConfig, compare
from kvroute_simulator.workloads import make_workload

STRATEGIES = ("consistent-hash", "bounded-load", "bounded-cache", "tokenizer-prefix")
#: Per workload: (rate, requests) at 7 instances (the workloads' defaults).
PER_7 = {"agentic": (0.2, 2000), "multi-turn-short": (2.0, 1500)}
HIT_TARGET = 0.97
SHARE_TARGET = 1.25


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if ".." in text:
        lo, _, hi = text.partition("..")
        return (int(lo), int(hi))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(PER_7), help="comma-separated workloads")
    parser.add_argument("--instances", default="4,16,64", help="comma-separated fleet sizes")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-W", "--workload-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sessions", action="store_true", help="the router keeps sessions (kvroute.sessions)")
    parser.add_argument(
        "-o",
        "--strategy-option",
        action="append",
        default=[],
        metavar="STRATEGY.KEY=VALUE",
        help="a strategy option, as kvroute simulate's -o (tokenizer-prefix.cold_choices=2)",
    )
    args = parser.parse_args(argv)
    configure_logging("warning")
    extra = {k: _value(v) for k, _, v in (item.partition("=") for item in args.workload_option)}
    strategies = [s for s in args.strategies.split(",") if s]
    strategy_options: dict[str, dict[str, Any]] = {}
    for item in args.strategy_option:
        name, _, rest = item.partition(".")
        key, sep, value = rest.partition("=")
        if not (name and key and sep):
            parser.error(f"-o expects STRATEGY.KEY=VALUE (got {item!r})")
        strategy_options.setdefault(name, {})[key] = _value(value)
    print("| workload | instances | strategy | hit rate | bound | of the bound | busiest / idlest vs fair | targets |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for workload in args.workloads.split(","):
        rate, requests = PER_7[workload]
        for instances in (int(n) for n in args.instances.split(",")):
            options = {
                "rate": rate * instances / 7,
                "requests": round(requests * instances / 7),
                "seed": args.seed,
                **extra,
            }
            arrivals = list(make_workload(workload, **options).arrivals())
            started = time.perf_counter()
            config = SimulationConfig(instances=instances, seed=args.seed, sessions=args.sessions)
            comparison = compare(arrivals, strategies, config, options=strategy_options, workload=workload)
            bound = comparison.upper_bound_hit_rate
            for result in comparison.results:
                ratio = result.hit_rate / bound if bound else 0.0
                busiest, idlest = result.share_max * instances, result.share_min * instances
                ok = ratio >= HIT_TARGET and busiest <= SHARE_TARGET and idlest >= 1 / SHARE_TARGET
                failed += not ok
                print(
                    f"| {workload} | {instances} | {result.strategy} | {result.hit_rate:.1%} | {bound:.1%} "
                    f"| {ratio:.1%} | {busiest:.2f}x / {idlest:.2f}x | {'yes' if ok else 'no'} |",
                    flush=True,
                )
            print(
                f"<!-- {workload} {instances}: {len(arrivals)} requests, {time.perf_counter() - started:.0f} s -->",
                file=sys.stderr,
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
