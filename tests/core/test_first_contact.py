"""A new user's first minutes, as separate processes: the real `kvroute` entry point and a fresh interpreter.

* Commands whose application distribution (kvroute-server, kvroute-simulator) is not installed
  are listed anyway and say what to install. The missing distribution is simulated for real:
  ``KVROUTE_BLOCK_PLUGINS`` keeps the plugin manager from loading its entry point, and a
  ``sitecustomize`` module on ``PYTHONPATH`` makes its package unimportable, as after a plain
  ``pip install kvroute``.
* Help, a wrong flag and a wrong command give short messages and exit status 2, never a traceback.
* kvroute used as a library writes nothing on stdout or stderr unless the host configures logging.

These run in tox's ``core`` env, which installs neither application, and in a development
environment that has both; what needs them (``kvroute serve --help``, ``kvroute simulate``'s
log lines, ``kvroute emulate`` without kvroute-server) is tested in tests/server and tests/simulator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import blocking_env
from tests.helpers import help_commands as _commands
from tests.helpers import installed as _installed
from tests.helpers import run_kvroute as _kvroute


def _run(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def _without(tmp_path_factory: pytest.TempPathFactory, entry_points: list[str], packages: list[str]) -> dict[str, str]:
    """An environment in which ``entry_points`` are not loaded and ``packages`` cannot be imported."""
    directory = tmp_path_factory.mktemp("without-" + "-".join(entry_points))
    return blocking_env(directory, entry_points=entry_points, modules=packages)


@pytest.fixture(scope="module")
def library_only(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """As after `pip install kvroute`: neither kvroute-server nor kvroute-simulator."""
    return _without(tmp_path_factory, ["server", "simulator"], ["kvroute_server", "kvroute_simulator"])


@pytest.fixture(scope="module")
def without_server(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """As after `pip install "kvroute[simulator]"`: no kvroute-server (kvroute-simulator when this environment has
    it)."""
    return _without(tmp_path_factory, ["server"], ["kvroute_server"])


ALL_COMMANDS = ["check-parity", "emulate", "p2c-info", "plugins", "serve", "simulate"]
SERVE = "Run the OpenAI-compatible routing proxy."
NEEDS = '[needs: pip install "kvroute[{}]"]'


def _hint(command: str, distribution: str, extra: str) -> str:
    return (
        f"'kvroute {command}' comes with the {distribution} distribution, which is not installed. "
        f'Install it with: pip install "kvroute[{extra}]"'
    )


class TestLibraryOnly:
    def test_the_blocks_hold(self, library_only: dict[str, str]) -> None:
        """The simulated environment loads no application plugin and imports no application package (else the tests
        below prove nothing)."""
        code = (
            "from kvroute.plugins import PluginManager\n"
            "print(sorted(p.name for p in PluginManager().plugins()))\n"
            "for name in ('kvroute_server', 'kvroute_simulator'):\n"
            "    try:\n        __import__(name)\n    except ModuleNotFoundError as exc:\n        print(exc.name)\n"
        )
        result = _run([sys.executable, "-c", code], env=library_only)
        assert result.returncode == 0, result.stderr
        plugins, *unimportable = result.stdout.splitlines()
        assert "server" not in plugins and "simulator" not in plugins and "p2c" in plugins
        assert unimportable == ["kvroute_server", "kvroute_simulator"]

    def test_help_lists_every_command_with_its_extra(self, library_only: dict[str, str]) -> None:
        """`kvroute --help` lists serve, check-parity, simulate and emulate, each with the pip command that brings
        it."""
        result = _kvroute("--help", env=library_only)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        commands = _commands(result.stdout)
        assert sorted(commands) == ALL_COMMANDS
        assert commands["serve"] == f"{SERVE} {NEEDS.format('server')}"
        assert commands["check-parity"].endswith(NEEDS.format("server"))
        assert commands["simulate"].endswith(NEEDS.format("simulator"))
        assert commands["emulate"].endswith(NEEDS.format("emulator"))
        assert "needs:" not in commands["plugins"] + commands["p2c-info"]

    @pytest.mark.parametrize(
        ("args", "hint"),
        [
            (["serve"], _hint("serve", "kvroute-server", "server")),
            (["serve", "--help"], _hint("serve", "kvroute-server", "server")),
            (["serve", "-h"], _hint("serve", "kvroute-server", "server")),
            (["serve", "--backend", "http://127.0.0.1:9", "--port", "0"], _hint("serve", "kvroute-server", "server")),
            (["check-parity", "--backend", "http://127.0.0.1:9"], _hint("check-parity", "kvroute-server", "server")),
            (["simulate"], _hint("simulate", "kvroute-simulator", "simulator")),
            (["simulate", "--help"], _hint("simulate", "kvroute-simulator", "simulator")),
            (["simulate", "--requests", "5", "--bogus"], _hint("simulate", "kvroute-simulator", "simulator")),
            (["emulate", "--port", "0"], _hint("emulate", "kvroute-simulator", "emulator")),
            (["emulate", "--help"], _hint("emulate", "kvroute-simulator", "emulator")),
        ],
    )
    def test_command_says_what_to_install(self, library_only: dict[str, str], args: list[str], hint: str) -> None:
        """Running a command of a missing distribution prints one line naming it and the pip command, exit 1, whatever
        the arguments."""
        result = _kvroute(*args, env=library_only)
        assert (result.returncode, result.stderr, result.stdout) == (1, f"Error: {hint}\n", "")

    def test_other_commands_unaffected(self, library_only: dict[str, str]) -> None:
        """Commands of installed plugins still run: `kvroute plugins --json` lists the strategies, `kvroute p2c-info`
        answers."""
        result = _kvroute("plugins", "--json", env=library_only)
        assert result.returncode == 0, result.stderr
        assert {"bounded-load", "p2c"} <= {row["name"] for row in json.loads(result.stdout)}
        info = _kvroute("p2c-info", env=library_only)
        assert (info.returncode, info.stderr) == (0, "") and info.stdout.startswith("p2c:")


class TestWithoutServer:
    def test_help_marks_what_needs_the_server(self, without_server: dict[str, str]) -> None:
        """Without kvroute-server, serve, check-parity and emulate are marked with their extra; simulate only if
        kvroute-simulator is missing too."""
        result = _kvroute("--help", env=without_server)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        commands = _commands(result.stdout)
        assert sorted(commands) == ALL_COMMANDS
        assert commands["serve"] == f"{SERVE} {NEEDS.format('server')}"
        assert commands["check-parity"].endswith(NEEDS.format("server"))
        assert commands["emulate"] == f"Run an engine emulator (a fake vLLM server). {NEEDS.format('emulator')}"
        assert commands["simulate"].endswith(NEEDS.format("simulator")) != _installed("kvroute-simulator")

    @pytest.mark.parametrize("args", [["serve"], ["serve", "--help"], ["check-parity"]])
    def test_server_commands_say_what_to_install(self, without_server: dict[str, str], args: list[str]) -> None:
        """Without kvroute-server, its commands exit 1 with the server extra's pip command."""
        result = _kvroute(*args, env=without_server)
        assert (result.returncode, result.stderr, result.stdout) == (
            1,
            f"Error: {_hint(args[0], 'kvroute-server', 'server')}\n",
            "",
        )

    @pytest.mark.parametrize("args", [["emulate"], ["emulate", "--help"], ["emulate", "--port", "0"]])
    def test_emulate_says_what_to_install(self, without_server: dict[str, str], args: list[str]) -> None:
        """Without kvroute-server, `kvroute emulate` exits 1 with one line ending in the emulator extra's pip command,
        whoever answers."""
        result = _kvroute(*args, env=without_server)
        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr.startswith("Error: 'kvroute emulate' ")
        assert result.stderr.endswith('Install it with: pip install "kvroute[emulator]"\n')
        assert result.stderr.count("\n") == 1


