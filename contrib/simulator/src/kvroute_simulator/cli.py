"""``kvroute simulate``: compare routing strategies on a simulated fleet, in virtual time."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import click

from kvroute.errors import KvrouteError
from kvroute.settings import option
from kvroute.validators import parse_key_values
from kvroute.warmup import SlowStart
from kvroute_simulator.driver import Comparison, SimulationConfig, base_strategy, compare, parse_scale
from kvroute_simulator.engine import EngineConfig
from kvroute_simulator.parallel import default_jobs
from kvroute_simulator.report import BASELINE, finite, plot_run, pyplot, render_joins, render_table, to_json
from kvroute_simulator.workloads import WORKLOADS, make_workload

__all__ = ["simulate"]

EXAMPLES = """
\b
Examples:
  kvroute simulate                                   the seed's scenario: 7 instances, long-prefix, every strategy
  kvroute simulate -s random,bounded-load --seed 3   two strategies, another seed
  kvroute simulate -w multi-turn --requests 3000     ShareGPT-like conversations
  kvroute simulate -W concurrency=64                 closed loop: 64 users instead of Poisson arrivals
  kvroute simulate --trace mooncake.jsonl -n 16      replay a Mooncake trace on 16 instances
  kvroute simulate --scale "120s:+1,240s:-2" --plot run.png
  kvroute simulate -o bounded-load.load_factor=1.5 --json results.json
  kvroute simulate -w short-prefix                   a shared prefix shorter than the default prefix_length
  kvroute simulate --working-set 0.5,0.8,1.0,1.5     hit rate and TTFT as the prefixes outgrow the KV memory
  kvroute simulate --scale 120s:+1 --prefill 64 --slow-start 30    a warm join
  kvroute simulate --working-set 0.5,1.0 --jobs 4   strategies and sweep points in 4 worker processes
  kvroute simulate --trace t.jsonl -n 1000 --ray auto   runs as tasks on a Ray cluster
  kvroute simulate --slo ttft=500ms,tpot=50ms -s bounded-load,bounded-load+slo   goodput, SLO-aware choice
  kvroute simulate --slo ttft=500ms,tpot=50ms --load 0.8,1.0,1.2,1.5 --plot goodput.png   goodput against load
"""


def _value(text: str) -> Any:
    """Parse a KEY=VALUE value: int, float, true/false, a range LO..HI, or the string itself."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if ".." in text:
        lo, _, hi = text.partition("..")
        try:
            return (int(lo), int(hi))
        except ValueError:
            return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _pairs(items: Sequence[str], option: str) -> list[tuple[str, str]]:
    return parse_key_values(
        items, lambda item: click.BadParameter(f"expected KEY=VALUE (got {item!r}).", param_hint=option)
    )


