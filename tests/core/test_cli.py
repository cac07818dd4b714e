"""The command line as a user meets it: help, wrong flags, plugins listing, commands that plugins add.

Subcommands other than ``plugins`` come from plugins (hook ``kvroute_register_commands``). The
commands of kvroute's own application distributions (kvroute-server, kvroute-simulator) are
listed even when those are not installed, with the pip command that brings them. Tests that
need an environment without them run ``kvroute`` in a subprocess with the distribution's entry
point blocked (tests/core/test_first_contact.py); the ones here build a fresh ``kvroute`` group
in-process, or run fake plugin distributions in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvroute import cli
from kvroute.cli import main
from kvroute.plugins import BLOCK_ENV, PluginManager
from tests.helpers import help_commands as _listed
from tests.helpers import installed as _installed

ROOT = Path(__file__).resolve().parents[2]

#: The application distributions whose commands kvroute lists even when they are missing:
#: their folder in the checkout and the entry-point name KVROUTE_BLOCK_PLUGINS takes.
APPLICATIONS = {"kvroute-server": ("contrib/server", "server"), "kvroute-simulator": ("contrib/simulator", "simulator")}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fresh_main() -> click.Group:
    """A new ``kvroute`` group, as a new process builds it: plugins are asked on its first use."""
    return cli._PluginGroup(
        name="kvroute",
        callback=main.callback,
        params=list(main.params),
        help=main.help,
        context_settings=main.context_settings,
        commands={"plugins": cli.plugins},
    )


class TestCli:
    def test_help_lists_commands(self) -> None:
        """`kvroute --help` lists the plugins command with examples."""
        result = CliRunner().invoke(main, ["--help"])
        assert result.exit_code == 0
        assert "plugins" in result.output and "Examples:" in result.output

    def test_unknown_command(self) -> None:
        """A wrong command exits 2 with click's usage error, not a traceback."""
        result = CliRunner().invoke(main, ["nonsense"])
        assert result.exit_code == 2 and "No such command 'nonsense'" in result.output

    def test_wrong_flag(self) -> None:
        """A wrong flag exits 2 and names the flag."""
        result = CliRunner().invoke(main, ["plugins", "--bogus"])
        assert result.exit_code == 2 and "--bogus" in result.output and "No such option" in result.output

    def test_plugins_table_and_json(self) -> None:
        """`kvroute plugins` prints a table; --json the same rows as JSON."""
        table = CliRunner().invoke(main, ["plugins"])
        assert table.exit_code == 0 and "least-outstanding" in table.output and "openai" in table.output
        rows = json.loads(CliRunner().invoke(main, ["plugins", "--json"]).output)
        openai = [r for r in rows if (r["type"], r["name"]) == ("backend kind", "openai")]
        assert len(openai) == 1 and openai[0]["distribution"] == "kvroute"

    def test_version(self) -> None:
        """`kvroute --version` prints the version."""
        result = CliRunner().invoke(main, ["--version"])
        assert result.exit_code == 0 and "kvroute, version" in result.output


class TestKnownCommands:
    """The table of commands of kvroute's own applications, against the distributions that add them."""

    def test_every_known_command_is_listed(self) -> None:
        """`kvroute --help` lists every known command, `plugins` and the third-party p2c-info; a known one is marked
        with its extra exactly when its distribution is missing."""
        result = CliRunner().invoke(main, ["--help"])
        assert result.exit_code == 0, result.output
        listed = _listed(result.output)
        assert set(listed) == {*cli._KNOWN_COMMANDS, "plugins", "p2c-info"}
        for name, known in cli._KNOWN_COMMANDS.items():
            marker = f'[needs: pip install "kvroute[{known.extra}]"]'
            assert listed[name].endswith(marker) != _installed(known.distribution), (name, listed[name])
        assert "needs:" not in listed["plugins"] + listed["p2c-info"]

    def test_installed_commands_come_from_their_distribution(self) -> None:
        """A known command whose distribution is installed is the one that distribution's plugin added; otherwise a
        stand-in that exits 1 with the hint."""
        added = PluginManager().register_commands(click.Group())
        for name, known in cli._KNOWN_COMMANDS.items():
            command = main.get_command(click.Context(main), name)
            assert command is not None and command.name == name
            if _installed(known.distribution):
                assert added[name].distribution == known.distribution, (name, added.get(name))
            else:
                assert name not in added
                result = CliRunner().invoke(main, [name])
                assert result.exit_code == 1 and f'pip install "kvroute[{known.extra}]"' in result.stderr

    def test_each_hint_installs_the_distribution(self) -> None:
        """The extra each hint names makes pip install the distribution the command comes with."""
        requires = metadata.requires("kvroute") or []
        for name, known in cli._KNOWN_COMMANDS.items():
            in_extra = {
                _canonical(re.match(r"[A-Za-z0-9._-]+", req).group())  # type: ignore[union-attr]
                for req in requires
                if re.search(rf"extra\s*==\s*['\"]{re.escape(known.extra)}['\"]", req)
            }
            assert _canonical(known.distribution) in in_extra, (name, known.extra, in_extra)

    def test_emulator_extra_brings_the_server(self) -> None:
        """`kvroute emulate` serves HTTP with kvroute-server: its extra pulls kvroute-simulator's emulator extra, which
        requires kvroute-server."""
        assert cli._KNOWN_COMMANDS["emulate"].extra == "emulator"
        requires = metadata.requires("kvroute") or []
        assert any(re.match(r"kvroute-simulator\[emulator\]==", r) and "extra == 'emulator'" in r for r in requires), (
            requires
        )
        simulator = tomllib.loads((ROOT / "contrib/simulator/pyproject.toml").read_text())
        assert any(r.startswith("kvroute-server==") for r in simulator["project"]["optional-dependencies"]["emulator"])

    def test_known_distributions_are_plugins_of_their_commands(self) -> None:
        """Each distribution the table names is a folder of this repository with one entry point in group kvroute, the
        name tests block."""
        distributions = {known.distribution for known in cli._KNOWN_COMMANDS.values()}
        assert distributions == set(APPLICATIONS)
        for distribution, (folder, entry_point) in APPLICATIONS.items():
            project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
            assert project["name"] == distribution
            assert list(project["entry-points"]["kvroute"]) == [entry_point]


