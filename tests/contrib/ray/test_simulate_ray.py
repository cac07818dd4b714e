"""``kvroute simulate --ray``: runs as Ray tasks give the serial results; a failing cluster leaves no output.

The session's local Ray (conftest) is the cluster: ``--ray`` connects only when Ray is not initialized
in the process yet, and otherwise uses the one there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute_simulator import parallel

pytestmark = pytest.mark.usefixtures("serve_cluster")

TIMINGS = {"wall", "wall_time", "route_cost_p50", "route_cost_p99"}
ARGS = [
    "simulate",
    "--requests",
    "120",
    "-s",
    "consistent-hash,bounded-load",
    "--working-set",
    "0.8,1.2",
    "--no-progress",
]


def without_timings(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: without_timings(v) for k, v in data.items() if k not in TIMINGS}
    if isinstance(data, list):
        return [without_timings(v) for v in data]
    return data


class TestSimulateOnRay:
    def test_ray_tasks_give_the_serial_results(self, tmp_path: Path) -> None:
        """Two strategies on two sweep points as Ray tasks give the serial JSON, timings aside."""
        outputs = {}
        for name, extra in (("serial", ["--jobs", "1"]), ("ray", ["--ray", "local"])):
            path = tmp_path / f"{name}.json"
            result = CliRunner().invoke(main, [*ARGS, *extra, "--json", str(path)])
            assert result.exit_code == 0, result.output
            outputs[name] = without_timings(json.loads(path.read_text()))
        assert len(outputs["serial"]["sweep"]) == 2
        assert outputs["ray"] == outputs["serial"]

    def test_cluster_failure_mid_sweep(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A task whose Ray worker dies fails the command with a clear error; no partial JSON is written."""

        def crash(arrivals: Any, configs: Any, run: parallel.Run) -> Any:  # nested: Ray ships it by value
            os._exit(1)

        monkeypatch.setattr(parallel, "_run_with", crash)
        out = tmp_path / "out.json"
        result = CliRunner().invoke(main, [*ARGS, "--ray", "local", "--json", str(out)])
        assert result.exit_code == 1, result.output
        assert "the Ray cluster at 'local' failed after 0 of 4 runs" in result.output
        assert "nothing was written" in result.output and "Traceback" not in result.output
        assert not out.exists()
