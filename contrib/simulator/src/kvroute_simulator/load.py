"""Goodput under latency objectives: ``kvroute simulate --slo ... --load ...``.

``--slo ttft=500ms,tpot=50ms`` gives every request those objectives (`kvroute.slo.Objectives`):
each strategy's table row gains its TPOT p99, its goodput (requests per second of the makespan
that met every objective) and its SLO attainment (the share of all requests that did).

``--load 0.8,1.0,1.2`` sweeps the offered load as a multiple of the fleet's *measured capacity*,
found first (:func:`measure_capacity`): the workload's requests all arrive at once (their
arrival times multiplied by 0) on the same fleet, routed by ``least-outstanding`` (cache-blind and
balanced, so the figure does not favour a prefix strategy), and the capacity is the requests
completed over the makespan, the throughput of a fleet that is never idle. Each load ``L`` then
replays the workload with its arrival times scaled so the mean arrival rate is ``L x capacity``
(`SimulationConfig.time_scale`); a conversation's think times are not scaled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import click

from kvroute.errors import ConfigError
from kvroute.plugins import PluginManager
from kvroute.slo import Objectives
from kvroute_simulator.arrivals import Arrival
from kvroute_simulator.driver import simulate
from kvroute_simulator.report import describe_slo, ms
from kvroute_simulator.results import Comparison
from kvroute_simulator.simulation_config import SimulationConfig

__all__ = [
    "CAPACITY_STRATEGY",
    "arrival_rate",
    "measure_capacity",
    "parse_loads",
    "parse_slo",
    "plot_load_sweep",
    "render_load_sweep",
    "sized_for_load",
]

#: The strategy the capacity is measured with (see the module docstring).
CAPACITY_STRATEGY = "least-outstanding"

_DURATION = re.compile(r"^\s*(?P<value>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>ms|s)?\s*$")
_SLO_HELP = "KEY=DURATION pairs, KEY ttft or tpot, DURATION a positive number of ms or s (e.g. ttft=500ms,tpot=50ms)"


def parse_slo(text: str) -> Objectives:
    """Parse ``ttft=500ms,tpot=50ms`` (a bare number is milliseconds) into objectives; `click.BadParameter` if not."""
    values: dict[str, float] = {}
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise click.BadParameter(f"expected {_SLO_HELP} (got {text!r}).", param_hint="--slo")
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        match = _DURATION.match(raw) if eq else None
        if key not in ("ttft", "tpot") or match is None:
            raise click.BadParameter(f"expected {_SLO_HELP} (got {item!r}).", param_hint="--slo")
        seconds = float(match["value"]) / (1.0 if match["unit"] == "s" else 1000.0)
        if not (math.isfinite(seconds) and 0 < seconds <= 3600):
            raise click.BadParameter(f"expected {key} between 1 ms and 1 h (got {item!r}).", param_hint="--slo")
        if key in values:
            raise click.BadParameter(f"expected {key} once (got it twice in {text!r}).", param_hint="--slo")
        values[key] = seconds
    return Objectives(ttft_s=values.get("ttft"), tpot_s=values.get("tpot"))


def parse_loads(text: str) -> list[float]:
    """Parse ``--load``: comma-separated positive multiples of the capacity; `click.BadParameter` if not."""
    loads = []
    for item in (part.strip() for part in text.split(",")):
        try:
            load = float(item)
        except ValueError:
            load = math.nan
        if not (math.isfinite(load) and 0 < load <= 100):
            raise click.BadParameter(
                f"expected multiples of the fleet's capacity, positive numbers up to 100 separated by commas, "
                f"e.g. 0.5,0.8,1.0,1.2,1.5 (got {item!r}).",
                param_hint="--load",
            )
        loads.append(load)
    return loads


def arrival_rate(arrivals: Sequence[Arrival]) -> float:
    """The workload's mean arrival rate (requests per second between its first and last arrival); 0 if all at once."""
    if len(arrivals) < 2:
        return 0.0
    span = arrivals[-1].time - arrivals[0].time
    return (len(arrivals) - 1) / span if span > 0 else 0.0