class TestNewUser:
    def test_help(self) -> None:
        """`kvroute --help` lists every command with its one-line help, marks those whose distribution is missing, and
        exits 0."""
        result = _kvroute("--help")
        assert result.returncode == 0 and result.stderr == ""
        commands = _commands(result.stdout)
        assert sorted(commands) == ALL_COMMANDS
        assert commands["serve"].endswith(NEEDS.format("server")) != _installed("kvroute-server")
        assert commands["simulate"].endswith(NEEDS.format("simulator")) != _installed("kvroute-simulator")
        assert commands["plugins"].startswith("List installed strategies and backend kinds")

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["plugins", "--bogus"], "Error: No such option '--bogus'"),
            (["plugins", "extra"], "Error: Got unexpected extra argument (extra)"),
            (["nonsense"], "Error: No such command 'nonsense'."),
            (["serv"], "Error: No such command 'serv'. Did you mean 'serve'?"),
            (["simulat"], "Error: No such command 'simulat'. Did you mean 'simulate'?"),
            (["--bogus"], "Error: No such option '--bogus'"),
        ],
    )
    def test_mistakes_exit_2_without_traceback(self, args: list[str], message: str) -> None:
        """A wrong flag, argument or command prints usage and one error line, exit 2, no traceback."""
        result = _kvroute(*args)
        assert result.returncode == 2
        assert message in result.stderr and "Usage: kvroute" in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""


