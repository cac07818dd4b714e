"""kvroute-simulator's commands as a user runs them: the real `kvroute` script in a subprocess.

``kvroute emulate`` needs kvroute-server. Its absence is simulated for real: ``KVROUTE_BLOCK_PLUGINS=server``
keeps its entry point from loading and a ``sitecustomize`` module on ``PYTHONPATH`` makes its
package unimportable, as after ``pip install "kvroute[simulator]"``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvroute_simulator.commands import EMULATE_NEEDS_SERVER
from tests.helpers import blocking_env as _env
from tests.helpers import help_commands as _commands
from tests.helpers import run_kvroute as _kvroute

EMULATE_HINT = (
    "Error: 'kvroute emulate' needs kvroute-server (missing module 'kvroute_server'). "
    'Install it with: pip install "kvroute[emulator]"\n'
)


@pytest.fixture(scope="module")
def without_server(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """As after `pip install "kvroute[simulator]"`: kvroute-simulator without kvroute-server."""
    return _env(tmp_path_factory.mktemp("without-server"), entry_points=["server"], modules=["kvroute_server"])


class TestEmulateWithoutServer:
    def test_the_block_holds(self, without_server: dict[str, str]) -> None:
        """kvroute_server cannot be imported, its plugin is not loaded, and the simulator's is (else the tests below
        prove nothing)."""
        code = (
            "from kvroute.plugins import PluginManager\n"
            "print(sorted(p.name for p in PluginManager().plugins()))\n"
            "try:\n    import kvroute_server\nexcept ModuleNotFoundError as exc:\n    print(exc.name)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=without_server, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr
        plugins, missing = result.stdout.splitlines()
        assert "'simulator'" in plugins and "'server'" not in plugins
        assert missing == "kvroute_server"

    def test_listed_as_needing_the_emulator_extra(self, without_server: dict[str, str]) -> None:
        """`kvroute --help` marks emulate with the emulator extra's pip command, as kvroute marks a missing command;
        simulate is unmarked."""
        result = _kvroute("--help", env=without_server)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        commands = _commands(result.stdout)
        assert commands["emulate"] == EMULATE_NEEDS_SERVER
        assert EMULATE_NEEDS_SERVER.endswith('[needs: pip install "kvroute[emulator]"]')
        assert "needs:" not in commands["simulate"]

    @pytest.mark.parametrize("args", [[], ["--help"], ["-h"], ["--port", "0", "--model", "m"], ["--no-such-flag"]])
    def test_says_what_to_install(self, without_server: dict[str, str], args: list[str]) -> None:
        """Whatever its arguments, `kvroute emulate` exits 1 with one line naming the missing module and the emulator
        extra; no traceback."""
        result = _kvroute("emulate", *args, env=without_server)
        assert (result.returncode, result.stderr, result.stdout) == (1, EMULATE_HINT, "")

    def test_simulate_still_runs(self, without_server: dict[str, str]) -> None:
        """The simulator itself does not need kvroute-server: `kvroute simulate` prints its table."""
        result = _kvroute(
            "simulate", "-s", "random", "-n", "2", "--requests", "20", "--no-progress", env=without_server
        )
        assert result.returncode == 0, result.stderr
        assert "random" in result.stdout

    def test_missing_module_of_the_simulator_is_not_hidden(self, tmp_path: Path) -> None:
        """A module of kvroute-simulator itself that is missing is a broken installation: an error naming the plugin,
        not an install hint."""
        env = _env(tmp_path, entry_points=[], modules=["kvroute_simulator.emulator.realtime"])
        result = _kvroute("emulate", "--help", env=env)
        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr == (
            "Error: plugin 'simulator' (distribution kvroute-simulator 0.1.0) "
            "failed in hook kvroute_register_commands: "
            "ModuleNotFoundError: No module named 'kvroute_simulator.emulator.realtime'\n"
        )


class TestSimulateCommandLine:
    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["simulate", "--instances", "0"], "Error: Invalid value for '-n' / '--instances'"),
            (["simulate", "--seed", "x"], "Error: Invalid value for '--seed': 'x' is not a valid integer."),
        ],
    )
    def test_mistakes_exit_2_without_traceback(self, args: list[str], message: str) -> None:
        """A wrong value prints usage and one error line, exit 2, no traceback."""
        result = _kvroute(*args)
        assert result.returncode == 2
        assert message in result.stderr and "Usage: kvroute simulate" in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""

    def test_simulate_logs_on_stderr(self) -> None:
        """`kvroute simulate --log-level info` keeps its table on stdout and the library's log lines on stderr."""
        result = _kvroute(
            "simulate", "-s", "least-outstanding", "--requests", "20", "--no-progress", "--log-level", "info"
        )
        assert result.returncode == 0, result.stderr
        assert "least-outstanding" in result.stdout and "fleet_changed" not in result.stdout
        assert "fleet_changed" in result.stderr
