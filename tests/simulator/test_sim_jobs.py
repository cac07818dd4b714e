"""``kvroute simulate --jobs N``: runs in worker processes give the serial results; failures leave no output."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute_simulator import parallel

#: JSON keys that are measured wall-clock times (they differ between any two runs, serial or not).
TIMINGS = {"wall", "wall_time", "route_cost_p50", "route_cost_p99"}

ARGS = ["simulate", "--requests", "150", "-s", "random,bounded-load,consistent-hash", "--no-progress"]


def without_timings(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: without_timings(v) for k, v in data.items() if k not in TIMINGS}
    if isinstance(data, list):
        return [without_timings(v) for v in data]
    return data


def body(table: str) -> list[str]:
    """The table from its top border on (the title above it holds the wall time)."""
    lines = table.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.lstrip().startswith("┏")) :]


def run(tmp_path: Path, name: str, *extra: str) -> tuple[Any, str]:
    out = tmp_path / f"{name}.json"
    result = CliRunner().invoke(main, [*ARGS, *extra, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def _die(run: parallel.Run) -> Any:
    """Stands in for a run whose worker process is killed (out of memory, a signal)."""
    os._exit(3)


class TestJobs:
    def test_two_jobs_give_the_serial_results(self, tmp_path: Path) -> None:
        """Three strategies on two sweep points in 2 worker processes give the serial JSON, timings aside."""
        serial, serial_table = run(tmp_path, "serial", "--working-set", "0.8,1.2", "--jobs", "1")
        parallel_, parallel_table = run(tmp_path, "parallel", "--working-set", "0.8,1.2", "--jobs", "2")
        assert len(serial["sweep"]) == 2 and len(serial["sweep"][0]["strategies"]) == 3
        assert without_timings(parallel_) == without_timings(serial)
        assert body(parallel_table) == body(serial_table)  # the sweep table has no timing column

    def test_single_run_parallel(self, tmp_path: Path) -> None:
        """One sweep point, three strategies, 3 jobs: the same as serial."""
        serial, _ = run(tmp_path, "serial", "--jobs", "1")
        parallel_, _ = run(tmp_path, "parallel", "--jobs", "3")
        assert without_timings(parallel_) == without_timings(serial)

    @pytest.mark.skipif(
        sys.platform != "linux" or multiprocessing.get_start_method() != "fork",
        reason="the stand-in run reaches the workers by fork",
    )
    def test_worker_death_fails_without_output(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A worker process that dies fails the command with a clear error, and no JSON is written."""
        monkeypatch.setattr(parallel, "_run_here", _die)
        out = tmp_path / "out.json"
        result = CliRunner().invoke(main, [*ARGS, "--jobs", "2", "--json", str(out)])
        assert result.exit_code == 1
        assert "a simulation worker process died" in result.output and "nothing was written" in result.output
        assert not out.exists()

    def test_bad_strategy_option_in_a_worker(self, tmp_path: Path) -> None:
        """A strategy option rejected inside a worker fails with kvroute's message, as in a serial run."""
        result = CliRunner().invoke(main, [*ARGS, "--jobs", "2", "-o", "bounded-load.load_factor=0.5"])
        assert result.exit_code == 1
        assert "'load_factor' must be between 1.0 and 100.0 (got 0.5)" in result.output
        assert "Traceback" not in result.output

    def test_jobs_must_be_positive(self) -> None:
        """--jobs 0 is refused by the option parser."""
        result = CliRunner().invoke(main, [*ARGS, "--jobs", "0"])
        assert result.exit_code == 2 and "--jobs" in result.output


class TestRayOption:
    def test_empty_address(self) -> None:
        """--ray with an empty address says what is expected."""
        result = CliRunner().invoke(main, [*ARGS, "--ray", " "])
        assert result.exit_code == 2 and "expected a Ray address, auto or local" in result.output

    def test_without_ray_installed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """--ray on a machine without Ray says how to install it (no traceback)."""
        monkeypatch.setitem(sys.modules, "ray", None)
        result = CliRunner().invoke(main, [*ARGS, "--ray", "auto"])
        assert result.exit_code == 1 and "--ray needs Ray" in result.output
        assert "Traceback" not in result.output