class TestStandIns:
    """What a known command whose distribution is missing does, with that distribution's entry point blocked."""

    def test_listed_with_the_pip_command(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without the applications, each known command is one help line ending in the pip command that brings it."""
        monkeypatch.setenv(BLOCK_ENV, "server,simulator")
        listing = CliRunner().invoke(fresh_main(), ["--help"], terminal_width=200)
        assert listing.exit_code == 0, listing.output
        expected = {
            "serve": 'Run the OpenAI-compatible routing proxy. [needs: pip install "kvroute[server]"]',
            "check-parity": "Compare the router's tokenizer with an engine's. [needs: pip install \"kvroute[server]\"]",
            "simulate": 'Simulate a fleet and compare strategies. [needs: pip install "kvroute[simulator]"]',
            "emulate": 'Run an engine emulator (a fake vLLM server). [needs: pip install "kvroute[emulator]"]',
        }
        for name, text in expected.items():
            assert re.search(rf"^  {re.escape(name)} +{re.escape(text)}$", listing.output, re.MULTILINE), listing.output

    @pytest.mark.parametrize(
        ("command", "distribution", "extra"),
        [
            ("serve", "kvroute-server", "server"),
            ("check-parity", "kvroute-server", "server"),
            ("simulate", "kvroute-simulator", "simulator"),
            ("emulate", "kvroute-simulator", "emulator"),
        ],
    )
    @pytest.mark.parametrize("args", [[], ["--help"], ["-h"], ["--no-such-flag", "value"], ["--port", "0", "extra"]])
    def test_any_arguments_give_the_hint(
        self, monkeypatch: pytest.MonkeyPatch, command: str, distribution: str, extra: str, args: list[str]
    ) -> None:
        """Whatever it is given, a missing command exits 1 with one line naming the distribution and the pip command."""
        monkeypatch.setenv(BLOCK_ENV, "server,simulator")
        result = CliRunner().invoke(fresh_main(), [command, *args])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert result.stderr == (
            f"Error: 'kvroute {command}' comes with the {distribution} distribution, which is not installed. "
            f'Install it with: pip install "kvroute[{extra}]"\n'
        )
        assert result.stdout == ""

    def test_installed_command_is_not_replaced(self) -> None:
        """With nothing blocked, a fresh group's `plugins` is kvroute's own and p2c-info the third party's."""
        group = fresh_main()
        context = click.Context(group)
        assert group.get_command(context, "plugins") is cli.plugins
        command = group.get_command(context, "p2c-info")
        assert command is not None and command.callback is not None
        assert command.callback.__module__ == "kvroute_p2c"

    def test_close_command_name_is_suggested(self) -> None:
        """A mistyped command exits 2 and suggests the closest one, installed or not."""
        result = CliRunner().invoke(main, ["simulat"])
        assert result.exit_code == 2 and "No such command 'simulat'. Did you mean 'simulate'?" in result.stderr

    def test_help_imports_no_server_runtime(self) -> None:
        """`kvroute --help` lists the commands without importing uvicorn, aiohttp, matplotlib or the proxy's app, runner
        and upstream client."""
        heavy = (
            "uvicorn",
            "aiohttp",
            "matplotlib",
            "kvroute_server.proxy.app",
            "kvroute_server.http.runner",
            "kvroute_server.http.client",
        )
        code = (
            "import sys\n"
            "from kvroute.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {heavy!r} if m in sys.modules], file=sys.stderr)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stderr == "[]\n" and "serve" in result.stdout and "p2c-info" in result.stdout


COMMAND_PLUGIN = """
import click
import kvroute

@kvroute.hookimpl
def kvroute_register_commands(cli):
    @cli.command({name!r})
    def hello():
        \"\"\"Say hello.\"\"\"
        click.echo({greeting!r})
"""

FAILING_PLUGIN = """
import kvroute

@kvroute.hookimpl
def kvroute_register_commands(cli):
    raise RuntimeError("no terminal here")
"""


def _fake_distribution(root: Path, dist: str, version: str, ep_name: str, module: str, source: str) -> None:
    """Write an installed-looking distribution (a .dist-info with an entry point) under root."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kvroute]\n{ep_name} = {module}\n")


def _kvroute(root: Path, *args: str, block: str = "") -> subprocess.CompletedProcess[str]:
    """Run the installed ``kvroute`` script with the fake distributions under root importable."""
    script = shutil.which("kvroute", path=str(Path(sys.executable).parent))
    assert script is not None, f"no kvroute script next to {sys.executable}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])))
    env[BLOCK_ENV] = block
    return subprocess.run([script, *args], capture_output=True, text=True, env=env, timeout=120, check=False)


class TestPluginCommandErrors:
    """Plugins that add commands badly, as the real `kvroute` script meets them."""

    def test_same_name_twice_names_both(self, tmp_path: Path) -> None:
        """Two distributions adding the same command make every invocation exit 1 with one line naming both; blocking
        one, as it says, fixes it."""
        _fake_distribution(
            tmp_path,
            "kvroute-hello-a",
            "1.0",
            "hello-a",
            "kvroute_hello_a",
            COMMAND_PLUGIN.format(name="hello", greeting="a"),
        )
        _fake_distribution(
            tmp_path,
            "kvroute-hello-b",
            "2.0",
            "hello-b",
            "kvroute_hello_b",
            COMMAND_PLUGIN.format(name="hello", greeting="b"),
        )
        named = (
            r"plugin 'hello-a' \(distribution kvroute-hello-a 1\.0\)"
            r"|plugin 'hello-b' \(distribution kvroute-hello-b 2\.0\)"
        )
        for args in (["--help"], ["hello"]):
            result = _kvroute(tmp_path, *args)
            assert result.returncode == 1 and result.stdout == ""
            assert re.fullmatch(
                rf"Error: command 'hello' is registered twice: by ({named}) and by ({named}); "
                r"block one with KVROUTE_BLOCK_PLUGINS\.\n",
                result.stderr,
            ), result.stderr
            assert "kvroute-hello-a" in result.stderr and "kvroute-hello-b" in result.stderr
        fixed = _kvroute(tmp_path, "hello", block="hello-b")
        assert (fixed.returncode, fixed.stdout, fixed.stderr) == (0, "a\n", "")

    def test_command_of_kvroute_itself_is_not_taken(self, tmp_path: Path) -> None:
        """A plugin adding a command named like kvroute's own `plugins` is refused, naming kvroute and the plugin."""
        _fake_distribution(
            tmp_path,
            "kvroute-squat",
            "1.0",
            "squat",
            "kvroute_squat",
            COMMAND_PLUGIN.format(name="plugins", greeting="mine"),
        )
        result = _kvroute(tmp_path, "plugins")
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == (
            "Error: command 'plugins' is registered twice: by kvroute itself and by plugin 'squat' "
            "(distribution kvroute-squat 1.0); block one with KVROUTE_BLOCK_PLUGINS.\n"
        )

    def test_failing_hook_is_named(self, tmp_path: Path) -> None:
        """A plugin whose command hook raises makes `kvroute` exit 1 with one line naming it, its distribution, the hook
        and the error; no traceback."""
        _fake_distribution(tmp_path, "kvroute-boom", "3.1", "boom", "kvroute_boom", FAILING_PLUGIN)
        for args in (["--help"], ["plugins"], ["serve"]):
            result = _kvroute(tmp_path, *args)
            assert result.returncode == 1 and result.stdout == ""
            assert result.stderr == (
                "Error: plugin 'boom' (distribution kvroute-boom 3.1) failed in hook kvroute_register_commands: "
                "RuntimeError: no terminal here\n"
            )
