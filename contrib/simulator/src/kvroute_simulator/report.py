"""What ``kvroute simulate`` prints and writes: the result table, the join table, the JSON and the plot of a run.

The working-set sweep's own table and plot are in :mod:`~kvroute_simulator.sweep`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from kvroute.slo import Objectives
from kvroute_simulator.results import Comparison, StrategyResult

__all__ = ["BASELINE", "describe_slo", "finite", "ms", "plot_run", "pyplot", "render_joins", "render_table", "to_json"]

#: The strategy every figure is compared with.
BASELINE = "random"


def _percent_change(value: float, base: float) -> str:
    if not (math.isfinite(value) and math.isfinite(base)) or base == 0:
        return ""
    return f" ({(value - base) / base * 100:+.0f}%)"


def describe_slo(slo: Objectives) -> str:
    """``TTFT <= 500 ms, TPOT <= 50 ms``."""
    parts = []
    if slo.ttft_s is not None:
        parts.append(f"TTFT <= {slo.ttft_s * 1000:g} ms")
    if slo.tpot_s is not None:
        parts.append(f"TPOT <= {slo.tpot_s * 1000:g} ms")
    return ", ".join(parts)


def ms(seconds: float) -> str:
    """A duration in seconds, written in milliseconds ("-" when there was no sample)."""
    return "-" if not math.isfinite(seconds) else f"{seconds * 1000:,.0f} ms"


def _us(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e6:,.0f} µs"


def render_table(comparison: Comparison, title: str) -> Any:
    """Return a rich Table: one row per strategy, each figure with its change against random."""
    from rich.table import Table

    base = comparison.baseline(BASELINE)
    table = Table(title=title, caption=_caption(comparison), caption_justify="left")
    for header in (
        "strategy",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "hit rate",
        "output tok/s",
        "share min / max",
        "spills",
        "routing p50 / p99",
    ):
        table.add_column(header, justify="left" if header == "strategy" else "right", no_wrap=True)
    slo = comparison.config.slo
    if slo is not None:
        for header in ("TPOT p99", "goodput req/s", "SLO attained"):
            table.add_column(header, justify="right", no_wrap=True)
    for r in comparison.results:

        def vs(value: float, attr: str, r: StrategyResult = r) -> str:
            return "" if base is None or r is base else _percent_change(value, getattr(base, attr))

        hit_change = "" if base is None or r is base else f" ({(r.hit_rate - base.hit_rate) * 100:+.1f} pt)"
        extra = []
        if slo is not None:
            extra = [
                ms(r.tpot_p99),
                f"{r.goodput:,.2f}" + vs(r.goodput, "goodput"),
                f"{r.attainment * 100:.1f}%" if math.isfinite(r.attainment) else "-",
            ]
        table.add_row(
            r.strategy,
            ms(r.ttft_p50) + vs(r.ttft_p50, "ttft_p50"),
            ms(r.ttft_p90) + vs(r.ttft_p90, "ttft_p90"),
            ms(r.ttft_p99) + vs(r.ttft_p99, "ttft_p99"),
            f"{r.hit_rate * 100:.1f}%{hit_change}",
            f"{r.output_throughput:,.0f}" + vs(r.output_throughput, "output_throughput"),
            f"{r.share_min * 100:.1f}% / {r.share_max * 100:.1f}%",
            str(r.spills),
            f"{_us(r.route_cost_p50)} / {_us(r.route_cost_p99)}",
            *extra,
        )
    return table


def render_joins(comparison: Comparison) -> Any:
    """Return a rich Table of each join: the TTFT of the requests that moved to the new instance, and of the others."""
    from rich.table import Table

    config = comparison.config
    warm = []
    if config.prefill:
        warm.append(f"pre-fill of the {config.prefill} hottest prefixes, {config.prefill_concurrency} at a time")
    if config.slow_start is not None:
        warm.append(f"slow start over {config.slow_start.period:g} s")
    table = Table(
        title=f"the {config.join_window:g} s after each join ({', '.join(warm) or 'cold join'})",
        caption="moved: the requests whose home is the new instance (a dry run on the fleet after the join)",
        caption_justify="left",
    )
    for header in ("strategy", "join", "requests", "moved", "moved TTFT p50 / p90", "others p90", "all p90 / mean"):
        table.add_column(header, justify="left" if header in ("strategy", "join") else "right", no_wrap=True)
    for r in comparison.results:
        for j in r.joins:
            warmed = f", {j.warm_requests} warm-up, serving at {j.serving_from:.1f} s" if j.warm_requests else ""
            table.add_row(
                r.strategy,
                f"{j.backend} at {j.time:g} s{warmed}",
                f"{j.window_requests:,}",
                f"{j.moved:,}",
                f"{ms(j.moved_ttft_p50)} / {ms(j.moved_ttft_p90)}",
                ms(j.others_ttft_p90),
                f"{ms(j.all_ttft_p90)} / {ms(j.all_ttft_mean)}",
            )
    return table


def _caption(comparison: Comparison) -> str:
    fair = 100 / comparison.config.instances
    lines = [
        f"upper bound hit rate (one instance with an infinite cache serving every request): "
        f"{comparison.upper_bound_hit_rate * 100:.1f}%",
        f"changes are against {BASELINE}; a fair share is {fair:.1f}% per instance; "
        "routing cost is wall clock per pick",
    ]
    if comparison.baseline(BASELINE) is None:
        lines[1] = f"{BASELINE} did not run: no changes shown; a fair share is {fair:.1f}% per instance"
    config = comparison.config
    if config.slo is not None:
        lines.append(
            f"objectives: {describe_slo(config.slo)}; goodput counts the requests meeting every one, per second"
        )
    if config.working_set is not None or comparison.pooled_hit_rate < comparison.upper_bound_hit_rate - 1e-12:
        sized = "" if config.working_set is None else f", sized for a working set of {config.working_set:.0%}"
        lines.insert(
            1,
            f"pooled LRU reference (one cache of the fleet's {config.fleet_blocks:,} KV blocks{sized}): "
            f"{comparison.pooled_hit_rate * 100:.1f}%",
        )
    return "\n".join([*lines, *_rejection_lines(comparison)])


def _rejection_lines(comparison: Comparison) -> list[str]:
    """Say how many requests were refused and why, one line per reason (nothing when none was)."""
    results = comparison.results
    if not comparison.rejected and not any(r.rejected for r in results):
        return []
    head = (
        f"of {comparison.requests:,} requests, answered with an error as vLLM's HTTP 400 "
        "(hit rates, shares and the bound leave them out)"
    )
    if all(dict(r.rejected_reasons) == dict(comparison.rejected_reasons) for r in results):
        lines = [f"rejected: {comparison.rejected:,} {head}:"]
        lines += [f"  {count:,}: {reason}" for reason, count in comparison.rejected_reasons.items()]
        return lines
    lines = [f"rejected per strategy, {head}:"]
    for r in results:
        reasons = "; ".join(f"{count:,} {reason}" for reason, count in r.rejected_reasons.items())
        lines.append(f"  {r.strategy}: {r.rejected:,}" + (f" ({reasons})" if reasons else ""))
    return lines


def to_json(comparison: Comparison, *, workload_options: Mapping[str, Any], seed: int, wall: float) -> dict[str, Any]:
    """The machine-readable results: the scenario, the upper bound, and every strategy's figures."""
    base = comparison.baseline(BASELINE)
    strategies = []
    for r in comparison.results:
        data = r.to_json()
        if base is not None and r is not base:
            data["vs_baseline"] = {
                "ttft_p50": (r.ttft_p50 - base.ttft_p50) / base.ttft_p50 if base.ttft_p50 else None,
                "ttft_p90": (r.ttft_p90 - base.ttft_p90) / base.ttft_p90 if base.ttft_p90 else None,
                "ttft_p99": (r.ttft_p99 - base.ttft_p99) / base.ttft_p99 if base.ttft_p99 else None,
                "hit_rate_points": r.hit_rate - base.hit_rate,
                "output_throughput": (r.output_throughput - base.output_throughput) / base.output_throughput
                if base.output_throughput
                else None,
            }
        else:
            data["vs_baseline"] = None
        strategies.append(data)
    config = comparison.config
    return {
        "workload": comparison.workload,
        "workload_options": {k: list(v) if isinstance(v, tuple) else v for k, v in workload_options.items()},
        "seed": seed,
        "instances": config.instances,
        "engine": {
            "block_size": config.engine.block_size,
            "capacity_blocks": config.engine.capacity_blocks,
            "max_num_batched_tokens": config.engine.max_num_batched_tokens,
            "max_num_seqs": config.engine.max_num_seqs,
        },
        "scale": [{"time": e.time, "delta": e.delta} for e in comparison.scale],
        "requests": comparison.requests,
        "rejected": comparison.rejected,
        "rejected_reasons": dict(comparison.rejected_reasons),
        "prompt_tokens": comparison.prompt_tokens,
        "upper_bound_hit_rate": comparison.upper_bound_hit_rate,
        "pooled_hit_rate": comparison.pooled_hit_rate,
        "working_set": config.working_set,
        "slo": None if config.slo is None else {"ttft_s": config.slo.ttft_s, "tpot_s": config.slo.tpot_s},
        "load": config.load,
        "capacity": config.capacity,
        "warm_join": {
            "slow_start": None if config.slow_start is None else config.slow_start.period,
            "prefill": config.prefill,
            "prefill_concurrency": config.prefill_concurrency,
            "join_window": config.join_window,
        },
        "baseline": BASELINE if base is not None else None,
        "strategies": strategies,
        "wall_time": wall,
    }