def measure_capacity(
    arrivals: Sequence[Arrival], config: SimulationConfig, plugins: PluginManager, strategy: str = CAPACITY_STRATEGY
) -> float:
    """Requests per second the fleet completes when every request arrives at once (see the module docstring)."""
    saturated = attrs.evolve(config, time_scale=0.0, slo=None, load=None, capacity=None)
    result = simulate(arrivals, strategy, None, saturated, plugins=plugins)
    if result.completed == 0 or result.makespan <= 0:
        raise ConfigError("could not measure the fleet's capacity: no request completed when they arrived at once.")
    return result.completed / result.makespan


def sized_for_load(
    config: SimulationConfig, arrivals: Sequence[Arrival], load: float, capacity: float
) -> SimulationConfig:
    """``config`` with arrival times scaled so the mean arrival rate is ``load x capacity``."""
    rate = arrival_rate(arrivals)
    if rate <= 0:
        raise ConfigError(
            "'load' scales arrival times, and this workload's requests all arrive at once (a closed loop); "
            "use an open workload (no concurrency option) or a trace."
        )
    return attrs.evolve(config, time_scale=rate / (load * capacity), load=load, capacity=capacity)


def render_load_sweep(comparisons: list[Comparison], title: str) -> Any:
    """A rich Table: a row per strategy, a column per load; each cell goodput, attainment, TTFT p99, TPOT p99."""
    from rich.table import Table

    first = comparisons[0].config
    slo = first.slo
    caption = [
        f"load: offered requests/s over the measured capacity, {first.capacity or math.nan:.2f} requests/s "
        f"(every request at once, routed by {CAPACITY_STRATEGY})",
        f"cells: goodput req/s / SLO attained / TTFT p99 / TPOT p99{'' if slo is None else '; ' + describe_slo(slo)}",
    ]
    table = Table(title=title, caption="\n".join(caption), caption_justify="left")
    table.add_column("strategy", no_wrap=True)
    for c in comparisons:
        rate = (c.config.load or math.nan) * (c.config.capacity or math.nan)
        table.add_column(f"load {c.config.load:g}x\n({rate:.2f} req/s)", justify="right")
    for k, result in enumerate(comparisons[0].results):
        cells = []
        for c in comparisons:
            r = c.results[k]
            attained = f"{r.attainment * 100:.0f}%" if math.isfinite(r.attainment) else "-"
            goodput = f"{r.goodput:.2f}" if math.isfinite(r.goodput) else "-"
            cells.append(f"{goodput} / {attained} / {ms(r.ttft_p99)} / {ms(r.tpot_p99)}")
        table.add_row(result.strategy, *cells)
    return table


def plot_load_sweep(comparisons: list[Comparison], path: Path, plt: Any) -> None:
    """Draw goodput and TTFT p99 against the offered load, a line per strategy."""
    xs = [c.config.load or math.nan for c in comparisons]
    fig, (ax_good, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5.5))
    for k, result in enumerate(comparisons[0].results):
        runs = [c.results[k] for c in comparisons]
        ax_good.plot(xs, [r.goodput for r in runs], marker="o", label=result.strategy)
        ax_ttft.plot(xs, [r.ttft_p99 * 1000 for r in runs], marker="o", label=result.strategy)
    slo = comparisons[0].config.slo
    ax_good.set(
        xlabel="offered load (x measured capacity)",
        ylabel="goodput (requests/s meeting the objectives)",
        title=f"Goodput ({describe_slo(slo)})" if slo is not None else "Goodput",
    )
    ax_ttft.set(xlabel="offered load (x measured capacity)", ylabel="TTFT p99 (ms)", title="TTFT p99")
    ax_ttft.set_yscale("log")
    if slo is not None and slo.ttft_s is not None:
        ax_ttft.axhline(slo.ttft_s * 1000, color="grey", linestyle="--", label="TTFT objective")
    for ax in (ax_good, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    first = comparisons[0]
    fig.suptitle(
        f"kvroute simulate --load: {first.workload}, {first.requests} requests, {first.config.instances} instances"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
