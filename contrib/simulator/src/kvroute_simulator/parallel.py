"""Run ``kvroute simulate``'s runs in parallel: worker processes (``--jobs N``) or Ray tasks (``--ray ADDRESS``).

One *run* is one strategy on one fleet configuration (one point of a ``--working-set`` sweep). Runs
share nothing: each builds its own router, strategy and engines from the same arrivals, and the
simulation is in virtual time and seeded, so a run's result does not depend on where or when it
runs. The parent computes each configuration's references (upper bound, pooled LRU, refusals) and
assembles the comparisons in the serial order, so the output is the serial one (the measured
``wall_time`` of each run aside).

The arrivals travel once per worker (the process pool's initializer; one object in Ray's store),
not once per run. Nothing is printed until every run has come back: a worker or a cluster that
fails mid-way fails the command with no partial table or JSON.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import attrs

from kvroute.errors import KvrouteError
from kvroute_simulator.driver import compare, simulate
from kvroute_simulator.results import Comparison, StrategyResult
from kvroute_simulator.simulation_config import SimulationConfig
from kvroute_simulator.workloads import Arrival

__all__ = ["ClusterGone", "Run", "default_jobs", "run_comparisons"]


class ClusterGone(KvrouteError):
    """The worker processes or the Ray cluster went away before every run came back."""


@attrs.frozen
class Run:
    """One strategy on one fleet configuration (``config_index`` into the sweep's configurations)."""

    config_index: int
    strategy: str
    options: Mapping[str, Any] | None


def default_jobs() -> int:
    """``--jobs``' default: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# -- one run, wherever it runs ----------------------------------------------------------------------

_ARRIVALS: Sequence[Arrival] = ()
_CONFIGS: Sequence[SimulationConfig] = ()


def _init_worker(arrivals: Sequence[Arrival], configs: Sequence[SimulationConfig]) -> None:
    """Process-pool initializer: keep the arrivals and configurations for every run of this worker."""
    global _ARRIVALS, _CONFIGS
    _ARRIVALS, _CONFIGS = arrivals, configs


def _run_here(run: Run) -> StrategyResult:
    """A run in a pool worker, on the arrivals its initializer received."""
    return simulate(_ARRIVALS, run.strategy, run.options, _CONFIGS[run.config_index])


def _run_with(arrivals: Sequence[Arrival], configs: Sequence[SimulationConfig], run: Run) -> StrategyResult:
    """A run as a Ray task (Ray resolves ``arrivals`` from its object store)."""
    return simulate(arrivals, run.strategy, run.options, configs[run.config_index])


# -- all runs --------------------------------------------------------------------------------------


def run_comparisons(
    arrivals: Sequence[Arrival],
    names: Sequence[str],
    configs: Sequence[SimulationConfig],
    per_strategy: Mapping[str, Mapping[str, Any]],
    workload: str,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
    progress: Callable[[int], None] | None = None,
    serial: Callable[[SimulationConfig], Comparison] | None = None,
) -> list[Comparison]:
    """One `Comparison` per configuration, every strategy of ``names`` in each, as `compare` gives them.

    ``jobs`` worker processes (1: in this process, through ``serial`` when given) or, with
    ``ray_address``, Ray tasks on that cluster (``auto``: the one ``RAY_ADDRESS`` or a local
    ``ray start`` names; ``local``: a new one on this machine). ``progress`` is called with the
    requests of each run that completes (runs in this process report each request).
    """
    runs = [Run(i, name, per_strategy.get(name)) for i in range(len(configs)) for name in names]
    if ray_address is None and (jobs <= 1 or len(runs) <= 1):
        if serial is not None:
            return [serial(config) for config in configs]
        return [
            compare(arrivals, names, c, options=per_strategy, workload=workload, progress=progress) for c in configs
        ]
    references: list[Comparison] = []

    def meanwhile() -> None:
        """While the runs run: each configuration's upper bound, pooled LRU and refusals, here."""
        references.extend(compare(arrivals, (), config, workload=workload) for config in configs)

    if ray_address is not None:
        results = _on_ray(arrivals, configs, runs, ray_address, progress, meanwhile)
    else:
        results = _in_processes(arrivals, configs, runs, jobs, progress, meanwhile)
    comparisons = []
    for i, reference in enumerate(references):
        mine = tuple(r for run, r in zip(runs, results, strict=True) if run.config_index == i)
        comparisons.append(attrs.evolve(reference, results=mine))
    return comparisons


def _in_processes(
    arrivals: Sequence[Arrival],
    configs: Sequence[SimulationConfig],
    runs: Sequence[Run],
    jobs: int,
    progress: Callable[[int], None] | None,
    meanwhile: Callable[[], None],
) -> list[StrategyResult]:
    workers = min(jobs, len(runs))
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(list(arrivals), list(configs))) as pool:
        futures: list[Future[StrategyResult]] = [pool.submit(_run_here, run) for run in runs]
        pending = set(futures)
        try:
            meanwhile()
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()  # a run that raised raises here, before anything is shown
                    if progress is not None:
                        progress(len(arrivals))
        except BrokenProcessPool as exc:
            for future in pending:
                future.cancel()
            finished = len(futures) - len(pending)
            raise ClusterGone(
                f"a simulation worker process died ({exc}) after {finished} of {len(runs)} runs; "
                "nothing was written. Fewer --jobs use less memory."
            ) from None
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        return [f.result() for f in futures]


def _on_ray(
    arrivals: Sequence[Arrival],
    configs: Sequence[SimulationConfig],
    runs: Sequence[Run],
    address: str,
    progress: Callable[[int], None] | None,
    meanwhile: Callable[[], None],
) -> list[StrategyResult]:
    try:  # imported by name: Ray is optional, and not installed where the types are checked
        ray: Any = importlib.import_module("ray")
        importlib.import_module("ray.exceptions")
    except ModuleNotFoundError:
        raise KvrouteError('--ray needs Ray on this machine and on the cluster: pip install "kvroute[ray]".') from None
    started_here = not ray.is_initialized()
    try:
        if started_here:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterGone(f"could not connect to the Ray cluster at {address!r}: {exc}") from None
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_run_with)
        arrivals_ref = ray.put(list(arrivals))
        configs_ref = ray.put(list(configs))
        refs = [task.remote(arrivals_ref, configs_ref, run) for run in runs]
        results: dict[Any, StrategyResult] = {}
        pending = list(refs)
        meanwhile()
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results[done[0]] = ray.get(done[0])
                if progress is not None:
                    progress(len(arrivals))
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, KvrouteError):
                raise cause from None
            raise
        except (ray.exceptions.RayError, ConnectionError) as exc:
            raise ClusterGone(
                f"the Ray cluster at {address!r} failed after {len(results)} of {len(runs)} runs "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); nothing was written."
            ) from None
        return [results[ref] for ref in refs]
    finally:
        if started_here:
            ray.shutdown()