def _field_option(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The option of a `SimulationConfig` setting: flag, type, default and help from its field."""
    field = attrs.fields_dict(SimulationConfig)[name]
    return option(field, field.default, name, given=True)


@click.command("simulate", epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-w",
    "--workload",
    type=click.Choice(sorted(WORKLOADS)),
    default="long-prefix",
    show_default=True,
    help="Traffic to simulate (see docs/simulation.md).",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL trace to replay (Mooncake or simple format); implies --workload trace.",
)
@_field_option("instances")
@click.option(
    "-s",
    "--strategies",
    default=None,
    metavar="NAMES",
    help="Comma-separated strategies to compare [default: every installed strategy].",
)
@click.option("--requests", type=click.IntRange(min=1), default=None, help="Requests to simulate [workload's default].")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None, help="Seconds of arrivals.")
@click.option(
    "--rate", type=click.FloatRange(min=0, min_open=True), default=None, help="Arrivals (conversations) per second."
)
@_field_option("seed")
@click.option("--scale", default=None, metavar="EVENTS", help='Scale events, e.g. "300s:+1,600s:-2".')
@click.option(
    "-W", "--workload-option", multiple=True, metavar="KEY=VALUE", help="Workload option (repeatable), e.g. groups=100."
)
@click.option(
    "-o",
    "--strategy-option",
    multiple=True,
    metavar="STRATEGY.KEY=VALUE",
    help="Strategy option (repeatable), e.g. bounded-load.load_factor=1.5.",
)
@click.option(
    "-E", "--engine-option", multiple=True, metavar="KEY=VALUE", help="Engine setting, e.g. capacity_blocks=20000."
)
@click.option(
    "--working-set",
    "working_sets",
    default=None,
    metavar="RATIOS",
    help="Size each engine's KV cache so the reused prefixes fill this share of the fleet's blocks (0.8: 80 %); "
    "several, comma-separated, print a sweep, e.g. 0.5,0.8,1.0,1.5.",
)
@click.option(
    "--slow-start",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Warm join: an instance --scale adds ramps from 10 % of its weight to all of it over SECONDS.",
)
@click.option(
    "--slo",
    "slo_text",
    default=None,
    metavar="OBJECTIVES",
    help="Latency objectives of every request, e.g. ttft=500ms,tpot=50ms (bare numbers are ms): adds TPOT p99, "
    "goodput (requests/s meeting all) and SLO attainment; a strategy named NAME+slo routes on them, "
    "NAME+slo+shed also sheds what it predicts no instance can serve in time.",
)
@click.option(
    "--load",
    "loads_text",
    default=None,
    metavar="MULTIPLES",
    help="Sweep the offered load as multiples of the fleet's measured capacity, e.g. 0.5,0.8,1.0,1.2,1.5 "
    "(see docs/simulation.md for how the capacity is measured).",
)
@_field_option("prefill")
@_field_option("sessions")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Worker processes running strategies and sweep points in parallel; the results are the serial ones "
    "[default: the CPUs this process may use].",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Run strategies and sweep points as Ray tasks on the cluster at ADDRESS (auto: RAY_ADDRESS or the local "
    "`ray start`; local: a new Ray on this machine). Needs Ray; see docs/simulation.md.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG of the run.")
@click.option("--progress/--no-progress", default=None, help="Progress bar [default: when stderr is a terminal].")
@click.option("--log-level", default="warning", show_default=True, help="Log level (debug, info, warning, error).")
def simulate(
    workload: str,
    trace_path: Path | None,
    instances: int,
    strategies: str | None,
    requests: int | None,
    duration: float | None,
    rate: float | None,
    seed: int,
    scale: str | None,
    workload_option: Sequence[str],
    strategy_option: Sequence[str],
    engine_option: Sequence[str],
    working_sets: str | None,
    slow_start: float | None,
    slo_text: str | None,
    loads_text: str | None,
    prefill: int,
    sessions: bool,
    jobs: int | None,
    ray_address: str | None,
    json_path: Path | None,
    plot_path: Path | None,
    progress: bool | None,
    log_level: str,
) -> None:
    """Simulate a fleet in virtual time and compare routing strategies.

    Every request goes through the real router and the installed strategy plugins; each
    instance is a vLLM-like engine model (Llama-3.1-70B on 8 x H100 by default). Prints,
    per strategy, TTFT p50/p90/p99, prefix-cache hit rate, output throughput, the smallest
    and largest share of requests an instance got, spills and the routing cost, each
    against random, plus the hit rate's upper bound. A strategy named NAME+slo is NAME with
    the router's SLO-aware choice (kvroute.slo_choice).
    """
    from rich.console import Console

    from kvroute.cli import configure_logging
    from kvroute.plugins import PluginManager

    configure_logging(log_level)
    started = time.perf_counter()
    from kvroute_simulator.load import parse_loads, parse_slo

    slo = parse_slo(slo_text) if slo_text is not None else None
    loads = parse_loads(loads_text) if loads_text is not None else []
    if loads and working_sets is not None:
        raise click.BadParameter(
            "--load sweeps the offered load and --working-set the cache size; give one of them (got both).",
            param_hint="--load",
        )
    try:
        if trace_path is not None:
            workload = "trace"
        options: dict[str, Any] = {k: _value(v) for k, v in _pairs(workload_option, "--workload-option")}
        if "working_set" in options:
            raise click.BadParameter(
                f"the working set sizes the engines, for any workload: use --working-set {options['working_set']} "
                "(several values, comma-separated, print a sweep).",
                param_hint="--workload-option",
            )
        if workload == "trace":
            if trace_path is None and "path" not in options:
                raise click.BadParameter("the trace workload needs --trace FILE.", param_hint="--trace")
            if trace_path is not None:
                options["path"] = trace_path
        for key, value in (("requests", requests), ("duration", duration), ("rate", rate)):
            if value is not None:
                options[key] = value
        if duration is not None and requests is None and workload != "trace":
            options.setdefault("requests", None)
        options.setdefault("seed", seed)
        wl = make_workload(workload, **options)

        per_strategy: dict[str, dict[str, Any]] = {}
        for key, raw in _pairs(strategy_option, "--strategy-option"):
            name, dot, opt = key.partition(".")
            if not dot or not opt:
                raise click.BadParameter(f"expected STRATEGY.KEY=VALUE (got {key!r}).", param_hint="--strategy-option")
            per_strategy.setdefault(name.replace("_", "-"), {})[opt] = raw
        engine_kwargs = {k: _value(v) for k, v in _pairs(engine_option, "--engine-option")}
        try:
            engine = EngineConfig(**engine_kwargs)
        except (TypeError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--engine-option") from None
        config = SimulationConfig(
            instances=instances,
            engine=engine,
            scale=parse_scale(scale) if scale else (),
            seed=seed,
            slow_start=SlowStart(slow_start) if slow_start is not None else None,
            prefill=prefill,
            sessions=sessions,
            slo=slo,
        )
        ratios = _ratios(working_sets)
        if ratios and "capacity_blocks" in engine_kwargs:
            raise click.BadParameter(
                "--working-set sets the engines' capacity_blocks; give one or the other (got both).",
                param_hint="--working-set",
            )

        plugins = PluginManager()
        installed = sorted(plugins.strategies)
        names = [s.strip() for s in strategies.split(",") if s.strip()] if strategies else installed
        if strategies is None and BASELINE in names:
            names.remove(BASELINE)
            names.insert(0, BASELINE)
        if not installed:
            raise click.ClickException(
                "no strategy plugin is installed, so there is nothing to compare. Install some, e.g. "
                'pip install "kvroute[random,bounded-load]" (or "kvroute[all]").'
            )
        unknown = [n for n in names if base_strategy(n) not in plugins.strategies]
        if unknown:
            raise click.BadParameter(
                f"unknown strategy {', '.join(map(repr, unknown))} (installed: {', '.join(installed)}); "
                f'others install as pip install "kvroute[NAME]".',
                param_hint="--strategies",
            )
        for name in per_strategy:
            if name not in names:
                raise click.BadParameter(
                    f"options given for {name!r}, which does not run.", param_hint="--strategy-option"
                )

        arrivals = list(wl.arrivals())
        if not arrivals:
            raise click.ClickException("the workload produced no request; raise --requests or --duration.")
        show_progress = sys.stderr.isatty() if progress is None else progress
        requests_ = [a.engine_request() for a in arrivals]
        configs = [config.sized_for(requests_, ratio) for ratio in ratios] or [config]
        if loads:
            from kvroute_simulator.load import CAPACITY_STRATEGY, measure_capacity, sized_for_load

            reference = CAPACITY_STRATEGY if CAPACITY_STRATEGY in installed else base_strategy(names[0])
            capacity = measure_capacity(arrivals, config, plugins, reference)
            configs = [sized_for_load(config, arrivals, load, capacity) for load in loads]
        if ray_address is not None and not ray_address.strip():
            raise click.BadParameter("expected a Ray address, auto or local (got an empty string).", param_hint="--ray")
        jobs = default_jobs() if jobs is None else jobs
        if ray_address is None and (jobs == 1 or len(configs) * len(names) == 1):
            comparisons = [_run(arrivals, names, c, per_strategy, workload, plugins, show_progress) for c in configs]
        else:
            comparisons = _run_parallel(
                arrivals, names, configs, per_strategy, workload, jobs, ray_address, show_progress
            )
    except KvrouteError as exc:
        raise click.ClickException(str(exc)) from None

    if loads:
        from kvroute_simulator.load import plot_load_sweep, render_load_sweep

        _print_sweep(
            comparisons,
            "load",
            render_load_sweep,
            plot_load_sweep,
            workload=workload,
            workload_options={},
            seed=seed,
            json_path=json_path,
            plot_path=plot_path,
            started=started,
            width=220,
            head={"capacity": comparisons[0].config.capacity},
        )
        return
    if len(comparisons) > 1:
        shown = {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}
        from kvroute_simulator.sweep import plot_sweep, render_sweep

        _print_sweep(
            comparisons,
            "working-set",
            render_sweep,
            plot_sweep,
            workload=workload,
            workload_options=shown,
            seed=seed,
            json_path=json_path,
            plot_path=plot_path,
            started=started,
        )
        return
    comparison = comparisons[0]
    wall = time.perf_counter() - started
    title = (
        f"kvroute simulate: {workload}, {len(arrivals):,} requests, {instances} instances, seed {seed} ({wall:.1f} s)"
    )
    console = Console()
    if not console.is_terminal:  # a file or a pipe: do not squeeze the table into 80 columns
        console = Console(width=180)
    console.print(render_table(comparison, title))
    if any(r.joins for r in comparison.results):
        console.print(render_joins(comparison))
    if json_path is not None:
        shown = {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}
        data = finite(to_json(comparison, workload_options=shown, seed=seed, wall=wall))
        json_path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if plot_path is not None:
        plot_run(comparison, plot_path)


def _ratios(text: str | None) -> list[float]:
    """Parse --working-set: comma-separated positive numbers (none when not given)."""
    if text is None:
        return []
    ratios = []
    for item in (part.strip() for part in text.split(",")):
        try:
            ratio = float(item)
        except ValueError:
            ratio = math.nan
        if not (math.isfinite(ratio) and ratio > 0):
            raise click.BadParameter(
                f"expected positive numbers separated by commas, e.g. 0.5,0.8,1.0,1.5 (got {item!r}).",
                param_hint="--working-set",
            )
        ratios.append(ratio)
    return ratios


def _print_sweep(
    comparisons: list[Comparison],
    kind: str,
    render: Callable[[list[Comparison], str], Any],
    plot: Callable[[list[Comparison], Path, Any], None],
    *,
    workload: str,
    workload_options: Mapping[str, Any],
    seed: int,
    json_path: Path | None,
    plot_path: Path | None,
    started: float,
    width: int = 180,
    head: Mapping[str, Any] | None = None,
) -> None:
    """Print a sweep's table (``kind``: ``working-set``, ``load``) with ``render``; write its JSON; ``plot`` it.

    The JSON is ``{**head, "sweep": [one run's JSON per point of the sweep]}``; ``width`` is the table's
    width when the output is not a terminal.
    """
    from rich.console import Console

    wall = time.perf_counter() - started
    first = comparisons[0]
    title = (
        f"kvroute simulate: {kind} sweep, {workload}, {first.requests:,} requests, "
        f"{first.config.instances} instances, seed {seed} ({wall:.1f} s)"
    )
    console = Console()
    if not console.is_terminal:  # a file or a pipe: do not squeeze the table into 80 columns
        console = Console(width=width)
    console.print(render(comparisons, title))
    if json_path is not None:
        runs = [to_json(c, workload_options=workload_options, seed=seed, wall=wall) for c in comparisons]
        data = finite({**(head or {}), "sweep": runs})
        json_path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if plot_path is not None:
        plot(comparisons, plot_path, pyplot())


def _run_parallel(
    arrivals: list[Any],
    names: list[str],
    configs: list[SimulationConfig],
    per_strategy: Mapping[str, Mapping[str, Any]],
    workload: str,
    jobs: int,
    ray_address: str | None,
    show_progress: bool,
) -> list[Comparison]:
    """Every strategy on every configuration in worker processes or Ray tasks (kvroute_simulator.parallel)."""
    from kvroute_simulator.parallel import run_comparisons

    def run(progress: Callable[[int], None] | None) -> list[Comparison]:
        return run_comparisons(
            arrivals, names, configs, per_strategy, workload, jobs=jobs, ray_address=ray_address, progress=progress
        )

    if not show_progress:
        return run(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task("simulate", total=len(arrivals) * len(names) * len(configs))
        return run(lambda n: bar.advance(task, n))


def _run(
    arrivals: list[Any],
    names: list[str],
    config: SimulationConfig,
    per_strategy: Mapping[str, Mapping[str, Any]],
    workload: str,
    plugins: Any,
    show_progress: bool,
) -> Comparison:
    if not show_progress:
        return compare(arrivals, names, config, options=per_strategy, workload=workload, plugins=plugins)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task("simulate", total=len(arrivals) * len(names))
        advance: Callable[[int], None] = lambda n: bar.advance(task, n)  # noqa: E731
        return compare(
            arrivals, names, config, options=per_strategy, workload=workload, plugins=plugins, progress=advance
        )
