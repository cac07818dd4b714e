"""A new user's first minutes, as separate processes: the real `kvroute` entry point and a fresh interpreter.

* Commands whose extra is not installed are listed anyway and say what to install. The missing
  extra is simulated with a ``sitecustomize`` module on ``PYTHONPATH`` whose meta path finder makes
  the server extra's modules unimportable, as in an environment with only ``pip install kvroute``.
* Help, a wrong flag and a wrong command give short messages and exit status 2, never a traceback.
* kvroute used as a library writes nothing on stdout or stderr unless the host configures logging;
  the commands keep showing their log lines on stderr.

These run in tox's ``core`` env, which does not install the server extra; what needs it (``kvroute
serve --help``, its log lines) is tested in tests/server/test_command.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SERVER_MODULES = ("uvicorn", "aiohttp", "prometheus_client")

BLOCKER = """
import sys

BLOCKED = {blocked!r}


class _NotInstalled:
    \"\"\"Make BLOCKED top-level packages unimportable, as if their distributions were not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


def _run(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def _kvroute(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``kvroute`` console script installed next to this interpreter, as a user would."""
    script = shutil.which("kvroute", path=str(Path(sys.executable).parent))
    assert script is not None, f"no kvroute script next to {sys.executable}"
    return _run([script, *args], env=env)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _commands(help_text: str) -> dict[str, str]:
    """The ``Commands:`` section of a help text: name -> its help, wrapped lines joined."""
    rows: dict[str, str] = {}
    name = ""
    for line in help_text.partition("Commands:")[2].splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            rows[name] = text.strip()
        elif line.strip() and name:
            rows[name] += " " + line.strip()
    return rows


@pytest.fixture(scope="module")
def without_server(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which the server extra's modules cannot be imported."""
    directory = tmp_path_factory.mktemp("without-server")
    (directory / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(SERVER_MODULES)))
    env = dict(os.environ)
    # The engine adapters depend on prometheus-client; plain `pip install kvroute` has neither.
    env["KVROUTE_BLOCK_PLUGINS"] = "vllm,tensorrt-llm"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH", "")]))
    return env


def _hint(command: str, what: str, module: str) -> str:
    return f"'kvroute {command}' needs {what} (missing module '{module}'). Install them with: pip install \"kvroute[server]\""


class TestMissingServerExtra:
    def test_the_blocker_blocks(self, without_server: dict[str, str]) -> None:
        """The simulated environment really lacks every module of the server extra (else the tests below prove nothing)."""
        for module in SERVER_MODULES:
            result = _run([sys.executable, "-c", f"import {module}"], env=without_server)
            assert result.returncode == 1 and f"No module named '{module}'" in result.stderr

    def test_help_lists_every_command_with_its_extra(self, without_server: dict[str, str]) -> None:
        """`kvroute --help` lists serve, emulate and check-parity, each marked with the install command it needs."""
        result = _kvroute("--help", env=without_server)
        assert result.returncode == 0, result.stderr
        commands = _commands(result.stdout)
        assert sorted(commands) == ["check-parity", "emulate", "plugins", "serve", "simulate"]
        for name in ("serve", "emulate", "check-parity"):
            assert commands[name].endswith('[needs: pip install "kvroute[server]"]'), commands
        assert "needs:" not in commands["simulate"] + commands["plugins"]

    @pytest.mark.parametrize(
        ("args", "hint"),
        [
            (["serve"], _hint("serve", "the proxy's dependencies", "uvicorn")),
            (["serve", "--help"], _hint("serve", "the proxy's dependencies", "uvicorn")),
            (["serve", "--backend", "http://127.0.0.1:9", "--port", "0"], _hint("serve", "the proxy's dependencies", "uvicorn")),
            (["emulate", "--port", "0"], _hint("emulate", "the emulator's dependencies", "uvicorn")),
            (["check-parity", "--backend", "http://127.0.0.1:9"], _hint("check-parity", "the HTTP client's dependencies", "aiohttp")),
        ],
    )
    def test_command_says_what_to_install(self, without_server: dict[str, str], args: list[str], hint: str) -> None:
        """Running a command without its extra prints one line naming the missing module and the pip command, exit 1."""
        result = _kvroute(*args, env=without_server)
        assert result.returncode == 1
        assert result.stderr == f"Error: {hint}\n"
        assert result.stdout == ""

    def test_other_commands_unaffected(self, without_server: dict[str, str]) -> None:
        """Commands that need no extra still run: `kvroute plugins --json` lists the strategies."""
        result = _kvroute("plugins", "--json", env=without_server)
        assert result.returncode == 0, result.stderr
        assert "bounded-load" in {row["name"] for row in json.loads(result.stdout)}


class TestNewUser:
    def test_help(self) -> None:
        """`kvroute --help` lists every command with its one-line help, marks those whose extra is missing, and exits 0."""
        result = _kvroute("--help")
        assert result.returncode == 0 and result.stderr == ""
        commands = _commands(result.stdout)
        assert sorted(commands) == ["check-parity", "emulate", "plugins", "serve", "simulate"]
        assert commands["simulate"] == "Simulate a fleet and compare strategies."
        # Marked as needing the server extra exactly when this environment lacks it (tox's core env does).
        server_missing = not all(map(_importable, SERVER_MODULES))
        marker = '[needs: pip install "kvroute[server]"]'
        assert commands["serve"] == "Run the OpenAI-compatible routing proxy." + (f" {marker}" if server_missing else "")

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["plugins", "--bogus"], "Error: No such option '--bogus'"),
            (["simulate", "--instances", "0"], "Error: Invalid value for '-n' / '--instances'"),
            (["simulate", "--seed", "x"], "Error: Invalid value for '--seed': 'x' is not a valid integer."),
            (["nonsense"], "Error: No such command 'nonsense'."),
            (["serv"], "Error: No such command 'serv'. Did you mean 'serve'?"),
            (["--bogus"], "Error: No such option '--bogus'"),
        ],
    )
    def test_mistakes_exit_2_without_traceback(self, args: list[str], message: str) -> None:
        """A wrong flag, value or command prints usage and one error line, exit 2, no traceback."""
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
        """After logging.basicConfig(level=INFO) the host sees fleet_changed events on stderr under 'kvroute.fleet', stdout stays clean."""
        script = tmp_path / "embed.py"
        script.write_text(LIBRARY_SCRIPT)
        result = _run([sys.executable, str(script), "host-logs"])
        assert result.returncode == 0, result.stderr
        assert result.stdout == ""
        events = [line for line in result.stderr.splitlines() if "fleet_changed" in line]
        assert len(events) == 7, result.stderr  # 2 initial backends, add, unhealthy, healthy, draining, remove
        assert all(line.startswith("INFO kvroute.fleet ") for line in events)
        assert "change=removed" in events[-1] and "backend=gpu2" in events[-1]


class TestCommandLogging:
    def test_simulate_logs_on_stderr(self) -> None:
        """`kvroute simulate --log-level info` keeps its table on stdout and the library's log lines on stderr."""
        result = _kvroute("simulate", "-s", "least-outstanding", "--requests", "20", "--no-progress", "--log-level", "info")
        assert result.returncode == 0, result.stderr
        assert "least-outstanding" in result.stdout and "fleet_changed" not in result.stdout
        assert "fleet_changed" in result.stderr