def plot_run(comparison: Comparison, path: Path) -> None:
    """Draw the TTFT CDF per strategy, the hit rate over time with scale events marked, and each instance's share."""
    plt = pyplot()
    fig, (ax_cdf, ax_hit, ax_load) = plt.subplots(1, 3, figsize=(18, 5.5))
    for r in comparison.results:
        ttfts = sorted(r.ttfts)
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax_cdf.plot([t * 1000 for t in ttfts], ys, label=r.strategy)
        points = [(t, h * 100) for t, h, _ in r.timeline if math.isfinite(h)]
        if points:
            ax_hit.plot([t for t, _ in points], [h for _, h in points], label=r.strategy)
    ax_cdf.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax_hit.set(xlabel="time (s)", ylabel="hit rate in window (%)", title="Prefix-cache hit rate over time")
    for event in comparison.scale:
        ax_hit.axvline(event.time, color="grey", linestyle="--")
        ax_hit.annotate(f"{event.delta:+d}", (event.time, 2), color="grey")
    ids = [i.id for i in comparison.results[0].instances] if comparison.results else []
    width = 0.8 / max(1, len(comparison.results))
    for k, r in enumerate(comparison.results):
        shares = {i.id: i.share * 100 for i in r.instances}
        ax_load.bar([x + k * width for x in range(len(ids))], [shares.get(i, 0) for i in ids], width, label=r.strategy)
    ax_load.set_xticks([x + 0.4 - width / 2 for x in range(len(ids))], ids)
    ax_load.set(xlabel="instance", ylabel="share of requests (%)", title="Per-instance load")
    top = max((i.share * 100 for r in comparison.results for i in r.instances), default=1.0)
    ax_load.set_ylim(0, top * 1.35)
    for ax in (ax_cdf, ax_hit, ax_load):
        ax.grid(alpha=0.3)
    ax_cdf.legend(fontsize="small", loc="lower right")
    ax_hit.legend(fontsize="small", loc="lower right")
    ax_load.legend(fontsize="small", loc="upper center", ncol=3)
    fig.suptitle(f"kvroute simulate: {comparison.workload}, {comparison.requests} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot() -> Any:
    """Return matplotlib.pyplot on the Agg backend, or say how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException(
            '--plot needs matplotlib, which is not installed: pip install "kvroute[plot]"'
        ) from None
    return plt


def finite(value: Any) -> Any:
    """Replace NaN and infinities (no sample) with None, so the JSON is standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
