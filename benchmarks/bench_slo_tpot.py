"""Where the SLO-aware choice's TPOT p99 comes from, in the simulator (a diagnostic, not a test).

Usage: python benchmarks/bench_slo_tpot.py [--requests 300] [--loads 1.2,1.5] [--trace FILE]
       [--strategy bounded-cache+slo] [-o slo_unmet=sink] [--baseline bounded-load]

Runs the baseline and the SLO-aware strategy at each load (objectives TTFT 500 ms, TPOT 50 ms, 7
instances, seed 0, the capacity measured as ``kvroute simulate --load`` does) and splits the requests
by whether their TTFT met the objective: TPOT p99 of each part, and per instance how many requests it
served, how many of them were late, and their TPOT p99. It records each finished request by wrapping
the simulator's private ``_Run._finish``, so it follows the simulator at this commit.
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import structlog

from kvroute.plugins import PluginManager
from kvroute_simulator import driver
from kvroute_simulator.load import measure_capacity, parse_slo, sized_for_load
from kvroute_simulator.simulation_config import SimulationConfig
from kvroute_simulator.workloads import make_workload

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

TTFT_S = 0.5


def p99_ms(values: Sequence[float | None]) -> float:
    ordered = sorted(v for v in values if v is not None)
    return ordered[int(0.99 * (len(ordered) - 1))] * 1000 if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--loads", default="1.2,1.5")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--strategy", default="bounded-cache+slo")
    parser.add_argument("--baseline", default="bounded-load")
    parser.add_argument("-o", "--option", action="append", default=["slo_unmet=sink"], metavar="KEY=VALUE")
    args = parser.parse_args()

    rows: list[tuple[str, float | None, float | None]] = []
    finish = driver._Run._finish

    def recording(self: Any, seq: Any, now: float) -> None:
        flight = self.flights[id(seq)]
        tpot = None
        if seq.first_token_time is not None and seq.generated > 1:
            tpot = (now - seq.first_token_time) / (seq.generated - 1)
        rows.append((flight.instance.backend.id, seq.ttft, tpot))
        finish(self, seq, now)

    driver._Run._finish = recording  # type: ignore[method-assign]
    if args.trace:
        workload = make_workload("trace", path=args.trace, requests=args.requests, seed=0)
    else:
        workload = make_workload("long-prefix", requests=args.requests, seed=0)
    arrivals = list(workload.arrivals())
    config = SimulationConfig(slo=parse_slo("ttft=500ms,tpot=50ms"))
    plugins = PluginManager()
    capacity = measure_capacity(arrivals, config, plugins)
    options = dict(item.split("=", 1) for item in args.option)
    for load in (float(x) for x in args.loads.split(",")):
        for name in (args.baseline, args.strategy):
            rows.clear()
            driver.simulate(
                arrivals,
                name,
                options if name == args.strategy else {},
                sized_for_load(config, arrivals, load, capacity),
                plugins=plugins,
            )
            on_time = [t for _, ttft, t in rows if ttft is not None and ttft <= TTFT_S]
            late = [t for _, ttft, t in rows if ttft is None or ttft > TTFT_S]
            print(
                f"{load} x {name}: TPOT p99 {p99_ms([t for *_, t in rows]):.0f} ms; TTFT met: {p99_ms(on_time):.0f} ms "
                f"(n={len(on_time)}); TTFT missed: {p99_ms(late):.0f} ms (n={len(late)})"
            )
            per: dict[str, list[tuple[float | None, float | None]]] = defaultdict(list)
            for backend, ttft, tpot in rows:
                per[backend].append((ttft, tpot))
            print(
                "    "
                + "  ".join(
                    f"{b}: {len(v)} served, {sum(1 for tt, _ in v if tt is None or tt > TTFT_S)} late, "
                    f"TPOT p99 {p99_ms([t for _, t in v]):.0f} ms"
                    for b, v in sorted(per.items())
                )
            )


if __name__ == "__main__":
    main()