LIBRARY_SCRIPT = textwrap.dedent(
    """
    import logging
    import sys

    if sys.argv[1:] == ["host-logs"]:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")

    import kvroute

    fleet = kvroute.Fleet([kvroute.Backend("gpu0", url="http://10.0.0.1:8000"), kvroute.Backend("gpu1", url="http://10.0.0.2:8000")])
    router = kvroute.Router.create(fleet, "bounded-load", {"prefix_length": 1024})
    chosen = set()
    for i in range(20):
        body = {"model": "m", "messages": [{"role": "user", "content": f"question {i % 3} " * 400}]}
        with router.route(kvroute.RouteRequest.from_openai(body, endpoint="chat")) as lease:
            chosen.add(lease.backend.id)
            if i == 5:
                lease.fail("HTTP 500")
    fleet.add(kvroute.Backend("gpu2", url="http://10.0.0.3:8000"))
    fleet.set_healthy("gpu0", False)
    fleet.set_healthy("gpu0", True)
    fleet.drain("gpu1")
    fleet.remove("gpu2")
    router.close()
    assert chosen, "nothing was routed"
    """
)


class TestLibraryLogging:
    def test_library_use_prints_nothing(self, tmp_path: Path) -> None:
        """Routing and changing the fleet from a program that has not configured logging writes nothing at all."""
        script = tmp_path / "embed.py"
        script.write_text(LIBRARY_SCRIPT)
        result = _run([sys.executable, str(script)])
        assert result.returncode == 0, result.stderr
        assert (result.stdout, result.stderr) == ("", "")

    def test_host_logging_sees_fleet_events(self, tmp_path: Path) -> None:
        """After logging.basicConfig(level=INFO) the host sees fleet_changed events on stderr under 'kvroute.fleet',
        stdout stays clean."""
        script = tmp_path / "embed.py"
        script.write_text(LIBRARY_SCRIPT)
        result = _run([sys.executable, str(script), "host-logs"])
        assert result.returncode == 0, result.stderr
        assert result.stdout == ""
        events = [line for line in result.stderr.splitlines() if "fleet_changed" in line]
        assert len(events) == 7, result.stderr  # 2 initial backends, add, unhealthy, healthy, draining, remove
        assert all(line.startswith("INFO kvroute.fleet ") for line in events)
        assert "change=removed" in events[-1] and "backend=gpu2" in events[-1]
