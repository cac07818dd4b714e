"""The working-set sweep of ``kvroute simulate --working-set 0.5,0.8,...``: its table and its plot.

Each run of the sweep is a :class:`~kvroute_simulator.results.Comparison` over the same
arrivals, on engines sized by :meth:`SimulationConfig.sized_for` so the reused prefixes fill
a given share of the fleet's KV blocks. The table and the plot set every strategy's hit rate
and TTFT against two references: the pooled LRU cache of the fleet's total capacity, and
the upper bound (an infinite cache), which does not depend on the capacity.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvroute_simulator.report import ms
from kvroute_simulator.results import Comparison

__all__ = ["POOLED", "UPPER_BOUND", "plot_sweep", "render_sweep"]

#: Row names of the references in the table.
POOLED = "pooled LRU (reference)"
UPPER_BOUND = "upper bound"


def render_sweep(comparisons: list[Comparison], title: str) -> Any:
    """Return a rich Table: a row per reference and per strategy, a column per working set.

    A strategy's cell is its hit rate, TTFT p50 and TTFT p90; a reference's, its hit rate.
    """
    from rich.table import Table

    caption = "per instance: " + ", ".join(
        f"{c.config.working_set:.0%} -> {c.config.engine.capacity_blocks:,} blocks" for c in comparisons
    )
    size = comparisons[0].config.engine.block_size
    table = Table(title=title, caption=f"{caption} (of {size} tokens)", caption_justify="left")
    table.add_column("strategy", no_wrap=True)
    for c in comparisons:
        table.add_column(f"working set {c.config.working_set:.0%}\nhit rate / TTFT p50 / p90", justify="right")
    table.add_row(POOLED, *(f"{c.pooled_hit_rate * 100:.1f}%" for c in comparisons))
    table.add_row(UPPER_BOUND, *(f"{c.upper_bound_hit_rate * 100:.1f}%" for c in comparisons), end_section=True)
    for k, result in enumerate(comparisons[0].results):
        cells = []
        for c in comparisons:
            r = c.results[k]
            cells.append(f"{r.hit_rate * 100:.1f}% / {ms(r.ttft_p50)} / {ms(r.ttft_p90)}")
        table.add_row(result.strategy, *cells)
    return table


def plot_sweep(comparisons: list[Comparison], path: Path, plt: Any) -> None:
    """Draw hit rate, TTFT p50 and TTFT p90 against the working set, with the references dashed."""
    xs = [(c.config.working_set or math.nan) * 100 for c in comparisons]
    fig, (ax_hit, ax_p50, ax_p90) = plt.subplots(1, 3, figsize=(18, 5.5))
    ax_hit.plot(xs, [c.pooled_hit_rate * 100 for c in comparisons], "k--", marker="o", label=POOLED)
    ax_hit.plot(xs, [c.upper_bound_hit_rate * 100 for c in comparisons], ":", color="grey", label=UPPER_BOUND)
    for k, result in enumerate(comparisons[0].results):
        runs = [c.results[k] for c in comparisons]
        ax_hit.plot(xs, [r.hit_rate * 100 for r in runs], marker="o", label=result.strategy)
        ax_p50.plot(xs, [r.ttft_p50 * 1000 for r in runs], marker="o", label=result.strategy)
        ax_p90.plot(xs, [r.ttft_p90 * 1000 for r in runs], marker="o", label=result.strategy)
    ax_hit.set(xlabel="working set (% of the fleet's KV blocks)", ylabel="hit rate (%)", title="Prefix-cache hit rate")
    ax_p50.set(xlabel="working set (% of the fleet's KV blocks)", ylabel="TTFT p50 (ms)", title="TTFT p50")
    ax_p90.set(xlabel="working set (% of the fleet's KV blocks)", ylabel="TTFT p90 (ms)", title="TTFT p90")
    from matplotlib.ticker import FuncFormatter

    milliseconds = FuncFormatter(lambda value, _pos: f"{value:,.0f}")
    for ax in (ax_p50, ax_p90):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(milliseconds)
        ax.yaxis.set_minor_formatter(milliseconds)
    for ax in (ax_hit, ax_p50, ax_p90):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    first = comparisons[0]
    fig.suptitle(
        f"kvroute simulate --working-set: {first.workload}, {first.requests} requests, "
        f"{first.config.instances} instances"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
